"""The paged, device-resident cache of routing rows.

Rows live in one pool tensor ``pages[num_pages, page_size, *row_shape]``. Each request is an
ordered block map: the blocks it captured itself (``own_pages``, from ``first_block`` on) and,
before those, prefix blocks that resolve through the published index by block hash. Every
page is in exactly one state:

- free, published (shared by block hash) or evictable (published, unpinned): ``PagePool``;
- tail / pending / duplicate: owned by one request (partly filled / full without hash /
  full with a hash that was already published by an earlier page).

A request pins the hashes it reads through the index (its prefix blocks; before its first
capture, every hash it is given) and those of its own published pages; ``retain`` pins from
outside. Nothing pins a page no one will read.

Reads walk the block map, so published, pending and tail blocks are one lookup. Rows move on
the device with one scatter per capture call and one gather per read call.

There is one way in per idea: ``capture_batch``, ``read_batch`` and ``add_block_hashes_batch``
take an engine step's requests at once; ``capture``, ``read`` and ``add_block_hashes`` are the
same calls for one request. Each checks every argument before anything changes. An engine
connector checks its step's arguments once, where they arise (vLLM's batch arrays and its own
state): ``capture_step`` (``capture_step_small``: spans as lists), ``read_step``,
``add_block_hashes_step``, ``pin_step`` and ``finish_step`` are the same operations without
those checks, keeping the ones only the cache can make (a first capture's start, ranges, room,
releases of what was not retained).

Every request also has a slot: its cursor and first captured block live in slot-indexed
arrays, and a block table ``[slots, blocks]`` mirrors its own pages. Up to ``SMALL_BATCH``
spans or intervals (``batch_size``), plain Python over them splits them at page boundaries (a fixed set of
array passes costs more for a few dozen); above it, array passes over the slot arrays do, with
a shorter set for a decode step (spans of at most a page, new blocks on free pages). A span
of many blocks (a prompt's chunk) is split by list extensions (``_append_page_runs``), a read
by slices of its block map (``_append_segments``): no Python per block. Python runs per
span the arrays do not cover (first captures, prefix reads), per request that settles
blocks, and appends each new page to its request's block map.
"""

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, compress, islice, repeat
from operator import add, eq, mul, not_, sub

import numpy as np
import torch

from .checks import (
    as_list, check_hashes, check_position, check_request_id, check_request_ids, check_row_values, check_rows,
    checked_hash_lists, fits_dtype, index_array,
)
from ..errors import CacheFullError, InvalidCaptureError, RangeUnavailableError, RoutedExpertsCacheError
from ..kernels import as_row_words, copy_segments_torch, interpreting, load_triton_copy, precompile_triton_copy
from . import batch_size
from .batch_size import as_plain_list, largest, total
from .page_pool import PagePool
from .request_slots import RequestSlots

POOL_DTYPES = (torch.uint8, torch.uint16, torch.int16, torch.int32)
# Positions fit int32, as in vLLM's batch arrays; far beyond any model's context length.
DEFAULT_MAX_POSITION = 2**31
# Up to this many rows, a small-batch copy goes by torch index copies (``_copy_small``): the
# per-row index costs less to build than the kernel's launch costs the host.
SMALL_COPY_ROWS = 256
# Spans of more rows than this many pages hold are split into page runs by list extensions
# (``_append_page_runs``), shorter ones by a loop over their blocks. At least 1.
SHORT_SPAN_PAGES = 8


def _as_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows


class _Request:
    """A request's block map; its cursor (next position to capture) is ``RequestSlots.cursor[slot]``."""

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

    def take_settling(self, full_blocks: int, hashes: list[bytes], pages: list[int]) -> None:
        """Add its own blocks among the first ``full_blocks`` whose hashes are known and that
        are not settled yet to ``hashes`` / ``pages`` (to publish), and count them settled
        (after its first capture)."""
        first_block, settled, known = self.first_block, self.num_settled, self.hashes
        settling = (full_blocks if full_blocks < len(known) else len(known)) - first_block
        if settling == settled + 1:  # one block, a decode step's: indexes (a list slice costs more)
            hashes.append(known[first_block + settled])
            pages.append(self.own_pages[settled])
            self.num_settled = settling
        elif settling > settled:
            hashes += known[first_block + settled : first_block + settling]
            pages += self.own_pages[settled:settling]
            self.num_settled = settling


def _indexable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or for uint16 (torch's CPU build has no ``index_put`` for it) its int16 view:
    the same bits."""
    return tensor.view(torch.int16) if tensor.dtype == torch.uint16 else tensor


def _format_ranges(ranges: list[tuple[int, int]]) -> str:
    return " ".join(f"[{a}, {b})" for a, b in ranges) if ranges else "nothing"


def _append_page_runs(source_rows: list, target_rows: list, lengths: list, pages: list[int], start: int, end: int,
                      source_row: int, size: int) -> None:
    """Append the segments of positions ``[start, end)``, a span of two blocks or more, one
    per block, whose rows come from source row ``source_row`` on; ``pages`` are the pages of
    its blocks ``start // size`` to ``(end - 1) // size``, in order. List extensions from
    ranges and maps, no Python per block: the split of a span longer than
    ``SHORT_SPAN_PAGES`` blocks (a prompt's chunk). Twelve spans of 128 blocks cost
    ``_plan_segments`` 2.4-4x and ``_segments_small`` 1.8x less this way than by the loops
    that split shorter spans, which cost less below about eight blocks
    (``bench/results/2026-12-08T0010-cpu-2core-x86_64/page_runs_micro.py``)."""
    head, num_blocks = start % size, len(pages)
    block_start = source_row - head  # the source row of the first block's position 0
    source_rows.append(source_row)
    source_rows += range(block_start + size, block_start + num_blocks * size, size)
    target_rows.append(pages[0] * size + head)
    target_rows += map(mul, islice(pages, 1, None), repeat(size))
    lengths.append(size - head)
    lengths += repeat(size, num_blocks - 2)
    lengths.append(end - (start - head) - (num_blocks - 1) * size)


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
        max_position: int = DEFAULT_MAX_POSITION,
        host_pages: int = 0,
    ) -> None:
        """``max_position``: positions are ``[0, max_position)`` (a request's length bound; vLLM's
        connector passes ``max_model_len``); a call naming a position past it is refused before
        anything changes. ``host_pages``: the host tier, pages in host memory (pinned on CUDA)
        that take retained blocks when the device pool is full (``PagePool``); reads gather
        their rows from there."""
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("max_position", max_position)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RoutedExpertsCacheError(f"{name} must be a positive int, got {value!r}")
        if isinstance(host_pages, bool) or not isinstance(host_pages, int) or host_pages < 0:
            raise RoutedExpertsCacheError(f"host_pages must be an int >= 0, got {host_pages!r}")
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
        self.max_position = max_position
        self.row_shape = row_shape
        self.dtype = dtype
        self.device = device
        self.backend = backend
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RoutedExpertsCacheError(
                f"device={str(device)!r} but CUDA is not available here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False): use device='cpu', or a CUDA build of torch on a GPU machine"
            )
        try:
            self.pages = torch.zeros((num_pages, page_size, *row_shape), dtype=dtype, device=device)
            self.host_arena = torch.zeros(
                (host_pages, page_size, *row_shape), dtype=dtype, pin_memory=device.type == "cuda" and host_pages > 0
            )
        except (RuntimeError, AssertionError) as error:  # an unusable device, or out of memory
            raise RoutedExpertsCacheError(
                f"cannot allocate the pool ({num_pages} pages x {page_size} rows of {row_shape} {dtype}) on "
                f"{device}, with {host_pages} host pages: {error}"
            ) from error
        # What the copy backend moves: Triton rows as aligned words (wide accesses), torch rows
        # as they are (its index copies take any row shape; uint16 has none on CPU: words too).
        self._copy_view = _as_rows if backend == "torch" and dtype != torch.uint16 else as_row_words
        self._pool_words = self._copy_view(self.pages.view(num_pages * page_size, *row_shape))
        self._copy = load_triton_copy() if backend == "triton" else copy_segments_torch
        if backend == "triton" and not interpreting():
            precompile_triton_copy(self._pool_words)  # no compile stalls once serving starts
        self.generation = 0
        self._clear()

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    def _clear(self) -> None:
        self._pages = PagePool(self.num_pages, self.host_arena.shape[0])  # pins: requests' hashes and retained ones
        self._requests: dict[object, _Request] = {}
        self._counters = Counter()
        self._slots = RequestSlots()

    def _register(self, request_id, request: _Request) -> None:
        request.slot = self._slots.add(request_id, request)
        self._requests[request_id] = request

    def _cursor_of(self, request: _Request) -> int:
        return self._slots.cursor.item(request.slot) if request.slot >= 0 else 0

    # ----------------------------------------------------------------- capture

    def capture(self, request_id, start: int, rows: torch.Tensor) -> None:
        """Store ``rows[n, *row_shape]`` as positions ``start .. start + n - 1``.

        ``capture_batch`` for one request. Its rows and span are checked here first, so every
        error names the request, also for a position no int64 array can hold.
        """
        check_rows(request_id, rows, self.row_shape)
        count = rows.shape[0]
        self._check_span(request_id, start, 0, count, count)
        self.capture_batch(rows, [request_id], [start], [0], [count])

    # ------------------------------------------------- batched calls (engine steps)

    def slots(self, request_ids: Sequence) -> np.ndarray:
        """The slot of each request, registering unknown ones (as ``add_block_hashes(id, [])``).

        Slots can be handed to ``capture_batch`` and ``read_batch`` to skip their lookup; one
        stays valid until its request is finished or the cache reset.
        """
        request_ids = as_list(request_ids, "request ids", RoutedExpertsCacheError)
        check_request_ids(request_ids)
        return np.array(self.slots_step(request_ids), dtype=np.int64)

    def slots_step(self, request_ids: list) -> list[int]:
        """``slots`` for an engine step's new requests, whose ids the caller has checked (vLLM's
        own request ids): no type checks, no arrays; Python per request. An id listed twice is
        registered once."""
        of = self._slots.of
        for request_id in request_ids:
            if request_id not in of:
                self._register(request_id, _Request())
        return list(map(of.__getitem__, request_ids))

    def capture_batch(self, source: torch.Tensor, request_ids: Sequence, starts, source_starts, counts, slots=None) -> None:
        """Store ``source[source_starts[i] : source_starts[i] + counts[i]]`` as request
        ``request_ids[i]``'s positions from ``starts[i]`` on, for every i.

        The form an engine step uses: a step's snapshot is captured where it lies (source rows
        no span names, such as rejected drafts, are never read). Spans that continue a
        request's captured rows are planned, copied and committed with array operations over
        the batch; the others (first captures, a request listed twice, invalid spans) are
        checked one by one in ``_plan_captures``. Either every span is stored, with one
        scatter, or the call is refused and nothing changes.
        """
        request_ids = as_list(request_ids, "capture request ids")
        check_rows("<batch>", source, self.row_shape)
        slots = self._slots.checked(request_ids, slots)
        n = len(request_ids)
        starts, source_starts, counts = (
            index_array(values, name, n, InvalidCaptureError)
            for values, name in ((starts, "starts"), (source_starts, "source starts"), (counts, "counts"))
        )
        size, ends = self.page_size, starts + counts
        # Compared so that nothing overflows int64: a sum of two huge values wraps negative.
        valid = (starts >= 0) & (source_starts >= 0) & (counts >= 0) & (counts <= source.shape[0])
        valid &= (source_starts <= source.shape[0] - counts) & (starts <= self.max_position - counts)
        active = counts != 0
        known = slots >= 0
        continuing = valid & active & known & (self._slots.first_block[slots] >= 0) & (starts == self._slots.cursor[slots])
        if continuing.any():
            listed = np.bincount(slots[active & known], minlength=len(self._slots.requests))
            continuing &= listed[slots] == 1
        others = (~continuing & (active | ~valid)).nonzero()[0].tolist()
        spans = [(request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i])) for i in others]
        plans, num_new_pages = self._plan_captures(source.shape[0], spans)
        if not fits_dtype(source.dtype, self.dtype):
            check_row_values(source, [
                (request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i])) for i in active.nonzero()[0].tolist()
            ], self.dtype)
        batch = None
        if continuing.any():
            pick = continuing.nonzero()[0]
            starts, ends = starts[pick], ends[pick]
            new_pages = -(-ends // size) + (-starts // size)  # blocks begun past the cursor
            batch = (slots[pick], starts, source_starts[pick], counts[pick], new_pages)
        if plans or batch is not None:
            self._write(plans, num_new_pages, self._source_words(source), batch, request_ids)

    def capture_step(self, source: torch.Tensor, request_ids: list, slots: np.ndarray, starts: np.ndarray,
                     source_starts: np.ndarray, counts: np.ndarray, order: Iterable | None = None) -> None:
        """``capture_batch`` for an engine step whose invariants the caller has established.

        The worker connector derives these from vLLM's batch arrays and its own state, and
        checks them once per step where they arise; this call does not check them again:
        ``source`` is a dense ``[rows, *row_shape]`` tensor of a dtype the pool holds;
        ``slots`` come from ``slots()`` for ``request_ids``, live and distinct; ``starts``,
        ``source_starts`` and ``counts`` are int64 arrays of the same length with every span
        inside ``source`` (``counts >= 0``); a request that has captured before continues at its
        cursor. Checked here as in ``capture_batch``: first captures (one
        by one: a start inside a block needs that block published), ``max_position``, room.

        ``order``: the request ids in the order the engine registers their blocks (vLLM: its
        scheduling order, which its input batch need not follow). Where spans of this call
        complete the same block, the first request in that order publishes it, as the engine
        serves later hits from that request's block; the others keep reading their own copy
        (their own forward's rows). Default: the call's order.
        """
        if len(slots) <= batch_size.SMALL_BATCH:
            lists = (values.tolist() for values in (starts, source_starts, counts))
            self.capture_step_small(source, request_ids, slots, *lists, (starts + counts).tolist(), order)
            return
        first = (self._slots.first_block[slots] < 0).nonzero()[0]
        if len(first) or not self._capture_within_pages(source, slots, starts, source_starts, counts, order):
            self._capture_planned(source, request_ids, slots, starts, source_starts, counts, first, order)

    def capture_step_small(self, source: torch.Tensor, request_ids: list, slots: np.ndarray | list, starts: list,
                           source_starts: list, counts: list, ends: list, order: Iterable | None = None) -> None:
        """``capture_step`` with the spans as lists (``ends[i] = starts[i] + counts[i]``), for a
        few dozen requests: the connector's small-batch commit builds them in one Python pass.
        The common steps, whose new blocks all take free pages (the first ones, in span order),
        are planned in one pass over the spans, without ``_write``'s look-ahead layers: spans
        that continue a request's rows, and first captures that start a page and capture a
        row. Any other (a first capture inside a published block or of no rows, new blocks on
        evicted or demoted pages, a span past ``max_position``) goes through ``_write``, the
        spans still lists."""
        slot_list, requests = as_plain_list(slots), self._slots.requests
        first = [i for i, slot in enumerate(slot_list) if requests[slot].first_block is None]
        first_pages = self._first_capture_pages(first, starts, ends) if first else None
        if not first or first_pages is not None:
            segments = self._segments_small(
                slot_list, starts, source_starts, counts, self._pages.free, self.max_position, first_pages)
            if segments is not None:
                started = [(request_ids[i], requests[slot_list[i]], starts[i]) for i in first]
                self._write_on_free_pages(
                    source, slots, ends, sum(counts), segments, request_ids if order is None else order, started)
                return
        self._capture_planned_small(source, request_ids, slots, starts, source_starts, counts, ends, first, order)

    def _first_capture_pages(self, first: list, starts: list, ends: list) -> int | None:
        """The new pages of the first captures ``first`` (indices) if each starts a page and
        captures a row (the first captures ``_segments_small`` plans) and the free pages hold
        them; else None: ``_write`` plans them (a seeded page, an empty first span, evictions)."""
        size, pages = self.page_size, 0
        for i in first:
            start, end = starts[i], ends[i]
            if start % size or start == end:
                return None
            pages += (end - start - 1) // size + 1
        return pages if pages <= len(self._pages.free) else None

    def _capture_planned_small(self, source: torch.Tensor, request_ids: list, slots: np.ndarray, starts: list,
                               source_starts: list, counts: list, ends: list, first: list, order) -> None:
        """``_capture_planned`` with the spans as lists: the continuing ones reach ``_write`` as
        lists too (its small-batch splitting takes lists), no array is built of them but the
        slots'."""
        slots = np.asarray(slots, dtype=np.int64)
        if ends and max(ends) > self.max_position:
            i = ends.index(max(ends))
            self._check_span(request_ids[i], starts[i], source_starts[i], counts[i], source.shape[0])
        plans, num_new_pages = self._plan_captures(
            source.shape[0], [(request_ids[i], starts[i], source_starts[i], counts[i]) for i in first])
        if first:
            planned = set(first)
            keep = [i for i in range(len(starts)) if i not in planned]
            slots = slots[keep]
            starts, source_starts, counts, ends = ([values[i] for i in keep] for values in (starts, source_starts, counts, ends))
        batch = None
        if starts:
            size = self.page_size  # new pages: the blocks begun past the cursor
            batch = (slots, starts, source_starts, counts, [-(-end // size) + (-start // size) for start, end in zip(starts, ends)])
        if plans or batch is not None:
            self._write(plans, num_new_pages, self._source_words(source), batch, request_ids if order is None else order)

    def _capture_planned(self, source: torch.Tensor, request_ids: list, slots: np.ndarray, starts: np.ndarray,
                         source_starts: np.ndarray, counts: np.ndarray, first: np.ndarray, order) -> None:
        """``capture_step`` through ``_write``: first captures (``first``: their indices) planned
        one by one, the continuing spans as arrays, with the look-ahead at evictions."""
        ends = starts + counts
        if len(ends) and largest(ends) > self.max_position:
            i = int(ends.argmax())
            self._check_span(request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i]), source.shape[0])
        plans, num_new_pages = [], 0
        if len(first):
            plans, num_new_pages = self._plan_captures(source.shape[0], [
                (request_ids[i], int(starts[i]), int(source_starts[i]), int(counts[i])) for i in first.tolist()
            ])
            keep = self._slots.first_block[slots] >= 0
            slots, starts, source_starts, counts, ends = slots[keep], starts[keep], source_starts[keep], counts[keep], ends[keep]
        batch = None
        if len(slots):
            new_pages = -(-ends // self.page_size) + (-starts // self.page_size)  # blocks begun past the cursor
            batch = (slots, starts, source_starts, counts, new_pages)
        if plans or batch is not None:
            self._write(plans, num_new_pages, self._source_words(source), batch, request_ids if order is None else order)

    def _capture_within_pages(self, source: torch.Tensor, slots: np.ndarray, starts: np.ndarray,
                              source_starts: np.ndarray, counts: np.ndarray, order) -> bool:
        """``capture_step``'s decode case above ``SMALL_BATCH``, without ``_write``'s look-ahead
        layers: continuing spans of at most a page each (a decode step's row and its speculative
        ones) whose new pages are all free ones, planned by ``_segments_within_pages``. Returns
        False, changing nothing, where it does not apply: ``_write`` handles that step."""
        if np.count_nonzero(counts > self.page_size) or np.count_nonzero(starts + counts > self.max_position):  # cheaper than max()
            return False
        segments = self._segments_within_pages((slots, starts, source_starts, counts, None), self._pages.free)
        if segments is None:
            return False
        self._write_on_free_pages(source, slots, starts + counts, int(counts.sum()), segments, order)
        return True

    def _write_on_free_pages(self, source: torch.Tensor, slots: np.ndarray, ends, num_rows: int, segments, order,
                             started: list[tuple] = ()) -> None:
        """Copy and commit spans (``num_rows`` rows, the requests of ``slots`` now captured up
        to ``ends``) whose ``segments`` were planned on the first free pages (the pages the
        allocation below takes, in that order), then settle their blocks. ``started``: the
        first captures among them, ``(request_id, request, start)``, which start as ``_write``
        starts them (their own blocks' hashes unpinned) and settle first."""
        source_rows, target_rows, lengths, table_slots, table_blocks, completed = segments
        if len(lengths):
            self._copy_on_device(self._source_words(source), self._pool_words, lengths, source_rows, target_rows)
        if started:
            self._start_first_captures(started, self._first_capture_unpins(started))
        self._commit_batch(slots, ends, self._pages.allocate_many(len(table_slots)), table_slots, table_blocks)
        settling = self._settling(completed)
        self._settle([request for _, request, _ in started] + settling if started else settling, order)
        self._counters["captured_rows"] += num_rows

    def _source_words(self, source: torch.Tensor) -> torch.Tensor:
        """The rows to copy, on the pool's device in its dtype, contiguous and aligned, in the
        copy backend's view (words for Triton).

        Runs before any state changes: a source that cannot be converted fails the call.
        """
        if source.dtype == self.dtype and source.device == self.device and source.is_contiguous() and not source.data_ptr() % 16:
            return self._copy_view(source)  # the engine's case: a step's rows as the capturer holds them
        try:
            rows = source.to(self.device, self.dtype).contiguous()
            if rows.data_ptr() % 16:  # a storage offset: word views and wide loads need alignment
                rows = rows.clone()
            return self._copy_view(rows)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            raise InvalidCaptureError(
                f"rows on {source.device} ({source.dtype}) cannot be copied to the pool on "
                f"{self.device} ({self.dtype}): {error}"
            ) from error

    def _write(self, plans: list[tuple], num_new_pages: int, source_words: torch.Tensor, batch, order) -> None:
        """Copy the planned rows into their pages, then commit the bookkeeping.

        ``plans`` come from ``_plan_captures``; ``batch`` (or None) holds continuing spans
        ``(slots, starts, source_starts, counts, new_pages)``, arrays (slots always) or, up to
        ``SMALL_BATCH`` spans, lists; ``order`` lists the request ids in publishing order (which
        request publishes a block that two of them complete: ``capture_step``). Nothing is
        changed before the copy: its target pages are chosen by looking ahead at the pages the
        allocation below will take (free ones first, then the oldest evictable, including pages
        that first captures of this call stop pinning), planned spans first, then the batch.
        """
        batch_new = total(batch[4]) if batch is not None else 0
        first_capture_unpins = self._first_capture_unpins(plans) if plans else []
        releasing = []  # with enough free pages, the allocation below takes no page they release
        if first_capture_unpins and num_new_pages + batch_new > len(self._pages.free):
            releasing = self._pages.released_by(first_capture_unpins)
        self._check_room(plans, num_new_pages, batch, batch_new, len(releasing))
        new_pages, victims, demotions = self._pages.next_pages(num_new_pages + batch_new, releasing)
        seeds, segments = [], []
        if plans:
            segments.append(self._plan_segments(plans, new_pages[:num_new_pages]))
            seeds = self._plan_seeds(plans, new_pages[:num_new_pages])
        if batch is not None:
            *batch_segments, table_slots, table_blocks, completed = self._continuing_segments(batch, new_pages[num_new_pages:])
            segments.append(batch_segments)
        if len(segments) == 1:
            source_rows, target_rows, lengths = segments[0]
        elif type(segments[1][0]) is list:  # both from plain Python: lists
            source_rows, target_rows, lengths = (first + second for first, second in zip(*segments))
        else:
            source_rows, target_rows, lengths = (np.concatenate(parts) for parts in zip(*segments))
        try:
            self._demote(demotions)  # first: the demoted blocks' rows reach the host before their pages are reused
            if seeds:  # then, while the published pages they copy are intact
                self._copy_seeds(seeds)
            self._copy_on_device(source_words, self._pool_words, lengths, source_rows, target_rows)
        except Exception:
            self._pages.discard(victims)  # their rows may be partly overwritten (fail closed)
            raise
        # Every page is taken before any block settles: settling frees and pins pages, which
        # would change which pages the allocation takes from the ones the copy wrote.
        if plans:
            self._start_first_captures(plans, first_capture_unpins)  # before allocating: pages they release are taken too
        pages = self._pages.allocate_many(num_new_pages + batch_new)
        if plans:
            self._commit_captures(plans, pages[:num_new_pages])
        if batch is not None:
            ends = list(map(add, batch[1], batch[3])) if type(batch[1]) is list else batch[1] + batch[3]
            self._commit_batch(batch[0], ends, pages[num_new_pages:], table_slots, table_blocks)
        planned = [request for _, request, *_ in plans]
        self._settle(planned + self._settling(completed) if batch is not None else planned, order)
        self._counters["captured_rows"] += int(sum(lengths) if type(lengths) is list else lengths.sum())

    def _demote(self, demotions: list[tuple[int, int]]) -> None:
        """Copy the rows of blocks moving to the host tier, ``(device page, host page)`` pairs,
        with one device-to-host copy."""
        if demotions:
            device_pages, host_pages = (list(column) for column in zip(*demotions))
            _indexable(self.host_arena)[[page - self.num_pages for page in host_pages]] = _indexable(self.pages[device_pages].cpu())

    def _check_room(self, plans: list[tuple], num_new_pages: int, batch, batch_new: int, releasing: int) -> None:
        """Refuse a capture that needs more new pages than are free or evictable."""
        if num_new_pages + batch_new <= self._pages.room(releasing):
            return
        free, evictable = len(self._pages.free), len(self._pages.evictable) + releasing
        wanted = [f"{plan[0]!r} [{plan[2]}, {plan[2] + plan[4]})" for plan in plans]
        if batch is not None:  # named like the planned spans: a refused capture names its requests
            slots, starts, _, counts, _ = batch
            wanted += [
                f"{self._slots.ids[slot]!r} [{start}, {start + count})"
                for slot, start, count in zip(*map(as_plain_list, (slots, starts, counts)))
            ]
        host = self._pages.host_pages
        host_room = f" (host tier: {self._pages.room(releasing) - free - evictable} to demote of {host})" if host else ""
        raise CacheFullError(
            f"capture of {', '.join(wanted)} needs {num_new_pages + batch_new} new pages; only "
            f"{free} free and {evictable} evictable of {self.num_pages}{host_room} "
            f"(the rest are pinned or owned by live requests)"
        )

    def _seed_page(self, request: _Request, block: int) -> int | None:
        """The published page of the request's block ``block``; None if its hash is not given or
        not published."""
        return self._pages.published.get(request.hashes[block]) if block < len(request.hashes) else None

    def _plan_seeds(self, plans: list[tuple], new_pages: list[int]) -> list[tuple[int, int, int]]:
        """``(rows, source page, target page)`` page-to-page copies for first captures that start
        inside a published block (a whole-prompt hit recomputes the last prompt token): the
        request's own page of that block starts as a copy of the published page's rows before
        the capture start. ``new_pages``: the planned spans' new pages, in plan order."""
        seeds, taken, size, started = [], 0, self.page_size, set()
        for _, request, start, _, _, num_new in plans:
            if request.first_block is None and id(request) not in started and start % size:
                page = self._seed_page(request, start // size)
                seeds.append((start % size, page, new_pages[taken]))
            started.add(id(request))
            taken += num_new
        return seeds

    def _copy_seeds(self, seeds: list[tuple[int, int, int]]) -> None:
        """Seed copies: from device pages with one launch, from host pages one block each (rare).

        A seed's new page may be the published page another seed copies from (a first capture of
        this call released that block, and the allocation reuses its page): then the seeded rows
        are gathered first and written with a second launch, since the segments of one launch run
        at once on a GPU."""
        size, on_device = self.page_size, [seed for seed in seeds if not self._pages.on_host(seed[1])]
        if on_device:
            lengths, sources, targets = (np.array(column) for column in zip(*on_device))
            if np.isin(targets, sources).any():
                offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                seeded = self._copy_view(torch.empty((int(lengths.sum()), *self.row_shape), dtype=self.dtype, device=self.device))
                self._copy_on_device(self._pool_words, seeded, lengths, sources * size, offsets)
                self._copy_on_device(seeded, self._pool_words, lengths, offsets, targets * size)
            else:
                self._copy_on_device(self._pool_words, self._pool_words, lengths, sources * size, targets * size)
        for length, source, target in seeds:
            if self._pages.on_host(source):
                self.pages[target, :length] = self.host_arena[source - self.num_pages, :length].to(self.device)
                self._counters["host_read_rows"] += length

    def _plan_segments(self, plans: list[tuple], new_pages: list[int]):
        """``(source_rows, target_rows, lengths)`` of the planned spans as lists, one segment per
        page run; ``new_pages`` are the pages their new blocks take, in plan order."""
        size, taken = self.page_size, 0
        lengths, seg_source_row, seg_target_row = [], [], []
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
            if count > SHORT_SPAN_PAGES * size:
                _append_page_runs(seg_source_row, seg_target_row, lengths,
                                  pages[start // size - first_block : (end - 1) // size - first_block + 1], start, end, source_row, size)
                continue
            while position < end:
                block = position // size
                run_end = min(end, block * size + size)
                seg_source_row.append(source_row)
                seg_target_row.append(pages[block - first_block] * size + position - block * size)
                lengths.append(run_end - position)
                source_row += run_end - position
                position = run_end
        return seg_source_row, seg_target_row, lengths

    def _continuing_segments(self, batch, new_pages: list[int]):
        """``(source_rows, target_rows, lengths, table_slots, table_blocks, completed)`` of the
        continuing spans: one segment per page run (a block the request has a page for reads
        it from its block map, a new block takes the next of ``new_pages``, in span order), the
        table cells the new pages fill (slot, own block), and the slots whose span completed a
        block. Plain Python over the spans for a few dozen of them (cheaper than a fixed set of
        array passes), vectorised above that, with fewer passes where no span is longer than a
        page (decoding); all give the same result. Spans given as lists take the plain pass."""
        if type(batch[1]) is list or len(batch[0]) <= batch_size.SMALL_BATCH:
            return self._segments_small(*map(as_plain_list, batch[:4]), new_pages)
        if not np.count_nonzero(batch[3] > self.page_size):
            return self._segments_within_pages(batch, new_pages)
        return self._segments_by_page_runs(batch, new_pages)

    def _segments_by_page_runs(self, batch, new_pages: list[int]):
        """``_continuing_segments`` for spans of any length: split at page boundaries
        (``_page_runs``), a new block taking the next of ``new_pages``."""
        slots, starts, source_starts, counts, _ = batch
        size, table = self.page_size, self._slots.table
        ends = starts + counts
        span, block, first, end = self._page_runs(starts, ends)
        first_new = -(-starts // size)  # the span's first block without a page yet
        is_new = block >= first_new[span]
        own_block = block - self._slots.first_block[slots[span]]  # the table's column
        page = table[slots[span], np.minimum(own_block, table.shape[1] - 1)]
        if new_pages:
            page[is_new] = new_pages
        completed = slots[ends // size > starts // size].tolist()
        source_rows = source_starts[span] + first - starts[span]
        return source_rows, page * size + first - block * size, end - first, slots[span][is_new], own_block[is_new], completed

    def _segments_within_pages(self, batch, new_pages):
        """``_continuing_segments`` for spans of at most a page each, in a fixed set of array
        passes: a span writes the rest of its current page and at most one new page (its first
        if it starts on a page boundary, else its second). ``new_pages`` may be the free pages
        themselves: None if the spans need more of them."""
        slots, starts, source_starts, counts, _ = batch
        size = self.page_size
        keep = counts.nonzero()[0]
        if len(keep) < len(counts):  # an empty span copies nothing
            slots, starts, source_starts, counts = (values[keep] for values in (slots, starts, source_starts, counts))
        offsets = starts % size
        heads = size - offsets  # the rows left in the span's current page
        crossing = counts > heads
        starting = offsets == 0  # a span on a page boundary begins a block (its first row is past the cursor)
        takes = (starting | crossing).nonzero()[0]  # spans taking one new page each, in span order
        if len(takes) > len(new_pages):
            return None
        blocks = starts // size - self._slots.first_block[slots]  # own block of each span's first row
        table = self._slots.table
        pages = table[slots, np.minimum(blocks, table.shape[1] - 1)]
        fresh = np.fromiter(islice(new_pages, len(takes)), dtype=np.int64, count=len(takes))
        pages[starting] = fresh[starting[takes]]
        second = crossing.nonzero()[0]
        return (
            np.concatenate([source_starts, source_starts[second] + heads[second]]),
            np.concatenate([pages * size + offsets, fresh[crossing[takes]] * size]),
            np.concatenate([np.minimum(counts, heads), counts[second] - heads[second]]),
            slots[takes], blocks[takes] + crossing[takes], slots[counts >= heads].tolist(),
        )

    def _settling(self, completed_slots: list[int]) -> list[_Request]:
        """The requests of these slots (spans that completed a block) with a full own block
        whose hash is known: the only ones with a block to settle."""
        requests = self._slots.requests
        return [
            request for request in map(requests.__getitem__, completed_slots)
            if len(request.hashes) > request.first_block + request.num_settled
        ]

    def _segments_small(self, slots: list, starts: list, source_starts: list, counts: list, new_pages,
                        max_position: int | None = None, first_pages: int | None = None):
        """``_continuing_segments`` in plain Python over the spans (lists, no arrays).
        ``new_pages`` may be the free pages themselves: None if the spans need more of them.
        None too with ``max_position`` where a span ends past it, and where a request has not
        captured before (a first capture: ``_plan_captures`` plans it) unless ``first_pages``
        is given: then first captures, each starting a page and capturing a row (the caller
        checked), take the first ``first_pages`` new pages in span order, as ``_write`` plans
        them, the continuing spans the pages after; their table cells come first too."""
        size, requests, taken, first_taken = self.page_size, self._slots.requests, first_pages or 0, 0
        long_span = SHORT_SPAN_PAGES * size  # more rows: split by list extensions
        source_rows, target_rows, lengths, table_slots, table_blocks, completed = [], [], [], [], [], []
        first_slots, first_blocks = [], []  # the first captures' table cells
        for slot, start, source_row, count in zip(slots, starts, source_starts, counts):
            request = requests[slot]
            pages, first_block = request.own_pages, request.first_block
            position, end = start, start + count
            if max_position is not None and end > max_position:
                return None
            if first_block is None:
                if first_pages is None:
                    return None
                if count > long_span:  # a new page per block, from the page the span starts
                    num_new = (end - 1) // size - start // size + 1
                    first_slots += repeat(slot, num_new)
                    first_blocks += range(num_new)
                    fresh = list(islice(new_pages, first_taken, first_taken + num_new))
                    _append_page_runs(source_rows, target_rows, lengths, fresh, start, end, source_row, size)
                    first_taken += num_new
                    continue
                while position < end:
                    run_end = position + size if position + size < end else end
                    first_slots.append(slot)
                    first_blocks.append((position - start) // size)
                    source_rows.append(source_row)
                    target_rows.append(new_pages[first_taken] * size)
                    lengths.append(run_end - position)
                    first_taken += 1
                    source_row += run_end - position
                    position = run_end
                continue
            if not count:
                continue
            if end // size > start // size:
                completed.append(slot)
            if count > long_span:  # its pages, then new ones for its blocks past them
                own, own_last = start // size - first_block, (end - 1) // size - first_block
                num_new = max(own_last + 1 - max(len(pages), own), 0)  # (0: it ends in its last page)
                if taken + num_new > len(new_pages):
                    return None
                fresh = list(islice(new_pages, taken, taken + num_new))
                table_slots += repeat(slot, len(fresh))
                table_blocks += range(own_last + 1 - len(fresh), own_last + 1)
                taken += len(fresh)
                _append_page_runs(source_rows, target_rows, lengths, pages[own : own_last + 1] + fresh, start, end, source_row, size)
                continue
            while position < end:
                block = position // size
                own_block = block - first_block
                if own_block < len(pages):
                    page = pages[own_block]
                elif taken < len(new_pages):
                    page = new_pages[taken]
                    taken += 1
                    table_slots.append(slot)
                    table_blocks.append(own_block)
                else:
                    return None
                run_end = block * size + size
                if run_end > end:
                    run_end = end
                source_rows.append(source_row)
                target_rows.append(page * size + position - block * size)
                lengths.append(run_end - position)
                source_row += run_end - position
                position = run_end
        if first_slots:
            table_slots, table_blocks = first_slots + table_slots, first_blocks + table_blocks
        return source_rows, target_rows, lengths, table_slots, table_blocks, completed

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

    def _commit_batch(self, slots: np.ndarray, ends, pages: list[int], table_slots, table_blocks) -> None:
        """Apply the continuing spans: new pages into the block maps and the block table (at
        the cells ``_continuing_segments`` named), cursors (now ``ends``). Python per new page
        only; blocks settle in the caller."""
        if pages:
            self._slots.set_pages(table_slots, table_blocks, pages)
            requests = self._slots.requests
            for slot, page in zip(table_slots if type(table_slots) is list else table_slots.tolist(), pages):
                requests[slot].own_pages.append(page)  # in block order per request
        self._slots.cursor[slots] = ends

    def _first_capture_unpins(self, plans: list[tuple]) -> list[bytes]:
        """The hashes this call's first captures stop pinning (the request's own blocks), in
        the order ``_start_first_captures`` unpins them."""
        unpins, first_captures = [], set()
        for _, request, start, *_ in plans:
            if request.first_block is None and id(request) not in first_captures:
                first_captures.add(id(request))
                unpins += reversed(request.hashes[start // self.page_size :])
        return unpins

    def _start_first_captures(self, plans: list[tuple], unpins: list[bytes]) -> None:
        """First captures stop pinning their own blocks' hashes, ``unpins`` (from
        ``_first_capture_unpins``): the request reads its own pages there."""
        hit_rows = 0
        for request_id, request, start, *_ in plans:
            if request.first_block is None:
                request.first_block = start // self.page_size
                if request.slot < 0:
                    self._register(request_id, request)
                self._slots.first_block[request.slot] = request.first_block
                self._slots.cursor[request.slot] = start
                hit_rows += start
        self._counters["prefix_hit_rows"] += hit_rows
        self._pages.unpin(unpins)

    def _commit_captures(self, plans: list[tuple], pages: list[int]) -> None:
        """Apply planned captures: their new pages (in plan order) and cursors."""
        taken, table_slots, table_blocks = 0, [], []
        for _, request, start, _, count, num_new in plans:
            if num_new:
                first = len(request.own_pages)  # the table's columns are the request's own blocks
                table_slots += [request.slot] * num_new
                table_blocks += range(first, first + num_new)
                request.own_pages += pages[taken : taken + num_new]
                taken += num_new
            self._slots.cursor[request.slot] = start + count
        if pages:
            self._slots.set_pages(table_slots, table_blocks, pages)

    def _copy_on_device(self, source, target, lengths, seg_source_row, seg_target_row) -> None:
        """Segment i copies ``lengths[i]`` rows from ``seg_source_row[i]`` to ``seg_target_row[i]``:
        one host-to-device descriptor copy and one kernel launch, or, for up to
        ``SMALL_COPY_ROWS`` rows in all, torch index copies by row."""
        n, as_list = len(lengths), type(lengths) is list  # lists: the small-batch paths' segments
        ends = None if as_list else np.cumsum(lengths)
        rows = sum(lengths) if as_list else int(ends[-1]) if n else 0
        if rows <= SMALL_COPY_ROWS:
            if rows:
                self._copy_small(source, target, lengths, seg_source_row, seg_target_row, rows)
            return
        if as_list:  # one conversion, no array passes
            descriptor = np.fromiter(chain((0,), accumulate(lengths), seg_source_row, seg_target_row), np.int32, 3 * n + 1)
        else:
            descriptor = np.empty(3 * n + 1, dtype=np.int32)
            descriptor[0] = 0
            descriptor[1 : n + 1] = ends
            descriptor[n + 1 : 2 * n + 1] = seg_source_row
            descriptor[2 * n + 1 :] = seg_target_row
        if self.device.type == "cpu":  # three views of the host array
            parts = map(torch.from_numpy, (descriptor[: n + 1], descriptor[n + 1 : 2 * n + 1], descriptor[2 * n + 1 :]))
        else:  # one host-to-device copy, sliced there
            on_device = torch.from_numpy(descriptor).to(self.device, non_blocking=True)
            parts = (on_device[: n + 1], on_device[n + 1 : 2 * n + 1], on_device[2 * n + 1 :])
        self._copy(source, target, *parts, int(descriptor[n]))

    def _copy_small(self, source, target, lengths, seg_source_row, seg_target_row, rows: int) -> None:
        """A few hundred rows at most, as torch index copies: each row's source and target, one
        host-to-device copy of both, then a slice or ``index_select`` of the source and an
        ``index_copy_`` into the target (or one ``index_select`` into a packed gather's target).
        On an H200 these launches cost the host about a third of the kernel's (upload and
        launch, ``bench/bench_small_scatter.py``), and the rows of a decode step are few.
        Segments as lists (the small-batch paths) are checked for contiguous rows segment by
        segment and expanded with C-level iterators, only the side the copy indexes (a step's
        contiguous rows need no source index, a packed read no target index); as arrays, in
        numpy."""
        if type(lengths) is list:
            one_row = rows == len(lengths)  # a decode step's captures: the segments are the rows
            first = seg_source_row[0]
            source_ends = range(first + 1, first + rows + 1) if one_row else list(map(add, seg_source_row, lengths))
            contiguous = source is not target and all(map(eq, seg_source_row[1:], source_ends))
            packed = source is not target and target.shape[0] == rows and seg_target_row[0] == 0 and all(
                map(eq, seg_target_row[1:], range(1, rows) if one_row else accumulate(lengths)))
            expanded = []  # the rows of the sides the copy indexes
            if packed or not contiguous:
                expanded.append(seg_source_row if one_row else chain.from_iterable(map(range, seg_source_row, source_ends)))
            if not packed:
                expanded.append(seg_target_row if one_row else chain.from_iterable(
                    map(range, seg_target_row, map(add, seg_target_row, lengths))))
            index = np.fromiter(chain.from_iterable(expanded), np.int64, len(expanded) * rows)
        else:
            index = np.empty(2 * rows, dtype=np.int64)
            if rows == len(lengths):
                index[:rows], index[rows:] = seg_source_row, seg_target_row
            else:
                within = np.arange(rows) - np.repeat(np.cumsum(lengths) - lengths, lengths)
                index[:rows] = np.repeat(seg_source_row, lengths) + within
                index[rows:] = np.repeat(seg_target_row, lengths) + within
            first = int(index[0])
            contiguous = source is not target and int(index[rows - 1]) - first == rows - 1 and not np.count_nonzero(
                np.diff(index[:rows]) - 1)
            packed = source is not target and target.shape[0] == rows and not np.count_nonzero(index[rows:] - np.arange(rows))
        needs_source, needs_target = packed or not contiguous, not packed  # index: source rows, then target rows
        if self.device.type == "cpu":  # views of the host array: cheaper than slicing a tensor
            source_index = torch.from_numpy(index[:rows]) if needs_source else None
            target_index = torch.from_numpy(index[-rows:]) if needs_target else None
        else:  # one host-to-device copy, sliced there
            index = torch.from_numpy(index).to(self.device, non_blocking=True)
            source_index = index[:rows] if needs_source else None
            target_index = index[-rows:] if needs_target else None
        self._copy_rows(source, target, source_index, target_index, first if contiguous else None, packed)

    @staticmethod
    def _copy_rows(source, target, source_index, target_index, source_first, packed_target: bool) -> None:
        """``target[target_index] = source[source_index]``; ``source_first``: the source rows
        are ``source_first`` on, contiguous, and ``source`` is not ``target`` (None: either is
        not; where it is given, ``source_index`` may be None); ``packed_target``: the target rows
        are all of ``target``, in order (``target_index`` None)."""
        if packed_target:
            torch.index_select(source, 0, source_index, out=target)
        elif source_first is not None:  # a view, no gather
            target.index_copy_(0, target_index, source[source_first : source_first + len(target_index)])
        else:
            target.index_copy_(0, target_index, source.index_select(0, source_index))

    def _plan_captures(self, num_source_rows: int, spans) -> tuple[list[tuple], int]:
        """Check every span against the request cursors as they will be; change nothing.

        Returns ``(request_id, request, start, source_start, count, new pages)`` per span, and
        the number of new pages in all.
        """
        plans, size, num_new_pages = [], self.page_size, 0
        simulated: dict[object, tuple[_Request, int | None, int]] = {}
        for request_id, start, source_start, count in spans:
            self._check_span(request_id, start, source_start, count, num_source_rows)
            if count == 0:
                continue
            known = simulated.get(request_id)
            if known is None:
                request = self._requests.get(request_id) or _Request()
                first_block, cursor = request.first_block, self._cursor_of(request)
            else:
                request, first_block, cursor = known
            seeded = 0
            if first_block is None:
                if start % size and self._seed_page(request, start // size) is None:
                    raise InvalidCaptureError(
                        f"request {request_id!r}: first capture at position {start} starts inside block "
                        f"{start // size}, whose rows are not in the cache (a first capture starts on a page "
                        f"boundary (page size {size}), or inside a block whose hash is published)"
                    )
                first_block, cursor, seeded = start // size, start, start % size > 0
            elif start != cursor:
                kind = "gap" if start > cursor else "overlap"
                raise InvalidCaptureError(
                    f"request {request_id!r}: capture at [{start}, {start + count}) leaves a {kind}; "
                    f"captured rows are [{first_block * size}, {cursor}), next position {cursor}"
                )
            end = start + count
            new_pages = (end + size - 1) // size - (cursor + size - 1) // size + seeded  # blocks begun past the cursor
            num_new_pages += new_pages
            plans.append((request_id, request, start, source_start, count, new_pages))
            simulated[request_id] = (request, first_block, end)
        return plans, num_new_pages

    def _check_span(self, request_id, start, source_start, count, num_source_rows: int) -> None:
        """Refuse a capture span with a bad id or position, or one past its source or past
        ``max_position``; every message names the request."""
        if not (type(start) is type(source_start) is type(count) is int and start >= 0 and source_start >= 0 and count >= 0):
            check_request_id(request_id)
            for name, value in (("start", start), ("source_start", source_start), ("count", count)):
                if check_position(name, value, request_id) < 0:
                    raise InvalidCaptureError(f"request {request_id!r}: {name} must be >= 0, got {value}")
        if type(request_id) is not str:
            check_request_id(request_id)
        if source_start + count > num_source_rows:
            raise InvalidCaptureError(
                f"request {request_id!r}: rows [{source_start}, {source_start + count}) exceed the "
                f"{num_source_rows} source rows"
            )
        if start + count > self.max_position:
            raise InvalidCaptureError(
                f"request {request_id!r}: capture at [{start}, {start + count}) goes past the cache's "
                f"max_position {self.max_position}"
            )

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
        self.add_block_hashes_step(*checked_hash_lists(request_ids, hash_lists))

    def add_block_hashes_step(self, request_ids: list, hash_lists: list[list[bytes]]) -> None:
        """``add_block_hashes_batch`` for an engine step whose ids and hashes the caller has
        checked: lists as ``checks.checked_hash_lists`` returns them.

        In request order, a request's hashes before its first own block are pinned, and its
        full own blocks whose hashes are now known are published (as ``_settle`` does, in the same
        pass: a decode step's common case, one request's newly full block, costs no second one).
        Pins and publishes batch up where their order does not matter; a pin after a publish
        flushes both, in order: it decides duplicates."""
        requests, pinning, publishing, pages = self._requests, [], [], []
        size, cursor_of = self.page_size, self._slots.cursor.item
        for request_id, hashes in zip(request_ids, hash_lists):
            request = requests.get(request_id)
            if request is None:
                request = _Request()
                self._register(request_id, request)
                cursor_of = self._slots.cursor.item  # the slot arrays may have grown
            known = request.hashes
            first_new = len(known)
            known += hashes
            first_block = request.first_block
            if first_block is None or first_block > first_new:  # hashes of prefix blocks: pins
                if publishing:
                    if pinning:
                        self._pages.pin(pinning)
                    self._pages.publish_many(publishing, pages)
                    pinning, publishing, pages = [], [], []
                if first_block is None:
                    pinning += hashes
                    continue
                pinning += hashes[: first_block - first_new]
            request.take_settling(cursor_of(request.slot) // size, publishing, pages)  # its full own blocks
        if pinning:
            self._pages.pin(pinning)
        if publishing:
            self._pages.publish_many(publishing, pages)

    def retain(self, hashes: Iterable[bytes]) -> None:
        """Pin published (or future) blocks by hash, independent of any request."""
        hashes = as_list(hashes, "retained hashes")
        check_hashes(hashes, "retained hashes")
        self._pages.retain(hashes)

    def pin_step(self, retained: list[bytes], released: list[bytes]) -> None:
        """``retain(retained)``, then ``release(released)``, for an engine step whose hashes the
        caller has checked (lists of non-empty bytes). A release of hashes that are not retained
        then refuses both: nothing changes."""
        self._pages.retain(retained)
        try:
            self._check_retained(released)
        except RoutedExpertsCacheError:
            self._pages.release(retained)
            raise
        self._pages.release(released)

    def _check_retained(self, hashes: list[bytes], retained_before: Counter | None = None) -> None:
        """Raise unless every hash of ``hashes`` is retained as often as it is listed, counting
        ``retained_before`` (retains not applied yet, less their releases) as retained."""
        if hashes:
            retained_before = retained_before or Counter()
            missing = [h.hex() for h, n in Counter(hashes).items() if self._pages.retained.get(h, 0) + retained_before[h] < n]
            if missing:
                raise RoutedExpertsCacheError(f"release of hashes that were not retained: {missing}")

    def check_pin_step(self, retained: list[bytes], released: list[bytes], retained_before: Counter) -> None:
        """Raise as ``pin_step(retained, released)`` would after ``retained_before`` (net retains of
        pin steps not applied yet); change nothing. The caller that defers pin steps checks
        each one when it arrives, so applying them in order later cannot fail."""
        if released:
            before = Counter(retained_before)  # counts may be negative: releases of retains applied already
            before.update(retained)
            self._check_retained(released, before)

    def release(self, hashes: Iterable[bytes]) -> None:
        """Drop pins taken by ``retain``, in the given order (last released is evicted last)."""
        hashes = as_list(hashes, "released hashes")
        check_hashes(hashes, "released hashes")
        self._check_retained(hashes)
        self._pages.release(hashes)

    def import_blocks(self, hashes: Iterable[bytes], rows: torch.Tensor) -> int:
        """Publish rows computed elsewhere (another engine instance's prefill) as full blocks:
        ``rows[i * page_size : (i + 1) * page_size]`` under ``hashes[i]``. Blocks already
        published keep their pages. Imported blocks are not pinned: a request that reads them
        pins them by hash (``add_block_hashes`` before this call). Returns the blocks imported.

        All or nothing: rows and hashes are checked and the room is found before any change.
        """
        hashes = as_list(hashes, "imported hashes")
        check_hashes(hashes, "imported hashes")
        check_rows("<import>", rows, self.row_shape)
        size = self.page_size
        if rows.shape[0] != len(hashes) * size:
            raise InvalidCaptureError(
                f"import of {len(hashes)} blocks needs {len(hashes) * size} rows (page size {size}), got {rows.shape[0]}"
            )
        if not fits_dtype(rows.dtype, self.dtype):
            check_row_values(rows, [("<import>", 0, 0, rows.shape[0])], self.dtype)
        new, seen = [], set()
        for i, block_hash in enumerate(hashes):  # each hash once, those not published yet
            if block_hash not in self._pages.published and block_hash not in seen:
                seen.add(block_hash)
                new.append(i)
        if not new:
            return 0
        if len(new) > self._pages.room():
            raise CacheFullError(
                f"import of {len(new)} blocks needs {len(new)} pages; only {self._pages.room()} free, evictable "
                f"or demotable of {self.num_pages}"
            )
        source_words = self._source_words(rows)
        pages, victims, demotions = self._pages.next_pages(len(new), [])
        try:
            self._demote(demotions)
            lengths = np.full(len(new), size, dtype=np.int64)
            self._copy_on_device(source_words, self._pool_words, lengths, np.array(new) * size, np.array(pages) * size)
        except Exception:
            self._pages.discard(victims)
            raise
        # Every page is taken before any block is published: an imported block is unpinned, so
        # evictable, and an allocation after it would take its page instead of the one the copy
        # wrote (with a host tier, a block demoted in the look-ahead above would stay published
        # on a page that now holds imported rows).
        for i, page in zip(new, self._pages.allocate_many(len(new))):
            self._pages.publish(hashes[i], page)
            self._pages.unpin([hashes[i]])  # no publisher holds it: readers pin it by hash
        self._counters["imported_rows"] += len(new) * size
        return len(new)

    def _pinned_hashes(self, request: _Request) -> list[bytes]:
        """The hashes a request pins, in block order: its prefix blocks (every hash before its
        first capture) and its own blocks whose page is the published one."""
        if request.first_block is None:
            return list(request.hashes)
        own = request.hashes[request.first_block : request.first_block + request.num_settled]
        return request.hashes[: request.first_block] + [
            block_hash for block_hash, page in zip(own, request.own_pages) if self._pages.published.get(block_hash) == page
        ]

    def _settle(self, requests: list[_Request], order: Iterable | None = None) -> None:
        """Publish the requests' full own blocks whose hashes are known, with one
        ``publish_many``: in request and block order, or, where two of the requests complete
        the same block, with the requests in ``order`` (request ids; the first publishes it).

        A block whose hash another page publishes and someone pins stays a duplicate: this
        request keeps reading its own copy, freed at finish (``PagePool.publish``).
        """
        hashes, pages, ends = [], [], []
        size, cursor_of = self.page_size, self._slots.cursor.item
        for request in requests:
            if request.first_block is not None:
                request.take_settling(cursor_of(request.slot) // size, hashes, pages)
            ends.append(len(hashes))
        if not hashes:
            return
        if order is not None and len(requests) > 1 and len(set(hashes)) < len(hashes):
            # Each id's first position in ``order``, in C-level passes (``order`` lists every
            # request of the step, not only these): reversed, so that the first position is
            # the one a repeated id keeps.
            listed = list(order)
            rank = dict(zip(reversed(listed), range(len(listed) - 1, -1, -1)))
            ids, starts = self._slots.ids, [0, *ends[:-1]]
            by_rank = sorted(range(len(requests)), key=lambda j: rank.get(ids[requests[j].slot], len(rank)))
            hashes, pages = (
                list(chain.from_iterable(map(values.__getitem__, (slice(starts[j], ends[j]) for j in by_rank))))
                for values in (hashes, pages)
            )
        self._pages.publish_many(hashes, pages)

    # -------------------------------------------------------------------- read

    def read(self, request_id, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of a request as a new tensor ``[end - start, *row_shape]``.

        ``read_batch`` for one interval. Its range is checked here first, so every error names
        the request, also for a position no int64 array can hold.
        """
        self._check_range(request_id, start, end)
        return self.read_batch([request_id], [start], [end])[0]

    def read_batch(self, request_ids: Sequence, starts, ends, slots=None) -> tuple[torch.Tensor, np.ndarray]:
        """Rows ``[starts[i], ends[i])`` of request ``request_ids[i]`` for every i, in one new
        tensor (never a view of the pool) with one gather: interval i is
        ``packed[offsets[i] : offsets[i + 1]]``, ``offsets`` an int64 array of n + 1.

        Every interval is located before anything is copied: a missing row fails the call.
        """
        request_ids = as_list(request_ids, "read request ids", RangeUnavailableError)
        slots = self._slots.checked(request_ids, slots)
        n = len(request_ids)
        starts, ends = (index_array(v, w, n, RangeUnavailableError) for v, w in ((starts, "starts"), (ends, "ends")))
        return self.read_step(request_ids, slots, starts, ends)

    def read_step(self, request_ids: list, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """``read_batch`` for an engine step whose arguments the caller has checked: ``slots``
        from ``slots()`` (or -1) for ``request_ids``, ``starts`` and ``ends`` int64 arrays of the
        same length. Ranges are checked here (names the request, the range and what exists).

        Above ``SMALL_BATCH`` intervals, those within a request's own captured rows are
        located with array passes; the others (and every interval of a small batch) are walked
        one by one in ``_append_segments``, their segments landing at their packed offsets.
        """
        n, size = len(request_ids), self.page_size
        source_rows, target_rows, lengths = [], [], []
        if n <= batch_size.SMALL_BATCH:  # offsets summed in Python: numpy's cumsum costs more for a few
            others, start_list, end_list = range(n), starts.tolist(), ends.tolist()
            offset_list = list(accumulate(map(max, map(sub, end_list, start_list), repeat(0, n)), initial=0))
            offsets = None  # an array once every interval is found (their rows fit the pool, so int64)
        else:  # intervals within a request's own rows located with array passes
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.maximum(ends - starts, 0), out=offsets[1:])
            first_block = self._slots.first_block[slots]
            own = (slots >= 0) & (first_block >= 0) & (starts >= first_block * size) & (starts <= ends)
            own &= ends <= self._slots.cursor[slots]
            pick = own.nonzero()[0]
            span, block, first, end = self._page_runs(starts[pick], ends[pick])
            pages = self._slots.table[slots[pick][span], block - first_block[pick][span]]
            source_rows.append(pages * size + first - block * size)
            target_rows.append(offsets[pick][span] + first - starts[pick][span])
            lengths.append(end - first)
            others = (~own).nonzero()[0].tolist()
            start_list, end_list, offset_list = starts[others].tolist(), ends[others].tolist(), offsets[others].tolist()
        seg_source_row, seg_target_row, seg_end = [], [], []
        for i, start, end, offset in zip(others, start_list, end_list, offset_list):
            seg_start = [offset]
            self._append_segments(request_ids[i], start, end, seg_source_row, seg_start)
            seg_target_row += seg_start[:-1]
            seg_end += seg_start[1:]
        if offsets is None:
            offsets = np.array(offset_list, dtype=np.int64)
        seg_lengths = [end - start for start, end in zip(seg_target_row, seg_end)]
        if lengths:  # with the array passes' segments
            lengths, source_rows, target_rows = (
                np.concatenate([*parts, np.array(walked, dtype=np.int64)])
                for parts, walked in ((lengths, seg_lengths), (source_rows, seg_source_row), (target_rows, seg_target_row))
            )
        else:
            lengths, source_rows, target_rows = seg_lengths, seg_source_row, seg_target_row
        total = int(offsets[-1])
        packed = torch.empty((total, *self.row_shape), dtype=self.dtype, device=self.device)
        if self._pages.host_pages:
            lengths, source_rows, target_rows = self._gather_host_rows(packed, lengths, source_rows, target_rows)
        self._copy_on_device(self._pool_words, self._copy_view(packed), lengths, source_rows, target_rows)
        self._counters["read_rows"] += total
        return packed, offsets

    def _gather_host_rows(self, packed: torch.Tensor, lengths, source_rows, target_rows):
        """Copy the segments of blocks demoted to the host tier into ``packed`` (gathered on the
        host, one copy to the device); return the segments left for the pool gather."""
        lengths, source_rows, target_rows = (np.asarray(v, dtype=np.int64) for v in (lengths, source_rows, target_rows))
        host_rows = self.num_pages * self.page_size
        from_host = source_rows >= host_rows
        if from_host.any():
            runs = lengths[from_host]
            within = np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)
            rows = self.host_arena.view(-1, *self.row_shape)[np.repeat(source_rows[from_host] - host_rows, runs) + within]
            _indexable(packed)[torch.from_numpy(np.repeat(target_rows[from_host], runs) + within).to(self.device)] = _indexable(
                rows.to(self.device))
            lengths, source_rows, target_rows = lengths[~from_host], source_rows[~from_host], target_rows[~from_host]
            self._counters["host_read_rows"] += int(runs.sum())
        return lengths, source_rows, target_rows

    def _append_segments(self, request_id, start, end, seg_source_row: list, seg_start: list) -> None:
        """Append the pool segments covering [start, end); raise if any row is missing."""
        self._check_range(request_id, start, end)
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
        # One segment per block: prefix blocks through the published index, own blocks from
        # the block map (map and slices, no Python per block).
        first, last, own_first = start // size, (end - 1) // size, own_start // size
        pages = []
        if first < own_first:
            prefix = request.hashes[first : min(last + 1, own_first)]
            pages = list(map(self._pages.published.get, prefix))
            if len(prefix) < min(last + 1, own_first) - first or None in pages:
                raise self._unavailable(request_id, request, start, end)
        if last >= own_first:
            pages += request.own_pages[max(first, own_first) - first_block : last + 1 - first_block]
        rows = [page * size for page in pages]
        rows[0] += start - first * size
        seg_source_row += rows
        offset = seg_start[-1] - start
        seg_start += range(offset + (first + 1) * size, offset + end, size)
        seg_start.append(offset + end)

    def _check_range(self, request_id, start, end) -> None:
        """Refuse a read with a bad id or position, a reversed range or one past
        ``max_position``; every message names the request."""
        if type(request_id) is not str:
            check_request_id(request_id)
        if type(start) is not int or type(end) is not int:
            check_position("start", start, request_id)
            check_position("end", end, request_id)
        if not 0 <= start <= end:
            raise RangeUnavailableError(f"request {request_id!r}: invalid range [{start}, {end})")
        if end > self.max_position:
            raise RangeUnavailableError(
                f"request {request_id!r}: range [{start}, {end}) goes past the cache's max_position {self.max_position}"
            )

    def _unavailable(self, request_id, request: _Request, start: int, end: int) -> RangeUnavailableError:
        own_start = request.own_start(self.page_size)
        prefix_blocks = min(len(request.hashes), own_start // self.page_size)
        ranges: list[tuple[int, int]] = []
        for block in range(prefix_blocks):
            if request.hashes[block] in self._pages.published:
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
        check_request_id(request_id)
        self.finish_step([request_id])

    def finish_step(self, request_ids: list) -> None:
        """``finish`` for an engine step's finished requests, in order, whose ids the caller has
        checked: the pages freed and the pins released are those of ``finish`` one request
        after another, in the same order, with one free-list extend and one ``unpin`` for all
        of them (finishing a request frees pages and drops pins but publishes nothing, so the
        next request's kept pages are the same either way)."""
        pop, finished, finished_ids = self._requests.pop, [], []
        for request_id in request_ids:
            request = pop(request_id, None)
            if request is not None:
                finished.append(request)
                finished_ids.append(request_id)
        if not finished:
            return
        self._slots.remove_many(finished_ids)
        published_get, freed, unpins = self._pages.published.get, [], []
        for request in finished:
            if request.first_block is None:
                unpins.append(reversed(request.hashes))
                continue
            # Own pages published under their block's hash stay (pinned by this request until the
            # unpin below); every other own page (tail, pending, duplicate) is freed.
            first_block, settled = request.first_block, request.num_settled
            own, pages = request.hashes[first_block : first_block + settled], request.own_pages
            kept = list(map(eq, map(published_get, own), pages))
            freed.append(reversed(pages[settled:]))
            freed.append(compress(reversed(pages[:settled]), map(not_, reversed(kept))))
            unpins.append(reversed(list(compress(own, kept))))
            unpins.append(reversed(request.hashes[:first_block]))
        self._pages.free.extend(chain.from_iterable(freed))
        self._pages.unpin(chain.from_iterable(unpins))

    def rewind(self, request_id, position: int) -> None:
        """Forget a request's captured rows from ``position`` on: the engine recomputes them.

        vLLM rolls a request's computed tokens back when KV blocks fail to load; the rows
        computed on that KV are not the request's rows. Own pages past ``position`` are freed,
        and unpublished if they were the published copy; before the first captured block the
        rewind must be on a page boundary, and those prefix blocks become the request's own
        (it recomputes them). Unknown requests and positions at or past the cursor: no-op.
        """
        check_request_id(request_id)
        if not 0 <= check_position("position", position, request_id) <= self.max_position:
            raise InvalidCaptureError(
                f"request {request_id!r}: rewind position {position} is outside [0, max_position {self.max_position}]"
            )
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
            if self._pages.published.get(block_hash) == request.own_pages[offset]:
                self._pages.unpublish(block_hash)  # its rows came from the rolled-back computation
        request.num_settled = min(request.num_settled, partial)
        keep = -(-max(0, position - own_start) // size)  # own pages still holding rows
        self._pages.free.extend(reversed(request.own_pages[keep:]))
        del request.own_pages[keep:]
        if position < own_start:
            request.first_block = position // size
            self._slots.first_block[request.slot] = request.first_block
            self._pages.unpin(reversed(request.hashes[request.first_block : first_block]))
        self._counters["rewound_rows"] += self._cursor_of(request) - position
        self._slots.cursor[request.slot] = position

    def reset(self) -> None:
        """Drop every request and page; hashes from before never hit again."""
        self.generation += 1
        self._clear()

    # ------------------------------------------------------------ introspection

    def is_published(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is in the index (findable by prefix hits)."""
        return block_hash in self._pages.published

    def page_states(self) -> dict[int, str]:
        """State of every non-free page: 'tail', 'pending', 'duplicate' or 'published'."""
        num_pages, size = self.num_pages, self.page_size
        states = {page: "published" for page in self._pages.published.values() if page < num_pages}
        for request in self._requests.values():
            cursor = self._cursor_of(request)
            for offset, page in enumerate(request.own_pages):
                if offset < request.num_settled:
                    if states.get(page) != "published":
                        states[page] = "duplicate"
                elif (request.first_block + offset + 1) * size <= cursor:
                    states[page] = "pending"
                else:
                    states[page] = "tail"
        return states

    def stats(self) -> dict[str, int]:
        counts = Counter(self.page_states().values())
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "free": len(self._pages.free),
            "tail": counts["tail"],
            "pending": counts["pending"],
            "duplicate": counts["duplicate"],
            "published": counts["published"],
            "evictable": len(self._pages.evictable),
            "pinned_hashes": len(self._pages.pins),
            "requests": len(self._requests),
            "generation": self.generation,
            "evictions": self._pages.evictions,
            "host_pages": self._pages.host_pages,
            "demoted": self._pages.host_pages - len(self._pages.host_free),
            "demotions": self._pages.demotions,
            "host_evictions": self._pages.host_evictions,
            "published_blocks": self._pages.published_blocks,
            "prefix_hit_rows": self._counters["prefix_hit_rows"],
            "captured_rows": self._counters["captured_rows"],
            "read_rows": self._counters["read_rows"],
            "host_read_rows": self._counters["host_read_rows"],
            "imported_rows": self._counters["imported_rows"],
            "rewound_rows": self._counters["rewound_rows"],
        }

    def check_consistency(self) -> None:
        """Raise if the page accounting is broken (used by the property tests)."""
        owned = [page for r in self._requests.values() for page in r.own_pages]
        expected_pins = Counter(h for r in self._requests.values() for h in self._pinned_hashes(r)) + Counter(self._pages.retained)
        problems = self._pages.problems(set(owned), expected_pins)
        if len(set(owned)) != len(owned):
            problems.append("a page is owned by two requests")
        slots = self._slots
        if len(slots.free) + len(self._requests) != len(slots.requests) or any(
            slots.requests[slot] is not None or slots.ids[slot] is not None for slot in slots.free
        ):
            problems.append("a free slot still holds a request, or a slot is neither free nor live")
        for request_id, r in self._requests.items():
            first = r.first_block if r.first_block is not None else -1
            if (
                self._slots.requests[r.slot] is not r or self._slots.first_block[r.slot] != first
                or self._slots.ids[r.slot] != request_id or self._slots.of[request_id] != r.slot
            ):
                problems.append("a request's slot arrays disagree with its block map")
            elif r.own_pages and self._slots.table[r.slot, : len(r.own_pages)].tolist() != r.own_pages:
                problems.append("the block table disagrees with a request's own pages")
            elif r.first_block is not None and r.num_settled != max(
                0, min(self._cursor_of(r) // self.page_size, len(r.hashes)) - r.first_block
            ):
                problems.append("a request's full own blocks with known hashes are not all settled")
        if problems:
            raise RoutedExpertsCacheError("cache accounting is inconsistent: " + "; ".join(problems))
