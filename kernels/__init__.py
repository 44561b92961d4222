"""Row-copy kernels of the cache: the Triton segment copy and its pure-torch twin.

The Triton module is imported on demand (``load_triton_copy``) so that the torch path works
without compiling anything, and so that ``TRITON_INTERPRET`` can be set before that import.
"""

from .reference import copy_segments_torch
from .rows import as_row_words, interpreting


def load_triton_copy():
    """Return the Triton ``copy_segments`` (same signature as ``copy_segments_torch``)."""
    from .segment_copy import copy_segments

    return copy_segments


def precompile_triton_copy(words) -> None:
    """Compile the Triton copy for rows like ``words`` (``[R, W]`` word view)."""
    from .segment_copy import precompile

    precompile(words)


__all__ = ["as_row_words", "copy_segments_torch", "interpreting", "load_triton_copy", "precompile_triton_copy"]
