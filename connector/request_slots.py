"""Slot-indexed arrays of the live requests: what a step's batched calls vectorise over."""

from itertools import repeat

import numpy as np

from .checks import check_request_ids, index_array
from ..errors import RoutedExpertsCacheError


class RequestSlots:
    """Each live request has a slot; per slot, arrays mirror its block map.

    ``cursor[s]`` is the next position to capture, ``first_block[s]`` the first block the
    request captured itself (-1 before its first capture), ``table[s, k]`` the page of its
    ``k``-th own block, block ``first_block[s] + k`` (-1 elsewhere), and ``ids[s]`` its id, so
    a slot handed back by a caller is checked against the request it names. The table is as
    wide as the most blocks one request holds, however far out a request starts. A finished
    request's slot is reused; the arrays grow by doubling, so a step never reallocates them
    in the common case.
    """

    def __init__(self) -> None:
        self.of: dict[object, int] = {}  # request id -> slot
        self.requests: list = []  # per slot: the request's block map, None once free
        self.free: list[int] = []  # slots of finished requests, reused first
        self.cursor = np.zeros(16, dtype=np.int64)
        self.first_block = np.full(16, -1, dtype=np.int64)
        self.table = np.full((16, 16), -1, dtype=np.int64)
        self.ids = np.full(16, None, dtype=object)

    def add(self, request_id, request) -> int:
        """Give a new request a slot (nothing captured: cursor 0, first block -1) and return it."""
        if self.free:
            slot = self.free.pop()
        else:
            slot = len(self.requests)
            self.requests.append(None)
            if slot == len(self.cursor):
                self.cursor = np.concatenate([self.cursor, np.zeros_like(self.cursor)])
                self.first_block = np.concatenate([self.first_block, np.full_like(self.first_block, -1)])
                self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
                self.ids = np.concatenate([self.ids, np.full_like(self.ids, None)])
        self.of[request_id] = slot
        self.requests[slot] = request
        self.ids[slot] = request_id
        self.cursor[slot] = 0
        self.first_block[slot] = -1
        return slot

    def remove_many(self, request_ids: list) -> None:
        """Free live requests' slots, in order (their table rows are overwritten by the next
        owners' pages)."""
        requests, ids, pop = self.requests, self.ids, self.of.pop
        for request_id in request_ids:
            slot = pop(request_id)
            requests[slot] = None
            ids[slot] = None
            self.free.append(slot)

    def set_pages(self, slots, own_blocks, pages) -> None:
        """``table[slots, own_blocks] = pages``, widening the table to the largest own block."""
        width = (max(own_blocks) if type(own_blocks) is list else int(own_blocks.max())) + 1
        if width > self.table.shape[1]:
            grown = np.full((self.table.shape[0], 1 << (width - 1).bit_length()), -1, dtype=np.int64)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        if type(pages) is list and len(pages) <= 8:  # a few cells: cheaper than converting three lists
            table = self.table
            for slot, own_block, page in zip(slots, own_blocks, pages):
                table[slot, own_block] = page
        else:
            self.table[slots, own_blocks] = pages

    def lookup(self, request_ids: list) -> np.ndarray:
        """Slots of live requests, -1 for unknown ones; ids of the wrong type are refused."""
        check_request_ids(request_ids)
        return np.fromiter(map(self.of.get, request_ids, repeat(-1)), dtype=np.int64, count=len(request_ids))

    def checked(self, request_ids: list, slots) -> np.ndarray:
        """The slots of ``request_ids``: looked up, or the given ones checked against the ids
        (a stale slot must never read another request's rows)."""
        if slots is None:
            return self.lookup(request_ids)
        slots = index_array(slots, "slots", len(request_ids))
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self.requests)):
            raise RoutedExpertsCacheError(f"slots must come from slots(); got values outside [0, {len(self.requests)})")
        owners = self.ids[slots].tolist()
        if owners != request_ids:
            i = next(i for i, (owner, request_id) in enumerate(zip(owners, request_ids)) if owner != request_id)
            raise RoutedExpertsCacheError(
                f"slot {slots[i]} does not belong to request {request_ids[i]!r} (slots stay valid until "
                f"their request finishes or the cache is reset)"
            )
        return slots
