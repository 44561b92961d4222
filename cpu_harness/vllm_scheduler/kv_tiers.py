"""vLLM's real CPU-offload KV connectors on the scheduler side, with a stand-in for their worker.

``tier_transfer_config(name, tier_blocks)`` names ``OffloadingConnector`` or
``SimpleCPUOffloadConnector`` in a ``KVTransferConfig`` sized so that the CPU tier holds
``tier_blocks`` GPU KV blocks; ``make_scheduler(kv_tier=...)`` builds the real scheduler with it,
and the scheduler builds the real scheduler-side connector (its offloading manager, its CPU block
pool, its lookups and store / load jobs). Their worker sides need CUDA, so ``TierWorker`` stands
in for them: every store and load job of a step's metadata completes in that step and is reported
as their workers report it (``OffloadingWorkerMetadata.completed_jobs`` /
``SimpleCPUOffloadWorkerMetadata.completed_store_events``, async loads in ``finished_recving``).
No KV is moved (the simulated model has none), and no load fails.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata

from .toy_model import HarnessError

TIER_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")


def tier_transfer_config(name: str, tier_blocks: int | dict, block_bytes: int) -> KVTransferConfig:
    """A ``KVTransferConfig`` for a real CPU-offload connector whose tier holds ``tier_blocks`` GPU
    KV blocks of ``block_bytes`` each (Offloading: one block per chunk, a chunk rounded up to the
    OS page; SimpleCPU: its block 0 is the null block). A dict instead of a block count is the
    connector's ``kv_connector_extra_config`` as given (the tier sized as a user would size it)."""
    if name not in TIER_CONNECTORS:
        raise HarnessError(f"no CPU-offload connector {name!r}; these are: {TIER_CONNECTORS}")
    if isinstance(tier_blocks, dict):
        extra = tier_blocks
    elif name == "OffloadingConnector":
        chunk_bytes = -(-block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        extra = {"cpu_bytes_to_use": tier_blocks * chunk_bytes}
    else:
        extra = {"num_cpu_blocks": tier_blocks + 1}
    return KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra)


@dataclass
class TierLoad:
    """A load the stand-in completed: ``block_ids`` are the GPU KV blocks it wrote."""

    request_ids: tuple[str, ...]
    block_ids: list[int]
    is_async: bool


@dataclass
class _Completed:
    job: TierLoad
    failed: set[int] = field(default_factory=set)


@dataclass
class _TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class TierWorker:
    """The worker side of a CPU-offload connector, as ``SimModelRunner`` drives a KV worker
    (MRV2's ``ActiveKVConnector`` calls), completing every job of the bound metadata."""

    def __init__(self) -> None:
        self._metadata = None
        self._loads_started = False
        self._worker_meta = None
        self._finished_recving: set[str] = set()
        self._results: list[_Completed] = []
        self.loads: list[TierLoad] = []
        self.stored_blocks = 0

    def handle_preemptions(self, metadata) -> None:
        return None

    def bind_connector_metadata(self, metadata) -> None:
        self._metadata, self._loads_started = metadata, False

    def start_load_kv(self, forward_context) -> None:
        """Complete the metadata's stores and loads (as their CUDA copies would, in this step)."""
        if self._loads_started:
            raise HarnessError("start_load_kv called twice for one metadata")
        self._loads_started = True
        metadata, loads = self._metadata, []
        if isinstance(metadata, SimpleCPUOffloadMetadata):
            if metadata.store_event >= 0:
                self._worker_meta = SimpleCPUOffloadWorkerMetadata(completed_store_events={metadata.store_event: 1})
                self.stored_blocks += len(metadata.store_gpu_blocks)
            if metadata.load_event >= 0:
                request_ids = tuple(metadata.load_event_to_reqs.get(metadata.load_event, ()))
                loads.append(TierLoad(request_ids, [int(b) for b in metadata.load_gpu_blocks], True))
        else:  # OffloadingConnectorMetadata
            completed = {job_id: 1 for job_id in (*metadata.store_jobs, *metadata.load_jobs)}
            self.stored_blocks += sum(len(job.dst_spec.block_ids) for job in metadata.store_jobs.values())
            for job in metadata.load_jobs.values():
                loads.append(TierLoad((job.req_id,), [int(b) for b in job.dst_spec.block_ids], not job.sync))
            self._worker_meta = OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
        for load in loads:
            self.loads.append(load)
            self._results.append(_Completed(load))
            if load.is_async:
                self._finished_recving.update(load.request_ids)

    @property
    def loads_started(self) -> bool:
        return self._loads_started

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> _TransferResults:
        done, self._finished_recving = self._finished_recving, set()
        return _TransferResults(finished_recving=done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_connector_worker_meta(self):
        meta, self._worker_meta = self._worker_meta, None
        return meta

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def take_load_results(self) -> list[_Completed]:
        results, self._results = self._results, []
        return results
