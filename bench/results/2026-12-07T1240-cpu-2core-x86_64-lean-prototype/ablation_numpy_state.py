"""Ablation: how much of this project's lead over the prototype is its per-slot numpy state?

    .venv-vllm033/bin/python bench/results/<this folder>/ablation_numpy_state.py [--concurrency 16 64] [--rounds 6]

``MirroredConnector`` is the checked prototype plus the numpy work this project's small-step
path does on per-slot arrays beside its Python objects, call for call: the connector's five
cursor arrays (the emit-ahead check and the new requests' slots in ``begin_step``, the pending
count in ``prepare_output`` and ``process_output``, three cursor gathers and three scatters per
step, the teardown check), and the cache's slot arrays (the first-block check, the cursor
scatter, the block-table write of the step's new pages); ``parts`` keeps either or neither
(neither: only the mirror's own slot bookkeeping). ``PackedConnector`` keeps the same fields
as one packed array read and written once per step. The values written are the objects' (the
prototype keeps working from its objects); only the cost is added. Replayed interleaved with
the checked prototype and this project's connector on ``bench_host``'s trace; the rows of
every variant are compared with this project's.
"""

import argparse
import statistics
import sys
from itertools import repeat
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]

from bench.bench_host import bookkeeping, builders, record_trace, replay_alternating, same_outputs  # noqa: E402
from lean_prototype import LeanConnector, pool_layout  # noqa: E402

SLOTS, BLOCKS = 4096, 128


class _SlotMirror(LeanConnector):
    """The checked prototype with slots for its requests (as this project's slot arrays index
    them) and a block table: what both mirrors below share."""

    def __init__(self, *args) -> None:
        super().__init__(*args, checked=True)
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(SLOTS - 1, -1, -1))
        self.table = np.zeros((SLOTS, BLOCKS), dtype=np.int64)
        self.step_slots: dict[int, np.ndarray] = {}

    def _take_slots(self, request_ids: list) -> list[int]:
        taken = [self.free_slots.pop() for _ in request_ids]
        self.slot_of.update(zip(request_ids, taken))
        return taken

    def _write_new_pages(self, slots, pages_before: list[int], states) -> None:
        """The block-table write of the step's new pages (the values are not the point)."""
        new = [(slot, before) for slot, before, request in zip(slots, pages_before, states) if len(request.pages) > before]
        if new:
            table_slots, table_blocks = zip(*new)
            self.table[list(table_slots), list(table_blocks)] = 0

    def _free_finished_slots(self, pending) -> None:
        for request_id, request in zip(pending.request_ids, pending.states):
            if request.finished and not request.pending and request_id in self.slot_of:
                self.free_slots.append(self.slot_of.pop(request_id))


class MirroredConnector(_SlotMirror):
    """``parts``: which arrays to keep, "connector" and / or "cache"."""

    def __init__(self, *args, parts=("connector", "cache")) -> None:
        super().__init__(*args)
        self.connector_arrays, self.cache_arrays = "connector" in parts, "cache" in parts
        self.emit_cursor, self.capture_cursor, self.scheduled_cursor, self.pending_count = (
            np.zeros(SLOTS, dtype=np.int64) for _ in range(4))
        self.finished_flag = np.zeros(SLOTS, dtype=bool)
        self.cache_cursor, self.cache_first_block = np.zeros(SLOTS, dtype=np.int64), np.full(SLOTS, -1, dtype=np.int64)

    def begin_step(self, metadata) -> None:
        if metadata is not None and self.connector_arrays:
            ids = list(metadata.requests)
            emits = np.fromiter(metadata.requests.values(), dtype=np.int64, count=len(ids))
            slots = np.fromiter(map(self.slot_of.get, ids, repeat(-1)), dtype=np.int64, count=len(ids))
            ahead = (emits > self.emit_cursor[slots]).nonzero()[0].tolist()
            [i for i in ahead if slots[i] >= 0 and self.pending_count[slots[i]] == 0]
            new = (slots < 0).nonzero()[0]
            if len(new):
                taken = np.array(self._take_slots([ids[i] for i in new.tolist()]), dtype=np.int64)
                self.emit_cursor[taken] = emits[new]
                self.capture_cursor[taken] = -1
                self.scheduled_cursor[taken] = 0
                self.pending_count[taken] = 0
                self.finished_flag[taken] = False
        if metadata is not None and self.cache_arrays:
            new_ids = [request_id for request_id in metadata.requests if request_id not in self.slot_of]
            if new_ids:
                self.cache_first_block[np.array(self._take_slots(new_ids), dtype=np.int64)] = -1
        super().begin_step(metadata)

    def prepare_output(self, batch):
        pending = super().prepare_output(batch)
        slots = np.fromiter(map(self.slot_of.get, pending.request_ids, repeat(-1)), dtype=np.int64, count=len(pending.request_ids))
        if self.connector_arrays:
            self.pending_count[slots] += 1
        self.step_slots[id(pending)] = slots
        return pending

    def process(self, pending, sampled, rejected) -> dict:
        slots, states = self.step_slots.pop(id(pending)), pending.states
        if self.connector_arrays:
            self.capture_cursor[slots].tolist(), self.emit_cursor[slots].tolist(), self.scheduled_cursor[slots].tolist()
        if self.cache_arrays:
            (self.cache_first_block[slots] < 0).nonzero()[0].tolist()
            pages_before = [len(request.pages) for request in states]
        result = super().process(pending, sampled, rejected)
        captured = [request.captured for request in states]
        if self.connector_arrays:
            self.capture_cursor[slots] = captured
            self.scheduled_cursor[slots] = [request.scheduled for request in states]
            self.emit_cursor[slots] = [request.emit for request in states]
            self.pending_count[slots] -= 1
            (self.finished_flag[slots] & (self.pending_count[slots] == 0)).nonzero()[0].tolist()
        if self.cache_arrays:
            self.cache_cursor[slots] = captured
            self.cache_first_block[slots] = [request.first_block for request in states]
            self._write_new_pages(slots.tolist(), pages_before, states)
        self._free_finished_slots(pending)
        return result


class PackedConnector(_SlotMirror):
    """The checked prototype plus the same per-slot state kept as one packed array
    ``state[slot, field]`` (the five connector fields and the cache's cursor and first block),
    read and written once per step each (a gather of the step's rows as lists, one scatter of
    them back), the pending count once in ``prepare_output``, and the block-table write of the
    step's new pages: the numpy calls a one-pass small-step engine over per-slot arrays needs."""

    EMIT, CAPTURED, SCHEDULED, PENDING, FINISHED, CURSOR, FIRST_BLOCK = range(7)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.state = np.zeros((SLOTS, 7), dtype=np.int64)

    def begin_step(self, metadata) -> None:
        if metadata is not None:
            new_ids = [request_id for request_id in metadata.requests if request_id not in self.slot_of]
            known = [self.slot_of[request_id] for request_id in metadata.requests if request_id in self.slot_of]
            if known:
                self.state[known].tolist()  # the emit-ahead check's rows
            if new_ids:
                self.state[self._take_slots(new_ids)] = [[metadata.requests[request_id], -1, 0, 0, 0, 0, -1] for request_id in new_ids]
        super().begin_step(metadata)

    def prepare_output(self, batch):
        pending = super().prepare_output(batch)
        slots = list(map(self.slot_of.__getitem__, pending.request_ids))
        self.state[slots, self.PENDING] += 1
        self.step_slots[id(pending)] = slots
        return pending

    def process(self, pending, sampled, rejected) -> dict:
        slots, states = self.step_slots.pop(id(pending)), pending.states
        self.state[slots].tolist()
        pages_before = [len(request.pages) for request in states]
        result = super().process(pending, sampled, rejected)
        self.state[slots] = [
            [request.emit, request.captured, request.scheduled, request.pending, request.finished, request.captured, request.first_block]
            for request in states
        ]
        self._write_new_pages(slots, pages_before, states)
        self._free_finished_slots(pending)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[24, 96])
    args = parser.parse_args()
    for concurrency in args.concurrency:
        setup, events, _ = record_trace(concurrency, 120, output_tokens=args.output_tokens)
        num_pages, page_size = pool_layout(setup)
        builds = {
            "ours": builders()["routed-experts-cache"],
            "lean, checked": lambda setup, capturer: LeanConnector(setup, capturer, num_pages, page_size, checked=True),
            "lean, checked, numpy state": lambda setup, capturer: MirroredConnector(setup, capturer, num_pages, page_size),
            "  connector's arrays only": lambda setup, capturer: MirroredConnector(
                setup, capturer, num_pages, page_size, parts=("connector",)),
            "  cache's arrays only": lambda setup, capturer: MirroredConnector(setup, capturer, num_pages, page_size, parts=("cache",)),
            "  neither (the mirror's own bookkeeping)": lambda setup, capturer: MirroredConnector(
                setup, capturer, num_pages, page_size, parts=()),
            "lean, checked, packed state": lambda setup, capturer: PackedConnector(setup, capturer, num_pages, page_size),
        }
        samples, outputs = replay_alternating(setup, events, builds, args.rounds)
        equal = all(same_outputs(outputs["ours"], outputs[name]) for name in builds)
        medians = {name: statistics.median(bookkeeping(steps)) * 1e3 for name, steps in samples.items()}
        print(f"[{concurrency} requests, outputs {args.output_tokens[0]}-{args.output_tokens[1]} tokens, "
              f"{args.rounds - 1} measured rounds] rows equal ours: {equal}")
        for name, value in medians.items():
            print(f"  {name:28s} {value:7.3f} ms/step  / lean, checked {value / medians['lean, checked']:5.2f}")


if __name__ == "__main__":
    main()
