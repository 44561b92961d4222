"""The routed-experts cache and its vLLM adapter.

``RoutedExpertsCache`` is engine-agnostic; the vLLM worker connector and plugin live in
``routed_experts_cache.connector.vllm_worker`` / ``.vllm_plugin`` and import vLLM lazily.
"""

from .cache import RoutedExpertsCache
from .errors import CacheFullError, InvalidCaptureError, RangeUnavailableError, RoutedExpertsCacheError

__all__ = [
    "CacheFullError",
    "InvalidCaptureError",
    "RangeUnavailableError",
    "RoutedExpertsCache",
    "RoutedExpertsCacheError",
]
