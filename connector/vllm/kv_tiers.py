"""What vLLM's KV connectors offer beyond the GPU KV cache, as the routed-experts path needs it:
how many blocks their tier holds, and whether they load a smaller hit than they offered.

Read from vLLM 0.33's and 0.34's sources (identical in what is used here):

- ``OffloadingConnector``: ``cpu_bytes_to_use`` buys chunks of ``blocks_per_chunk`` GPU blocks
  (``block_size`` / GPU block size when given instead), each chunk rounded up to the OS page
  (``CPUOffloadingSpec``: ``cpu_bytes_to_use // round_up(bytes_per_block * world_size *
  blocks_per_chunk, mmap.PAGESIZE)``), one chunk per offloaded KV group. Its
  ``update_state_after_alloc`` loads any smaller count (no equality check).
- ``SimpleCPUOffloadConnector``: ``num_cpu_blocks`` (else the worker's
  ``cache_config.simple_cpu_offload_num_blocks``, else ``cpu_bytes_to_use`` -- default 8 GiB --
  over the GPU's bytes per block; with ``kv_offload_backend="disk"``, ``disk_capacity_bytes``
  -- default 100 GiB, not divided among ranks -- instead), block 0 being the null block; nothing
  without prefix caching. It loads any smaller block-aligned count.
- ``ExampleConnector`` loads any count > 0. LMCache, MooncakeStore, UMBP and HF3FS assert that
  the scheduler took exactly what they offered: a hit is all or nothing for them, as for every
  connector not named here. Their tier size lives outside vLLM: ``ROUTED_EXPERTS_CACHE_TIER_BLOCKS``.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING

from ...errors import RoutedExpertsCacheError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

TIER_BLOCKS_ENV = "ROUTED_EXPERTS_CACHE_TIER_BLOCKS"  # KV blocks the connector's tier holds, where vLLM cannot tell
PARTIAL_HIT_CONNECTORS = frozenset({"OffloadingConnector", "SimpleCPUOffloadConnector", "ExampleConnector"})
DEFAULT_SIMPLE_CPU_BYTES = 8 << 30  # SimpleCPUOffloadConnector's cpu_bytes_to_use default
DEFAULT_SIMPLE_DISK_BYTES = 100 << 30  # and its disk_capacity_bytes default (kv_offload_backend "disk")


def retained_blocks(vllm_config: VllmConfig | None, kv_cache_config: KVCacheConfig) -> int:
    """KV blocks whose rows the scheduler keeps retained after their request finished: the GPU
    KV cache's blocks plus the KV connector's tier. Without a KV connector, the GPU's only.

    A connector whose tier size vLLM does not know counts as one GPU KV cache more (vLLM's own
    ``2 x num_blocks``), unless ``ROUTED_EXPERTS_CACHE_TIER_BLOCKS`` says how many it holds.
    """
    num_gpu_blocks = kv_cache_config.num_blocks
    transfer = vllm_config.kv_transfer_config if vllm_config is not None else None
    if transfer is None:
        return num_gpu_blocks
    raw = os.environ.get(TIER_BLOCKS_ENV)
    if raw is not None:
        try:
            tier = int(raw)
        except ValueError:
            tier = -1
        if tier < 0:
            raise RoutedExpertsCacheError(f"{TIER_BLOCKS_ENV}={raw!r} must be a number of KV blocks >= 0")
        return num_gpu_blocks + tier
    tier = tier_blocks(vllm_config, kv_cache_config)
    return num_gpu_blocks + (num_gpu_blocks if tier is None else tier)


def tier_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int | None:
    """The KV connector's tier in GPU KV blocks, from the configs; None if vLLM cannot tell."""
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config or {}
    world_size = vllm_config.parallel_config.world_size
    groups = [group for group in kv_cache_config.kv_cache_groups if group.kv_cache_spec.prefix_cacheable]
    if transfer.kv_connector == "OffloadingConnector":
        gpu_block_size = groups[0].kv_cache_spec.block_size
        blocks_per_chunk = int(extra.get("blocks_per_chunk", 0)) or int(extra.get("block_size", gpu_block_size)) // gpu_block_size
        if kv_cache_config.kv_cache_tensors:
            block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        else:
            block_bytes = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in groups)
        chunk_bytes = -(-block_bytes * world_size * blocks_per_chunk // mmap.PAGESIZE) * mmap.PAGESIZE
        return int(extra["cpu_bytes_to_use"]) // chunk_bytes * blocks_per_chunk // len(groups)
    if transfer.kv_connector == "SimpleCPUOffloadConnector":
        if not vllm_config.cache_config.enable_prefix_caching:
            return 0
        num_cpu_blocks = extra.get("num_cpu_blocks") or vllm_config.cache_config.simple_cpu_offload_num_blocks
        if num_cpu_blocks is None:
            if extra.get("kv_offload_backend", "cpu") == "disk":  # the tier is on disk, sized by its bytes
                capacity = int(extra.get("disk_capacity_bytes", DEFAULT_SIMPLE_DISK_BYTES))
            else:
                capacity = int(extra.get(
                    "cpu_bytes_to_use_per_rank", int(extra.get("cpu_bytes_to_use", DEFAULT_SIMPLE_CPU_BYTES)) // world_size
                ))
            num_cpu_blocks = max(1, kv_cache_config.num_blocks * capacity // kv_cache_config.kv_cache_tensors[0].size)
        return int(num_cpu_blocks) - 1  # block 0 is the null block
    return None


def takes_partial_hits(kv_connector) -> bool:
    """Whether the connector loads a smaller count than it offered (else: all or nothing)."""
    return kv_connector is not None and type(kv_connector).__name__ in PARTIAL_HIT_CONNECTORS
