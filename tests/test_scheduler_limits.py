"""Limits tier: vLLM 0.33's / 0.34's real scheduler with TINY KV caches against this project's connector.

Runs in the vLLM 0.33 and 0.34 environments (``.venv-vllm033``, ``.venv-vllm034``). The real ``Scheduler`` /
``AsyncScheduler`` runs with a few dozen KV blocks, so KV eviction, preemption and the
aux-output scheduler's retained blocks at capacity (``AuxOutputSchedulerConnector._capacity``:
``num_blocks``, doubled with a KV connector) happen all the time. The traffic is multi-turn
conversations whose next turn re-sends the whole history (previous prompt + generated tokens
+ new tokens), usually after other traffic evicted it, plus one-shot requests that share
system prefixes; speculative decoding (MTP) with rejections, lookahead hashing 0/1/2, sync and
async scheduling, with and without the stub KV connector (``cpu_harness/vllm_scheduler/kv_connector.py``,
whose external hits serve rows from retained blocks). Every ``WEIGHT_UPDATE_EVERY`` steps an RL
weight update (``SimEngine.update_weights``) changes the routing of every row and resets the prefix
cache with requests running: a row kept from before it fails the checks. Hybrid models run under
vLLM's hybrid KV cache manager (``HybridKVCacheCoordinator``): full attention beside a sliding
window (gpt-oss), and beside Mamba in ``align`` mode with twice the attention block (Qwen3-Next:
the scheduler block is the LCM, 8 tokens, the hash block and pool page the GCD, 4). vLLM admits
a request only when its whole sequence fits every group (with 40 blocks for two groups a 90-token
prompt waits forever, silently), so their KV pool is 80 blocks.

The connector is ``build_our_connector(setup, capturer)``: its pool is sized by the project's
own ``build_cache``. Per configuration, at least ``LIMITS_STEPS`` engine steps (10,000 by
default; the environment variable overrides it for development); every step's returned rows,
every finished request's client rows and every retained block (published in the cache while
the scheduler holds it) are checked; a ``CacheFullError`` stops the configuration and fails it.
With ``-s`` a table per configuration is printed: steps, requests, preemptions, peak
non-evictable pages (``num_pages - free - evictable``) and peak pages in use
(``num_pages - free``) against the pool, retained blocks against the scheduler's capacity,
and the CacheFullError count.

``test_issue_schedule_*`` is the exact schedule of the issue (block 16, 16 KV blocks,
``max_num_seqs`` 1, 64 batched tokens, sync, no speculative decoding, no KV connector, pool
38 = 2 x 16 + 6 pages): ``x0`` (188-token prompt, 4 generated), then ``y0`` and ``y1``
(140-token prompts, 4 generated each), then x0's next turn (its 192-token history + 3 new
tokens, 1 generated).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    HarnessError,
    RetainedPins,
    SimEngine,
    build_our_connector,
    make_request,
    make_scheduler,
    random_prompt,
)
from routed_experts_cache import CacheFullError

LIMITS_STEPS = int(os.environ.get("LIMITS_STEPS", "10000"))
# An RL weight update (new routing for every row, prefix cache and KV connector reset, running
# requests preempted) every this many engine steps, at least once per configuration.
WEIGHT_UPDATE_EVERY = max(1, min(2500, LIMITS_STEPS // 5))


@dataclass(frozen=True)
class Config:
    name: str
    num_spec_tokens: int  # 0: no speculative decoding
    lookahead: int  # hash lookahead tokens vLLM derives (0 with a KV connector, by vLLM's rule)
    async_scheduling: bool
    kv_connector: bool
    seed: int
    kv_tier: str = ""  # a real CPU-offload connector instead of the stub, its tier 4 x the GPU KV
    kv_groups: str = "full"  # make_scheduler's kv_groups: hybrid models under vLLM's hybrid KV cache manager


# Every speculative mode meets sync and async scheduling; the KV connector (which forces
# lookahead 0) meets both scheduling modes with and without speculative decoding.
CONFIGS = [
    Config("nospec-sync", 0, 0, False, False, 1),
    Config("nospec-sync-kv", 0, 0, False, True, 2),
    Config("nospec-async-kv", 0, 0, True, True, 3),
    Config("mtp2-sync-kv", 2, 0, False, True, 4),
    Config("mtp2-async-kv", 2, 0, True, True, 5),
    Config("mtp2-L0-async", 2, 0, True, False, 6),
    Config("mtp2-L1-sync", 2, 1, False, False, 7),
    Config("mtp1-L1-async", 1, 1, True, False, 8),
    Config("mtp2-L2-sync", 2, 2, False, False, 9),
    Config("mtp2-L2-async", 2, 2, True, False, 10),
    Config("nospec-sync-offload", 0, 0, False, False, 11, kv_tier="OffloadingConnector"),
    Config("nospec-async-cpu", 0, 0, True, False, 12, kv_tier="SimpleCPUOffloadConnector"),
    # Hybrid models: full attention beside sliding window (gpt-oss), and beside Mamba in align
    # mode with a block twice the attention's (Qwen3-Next: scheduler block 8, hash block 4).
    Config("sliding-mtp2-L1-async", 2, 1, True, False, 13, kv_groups="sliding"),
    Config("sliding-nospec-sync", 0, 0, False, False, 14, kv_groups="sliding"),
    Config("mamba-mtp2-L2-sync", 2, 2, False, False, 15, kv_groups="mamba"),
    Config("mamba-nospec-async", 0, 0, True, False, 16, kv_groups="mamba"),
    # Hybrid models with a real CPU-offload KV tier (one KV tensor per group).
    Config("sliding-nospec-async-offload", 0, 0, True, False, 17, kv_tier="OffloadingConnector", kv_groups="sliding"),
    Config("mamba-nospec-sync-cpu", 0, 0, False, False, 18, kv_tier="SimpleCPUOffloadConnector", kv_groups="mamba"),
]

# Tiny engine: 40 KV blocks of 4 tokens (160 tokens) for up to 4 running requests.
BLOCK = 4
NUM_BLOCKS = 40
MAX_SEQS = 4
BATCHED = 32
MAX_MODEL_LEN = 120
CONCURRENCY = 6  # live requests (running + waiting) the driver keeps


@dataclass
class Row:
    config: str
    steps: int = 0
    requests: int = 0
    turns: int = 0  # requests that re-sent a conversation's history
    preemptions: int = 0
    external_tokens: int = 0  # tokens loaded through the KV connector
    peak_non_evictable: int = 0
    peak_in_use: int = 0
    pool: int = 0
    peak_retained: int = 0
    capacity: int = 0
    evictions: int = 0
    host_pages: int = 0  # the host tier (with a KV connector)
    peak_demoted: int = 0  # host pages in use, at most
    demotions: int = 0
    cache_full: int = 0
    weight_updates: int = 0
    seconds: float = 0.0
    error: str = ""


TABLE: list[Row] = []


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if not TABLE:
        return
    header = (f"{'configuration':<18} {'steps':>6} {'reqs':>5} {'turns':>5} {'preempt':>7} {'ext tok':>7} "
              f"{'non-evictable/pool':>18} {'in-use/pool':>11} {'retained/cap':>12} {'evict':>6} "
              f"{'host/pool':>9} {'demote':>6} {'CacheFull':>9} {'updates':>7} {'s':>5}")
    print("\n\nlimits tier (vLLM's real scheduler, tiny KV cache, our connector sized by build_cache)")
    print(header)
    for row in TABLE:
        print(f"{row.config:<18} {row.steps:>6} {row.requests:>5} {row.turns:>5} {row.preemptions:>7} "
              f"{row.external_tokens:>7} {row.peak_non_evictable:>9}/{row.pool:<8} "
              f"{row.peak_in_use:>5}/{row.pool:<5} {row.peak_retained:>6}/{row.capacity:<5} {row.evictions:>6} "
              f"{row.peak_demoted:>4}/{row.host_pages:<4} {row.demotions:>6} {row.cache_full:>9} {row.weight_updates:>7} {row.seconds:>5.1f}" + (f"  ERROR {row.error}" if row.error else ""))


class PageMeter:
    """Peak pages of the cache, sampled after every begin_step and every step output."""

    def __init__(self, engine: SimEngine, row: Row) -> None:
        self.cache = engine.connector.cache
        self.aux = engine.scheduler.aux_output_connector
        self.row = row
        row.pool = self.cache.num_pages
        row.host_pages = self.cache.stats()["host_pages"]
        row.capacity = self.aux._capacity
        engine.runner.after_begin_step.append(self.sample)
        engine.runner.after_output.append(self.sample)

    def sample(self, _=None) -> None:
        stats = self.cache.stats()
        in_use = self.cache.num_pages - stats["free"]
        row = self.row
        row.peak_in_use = max(row.peak_in_use, in_use)
        row.peak_non_evictable = max(row.peak_non_evictable, in_use - stats["evictable"])
        row.peak_retained = max(row.peak_retained, len(self.aux._kv_cached))
        row.peak_demoted = max(row.peak_demoted, stats["demoted"])
        row.demotions = stats["demotions"]


@dataclass
class Conversation:
    tokens: list[int]  # the history the next turn re-sends
    turns_left: int
    ready_at: int  # engine step from which the next turn may be sent


@dataclass
class Traffic:
    """Multi-turn conversations and one-shot requests sharing system prefixes."""

    setup: object
    engine: SimEngine
    rng: np.random.Generator
    prefixes: list[list[int]] = field(default_factory=list)
    waiting_turns: deque = field(default_factory=deque)  # Conversation, in ready order
    open_turns: dict[str, Conversation] = field(default_factory=dict)  # request id -> its conversation
    added: int = 0
    turns: int = 0

    def __post_init__(self) -> None:
        self.prefixes = [random_prompt(self.rng, int(n)) for n in self.rng.integers(8, 24, size=3)]

    def _add(self, prompt: list[int], max_tokens: int, conversation: Conversation | None) -> None:
        request_id = f"q{self.added}"
        self.added += 1
        prompt_start = int(self.rng.integers(0, len(prompt))) if self.rng.random() < 0.1 else 0
        self.engine.add(make_request(self.setup, request_id, prompt, max_tokens, prompt_start=prompt_start))
        if conversation is not None:
            self.open_turns[request_id] = conversation

    def on_finished(self, request_id: str, step: int) -> None:
        conversation = self.open_turns.pop(request_id, None)
        if conversation is None:
            return
        conversation.tokens = list(self.engine.requests[request_id].all_token_ids)
        if conversation.turns_left > 0:
            # Other traffic runs in between: the history's KV is usually evicted by then.
            conversation.ready_at = step + int(self.rng.integers(5, 60))
            self.waiting_turns.append(conversation)

    def top_up(self, step: int, live: int) -> None:
        for _ in range(CONCURRENCY - live):
            max_tokens = int(self.rng.integers(2, 14))
            ready = self.waiting_turns and self.waiting_turns[0].ready_at <= step
            if ready:
                conversation = self.waiting_turns.popleft()
                new = random_prompt(self.rng, int(self.rng.integers(2, 16)))
                prompt = conversation.tokens + new
                if len(prompt) + max_tokens + 4 <= MAX_MODEL_LEN:
                    conversation.turns_left -= 1
                    self.turns += 1
                    self._add(prompt, max_tokens, conversation)
                    continue
            if self.rng.random() < 0.5:
                prefix = self.prefixes[int(self.rng.integers(0, len(self.prefixes)))]
                prompt = prefix + random_prompt(self.rng, int(self.rng.integers(4, 40)))
                self._add(prompt, max_tokens, None)
            else:
                conversation = Conversation([], int(self.rng.integers(1, 5)), 0)
                self._add(random_prompt(self.rng, int(self.rng.integers(12, 48))), max_tokens, conversation)


def run_config(config: Config, steps: int) -> Row:
    row = Row(config.name)
    started = time.perf_counter()
    setup = make_scheduler(
        lookahead=config.lookahead, num_spec_tokens=config.num_spec_tokens, async_scheduling=config.async_scheduling,
        # Hybrid: each group takes its own blocks from the one pool (vLLM admits a request only
        # when its whole sequence fits in every group), so the pool doubles.
        num_blocks=NUM_BLOCKS * (1 if config.kv_groups == "full" else 2), max_num_seqs=MAX_SEQS, max_num_batched_tokens=BATCHED, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        kv_connector={"load_mode": "alternate", "async_load_steps": 1} if config.kv_connector else None,
        kv_tier=(config.kv_tier, 4 * NUM_BLOCKS) if config.kv_tier else None, kv_groups=config.kv_groups,
    )
    engine = SimEngine(setup, build_our_connector(setup), seed=config.seed)
    meter = PageMeter(engine, row)
    pins = RetainedPins(engine.runner)
    traffic = Traffic(setup, engine, np.random.default_rng(config.seed))
    num_checked = 0

    def check_finished(step: int) -> None:
        nonlocal num_checked
        while num_checked < len(engine.finish_order):
            request_id = engine.finish_order[num_checked]
            engine.check_finished_request(request_id)
            traffic.on_finished(request_id, step)
            num_checked += 1

    try:
        next_update = WEIGHT_UPDATE_EVERY
        while engine.engine_steps < steps:
            if engine.engine_steps >= next_update:
                if setup.kv_worker is not None:
                    # vLLM cannot reset the prefix cache while a KV connector holds a running
                    # request's blocks for a store (the reset raises and the engine dies): with a
                    # KV connector the update waits until the engine is idle ("wait" pause mode).
                    engine.run(max_steps=steps)
                engine.update_weights()
                next_update += WEIGHT_UPDATE_EVERY
            live = len(engine.requests) - len(engine.finished)
            traffic.top_up(engine.engine_steps, live)
            engine.step()
            check_finished(engine.engine_steps)
        engine.run(max_steps=steps)  # drain: no new traffic
        engine.flush()
        check_finished(engine.engine_steps)
        if engine.check_all_finished() != len(engine.requests):
            raise HarnessError("aborted requests in a run without aborts")
        if engine.connector.cache.stats()["requests"] != 0:
            raise HarnessError("requests left in the cache after every request finished")
    except CacheFullError as error:
        row.cache_full += 1
        row.error = f"CacheFullError at engine step {engine.engine_steps}: {error}"
    except Exception as error:
        row.error = f"{type(error).__name__}: {error}"
        raise
    finally:
        meter.sample()
        row.steps = engine.engine_steps
        row.requests = traffic.added
        row.turns = traffic.turns
        row.weight_updates = engine.weight_updates
        row.preemptions = sum(engine.num_preemptions.values())
        row.evictions = engine.connector.cache.stats()["evictions"]
        if config.kv_tier:
            row.external_tokens = BLOCK * sum(len(load.block_ids) for load in setup.kv_worker.loads)
        elif setup.kv_worker is not None:
            row.external_tokens = setup.scheduler.connector.stats["loaded_tokens"]
        row.seconds = time.perf_counter() - started
        TABLE.append(row)
        engine.close()
    if pins.seen["checks"] == 0:
        raise HarnessError("retained blocks were never checked")
    return row


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_limits_tiny_kv_cache(config):
    # vLLM's hybrid coordinator costs about twice the single-group one per step: the hybrid
    # configurations run 40 % of the steps (4,000 by default) to keep the tier's time.
    steps = LIMITS_STEPS if config.kv_groups == "full" else max(1, LIMITS_STEPS * 2 // 5)
    row = run_config(config, steps)
    assert row.cache_full == 0, row.error
    assert row.steps >= steps
    # The configuration really is at its limits: preemptions, retained blocks at the
    # scheduler's capacity, re-sent histories; with the KV connector, external hits.
    assert row.preemptions > 0
    assert row.peak_retained == row.capacity
    assert row.turns > 0
    assert row.weight_updates > 0
    if config.kv_connector or config.kv_tier:
        assert row.external_tokens > 0
    if config.kv_tier and config.kv_groups != "mamba":  # retention beyond the device pool's share: the host tier takes it
        assert row.demotions > 0  # (with Mamba groups the device pool, sized by the LCM block, holds every retained block)
    assert row.peak_in_use <= row.pool and row.peak_demoted <= row.host_pages


# ---------------------------------------------------------------- the issue's schedule


def _issue_schedule():
    setup = make_scheduler(lookahead=0, num_spec_tokens=0, async_scheduling=False, num_blocks=16, block_size=16,
                           max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512)
    engine = SimEngine(setup, build_our_connector(setup), seed=0)
    row = Row("issue-schedule")
    meter = PageMeter(engine, row)
    rng = np.random.default_rng(2026)
    engine.add(make_request(setup, "x0", random_prompt(rng, 188), 4))
    engine.run_until_finished("x0")
    for request_id in ("y0", "y1"):
        engine.add(make_request(setup, request_id, random_prompt(rng, 140), 4))
        engine.run_until_finished(request_id)
    history = list(engine.requests["x0"].all_token_ids)
    engine.add(make_request(setup, "x1", history + random_prompt(rng, 3), 1))
    return setup, engine, row, meter, history


def test_issue_schedule_shape():
    """The schedule is the issue's: pool 38 pages, x0's history 192 tokens, 64-token chunks."""
    setup, engine, row, _, history = _issue_schedule()
    try:
        assert row.pool == 38 == 2 * 16 + 6
        assert len(history) == 192 and engine.requests["x1"].num_prompt_tokens == 195
        assert engine.scheduler.aux_output_connector._capacity == 16
    finally:
        engine.close()


def test_issue_schedule_completes_with_exact_rows():
    setup, engine, row, meter, _ = _issue_schedule()
    try:
        engine.run_until_finished("x1")
        engine.flush()
        assert engine.check_all_finished() == 4
        # x1's prompt is 195 tokens, chunked by 64 from its local prefix hit.
        starts = [start for start, _ in engine.stats.spans["x1"]]
        assert len(starts) >= 3
    finally:
        meter.sample()
        print(f"\nissue schedule: peak non-evictable {row.peak_non_evictable}/{row.pool}, "
              f"peak in use {row.peak_in_use}/{row.pool}, retained peak {row.peak_retained}/{row.capacity}, "
              f"x1 spans {engine.stats.spans.get('x1')}")
        engine.close()
