"""Row layout shared by the gather and scatter launchers.

A routing row (``L x K`` expert ids) is copied as a unit. Viewing each row as 32-bit words
(when its byte size allows) lets the kernels move 4 bytes per lane instead of 1.
"""

import os
from math import prod

import torch

# Words one program moves per loop iteration, compiled: 16 words (four 16-byte accesses) per
# thread of 4 warps. The interpreter costs about 1 ms per program instance and per operation:
# it gives each program many segments at once instead.
_COMPILED_BLOCK_WORDS = 1 << 11
_INTERPRETED_TILE_WORDS = 1 << 17
_INTERPRETED_ROWS_PER_SEGMENT = 16  # vLLM's usual block: most segments copy in one iteration


def as_row_words(rows: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[n, ...]`` tensor as ``[n, words]`` of the widest integer word."""
    flat = rows.reshape(rows.shape[0], prod(rows.shape[1:]))
    row_bytes = flat.shape[1] * flat.element_size()
    for word in (torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0:
            return flat.view(torch.uint8).view(word) if flat.dtype != word else flat
    return flat.view(torch.uint8)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_shape(num_segments: int, row_words: int) -> tuple[int, int]:
    """(segments per program, words per loop iteration) for a launch over ``num_segments``.

    Compiled, a program copies one segment and the tile depends only on the row width, so a
    serving process compiles one variant per row shape; the interpreter has no compile cost
    and packs many segments into each program instead.
    """
    row_block = 1 << max(0, row_words - 1).bit_length()
    if not interpreting():
        return 1, max(_COMPILED_BLOCK_WORDS, row_block)
    block_words = row_block * _INTERPRETED_ROWS_PER_SEGMENT
    segments = max(1, _INTERPRETED_TILE_WORDS // block_words)
    return min(segments, 1 << max(0, num_segments - 1).bit_length()), block_words
