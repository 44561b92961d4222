"""vLLM scheduler-side AuxOutput connector: which prefix blocks have routing rows.

Drop-in for ``vllm.distributed.aux_output_connector.connector.AuxOutputSchedulerConnector``
(vLLM 0.33 and 0.34, identical there), installed by the plugin before ``EngineCore`` builds
its scheduler. The metadata and output plumbing are vLLM's (inherited); what the scheduler
may use of a prefix hit is decided here:

- **Retention follows the KV tier.** Up to GPU blocks + the KV connector's tier blocks
  (``kv_tiers.retained_blocks``) stay pinned for the worker after their request finished,
  instead of ``2 x num_blocks`` whatever the tier holds.
- **Release is tail-first.** A finished request's blocks enter the release order last block
  first, and a hit touches its blocks last block first, so a partial release leaves a prefix
  the next hit can use (vLLM releases the prefix first, leaving tails no hit can reach).
- **Partial external hits are cut, not dropped,** to the covered block-aligned prefix for KV
  connectors that load a smaller count (``kv_tiers.takes_partial_hits``); all or nothing for
  the others.
- **Whole-prompt hits are accepted** when rows cover every block: the recomputed last token
  starts inside the last block, whose rows the worker seeds from the published page.
- **Rows cross a prefill/decode split** (``row_transfer``): a prefill exports a request's rows
  in its ``kv_transfer_params``, a decode's hit may use rows it imported from there.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

from .kv_tiers import retained_blocks, takes_partial_hits
from .row_transfer import RowTransfer

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request


class CacheSchedulerConnector(RowTransfer, AuxOutputSchedulerConnector):
    """Pins blocks whose KV may come back, so their rows are there when it does.

    ``_kv_cached`` (block -> its hash keys) is the set of retained blocks and its order is the
    release order: the oldest goes first, and within one request its last block goes first.
    Blocks a request is loading, and blocks still cached on the GPU, are never released; the
    rest is released, in that order, down to ``_capacity``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, kv_connector: KVConnectorBase_V1 | None = None) -> None:
        super().__init__(kv_cache_manager, kv_connector)
        vllm_config = kv_connector._vllm_config if kv_connector is not None else None
        self._capacity = retained_blocks(vllm_config, kv_cache_manager.kv_cache_config)
        self._cuts_partial_hits = takes_partial_hits(kv_connector)
        self._init_row_transfer(vllm_config, self._block_size)

    def covered_tokens(self, request: Request) -> int:
        """Tokens of the request's longest prefix whose every block has rows (retained, or
        cached on the GPU); touches the retained ones, last block first."""
        touched = []
        num_blocks = 0
        for block, keys in self._kv_blocks(request.block_hashes):
            if block in self._kv_cached:
                touched.append(block)
            elif not self._gpu_cached(keys[-1]):
                break
            num_blocks += 1
        for block in reversed(touched):
            self._kv_cached.move_to_end(block)
        return num_blocks * self._block_size

    def max_cache_hit(self, request: Request) -> int:
        """The local prefix-cache hit's cap: covered tokens, short of the last token (vLLM
        computes that one to sample from it)."""
        return min(self.covered_tokens(request), request.num_tokens - 1)

    def cap_external_hit(self, request: Request, num_local: int, num_external: int) -> int:
        """The external tokens the scheduler may load: all of them when rows cover the whole
        hit (the whole prompt included), else the covered block-aligned part for connectors
        that load a smaller count, else none."""
        if num_external <= 0:
            return 0
        num_hit = num_local + num_external
        covered = max(self.covered_tokens(request), self.imported_tokens(request))
        if num_hit % self._block_size == 0 and num_hit <= covered:
            return num_external
        if not self._cuts_partial_hits:
            return 0
        usable = min(covered, num_hit) // self._block_size * self._block_size
        return max(usable - num_local, 0)

    def build_connector_meta(self, scheduler_output, requests):
        return self.with_imports(super().build_connector_meta(scheduler_output, requests), requests)

    def request_finished(self, request: Request) -> None:
        """Queue the terminal event; retain the request's GPU-cached computed blocks, last
        block first in the release order."""
        self._loading.pop(request.request_id, None)
        self.forget_import(request.request_id)
        num_blocks = request.num_computed_tokens // self._block_size
        blocks = list(islice(self._kv_blocks(request.block_hashes), num_blocks))
        for block, keys in reversed(blocks):
            if block in self._kv_cached:
                self._kv_cached.move_to_end(block)
            elif self._gpu_cached(keys[-1]):
                self._kv_cached[block] = keys
                self._retained_hashes.extend(keys)
        self._release_unheld()
        self._finish_request(request)

    def _finish_request(self, request: Request) -> None:
        """vLLM's terminal event for the worker, with the request's last block hashes."""
        request_id = request.request_id
        if request_id not in self._sent_hash_counts:
            return
        self._finished_requests[request_id] = self._take_new_hashes(request, request.num_computed_tokens)
        del self._sent_hash_counts[request_id]
