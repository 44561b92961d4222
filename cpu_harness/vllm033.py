"""Drive vLLM 0.33's real scheduler side against a worker connector, without a model.

Real vLLM 0.33 pieces: ``VllmConfig`` (a DeepSeek-V3 MTP speculative config, so
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

Routing rows are a pure function of the token prefix: the row of position ``p`` is derived
from a chained hash of ``tokens[0..p]``. Rows computed for a rejected draft therefore
differ from the true row of that position, and rows of equal prefixes (prefix-cache hits)
are equal. Every row a connector returns is checked against that function, and every
request's rows as the client assembles them (``take_output`` chunks, concatenated) must be
exactly ``[routed_experts_prompt_start, num_tokens - 1)``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from math import prod
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM caches model-class inspection results; keep them out of the user's cache but
# reuse them across runs (the first run inspects the two architectures, ~15 s).
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "routed-experts-cache-vllm033"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm  # noqa: E402

if not vllm.__version__.startswith("0.33"):
    raise RuntimeError(f"the vLLM 0.33 harness needs vLLM 0.33.x, found {vllm.__version__}")

from vllm.config import (  # noqa: E402
    AuxOutputConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer  # noqa: E402
from vllm.distributed.aux_output_connector.store import BackgroundBlockObjectStore, BlockObjectStore  # noqa: E402
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from routed_experts_cache.connector import RoutedExpertsCache  # noqa: E402
from routed_experts_cache.connector.vllm_worker import CacheWorkerConnector, build_cache  # noqa: E402

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
                hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
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
) -> SchedulerSetup:
    """The real 0.33 scheduler, configured the way the engine core builds it.

    ``lookahead`` 1 is single-module MTP (eagle family, any ``num_spec_tokens``); L > 1 is
    multi-module MTP with ``num_spec_tokens == L``; 0 turns lookahead hashing off
    (``disable_lookahead_block_hashes``). vLLM derives ``num_hash_lookahead_tokens``
    itself; it is checked against ``lookahead`` here.
    """
    nextn = max(1, lookahead)
    if lookahead > 1 and num_spec_tokens != lookahead:
        # Multi-module MTP hashes num_speculative_tokens lookahead tokens.
        raise HarnessError("multi-module MTP lookahead L needs num_spec_tokens == L")
    model_config = ModelConfig(
        model=_model_dir(nextn), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len
    )
    speculative_config = SpeculativeConfig(
        method="mtp", num_speculative_tokens=num_spec_tokens, target_model_config=model_config,
        target_parallel_config=ParallelConfig(), disable_lookahead_block_hashes=lookahead == 0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=True, async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold, is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        speculative_config=speculative_config, device_config=DeviceConfig(device="cpu"),
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
    )
    if vllm_config.num_hash_lookahead_tokens != lookahead:
        raise HarnessError(
            f"vLLM derived num_hash_lookahead_tokens={vllm_config.num_hash_lookahead_tokens}, wanted {lookahead}"
        )
    if not vllm_config.use_v2_model_runner:
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
    # EngineCore.__init__: the request block hasher with the config's lookahead tokens.
    caching_hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(caching_hash_fn)
    block_hasher = get_request_block_hasher(hash_block_size, caching_hash_fn, vllm_config.num_hash_lookahead_tokens)
    return SchedulerSetup(
        scheduler, vllm_config, kv_cache_config, block_hasher, lookahead, num_spec_tokens, async_scheduling
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


def build_our_connector(setup: SchedulerSetup, capturer: SnapshotCapturer, *, backend: str | None = None,
                        num_pages: int | None = None) -> CacheWorkerConnector:
    """This project's connector, sized by its own ``build_cache`` unless a pool is forced."""
    if backend is None and num_pages is None:
        cache = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    else:
        if num_pages is None:
            num_pages = build_cache(setup.vllm_config, setup.kv_cache_config, capturer).num_pages
        cache = RoutedExpertsCache(num_pages, BLOCK_SIZE, ROW_SHAPE, dtype=torch.uint8, device="cpu",
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


# ------------------------------------------------------------------ simulated model runner


@dataclass
class _DeviceRequest:
    computed: int  # device view of num_computed_tokens (rejections applied)
    cpu_computed: int  # the scheduler's view, as the input batch carries it
    drafts: list[int] = field(default_factory=list)


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


class SimModelRunner:
    """Model Runner V2's behaviour around the aux-output hooks, on synthetic tokens and rows."""

    def __init__(self, connector, capturer: SnapshotCapturer, *, num_spec_tokens: int, async_scheduling: bool,
                 seed: int = 0, accept=None) -> None:
        self.connector = connector
        self.capturer = capturer
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.rng = np.random.default_rng(seed)
        # accept(request_id, rng) -> number of leading correct drafts proposed next step.
        self.accept = accept or (lambda request_id, rng: int(rng.integers(0, num_spec_tokens + 1)))
        self.tokens: dict[str, list[int]] = {}  # true tokens (what the device sampled); kept across preemption
        self.states: dict[str, list[bytes]] = {}
        self.device: dict[str, _DeviceRequest] = {}
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

    def check_rows(self, outputs) -> None:
        """Every row the connector returned equals the oracle's row of that position."""
        for request_id, output in (outputs or {}).items():
            rows = np.asarray(output.rows)
            if rows.dtype != np.uint8 or rows.shape[1:] != ROW_SHAPE:
                raise HarnessError(f"{request_id}: rows {rows.dtype} {rows.shape}")
            start, end = int(output.token_start), int(output.token_start) + rows.shape[0]
            states = self._states(request_id)
            if end > len(states):
                raise HarnessError(f"{request_id}: rows up to {end}, only {len(states)} tokens exist")
            want = np.stack([row_of(s) for s in states[start:end]]) if end > start else rows
            if not np.array_equal(rows, want):
                bad = [start + int(i) for i in np.nonzero((rows != want).reshape(len(rows), -1).any(1))[0]]
                raise HarnessError(f"{request_id}: rows [{start}, {end}) differ from the oracle at positions {bad}")
            self.stats.rows_checked += rows.shape[0]
            self.stats.outputs.setdefault(request_id, []).append((start, end))

    # -- the step
    def execute(self, scheduler_output) -> "_StepHandle":
        so = scheduler_output
        # MRV2 order: finish / free states, add new (and resumed), update cached, begin_step.
        for request_id in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.device.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            known = list(new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids)
            mine = self.tokens.setdefault(new.req_id, [])
            if mine and mine != known:
                raise HarnessError(f"{new.req_id}: scheduler resumes with {len(known)} tokens, device has {len(mine)}")
            self.tokens[new.req_id] = known
            self.states.pop(new.req_id, None)
            self.device[new.req_id] = _DeviceRequest(new.num_computed_tokens, new.num_computed_tokens)
            self.stats.prefix_hit_tokens += new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for request_id, cpu_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.device[request_id].cpu_computed = cpu_computed
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
        if so.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return _StepHandle(self, None, None)

        order = list(so.num_scheduled_tokens)
        rows, query_start_loc, cpu_starts, num_sampled, num_rejected, sampled = [], [0], [], [], [], []
        self.last_drafts = {}
        for request_id in order:
            dev, n = self.device[request_id], so.num_scheduled_tokens[request_id]
            real, cpu = dev.computed, dev.cpu_computed
            if real > cpu or (real != cpu and not self.async_scheduling):
                raise HarnessError(f"{request_id}: device computed {real}, scheduler says {cpu}")
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
            for token in fed:
                state = advance(state, token)
                rows.append(row_of(state))
            query_start_loc.append(query_start_loc[-1] + n)
            cpu_starts.append(cpu)
            self.stats.spans.setdefault(request_id, []).append((real, real + n))
            if num_drafts < 0:  # a prefill chunk short of the end: nothing sampled
                self.stats.chunked_prefill_steps += 1
                dev.computed = real + n
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
            dev.computed = real + n - rejected
            dev.drafts = self._propose(request_id)
            self.last_drafts[request_id] = list(dev.drafts)
            num_sampled.append(len(new_tokens))
            num_rejected.append(rejected)
            sampled.append(new_tokens)

        self.capturer.next_snapshot = torch.from_numpy(np.stack(rows))
        input_batch = SimpleNamespace(
            req_ids=order,
            query_start_loc_np=np.array(query_start_loc, dtype=np.int32),
            num_computed_tokens_np=np.array(cpu_starts, dtype=np.int32),
        )
        pending = self.connector.prepare_output(input_batch)
        if pending is not None:
            pending.enqueue_cpu_copy(np.array(num_sampled, dtype=np.int32), np.array(num_rejected, dtype=np.int32))
        output = ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled
        )
        return _StepHandle(self, pending, output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self.last_drafts:
            return None
        req_ids = list(self.last_drafts)
        return DraftTokenIds(req_ids, [list(self.last_drafts[r]) for r in req_ids])


class _StepHandle:
    def __init__(self, runner: SimModelRunner, pending, output) -> None:
        self.runner, self.pending, self.output = runner, pending, output

    def get_output(self) -> ModelRunnerOutput:
        """The output thread: ``process_output`` after the copy, then the row checks."""
        if self.output is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.pending is not None:
            aux = self.pending.process_output()
            self.runner.check_rows(aux)
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


class SimEngine:
    """``EngineCore.step`` / ``step_with_batch_queue`` over the real scheduler and the simulated runner."""

    def __init__(self, setup: SchedulerSetup, connector, *, seed: int = 0, accept=None) -> None:
        self.setup = setup
        self.scheduler = setup.scheduler
        self.capturer = connector._capturer
        self.connector = connector
        self.runner = SimModelRunner(connector, self.capturer, num_spec_tokens=setup.num_spec_tokens,
                                     async_scheduling=setup.async_scheduling, seed=seed, accept=accept)
        self.batch_queue: deque = deque()
        self.batch_queue_size = setup.vllm_config.max_concurrent_batches
        self.requests: dict[str, Request] = {}
        self.chunks: dict[str, list[np.ndarray]] = {}
        self.finished: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.num_preemptions = Counter()

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

    def _update(self, scheduler_output, model_output) -> None:
        self._collect(self.scheduler.update_from_output(scheduler_output, model_output))
        for request_id, request in self.requests.items():
            self.num_preemptions[request_id] = request.num_preemptions

    def step(self) -> bool:
        """One engine-core step; False once there is nothing left to do."""
        if not self.setup.async_scheduling:
            if not self.scheduler.has_requests():
                return False
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self._update(so, handle.get_output())
            if so.total_num_scheduled_tokens > 0:  # EngineCore.post_step
                drafts = self.runner.take_draft_token_ids()
                if drafts is not None:
                    self.scheduler.update_draft_token_ids(drafts)
            return True
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self.batch_queue.appendleft((handle, so))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return True
        elif not self.batch_queue:
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
