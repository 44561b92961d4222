"""Property test over every input the cache API takes: accepted ones store exact rows,
refused ones raise the project's typed error and change nothing.

- Rows of every integer dtype (int8 ... int64, uint8 ... uint64) with values at the limits of
  their dtype and of each pool dtype (one past them too), laid out contiguous, with a
  storage offset, strided, transposed or expanded, through ``capture``, ``capture_batch``
  (continuing spans, first captures, and two spans of the same source rows) and
  ``import_blocks`` (a page of rows computed elsewhere, read back through the index); rows on the
  ``meta`` device, of non-integer dtypes, and rows whose conversion to the pool fails (a
  simulated device out-of-memory).
- A wrong Python value in every argument position of every public call, the batched calls'
  index arrays (positions and slots) included.

Accepted: the rows read back exactly (compared as integers) and every other row is unchanged.
Refused: a ``RoutedExpertsCacheError`` (the documented subclass where there is one), and
``page_states()``, ``stats()``, the pool and every read are exactly as before.
``test_bad_input.py`` runs this file again under ``python -O`` (asserts in the library vanish).
"""

from operator import add

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from routed_experts_cache import (
    InvalidCaptureError,
    RangeUnavailableError,
    RoutedExpertsCache,
    RoutedExpertsCacheError,
)
from routed_experts_cache.connector import batch_size

ROW = (2, 3)
PAGE = 4
SOURCE_DTYPES = (
    torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64,
)
POOL_DTYPES = (torch.uint8, torch.uint16, torch.int16, torch.int32)
LAYOUTS = ("contiguous", "offset", "strided", "transposed", "expanded")
REFUSED_SOURCES = ("meta", "float", "bool", "unconvertible")
EXAMPLES = {"torch": 250, "triton": 40}


class UnconvertibleRows(torch.Tensor):
    """Rows whose copy to the pool fails, as a device out-of-memory in ``.to()`` would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("to", "contiguous", "clone", "cat"):
            raise torch.OutOfMemoryError("simulated out-of-memory while converting rows")
        return super().__torch_function__(func, types, args, kwargs or {})


def populated(backend: str, pool_dtype: torch.dtype = torch.uint8, **limit) -> RoutedExpertsCache:
    """'a': 6 rows, block 0 published; 'b': 3 rows; 3 of 6 pages free (``limit``: max_position)."""
    cache = RoutedExpertsCache(6, PAGE, ROW, dtype=pool_dtype, device=TEST_DEVICE, backend=backend, **limit)
    cache.capture("a", 0, torch.arange(36).reshape(6, *ROW) % 100)
    cache.add_block_hashes("a", [b"a0"])
    cache.capture("b", 0, torch.arange(18).reshape(3, *ROW) % 50 + 7)
    return cache


def observe(cache: RoutedExpertsCache):
    """Everything a caller can see, read with the cache's own calls."""
    stats = cache.stats()
    reads = [cache.read("a", 0, 6).cpu(), cache.read("b", 0, 3).cpu()]
    return stats, cache.page_states(), cache.pages.cpu().clone(), reads


def assert_unchanged(before, after) -> None:
    stats, states, pages, reads = before
    stats2, states2, pages2, reads2 = after
    stats2 = dict(stats2, read_rows=stats["read_rows"])  # observe() itself reads
    assert stats2 == stats
    assert states2 == states
    assert torch.equal(pages2, pages)
    assert all(torch.equal(x, y) for x, y in zip(reads, reads2))


def limits(dtype: torch.dtype, pool_dtype: torch.dtype) -> list[int]:
    """Values at the edges of the source dtype and of the pool dtype, where representable."""
    source, pool = torch.iinfo(dtype), torch.iinfo(pool_dtype)
    if dtype == torch.uint64:
        source_max = 2**64 - 1
    else:
        source_max = source.max
    candidates = {source.min, source_max, 0, 1, pool.min, pool.max, pool.min - 1, pool.max + 1, 2**63 - 1, 2**63}
    return sorted(v for v in candidates if source.min <= v <= source_max)


def laid_out(values: torch.Tensor, layout: str, offset: int) -> torch.Tensor:
    """The same rows in another memory layout (values is contiguous)."""
    n = values.shape[0]
    if layout == "contiguous":
        return values
    if layout == "offset":  # a view starting ``offset`` elements into its storage
        buffer = torch.zeros(offset + values.numel(), dtype=values.dtype)
        buffer[offset:] = values.flatten()
        return buffer[offset:].view(values.shape)
    if layout == "strided":  # every other element of a wider tensor
        wide = torch.zeros((n, ROW[0], 2 * ROW[1]), dtype=values.dtype)
        wide[:, :, ::2] = values
        return wide[:, :, ::2]
    if layout == "transposed":
        return values.transpose(1, 2).contiguous().transpose(1, 2)
    return values[:1].expand(n, *ROW)  # "expanded": stride 0 over rows


@st.composite
def row_sources(draw, pool_dtype, rows=st.integers(1, 6)):
    """(source tensor, its values as int64 or None when unrepresentable, expected to fit)."""
    n = draw(rows, label="n")
    kind = draw(st.sampled_from(("integer",) * 6 + REFUSED_SOURCES), label="kind")
    if kind == "float":
        return torch.zeros((n, *ROW), dtype=torch.float32), None, False
    if kind == "bool":
        return torch.zeros((n, *ROW), dtype=torch.bool), None, False
    if kind in ("meta", "unconvertible"):
        rows = torch.zeros((n, *ROW), dtype=torch.int64)
        return (rows.to("meta") if kind == "meta" else rows.as_subclass(UnconvertibleRows)), None, False
    # half of the sources already have the pool dtype: no conversion copy hides their layout
    dtype = draw(st.sampled_from(SOURCE_DTYPES) | st.just(pool_dtype), label="dtype")
    layout = draw(st.sampled_from(LAYOUTS), label="layout")
    pool = torch.iinfo(pool_dtype)
    inside = [v for v in limits(dtype, pool_dtype) if pool.min <= v <= pool.max]
    outside = [v for v in limits(dtype, pool_dtype) if not pool.min <= v <= pool.max]
    flat = draw(st.lists(st.sampled_from(inside), min_size=6 * n, max_size=6 * n), label="values")
    if outside and draw(st.booleans(), label="one_outside"):  # one id that does not fit, anywhere
        flat[draw(st.integers(0, 6 * n - 1), label="at")] = draw(st.sampled_from(outside), label="outside")
    if layout == "expanded":
        flat = flat[:6] * n
    values = torch.tensor(flat, dtype=dtype).reshape(n, *ROW)
    source = laid_out(values, layout, draw(st.integers(1, 3), label="offset"))
    fits = all(pool.min <= v <= pool.max for v in flat)
    return source, flat, fits


ROW_APIS = sorted(["capture", "capture_new", "capture_batch", "capture_batch_two", "capture_batch_new", "import_blocks"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_of_any_dtype_and_layout_are_stored_exactly_or_refused_without_change(backend):
    run = settings(
        deadline=None, derandomize=True, database=None, max_examples=EXAMPLES[backend],
        suppress_health_check=[HealthCheck.too_slow],
    )(given(data=st.data())(lambda data: check_one_capture(backend, data)))
    run()


def check_one_capture(backend, data):
    pool_dtype = data.draw(st.sampled_from(POOL_DTYPES), label="pool_dtype")
    cache = populated(backend, pool_dtype)
    api = data.draw(st.sampled_from(ROW_APIS), label="api")
    importing = api == "import_blocks"  # one block: exactly a page of rows
    source, flat, fits = data.draw(row_sources(pool_dtype, st.just(PAGE) if importing else st.integers(1, 6)), label="source")
    n = source.shape[0]
    # api -> (the call, the request and start it reads back, a second one given the same rows)
    apis = {
        "capture": (lambda: cache.capture("a", 6, source), "a", 6, None),
        "capture_new": (lambda: cache.capture("c", 0, source), "c", 0, None),
        "capture_batch": (lambda: cache.capture_batch(source, ["a"], [6], [0], [n]), "a", 6, None),
        # two continuing spans of the same source rows
        "capture_batch_two": (lambda: cache.capture_batch(source, ["b", "a"], [3, 6], [0, 0], [n, n]), "a", 6, ("b", 3)),
        # a first capture (the per-request path) next to a continuing span (the array path)
        "capture_batch_new": (lambda: cache.capture_batch(source, ["c", "a"], [0, 6], [0, 0], [n, n]), "a", 6, ("c", 0)),
        # rows computed elsewhere, published as one block; "i" reads them through the index
        "import_blocks": (lambda: cache.import_blocks([b"z0"], source), "i", 0, None),
    }
    assert sorted(apis) == ROW_APIS
    call, request_id, start, also = apis[api]
    before = observe(cache)
    if not fits:
        with pytest.raises(InvalidCaptureError):
            call()
        assert_unchanged(before, observe(cache))
        cache.check_consistency()
        return
    call()
    cache.check_consistency()
    if importing:
        cache.add_block_hashes("i", [b"z0"])
    want = torch.tensor(flat, dtype=torch.int64).reshape(n, *ROW)
    assert torch.equal(cache.read(request_id, start, start + n).cpu().to(torch.int64), want)
    if also is not None:
        assert torch.equal(cache.read(also[0], also[1], also[1] + n).cpu().to(torch.int64), want)
    _, _, _, reads = before
    assert torch.equal(cache.read("a", 0, 6).cpu(), reads[0])
    assert torch.equal(cache.read("b", 0, 3).cpu(), reads[1])


# ------------------------------------------------------------- wrong Python values

MAX_POSITION = RoutedExpertsCache(1, PAGE, ROW).max_position  # the default bound on positions
HUGE_POSITIONS = (MAX_POSITION + 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63))
BAD_VALUES = (
    None, 1.5, True, False, -1, "x", b"x", b"", [1], ("a", 1), {}, np.int64(3), torch.tensor(3), object(),
    torch.zeros((2, *ROW), dtype=torch.int64), *HUGE_POSITIONS, np.int64(2**62), torch.tensor(2**40),
)


def valid(kind: str, value) -> bool:
    """Whether ``value`` is an acceptable argument of this kind (then it is not a bad value)."""
    if kind == "id":
        return type(value) in (str, int)
    if kind == "position":
        return type(value) is int and 0 <= value <= MAX_POSITION
    if kind == "rows":
        return isinstance(value, torch.Tensor) and value.dim() == 3
    if kind == "hash":
        return type(value) is bytes and len(value) > 0
    if kind == "element":  # one integer of an index array (numpy and 0-d torch integers too)
        is_integer = isinstance(value, (int, np.integer)) or (
            isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point()
        )
        return is_integer and type(value) is not bool and 0 <= int(value) <= MAX_POSITION
    if kind == "sequence":  # an empty collection is a valid "nothing to do"
        return isinstance(value, (list, tuple, dict)) and not value
    if kind == "array":  # a batched call's index array for one request
        return isinstance(value, (list, tuple)) and len(value) == 1 and valid("element", value[0])
    if kind == "slots":  # None: look the slots up
        return value is None or valid("array", value)
    return False


ROWS2 = torch.arange(12).reshape(2, *ROW)
ROWS_OF_A_PAGE = torch.arange(PAGE * 6).reshape(PAGE, *ROW)
# call name -> (function of the argument list, the valid arguments, their kinds, the error type)
CALLS = {
    "capture": (lambda c, a: c.capture(*a), ("a", 6, ROWS2), ("id", "position", "rows"), RoutedExpertsCacheError),
    "add_block_hashes": (lambda c, a: c.add_block_hashes(a[0], [a[1]]), ("a", b"a1"), ("id", "hash"),
                         RoutedExpertsCacheError),
    "add_block_hashes sequence": (lambda c, a: c.add_block_hashes("a", a[0]), ([b"a1"],), ("sequence",),
                                  InvalidCaptureError),
    "add_block_hashes_batch": (lambda c, a: c.add_block_hashes_batch([a[0]], [[a[1]]]), ("a", b"a1"),
                               ("id", "hash"), RoutedExpertsCacheError),
    "retain": (lambda c, a: c.retain([a[0]]), (b"a0",), ("hash",), InvalidCaptureError),
    "retain sequence": (lambda c, a: c.retain(a[0]), ([b"a0"],), ("sequence",), InvalidCaptureError),
    "release": (lambda c, a: c.release([a[0]]), (b"a0",), ("hash",), InvalidCaptureError),
    "release sequence": (lambda c, a: c.release(a[0]), ([],), ("sequence",), InvalidCaptureError),
    "read": (lambda c, a: c.read(*a), ("a", 0, 6), ("id", "position", "position"), RoutedExpertsCacheError),
    "capture_batch source": (lambda c, a: c.capture_batch(a[0], ["a"], [6], [0], [2]), (ROWS2,), ("rows",),
                             InvalidCaptureError),
    "capture_batch ids": (lambda c, a: c.capture_batch(ROWS2, a[0], [6], [0], [2]), (["a"],), ("sequence",),
                          RoutedExpertsCacheError),
    "capture_batch span": (lambda c, a: c.capture_batch(ROWS2, [a[0]], [a[1]], [a[2]], [a[3]]), ("a", 6, 0, 2),
                           ("id", "element", "element", "element"), RoutedExpertsCacheError),
    "capture_batch arrays": (lambda c, a: c.capture_batch(ROWS2, ["a"], *a), ([6], [0], [2]), ("array",) * 3,
                             InvalidCaptureError),
    "capture_batch slots": (lambda c, a: c.capture_batch(ROWS2, ["a"], [6], [0], [2], slots=a[0]), ([0],),
                            ("slots",), RoutedExpertsCacheError),
    "read_batch ids": (lambda c, a: c.read_batch(a[0], [0], [6]), (["a"],), ("sequence",), RangeUnavailableError),
    "read_batch interval": (lambda c, a: c.read_batch([a[0]], [a[1]], [a[2]]), ("a", 0, 6), ("id", "element", "element"),
                            RoutedExpertsCacheError),
    "read_batch arrays": (lambda c, a: c.read_batch(["a"], *a), ([0], [6]), ("array",) * 2, RangeUnavailableError),
    "read_batch slots": (lambda c, a: c.read_batch(["a"], [0], [6], slots=a[0]), ([0],), ("slots",),
                         RoutedExpertsCacheError),
    "slots": (lambda c, a: c.slots([a[0]]), ("a",), ("id",), RoutedExpertsCacheError),
    "finish": (lambda c, a: c.finish(a[0]), ("a",), ("id",), RoutedExpertsCacheError),
    "rewind": (lambda c, a: c.rewind(*a), ("a", 2), ("id", "position"), RoutedExpertsCacheError),
    "import_blocks": (lambda c, a: c.import_blocks([a[0]], a[1]), (b"z0", ROWS_OF_A_PAGE), ("hash", "rows"),
                      InvalidCaptureError),
    "import_blocks sequence": (lambda c, a: c.import_blocks(a[0], ROWS_OF_A_PAGE), ([b"z0"],), ("sequence",),
                               InvalidCaptureError),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("call_name", sorted(CALLS))
def test_every_wrong_value_in_every_argument_is_refused_without_change(backend, call_name):
    """Each value of BAD_VALUES that is wrong for an argument, in each argument of the call:
    all of them, not a sample (a sample left a wrong id unchecked in one call unnoticed)."""
    call, arguments, kinds, error = CALLS[call_name]
    cache = populated(backend, torch.uint8)
    before = observe(cache)
    refused = 0
    for position, kind in enumerate(kinds):
        for bad in BAD_VALUES:
            if valid(kind, bad) or (kind == "id" and type(bad) is int):  # an unknown int id is no type error
                continue
            wrong = list(arguments)
            wrong[position] = bad
            try:
                call(cache, wrong)
            except error:
                refused += 1
            except Exception as exc:  # noqa: BLE001 - named below, with the value that raised it
                pytest.fail(f"{call_name}: {bad!r} as argument {position} raised {type(exc).__name__}: {exc}")
            else:
                pytest.fail(f"{call_name}: {bad!r} as argument {position} was accepted")
            assert_unchanged(before, observe(cache))
    assert refused >= len(BAD_VALUES) // 2
    cache.check_consistency()


POSITION_CALLS = {  # every call that takes a position, with one bad position in each place
    "capture": lambda c, p: c.capture("n", p, ROWS2),
    "capture continuing": lambda c, p: c.capture("b", p, ROWS2),
    "capture_batch start": lambda c, p: c.capture_batch(ROWS2, ["b", "n"], [3, p], [0, 0], [1, 1]),
    "capture_batch continuing": lambda c, p: c.capture_batch(ROWS2, ["a", "b"], [6, p], [0, 1], [1, 1]),
    "read end": lambda c, p: c.read("a", 0, p),
    "read start": lambda c, p: c.read("a", p, p + 1),
    "read_batch": lambda c, p: c.read_batch(["b", "a"], [0, 0], [3, p]),
    "read_batch start": lambda c, p: c.read_batch(["b", "a"], [0, p], [3, p + 1]),
    "rewind": lambda c, p: c.rewind("a", p),
}


BOOL_BESIDE_INTS_CALLS = {  # a batched call's index arrays (list or tuple w), one element a bool among ints
    "capture_batch starts": lambda c, b, w: c.capture_batch(ROWS2, ["b", "n"], w([3, b]), [0, 1], [1, 1]),
    "capture_batch source starts": lambda c, b, w: c.capture_batch(ROWS2, ["b", "n"], [3, 0], w([0, b]), [1, 1]),
    "capture_batch counts": lambda c, b, w: c.capture_batch(ROWS2, ["b", "n"], [3, 0], [0, 1], w([1, b])),
    "capture_batch slots": lambda c, b, w: c.capture_batch(ROWS2, ["a", "b"], [6, 3], [0, 1], [1, 1], slots=w([b, 1])),
    "read_batch starts": lambda c, b, w: c.read_batch(["b", "a"], w([0, b]), [3, 2]),
    "read_batch ends": lambda c, b, w: c.read_batch(["b", "a"], [0, 0], w([3, b])),
    "read_batch slots": lambda c, b, w: c.read_batch(["a", "b"], [0, 0], [2, 3], slots=w([0, b])),
}


@pytest.mark.parametrize("call_name", sorted(BOOL_BESIDE_INTS_CALLS))
@pytest.mark.parametrize("flag", [True, False, np.True_, np.False_], ids=repr)
@pytest.mark.parametrize("wrap", [list, tuple], ids=lambda w: w.__name__)
def test_a_bool_beside_ints_in_a_batched_call_is_refused_without_change(call_name, flag, wrap):
    """``read("a", True, 1)`` is refused; so is a bool among the integers of a batched call's
    index sequence (numpy would fold it into an int array), with nothing changed."""
    cache = RoutedExpertsCache(6, PAGE, ROW, device=TEST_DEVICE)
    cache.capture("a", 0, torch.arange(36).reshape(6, *ROW) % 100)
    cache.capture("b", 0, torch.arange(18).reshape(3, *ROW) % 50 + 7)
    before = observe(cache)
    with pytest.raises(RoutedExpertsCacheError, match="bool"):
        BOOL_BESIDE_INTS_CALLS[call_name](cache, flag, wrap)
    assert_unchanged(before, observe(cache))


SLOT_CALLS = {  # the batched calls that take slots, with one slot (for request "a") outside the slot arrays
    "capture_batch": lambda c, s: c.capture_batch(ROWS2, ["a", "b"], [6, 3], [0, 1], [1, 1], slots=[s, 1]),
    "read_batch": lambda c, s: c.read_batch(["b", "a"], [0, 0], [3, 6], slots=[1, s]),
}


@pytest.mark.parametrize("call_name", sorted(SLOT_CALLS))
@pytest.mark.parametrize("slot", [-1, -(2**63), 2, 16, 2**40, 2**63 - 1], ids=repr)
def test_a_slot_outside_the_slot_arrays_is_refused_without_change(call_name, slot):
    """A slot below 0 or past the live slots (beside a valid one, past the arrays' capacity too)
    is refused as not coming from ``slots()``, before it indexes anything."""
    cache = populated("torch")
    assert cache.slots(["a", "b"]).tolist() == [0, 1]
    before = observe(cache)
    with pytest.raises(RoutedExpertsCacheError, match=r"slots must come from slots\(\); got values outside \[0, 2\)"):
        SLOT_CALLS[call_name](cache, slot)
    assert_unchanged(before, observe(cache))


# The batched calls' index arrays, valid for the requests ["a", "b"] (or their first n).
BATCH_ARRAYS = {
    "capture_batch": {"starts": [6, 3], "source starts": [0, 1], "counts": [1, 1], "slots": [0, 1]},
    "read_batch": {"starts": [0, 0], "ends": [6, 3], "slots": [0, 1]},
}
LENGTH_CASES = [(["a", "b"], [0]), (["a"], []), ([], [0]), ([], [0, 0])]


def _batched(call: str, name: str, ids: list, values: list):
    """``call`` for the requests ``ids`` with valid arrays but the one named, which gets ``values``."""
    arrays = {key: valid[: len(ids)] for key, valid in BATCH_ARRAYS[call].items()} | {name: values}
    if call == "capture_batch":
        return lambda c: c.capture_batch(ROWS2, ids, arrays["starts"], arrays["source starts"], arrays["counts"],
                                         slots=arrays["slots"])
    return lambda c: c.read_batch(ids, arrays["starts"], arrays["ends"], slots=arrays["slots"])


@pytest.mark.parametrize("call, name", [(call, name) for call, arrays in BATCH_ARRAYS.items() for name in arrays])
@pytest.mark.parametrize("ids, values", LENGTH_CASES, ids=repr)
def test_an_index_array_of_another_length_than_the_requests_is_refused_without_change(call, name, ids, values):
    """One value too few or too many, also for no requests or an empty array: never a call
    that quietly does less (or nothing) for a request it was given."""
    cache = populated("torch")
    before = observe(cache)
    with pytest.raises(RoutedExpertsCacheError, match=f"{name} must be {len(ids)} integers, got .* of shape \\({len(values)},\\)"):
        _batched(call, name, ids, values)(cache)
    assert_unchanged(before, observe(cache))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("call_name", sorted(POSITION_CALLS))
@pytest.mark.parametrize("past", [1, 4, 2**20, 2**40, 2**62], ids=lambda p: f"limit+{p}")
def test_positions_past_the_limit_are_refused_in_every_call_without_change(backend, call_name, past):
    """A position past ``max_position`` (here 64, and the default) is refused by every call
    that takes one, with a typed error and nothing changed (no request registered, no page
    taken, no counter moved), before any arithmetic on it can overflow or allocate."""
    cache = populated(backend, max_position=64)
    before = observe(cache)
    with pytest.raises(RoutedExpertsCacheError, match="max_position 64"):
        POSITION_CALLS[call_name](cache, 64 + past)
    assert_unchanged(before, observe(cache))
    cache.check_consistency()


# The largest position each call of POSITION_CALLS takes: captures end past it by their rows
# (two, or one in the batched spans), reads by one row where the position is a start.
AT_THE_LIMIT = {"capture": 62, "capture continuing": 62, "capture_batch start": 63, "capture_batch continuing": 63,
                "read end": 64, "read start": 63, "read_batch": 64, "read_batch start": 63, "rewind": 64}


@pytest.mark.parametrize("call_name", sorted(POSITION_CALLS))
def test_positions_at_the_limit_pass_its_check_in_every_call(call_name):
    """The limit is inclusive: at ``max_position`` (64 here) no call refuses for it. The call
    may still refuse for another reason (a first capture off a page boundary, rows that do
    not exist), never naming the limit."""
    cache = populated("auto", max_position=64)
    try:
        POSITION_CALLS[call_name](cache, AT_THE_LIMIT[call_name])
    except RoutedExpertsCacheError as error:
        assert "max_position" not in str(error)
    with pytest.raises(RoutedExpertsCacheError, match="max_position 64"):
        POSITION_CALLS[call_name](cache, AT_THE_LIMIT[call_name] + 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("call_name", ["capture_step", "capture_step_arrays", "capture_step_small"])
def test_an_engine_step_past_the_limit_is_refused_without_change(backend, call_name, monkeypatch):
    """The engine's calls (spans as arrays, or as lists from the connector's small-batch
    commit; above ``SMALL_BATCH`` requests, array passes) take continuing spans on free pages
    by a shortcut: a span ending past ``max_position`` still fails, naming its request, with
    nothing changed, and one ending at it is taken."""
    if call_name == "capture_step_arrays":
        monkeypatch.setattr(batch_size, "SMALL_BATCH", 0)
    cache = RoutedExpertsCache(32, PAGE, ROW, device=TEST_DEVICE, backend=backend, max_position=64)
    cache.capture("a", 0, torch.arange(36).reshape(6, *ROW) % 100)
    cache.capture("b", 0, torch.arange(18).reshape(3, *ROW) % 50 + 7)
    rows = (torch.arange(62 * 6).reshape(62, *ROW) % 90).to(cache.device, cache.dtype)

    def step(counts):
        ids, slots, starts, source_starts = ["b", "a"], cache.slots(["b", "a"]), [3, 6], [0, 2]
        if call_name != "capture_step_small":
            as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
            cache.capture_step(rows, ids, slots, as_array(starts), as_array(source_starts), as_array(counts))
        else:
            cache.capture_step_small(rows, ids, slots, starts, source_starts, counts, list(map(add, starts, counts)))

    before = observe(cache)
    with pytest.raises(InvalidCaptureError, match="request 'a': .* max_position 64"):
        step([1, 59])  # "a" would end at 65
    assert_unchanged(before, observe(cache))
    step([2, 58])  # "a" ends at 64, the limit
    assert torch.equal(cache.read("a", 6, 64), rows[2:60])
    assert torch.equal(cache.read("b", 3, 5), rows[0:2])
    cache.check_consistency()



@pytest.mark.parametrize("start", [2**31, 2**40, 2**62, 2**63 - 4, 2**63, 2**64])
def test_a_first_capture_far_out_is_refused_untouched_with_the_default_limit(start):
    """The reported bug: a first capture at 2**40 took a page, registered the request and
    moved prefix_hit_rows before failing with numpy's MemoryError; 2**63 left an empty request."""
    cache = RoutedExpertsCache(8, 16, (2,), torch.int32, backend="torch")
    fresh = cache.stats(), cache.page_states()
    with pytest.raises(InvalidCaptureError, match=r"'r'.*max_position 2147483648"):
        cache.capture("r", start, torch.ones(3, 2, dtype=torch.int32))
    assert (cache.stats(), cache.page_states()) == fresh and cache.stats()["free"] == 8
    with pytest.raises(RangeUnavailableError):
        cache.read("r", 0, 1)  # no request was left behind


def test_the_block_table_grows_with_what_requests_hold_not_how_far_out_they_start():
    cache = RoutedExpertsCache(8, 16, (2,), torch.int32, backend="torch")
    far = 2**31 - 64  # just inside the default limit
    cache.capture("far", far, torch.arange(96).reshape(48, 2).to(torch.int32))
    cache.capture("near", 0, torch.ones(20, 2, dtype=torch.int32))
    assert cache._slots.table.shape[1] <= 16  # was 2**27 columns (a row per slot), GiBs
    assert torch.equal(cache.read("far", far, far + 48), torch.arange(96).reshape(48, 2).to(torch.int32))
    assert cache.read_batch(["far", "near"], [far + 40, 0], [far + 48, 20])[1].tolist() == [0, 8, 28]
    cache.capture_batch(torch.ones(16, 2, dtype=torch.int32), ["far"], [far + 48], [0], [16])
    assert torch.equal(cache.read("far", far + 56, far + 64), torch.ones(8, 2, dtype=torch.int32))
    with pytest.raises(InvalidCaptureError, match="max_position"):
        cache.capture("far", far + 64, torch.ones(1, 2, dtype=torch.int32))
    cache.check_consistency()


@pytest.mark.parametrize("bad_row, named", [(0, "'a': row at position 0"), (2, "'a': row at position 2"),
                                            (3, "'b': row at position 4"), (5, "'b': row at position 6")])
def test_an_id_outside_the_pool_dtype_in_a_batch_is_named_by_its_own_span(bad_row, named):
    """Two spans side by side in one source: the bad row is named by the span that holds it
    (the next span's first row included), at that request's position."""
    cache = RoutedExpertsCache(8, PAGE, ROW, dtype=torch.uint8, device=TEST_DEVICE, backend="torch")
    source = torch.zeros((6, *ROW), dtype=torch.int32)
    source[bad_row, 1, 2] = 256
    with pytest.raises(InvalidCaptureError, match=f"{named} of capture .*first at index \\(1, 2\\) .*id 256"):
        cache.capture_batch(source, ["a", "b"], [0, 4], [0, 3], [3, 3])
    assert cache.stats()["captured_rows"] == 0


@pytest.mark.parametrize("bad_row", [0, PAGE - 1, PAGE, 2 * PAGE - 1])
def test_an_id_outside_the_pool_dtype_in_an_import_is_refused_by_its_row(bad_row):
    """Imported blocks are checked from their first row to their last: narrowing the bad id
    would publish a wrong row under the block's hash."""
    cache = RoutedExpertsCache(8, PAGE, ROW, dtype=torch.uint8, device=TEST_DEVICE, backend="torch")
    rows = torch.zeros((2 * PAGE, *ROW), dtype=torch.int64)
    rows[bad_row, 1, 2] = 256
    before = cache.stats()
    with pytest.raises(InvalidCaptureError, match=f"row at position {bad_row} of capture \\[0, {2 * PAGE}\\) .*id 256"):
        cache.import_blocks([b"z0", b"z1"], rows)
    assert cache.stats() == before
    cache.add_block_hashes("i", [b"z0", b"z1"])
    with pytest.raises(RangeUnavailableError):
        cache.read("i", 0, 1)


def test_uint64_integers_past_int64_are_refused_as_such():
    """numpy's uint64 holds values int64 cannot; they are refused by name, and int64's
    largest value passes (a later check weighs it against ``max_position``)."""
    from routed_experts_cache.connector.checks import index_array

    with pytest.raises(RoutedExpertsCacheError, match=f"starts must fit int64, got {2**63}"):
        index_array(np.array([0, 2**63], dtype=np.uint64), "starts", 2)
    edge = index_array(np.array([2**63 - 1], dtype=np.uint64), "starts", 1)
    assert edge.dtype == np.int64 and edge.tolist() == [2**63 - 1]
