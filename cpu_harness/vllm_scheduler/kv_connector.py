"""A stub KV connector for vLLM 0.33, loaded the way vLLM loads any external connector.

``kv_transfer_config(...)`` returns a ``KVTransferConfig`` naming ``StubKVConnector`` in this
module (``kv_connector_module_path``); the 0.33 ``Scheduler`` builds its scheduler-side
instance through ``KVConnectorFactory``, and ``make_worker(...)`` builds the worker-side
instance through the same factory. No KV is moved (the simulated model has none); what is
modelled is the control flow between the two sides and the scheduler:

Scheduler side (an "external store" of KV blocks, like an offloading connector):

- ``request_finished`` saves the request's computed, hashed blocks into the store (LRU,
  ``store_blocks`` entries; unbounded when ``None``);
- ``get_num_new_matched_tokens(request, num_computed_tokens)`` reports the run of stored
  blocks that follows the local hit (whole blocks, never reaching the last prompt token), as
  a synchronous load or an asynchronous one (``load_mode``: ``"sync"``, ``"async"`` or
  ``"alternate"``, which alternates between the two, hit after hit); vLLM 0.33's
  ``AuxOutputSchedulerConnector.cap_external_hit`` then accepts the hit only if every block
  of it has known routing rows, else the scheduler loads nothing;
- ``update_state_after_alloc`` turns an accepted hit into a ``LoadJob`` (the KV block ids the
  load writes, the block hashes it covers), and ``build_connector_meta`` ships the step's
  jobs to the worker in ``StubKVMetadata``.

Worker side: ``start_load_kv`` runs the bound jobs: synchronous loads complete before the
forward (MRV2 calls it before the forward when ``has_sync_kv_loads``), asynchronous loads
complete after ``async_load_steps`` more passes and are reported in ``get_finished``'s
``finished_recving``. A load's failed blocks come from ``fault(job)`` (set by the
simulated model runner or the test: indices into ``job.block_ids``) and are reported by
``get_block_ids_with_load_errors`` (``KVConnectorOutput.invalid_block_ids``) in the pass that
detects them: the pass of a synchronous load, the completion pass of an asynchronous one
(the latest pass the base-class contract admits).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .toy_model import HarnessError

CONNECTOR_NAME = "StubKVConnector"
MODULE_PATH = __name__  # vLLM imports the connector class from here
LOAD_MODES = ("sync", "async", "alternate")
_OPTIONS = {"load_mode", "async_load_steps", "store_blocks", "min_hit_blocks", "keeps_lookahead_hashes", "shared_store"}
# Stores shared by name between scheduler instances of this process: a prefill instance saves,
# a decode instance loads (a P/D pair, as ExampleConnector's shared storage path).
SHARED_STORES: dict[str, OrderedDict] = {}


class StubConnectorError(HarnessError):
    """The stub saw a call sequence vLLM's contract does not allow, or a bad option."""


def kv_transfer_config(*, load_mode: str = "alternate", async_load_steps: int = 1, store_blocks: int | None = None,
                       min_hit_blocks: int = 1, kv_load_failure_policy: str = "recompute",
                       keeps_lookahead_hashes: bool = False, shared_store: str | None = None) -> KVTransferConfig:
    """The ``KVTransferConfig`` that makes vLLM load ``StubKVConnector`` from this module.

    ``keeps_lookahead_hashes``: the connector opts in to lookahead block hashing (vLLM 0.34's
    ``supports_lookahead_block_hashes``, as its Mooncake and CPU-offload connectors do); vLLM
    0.33 has no such opt-in and turns lookahead off with any KV connector.

    ``shared_store``: a name; instances built with the same name share their store (``SHARED_STORES``),
    so one engine's finished requests are another engine's external hits (prefill / decode).
    """
    extra = {"load_mode": load_mode, "async_load_steps": async_load_steps, "store_blocks": store_blocks,
             "min_hit_blocks": min_hit_blocks, "keeps_lookahead_hashes": keeps_lookahead_hashes,
             "shared_store": shared_store}
    _check_options(extra)
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_connector_module_path=MODULE_PATH, kv_role="kv_both",
        kv_load_failure_policy=kv_load_failure_policy, kv_connector_extra_config=extra,
    )


def _check_options(extra: dict[str, Any]) -> dict[str, Any]:
    unknown = set(extra) - _OPTIONS
    if unknown:
        raise StubConnectorError(f"unknown stub connector options {sorted(unknown)}")
    options = {"load_mode": "alternate", "async_load_steps": 1, "store_blocks": None, "min_hit_blocks": 1,
               "keeps_lookahead_hashes": False, "shared_store": None, **extra}
    if options["shared_store"] is not None and type(options["shared_store"]) is not str:
        raise StubConnectorError(f"shared_store must be None or a name, got {options['shared_store']!r}")
    if type(options["keeps_lookahead_hashes"]) is not bool:
        raise StubConnectorError(f"keeps_lookahead_hashes must be a bool, got {options['keeps_lookahead_hashes']!r}")
    if options["load_mode"] not in LOAD_MODES:
        raise StubConnectorError(f"load_mode must be one of {LOAD_MODES}, got {options['load_mode']!r}")
    for name in ("async_load_steps", "min_hit_blocks"):
        value = options[name]
        if type(value) is not int or value < 0:
            raise StubConnectorError(f"{name} must be an int >= 0, got {value!r}")
    store = options["store_blocks"]
    if store is not None and (type(store) is not int or store <= 0):
        raise StubConnectorError(f"store_blocks must be None or an int > 0, got {store!r}")
    return options


def make_worker(vllm_config, kv_cache_config) -> StubKVConnector:
    """The worker-side instance, built by vLLM's factory from ``vllm_config.kv_transfer_config``."""
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    if not isinstance(connector, StubKVConnector):
        raise StubConnectorError(f"the factory built {type(connector).__name__}, not {CONNECTOR_NAME}")
    return connector


@dataclass
class LoadJob:
    """One request's external load: ``block_ids[i]`` receives the KV of block ``first_block + i``."""

    request_id: str
    first_block: int
    block_ids: list[int]
    block_hashes: list[bytes]
    is_async: bool
    scheduled_step: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids)


@dataclass
class LoadResult:
    """A completed load as the worker saw it (``failed``: KV block ids whose load failed)."""

    job: LoadJob
    failed: set[int]
    completed_pass: int


@dataclass
class StubKVMetadata(KVConnectorMetadata):
    step: int
    loads: list[LoadJob] = field(default_factory=list)


class StubKVConnector(KVConnectorBase_V1):
    """Both roles of the stub connector (vLLM builds one instance per role)."""

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:
        """vLLM 0.34 asks this before it keeps lookahead hashing with a KV connector."""
        return bool(_check_options(dict(kv_transfer_config.kv_connector_extra_config))["keeps_lookahead_hashes"])

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options = _check_options(dict(self._kv_transfer_config.kv_connector_extra_config))
        self.load_mode: str = options["load_mode"]
        self.async_load_steps: int = options["async_load_steps"]
        self.store_blocks: int | None = options["store_blocks"]
        self.min_hit_blocks: int = options["min_hit_blocks"]
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise StubConnectorError(f"the stub supports one KV cache group, got {len(groups)}")
        self.block_size: int = groups[0].kv_cache_spec.block_size
        self.stats: Counter = Counter()
        # scheduler side
        shared = options["shared_store"]
        self._store: OrderedDict[bytes, None] = SHARED_STORES.setdefault(shared, OrderedDict()) if shared else OrderedDict()
        self._matched: dict[str, tuple[int, int, bool]] = {}  # request -> (local tokens, external tokens, async)
        self._jobs: list[LoadJob] = []
        self._num_hits = 0
        self._step = 0
        # hit filter: hit_filter(request, num_local_tokens, num_external_tokens) -> bool (test hook)
        self.hit_filter: Callable[[Any, int, int], bool] | None = None
        # worker side
        self._in_flight: dict[str, list] = {}  # request -> [passes left, job]
        self._invalid: set[int] = set()
        self._results: list[LoadResult] = []
        self._loads_started = False
        self._pass = 0
        # fault(job) -> indices into job.block_ids that fail to load (simulation / test hook)
        self.fault: Callable[[LoadJob], Iterable[int]] | None = None

    # ----------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        if num_computed_tokens % bs:
            raise StubConnectorError(
                f"{request.request_id}: local hit {num_computed_tokens} is not block aligned (vLLM aligns it)"
            )
        hashes = request.block_hashes
        first = num_computed_tokens // bs
        # Never the block holding the last prompt token: the scheduler must compute it.
        limit = min(len(hashes), (request.num_prompt_tokens - 1) // bs)
        count = 0
        while first + count < limit and hashes[first + count] in self._store:
            count += 1
        self.stats["lookups"] += 1
        if count < max(1, self.min_hit_blocks):
            return 0, False
        num_external = count * bs
        if self.hit_filter is not None and not self.hit_filter(request, num_computed_tokens, num_external):
            self.stats["hits_filtered"] += 1
            return 0, False
        for key in hashes[first: first + count]:
            self._store.move_to_end(key)
        if self.load_mode == "alternate":
            is_async = self._num_hits % 2 == 1
        else:
            is_async = self.load_mode == "async"
        self._num_hits += 1
        self._matched[request.request_id] = (num_computed_tokens, num_external, is_async)
        self.stats["hits_offered"] += 1
        return num_external, is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0:
            if matched is not None:
                self.stats["hits_refused"] += 1  # e.g. AuxOutputSchedulerConnector.cap_external_hit
            return
        if matched is None:
            raise StubConnectorError(f"{request.request_id}: {num_external_tokens} external tokens never offered")
        num_local, num_external, is_async = matched
        if num_external != num_external_tokens:
            raise StubConnectorError(
                f"{request.request_id}: offered {num_external} external tokens, scheduler took {num_external_tokens}"
            )
        bs = self.block_size
        first, end = num_local // bs, (num_local + num_external) // bs
        (block_ids,) = blocks.get_block_ids()
        if len(block_ids) < end:
            raise StubConnectorError(f"{request.request_id}: {len(block_ids)} blocks allocated, load needs {end}")
        self._jobs.append(LoadJob(
            request_id=request.request_id, first_block=first, block_ids=list(block_ids[first:end]),
            block_hashes=list(request.block_hashes[first:end]), is_async=is_async, scheduled_step=self._step,
        ))
        self.stats["async_loads" if is_async else "sync_loads"] += 1
        self.stats["loaded_tokens"] += num_external

    def build_connector_meta(self, scheduler_output) -> StubKVMetadata:
        metadata = StubKVMetadata(step=self._step, loads=self._jobs)
        self._jobs = []
        self._step += 1
        return metadata

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Save the request's computed, hashed blocks (synchronously: nothing to free later)."""
        self._matched.pop(request.request_id, None)
        num_blocks = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for key in request.block_hashes[:num_blocks]:
            self._store[key] = None
            self._store.move_to_end(key)
        while self.store_blocks is not None and len(self._store) > self.store_blocks:
            self._store.popitem(last=False)
        self.stats["saved_blocks"] += num_blocks
        return False, None

    def update_connector_output(self, connector_output) -> None:
        self.stats["finished_recving"] += len(connector_output.finished_recving or ())
        self.stats["invalid_blocks_reported"] += len(connector_output.invalid_block_ids or ())

    # -------------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, StubKVMetadata):
            raise StubConnectorError(f"metadata {type(connector_metadata).__name__} is not the stub's")
        super().bind_connector_metadata(connector_metadata)
        self._loads_started = False

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._loads_started:
            raise StubConnectorError("start_load_kv called twice for one metadata")
        self._loads_started = True
        metadata = self._get_connector_metadata()
        for job in metadata.loads:
            if job.is_async:
                if job.request_id in self._in_flight:
                    raise StubConnectorError(f"{job.request_id}: a second async load while one is in flight")
                self._in_flight[job.request_id] = [self.async_load_steps, job]
            else:
                self._complete(job)

    def _complete(self, job: LoadJob) -> None:
        failed_indices = sorted(set(self.fault(job))) if self.fault is not None else []
        bad = [i for i in failed_indices if not 0 <= i < len(job.block_ids)]
        if bad:
            raise StubConnectorError(f"{job.request_id}: fault indices {bad} outside the {len(job.block_ids)} blocks")
        failed = {job.block_ids[i] for i in failed_indices}
        self._invalid |= failed
        self._results.append(LoadResult(job, failed, self._pass))
        self.stats["loads_failed" if failed else "loads_ok"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = []
        for request_id, entry in self._in_flight.items():
            if entry[0] == 0:
                done.append(request_id)
            else:
                entry[0] -= 1
        for request_id in done:
            self._complete(self._in_flight.pop(request_id)[1])
        self._pass += 1
        return None, set(done) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_load_results(self) -> list[LoadResult]:
        """Loads completed since the last call (the simulated model runner applies them to its KV)."""
        results, self._results = self._results, []
        return results

    @property
    def loads_started(self) -> bool:
        """Whether ``start_load_kv`` ran for the bound metadata (MRV2 starts it after the forward if not)."""
        return self._loads_started
