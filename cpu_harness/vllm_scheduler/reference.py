"""A plain-Python worker connector with the same contract, the model the stateful tests compare against."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import installed  # noqa: F401  (first: checks the installed vLLM, sets its environment)
import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

from .connectors import SnapshotCapturer
from .scheduler import SchedulerSetup
from .toy_model import HarnessError, ROW_SHAPE


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
