"""Lookahead block hashes (vLLM 0.33, 0.34): the real scheduler side against this project's connector.

Runs in the vLLM 0.33 and 0.34 environments (``.venv-vllm033``, ``.venv-vllm034``); it fails at
import anywhere else. Neither release generates on these CPU machines, but their scheduler sides import, so
the tests drive the real ``Scheduler`` / ``AsyncScheduler`` (with its ``KVCacheManager``,
``BlockPool``, ``Request`` block hasher with 1 or 2 lookahead tokens and the
``AuxOutputSchedulerConnector`` it builds) against ``CacheWorkerConnector``, with a
simulated Model Runner V2 and synthetic routing rows that are a pure function of the token
prefix (see ``cpu_harness/vllm_scheduler/``). Every row the connector returns, and every request's rows
as the client assembles them from ``take_output``'s chunks, must equal that function.

Our connector is built by the plugin's factory the way the installed vLLM builds it (0.34:
its real ``profile_run``, then ``initialize_output_storage``). Section 4 of
design/vllm-aux-output.md: vLLM 0.33's own worker connector (``AuxOutputWorkerConnector``,
built as its unit tests build it) fails cases A and B with an ``AssertionError`` from
``RoutedExpertsBuffer.read``; 0.34's passes them (the fix upstream); ours returns exact rows on both.
"""

import numpy as np
import pytest

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    BLOCK_SIZE,
    CONTRACT,
    HarnessError,
    RetainedPins,
    SimEngine,
    SnapshotCapturer,
    build_our_connector,
    build_vllm_connector,
    make_request,
    make_scheduler,
    random_prompt,
)
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector

ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
LOOKAHEAD = pytest.mark.parametrize("lookahead", [1, 2], ids=["L1", "L2"])

CASE_A_ERROR = r"auxiliary output buffer is missing request r$"
CASE_B_ERROR = r"auxiliary output range is unavailable: request=r, range=\[4, 9\), available=\[8, 9\)$"


@pytest.fixture
def engines():
    """Factory: ``engines(setup, which="ours"|"vllm", **kw) -> SimEngine``; closes them all."""
    made = []

    def make(setup, which="ours", seed=0, accept=None, **connector_kw):
        if which == "ours":  # built by the plugin's factory, as the installed vLLM builds it
            connector = build_our_connector(setup, **connector_kw)
        else:
            connector = build_vllm_connector(setup, SnapshotCapturer())
        engine = SimEngine(setup, connector, seed=seed, accept=accept)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- section 4 crash cases
#
# Chunking comes from the real scheduler: a filler request that arrives first takes part of
# the token budget, so "r" is prefilled as [0, 4) and then the rest in one step.


def _case_a_chunked(engines, which, async_scheduling):
    """bs=4, L=1, an 8-token prompt prefilled as [0, 4) then [4, 8)."""
    setup = make_scheduler(lookahead=1, async_scheduling=async_scheduling, max_num_batched_tokens=8)
    engine = engines(setup, which)
    rng = _rng(11)
    engine.add(make_request(setup, "f", random_prompt(rng, 4), 5))
    engine.add(make_request(setup, "r", random_prompt(rng, 8), 6))
    return engine


def _case_a_prefix_hit(engines, which, async_scheduling):
    """bs=4, L=1, block 0 of an 8-token prompt is a prefix hit, [4, 8) runs in one step."""
    setup = make_scheduler(lookahead=1, async_scheduling=async_scheduling)
    engine = engines(setup, which)
    rng = _rng(12)
    prompt = random_prompt(rng, 8)
    # Block 0's lookahead hash covers token 4, so the donor shares tokens 0..4.
    engine.add(make_request(setup, "d", prompt[:5] + random_prompt(rng, 3), 3))
    engine.run_until_finished("d")
    engine.add(make_request(setup, "r", prompt, 6))
    return engine


def _case_b(engines, which, async_scheduling):
    """bs=4, L=2, a 9-token prompt prefilled as [0, 4) then [4, 9)."""
    setup = make_scheduler(lookahead=2, async_scheduling=async_scheduling, max_num_batched_tokens=9)
    engine = engines(setup, which)
    rng = _rng(13)
    engine.add(make_request(setup, "f", random_prompt(rng, 5), 5))
    engine.add(make_request(setup, "r", random_prompt(rng, 9), 6))
    return engine


CASES = {
    "A-chunked": (_case_a_chunked, [(0, 4), (4, 8)], CASE_A_ERROR),
    "A-prefix-hit": (_case_a_prefix_hit, [(4, 8)], CASE_A_ERROR),
    "B": (_case_b, [(0, 4), (4, 9)], CASE_B_ERROR),
}


@ASYNC
@pytest.mark.parametrize("case", list(CASES))
def test_crash_case_exact_rows_with_our_connector(engines, case, async_scheduling):
    build, prefill_spans, _ = CASES[case]
    engine = build(engines, "ours", async_scheduling)
    hashes_at_first_output = []

    def record_hashes(outputs):  # the scheduler's hashes for "r" when its first rows come back
        if "r" in outputs and not hashes_at_first_output:
            hashes_at_first_output.append(len(engine.requests["r"].block_hashes))

    engine.runner.after_output.append(record_hashes)
    engine.flush()
    stats = engine.stats
    # The scheduler really produced the case's prefill chunks ...
    assert stats.spans["r"][: len(prefill_spans)] == prefill_spans
    # ... the last full prefill block had no hash yet (lookahead) and sat pending ...
    assert hashes_at_first_output == [prefill_spans[-1][1] // BLOCK_SIZE - 1]
    assert stats.max_pending_pages >= 1
    # ... and the first output materialized the whole prompt across a stored (or hit)
    # block, the pending block and (case B) the tail, in one interval.
    first_end = prefill_spans[-1][1]
    assert stats.outputs["r"][0] == (0, first_end)
    assert engine.check_all_finished() == len(engine.requests)
    assert engine.connector.cache.stats()["requests"] == 0


@ASYNC
@pytest.mark.parametrize("case", list(CASES))
def test_crash_case_on_vllm_own_worker_connector(engines, case, async_scheduling):
    """vLLM 0.33's own connector fails the section 4 cases; 0.34's reads pending blocks
    (``RoutedExpertsBuffer.read`` takes them) and returns exact rows."""
    build, prefill_spans, error = CASES[case]
    engine = build(engines, "vllm", async_scheduling)
    if CONTRACT.builtin_reads_pending_blocks:
        engine.flush()
        assert engine.stats.outputs["r"][0] == (0, prefill_spans[-1][1])
        assert engine.check_all_finished() == len(engine.requests)
    else:
        with pytest.raises(AssertionError, match=error):
            engine.flush()
        assert "r" not in engine.stats.outputs  # it never returned a row for "r"
    assert engine.stats.spans["r"][: len(prefill_spans)] == prefill_spans


@ASYNC
def test_vllm_own_worker_connector_passes_without_a_pending_block_read(engines, async_scheduling):
    """Control: the same harness with vLLM's connector and no materialize across a pending
    block (one unchunked prompt, decode with speculation) gives exact rows, so the failures
    above are the section 4 bug, not the harness."""
    setup = make_scheduler(lookahead=1, async_scheduling=async_scheduling)
    engine = engines(setup, "vllm", seed=3)
    engine.add(make_request(setup, "r", random_prompt(_rng(14), 8), 12))
    engine.flush()
    assert engine.stats.spans["r"][0] == (0, 8)
    assert engine.stats.drafts_rejected > 0
    assert engine.check_all_finished() == 1


# ---------------------------------------------------------------- full workloads


def _mixed_workload(engine, setup, seed):
    """Shared system prompt (prefix hits), long prompts (chunked), staggered arrivals,
    a routed_experts_prompt_start, an abort, random speculative acceptance."""
    rng = _rng(seed)
    system = random_prompt(rng, 22)
    engine.add(make_request(setup, "s0", system + random_prompt(rng, 9), 14))
    engine.add(make_request(setup, "long0", random_prompt(rng, 41), 9))
    for _ in range(3):
        engine.step()
    engine.add(make_request(setup, "s1", system + random_prompt(rng, 5), 11, prompt_start=7))
    engine.add(make_request(setup, "abort-me", system[:13] + random_prompt(rng, 20), 30))
    engine.run_until_finished("s0")
    engine.abort("abort-me")
    engine.add(make_request(setup, "s2", system + random_prompt(rng, 13), 12, prompt_start=40))
    engine.add(make_request(setup, "s3", system[:17], 16))
    engine.add(make_request(setup, "long1", random_prompt(rng, 35), 7))
    engine.flush()


@ASYNC
@LOOKAHEAD
def test_mixed_workload_exact_rows(engines, lookahead, async_scheduling):
    setup = make_scheduler(
        lookahead=lookahead, num_spec_tokens=3 if lookahead == 1 else lookahead, async_scheduling=async_scheduling,
        long_prefill_token_threshold=8, max_num_batched_tokens=32,
    )
    engine = engines(setup, seed=lookahead)
    _mixed_workload(engine, setup, seed=100 + lookahead)
    stats = engine.stats
    assert engine.check_all_finished() == 6
    # The workload exercised what it is meant to.
    assert stats.prefix_hit_tokens > 0
    assert stats.chunked_prefill_steps > 0
    assert 0 < stats.drafts_rejected < stats.drafts_fed
    assert stats.max_pending_pages >= 1
    assert (stats.reattached > 0) == async_scheduling
    assert engine.connector.stats()["reattachments"] == stats.reattached  # every one was re-attached
    assert stats.rows_checked > 0
    cache_stats = engine.connector.cache.stats()
    assert cache_stats["prefix_hit_rows"] > 0
    assert cache_stats["requests"] == 0  # every request torn down after its terminal event


def test_mixed_workload_triton_backend(engines):
    """The same workload through the Triton copy kernel (interpreter on CPU)."""
    setup = make_scheduler(lookahead=1, num_spec_tokens=3, async_scheduling=True, long_prefill_token_threshold=8,
                           max_num_batched_tokens=32)
    engine = engines(setup, seed=5, backend="triton")
    assert engine.connector.cache.backend == "triton"
    _mixed_workload(engine, setup, seed=105)
    assert engine.check_all_finished() == 6
    assert engine.stats.reattached > 0 and engine.stats.drafts_rejected > 0


@ASYNC
@LOOKAHEAD
def test_preemption_readds_request_from_scratch(engines, lookahead, async_scheduling):
    """A KV cache too small for the batch: the scheduler preempts; the terminal event reaches
    the worker in finished_requests and the request is re-added from scratch."""
    setup = make_scheduler(
        lookahead=lookahead, num_spec_tokens=2, async_scheduling=async_scheduling, num_blocks=24,
        max_num_batched_tokens=32, max_num_seqs=4,
    )
    engine = engines(setup, seed=20 + lookahead)
    rng = _rng(200 + lookahead)
    shared = random_prompt(rng, 10)
    for i in range(4):
        engine.add(make_request(setup, f"p{i}", shared + random_prompt(rng, 6 + i), 26, prompt_start=i))
    engine.flush()
    assert engine.check_all_finished() == 4
    preempted = {r for r, n in engine.num_preemptions.items() if n}
    assert preempted, "the workload did not preempt"
    stats = engine.stats
    assert preempted <= set(stats.finished_events)  # preemption is a terminal event for the worker
    assert stats.scheduled_after_finish >= preempted  # ... and the request comes back
    assert stats.drafts_rejected > 0
    assert engine.connector.cache.stats()["requests"] == 0


@ASYNC
def test_reset_bumps_generation(engines, async_scheduling):
    """A prefix-cache reset (running requests preempted) bumps the generation: the worker
    drops every request and page, running requests come back from scratch and continue from
    the rows already delivered, and keys of the new generation hit again."""
    setup = make_scheduler(lookahead=1, num_spec_tokens=2, async_scheduling=async_scheduling)
    engine = engines(setup, seed=30)
    cache = engine.connector.cache
    rng = _rng(300)
    shared = random_prompt(rng, 14)
    engine.add(make_request(setup, "a", shared + random_prompt(rng, 3), 20))
    engine.add(make_request(setup, "b", shared + random_prompt(rng, 7), 25, prompt_start=5))
    engine.run(until=lambda: len(engine.stats.outputs.get("b", ())) >= 3)
    assert cache.stats()["published"] > 0
    engine.reset_prefix_cache()  # with "a" and "b" running
    engine.add(make_request(setup, "c", shared + random_prompt(rng, 2), 9))
    engine.run_until_finished("a", "b", "c")
    engine.add(make_request(setup, "d", shared + random_prompt(rng, 5), 8))
    engine.run_until_finished("d")
    engine.reset_prefix_cache()  # idle
    engine.add(make_request(setup, "e", shared + random_prompt(rng, 1), 6))
    engine.flush()
    assert engine.check_all_finished() == 5
    assert engine.stats.generations == {0, 1, 2}
    assert cache.generation == 2
    # "a" was re-prefilled from scratch after the reset ...
    assert sum(start == 0 for start, _ in engine.stats.spans["a"]) == 2
    # ... "d" hit blocks published in generation 1, "e" hit nothing from before the reset.
    assert engine.stats.spans["d"][0][0] > 0
    assert engine.stats.spans["e"][0][0] == 0


@ASYNC
def test_weight_update_returns_only_the_new_weights_rows(engines, async_scheduling):
    """The RL loop: rollout, weight update (drain, new routing, prefix-cache reset with requests
    running), the same prompts again. Tokens and block hashes are unchanged by the update, rows
    are not: every row returned after it is the new weights' (the oracle changed), a request
    running across it keeps the rows it already returned, and the repeated prompts hit only
    blocks published after the update."""
    setup = make_scheduler(lookahead=1, num_spec_tokens=2, async_scheduling=async_scheduling)
    engine = engines(setup, seed=31)
    rng = _rng(310)
    shared = random_prompt(rng, 13)
    prompts = [shared + random_prompt(rng, 6), shared + random_prompt(rng, 9)]
    for k, prompt in enumerate(prompts):  # rollout 1, n = 2 per prompt
        engine.add(make_request(setup, f"old{k}a", prompt, 6))
        engine.add(make_request(setup, f"old{k}b", prompt, 6))
    engine.run_until_finished("old0a", "old0b", "old1a", "old1b")
    engine.add(make_request(setup, "across", shared + random_prompt(rng, 4), 30))
    engine.run(until=lambda: len(engine.stats.outputs.get("across", ())) >= 3)
    engine.update_weights()
    for k, prompt in enumerate(prompts):  # rollout 2 on the same prompts
        engine.add(make_request(setup, f"new{k}a", prompt, 6))
        engine.add(make_request(setup, f"new{k}b", prompt, 6))
    engine.flush()
    assert engine.check_all_finished() == 9 and engine.weight_updates == 1
    old, new = engine.assembled("old0a"), engine.assembled("new0a")
    assert list(engine.requests["old0a"].all_token_ids) == list(engine.requests["new0a"].all_token_ids)
    assert old.shape == new.shape and (old != new).any(axis=(1, 2)).all()  # every row changed
    versions = engine.runner.emitted_versions
    assert set(versions["old1b"].values()) == {0} and set(versions["new1b"].values()) == {1}
    assert set(versions["across"].values()) == {0, 1}  # returned rows before and after the update
    assert any(start > 0 for start, _ in engine.stats.spans["new0b"])  # a hit after the update


@ASYNC
@pytest.mark.parametrize("update", [False, True], ids=["pause", "pause-clear-update"])
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes_with_and_without_a_weight_update(engines, async_scheduling, mode, update):
    """The RL loop's pause (vLLM 0.33 / 0.34's ``pause_scheduler`` modes over the real
    scheduler): requests mid-decode, a pause, a request arriving while paused, and either a
    plain resume (``clear_cache=False``) or new weights loaded after the pause cleared the
    caches (the default). Nothing runs while paused; every row returned is the oracle's under
    the weights it was computed with. Under "keep" without clearing, the frozen requests are
    not preempted and continue with the old weights; with clearing, the reset preempts them,
    they keep the rows they returned and get the new weights' for the rest. "abort" ends them
    with what they returned; "wait" lets them finish before the pause completes."""
    setup = make_scheduler(lookahead=1, num_spec_tokens=2, async_scheduling=async_scheduling)
    engine = engines(setup, seed=41)
    rng = _rng(410)
    shared = random_prompt(rng, 13)
    running = [f"run{k}" for k in range(3)]
    for k, request_id in enumerate(running):
        engine.add(make_request(setup, request_id, shared + random_prompt(rng, 5 + k), 24))
    engine.run(until=lambda: all(len(engine.stats.outputs.get(r, ())) >= 3 for r in running))
    preemptions = sum(engine.num_preemptions[r] for r in running)
    engine.pause(mode, clear_cache=update)
    finished_in_pause = set(engine.finished)
    engine.add(make_request(setup, "queued", shared + random_prompt(rng, 7), 8))
    returned = {r: list(spans) for r, spans in engine.stats.outputs.items()}
    for _ in range(5):
        engine.step()
    assert {r: list(spans) for r, spans in engine.stats.outputs.items()} == returned  # paused: nothing ran
    if update:
        engine.load_new_weights()
    engine.resume()
    engine.flush()
    assert engine.check_all_finished() == (1 if mode == "abort" else 4)  # every row against the oracle
    versions = engine.runner.emitted_versions
    assert set(versions["queued"].values()) == {int(update)}
    if mode == "abort":
        assert engine.aborted == set(running)
    elif mode == "wait":
        assert set(running) <= finished_in_pause and all(set(versions[r].values()) == {0} for r in running)
    else:  # keep: frozen, then resumed
        assert not set(running) & finished_in_pause
        assert (sum(engine.num_preemptions[r] for r in running) > preemptions) == update
        assert all(set(versions[r].values()) == ({0, 1} if update else {0}) for r in running)
    assert engine.connector.cache.stats()["requests"] == 0


@ASYNC
def test_retained_pins_are_never_evicted(engines, async_scheduling):
    """0.33's retained / released block hashes (KV-aligned pins) against a small pool.

    The pool is the one ``build_cache`` sizes for a small KV cache (KV blocks, plus the
    scheduler's retained capacity, plus the working set); waves of requests with shared
    prefixes churn it. After every step output, every hash the scheduler retained and did not
    release yet is published in our cache; evictions did happen. (Sized for the KV blocks
    alone, the pool ran out: CacheFullError with every page pinned.)
    """
    setup = make_scheduler(
        lookahead=1, num_spec_tokens=2, async_scheduling=async_scheduling, num_blocks=40, max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    engine = engines(setup, seed=40)
    cache = engine.connector.cache
    pins = RetainedPins(engine.runner)
    rng = _rng(400)
    prefixes = [random_prompt(rng, 9) for _ in range(3)]
    for wave in range(10):
        names = [f"w{wave}-{i}" for i in range(4)]
        for i, name in enumerate(names):
            prompt = prefixes[(wave + i) % 3] + random_prompt(rng, 10 + 3 * i)
            engine.add(make_request(setup, name, prompt, 12 + i))
        if wave % 2:
            engine.run_until_finished(*names)
    engine.flush()
    assert engine.check_all_finished() == 40
    stats = cache.stats()
    assert pins.seen["retained"] > 0 and pins.seen["released"] > 0 and pins.seen["checks"] > 0
    assert stats["evictions"] > 0, f"the pool never evicted: {stats}"
    assert engine.stats.prefix_hit_tokens > 0
    assert pins.retained  # pins still held at the end


def test_harness_detects_wrong_rows(engines):
    """The checks can fail: a connector that returns a rejected draft's row is caught."""
    setup = make_scheduler(lookahead=1, num_spec_tokens=2)
    engine = engines(setup, seed=50, accept=lambda request_id, rng: 0)  # every draft rejected
    connector = engine.connector
    assert isinstance(connector, CacheWorkerConnector)
    original = connector.process_output

    def leak_rejected(pending):
        # Pretend nothing was rejected: the rejected drafts' rows would be kept.
        pending.num_rejected = np.zeros_like(pending.num_rejected)
        return original(pending)

    connector.process_output = leak_rejected
    rng = _rng(500)
    engine.add(make_request(setup, "x", random_prompt(rng, 2 * BLOCK_SIZE + 1), 8))
    with pytest.raises(HarnessError, match="differ from the oracle|rows up to"):
        engine.flush()


@pytest.mark.parametrize("seed", range(6))
def test_randomized_workloads(engines, seed):
    """Random configurations and event streams: arrivals with shared prefixes, aborts,
    prefix-cache resets, preemption from small KV caches; exact rows and pins throughout."""
    rng = _rng(1000 + seed)
    lookahead = 1 + seed % 2
    num_spec_tokens = lookahead if lookahead > 1 else int(rng.integers(1, 5))
    max_num_seqs = int(rng.choice([2, 4, 6]))
    setup = make_scheduler(
        lookahead=lookahead, num_spec_tokens=num_spec_tokens, async_scheduling=seed % 4 >= 2,
        num_blocks=int(rng.choice([16, 24, 40, 200])), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(int(rng.choice([8, 16, 32])), max_num_seqs * (1 + num_spec_tokens)),
        # vLLM 0.33's own scheduler asserts when the threshold cuts a padded 1 + k decode.
        long_prefill_token_threshold=int(rng.choice([0, 8])),
    )
    engine = engines(setup, seed=seed)
    pins = RetainedPins(engine.runner)
    prefixes = [random_prompt(rng, int(rng.integers(3, 20))) for _ in range(3)]
    num_requests = 0
    for _ in range(300):
        event = rng.random()
        if event < 0.08 and num_requests < 20:
            prefix = prefixes[int(rng.integers(0, 3))]
            prompt = prefix[: int(rng.integers(1, len(prefix) + 1))] + random_prompt(rng, int(rng.integers(0, 15)))
            engine.add(make_request(setup, f"r{num_requests}", prompt, int(rng.integers(1, 20)),
                                    prompt_start=int(rng.integers(0, 4))))
            num_requests += 1
        elif event < 0.09:
            live = [r for r in engine.requests if r not in engine.finished and r not in engine.aborted]
            if live:
                engine.abort(live[int(rng.integers(0, len(live)))])
        elif event < 0.095:
            engine.reset_prefix_cache()
        elif event < 0.1:
            engine.update_weights()
        engine.step()
    engine.flush()
    assert engine.check_all_finished() > 0
    assert engine.stats.rows_checked > 0 and pins.seen["checks"] > 0


@pytest.mark.skipif(not CONTRACT.kv_connectors_may_keep_lookahead,
                    reason=f"vLLM {CONTRACT.series} turns lookahead hashing off with any KV connector")
@ASYNC
@pytest.mark.parametrize("which", ["ours", "vllm"])
def test_kv_connector_that_keeps_lookahead_hashing(engines, which, async_scheduling):
    """vLLM 0.34: a KV connector may keep lookahead hashing (``supports_lookahead_block_hashes``,
    as Mooncake and the CPU-offload connectors do), a combination 0.33 never built. External
    hits of prompts whose last full block waits for its
    lookahead hash: every row exact, for ours and for 0.34's own connector."""
    setup = make_scheduler(
        lookahead=1, num_spec_tokens=2, async_scheduling=async_scheduling, num_blocks=24, max_num_seqs=2,
        max_num_batched_tokens=32, max_model_len=96,
        kv_connector={"load_mode": "alternate", "keeps_lookahead_hashes": True},
    )
    engine = engines(setup, which, seed=3)
    rng = _rng(21)
    donors = [random_prompt(rng, 40), random_prompt(rng, 36)]
    for k, donor in enumerate(donors):
        engine.add(make_request(setup, f"a{k}", donor, 4))
    engine.run_until_finished("a0", "a1")
    for request_id in ("f0", "f1"):  # evict the donors' KV; their rows stay retained
        engine.add(make_request(setup, request_id, random_prompt(rng, 60), 4))
        engine.run_until_finished(request_id)
    for k, donor in enumerate(donors):
        engine.add(make_request(setup, f"s{k}", donor + random_prompt(rng, 9), 6))
    engine.flush()
    kv = setup.scheduler.connector.stats
    assert kv["sync_loads"] + kv["async_loads"] >= 1 and kv["loaded_tokens"] >= 32  # external hits happened
    assert engine.stats.drafts_rejected > 0
    assert engine.check_all_finished() == len(engine.requests)
