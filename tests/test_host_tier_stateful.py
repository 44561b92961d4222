"""Stateful test of the host tier: random engine-shaped traffic on a tiny device pool with a
host tier, every read checked against the rows the tokens determine.

A Hypothesis ``RuleBasedStateMachine`` admits requests over a two-token alphabet (so prompts
share prefixes and prefix hits are common), takes prefix hits on published blocks (whole-prompt
hits included: the first capture then starts inside the last block), captures chunks, extends
requests as decoding does, reads single intervals and batches, finishes requests and retains
their blocks (as vLLM's scheduler does), releases retained blocks, imports blocks (as a decode
instance does with a prefill's rows), rolls requests back (within their rows or into their
prefix hits) and resets. The device pool is 3-6 pages, so retained
blocks are demoted to the host, read from there, seeded from there and evicted there all the
time. Checked after every rule, without modelling which page holds what:

- every read of a live request's captured interval succeeds and equals the rows its tokens
  determine (row p is a function of tokens[:p + 1], so a prefix block's rows are the same
  whichever request published them, on the device or on the host);
- a call refused with ``CacheFullError`` changes nothing (stats, device pages, host arena);
- a retained block, once published, stays published until it is released;
- the page accounting is consistent and the host holds at most ``host_pages`` blocks.

Runs are deterministic (``derandomize=True``); the test fails if a run stops demoting, reading
from the host, seeding from the host or evicting host blocks.
"""

import hashlib
from collections import Counter
from functools import lru_cache

import torch
from conftest import TEST_DEVICE, run_state_machine
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from routed_experts_cache import CacheFullError, RoutedExpertsCache

ROW_SHAPE = (2, 2)
MAX_LIVE = 3
# The same for both backends (seconds each): with smaller ones the deterministic runs missed host
# evictions or seeds from the host once roll-backs joined the rules.
BUDGETS = {
    "torch": dict(max_examples=100, stateful_step_count=100),
    "triton": dict(max_examples=150, stateful_step_count=100),
}


@lru_cache(maxsize=None)
def row_of(prefix: tuple) -> tuple:
    """Position len(prefix) - 1's row: a pure function of the tokens up to it."""
    return tuple(hashlib.blake2b(repr(prefix).encode(), digest_size=4).digest())


def rows_of(tokens: tuple, start: int, end: int) -> torch.Tensor:
    return torch.tensor([row_of(tokens[: p + 1]) for p in range(start, end)], dtype=torch.uint8).view(-1, *ROW_SHAPE)


@lru_cache(maxsize=None)
def hash_of(prefix: tuple) -> bytes:
    return hashlib.blake2b(repr(prefix).encode(), digest_size=8, person=b"block").digest()


class Request:
    def __init__(self, tokens: tuple, page_size: int):
        self.tokens, self.page_size = tokens, page_size
        self.cursor = 0
        self.first_start = 0  # where its first capture began (a prefix hit's end)
        self.num_hashes = 0

    def full_hashes(self) -> list[bytes]:
        size = self.page_size
        return [hash_of(self.tokens[: (i + 1) * size]) for i in range(len(self.tokens) // size)]


class HostTierMachine(RuleBasedStateMachine):
    BACKEND = "torch"
    COUNTS: Counter = Counter()

    @initialize(num_pages=st.integers(3, 6), host_pages=st.integers(1, 6), page_size=st.sampled_from([2, 3]),
                dtype=st.sampled_from([torch.uint8, torch.uint16]))  # uint16: more than 256 experts
    def setup(self, num_pages, host_pages, page_size, dtype):
        self.cache = RoutedExpertsCache(num_pages, page_size, ROW_SHAPE, dtype=dtype, device=TEST_DEVICE,
                                        backend=self.BACKEND, host_pages=host_pages)
        self.COUNTS[f"pool_{dtype}"] += 1
        self.page_size, self.host_pages = page_size, host_pages
        self.live: dict[str, Request] = {}
        self.retained: Counter = Counter()
        self.retained_published: set[bytes] = set()
        self.next_id = 0
        self.steps = 0
        self.COUNTS["examples"] += 1

    # ------------------------------------------------------------------ helpers

    def _state(self):
        return self.cache.stats(), self.cache.pages.clone(), self.cache.host_arena.clone()

    def _refused(self, before) -> None:
        stats, pages, host = self._state()
        assert stats == before[0] and torch.equal(pages, before[1]) and torch.equal(host, before[2])
        self.COUNTS["cache_full"] += 1

    def _give_hashes(self, rid: str, request: Request) -> None:
        hashes = request.full_hashes()[request.num_hashes :]
        self.cache.add_block_hashes(rid, hashes)
        request.num_hashes += len(hashes)

    def _capture(self, rid: str, request: Request, count: int) -> bool:
        """Capture ``count`` rows at the cursor; False (and nothing changed) if the pool is full."""
        before, host_reads = self._state(), self.cache.stats()["host_read_rows"]
        try:
            self.cache.capture(rid, request.cursor, rows_of(request.tokens, request.cursor, request.cursor + count))
        except CacheFullError:
            self._refused(before)
            return False
        request.cursor += count
        stats = self.cache.stats()
        self.COUNTS["demotions"] += stats["demotions"] > before[0]["demotions"]
        self.COUNTS["host_evictions"] += stats["host_evictions"] > before[0]["host_evictions"]
        if stats["host_read_rows"] > host_reads:
            self.COUNTS["seeds_from_host"] += 1
        return True

    def _drop(self, rid: str) -> None:
        self.cache.finish(rid)
        del self.live[rid]

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def admit(self, data):
        size = self.page_size
        tokens = tuple(data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=4 * size + 1)))
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(tokens, size)
        hashes = request.full_hashes()
        hit = 0
        while hit < len(hashes) and self.cache.is_published(hashes[hit]):
            hit += 1
        request.cursor = request.first_start = min(hit * size, len(tokens) - 1)  # a whole-prompt hit recomputes the last token
        if hit * size == len(tokens):
            self.COUNTS["whole_prompt_hits"] += 1
        elif hit:
            self.COUNTS["prefix_hits"] += 1
        self.live[rid] = request
        self._give_hashes(rid, request)
        chunk = data.draw(st.integers(1, len(tokens) - request.cursor))
        if not self._capture(rid, request, chunk):
            self._drop(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[rid]
        if request.cursor == len(request.tokens):  # decoding: new tokens, and the hashes of blocks they fill
            request.tokens += tuple(data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=self.page_size + 1)))
            self._give_hashes(rid, request)
        count = data.draw(st.integers(1, len(request.tokens) - request.cursor))
        if not self._capture(rid, request, count):
            self._drop(rid)  # preempted: its blocks stay published for a later hit

    @precondition(lambda self: any(r.cursor for r in self.live.values()))
    @rule(data=st.data())
    def read(self, data):
        intervals = []
        for rid in data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=3)):
            request = self.live[rid]
            if request.cursor:
                start = data.draw(st.integers(0, request.cursor - 1))
                intervals.append((rid, start, data.draw(st.integers(start + 1, request.cursor))))
        if not intervals:
            return
        host_reads = self.cache.stats()["host_read_rows"]
        if len(intervals) == 1:
            rid, start, end = intervals[0]
            got = [self.cache.read(rid, start, end)]
        else:
            packed, offsets = self.cache.read_batch(*(list(column) for column in zip(*intervals)))
            got = [packed[offsets[i] : offsets[i + 1]] for i in range(len(intervals))]
        for (rid, start, end), rows in zip(intervals, got):
            expected = rows_of(self.live[rid].tokens, start, end).to(self.cache.dtype)
            assert torch.equal(rows.cpu(), expected), f"{rid} [{start}, {end})"
        if self.cache.stats()["host_read_rows"] > host_reads:
            self.COUNTS["reads_from_host"] += 1

    @precondition(lambda self: self.steps % 4 == 2 and any(r.cursor for r in self.live.values()))  # now and then
    @rule(data=st.data())
    def rewind(self, data):
        """vLLM rolls a request back (its KV failed to load) and it recomputes from there: within
        its own rows, or back into its prefix hit on a block boundary. Skipped where a block it
        may have published is retained or read by another live request: those lose it (fail
        closed, test_cache.py), which this machine's reads and retention check do not model."""
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.live.items() if q.cursor)))
        request, size = self.live[rid], self.page_size
        own_start = request.first_start // size * size
        if own_start and data.draw(st.booleans()):
            position = data.draw(st.integers(0, own_start // size)) * size
        else:
            position = data.draw(st.integers(own_start, request.cursor))
        dropped = set(request.full_hashes()[max(position, own_start) // size : request.cursor // size])
        read_by_others = {h for other, q in self.live.items() if other != rid for h in q.full_hashes()[: q.first_start // size]}
        if dropped & (read_by_others | set(self.retained)):
            return
        self.cache.rewind(rid, position)
        request.cursor = position
        request.first_start = min(request.first_start, position)
        self.COUNTS["rewinds"] += 1
        self.COUNTS["rewinds_into_prefix"] += position < own_start

    @precondition(lambda self: self.live)
    @rule(data=st.data(), retain=st.booleans())
    def finish(self, data, retain):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[rid]
        hashes = request.full_hashes()[: request.cursor // self.page_size]
        self._drop(rid)
        if retain:  # the scheduler retains a finished request's blocks, once each
            new = [h for h in dict.fromkeys(hashes) if not self.retained[h]]
            self.cache.retain(new)
            self.retained.update(new)
            self.COUNTS["retains"] += bool(new)

    @precondition(lambda self: self.retained)
    @rule(data=st.data())
    def release(self, data):
        hashes = data.draw(st.lists(st.sampled_from(sorted(self.retained)), min_size=1, max_size=3, unique=True))
        self.cache.release(hashes)
        for block_hash in hashes:
            del self.retained[block_hash]
            self.retained_published.discard(block_hash)
        self.COUNTS["releases"] += 1

    @precondition(lambda self: self.steps % 5 == 0)  # now and then, as decode instances import
    @rule(data=st.data())
    def import_blocks(self, data):
        size = self.page_size
        tokens = tuple(data.draw(st.lists(st.integers(0, 1), min_size=size, max_size=3 * size)))
        num_blocks = len(tokens) // size
        hashes = [hash_of(tokens[: (i + 1) * size]) for i in range(num_blocks)]
        before = self._state()
        try:
            self.cache.import_blocks(hashes, rows_of(tokens, 0, num_blocks * size))
        except CacheFullError:
            self._refused(before)
            return
        self.COUNTS["imports"] += 1

    @precondition(lambda self: self.steps % 30 == 29)
    @rule()
    def reset(self):
        self.cache.reset()
        self.live.clear()
        self.retained.clear()
        self.retained_published.clear()
        self.COUNTS["resets"] += 1

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.steps += 1
        self.COUNTS["steps"] += 1
        self.cache.check_consistency()
        stats = self.cache.stats()
        assert 0 <= stats["demoted"] <= self.host_pages
        if stats["demoted"]:
            self.COUNTS["steps_with_host_blocks"] += 1
        for block_hash in self.retained:
            if self.cache.is_published(block_hash):
                self.retained_published.add(block_hash)
        lost = [h.hex() for h in self.retained_published if not self.cache.is_published(h)]
        assert not lost, f"retained blocks lost their rows: {lost}"


def test_the_host_tier_under_random_traffic(backend):
    counts = Counter()
    machine = type(f"HostTierMachine_{backend}", (HostTierMachine,), {"BACKEND": backend, "COUNTS": counts})
    run_state_machine(machine, BUDGETS[backend])
    print(f"\n[{backend}] " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()) if not k.startswith("_")))
    for what in ("demotions", "reads_from_host", "seeds_from_host", "whole_prompt_hits", "prefix_hits",
                 "cache_full", "imports", "releases", "host_evictions", "resets", "rewinds", "rewinds_into_prefix",
                 "pool_torch.uint8", "pool_torch.uint16"):
        assert counts[what] > 0, f"the state machine never exercised {what}: {dict(counts)}"
