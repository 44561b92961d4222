"""Rows across a prefill/decode split, at the scheduler level, on vLLM 0.33's and 0.34's real
scheduler: two engines in one process (a prefill instance and a decode instance, each with its
own scheduler, KV cache and worker connector of this project) share KV through the harness's
stub KV connector (``shared_store``: what the prefill saves, the decode loads, like
ExampleConnector's shared storage path).

The prefill runs each prompt for one token with ``kv_transfer_params={"do_remote_decode":
True}`` and returns ``kv_transfer_params`` carrying the rows (``row_transfer``); they go
unchanged into the decode request, whose scheduler may then load the prompt's KV (the hit is
covered by the imported rows) and whose client rows, for the whole sequence, equal the routing
oracle. Without the rows, or with rows that do not fit the model, the decode recomputes the
prompt; its rows are exact as well.
"""

import copy
import itertools

import numpy as np
import pytest

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    SimEngine, build_our_connector, make_request, make_scheduler, random_prompt,
)
from cpu_harness.vllm_scheduler.multi_turn import TierRun, observe_hits
from routed_experts_cache.connector.vllm.row_transfer import MAX_BYTES_ENV, ROWS_KEY

_STORES = itertools.count()


def pd_pair():
    """A prefill engine and a decode engine sharing one KV store."""
    store = f"pd-{next(_STORES)}"
    engines = []
    for _ in range(2):
        setup = make_scheduler(lookahead=0, num_spec_tokens=0, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                               kv_connector={"load_mode": "async", "shared_store": store})
        engines.append((setup, SimEngine(setup, build_our_connector(setup))))
    run = TierRun("stub", "ours", 64, 0)
    observe_hits(engines[1][0].scheduler, run)
    return engines[0], engines[1], run


def prefill(setup, engine, prompts):
    for request_id, prompt in prompts.items():
        engine.add(make_request(setup, request_id, prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    engine.flush()
    engine.check_all_finished()
    return {request_id: engine.kv_transfer_params[request_id] for request_id in prompts}


def decode(setup, engine, prompts, params):
    for request_id, prompt in prompts.items():
        engine.add(make_request(setup, request_id, prompt, 6, kv_transfer_params=params.get(request_id)))
    engine.flush()
    engine.check_all_finished()  # every client row, [0, num_tokens - 1), equal to the oracle


def test_a_decode_instance_takes_the_prefills_rows_and_does_not_recompute_the_prompt():
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(5)
    prompts = {f"r{i}": random_prompt(rng, int(n)) for i, n in enumerate(rng.integers(20, 60, size=6))}
    params = prefill(p_setup, p_engine, prompts)
    for request_id, prompt in prompts.items():
        entry = params[request_id][ROWS_KEY]
        assert entry["start"] == 0 and entry["shape"][0] == len(prompt) and entry["dtype"] == "uint8"
    decode(d_setup, d_engine, prompts, params)
    for request_id, prompt in prompts.items():
        decision = run.decisions[request_id]
        assert decision.offered > 0 and decision.accepted == decision.offered  # the prompt's KV was loaded
        first_computed = d_engine.stats.spans[request_id][0][0]
        assert first_computed >= len(prompt) - d_setup.block_size  # only the last partial block recomputed
    assert d_engine.connector.stats()["imported_rows"] >= sum(len(p) // 4 * 4 for p in prompts.values()) - 4 * len(prompts)


@pytest.mark.parametrize("damage", ["none", "missing", "wrong_shape", "wrong_dtype", "truncated_data", "start"])
def test_without_usable_rows_the_decode_recomputes_the_prompt_with_exact_rows(damage):
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(6)
    prompts = {"r": random_prompt(rng, 40)}
    params = prefill(p_setup, p_engine, prompts)
    entry = params["r"][ROWS_KEY]
    if damage == "missing":
        params = {}
    else:
        bad = copy.deepcopy(entry)
        if damage == "wrong_shape":
            bad["shape"] = [bad["shape"][0], bad["shape"][2], bad["shape"][1] + 1]
        elif damage == "wrong_dtype":
            bad["dtype"] = "uint16"
        elif damage == "truncated_data":
            bad["data"] = bad["data"][:-8]
        elif damage == "start":
            bad["start"] = 4
        params = {"r": {**params["r"], ROWS_KEY: bad}}
    decode(d_setup, d_engine, prompts, params)
    decision = run.decisions["r"]
    assert decision.offered > 0
    assert decision.accepted == (decision.offered if damage == "none" else 0)


def test_rows_over_the_size_limit_are_not_exported(monkeypatch):
    monkeypatch.setenv(MAX_BYTES_ENV, "100")  # below 40 rows x 3 x 2 bytes
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(7)
    prompts = {"r": random_prompt(rng, 40)}
    params = prefill(p_setup, p_engine, prompts)
    assert params["r"] is None or ROWS_KEY not in params["r"]
    decode(d_setup, d_engine, prompts, {"r": params["r"]} if params["r"] else {})
    assert run.decisions["r"].accepted == 0  # recomputed


def _config_with(connector: str, prefix_caching: bool = True):
    """A VllmConfig with routed experts on and ``connector`` as its KV connector."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.config.aux_output import AuxOutputConfig

    from cpu_harness.vllm_scheduler.scheduler import _model_dir

    return VllmConfig(
        model_config=ModelConfig(model=_model_dir(1), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=prefix_caching),
        device_config=DeviceConfig(device="cpu"), aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both"),
    )


def test_nixl_is_refused_with_routed_experts_unless_the_user_opts_in(monkeypatch):
    """vLLM refuses NIXL-class P/D connectors with routed experts; the plugin keeps that refusal
    unless ``ROUTED_EXPERTS_CACHE_PD_CONNECTORS`` is on, and lifts nothing else."""
    from routed_experts_cache import RoutedExpertsCacheError
    from routed_experts_cache.connector.vllm import plugin

    assert plugin.register()
    monkeypatch.delenv(plugin.PD_CONNECTORS_SWITCH, raising=False)
    with pytest.raises(ValueError, match="incompatible with NixlConnector; PD auxiliary output is not supported"):
        _config_with("NixlConnector")
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "0")
    with pytest.raises(ValueError, match="incompatible with NixlConnector"):
        _config_with("NixlConnector")
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "1")
    config = _config_with("NixlConnector")
    assert config.kv_transfer_config.kv_connector == "NixlConnector"
    assert config.aux_output_config.enable_return_routed_experts
    with pytest.raises(ValueError, match="requires prefix caching"):  # vLLM's other checks still hold
        _config_with("NixlConnector", prefix_caching=False)
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "sometimes")  # refused at start, and at the check
    with pytest.raises(RoutedExpertsCacheError, match="ROUTED_EXPERTS_CACHE_PD_CONNECTORS='sometimes' is not understood"):
        plugin.register()
    with pytest.raises(ValueError, match="ROUTED_EXPERTS_CACHE_PD_CONNECTORS='sometimes' is not understood"):
        _config_with("NixlConnector")
