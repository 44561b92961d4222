"""The paged, device-resident cache of routing rows.

Rows live in one pool tensor ``pages[num_pages, page_size, *row_shape]``. Each request is an
ordered block map: the blocks it captured itself (``own_pages``, from ``first_block`` on) and,
before those, prefix blocks that resolve through the published index by block hash. Every
page is in exactly one state:

- free: in ``_free``;
- tail / pending / duplicate: owned by one request (partly filled / full without hash /
  full with a hash that was already published by an earlier page);
- published: ``_index[key] -> page``, shared. Pins are counted per key: a request pins the
  hashes it reads through the index (its prefix blocks; before its first capture, every hash
  it is given) and those of its own published pages; ``retain`` pins from outside. Nothing
  pins a page no one will read. A published page whose key has no pin is in ``_evictable``,
  whose order is the eviction order (oldest first).

Reads walk the block map, so published, pending and tail blocks are one lookup. Rows move on
the device with one scatter per capture call and one gather per read call.

Every request also has a slot: its cursor and first captured block live in slot-indexed arrays,
and a block table ``[slots, blocks]`` mirrors its own pages. The batched calls an engine makes
every step (``capture_batch``, ``read_batch``) work on those arrays with a constant number of
numpy operations; Python runs only per new page, per completed block and for the rare spans
the arrays do not cover (first captures, prefix reads), which take the per-request path.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import chain, islice, repeat
from math import prod

import numpy as np
import torch

from ..kernels import as_row_words, copy_segments_torch, interpreting, load_triton_copy, precompile_triton_copy
from .errors import CacheFullError, InvalidCaptureError, RangeUnavailableError, RoutedExpertsCacheError

POOL_DTYPES = (torch.uint8, torch.uint16, torch.int16, torch.int32)
_INTEGER_DTYPES = (
    torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32, torch.int32, torch.uint64, torch.int64,
)


class _Request:
    """A request's block map; its cursor (next position to capture) is ``cache._cursor[slot]``."""

    __slots__ = ("slot", "hashes", "first_block", "own_pages", "num_settled")

    def __init__(self) -> None:
        self.slot = -1  # index into the cache's slot arrays once registered
        self.hashes: list[bytes] = []  # block i <-> hashes[i]
        self.first_block: int | None = None  # first block captured by the request itself
        self.own_pages: list[int] = []  # pages of blocks first_block, first_block + 1, ...
        self.num_settled = 0  # own full blocks already published (or found duplicate)

    def own_start(self, page_size: int) -> int:
        if self.first_block is None:  # nothing captured yet: every hashed block is a prefix block
            return len(self.hashes) * page_size
        return self.first_block * page_size


def _check_request_id(request_id) -> None:
    if type(request_id) is not str and type(request_id) is not int:  # bool and numpy ints are refused
        raise RoutedExpertsCacheError(f"request id must be a str or int, got {request_id!r}")


def _check_position(name: str, value, request_id) -> int:
    if type(value) is not int:
        raise RoutedExpertsCacheError(f"request {request_id!r}: {name} must be an int, got {value!r}")
    return value


def _as_list(values, what: str, error: type[RoutedExpertsCacheError] = InvalidCaptureError) -> list:
    """``list(values)`` for a sequence argument; one value or a non-iterable is refused."""
    if isinstance(values, (bytes, bytearray, str, torch.Tensor)) or not isinstance(values, Iterable):
        raise error(f"{what} must be a sequence (a list or another iterable), got {type(values).__name__}")
    return list(values)


def _index_array(values, what: str, length: int, error: type[RoutedExpertsCacheError] = RoutedExpertsCacheError) -> np.ndarray:
    """A 1-D int64 array of ``length`` integers (numpy, torch CPU or a sequence of ints)."""
    try:
        array = np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise error(f"{what} must be integers, got {type(values).__name__}: {exc}") from exc
    if array.shape == (0,) and length == 0:
        return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64
    if array.dtype.kind not in "iu" or array.shape != (length,):
        raise error(f"{what} must be {length} integers, got {array.dtype} of shape {array.shape}")
    if array.dtype == np.uint64 and length and array.max() > np.iinfo(np.int64).max:
        raise error(f"{what} must fit int64, got {array.max()}")
    return array.astype(np.int64, copy=False)


def _all_hashes(values: list) -> bool:
    """Whether every value is non-empty bytes (two C-level passes, no Python loop)."""
    return set(map(type, values)) <= {bytes} and all(values)


def _check_hashes(hashes: list, what: str, request_id=None) -> None:
    if _all_hashes(hashes):
        return
    for block_hash in hashes:
        if type(block_hash) is not bytes or not block_hash:
            where = f"request {request_id!r}: " if request_id is not None else ""
            raise InvalidCaptureError(f"{where}{what} must be non-empty bytes, got {block_hash!r}")


def checked_hash_lists(request_ids, hash_lists) -> tuple[list, list[list[bytes]]]:
    """``(request_ids, hash_lists)`` as lists, each hash list a list of non-empty bytes; raise
    the error ``add_block_hashes_batch`` would, before anything is added."""
    request_ids = _as_list(request_ids, "request ids for block hashes")
    hash_lists = _as_list(hash_lists, "block hash lists")
    if len(hash_lists) != len(request_ids):
        raise InvalidCaptureError(f"{len(request_ids)} request ids but {len(hash_lists)} block hash lists")
    if not set(map(type, request_ids)) <= {str, int}:
        for request_id in request_ids:
            _check_request_id(request_id)
    for i, hashes in enumerate(hash_lists):
        if type(hashes) is not list:
            hash_lists[i] = _as_list(hashes, f"request {request_ids[i]!r}: block hashes")
    if not _all_hashes(list(chain.from_iterable(hash_lists))):
        for request_id, hashes in zip(request_ids, hash_lists):
            _check_hashes(hashes, "block hashes", request_id)  # names the first bad one
    return request_ids, hash_lists


def _format_ranges(ranges: list[tuple[int, int]]) -> str:
    return " ".join(f"[{a}, {b})" for a, b in ranges) if ranges else "nothing"


class RoutedExpertsCache:
    """Paged cache of MoE routing rows, keyed per request and shared by block hash."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        row_shape: Sequence[int],
        dtype: torch.dtype = torch.uint8,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RoutedExpertsCacheError(f"{name} must be a positive int, got {value!r}")
        row_shape = tuple(row_shape)
        if not row_shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in row_shape):
            raise RoutedExpertsCacheError(f"row_shape must be positive ints, got {row_shape!r}")
        if dtype not in POOL_DTYPES:
            raise RoutedExpertsCacheError(f"dtype must be one of {POOL_DTYPES}, got {dtype!r}")
        device = torch.device(device)
        if backend not in ("auto", "triton", "torch"):
            raise RoutedExpertsCacheError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        if backend == "triton" and device.type == "cpu" and not interpreting():
            raise RoutedExpertsCacheError(
                "backend='triton' on a CPU device needs TRITON_INTERPRET=1 set before Triton "
                "kernels are first imported"
            )
        self.page_size = page_size
        self.row_shape = row_shape
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.pages = torch.zeros((num_pages, page_size, *row_shape), dtype=dtype, device=device)
        self._pool_words = as_row_words(self.pages.view(num_pages * page_size, -1))
        self._copy = load_triton_copy() if backend == "triton" else copy_segments_torch
        if backend == "triton" and not interpreting():
            precompile_triton_copy(self._pool_words)  # no compile stalls once serving starts
        self.generation = 0
        self._clear()

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def row_nbytes(self) -> int:
        return prod(self.row_shape) * self.pages.element_size()

    def _clear(self) -> None:
        self._free: deque[int] = deque(range(self.num_pages))
        self._index: dict[bytes, int] = {}
        self._pins: Counter[bytes] = Counter()  # all pins: requests' hashes and retained ones
        self._retained: Counter[bytes] = Counter()  # pins taken by retain(), for release()
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._requests: dict[object, _Request] = {}
        self._counters = Counter()
        self._slot_of: dict[object, int] = {}
        self._slot_requests: list[_Request | None] = []
        self._free_slots: list[int] = []
        self._cursor = np.zeros(16, dtype=np.int64)  # per slot: next position to capture
        self._first_block = np.full(16, -1, dtype=np.int64)  # per slot: first own block, -1 before
        self._table = np.full((16, 16), -1, dtype=np.int64)  # per slot and block: own page
        self._slot_ids = np.full(16, None, dtype=object)  # per slot: its request id (checks given slots)

    def _register(self, request_id, request: _Request) -> None:
        """Give a new request a slot (all bookkeeping arrays grow by doubling)."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._slot_requests)
            self._slot_requests.append(None)
            if slot == len(self._cursor):
                self._cursor = np.concatenate([self._cursor, np.zeros_like(self._cursor)])
                self._first_block = np.concatenate([self._first_block, np.full_like(self._first_block, -1)])
                self._table = np.concatenate([self._table, np.full_like(self._table, -1)])
                self._slot_ids = np.concatenate([self._slot_ids, np.full_like(self._slot_ids, None)])
        request.slot = slot
        self._slot_of[request_id] = slot
        self._slot_requests[slot] = request
        self._slot_ids[slot] = request_id
        self._cursor[slot] = 0
        self._first_block[slot] = -1 if request.first_block is None else request.first_block
        self._requests[request_id] = request

    def _cursor_of(self, request: _Request) -> int:
        return int(self._cursor[request.slot]) if request.slot >= 0 else 0

    def _set_table(self, slots, blocks, pages) -> None:
        """Mirror own pages into the block table (``table[slots, blocks] = pages``), widening it."""
        width = int(np.max(blocks)) + 1
        if width > self._table.shape[1]:
            grown = np.full((self._table.shape[0], 1 << (width - 1).bit_length()), -1, dtype=np.int64)
            grown[:, : self._table.shape[1]] = self._table
            self._table = grown
        self._table[slots, blocks] = pages

    # ----------------------------------------------------------------- capture

    def capture(self, request_id, start: int, rows: torch.Tensor) -> None:
        """Store ``rows[n, *row_shape]`` as positions ``start .. start + n - 1``."""
        self.capture_many([(request_id, start, rows)])

    def capture_many(self, items: Iterable[tuple[object, int, torch.Tensor]]) -> None:
        """Validate every item, then write all of them with one device launch."""
        items = _as_list(items, "capture items")
        spans, offset = [], 0
        for item in items:
            if type(item) is not tuple or len(item) != 3:
                raise InvalidCaptureError(f"a capture item is (request_id, start, rows), got {item!r}")
            self._check_rows(item[0], item[2])
            spans.append((item[0], item[1], offset, item[2].shape[0]))
            offset += item[2].shape[0]
        plans, num_new_pages = self._plan_captures(offset, spans)
        for (_, _, rows), (request_id, start, _, count) in zip(items, spans):
            self._check_values(rows, [(request_id, start, 0, count)])
        if plans:
            self._write(plans, num_new_pages, self._source_words([rows for _, _, rows in items]))

    def capture_from(self, source: torch.Tensor, spans: Iterable[tuple[object, int, int, int]]) -> None:
        """Capture slices of one row tensor: ``(request_id, start, source_start, count)``.

        The batched form the vLLM adapter uses: a step's snapshot is captured where it lies
        (narrowed once if needed), with one scatter for all requests.
        """
        spans = _as_list(spans, "capture spans")
        self._check_rows("<batch>", source)
        plans, num_new_pages = self._plan_captures(source.shape[0], spans)
        self._check_values(source, spans)
        if plans:
            self._write(plans, num_new_pages, self._source_words([source]))

    # ------------------------------------------------- batched calls (engine steps)

    def slots(self, request_ids: Sequence) -> np.ndarray:
        """The slot of each request, registering unknown ones (as ``add_block_hashes(id, [])``).

        Slots can be handed to ``capture_batch`` and ``read_batch`` to skip their lookup; one
        stays valid until its request is finished or the cache reset.
        """
        request_ids = _as_list(request_ids, "request ids", RoutedExpertsCacheError)
        slots = self._lookup_slots(request_ids)
        for i in np.flatnonzero(slots < 0).tolist():
            if request_ids[i] not in self._slot_of:  # an id listed twice is registered once
                self._register(request_ids[i], _Request())
            slots[i] = self._slot_of[request_ids[i]]
        return slots

    def _lookup_slots(self, request_ids: list) -> np.ndarray:
        """Slots of known requests, -1 for unknown ones; ids of the wrong type are refused."""
        if not set(map(type, request_ids)) <= {str, int}:
            for request_id in request_ids:
                _check_request_id(request_id)
        return np.fromiter(map(self._slot_of.get, request_ids, repeat(-1)), dtype=np.int64, count=len(request_ids))

    def _batch_slots(self, request_ids: list, slots) -> np.ndarray:
        """Given slots are checked against the ids (a stale slot must never read another's rows)."""
        if slots is None:
            return self._lookup_slots(request_ids)
        slots = _index_array(slots, "slots", len(request_ids))
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self._slot_requests)):
            raise RoutedExpertsCacheError(f"slots must come from slots(); got values outside [0, {len(self._slot_requests)})")
        owners = self._slot_ids[slots].tolist()
        if owners != request_ids:
            i = next(i for i, (owner, request_id) in enumerate(zip(owners, request_ids)) if owner != request_id)
            raise RoutedExpertsCacheError(
                f"slot {slots[i]} does not belong to request {request_ids[i]!r} (slots stay valid until "
                f"their request finishes or the cache is reset)"
            )
        return slots

    def capture_batch(self, source: torch.Tensor, request_ids: Sequence, starts, source_starts, counts, slots=None) -> None:
        """``capture_from(source, zip(request_ids, starts, source_starts, counts))`` with arrays.

        The form an engine step uses: spans that continue a request's captured rows are
        planned, copied and committed with array operations over the batch; the others (first
        captures, a request listed twice, invalid spans) take ``capture_from``'s checks, and
        the whole call is still one scatter that either happens completely or not at all.
        """
        request_ids = _as_list(request_ids, "capture request ids")
        self._check_rows("<batch>", source)
        slots = self._batch_slots(request_ids, slots)
        n = len(request_ids)
        starts, source_starts, counts = (
            _index_array(values, name, n, InvalidCaptureError)
            for values, name in ((starts, "starts"), (source_starts, "source starts"), (counts, "counts"))
        )
        size, ends = self.page_size, starts + counts
        valid = (starts >= 0) & (source_starts >= 0) & (counts >= 0) & (source_starts + counts <= source.shape[0])
        active = counts != 0
        known = slots >= 0
        continuing = valid & active & known & (self._first_block[slots] >= 0) & (starts == self._cursor[slots])
        if continuing.any():
            listed = np.bincount(slots[active & known], minlength=len(self._slot_requests))
            continuing &= listed[slots] == 1
        others = np.flatnonzero(~continuing & (active | ~valid)).tolist()
        spans = [(request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i])) for i in others]
        plans, num_new_pages = self._plan_captures(source.shape[0], spans)
        if not self._fits_pool_dtype(source):
            self._check_values(source, [
                (request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i])) for i in np.flatnonzero(active).tolist()
            ])
        batch = None
        if continuing.any():
            pick = np.flatnonzero(continuing)
            starts, ends = starts[pick], ends[pick]
            new_pages = -(-ends // size) + (-starts // size)  # blocks begun past the cursor
            batch = (slots[pick], starts, source_starts[pick], counts[pick], new_pages)
        if plans or batch is not None:
            self._write(plans, num_new_pages, self._source_words([source]), batch)

    def _source_words(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The rows to copy, on the pool's device in its dtype, as aligned contiguous words.

        Runs before any state changes: a source that cannot be converted fails the call.
        """
        try:
            rows = [source.to(self.device, self.dtype) for source in sources]
            rows = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()
            if rows.data_ptr() % 16:  # a storage offset: word views and wide loads need alignment
                rows = rows.clone()
            return as_row_words(rows)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            raise InvalidCaptureError(
                f"rows on {sources[0].device} ({sources[0].dtype}) cannot be copied to the pool on "
                f"{self.device} ({self.dtype}): {error}"
            ) from error

    def _write(self, plans: list[tuple], num_new_pages: int, source_words: torch.Tensor, batch=None) -> None:
        """Copy the planned rows into their pages, then commit the bookkeeping.

        ``plans`` come from ``_plan_captures``; ``batch`` (from ``capture_batch``) holds
        continuing spans as arrays ``(slots, starts, source_starts, counts, new_pages)``.
        Nothing is changed before the copy: its target pages are chosen by looking ahead at
        the pages the allocation below will take (free ones first, then the oldest
        evictable, including pages that first captures of this call stop pinning), planned
        spans first, then the batch.
        """
        batch_new = int(batch[4].sum()) if batch is not None else 0
        releasing = self._released_by_first_captures(plans)
        available = len(self._free) + len(self._evictable) + len(releasing)
        if num_new_pages + batch_new > available:
            wanted = [f"{plan[0]!r} [{plan[2]}, {plan[2] + plan[4]})" for plan in plans]
            if batch is not None:
                wanted.append(f"{len(batch[0])} continuing requests ({batch_new} pages)")
            raise CacheFullError(
                f"capture of {', '.join(wanted)} needs {num_new_pages + batch_new} new pages; only "
                f"{len(self._free)} free and {available - len(self._free)} evictable of {self.num_pages} "
                f"(the rest are pinned or owned by live requests)"
            )
        from_free = list(islice(self._free, num_new_pages + batch_new))
        victims = list(islice(chain(self._evictable, releasing), num_new_pages + batch_new - len(from_free)))
        new_pages = from_free + [self._index[key] for key in victims]
        size, taken = self.page_size, 0
        seg_start, seg_source_row, seg_target_row = [0], [], []
        pages_after: dict[int, tuple[int, list[int]]] = {}  # per request: first block, pages after this call
        for _, request, start, source_row, count, num_new in plans:
            first_block, pages = pages_after.get(id(request)) or (
                request.first_block if request.first_block is not None else start // size, request.own_pages
            )
            if num_new:
                pages = pages + new_pages[taken : taken + num_new]
                taken += num_new
            pages_after[id(request)] = first_block, pages
            position, end = start, start + count
            while position < end:
                block = position // size
                run_end = min(end, block * size + size)
                seg_source_row.append(source_row)
                seg_target_row.append(pages[block - first_block] * size + position - block * size)
                seg_start.append(seg_start[-1] + run_end - position)
                source_row += run_end - position
                position = run_end
        descriptor = [np.array(seg_source_row, dtype=np.int64), np.array(seg_target_row, dtype=np.int64)]
        lengths = [np.diff(seg_start)]
        if batch is not None:
            slots, starts, source_starts, counts, num_new = batch
            span, block, first, end = self._page_runs(starts, starts + counts)
            first_new = -(-starts // size)  # the batch's first block without a page yet
            is_new = block >= first_new[span]
            batch_pages = np.array(new_pages[taken:], dtype=np.int64)
            new_offset = (np.cumsum(num_new) - num_new)[span] + block - first_new[span]
            table = self._table[slots[span], np.minimum(block, self._table.shape[1] - 1)]
            page = np.where(is_new, batch_pages[np.where(is_new, new_offset, 0)] if batch_new else 0, table)
            descriptor[0] = np.concatenate([descriptor[0], source_starts[span] + first - starts[span]])
            descriptor[1] = np.concatenate([descriptor[1], page * size + first - block * size])
            lengths.append(end - first)
        lengths = np.concatenate(lengths)
        try:
            self._copy_on_device(source_words, self._pool_words, lengths, *descriptor)
        except Exception:
            for key in victims:  # their rows may be partly overwritten: unpublish them (fail closed)
                self._evictable.pop(key, None)
                self._free.append(self._index.pop(key))
            raise
        # Every page is taken before any block settles: settling frees and pins pages, which
        # would change which pages the allocation takes from the ones the copy wrote.
        self._start_first_captures(plans)
        pages = [self._allocate_page() for _ in range(num_new_pages + batch_new)]
        self._commit_captures(plans, pages[:num_new_pages])
        if batch is not None:
            self._commit_batch(batch, pages[num_new_pages:])
        for _, request, *_ in plans:
            self._settle(request)
        if batch is not None:  # only requests that completed a block can have one to settle
            slots, starts, _, counts, _ = batch
            for slot in slots[(starts + counts) // size > starts // size].tolist():
                request = self._slot_requests[slot]
                if len(request.hashes) > request.first_block + request.num_settled:  # else nothing to settle
                    self._settle(request)
        self._counters["captured_rows"] += int(lengths.sum())

    def _page_runs(self, starts: np.ndarray, ends: np.ndarray):
        """Split intervals ``[starts[i], ends[i])`` at page boundaries, vectorised.

        Returns ``(span, block, first, end)`` per run: the interval it belongs to, its block,
        and its positions ``[first, end)``. Empty intervals give no run.
        """
        size = self.page_size
        first_block = starts // size
        runs = np.where(ends > starts, (ends - 1) // size - first_block + 1, 0)
        span = np.repeat(np.arange(len(starts)), runs)
        block = first_block[span] + np.arange(len(span)) - np.repeat(np.cumsum(runs) - runs, runs)
        return span, block, np.maximum(starts[span], block * size), np.minimum(ends[span], block * size + size)

    def _commit_batch(self, batch, pages: list[int]) -> None:
        """Apply the continuing spans of ``capture_batch``: new pages into the block maps and
        the block table, cursors (Python per new page only; blocks settle in ``_write``)."""
        slots, starts, _, counts, num_new = batch
        if pages:
            first_new = -(-starts // self.page_size)
            offsets = np.cumsum(num_new) - num_new
            page_slots = np.repeat(slots, num_new)
            blocks = np.repeat(first_new, num_new) + np.arange(len(pages)) - np.repeat(offsets, num_new)
            self._set_table(page_slots, blocks, pages)
            for slot, page in zip(page_slots.tolist(), pages):  # in block order per request
                self._slot_requests[slot].own_pages.append(page)
        self._cursor[slots] = starts + counts

    def _released_by_first_captures(self, plans: list[tuple]) -> list[bytes]:
        """Published hashes that become evictable when this call's first captures drop their
        pins on the request's own blocks, in the order they are released."""
        drops: Counter[bytes] = Counter()
        released, first_captures = [], set()
        for _, request, start, *_ in plans:
            if request.first_block is None and id(request) not in first_captures:
                first_captures.add(id(request))
                for block_hash in reversed(request.hashes[start // self.page_size :]):
                    drops[block_hash] += 1
                    if drops[block_hash] == self._pins[block_hash] and block_hash in self._index:
                        released.append(block_hash)
        return released

    def _start_first_captures(self, plans: list[tuple]) -> None:
        """First captures stop pinning their own blocks' hashes: the request reads its own
        pages there (the released pages are the ones ``_released_by_first_captures`` saw)."""
        for request_id, request, start, *_ in plans:
            if request.first_block is None:
                request.first_block = start // self.page_size
                if request.slot < 0:
                    self._register(request_id, request)
                self._first_block[request.slot] = request.first_block
                self._cursor[request.slot] = start
                self._counters["prefix_hit_rows"] += start
                self._unpin(reversed(request.hashes[request.first_block :]))

    def _commit_captures(self, plans: list[tuple], pages: list[int]) -> None:
        """Apply planned captures: their new pages (in plan order) and cursors."""
        taken, table_slots, table_blocks = 0, [], []
        for _, request, start, _, count, num_new in plans:
            if num_new:
                first = request.first_block + len(request.own_pages)
                table_slots += [request.slot] * num_new
                table_blocks += range(first, first + num_new)
                request.own_pages += pages[taken : taken + num_new]
                taken += num_new
            self._cursor[request.slot] = start + count
        if pages:
            self._set_table(table_slots, table_blocks, pages)

    def _copy_on_device(self, source, target, lengths, seg_source_row, seg_target_row) -> None:
        """One host-to-device descriptor copy, one kernel launch; segment i copies
        ``lengths[i]`` rows from ``seg_source_row[i]`` to ``seg_target_row[i]``."""
        n = len(lengths)
        descriptor = np.empty(3 * n + 1, dtype=np.int32)
        descriptor[0] = 0
        np.cumsum(lengths, out=descriptor[1 : n + 1])
        descriptor[n + 1 : 2 * n + 1] = seg_source_row
        descriptor[2 * n + 1 :] = seg_target_row
        on_device = torch.from_numpy(descriptor).to(self.device, non_blocking=True)
        self._copy(source, target, on_device[: n + 1], on_device[n + 1 : 2 * n + 1], on_device[2 * n + 1 :], int(descriptor[n]))

    def _check_rows(self, request_id, rows) -> None:
        if not isinstance(rows, torch.Tensor):
            raise InvalidCaptureError(f"request {request_id!r}: rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dtype not in _INTEGER_DTYPES:
            raise InvalidCaptureError(f"request {request_id!r}: rows must be an integer tensor, got {rows.dtype}")
        if rows.layout != torch.strided or rows.is_meta:
            raise InvalidCaptureError(
                f"request {request_id!r}: rows must be a dense tensor holding data, got {rows.layout} on {rows.device}"
            )
        if rows.dim() != 1 + len(self.row_shape) or tuple(rows.shape[1:]) != self.row_shape:
            raise InvalidCaptureError(
                f"request {request_id!r}: rows must have shape [n, {', '.join(map(str, self.row_shape))}], "
                f"got {list(rows.shape)}"
            )

    def _fits_pool_dtype(self, source: torch.Tensor) -> bool:
        wide, narrow = torch.iinfo(source.dtype), torch.iinfo(self.dtype)
        return wide.min >= narrow.min and wide.max <= narrow.max

    def _check_values(self, source: torch.Tensor, spans) -> None:
        """Refuse rows whose ids do not fit the pool dtype: narrowing them would store wrong ids.

        Costs nothing when the source dtype fits (the vLLM path); otherwise one reduction and
        one host copy of the offending row numbers. Each bound is compared only where the
        source dtype can exceed it, so the bound itself is representable there (torch narrows
        a Python scalar to the tensor's dtype: ``int8 > 255`` would wrap).
        """
        if self._fits_pool_dtype(source):
            return
        wide, narrow = torch.iinfo(source.dtype), torch.iinfo(self.dtype)
        values = source.flatten(1)
        if values.dtype == torch.uint64:  # no comparisons in torch: ids >= 2**63 read as negative
            values = values.view(torch.int64)
            bad = (values < 0) | (values > narrow.max)
        else:
            if values.dtype in (torch.uint16, torch.uint32):  # no comparisons in torch either
                values = values.to(torch.int64)
            below = values < narrow.min if wide.min < narrow.min else None
            above = values > narrow.max if wide.max > narrow.max else None
            bad = above if below is None else below if above is None else below | above
        bad_rows = bad.any(1).nonzero().flatten().cpu()
        if bad_rows.numel() == 0:
            return
        for request_id, start, source_start, count in spans:
            first_bad = int(torch.searchsorted(bad_rows, source_start))
            if first_bad < bad_rows.numel() and bad_rows[first_bad] < source_start + count:
                row = int(bad_rows[first_bad])
                raise InvalidCaptureError(
                    f"request {request_id!r}: row at position {start + row - source_start} of capture "
                    f"[{start}, {start + count}) holds ids outside the pool dtype {self.dtype} "
                    f"[{narrow.min}, {narrow.max}]: {source[row].flatten().tolist()}"
                )

    def _plan_captures(self, num_source_rows: int, spans) -> tuple[list[tuple], int]:
        """Check every span against the request cursors as they will be; change nothing.

        Returns ``(request_id, request, start, source_start, count, new pages)`` per span, and
        the number of new pages in all.
        """
        plans, size, num_new_pages = [], self.page_size, 0
        simulated: dict[object, tuple[_Request, int | None, int]] = {}
        for span in spans:
            if type(span) is not tuple or len(span) != 4:
                raise InvalidCaptureError(f"a capture span is (request_id, start, source_start, count), got {span!r}")
            request_id, start, source_start, count = span
            if not (type(start) is type(source_start) is type(count) is int and start >= 0 and source_start >= 0 and count >= 0):
                _check_request_id(request_id)
                for name, value in (("start", start), ("source_start", source_start), ("count", count)):
                    if _check_position(name, value, request_id) < 0:
                        raise InvalidCaptureError(f"request {request_id!r}: {name} must be >= 0, got {value}")
            if type(request_id) is not str:
                _check_request_id(request_id)
            if source_start + count > num_source_rows:
                raise InvalidCaptureError(
                    f"request {request_id!r}: rows [{source_start}, {source_start + count}) exceed the "
                    f"{num_source_rows} source rows"
                )
            if count == 0:
                continue
            known = simulated.get(request_id)
            if known is None:
                request = self._requests.get(request_id) or _Request()
                first_block, cursor = request.first_block, self._cursor_of(request)
            else:
                request, first_block, cursor = known
            if first_block is None:
                if start % size:
                    raise InvalidCaptureError(
                        f"request {request_id!r}: first capture must start on a page boundary "
                        f"(page size {size}), got position {start}"
                    )
                first_block, cursor = start // size, start
            elif start != cursor:
                kind = "gap" if start > cursor else "overlap"
                raise InvalidCaptureError(
                    f"request {request_id!r}: capture at [{start}, {start + count}) leaves a {kind}; "
                    f"captured rows are [{first_block * size}, {cursor}), next position {cursor}"
                )
            end = start + count
            new_pages = (end + size - 1) // size - (cursor + size - 1) // size  # blocks begun past the cursor
            num_new_pages += new_pages
            plans.append((request_id, request, start, source_start, count, new_pages))
            simulated[request_id] = (request, first_block, end)
        return plans, num_new_pages

    def _allocate_page(self) -> int:
        if self._free:
            return self._free.popleft()
        key, _ = self._evictable.popitem(last=False)
        self._counters["evictions"] += 1
        return self._index.pop(key)

    # ------------------------------------------------------------------ hashes

    def add_block_hashes(self, request_id, hashes: Iterable[bytes]) -> None:
        """Append block hashes (block i <-> hashes[i]); full captured blocks publish.

        Prefix blocks (before the request's first capture) are pinned while it lives: it
        reads them through the index. Its own blocks are pinned only once its page is the
        published one.
        """
        self.add_block_hashes_batch([request_id], [hashes])

    def add_block_hashes_batch(self, request_ids: Sequence, hash_lists: Sequence[Iterable[bytes]]) -> None:
        """``add_block_hashes(request_ids[i], hash_lists[i])`` for every i, in order; every
        id and hash is checked before any is added (an engine step's hashes in one call)."""
        request_ids, hash_lists = checked_hash_lists(request_ids, hash_lists)
        size = self.page_size
        for request_id, hashes in zip(request_ids, hash_lists):
            request = self._requests.get(request_id)
            if request is None:
                request = _Request()
                self._register(request_id, request)
            first_new = len(request.hashes)
            request.hashes += hashes
            first_block = request.first_block
            if first_block is None:
                self._pin(hashes)
            else:
                if first_new < first_block:
                    self._pin(hashes[: first_block - first_new])
                if first_block + request.num_settled < self._cursor[request.slot] // size:
                    self._settle(request)  # a full own block may have its hash now

    def retain(self, hashes: Iterable[bytes]) -> None:
        """Pin published (or future) blocks by hash, independent of any request."""
        hashes = _as_list(hashes, "retained hashes")
        _check_hashes(hashes, "retained hashes")
        self._retained.update(hashes)
        self._pin(hashes)

    def release(self, hashes: Iterable[bytes]) -> None:
        """Drop pins taken by ``retain``, in the given order (last released is evicted last)."""
        hashes = _as_list(hashes, "released hashes")
        _check_hashes(hashes, "released hashes")
        missing = [h.hex() for h, n in Counter(hashes).items() if self._retained[h] < n]
        if missing:
            raise RoutedExpertsCacheError(f"release of hashes that were not retained: {missing}")
        for block_hash in hashes:
            self._retained[block_hash] -= 1
            if not self._retained[block_hash]:
                del self._retained[block_hash]
        self._unpin(hashes)

    def _pin(self, hashes: list[bytes]) -> None:
        self._pins.update(hashes)
        if self._evictable and not self._evictable.keys().isdisjoint(hashes):
            for block_hash in hashes:
                self._evictable.pop(block_hash, None)

    def _unpin(self, hashes: Iterable[bytes]) -> None:
        for block_hash in hashes:
            self._pins[block_hash] -= 1
            if self._pins[block_hash] == 0:
                del self._pins[block_hash]
                if block_hash in self._index:
                    self._evictable[block_hash] = None

    def _pinned_hashes(self, request: _Request) -> list[bytes]:
        """The hashes a request pins, in block order: its prefix blocks (every hash before its
        first capture) and its own blocks whose page is the published one."""
        if request.first_block is None:
            return list(request.hashes)
        own = request.hashes[request.first_block : request.first_block + request.num_settled]
        return request.hashes[: request.first_block] + [
            block_hash for block_hash, page in zip(own, request.own_pages) if self._index.get(block_hash) == page
        ]

    def _settle(self, request: _Request) -> None:
        """Publish the request's full own blocks whose hashes are known.

        A hash that is already published keeps its page while anyone pins it (this request
        then keeps reading its own copy, a duplicate freed at finish); an unpinned one is
        replaced by this copy and its old page freed, so a recomputed block holds one page.
        """
        if request.first_block is None:
            return
        full_blocks = self._cursor_of(request) // self.page_size
        while True:
            block = request.first_block + request.num_settled
            if block >= full_blocks or block >= len(request.hashes):
                return
            block_hash = request.hashes[block]
            stale_page = self._index.get(block_hash)
            if stale_page is None or block_hash in self._evictable:
                if stale_page is not None:
                    self._free.append(stale_page)
                self._index[block_hash] = request.own_pages[request.num_settled]
                self._counters["published_blocks"] += 1
                self._pins[block_hash] += 1  # _pin of one hash, inlined: once per published block
                self._evictable.pop(block_hash, None)
            request.num_settled += 1

    # -------------------------------------------------------------------- read

    def read(self, request_id, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of a request as a new tensor ``[end - start, *row_shape]``."""
        return self.read_many([(request_id, start, end)])[0]

    def read_many(self, intervals: Iterable[tuple[object, int, int]]) -> list[torch.Tensor]:
        """Many intervals with one gather launch; each result is owned (never a pool view)."""
        packed, offsets = self.read_packed(intervals)
        return [packed[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

    def read_packed(self, intervals: Iterable[tuple[object, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """All intervals in one new tensor; interval i is ``packed[offsets[i]:offsets[i+1]]``.

        Every interval is located before anything is copied: a missing row fails the call.
        """
        seg_start, seg_source_row, offsets = [0], [], [0]
        for interval in _as_list(intervals, "read intervals", RangeUnavailableError):
            if type(interval) is not tuple or len(interval) != 3:
                raise RangeUnavailableError(f"an interval is (request_id, start, end), got {interval!r}")
            self._append_segments(interval[0], interval[1], interval[2], seg_source_row, seg_start)
            offsets.append(seg_start[-1])
        total = seg_start[-1]
        packed = torch.empty((total, *self.row_shape), dtype=self.dtype, device=self.device)
        self._copy_on_device(self._pool_words, as_row_words(packed), np.diff(seg_start), seg_source_row, seg_start[:-1])
        self._counters["read_rows"] += total
        return packed, offsets

    def read_batch(self, request_ids: Sequence, starts, ends, slots=None) -> tuple[torch.Tensor, np.ndarray]:
        """``read_packed(zip(request_ids, starts, ends))`` with arrays; offsets as an array.

        Intervals within a request's own captured rows are located with array operations
        over the batch; the others (prefix rows, unknown requests, invalid ranges) take
        ``read_packed``'s path and its errors. Nothing is copied unless every row exists.
        """
        request_ids = _as_list(request_ids, "read request ids", RangeUnavailableError)
        slots = self._batch_slots(request_ids, slots)
        n, size = len(request_ids), self.page_size
        starts, ends = (_index_array(v, w, n, RangeUnavailableError) for v, w in ((starts, "starts"), (ends, "ends")))
        first_block = self._first_block[slots]
        own = (slots >= 0) & (first_block >= 0) & (starts >= first_block * size) & (starts <= ends)
        own &= ends <= self._cursor[slots]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.maximum(ends - starts, 0), out=offsets[1:])
        pick = np.flatnonzero(own)
        span, block, first, end = self._page_runs(starts[pick], ends[pick])
        pages = self._table[slots[pick][span], block]
        source_rows, target_rows = [pages * size + first - block * size], [offsets[pick][span] + first - starts[pick][span]]
        lengths = [end - first]
        others = np.flatnonzero(~own).tolist()
        if others:  # one Python walk per interval: segments land at their packed offsets directly
            seg_source_row, seg_target_row, seg_end = [], [], []
            for i in others:
                seg_start = [int(offsets[i])]
                self._append_segments(request_ids[i], starts[i].item(), ends[i].item(), seg_source_row, seg_start)
                seg_target_row += seg_start[:-1]
                seg_end += seg_start[1:]
            source_rows.append(np.array(seg_source_row, dtype=np.int64))
            target_rows.append(np.array(seg_target_row, dtype=np.int64))
            lengths.append(np.array(seg_end, dtype=np.int64) - target_rows[-1])
        total = int(offsets[-1])
        packed = torch.empty((total, *self.row_shape), dtype=self.dtype, device=self.device)
        self._copy_on_device(
            self._pool_words, as_row_words(packed), np.concatenate(lengths), np.concatenate(source_rows),
            np.concatenate(target_rows),
        )
        self._counters["read_rows"] += total
        return packed, offsets

    def _append_segments(self, request_id, start, end, seg_source_row: list, seg_start: list) -> None:
        """Append the pool segments covering [start, end); raise if any row is missing."""
        if type(request_id) is not str:
            _check_request_id(request_id)
        if type(start) is not int or type(end) is not int:
            _check_position("start", start, request_id)
            _check_position("end", end, request_id)
        if not 0 <= start <= end:
            raise RangeUnavailableError(f"request {request_id!r}: invalid range [{start}, {end})")
        request = self._requests.get(request_id)
        if request is None:
            raise RangeUnavailableError(
                f"request {request_id!r} is unknown (never captured, or finished); range [{start}, {end})"
            )
        if start == end:
            return
        size = self.page_size
        first_block, own_start = request.first_block, request.own_start(size)
        if end > own_start and end > self._cursor_of(request):
            raise self._unavailable(request_id, request, start, end)
        position, total = start, seg_start[-1]
        while position < end:
            block = position // size
            if position >= own_start:
                page = request.own_pages[block - first_block]
            else:
                page = self._index.get(request.hashes[block]) if block < len(request.hashes) else None
                if page is None:
                    raise self._unavailable(request_id, request, start, end)
            block_end = block * size + size
            run_end = end if end < block_end else block_end
            seg_source_row.append(page * size + position - block * size)
            total += run_end - position
            seg_start.append(total)
            position = run_end

    def _unavailable(self, request_id, request: _Request, start: int, end: int) -> RangeUnavailableError:
        own_start = request.own_start(self.page_size)
        prefix_blocks = min(len(request.hashes), own_start // self.page_size)
        ranges: list[tuple[int, int]] = []
        for block in range(prefix_blocks):
            if request.hashes[block] in self._index:
                first = block * self.page_size
                if ranges and ranges[-1][1] == first:
                    ranges[-1] = (ranges[-1][0], first + self.page_size)
                else:
                    ranges.append((first, first + self.page_size))
        cursor = self._cursor_of(request)
        if cursor > own_start:
            if ranges and ranges[-1][1] == own_start:
                ranges[-1] = (ranges[-1][0], cursor)
            else:
                ranges.append((own_start, cursor))
        return RangeUnavailableError(
            f"request {request_id!r}: range [{start}, {end}) is unavailable; available: {_format_ranges(ranges)} "
            f"({len(request.hashes)} block hashes known, page size {self.page_size})"
        )

    # --------------------------------------------------------------- lifecycle

    def finish(self, request_id) -> None:
        """Drop a request (finish, abort or preemption); unknown ids are a no-op.

        Owned pages are freed; pins are released in reverse block order, so the request's
        last blocks become the first to be evicted.
        """
        _check_request_id(request_id)
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        del self._slot_of[request_id]
        self._slot_requests[request.slot] = None
        self._slot_ids[request.slot] = None
        self._free_slots.append(request.slot)
        pinned = self._pinned_hashes(request)
        published = {self._index.get(block_hash) for block_hash in pinned}
        self._free.extend(page for page in reversed(request.own_pages) if page not in published)
        self._unpin(reversed(pinned))

    def rewind(self, request_id, position: int) -> None:
        """Forget a request's captured rows from ``position`` on: the engine recomputes them.

        vLLM rolls a request's computed tokens back when KV blocks fail to load; the rows
        computed on that KV are not the request's rows. Own pages past ``position`` are freed,
        and unpublished if they were the published copy; before the first captured block the
        rewind must be on a page boundary, and those prefix blocks become the request's own
        (it recomputes them). Unknown requests and positions at or past the cursor: no-op.
        """
        _check_request_id(request_id)
        if _check_position("position", position, request_id) < 0:
            raise InvalidCaptureError(f"request {request_id!r}: rewind position must be >= 0, got {position}")
        request = self._requests.get(request_id)
        if request is None or request.first_block is None or position >= self._cursor_of(request):
            return
        size, first_block = self.page_size, request.first_block
        own_start = first_block * size
        if position < own_start and position % size:
            raise InvalidCaptureError(
                f"request {request_id!r}: a rewind before the first captured block ({own_start}) must be "
                f"on a page boundary (page size {size}), got {position}"
            )
        partial = max(0, position - own_start) // size  # own blocks before this one stay settled
        for offset in range(partial, request.num_settled):
            block_hash = request.hashes[first_block + offset]
            if self._index.get(block_hash) == request.own_pages[offset]:
                del self._index[block_hash]  # its rows came from the rolled-back computation
                self._unpin([block_hash])
        request.num_settled = min(request.num_settled, partial)
        keep = -(-max(0, position - own_start) // size)  # own pages still holding rows
        self._free.extend(reversed(request.own_pages[keep:]))
        del request.own_pages[keep:]
        if position < own_start:
            request.first_block = position // size
            self._first_block[request.slot] = request.first_block
            self._unpin(reversed(request.hashes[request.first_block : first_block]))
        self._counters["rewound_rows"] += self._cursor_of(request) - position
        self._cursor[request.slot] = position

    def reset(self) -> None:
        """Drop every request and page; hashes from before never hit again."""
        self.generation += 1
        self._clear()

    # ------------------------------------------------------------ introspection

    def is_published(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is in the index (findable by prefix hits)."""
        return block_hash in self._index

    def page_states(self) -> dict[int, str]:
        """State of every non-free page: 'tail', 'pending', 'duplicate' or 'published'."""
        states = {page: "published" for page in self._index.values()}
        for request in self._requests.values():
            for offset, page in enumerate(request.own_pages):
                if offset < request.num_settled:
                    if states.get(page) != "published":
                        states[page] = "duplicate"
                elif (request.first_block + offset + 1) * self.page_size <= self._cursor_of(request):
                    states[page] = "pending"
                else:
                    states[page] = "tail"
        return states

    def stats(self) -> dict[str, int]:
        counts = Counter(self.page_states().values())
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "free": len(self._free),
            "tail": counts["tail"],
            "pending": counts["pending"],
            "duplicate": counts["duplicate"],
            "published": counts["published"],
            "evictable": len(self._evictable),
            "pinned_hashes": len(self._pins),
            "requests": len(self._requests),
            "generation": self.generation,
            "evictions": self._counters["evictions"],
            "published_blocks": self._counters["published_blocks"],
            "prefix_hit_rows": self._counters["prefix_hit_rows"],
            "captured_rows": self._counters["captured_rows"],
            "read_rows": self._counters["read_rows"],
            "rewound_rows": self._counters["rewound_rows"],
        }

    def check_consistency(self) -> None:
        """Raise if the page accounting is broken (used by the property tests)."""
        states = self.page_states()
        free = list(self._free)
        problems = []
        if len(set(free)) != len(free) or set(free) & set(states):
            problems.append("a free page is also in use")
        if len(free) + len(states) != self.num_pages:
            problems.append(f"{self.num_pages - len(free) - len(states)} pages are in no state")
        for request_id, r in self._requests.items():
            first = r.first_block if r.first_block is not None else -1
            if (
                self._slot_requests[r.slot] is not r or self._first_block[r.slot] != first
                or self._slot_ids[r.slot] != request_id or self._slot_of[request_id] != r.slot
            ):
                problems.append("a request's slot arrays disagree with its block map")
            elif r.own_pages and self._table[r.slot, first : first + len(r.own_pages)].tolist() != r.own_pages:
                problems.append("the block table disagrees with a request's own pages")
        owners = Counter(p for r in self._requests.values() for p in r.own_pages)
        if any(n > 1 for n in owners.values()):
            problems.append("a page is owned by two requests")
        expected_pins = Counter(h for r in self._requests.values() for h in self._pinned_hashes(r)) + self._retained
        if +self._pins != expected_pins:
            problems.append("pin counts differ from the requests' hashes plus retained hashes")
        if set(self._evictable) != {h for h in self._index if self._pins[h] == 0}:
            problems.append("the evictable set differs from the unpinned published keys")
        if problems:
            raise RoutedExpertsCacheError("cache accounting is inconsistent: " + "; ".join(problems))
