"""The capture journal (``RoutedExpertsCache(journal_rows=...)``): continuing capture steps whose
page planning waits in a ring leave the cache exactly as the same calls planned at once.

A random engine-like workload makes the step calls the vLLM connector makes (``slots_step``,
``add_block_hashes_step`` with prompt hashes and with hashes that arrive late, ``capture_step``
with arrivals, prefix hits, decode and speculative rows between rejected ones, ``pin_step``,
``read_step``, ``finish``, ``rewind``) on two caches, one with the journal and one without,
over a pool small enough to evict and, with a host tier, to demote. Every call's result or
error must agree, and every few steps (where the journaled cache flushes) every observable:
``stats()``, ``page_states()``, the published index, ``check_consistency()``, every live
request's rows and every published block's rows.
"""

import hashlib

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from routed_experts_cache import CacheFullError, RangeUnavailableError, RoutedExpertsCache, RoutedExpertsCacheError
from routed_experts_cache.connector import batch_size

PAGE = 4
ROW_SHAPE = (3, 2)
PREFIXES = [tuple(range(100 * k, 100 * k + 12)) for k in range(3)]  # shared prompt starts: prefix hits


def row_of(tokens: tuple) -> np.ndarray:
    """The routing row of the last token: a fixed function of the token prefix."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=6).digest()
    return np.frombuffer(digest, dtype=np.uint8).reshape(ROW_SHAPE)


def block_hash(tokens: tuple, block: int) -> bytes:
    return hashlib.blake2b(repr(tokens[: (block + 1) * PAGE]).encode(), digest_size=8).digest()


class Twin:
    """The same calls on a journaled cache and an eager one; results and errors must agree."""

    def __init__(self, num_pages: int, host_pages: int, dtype: torch.dtype, backend: str) -> None:
        self.journaled, self.eager = (
            RoutedExpertsCache(num_pages, PAGE, ROW_SHAPE, dtype=dtype, device=TEST_DEVICE, backend=backend,
                               host_pages=host_pages, journal_rows=journal_rows)
            for journal_rows in (256, 0)
        )
        self.flushed_steps = []  # capture steps per flush that had more than one

        def counted(flush=self.journaled._flush):
            steps = sum(1 for entry in self.journaled._journal.entries if entry[0] == "capture")
            if steps > 1:
                self.flushed_steps.append(steps)
            flush()

        self.journaled._flush = counted

    def call(self, name: str, *args, **kwargs):
        outcomes = []
        for cache in (self.journaled, self.eager):
            try:
                outcomes.append(("ok", getattr(cache, name)(*args, **kwargs)))
            except (CacheFullError, RangeUnavailableError) as error:
                outcomes.append((type(error).__name__, str(error)))
        (kind, result), (eager_kind, eager_result) = outcomes
        assert kind == eager_kind, f"{name}: journaled {kind} {result!r}, eager {eager_kind} {eager_result!r}"
        if kind == "ok" and name == "read_step":
            assert torch.equal(result[0].cpu(), eager_result[0].cpu()) and np.array_equal(result[1], eager_result[1])
        elif kind != "ok":
            assert result == eager_result
        return kind, eager_result

    def compare_everything(self, live: dict) -> None:
        journaled, eager = self.journaled, self.eager
        assert journaled.stats() == eager.stats()
        assert journaled.page_states() == eager.page_states()
        assert journaled._pages.published == eager._pages.published
        assert list(journaled._pages.evictable) == list(eager._pages.evictable)
        journaled.check_consistency()
        ids = [rid for rid, r in live.items() if r["captured"]]
        if ids:
            starts = np.array([live[rid]["first"] for rid in ids], dtype=np.int64)
            ends = np.array([live[rid]["cursor"] for rid in ids], dtype=np.int64)
            kind, (rows, offsets) = self.call("read_step", ids, eager.slots(ids), starts, ends)
            assert kind == "ok"
            for rid, lo, hi in zip(ids, offsets[:-1].tolist(), offsets[1:].tolist()):
                tokens, first = live[rid]["tokens"], live[rid]["first"]
                expected = np.array([row_of(tokens[: p + 1]) for p in range(first, live[rid]["cursor"])],
                                    dtype=np.int64).reshape(-1, *ROW_SHAPE)
                assert np.array_equal(rows[lo:hi].cpu().numpy().astype(np.int64), expected), rid


def run_workload(twin: Twin, seed: int, steps: int, retain_rate: float) -> dict:
    """Drive both caches like an engine; return what the run exercised."""
    rng = np.random.default_rng(seed)
    live, retained, next_id, exercised = {}, [], 0, {"cache_full": 0, "reads": 0, "rewinds": 0}
    for step in range(steps):
        arrivals = []
        if not live or rng.random() < 0.12:
            for _ in range(int(rng.integers(1, 3))):
                rid = f"r{next_id}"
                next_id += 1
                prompt = PREFIXES[int(rng.integers(len(PREFIXES)))][: int(rng.integers(4, 13))]
                tokens = prompt + tuple(int(t) for t in rng.integers(0, 50, int(rng.integers(4, 24))))
                twin.call("slots_step", [rid])
                given = len(prompt) // PAGE if rng.random() < 0.7 else 0  # else its prefix's hashes come late
                twin.call("add_block_hashes_step", [rid], [[block_hash(tokens, b) for b in range(given)]])
                hit = 0  # a prefix hit: the published blocks of its prompt (as the engine's KV cache would have)
                while hit < len(prompt) // PAGE and twin.eager.is_published(block_hash(tokens, hit)) and (hit + 1) * PAGE < len(prompt):
                    hit += 1
                live[rid] = {"tokens": tokens, "cursor": hit * PAGE, "first": hit * PAGE, "given": given,
                             "captured": False}
                arrivals.append(rid)
        # One step: arrivals' prompts (maybe chunked), the others' decode rows (with drafts).
        ids, spans, parts, offset = [], [], [], 0
        for rid in sorted(live, key=lambda _: rng.random()):
            r = live[rid]
            left = len(r["tokens"]) - r["cursor"]
            if not left:
                continue
            count = min(left, int(rng.integers(1, 9)) if not r["captured"] else int(rng.integers(0, 4)))
            pad = int(rng.integers(0, 3))  # rejected drafts between the spans
            parts.append(np.zeros((pad, *ROW_SHAPE), dtype=np.int64))
            parts.append(np.array([row_of(r["tokens"][: p + 1]) for p in range(r["cursor"], r["cursor"] + count)],
                                  dtype=np.int64).reshape(count, *ROW_SHAPE))
            ids.append(rid)
            spans.append((r["cursor"], offset + pad, count))
            offset += pad + count
        if ids:
            source = torch.from_numpy(np.concatenate(parts)).to(TEST_DEVICE)
            starts, source_starts, counts = (np.array(column, dtype=np.int64) for column in zip(*spans))
            order = list(ids) if rng.random() < 0.5 else None
            kind, _ = twin.call("capture_step", source, ids, twin.eager.slots(ids), starts, source_starts, counts, order)
            if kind == "ok":
                for rid, (start, _, count) in zip(ids, spans):
                    live[rid]["cursor"] = start + count
                    live[rid]["captured"] = live[rid]["captured"] or count > 0
            else:
                exercised["cache_full"] += 1
        # Hashes of full blocks, some of them late.
        late = [rid for rid, r in live.items() if r["cursor"] // PAGE > r["given"] and rng.random() < 0.6]
        if late:
            lists = []
            for rid in late:
                r = live[rid]
                lists.append([block_hash(r["tokens"], b) for b in range(r["given"], r["cursor"] // PAGE)])
                r["given"] = r["cursor"] // PAGE
            twin.call("add_block_hashes_step", late, lists)
        if rng.random() < 0.05 and live:  # an abort
            rid = list(live)[int(rng.integers(len(live)))]
            twin.call("finish", rid)
            del live[rid]
        done = [rid for rid, r in live.items() if r["cursor"] == len(r["tokens"]) and rng.random() < 0.5]
        for rid in done:
            twin.call("finish", rid)
            del live[rid]
        if rng.random() < retain_rate:  # the scheduler's pins: retain published blocks, release older ones
            published = list(twin.eager._pages.published)
            retain = [published[i] for i in rng.integers(0, len(published), 3).tolist()] if published else []
            release = retained[:1] if rng.random() < 0.5 else []
            twin.call("pin_step", retain, release)
            retained = retained[1:] + retain
        if rng.random() < 0.08 and live:
            rid = list(live)[int(rng.integers(len(live)))]
            lo = int(rng.integers(0, live[rid]["cursor"] + 1))
            twin.call("read_step", [rid], twin.eager.slots([rid]), np.array([lo], np.int64),
                      np.array([live[rid]["cursor"]], np.int64))
            exercised["reads"] += 1
        if rng.random() < 0.03 and live:
            rid = list(live)[int(rng.integers(len(live)))]
            r = live[rid]
            if r["captured"] and r["cursor"] > r["first"]:
                position = int(rng.integers(r["first"], r["cursor"]))
                twin.call("rewind", rid, position)
                r["cursor"] = position  # its hashes stay known: they are the tokens'

                exercised["rewinds"] += 1
        if step % 12 == 11:
            twin.compare_everything(live)
    twin.compare_everything(live)
    return exercised


@pytest.mark.parametrize("host_pages", [0, 6], ids=["device-only", "host-tier"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int32], ids=str)
@pytest.mark.parametrize("path", ["small-batch", "array"])
def test_journaled_steps_leave_the_cache_as_steps_planned_at_once(backend, monkeypatch, host_pages, dtype, path):
    if path == "array":
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)  # every step through capture_step's array path
    twin = Twin(num_pages=40, host_pages=host_pages, dtype=dtype, backend=backend)
    # With a host tier the scheduler retains more: blocks pinned by retains alone leave the device by demotion.
    exercised = run_workload(twin, seed=7, steps=200, retain_rate=0.3 if host_pages else 0.08)
    stats = twin.eager.stats()
    # What the run must have covered for the comparison to mean something.
    assert len(twin.flushed_steps) >= 10 and max(twin.flushed_steps) >= 5, twin.flushed_steps
    assert stats["evictions"] > 0 and stats["prefix_hit_rows"] > 0 and stats["published_blocks"] > 10
    assert exercised["reads"] > 5 and exercised["rewinds"] > 0
    if host_pages:
        assert stats["demotions"] > 0


def test_every_call_but_the_journaled_ones_flushes_first(backend):
    """A journaled step is in the pool (its rows readable, its blocks published, its pages in
    the stats) for every other call: each of them finds the journal empty when it looks."""
    calls = {
        "capture_batch": lambda c: c.capture_batch(torch.zeros((1, *ROW_SHAPE), dtype=torch.int64), ["b"], [0], [0], [1]),
        "capture": lambda c: c.capture("b", 0, torch.zeros((1, *ROW_SHAPE), dtype=torch.int64)),
        "add_block_hashes": lambda c: c.add_block_hashes("a", []),
        "add_block_hashes_batch": lambda c: c.add_block_hashes_batch(["a"], [[]]),
        "add_block_hashes_step of a new request (pins)": lambda c: c.add_block_hashes_step(["new"], [[b"x"]]),
        "retain": lambda c: c.retain([b"x"]),
        "release": lambda c: (c.retain([b"x"]), c.release([b"x"])),
        "pin_step": lambda c: c.pin_step([b"x"], []),
        "import_blocks": lambda c: c.import_blocks([b"y"], torch.zeros((PAGE, *ROW_SHAPE), dtype=torch.int64)),
        "read": lambda c: c.read("a", 0, 1),
        "read_batch": lambda c: c.read_batch(["a"], [0], [1]),
        "read_step": lambda c: c.read_step(["a"], c.slots(["a"]), np.array([0]), np.array([1])),
        "finish": lambda c: c.finish("a"),
        "rewind": lambda c: c.rewind("a", 1),
        "is_published": lambda c: c.is_published(b"x"),
        "page_states": lambda c: c.page_states(),
        "stats": lambda c: c.stats(),
        "check_consistency": lambda c: c.check_consistency(),
    }
    for name, call in calls.items():
        cache = RoutedExpertsCache(8, PAGE, ROW_SHAPE, device=TEST_DEVICE, backend=backend, journal_rows=16)
        rows = torch.arange(2 * 6, dtype=torch.int64).reshape(2, *ROW_SHAPE)
        slots = cache.slots(["a"])
        cache.capture_step(rows[:1], ["a"], slots, np.array([0]), np.array([0]), np.array([1]))  # a first capture: now
        cache.capture_step(rows[1:], ["a"], slots, np.array([1]), np.array([0]), np.array([1]))  # journaled
        assert cache._journal.entries, name
        call(cache)
        assert not cache._journal.entries, f"{name} ran with a journaled step not in the pool"


def test_a_step_the_journal_cannot_hold_is_captured_at_once(backend):
    """Journaling stops where waiting could change what happens: past ``max_position`` (the
    refusal comes from the call itself), more rows than a quarter of the ring, blocks the pool
    may have no room for; the journal keeps nothing then."""
    cache = RoutedExpertsCache(2, PAGE, ROW_SHAPE, device=TEST_DEVICE, backend=backend, journal_rows=16, max_position=12)
    rows = torch.arange(8 * 6, dtype=torch.int64).reshape(8, *ROW_SHAPE)
    slots = cache.slots(["a"])

    def step(start, count):
        cache.capture_step(rows[:count], ["a"], slots, np.array([start]), np.array([0]), np.array([count]))

    step(0, 1)  # a first capture
    step(1, 1)
    assert len(cache._journal.entries) == 1
    step(2, 5)  # 5 rows: more than a quarter of 16
    assert not cache._journal.entries and cache.stats()["captured_rows"] == 7
    step(7, 1)  # up to one new block, and no page free: captured now
    assert not cache._journal.entries
    with pytest.raises(Exception, match="max_position|outside"):
        step(8, 5)
    assert cache.stats()["captured_rows"] == 8
    assert torch.equal(cache.read("a", 0, 8), rows[[0, 0, 0, 1, 2, 3, 4, 0]].to(torch.uint8))


def test_hashes_that_pin_apply_at_once_so_a_capture_past_the_room_is_refused_in_its_own_call(backend):
    """A late prefix hash pins its block, which then is no longer evictable: the pool's room
    shrinks. Were that hash step journaled, the room a later step is checked against would be
    stale, and that step journaled where the eager cache refuses it."""
    twin = Twin(num_pages=5, host_pages=0, dtype=torch.uint8, backend=backend)
    for cache in (twin.journaled, twin.eager):
        cache._journal.ring = cache._journal.ring[:16]  # a quarter: steps of up to 4 rows wait
    rows = torch.arange(12 * 6, dtype=torch.int64).reshape(12, *ROW_SHAPE)
    hashes = [b"h0", b"h1", b"h2"]

    def step(rid, start, count):
        return twin.call("capture_step", rows[:count], [rid], twin.eager.slots([rid]), np.array([start]), np.array([0]),
                         np.array([count]))[0]

    twin.call("slots_step", ["p", "q", "a"])
    twin.call("add_block_hashes_step", ["p"], [hashes])
    assert step("p", 0, 12) == "ok"
    twin.call("finish", "p")  # h0, h1, h2 evictable; 2 pages free
    assert step("q", 12, 1) == step("a", 0, 1) == "ok"  # first captures: no page free, 3 evictable
    assert step("a", 1, 1) == "ok" and twin.journaled._journal.entries  # journaled: at most 1 new page
    twin.call("add_block_hashes_step", ["q"], [hashes])  # q's prefix: pins h0, h1 and h2, the room is 0
    assert step("a", 2, 4) == "CacheFullError"  # its second block has no page to take
    twin.compare_everything({})


def test_a_flush_that_takes_a_retained_blocks_page_demotes_its_rows_to_the_host_first(backend):
    """With no page free or evictable, a journaled block's page comes from demoting a block the
    scheduler retains: its rows must reach the host before the flush's copy overwrites the page."""
    twin = Twin(num_pages=3, host_pages=2, dtype=torch.uint8, backend=backend)
    rows = torch.arange(8 * 6, dtype=torch.int64).reshape(8, *ROW_SHAPE)
    hashes = [b"h0", b"h1"]
    twin.call("slots_step", ["p", "a"])
    twin.call("add_block_hashes_step", ["p"], [hashes])
    twin.call("capture_step", rows, ["p"], twin.eager.slots(["p"]), np.array([0]), np.array([0]), np.array([8]))
    twin.call("finish", "p")
    twin.call("pin_step", hashes, [])  # retained: demotable, not evictable
    for start, count in ((0, 1), (1, 3), (4, 1)):  # a first capture, then two journaled steps
        twin.call("capture_step", rows[:count].flip(0), ["a"], twin.eager.slots(["a"]), np.array([start]), np.array([0]),
                  np.array([count]))
    assert len(twin.journaled._journal.entries) == 2
    twin.call("slots_step", ["reader"])
    twin.call("add_block_hashes_step", ["reader"], [hashes])
    kind, (read, _) = twin.call("read_step", ["reader"], twin.eager.slots(["reader"]), np.array([0]), np.array([8]))
    assert kind == "ok" and torch.equal(read.cpu(), rows.to(torch.uint8))
    assert twin.eager.stats()["demotions"] == 1
    twin.compare_everything({})


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", None, np.int64(4)])
def test_a_bad_ring_size_is_refused(backend, bad):
    with pytest.raises(RoutedExpertsCacheError, match=r"journal_rows must be an int >= 0"):
        RoutedExpertsCache(4, PAGE, ROW_SHAPE, backend=backend, journal_rows=bad)
