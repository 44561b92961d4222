"""Drive vLLM 0.33's or 0.34's real scheduler side against a worker connector, without a model.

What differs between the two releases comes from ``routed_experts_cache.connector.vllm.versions``
(``CONTRACT``: the installed release's row). ``build_our_connector`` builds this project's
connector through the plugin's factory the way the installed release's Model Runner V2 does
(0.34: the real ``GPUModelRunner.profile_run``, then ``initialize_output_storage``).

Real vLLM pieces: ``VllmConfig`` (a DeepSeek-V3 MTP speculative config, so
``num_hash_lookahead_tokens`` is 1 or 2 exactly as vLLM derives it), the real
``Scheduler`` / ``AsyncScheduler`` with its ``KVCacheManager`` and ``BlockPool``,
``Request`` with the block hasher of ``vllm.v1.core.kv_cache_utils`` (lookahead tokens
included), and ``AuxOutputSchedulerConnector`` (built by the scheduler itself; its
``take_output`` trims every worker chunk).

Simulated pieces (no GPU, no model): ``SimModelRunner`` mirrors what Model Runner V2 does
around the aux-output hooks: it keeps the device-side view of each request (the real
``num_computed_tokens``, corrected for rejected drafts, while the CPU value in the input
batch assumes every draft was accepted under async scheduling), feeds the scheduled
tokens plus its own drafts, samples with a deterministic "true" next-token function and a
rejection sampler, and hands the connector a snapshot of routing rows. ``SimEngine``
mirrors ``EngineCore.step`` (sync) and ``EngineCore.step_with_batch_queue`` (async).

With a KV connector (``make_scheduler(kv_connector={...})``: the stub of
``cpu_harness/kv_connector.py``, loaded by vLLM through ``kv_transfer_config``) the runner
also drives the worker side of the connector as MRV2's ``ActiveKVConnector`` does, and keeps
a model of invalid KV (a failed load) so rows computed over it are wrong (``poison``). What
vLLM 0.33 does there, read from its source and observed with this harness:

- Rows of externally loaded tokens are not computed: they are prefix rows. The scheduler
  (``AuxOutputSchedulerConnector.cap_external_hit``) accepts an external hit only if it ends
  on a KV block boundary and every block of local + external hit is GPU-cached or retained
  by the aux-output scheduler (``_kv_cached``, up to ``_capacity`` = 2 x ``num_blocks`` with
  a KV connector); otherwise it drops the whole external hit. ``request_loading`` keeps an
  async load's blocks retained until the request is scheduled. The worker gets the hashes
  of the loaded blocks like any prefix hit and returns their rows from what it retained;
  the client receives them (from ``routed_experts_prompt_start``).
- With a KV connector vLLM keeps the legacy block hashes (``num_hash_lookahead_tokens`` 0).
- A failed *synchronous* load (recompute policy): ``update_from_output`` ->
  ``_handle_invalid_blocks`` sets the running request's ``num_computed_tokens`` to its
  first invalid block and skips its output of the step (no ``take_output``, no tokens);
  running requests that share an invalid block another request marks are set back to
  their count before the step. The next step schedules them as running requests at the
  lower count: the input batch's ``num_computed_tokens_np`` goes backwards; the block hashes
  already sent (up to the failed step's end) are not sent again, no terminal event. MRV2
  0.33's ``update_requests`` writes only that CPU mirror: its device ``num_computed_tokens``,
  sampled token and drafts are not rolled back. This harness's device follows the scheduler
  (``SimModelRunner.follow_rollback``), the behaviour the scheduler asks for.
- A failed *asynchronous* load is handled while the request waits for its KV: the worker
  first sees it at the lowered count; nothing goes backwards.
- Under ``AsyncScheduler`` the roll-back subtracts only the processed step's tokens from a
  count that includes the step in flight; the harness refuses to simulate that
  (``HarnessError``).

Routing rows are a pure function of the token prefix: the row of position ``p`` is derived
from a chained hash of ``tokens[0..p]``. Rows computed for a rejected draft therefore
differ from the true row of that position, and rows of equal prefixes (prefix-cache hits)
are equal. Every row a connector returns is checked against that function, and every
request's rows as the client assembles them (``take_output`` chunks, concatenated) must be
exactly ``[routed_experts_prompt_start, num_tokens - 1)``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import tempfile
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from math import prod
from types import SimpleNamespace
from unittest import mock

from routed_experts_cache.connector.vllm.versions import contract_for, series_of  # noqa: E402

VLLM_VERSION = importlib.metadata.version("vllm")
CONTRACT = contract_for(VLLM_VERSION)
if CONTRACT is None or not CONTRACT.scheduler_pins:
    raise RuntimeError(f"the scheduler harness needs vLLM 0.33.x or 0.34.x, found {VLLM_VERSION}")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM caches model-class inspection results; keep them out of the user's cache but
# reuse them across runs (the first run inspects the two architectures, ~15 s).
os.environ.setdefault(
    "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"routed-experts-cache-vllm{series_of(VLLM_VERSION)}")
)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm.v1.worker.gpu.model_runner as runner_module  # noqa: E402
from vllm.config import (  # noqa: E402
    AuxOutputConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer  # noqa: E402
from vllm.distributed.aux_output_connector.store import BackgroundBlockObjectStore, BlockObjectStore  # noqa: E402
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe import routed_experts_capturer  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from routed_experts_cache import RoutedExpertsCache  # noqa: E402
from routed_experts_cache.connector.vllm import plugin as vllm_plugin  # noqa: E402
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector, build_cache  # noqa: E402

BLOCK_SIZE = 4
ROW_SHAPE = (3, 2)  # (layers, top_k)
NUM_EXPERTS = 64
VOCAB = 500
_ROOT = b"\x00" * 16
PLACEHOLDER = -1  # a draft slot without a proposal; never accepted


class HarnessError(AssertionError):
    """The simulation saw something vLLM's real components would not produce, or a row check failed."""


# ------------------------------------------------------------------ routing oracle


def advance(state: bytes, token: int) -> bytes:
    """Chain state after one more token: a function of the whole prefix."""
    return hashlib.blake2b(state + int(token).to_bytes(4, "little", signed=True), digest_size=16).digest()


def row_of(state: bytes) -> np.ndarray:
    """Expert ids (layers, top_k) of the position whose prefix ends in ``state``."""
    return (np.frombuffer(state, dtype=np.uint8)[: prod(ROW_SHAPE)] % NUM_EXPERTS).reshape(ROW_SHAPE)


def true_next_token(state: bytes) -> int:
    """The token the (simulated) target model samples after the prefix ``state``."""
    return int.from_bytes(state[12:16], "little") % VOCAB


def prefix_states(tokens) -> list[bytes]:
    states, state = [], _ROOT
    for token in tokens:
        state = advance(state, token)
        states.append(state)
    return states


def expected_rows(tokens, start: int, end: int) -> np.ndarray:
    """Rows of positions ``[start, end)``: position p is a function of ``tokens[0..p]``."""
    if not 0 <= start <= end <= len(tokens):
        raise HarnessError(f"expected rows [{start}, {end}) of a {len(tokens)}-token sequence")
    states = prefix_states(tokens[:end])
    rows = [row_of(s) for s in states[start:end]]
    return np.stack(rows) if rows else np.empty((0, *ROW_SHAPE), dtype=np.uint8)


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, size=n)]


# ------------------------------------------------------------------ vLLM configuration

_MODEL_DIRS: dict[int, str] = {}
_MODEL_DIRS_LOCK = threading.Lock()


def _model_dir(num_nextn_predict_layers: int) -> str:
    """A config-only tiny DeepSeek-V3 (MoE, MTP) checkpoint directory; no weights needed."""
    with _MODEL_DIRS_LOCK:
        if num_nextn_predict_layers not in _MODEL_DIRS:
            path = tempfile.mkdtemp(prefix=f"rec-vllm033-dsv3-mtp{num_nextn_predict_layers}-")
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            config = dict(
                architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512,
                hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=ROW_SHAPE[0],
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=NUM_EXPERTS,
                num_experts_per_tok=ROW_SHAPE[1], n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=32,
                v_head_dim=32, max_position_embeddings=1024, torch_dtype="float32",
                num_nextn_predict_layers=num_nextn_predict_layers, rope_theta=10000.0,
            )
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(config, f)
            _MODEL_DIRS[num_nextn_predict_layers] = path
        return _MODEL_DIRS[num_nextn_predict_layers]


@dataclass
class SchedulerSetup:
    scheduler: object
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    block_hasher: object
    lookahead: int
    num_spec_tokens: int
    async_scheduling: bool
    # The worker-side StubKVConnector (cpu_harness/kv_connector.py) when make_scheduler
    # was given kv_connector options; the scheduler built its own scheduler-side instance.
    kv_worker: object = None

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size


def make_scheduler(
    *,
    lookahead: int,
    num_spec_tokens: int = 2,
    async_scheduling: bool = False,
    num_blocks: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 512,
    block_size: int = BLOCK_SIZE,
    kv_connector: dict | None = None,
) -> SchedulerSetup:
    """The real 0.33 scheduler, configured the way the engine core builds it.

    ``lookahead`` 1 is single-module MTP (eagle family, any ``num_spec_tokens``); L > 1 is
    multi-module MTP with ``num_spec_tokens == L``; 0 turns lookahead hashing off
    (``disable_lookahead_block_hashes``). vLLM derives ``num_hash_lookahead_tokens``
    itself; it is checked against ``lookahead`` here. ``num_spec_tokens=0`` (with
    ``lookahead=0``) builds no speculative config at all: no speculative decoding.

    ``kv_connector``: options of ``cpu_harness.kv_connector.kv_transfer_config`` (``{}`` for
    the defaults); the scheduler then loads ``StubKVConnector`` through vLLM's
    ``kv_transfer_config`` (``kv_role="kv_both"``, ``kv_load_failure_policy`` "recompute"
    unless given) and the worker-side instance is ``setup.kv_worker``.
    """
    nextn = max(1, lookahead)
    if lookahead > 1 and num_spec_tokens != lookahead:
        # Multi-module MTP hashes num_speculative_tokens lookahead tokens.
        raise HarnessError("multi-module MTP lookahead L needs num_spec_tokens == L")
    if num_spec_tokens == 0 and lookahead != 0:
        raise HarnessError("lookahead hashing needs speculative decoding (num_spec_tokens > 0)")
    if num_spec_tokens < 0:
        raise HarnessError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    model_config = ModelConfig(
        model=_model_dir(nextn), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len
    )
    keeps_lookahead = kv_connector is not None and kv_connector.get("keeps_lookahead_hashes", False)
    if keeps_lookahead and not CONTRACT.kv_connectors_may_keep_lookahead:
        raise HarnessError(f"vLLM {CONTRACT.series} has no KV connector that keeps lookahead hashing")
    if kv_connector is not None and lookahead != 0 and not keeps_lookahead:
        # VllmConfig.num_hash_lookahead_tokens: KV connectors keep the legacy hashes unless they
        # opt in (0.34's supports_lookahead_block_hashes).
        raise HarnessError("a KV connector without the lookahead opt-in turns lookahead hashing off: use lookahead=0")
    speculative_config = None
    if num_spec_tokens > 0:
        # With a KV connector lookahead hashing stays requested (vLLM's default) and vLLM
        # itself must turn it off; the check below holds it to that.
        speculative_config = SpeculativeConfig(
            method="mtp", num_speculative_tokens=num_spec_tokens, target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
            disable_lookahead_block_hashes=lookahead == 0 and (kv_connector is None or keeps_lookahead),
        )
    kv_transfer = None
    if kv_connector is not None:
        from cpu_harness.kv_connector import kv_transfer_config  # imports this module: not at the top

        kv_transfer = kv_transfer_config(**kv_connector)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=True, async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold, is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        speculative_config=speculative_config, device_config=DeviceConfig(device="cpu"),
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=True), kv_transfer_config=kv_transfer,
    )
    if vllm_config.num_hash_lookahead_tokens != lookahead:
        raise HarnessError(
            f"vLLM derived num_hash_lookahead_tokens={vllm_config.num_hash_lookahead_tokens}, wanted {lookahead}"
        )
    if CONTRACT.has_model_runner_v1 and not vllm_config.use_v2_model_runner:
        raise HarnessError("routed experts need Model Runner V2")
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), block_size=scheduler_block_size,
        hash_block_size=hash_block_size, log_stats=False,
    )
    if scheduler.aux_output_connector is None:
        raise HarnessError("the scheduler built no AuxOutputSchedulerConnector")
    kv_worker = None
    if kv_transfer is not None:
        from cpu_harness.kv_connector import StubKVConnector, make_worker

        if not isinstance(scheduler.connector, StubKVConnector):
            raise HarnessError(f"the scheduler built KV connector {type(scheduler.connector).__name__}")
        kv_worker = make_worker(vllm_config, kv_cache_config)
    # With a KV connector the aux-output scheduler keeps up to 2 x num_blocks retained blocks.
    capacity = num_blocks * (2 if kv_transfer is not None else 1)
    if scheduler.aux_output_connector._capacity != capacity:
        raise HarnessError(f"AuxOutputSchedulerConnector capacity {scheduler.aux_output_connector._capacity}, "
                           f"expected {capacity}")
    # EngineCore.__init__: the request block hasher with the config's lookahead tokens.
    caching_hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(caching_hash_fn)
    block_hasher = get_request_block_hasher(hash_block_size, caching_hash_fn, vllm_config.num_hash_lookahead_tokens)
    return SchedulerSetup(
        scheduler, vllm_config, kv_cache_config, block_hasher, lookahead, num_spec_tokens, async_scheduling,
        kv_worker,
    )


def make_request(setup: SchedulerSetup, request_id: str, prompt: list[int], max_tokens: int,
                 prompt_start: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, routed_experts_prompt_start=prompt_start)
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
        block_hasher=setup.block_hasher,
    )


# ------------------------------------------------------------------ worker connectors


class SnapshotCapturer:
    """Stands in for ``RoutedExpertsCapturer``: the step's rows, in batch order, on the CPU."""

    shape_per_token = ROW_SHAPE
    output_dtype = torch.uint8
    output_dtype_name = "uint8"

    def __init__(self) -> None:
        self.device_buffer = torch.empty(0, dtype=torch.int32)
        self.next_snapshot: torch.Tensor | None = None

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        snapshot, self.next_snapshot = self.next_snapshot, None
        if snapshot is None or snapshot.shape[0] != num_tokens:
            raise HarnessError(f"snapshot of {num_tokens} rows asked, {None if snapshot is None else snapshot.shape}")
        return snapshot


class HarnessMoEModel(torch.nn.Module):
    """The model the factory binds vLLM's capturer to: one capture source per MoE layer (the
    ``RoutedExpertsCaptureSource`` protocol: ``layer_id`` and the ``capture_fn`` vLLM sets)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.moe_layers = torch.nn.ModuleList(_CaptureSource(layer) for layer in range(num_layers))

    def route(self, rows: torch.Tensor, vllm_config: VllmConfig) -> None:
        """What the MoE layers do in a forward pass (under inference mode, as Model Runner V2's
        ``execute_model``): hand each layer's top-k ids to its hook."""
        with torch.inference_mode(), set_forward_context(None, vllm_config):
            for layer in self.moe_layers:
                layer.capture_fn(rows[:, layer.layer_id])


class _CaptureSource(torch.nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


# connector -> the model its capturer is bound to; weak, so a collected connector's id, reused
# by a later object, never routes that object's rows into a stale model
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DISTRIBUTED_LOCK = threading.Lock()


def _ensure_single_rank_group(vllm_config: VllmConfig) -> None:
    """A one-process gloo world, so ``get_tp_group()`` answers as on a single-GPU worker."""
    with _DISTRIBUTED_LOCK:
        if model_parallel_is_initialized():
            return
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def _set_up_as_a_worker():
    """What differs from a GPU worker here, and nothing else: the light environment's vLLM has
    no platform (a CUDA wheel without CUDA), so the capturer's buffer goes to the CPU, and
    ``profile_run``'s device sync has no accelerator to wait for."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            routed_experts_capturer, "current_platform", SimpleNamespace(device_type="cpu")))
        if not torch.accelerator.is_available():
            stack.enter_context(mock.patch.object(torch.accelerator, "synchronize", lambda *args, **kwargs: None))
        yield


def build_connector_like_vllm(setup: SchedulerSetup) -> CacheWorkerConnector:
    """This project's connector, built by the plugin's factory as the installed vLLM builds it.

    The plugin is registered as vLLM does at start-up (it replaces the factory in the model
    runner's module). vLLM 0.34: the real ``GPUModelRunner.profile_run`` calls the factory
    ``(model, vllm_config)`` and runs its dummy pass (the harness model routes
    ``max_num_batched_tokens`` rows through the live capture hooks), then
    ``initialize_output_storage(kv_cache_config)`` as ``initialize_kv_cache`` calls it.
    vLLM 0.33: one call ``(model, vllm_config, kv_cache_config)``, as its ``initialize_kv_cache``.
    """
    vllm_config = setup.vllm_config
    _ensure_single_rank_group(vllm_config)
    model = HarnessMoEModel(vllm_config.model_config.get_total_num_hidden_layers())
    saved = runner_module.get_aux_output_connector
    try:
        with _set_up_as_a_worker():
            if not vllm_plugin.register():
                raise HarnessError("the plugin did not install its worker connector factory")
            if CONTRACT.two_step_storage:
                runner = _profiling_runner(vllm_config, model)
                runner.profile_run()
                connector = runner.aux_output_connector
                if connector is None or connector.cache is not None:
                    raise HarnessError(f"profile_run built {connector!r}, expected a connector without storage")
                connector.initialize_output_storage(setup.kv_cache_config)
            else:
                connector = runner_module.get_aux_output_connector(model, vllm_config, setup.kv_cache_config)
    finally:
        runner_module.get_aux_output_connector = saved
    if not isinstance(connector, CacheWorkerConnector):
        raise HarnessError(f"the model runner's factory built {type(connector).__name__}")
    _MODELS[connector] = model
    return connector


def _profiling_runner(vllm_config: VllmConfig, model: HarnessMoEModel):
    """vLLM 0.34's ``GPUModelRunner`` with the attributes ``profile_run`` reads (its ``__init__``
    needs a GPU); the dummy pass routes rows through the model's capture hooks."""
    runner = object.__new__(runner_module.GPUModelRunner)
    runner.vllm_config, runner.model = vllm_config, model
    runner.supports_mm_inputs, runner.is_first_pp_rank, runner.is_last_pp_rank = False, True, False
    runner.encoder_cache = runner.pooling_runner = None
    runner.aux_output_connector = None
    runner.dummy_rows_routed = 0

    def dummy_run(num_tokens: int, **_options):
        model.route(torch.zeros((num_tokens, *ROW_SHAPE), dtype=torch.int64), vllm_config)
        runner.dummy_rows_routed += num_tokens
        return None, None

    runner._dummy_run = dummy_run
    runner.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    return runner


def feed_rows(connector, rows: torch.Tensor, vllm_config: VllmConfig) -> None:
    """A step's routing rows, as the connector's capturer receives them: through the model's
    capture hooks for a factory-built connector, as the stand-in's next snapshot otherwise."""
    model = _MODELS.get(connector)
    if model is not None:
        model.route(rows, vllm_config)
    else:
        connector._capturer.next_snapshot = rows


def build_our_connector(setup: SchedulerSetup, capturer: SnapshotCapturer | None = None, *,
                        backend: str | None = None, num_pages: int | None = None) -> CacheWorkerConnector:
    """This project's connector: built the way vLLM builds it (``build_connector_like_vllm``)
    unless a stand-in capturer is given or a pool is forced; then constructed directly, sized
    by its own ``build_cache`` unless ``num_pages`` is given."""
    if capturer is None and backend is None and num_pages is None:
        return build_connector_like_vllm(setup)
    capturer = capturer or SnapshotCapturer()
    if backend is None and num_pages is None:
        cache = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    else:
        if num_pages is None:
            num_pages = build_cache(setup.vllm_config, setup.kv_cache_config, capturer).num_pages
        _, page_size = resolve_kv_cache_block_sizes(setup.kv_cache_config, setup.vllm_config)
        cache = RoutedExpertsCache(num_pages, page_size, ROW_SHAPE, dtype=torch.uint8, device="cpu",
                                   backend=backend or "auto")
    return CacheWorkerConnector(
        capturer=capturer, cache=cache, max_concurrent_batches=setup.vllm_config.max_concurrent_batches
    )


def build_vllm_connector(setup: SchedulerSetup, capturer: SnapshotCapturer) -> AuxOutputWorkerConnector:
    """vLLM 0.33's own worker connector, built the way its unit tests build it.

    ``object.__new__`` without ``__init__`` (which needs a model and a GPU capturer), then
    the attributes its methods use: a real ``RoutedExpertsBuffer`` and a real
    ``BackgroundBlockObjectStore`` over a ``BlockObjectStore`` sized as ``__init__`` sizes
    it; the capturer returns a CPU tensor in place of the GPU snapshot.
    """
    vllm_config = setup.vllm_config
    scheduler_config = vllm_config.scheduler_config
    _, hash_block_size = resolve_kv_cache_block_sizes(setup.kv_cache_config, vllm_config)
    dtype = np.dtype(capturer.output_dtype_name)
    row_shape = tuple(capturer.shape_per_token)
    block_nbytes = hash_block_size * prod(row_shape) * dtype.itemsize
    connector = object.__new__(AuxOutputWorkerConnector)
    connector._capturer = capturer
    connector._requests = {}
    connector._generation = 0
    connector._step_metadata = None
    connector._pending_outputs = []
    connector._lock = threading.Lock()
    connector._max_concurrent_batches = vllm_config.max_concurrent_batches
    connector._store = BackgroundBlockObjectStore(
        BlockObjectStore(max_bytes=setup.kv_cache_config.num_blocks * block_nbytes, object_nbytes=block_nbytes),
        max_pending_batches=2 * scheduler_config.max_num_seqs,
    )
    connector._buffer = RoutedExpertsBuffer(
        dtype, row_shape, hash_block_size, scheduler_config.max_num_seqs,
        scheduler_config.max_num_batched_tokens, vllm_config.max_concurrent_batches,
    )
    return connector


@dataclass
class _ReferenceState:
    emit: int  # first row the client has not received
    emit_start: int  # the scheduler's emit start in the latest metadata
    hashes: list[bytes] = field(default_factory=list)
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # own captured rows by position
    cursor: int | None = None
    published: set[int] = field(default_factory=set)  # block indices this request published
    pending: int = 0
    finished: bool = False


class _ReferencePending:
    def __init__(self, connector, request_ids, token_starts, query_start_loc, snapshot) -> None:
        self.connector, self.request_ids = connector, request_ids
        self.token_starts, self.query_start_loc, self.snapshot = token_starts, query_start_loc, snapshot
        self.num_sampled = self.num_rejected = None

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self.num_sampled, self.num_rejected = num_sampled, num_rejected

    def process_output(self):
        return self.connector.process_output(self)


class ReferenceWorkerConnector:
    """An ideal worker connector on host dicts, used to check scenarios, not a product.

    No memory bound (published rows are never evicted, so pins are moot) and no device
    work. When a step's token start is behind what it captured (vLLM rolled back
    ``num_computed_tokens``), it drops its rows from there on, withdraws the blocks it had
    published from them and emits again from the scheduler's emit start (the client never
    received the dropped step's rows). A scenario that fails with this connector points at
    the harness or at vLLM, not at the connector under test.
    """

    def __init__(self, capturer: SnapshotCapturer, block_size: int) -> None:
        self._capturer = capturer
        self.block_size = block_size
        self.published: dict[bytes, tuple[str, np.ndarray]] = {}  # hash -> (publisher, block rows)
        self.requests: dict[str, _ReferenceState] = {}
        self.generation = 0
        self.metadata = None
        self.rollbacks = 0
        self.withdrawn = 0

    def begin_step(self, metadata) -> None:
        self.metadata = metadata
        if metadata is None:
            return
        if metadata.generation != self.generation:
            self.generation = metadata.generation
            self.published.clear()
            self.requests.clear()
        for request_id, emit_start in metadata.requests.items():
            state = self.requests.setdefault(request_id, _ReferenceState(emit=emit_start, emit_start=emit_start))
            state.emit_start = emit_start
        for request_id, packed in metadata.block_hashes.items():
            state = self.requests.get(request_id)
            if state is None:
                raise HarnessError(f"reference: hashes for unknown request {request_id}")
            state.hashes.extend(packed)
            self._publish(request_id, state)
        for request_id in metadata.finished_requests:
            state = self.requests.get(request_id)
            if state is not None:
                state.finished = True
                if state.pending == 0:
                    del self.requests[request_id]

    def prepare_output(self, input_batch):
        if self.metadata is None:
            return None
        request_ids = list(input_batch.req_ids)
        query_start_loc = np.array(input_batch.query_start_loc_np[: len(request_ids) + 1])
        snapshot = self._capturer.snapshot_routing_data(int(query_start_loc[-1])).numpy()
        for request_id in request_ids:
            self.requests[request_id].pending += 1
        return _ReferencePending(self, request_ids, np.array(input_batch.num_computed_tokens_np[: len(request_ids)]),
                                 query_start_loc, snapshot)

    def process_output(self, pending: _ReferencePending):
        bs, outputs = self.block_size, {}
        for request_id, token_start, start, end, sampled, rejected in zip(
            pending.request_ids, pending.token_starts.tolist(), pending.query_start_loc[:-1].tolist(),
            pending.query_start_loc[1:].tolist(), pending.num_sampled.tolist(), pending.num_rejected.tolist(),
            strict=True,
        ):
            state = self.requests[request_id]
            state.pending -= 1
            capture_start = token_start
            cursor = state.cursor if state.cursor is not None else capture_start
            if capture_start < cursor:  # roll-back
                self.rollbacks += 1
                for position in [p for p in state.rows if p >= capture_start]:
                    del state.rows[position]
                for k in sorted(k for k in state.published if (k + 1) * bs > capture_start):
                    key = state.hashes[k]
                    if self.published.get(key, (None,))[0] == request_id:
                        del self.published[key]
                        self.withdrawn += 1
                    state.published.discard(k)
                state.emit = min(state.emit, state.emit_start)
            elif capture_start > cursor:  # async scheduling: drafts the device rejected
                capture_start = cursor
            accepted = end - start - rejected
            for i in range(accepted):
                state.rows[capture_start + i] = pending.snapshot[start + i].copy()
            state.cursor = token_end = capture_start + accepted
            self._publish(request_id, state)
            if sampled > 0 and state.emit <= token_end:
                outputs[request_id] = AuxRequestOutput(state.emit, self._read(request_id, state, state.emit, token_end))
                state.emit = token_end
            if state.finished and state.pending == 0:
                del self.requests[request_id]
        return outputs

    def _publish(self, request_id: str, state: _ReferenceState) -> None:
        bs = self.block_size
        for k, key in enumerate(state.hashes):
            if k in state.published or key in self.published:
                continue
            if all(p in state.rows for p in range(k * bs, (k + 1) * bs)):
                self.published[key] = (request_id, np.stack([state.rows[p] for p in range(k * bs, (k + 1) * bs)]))
                state.published.add(k)

    def _read(self, request_id: str, state: _ReferenceState, start: int, end: int) -> np.ndarray:
        rows = []
        for p in range(start, end):
            row = state.rows.get(p)
            if row is None:
                k = p // self.block_size
                entry = self.published.get(state.hashes[k]) if k < len(state.hashes) else None
                if entry is None:
                    raise HarnessError(f"reference: {request_id} row {p} is neither captured nor published")
                row = entry[1][p % self.block_size]
            rows.append(row)
        return np.stack(rows) if rows else np.empty((0, *ROW_SHAPE), dtype=np.uint8)

    def close(self) -> None:
        self.requests.clear()


def build_reference_connector(setup: SchedulerSetup, capturer: SnapshotCapturer) -> ReferenceWorkerConnector:
    _, hash_block_size = resolve_kv_cache_block_sizes(setup.kv_cache_config, setup.vllm_config)
    return ReferenceWorkerConnector(capturer, hash_block_size)


# ------------------------------------------------------------------ simulated model runner


@dataclass
class _DeviceRequest:
    computed: int  # device view of num_computed_tokens (rejections applied)
    cpu_computed: int  # the scheduler's view, as the input batch carries it
    drafts: list[int] = field(default_factory=list)
    captured_end: int = 0  # end of the rows the last executed step produced and accepted


@dataclass
class RunStats:
    steps: int = 0
    empty_steps: int = 0
    chunked_prefill_steps: int = 0  # a request ran a prefill chunk that did not reach its end
    drafts_fed: int = 0
    drafts_rejected: int = 0
    placeholder_drafts: int = 0
    reattached: int = 0  # steps where the CPU's token start was ahead of the device's
    prefix_hit_tokens: int = 0  # first scheduled position of new/resumed requests, summed
    rows_checked: int = 0  # rows returned by the connector and checked against the oracle
    max_pending_pages: int = 0
    generations: set[int] = field(default_factory=set)
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # device (start, end) per step
    outputs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # connector (start, end) per output
    finished_events: Counter = field(default_factory=Counter)  # metadata.finished_requests, per request
    scheduled_after_finish: set[str] = field(default_factory=set)  # re-added after a terminal event
    # With a KV connector:
    external_loads: int = 0  # loads the worker completed (sync and async)
    failed_loads: int = 0  # ... with at least one invalid block
    poisoned_rows: int = 0  # rows computed while attending to KV of a block whose load failed
    poisoned_steps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> poisoned spans
    dropped_tokens: int = 0  # device tokens the scheduler dropped (stale output of a preempted request)
    # (request, end of the rows the worker captured, token start the next input batch carried)
    worker_rollbacks: list[tuple[str, int, int]] = field(default_factory=list)


def poison(rows: np.ndarray) -> np.ndarray:
    """What the model computes at a position whose attention reads KV that failed to load: not the true row."""
    return ((rows.astype(np.int64) + 1) % NUM_EXPERTS).astype(rows.dtype)


class SimModelRunner:
    """Model Runner V2's behaviour around the aux-output hooks, on synthetic tokens and rows.

    With a KV connector (``kv_worker``, the worker side of ``cpu_harness.kv_connector``)
    the runner also does what MRV2's ``ActiveKVConnector`` does around the forward:
    ``handle_preemptions`` and ``bind_connector_metadata`` before it, ``start_load_kv``
    before it when the step has synchronous loads (else after), then ``wait_for_save``,
    ``get_transfer_results``, ``get_block_ids_with_load_errors`` and
    ``clear_connector_metadata``; the result is the step's ``kv_connector_output``, also on
    steps without scheduled tokens (MRV2's ``no_forward``). Tokens a load brings in are
    computed tokens the model does not run: no routing row is produced for them (they are
    before the first scheduled position, like a local prefix hit).

    The runner also keeps a model of its KV: the block table of every request (from the
    scheduler output) and the set of KV blocks whose content is invalid (a failed load).
    A row computed at position ``p`` whose attention reads such a block (any block of the
    request at or before ``p``) is wrong: ``poison(true row)``. Blocks written from their
    first slot by an unpoisoned computation become valid again; blocks written by a
    poisoned one become invalid.
    """

    def __init__(self, connector, vllm_config: VllmConfig, *, num_spec_tokens: int, async_scheduling: bool,
                 seed: int = 0, accept=None, kv_worker=None, block_size: int = BLOCK_SIZE) -> None:
        self.connector = connector
        self.vllm_config = vllm_config
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.kv_worker = kv_worker
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        # accept(request_id, rng) -> number of leading correct drafts proposed next step.
        self.accept = accept or (lambda request_id, rng: int(rng.integers(0, num_spec_tokens + 1)))
        self.tokens: dict[str, list[int]] = {}  # true tokens (what the device sampled); kept across preemption
        self.states: dict[str, list[bytes]] = {}
        self.device: dict[str, _DeviceRequest] = {}
        self.block_tables: dict[str, list[int]] = {}  # KV block ids per request, as MRV2's block table
        self.kv_bad: set[int] = set()  # KV blocks whose content is invalid (failed load)
        self.last_drafts: dict[str, list[int]] = {}
        self.stats = RunStats()
        self.after_output = []  # callbacks(aux_output) run after every process_output
        self.after_begin_step = []  # callbacks(metadata) run after every begin_step
        if isinstance(connector, CacheWorkerConnector):
            self.after_output.append(self._track_cache)

    def _track_cache(self, _outputs) -> None:
        cache = self.connector.cache
        cache.check_consistency()
        self.stats.max_pending_pages = max(self.stats.max_pending_pages, cache.stats()["pending"])

    # -- helpers
    def _states(self, request_id: str) -> list[bytes]:
        tokens, states = self.tokens[request_id], self.states.setdefault(request_id, [])
        state = states[-1] if states else _ROOT
        for token in tokens[len(states):]:
            state = advance(state, token)
            states.append(state)
        return states

    def _propose(self, request_id: str) -> list[int]:
        state = self._states(request_id)[-1]
        num_correct = self.accept(request_id, self.rng)
        drafts = []
        for i in range(self.num_spec_tokens):
            correct = true_next_token(state)
            draft = correct if i < num_correct else (correct + 1 + int(self.rng.integers(0, VOCAB - 1))) % VOCAB
            drafts.append(draft)
            state = advance(state, draft)
        return drafts

    def check_rows(self, outputs, poisoned: dict[str, tuple[int, int]] | None = None) -> None:
        """Every row the connector returned equals the oracle's row of that position.

        ``poisoned``: this step's positions computed over invalid KV, per request; the
        connector cannot know, so there the rows must equal what the model produced.
        """
        for request_id, output in (outputs or {}).items():
            rows = np.asarray(output.rows)
            if rows.dtype != np.uint8 or rows.shape[1:] != ROW_SHAPE:
                raise HarnessError(f"{request_id}: rows {rows.dtype} {rows.shape}")
            start, end = int(output.token_start), int(output.token_start) + rows.shape[0]
            states = self._states(request_id)
            if end > len(states):
                raise HarnessError(f"{request_id}: rows up to {end}, only {len(states)} tokens exist")
            want = np.stack([row_of(s) for s in states[start:end]]) if end > start else rows
            span = (poisoned or {}).get(request_id)
            if span is not None and end > start:
                lo, hi = max(start, span[0]), min(end, span[1])
                if lo < hi:
                    want = want.copy()
                    want[lo - start: hi - start] = poison(want[lo - start: hi - start])
            if not np.array_equal(rows, want):
                bad = [start + int(i) for i in np.nonzero((rows != want).reshape(len(rows), -1).any(1))[0]]
                raise HarnessError(f"{request_id}: rows [{start}, {end}) differ from the oracle at positions {bad}")
            self.stats.rows_checked += rows.shape[0]
            self.stats.outputs.setdefault(request_id, []).append((start, end))

    # -- KV connector (MRV2's ActiveKVConnector around the forward)
    def _kv_pre_forward(self, so) -> None:
        if self.kv_worker is None:
            return
        metadata = so.kv_connector_metadata
        if metadata is None:
            raise HarnessError("the scheduler has a KV connector but sent no kv_connector_metadata")
        self.kv_worker.handle_preemptions(metadata)
        self.kv_worker.bind_connector_metadata(metadata)
        if so.has_sync_kv_loads:
            self.kv_worker.start_load_kv(None)
            self._apply_loads()

    def _kv_post_forward(self, so) -> KVConnectorOutput | None:
        if self.kv_worker is None:
            return None
        worker = self.kv_worker
        if not worker.loads_started:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(set(so.finished_req_ids))
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving, invalid_block_ids=worker.get_block_ids_with_load_errors(),
        )
        worker.clear_connector_metadata()
        self._apply_loads()
        return output

    def _apply_loads(self) -> None:
        """A completed load wrote its blocks: valid KV, or invalid where it failed."""
        for result in self.kv_worker.take_load_results():
            self.stats.external_loads += 1
            self.stats.failed_loads += bool(result.failed)
            for block_id in result.job.block_ids:
                if block_id in result.failed:
                    self.kv_bad.add(block_id)
                else:
                    self.kv_bad.discard(block_id)

    def _poison_starts(self, spans: dict[str, tuple[int, int]]) -> dict[str, int]:
        """First position of each request whose computation this step reads invalid KV."""
        if not self.kv_bad:
            return {}
        bs = self.block_size
        fresh: dict[int, str] = {}  # blocks written from their first slot this step -> writer
        for request_id, (start, end) in spans.items():
            table = self.block_tables[request_id]
            if (end - 1) // bs >= len(table):
                raise HarnessError(f"{request_id}: positions up to {end} but {len(table)} KV blocks")
            for k in range(-(-start // bs), (end - 1) // bs + 1):
                fresh[table[k]] = request_id
        poisoned: dict[str, int] = {}
        for _ in range(8):
            bad = {b for b in self.kv_bad if b not in fresh} | {b for b, w in fresh.items() if w in poisoned}
            found = {}
            for request_id, (start, end) in spans.items():
                table = self.block_tables[request_id]
                for k in range((end - 1) // bs + 1):
                    block_id = table[k]
                    if block_id in bad and fresh.get(block_id) != request_id:
                        found[request_id] = max(start, k * bs)
                        break
            if found == poisoned:
                return poisoned
            poisoned = found
        raise HarnessError("the invalid-KV model did not settle")

    def _update_kv_validity(self, spans: dict[str, tuple[int, int]], poisoned: dict[str, int]) -> None:
        bs = self.block_size
        for request_id, (start, end) in spans.items():
            table = self.block_tables[request_id]
            first_bad = poisoned.get(request_id)
            for k in range(start // bs, (end - 1) // bs + 1):
                if first_bad is not None and (k + 1) * bs > first_bad:
                    self.kv_bad.add(table[k])
                elif start <= k * bs:
                    self.kv_bad.discard(table[k])

    def follow_rollback(self, request) -> None:
        """The scheduler rolled a running request back (KV load failure): drop what it dropped.

        vLLM 0.33's scheduler skips the request's output of the step (its sampled tokens)
        and lowers ``num_computed_tokens``; the device here follows it (see the module
        docstring: MRV2 0.33 itself only updates its CPU mirror).
        """
        request_id = request.request_id
        dev = self.device.get(request_id)
        if dev is None:
            return
        known = len(request.all_token_ids)
        tokens = self.tokens[request_id]
        if tokens[:known] != list(request.all_token_ids):
            raise HarnessError(f"{request_id}: scheduler tokens differ from the device's at a rollback")
        del tokens[known:]
        del self.states.setdefault(request_id, [])[known:]
        dev.computed = dev.cpu_computed = request.num_computed_tokens

    # -- the step
    def execute(self, scheduler_output) -> "_StepHandle":
        so = scheduler_output
        # MRV2 order: finish / free states, add new (and resumed), update cached, begin_step.
        for request_id in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.device.pop(request_id, None)
            self.block_tables.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            known = list(new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids)
            mine = self.tokens.setdefault(new.req_id, [])
            if mine and mine != known:
                # With a KV connector that requires KV delivery (kv_role kv_both), a preemption
                # drops the request's in-flight output: the device sampled tokens the scheduler
                # never appended.
                dropped = self.kv_worker is not None and len(known) < len(mine) and mine[: len(known)] == known
                if not dropped:
                    raise HarnessError(
                        f"{new.req_id}: scheduler resumes with {len(known)} tokens, device has {len(mine)}"
                    )
                self.stats.dropped_tokens += len(mine) - len(known)
            self.tokens[new.req_id] = known
            self.states.pop(new.req_id, None)
            self.device[new.req_id] = _DeviceRequest(new.num_computed_tokens, new.num_computed_tokens,
                                                     captured_end=new.num_computed_tokens)
            self.block_tables[new.req_id] = list(new.block_ids[0])
            self.stats.prefix_hit_tokens += new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for request_id, cpu_computed, new_block_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            self.device[request_id].cpu_computed = cpu_computed
            if new_block_ids is not None:
                if CONTRACT.cached_requests_have_resumed_ids and request_id in cached.resumed_req_ids:
                    self.block_tables[request_id] = list(new_block_ids[0])
                else:
                    self.block_tables[request_id].extend(new_block_ids[0])
        metadata = so.aux_output_connector_metadata
        if metadata is not None:
            self.stats.generations.add(metadata.generation)
            for request_id in metadata.requests:
                if self.stats.finished_events[request_id]:
                    self.stats.scheduled_after_finish.add(request_id)
            self.stats.finished_events.update(metadata.finished_requests)
        self.connector.begin_step(metadata)
        for callback in self.after_begin_step:
            callback(metadata)
        self.stats.steps += 1
        self._kv_pre_forward(so)
        if so.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            kv_output = self._kv_post_forward(so)
            output = None if kv_output is None else ModelRunnerOutput.with_kv_conn_output_only(kv_output)
            return _StepHandle(self, None, output)

        order = list(so.num_scheduled_tokens)
        spans = {}
        for request_id in order:
            dev = self.device[request_id]
            spans[request_id] = (dev.computed, dev.computed + so.num_scheduled_tokens[request_id])
        poison_starts = self._poison_starts(spans)
        poisoned_spans: dict[str, tuple[int, int]] = {}
        rows, query_start_loc, cpu_starts, num_sampled, num_rejected, sampled = [], [0], [], [], [], []
        self.last_drafts = {}
        for request_id in order:
            dev, n = self.device[request_id], so.num_scheduled_tokens[request_id]
            real, cpu = dev.computed, dev.cpu_computed
            if real > cpu or (real != cpu and not self.async_scheduling):
                raise HarnessError(f"{request_id}: device computed {real}, scheduler says {cpu}")
            if cpu < dev.captured_end:
                self.stats.worker_rollbacks.append((request_id, dev.captured_end, cpu))
            self.stats.reattached += cpu > real
            tokens, states = self.tokens[request_id], self._states(request_id)
            known = len(tokens)
            num_drafts = real + n - known
            if num_drafts > 0:
                # Slots without a proposal are placeholders (-1): the scheduler pads a new
                # request with one token left (e.g. a full prefix hit) to 1 + k rows.
                drafts = dev.drafts[:num_drafts] + [PLACEHOLDER] * (num_drafts - len(dev.drafts))
                self.stats.placeholder_drafts += drafts.count(PLACEHOLDER)
                if not self.async_scheduling and so.scheduled_spec_decode_tokens.get(request_id) != drafts:
                    raise HarnessError(f"{request_id}: scheduled drafts differ from the proposed ones")
            else:
                drafts = []
            fed = tokens[real: real + n] + drafts
            state = states[real - 1] if real else _ROOT
            first_bad = poison_starts.get(request_id)
            for position, token in enumerate(fed, start=real):
                state = advance(state, token)
                row = row_of(state)
                if first_bad is not None and position >= first_bad:
                    row = poison(row)
                rows.append(row)
            if first_bad is not None:
                poisoned_spans[request_id] = (first_bad, real + n)
                self.stats.poisoned_rows += real + n - first_bad
                self.stats.poisoned_steps.setdefault(request_id, []).append((first_bad, real + n))
            query_start_loc.append(query_start_loc[-1] + n)
            cpu_starts.append(cpu)
            self.stats.spans.setdefault(request_id, []).append((real, real + n))
            if num_drafts < 0:  # a prefill chunk short of the end: nothing sampled
                self.stats.chunked_prefill_steps += 1
                dev.computed = dev.captured_end = real + n
                num_sampled.append(0)
                num_rejected.append(0)
                sampled.append([])
                continue
            # Rejection sampling against the true next tokens.
            state, accepted = states[-1], 0
            for draft in drafts:
                if draft != true_next_token(state):
                    break
                accepted += 1
                state = advance(state, draft)
            new_tokens = drafts[:accepted] + [true_next_token(state)]
            tokens.extend(new_tokens)
            rejected = num_drafts - accepted
            self.stats.drafts_fed += num_drafts
            self.stats.drafts_rejected += rejected
            dev.computed = dev.captured_end = real + n - rejected
            dev.drafts = self._propose(request_id)
            self.last_drafts[request_id] = list(dev.drafts)
            num_sampled.append(len(new_tokens))
            num_rejected.append(rejected)
            sampled.append(new_tokens)
        if self.kv_worker is not None:
            self._update_kv_validity(spans, poison_starts)

        feed_rows(self.connector, torch.from_numpy(np.stack(rows)), self.vllm_config)
        input_batch = SimpleNamespace(
            req_ids=order,
            query_start_loc_np=np.array(query_start_loc, dtype=np.int32),
            num_computed_tokens_np=np.array(cpu_starts, dtype=np.int32),
        )
        pending = self.connector.prepare_output(input_batch)
        if pending is not None:
            pending.enqueue_cpu_copy(np.array(num_sampled, dtype=np.int32), np.array(num_rejected, dtype=np.int32))
        index = {"req_id_to_index": {r: i for i, r in enumerate(order)}} if CONTRACT.runner_output_has_req_id_to_index else {}
        output = ModelRunnerOutput(req_ids=order, sampled_token_ids=sampled, **index)
        output.kv_connector_output = self._kv_post_forward(so)
        return _StepHandle(self, pending, output, poisoned_spans)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self.last_drafts:
            return None
        req_ids = list(self.last_drafts)
        return DraftTokenIds(req_ids, [list(self.last_drafts[r]) for r in req_ids])


class _StepHandle:
    def __init__(self, runner: SimModelRunner, pending, output, poisoned=None) -> None:
        self.runner, self.pending, self.output = runner, pending, output
        self.poisoned = poisoned or {}

    def get_output(self) -> ModelRunnerOutput:
        """The output thread: ``process_output`` after the copy, then the row checks."""
        if self.output is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.pending is not None:
            aux = self.pending.process_output()
            self.runner.check_rows(aux, self.poisoned)
            self.output.aux_output_connector_output = aux
            for callback in self.runner.after_output:
                callback(aux)
        return self.output


class RetainedPins:
    """0.33's retained / released block hashes, checked against our cache.

    After every step output, every hash the scheduler retained and has not released yet is
    published in the cache (its rows can be read by a later prefix hit). A generation change
    drops the pins, as the connector does.
    """

    def __init__(self, runner: "SimModelRunner") -> None:
        self.cache = runner.connector.cache
        self.generation = 0
        self.retained: Counter = Counter()
        self.seen = Counter()
        runner.after_begin_step.append(self.on_begin_step)
        runner.after_output.append(self.on_output)

    def on_begin_step(self, metadata) -> None:
        if metadata is None:
            return
        if metadata.generation != self.generation:
            self.generation = metadata.generation
            self.retained.clear()
            self.seen["generations"] += 1
            return
        new = list(metadata.retained_block_hashes or ())
        gone = list(metadata.released_block_hashes or ())
        self.retained.update(new)
        self.retained.subtract(gone)
        if any(n < 0 for n in self.retained.values()):
            raise HarnessError("the scheduler released a hash it never retained")
        self.retained += Counter()
        self.seen["retained"] += len(new)
        self.seen["released"] += len(gone)

    def on_output(self, _outputs) -> None:
        missing = [h.hex() for h in self.retained if not self.cache.is_published(h)]
        if missing:
            raise HarnessError(f"retained blocks are not in the cache (evicted?): {missing}")
        self.seen["checks"] += 1


# ------------------------------------------------------------------ engine loop


@dataclass
class RollbackEvent:
    """One call of the scheduler's ``_handle_invalid_blocks`` (the worker reported invalid blocks)."""

    engine_step: int
    invalid_block_ids: set[int]
    skipped: set[str]  # running requests whose output of this step the scheduler dropped
    scheduled: dict[str, int]  # the step's num_scheduled_tokens
    changed: dict[str, tuple[int, int]]  # request -> (num_computed_tokens before, after)
    running: set[str]  # which of the watched requests were running (the rest were loading async)
    hashes_sent: dict[str, int]  # block hashes the aux-output connector had sent to the worker, per request


class SimEngine:
    """``EngineCore.step`` / ``step_with_batch_queue`` over the real scheduler and the simulated runner."""

    def __init__(self, setup: SchedulerSetup, connector, *, seed: int = 0, accept=None) -> None:
        self.setup = setup
        self.scheduler = setup.scheduler
        self.capturer = connector._capturer
        self.connector = connector
        self.runner = SimModelRunner(connector, setup.vllm_config, num_spec_tokens=setup.num_spec_tokens,
                                     async_scheduling=setup.async_scheduling, seed=seed, accept=accept,
                                     kv_worker=setup.kv_worker, block_size=setup.block_size)
        self.batch_queue: deque = deque()
        self.batch_queue_size = setup.vllm_config.max_concurrent_batches
        self.requests: dict[str, Request] = {}
        self.chunks: dict[str, list[np.ndarray]] = {}
        self.finished: dict[str, str] = {}
        self.finish_order: list[str] = []  # request ids in the order their finish reached the client
        self.aborted: set[str] = set()
        self.num_preemptions = Counter()
        self.engine_steps = 0  # step() calls that did something (schedule and/or consume an output)
        # KV load failures the scheduler handled (recompute policy), as observed around its
        # _handle_invalid_blocks; the runner follows the running requests it rolled back.
        self.rollbacks: list[RollbackEvent] = []
        self._new_rollbacks: list[RollbackEvent] = []
        if self.scheduler.connector is not None:
            self._observe_invalid_blocks()

    def _observe_invalid_blocks(self) -> None:
        """Record what vLLM's own ``_handle_invalid_blocks`` does (it still does all of it)."""
        scheduler = self.scheduler
        handle_invalid_blocks = scheduler._handle_invalid_blocks

        def observed(invalid_block_ids, num_scheduled_tokens):
            watched = list(scheduler.running) + [
                r for r in scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ]
            before = {r.request_id: (r.num_computed_tokens, r.status) for r in watched}
            sent = dict(scheduler.aux_output_connector._sent_hash_counts)
            skipped = handle_invalid_blocks(invalid_block_ids, num_scheduled_tokens)
            event = RollbackEvent(
                engine_step=self.engine_steps, invalid_block_ids=set(invalid_block_ids), skipped=set(skipped),
                scheduled=dict(num_scheduled_tokens),
                changed={
                    r.request_id: (before[r.request_id][0], r.num_computed_tokens)
                    for r in watched if r.num_computed_tokens != before[r.request_id][0]
                },
                running={r.request_id for r in watched if before[r.request_id][1] == RequestStatus.RUNNING},
                hashes_sent={r.request_id: sent.get(r.request_id, 0) for r in watched},
            )
            self.rollbacks.append(event)
            self._new_rollbacks.append(event)
            return skipped

        scheduler._handle_invalid_blocks = observed

    @property
    def stats(self) -> RunStats:
        return self.runner.stats

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.chunks[request.request_id] = []
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(request_id)

    def _collect(self, engine_core_outputs) -> None:
        for outputs in engine_core_outputs.values():
            for output in outputs.outputs:
                if output.routed_experts is not None:
                    self.chunks[output.request_id].append(np.asarray(output.routed_experts))
                if output.finish_reason is not None:
                    self.finished[output.request_id] = str(output.finish_reason)
                    self.finish_order.append(output.request_id)

    def _update(self, scheduler_output, model_output) -> None:
        self._collect(self.scheduler.update_from_output(scheduler_output, model_output))
        for request_id in (*scheduler_output.num_scheduled_tokens, *(scheduler_output.preempted_req_ids or ())):
            request = self.requests.get(request_id)
            if request is not None:
                self.num_preemptions[request_id] = request.num_preemptions
        events, self._new_rollbacks = self._new_rollbacks, []
        for event in events:
            rolled_back = [r for r in event.running if r in event.changed or r in event.skipped]
            if rolled_back and self.setup.async_scheduling:
                raise HarnessError(
                    f"KV load failure rolled back running requests {sorted(rolled_back)} under async scheduling: "
                    f"the simulated device does not model it (steps in flight ran on the dropped tokens)"
                )
            for request_id in rolled_back:
                self.runner.follow_rollback(self.scheduler.requests[request_id])

    def step(self) -> bool:
        """One engine-core step; False once there is nothing left to do."""
        if not self.setup.async_scheduling:
            if not self.scheduler.has_requests():
                return False
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self.engine_steps += 1
            self._update(so, handle.get_output())
            if so.total_num_scheduled_tokens > 0 and self.setup.num_spec_tokens > 0:  # EngineCore.post_step
                drafts = self.runner.take_draft_token_ids()
                if drafts is not None:
                    self.scheduler.update_draft_token_ids(drafts)
            return True
        self.engine_steps += 1
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self.batch_queue.appendleft((handle, so))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return True
        elif not self.batch_queue:
            self.engine_steps -= 1
            return False
        handle, so = self.batch_queue.pop()
        self._update(so, handle.get_output())
        return True

    def drain(self) -> None:
        """Consume every in-flight step (what the engine does before a prefix-cache reset)."""
        while self.batch_queue:
            handle, so = self.batch_queue.pop()
            self._update(so, handle.get_output())

    def reset_prefix_cache(self) -> None:
        self.drain()
        if not self.scheduler.reset_prefix_cache(reset_running_requests=True):
            raise HarnessError("prefix-cache reset failed")

    def run(self, max_steps: int = 2000, until=None) -> None:
        for _ in range(max_steps):
            if until is not None and until():
                return
            if not self.step():
                if until is None:
                    return
                raise HarnessError("engine went idle before the condition held")
        raise HarnessError(f"still running after {max_steps} steps")

    def run_until_finished(self, *request_ids: str, max_steps: int = 2000) -> None:
        self.run(max_steps, until=lambda: all(r in self.finished for r in request_ids))

    def flush(self) -> None:
        """Run to idle, then one more schedule so the last terminal events reach the worker."""
        self.run()
        self.drain()
        so = self.scheduler.schedule()
        self._update(so, self.runner.execute(so).get_output())

    # -- checks
    def assembled(self, request_id: str) -> np.ndarray:
        chunks = self.chunks[request_id]
        return np.concatenate(chunks) if chunks else np.empty((0, *ROW_SHAPE), dtype=np.uint8)

    def check_finished_request(self, request_id: str) -> None:
        """The client's rows (take_output chunks, concatenated) are exactly the oracle's."""
        if request_id not in self.finished:
            raise HarnessError(f"{request_id} did not finish")
        request = self.requests[request_id]
        tokens = list(request.all_token_ids)
        if tokens != self.runner.tokens[request_id][: len(tokens)]:
            raise HarnessError(f"{request_id}: scheduler tokens differ from the device's")
        start = min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens)
        want = expected_rows(tokens, start, len(tokens) - 1)
        got = self.assembled(request_id)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise HarnessError(
                f"{request_id}: client rows {got.shape} differ from the oracle's {want.shape} "
                f"(prompt {request.num_prompt_tokens}, {len(tokens)} tokens, start {start})"
            )

    def check_all_finished(self) -> int:
        done = [r for r in self.requests if r not in self.aborted]
        for request_id in done:
            self.check_finished_request(request_id)
        return len(done)

    def close(self) -> None:
        self.connector.close()
