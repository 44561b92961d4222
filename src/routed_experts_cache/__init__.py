"""A GPU-resident paged cache of MoE routed-expert rows, and a vLLM worker connector built on it.

``RoutedExpertsCache`` and its errors are engine-agnostic (torch and numpy only); the vLLM
connector lives in ``routed_experts_cache.connector.vllm_worker`` and imports vLLM itself.
"""

from . import connector
from .connector import *  # noqa: F401,F403  (the cache and its errors: connector.__all__)

__version__ = "0.2.0"

__all__ = [*connector.__all__, "__version__"]
