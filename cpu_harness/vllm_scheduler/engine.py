"""``SimEngine``: ``EngineCore.step`` / ``step_with_batch_queue`` over the real scheduler and the
simulated runner, and ``RetainedPins``, the check that retained hashes stay readable."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from . import installed  # noqa: F401  (first: checks the installed vLLM, sets its environment)
import numpy as np
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.request import Request, RequestStatus

from .runner import RunStats, SimModelRunner
from .scheduler import SchedulerSetup
from .toy_model import HarnessError, ROW_SHAPE, expected_rows


class RetainedPins:
    """0.33's retained / released block hashes, checked against our cache.

    After every step output, every hash the scheduler retained and has not released yet is
    published in the cache (its rows can be read by a later prefix hit). A generation change
    drops the pins, as the connector does.
    """

    def __init__(self, runner: "SimModelRunner") -> None:
        self.cache = runner.connector.cache
        self.generation = 0
        self.retained: Counter = Counter()
        self.seen = Counter()
        runner.after_begin_step.append(self.on_begin_step)
        runner.after_output.append(self.on_output)

    def on_begin_step(self, metadata) -> None:
        if metadata is None:
            return
        if metadata.generation != self.generation:
            self.generation = metadata.generation
            self.retained.clear()
            self.seen["generations"] += 1
            return
        new = list(metadata.retained_block_hashes or ())
        gone = list(metadata.released_block_hashes or ())
        self.retained.update(new)
        self.retained.subtract(gone)
        if any(n < 0 for n in self.retained.values()):
            raise HarnessError("the scheduler released a hash it never retained")
        self.retained += Counter()
        self.seen["retained"] += len(new)
        self.seen["released"] += len(gone)

    def on_output(self, _outputs) -> None:
        missing = [h.hex() for h in self.retained if not self.cache.is_published(h)]
        if missing:
            raise HarnessError(f"retained blocks are not in the cache (evicted?): {missing}")
        self.seen["checks"] += 1


# ------------------------------------------------------------------ engine loop


@dataclass
class RollbackEvent:
    """One call of the scheduler's ``_handle_invalid_blocks`` (the worker reported invalid blocks)."""

    engine_step: int
    invalid_block_ids: set[int]
    skipped: set[str]  # running requests whose output of this step the scheduler dropped
    scheduled: dict[str, int]  # the step's num_scheduled_tokens
    changed: dict[str, tuple[int, int]]  # request -> (num_computed_tokens before, after)
    running: set[str]  # which of the watched requests were running (the rest were loading async)
    hashes_sent: dict[str, int]  # block hashes the aux-output connector had sent to the worker, per request


class SimEngine:
    """``EngineCore.step`` / ``step_with_batch_queue`` over the real scheduler and the simulated runner."""

    def __init__(self, setup: SchedulerSetup, connector, *, seed: int = 0, accept=None) -> None:
        self.setup = setup
        self.scheduler = setup.scheduler
        self.capturer = connector._capturer
        self.connector = connector
        self.runner = SimModelRunner(connector, setup.vllm_config, num_spec_tokens=setup.num_spec_tokens,
                                     async_scheduling=setup.async_scheduling, seed=seed, accept=accept,
                                     kv_worker=setup.kv_worker, block_size=setup.block_size)
        self.batch_queue: deque = deque()
        self.batch_queue_size = setup.vllm_config.max_concurrent_batches
        self.requests: dict[str, Request] = {}
        self.chunks: dict[str, list[np.ndarray]] = {}
        self.finished: dict[str, str] = {}
        self.finish_order: list[str] = []  # request ids in the order their finish reached the client
        self.kv_transfer_params: dict[str, dict | None] = {}  # what each finished request returned
        self.aborted: set[str] = set()
        self.num_preemptions = Counter()
        self.engine_steps = 0  # step() calls that did something (schedule and/or consume an output)
        self.weight_updates = 0  # new weights loaded (update_weights, or load_new_weights while paused)
        # KV load failures the scheduler handled (recompute policy), as observed around its
        # _handle_invalid_blocks; the runner follows the running requests it rolled back.
        self.rollbacks: list[RollbackEvent] = []
        self._new_rollbacks: list[RollbackEvent] = []
        if self.scheduler.connector is not None:
            self._observe_invalid_blocks()

    def _observe_invalid_blocks(self) -> None:
        """Record what vLLM's own ``_handle_invalid_blocks`` does (it still does all of it)."""
        scheduler = self.scheduler
        handle_invalid_blocks = scheduler._handle_invalid_blocks

        def observed(invalid_block_ids, num_scheduled_tokens):
            watched = list(scheduler.running) + [
                r for r in scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ]
            before = {r.request_id: (r.num_computed_tokens, r.status) for r in watched}
            sent = dict(scheduler.aux_output_connector._sent_hash_counts)
            skipped = handle_invalid_blocks(invalid_block_ids, num_scheduled_tokens)
            event = RollbackEvent(
                engine_step=self.engine_steps, invalid_block_ids=set(invalid_block_ids), skipped=set(skipped),
                scheduled=dict(num_scheduled_tokens),
                changed={
                    r.request_id: (before[r.request_id][0], r.num_computed_tokens)
                    for r in watched if r.num_computed_tokens != before[r.request_id][0]
                },
                running={r.request_id for r in watched if before[r.request_id][1] == RequestStatus.RUNNING},
                hashes_sent={r.request_id: sent.get(r.request_id, 0) for r in watched},
            )
            self.rollbacks.append(event)
            self._new_rollbacks.append(event)
            return skipped

        scheduler._handle_invalid_blocks = observed

    @property
    def stats(self) -> RunStats:
        return self.runner.stats

    def add(self, request: Request) -> None:
        """Schedule a new request; an id used before (finished or aborted) names a new request."""
        if request.request_id in self.finished or request.request_id in self.aborted:
            for per_request in (self.finished, self.kv_transfer_params):
                per_request.pop(request.request_id, None)
            self.aborted.discard(request.request_id)
            self.runner.forget(request.request_id)
        self.requests[request.request_id] = request
        self.chunks[request.request_id] = []
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(request_id)

    def _collect(self, engine_core_outputs) -> None:
        for outputs in engine_core_outputs.values():
            for output in outputs.outputs:
                if output.routed_experts is not None:
                    self.chunks[output.request_id].append(np.asarray(output.routed_experts))
                if output.finish_reason is not None:
                    self.finished[output.request_id] = str(output.finish_reason)
                    self.kv_transfer_params[output.request_id] = output.kv_transfer_params
                    self.finish_order.append(output.request_id)

    def _update(self, scheduler_output, model_output) -> None:
        self._collect(self.scheduler.update_from_output(scheduler_output, model_output))
        for request_id in (*scheduler_output.num_scheduled_tokens, *(scheduler_output.preempted_req_ids or ())):
            request = self.requests.get(request_id)
            if request is not None:
                self.num_preemptions[request_id] = request.num_preemptions
        events, self._new_rollbacks = self._new_rollbacks, []
        for event in events:
            rolled_back = [r for r in event.running if r in event.changed or r in event.skipped]
            if rolled_back and self.setup.async_scheduling:
                raise HarnessError(
                    f"KV load failure rolled back running requests {sorted(rolled_back)} under async scheduling: "
                    f"the simulated device does not model it (steps in flight ran on the dropped tokens)"
                )
            for request_id in rolled_back:
                self.runner.follow_rollback(self.scheduler.requests[request_id])

    def step(self) -> bool:
        """One engine-core step; False once there is nothing left to do."""
        if not self.setup.async_scheduling:
            if not self.scheduler.has_requests():
                return False
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self.engine_steps += 1
            self._update(so, handle.get_output())
            if so.total_num_scheduled_tokens > 0 and self.setup.num_spec_tokens > 0:  # EngineCore.post_step
                drafts = self.runner.take_draft_token_ids()
                if drafts is not None:
                    self.scheduler.update_draft_token_ids(drafts)
            return True
        self.engine_steps += 1
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            handle = self.runner.execute(so)
            self.batch_queue.appendleft((handle, so))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return True
        elif not self.batch_queue:
            self.engine_steps -= 1
            return False
        handle, so = self.batch_queue.pop()
        self._update(so, handle.get_output())
        return True

    def drain(self) -> None:
        """Consume every in-flight step (what the engine does before a prefix-cache reset)."""
        while self.batch_queue:
            handle, so = self.batch_queue.pop()
            self._update(so, handle.get_output())

    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        self.drain()
        if not self.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=reset_connector):
            raise HarnessError("prefix-cache reset failed")

    def update_weights(self) -> None:
        """An RL weight update as vLLM's users run it: finish the in-flight steps, load new
        weights (every row computed from now on differs), reset the prefix cache with running
        requests preempted, and the KV connector's cache (its KV is the old weights' too). A row
        published or captured before it and returned after it fails the row checks.

        vLLM cannot reset while a request waits for a KV connector's load or a finished one's
        blocks wait for its store (its reset raises "Failed to reset KV cache even when all the
        running requests are preempted"): the engine steps, adding nothing, until neither is
        left, as an engine draining for a pause does."""
        for _ in range(200):
            if not any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.is_finished()
                       for r in self.scheduler.requests.values()):
                break
            if not self.step():  # only finished requests' stores left: an empty step reports them
                so = self.scheduler.schedule()
                self._update(so, self.runner.execute(so).get_output())
        else:
            raise HarnessError("KV loads or stores still pending after 200 steps: no weight update possible")
        self.drain()
        self.load_new_weights()
        self.reset_prefix_cache(reset_connector=True)

    def load_new_weights(self) -> None:
        """New weights in the device: every row computed from now on differs."""
        self.runner.weights_version += 1
        self.weight_updates += 1

    def pause(self, mode: str, clear_cache: bool = True) -> None:
        """vLLM 0.33 / 0.34's ``pause_scheduler`` (``EngineCoreProc``'s, which admits "wait")
        over the real scheduler. New requests queue in every mode; "abort" aborts every
        request, "wait" steps until the running ones finish, "keep" freezes them (the scheduler
        schedules nothing, ``PauseState.PAUSED_ALL``). The pause completes once the in-flight
        steps are consumed; with ``clear_cache`` it then resets the prefix cache and the KV
        connector's, with kept requests preempted (``_reset_caches``)."""
        if mode not in ("abort", "wait", "keep"):
            raise HarnessError(f"pause mode {mode!r}")
        if mode == "abort":
            self.aborted.update(r.request_id for r in self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED))
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        for _ in range(2000):  # the output queue drains; under "wait" the running requests too
            if not self.batch_queue and (mode != "wait" or not self.scheduler.get_num_unfinished_requests()):
                break
            self.step()
        else:
            raise HarnessError(f"pause({mode!r}) did not drain in 2000 steps")
        if clear_cache:
            self.reset_prefix_cache(reset_connector=True)

    def resume(self) -> None:
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def run(self, max_steps: int = 2000, until=None) -> None:
        for _ in range(max_steps):
            if until is not None and until():
                return
            if not self.step():
                if until is None:
                    return
                raise HarnessError("engine went idle before the condition held")
        raise HarnessError(f"still running after {max_steps} steps")

    def run_until_finished(self, *request_ids: str, max_steps: int = 2000) -> None:
        self.run(max_steps, until=lambda: all(r in self.finished for r in request_ids))

    def flush(self) -> None:
        """Run to idle, then one more schedule so the last terminal events reach the worker."""
        self.run()
        self.drain()
        so = self.scheduler.schedule()
        self._update(so, self.runner.execute(so).get_output())

    # -- checks
    def assembled(self, request_id: str) -> np.ndarray:
        chunks = self.chunks[request_id]
        return np.concatenate(chunks) if chunks else np.empty((0, *ROW_SHAPE), dtype=np.uint8)

    def check_finished_request(self, request_id: str) -> None:
        """The client's rows (take_output chunks, concatenated) are exactly the oracle's."""
        if request_id not in self.finished:
            raise HarnessError(f"{request_id} did not finish")
        request = self.requests[request_id]
        tokens = list(request.all_token_ids)
        if tokens != self.runner.tokens[request_id][: len(tokens)]:
            raise HarnessError(f"{request_id}: scheduler tokens differ from the device's")
        start = min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens)
        emitted = self.runner.emitted_versions.get(request_id, {})
        want = expected_rows(tokens, start, len(tokens) - 1, [emitted.get(p, 0) for p in range(len(tokens))])
        got = self.assembled(request_id)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise HarnessError(
                f"{request_id}: client rows {got.shape} differ from the oracle's {want.shape} "
                f"(prompt {request.num_prompt_tokens}, {len(tokens)} tokens, start {start})"
            )

    def check_all_finished(self) -> int:
        done = [r for r in self.requests if r not in self.aborted]
        for request_id in done:
            self.check_finished_request(request_id)
        return len(done)

    def close(self) -> None:
        self.connector.close()
