"""The Triton segment copy (under the interpreter on CPU, or compiled on ``TEST_DEVICE``) vs
its torch twin vs naive slicing.

Every case runs three implementations on the same inputs:
- ``naive``: one explicit Python slice assignment per segment, on the row tensors themselves;
- the torch twin ``copy_segments_torch`` and the Triton ``copy_segments``, both on the word
  views that ``as_row_words`` gives (as the cache calls them).
The twin must equal the naive result (so the oracle itself is checked) and Triton must equal
the twin, byte for byte, including rows the descriptor does not touch.
"""

import os
import subprocess
import sys
import zlib

import pytest
import torch
import triton
from conftest import ON_CPU, TEST_DEVICE

from routed_experts_cache.kernels import (
    as_row_words,
    copy_segments_torch,
    interpreting,
    load_triton_copy,
    precompile_triton_copy,
)
from routed_experts_cache.kernels.rows import tile_shape
from routed_experts_cache.kernels.segment_copy import copy_segments

PAGE = 8
NUM_PAGES = 24

ROW_DTYPES = [torch.uint8, torch.uint16, torch.int32]
ROW_SHAPES = [(2, 2), (3, 1), (48, 8), (61, 8), (60, 8)]

# Runs (page, first row, end row) inside pages: the unit both the gather and the scatter use.
RUN_PATTERNS = {
    "one_full_page": [(5, 0, PAGE)],
    "one_partial": [(3, 2, 7)],
    "one_row": [(9, 7, 8)],
    "many_full_pages": [(p, 0, PAGE) for p in (7, 2, 9, 0, 11, 4, 5, 23, 16)],
    "unaligned": [(2, 3, PAGE), (7, 0, 5), (0, 1, 2), (10, 7, 8), (6, 4, 6), (12, 0, PAGE), (13, 0, 1)],
    "single_rows": [(p, (3 * p) % PAGE, (3 * p) % PAGE + 1) for p in range(NUM_PAGES)],
    "empty_segment_inside": [(2, 0, PAGE), (4, 3, 3), (6, 1, 5), (8, 2, 2), (1, 5, 6)],
}


def random_rows(gen: torch.Generator, n: int, row_shape, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int32:
        values = torch.randint(-(2**31), 2**31 - 1, (n, *row_shape), generator=gen, dtype=torch.int64)
    else:
        high = 1 << (8 * torch.empty((), dtype=dtype).element_size())
        values = torch.randint(0, high, (n, *row_shape), generator=gen, dtype=torch.int64)
    return values.to(dtype)


def interval_runs(gen: torch.Generator, num_pages: int, page: int) -> list[tuple[int, int, int]]:
    """Many intervals over distinct pages, 1..4 pages each, unaligned first start and last end."""
    order = torch.randperm(num_pages, generator=gen).tolist()
    runs = []
    while order:
        size = min(len(order), int(torch.randint(1, 5, (), generator=gen)))
        pages, order = order[:size], order[size:]
        first = int(torch.randint(0, page, (), generator=gen))
        last = int(torch.randint(1, page + 1, (), generator=gen))
        if size == 1:
            first, last = min(first, last - 1), last
        for i, p in enumerate(pages):
            runs.append((p, first if i == 0 else 0, last if i == size - 1 else page))
    return runs


def gather_segments(runs, page):
    """Pool pages -> packed output: (source row, target row, count) with targets = seg_start."""
    segments, offset = [], 0
    for p, first, last in runs:
        segments.append((p * page + first, offset, last - first))
        offset += last - first
    return segments, offset


def scatter_segments(runs, page, gen):
    """Packed source with gaps (like rejected speculative rows) -> pool pages."""
    segments, offset = [], 0
    for p, first, last in runs:
        offset += int(torch.randint(0, 3, (), generator=gen))  # a gap of 0..2 unused source rows
        segments.append((offset, p * page + first, last - first))
        offset += last - first
    return segments, offset + 1


def descriptor(segments):
    seg_start = [0]
    for _, _, n in segments:
        seg_start.append(seg_start[-1] + n)
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return (
        as_i32(seg_start),
        as_i32([s for s, _, _ in segments]),
        as_i32([t for _, t, _ in segments]),
        seg_start[-1],
    )


def naive_copy(source: torch.Tensor, target: torch.Tensor, segments) -> torch.Tensor:
    expected = target.clone()
    for src, tgt, n in segments:
        expected[tgt : tgt + n] = source[src : src + n]
    return expected


def run_all_three(source, target, segments, gather: bool):
    """Return (naive, twin, triton) results as row tensors shaped like ``target``."""
    expected = naive_copy(source, target, segments)
    seg_start, seg_source_row, seg_target_row, total = descriptor(segments)
    if gather:
        seg_target_row = seg_start[:-1]
    twin = target.clone()
    copy_segments_torch(as_row_words(source), as_row_words(twin), seg_start, seg_source_row, seg_target_row, total)
    out = target.to(TEST_DEVICE, copy=True)
    on_device = [t.to(TEST_DEVICE) for t in (source, seg_start, seg_source_row, seg_target_row)]
    copy_segments(as_row_words(on_device[0]), as_row_words(out), *on_device[1:], total)
    return expected, twin, out.cpu()


def assert_same(expected, twin, tri):
    assert twin.dtype == expected.dtype and tri.dtype == expected.dtype
    assert torch.equal(twin, expected), "torch twin differs from naive per-segment slicing"
    assert torch.equal(tri, twin), "Triton kernel differs from the torch twin"


def test_interpreter_is_on_exactly_on_cpu_and_loader_returns_the_kernel():
    assert (os.environ.get("TRITON_INTERPRET") == "1") == ON_CPU
    assert interpreting() == ON_CPU
    assert load_triton_copy() is copy_segments


@pytest.mark.parametrize(
    "dtype, row_shape, word_dtype, words",
    [
        (torch.uint8, (3, 1), torch.uint8, 3),
        (torch.uint8, (2, 2), torch.int32, 1),
        (torch.uint8, (61, 8), torch.int32, 122),
        (torch.uint16, (3, 1), torch.int16, 3),
        (torch.uint16, (60, 8), torch.int32, 240),
        (torch.int32, (3, 1), torch.int32, 3),
        (torch.int32, (61, 8), torch.int32, 488),
        (torch.int16, (3, 1), torch.int16, 3),
    ],
)
def test_as_row_words_is_a_writable_view_of_the_widest_word(dtype, row_shape, word_dtype, words):
    rows = torch.zeros((5, *row_shape), dtype=dtype)
    view = as_row_words(rows)
    assert view.dtype == word_dtype
    assert tuple(view.shape) == (5, words)
    assert view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    view[2] = -1  # all bits set: visible through the original tensor, row 2 only
    assert torch.equal(rows[2].view(torch.uint8), torch.full_like(rows[2].view(torch.uint8), 255))
    assert int(rows[[0, 1, 3, 4]].view(torch.uint8).sum()) == 0


def test_tile_shape_is_a_power_of_two_covering_a_row():
    for num_segments in (1, 2, 3, 7, 600, 1 << 17, (1 << 17) + 1):
        for row_words in (1, 3, 122, 256, 488):
            segments_per_program, block_words = tile_shape(num_segments, row_words)
            assert segments_per_program & (segments_per_program - 1) == 0
            assert block_words & (block_words - 1) == 0
            assert block_words >= row_words and segments_per_program >= 1


def test_tile_wastes_less_than_half_of_a_launch(monkeypatch):
    """The row block is the smallest power of two that covers a row (compiled: at least the
    2048-word loop), and the interpreter packs at most the next power of two of the launch's
    segments into a program: a larger tile is still correct, only masked-off work."""
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        for num_segments in (1, 2, 3, 7, 600):
            for row_words in (1, 2, 3, 122, 256, 488, 4000):
                segments_per_program, block_words = tile_shape(num_segments, row_words)
                assert segments_per_program < 2 * num_segments
                row_block = block_words if interpret == "0" else block_words // 16  # 16 rows a segment
                if interpret == "0" and row_words <= 2048:
                    assert block_words == 2048
                else:
                    assert row_words <= row_block < 2 * row_words


def test_compiled_tile_is_one_segment_per_program_and_depends_only_on_the_row_width(monkeypatch):
    """One compiled kernel variant per row shape, whatever the batch size."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for row_words in (1, 96, 122, 240, 4000):
        shapes = {tile_shape(num_segments, row_words) for num_segments in (1, 5, 643, 1 << 20)}
        assert len(shapes) == 1 and next(iter(shapes))[0] == 1


@pytest.mark.parametrize("pattern", sorted(RUN_PATTERNS) + ["many_intervals"])
@pytest.mark.parametrize("row_shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_segment_copy_matches_twin_and_naive(direction, dtype, row_shape, pattern):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((direction, dtype, row_shape, pattern)).encode()))
    runs = interval_runs(gen, NUM_PAGES, PAGE) if pattern == "many_intervals" else RUN_PATTERNS[pattern]
    pool = random_rows(gen, NUM_PAGES * PAGE, row_shape, dtype)
    if direction == "gather":
        segments, total = gather_segments(runs, PAGE)
        packed = random_rows(gen, total, row_shape, dtype)  # garbage: every row must be overwritten
        expected, twin, tri = run_all_three(pool, packed, segments, gather=True)
        # the naive result is itself the concatenation of the page runs
        runs_rows = [pool[p * PAGE + a : p * PAGE + b] for p, a, b in runs]
        assert torch.equal(expected, torch.cat(runs_rows))
    else:
        segments, source_rows = scatter_segments(runs, PAGE, gen)
        source = random_rows(gen, source_rows, row_shape, dtype)
        expected, twin, tri = run_all_three(source, pool, segments, gather=False)
        touched = sum(n for _, _, n in segments)
        changed_rows = int((expected != pool).flatten(1).any(1).sum())
        assert 0 < changed_rows <= touched
    if pattern == "many_intervals":
        assert len(segments) > NUM_PAGES // 2
    assert_same(expected, twin, tri)


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_empty_batch_changes_nothing(direction, dtype):
    gen = torch.Generator().manual_seed(7)
    pool = random_rows(gen, 4 * PAGE, (3, 1), dtype)
    other = random_rows(gen, 0 if direction == "gather" else 5, (3, 1), dtype)
    source, target = (pool, other) if direction == "gather" else (other, pool)
    source, target = source.to(TEST_DEVICE), target.to(TEST_DEVICE)
    before = target.clone()
    empty = torch.zeros(0, dtype=torch.int32, device=TEST_DEVICE)
    seg_start = torch.zeros(1, dtype=torch.int32, device=TEST_DEVICE)
    for copy in (copy_segments_torch, copy_segments):
        copy(as_row_words(source), as_row_words(target), seg_start, empty, empty, 0)
        assert torch.equal(target, before)


def _multi_program_case(gen, row_shape, dtype, num_segments, max_len, direction, page=PAGE):
    num_pages = num_segments if direction == "scatter" else 64
    runs = []
    for s in range(num_segments):
        index = s if direction == "scatter" else int(torch.randint(0, num_pages, (), generator=gen))
        first = int(torch.randint(0, 3, (), generator=gen))
        length = int(torch.randint(1, max_len + 1, (), generator=gen))
        runs.append((index, first, min(page, first + length)))
    pool = random_rows(gen, num_pages * page, row_shape, dtype)
    if direction == "gather":
        segments, total = gather_segments(runs, page)
        return pool, random_rows(gen, total, row_shape, dtype), segments, total
    segments, source_rows = scatter_segments(runs, page, gen)
    return random_rows(gen, source_rows, row_shape, dtype), pool, segments, sum(n for _, _, n in segments)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_launch_with_more_than_one_program_and_segments_longer_than_a_block(direction):
    # int32 rows of 61 x 8 = 488 words; segments of up to 40 rows (19520 words) take several
    # loop iterations of a program; 300 segments need several programs.
    gen = torch.Generator().manual_seed(11)
    row_shape, dtype = (61, 8), torch.int32
    page = 40
    source, target, segments, total = _multi_program_case(gen, row_shape, dtype, 300, page, direction, page)
    segments_per_program, block_words = tile_shape(len(segments), 61 * 8)
    assert max(n for _, _, n in segments) * 61 * 8 > 2 * block_words
    assert triton.cdiv(len(segments), segments_per_program) >= 2
    expected, twin, tri = run_all_three(source, target, segments, gather=direction == "gather")
    assert_same(expected, twin, tri)


def test_launch_with_more_than_one_program_of_one_word_rows():
    # one int32 word per row (uint8 rows of 2 x 2)
    gen = torch.Generator().manual_seed(12)
    row_shape, dtype = (2, 2), torch.uint8
    source, target, segments, total = _multi_program_case(gen, row_shape, dtype, 33000, PAGE, "scatter")
    segments_per_program, _ = tile_shape(len(segments), 1)
    assert triton.cdiv(len(segments), segments_per_program) >= 2
    expected, twin, tri = run_all_three(source, target, segments, gather=False)
    assert_same(expected, twin, tri)


@pytest.mark.parametrize("row_shape, dtype", [((48, 8), torch.uint8), ((3, 1), torch.uint16)], ids=str)
def test_precompiling_leaves_rows_unchanged(row_shape, dtype):
    gen = torch.Generator().manual_seed(5)
    rows = random_rows(gen, 3 * PAGE, row_shape, dtype).to(TEST_DEVICE)
    before = rows.clone()
    precompile_triton_copy(as_row_words(rows))
    assert torch.equal(rows, before)


def test_compiled_kernel_does_not_specialize_on_per_step_sizes_or_descriptor_offsets():
    # Compiled (no interpreter: a fresh process), Triton would otherwise compile a new variant
    # whenever a row or segment count changes its divisibility by 16 or a descriptor slice
    # its alignment, i.e. mid-serving.
    probe = (
        "from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel as k\n"
        "print(sorted(p.name for p in k.params if p.do_not_specialize))\n"
        "print(sorted(p.name for p in k.params if p.do_not_specialize_on_alignment))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    sizes, offsets = out.splitlines()
    assert sizes == str(["num_segments"])
    assert offsets == str(["seg_source_row_ptr", "seg_start_ptr", "seg_target_row_ptr"])


def test_compiled_variants_launch_directly_once_found_and_unaligned_rows_go_through_the_jit():
    # Compiled, the first launch of a variant goes through Triton's JIT and later ones skip it
    # (segment_copy._compiled); both must copy exactly what the twin copies. A row pointer that
    # is not 16-byte aligned is a variant the direct path never takes. Interpreted (CPU), every
    # launch goes through the interpreter and nothing is kept.
    from routed_experts_cache.kernels import segment_copy

    gen = torch.Generator().manual_seed(13)
    row_shape, dtype = (5, 4), torch.uint8  # 5 words a row (no other test's width): a one-row offset is 20 bytes
    pool = random_rows(gen, NUM_PAGES * PAGE, row_shape, dtype)
    segments, source_rows = scatter_segments(RUN_PATTERNS["unaligned"], PAGE, gen)
    seg_start, seg_source_row, seg_target_row, total = descriptor(segments)
    for trial in range(3):
        rows = random_rows(gen, source_rows + 1, row_shape, dtype)
        source = rows[1:] if trial == 2 else rows[:source_rows]  # trial 2: rows 20 bytes into their storage
        expected = naive_copy(source, pool, segments)
        on_device = rows.to(TEST_DEVICE)
        source_on_device = on_device[1:] if trial == 2 else on_device[:source_rows]
        assert bool(source_on_device.data_ptr() % 16) == (trial == 2)
        out = pool.to(TEST_DEVICE, copy=True)
        copy_segments(as_row_words(source_on_device), as_row_words(out),
                      *(t.to(TEST_DEVICE) for t in (seg_start, seg_source_row, seg_target_row)), total)
        assert torch.equal(out.cpu(), expected), f"trial {trial}"
        kept = [key for key in segment_copy._compiled if key[1] == torch.int32 and key[-3] == 5]  # words, ROW_WORDS
        if ON_CPU:
            assert not segment_copy._compiled
        else:
            assert len(kept) == 1, kept  # the aligned variant only, found by the first launch
