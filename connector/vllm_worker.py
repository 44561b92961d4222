"""vLLM worker-side AuxOutput connector backed by the device-resident cache.

Drop-in for ``vllm.distributed.aux_output_connector.worker.AuxOutputWorkerConnector``
(vLLM 0.32 and 0.33): the same hooks (``begin_step``, ``prepare_output`` ->
``enqueue_cpu_copy`` / ``process_output``, ``close``) and the same output contract
(``{request_id: AuxRequestOutput(token_start, rows)}``, rows an owned numpy array).

Per output step: the step's snapshot stays on the device; its accepted rows enter the pool
with one scatter; every emitted interval (this step's rows, or earlier rows after a prefix
hit, chunked prefill or resume) comes back with one gather and one device-to-host copy.
Pending blocks (full, hash not known yet, as under 0.33's lookahead hashing) are ordinary
blocks of the request's block map, so a read across them never fails.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata, AuxRequestOutput
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

from .cache import RoutedExpertsCache
from .errors import RoutedExpertsCacheError
from .side_stream import SideStream

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch


logger = logging.getLogger("vllm.routed_experts_cache")
BACKEND_ENV = "ROUTED_EXPERTS_CACHE_BACKEND"


class ConnectorStateError(RoutedExpertsCacheError):
    """vLLM metadata or step outputs contradict the connector's request state."""


@dataclass
class _RequestState:
    emit_cursor: int  # first row the client has not received yet
    capture_cursor: int | None = None  # next row to capture (None before the first capture)
    scheduled_cursor: int = 0  # end of what the scheduler last ran, drafts included
    pending_outputs: int = 0  # step outputs in flight that cover this request
    finished: bool = False  # terminal event seen; teardown waits for pending_outputs == 0


@dataclass(eq=False)  # compared by identity: the connector keeps and removes these in a list
class PendingCacheOutput:
    """One step's snapshot, kept on the device until the step's output is processed."""

    connector: CacheWorkerConnector
    request_ids: list[str]
    token_starts: np.ndarray
    query_start_loc: np.ndarray
    snapshot: torch.Tensor
    emit_starts: dict[str, int]  # the step metadata's emit start per request
    snapshot_ready: torch.cuda.Event | None = None  # recorded on the model's stream (CUDA only)
    num_sampled: np.ndarray | None = None
    num_rejected: np.ndarray | None = None

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Keep the acceptance counts (filled by vLLM's async copy); rows stay on the device."""
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected

    def process_output(self) -> dict[str, AuxRequestOutput]:
        return self.connector.process_output(self)


def working_set_pages(page_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_concurrent_batches: int) -> int:
    """Pages for tails and pending blocks, beyond the pages that mirror the KV cache.

    vLLM's own buffer bound: every in-flight step can complete ``ceil(T / page) + S`` blocks
    before their hashes arrive, and each running request has one tail.
    """
    step_blocks = math.ceil(max_num_batched_tokens / page_size) + max_num_seqs
    return max_concurrent_batches * step_blocks + max_num_seqs


class CacheWorkerConnector:
    """Capture routing rows into the device cache and return each request's rows."""

    def __init__(self, *, capturer, cache: RoutedExpertsCache | None, max_concurrent_batches: int) -> None:
        """``capturer`` provides ``snapshot_routing_data(num_tokens)`` (vLLM's capturer);
        ``cache`` is None on ranks that keep no data (all but the first TP rank)."""
        self._capturer = capturer
        self._cache = cache
        self._requests: dict[str, _RequestState] = {}
        self._generation = 0
        self._step_metadata: AuxOutputConnectorMetadata | None = None
        self._pending_outputs: list[PendingCacheOutput] = []
        self._max_concurrent_batches = max_concurrent_batches
        self._lock = Lock()
        self._side_stream = SideStream(cache.device) if cache is not None and cache.device.type == "cuda" else None
        self._reattachments = 0
        self._rollbacks = 0

    @property
    def cache(self) -> RoutedExpertsCache | None:
        return self._cache

    def stats(self) -> dict[str, int]:
        """The cache's page counts and counters, plus the requests re-attached after rejected
        drafts (async scheduling) and rolled back after failed KV loads."""
        with self._lock:
            cache_stats = self._cache.stats() if self._cache is not None else {}
            return {
                **cache_stats, "reattachments": self._reattachments, "rollbacks": self._rollbacks,
                "requests_tracked": len(self._requests),
            }

    # ---------------------------------------------------------- model thread

    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Apply one scheduler step's requests, block hashes, pins and terminal events.

        The whole metadata is checked first: a refused step changes nothing.
        """
        if self._cache is None or metadata is None:
            self._step_metadata = metadata
            return
        with self._lock:
            new_generation = self._check_metadata(metadata)
            hashes = {request_id: list(packed) for request_id, packed in metadata.block_hashes.items()}
            self._step_metadata = metadata
            if new_generation:
                # vLLM resets the prefix cache only once all output is consumed; the pins of
                # this metadata belong to the old generation and are dropped with it.
                self._cache.reset()
                self._requests.clear()
                self._generation = metadata.generation
            else:
                self._apply_pins(metadata)
            requests = self._requests
            for request_id, emit_start in metadata.requests.items():
                if request_id not in requests:
                    requests[request_id] = _RequestState(emit_cursor=emit_start)
            for request_id, block_hashes in hashes.items():
                self._cache.add_block_hashes(request_id, block_hashes)
            for request_id in metadata.finished_requests:
                state = self._requests.get(request_id)
                if state is None:
                    continue
                state.finished = True
                if state.pending_outputs == 0:
                    self._teardown(request_id)

    def _check_metadata(self, metadata: AuxOutputConnectorMetadata) -> bool:
        """Raise if the metadata contradicts the connector's state; True on a new generation."""
        both = metadata.requests.keys() & set(metadata.finished_requests)
        if both:
            raise ConnectorStateError(f"requests {sorted(both)} are scheduled and finished in one step")
        if metadata.generation < self._generation:
            raise ConnectorStateError(
                f"metadata generation went backwards: {metadata.generation} < {self._generation}"
            )
        new_generation = metadata.generation > self._generation
        if new_generation and self._pending_outputs:
            raise ConnectorStateError(
                f"generation changed to {metadata.generation} with {len(self._pending_outputs)} step "
                f"outputs in flight"
            )
        known = {} if new_generation else self._requests
        for request_id, emit_start in metadata.requests.items():
            state = known.get(request_id)
            if state is None:
                continue
            if state.finished:
                raise ConnectorStateError(
                    f"request {request_id!r} was scheduled again before its teardown completed"
                )
            if state.pending_outputs == 0 and emit_start > state.emit_cursor:
                raise ConnectorStateError(
                    f"request {request_id!r}: scheduler emit start {emit_start} is ahead of the rows "
                    f"delivered so far ({state.emit_cursor})"
                )
        for request_id in metadata.block_hashes:
            if request_id not in known and request_id not in metadata.requests:
                raise ConnectorStateError(
                    f"block hashes for request {request_id!r}, which is not running (never scheduled, "
                    f"or finished); running: {len(known)} requests"
                )
        return new_generation

    def _apply_pins(self, metadata: AuxOutputConnectorMetadata) -> None:
        """0.33's KV-aligned pins (absent in 0.32): retain first, then release, atomically."""
        retained = list(getattr(metadata, "retained_block_hashes", None) or ())
        released = list(getattr(metadata, "released_block_hashes", None) or ())
        self._cache.retain(retained)
        try:
            self._cache.release(released)
        except RoutedExpertsCacheError:
            self._cache.release(retained)
            raise

    def prepare_output(self, input_batch: InputBatch) -> PendingCacheOutput | None:
        """Keep this step's routing snapshot (device) for ``process_output``."""
        if self._cache is None or self._step_metadata is None:
            return None
        request_ids = list(input_batch.req_ids)
        query_start_loc = np.array(input_batch.query_start_loc_np[: len(request_ids) + 1])
        pending = PendingCacheOutput(
            connector=self,
            request_ids=request_ids,
            token_starts=np.array(input_batch.num_computed_tokens_np[: len(request_ids)]),
            query_start_loc=query_start_loc,
            snapshot=self._capturer.snapshot_routing_data(int(query_start_loc[-1])),
            emit_starts=self._step_metadata.requests,
        )
        if self._side_stream is not None:
            pending.snapshot_ready = self._side_stream.mark_ready()
        with self._lock:
            if len(self._pending_outputs) >= self._max_concurrent_batches:
                raise ConnectorStateError(
                    f"{len(self._pending_outputs)} step outputs are in flight, more than "
                    f"max_concurrent_batches={self._max_concurrent_batches}: outputs are not consumed"
                )
            unknown = [r for r in request_ids if r not in self._requests]
            if unknown:
                raise ConnectorStateError(f"step covers requests {unknown} that were never scheduled")
            self._pending_outputs.append(pending)
            for request_id in request_ids:
                self._requests[request_id].pending_outputs += 1
        return pending

    # --------------------------------------------------------- output thread

    def process_output(self, pending: PendingCacheOutput) -> dict[str, AuxRequestOutput]:
        """Capture one step's accepted rows and return each request's new rows.

        Steps are processed in order. A request whose terminal event arrived while this
        step was in flight is torn down here.
        """
        with self._lock:
            try:
                if self._side_stream is None:
                    return self._commit(pending)
                return self._side_stream.run(lambda: self._commit(pending), pending.snapshot, pending.snapshot_ready)
            finally:
                if pending in self._pending_outputs:
                    self._pending_outputs.remove(pending)
                for request_id in pending.request_ids:
                    state = self._requests.get(request_id)
                    if state is None:
                        continue
                    state.pending_outputs -= 1
                    if state.finished and state.pending_outputs == 0:
                        self._teardown(request_id)

    def _commit(self, pending: PendingCacheOutput) -> dict[str, AuxRequestOutput]:
        if pending.num_sampled is None or pending.num_rejected is None:
            raise ConnectorStateError("process_output before enqueue_cpu_copy: acceptance counts missing")
        spans, emits, updates, rewinds, reattached = [], [], [], [], 0
        for request_id, token_start, start, end, sampled, rejected in zip(
            pending.request_ids,
            pending.token_starts.tolist(),
            pending.query_start_loc[:-1].tolist(),
            pending.query_start_loc[1:].tolist(),
            pending.num_sampled.tolist(),
            pending.num_rejected.tolist(),
            strict=True,
        ):
            state = self._requests[request_id]
            num_rows = end - start
            if num_rows <= 0 or not 0 <= rejected <= num_rows:
                raise ConnectorStateError(
                    f"request {request_id!r}: invalid step rows ({num_rows} scheduled, {rejected} rejected)"
                )
            capture_start, emit_start = token_start, state.emit_cursor
            cursor = state.capture_cursor if state.capture_cursor is not None else capture_start
            if capture_start < cursor:
                # vLLM rolled the request back (KV blocks failed to load; recompute policy) and
                # dropped that step's output: rows from there on came from the failed KV.
                # Recapture them, and emit again from where the scheduler now starts.
                rewinds.append((request_id, capture_start))
                emit_start = min(emit_start, pending.emit_starts.get(request_id, emit_start))
            elif capture_start > cursor:
                # Async scheduling assumed every draft was accepted; re-attach at the cursor.
                if cursor >= state.scheduled_cursor:
                    raise ConnectorStateError(
                        f"request {request_id!r}: rows [{cursor}, {capture_start}) were never scheduled"
                    )
                capture_start = cursor
                reattached += 1
            token_end = capture_start + num_rows - rejected
            spans.append((request_id, capture_start, start, num_rows - rejected))
            if sampled > 0 and emit_start <= token_end:
                emits.append((request_id, emit_start, token_end))
            updates.append((state, token_end, token_start + num_rows, emit_start))
        for request_id, position in rewinds:
            self._cache.rewind(request_id, position)
        self._rollbacks += len(rewinds)
        self._cache.capture_from(pending.snapshot, spans)
        for state, token_end, scheduled_end, emit_start in updates:
            state.capture_cursor = token_end
            state.scheduled_cursor = scheduled_end
            state.emit_cursor = emit_start  # lower only after a roll-back
        self._reattachments += reattached
        packed, offsets = self._cache.read_packed(emits)
        host_rows = packed.cpu().numpy()
        for request_id, _, token_end in emits:
            self._requests[request_id].emit_cursor = token_end
        return {
            request_id: AuxRequestOutput(emit_start, host_rows[offsets[i] : offsets[i + 1]])
            for i, (request_id, emit_start, _) in enumerate(emits)
        }

    def _teardown(self, request_id: str) -> None:
        del self._requests[request_id]
        self._cache.finish(request_id)

    def close(self) -> None:
        with self._lock:
            self._pending_outputs.clear()
            self._requests.clear()
            self._cache = None


# vLLM 0.33's scheduler connector sends retained / released block hashes (pins).
_SCHEDULER_RETAINS_PINS = "retained_block_hashes" in getattr(AuxOutputConnectorMetadata, "__dataclass_fields__", {})


def build_cache(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, capturer) -> RoutedExpertsCache:
    """The pool for this engine: every KV-cached block's rows plus the working set.

    With vLLM 0.33's pins, the scheduler keeps up to its KV capacity of finished blocks
    retained whether or not their KV is still cached, on top of the blocks live requests
    hold: the KV-sized part is counted once for each.
    ``aux_output_config.max_bytes``, when set, replaces the KV-sized part. The copy backend
    is ``ROUTED_EXPERTS_CACHE_BACKEND`` (auto / triton / torch; auto = Triton on CUDA).
    """
    scheduler_config = vllm_config.scheduler_config
    scheduler_block_size, page_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    row_shape = tuple(capturer.shape_per_token)
    page_nbytes = page_size * math.prod(row_shape) * capturer.output_dtype.itemsize
    max_bytes = vllm_config.aux_output_config.max_bytes
    if max_bytes is None:
        kv_pages = kv_cache_config.num_blocks * (scheduler_block_size // page_size)
        # AuxOutputSchedulerConnector._capacity: num_blocks, doubled with a KV connector.
        retained_pages = kv_pages * (2 if vllm_config.kv_transfer_config is not None else 1)
        shared_pages = kv_pages + (retained_pages if _SCHEDULER_RETAINS_PINS else 0)
    else:
        shared_pages = max_bytes // page_nbytes
    working_set = working_set_pages(
        page_size, scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
        vllm_config.max_concurrent_batches,
    )
    return RoutedExpertsCache(
        shared_pages + working_set, page_size, row_shape, dtype=capturer.output_dtype,
        device=capturer.device_buffer.device, backend=os.environ.get(BACKEND_ENV, "auto"),
    )


def get_aux_output_connector(
    model: torch.nn.Module, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> CacheWorkerConnector:
    """Factory with the signature of vLLM's ``get_aux_output_connector``."""
    capturer = RoutedExpertsCapturer(
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens, vllm_config=vllm_config
    )
    bind_routed_experts_capturer(model, capturer)
    # Every TP rank captures (the capture may all-gather); only the first keeps data.
    cache = build_cache(vllm_config, kv_cache_config, capturer) if get_tp_group().is_first_rank else None
    if cache is not None:
        logger.info(
            "routed-experts-cache: active; routed experts are served from a %s pool of %d pages x %d rows "
            "(%.1f MiB, rows %s %s, backend %s)",
            cache.device, cache.num_pages, cache.page_size, cache.pages.nbytes / 2**20, cache.row_shape,
            cache.dtype, cache.backend,
        )
    return CacheWorkerConnector(
        capturer=capturer, cache=cache, max_concurrent_batches=vllm_config.max_concurrent_batches
    )
