"""A GPU-resident paged cache of MoE routed-expert rows, and a vLLM worker connector built on it.

``RoutedExpertsCache`` and its errors are engine-agnostic (torch and numpy only); the vLLM
connector lives in ``routed_experts_cache.connector`` and imports vLLM itself.
"""

from .connector.cache import RoutedExpertsCache
from .errors import CacheFullError, InvalidCaptureError, RangeUnavailableError, RoutedExpertsCacheError

__version__ = "0.2.0"

__all__ = [
    "CacheFullError",
    "InvalidCaptureError",
    "RangeUnavailableError",
    "RoutedExpertsCache",
    "RoutedExpertsCacheError",
    "__version__",
]
