"""The public API of ``routed_experts_cache.connector``: RoutedExpertsCache and its errors.

Every cache test runs on both copy backends ("torch", and "triton" under the interpreter; see
the ``backend`` fixture in conftest.py). Expected rows are always the rows the test captured
(narrowed to the pool dtype), never something read back from the cache.
"""

import hashlib

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE
from test_cache_inputs import UnconvertibleRows

from routed_experts_cache import (
    CacheFullError,
    InvalidCaptureError,
    RangeUnavailableError,
    RoutedExpertsCache,
    RoutedExpertsCacheError,
)
from routed_experts_cache.connector import batch_size
from routed_experts_cache.connector import cache as cache_module
from routed_experts_cache.connector.cache import SMALL_COPY_ROWS, _append_page_runs

ROW = (3, 2)
STATE_KEYS = ("free", "tail", "pending", "duplicate", "published", "evictable")


def rand_rows(gen, n, high=256, row_shape=ROW, dtype=torch.int64):
    return torch.randint(0, high, (n, *row_shape), generator=gen, dtype=torch.int64).to(dtype)


def h(tag, block) -> bytes:
    return f"{tag}/{block}".encode()


def u8(rows):
    return rows.to(torch.uint8)


def states(cache, *keys):
    s = cache.stats()
    return {k: s[k] for k in (keys or STATE_KEYS)}


def assert_rows(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.cpu(), expected.cpu()), f"rows differ:\n{actual}\n!=\n{expected}"


def assert_unavailable(cache, request_id, start, end):
    with pytest.raises(RangeUnavailableError) as excinfo:
        cache.read(request_id, start, end)
    assert repr(request_id) in str(excinfo.value) and f"[{start}, {end})" in str(excinfo.value)


def read_intervals(cache, intervals):
    """Each ``(request_id, start, end)`` interval's rows, read with one ``read_batch``."""
    ids, starts, ends = (list(column) for column in zip(*intervals))
    packed, offsets = cache.read_batch(ids, starts, ends)
    return [packed[offsets[i] : offsets[i + 1]] for i in range(len(intervals))]


def assert_accounting(cache):
    cache.check_consistency()
    s = cache.stats()
    assert sum(s[k] for k in ("free", "tail", "pending", "duplicate", "published")) == s["num_pages"]
    assert s["evictable"] <= s["published"]


# ------------------------------------------------------------------ seed regressions


def test_seed_a_lookahead_1_pending_block_published_when_its_hash_arrives(make_cache, gen):
    cache = make_cache(8)
    rows = rand_rows(gen, 8)
    cache.capture("a", 0, rows[:4])
    cache.add_block_hashes("a", [h("p", 0)])
    cache.capture("a", 4, rows[4:])
    assert_rows(cache.read("a", 0, 8), u8(rows))
    assert states(cache) == dict(free=6, tail=0, pending=1, duplicate=0, published=1, evictable=0)

    # a second request that already knows both hashes cannot use the pending block yet
    cache.add_block_hashes("b", [h("p", 0), h("p", 1)])
    rows_b = rand_rows(gen, 2)
    cache.capture("b", 8, rows_b)
    assert_rows(cache.read("b", 0, 4), u8(rows[:4]))
    assert_unavailable(cache, "b", 0, 10)

    cache.add_block_hashes("a", [h("p", 1)])
    assert states(cache) == dict(free=5, tail=1, pending=0, duplicate=0, published=2, evictable=0)
    assert cache.stats()["published_blocks"] == 2
    assert_rows(cache.read("b", 0, 10), u8(torch.cat([rows, rows_b])))

    cache.add_block_hashes("c", [h("p", 0), h("p", 1)])
    rows_c = rand_rows(gen, 3)
    cache.capture("c", 8, rows_c)
    assert_rows(cache.read("c", 0, 11), u8(torch.cat([rows, rows_c])))
    assert_rows(cache.read("c", 3, 9), u8(torch.cat([rows, rows_c])[3:9]))
    assert cache.stats()["prefix_hit_rows"] == 16
    assert_rows(cache.read("a", 0, 8), u8(rows))
    assert_accounting(cache)


def test_seed_b_lookahead_2_published_pending_and_one_row_tail(make_cache, gen):
    cache = make_cache(8)
    rows = rand_rows(gen, 9)
    cache.capture("a", 0, rows[:4])
    cache.add_block_hashes("a", [h("p", 0)])
    cache.capture("a", 4, rows[4:9])
    assert states(cache) == dict(free=5, tail=1, pending=1, duplicate=0, published=1, evictable=0)
    assert_rows(cache.read("a", 4, 9), u8(rows[4:9]))
    assert_rows(cache.read("a", 1, 9), u8(rows[1:9]))
    assert_rows(cache.read("a", 8, 9), u8(rows[8:9]))
    assert_rows(cache.read("a", 0, 9), u8(rows))
    assert_unavailable(cache, "a", 1, 10)
    assert_accounting(cache)


def test_seed_c_prefix_hit_from_finished_request_then_pending_and_tail(make_cache, gen):
    cache = make_cache(8)
    rows_a = rand_rows(gen, 8)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("p", 0), h("a", 1)])
    cache.finish("a")
    assert states(cache, "free", "published", "evictable") == dict(free=6, published=2, evictable=2)

    cache.add_block_hashes("b", [h("p", 0)])
    rows_b = rand_rows(gen, 7)  # positions [4, 11): a full pending block and a 3-row tail
    cache.capture("b", 4, rows_b)
    expected = u8(torch.cat([rows_a[:4], rows_b]))
    assert_rows(cache.read("b", 0, 11), expected)
    assert_rows(cache.read("b", 2, 6), expected[2:6])
    assert_rows(cache.read("b", 0, 4), expected[:4])
    assert states(cache) == dict(free=4, tail=1, pending=1, duplicate=0, published=2, evictable=1)
    assert cache.stats()["prefix_hit_rows"] == 4
    assert_unavailable(cache, "b", 0, 12)
    assert_accounting(cache)


def test_seed_d_returned_tensors_survive_reuse_of_every_page(make_cache, gen):
    cache = make_cache(6)
    rows_a, rows_b = rand_rows(gen, 10), rand_rows(gen, 5)
    cache.capture("a", 0, rows_a[:6])
    cache.capture_batch(torch.cat([rows_a[6:], rows_b]), ["a", "b"], [6, 0], [0, 4], [4, 5])
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    single_page = cache.read("a", 4, 8)
    one_row = cache.read("a", 5, 6)
    whole = cache.read("a", 0, 10)
    many = read_intervals(cache, [("a", 1, 9), ("b", 0, 5), ("a", 8, 10), ("b", 2, 2)])
    packed, offsets = cache.read_batch(["b", "a"], np.array([2, 0]), torch.tensor([5, 3]))
    pool_before = cache.pages.clone()
    cache.finish("a")
    cache.finish("b")

    for k in range(3):  # each fills the whole pool; published pages must be evicted
        cache.capture(f"fill{k}", 0, rand_rows(gen, 24))
        cache.add_block_hashes(f"fill{k}", [h(f"fill{k}", i) for i in range(6)])
        cache.finish(f"fill{k}")
    assert cache.stats()["evictions"] >= 8
    changed = (cache.pages != pool_before).flatten(1).any(1)
    assert bool(changed.all()), "every page must have been overwritten"

    a, b = u8(rows_a), u8(rows_b)
    assert_rows(single_page, a[4:8])
    assert_rows(one_row, a[5:6])
    assert_rows(whole, a)
    assert [t.shape[0] for t in many] == [8, 5, 2, 0]
    for got, want in zip(many, [a[1:9], b, a[8:10], b[2:2]]):
        assert_rows(got, want)
    assert offsets.tolist() == [0, 3, 6]
    assert_rows(packed, torch.cat([b[2:5], a[0:3]]))
    assert_unavailable(cache, "a", 0, 1)
    assert_accounting(cache)


# ----------------------------------------------------------------------------- rows


@pytest.mark.parametrize("pool_dtype", [torch.uint8, torch.uint16, torch.int32], ids=str)
@pytest.mark.parametrize("row_dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
def test_rows_of_any_integer_dtype_are_stored_narrowed_to_the_pool_dtype(make_cache, gen, pool_dtype, row_dtype):
    limits = {torch.uint8: 256, torch.uint16: 1 << 16, torch.int32: 1 << 31, torch.int64: 1 << 40}
    high = min(limits[pool_dtype], limits[row_dtype])
    values = rand_rows(gen, 7, high=high)
    values[0, 0, 0] = high - 1  # the largest value both dtypes hold
    cache = make_cache(4, dtype=pool_dtype)
    cache.capture("a", 0, values.to(row_dtype))
    out = cache.read("a", 0, 7)
    assert out.dtype == pool_dtype == cache.pages.dtype
    assert out.device == cache.pages.device and out.device.type == torch.device(TEST_DEVICE).type
    assert out.shape == (7, *ROW)
    assert torch.equal(out.cpu().to(torch.int64), values)
    assert cache.pages.element_size() == torch.empty((), dtype=pool_dtype).element_size()


def test_int32_pool_keeps_negative_and_large_values(make_cache, gen):
    cache = make_cache(4, dtype=torch.int32, row_shape=(5,))
    values = torch.randint(-(2**31), 2**31 - 1, (6, 5), generator=gen, dtype=torch.int64)
    cache.capture("a", 0, values)
    assert torch.equal(cache.read("a", 0, 6).cpu().to(torch.int64), values)


@pytest.mark.parametrize("row_shape", [(3, 1), (2, 2), (61, 8)], ids=str)
def test_odd_row_sizes_round_trip(make_cache, gen, row_shape):
    cache = make_cache(6, row_shape=row_shape)
    rows = rand_rows(gen, 13, row_shape=row_shape)
    cache.capture_batch(rows, ["a", "b"], [0, 0], [0, 5], [5, 8])
    cache.capture("a", 5, rows[:2])
    assert_rows(cache.read("a", 0, 7), u8(torch.cat([rows[:5], rows[:2]])))
    assert_rows(cache.read("b", 3, 8), u8(rows[8:13]))


def test_results_never_alias_the_pool(make_cache, gen):
    cache = make_cache(4)
    rows = rand_rows(gen, 6)
    cache.capture("a", 0, rows)
    pool = cache.pages.untyped_storage()
    pool_range = range(pool.data_ptr(), pool.data_ptr() + pool.nbytes())
    out = cache.read("a", 0, 6)
    packed, offsets = cache.read_batch(["a", "a"], [0, 4], [4, 6])
    pieces = [packed[offsets[i] : offsets[i + 1]] for i in range(2)]
    for result in [out, packed, *pieces]:
        assert result.untyped_storage().data_ptr() != pool.data_ptr()
        assert result.untyped_storage().data_ptr() not in pool_range
        result.add_(1)
    out.zero_()
    assert_rows(cache.read("a", 0, 6), u8(rows))
    assert_rows(cache.read("a", 0, 4), u8(rows[:4]))


def test_empty_reads_and_captures(make_cache, gen):
    cache = make_cache(4)
    rows = rand_rows(gen, 5)
    cache.capture("a", 0, rows)
    before = cache.stats()
    empty = cache.read("a", 3, 3)
    assert empty.shape == (0, *ROW) and empty.dtype == torch.uint8
    packed, offsets = cache.read_batch([], [], [])
    assert packed.shape == (0, *ROW) and offsets.tolist() == [0]
    packed, offsets = cache.read_batch(["a", "a"], [3, 0], [3, 0])
    assert packed.shape == (0, *ROW) and offsets.tolist() == [0, 0, 0]
    cache.capture_batch(rows[:0], [], [], [], [])
    cache.capture("z", 2, rand_rows(gen, 0))  # nothing to capture: not even the alignment matters
    cache.capture_batch(rows, ["z", "a"], [2, 5], [0, 5], [0, 0])  # empty spans: no-ops, even unaligned
    assert cache.stats() == before
    assert_unavailable(cache, "z", 0, 1)


def test_one_device_copy_per_batched_call(make_cache, gen):
    """Many requests in one call, whether their spans take the array path (continuing rows,
    own rows) or the per-request one (first captures, prefix reads), cost one copy: one
    kernel launch, or, for a few rows, one set of torch index copies (``_copy_rows``)."""
    cache = make_cache(8)
    calls = []
    copy, copy_rows = cache._copy, cache._copy_rows
    cache._copy = lambda *args: (calls.append(args[-1]), copy(*args))
    cache._copy_rows = lambda *args: (calls.append(len(args[3] if args[2] is None else args[2])), copy_rows(*args))
    rows = rand_rows(gen, 11)
    cache.capture_batch(rows, ["a", "b", "c"], [0, 0, 4], [0, 5, 9], [5, 4, 2])
    assert calls == [11]
    cache.capture_batch(rows, ["a", "d"], [5, 0], [0, 5], [3, 2])  # a continues, d starts
    assert calls == [11, 5]
    cache.add_block_hashes("a", [h("a", 0)])
    cache.add_block_hashes("e", [h("a", 0)])  # e reads block 0 through the index
    packed, offsets = cache.read_batch(["a", "b", "c", "a", "e", "d"], [1, 0, 4, 0, 1, 0], [8, 4, 6, 2, 3, 2])
    assert calls == [11, 5, 19]
    a = torch.cat([rows[:5], rows[:3]])
    expected = torch.cat([a[1:8], rows[5:9], rows[9:], a[:2], a[1:3], rows[5:7]])
    assert_rows(packed, u8(expected))
    assert offsets.tolist() == [0, 7, 11, 13, 15, 17, 19]


# ----------------------------------------------------------------- batched capture


# A first span ("a", 0, source rows [0, 4)) and a bad second one: (source, second span, error).
BAD_SECOND_SPANS = {
    "wrong_shape": (lambda a, b: (torch.zeros(8, 2, 3, dtype=torch.int64), ("b", 0, 4, 4)), InvalidCaptureError),
    "float_rows": (lambda a, b: (torch.zeros(8, *ROW), ("b", 0, 4, 4)), InvalidCaptureError),
    "gap_in_same_call": (lambda a, b: (torch.cat([a, b]), ("a", 8, 4, 4)), InvalidCaptureError),
    "overlap_in_same_call": (lambda a, b: (torch.cat([a, b]), ("a", 2, 4, 4)), InvalidCaptureError),
    "gap_of_existing_request": (lambda a, b: (torch.cat([a, b]), ("x", 5, 4, 4)), InvalidCaptureError),
    "unaligned_new_request": (lambda a, b: (torch.cat([a, b]), ("b", 1, 4, 4)), InvalidCaptureError),
    "negative_start": (lambda a, b: (torch.cat([a, b]), ("b", -4, 4, 4)), InvalidCaptureError),
    "span_beyond_source": (lambda a, b: (torch.cat([a, b]), ("b", 0, 4, 5)), InvalidCaptureError),
    "bad_request_id": (lambda a, b: (torch.cat([a, b]), (None, 0, 4, 4)), RoutedExpertsCacheError),
    "continuing_id_above_pool_dtype": (
        lambda a, b: (torch.cat([a, _with_value(b, 2, 300)]), ("x", 4, 4, 4)), InvalidCaptureError,
    ),
    "cache_full": (lambda a, b: (torch.cat([a] + [b] * 5), ("b", 0, 4, 20)), CacheFullError),
    "continuing_cache_full": (lambda a, b: (torch.cat([a] + [b] * 5), ("x", 4, 4, 20)), CacheFullError),
}


@pytest.mark.parametrize("case", sorted(BAD_SECOND_SPANS))
def test_capture_batch_validates_every_span_before_writing(make_cache, gen, case):
    cache = make_cache(6)
    rows_x = rand_rows(gen, 4)
    cache.capture("x", 0, rows_x)
    rows_a, rows_b = rand_rows(gen, 4), rand_rows(gen, 4)
    make_bad, error = BAD_SECOND_SPANS[case]
    source, (request_id, start, source_start, count) = make_bad(rows_a, rows_b)
    before, pool = cache.stats(), cache.pages.clone()
    with pytest.raises(error) as excinfo:
        cache.capture_batch(source, ["a", request_id], [0, start], [0, source_start], [4, count])
    assert type(excinfo.value) is error
    assert cache.stats() == before
    assert torch.equal(cache.pages, pool)
    assert_unavailable(cache, "a", 0, 4)
    assert_rows(cache.read("x", 0, 4), u8(rows_x))
    assert_accounting(cache)
    # nothing moved: the same captures, done right, land where they would have
    cache.capture_batch(torch.cat([rows_a, rows_b]), ["a", "x"], [0, 4], [0, 4], [4, 4])
    assert_rows(cache.read("a", 0, 4), u8(rows_a))
    assert_rows(cache.read("x", 0, 8), u8(torch.cat([rows_x, rows_b])))


def test_ids_that_do_not_fit_are_refused_only_inside_captured_spans(make_cache, gen):
    # A source row no span takes (a rejected draft, padding) may hold anything.
    cache = make_cache(4)
    source = rand_rows(gen, 6)
    source[2, 0, 1] = -5
    source[5, 2, 0] = 70000
    cache.capture_batch(source, ["a", "a"], [0, 2], [0, 3], [2, 2])
    assert_rows(cache.read("a", 0, 4), u8(torch.cat([source[:2], source[3:5]])))
    with pytest.raises(InvalidCaptureError, match="position 4 .*70000"):
        cache.capture_batch(source, ["a"], [4], [5], [1])
    assert_accounting(cache)


def test_capture_batch_spans_of_one_source_with_gaps(make_cache, gen):
    cache = make_cache(8)
    source = rand_rows(gen, 13)
    spans = [
        ("a", 0, 0, 3),
        ("b", 0, 3, 2),
        ("a", 3, 6, 2),  # source row 5 is a rejected speculative row
        ("c", 4, 8, 4),
        ("d", 1, 12, 0),  # empty span: ignored, however unaligned
        ("b", 2, 12, 1),
    ]
    ids, starts, source_starts, counts = (list(column) for column in zip(*spans))
    cache.capture_batch(source, ids, starts, source_starts, counts)
    s = u8(source)
    assert_rows(cache.read("a", 0, 5), torch.cat([s[0:3], s[6:8]]))
    assert_rows(cache.read("b", 0, 3), torch.cat([s[3:5], s[12:13]]))
    assert_rows(cache.read("c", 4, 8), s[8:12])
    assert_unavailable(cache, "d", 0, 1)
    assert cache.stats()["captured_rows"] == 12
    assert states(cache, "free", "tail", "pending") == dict(free=4, tail=2, pending=2)
    # a later step continues from the cursors
    source2 = rand_rows(gen, 4)
    cache.capture_batch(source2, ["a", "c"], [5, 8], [1, 0], [3, 1])
    assert_rows(cache.read("a", 0, 8), torch.cat([s[0:3], s[6:8], u8(source2[1:4])]))
    assert_rows(cache.read("c", 4, 9), torch.cat([s[8:12], u8(source2[0:1])]))
    assert_accounting(cache)


# ------------------------------------------------------------------------ errors


def _populated(make_cache, gen):
    """a: [0, 10) with blocks 0, 1 published; b: 3-row tail; p: first capture at 4 with an
    unpublished hash for block 0; q: first capture at 4 without hashes. 2 pages free."""
    cache = make_cache(8)
    rows = {"a": rand_rows(gen, 10), "b": rand_rows(gen, 3), "p": rand_rows(gen, 2), "q": rand_rows(gen, 2)}
    cache.capture("a", 0, rows["a"][:8])
    cache.capture("a", 8, rows["a"][8:])
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    cache.capture("b", 0, rows["b"])
    cache.add_block_hashes("p", [b"never-published"])
    cache.capture_batch(torch.cat([rows["p"], rows["q"]]), ["p", "q"], [4, 4], [0, 2], [2, 2])
    intervals = [("a", 0, 10), ("b", 0, 3), ("p", 4, 6), ("q", 4, 6)]
    expected = [u8(rows["a"]), u8(rows["b"]), u8(rows["p"]), u8(rows["q"])]
    return cache, intervals, expected


def _r(n):
    return torch.arange(n * 6, dtype=torch.int64).view(n, *ROW) % 251


def _with_value(rows, row, value, dtype=torch.int64):
    """``rows`` with one id set to ``value`` (outside a uint8 pool's range) in row ``row``."""
    rows = rows.clone()
    rows[row, 1, 0] = value
    return rows.to(dtype)


ERROR_CASES = {
    "read_unknown_request": (lambda c: c.read("zz", 0, 4), RangeUnavailableError, ["'zz'", "[0, 4)", "unknown"]),
    "read_unknown_int_request": (lambda c: c.read(17, 2, 3), RangeUnavailableError, ["17", "[2, 3)", "unknown"]),
    "read_beyond_cursor": (lambda c: c.read("a", 4, 11), RangeUnavailableError, ["'a'", "[4, 11)", "available: [0, 10)"]),
    "read_batch_one_bad_interval": (
        lambda c: c.read_batch(["a", "b"], [0, 1], [4, 4]),
        RangeUnavailableError,
        ["'b'", "[1, 4)", "available: [0, 3)"],
    ),
    "read_prefix_hash_unknown_to_index": (
        lambda c: c.read("p", 0, 6),
        RangeUnavailableError,
        ["'p'", "[0, 6)", "available: [4, 6)", "1 block hashes"],
    ),
    "read_prefix_without_hash": (
        lambda c: c.read("q", 3, 5),
        RangeUnavailableError,
        ["'q'", "[3, 5)", "available: [4, 6)", "0 block hashes"],
    ),
    "read_start_after_end": (lambda c: c.read("a", 5, 3), RangeUnavailableError, ["'a'", "[5, 3)"]),
    "read_negative_start": (lambda c: c.read("a", -1, 3), RangeUnavailableError, ["'a'", "[-1, 3)"]),
    "read_float_end": (lambda c: c.read("a", 0, 2.0), RoutedExpertsCacheError, ["'a'", "end", "2.0"]),
    # read_batch takes numpy integers; read, like every call of one request, takes Python ints
    "read_numpy_start": (lambda c: c.read("a", np.int64(0), 4), RoutedExpertsCacheError, ["'a'", "start", "int"]),
    "read_end_past_int64": (
        lambda c: c.read("a", 0, 2**64), RangeUnavailableError, ["'a'", f"[0, {2**64})", "max_position"],
    ),
    "read_batch_ends_shorter_than_ids": (
        lambda c: c.read_batch(["a", "b"], [0, 0], [4]), RangeUnavailableError, ["ends", "2 integers"],
    ),
    "capture_gap": (
        lambda c: c.capture("a", 11, _r(1)),
        InvalidCaptureError,
        ["'a'", "[11, 12)", "gap", "[0, 10)", "next position 10"],
    ),
    "capture_overlap": (lambda c: c.capture("a", 9, _r(2)), InvalidCaptureError, ["'a'", "[9, 11)", "overlap"]),
    "capture_before_first_block": (
        lambda c: c.capture("q", 0, _r(4)),
        InvalidCaptureError,
        ["'q'", "[0, 4)", "overlap", "[4, 6)"],
    ),
    "capture_unaligned_first": (
        lambda c: c.capture("n", 2, _r(1)),
        InvalidCaptureError,
        ["'n'", "page boundary", "page size 4", "position 2"],
    ),
    "capture_negative_start": (lambda c: c.capture("n", -4, _r(4)), InvalidCaptureError, ["'n'", "start", "-4"]),
    "capture_numpy_start": (
        lambda c: c.capture("a", np.int64(10), _r(1)), RoutedExpertsCacheError, ["'a'", "start must be an int"],
    ),
    "capture_bool_start": (lambda c: c.capture("a", True, _r(1)), RoutedExpertsCacheError, ["'a'", "True"]),
    "capture_start_past_int64": (
        lambda c: c.capture("a", 2**63, _r(1)), InvalidCaptureError, ["'a'", f"[{2**63}, {2**63 + 1})", "max_position"],
    ),
    "capture_wrong_row_shape": (
        lambda c: c.capture("a", 10, torch.zeros(2, 2, 3, dtype=torch.int64)),
        InvalidCaptureError,
        ["'a'", "[n, 3, 2]", "[2, 2, 3]"],
    ),
    "capture_missing_row_dim": (
        lambda c: c.capture("a", 10, torch.zeros(3, 2, dtype=torch.int64)),
        InvalidCaptureError,
        ["'a'", "[n, 3, 2]", "[3, 2]"],
    ),
    "capture_float_rows": (
        lambda c: c.capture("a", 10, torch.zeros(2, *ROW)),
        InvalidCaptureError,
        ["'a'", "integer", "float32"],
    ),
    "capture_bool_rows": (
        lambda c: c.capture("a", 10, torch.zeros(2, *ROW, dtype=torch.bool)),
        InvalidCaptureError,
        ["'a'", "bool"],
    ),
    "capture_not_a_tensor": (lambda c: c.capture("a", 10, [[0] * 6]), InvalidCaptureError, ["'a'", "list"]),
    "capture_batch_span_beyond_source": (
        lambda c: c.capture_batch(_r(3), ["a"], [10], [2], [2]),
        InvalidCaptureError,
        ["'a'", "[2, 4)", "3 source rows"],
    ),
    "capture_id_above_pool_dtype": (
        lambda c: c.capture("a", 10, _with_value(_r(3), 1, 256)),
        InvalidCaptureError,
        ["'a'", "position 11", "[10, 13)", "torch.uint8", "[0, 255]", "256"],
    ),
    "capture_negative_id": (
        lambda c: c.capture("a", 10, _with_value(_r(2), 0, -1, torch.int8)),
        InvalidCaptureError,
        ["'a'", "position 10", "-1"],
    ),
    "capture_uint16_id_above_pool_dtype": (
        lambda c: c.capture("a", 10, _with_value(_r(2), 1, 300, torch.uint16)),
        InvalidCaptureError,
        ["'a'", "position 11", "300"],
    ),
    "capture_batch_id_above_pool_dtype_in_a_continuing_span": (
        lambda c: c.capture_batch(
            torch.cat([_r(4), _with_value(_r(2), 0, 1000)]).to(torch.int32), ["n", "a"], [0, 10], [0, 4], [4, 2]
        ),
        InvalidCaptureError,
        ["'a'", "position 10", "1000"],
    ),
    "capture_batch_id_above_pool_dtype_inside_a_span": (
        lambda c: c.capture_batch(_with_value(_r(6), 4, 999), ["n", "a"], [0, 10], [0, 3], [2, 2]),
        InvalidCaptureError,
        ["'a'", "position 11", "[10, 12)", "999"],
    ),
    "capture_bad_request_id": (lambda c: c.capture(3.5, 0, _r(4)), RoutedExpertsCacheError, ["3.5"]),
    "capture_cache_full": (
        lambda c: c.capture("n", 0, _r(12)),
        CacheFullError,
        ["'n'", "[0, 12)", "3 new pages", "2 free", "0 evictable"],
    ),
    "capture_continuing_cache_full": (
        lambda c: c.capture("a", 10, _r(12)),
        CacheFullError,
        ["'a' [10, 22)", "3 new pages", "2 free", "0 evictable"],
    ),
    "capture_batch_cache_full_across_spans": (
        lambda c: c.capture_batch(torch.cat([_r(4), _r(2), _r(5)]), ["n", "a", "m"], [0, 10, 0], [0, 4, 6], [4, 2, 5]),
        CacheFullError,
        ["'n' [0, 4)", "'m' [0, 5)", "'a' [10, 12)", "3 new pages"],
    ),
    "hash_not_bytes": (lambda c: c.add_block_hashes("a", ["a/2"]), InvalidCaptureError, ["'a'", "'a/2'"]),
    "hash_bytearray": (
        lambda c: c.add_block_hashes("a", [bytearray(b"a/2")]),
        InvalidCaptureError,
        ["'a'", "bytearray"],
    ),
    "hash_empty": (lambda c: c.add_block_hashes("b", [b""]), InvalidCaptureError, ["'b'", "b''"]),
    "hashes_as_one_bytes_value": (lambda c: c.add_block_hashes("a", b"a/2"), InvalidCaptureError, ["'a'", "sequence"]),
    "hash_bad_on_new_request": (
        lambda c: c.add_block_hashes("new", [b"fine", 7]),
        InvalidCaptureError,
        ["'new'", "7"],
    ),
    "hashes_batch_bad_hash_in_a_later_list": (  # nothing is added for 'new' either
        lambda c: c.add_block_hashes_batch(["new", "a"], [[b"new/0"], [h("a", 2), 7]]),
        InvalidCaptureError,
        ["'a'", "7"],
    ),
    "hashes_batch_lengths_differ": (
        lambda c: c.add_block_hashes_batch(["new", "a"], [[b"new/0"]]),
        InvalidCaptureError,
        ["2 request ids", "1 block hash lists"],
    ),
    "hashes_batch_bad_id": (
        lambda c: c.add_block_hashes_batch(["new", 1.5], [[b"new/0"], []]), RoutedExpertsCacheError, ["1.5"],
    ),
    "hashes_batch_one_bytes_value": (
        lambda c: c.add_block_hashes_batch(["new"], [b"new/0"]), InvalidCaptureError, ["'new'", "sequence"],
    ),
    "retain_not_bytes": (lambda c: c.retain([b"ok", "no"]), InvalidCaptureError, ["'no'"]),
    "release_not_pinned": (lambda c: c.release([b"never"]), RoutedExpertsCacheError, [b"never".hex()]),
    "release_more_than_pinned": (
        lambda c: c.release([h("a", 1), h("a", 1)]),
        RoutedExpertsCacheError,
        [h("a", 1).hex()],
    ),
    "release_not_bytes": (lambda c: c.release(["a/0"]), InvalidCaptureError, ["'a/0'"]),
}


def test_a_refused_read_lists_what_exists_as_merged_ranges(make_cache, gen):
    """The refusal names every range the request can read: consecutive published prefix blocks
    as one range, a missing block as a gap, and the last published prefix block joined with the
    request's own rows."""
    cache = make_cache(16)
    cache.capture("a", 0, rand_rows(gen, 16))
    cache.add_block_hashes("a", [h("a", b) for b in range(4)])
    cache.add_block_hashes("r", [h("a", 0), h("a", 1), b"never-published", h("a", 3)])
    cache.capture("r", 16, rand_rows(gen, 2))
    with pytest.raises(RangeUnavailableError) as excinfo:
        cache.read("r", 0, 18)
    assert "request 'r': range [0, 18) is unavailable; available: [0, 8) [12, 18) (4 block hashes known" in str(excinfo.value)


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_refused_call_names_the_problem_and_changes_nothing(make_cache, gen, case):
    cache, intervals, expected = _populated(make_cache, gen)
    call, error, needles = ERROR_CASES[case]
    for got, want in zip(read_intervals(cache, intervals), expected):
        assert_rows(got, want)
    before_stats, before_states, before_pool = cache.stats(), cache.page_states(), cache.pages.clone()
    with pytest.raises(error) as excinfo:
        call(cache)
    assert type(excinfo.value) is error and isinstance(excinfo.value, ValueError)
    message = str(excinfo.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert cache.stats() == before_stats
    assert cache.page_states() == before_states
    assert torch.equal(cache.pages, before_pool)
    for got, want in zip(read_intervals(cache, intervals), expected):
        assert_rows(got, want)
    assert_accounting(cache)
    for request_id in ("n", "m", "new", "zz", 17):
        assert_unavailable(cache, request_id, 0, 0)
    # cursors did not move: the next rows of 'a' go exactly at position 10
    rows = rand_rows(gen, 2)
    cache.capture("a", 10, rows)
    assert_rows(cache.read("a", 0, 12), torch.cat([expected[0], u8(rows)]))


def test_constructor_rejects_bad_arguments(backend):
    for kwargs in (
        dict(num_pages=0),
        dict(page_size=-1),
        dict(row_shape=()),
        dict(row_shape=(3, 0)),
        dict(dtype=torch.float32),
        dict(dtype=torch.int64),
        dict(backend="cuda"),
    ):
        args = dict(num_pages=4, page_size=4, row_shape=ROW, backend=backend) | kwargs
        with pytest.raises(RoutedExpertsCacheError):
            RoutedExpertsCache(**args)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RoutedExpertsCacheError, match="TRITON_INTERPRET"):
        RoutedExpertsCache(4, 4, ROW, backend="triton")
    assert RoutedExpertsCache(4, 4, ROW).backend == "torch"  # auto on CPU


# ------------------------------------------------------------------- publication


def test_duplicate_publication_keeps_first_writer_and_frees_copy_on_finish(make_cache, gen):
    cache = make_cache(8)
    rows_a, rows_b = rand_rows(gen, 4), rand_rows(gen, 4)
    assert not torch.equal(rows_a, rows_b)
    cache.capture("a", 0, rows_a)
    cache.capture("b", 0, rows_b)
    cache.add_block_hashes("a", [h("p", 0)])
    cache.add_block_hashes("b", [h("p", 0)])
    assert states(cache) == dict(free=6, tail=0, pending=0, duplicate=1, published=1, evictable=0)
    assert cache.stats()["published_blocks"] == 1
    assert_rows(cache.read("a", 0, 4), u8(rows_a))
    assert_rows(cache.read("b", 0, 4), u8(rows_b))  # its OWN rows, not the index's

    cache.add_block_hashes("c", [h("p", 0)])
    rows_c = rand_rows(gen, 1)
    cache.capture("c", 4, rows_c)
    assert_rows(cache.read("c", 0, 5), u8(torch.cat([rows_a, rows_c])))  # the index: first writer

    cache.finish("a")  # the first writer's page stays: b and c pin its hash
    assert states(cache) == dict(free=5, tail=1, pending=0, duplicate=1, published=1, evictable=0)
    assert_rows(cache.read("b", 0, 4), u8(rows_b))
    cache.finish("b")  # b's duplicate page is freed
    assert states(cache) == dict(free=6, tail=1, pending=0, duplicate=0, published=1, evictable=0)
    assert_rows(cache.read("c", 0, 5), u8(torch.cat([rows_a, rows_c])))
    cache.finish("c")
    assert states(cache) == dict(free=7, tail=0, pending=0, duplicate=0, published=1, evictable=1)
    assert_accounting(cache)


@pytest.mark.parametrize("call", ["capture_batch", "capture_step", "capture_step_arrays"])
@pytest.mark.parametrize("listed_first", ["a", "b"])
def test_a_block_two_requests_complete_in_one_call_is_published_by_the_first_listed(
    make_cache, gen, monkeypatch, call, listed_first
):
    """"a" continues its rows and "b" captures for the first time (planned span by span, apart
    from the continuing spans), and both complete block 0 in one call: the request the call
    lists first publishes it, the other keeps a duplicate, whichever kind of span it is."""
    if call == "capture_step_arrays":
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)  # the array path of capture_step
    cache = make_cache(8)
    rows = {"a": rand_rows(gen, 4), "b": rand_rows(gen, 4)}
    assert not torch.equal(rows["a"], rows["b"])
    cache.capture("a", 0, rows["a"][:2])
    cache.add_block_hashes("a", [h("p", 0)])  # its own block: published once full
    cache.add_block_hashes("b", [h("p", 0)])  # pinned until its first capture computes the block
    spans = {"a": (2, rows["a"][2:]), "b": (0, rows["b"])}  # start, rows
    ids = [listed_first, "b" if listed_first == "a" else "a"]
    source = torch.cat([spans[request_id][1] for request_id in ids])
    starts = np.array([spans[request_id][0] for request_id in ids], dtype=np.int64)
    counts = np.array([len(spans[request_id][1]) for request_id in ids], dtype=np.int64)
    source_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    if call == "capture_batch":
        cache.capture_batch(source, ids, starts, source_starts, counts)
    else:
        cache.capture_step(source, ids, cache.slots(ids), starts, source_starts, counts)
    assert states(cache, "duplicate", "published", "evictable") == dict(duplicate=1, published=1, evictable=0)
    cache.add_block_hashes("c", [h("p", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows[listed_first]))  # the index: the first listed's page
    for request_id in ("a", "b"):
        assert_rows(cache.read(request_id, 0, 4), u8(rows[request_id]))  # each reads its own rows
    cache.finish(ids[1])  # the duplicate is freed, the published page stays pinned by the others
    assert states(cache, "duplicate", "published", "evictable") == dict(duplicate=0, published=1, evictable=0)
    assert_accounting(cache)


def test_a_request_listed_twice_publishes_as_listed_at_its_first_span(make_cache, gen):
    """"a" is listed first and third, "b" second, and both complete block 0 in the call: "a"
    publishes it, as listed first (its first position counts, not its last)."""
    cache = make_cache(8)
    rows = {"a": rand_rows(gen, 4), "b": rand_rows(gen, 4)}
    cache.capture("a", 0, rows["a"][:1])
    cache.add_block_hashes("a", [h("p", 0)])
    cache.add_block_hashes("b", [h("p", 0)])
    source = torch.cat([rows["a"][1:2], rows["b"], rows["a"][2:]])
    cache.capture_batch(source, ["a", "b", "a"], [1, 0, 2], [0, 1, 5], [1, 4, 2])
    assert states(cache, "duplicate", "published") == dict(duplicate=1, published=1)
    cache.add_block_hashes("c", [h("p", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows["a"]))  # the index: "a"'s page
    for request_id in ("a", "b"):
        assert_rows(cache.read(request_id, 0, 4), u8(rows[request_id]))
    assert_accounting(cache)


@pytest.mark.parametrize("call", ["capture_step", "capture_step_arrays"])
@pytest.mark.parametrize("a_continues", [True, False], ids=["continuing-and-first", "both-first"])
@pytest.mark.parametrize("publisher", ["a", "b"])
def test_a_block_two_requests_complete_in_one_step_is_published_by_the_first_in_the_engines_order(
    make_cache, gen, monkeypatch, call, a_continues, publisher
):
    """A step's ``order`` (vLLM's scheduling order, which its input batch need not follow)
    decides which of two requests completing the same block publishes it, whatever the call's
    order: vLLM serves later hits from the KV block of the request it scheduled first, and
    where batch position changes the numerics (bf16) its rows are the ones that match that KV.
    Each request keeps reading its own rows, the routing of its own forward."""
    if call == "capture_step_arrays":
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    cache = make_cache(8)
    rows = {"a": rand_rows(gen, 4), "b": rand_rows(gen, 4)}
    if a_continues:
        cache.capture("a", 0, rows["a"][:2])
    cache.add_block_hashes("a", [h("p", 0)])
    cache.add_block_hashes("b", [h("p", 0)])
    spans = {"a": (2, rows["a"][2:]) if a_continues else (0, rows["a"]), "b": (0, rows["b"])}
    ids = ["b", "a"]  # the call (the input batch) lists b first
    source = torch.cat([spans[request_id][1] for request_id in ids])
    starts = np.array([spans[request_id][0] for request_id in ids], dtype=np.int64)
    counts = np.array([len(spans[request_id][1]) for request_id in ids], dtype=np.int64)
    source_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    order = {publisher: 0, "b" if publisher == "a" else "a": 0}  # the metadata's dict: its keys in order
    cache.capture_step(source, ids, cache.slots(ids), starts, source_starts, counts, order)
    assert states(cache, "duplicate", "published") == dict(duplicate=1, published=1)
    cache.add_block_hashes("c", [h("p", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows[publisher]))
    for request_id in ("a", "b"):
        assert_rows(cache.read(request_id, 0, 4), u8(rows[request_id]))
    assert_accounting(cache)


def test_recomputed_block_replaces_an_unpinned_published_page(make_cache, gen):
    cache = make_cache(4)
    rows_a, rows_b = rand_rows(gen, 4), rand_rows(gen, 4)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("p", 0)])
    cache.finish("a")
    assert states(cache, "published", "evictable", "free") == dict(published=1, evictable=1, free=3)
    cache.add_block_hashes("b", [h("p", 0)])  # before its first capture, any hash may be a prefix hit
    assert states(cache, "published", "evictable") == dict(published=1, evictable=0)
    cache.capture("b", 0, rows_b)  # b recomputes block 0: its copy replaces the unpinned one
    assert states(cache, "duplicate", "published", "evictable", "free") == dict(
        duplicate=0, published=1, evictable=0, free=3
    )
    assert_rows(cache.read("b", 0, 4), u8(rows_b))
    cache.add_block_hashes("c", [h("p", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows_b))
    cache.finish("b")
    cache.finish("c")
    assert states(cache, "duplicate", "published", "evictable", "free") == dict(
        duplicate=0, published=1, evictable=1, free=3
    )
    assert_accounting(cache)


def test_recomputed_block_is_a_duplicate_while_the_published_page_is_pinned(make_cache, gen):
    cache = make_cache(4)
    rows_a, rows_b = rand_rows(gen, 4), rand_rows(gen, 4)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("p", 0)])
    cache.finish("a")
    cache.retain([h("p", 0)])
    cache.add_block_hashes("b", [h("p", 0)])
    cache.capture("b", 0, rows_b)
    assert states(cache, "duplicate", "published", "evictable", "free") == dict(
        duplicate=1, published=1, evictable=0, free=2
    )
    assert cache.stats()["pinned_hashes"] == 1  # the retain only: b does not pin a page it never reads
    assert_rows(cache.read("b", 0, 4), u8(rows_b))
    cache.add_block_hashes("c", [h("p", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows_a))
    cache.finish("b")  # b's duplicate page is freed
    assert states(cache, "duplicate", "published", "evictable", "free") == dict(
        duplicate=0, published=1, evictable=0, free=3
    )
    assert_accounting(cache)


def test_hashes_of_one_batch_apply_in_request_order(make_cache, gen):
    """A publish and a later request's pin of the same hash in one batch act as two calls in
    that order: a's recomputed copy replaces the unpinned stale page before b pins the hash, so
    b reads a's rows (pinned first, the stale page would stay and a's copy be a duplicate)."""
    results = []
    for batched in (False, True):
        cache = make_cache(4)
        rows_x, rows_a = rand_rows(gen, 4), rand_rows(gen, 4)
        cache.capture("x", 0, rows_x)
        cache.add_block_hashes("x", [h("p", 0)])
        cache.finish("x")  # published, unpinned
        cache.capture("a", 0, rows_a)  # a recomputes block 0; its hash comes next
        if batched:
            cache.add_block_hashes_batch(["a", "b"], [[h("p", 0)], [h("p", 0)]])
        else:
            cache.add_block_hashes("a", [h("p", 0)])
            cache.add_block_hashes("b", [h("p", 0)])
        assert_rows(cache.read("b", 0, 4), u8(rows_a))
        assert_accounting(cache)
        results.append(states(cache))
    assert results[0] == results[1] == dict(free=3, tail=0, pending=0, duplicate=0, published=1, evictable=0)


def test_first_capture_unpins_the_blocks_it_recomputes_before_it_allocates(make_cache, gen):
    """The pins a request took on hashes it then recomputes itself return those pages to
    eviction in the same call: a full pool of stale pages does not refuse the capture."""
    cache = make_cache(2)
    rows_a, rows_b = rand_rows(gen, 8), rand_rows(gen, 8)
    hashes = [h("p", 0), h("p", 1)]
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", hashes)
    cache.finish("a")
    cache.add_block_hashes("b", hashes)  # pins both published pages: nothing is evictable now
    assert states(cache, "published", "evictable", "free") == dict(published=2, evictable=0, free=0)
    cache.capture("b", 0, rows_b)  # starts at block 0: both blocks are b's own
    assert states(cache, "published", "evictable", "free", "duplicate") == dict(
        published=2, evictable=0, free=0, duplicate=0
    )
    assert_rows(cache.read("b", 0, 8), u8(rows_b))
    assert cache.stats()["evictions"] == 2
    assert_accounting(cache)


def test_hashes_before_capture_publish_as_blocks_fill(make_cache, gen):
    cache = make_cache(8)
    rows = rand_rows(gen, 12)
    cache.add_block_hashes("a", [h("a", i) for i in range(3)])
    assert states(cache) == dict(free=8, tail=0, pending=0, duplicate=0, published=0, evictable=0)
    assert cache.stats()["requests"] == 1
    cache.capture("a", 0, rows[:6])
    assert states(cache, "published", "tail", "pending") == dict(published=1, tail=1, pending=0)
    cache.capture("a", 6, rows[6:])
    assert states(cache, "published", "tail", "pending") == dict(published=3, tail=0, pending=0)

    # a request that has only hashes (nothing captured yet) reads its prefix through the index
    cache.add_block_hashes("b", [h("a", 0), h("a", 1), h("a", 2)])
    assert_rows(cache.read("b", 0, 12), u8(rows))
    assert_rows(cache.read("b", 5, 7), u8(rows[5:7]))
    assert_unavailable(cache, "b", 0, 13)
    cache.add_block_hashes("z", [b"never-published"])
    assert_unavailable(cache, "z", 0, 4)


def test_first_capture_past_zero_reads_earlier_blocks_through_the_index(make_cache, gen):
    cache = make_cache(8)
    rows_a = rand_rows(gen, 12)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1), h("a", 2)])

    cache.add_block_hashes("b", [h("a", 0), h("a", 1)])
    rows_b = rand_rows(gen, 4)
    cache.capture("b", 8, rows_b)
    assert_rows(cache.read("b", 0, 12), u8(torch.cat([rows_a[:8], rows_b])))
    assert_rows(cache.read("b", 1, 7), u8(rows_a[1:7]))  # prefix blocks only

    # hashes that arrive after the first capture make the prefix readable then
    rows_c = rand_rows(gen, 5)
    cache.capture("c", 8, rows_c)
    assert_unavailable(cache, "c", 0, 12)
    assert_rows(cache.read("c", 8, 13), u8(rows_c))
    published = cache.stats()["published"]
    cache.add_block_hashes("c", [h("a", 0), h("a", 1), h("c", 2)])
    assert_rows(cache.read("c", 0, 13), u8(torch.cat([rows_a[:8], rows_c])))
    assert cache.stats()["published"] == published + 1  # c's own block 2
    assert_accounting(cache)


def test_first_capture_inside_a_published_block_starts_from_its_rows(make_cache, gen):
    """A whole-prompt hit: vLLM loads every block and recomputes the last prompt token, so the
    first capture starts inside the last block. The request's own page of that block starts as a
    copy of the published page; the recomputed row replaces its last row."""
    cache = make_cache(8)
    rows_a = rand_rows(gen, 12)
    hashes = [h("a", 0), h("a", 1), h("a", 2)]
    cache.add_block_hashes("a", hashes)
    cache.capture("a", 0, rows_a)
    cache.finish("a")
    cache.add_block_hashes("b", hashes)
    recomputed = rand_rows(gen, 3)
    cache.capture_batch(recomputed, ["b"], [11], [0], [1])
    assert_rows(cache.read("b", 0, 12), u8(torch.cat([rows_a[:11], recomputed[:1]])))
    assert cache.stats()["prefix_hit_rows"] == 11
    cache.capture("b", 12, recomputed[1:])
    assert_rows(cache.read("b", 6, 14), u8(torch.cat([rows_a[6:11], recomputed])))
    cache.finish("b")
    # The published block was replaced by b's copy, which holds b's recomputed last row.
    cache.add_block_hashes("c", hashes)
    cache.capture("c", 12, recomputed[1:2])
    assert_rows(cache.read("c", 0, 13), u8(torch.cat([rows_a[:11], recomputed[:2]])))
    assert_accounting(cache)


def test_first_capture_inside_a_block_without_published_rows_is_refused_and_changes_nothing(make_cache, gen):
    cache = make_cache(8)
    rows = rand_rows(gen, 8)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    cache.capture("a", 0, rows)
    cache.finish("a")
    for hashes, block in (([h("a", 0)], 1), ([h("a", 0), h("x", 1)], 1)):  # hash not given / not published
        cache.add_block_hashes("b", hashes)
        before = cache.stats()
        with pytest.raises(InvalidCaptureError, match=rf"'b'.*position 7.*inside block {block}.*not in the cache"):
            cache.capture("b", 7, rows[7:])
        assert cache.stats() == before
        cache.finish("b")
    assert_accounting(cache)


def test_a_seeded_block_is_copied_before_its_published_page_is_reused(make_cache, gen):
    """The first capture unpins the block it seeds from, so the same call may take that published
    page for a later block: the seed is read before the capture writes."""
    cache = make_cache(4)
    rows_a = rand_rows(gen, 12)
    hashes = [h("a", 0), h("a", 1), h("a", 2)]
    cache.add_block_hashes("a", hashes)
    cache.capture("a", 0, rows_a)
    cache.finish("a")
    cache.add_block_hashes("b", hashes)
    recomputed = rand_rows(gen, 5)
    cache.capture("b", 11, recomputed)  # block 2 takes the free page, block 3 the evicted published one
    assert cache.stats()["evictions"] == 1
    assert_rows(cache.read("b", 0, 16), u8(torch.cat([rows_a[:11], recomputed])))
    assert_accounting(cache)


# --------------------------------------------------------------------- eviction


def test_finish_releases_in_reverse_block_order_so_the_last_block_is_evicted_first(make_cache, gen):
    cache = make_cache(5)
    rows_a = rand_rows(gen, 12)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", i) for i in range(3)])
    cache.finish("a")
    assert states(cache, "free", "published", "evictable") == dict(free=2, published=3, evictable=3)

    cache.capture("x", 0, rand_rows(gen, 12))  # 3 pages: 2 free + exactly one eviction
    assert cache.stats()["evictions"] == 1
    assert states(cache, "free", "published", "evictable") == dict(free=0, published=2, evictable=2)
    cache.finish("x")

    cache.add_block_hashes("n", [h("a", i) for i in range(3)])
    cache.capture("n", 12, rand_rows(gen, 1))
    assert_rows(cache.read("n", 0, 8), u8(rows_a[:8]))
    assert_unavailable(cache, "n", 0, 12)
    assert_unavailable(cache, "n", 8, 9)
    assert_accounting(cache)


def test_eviction_is_lru_over_requests_and_repins_refresh(make_cache, gen):
    cache = make_cache(4)
    rows = {tag: rand_rows(gen, 4) for tag in "ab"}
    for tag in "ab":
        cache.capture(tag, 0, rows[tag])
        cache.add_block_hashes(tag, [h(tag, 0)])
        cache.finish(tag)
    cache.add_block_hashes("c", [h("a", 0)])  # a prefix hit on a's block: a becomes recent
    cache.finish("c")
    assert states(cache, "free", "evictable") == dict(free=2, evictable=2)

    cache.capture("x", 0, rand_rows(gen, 12))  # one eviction: b's block, the least recent
    assert cache.stats()["evictions"] == 1
    cache.finish("x")
    cache.add_block_hashes("ya", [h("a", 0)])
    cache.add_block_hashes("yb", [h("b", 0)])
    assert_rows(cache.read("ya", 0, 4), u8(rows["a"]))
    assert_unavailable(cache, "yb", 0, 4)


def test_pinned_pages_are_never_evicted_and_cache_full_changes_nothing(make_cache, gen):
    cache = make_cache(4)
    rows_a, rows_b, rows_g = rand_rows(gen, 8), rand_rows(gen, 3), rand_rows(gen, 4)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])  # published, pinned by a live request
    cache.add_block_hashes("b", [h("a", 0)])
    cache.capture("b", 4, rows_b)  # b pins a's block 0 and owns a tail
    cache.capture("g", 0, rows_g)
    cache.add_block_hashes("g", [h("g", 0)])
    cache.finish("g")
    assert states(cache, "free", "evictable") == dict(free=0, evictable=1)
    cache.retain([h("g", 0)])
    assert states(cache, "free", "evictable") == dict(free=0, evictable=0)

    before_stats, before_pool = cache.stats(), cache.pages.clone()
    with pytest.raises(CacheFullError, match=r"'n' \[0, 1\).*0 free and 0 evictable"):
        cache.capture("n", 0, rand_rows(gen, 1))
    assert cache.stats() == before_stats and torch.equal(cache.pages, before_pool)
    assert_unavailable(cache, "n", 0, 0)

    cache.finish("a")  # a's block 1 becomes evictable; block 0 stays pinned by b
    assert states(cache, "free", "evictable", "published") == dict(free=0, evictable=1, published=3)
    cache.capture("n", 0, rand_rows(gen, 1))  # evicts a's block 1, nothing else
    with pytest.raises(CacheFullError):
        cache.capture("m", 0, rand_rows(gen, 1))
    cache.release([h("g", 0)])
    rows_m = rand_rows(gen, 1)
    cache.capture("m", 0, rows_m)  # now g's block can go
    assert cache.stats()["evictions"] == 2
    assert_rows(cache.read("b", 0, 7), u8(torch.cat([rows_a[:4], rows_b])))
    assert_rows(cache.read("m", 0, 1), u8(rows_m))
    cache.add_block_hashes("probe", [h("a", 0), h("a", 1)])
    assert_rows(cache.read("probe", 0, 4), u8(rows_a[:4]))
    assert_unavailable(cache, "probe", 0, 8)
    assert_accounting(cache)


def test_retained_future_hash_pins_the_page_once_published(make_cache, gen):
    cache = make_cache(2)
    cache.retain([h("f", 0)])
    rows_f = rand_rows(gen, 4)
    cache.capture("f", 0, rows_f)
    cache.add_block_hashes("f", [h("f", 0)])
    cache.finish("f")
    assert states(cache, "published", "evictable", "free") == dict(published=1, evictable=0, free=1)
    with pytest.raises(CacheFullError):
        cache.capture("x", 0, rand_rows(gen, 8))
    cache.release([h("f", 0)])
    assert states(cache, "evictable") == dict(evictable=1)
    cache.add_block_hashes("y", [h("f", 0)])
    assert_rows(cache.read("y", 0, 4), u8(rows_f))


def test_release_only_drops_retained_pins_never_a_requests_pin(make_cache, gen):
    cache = make_cache(2)
    rows_a = rand_rows(gen, 4)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", 0)])
    before = cache.stats()
    with pytest.raises(RoutedExpertsCacheError, match="not retained"):
        cache.release([h("a", 0)])
    assert cache.stats() == before
    with pytest.raises(CacheFullError):  # the page is still pinned by request "a"
        cache.capture("x", 0, rand_rows(gen, 8))
    assert_rows(cache.read("a", 0, 4), u8(rows_a))
    assert_accounting(cache)


def test_a_first_capture_in_two_spans_of_one_call_counts_its_released_pins_once(make_cache, gen):
    """The look-ahead that picks the copy's target pages counts the pins a first capture stops
    holding (its own blocks' hashes) once per request, however many spans it has in the call:
    here every hash is still pinned by the live request that published it, so nothing is
    released and the call is refused with nothing changed (counted twice, the publisher's page
    would be taken as a target)."""
    cache = make_cache(3)
    rows_a = rand_rows(gen, 8)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    cache.add_block_hashes("b", [h("a", 0), h("a", 1)])  # a prefix hit on both blocks
    before = cache.stats()
    with pytest.raises(CacheFullError):
        cache.capture_batch(rand_rows(gen, 8), ["b", "b"], [0, 4], [0, 4], [4, 4])
    assert cache.stats() == before
    assert_rows(cache.read("a", 0, 8), u8(rows_a))
    assert_rows(cache.read("b", 0, 8), u8(rows_a))
    assert_accounting(cache)


def test_evictable_pages_stay_findable_until_evicted(make_cache, gen):
    cache = make_cache(6)
    rows_a = rand_rows(gen, 8)
    cache.capture("a", 0, rows_a)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    cache.finish("a")
    cache.capture("x", 0, rand_rows(gen, 16))  # uses exactly the 4 free pages
    assert cache.stats()["evictions"] == 0
    assert states(cache, "free", "evictable") == dict(free=0, evictable=2)
    cache.finish("x")
    for k in range(3):
        cache.add_block_hashes(f"n{k}", [h("a", 0), h("a", 1)])
        cache.capture(f"n{k}", 8, rand_rows(gen, 1))
        assert_rows(cache.read(f"n{k}", 0, 8), u8(rows_a))
        cache.finish(f"n{k}")
    assert cache.stats()["evictions"] == 0 and cache.stats()["evictable"] == 2


def test_finish_of_unknown_request_is_a_no_op(make_cache, gen):
    cache = make_cache(4)
    rows = rand_rows(gen, 5)
    cache.capture("a", 0, rows)
    cache.add_block_hashes("a", [h("a", 0)])
    before = cache.stats()
    cache.finish("nobody")
    cache.finish(12)
    assert cache.stats() == before
    cache.finish("a")
    after = cache.stats()
    cache.finish("a")
    assert cache.stats() == after
    assert after["free"] == 3 and after["evictable"] == 1 and after["requests"] == 0
    assert_unavailable(cache, "a", 0, 1)
    assert_accounting(cache)


def _pool_order(cache) -> tuple:
    """What decides the next allocations: the free pages and the evictable hashes, in order,
    with the pins and the free slots."""
    pages = cache._pages
    return list(pages.free), list(pages.evictable), dict(pages.pins), list(cache._slots.free), cache.page_states()


def test_finishing_a_steps_requests_at_once_equals_finishing_them_one_by_one(make_cache, gen):
    """``finish_step`` (the connector's call for a step's finished requests) frees the same
    pages and releases the same pins in the same order as ``finish`` per request: requests
    with tail, pending, published and duplicate pages, a prefix hit, one that only has hashes,
    an unknown id and an id listed twice; the next allocations then evict the same blocks."""
    one_by_one, at_once = make_cache(14, page_size=4), make_cache(14, page_size=4)
    rows = {tag: rand_rows(gen, 11) for tag in "abc"}
    for cache in (one_by_one, at_once):
        cache.capture("a", 0, rows["a"])  # 2 published blocks, a tail
        cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
        cache.capture("b", 0, rows["b"][:9])  # 2 pending blocks (no hashes), a tail
        cache.capture("c", 0, rows["a"][:10])  # the same blocks as a: duplicates, a tail
        cache.add_block_hashes("c", [h("a", 0), h("a", 1)])
        cache.add_block_hashes("d", [h("a", 0), h("a", 1)])  # a prefix hit, then its own block
        cache.capture("d", 8, rows["c"][:6])
        cache.add_block_hashes("d", [h("d", 2)])
        cache.add_block_hashes("e", [h("a", 1), h("x", 9)])  # hashes only: pins, no pages
    finished = ["a", "e", "d", "nobody", "c", "b", "a"]  # d's prefix blocks are evictable once d finishes
    for request_id in finished:
        one_by_one.finish(request_id)
    at_once.finish_step(finished)
    assert _pool_order(at_once) == _pool_order(one_by_one)
    assert at_once.stats() == one_by_one.stats()
    free = at_once.stats()["free"]
    y_rows = rand_rows(gen, (free + 2) * 4)
    for cache in (one_by_one, at_once):  # every free page, then two evictions in the order above
        cache.capture("y", 0, y_rows)
        assert_accounting(cache)
    assert _pool_order(at_once) == _pool_order(one_by_one)
    assert at_once.stats()["evictions"] == one_by_one.stats()["evictions"] == 2
    # Each request's pins went in reverse block order: d's own block, then its prefix a1, a0.
    published = [block_hash for block_hash in (h("d", 2), h("a", 1), h("a", 0)) if at_once.is_published(block_hash)]
    assert published == [h("a", 0)]
    at_once.finish_step([])
    assert _pool_order(at_once) == _pool_order(one_by_one)


def test_reset_drops_everything_and_old_hashes_never_hit(make_cache, gen):
    cache = make_cache(6)
    rows = rand_rows(gen, 10)
    cache.capture("a", 0, rows)
    cache.add_block_hashes("a", [h("a", 0), h("a", 1)])
    cache.capture("b", 0, rows[:4])
    cache.add_block_hashes("b", [h("a", 0)])
    cache.retain([h("a", 1)])
    cache.finish("b")
    cache.reset()
    s = cache.stats()
    assert s["generation"] == 1
    assert {k: s[k] for k in STATE_KEYS} == dict(free=6, tail=0, pending=0, duplicate=0, published=0, evictable=0)
    assert s["requests"] == 0 and s["pinned_hashes"] == 0
    assert_unavailable(cache, "a", 0, 1)
    cache.add_block_hashes("n", [h("a", 0), h("a", 1)])
    assert_unavailable(cache, "n", 0, 4)
    cache.capture("n", 8, rand_rows(gen, 2))
    assert_unavailable(cache, "n", 0, 10)
    rows_n = rand_rows(gen, 5)
    cache.capture("m", 0, rows_n)
    assert_rows(cache.read("m", 0, 5), u8(rows_n))
    assert_accounting(cache)


# ------------------------------------------------------------- a small random model

PAGE = 4


def _token_rows(tokens) -> torch.Tensor:
    """Rows are a function of the token prefix (as routing is): identical prefixes share rows."""
    out = [
        list(hashlib.blake2b(repr(tokens[: p + 1]).encode(), digest_size=6).digest()) for p in range(len(tokens))
    ]
    return torch.tensor(out, dtype=torch.uint8).view(len(tokens), *ROW)


def _block_hashes(tokens) -> list[bytes]:
    return [hashlib.sha256(repr(tokens[: (i + 1) * PAGE]).encode()).digest() for i in range(len(tokens) // PAGE)]


def test_random_workload_against_a_token_model(make_cache):
    """Requests over prompts sharing prefixes; every read is checked against the rows the
    token model defines; a live request's captured range and pinned prefix never go away."""
    rng = torch.Generator().manual_seed(99)
    randint = lambda n: int(torch.randint(0, n, (), generator=rng))  # noqa: E731
    base = list(range(100, 124))
    prompts = [base[:n] + [k] * m for k, (n, m) in enumerate([(24, 0), (20, 3), (12, 9), (8, 10), (16, 6), (0, 13)])]
    cache = make_cache(12, page_size=PAGE)
    live = {}  # request id -> dict(tokens, rows, hashes, given, start, cursor)
    next_id = 0
    for _ in range(220):
        op = randint(10)
        if op < 3 and len(live) < 4:
            tokens = prompts[randint(len(prompts))]
            hashes = _block_hashes(tokens)
            given = randint(len(hashes) + 1)
            rid = f"r{next_id}"
            next_id += 1
            cache.add_block_hashes(rid, hashes[:given])
            hit = next((j for j in range(given, 0, -1) if _readable(cache, rid, 0, j * PAGE)), 0)
            if hit * PAGE == len(tokens):
                hit -= 1  # the engine always recomputes at least one row
            live[rid] = dict(tokens=tokens, rows=_token_rows(tokens), hashes=hashes, given=given, cursor=hit * PAGE)
        elif op < 8 and live:
            rid = sorted(live)[randint(len(live))]
            r = live[rid]
            n = min(1 + randint(6), len(r["tokens"]) - r["cursor"])
            before = cache.stats()
            try:
                cache.capture(rid, r["cursor"], r["rows"][r["cursor"] : r["cursor"] + n].to(torch.int64))
            except CacheFullError:
                assert cache.stats() == before
                cache.finish(rid)  # preempted
                del live[rid]
                continue
            r["cursor"] += n
            more = min(len(r["hashes"]), r["given"] + randint(3))
            cache.add_block_hashes(rid, r["hashes"][r["given"] : more])
            r["given"] = more
            if r["cursor"] == len(r["tokens"]):
                assert_rows(cache.read(rid, 0, r["cursor"]), r["rows"])
                cache.finish(rid)
                del live[rid]
        elif live:
            rid = sorted(live)[randint(len(live))]
            r = live[rid]
            start = randint(r["cursor"] + 1)
            end = start + randint(r["cursor"] - start + 1)
            assert_rows(cache.read(rid, start, end), r["rows"][start:end])
        for rid, r in live.items():  # fail closed never bites a live request's pinned rows
            assert_rows(cache.read(rid, 0, r["cursor"]), r["rows"][: r["cursor"]])
        assert_accounting(cache)
    s = cache.stats()
    assert s["evictions"] > 0 and s["prefix_hit_rows"] > 0 and s["published_blocks"] > 5


def _readable(cache, request_id, start, end) -> bool:
    try:
        cache.read(request_id, start, end)
    except RangeUnavailableError:
        return False
    return True


# ------------------------------------------------ regressions of adversarial findings


def test_a_source_with_a_storage_offset_is_stored_exactly_never_stale_rows(make_cache):
    """Once a failed conversion after the bookkeeping left a page of 'old' rows readable as 'r'."""
    cache = make_cache(1, page_size=4, row_shape=(2, 2))
    cache.capture("old", 0, torch.full((4, 2, 2), 7))
    cache.finish("old")
    cache.capture("r", 0, torch.full((1, 2, 2), 1))
    source = torch.arange(1, 18, dtype=torch.uint8)[1:].view(4, 2, 2)  # storage offset 1
    cache.capture_batch(source, ["r"], [1], [0], [1])
    assert_rows(cache.read("r", 0, 2), torch.stack([torch.full((2, 2), 1, dtype=torch.uint8), source[0]]))


def test_a_failed_conversion_is_typed_and_changes_nothing(make_cache):
    cache = make_cache(2, page_size=4, row_shape=(2, 2))
    cache.capture("r", 0, torch.full((1, 2, 2), 1))
    cache.add_block_hashes("r", [b"r0"])
    before = cache.stats(), cache.page_states(), cache.pages.clone()
    for call in (
        lambda: cache.capture_batch(
            torch.ones(4, 2, 2, dtype=torch.int64).as_subclass(UnconvertibleRows), ["r"], [1], [0], [3]
        ),
        lambda: cache.capture("r", 1, torch.ones(3, 2, 2, dtype=torch.int64).as_subclass(UnconvertibleRows)),
        lambda: cache.capture("r", 1, torch.ones(3, 2, 2, dtype=torch.int64, device="meta")),
    ):
        with pytest.raises(InvalidCaptureError):
            call()
        assert (cache.stats(), cache.page_states()) == before[:2] and torch.equal(cache.pages, before[2])
    assert_rows(cache.read("r", 0, 1), torch.full((1, 2, 2), 1, dtype=torch.uint8))


@pytest.mark.parametrize(
    "source_dtype, pool_dtype",
    [(torch.int8, torch.uint8), (torch.int8, torch.uint16), (torch.int16, torch.uint16), (torch.uint64, torch.uint8),
     (torch.uint32, torch.int16), (torch.uint64, torch.int32)],
)
def test_narrow_and_unsigned_rows_that_fit_are_accepted_and_those_that_do_not_are_refused(
    make_cache, source_dtype, pool_dtype
):
    cache = make_cache(2, page_size=4, row_shape=(2, 2), dtype=pool_dtype)
    fitting = torch.tensor([0, 1, 2, 127], dtype=source_dtype).view(1, 2, 2)
    cache.capture("r", 0, fitting)
    assert torch.equal(cache.read("r", 0, 1).cpu().to(torch.int64), fitting.to(torch.int64))
    big = 2**64 - 1 if source_dtype == torch.uint64 else torch.iinfo(source_dtype).max
    small = torch.iinfo(source_dtype).min
    for bad in ([0, 0, 0, -1] if small < 0 else [0, 0, 0, big],):
        if torch.iinfo(pool_dtype).min <= bad[-1] <= torch.iinfo(pool_dtype).max:
            continue
        with pytest.raises(InvalidCaptureError, match="outside the pool dtype"):
            cache.capture("r", 1, torch.tensor(bad, dtype=source_dtype).view(1, 2, 2))
    assert cache.stats()["captured_rows"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_with_what_to_do():
    with pytest.raises(RoutedExpertsCacheError, match=r"device='cuda' but CUDA is not available.*use device='cpu'"):
        RoutedExpertsCache(4, 16, (2, 2), device="cuda")


def test_an_out_of_range_id_is_named_by_its_position_not_the_whole_row(make_cache):
    cache = make_cache(2, page_size=4, row_shape=(48, 8))
    rows = torch.zeros((3, 48, 8), dtype=torch.int32)
    rows[2, 5, 3], rows[2, 40, 0] = 300, -1
    with pytest.raises(InvalidCaptureError) as refused:
        cache.capture("r", 0, rows)
    message = str(refused.value)
    assert "'r': row at position 2" in message and "first at index (5, 3)" in message
    assert "id 300; 2 bad ids in the row" in message and len(message) < 300
    assert cache.stats()["captured_rows"] == 0


def test_malformed_arguments_raise_typed_errors(make_cache):
    cache = make_cache(2, page_size=4, row_shape=(2, 2))
    out_of_range = torch.full((1, 2, 2), 300)
    with pytest.raises(RoutedExpertsCacheError, match="start must be an int"):
        cache.capture("r", 0.0, out_of_range)  # the position is checked before the ids
    for call in (
        lambda: cache.capture_batch(torch.zeros(1, 2, 2, dtype=torch.uint8), None, [], [], []),
        lambda: cache.add_block_hashes("r", None),
        lambda: cache.retain(None),
        lambda: cache.release(None),
    ):
        with pytest.raises(InvalidCaptureError, match="must be a sequence"):
            call()
    with pytest.raises(RangeUnavailableError, match="must be a sequence"):
        cache.read_batch(None, [], [])


def test_rewind_drops_rows_computed_on_failed_kv_and_recaptures_them(make_cache, gen):
    cache = make_cache(8)
    good, bad = rand_rows(gen, 10), rand_rows(gen, 10)
    cache.add_block_hashes("p", [h("p", 0)])
    cache.capture("p", 0, good[:4])  # block 0 published by another request
    cache.add_block_hashes("r", [h("p", 0), h("r", 1), h("r", 2)])
    cache.capture("r", 4, bad[4:10])  # rows computed on KV that then failed to load
    assert cache.is_published(h("r", 1))
    cache.rewind("r", 6)  # mid-block: [4, 6) stay, block 1 is unpublished (its rows were bad)
    assert not cache.is_published(h("r", 1)) and cache.stats()["rewound_rows"] == 4
    assert_rows(cache.read("r", 0, 6), u8(torch.cat([good[:4], bad[4:6]])))
    assert_unavailable(cache, "r", 0, 7)
    cache.rewind("r", 0)  # into the prefix: block 0 becomes r's own, recomputed
    assert_unavailable(cache, "r", 0, 1)
    cache.capture("r", 0, good)
    assert_rows(cache.read("r", 0, 10), u8(good))
    assert cache.is_published(h("r", 1))
    cache.add_block_hashes("s", [h("p", 0)])
    cache.capture("s", 4, good[4:6])
    with pytest.raises(InvalidCaptureError, match="page boundary"):
        cache.rewind("s", 2)  # inside a prefix block: rows [0, 2) alone cannot be kept
    assert_accounting(cache)


def test_batched_calls_match_the_per_request_calls_and_refuse_a_stale_slot(make_cache, gen):
    """capture_batch / read_batch over two requests give the rows captured and what capture /
    read give one request at a time; a slot kept past its request's finish (and reused by
    another request) is refused, never read through."""
    batched, plain = make_cache(8, page_size=4), make_cache(8, page_size=4)
    source = rand_rows(gen, 12)
    for cache in (batched, plain):
        cache.capture("a", 0, source[:3])
        cache.add_block_hashes("b", [h("p", 0)])
        cache.capture("p", 0, source[:4])
        cache.add_block_hashes("p", [h("p", 0)])
    slots = batched.slots(["a", "b"])
    batched.capture_batch(source, ["a", "b"], [3, 4], [3, 6], [6, 5], slots=slots)
    plain.capture("a", 3, source[3:9])
    plain.capture("b", 4, source[6:11])
    packed, offsets = batched.read_batch(["b", "a"], [0, 1], [9, 9], slots=slots[::-1])
    assert_rows(packed, u8(torch.cat([source[:4], source[6:11], source[1:9]])))
    assert_rows(packed, torch.cat([plain.read("b", 0, 9), plain.read("a", 1, 9)]))
    assert offsets.tolist() == [0, 9, 17]
    assert batched.stats() == plain.stats()
    before = batched.stats()
    batched.capture_batch(source[:0], [], [], [], [])  # empty batches, plain lists: a no-op
    packed, offsets = batched.read_batch([], [], [])
    assert packed.shape == (0, *ROW) and offsets.tolist() == [0] and batched.stats() == before
    batched.finish("a")
    for reused in (False, True):  # a's slot while free, then once "c" took it
        if reused:
            batched.capture("c", 0, source[:2])
            assert batched.slots(["c"])[0] == slots[0]
        before = batched.stats(), batched.page_states(), batched.pages.clone()
        for call in (
            lambda: batched.read_batch(["a"], [0], [2], slots=slots[:1]),
            lambda: batched.capture_batch(source, ["a"], [9], [0], [1], slots=slots[:1]),
        ):
            with pytest.raises(RoutedExpertsCacheError, match="does not belong"):
                call()
            assert (batched.stats(), batched.page_states()) == before[:2] and torch.equal(batched.pages, before[2])
    assert_accounting(batched)


def test_step_slots_equal_the_checked_slots(make_cache, gen):
    """``slots_step`` (the connector's unchecked call for a step's new requests) gives what
    ``slots`` gives: known requests keep their slot, new ones are registered once, a finished
    request's slot is reused, and the stats agree."""
    checked, step = make_cache(8, page_size=4), make_cache(8, page_size=4)
    rows = rand_rows(gen, 6)
    for cache in (checked, step):
        cache.capture("a", 0, rows)
        cache.add_block_hashes("b", [h("p", 0)])
        cache.capture("x", 0, rows[:2])
        cache.finish("x")
    ids = ["c", "a", "b", "d", 7]
    assert step.slots_step(ids) == checked.slots(ids).tolist()
    assert step.slots_step(["d", "e"]) == checked.slots(["d", "e"]).tolist()
    assert step.stats() == checked.stats()
    assert_accounting(step)


def test_a_reused_slot_starts_empty(make_cache, gen):
    """A request that takes a finished request's slot has captured nothing yet: its cursor,
    first block and pages start afresh."""
    cache = make_cache(8, page_size=4)
    cache.capture("a", 4, rand_rows(gen, 10))
    cache.finish("a")
    (slot,) = cache.slots(["b"])  # a's slot, registered without a capture
    assert_unavailable(cache, "b", 0, 1)
    with pytest.raises(RangeUnavailableError):
        cache.read_batch(["b"], [4], [6], slots=[slot])
    rows = rand_rows(gen, 3)
    cache.capture_batch(rows, ["b"], [0], [0], [3], slots=[slot])
    assert_rows(cache.read_batch(["b"], [0], [3], slots=[slot])[0], u8(rows))
    assert_accounting(cache)


def test_a_batch_takes_the_pages_its_copy_wrote_when_a_first_capture_frees_a_stale_page(make_cache, gen):
    """Once: a first capture in the same capture_batch settled a recomputed block, freeing its
    stale published page before the continuing spans took theirs, so a continuing span's rows
    were written to one page and its block table pointed at another (wrong rows, no error)."""
    cache = make_cache(4, page_size=2)
    source = rand_rows(gen, 4)
    cache.capture("b", 0, source[:1])  # a one-row tail
    for tag in ("x", "e1", "e2"):  # three evictable published pages, x oldest; nothing free
        cache.capture(tag, 0, rand_rows(gen, 2))
        cache.add_block_hashes(tag, [h(tag, 0)])
        cache.finish(tag)
    cache.add_block_hashes("r", [h("x", 0)])  # pins x; r then recomputes that block itself
    cache.capture_batch(source, ["r", "b"], [0, 1], [0, 2], [2, 2])
    assert_rows(cache.read("b", 0, 3), u8(torch.cat([source[:1], source[2:4]])))
    assert_rows(cache.read("r", 0, 2), u8(source[:2]))
    assert_accounting(cache)


def test_a_copy_that_fails_midway_unpublishes_the_pages_it_was_evicting(make_cache, gen):
    """A device copy that raises may already have written the evictable pages it took: their
    hashes must never hit again (fail closed), and the refused capture leaves nothing else."""
    cache = make_cache(2)
    rows = rand_rows(gen, 8)
    cache.capture("a", 0, rows)
    cache.add_block_hashes("a", [b"h0", b"h1"])
    cache.finish("a")  # both pages published and evictable
    copy, copy_rows = cache._copy, cache._copy_rows

    def then_fault(copy):
        def copy_then_fault(*args):
            copy(*args)
            raise RuntimeError("device fault after the copy")
        return copy_then_fault

    cache._copy, cache._copy_rows = then_fault(copy), then_fault(copy_rows)  # a kernel launch or index copies
    with pytest.raises(RuntimeError, match="device fault"):
        cache.capture("b", 0, rand_rows(gen, 5))  # evicts h0 (oldest), then h1
    cache._copy, cache._copy_rows = copy, copy_rows
    assert not cache.is_published(b"h0") and not cache.is_published(b"h1")
    stats = cache.stats()
    assert (stats["free"], stats["published"], stats["evictable"], stats["requests"]) == (2, 0, 0, 0)
    cache.check_consistency()
    cache.add_block_hashes("c", [b"h0", b"h1"])
    assert_unavailable(cache, "c", 0, 4)
    cache.capture("c", 0, rows[:3])  # the freed pages serve new captures
    assert_rows(cache.read("c", 0, 3), u8(rows[:3]))


def test_long_requests_and_many_requests_grow_the_slot_arrays(make_cache, gen):
    """The block table starts 16 blocks wide and the slot arrays 16 slots long: a step past
    either grows them, and every row stays where it was."""
    cache = make_cache(800, page_size=1)
    rows = rand_rows(gen, 40)
    ids = [f"r{i}" for i in range(20)]
    cache.capture_batch(torch.cat([rows[:5]] * 20), ids, [0] * 20, range(0, 100, 5), [5] * 20)
    for start in range(5, 40, 5):  # continuing spans: 40 blocks per request by the end
        cache.capture_batch(torch.cat([rows[start : start + 5]] * 20), ids, [start] * 20, range(0, 100, 5), [5] * 20)
    packed, offsets = cache.read_batch(ids, [0] * 20, [40] * 20)
    assert_rows(packed, u8(torch.cat([rows] * 20)))
    assert offsets.tolist() == list(range(0, 801, 40))
    assert_accounting(cache)


def test_a_continuing_batch_that_needs_more_pages_than_exist_is_refused_whole(make_cache, gen):
    """Continuing spans count toward the pages a step needs: when they do not fit, the step is
    refused with the continuing requests named, and nothing of it is applied."""
    cache = make_cache(4, page_size=2)
    source = rand_rows(gen, 8)
    cache.capture_batch(source, ["a", "b", "c"], [0, 0, 0], [0, 1, 2], [1, 1, 1])  # 3 pages, 1 free
    before = cache.stats(), cache.page_states(), cache.pages.clone()
    with pytest.raises(CacheFullError, match=r"'a' \[1, 3\), 'b' \[1, 3\), 'c' \[1, 3\) needs 3 new pages"):
        cache.capture_batch(source, ["a", "b", "c"], [1, 1, 1], [3, 4, 5], [2, 2, 2])
    assert (cache.stats(), cache.page_states()) == before[:2] and torch.equal(cache.pages, before[2])
    cache.capture_batch(source, ["a", "b", "c"], [1, 1, 1], [3, 4, 5], [1, 1, 1])  # fills their pages: fits
    assert_rows(cache.read_batch(["a", "b", "c"], [0] * 3, [2] * 3)[0], u8(source[[0, 3, 1, 4, 2, 5]]))
    assert_accounting(cache)



@pytest.mark.parametrize("case", [
    "scatter", "scatter_contiguous", "scatter_gap_at_end", "gather_packed", "gather_permuted", "gather_last_swapped",
    "pool_to_pool",
])
@pytest.mark.parametrize("max_segment_rows", [1, 3])
def test_small_copies_by_row_equal_the_segment_copy(make_cache, monkeypatch, case, max_segment_rows):
    """Copies of up to ``SMALL_COPY_ROWS`` rows go by torch index copies by row, their segments
    expanded to rows in Python (lists, the small-batch paths) or in numpy (arrays); above it,
    through the segment copy (the kernel, or its torch twin). All three leave the same target,
    for each kind of copy the cache makes: a step's rows into pages (scattered or contiguous in
    the step), a read into a packed output, and pages copied within the pool (seeds); a step's
    rows that break their run only at the last segment are not taken for contiguous, nor a read
    whose last two segments are swapped for packed."""
    rng = np.random.default_rng(max_segment_rows)
    n, row_shape, page_size, num_pages = 7, (5, 3), 4, 24
    pool_rows = num_pages * page_size
    lengths = rng.integers(1, max_segment_rows + 1, n).tolist()
    rows = sum(lengths)
    offsets = [sum(lengths[:i]) for i in range(n)]
    slots = (rng.permutation(pool_rows // 3)[: 2 * n] * 3).tolist()  # disjoint 3-row runs of the pool
    sources, targets = {
        "scatter": ([3 * i + 1 for i in rng.permutation(n).tolist()], slots[:n]),
        "scatter_contiguous": ([2 + o for o in offsets], slots[:n]),
        "scatter_gap_at_end": ([2 + o for o in offsets[:-1]] + [3 + offsets[-1]], slots[:n]),
        "gather_packed": (slots[:n], offsets),
        "gather_permuted": (slots[:n], [rows - o - length for o, length in zip(offsets, lengths)]),  # last first
        "gather_last_swapped": (slots[:n], offsets[:-2] + [offsets[-2] + lengths[-1], offsets[-2]]),
        "pool_to_pool": (slots[n:], slots[:n]),
    }[case]
    start = torch.from_numpy(rng.integers(-(2**15), 2**15, (pool_rows, *row_shape), dtype=np.int16))
    step_rows = torch.from_numpy(rng.integers(-(2**15), 2**15, (3 * n + 2, *row_shape), dtype=np.int16))
    results, as_arrays = [], tuple(np.array(v, dtype=np.int64) for v in (lengths, sources, targets))
    for segments, by_row in (((lengths, sources, targets), True), (as_arrays, True), (as_arrays, False)):
        monkeypatch.setattr(cache_module, "SMALL_COPY_ROWS", SMALL_COPY_ROWS if by_row else 0)
        cache = make_cache(num_pages, page_size=page_size, row_shape=row_shape, dtype=torch.int16)
        copies = []
        for name in ("_copy", "_copy_rows"):
            monkeypatch.setattr(cache, name, (lambda copy, name: lambda *args: (copies.append(name), copy(*args)))(getattr(cache, name), name))
        cache.pages.copy_(start.view(cache.pages.shape).to(cache.device))
        source = target = cache._pool_words
        if case.startswith("gather"):
            target = cache._copy_view(torch.zeros((rows, *row_shape), dtype=torch.int16, device=cache.device))
        elif case != "pool_to_pool":
            source = cache._copy_view(step_rows.to(cache.device))
        cache._copy_on_device(source, target, *segments)
        assert copies == ["_copy_rows" if by_row else "_copy"]
        results.append(target.cpu().clone())
    assert rows <= SMALL_COPY_ROWS
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    before = torch.zeros_like(results[0]) if case.startswith("gather") else cache._copy_view(start)
    assert not torch.equal(results[0], before)  # the copy wrote


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_long_spans_page_runs_are_its_rows_split_at_block_boundaries(page_size):
    """``_append_page_runs`` (the split of spans longer than ``SHORT_SPAN_PAGES`` blocks)
    appends one segment per block of a span to what the lists hold; row by row, its segments
    take consecutive source rows from the given one and write each position at its offset in
    its block's page. Spans of two blocks to three times the threshold, starting anywhere in
    a block and ending anywhere."""
    rng = np.random.default_rng(page_size)
    for _ in range(300):
        start = int(rng.integers(0, 5 * page_size))
        first = start // page_size
        end = int(rng.integers((first + 1) * page_size + 1, (first + 3 * cache_module.SHORT_SPAN_PAGES) * page_size + 1))
        pages = rng.permutation(1000)[: (end - 1) // page_size - first + 1].tolist()
        source_row = int(rng.integers(0, 100))
        lists = ([-1], [-2], [-3])  # what the lists held before
        _append_page_runs(*lists, pages, start, end, source_row, page_size)
        assert [values[0] for values in lists] == [-1, -2, -3]
        sources, targets, lengths = (values[1:] for values in lists)
        assert len(sources) == len(targets) == len(lengths) == len(pages) >= 2
        rows = [(source + k, target + k) for source, target, length in zip(sources, targets, lengths) for k in range(length)]
        assert rows == [
            (source_row + position - start, pages[position // page_size - first] * page_size + position % page_size)
            for position in range(start, end)
        ]


def capture_live_step(cache, live: list, cursors: dict, expected: dict, counts: np.ndarray, gen) -> None:
    """One ``capture_step`` of random rows, ``counts[i]`` for ``live[i]`` from its cursor; the rows
    join ``expected`` and the cursors move on."""
    rows = torch.randint(0, 256, (int(counts.sum()), *cache.row_shape), dtype=torch.uint8, generator=gen)
    source_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    starts = np.array([cursors[request_id] for request_id in live], dtype=np.int64)
    cache.capture_step(rows, list(live), cache.slots(live), starts, source_starts, counts)
    for request_id, first, count in zip(live, source_starts.tolist(), counts.tolist()):
        expected[request_id].append(rows[first : first + count])
        cursors[request_id] += count


@pytest.mark.parametrize("short_span_pages", [cache_module.SHORT_SPAN_PAGES, 1])
@pytest.mark.parametrize("free_pages", ["enough", "short"])
def test_steps_with_arrivals_above_the_small_batch_equal_the_general_path(make_cache, monkeypatch, free_pages, short_span_pages):
    """Above ``SMALL_BATCH`` continuing requests, a step that also has first captures (arrivals,
    one a prefix hit starting inside a published block, listed among the continuing spans)
    goes through ``_write``, which plans continuing spans of at most a page each with the
    fewer array passes of ``_segments_within_pages``. The pool it leaves (rows, page states,
    published blocks, counters) equals the one the page-run split leaves, and every request
    reads back its rows, with free pages to spare and with evictions. Also with every span
    longer than a page split by list extensions (``SHORT_SPAN_PAGES`` 1)."""
    monkeypatch.setattr(cache_module, "SHORT_SPAN_PAGES", short_span_pages)
    n, page_size, row_shape, arrivals, num_steps = batch_size.SMALL_BATCH + 16, 4, (3, 2), 3, 7
    leaving = n // 4  # the last quarter finishes after step 3
    rng = np.random.default_rng(11)
    steps = [rng.integers(2 * page_size, 3 * page_size, n)]
    steps += [rng.integers(0, page_size + 1, n + arrivals * step) for step in range(1, num_steps)]
    needed = int((-(-sum(steps[step][:n] for step in range(num_steps)) // page_size)).sum())  # the first n's pages at the end
    num_pages = 2 * needed if free_pages == "enough" else needed - leaving
    results, taken = [], []
    for fast in (True, False):
        cache = make_cache(num_pages, page_size=page_size, row_shape=row_shape)
        within_pages, calls = cache._segments_within_pages, []
        monkeypatch.setattr(cache, "_segments_within_pages",
                            (lambda *args: calls.append(len(args[0][0])) or within_pages(*args)) if fast else cache._segments_by_page_runs)
        gen, expected = torch.Generator().manual_seed(5), {}
        live, cursors = [], {}

        def arrive(request_id, hashes, start):
            cache.add_block_hashes(request_id, hashes)
            live.append(request_id)
            cursors[request_id] = start

        for i in range(n):  # a hash for every block a request completes: its blocks publish
            arrive(f"r{i}", [f"r{i}-{b}".encode() for b in range(64)], 0)
            expected[f"r{i}"] = []
        for step in range(num_steps):
            if step == 3:
                for request_id in [f"r{i}" for i in range(n - leaving, n)]:
                    cache.finish(request_id)
                    live.remove(request_id)
            if step:
                for a in range(arrivals):  # listed among the others; the first one a prefix hit of r0
                    request_id = f"a{step}-{a}"
                    if a == 0:
                        arrive(request_id, [b"r0-0", b"r0-1", *(f"{request_id}-{b}".encode() for b in range(2, 64))], 2 * page_size - 1)
                        expected[request_id] = [expected["r0"][0][: 2 * page_size - 1]]  # the published prefix
                    else:
                        arrive(request_id, [f"{request_id}-{b}".encode() for b in range(64)], 0)
                        expected[request_id] = []
                    live.insert(3 * a + 1, live.pop())
            capture_live_step(cache, live, cursors, expected, np.resize(steps[step], len(live)).astype(np.int64), gen)
            if step == 0:
                expected["r0"] = [torch.cat(expected["r0"])]
        cache.check_consistency()
        results.append((
            cache.pages.cpu().clone(), cache.page_states(), dict(cache._pages.published), cache.stats(),
            [cache.read(request_id, 0, cursors[request_id]) for request_id in live],
        ))
        taken.append(calls)
    (pages, states, published, stats, reads), (pages_ref, states_ref, published_ref, stats_ref, reads_ref) = results
    assert torch.equal(pages, pages_ref) and states == states_ref and published == published_ref and stats == stats_ref
    assert all(torch.equal(read.cpu(), torch.cat(expected[request_id])) for read, request_id in zip(reads, live))
    assert all(torch.equal(a, b) for a, b in zip(reads, reads_ref))
    hits = [f"a{step}-0" for step in range(1, num_steps) if cursors[f"a{step}-0"] > 2 * page_size - 1]  # captured a row
    assert len(hits) >= num_steps // 2  # (a first capture of no rows is none: its hit counts when it captures)
    assert stats["published"] > 0 and stats["prefix_hit_rows"] == len(hits) * (2 * page_size - 1)
    assert len(taken[0]) == num_steps - 1 and min(taken[0]) > batch_size.SMALL_BATCH  # every step with arrivals
    assert (stats["evictions"] > 0) == (free_pages == "short")


@pytest.mark.parametrize("free_pages", ["enough", "short"])
def test_decode_steps_above_the_small_batch_equal_the_general_path(make_cache, monkeypatch, free_pages):
    """Above ``SMALL_BATCH`` requests, a step of continuing spans of at most a page each (decode,
    speculative rows) is written by a fixed set of array passes (``_capture_within_pages``): a
    span that crosses a page boundary, one that starts on one, an empty one. The pool it leaves
    (rows, page states, block tables, published blocks) equals the general path's (``_write``,
    spans split at page boundaries); where free pages run short, it declines, changing nothing,
    and the general path evicts as before."""

    n, page_size, row_shape = 2 * batch_size.SMALL_BATCH, 4, (3, 2)
    rng = np.random.default_rng(7)
    steps = [rng.integers(1, 3 * page_size, n), *(rng.integers(0, page_size + 1, n) for _ in range(8))]
    ids, leaving = [f"r{i}" for i in range(n)], n // 4  # the first quarter finishes after step 3
    blocks = -(-np.cumsum(steps, axis=0) // page_size)  # pages each request holds after each step
    needed = max(int(blocks[:3].sum(axis=1).max()), int(blocks[-1, leaving:].sum()))
    num_pages = needed + n if free_pages == "enough" else needed  # short: the finished ones' blocks get evicted
    results, taken = [], []
    for fast in (True, False):
        cache = make_cache(num_pages, page_size=page_size, row_shape=row_shape)
        within_pages = cache._capture_within_pages
        outcomes = []
        monkeypatch.setattr(cache, "_capture_within_pages",
                            (lambda *args: outcomes.append(within_pages(*args)) or outcomes[-1]) if fast else (lambda *args: False))
        if not fast:  # the reference splits spans at page boundaries
            monkeypatch.setattr(cache, "_segments_within_pages", cache._segments_by_page_runs)
        for request_id in ids:  # a hash for every block a request completes: its blocks publish
            cache.add_block_hashes(request_id, [f"{request_id}-{b}".encode() for b in range(16)])
        live, cursors = list(ids), np.zeros(n, dtype=np.int64)
        gen, expected = torch.Generator().manual_seed(3), {request_id: [] for request_id in ids}
        for step, counts in enumerate(steps):
            if step == 3:
                for request_id in ids[:leaving]:
                    cache.finish(request_id)
                live, cursors, counts = ids[leaving:], cursors[leaving:], counts[leaving:]
            elif step > 3:
                counts = counts[leaving:]
            counts = np.asarray(counts, dtype=np.int64)
            rows = torch.randint(0, 256, (int(counts.sum()), *row_shape), dtype=torch.uint8, generator=gen)
            source_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            cache.capture_step(rows, live, cache.slots(live), cursors.copy(), source_starts, counts)
            cursors += counts
            for request_id, first, count in zip(live, source_starts.tolist(), counts.tolist()):
                expected[request_id].append(rows[first : first + count])
        cache.check_consistency()
        results.append((
            cache.pages.cpu().clone(), cache.page_states(), dict(cache._pages.published), cache.stats(),
            [cache.read(request_id, 0, int(cursor)) for request_id, cursor in zip(live, cursors)],
        ))
        taken.append(outcomes)
    (pages, states, published, stats, reads), (pages_ref, states_ref, published_ref, stats_ref, reads_ref) = results
    assert torch.equal(pages, pages_ref) and states == states_ref and published == published_ref and stats == stats_ref
    assert all(torch.equal(a, b) for a, b in zip(reads, reads_ref))
    assert all(torch.equal(read.cpu(), torch.cat(expected[request_id])) for read, request_id in zip(reads, ids[leaving:]))
    assert stats["published"] > 0
    if free_pages == "enough":
        assert taken[0] == [True] * (len(steps) - 1) and stats["evictions"] == 0  # every decode step: array passes
    else:
        assert True in taken[0] and False in taken[0] and stats["evictions"] > 0  # declined once free pages ran out


@pytest.mark.parametrize("call", ["capture_step", "capture_batch"])
@pytest.mark.parametrize("small_batch", ["lists", "arrays"])
@pytest.mark.parametrize("rows_per_step", [(1, 2), (1, 4), (5, 12)], ids=["decode", "within-a-page", "over-pages"])
@pytest.mark.parametrize("free_pages", ["enough", "short"])
def test_own_blocks_past_the_block_tables_width_read_back_exactly(make_cache, monkeypatch, call, small_batch,
                                                                   rows_per_step, free_pages):
    """The block table starts 16 own blocks wide and doubles as requests grow. Requests that
    capture step by step (a decode row, spans within a page, spans over several pages), with
    staggered starts so that each reaches the table's last column and its growth at another
    step, through every capture path (lists, array passes, the general path where free pages
    run short), read back exactly, and the block tables match the pages."""
    if small_batch == "arrays":
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    page_size, row_shape, num_blocks = 4, (3, 2), 40
    ids = ["a", "b", "c"]
    # short: fewer pages than the requests hold at the end; blocks publish (hashes below) and
    # a finished request's blocks are evicted as the others grow.
    num_pages = 3 * num_blocks + 3 if free_pages == "enough" else 2 * num_blocks + 8
    cache = make_cache(num_pages, page_size=page_size, row_shape=row_shape)
    for request_id in ids:
        cache.add_block_hashes(request_id, [f"{request_id}-{b}".encode() for b in range(num_blocks)])
    gen, rng = torch.Generator().manual_seed(11), np.random.default_rng(5)
    cursors, expected = dict.fromkeys(ids, 0), {request_id: [] for request_id in ids}
    inside_last_column = 0  # steps in which a request continues a block in the table's last column
    end = {"a": num_blocks * page_size, "b": num_blocks * page_size, "c": 12 * page_size}
    for step in range(10 * num_blocks * page_size):
        live = [r for k, r in enumerate(ids) if step >= 2 * k and cursors[r] < end[r]]  # "b" starts 2 steps later
        if not live:
            break
        counts = np.minimum(rng.integers(rows_per_step[0], rows_per_step[1] + 1, len(live)), [end[r] - cursors[r] for r in live])
        starts = np.array([cursors[r] for r in live], dtype=np.int64)
        width = cache._slots.table.shape[1]
        inside_last_column += int(np.count_nonzero((starts // page_size == width - 1) & (starts % page_size != 0)))
        rows = torch.randint(0, 256, (int(counts.sum()), *row_shape), dtype=torch.uint8, generator=gen)
        source_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if call == "capture_step":
            cache.capture_step(rows, live, cache.slots(live), starts, source_starts, counts)
        else:
            cache.capture_batch(rows, live, starts, source_starts, counts)
        for request_id, first, count in zip(live, source_starts.tolist(), counts.tolist()):
            expected[request_id].append(rows[first : first + count])
            cursors[request_id] += count
        if cursors["c"] == end["c"] and "c" in cache._requests and free_pages == "short":
            cache.finish("c")
    cache.check_consistency()
    assert cache._slots.table.shape[1] >= 64 and inside_last_column > 0  # grew twice; the last column was read
    for request_id in ("a", "b"):
        assert torch.equal(cache.read(request_id, 0, end[request_id]).cpu(), torch.cat(expected[request_id]))
    assert (cache.stats()["evictions"] > 0) == (free_pages == "short")


# ------------------------------- checks of the checks: the property tests' oracle, refusal messages


def two_requests() -> RoutedExpertsCache:
    """"a": blocks 0 (published), 1 (pending) and a 2-row tail; "b": block 0 pending."""
    cache = RoutedExpertsCache(8, 4, (2,))
    cache.capture("a", 0, torch.zeros(10, 2, dtype=torch.uint8))
    cache.add_block_hashes("a", [b"a0"])
    cache.capture("b", 0, torch.ones(4, 2, dtype=torch.uint8))
    return cache


def share_a_page(cache):
    cache._requests["b"].own_pages.append(cache._requests["a"].own_pages[-1])


def keep_a_finished_request_in_its_slot(cache):
    """What ``RequestSlots.remove`` would leave if it only freed the slot: the block map stays referenced."""
    request = cache._requests["b"]
    cache.finish("b")
    cache._slots.requests[request.slot] = request


def free_a_slot_twice(cache):
    slot = cache._requests["b"].slot
    cache.finish("b")
    cache._slots.free.append(slot)


@pytest.mark.parametrize("problem, corrupt", [
    ("a page is owned by two requests", share_a_page),
    ("slot arrays disagree", lambda cache: cache._slots.first_block.__setitem__(cache._requests["a"].slot, 1)),
    ("block table disagrees", lambda cache: cache._slots.table.__setitem__((cache._requests["a"].slot, 1), 7)),
    ("are not all settled", lambda cache: setattr(cache._requests["b"], "num_settled", 1)),
    ("a free slot still holds a request", keep_a_finished_request_in_its_slot),
    ("a slot is neither free nor live", free_a_slot_twice),
])
def test_the_consistency_check_reports_each_way_the_block_maps_can_break(problem, corrupt):
    """``check_consistency`` is what the property tests assert after every call: each
    invariant of the block maps it states, once broken, is reported."""
    cache = two_requests()
    cache.check_consistency()
    corrupt(cache)
    with pytest.raises(RoutedExpertsCacheError, match=problem):
        cache.check_consistency()


def test_a_negative_span_value_is_named_in_the_refusal():
    cache = two_requests()
    rows = torch.zeros(4, 2, dtype=torch.uint8)
    for index, name in enumerate(("start", "source_start", "count")):
        span = [10, 0, 2]
        span[index] = -1
        with pytest.raises(RoutedExpertsCacheError, match=f"'a': {name} must be >= 0, got -1"):
            cache.capture_batch(rows, ["a"], *([value] for value in span))


@pytest.mark.parametrize("short_span_pages", [cache_module.SHORT_SPAN_PAGES, 1])
@pytest.mark.parametrize("free_pages", ["enough", "short"])
def test_small_steps_with_arrivals_equal_the_general_path(make_cache, monkeypatch, free_pages, short_span_pages):
    """Up to ``SMALL_BATCH`` requests, a step whose first captures each start a page (from 0,
    or after a prefix hit of whole blocks) and fit the free pages is planned in the continuing
    spans' pass (``_segments_small``), without ``_write``'s look-ahead; one that starts inside
    a published block (seeded), captures nothing yet, or needs evictions goes through
    ``_write``. The pool it leaves (rows, page states, published blocks in their eviction
    order, pins, counters) equals the one ``_write`` leaves for every step, and every request
    reads back its rows, with free pages to spare and with evictions (where the continuing
    spans may then find too few free pages after the first captures': that step declines
    too, changing nothing). Also with every span longer than a page split by list extensions
    (``SHORT_SPAN_PAGES`` 1)."""
    monkeypatch.setattr(cache_module, "SHORT_SPAN_PAGES", short_span_pages)
    n, page_size, row_shape, num_steps = 6, 4, (3, 2), 9
    leaving = 2  # the first two finish at step 4
    rng = np.random.default_rng(13)
    steps = [rng.integers(2 * page_size, 3 * page_size, n)]
    steps += [rng.integers(0, page_size + 2, n + 3 * step) for step in range(1, num_steps)]
    num_pages = 200 if free_pages == "enough" else 54
    results, planned = [], []
    for fast in (True, False):
        cache = make_cache(num_pages, page_size=page_size, row_shape=row_shape)
        first_capture_pages, write, outcomes, writes = cache._first_capture_pages, cache._write, [], []
        monkeypatch.setattr(cache, "_first_capture_pages", (
            lambda *args: outcomes.append(first_capture_pages(*args)) or outcomes[-1]) if fast else (lambda *args: None))
        monkeypatch.setattr(cache, "_write", lambda *args: writes.append(step) or write(*args))
        gen, expected, live, cursors = torch.Generator().manual_seed(5), {}, [], {}

        def arrive(request_id, hashes, start, prefix=()):
            cache.add_block_hashes(request_id, hashes)
            live.insert(len(live) // 2, request_id)  # listed among the continuing ones
            cursors[request_id] = start
            expected[request_id] = list(prefix)

        for i in range(n):  # a hash for every block a request completes: its blocks publish
            arrive(f"r{i}", [f"r{i}-{b}".encode() for b in range(64)], 0)
        for step in range(num_steps):
            finishing = [f"r{i}" for i in range(leaving)] if step == 4 else []
            finishing += [f"a{step - 2}-{a}" for a in range(3)] if step >= 3 else []  # arrivals stay two steps
            for request_id in finishing:
                cache.finish(request_id)
                live.remove(request_id)
            if step:  # arrivals: one from 0, prefix hits of r2's first two blocks, whole or seeded
                hit = 2 * page_size - step % 2  # a page boundary on even steps, inside block 1 on odd ones
                for a, start in enumerate((0, 2 * page_size, hit)):
                    request_id = f"a{step}-{a}"
                    hashes = [f"{request_id}-{b}".encode() for b in range(64)]
                    if start:
                        hashes[:2] = [b"r2-0", b"r2-1"]
                    arrive(request_id, hashes, start, [expected["r2"][0][:start]] if start else ())
            capture_live_step(cache, live, cursors, expected, np.resize(steps[step], len(live)).astype(np.int64), gen)
            if step == 0:
                expected["r2"] = [torch.cat(expected["r2"])]
            assert len(live) <= batch_size.SMALL_BATCH
        cache.check_consistency()
        pool = cache._pages
        results.append((
            cache.pages.cpu().clone(), cache.page_states(), dict(pool.published), list(pool.evictable), dict(pool.pins),
            cache.stats(), [cache.read(request_id, 0, cursors[request_id]) for request_id in live],
        ))
        planned.append((outcomes, writes))
    (pages, *state, reads), (pages_ref, *state_ref, reads_ref) = results
    assert torch.equal(pages, pages_ref) and state == state_ref
    assert all(torch.equal(read.cpu(), torch.cat(expected[request_id])) for read, request_id in zip(reads, live))
    assert any(request_id.startswith("a") for request_id in live)
    stats = state[-1]
    assert stats["published"] > 0 and stats["prefix_hit_rows"] > 0
    (outcomes, writes), (_, writes_ref) = planned
    taken = [pages is not None for pages in outcomes]
    assert len(taken) == num_steps and taken[0] and False in taken[1::2]  # seeded arrivals need _write
    assert any(taken[2::2])  # steps of arrivals on page boundaries only (and rows to capture)
    assert writes_ref == list(range(num_steps))  # the reference: every step through _write
    declined = [step for step, pages in enumerate(outcomes) if pages is None]
    if free_pages == "enough":
        assert writes == declined  # every other step planned in one pass
    else:  # also where the first captures fit the free pages and the continuing spans then do not
        assert set(declined) < set(writes)
    assert (stats["evictions"] > 0) == (free_pages == "short")


@pytest.mark.parametrize("listed", [["new"], ["new", "more"]], ids=["one", "two"])
def test_small_steps_first_captures_past_the_free_pages_evict_as_write_does(make_cache, gen, listed):
    """A small step whose first captures need more pages than are free (one request, or two
    that each fit alone) is not planned on the free pages: ``_write`` takes it and evicts the
    oldest published block, and the rows read back."""
    cache = make_cache(4)
    cache.capture("old", 0, rand_rows(gen, 12))
    cache.add_block_hashes("old", [h("o", b) for b in range(3)])
    cache.finish("old")  # three published blocks, evictable; one page free
    counts = [8] if len(listed) == 1 else [4, 4]
    rows = rand_rows(gen, sum(counts))
    cache.capture_step(rows, listed, np.array(cache.slots_step(listed), dtype=np.int64), np.zeros(len(listed), dtype=np.int64),
                       np.array([0, 4][: len(listed)], dtype=np.int64), np.array(counts, dtype=np.int64))
    assert cache.stats()["evictions"] == 1
    for request_id, first, count in zip(listed, [0, 4], counts):
        assert_rows(cache.read(request_id, 0, count), u8(rows[first : first + count]))
    cache.check_consistency()
