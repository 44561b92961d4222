"""Row layout shared by the gather and scatter launchers.

A routing row (``L x K`` expert ids) is copied as a unit. Viewing each row as 32-bit words
(when its byte size allows) lets the kernels move 4 bytes per lane instead of 1.
"""

import os
from math import prod

import torch

# The interpreter costs about 1 ms per program instance: give each program many rows.
_INTERPRETED_TILE_WORDS = 1 << 17
_COMPILED_TILE_WORDS = 1 << 12
MAX_WORD_BLOCK = 256


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


def tile_shape(num_rows: int, row_words: int) -> tuple[int, int]:
    """(rows per program, words per column block) for a launch over ``num_rows`` rows.

    Compiled, the tile depends only on the row width, so a serving process compiles one
    variant per row shape instead of one per batch size; the interpreter has no compile cost
    and shrinks the tile to the batch instead.
    """
    word_block = min(MAX_WORD_BLOCK, 1 << max(0, row_words - 1).bit_length())
    if not interpreting():
        return max(1, _COMPILED_TILE_WORDS // word_block), word_block
    rows_per_program = max(1, _INTERPRETED_TILE_WORDS // word_block)
    return min(rows_per_program, 1 << max(0, num_rows - 1).bit_length()), word_block


def search_steps(num_segments: int) -> int:
    """Binary-search iterations for ``num_segments`` segments, rounded up to a multiple of 4
    (extra iterations are no-ops) so that few kernel variants get compiled."""
    return max(4, -(-num_segments.bit_length() // 4) * 4)
