"""KV load failures with the "recompute" policy: vLLM 0.33 and 0.34 roll back num_computed_tokens.

Runs in the vLLM 0.33 and 0.34 environments (their invalid-block handling is the same). The real ``Scheduler`` with
the stub KV connector of ``cpu_harness/vllm_scheduler/kv_connector.py`` (loaded through vLLM's
``kv_transfer_config``, ``kv_load_failure_policy="recompute"``): request ``s`` re-sends a
donor's 40-token prompt after other traffic evicted the donor's KV (the aux-output scheduler
still retains its rows), so 40 tokens are an external hit, loaded synchronously or
asynchronously; the simulated worker reports its block 1 (tokens [4, 8)) as failed to load.

Synchronous load, what the worker sees (``RollbackEvent`` and ``RunStats.worker_rollbacks``):
step N schedules ``s`` as a new request at num_computed_tokens 40 (10 scheduled tokens, the
rest of the prompt); the aux metadata sends ``s``'s 12 block hashes (blocks 0-9 loaded, 10-11
computed in step N, over the invalid block: their rows are wrong); the worker connector
captures and returns rows [0, 50). The step's output reports the invalid block:
``_handle_invalid_blocks`` sets ``s``'s num_computed_tokens to 4 (the first invalid block)
and drops its output (the client never gets those rows). Step N+1 schedules ``s`` again as a
*running* request: the input batch's num_computed_tokens goes from 50 back to 4. No terminal
event, no hash is re-sent, the emit start stays 0. With ``shared``, request ``t`` (same 40
tokens, other suffix) got a local prefix hit on the blocks ``s`` was loading in the same
step; it is rolled back by exactly its scheduled tokens (50 -> 40) and its output dropped.

Asynchronous load: the failure is handled while the request waits for its KV
(WAITING_FOR_REMOTE_KVS); the worker sees it first at the rolled-back position, so nothing
goes backwards there and vLLM's own worker connector returns exact rows too.

Follow-up requests ``c`` / ``d`` re-send the full histories of ``s`` / ``t``: their prefix
rows come from what the connector published under ``s``'s and ``t``'s block hashes, so rows
computed over the invalid KV (wrongly kept or published) show up there.

``reference`` is the harness's ideal host-dict connector: it passes every scenario, so the
scenarios are satisfiable (a failure of "ours" is the connector's).
"""

import numpy as np
import pytest

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    HarnessError,
    SimEngine,
    SnapshotCapturer,
    build_our_connector,
    build_reference_connector,
    build_vllm_connector,
    make_request,
    make_scheduler,
    random_prompt,
)

BUILD = {"ours": lambda setup, _capturer: build_our_connector(setup), "vllm": build_vllm_connector, "reference": build_reference_connector}
SPEC = pytest.mark.parametrize("num_spec_tokens", [0, 2], ids=["nospec", "mtp2"])
VLLM_ERROR = "auxiliary output capture moved backwards"


def _scenario(which: str, *, load_mode: str, num_spec_tokens: int, shared: bool, async_scheduling: bool = False):
    setup = make_scheduler(
        lookahead=0, num_spec_tokens=num_spec_tokens, async_scheduling=async_scheduling, num_blocks=24,
        max_num_seqs=2, max_num_batched_tokens=32, max_model_len=96,
        kv_connector={"load_mode": load_mode, "async_load_steps": 1},
    )
    engine = SimEngine(setup, BUILD[which](setup, SnapshotCapturer()), seed=3)
    rng = np.random.default_rng(1234)
    donor = random_prompt(rng, 40)
    engine.add(make_request(setup, "a", donor, 4))
    engine.run_until_finished("a")
    # 32 blocks of other traffic: the donor's KV is evicted, its 10 blocks stay retained
    # (the aux-output scheduler keeps 2 x 24 blocks with a KV connector).
    for request_id in ("f0", "f1"):
        engine.add(make_request(setup, request_id, random_prompt(rng, 60), 4))
        engine.run_until_finished(request_id)
    failed = []

    def fault(job):  # s's first load loses block 1 of the request (index 1 of the load)
        if job.request_id == "s" and not failed:
            failed.append(job)
            return [1]
        return []

    setup.kv_worker.fault = fault
    engine.add(make_request(setup, "s", donor + random_prompt(rng, 10), 4))
    if shared:
        engine.add(make_request(setup, "t", donor + random_prompt(rng, 10), 4))
    return setup, engine, rng, failed


def _finish(engine, setup, rng, shared: bool) -> None:
    engine.run_until_finished(*(["s", "t"] if shared else ["s"]))
    # Histories re-sent: their prefix rows are read from what s and t published.
    engine.add(make_request(setup, "c", list(engine.requests["s"].all_token_ids) + random_prompt(rng, 6), 3))
    if shared:
        engine.add(make_request(setup, "d", list(engine.requests["t"].all_token_ids) + random_prompt(rng, 6), 3))
    engine.flush()


def _check_sync_rollback(setup, engine, failed, shared: bool) -> None:
    """The roll-back really happened, as described in the module docstring."""
    assert len(failed) == 1 and not failed[0].is_async and failed[0].first_block == 0
    assert [(e.changed, e.skipped, e.running) for e in engine.rollbacks] == [(
        {"s": (50, 4), **({"t": (50, 40)} if shared else {})},
        {"s", "t"} if shared else {"s"},
        {"s", "t"} if shared else {"s"},
    )]
    event = engine.rollbacks[0]
    assert event.scheduled == ({"s": 10, "t": 10} if shared else {"s": 10})
    assert event.hashes_sent["s"] == 12  # blocks 0-11: 10 loaded, 2 computed over the invalid block
    assert engine.stats.poisoned_steps["s"][0] == (40, 50)
    assert engine.stats.worker_rollbacks[:1] == [("s", 50, 4)]


@SPEC
@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
def test_sync_load_failure_breaks_vllm_worker_connector(num_spec_tokens, shared):
    setup, engine, rng, failed = _scenario("vllm", load_mode="sync", num_spec_tokens=num_spec_tokens, shared=shared)
    try:
        with pytest.raises(AssertionError, match=VLLM_ERROR):
            _finish(engine, setup, rng, shared)
        _check_sync_rollback(setup, engine, failed, shared)
    finally:
        engine.close()


@SPEC
@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
@pytest.mark.parametrize("which", ["ours", "reference"])
def test_sync_load_failure_exact_rows(which, num_spec_tokens, shared):
    setup, engine, rng, failed = _scenario(which, load_mode="sync", num_spec_tokens=num_spec_tokens, shared=shared)
    try:
        _finish(engine, setup, rng, shared)
        _check_sync_rollback(setup, engine, failed, shared)
        if shared:
            assert ("t", 50, 40) in engine.stats.worker_rollbacks
        assert engine.check_all_finished() == len(engine.requests)
        # s recomputed [4, 50) after the roll-back; c read s's blocks as a prefix hit.
        assert (4, 36) in engine.stats.spans["s"]
        assert engine.stats.spans["c"][0][0] >= 48
        if which == "ours":
            assert engine.connector.cache.stats()["requests"] == 0
    finally:
        engine.close()


@SPEC
@pytest.mark.parametrize("which", ["ours", "vllm", "reference"])
def test_async_load_failure_is_invisible_to_the_worker(which, num_spec_tokens):
    setup, engine, rng, failed = _scenario(which, load_mode="async", num_spec_tokens=num_spec_tokens, shared=False)
    try:
        _finish(engine, setup, rng, shared=False)
        assert len(failed) == 1 and failed[0].is_async
        # Rolled back while loading (not running), before the worker ever saw the request.
        assert [(e.changed, e.skipped, e.running) for e in engine.rollbacks] == [({"s": (40, 4)}, set(), set())]
        assert engine.rollbacks[0].hashes_sent["s"] == 0
        assert engine.stats.worker_rollbacks == []
        assert engine.stats.spans["s"][0] == (4, 36)
        assert engine.stats.poisoned_rows == 0
        assert engine.check_all_finished() == len(engine.requests)
    finally:
        engine.close()


def test_async_scheduling_rollback_counts_the_step_in_flight():
    """Under AsyncScheduler the roll-back is computed from a count that includes the next step.

    ``_update_requests_with_invalid_blocks`` subtracts only the processed step's scheduled
    tokens, while num_computed_tokens already includes the step scheduled since: ``t`` is
    set to 41, not 40 (the position computed over the invalid KV in the step in flight is
    kept), and that step ran on the token the scheduler dropped. The simulated device does
    not model this and refuses to go on.
    """
    setup, engine, rng, failed = _scenario("reference", load_mode="sync", num_spec_tokens=0, shared=True,
                                           async_scheduling=True)
    try:
        with pytest.raises(HarnessError, match="under async scheduling"):
            _finish(engine, setup, rng, shared=True)
        (event,) = engine.rollbacks
        assert event.changed == {"s": (51, 4), "t": (51, 41)}
        assert event.scheduled == {"s": 10, "t": 10} and event.skipped == {"s", "t"}
    finally:
        engine.close()
