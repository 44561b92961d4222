"""The installed vLLM release and its row of the version table; imported first by every module
here: it refuses a vLLM without the scheduler-side pins (0.32 and older) and sets the
environment vLLM reads at import."""

import importlib.metadata
import os
import tempfile

from routed_experts_cache.connector.vllm.versions import contract_for, series_of

VLLM_VERSION = importlib.metadata.version("vllm")
CONTRACT = contract_for(VLLM_VERSION)
if CONTRACT is None or not CONTRACT.scheduler_pins:
    raise RuntimeError(f"the scheduler harness needs vLLM 0.33.x or 0.34.x, found {VLLM_VERSION}")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM caches model-class inspection results; keep them out of the user's cache but
# reuse them across runs (the first run inspects the two architectures, ~15 s).
os.environ.setdefault(
    "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"routed-experts-cache-vllm{series_of(VLLM_VERSION)}")
)
