"""Faults and concurrency in the worker connector, with vLLM 0.33's / 0.34's metadata types, no model.

Each fault yields a typed error (or a documented recovery), names the request, and leaves
every other request's rows intact and readable. The concurrency test runs ``begin_step`` on
one thread and ``process_output`` on another, as vLLM does, for many steps.
"""

import logging
import queue
import threading

import numpy as np
import pytest
import torch
from connector_rows import PAGE, ROW, FixedCapturer, input_batch, pack_hashes, row_of
from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

from cpu_harness.vllm_scheduler import SnapshotCapturer, build_our_connector, make_scheduler
from routed_experts_cache import CacheFullError, RoutedExpertsCache, RoutedExpertsCacheError
from routed_experts_cache.connector import batch_size
from routed_experts_cache.connector.vllm.worker import (
    LOG_INTERVAL_ENV,
    CacheWorkerConnector,
    ConnectorStateError,
    log_interval,
)



def block_hash(request_id: str, block: int) -> bytes:
    return f"{request_id}/{block}".encode().ljust(16, b".")


def metadata(requests=None, hashes=None, finished=(), generation=0, retained=(), released=()):
    return AuxOutputConnectorMetadata(
        generation=generation,
        requests=dict(requests or {}),
        block_hashes={r: pack_hashes(h) for r, h in (hashes or {}).items()},
        finished_requests=tuple(finished),
        retained_block_hashes=pack_hashes(retained),
        released_block_hashes=pack_hashes(released),
    )


class Driver:
    """Feeds one connector the way Model Runner V2 does; steps are (request, start, count)."""

    def __init__(self, num_pages: int = 64) -> None:
        self.capturer = FixedCapturer()
        self.cache = RoutedExpertsCache(num_pages, PAGE, ROW)
        self.connector = CacheWorkerConnector(capturer=self.capturer, cache=self.cache, max_concurrent_batches=2)

    def launch(self, meta, batch, rejected=None, padded_requests=0):
        """begin_step + prepare_output + enqueue_cpu_copy; returns the pending output.
        ``padded_requests``: entries past the batch in ``query_start_loc_np``, as vLLM pads them."""
        self.connector.begin_step(meta)
        if not batch:
            return None
        rows, starts, loc = [], [], [0]
        for request_id, start, count in batch:
            rows += [row_of(request_id, p) for p in range(start, start + count)]
            starts.append(start)
            loc.append(loc[-1] + count)
        loc += [loc[-1]] * padded_requests
        self.capturer.rows = torch.from_numpy(np.stack(rows))
        pending = self.connector.prepare_output(input_batch([r for r, _, _ in batch], loc, starts))
        rejected = rejected or [0] * len(batch)
        pending.enqueue_cpu_copy(np.ones(len(batch), dtype=np.int32), np.array(rejected, dtype=np.int32))
        return pending

    def step(self, meta, batch, rejected=None, padded_requests=0):
        pending = self.launch(meta, batch, rejected, padded_requests)
        return None if pending is None else pending.process_output()

    def expect_rows(self, request_id: str, start: int, end: int) -> None:
        want = np.stack([row_of(request_id, p) for p in range(start, end)])
        np.testing.assert_array_equal(self.cache.read(request_id, start, end).numpy(), want)


def check_output(output: dict, request_id: str, start: int, end: int) -> None:
    got = output[request_id]
    assert got.token_start == start and got.rows.shape == (end - start, *ROW)
    np.testing.assert_array_equal(got.rows, np.stack([row_of(request_id, p) for p in range(start, end)]))


def two_requests(driver: Driver) -> None:
    """a: 6 prompt rows + 1 decode row; b: 5 rows. Both readable afterwards."""
    out = driver.step(metadata({"a": 0, "b": 0}), [("a", 0, 6), ("b", 0, 5)])
    check_output(out, "a", 0, 6)
    out = driver.step(metadata({"a": 6}, hashes={"a": [block_hash("a", 0)]}), [("a", 6, 1)])
    check_output(out, "a", 6, 7)


def test_returned_rows_are_owned_when_the_capturer_reuses_its_buffer():
    """Rows handed to vLLM stay the request's rows after the capturer writes its buffer again
    (a CPU snapshot in the pool dtype is the capturer's own tensor, not a copy)."""
    driver = Driver()
    out = driver.step(metadata({"a": 0, "b": 0}), [("a", 0, 6), ("b", 0, 5)])
    driver.capturer.rows.fill_(255)  # the capturer's next step overwrites the same buffer
    check_output(out, "a", 0, 6)
    check_output(out, "b", 0, 5)


def test_pool_exhaustion_mid_batch_fails_the_step_and_keeps_other_rows():
    driver = Driver(num_pages=5)
    two_requests(driver)  # a: 2 pages, b: 2 pages -> 1 page left
    before = driver.cache.stats()
    with pytest.raises(CacheFullError, match=r"'c' \[0, 12\)"):
        driver.step(metadata({"a": 7, "c": 0}), [("a", 7, 1), ("c", 0, 12)])
    # begin_step took 'c' in (a cache slot, no rows); the refused capture wrote nothing.
    assert driver.cache.stats() == {**before, "requests": before["requests"] + 1}
    driver.expect_rows("a", 0, 7)
    driver.expect_rows("b", 0, 5)
    # Recovery: the refused step captured nothing; the request's next step starts at its cursor.
    out = driver.step(metadata({"a": 7}), [("a", 7, 1)])
    check_output(out, "a", 7, 8)


@pytest.mark.parametrize("small", [True, False], ids=["small-batch", "array"])
@pytest.mark.parametrize("scheduled_first", ["a", "b"])
def test_a_block_two_requests_compute_in_one_step_is_published_from_the_one_vllm_scheduled_first(
    monkeypatch, small, scheduled_first
):
    """Model Runner V2's input batch need not follow the scheduler's order (the metadata's).
    Two requests compute the same block in one step; vLLM serves later hits from the KV block of
    the one it scheduled first, so that one's rows are published, and each request still gets
    its own rows."""
    if not small:
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    driver = Driver()
    shared = block_hash("shared", 0)
    order = {scheduled_first: 0, "b" if scheduled_first == "a" else "a": 0}
    out = driver.step(metadata(order, hashes={"a": [shared], "b": [shared]}), [("a", 0, PAGE + 1), ("b", 0, PAGE + 1)])
    check_output(out, "a", 0, PAGE + 1)
    check_output(out, "b", 0, PAGE + 1)
    out = driver.step(metadata({"c": 0}, hashes={"c": [shared]}), [("c", PAGE, 1)])  # a prefix hit of the block
    want = np.stack([row_of(scheduled_first, p) for p in range(PAGE)])
    np.testing.assert_array_equal(out["c"].rows[:PAGE], want)


@pytest.mark.parametrize("case", ["unknown", "finished", "two unknown"])
def test_hashes_for_a_request_that_is_not_running_are_refused(case):
    driver = Driver()
    two_requests(driver)
    if case == "finished":
        driver.step(metadata(finished=["b"]), [])
    target = {"unknown": "zz", "finished": "b", "two unknown": "yy"}[case]
    hashes = {"a": [block_hash("a", 1)], target: [block_hash(target, 0)]}
    if case == "two unknown":  # the first one listed is named
        hashes["xx"] = [block_hash("xx", 0)]
    before = driver.cache.stats()
    with pytest.raises(ConnectorStateError, match=f"request {target!r}, which is not running"):
        driver.step(metadata({"a": 7}, hashes=hashes), [])
    assert driver.cache.stats() == before  # a's hash was not applied either
    driver.expect_rows("a", 0, 7)


def test_a_step_with_a_bad_block_hash_is_refused_before_anything_changes():
    driver = Driver()
    two_requests(driver)
    before = driver.cache.stats()
    bad = AuxOutputConnectorMetadata(
        generation=0, requests={"a": 7, "n": 0}, block_hashes={"a": [block_hash("a", 1)], "b": [b"ok", "not bytes"]},
        finished_requests=(), retained_block_hashes=pack_hashes([block_hash("zz", 9)]), released_block_hashes=None,
    )
    with pytest.raises(RoutedExpertsCacheError, match="'b'.*'not bytes'"):
        driver.connector.begin_step(bad)
    # Neither the pin, nor a's hash, nor the new request 'n' was applied.
    assert driver.cache.stats() == before
    assert driver.connector.stats()["requests_tracked"] == 2
    driver.expect_rows("a", 0, 7)
    out = driver.step(metadata({"a": 7}), [("a", 7, 1)])
    check_output(out, "a", 7, 8)


@pytest.mark.parametrize("bad_id", [True, ("a",), 1.5, b"n"])
@pytest.mark.parametrize("generation", [0, 1])
def test_a_new_request_id_of_the_wrong_type_is_refused_before_anything_changes(bad_id, generation):
    """New requests' ids are checked at begin_step (the cache's step call takes them as they
    come); a refusal changes nothing, also when the step would start a new generation."""
    driver = Driver()
    two_requests(driver)
    before = driver.cache.stats()
    with pytest.raises(RoutedExpertsCacheError, match="request id must be a str or int"):
        driver.connector.begin_step(metadata({"a": 7, "n": 0, bad_id: 0}, finished=["b"], generation=generation))
    assert driver.cache.stats() == before
    assert driver.connector.stats()["requests_tracked"] == 2
    driver.expect_rows("a", 0, 7)
    out = driver.step(metadata({"a": 7}), [("a", 7, 1)])
    check_output(out, "a", 7, 8)


def test_reset_with_outputs_in_flight_is_refused_and_changes_nothing():
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"a": 7}), [("a", 7, 1)])
    before = driver.cache.stats()
    with pytest.raises(ConnectorStateError, match="in flight"):
        driver.connector.begin_step(metadata({"b": 5}, generation=1))
    assert driver.cache.stats() == before
    check_output(pending.process_output(), "a", 7, 8)
    # Once nothing is in flight, the new generation starts from an empty cache.
    driver.step(metadata({"n": 0}, generation=1), [("n", 0, 3)])
    assert driver.cache.stats()["requests"] == 1
    driver.expect_rows("n", 0, 3)


def test_metadata_that_goes_backwards_is_refused():
    driver = Driver()
    driver.step(metadata({"a": 0}, generation=2), [("a", 0, 3)])
    with pytest.raises(ConnectorStateError, match="backwards"):
        driver.connector.begin_step(metadata({"a": 3}, generation=1))
    with pytest.raises(ConnectorStateError, match=r"'a'.*emit start 9"):
        driver.connector.begin_step(metadata({"a": 9}, generation=2))
    with pytest.raises(ConnectorStateError, match="scheduled and finished"):
        driver.connector.begin_step(metadata({"a": 3}, finished=["a"], generation=2))
    out = driver.step(metadata({"a": 3}, generation=2), [("a", 3, 1)])
    check_output(out, "a", 3, 4)


@pytest.mark.parametrize("small_batch", [batch_size.SMALL_BATCH, 0])  # the plain pass, the array pass
def test_a_step_past_max_concurrent_batches_in_flight_is_refused(monkeypatch, small_batch):
    """vLLM keeps at most ``max_concurrent_batches`` step outputs in flight; one more means its
    outputs are not consumed: refused, and the steps in flight still return their rows."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", small_batch)
    driver = Driver()
    driver.step(metadata({"a": 0}), [("a", 0, 3)])
    first = driver.launch(metadata({"a": 3}), [("a", 3, 1)])
    second = driver.launch(metadata({"a": 4}), [("a", 4, 1)])
    with pytest.raises(ConnectorStateError, match="2 step outputs are in flight, more than max_concurrent_batches=2"):
        driver.launch(metadata({"a": 5}), [("a", 5, 1)])
    check_output(first.process_output(), "a", 3, 4)
    check_output(second.process_output(), "a", 4, 5)


@pytest.mark.parametrize("small_batch", [batch_size.SMALL_BATCH, 0])  # the plain pass, the array pass
def test_an_emit_start_ahead_of_the_rows_delivered_is_refused_only_with_nothing_in_flight(monkeypatch, small_batch):
    """vLLM's emit start assumes that the drafts in flight were accepted: ahead of the rows
    delivered is allowed while a step of the request is in flight, refused once none is; a
    request not tracked yet starts where the scheduler says (a prefix hit), whatever other
    requests' cursors are."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", small_batch)
    driver = Driver()
    driver.step(metadata({"a": 0, "b": 0}), [("a", 0, 3), ("b", 0, 3)])
    pending = driver.launch(metadata({"a": 3}), [("a", 3, 2)], rejected=[1])
    driver.connector.begin_step(metadata({"a": 5, "b": 3, "n": 16}))
    with pytest.raises(ConnectorStateError, match=r"request 'b': scheduler emit start 4 is ahead of the rows delivered so far \(3\)"):
        driver.connector.begin_step(metadata({"a": 5, "b": 4, "n": 16}))
    check_output(pending.process_output(), "a", 3, 4)


@pytest.mark.parametrize("small_batch", [batch_size.SMALL_BATCH, 0])  # the plain pass, the array pass
@pytest.mark.parametrize("rejected, scheduled", [(3, 2), (-1, 2), (0, 0)],
                         ids=["more rejected than scheduled", "negative", "no rows scheduled"])
def test_invalid_acceptance_counts_are_refused_naming_the_request(monkeypatch, small_batch, rejected, scheduled):
    monkeypatch.setattr(batch_size, "SMALL_BATCH", small_batch)
    driver = Driver()
    two_requests(driver)
    before = driver.cache.stats()
    with pytest.raises(ConnectorStateError, match=rf"request 'b': invalid step rows \({scheduled} scheduled, {rejected} rejected\)"):
        driver.step(metadata({"a": 7, "b": 5}), [("a", 7, 1), ("b", 5, scheduled)], rejected=[0, rejected])
    assert driver.cache.stats() == before
    driver.expect_rows("a", 0, 7)
    driver.expect_rows("b", 0, 5)


@pytest.mark.parametrize("small_batch", [batch_size.SMALL_BATCH, 0])  # the plain pass, the array pass
def test_a_step_padded_for_cuda_graphs_returns_what_the_unpadded_step_returns(monkeypatch, small_batch):
    """Under full CUDA graphs, vLLM 0.33 / 0.34 (``gpu/model_runner.py``) hand the step a
    ``query_start_loc_np`` of the padded request count + 1 entries, the pads at the step's token
    count; its other arrays cover the real requests. The connector reads the batch's entries only."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", small_batch)
    runs = []
    for padded_requests in (0, 3):
        driver = Driver()
        outputs = [
            driver.step(metadata({"a": 0, "b": 0}), [("a", 0, 6), ("b", 0, 5)], padded_requests=padded_requests),
            driver.step(metadata({"a": 6, "b": 5}, hashes={"a": [block_hash("a", 0)]}), [("b", 5, 2), ("a", 6, 1)],
                        rejected=[1, 0], padded_requests=padded_requests),
        ]
        check_output(outputs[0], "a", 0, 6)
        check_output(outputs[1], "b", 5, 6)
        check_output(outputs[1], "a", 6, 7)
        runs.append(([{r: (o.token_start, o.rows.tolist()) for r, o in out.items()} for out in outputs], driver.cache.stats()))
    assert runs[0] == runs[1]


def test_acceptance_counts_for_fewer_requests_than_the_step_are_refused():
    driver = Driver()
    two_requests(driver)
    before = driver.cache.stats()
    with pytest.raises(ConnectorStateError, match=r"acceptance counts for 2 / 1 of 2 requests"):
        driver.step(metadata({"a": 7, "b": 5}), [("a", 7, 1), ("b", 5, 1)], rejected=[0])
    assert driver.cache.stats() == before


def test_capture_that_skips_positions_is_refused_and_others_stay_readable():
    driver = Driver()
    two_requests(driver)
    with pytest.raises(ConnectorStateError, match=r"'a'.*\[7, 9\) were never scheduled"):
        driver.step(metadata({"a": 7, "b": 5}), [("b", 5, 1), ("a", 9, 1)])
    driver.expect_rows("a", 0, 7)
    driver.expect_rows("b", 0, 5)
    out = driver.step(metadata({"a": 7, "b": 5}), [("b", 5, 1), ("a", 7, 1)])
    check_output(out, "a", 7, 8)
    check_output(out, "b", 5, 6)


def test_release_of_unretained_hash_is_refused_atomically():
    driver = Driver()
    two_requests(driver)
    driver.step(metadata(retained=[block_hash("a", 0)]), [])
    before = driver.cache.stats()
    with pytest.raises(Exception, match="not retained"):
        driver.connector.begin_step(metadata(retained=[block_hash("b", 0)], released=[block_hash("zz", 0)]))
    assert driver.cache.stats() == before
    driver.step(metadata(released=[block_hash("a", 0)]), [])


def test_pool_updates_wait_for_the_output_thread_and_apply_in_order():
    """begin_step leaves the pool as it is (block hashes, pins, a finished request's pages):
    the next process_output applies them, in the order the steps began, before its own
    step; the pool seen through the connector has them at once."""
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"b": 5}), [("b", 5, 1)])
    before = driver.cache.stats()
    driver.connector.begin_step(metadata({"b": 6}, hashes={"b": [block_hash("b", 0)]}, finished=["a"],
                                         retained=[block_hash("a", 0)]))
    assert driver.cache.stats() == before  # the model thread did not touch the pool
    assert not driver.cache.is_published(block_hash("b", 0))
    check_output(pending.process_output(), "b", 5, 6)  # applies the step begun meanwhile first
    stats = driver.cache.stats()
    assert stats["requests"] == 1 and driver.cache.is_published(block_hash("b", 0))
    assert driver.cache.is_published(block_hash("a", 0))  # a's published block stays: retained
    driver.step(metadata(released=[block_hash("a", 0)]), [])  # the retain is applied: its release is accepted
    assert driver.connector.stats()["pinned_hashes"] == 1  # b's own block only


def test_updates_of_a_step_without_output_are_applied_by_the_next_step():
    """With no step output in flight nothing else would apply a step's deferred updates: the
    next begin_step does (the deferred updates never span more than the steps in flight)."""
    driver = Driver()
    two_requests(driver)
    driver.connector.begin_step(metadata(finished=["a"]))
    assert driver.cache.stats()["requests"] == 2  # a's pages: deferred
    driver.connector.begin_step(metadata())
    assert driver.cache.stats()["requests"] == 1


def test_a_request_id_scheduled_again_while_its_teardown_is_deferred_starts_fresh():
    """vLLM may schedule a new request under a finished one's id: the pool lets go of the old
    one first, and the new one's rows start at 0."""
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"b": 5}), [("b", 5, 1)])  # keeps the pool updates deferred
    driver.connector.begin_step(metadata(finished=["a"]))
    again = driver.launch(metadata({"a": 0}), [("a", 0, 3)])
    check_output(pending.process_output(), "b", 5, 6)
    check_output(again.process_output(), "a", 0, 3)
    assert driver.cache.stats()["requests"] == 2
    driver.expect_rows("a", 0, 3)


def test_releases_are_checked_against_deferred_pins_when_they_arrive():
    """A release is refused at begin_step, changing nothing, unless the hash is retained as
    often, counting the pins of steps whose pool updates are still deferred."""
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"b": 5}), [("b", 5, 1)])  # keeps the following updates deferred
    driver.connector.begin_step(metadata(retained=[block_hash("a", 0)]))
    driver.connector.begin_step(metadata(released=[block_hash("a", 0)]))  # the deferred retain counts
    before = driver.cache.stats()
    with pytest.raises(RoutedExpertsCacheError, match="not retained"):
        driver.connector.begin_step(metadata(released=[block_hash("a", 0)]))  # released already, deferred
    with pytest.raises(RoutedExpertsCacheError, match="not retained"):
        driver.connector.begin_step(metadata(retained=[block_hash("b", 0)], released=[block_hash("b", 0)] * 2))
    assert driver.cache.stats() == before
    check_output(pending.process_output(), "b", 5, 6)
    assert driver.connector.stats()["pinned_hashes"] == 1  # a's own block (a still runs)


def test_teardown_waits_for_outputs_in_flight():
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"a": 7}), [("a", 7, 2)], rejected=[1])
    driver.connector.begin_step(metadata(finished=["a"]))  # terminal event while a step is in flight
    assert driver.cache.stats()["requests"] == 2
    check_output(pending.process_output(), "a", 7, 8)  # the rejected draft row is dropped
    assert driver.cache.stats()["requests"] == 1
    with pytest.raises(Exception, match="'a' is unknown"):
        driver.cache.read("a", 0, 1)


@pytest.mark.parametrize("small_batch", [batch_size.SMALL_BATCH, 0])  # the plain pass, the array pass
def test_a_step_finishing_several_requests_tears_down_the_idle_ones_now_and_the_others_later(
    monkeypatch, small_batch
):
    """Terminal events for several requests in one step (one listed twice, one never
    scheduled): those without outputs in flight leave at once, the one with a step in flight
    once that step is processed, and every other request's rows stay readable."""
    monkeypatch.setattr(batch_size, "SMALL_BATCH", small_batch)
    driver = Driver()
    driver.step(metadata({"a": 0, "b": 0, "c": 0, "d": 0}), [("a", 0, 3), ("b", 0, 2), ("c", 0, 4), ("d", 0, 1)])
    pending = driver.launch(metadata({"b": 2}), [("b", 2, 1)])  # b has a step in flight
    driver.connector.begin_step(metadata(finished=["a", "b", "never", "c", "a"]))
    assert driver.connector.stats()["requests_tracked"] == 2  # b (in flight) and d
    assert driver.cache.stats()["requests"] == 2  # stats() applied the pool's updates: a and c left
    check_output(pending.process_output(), "b", 2, 3)
    assert driver.connector.stats()["requests_tracked"] == 1
    assert driver.cache.stats()["requests"] == 1
    for request_id in ("a", "b", "c"):
        with pytest.raises(RoutedExpertsCacheError, match=f"'{request_id}' is unknown"):
            driver.cache.read(request_id, 0, 1)
    driver.expect_rows("d", 0, 1)
    out = driver.step(metadata({"d": 1, "a": 0}), [("d", 1, 1), ("a", 0, 2)])  # "a" again: a new request
    check_output(out, "d", 1, 2)
    check_output(out, "a", 0, 2)


def test_a_request_scheduled_again_before_its_teardown_completes_is_refused():
    """A finished request whose step output is still in flight cannot be scheduled again
    under its id until that output is processed: the step is refused and changes nothing."""
    driver = Driver()
    two_requests(driver)
    pending = driver.launch(metadata({"a": 7}), [("a", 7, 2)])
    driver.connector.begin_step(metadata(finished=["a"]))
    before = driver.connector.stats()
    with pytest.raises(ConnectorStateError, match="request 'a' was scheduled again before its teardown completed"):
        driver.connector.begin_step(metadata({"b": 5, "a": 0}))
    assert driver.connector.stats() == before
    check_output(pending.process_output(), "a", 7, 9)
    again = driver.launch(metadata({"a": 0}), [("a", 0, 3)])  # torn down now: a new request
    check_output(again.process_output(), "a", 0, 3)


def test_begin_step_and_process_output_on_two_threads():
    """Model thread runs ahead (<= 2 steps in flight); the output thread checks every row."""
    driver = Driver(num_pages=400)
    rng = np.random.default_rng(0)
    in_flight: queue.Queue = queue.Queue()
    slots = threading.Semaphore(2)  # max_concurrent_batches steps launched and not yet processed
    received: dict[str, list] = {}
    errors: list[BaseException] = []

    def output_thread():
        try:
            while (item := in_flight.get()) is not None:
                for request_id, out in item.process_output().items():
                    received.setdefault(request_id, []).append((out.token_start, out.rows.copy()))
                slots.release()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    worker = threading.Thread(target=output_thread)
    worker.start()
    live: dict[str, int] = {}
    hashed: dict[str, int] = {}
    finished_total, next_id = 0, 0
    try:
        for step in range(400):
            finishing = [r for r in live if rng.random() < 0.04]
            for request_id in finishing:
                del live[request_id]
            while len(live) < 12:
                live[f"r{next_id}"], next_id = 0, next_id + 1
            batch, hashes = [], {}
            for request_id, cursor in live.items():
                count = int(rng.integers(1, 7)) if cursor < 20 else 1
                batch.append((request_id, cursor, count))
                full = cursor // PAGE
                if full > hashed.get(request_id, 0):
                    hashes[request_id] = [block_hash(request_id, b) for b in range(hashed.get(request_id, 0), full)]
                    hashed[request_id] = full
            meta = metadata({r: c for r, c, _ in batch if c == 0}, hashes=hashes, finished=finishing)
            meta.requests.update({r: c for r, c, _ in batch if c > 0})
            if not slots.acquire(timeout=60):
                raise AssertionError("output thread stopped consuming")
            pending = driver.launch(meta, batch)
            for request_id, cursor, count in batch:
                live[request_id] = cursor + count
            in_flight.put(pending)
            finished_total += len(finishing)
            if errors:
                break
    finally:
        in_flight.put(None)
        worker.join(timeout=60)
    assert not worker.is_alive(), "output thread deadlocked"
    if errors:
        raise errors[0]
    assert finished_total > 20
    for request_id, chunks in received.items():
        position = 0
        for start, rows in chunks:
            assert start == position, f"{request_id}: chunk at {start}, expected {position}"
            np.testing.assert_array_equal(rows, np.stack([row_of(request_id, p) for p in range(start, start + len(rows))]))
            position += len(rows)
    assert sum(len(c) for c in received.values()) > 2000
    driver.cache.check_consistency()


def test_a_step_without_metadata_after_real_steps_returns_nothing_and_changes_nothing():
    """``begin_step(None)`` (a step the scheduler built no routed-experts metadata for) is
    never served the previous step's metadata: ``prepare_output`` returns None for its batch,
    even one of requests the connector never saw, and the next real step goes on."""
    driver = Driver()
    two_requests(driver)
    before = (driver.cache.stats(), driver.connector.stats())
    driver.connector.begin_step(None)
    driver.capturer.rows = torch.from_numpy(np.stack([row_of("dummy", p) for p in range(2)]))
    assert driver.connector.prepare_output(input_batch(["dummy"], [0, 2], [0])) is None
    assert (driver.cache.stats(), driver.connector.stats()) == before
    check_output(driver.step(metadata({"a": 7}), [("a", 7, 1)]), "a", 7, 8)
    driver.expect_rows("b", 0, 5)


def test_a_step_covering_a_request_never_scheduled_names_only_that_one():
    driver = Driver()
    two_requests(driver)  # "a" holds slot 0
    driver.connector.begin_step(metadata({"a": 7}))
    driver.capturer.rows = torch.from_numpy(np.stack([row_of(r, 7) for r in ("a", "zz")]))
    with pytest.raises(ConnectorStateError, match=r"step covers requests \['zz'\] that were never scheduled"):
        driver.connector.prepare_output(input_batch(["a", "zz"], [0, 1, 2], [7, 0]))
    check_output(driver.step(metadata({"a": 7}), [("a", 7, 1)]), "a", 7, 8)


def test_backend_is_chosen_by_environment(monkeypatch):
    setup = make_scheduler(lookahead=1)
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE_BACKEND", "torch")
    assert build_our_connector(setup, SnapshotCapturer()).cache.backend == "torch"
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE_BACKEND", "triton")  # on CPU under TRITON_INTERPRET=1
    assert build_our_connector(setup, SnapshotCapturer()).cache.backend == "triton"
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE_BACKEND", "cuda-graphs")
    with pytest.raises(RoutedExpertsCacheError, match=r"ROUTED_EXPERTS_CACHE_BACKEND='cuda-graphs' is not understood"):
        build_our_connector(setup, SnapshotCapturer())


def test_returned_arrays_are_owned_and_survive_page_reuse():
    driver = Driver(num_pages=6)
    first = driver.step(metadata({"a": 0, "b": 0}), [("a", 0, 6), ("b", 0, 5)])
    kept = {r: (out.token_start, out.rows) for r, out in first.items()}  # no copies taken
    assert all(out.rows.base is None or not np.shares_memory(out.rows, driver.cache.pages.numpy()) for out in first.values())
    driver.step(metadata(finished=["a", "b"]), [])
    for k in range(3):  # every page is reused by later requests
        driver.step(metadata({f"n{k}": 0}, finished=[f"n{k - 1}"] if k else []), [(f"n{k}", 0, 12)])
    assert driver.cache.stats()["free"] <= 3
    for request_id, (start, rows) in kept.items():
        np.testing.assert_array_equal(rows, np.stack([row_of(request_id, p) for p in range(start, start + len(rows))]))


def test_ranks_without_a_cache_follow_the_steps_and_return_nothing():
    # vLLM's rule: every TP rank captures, only the first keeps and returns rows.
    capturer = FixedCapturer()
    connector = CacheWorkerConnector(capturer=capturer, cache=None, max_concurrent_batches=2)
    capturer.rows = torch.from_numpy(np.stack([row_of("a", p) for p in range(PAGE)]))
    for generation in (0, 1):
        connector.begin_step(metadata({"a": 0}, {"a": [block_hash("a", 0)]}, generation=generation))
        assert connector.prepare_output(input_batch(["a"], [0, PAGE], [0])) is None
    assert connector.cache is None
    assert connector.stats() == {"reattachments": 0, "rollbacks": 0, "returned_rows": 0, "requests_tracked": 0}
    connector.close()


def test_stats_line_reports_pool_use_and_counters_since_the_last_line(caplog, monkeypatch):
    driver = Driver()
    driver.connector = CacheWorkerConnector(
        capturer=driver.capturer, cache=driver.cache, max_concurrent_batches=2, stats_log_interval=1e-9
    )
    with caplog.at_level(logging.INFO, logger="vllm.routed_experts_cache"):
        two_requests(driver)
    lines = [r.getMessage() for r in caplog.records if "pool" in r.getMessage()]
    assert len(lines) == 2  # one per processed step at this interval
    stats = driver.cache.stats()
    in_use = stats["num_pages"] - stats["free"]
    assert f"({in_use} of {stats['num_pages']} pages: {stats['tail']} tail, {stats['pending']} pending" in lines[-1]
    assert "2 requests" in lines[-1] and "1 rows captured, 1 returned (0 of them read from the pool)" in lines[-1]
    assert "11 rows captured, 11 returned (0 of them read from the pool)" in lines[0]
    quiet = Driver()  # the default: no stats lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.routed_experts_cache"):
        two_requests(quiet)
    assert not [r for r in caplog.records if "pool" in r.getMessage()]


@pytest.mark.parametrize(("value", "seconds"), [(None, 10.0), ("0", 0.0), ("2.5", 2.5)])
def test_log_interval_from_the_environment(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(LOG_INTERVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(LOG_INTERVAL_ENV, value)
    assert log_interval() == seconds


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf", ""])
def test_a_bad_log_interval_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(LOG_INTERVAL_ENV, value)
    with pytest.raises(RoutedExpertsCacheError, match=LOG_INTERVAL_ENV):
        log_interval()
