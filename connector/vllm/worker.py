"""vLLM worker-side AuxOutput connector backed by the device-resident cache.

Drop-in for ``vllm.distributed.aux_output_connector.worker.AuxOutputWorkerConnector``
(vLLM 0.32, 0.33 and 0.34): the same hooks (``initialize_output_storage`` on 0.34,
``begin_step``, ``prepare_output`` -> ``enqueue_cpu_copy`` / ``process_output``, ``close``) and
the same output contract (``{request_id: AuxRequestOutput(token_start, rows)}``, rows an owned
numpy array). What differs between those releases is in ``versions``.

Per output step: the step's accepted rows enter the pool with one scatter, and the client
gets them from the snapshot with one device-to-host copy (the copy vLLM's own connector
makes); rows it has not received from before (a prefix hit's, rows recomputed after a
roll-back) come from the pool with one gather.
Pending blocks (full, hash not known yet, as under 0.33's lookahead hashing) are ordinary
blocks of the request's block map, so a read across them never fails.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
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

from .. import batch_size
from ..batch_size import as_plain_list, smallest, total
from ..cache import RoutedExpertsCache
from ..checks import check_request_ids
from ...errors import RoutedExpertsCacheError
from .kv_tiers import retained_blocks
from .side_stream import SideStream
from .step_hashes import StepHashes
from .versions import installed_contract

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch


logger = logging.getLogger("vllm.routed_experts_cache")
BACKEND_ENV = "ROUTED_EXPERTS_CACHE_BACKEND"
LOG_INTERVAL_ENV = "ROUTED_EXPERTS_CACHE_LOG_INTERVAL"  # seconds between stats lines; 0 turns them off
DEFAULT_LOG_INTERVAL = 10.0  # vLLM's own stats interval (VLLM_LOG_STATS_INTERVAL)


class ConnectorStateError(RoutedExpertsCacheError):
    """vLLM metadata or step outputs contradict the connector's request state."""


class TrackedRequest:
    """A tracked request: its cache slot, and while steps are small its state (in the slot
    arrays of the same names while they are large)."""

    __slots__ = ("slot", "emit_cursor", "capture_cursor", "scheduled_cursor", "pending", "finished")

    def __init__(self, slot: int, emit_cursor: int) -> None:
        self.slot = slot
        self.emit_cursor = emit_cursor  # first row the client has not received
        self.capture_cursor = -1  # next row to capture; -1 before the first
        self.scheduled_cursor = 0  # end of what last ran, drafts included
        self.pending = 0  # step outputs in flight covering the request
        self.finished = False  # terminal event seen; teardown once pending is 0


STATE_FIELDS = ("emit_cursor", "capture_cursor", "scheduled_cursor", "pending", "finished")


@dataclass(eq=False)  # compared by identity: the connector keeps and removes these in a list
class PendingCacheOutput:
    """One step's snapshot, kept on the device until the step's output is processed."""

    connector: CacheWorkerConnector
    request_ids: list[str]
    slots: np.ndarray | list[int]  # the requests' cache slots (index the connector's state arrays)
    token_starts: np.ndarray | list[int]  # lists where the step began small (its plain passes)
    query_start_loc: np.ndarray | list[int]
    snapshot: torch.Tensor
    emit_starts: dict[str, int]  # the step metadata's emit start per request
    tracked: list[TrackedRequest] | None = None  # the requests' state objects (small steps)
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
    """Capture routing rows into the device cache and return each request's rows.

    Each tracked request's state (cursors, outputs in flight, finished) lives in one of two
    places, chosen at each step's start by how many requests are tracked
    (``batch_size.stays_small``): in its ``TrackedRequest`` while they are few, where one plain
    pass over a step's requests costs less than a numpy call per field; in arrays indexed by
    the request's cache slot while they are many, so that a step is a fixed number of numpy
    operations over vLLM's batch arrays. A switch moves every tracked request's state across,
    once. The rare steps (roll-backs, invalid counts) take the array path in either mode.
    """

    def __init__(
        self, *, capturer, cache: RoutedExpertsCache | None, max_concurrent_batches: int,
        stats_log_interval: float = 0.0, vllm_config: VllmConfig | None = None,
    ) -> None:
        """``capturer`` provides ``snapshot_routing_data(num_tokens)`` (vLLM's capturer);
        ``cache`` is None on ranks that keep no data (all but the first TP rank);
        ``stats_log_interval``: seconds between stats log lines (0: none).

        With ``vllm_config`` (and ``cache=None``) the storage comes later, from
        ``initialize_output_storage`` (vLLM 0.34's second set-up step); until then the
        connector accepts no step that carries routed-experts metadata.
        """
        self._capturer = capturer
        self._cache = cache
        self._vllm_config = vllm_config
        self._storage_ready = vllm_config is None
        self._generation = 0
        self._step_metadata: AuxOutputConnectorMetadata | None = None
        self._pending_outputs: list[PendingCacheOutput] = []
        self._max_concurrent_batches = max_concurrent_batches
        self._lock = Lock()
        self._side_stream = SideStream(cache.device) if cache is not None and cache.device.type == "cuda" else None
        self._reattachments = 0
        self._rollbacks = 0
        self._returned_rows = 0  # rows handed to vLLM: this step's from the snapshot, earlier ones from the pool
        self._stats_log_interval = stats_log_interval
        self._stats_logged_at = time.monotonic()
        self._stats_last: dict[str, int] = {}
        self._clear()

    def _clear(self) -> None:
        # The requests this connector tracks -> cache slot (the slot is also the object's: this
        # dict spares a large step's slot lookup a Python pass over the objects).
        self._slot_of: dict[str, int] = {}
        self._tracked: dict[str, TrackedRequest] = {}  # the same requests -> their state objects
        self._small = True  # state in the TrackedRequest objects, not in the slot arrays below
        self._emit_cursor = np.zeros(0, dtype=np.int64)
        self._capture_cursor = np.zeros(0, dtype=np.int64)
        self._scheduled_cursor = np.zeros(0, dtype=np.int64)
        self._pending = np.zeros(0, dtype=np.int64)
        self._finished = np.zeros(0, dtype=bool)
        self._awaiting_teardown: set[str] = set()  # finished, with step outputs still in flight
        # Pool updates of the steps begun (pins, block hashes, imports, teardowns), applied in
        # order before the pool is next used: off the model thread, as vLLM's writer thread.
        self._deferred: list[tuple] = []
        self._deferred_teardowns: set[str] = set()  # requests the pool still holds

    def _track(self, request_ids: list[str], emit_starts: list[int]) -> None:
        """Start tracking new requests: take their cache slots and set up their state."""
        slot_list = self._cache.slots_step(request_ids)
        if max(slot_list, default=-1) >= len(self._pending):
            grow = max(max(slot_list) + 1, 2 * len(self._pending), 16) - len(self._pending)
            for field in STATE_FIELDS:
                array = getattr(self, "_" + field)
                setattr(self, "_" + field, np.concatenate([array, np.zeros(grow, dtype=array.dtype)]))
        states = list(map(TrackedRequest, slot_list, emit_starts))
        self._slot_of.update(zip(request_ids, slot_list))
        self._tracked.update(zip(request_ids, states))
        if not self._small:
            self._store_in_arrays(states)

    def _untrack(self, request_ids: list) -> None:
        for request_id in request_ids:
            del self._slot_of[request_id]
            del self._tracked[request_id]

    def _use_small_steps(self, small: bool) -> None:
        """Move every tracked request's state into its object (``small``) or into the slot
        arrays, where it is not there already: O(requests tracked), at a switch only."""
        if small == self._small:
            return
        states = list(self._tracked.values())
        if small:
            slots = np.fromiter(map(attrgetter("slot"), states), dtype=np.int64, count=len(states))
            for field in STATE_FIELDS:
                list(map(setattr, states, repeat(field), getattr(self, "_" + field)[slots].tolist()))
        else:
            self._store_in_arrays(states)
        self._small = small

    def _store_in_arrays(self, states: list[TrackedRequest]) -> None:
        """Write these requests' state from their objects into the slot arrays."""
        slots = np.fromiter(map(attrgetter("slot"), states), dtype=np.int64, count=len(states))
        for field in STATE_FIELDS:
            array = getattr(self, "_" + field)
            array[slots] = np.fromiter(map(attrgetter(field), states), dtype=array.dtype, count=len(states))

    def _slots(self, request_ids) -> np.ndarray:
        """Slots of tracked requests; -1 for the others."""
        return np.fromiter(map(self._slot_of.get, request_ids, repeat(-1)), dtype=np.int64, count=len(request_ids))

    @property
    def cache(self) -> RoutedExpertsCache | None:
        """The pool, with every step's updates applied."""
        if self._deferred:
            with self._lock:
                self._apply_deferred()
        return self._cache

    def initialize_output_storage(self, kv_cache_config: KVCacheConfig) -> None:
        """vLLM 0.34's second set-up step: create the pool, now that the KV layout is known.

        Only the first tensor-parallel rank keeps a pool (as in vLLM); a second call is refused.
        """
        with self._lock:
            if self._storage_ready:
                pool = "no pool" if self._cache is None else f"a pool of {self._cache.num_pages} pages"
                raise ConnectorStateError(
                    f"initialize_output_storage called again: this worker connector's output storage is "
                    f"already initialised ({pool}); vLLM initialises it once per worker"
                )
            if self._vllm_config is None:
                raise ConnectorStateError("initialize_output_storage needs the connector built with its vllm_config")
            self._cache = pool_for_this_rank(self._vllm_config, kv_cache_config, self._capturer)
            if self._cache is not None and self._cache.device.type == "cuda":
                self._side_stream = SideStream(self._cache.device)
            self._storage_ready = True

    def stats(self) -> dict[str, int]:
        """The cache's page counts and counters, plus the requests re-attached after rejected
        drafts (async scheduling) and rolled back after failed KV loads, and the rows returned
        (``read_rows`` of those came from the pool, the rest from the step snapshots)."""
        with self._lock:
            self._apply_deferred()
            cache_stats = self._cache.stats() if self._cache is not None else {}
            return {
                **cache_stats, "reattachments": self._reattachments, "rollbacks": self._rollbacks,
                "returned_rows": self._returned_rows, "requests_tracked": len(self._slot_of),
            }

    # ---------------------------------------------------------- model thread

    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Take one scheduler step's requests, block hashes, pins and terminal events.

        The whole metadata is checked first: a refused step changes nothing. New requests
        get their slots and finished ones leave the connector's state here; the pool updates
        (pins, block hashes, imported rows, finished requests' pages) are deferred to the
        next use of the pool, normally the next ``process_output`` on the output thread,
        which applies them in order before its own step: every pool operation happens in the
        order it would have here, and the model thread does not wait for them.
        """
        if not self._storage_ready and metadata is not None:
            raise ConnectorStateError(
                f"a scheduler step with routed-experts metadata ({len(metadata.requests)} requests) arrived "
                f"before initialize_output_storage: the connector has no storage yet"
            )
        if self._cache is None or metadata is None:
            self._step_metadata = metadata
            return
        with self._lock:
            request_ids = list(metadata.requests)
            emit_starts = np.fromiter(metadata.requests.values(), dtype=np.int64, count=len(request_ids))
            new_generation, new = self._check_metadata(metadata, request_ids, emit_starts)
            new_ids = [request_ids[i] for i in new]
            check_request_ids(new_ids)  # the cache's slots_step does not check them
            hashes = StepHashes(metadata)
            self._step_metadata = metadata
            if new_generation:
                # vLLM resets the prefix cache only once all output is consumed; the pins of
                # this metadata and the deferred updates belong to the old generation and are
                # dropped with it.
                self._cache.reset()
                self._clear()
                self._generation = metadata.generation
                hashes.drop_pins()
            elif hashes.released:
                self._cache.check_pin_step(hashes.retained, hashes.released, self._deferred_retains())  # refused here
            if self._deferred and not self._pending_outputs:
                self._apply_deferred()  # no process_output is coming to apply them
            self._use_small_steps(batch_size.stays_small(len(self._slot_of) + len(new_ids), self._small))
            if new_ids:
                if self._deferred_teardowns and not self._deferred_teardowns.isdisjoint(new_ids):
                    self._apply_deferred()  # the pool still holds an earlier request of that id
                emit_list = emit_starts.tolist()
                self._track(new_ids, [emit_list[i] for i in new])
            teardowns = []
            if metadata.finished_requests:
                teardowns = self._finish(list(dict.fromkeys(filter(self._slot_of.__contains__, metadata.finished_requests))))
            imports = getattr(metadata, "imported_rows", None)
            if hashes or imports or teardowns:
                self._deferred.append((hashes, imports, teardowns))
                self._deferred_teardowns.update(teardowns)

    def _deferred_retains(self) -> Counter:
        """Net retains (retains less releases) of the deferred pin steps."""
        net = Counter()
        for hashes, *_ in self._deferred:
            net.update(hashes.retained)
            net.subtract(hashes.released)
        return net

    def _apply_deferred(self) -> None:
        """Apply the deferred pool updates, step by step in the order the steps began (each
        step's pins, block hashes, imported rows, then its finished requests)."""
        deferred, self._deferred = self._deferred, []
        try:
            for hashes, imports, teardowns in deferred:
                retained, released = hashes.retained, hashes.released
                if retained or released:
                    self._cache.pin_step(retained, released)
                if hashes.request_ids:
                    self._cache.add_block_hashes_step(hashes.request_ids, hashes.hash_lists)
                if imports:
                    self._import_rows(imports, dict(zip(hashes.request_ids, hashes.hash_lists)))
                if teardowns:
                    self._cache.finish_step(teardowns)
        finally:
            self._deferred_teardowns.clear()

    def _finish(self, request_ids: list) -> list:
        """Terminal events: tear a request down now, or once its outputs in flight are processed.
        Returns the requests torn down now, whose pages the pool frees with the step's updates."""
        if not request_ids:
            return []
        if self._small:
            torn_down, awaiting, tracked = [], self._awaiting_teardown, self._tracked
            for request_id in request_ids:
                state = tracked[request_id]
                state.finished = True
                if state.pending:
                    awaiting.add(request_id)
                else:
                    torn_down.append(request_id)
        else:
            slots = self._slots(request_ids)
            self._finished[slots] = True
            idle = self._pending[slots] == 0
            torn_down = [request_ids[i] for i in idle.nonzero()[0].tolist()]
            self._awaiting_teardown.update(request_ids[i] for i in (~idle).nonzero()[0].tolist())
        self._untrack(torn_down)
        return torn_down

    def _import_rows(self, imports: dict, hashes_of: dict) -> None:
        """Publish rows a prefill instance computed (``row_transfer``) under the requests' own
        block hashes, after the requests pinned them. An import that does not fit this pool
        (row shape, dtype, ids) is not used: the rows it would cover stay unavailable, and a
        read of them fails closed."""
        size = self._cache.page_size
        for request_id, rows in imports.items():
            hashes = hashes_of.get(request_id, [])
            num_blocks = min(len(rows) // size, len(hashes))
            try:
                self._cache.import_blocks(hashes[:num_blocks], torch.from_numpy(np.ascontiguousarray(rows[: num_blocks * size])))
            except RoutedExpertsCacheError as error:
                logger.warning("routed-experts-cache: request %s: imported rows not used: %s", request_id, error)

    def _check_metadata(
        self, metadata: AuxOutputConnectorMetadata, request_ids: list, emit_starts: np.ndarray
    ) -> tuple[bool, list[int]]:
        """Raise if the metadata contradicts the connector's state; return whether it starts a
        new generation, and the indices of the scheduled requests not tracked yet."""
        if not metadata.requests.keys().isdisjoint(metadata.finished_requests):
            both = metadata.requests.keys() & set(metadata.finished_requests)
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
        known = {} if new_generation else self._slot_of
        if not known:
            new = list(range(len(request_ids)))
        else:
            if self._awaiting_teardown and any(map(metadata.requests.__contains__, self._awaiting_teardown)):
                again = next(r for r in request_ids if r in self._awaiting_teardown)
                raise ConnectorStateError(f"request {again!r} was scheduled again before its teardown completed")
            new, ahead = self._untracked_and_ahead(request_ids, emit_starts)
            if ahead is not None:
                i, delivered = ahead
                raise ConnectorStateError(
                    f"request {request_ids[i]!r}: scheduler emit start {emit_starts[i]} is ahead of the rows "
                    f"delivered so far ({delivered})"
                )
        stray = [r for r in metadata.block_hashes if r not in known and r not in metadata.requests]
        if stray:
            request_id = stray[0]  # the first, as listed
            raise ConnectorStateError(
                f"block hashes for request {request_id!r}, which is not running (never scheduled, "
                f"or finished); running: {len(known)} requests"
            )
        return new_generation, new

    def _untracked_and_ahead(self, request_ids: list, emit_starts: np.ndarray) -> tuple[list[int], tuple | None]:
        """The indices of untracked requests, and the first tracked one whose scheduler emit
        start is ahead of the rows delivered (index, rows delivered), or None. Settled requests
        only: in-flight steps leave the emit cursor behind the scheduler's optimistic view."""
        if self._small:
            new, ahead, tracked = [], None, self._tracked
            for i, (request_id, emit_start) in enumerate(zip(request_ids, emit_starts.tolist())):
                state = tracked.get(request_id)
                if state is None:
                    new.append(i)
                elif emit_start > state.emit_cursor and not state.pending and ahead is None:
                    ahead = i, state.emit_cursor
            return new, ahead
        slots = self._slots(request_ids)
        new = (slots < 0).nonzero()[0].tolist()
        # (Untracked requests, slot -1, read an unrelated cursor: skipped.)
        beyond = (emit_starts > self._emit_cursor[slots]).nonzero()[0].tolist()
        beyond = [i for i in beyond if slots[i] >= 0 and self._pending[slots[i]] == 0]
        return new, ((beyond[0], int(self._emit_cursor[slots[beyond[0]]])) if beyond else None)

    def prepare_output(self, input_batch: InputBatch) -> PendingCacheOutput | None:
        """Keep this step's routing snapshot (device) for ``process_output``."""
        if self._cache is None or self._step_metadata is None:
            return None
        request_ids = list(input_batch.req_ids)
        n = len(request_ids)
        snapshot = self._capturer.snapshot_routing_data(int(input_batch.query_start_loc_np[n]))
        with self._lock:
            if len(self._pending_outputs) >= self._max_concurrent_batches:
                raise ConnectorStateError(
                    f"{len(self._pending_outputs)} step outputs are in flight, more than "
                    f"max_concurrent_batches={self._max_concurrent_batches}: outputs are not consumed"
                )
            if self._small:  # the batch as lists, for the plain passes
                tracked = list(map(self._tracked.get, request_ids))
                if None in tracked:
                    self._refuse_untracked([r for r, state in zip(request_ids, tracked) if state is None])
                slots = [state.slot for state in tracked]
                query_start_loc = input_batch.query_start_loc_np[: n + 1].tolist()
                token_starts = input_batch.num_computed_tokens_np[:n].tolist()
            else:
                slots = self._slots(request_ids)
                if n and smallest(slots) < 0:
                    self._refuse_untracked([request_ids[i] for i in (slots < 0).nonzero()[0].tolist()])
                query_start_loc = np.array(input_batch.query_start_loc_np[: n + 1], dtype=np.int64)
                token_starts = np.array(input_batch.num_computed_tokens_np[:n], dtype=np.int64)
            if len(set(request_ids)) < n:
                raise ConnectorStateError(f"step lists a request twice: {request_ids}")
            pending = PendingCacheOutput(
                self, request_ids, slots, token_starts, query_start_loc, snapshot, self._step_metadata.requests
            )
            if self._side_stream is not None:
                pending.snapshot_ready = self._side_stream.mark_ready()
            self._pending_outputs.append(pending)
            if self._small:
                pending.tracked = tracked
                for state in tracked:
                    state.pending += 1
            else:
                self._pending[slots] += 1
        return pending

    @staticmethod
    def _refuse_untracked(unknown: list) -> None:
        raise ConnectorStateError(f"step covers requests {unknown} that were never scheduled")

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
                if self._stats_log_interval and time.monotonic() - self._stats_logged_at >= self._stats_log_interval:
                    self._log_stats()
                if pending in self._pending_outputs:  # not after close() or a reset
                    self._pending_outputs.remove(pending)
                    self._settle_output(pending)

    def _settle_output(self, pending: PendingCacheOutput) -> None:
        """The step's output is processed: its requests have one step output fewer in flight,
        and those finished with none left are torn down."""
        done = []
        if self._small:
            for request_id, state in zip(pending.request_ids, self._tracked_of(pending)):
                state.pending -= 1
                if state.finished and not state.pending:
                    done.append(request_id)
        else:
            slots = np.asarray(pending.slots, dtype=np.int64)
            self._pending[slots] -= 1
            if self._awaiting_teardown:
                idle = (self._finished[slots] & (self._pending[slots] == 0)).nonzero()[0].tolist()
                done = [pending.request_ids[i] for i in idle]
        if done:
            self._teardown(done)

    def _tracked_of(self, pending: PendingCacheOutput) -> list[TrackedRequest]:
        """The state objects of a step's requests (kept from ``prepare_output`` if steps were
        small then). They stay tracked while the step's output is in flight."""
        if pending.tracked is None:
            pending.tracked = list(map(self._tracked.__getitem__, pending.request_ids))
        return pending.tracked

    def _log_stats(self) -> None:
        """One line in vLLM's log style: pool use by page state, and counters since the last line."""
        if self._cache is None:
            return
        now = {
            **self._cache.stats(), "rollbacks": self._rollbacks, "reattachments": self._reattachments,
            "returned_rows": self._returned_rows,
        }
        since = {key: now[key] - self._stats_last.get(key, 0) for key in (
            "prefix_hit_rows", "captured_rows", "returned_rows", "read_rows", "evictions", "rollbacks", "reattachments")}
        in_use = now["num_pages"] - now["free"]
        logger.info(
            "routed-experts-cache: pool %.1f%% in use (%d of %d pages: %d tail, %d pending, %d duplicate, "
            "%d published of which %d evictable); %d requests; since the last line: %d rows captured, "
            "%d returned (%d of them read from the pool), %d prefix-hit rows, %d evictions, %d roll-backs, "
            "%d re-attachments",
            100.0 * in_use / now["num_pages"], in_use, now["num_pages"], now["tail"], now["pending"],
            now["duplicate"], now["published"], now["evictable"], len(self._slot_of), since["captured_rows"],
            since["returned_rows"], since["read_rows"], since["prefix_hit_rows"], since["evictions"], since["rollbacks"],
            since["reattachments"],
        )
        self._stats_last = now
        self._stats_logged_at = time.monotonic()

    def _commit(self, pending: PendingCacheOutput) -> dict[str, AuxRequestOutput]:
        """Capture the step's accepted rows and build its outputs: array passes over the batch,
        with Python only where requests re-attach, roll back or read rows from before. The
        pool updates of the steps begun since the last one come first."""
        if self._deferred:
            self._apply_deferred()
        if pending.num_sampled is None or pending.num_rejected is None:
            raise ConnectorStateError("process_output before enqueue_cpu_copy: acceptance counts missing")
        n = len(pending.request_ids)
        sampled, rejected = (np.asarray(counts, dtype=np.int64)[:n] for counts in (pending.num_sampled, pending.num_rejected))
        if len(sampled) != n or len(rejected) != n:
            raise ConnectorStateError(f"acceptance counts for {len(sampled)} / {len(rejected)} of {n} requests")
        if not self._small:
            return self._commit_arrays(pending, sampled, rejected)
        outputs = self._commit_small(pending, sampled, rejected)
        if outputs is not None:
            return outputs
        self._use_small_steps(False)  # a rare step (a roll-back, invalid counts): the array path
        try:
            return self._commit_arrays(pending, sampled, rejected)
        finally:
            self._use_small_steps(True)

    def _commit_arrays(self, pending: PendingCacheOutput, sampled: np.ndarray, rejected: np.ndarray):
        """``_commit``'s array passes over the batch (the state in the slot arrays)."""
        request_ids = pending.request_ids
        slots, token_starts, query_start_loc = (
            np.asarray(values, dtype=np.int64) for values in (pending.slots, pending.token_starts, pending.query_start_loc))
        n = len(request_ids)
        row_starts = query_start_loc[:-1]
        num_rows = query_start_loc[1:] - row_starts
        counts = num_rows - rejected
        if n and smallest((num_rows - 1) | rejected | counts) < 0:  # the sign bit of any of them
            i = ((num_rows <= 0) | (rejected < 0) | (counts < 0)).nonzero()[0][0]
            raise ConnectorStateError(
                f"request {request_ids[i]!r}: invalid step rows ({num_rows[i]} scheduled, {rejected[i]} rejected)"
            )
        captured = self._capture_cursor[slots]
        emit_starts = self._emit_cursor[slots]
        # Async scheduling assumed every draft was accepted: re-attach at the capture cursor,
        # which must lie inside what the scheduler ran.
        reattach = token_starts > captured
        reattach &= captured >= 0
        capture_starts = np.where(reattach, captured, token_starts)
        num_reattached = int(np.count_nonzero(reattach))
        if num_reattached:
            unscheduled = (reattach & (captured >= self._scheduled_cursor[slots])).nonzero()[0]
            if len(unscheduled):
                i = unscheduled[0]
                raise ConnectorStateError(
                    f"request {request_ids[i]!r}: rows [{captured[i]}, {token_starts[i]}) were never scheduled"
                )
            self._reattachments += num_reattached
        rollbacks = (token_starts < captured).nonzero()[0]
        if len(rollbacks):
            self._roll_back(pending, emit_starts, rollbacks.tolist())
        token_ends = capture_starts + counts
        self._cache.capture_step(pending.snapshot, request_ids, slots, capture_starts, row_starts, counts, pending.emit_starts)
        self._capture_cursor[slots] = token_ends
        self._scheduled_cursor[slots] = token_starts + num_rows
        emitting = (sampled > 0) & (emit_starts <= token_ends)
        self._emit_cursor[slots] = np.where(emitting, token_ends, emit_starts)  # lower only after a roll-back
        pick = emitting.nonzero()[0]
        if len(pick) < n:
            request_ids = [request_ids[i] for i in pick.tolist()]
            slots, emit_starts, capture_starts, row_starts, counts = (
                values[pick] for values in (slots, emit_starts, capture_starts, row_starts, counts))
        return self._emitted_rows(pending, request_ids, slots, emit_starts, capture_starts, row_starts, counts)

    def _commit_small(self, pending: PendingCacheOutput, sampled: np.ndarray, rejected: np.ndarray):
        """``_commit`` in one plain Python pass over the requests' state objects (small steps,
        where that costs less than its two dozen array passes): the same captures, cursors and
        outputs. Returns None, changing nothing, where a request rolls back or its counts are
        invalid: the array path takes the step (and raises, for invalid counts)."""
        request_ids, tracked = pending.request_ids, self._tracked_of(pending)
        bounds, starts = as_plain_list(pending.query_start_loc), as_plain_list(pending.token_starts)
        capture_starts, counts, token_ends, scheduled_ends, outputs, earlier = [], [], [], [], [], []
        reattached = returned = 0
        for i, (state, start, accepted, dropped) in enumerate(zip(tracked, starts, sampled.tolist(), rejected.tolist())):
            row_start, num_rows = bounds[i], bounds[i + 1] - bounds[i]
            count, captured = num_rows - dropped, state.capture_cursor
            if num_rows <= 0 or dropped < 0 or count < 0 or start < captured:
                return None
            if start > captured >= 0:  # re-attach at the capture cursor (async scheduling)
                if captured >= state.scheduled_cursor:
                    return None
                reattached += 1
                start_at = captured
            else:
                start_at = start
            capture_starts.append(start_at)
            counts.append(count)
            token_ends.append(start_at + count)
            scheduled_ends.append(start + num_rows)
            emit_start = state.emit_cursor
            if accepted > 0 and emit_start <= start_at + count:
                returned += start_at + count - emit_start
                if emit_start < start_at:  # rows from before this step (a prefix hit's)
                    earlier.append(len(outputs))
                outputs.append((i, emit_start, row_start + max(emit_start - start_at, 0), row_start + count))
        self._cache.capture_step_small(
            pending.snapshot, request_ids, pending.slots, capture_starts, bounds[:-1], counts, token_ends, pending.emit_starts)
        for state, end, scheduled_end in zip(tracked, token_ends, scheduled_ends):  # the capture held: move on
            state.capture_cursor = end
            state.scheduled_cursor = scheduled_end
        for i, _, _, _ in outputs:
            tracked[i].emit_cursor = token_ends[i]
        self._reattachments += reattached
        self._returned_rows += returned
        host = self._copy_out(pending.snapshot)
        if not earlier:
            return {
                request_ids[i]: AuxRequestOutput(emit_start, host[first_row:end_row])
                for i, emit_start, first_row, end_row in outputs
            }
        # Those requests get their whole interval from the pool.
        rows = [host[first_row:end_row] for _, _, first_row, end_row in outputs]
        picked = [outputs[j][0] for j in earlier]
        read = self._pool_rows(
            [request_ids[i] for i in picked], np.asarray(pending.slots, dtype=np.int64)[picked], np.array([outputs[j][1] for j in earlier], dtype=np.int64),
            np.array([token_ends[i] for i in picked], dtype=np.int64),
        )
        for j, request_rows in zip(earlier, read):
            rows[j] = request_rows
        return {
            request_ids[i]: AuxRequestOutput(emit_start, row_block)
            for (i, emit_start, _, _), row_block in zip(outputs, rows)
        }

    def _roll_back(self, pending, emit_starts: np.ndarray, rollbacks: list[int]) -> None:
        """vLLM rolled these requests back (KV blocks failed to load; recompute policy) and
        dropped that step's output: rows from there on came from the failed KV. Forget them,
        and emit again from where the scheduler now starts (``emit_starts`` lowered in place)."""
        request_ids, token_starts = pending.request_ids, pending.token_starts
        for i in rollbacks:
            emit_starts[i] = min(emit_starts[i], pending.emit_starts.get(request_ids[i], emit_starts[i]))
            self._cache.rewind(request_ids[i], int(token_starts[i]))
        self._rollbacks += len(rollbacks)

    def _emitted_rows(self, pending, request_ids, slots, emit_starts, capture_starts, row_starts, counts):
        """Rows ``[emit_start, capture_start + count)`` per request (this step's rows start at
        ``capture_start``). A request that gets only what this step captured gets it straight
        from the step's snapshot (one device-to-host copy, the rows the pool now holds); one
        that also gets rows from before (a prefix hit's, rows recomputed after a roll-back) gets
        its whole interval gathered from the pool."""
        host = self._copy_out(pending.snapshot)
        skipped = emit_starts - capture_starts  # > 0: rows of this step the client has (a re-attachment)
        row_ends = row_starts + counts
        rows = list(map(host.__getitem__, map(slice, (row_starts + np.maximum(skipped, 0)).tolist(), row_ends.tolist())))
        earlier = (skipped < 0).nonzero()[0]
        ends = capture_starts + counts
        if len(earlier):
            picked = earlier.tolist()
            read = self._pool_rows([request_ids[i] for i in picked], slots[earlier], emit_starts[earlier], ends[earlier])
            for i, request_rows in zip(picked, read):
                rows[i] = request_rows
        self._returned_rows += total(ends - emit_starts)
        return dict(zip(request_ids, map(AuxRequestOutput, emit_starts.tolist(), rows)))

    def _pool_rows(self, request_ids: list, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
        """Each request's rows ``[starts[i], ends[i])`` from the pool: one gather, one copy to the
        host, a view per request."""
        packed, offsets = self._cache.read_step(request_ids, slots, starts, ends)
        packed, bounds = packed.cpu().numpy(), offsets.tolist()
        return list(map(packed.__getitem__, map(slice, bounds[:-1], bounds[1:])))

    def _copy_out(self, snapshot: torch.Tensor) -> np.ndarray:
        """The step's rows on the host in the pool dtype: the device-to-host copy, and a copy
        on CPU too (a capturer may hand out a view of a buffer it writes again next step)."""
        return snapshot.to(device="cpu", dtype=self._cache.dtype, copy=True).numpy()

    def _teardown(self, request_ids: list) -> None:
        """Tear down finished requests whose last step outputs were processed."""
        self._awaiting_teardown.difference_update(request_ids)
        self._untrack(request_ids)
        self._cache.finish_step(request_ids)

    def close(self) -> None:
        with self._lock:
            self._pending_outputs.clear()
            self._clear()
            self._cache = None


def build_cache(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, capturer) -> RoutedExpertsCache:
    """The pool for this engine: every KV-cached block's rows plus the working set.

    With the scheduler's pins (vLLM 0.33, 0.34), it keeps the rows of up to its retention
    capacity C of finished blocks (the GPU's KV blocks plus the KV connector's tier,
    ``kv_tiers.retained_blocks``) whether or not their KV is still on the GPU, on top of the
    blocks live requests hold: up to N (the KV blocks) of them on the device, and all of them,
    with readers' pins, in a host tier of C + N pages when C exceeds N (a KV connector). On vLLM 0.34 with the
    extensible KV cache, ``num_blocks`` is the reserved capacity (at least the final size).
    ``aux_output_config.max_bytes``, when set, replaces the KV-sized part. The copy backend
    is ``ROUTED_EXPERTS_CACHE_BACKEND`` (auto / triton / torch; auto = Triton on CUDA).
    """
    scheduler_config = vllm_config.scheduler_config
    scheduler_block_size, page_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    row_shape = tuple(capturer.shape_per_token)
    page_nbytes = page_size * math.prod(row_shape) * capturer.output_dtype.itemsize
    kv_pages = kv_cache_config.num_blocks * (scheduler_block_size // page_size)
    retained_pages = 0
    if installed_contract().scheduler_pins:
        # The scheduler side's retention capacity (scheduler.CacheSchedulerConnector): the GPU's
        # blocks plus the KV connector's tier. Up to kv_pages of them stay on the device; the host
        # tier takes every retained block (and a reader's pins on them, which count against its
        # KV blocks) whenever the device needs their pages.
        retained_pages = retained_blocks(vllm_config, kv_cache_config) * (scheduler_block_size // page_size)
    host_pages = retained_pages + kv_pages if retained_pages > kv_pages else 0
    max_bytes = vllm_config.aux_output_config.max_bytes
    if max_bytes is None:
        shared_pages = kv_pages + min(retained_pages, kv_pages)
    else:
        shared_pages = max_bytes // page_nbytes
    working_set = working_set_pages(
        page_size, scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
        vllm_config.max_concurrent_batches,
    )
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend not in ("auto", "triton", "torch"):
        raise RoutedExpertsCacheError(f"{BACKEND_ENV}={backend!r} is not understood; use auto (the default), triton or torch")
    speculative = vllm_config.speculative_config
    drafts = speculative.num_speculative_tokens if speculative is not None else 0
    return RoutedExpertsCache(
        shared_pages + working_set, page_size, row_shape, dtype=capturer.output_dtype,
        device=capturer.device_buffer.device, backend=backend,
        max_position=vllm_config.model_config.max_model_len + drafts,  # drafts may run past the last token
        host_pages=host_pages,
    )


def pool_for_this_rank(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, capturer) -> RoutedExpertsCache | None:
    """The pool on the first tensor-parallel rank (which returns rows, as in vLLM), None on the
    others (they capture, since the capture may all-gather, but keep nothing); logs which."""
    tp_group = get_tp_group()
    if not tp_group.is_first_rank:
        logger.info(
            "routed-experts-cache: active on tensor-parallel rank %d of %d, without a pool; rank 0 keeps "
            "and returns the rows", tp_group.rank_in_group, tp_group.world_size,
        )
        return None
    cache = build_cache(vllm_config, kv_cache_config, capturer)
    logger.info(
        "routed-experts-cache: active; routed experts are served from a %s pool of %d pages x %d rows "
        "(%.1f MiB, rows %s %s, backend %s; host tier %d pages, %.1f MiB)",
        cache.device, cache.num_pages, cache.page_size, cache.pages.nbytes / 2**20, cache.row_shape,
        cache.dtype, cache.backend, cache.host_arena.shape[0], cache.host_arena.nbytes / 2**20,
    )
    return cache


def get_aux_output_connector(
    model: torch.nn.Module, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None
) -> CacheWorkerConnector:
    """Factory with both call shapes of vLLM's ``get_aux_output_connector``.

    vLLM 0.32 / 0.33 call it once the KV layout is known, with ``kv_cache_config``: the pool is
    made here. vLLM 0.34 calls it without, in ``profile_run`` (so the capturer's buffer is part
    of its memory profile), and later ``initialize_output_storage(kv_cache_config)``.
    """
    capturer = RoutedExpertsCapturer(
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens, vllm_config=vllm_config
    )
    bind_routed_experts_capturer(model, capturer)
    connector = CacheWorkerConnector(
        capturer=capturer, cache=None, max_concurrent_batches=vllm_config.max_concurrent_batches,
        stats_log_interval=log_interval(), vllm_config=vllm_config,
    )
    if kv_cache_config is not None:
        connector.initialize_output_storage(kv_cache_config)
    return connector


def log_interval() -> float:
    """``ROUTED_EXPERTS_CACHE_LOG_INTERVAL`` (seconds, default 10; 0 turns the stats line off)."""
    raw = os.environ.get(LOG_INTERVAL_ENV, str(DEFAULT_LOG_INTERVAL))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or math.isinf(seconds):
        raise RoutedExpertsCacheError(f"{LOG_INTERVAL_ENV}={raw!r} must be a number of seconds >= 0 (0: no stats lines)")
    return seconds
