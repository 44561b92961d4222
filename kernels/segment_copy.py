"""Segment copy: the one Triton kernel behind both the cache's gather and its scatter.

Segment ``s`` copies ``n_s = seg_start[s+1] - seg_start[s]`` rows: source rows
``seg_source_row[s] + j`` to target rows ``seg_target_row[s] + j``. A segment never crosses a
page, so the host builds one per touched page (O(blocks), never O(rows)).

- gather (read): source = the pool, target = a new packed output (``seg_target_row = seg_start``);
- scatter (capture): source = the step's snapshot rows, target = the pool.

The grid is sized by rows (``seg_start[-1]``), not by segments or requests: many one-row
decode segments and one huge prefill segment both fill it. Each row finds its segment by a
binary search over ``seg_start``. The row width is a compile-time constant (one variant per
row shape, as the tile is): the word loop unrolls and the compiler sees the row alignment.

Compiled variants: Triton would specialize on every int argument's divisibility by 16 and
every pointer's alignment. Segment and row counts change every step and the descriptor is
sliced at arbitrary offsets, so those arguments are not specialized; what is left is one
variant per (row words, word dtype, search depth), all compiled up front by
``compile_search_depths`` so that a serving step never waits for a compile.
"""

import torch
import triton
import triton.language as tl

from .rows import search_steps, tile_shape


MAX_PRECOMPILED_SEARCH_STEPS = 24  # up to 2**24 segments in one launch


@triton.jit(
    do_not_specialize=["num_segments", "total_rows"],
    do_not_specialize_on_alignment=["seg_start_ptr", "seg_source_row_ptr", "seg_target_row_ptr"],
)
def _segment_copy_kernel(
    source_ptr,
    target_ptr,
    seg_start_ptr,
    seg_source_row_ptr,
    seg_target_row_ptr,
    num_segments,
    total_rows,
    ROW_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < total_rows
    # Largest s with seg_start[s] <= row; invariant seg_start[lo] <= row < seg_start[hi].
    lo = tl.zeros_like(rows)
    hi = lo + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(seg_start_ptr + mid) <= rows
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    within = rows - tl.load(seg_start_ptr + lo)
    source_base = (tl.load(seg_source_row_ptr + lo) + within).to(tl.int64)[:, None] * ROW_WORDS
    target_base = (tl.load(seg_target_row_ptr + lo) + within).to(tl.int64)[:, None] * ROW_WORDS
    for first_word in tl.static_range(0, ROW_WORDS, WORDS):
        words = first_word + tl.arange(0, WORDS)
        mask = row_mask[:, None] & (words < ROW_WORDS)[None, :]
        values = tl.load(source_ptr + source_base + words[None, :], mask=mask)
        tl.store(target_ptr + target_base + words[None, :], values, mask=mask)


def copy_segments(
    source: torch.Tensor,
    target: torch.Tensor,
    seg_start: torch.Tensor,
    seg_source_row: torch.Tensor,
    seg_target_row: torch.Tensor,
    total_rows: int,
) -> None:
    """Copy rows between contiguous ``[R, W]`` tensors of one word dtype, in one launch.

    ``seg_start`` (int32, n + 1, from 0 to ``total_rows``), ``seg_source_row`` and
    ``seg_target_row`` (int32, n) live on the tensors' device.
    """
    if total_rows == 0:
        return
    num_segments = seg_source_row.shape[0]
    _launch(source, target, seg_start, seg_source_row, seg_target_row, total_rows, search_steps(num_segments))


def compile_search_depths(words: torch.Tensor) -> None:
    """Compile the kernel for rows like ``words`` at every search depth now.

    Each depth is compiled by a one-row copy of row 0 onto itself (rows unchanged). Kernels
    are cached per process and on disk by Triton, so this is slow once per row shape.
    """
    descriptor = torch.tensor([0, 1, 0, 0], dtype=torch.int32, device=words.device)
    for steps in range(4, MAX_PRECOMPILED_SEARCH_STEPS + 1, 4):
        _launch(words, words, descriptor[:2], descriptor[2:3], descriptor[3:], 1, steps)


def _launch(source, target, seg_start, seg_source_row, seg_target_row, total_rows: int, steps: int) -> None:
    rows_per_program, word_block = tile_shape(total_rows, source.shape[1])
    _segment_copy_kernel[(triton.cdiv(total_rows, rows_per_program),)](
        source,
        target,
        seg_start,
        seg_source_row,
        seg_target_row,
        seg_source_row.shape[0],
        total_rows,
        ROW_WORDS=source.shape[1],
        ROWS=rows_per_program,
        WORDS=word_block,
        SEARCH_STEPS=steps,
    )
