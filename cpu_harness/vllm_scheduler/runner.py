"""``SimModelRunner``: what Model Runner V2 does around the aux-output hooks, on synthetic tokens and rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

from .installed import CONTRACT  # first: checks the installed vLLM, sets its environment
import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.outputs import (
    DraftTokenIds,
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    ModelRunnerOutput,
)

from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector

from .connectors import feed_rows
from .toy_model import (
    BLOCK_SIZE, NUM_EXPERTS, PLACEHOLDER, ROOT_STATE, ROW_SHAPE, VOCAB, HarnessError, advance, row_of, true_next_token,
)


@dataclass
class _DeviceRequest:
    computed: int  # device view of num_computed_tokens (rejections applied)
    cpu_computed: int  # the scheduler's view, as the input batch carries it
    drafts: list[int] = field(default_factory=list)
    captured_end: int = 0  # end of the rows the last executed step produced and accepted


@dataclass
class RunStats:
    steps: int = 0
    empty_steps: int = 0
    chunked_prefill_steps: int = 0  # a request ran a prefill chunk that did not reach its end
    drafts_fed: int = 0
    drafts_rejected: int = 0
    placeholder_drafts: int = 0
    reattached: int = 0  # steps where the CPU's token start was ahead of the device's
    prefix_hit_tokens: int = 0  # first scheduled position of new/resumed requests, summed
    rows_checked: int = 0  # rows returned by the connector and checked against the oracle
    max_pending_pages: int = 0
    generations: set[int] = field(default_factory=set)
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # device (start, end) per step
    outputs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # connector (start, end) per output
    finished_events: Counter = field(default_factory=Counter)  # metadata.finished_requests, per request
    scheduled_after_finish: set[str] = field(default_factory=set)  # re-added after a terminal event
    # With a KV connector:
    external_loads: int = 0  # loads the worker completed (sync and async)
    failed_loads: int = 0  # ... with at least one invalid block
    poisoned_rows: int = 0  # rows computed while attending to KV of a block whose load failed
    poisoned_steps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> poisoned spans
    dropped_tokens: int = 0  # device tokens the scheduler dropped (stale output of a preempted request)
    # (request, end of the rows the worker captured, token start the next input batch carried)
    worker_rollbacks: list[tuple[str, int, int]] = field(default_factory=list)


def poison(rows: np.ndarray) -> np.ndarray:
    """What the model computes at a position whose attention reads KV that failed to load: not the true row."""
    return ((rows.astype(np.int64) + 1) % NUM_EXPERTS).astype(rows.dtype)


class SimModelRunner:
    """Model Runner V2's behaviour around the aux-output hooks, on synthetic tokens and rows.

    With a KV connector (``kv_worker``, the worker side of ``kv_connector.py``)
    the runner also does what MRV2's ``ActiveKVConnector`` does around the forward:
    ``handle_preemptions`` and ``bind_connector_metadata`` before it, ``start_load_kv``
    before it when the step has synchronous loads (else after), then ``wait_for_save``,
    ``get_transfer_results``, ``get_block_ids_with_load_errors`` and
    ``clear_connector_metadata``; the result is the step's ``kv_connector_output``, also on
    steps without scheduled tokens (MRV2's ``no_forward``). Tokens a load brings in are
    computed tokens the model does not run: no routing row is produced for them (they are
    before the first scheduled position, like a local prefix hit).

    The runner also keeps a model of its KV: the block table of every request (from the
    scheduler output) and the set of KV blocks whose content is invalid (a failed load).
    A row computed at position ``p`` whose attention reads such a block (any block of the
    request at or before ``p``) is wrong: ``poison(true row)``. Blocks written from their
    first slot by an unpoisoned computation become valid again; blocks written by a
    poisoned one become invalid.
    """

    def __init__(self, connector, vllm_config: VllmConfig, *, num_spec_tokens: int, async_scheduling: bool,
                 seed: int = 0, accept=None, kv_worker=None, block_size: int = BLOCK_SIZE) -> None:
        self.connector = connector
        self.vllm_config = vllm_config
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.kv_worker = kv_worker
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        # accept(request_id, rng) -> number of leading correct drafts proposed next step.
        self.accept = accept or (lambda request_id, rng: int(rng.integers(0, num_spec_tokens + 1)))
        self.tokens: dict[str, list[int]] = {}  # true tokens (what the device sampled); kept across preemption
        self.states: dict[str, list[bytes]] = {}
        self.device: dict[str, _DeviceRequest] = {}
        self.block_tables: dict[str, list[int]] = {}  # KV block ids per request, as MRV2's block table
        self.kv_bad: set[int] = set()  # KV blocks whose content is invalid (failed load)
        self.last_drafts: dict[str, list[int]] = {}
        self.weights_version = 0  # bumped by a weight update: every row computed after it differs
        self.emitted_versions: dict[str, dict[int, int]] = {}  # request -> position -> weights of its returned row
        self.stats = RunStats()
        self.after_output = []  # callbacks(aux_output) run after every process_output
        self.after_begin_step = []  # callbacks(metadata) run after every begin_step
        if isinstance(connector, CacheWorkerConnector):
            self.after_output.append(self._track_cache)

    def _track_cache(self, _outputs) -> None:
        cache = self.connector.cache
        cache.check_consistency()
        self.stats.max_pending_pages = max(self.stats.max_pending_pages, cache.stats()["pending"])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's device-side history: its id now names a new request."""
        for per_request in (self.tokens, self.states, self.last_drafts, self.emitted_versions):
            per_request.pop(request_id, None)

    # -- helpers
    def _states(self, request_id: str) -> list[bytes]:
        tokens, states = self.tokens[request_id], self.states.setdefault(request_id, [])
        state = states[-1] if states else ROOT_STATE
        for token in tokens[len(states):]:
            state = advance(state, token)
            states.append(state)
        return states

    def _propose(self, request_id: str) -> list[int]:
        state = self._states(request_id)[-1]
        num_correct = self.accept(request_id, self.rng)
        drafts = []
        for i in range(self.num_spec_tokens):
            correct = true_next_token(state)
            draft = correct if i < num_correct else (correct + 1 + int(self.rng.integers(0, VOCAB - 1))) % VOCAB
            drafts.append(draft)
            state = advance(state, draft)
        return drafts

    def check_rows(self, outputs, poisoned: dict[str, tuple[int, int]] | None = None) -> None:
        """Every row the connector returned equals the oracle's row of that position.

        ``poisoned``: this step's positions computed over invalid KV, per request; the
        connector cannot know, so there the rows must equal what the model produced.
        """
        for request_id, output in (outputs or {}).items():
            rows = np.asarray(output.rows)
            if rows.dtype != np.uint8 or rows.shape[1:] != ROW_SHAPE:
                raise HarnessError(f"{request_id}: rows {rows.dtype} {rows.shape}")
            start, end = int(output.token_start), int(output.token_start) + rows.shape[0]
            states = self._states(request_id)
            if end > len(states):
                raise HarnessError(f"{request_id}: rows up to {end}, only {len(states)} tokens exist")
            # A row returned now was computed under the current weights: a weight update drains
            # the engine and resets the prefix cache, so an older row is stale.
            version = self.weights_version
            want = np.stack([row_of(s, version) for s in states[start:end]]) if end > start else rows
            span = (poisoned or {}).get(request_id)
            if span is not None and end > start:
                lo, hi = max(start, span[0]), min(end, span[1])
                if lo < hi:
                    want = want.copy()
                    want[lo - start: hi - start] = poison(want[lo - start: hi - start])
            if not np.array_equal(rows, want):
                bad = [start + int(i) for i in np.nonzero((rows != want).reshape(len(rows), -1).any(1))[0]]
                raise HarnessError(f"{request_id}: rows [{start}, {end}) differ from the oracle at positions {bad}")
            self.stats.rows_checked += rows.shape[0]
            self.emitted_versions.setdefault(request_id, {}).update(dict.fromkeys(range(start, end), version))
            self.stats.outputs.setdefault(request_id, []).append((start, end))

    # -- KV connector (MRV2's ActiveKVConnector around the forward)
    def _kv_pre_forward(self, so) -> None:
        if self.kv_worker is None:
            return
        metadata = so.kv_connector_metadata
        if metadata is None:
            raise HarnessError("the scheduler has a KV connector but sent no kv_connector_metadata")
        self.kv_worker.handle_preemptions(metadata)
        self.kv_worker.bind_connector_metadata(metadata)
        if so.has_sync_kv_loads:
            self.kv_worker.start_load_kv(None)
            self._apply_loads()

    def _kv_post_forward(self, so) -> KVConnectorOutput | None:
        if self.kv_worker is None:
            return None
        worker = self.kv_worker
        if not worker.loads_started:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(set(so.finished_req_ids))
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving, invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        self._apply_loads()
        return output

    def _apply_loads(self) -> None:
        """A completed load wrote its blocks: valid KV, or invalid where it failed."""
        for result in self.kv_worker.take_load_results():
            self.stats.external_loads += 1
            self.stats.failed_loads += bool(result.failed)
            for block_id in result.job.block_ids:
                if block_id in result.failed:
                    self.kv_bad.add(block_id)
                else:
                    self.kv_bad.discard(block_id)

    def _poison_starts(self, spans: dict[str, tuple[int, int]]) -> dict[str, int]:
        """First position of each request whose computation this step reads invalid KV."""
        if not self.kv_bad:
            return {}
        bs = self.block_size
        fresh: dict[int, str] = {}  # blocks written from their first slot this step -> writer
        for request_id, (start, end) in spans.items():
            table = self.block_tables[request_id]
            if (end - 1) // bs >= len(table):
                raise HarnessError(f"{request_id}: positions up to {end} but {len(table)} KV blocks")
            for k in range(-(-start // bs), (end - 1) // bs + 1):
                fresh[table[k]] = request_id
        poisoned: dict[str, int] = {}
        for _ in range(8):
            bad = {b for b in self.kv_bad if b not in fresh} | {b for b, w in fresh.items() if w in poisoned}
            found = {}
            for request_id, (start, end) in spans.items():
                table = self.block_tables[request_id]
                for k in range((end - 1) // bs + 1):
                    block_id = table[k]
                    if block_id in bad and fresh.get(block_id) != request_id:
                        found[request_id] = max(start, k * bs)
                        break
            if found == poisoned:
                return poisoned
            poisoned = found
        raise HarnessError("the invalid-KV model did not settle")

    def _update_kv_validity(self, spans: dict[str, tuple[int, int]], poisoned: dict[str, int]) -> None:
        bs = self.block_size
        for request_id, (start, end) in spans.items():
            table = self.block_tables[request_id]
            first_bad = poisoned.get(request_id)
            for k in range(start // bs, (end - 1) // bs + 1):
                if first_bad is not None and (k + 1) * bs > first_bad:
                    self.kv_bad.add(table[k])
                elif start <= k * bs:
                    self.kv_bad.discard(table[k])

    def follow_rollback(self, request) -> None:
        """The scheduler rolled a running request back (KV load failure): drop what it dropped.

        vLLM 0.33's scheduler skips the request's output of the step (its sampled tokens)
        and lowers ``num_computed_tokens``; the device here follows it (see the module
        docstring: MRV2 0.33 itself only updates its CPU mirror).
        """
        request_id = request.request_id
        dev = self.device.get(request_id)
        if dev is None:
            return
        known = len(request.all_token_ids)
        tokens = self.tokens[request_id]
        if tokens[:known] != list(request.all_token_ids):
            raise HarnessError(f"{request_id}: scheduler tokens differ from the device's at a rollback")
        del tokens[known:]
        del self.states.setdefault(request_id, [])[known:]
        dev.computed = dev.cpu_computed = request.num_computed_tokens

    # -- the step
    def execute(self, scheduler_output) -> "_StepHandle":
        so = scheduler_output
        # MRV2 order: finish / free states, add new (and resumed), update cached, begin_step.
        for request_id in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.device.pop(request_id, None)
            self.block_tables.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            known = list(new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids)
            mine = self.tokens.setdefault(new.req_id, [])
            if mine and mine != known:
                # With a KV connector that requires KV delivery (kv_role kv_both), a preemption
                # drops the request's in-flight output: the device sampled tokens the scheduler
                # never appended.
                dropped = self.kv_worker is not None and len(known) < len(mine) and mine[: len(known)] == known
                if not dropped:
                    raise HarnessError(
                        f"{new.req_id}: scheduler resumes with {len(known)} tokens, device has {len(mine)}"
                    )
                self.stats.dropped_tokens += len(mine) - len(known)
            self.tokens[new.req_id] = known
            self.states.pop(new.req_id, None)
            self.device[new.req_id] = _DeviceRequest(new.num_computed_tokens, new.num_computed_tokens,
                                                     captured_end=new.num_computed_tokens)
            self.block_tables[new.req_id] = list(new.block_ids[0])
            self.stats.prefix_hit_tokens += new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for request_id, cpu_computed, new_block_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            self.device[request_id].cpu_computed = cpu_computed
            if new_block_ids is not None:
                if CONTRACT.cached_requests_have_resumed_ids and request_id in cached.resumed_req_ids:
                    self.block_tables[request_id] = list(new_block_ids[0])
                else:
                    self.block_tables[request_id].extend(new_block_ids[0])
        metadata = so.aux_output_connector_metadata
        if metadata is not None:
            self.stats.generations.add(metadata.generation)
            for request_id in metadata.requests:
                if self.stats.finished_events[request_id]:
                    self.stats.scheduled_after_finish.add(request_id)
            self.stats.finished_events.update(metadata.finished_requests)
        self.connector.begin_step(metadata)
        for callback in self.after_begin_step:
            callback(metadata)
        self.stats.steps += 1
        self._kv_pre_forward(so)
        if so.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            kv_output = self._kv_post_forward(so)
            output = None if kv_output is None else ModelRunnerOutput.with_kv_conn_output_only(kv_output)
            return _StepHandle(self, None, output)

        order = list(so.num_scheduled_tokens)
        spans = {}
        for request_id in order:
            dev = self.device[request_id]
            spans[request_id] = (dev.computed, dev.computed + so.num_scheduled_tokens[request_id])
        poison_starts = self._poison_starts(spans)
        poisoned_spans: dict[str, tuple[int, int]] = {}
        rows, query_start_loc, cpu_starts, num_sampled, num_rejected, sampled = [], [0], [], [], [], []
        self.last_drafts = {}
        for request_id in order:
            dev, n = self.device[request_id], so.num_scheduled_tokens[request_id]
            real, cpu = dev.computed, dev.cpu_computed
            if real > cpu or (real != cpu and not self.async_scheduling):
                raise HarnessError(f"{request_id}: device computed {real}, scheduler says {cpu}")
            if cpu < dev.captured_end:
                self.stats.worker_rollbacks.append((request_id, dev.captured_end, cpu))
            self.stats.reattached += cpu > real
            tokens, states = self.tokens[request_id], self._states(request_id)
            known = len(tokens)
            num_drafts = real + n - known
            if num_drafts > 0:
                # Slots without a proposal are placeholders (-1): the scheduler pads a new
                # request with one token left (e.g. a full prefix hit) to 1 + k rows.
                drafts = dev.drafts[:num_drafts] + [PLACEHOLDER] * (num_drafts - len(dev.drafts))
                self.stats.placeholder_drafts += drafts.count(PLACEHOLDER)
                if not self.async_scheduling and so.scheduled_spec_decode_tokens.get(request_id) != drafts:
                    raise HarnessError(f"{request_id}: scheduled drafts differ from the proposed ones")
            else:
                drafts = []
            fed = tokens[real: real + n] + drafts
            state = states[real - 1] if real else ROOT_STATE
            first_bad = poison_starts.get(request_id)
            for position, token in enumerate(fed, start=real):
                state = advance(state, token)
                row = row_of(state, self.weights_version)
                if first_bad is not None and position >= first_bad:
                    row = poison(row)
                rows.append(row)
            if first_bad is not None:
                poisoned_spans[request_id] = (first_bad, real + n)
                self.stats.poisoned_rows += real + n - first_bad
                self.stats.poisoned_steps.setdefault(request_id, []).append((first_bad, real + n))
            query_start_loc.append(query_start_loc[-1] + n)
            cpu_starts.append(cpu)
            self.stats.spans.setdefault(request_id, []).append((real, real + n))
            if num_drafts < 0:  # a prefill chunk short of the end: nothing sampled
                self.stats.chunked_prefill_steps += 1
                dev.computed = dev.captured_end = real + n
                num_sampled.append(0)
                num_rejected.append(0)
                sampled.append([])
                continue
            # Rejection sampling against the true next tokens.
            state, accepted = states[-1], 0
            for draft in drafts:
                if draft != true_next_token(state):
                    break
                accepted += 1
                state = advance(state, draft)
            new_tokens = drafts[:accepted] + [true_next_token(state)]
            tokens.extend(new_tokens)
            rejected = num_drafts - accepted
            self.stats.drafts_fed += num_drafts
            self.stats.drafts_rejected += rejected
            dev.computed = dev.captured_end = real + n - rejected
            dev.drafts = self._propose(request_id)
            self.last_drafts[request_id] = list(dev.drafts)
            num_sampled.append(len(new_tokens))
            num_rejected.append(rejected)
            sampled.append(new_tokens)
        if self.kv_worker is not None:
            self._update_kv_validity(spans, poison_starts)

        feed_rows(self.connector, torch.from_numpy(np.stack(rows)), self.vllm_config)
        # As vLLM 0.33 / 0.34 under full CUDA graphs: query_start_loc_np covers the request count
        # padded to a captured batch size (here the next power of two), the pads at the token count.
        query_start_loc += [query_start_loc[-1]] * ((1 << (len(order) - 1).bit_length()) - len(order))
        input_batch = SimpleNamespace(
            req_ids=order,
            query_start_loc_np=np.array(query_start_loc, dtype=np.int32),
            num_computed_tokens_np=np.array(cpu_starts, dtype=np.int32),
        )
        pending = self.connector.prepare_output(input_batch)
        if pending is not None:
            pending.enqueue_cpu_copy(np.array(num_sampled, dtype=np.int32), np.array(num_rejected, dtype=np.int32))
        index = {"req_id_to_index": {r: i for i, r in enumerate(order)}} if CONTRACT.runner_output_has_req_id_to_index else {}
        output = ModelRunnerOutput(req_ids=order, sampled_token_ids=sampled, **index)
        output.kv_connector_output = self._kv_post_forward(so)
        return _StepHandle(self, pending, output, poisoned_spans)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self.last_drafts:
            return None
        req_ids = list(self.last_drafts)
        return DraftTokenIds(req_ids, [list(self.last_drafts[r]) for r in req_ids])


class _StepHandle:
    def __init__(self, runner: SimModelRunner, pending, output, poisoned=None) -> None:
        self.runner, self.pending, self.output = runner, pending, output
        self.poisoned = poisoned or {}

    def get_output(self) -> ModelRunnerOutput:
        """The output thread: ``process_output`` after the copy, then the row checks."""
        if self.output is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.pending is not None:
            aux = self.pending.process_output()
            self.runner.check_rows(aux, self.poisoned)
            self.output.aux_output_connector_output = aux
            for callback in self.runner.after_output:
                callback(aux)
        return self.output
