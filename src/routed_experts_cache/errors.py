"""Typed errors of the routed-experts cache.

Every failure is one of these (never an ``assert``), and a call that raises leaves the
cache exactly as it was.
"""


class RoutedExpertsCacheError(ValueError):
    """Base class: a call to the cache was refused; nothing changed."""


class RangeUnavailableError(RoutedExpertsCacheError):
    """A read named an unknown request or rows that are not (or no longer) present."""


class CacheFullError(RoutedExpertsCacheError):
    """No free page and no evictable published page is left for a capture."""


class InvalidCaptureError(RoutedExpertsCacheError):
    """Captured rows or block hashes do not fit the request (gap, overlap, shape, type)."""
