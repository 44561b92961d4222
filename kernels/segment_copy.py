"""Segment copy: the one Triton kernel behind both the cache's gather and its scatter.

Segment ``s`` copies ``n_s = seg_start[s+1] - seg_start[s]`` rows: source rows
``seg_source_row[s] + j`` to target rows ``seg_target_row[s] + j``. A segment never crosses a
page, so the host builds one per touched page (O(blocks), never O(rows)).

- gather (read): source = the pool, target = a new packed output (``seg_target_row = seg_start``);
- scatter (capture): source = the step's snapshot rows, target = the pool.

Rows are resolved without any search: a program owns whole segments (one when compiled), reads
its descriptor with four scalar loads and copies each segment as one flat run of
``n_s * ROW_WORDS`` words, since a segment's rows are contiguous on both sides. The word offsets
are multiples of ``ROW_WORDS``, so the compiler proves the alignment that 16-byte accesses need
whenever the row's byte size allows it. The grid is sized by segments: a decode step's one-row
segments and a prefill's full pages both give one program per page touched.

Compiled variants: Triton would specialize on every int argument's divisibility by 16 and
every pointer's alignment. Segment counts change every step and the descriptor is sliced at
arbitrary offsets, so those arguments are not specialized; what is left is one variant per
(row words, word dtype), compiled up front by ``precompile`` so that a serving step never
waits for a compile. Once found, a variant is launched directly, without the JIT's per-call
binding (``_compiled``).
"""

import torch
import triton
import triton.language as tl

from .rows import interpreting, tile_shape


@triton.jit(
    do_not_specialize=["num_segments"],
    do_not_specialize_on_alignment=["seg_start_ptr", "seg_source_row_ptr", "seg_target_row_ptr"],
)
def _segment_copy_kernel(
    source_ptr,
    target_ptr,
    seg_start_ptr,
    seg_source_row_ptr,
    seg_target_row_ptr,
    num_segments,
    ROW_WORDS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    segments = tl.program_id(0) * SEGMENTS + tl.arange(0, SEGMENTS)
    present = segments < num_segments
    first_row = tl.load(seg_start_ptr + segments, mask=present, other=0)
    end_row = tl.load(seg_start_ptr + segments + 1, mask=present, other=0)
    num_words = ((end_row - first_row) * ROW_WORDS)[:, None]
    longest = tl.max(num_words)
    source_base = tl.load(seg_source_row_ptr + segments, mask=present, other=0).to(tl.int64)[:, None] * ROW_WORDS
    target_base = tl.load(seg_target_row_ptr + segments, mask=present, other=0).to(tl.int64)[:, None] * ROW_WORDS
    # A while loop, not range(0, longest, ...): triton 3.6's interpreter cannot take a tensor
    # as a range bound under numpy 2 (its scalars are 1-element arrays).
    first_word = 0
    while first_word < longest:
        words = first_word + tl.arange(0, BLOCK_WORDS)[None, :]
        mask = words < num_words
        values = tl.load(source_ptr + source_base + words, mask=mask)
        tl.store(target_ptr + target_base + words, values, mask=mask)
        first_word += BLOCK_WORDS


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
    segments_per_program, block_words = tile_shape(num_segments, source.shape[1])
    grid = triton.cdiv(num_segments, segments_per_program)
    arguments = (source, target, seg_start, seg_source_row, seg_target_row, num_segments,
                 source.shape[1], segments_per_program, block_words)
    key = _launch_key(*arguments)
    kernel = _compiled.get(key) if key is not None else None
    if kernel is None:  # Triton's JIT: specializes, compiles once per variant, launches
        kernel = _segment_copy_kernel[(grid,)](*arguments[:6], ROW_WORDS=arguments[6], SEGMENTS=arguments[7],
                                               BLOCK_WORDS=arguments[8], num_stages=1)
        if key is not None:
            _compiled[key] = kernel
        return
    _launch(kernel, grid, arguments)


# Compiled kernels by everything the JIT's choice of variant depends on for this kernel's
# arguments, so that a launch skips the JIT's per-call binding and specialization: about 20 of
# the 75-100 us of host time a launch took on an H200 machine (triton 3.6), on every step's path.
_compiled: dict[tuple, object] = {}


def _launch_key(source, target, seg_start, seg_source_row, seg_target_row, num_segments, *constants):
    """The variant the JIT would launch, for a compiled (not interpreted) launch whose row
    pointers are 16-byte aligned (the only alignment the JIT specializes on here: the
    descriptor pointers and ``num_segments`` are not specialized); None otherwise."""
    if (source.data_ptr() | target.data_ptr()) % 16 or source.device.type != "cuda" or interpreting():
        return None
    return (torch.cuda.current_device(), source.dtype, target.dtype, seg_start.dtype, seg_source_row.dtype,
            seg_target_row.dtype, *constants)


def _launch(kernel, grid: int, arguments: tuple) -> None:
    """Launch a compiled variant as Triton's JIT does once it has found it (triton 3.6-3.8)."""
    from triton import knobs
    from triton.runtime import driver

    stream = driver.active.get_current_stream(driver.active.get_current_device())
    kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata,
               kernel.launch_metadata((grid,), stream, *arguments),
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *arguments)


def precompile(words: torch.Tensor) -> None:
    """Compile the kernel for rows like ``words`` now (a one-row copy of row 0 onto itself).

    Kernels are cached per process and on disk by Triton, so this is slow once per row shape.
    """
    descriptor = torch.tensor([0, 1, 0, 0], dtype=torch.int32, device=words.device)
    copy_segments(words, words, descriptor[:2], descriptor[2:3], descriptor[3:], 1)
