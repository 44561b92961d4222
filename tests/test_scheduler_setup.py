"""How vLLM sets the worker connector up, per release, with the plugin's factory.

vLLM 0.34 builds it in two steps: Model Runner V2's real ``profile_run`` calls the factory
``(model, vllm_config)`` (the capturer's buffer is part of the memory profile, the capture
hooks are live in the dummy pass), and ``initialize_kv_cache`` later calls
``initialize_output_storage(kv_cache_config)``. vLLM 0.33 calls the factory once, with the
KV cache config. A step before the storage exists, and a second initialisation, are refused
with a typed error and change nothing.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from connector_rows import input_batch, pack_hashes
from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
from vllm_contract_facts import assert_installed_contract_matches_vllm

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    CONTRACT,
    ROW_SHAPE,
    HarnessMoEModel,
    build_connector_like_vllm,
    feed_rows,
    make_scheduler,
)
from cpu_harness.vllm_scheduler.connectors import ensure_single_rank_group, profiling_runner, set_up_as_a_worker
from routed_experts_cache.connector.vllm import plugin as vllm_plugin, worker as vllm_worker
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector, ConnectorStateError, build_cache

two_step_only = pytest.mark.skipif(not CONTRACT.two_step_storage, reason=f"vLLM {CONTRACT.series} sets up in one call")


def step_metadata(requests):
    return AuxOutputConnectorMetadata(
        generation=0, requests=requests, block_hashes={}, finished_requests=(),
        retained_block_hashes=pack_hashes(()), released_block_hashes=pack_hashes(()),
    )


def test_the_installed_releases_row_of_the_version_table_is_what_its_code_shows():
    """The fields the harness and the connector branch on (``CONTRACT``) match vLLM's code."""
    assert_installed_contract_matches_vllm()


def test_the_factory_builds_a_pool_sized_by_build_cache_as_vllm_sets_it_up():
    setup = make_scheduler(lookahead=1)
    connector = build_connector_like_vllm(setup)
    assert isinstance(connector, CacheWorkerConnector)
    expected = build_cache(setup.vllm_config, setup.kv_cache_config, connector._capturer)
    assert connector.cache.num_pages == expected.num_pages and connector.cache.row_shape == ROW_SHAPE
    # Both the KV-sized part and the scheduler's pins (0.33 and 0.34 pin): twice num_blocks.
    working_set = vllm_worker.working_set_pages(
        connector.cache.page_size, setup.vllm_config.scheduler_config.max_num_batched_tokens,
        setup.vllm_config.scheduler_config.max_num_seqs, setup.vllm_config.max_concurrent_batches,
    )
    assert connector.cache.num_pages == 2 * setup.kv_cache_config.num_blocks + working_set
    assert connector.cache.stats()["host_pages"] == 0  # without a KV tier, the device holds every retained block
    # vLLM's real capturer, bound to the harness model's MoE layers, feeds the connector.
    rows = torch.randint(0, 64, (5, *ROW_SHAPE))
    feed_rows(connector, rows, setup.vllm_config)
    assert torch.equal(connector._capturer.snapshot_routing_data(5), rows.to(torch.uint8))


def test_with_a_kv_tier_the_host_tier_holds_every_retained_block_and_the_gpus():
    """Retention is the GPU's blocks plus the tier's; past the device's share they go to a host
    tier of retained + GPU blocks (readers' pins count against the GPU's), in pages."""
    setup = make_scheduler(lookahead=0, num_spec_tokens=0, num_blocks=64, kv_tier=("OffloadingConnector", 192))
    capturer = build_connector_like_vllm(setup)._capturer
    cache = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    num_blocks = setup.kv_cache_config.num_blocks
    assert cache.page_size == setup.vllm_config.cache_config.block_size  # a page per KV block here
    assert cache.stats()["host_pages"] == (num_blocks + 192) + num_blocks


def test_a_byte_budget_sizes_the_shared_pages_and_drafts_extend_the_position_limit():
    """``aux_output_config.max_bytes`` (vLLM's budget for routed-experts storage) replaces the
    pages derived from the KV cache; the working set stays. Draft rows run past the last
    token, so positions are accepted up to ``max_model_len`` plus the drafts."""
    setup = make_scheduler(lookahead=1)
    capturer = build_connector_like_vllm(setup)._capturer
    derived = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    working_set = derived.num_pages - 2 * setup.kv_cache_config.num_blocks  # as the test above finds it
    page_nbytes = derived.page_size * int(np.prod(ROW_SHAPE)) * derived.dtype.itemsize
    setup.vllm_config.aux_output_config.max_bytes = 10 * page_nbytes + page_nbytes // 2
    budgeted = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    assert budgeted.num_pages == 10 + working_set
    drafts = setup.vllm_config.speculative_config.num_speculative_tokens
    assert drafts > 0 and derived.max_position == setup.vllm_config.model_config.max_model_len + drafts


def test_a_second_initialisation_is_refused_and_keeps_the_pool():
    setup = make_scheduler(lookahead=1)
    connector = build_connector_like_vllm(setup)
    pool = connector.cache
    with pytest.raises(ConnectorStateError, match=rf"initialize_output_storage called again.*{pool.num_pages} pages"):
        connector.initialize_output_storage(setup.kv_cache_config)
    assert connector.cache is pool


@two_step_only
def test_vllm_034_profile_run_calls_the_factory_then_storage_comes_with_the_kv_layout():
    import vllm.v1.worker.gpu.model_runner as runner_module

    setup = make_scheduler(lookahead=1)
    model_runner = None
    saved = runner_module.get_aux_output_connector
    try:
        model = HarnessMoEModel(setup.vllm_config.model_config.get_total_num_hidden_layers())
        with set_up_as_a_worker():
            assert vllm_plugin.register() is True
            model_runner = profiling_runner(setup.vllm_config, model)
            model_runner.profile_run()  # vLLM 0.34's own code calls the (patched) factory
    finally:
        runner_module.get_aux_output_connector = saved
    connector = model_runner.aux_output_connector
    assert isinstance(connector, CacheWorkerConnector) and connector.cache is None
    # The capture hooks were live in the profiling pass: its dummy rows reached vLLM's capturer.
    assert model_runner.dummy_rows_routed == setup.vllm_config.scheduler_config.max_num_batched_tokens
    assert all(layer.capture_fn is not None for layer in model.moe_layers)
    # Dummy runs carry no metadata: nothing happens, nothing is refused.
    connector.begin_step(None)
    assert connector.prepare_output(input_batch(["a"], [0, 4], [0])) is None
    # A real step before the storage exists is refused, naming what happened; nothing changes.
    with pytest.raises(ConnectorStateError, match=r"before initialize_output_storage"):
        connector.begin_step(step_metadata({"a": 0}))
    assert connector.stats() == {"reattachments": 0, "rollbacks": 0, "returned_rows": 0, "requests_tracked": 0}
    connector.initialize_output_storage(setup.kv_cache_config)
    assert connector.cache is not None and connector.cache.stats()["requests"] == 0
    connector.begin_step(step_metadata({"a": 0}))
    assert connector.stats()["requests_tracked"] == 1


def test_both_call_shapes_of_the_factory_are_accepted():
    """0.33's one-call shape and 0.34's two-step shape give the same pool."""
    setup = make_scheduler(lookahead=1)
    ensure_single_rank_group(setup.vllm_config)
    num_layers = setup.vllm_config.model_config.get_total_num_hidden_layers()
    with set_up_as_a_worker():
        one_call = vllm_worker.get_aux_output_connector(HarnessMoEModel(num_layers), setup.vllm_config,
                                                        setup.kv_cache_config)
        two_step = vllm_worker.get_aux_output_connector(HarnessMoEModel(num_layers), setup.vllm_config)
    assert two_step.cache is None
    two_step.initialize_output_storage(setup.kv_cache_config)
    assert one_call.cache.num_pages == two_step.cache.num_pages
    assert np.array_equal(one_call.cache.pages.shape, two_step.cache.pages.shape)


INSTALLED_SCHEDULER_CONNECTOR = """
from routed_experts_cache.connector.vllm import plugin
active = plugin.register()
import vllm.distributed.aux_output_connector.connector as source
import vllm.v1.core.sched.scheduler as scheduler
print(active, source.AuxOutputSchedulerConnector.__name__, scheduler.AuxOutputSchedulerConnector.__name__)
"""


@pytest.mark.parametrize("switch, expected", [("1", "True CacheSchedulerConnector CacheSchedulerConnector"),
                                              ("0", "False AuxOutputSchedulerConnector AuxOutputSchedulerConnector")])
def test_the_plugin_replaces_the_scheduler_side_connector_where_the_scheduler_reads_it(switch, expected):
    """In a fresh process, as ``EngineCore`` loads plugins before it builds the scheduler: both
    names the scheduler can reach are ours when the plugin is on, vLLM's when it is off."""
    env = dict(os.environ, ROUTED_EXPERTS_CACHE=switch)
    done = subprocess.run([sys.executable, "-c", INSTALLED_SCHEDULER_CONNECTOR], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == expected
