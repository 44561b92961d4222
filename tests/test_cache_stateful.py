"""Stateful reliability test: RoutedExpertsCache driven against a plain-Python model.

A Hypothesis ``RuleBasedStateMachine`` plays an engine: requests whose tokens share prefixes
(so chained block hashes collide across requests), random capture chunks (1 .. 2 * page size,
single and batched), block hashes that become available only ``L`` (0-2) tokens past the
block end and then arrive some steps late, prefix attaches on published blocks, duplicate
publication, single and batched reads, finish / abort / preemption with restarts of the same
id, ``retain`` / ``release``, ``reset()``, and a small pool so eviction and ``CacheFullError``
happen all the time.

The model is written from the documented behaviour, not from the cache's internals:

- a request's rows are a pure function of its tokens (row p from the token prefix [:p+1]);
- a request's own captured rows are always present; a prefix row (before its first capture,
  or before its known hashes if it never captured) is present iff the block's hash was given
  to the request and is published. A request starts past block 0 only on a prefix hit (blocks
  published at admission); the hit's hashes usually come with it, sometimes later;
- published hashes are pinned by every live request given them and by ``retain``; unpinned
  published hashes are evicted oldest-unpinned first (a request's pins are dropped in reverse
  block order on finish), and only when no free page is left;
- a capture needs one new page per block it starts; it fails with ``CacheFullError`` iff that
  is more than free + evictable pages, and a failed call changes nothing.

With the index, pins and LRU order modelled exactly, every ``stats()`` field is predicted and
compared after every step, every read either equals the model's rows or raises
``RangeUnavailableError`` exactly when the model says a row is missing (and then changes
nothing), every capture succeeds or raises ``CacheFullError`` exactly as the model predicts,
and after every step one gather reads back every live request's held rows and every published
hash (pinned or evictable) and compares them with the model.

Runs are deterministic (``derandomize=True``, no example database); the test prints what it
exercised (with ``-s``) and fails if a run stops exercising one of the behaviours above.
"""

import hashlib
from collections import Counter, OrderedDict
from functools import lru_cache

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE, run_state_machine
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from routed_experts_cache.connector import batch_size
from routed_experts_cache.connector import cache as cache_module
from routed_experts_cache import (
    CacheFullError,
    InvalidCaptureError,
    RangeUnavailableError,
    RoutedExpertsCache,
    RoutedExpertsCacheError,
)

# (row_shape, pool dtype): one-byte routing ids, two-byte ones (more than 256 experts, as
# Kimi-K2's 384), and a wide signed pool with odd-sized rows
ROW_CONFIGS = (((3, 2), torch.uint8), ((2, 3), torch.uint16), ((5,), torch.int32))
MAX_LIVE = 4
BASE_LEN = 32  # tokens of each shared prefix family
PROBE_ID = "__probe__"
GHOST_ID = "ghost"
RESET_EVERY = 20  # a reset is allowed only this many steps after the previous one

# per-backend example budgets: together ~thousands of steps; the Triton interpreter is slower
# (triton 80: with the capture_step draw added, 60 derandomized examples no longer reached a
# preemption on that backend)
BUDGETS = {
    "torch": dict(max_examples=300, stateful_step_count=50),
    "triton": dict(max_examples=80, stateful_step_count=40),
}


# ------------------------------------------------------------------ the token model


@lru_cache(maxsize=None)
def token_rows(tokens: tuple, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """int64 rows [len(tokens), *row_shape]: row p is a hash of tokens[:p+1] (routing is a
    function of the prefix), values in the pool dtype's range."""
    numel = 1
    for d in row_shape:
        numel *= d
    width, out = dtype.itemsize, []  # ids over the pool dtype's whole range
    for p in range(len(tokens)):
        digest = hashlib.blake2b(repr(tokens[: p + 1]).encode(), digest_size=width * numel).digest()
        out.append([int.from_bytes(digest[width * i : width * (i + 1)], "little", signed=dtype.is_signed)
                    for i in range(numel)])
    return torch.tensor(out, dtype=torch.int64).view(len(tokens), *row_shape)


@lru_cache(maxsize=None)
def block_hashes(tokens: tuple, page_size: int) -> tuple:
    """vLLM-style chained hashes: hash_b = H(hash_{b-1}, tokens of block b), full blocks only."""
    hashes, parent = [], b"root"
    for b in range(len(tokens) // page_size):
        block = repr(tokens[b * page_size : (b + 1) * page_size]).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return tuple(hashes)


class ModelRequest:
    def __init__(self, rid, tokens, prompt_len, start, page_size, row_shape, dtype):
        self.rid = rid
        self.tokens = tokens
        self.rows = token_rows(tokens, row_shape, dtype)  # int64
        self.hashes = block_hashes(tokens, page_size)
        self.prompt_len = prompt_len
        self.start = start  # first capture position (k blocks of prefix hit)
        self.given = 0  # hashes delivered to the cache
        self.registered = False  # known to the cache (add_block_hashes or a capture)
        self.first_block = None
        self.cursor = 0
        self.own = []  # per own block: "pub" (its page is the published one), "dup", or None (unsettled)
        self.num_settled = 0
        self.hit_pinned = True  # the prefix-hit hashes were given at admission (else: late)

    @property
    def next_start(self) -> int:
        return self.start if self.first_block is None else self.cursor


def blocks_touched(cursor: int, end: int, page_size: int) -> int:
    return -(-end // page_size) - -(-cursor // page_size)


# ------------------------------------------------------------------ the machine


class CacheMachine(RuleBasedStateMachine):
    BACKEND = "torch"
    COUNTS: Counter = Counter()

    def __init__(self):
        super().__init__()
        self.cache = None

    # ---------------------------------------------------------------- model core

    def _model_clear(self):
        self.index: dict[bytes, None] = {}  # published hashes (insertion order, for determinism)
        self.evictable: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.pins: Counter = Counter()
        self.retained: Counter = Counter()
        self.live: dict[object, ModelRequest] = {}
        self.counters = Counter()

    @initialize(
        num_pages=st.integers(8, 20),
        page_size=st.sampled_from([4, 3]),
        row_config=st.sampled_from(ROW_CONFIGS),
        lookahead=st.integers(0, 2),
        prompt_hashes_early=st.booleans(),
    )
    def setup(self, num_pages, page_size, row_config, lookahead, prompt_hashes_early):
        self.num_pages, self.ps = num_pages, page_size
        self.row_shape, self.dtype = row_config
        self.lookahead = lookahead
        # True: the hasher sees the whole prompt up front (vLLM computes prompt block hashes at
        # admission); False: a block's hash exists only once L tokens past it are captured
        self.prompt_hashes_early = prompt_hashes_early
        self.cache = RoutedExpertsCache(
            num_pages, page_size, self.row_shape, dtype=self.dtype, device=TEST_DEVICE, backend=self.BACKEND
        )
        self.generation = 0
        self._model_clear()
        self.finished: dict[object, tuple] = {}  # id -> (tokens, prompt_len) for restarts
        self.hash_rows: dict[bytes, torch.Tensor] = {}  # every hash seen -> its block's rows
        self.next_id = 0
        self.steps_since_reset = 0
        self.COUNTS["examples"] += 1
        self.COUNTS[f"config_ps{page_size}_L{lookahead}_{'early' if prompt_hashes_early else 'late'}"] += 1
        self.COUNTS[f"pool_{self.dtype}"] += 1

    def _count(self, name):
        self.COUNTS[name] += 1

    def _free(self) -> int:
        private = sum(1 for r in self.live.values() for s in r.own if s != "pub")
        return self.num_pages - len(self.index) - private

    def _pin(self, hashes):
        for h in hashes:
            self.pins[h] += 1
            self.evictable.pop(h, None)

    def _unpin(self, hashes):
        for h in hashes:
            self.pins[h] -= 1
            if self.pins[h] == 0:
                del self.pins[h]
                if h in self.index:
                    self.evictable[h] = None

    def _settle(self, r: ModelRequest):
        if r.first_block is None:
            return
        while True:
            b = r.first_block + r.num_settled
            if b >= r.cursor // self.ps or b >= r.given:
                return
            h = r.hashes[b]
            if h in self.index and h not in self.evictable:  # pinned: the request keeps its copy
                r.own[r.num_settled] = "dup"
                self._count("duplicate_blocks")
            else:  # new, or replacing an unpinned page (freed): the request's page is published
                if h in self.index:
                    del self.index[h]
                    del self.evictable[h]
                    self._count("replaced_blocks")
                self.index[h] = None
                r.own[r.num_settled] = "pub"
                self.counters["published_blocks"] += 1
                self._pin([h])
            r.num_settled += 1

    def _pinned_by(self, r: ModelRequest) -> list:
        """Hashes a live request pins, in block order: prefix blocks and own published pages."""
        if r.first_block is None:
            return list(r.hashes[: r.given])
        own = [r.hashes[r.first_block + i] for i, s in enumerate(r.own) if s == "pub"]
        return list(r.hashes[: min(r.first_block, r.given)]) + own

    def _give(self, r: ModelRequest, n: int):
        self.cache.add_block_hashes(r.rid, list(r.hashes[r.given : r.given + n]))
        self._model_give(r, n)

    def _model_give(self, r: ModelRequest, n: int):
        hs = list(r.hashes[r.given : r.given + n])
        r.registered = True
        r.given += n
        # pinned: the blocks read through the index (all, before the first capture)
        self._pin(hs if r.first_block is None else hs[: max(0, r.first_block - (r.given - n))])
        self._settle(r)

    def _available_hashes(self, r: ModelRequest) -> int:
        known = max(r.prompt_len, r.cursor) if self.prompt_hashes_early else r.cursor
        avail = sum(1 for b in range(len(r.hashes)) if (b + 1) * self.ps + self.lookahead <= known)
        return max(avail, r.given, r.start // self.ps)  # prefix-hit hashes are known at admission

    def _present(self, rid, start, end) -> bool:
        """The model's answer: are rows [start, end) of ``rid`` all present?"""
        r = self.live.get(rid)
        if r is None or not r.registered or not 0 <= start <= end:
            return False
        if start == end:
            return True
        ps = self.ps
        own_start = r.first_block * ps if r.first_block is not None else r.given * ps
        for b in range(start // ps, (end - 1) // ps + 1):
            if b * ps >= own_start:  # own block: captured rows only
                if min(end, (b + 1) * ps) > r.cursor:
                    return False
            elif not (b < r.given and r.hashes[b] in self.index):  # prefix block: via the index
                return False
        return True

    def _model_stats(self) -> dict:
        states = Counter()
        for r in self.live.values():
            for offset, s in enumerate(r.own):
                if s is not None:
                    states["duplicate" if s == "dup" else "published_own"] += 1
                elif (r.first_block + offset + 1) * self.ps <= r.cursor:
                    states["pending"] += 1
                else:
                    states["tail"] += 1
        return {
            "num_pages": self.num_pages,
            "page_size": self.ps,
            "free": self._free(),
            "tail": states["tail"],
            "pending": states["pending"],
            "duplicate": states["duplicate"],
            "published": len(self.index),
            "evictable": len(self.evictable),
            "pinned_hashes": len(self.pins),
            "requests": sum(1 for r in self.live.values() if r.registered),
            "generation": self.generation,
            "evictions": self.counters["evictions"],
            "host_pages": 0, "demoted": 0, "demotions": 0, "host_evictions": 0, "host_read_rows": 0,  # no host tier in this model
            "imported_rows": 0,
            "published_blocks": self.counters["published_blocks"],
            "prefix_hit_rows": self.counters["prefix_hit_rows"],
            "captured_rows": self.counters["captured_rows"],
            "read_rows": self.counters["read_rows"],
            "rewound_rows": self.counters["rewound_rows"],
        }

    def _snapshot(self):
        return self.cache.stats(), self.cache.pages.clone()

    def _assert_unchanged(self, snapshot):
        stats, pages = snapshot
        assert self.cache.stats() == stats
        assert torch.equal(self.cache.pages, pages)

    def _expected(self, rid, start, end) -> torch.Tensor:
        return self.live[rid].rows[start:end].to(self.dtype)

    def _pick_live(self, data, only=None):
        ids = [rid for rid, r in self.live.items() if only is None or only(r)]
        return self.live[data.draw(st.sampled_from(ids))] if ids else None

    # ---------------------------------------------------------------- requests

    # Hypothesis picks among enabled rules uniformly and, per example, switches a random share
    # of rule *names* off (swarm testing). The engine's main moves (admit, capture) therefore
    # come as several differently named rules: more weight, and rarely all switched off.

    @precondition(lambda self: self.cache is not None and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def admit(self, data):
        self._admit(data, restart=False)

    @precondition(lambda self: self.cache is not None and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def admit_2(self, data):
        self._admit(data, restart=False)

    @precondition(lambda self: self.cache is not None and len(self.live) < MAX_LIVE and self.finished)
    @rule(data=st.data())
    def restart(self, data):
        self._admit(data, restart=True)

    def _admit(self, data, restart):
        """Admit a request (fresh id, or a finished id restarting); prefix-attach on a KV hit."""
        self._count("steps")
        if restart:
            rid = data.draw(st.sampled_from(sorted(self.finished, key=str)), label="rid")
            tokens, prompt_len = self.finished.pop(rid)
            self._count("restarts")
        else:
            n = self.next_id
            self.next_id += 1
            rid = n if n % 3 == 2 else f"r{n}"  # ids are str or int
            family = data.draw(st.integers(0, 2), label="family")
            nblocks = data.draw(st.integers(0, BASE_LEN // self.ps), label="prefix_blocks")
            extra = data.draw(st.sampled_from([0, 0, 1, self.ps - 1]), label="prefix_extra")
            plen = min(BASE_LEN, nblocks * self.ps + extra)
            suffix = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=12), label="suffix")
            tokens = tuple(1000 * (family + 1) + i for i in range(plen)) + tuple(suffix)
            prompt_len = data.draw(st.integers(1, len(tokens)), label="prompt_len")
            if prompt_len >= self.ps and data.draw(st.booleans(), label="prompt_of_whole_blocks"):
                prompt_len -= prompt_len % self.ps  # all of it can be a prefix hit
        r = ModelRequest(rid, tokens, prompt_len, 0, self.ps, self.row_shape, self.dtype)
        for b, h in enumerate(r.hashes):
            self.hash_rows.setdefault(h, r.rows[b * self.ps : (b + 1) * self.ps].to(self.dtype))

        # a KV prefix hit: only on blocks whose hashes the hasher has from the prompt and that are
        # published now. A hit on the whole prompt recomputes its last token: the first capture
        # starts inside the last block, whose own page begins as a copy of the published one.
        hit = 0
        while (
            hit < len(r.hashes)
            and (hit + 1) * self.ps + self.lookahead <= prompt_len
            and r.hashes[hit] in self.index
        ):
            hit += 1
        if hit and hit * self.ps == prompt_len and data.draw(st.booleans(), label="whole_prompt"):
            k = hit  # as often as the other hits together: few prompts allow it
        else:
            k = data.draw(st.integers(0, hit), label="hit_blocks")
        whole_prompt = k * self.ps == prompt_len
        r.start = prompt_len - 1 if whole_prompt else k * self.ps
        self.live[rid] = r
        prompt_avail = sum(1 for b in range(len(r.hashes)) if (b + 1) * self.ps + self.lookahead <= prompt_len)
        top = prompt_avail if self.prompt_hashes_early else k
        if whole_prompt:
            self._count("whole_prompt_hits")
        if k and not whole_prompt and data.draw(st.integers(0, 3), label="hit_hashes_late") == 0:
            # some of the hit's hashes reach the cache after its first capture: until they
            # arrive those blocks are unreadable and unpinned (they may even be evicted meanwhile)
            given = k - 1 - data.draw(st.integers(0, k - 1), label="missing")
            r.hit_pinned = False
            self._count("late_hit_hashes")
        else:
            given = data.draw(st.integers(k, max(k, top)), label="given")
        if given or data.draw(st.booleans(), label="register_empty"):
            self._give(r, given)
        if k:
            self._count("prefix_attaches")
        if k and r.hit_pinned:
            out = self.cache.read(rid, 0, r.start)  # the hit is readable before any capture
            self.counters["read_rows"] += r.start
            assert torch.equal(out.cpu(), self._expected(rid, 0, r.start))

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def deliver_hashes(self, data):
        """Late delivery: some of the hashes that are available by now, in order."""
        self._count("steps")
        r = self._pick_live(data, lambda r: self._available_hashes(r) > r.given)
        if r is None:
            return
        n = data.draw(st.integers(1, self._available_hashes(r) - r.given), label="n")
        self._give(r, n)
        self._count("hash_deliveries")

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def deliver_hashes_batch(self, data):
        """One ``add_block_hashes_batch`` for several requests (an engine step's hashes),
        possibly with empty lists and a request listed twice; the same as one call each."""
        self._count("steps")
        ready = [r for r in self.live.values() if self._available_hashes(r) > r.given]
        if not ready:
            return
        picked = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4), label="requests")
        given = {r.rid: r.given for r in picked}
        ids, lists = [], []
        for r in picked:
            n = data.draw(st.integers(0, self._available_hashes(r) - given[r.rid]), label="n")
            ids.append(r.rid)
            lists.append(list(r.hashes[given[r.rid] : given[r.rid] + n]))
            given[r.rid] += n
        self.cache.add_block_hashes_batch(ids, lists)
        for rid, hashes in zip(ids, lists):
            self._model_give(self.live[rid], len(hashes))
        self._count("hash_deliveries")

    def _deliver_some(self, data, r: ModelRequest):
        """After a capture: all available hashes at once, some, or none (they come later)."""
        ready = self._available_hashes(r) - r.given
        how = data.draw(st.sampled_from(["all", "all", "some", "none"]), label="hashes_now") if ready else "none"
        n = ready if how == "all" else data.draw(st.integers(0, ready), label="n") if how == "some" else 0
        if n:
            self._give(r, n)
            self._count("hash_deliveries")

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def finish_2(self, data):
        self.finish(data)

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def finish(self, data):
        """Finish, abort or preemption; the id may restart later from scratch."""
        self._count("steps")
        self._finish(self._pick_live(data))
        self._count("finishes")
        if data.draw(st.booleans(), label="finish_unknown"):
            self.cache.finish(GHOST_ID)  # a no-op

    def _finish(self, r: ModelRequest):
        self.cache.finish(r.rid)
        del self.live[r.rid]
        if r.registered:
            self._unpin(reversed(self._pinned_by(r)))
        preempted_len = max(r.prompt_len, r.cursor)  # a restart's prompt: everything so far
        self.finished[r.rid] = (r.tokens, max(1, min(preempted_len, len(r.tokens))))

    # ---------------------------------------------------------------- captures

    def _can_capture(self, r: ModelRequest) -> bool:
        """False for a whole-prompt hit whose seed block lost its rows before its first capture (a
        roll-back of the request that published it): the cache refuses that capture
        (test_cache.py), and the engine would recompute the request from scratch."""
        return r.first_block is not None or not r.start % self.ps or r.hashes[r.start // self.ps] in self.index

    def _capture_items(self, data, max_requests):
        """[(request, start, count)] in a valid order (a request may be split in two spans)."""
        capturable = [rid for rid, r in self.live.items() if r.next_start < len(r.tokens) and self._can_capture(r)]
        if not capturable:
            return []
        chosen = data.draw(
            st.lists(st.sampled_from(capturable), min_size=1, max_size=max_requests, unique=True), label="requests"
        )
        per_request = {}
        for rid in chosen:
            r = self.live[rid]
            start = r.next_start
            n = data.draw(st.integers(1, min(2 * self.ps, len(r.tokens) - start)), label="count")
            if n > 1 and max_requests > 1 and data.draw(st.booleans(), label="split"):
                cut = data.draw(st.integers(1, n - 1), label="cut")
                per_request[rid] = [(r, start, cut), (r, start + cut, n - cut)]
            else:
                per_request[rid] = [(r, start, n)]
        order = data.draw(st.permutations([rid for rid in chosen for _ in per_request[rid]]), label="order")
        taken = Counter()
        items = []
        for rid in order:
            items.append(per_request[rid][taken[rid]])
            taken[rid] += 1
        return items

    def _apply_captures(self, data, items):
        """Run the captures through ``capture_batch`` (or ``capture`` for one request); model
        and cache must agree."""
        sim_cursor = {}
        need = 0
        for r, start, n in items:  # a first capture's block begins at the block's start (seeded, or the capture's)
            cursor = sim_cursor.get(r.rid, r.cursor if r.first_block is not None else start - start % self.ps)
            need += blocks_touched(cursor, start + n, self.ps)
            sim_cursor[r.rid] = start + n
        # a first capture stops pinning the hashes of the blocks it computes itself
        first_captures, seen = [], set()
        for r, start, _ in items:
            if r.first_block is None and r.rid not in seen:
                seen.add(r.rid)
                first_captures.append((r, start))
        drops = Counter(h for r, start in first_captures for h in r.hashes[start // self.ps : r.given])
        releasing = sum(1 for h, k in drops.items() if h in self.index and self.pins[h] == k)
        full = need > self._free() + len(self.evictable) + releasing

        apis = ["capture_batch"] + (["capture"] if len(items) == 1 else [])
        if all(r.registered for r, _, _ in items) and len({r.rid for r, _, _ in items}) == len(items):
            apis.append("capture_step")  # the engine's call: live, distinct requests, checked spans
        api = data.draw(st.sampled_from(apis), label="api")
        row_dtype = data.draw(st.sampled_from([torch.int64, self.dtype]), label="row_dtype")
        chunks = [r.rows[start : start + n].to(row_dtype, copy=True) for r, start, n in items]
        snapshot = self._snapshot()
        batch_slots = None
        if api == "capture_batch" and all(r.registered for r, _, _ in items) and data.draw(st.booleans(), label="slots"):
            batch_slots = self.cache.slots([r.rid for r, _, _ in items])  # registered: changes nothing
        try:
            if api == "capture":
                (r, start, _), = items
                self.cache.capture(r.rid, start, chunks[0])
            else:  # one source tensor, spans into it
                parts, spans, offset = [], [], 0
                for (r, start, n), c in zip(items, chunks):
                    pad = data.draw(st.integers(0, 2), label="pad")  # rejected drafts between spans
                    parts.append(torch.zeros((pad, *self.row_shape), dtype=row_dtype))
                    parts.append(c)
                    spans.append((r.rid, start, offset + pad, n))
                    offset += pad + n
                if batch_slots is None and api != "capture_step" and data.draw(st.booleans(), label="zero_span"):  # a no-op span
                    spans.insert(data.draw(st.integers(0, len(spans)), label="zero_at"), (GHOST_ID, 1, 0, 0))
                ids, starts, source_starts, counts = zip(*spans)
                if api == "capture_step":
                    self.cache.capture_step(torch.cat(parts), list(ids), self.cache.slots(ids), *(
                        np.array(values, dtype=np.int64) for values in (starts, source_starts, counts)))
                    self._count("step_captures")
                else:
                    as_array = data.draw(st.sampled_from([np.array, torch.tensor, list]), label="arrays")
                    self.cache.capture_batch(
                        torch.cat(parts), list(ids), as_array(starts), as_array(source_starts), as_array(counts),
                        slots=batch_slots,
                    )
        except CacheFullError:
            assert full, f"CacheFullError; the model has {self._free()} free + {len(self.evictable)} for {need}"
            self._assert_unchanged(snapshot)
            self._count("cache_full")
            return False
        assert not full, f"capture of {need} pages succeeded; the model has {self._free()} + {len(self.evictable)}"
        for (r, start, n), c in zip(items, chunks):  # the caller's rows are never written to
            assert torch.equal(c, r.rows[start : start + n].to(row_dtype))

        for r, start in first_captures:
            if r.given > start // self.ps:
                self._count("first_capture_unpins")
            self._unpin(reversed(r.hashes[start // self.ps : r.given]))
        # model: free pages first, then the oldest evictable hashes
        for _ in range(max(0, need - self._free())):
            h, _ = self.evictable.popitem(last=False)
            del self.index[h]
            self.counters["evictions"] += 1
            self._count("evictions")
        touched = []
        for r, start, n in items:
            if r.first_block is None:
                r.first_block = start // self.ps
                self.counters["prefix_hit_rows"] += start
            r.own.extend([None] * blocks_touched(r.cursor if r.own else start - start % self.ps, start + n, self.ps))
            r.cursor = start + n
            r.registered = True
            self.counters["captured_rows"] += n
            if r not in touched:
                touched.append(r)
        for r in touched:
            self._settle(r)
        self._count("captures")
        return True

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def capture(self, data):
        self._capture_one(data)

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def capture_2(self, data):
        self._capture_one(data)

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def capture_3(self, data):
        self._capture_one(data)

    def _capture_one(self, data):
        """One request's next chunk (1 .. 2 * page size rows), then maybe some hashes at once;
        on CacheFullError the engine may preempt the request."""
        self._count("steps")
        items = self._capture_items(data, max_requests=1)
        if not items:
            return
        r = items[0][0]
        if self._apply_captures(data, items):
            self._deliver_some(data, r)
            if r.cursor == len(r.tokens) and data.draw(st.integers(0, 3), label="done") > 0:
                self._finish(r)  # a request whose tokens are all captured mostly finishes now
                self._count("finishes")
        elif data.draw(st.booleans(), label="preempt"):
            self._finish(r)
            self._count("preemptions")

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def run_through(self, data):
        """A request runs to its end (chunk after chunk, hashes as they become available) and
        mostly finishes: the volume that fills the pool with published, evictable pages."""
        self._count("steps")
        r = self._pick_live(data, self._can_capture)
        if r is None:
            return
        while r.next_start < len(r.tokens):
            n = data.draw(st.integers(1, min(2 * self.ps, len(r.tokens) - r.next_start)), label="count")
            if not self._apply_captures(data, [(r, r.next_start, n)]):
                self._finish(r)  # preempted
                self._count("preemptions")
                return
            if self._available_hashes(r) > r.given:
                self._give(r, self._available_hashes(r) - r.given)
        if data.draw(st.integers(0, 3), label="done") > 0:
            self._finish(r)
            self._count("finishes")

    @precondition(lambda self: self.cache is not None and len(self.live) >= 2)
    @rule(data=st.data())
    def capture_batch(self, data):
        """One engine step: several requests in one call (one device launch)."""
        self._count("steps")
        items = self._capture_items(data, max_requests=3)
        if items and self._apply_captures(data, items):
            self._count("batched_captures")
            for r in {id(r): r for r, _, _ in items}.values():
                self._deliver_some(data, r)
                if r.cursor == len(r.tokens) and data.draw(st.booleans(), label="done"):
                    self._finish(r)
                    self._count("finishes")

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def invalid_capture(self, data):
        """Gap, overlap or unaligned first capture (inside a block whose rows are not published:
        inside a published one it is a whole-prompt hit, test_cache.py):
        InvalidCaptureError, nothing changes."""
        self._count("steps")
        r = self._pick_live(data)
        if r.first_block is None:
            start = r.start + data.draw(st.integers(1, self.ps - 1), label="offset")
            block = start // self.ps
            if start % self.ps == 0 or block < r.given and r.hashes[block] in self.index:
                return  # a boundary after a whole-prompt hit's start, or inside a published block: valid
        else:
            start = r.cursor + data.draw(st.sampled_from([-1, 1, self.ps]), label="offset")
        n = data.draw(st.integers(1, 3), label="n")
        snapshot = self._snapshot()
        with pytest.raises(InvalidCaptureError):
            self.cache.capture(r.rid, start, torch.zeros((n, *self.row_shape), dtype=torch.int64))
        self._assert_unchanged(snapshot)
        self._count("invalid_captures")

    # ---------------------------------------------------------------- reads

    def _draw_interval(self, data):
        """(id, start, end): mostly a live request's captured (or known-prefix) rows, sometimes
        past them, an empty or reversed range, or a finished / unknown id."""
        gone = [GHOST_ID] + sorted(self.finished, key=str)[:2]
        if self.live and data.draw(st.integers(0, 9), label="gone") > 0:
            rid = data.draw(st.sampled_from(list(self.live)), label="rid")
        else:
            rid = data.draw(st.sampled_from(gone), label="rid")
        r = self.live.get(rid)
        kind = data.draw(st.sampled_from(["held"] * 12 + ["anywhere"] * 4 + ["empty", "reversed"]), label="kind")
        if r is None:
            limit = 4
        elif kind == "held":
            limit = r.cursor if r.first_block is not None else r.given * self.ps
        else:
            limit = len(r.tokens) + 2
        if kind == "empty" or limit == 0:
            start = data.draw(st.integers(0, limit), label="at")
            return rid, start, start
        start = data.draw(st.integers(0, limit - 1), label="start")
        end = data.draw(st.integers(start + 1, limit), label="end")
        if kind == "reversed":
            start, end = end, start
        return rid, start, end

    def _check_reads(self, intervals, results):
        for (rid, start, end), out in zip(intervals, results):
            expected = self._expected(rid, start, end)
            assert out.dtype == self.dtype and out.shape == expected.shape
            assert torch.equal(out.cpu(), expected), f"read {rid!r} [{start}, {end}) differs from the model"

    def _read_call(self, call, intervals):
        present = all(self._present(*iv) for iv in intervals)
        snapshot = self._snapshot()
        try:
            result = call()
        except RangeUnavailableError as error:
            assert not present, f"RangeUnavailableError for {intervals} the model has all present"
            self._assert_unchanged(snapshot)
            self._count("reads_unavailable")
            return error
        assert present, f"read of {intervals} succeeded; the model says a row is missing"
        self.counters["read_rows"] += sum(e - s for _, s, e in intervals)
        self._count("reads_ok")
        return result

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def read(self, data):
        self._count("steps")
        rid, start, end = self._draw_interval(data)
        out = self._read_call(lambda: self.cache.read(rid, start, end), [(rid, start, end)])
        if isinstance(out, RangeUnavailableError):  # the error names the request and the range
            assert repr(rid) in str(out) and f"[{start}, {end})" in str(out), str(out)
        else:
            self._check_reads([(rid, start, end)], [out])

    @precondition(lambda self: self.cache is not None and self.live)
    @rule(data=st.data())
    def read_batch(self, data):
        """Several intervals over several requests, one gather launch."""
        self._count("steps")
        n = data.draw(st.integers(1, 4), label="n")
        intervals = [self._draw_interval(data) for _ in range(n)]
        ids, starts, ends = (list(column) for column in zip(*intervals))
        as_array = data.draw(st.sampled_from([np.array, torch.tensor, list]), label="arrays")
        result = self._read_call(lambda: self.cache.read_batch(ids, as_array(starts), as_array(ends)), intervals)
        if not isinstance(result, RangeUnavailableError):
            packed, offsets = result
            assert offsets.tolist() == [0] + list(torch.tensor([e - s for _, s, e in intervals]).cumsum(0).tolist())
            self._check_reads(intervals, [packed[offsets[i] : offsets[i + 1]] for i in range(n)])

    @precondition(lambda self: self.cache is not None and any(r.first_block is not None for r in self.live.values()))
    @rule(data=st.data())
    def rewind(self, data):
        """The engine rolls a request back (KV blocks failed to load) and recomputes from there."""
        self._rewind(data, into_prefix=False)

    @precondition(lambda self: self.cache is not None and any(r.first_block for r in self.live.values()))
    @rule(data=st.data())
    def rewind_into_prefix(self, data):
        """A roll-back past a prefix hit: the request recomputes blocks it read from others."""
        self._rewind(data, into_prefix=True)

    def _rewind(self, data, into_prefix: bool):
        self._count("steps")
        r = self._pick_live(data, lambda r: r.first_block is not None and r.cursor > 0 and (r.first_block or not into_prefix))
        if r is None:
            return
        ps, own_start = self.ps, r.first_block * self.ps
        if into_prefix:
            position = data.draw(st.integers(0, r.first_block), label="block") * ps
        else:
            position = data.draw(st.integers(own_start, r.cursor), label="position")
        self.cache.rewind(r.rid, position)
        if position >= r.cursor:
            return
        partial = max(0, position - own_start) // ps
        for offset in range(partial, r.num_settled):
            if r.own[offset] == "pub":
                h = r.hashes[r.first_block + offset]
                del self.index[h]
                self._unpin([h])
                for other in self.live.values():  # readers of those rows lose them (fail closed)
                    if h in other.hashes[: other.given]:
                        other.hit_pinned = False
        r.num_settled = min(r.num_settled, partial)
        keep = -(-max(0, position - own_start) // ps)
        r.own = [s if i < r.num_settled else None for i, s in enumerate(r.own[:keep])]
        if position < own_start:
            first = position // ps
            self._unpin(reversed(r.hashes[first : min(r.first_block, r.given)]))
            r.first_block = first
            r.start = position
            self._count("rewinds_into_prefix")
        self.counters["rewound_rows"] += r.cursor - position
        r.cursor = position
        self._count("rewinds")

    # ---------------------------------------------------------------- pins, reset

    @precondition(lambda self: self.cache is not None and self.hash_rows and len(self.retained) < 4)
    @rule(data=st.data())
    def retain(self, data):
        """Pin hashes from outside: mostly published ones, sometimes not yet published."""
        self._count("steps")
        published = self.index and data.draw(st.booleans(), label="published")
        pool = list(self.index) if published else sorted(self.hash_rows)
        hs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3), label="hashes")
        self.cache.retain(hs)
        self.retained.update(hs)
        self._pin(hs)
        self._count("retains")

    @precondition(lambda self: self.cache is not None and self.retained)
    @rule(data=st.data())
    def release(self, data):
        self._count("steps")
        held = sorted(self.retained.elements())
        hs = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3), label="hashes")
        hs = data.draw(st.permutations(hs), label="order")
        if any(Counter(hs)[h] > self.retained[h] for h in hs):  # more than retained: refused
            snapshot = self._snapshot()
            with pytest.raises(RoutedExpertsCacheError, match="not retained"):
                self.cache.release(hs)
            self._assert_unchanged(snapshot)
            self._count("bad_releases")
            return
        self.cache.release(hs)
        self.retained.subtract(hs)
        self.retained += Counter()
        self._unpin(hs)
        self._count("releases")

    @precondition(lambda self: self.cache is not None and self.steps_since_reset >= RESET_EVERY)
    @rule()
    def reset(self):
        self._count("steps")
        self.cache.reset()
        self.generation += 1
        for rid, r in self.live.items():
            self.finished[rid] = (r.tokens, r.prompt_len)
        self._model_clear()
        self.steps_since_reset = 0
        self._count("resets")

    # ---------------------------------------------------------------- invariants

    @invariant()
    def accounting_matches_the_model(self):
        if self.cache is None:
            return
        self.steps_since_reset += 1
        self.cache.check_consistency()
        stats = self.cache.stats()
        assert sum(stats[k] for k in ("free", "tail", "pending", "duplicate", "published")) == stats["num_pages"]
        assert stats["requests"] == sum(1 for r in self.live.values() if r.registered)
        model = self._model_stats()
        assert stats == model, {k: (stats[k], model[k]) for k in stats if stats[k] != model.get(k)}

    @invariant()
    def held_rows_and_published_hashes_read_exactly(self):
        """Own rows are always readable, pinned published pages are never evicted, and
        evictable ones are intact until evicted -- checked with one gather per step.

        Every live request reads [0, cursor) (its own rows, plus its prefix, which it pins).
        A probe request given every published hash reads them all; it leaves no trace but
        ``read_rows``: pinned hashes stay pinned, and the evictable ones are given newest first,
        so finishing the probe (pins dropped in reverse block order) rebuilds the same
        eviction order."""
        if self.cache is None:
            return
        intervals = []
        for rid, r in self.live.items():
            if r.first_block is not None:
                assert self._present(rid, r.first_block * self.ps, r.cursor)
                if r.hit_pinned:
                    assert self._present(rid, 0, r.cursor)  # the prefix hit stays pinned
                start = 0 if self._present(rid, 0, r.cursor) else r.first_block * self.ps
                intervals.append((rid, start, r.cursor))
        expected = [self._expected(rid, s, e) for rid, s, e in intervals]
        pinned = [h for h in self.index if h not in self.evictable]
        assert all(self.pins[h] > 0 for h in pinned)
        probe = pinned + list(reversed(self.evictable))
        if probe:
            self.cache.add_block_hashes(PROBE_ID, probe)
            intervals.append((PROBE_ID, 0, len(probe) * self.ps))
            expected.append(torch.cat([self.hash_rows[h] for h in probe]))
        if not intervals:
            return
        ids, starts, ends = (list(column) for column in zip(*intervals))
        try:
            packed, offsets = self.cache.read_batch(ids, starts, ends)
        finally:
            self.cache.finish(PROBE_ID)
        self.counters["read_rows"] += int(offsets[-1])
        for i, ((rid, start, end), want) in enumerate(zip(intervals, expected)):
            assert torch.equal(packed[offsets[i] : offsets[i + 1]].cpu(), want), f"{rid!r} [{start}, {end}) differs"


# ------------------------------------------------------------------ the test


def test_cache_against_the_model(backend, monkeypatch):
    if backend == "triton":  # every copy through the kernel (the torch machine takes the row copies)
        monkeypatch.setattr(cache_module, "SMALL_COPY_ROWS", 0)
    counts = Counter()
    machine = type(f"CacheMachine_{backend}", (CacheMachine,), {"BACKEND": backend, "COUNTS": counts})
    run_state_machine(machine, BUDGETS[backend])
    print(f"\n[{backend}] " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    # the run must have exercised what it is here for (deterministic: derandomize=True)
    for what in (
        "prefix_attaches", "late_hit_hashes", "restarts", "preemptions", "duplicate_blocks", "evictions",
        "cache_full", "batched_captures", "reads_ok", "reads_unavailable", "retains", "releases", "resets",
        "hash_deliveries", "invalid_captures", "bad_releases", "replaced_blocks", "first_capture_unpins",
        "rewinds", "step_captures", *(f"pool_{dtype}" for _, dtype in ROW_CONFIGS),
        *(["rewinds_into_prefix", "whole_prompt_hits"] if backend == "torch" else []),  # rarer: the larger budget
    ):
        assert counts[what] > 0, f"the state machine never exercised {what}: {dict(counts)}"


def test_cache_against_the_model_with_array_passes_only(monkeypatch):
    """The same machine with every batch on the vectorised paths (``SMALL_BATCH`` 0), which
    the engine takes above a few dozen requests: they must agree with the model as well."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    counts = Counter()
    machine = type("CacheMachine_array_passes", (CacheMachine,), {"BACKEND": "torch", "COUNTS": counts})
    run_state_machine(machine, BUDGETS["torch"])
    for what in ("batched_captures", "step_captures", "reads_ok", "reads_unavailable", "rewinds"):
        assert counts[what] > 0, f"the state machine never exercised {what}: {dict(counts)}"
