"""How cheap could a pure-Python connector of this design be? A lower-bound prototype.

    .venv-vllm033/bin/python bench/results/<this folder>/lean_prototype.py [--concurrency 16 64]
        [--rounds 5] [--output-tokens 24 96]

``LeanConnector`` does the work this project's connector does on ``bench_host``'s trace -- a
paged pool of rows (free list, published hashes, scheduler pins, an eviction order), each
request's block map, first captures with prefix hits (seeded from a published page when they
start inside a block), re-attachment under async scheduling, publishing of full blocks once
their hash is known, reads of earlier rows, deferred teardowns -- in one flat class with no
argument checks, no layers and no error paths: every input is trusted, a roll-back or a
read of a missing row is not handled (the replay checks its rows against this project's
connector, so a trace that needed them would show up as a mismatch). It is not a connector
anyone should run; it is the cheapest shape of the same bookkeeping this session could write
in plain Python, replayed on the same trace beside vLLM's built-in connector, the output
contract's floor and this project's connector, interleaved, with ``bench_host``'s timing
(thread CPU; row copies left out of the bookkeeping).
"""

import argparse
import statistics
import sys
import threading
from itertools import chain
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.bench_host import (  # noqa: E402
    BUILTIN, FLOOR, OutputContractFloor, WideCapturer, bookkeeping, builders, record_trace, replay_alternating,
    same_outputs,
)
from cpu_harness.vllm_scheduler import build_our_connector  # noqa: E402
from routed_experts_cache.connector.checks import check_request_ids  # noqa: E402
from routed_experts_cache.connector.vllm.step_hashes import StepHashes, unpack_hashes  # noqa: E402
from routed_experts_cache.errors import RoutedExpertsCacheError  # noqa: E402
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402

LEAN = "lean prototype"
LEAN_CHECKED = "lean prototype, checked"
OURS = "routed-experts-cache"
TARGETS = {16: 0.5, 64: 0.5, 256: 0.25, 1024: 0.25}


class _Request:
    __slots__ = ("emit", "captured", "scheduled", "first_block", "pages", "hashes", "settled", "pending", "finished")

    def __init__(self, emit: int) -> None:
        self.emit, self.captured, self.scheduled = emit, -1, 0
        self.first_block, self.pages, self.hashes, self.settled = -1, [], [], 0
        self.pending, self.finished = 0, False


class LeanConnector:
    def __init__(self, setup, capturer, num_pages: int, page_size: int, checked: bool = False) -> None:
        self._capturer, self.size, self.checked = capturer, page_size, checked
        self.lock = threading.Lock()
        self.generation, self.in_flight, self.max_in_flight = 0, 0, 2
        self.max_position = setup.vllm_config.model_config.max_model_len + 4
        self.pin_view: dict[bytes, int] = {}  # the pins as the model thread sees them (deferred ones included)
        self.pool = torch.zeros((num_pages * page_size, *capturer.shape_per_token), dtype=torch.uint8)
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: pop() takes the lowest first
        self.published: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}  # published page -> its hash
        self.pins: dict[bytes, int] = {}
        self.evictable: dict[int, None] = {}  # published, unpinned, no live owner: oldest first
        self.owned: set[int] = set()  # pages of live requests
        self.requests: dict[str, _Request] = {}
        self.deferred: list = []
        self.cache = self  # bench_host's replay times ``cache._copy`` / ``cache._copy_rows`` as row copies

    # row copies (timed apart by the replay)
    def _copy_rows(self, source, target, source_index, target_index):
        target.index_copy_(0, target_index, source.index_select(0, source_index))

    _copy = _copy_rows

    def _copy_out(self, snapshot):
        return snapshot.to(device="cpu", dtype=torch.uint8, copy=True).numpy()

    # model thread
    def begin_step(self, metadata) -> None:
        if metadata is None:
            return
        if self.checked:
            with self.lock:
                return self._begin_checked(metadata)
        requests = self.requests
        for request_id, emit in metadata.requests.items():
            if request_id not in requests:
                requests[request_id] = _Request(emit)
        self._begin_rest(metadata, metadata.block_hashes, getattr(metadata, "retained_block_hashes", None),
                         getattr(metadata, "released_block_hashes", None))

    def _begin_checked(self, metadata) -> None:
        """The connector's checks of a step's metadata, all before anything changes."""
        requests, scheduled = self.requests, metadata.requests
        if not scheduled.keys().isdisjoint(metadata.finished_requests):
            raise RoutedExpertsCacheError("scheduled and finished in one step")
        if metadata.generation != self.generation:
            raise RoutedExpertsCacheError("a new generation: not handled by the prototype")
        new = [request_id for request_id in scheduled if request_id not in requests]
        check_request_ids(new)
        for request_id, emit in scheduled.items():
            request = requests.get(request_id)
            if request is not None and not request.pending and emit > request.emit:
                raise RoutedExpertsCacheError(f"request {request_id!r}: emit start ahead of the rows delivered")
        for request_id in metadata.block_hashes:
            if request_id not in requests and request_id not in scheduled:
                raise RoutedExpertsCacheError(f"block hashes for request {request_id!r}, which is not running")
        hashes = StepHashes(metadata)
        view = self.pin_view
        if hashes.released:
            released = hashes.released
            counts = {}
            for h in released:
                counts[h] = counts.get(h, 0) + 1
            retained = hashes.retained
            for h in retained:
                view[h] = view.get(h, 0) + 1
            for h, times in counts.items():
                if view.get(h, 0) < times:
                    for h2 in retained:  # undo: a refused step changes nothing
                        view[h2] -= 1
                    raise RoutedExpertsCacheError("a released hash that is not retained")
            for h, times in counts.items():
                left = view[h] - times
                if left:
                    view[h] = left
                else:
                    del view[h]
        elif hashes.retained:
            for h in hashes.retained:
                view[h] = view.get(h, 0) + 1
        for request_id in new:
            requests[request_id] = _Request(scheduled[request_id])
        self._begin_rest(metadata, dict(zip(hashes.request_ids, hashes.hash_lists)) if hashes.request_ids else {},
                         hashes.retained, hashes.released)

    def _begin_rest(self, metadata, block_hashes, retained, released) -> None:
        requests = self.requests
        finished = []
        for request_id in metadata.finished_requests:
            request = requests.get(request_id)
            if request is not None:
                request.finished = True
                if not request.pending:
                    finished.append(requests.pop(request_id))
        self.deferred.append((block_hashes, retained, released, finished))

    def prepare_output(self, batch):
        request_ids = list(batch.req_ids)
        n = len(request_ids)
        bounds = batch.query_start_loc_np[: n + 1].tolist()
        starts = batch.num_computed_tokens_np[:n].tolist()
        if self.checked:
            with self.lock:
                if self.in_flight >= self.max_in_flight:
                    raise RoutedExpertsCacheError("outputs are not consumed")
                states = list(map(self.requests.get, request_ids))
                if None in states:
                    raise RoutedExpertsCacheError("step covers requests that were never scheduled")
                if len(set(request_ids)) < n:
                    raise RoutedExpertsCacheError("step lists a request twice")
                self.in_flight += 1
        else:
            states = list(map(self.requests.__getitem__, request_ids))
        for request in states:
            request.pending += 1
        return _LeanPending(self, request_ids, states, bounds, starts, self._capturer.snapshot_routing_data(bounds[-1]))

    # output thread
    def _apply_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        pins, published, evictable, owned = self.pins, self.published, self.evictable, self.owned
        for block_hashes, retained, released, finished in deferred:
            if retained:
                for h in (retained if type(retained) is list else unpack_hashes(retained, "")):
                    pins[h] = pins.get(h, 0) + 1
                    page = published.get(h)
                    if page is not None:
                        evictable.pop(page, None)
            if released:
                for h in (released if type(released) is list else unpack_hashes(released, "")):
                    left = pins[h] - 1
                    if left:
                        pins[h] = left
                    else:
                        del pins[h]
                        page = published.get(h)
                        if page is not None and page not in owned:
                            evictable[page] = None
            for request_id, packed in block_hashes.items():
                request = self.requests.get(request_id)
                if request is not None:
                    request.hashes += packed if type(packed) is list else unpack_hashes(packed, "")
                    if request.first_block >= 0:
                        self._settle(request)
            for request in finished:
                self._release(request)

    def _release(self, request: _Request) -> None:
        hash_of, pins, evictable, owned = self.hash_of, self.pins, self.evictable, self.owned
        for page in request.pages:
            owned.discard(page)
            h = hash_of.get(page)
            if h is None:
                self.free.append(page)
            elif h not in pins:
                evictable[page] = None

    def _settle(self, request: _Request) -> None:
        """Publish the request's full own blocks whose hash is known."""
        size, first, published, hash_of = self.size, request.first_block, self.published, self.hash_of
        full = min(len(request.hashes), request.captured // size)
        for block in range(first + request.settled, full):
            h = request.hashes[block]
            if h not in published:
                page = request.pages[block - first]
                published[h] = page
                hash_of[page] = h
        if full > first + request.settled:
            request.settled = full - first

    def _take_page(self) -> int:
        if self.free:
            return self.free.pop()
        page = next(iter(self.evictable))
        del self.evictable[page]
        del self.published[self.hash_of.pop(page)]
        return page

    def process(self, pending, sampled, rejected) -> dict:
        if self.checked:
            with self.lock:
                return self._process(pending, sampled, rejected)
        return self._process(pending, sampled, rejected)

    def _process(self, pending, sampled, rejected) -> dict:
        if self.deferred:
            self._apply_deferred()
        size, owned, take, checked, max_position = self.size, self.owned, self._take_page, self.checked, self.max_position
        bounds, starts = pending.bounds, pending.starts
        if checked:
            self.in_flight -= 1
            if len(self.free) + len(self.evictable) < bounds[-1] // size + 2 * len(starts):
                raise RoutedExpertsCacheError("the pool may not have room: the general path would take this step")
            for i, (request, start, dropped) in enumerate(zip(pending.states, starts, rejected.tolist())):
                num_rows = bounds[i + 1] - bounds[i]
                captured = request.captured
                if num_rows <= 0 or dropped < 0 or dropped > num_rows or start < captured:
                    raise RoutedExpertsCacheError("invalid counts or a roll-back: the general path would take it")
                if start > captured >= 0 and captured >= request.scheduled:
                    raise RoutedExpertsCacheError("re-attachment outside what was scheduled")
                if (captured if start > captured >= 0 else start) + num_rows - dropped > max_position:
                    raise RoutedExpertsCacheError("past max_position")
        source_rows, target_rows, outputs, reads, seeds = [], [], [], [], []
        for i, (request, start, accepted, dropped) in enumerate(zip(pending.states, starts, sampled.tolist(), rejected.tolist())):
            row_start = bounds[i]
            num_rows = bounds[i + 1] - row_start
            count = num_rows - dropped
            captured = request.captured
            if start > captured >= 0:
                start = captured  # re-attach (async scheduling)
            end = start + count
            pages = request.pages
            if request.first_block < 0:
                request.first_block = start // size
                if start % size:  # seeded from the published page of that block
                    page = take()
                    owned.add(page)
                    pages.append(page)
                    seeds.append((self.published[request.hashes[start // size]], page, start % size))
            first = request.first_block
            position, source = start, row_start
            while position < end:
                block = position // size
                own = block - first
                if own == len(pages):
                    page = take()
                    owned.add(page)
                    pages.append(page)
                else:
                    page = pages[own]
                run_end = min(end, block * size + size)
                base = page * size - block * size
                source_rows.append(range(source, source + run_end - position))
                target_rows.append(range(base + position, base + run_end))
                source += run_end - position
                position = run_end
            completes = end // size > start // size
            request.captured = end
            request.scheduled = pending.starts[i] + num_rows
            if completes and len(request.hashes) > first + request.settled:
                self._settle(request)
            emit = request.emit
            if accepted > 0 and emit <= end:
                request.emit = end
                if emit < start:
                    reads.append(len(outputs))
                outputs.append((pending.request_ids[i], emit, row_start + max(emit - start, 0), row_start + count, request, end))
        for source_page, page, rows in seeds:
            self._copy_rows(self.pool, self.pool, torch.arange(source_page * size, source_page * size + rows),
                            torch.arange(page * size, page * size + rows))
        snapshot = pending.snapshot
        if source_rows:
            self._copy_rows(snapshot, self.pool, torch.from_numpy(np.fromiter(chain.from_iterable(source_rows), np.int64)),
                            torch.from_numpy(np.fromiter(chain.from_iterable(target_rows), np.int64)))
        host = self._copy_out(snapshot)
        result = {request_id: AuxRequestOutput(emit, host[first_row:end_row]) for request_id, emit, first_row, end_row, _, _ in outputs}
        if reads:
            index, spans, offset = [], [], 0
            published, hashes_rows = self.published, []
            for j in reads:
                request_id, emit, _, _, request, end = outputs[j]
                first, pages, hashes = request.first_block, request.pages, request.hashes
                position = emit
                while position < end:
                    block = position // size
                    page = published[hashes[block]] if block < first else pages[block - first]
                    run_end = min(end, block * size + size)
                    base = page * size - block * size
                    index.append(range(base + position, base + run_end))
                    position = run_end
                spans.append((request_id, emit, offset, offset + end - emit))
                offset += end - emit
            packed = torch.empty((offset, *self.pool.shape[1:]), dtype=torch.uint8)
            torch.index_select(self.pool, 0, torch.from_numpy(np.fromiter(chain.from_iterable(index), np.int64)), out=packed)
            packed = packed.numpy()
            for request_id, emit, a, b in spans:
                result[request_id] = AuxRequestOutput(emit, packed[a:b])
        for request in pending.states:
            request.pending -= 1
        for request_id, request in zip(pending.request_ids, pending.states):
            if request.finished and not request.pending and self.requests.get(request_id) is request:
                del self.requests[request_id]
                self._release(request)
        return result

    def close(self) -> None:
        self.requests.clear()


def pool_layout(setup) -> tuple[int, int]:
    """The page count and page size this project's connector gives its pool on ``setup``: the
    prototypes replay on a pool of the same size."""
    ours = build_our_connector(setup, WideCapturer())
    layout = ours.cache.num_pages, ours.cache.page_size
    ours.close()
    return layout


class _LeanPending:
    __slots__ = ("connector", "request_ids", "states", "bounds", "starts", "snapshot", "sampled", "rejected")

    def __init__(self, connector, request_ids, states, bounds, starts, snapshot) -> None:
        self.connector, self.request_ids, self.states = connector, request_ids, states
        self.bounds, self.starts, self.snapshot = bounds, starts, snapshot

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self.sampled, self.rejected = num_sampled, num_rejected

    def process_output(self):
        n = len(self.request_ids)
        return self.connector.process(self, self.sampled[:n], self.rejected[:n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[24, 96])
    args = parser.parse_args()
    for concurrency in args.concurrency:
        setup, events, _ = record_trace(concurrency, args.steps, output_tokens=args.output_tokens)
        num_pages, page_size = pool_layout(setup)
        builds = {**builders(), FLOOR: OutputContractFloor,
                  LEAN: lambda setup, capturer: LeanConnector(setup, capturer, num_pages, page_size),
                  LEAN_CHECKED: lambda setup, capturer: LeanConnector(setup, capturer, num_pages, page_size, checked=True)}
        samples, outputs = replay_alternating(setup, events, builds, args.rounds)
        equal = same_outputs(outputs[OURS], outputs[LEAN]) and same_outputs(outputs[OURS], outputs[LEAN_CHECKED])
        medians = {name: statistics.median(bookkeeping(steps)) * 1e3 for name, steps in samples.items()}
        builtin = medians[BUILTIN]
        print(f"[{concurrency} requests, outputs {args.output_tokens[0]}-{args.output_tokens[1]} tokens, "
              f"{args.rounds - 1} measured rounds] lean rows equal ours: {equal}")
        for name, value in medians.items():
            print(f"  {name:28s} {value:7.3f} ms/step  / built-in {value / builtin:5.2f}")
        print(f"  target {TARGETS.get(concurrency, float('nan'))} -> {TARGETS.get(concurrency, float('nan')) * builtin:.3f} ms")


if __name__ == "__main__":
    main()
