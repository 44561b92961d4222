"""The worker connector under random vLLM-shaped schedules, checked against a plain model.

A Hypothesis state machine drives ``CacheWorkerConnector`` with vLLM 0.33's / 0.34's metadata types
and no model: random batches with speculative drafts and rejections, up to
``max_concurrent_batches`` steps in flight (so the CPU's ``num_computed_tokens`` assumes all
drafts were accepted and the connector must re-attach), hash-only updates, finishes with
outputs in flight, retained/released pins and generation bumps. Rows are a function of
(request, position); rows of rejected drafts are poison and must never come back. Every
chunk a request receives must continue exactly where the previous one ended.
"""

from collections import Counter, deque

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from conftest import run_state_machine
from connector_rows import PAGE, ROW, FixedCapturer, input_batch, pack_hashes, row_of
from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

from routed_experts_cache import RoutedExpertsCache
from routed_experts_cache.connector import batch_size
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector

MAX_IN_FLIGHT = 2
POISON = np.full(ROW, 255, dtype=np.uint8)


class _Request:
    def __init__(self, request_id: str, generation: int) -> None:
        self.id = request_id
        self.true = 0  # rows the device really computed (accepted), in-flight steps included
        self.confirmed = 0  # accepted rows of processed steps: what the scheduler knows
        self.optimistic = 0  # the scheduler's num_computed_tokens (in-flight drafts assumed accepted)
        self.hashed = 0  # blocks whose hash was sent
        self.received = 0  # rows delivered to the client so far
        self.in_flight = 0
        self.generation = generation


COVERAGE = Counter()  # what the runs exercised, checked after all examples


class ConnectorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.capturer = FixedCapturer()
        self.cache = RoutedExpertsCache(1024, PAGE, ROW)
        self.connector = CacheWorkerConnector(capturer=self.capturer, cache=self.cache, max_concurrent_batches=2)
        self.requests: dict[str, _Request] = {}
        self.finishing: list[str] = []  # terminal events for the next metadata
        self.in_flight: deque = deque()
        self.retained: list[bytes] = []
        self.generation = 0
        self.next_id = 0

    def _block_hash(self, request: _Request, block: int) -> bytes:
        return f"{request.id}/{self.generation}/{block}".encode().ljust(12, b".")

    def _metadata(self, scheduled: dict, hashes: dict, retained=(), released=()) -> AuxOutputConnectorMetadata:
        finished, self.finishing = tuple(self.finishing), []
        return AuxOutputConnectorMetadata(
            generation=self.generation, requests=scheduled, block_hashes={r: pack_hashes(h) for r, h in hashes.items()},
            finished_requests=finished, retained_block_hashes=pack_hashes(retained),
            released_block_hashes=pack_hashes(released),
        )

    def _hash_updates(self, requests) -> dict:
        """Hashes of full blocks of confirmed tokens (lookahead 1: a block is hashed once a
        token past it exists, and a sampled token has no row yet)."""
        updates = {}
        for request in requests:
            full = request.confirmed // PAGE
            if full > request.hashed:
                updates[request.id] = [self._block_hash(request, b) for b in range(request.hashed, full)]
                request.hashed = full
        return updates

    @precondition(lambda self: len(self.requests) < 6)
    @rule()
    def add_request(self) -> None:
        request = _Request(f"q{self.next_id}", self.generation)
        self.next_id += 1
        self.requests[request.id] = request

    @precondition(lambda self: len(self.in_flight) < MAX_IN_FLIGHT and self.requests)
    @rule(data=st.data())
    def launch_step(self, data) -> None:
        live = [r for r in self.requests.values() if r.id not in self.finishing]
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique_by=lambda r: r.id))
        scheduled, rows, starts, loc, sampled, rejected, entries = {}, [], [], [0], [], [], []
        for request in batch:
            decoding = request.optimistic >= 6
            drafts = data.draw(st.integers(0, 3)) if decoding else 0
            count = 1 + drafts if decoding else data.draw(st.integers(1, 6 - request.optimistic))
            rejects = data.draw(st.integers(0, drafts))
            # Scheduler view: emit from the first row the client lacks (vLLM's emit_start).
            scheduled[request.id] = request.received
            # The device computes from its real cursor; the batch carries the scheduler's view.
            rows += [row_of(request.id, request.true + i) for i in range(count - rejects)] + [POISON] * rejects
            starts.append(request.optimistic)
            COVERAGE["reattached"] += request.optimistic > request.true - (count - rejects)
            COVERAGE["rejected_rows"] += rejects
            loc.append(loc[-1] + count)
            is_sampling = decoding or request.optimistic + count >= 6
            sampled.append(1 if is_sampling else 0)
            rejected.append(rejects)
            request.optimistic += count  # async: assumes every draft accepted
            request.true += count - rejects
            request.in_flight += 1
            entries.append((request, count - rejects, rejects))
        hashes = self._hash_updates(self.requests.values())
        self.connector.begin_step(self._metadata(scheduled, hashes))
        self.capturer.rows = torch.from_numpy(np.stack(rows))
        pending = self.connector.prepare_output(input_batch([r.id for r in batch], loc, starts))
        pending.enqueue_cpu_copy(np.array(sampled, dtype=np.int32), np.array(rejected, dtype=np.int32))
        self.in_flight.append((pending, entries))

    @precondition(lambda self: self.in_flight)
    @rule()
    def process_oldest(self) -> None:
        pending, entries = self.in_flight.popleft()
        outputs = pending.process_output()
        for request, accepted, rejects in entries:
            # update_from_output: the scheduler learns the accepted count of this step.
            request.in_flight -= 1
            request.confirmed += accepted
            request.optimistic -= rejects
            out = outputs.get(request.id)
            if out is None:
                continue
            assert out.token_start == request.received, (request.id, out.token_start, request.received)
            positions = range(out.token_start, out.token_start + len(out.rows))
            want = np.stack([row_of(request.id, p) for p in positions]) if len(out.rows) else out.rows
            np.testing.assert_array_equal(out.rows, want)  # poison rows would differ
            request.received += len(out.rows)
            COVERAGE["delivered_rows"] += len(out.rows)
            COVERAGE["materialized"] += out.token_start < request.confirmed - accepted
        self.pool_matches_model()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), roll=st.integers(0, 3))
    def finish(self, data, roll) -> None:
        if roll:  # requests live for several steps
            return
        request = data.draw(st.sampled_from(sorted(self.requests.values(), key=lambda r: r.id)))
        del self.requests[request.id]
        self.finishing.append(request.id)
        COVERAGE["finished_in_flight"] += request.in_flight > 0

    @rule()
    def hash_only_update(self) -> None:
        hashes = self._hash_updates(self.requests.values())
        self.connector.begin_step(self._metadata({}, hashes))

    @rule(data=st.data())
    def pins(self, data) -> None:
        published = [self._block_hash(r, b) for r in self.requests.values() for b in range(min(r.hashed, r.confirmed // PAGE))]
        retain = data.draw(st.lists(st.sampled_from(published), max_size=3)) if published else []
        release = data.draw(st.lists(st.sampled_from(self.retained), max_size=2, unique=True)) if self.retained else []
        self.connector.begin_step(self._metadata({}, {}, retain, release))
        self.retained += retain
        COVERAGE["retained"] += len(retain)
        for block_hash in release:
            self.retained.remove(block_hash)

    @precondition(lambda self: not self.in_flight)
    @rule(roll=st.integers(0, 19))
    def reset_generation(self, roll) -> None:
        if roll:  # a prefix-cache reset is rare
            return
        self.generation += 1
        COVERAGE["generations"] += 1
        self.connector.begin_step(self._metadata({}, {}))
        self.requests.clear()
        self.finishing.clear()
        self.retained.clear()

    @invariant()
    def accounting(self) -> None:
        self.cache.check_consistency()

    def pool_matches_model(self) -> None:
        """After a processed step the pool has every update of the steps begun so far (begin_step
        defers them to the next process_output): its requests and retained blocks match the model."""
        in_flight = {request.id for _, entries in self.in_flight for request, _, _ in entries}
        assert self.cache.stats()["requests"] <= len(set(self.requests) | set(self.finishing) | in_flight)
        for block_hash in self.retained:
            assert self.cache.is_published(block_hash), "a retained block was evicted"

    def teardown(self) -> None:
        while self.in_flight:
            self.process_oldest()
        self.connector.close()


def test_connector_against_the_model():
    run_state_machine(ConnectorMachine, dict(max_examples=300, stateful_step_count=60))
    # The runs must have exercised what this test claims to check.
    for what in ("reattached", "rejected_rows", "finished_in_flight", "delivered_rows", "materialized",
                 "generations", "retained"):
        assert COVERAGE[what] > 0, (what, dict(COVERAGE))


def test_connector_against_the_model_on_the_array_paths(monkeypatch):
    """The same machine with every step on the array paths (``SMALL_BATCH`` 0): the
    connector's ``_commit`` and the cache's vectorised calls, which its few-request batches
    otherwise leave to the plain Python ones."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    COVERAGE.clear()
    run_state_machine(ConnectorMachine, dict(max_examples=150, stateful_step_count=60))
    for what in ("reattached", "rejected_rows", "finished_in_flight", "delivered_rows", "materialized"):
        assert COVERAGE[what] > 0, (what, dict(COVERAGE))


FORCED_STATE = {"small": True}  # what batch_size.stays_small answers in the switching machine


class SwitchingConnectorMachine(ConnectorMachine):
    """The machine with the connector's state moved between its per-request objects and its
    slot arrays at random steps (``batch_size.stays_small`` forced), outputs in flight or not."""

    @rule()
    def switch_state(self) -> None:
        FORCED_STATE["small"] = not FORCED_STATE["small"]
        COVERAGE["switches_in_flight" if self.in_flight else "switches"] += 1


def test_connector_against_the_model_across_state_switches(monkeypatch):
    monkeypatch.setattr(batch_size, "stays_small", lambda num_requests, small_now: FORCED_STATE["small"])
    COVERAGE.clear()
    run_state_machine(SwitchingConnectorMachine, dict(max_examples=150, stateful_step_count=60))
    for what in ("switches", "switches_in_flight", "reattached", "finished_in_flight", "delivered_rows"):
        assert COVERAGE[what] > 0, (what, dict(COVERAGE))
