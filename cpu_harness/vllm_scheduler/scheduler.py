"""The installed vLLM's real scheduler, configured the way ``EngineCore`` builds it."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from unittest import mock

from .installed import CONTRACT  # first: checks the installed vLLM, sets its environment
import torch
from vllm.config import (
    AuxOutputConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec, SlidingWindowSpec,
)
import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

from routed_experts_cache.connector.vllm.kv_tiers import retained_blocks
from routed_experts_cache.connector.vllm.scheduler import CacheSchedulerConnector
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from .toy_model import BLOCK_SIZE, HarnessError, NUM_EXPERTS, ROW_SHAPE
from .kv_connector import StubKVConnector, kv_transfer_config, make_worker
from .kv_tiers import TierWorker, tier_transfer_config

SCHEDULER_CONNECTORS = {"ours": CacheSchedulerConnector, "vllm": AuxOutputSchedulerConnector}


_MODEL_DIRS: dict[int, str] = {}
_MODEL_DIRS_LOCK = threading.Lock()


def _model_dir(num_nextn_predict_layers: int) -> str:
    """A config-only tiny DeepSeek-V3 (MoE, MTP) checkpoint directory; no weights needed."""
    with _MODEL_DIRS_LOCK:
        if num_nextn_predict_layers not in _MODEL_DIRS:
            path = tempfile.mkdtemp(prefix=f"rec-vllm-dsv3-mtp{num_nextn_predict_layers}-")
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            config = dict(
                architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512,
                hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=ROW_SHAPE[0],
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=NUM_EXPERTS,
                num_experts_per_tok=ROW_SHAPE[1], n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=32,
                v_head_dim=32, max_position_embeddings=16384, torch_dtype="float32",  # room for long-prompt traces
                num_nextn_predict_layers=num_nextn_predict_layers, rope_theta=10000.0,
            )
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(config, f)
            _MODEL_DIRS[num_nextn_predict_layers] = path
        return _MODEL_DIRS[num_nextn_predict_layers]


@dataclass
class SchedulerSetup:
    scheduler: object
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    block_hasher: object
    lookahead: int
    num_spec_tokens: int
    async_scheduling: bool
    # The worker-side StubKVConnector (kv_connector.py) when make_scheduler
    # was given kv_connector options; the scheduler built its own scheduler-side instance.
    kv_worker: object = None

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size


KV_GROUPS = ("full", "sliding", "mamba")


def _extra_groups(kv_groups: str, block_size: int) -> list[KVCacheGroupSpec]:
    """The groups beside the full-attention one (see ``make_scheduler``'s ``kv_groups``)."""
    if kv_groups == "sliding":
        spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                 sliding_window=2 * block_size)
        return [KVCacheGroupSpec(["sliding"], spec)]
    if kv_groups == "mamba":
        spec = MambaSpec(block_size=2 * block_size, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode="align")
        return [KVCacheGroupSpec(["mamba"], spec)]
    return []


def make_scheduler(
    *,
    lookahead: int,
    num_spec_tokens: int = 2,
    async_scheduling: bool = False,
    num_blocks: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 512,
    block_size: int = BLOCK_SIZE,
    kv_connector: dict | None = None,
    kv_tier: tuple[str, int | dict] | None = None,
    scheduler_connector: str = "ours",
    kv_groups: str = "full",
) -> SchedulerSetup:
    """The real 0.33 scheduler, configured the way the engine core builds it.

    ``lookahead`` 1 is single-module MTP (eagle family, any ``num_spec_tokens``); L > 1 is
    multi-module MTP with ``num_spec_tokens == L``; 0 turns lookahead hashing off
    (``disable_lookahead_block_hashes``). vLLM derives ``num_hash_lookahead_tokens``
    itself; it is checked against ``lookahead`` here. ``num_spec_tokens=0`` (with
    ``lookahead=0``) builds no speculative config at all: no speculative decoding.

    ``kv_connector``: options of ``kv_connector.kv_transfer_config`` (``{}`` for
    the defaults); the scheduler then loads ``StubKVConnector`` through vLLM's
    ``kv_transfer_config`` (``kv_role="kv_both"``, ``kv_load_failure_policy`` "recompute"
    unless given) and the worker-side instance is ``setup.kv_worker``.

    ``kv_tier``: ``(connector name, tier blocks)``, a real CPU-offload connector of vLLM
    (``kv_tiers.tier_transfer_config``) whose tier holds that many GPU KV blocks (or ``(connector
    name, its kv_connector_extra_config)``, sized as that config says); the worker side
    is the stand-in ``kv_tiers.TierWorker``.

    ``scheduler_connector``: the scheduler-side aux-output connector the scheduler builds:
    ``"ours"`` (``CacheSchedulerConnector``, what the plugin installs) or ``"vllm"`` (vLLM's
    ``AuxOutputSchedulerConnector``).

    ``kv_groups``: the model's KV cache groups, which vLLM's hybrid KV cache manager serves
    (its coordinator is chosen by the group count): ``"full"`` one full-attention group;
    ``"sliding"`` a full-attention group beside a sliding-window one (gpt-oss's layout; window
    ``2 * block_size``); ``"mamba"`` a full-attention group of ``block_size`` beside a Mamba
    group in ``align`` mode of ``2 * block_size`` (a Qwen3-Next-like hybrid: the scheduler block
    is their LCM, the hash block their GCD, so hashes are finer than the scheduler block).
    Hybrid groups run with a ``kv_tier`` (one KV tensor per group), not with the stub
    ``kv_connector``.
    """
    if kv_groups not in KV_GROUPS:
        raise HarnessError(f"kv_groups must be one of {KV_GROUPS}, got {kv_groups!r}")
    if kv_groups != "full" and kv_connector is not None:
        raise HarnessError("hybrid KV groups run without the stub KV connector (it serves one group)")
    if scheduler_connector not in SCHEDULER_CONNECTORS:
        raise HarnessError(f"scheduler_connector must be one of {sorted(SCHEDULER_CONNECTORS)}, got {scheduler_connector!r}")
    if kv_connector is not None and kv_tier is not None:
        raise HarnessError("one KV connector: kv_connector (the stub) or kv_tier (a real CPU-offload connector)")
    nextn = max(1, lookahead)
    if lookahead > 1 and num_spec_tokens != lookahead:
        # Multi-module MTP hashes num_speculative_tokens lookahead tokens.
        raise HarnessError("multi-module MTP lookahead L needs num_spec_tokens == L")
    if num_spec_tokens == 0 and lookahead != 0:
        raise HarnessError("lookahead hashing needs speculative decoding (num_spec_tokens > 0)")
    if num_spec_tokens < 0:
        raise HarnessError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    model_config = ModelConfig(
        model=_model_dir(nextn), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len
    )
    keeps_lookahead = kv_connector is not None and kv_connector.get("keeps_lookahead_hashes", False)
    keeps_lookahead |= kv_tier is not None and CONTRACT.kv_connectors_may_keep_lookahead  # both opt in on 0.34
    if keeps_lookahead and not CONTRACT.kv_connectors_may_keep_lookahead:
        raise HarnessError(f"vLLM {CONTRACT.series} has no KV connector that keeps lookahead hashing")
    if (kv_connector is not None or kv_tier is not None) and lookahead != 0 and not keeps_lookahead:
        # VllmConfig.num_hash_lookahead_tokens: KV connectors keep the legacy hashes unless they
        # opt in (0.34's supports_lookahead_block_hashes).
        raise HarnessError("a KV connector without the lookahead opt-in turns lookahead hashing off: use lookahead=0")
    speculative_config = None
    if num_spec_tokens > 0:
        # With a KV connector lookahead hashing stays requested (vLLM's default) and vLLM
        # itself must turn it off; the check below holds it to that.
        speculative_config = SpeculativeConfig(
            method="mtp", num_speculative_tokens=num_spec_tokens, target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
            disable_lookahead_block_hashes=lookahead == 0 and (kv_connector is None and kv_tier is None or keeps_lookahead),
        )
    kv_spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_transfer = None
    if kv_connector is not None:
        kv_transfer = kv_transfer_config(**kv_connector)
    elif kv_tier is not None:
        kv_transfer = tier_transfer_config(*kv_tier, block_bytes=kv_spec.page_size_bytes)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=True, async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold, is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    if kv_groups == "mamba":  # what HybridAttentionMambaModelConfig sets with prefix caching on
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = 2 * block_size
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        speculative_config=speculative_config, device_config=DeviceConfig(device="cpu"),
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=True), kv_transfer_config=kv_transfer,
    )
    if vllm_config.num_hash_lookahead_tokens != lookahead:
        raise HarnessError(
            f"vLLM derived num_hash_lookahead_tokens={vllm_config.num_hash_lookahead_tokens}, wanted {lookahead}"
        )
    if CONTRACT.has_model_runner_v1 and not vllm_config.use_v2_model_runner:
        raise HarnessError("routed experts need Model Runner V2")
    # SimpleCPUOffloadConnector sizes its tier from the KV tensor (and refuses a config without one).
    groups = [KVCacheGroupSpec(["layer"], kv_spec)] + _extra_groups(kv_groups, block_size)
    kv_tensors = [] if kv_tier is None else [
        KVCacheTensor(size=page * num_blocks, layers=group.layer_names, layer_stride=page * num_blocks, block_stride=page)
        for group in groups for page in [group.kv_cache_spec.page_size_bytes]
    ]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=kv_tensors, kv_cache_groups=groups)
    cache_config.num_gpu_blocks = num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    with mock.patch.object(scheduler_module, "AuxOutputSchedulerConnector", SCHEDULER_CONNECTORS[scheduler_connector]):
        scheduler = scheduler_cls(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config), block_size=scheduler_block_size,
            hash_block_size=hash_block_size, log_stats=False,
        )
    if scheduler.aux_output_connector is None:
        raise HarnessError("the scheduler built no AuxOutputSchedulerConnector")
    if type(scheduler.aux_output_connector) is not SCHEDULER_CONNECTORS[scheduler_connector]:
        raise HarnessError(f"the scheduler built {type(scheduler.aux_output_connector).__name__}")
    kv_worker = None
    if kv_connector is not None:
        if not isinstance(scheduler.connector, StubKVConnector):
            raise HarnessError(f"the scheduler built KV connector {type(scheduler.connector).__name__}")
        kv_worker = make_worker(vllm_config, kv_cache_config)
    elif kv_tier is not None:
        if type(scheduler.connector).__name__ != kv_tier[0]:
            raise HarnessError(f"the scheduler built KV connector {type(scheduler.connector).__name__}")
        kv_worker = TierWorker()
    if scheduler_connector == "ours":  # the KV blocks plus the tier (kv_tiers.retained_blocks)
        capacity = retained_blocks(vllm_config, kv_cache_config)
    else:  # vLLM: num_blocks, doubled with any KV connector
        capacity = num_blocks * (2 if kv_transfer is not None else 1)
    if scheduler.aux_output_connector._capacity != capacity:
        raise HarnessError(f"AuxOutputSchedulerConnector capacity {scheduler.aux_output_connector._capacity}, "
                           f"expected {capacity}")
    # EngineCore.__init__: the request block hasher with the config's lookahead tokens.
    caching_hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(caching_hash_fn)
    block_hasher = get_request_block_hasher(hash_block_size, caching_hash_fn, vllm_config.num_hash_lookahead_tokens)
    return SchedulerSetup(
        scheduler, vllm_config, kv_cache_config, block_hasher, lookahead, num_spec_tokens, async_scheduling,
        kv_worker,
    )


def make_request(setup: SchedulerSetup, request_id: str, prompt: list[int], max_tokens: int,
                 prompt_start: int = 0, kv_transfer_params: dict | None = None) -> Request:
    """``kv_transfer_params`` travel as vLLM's entrypoints pass them: ``SamplingParams.extra_args``."""
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, routed_experts_prompt_start=prompt_start,
                            extra_args=extra_args)
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
        block_hasher=setup.block_hasher,
    )
