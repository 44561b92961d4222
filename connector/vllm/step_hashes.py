"""One scheduler step's block hashes, checked on the model thread and split into hashes where
they are used (the output thread).

vLLM (0.32-0.34) sends a request's new block hashes, and the step's retained and released ones,
as ``PackedBlockHashes``: one ``bytes`` of fixed-size items. Such a value is valid by its layout
alone (bytes, an item size that divides them), so checking a step costs a few C-level passes;
splitting it into one ``bytes`` per hash is the part that scales with the hashes, and it can
wait until the pool needs them.
"""

from __future__ import annotations

from itertools import accumulate, chain
from operator import attrgetter

import numpy as np

from ..checks import all_hashes, check_hashes, checked_hash_lists
from ...errors import InvalidCaptureError

ITEM_SIZE, DATA = attrgetter("item_size"), attrgetter("data")
SLICED_ITEMS = 16  # below it, slicing each item beats numpy's fixed cost


def unpack_hashes(packed, owner: str) -> list[bytes]:
    """The hashes of vLLM's ``PackedBlockHashes`` (one bytes object, fixed-size items), sliced
    in one comprehension instead of its per-item generator; other iterables as a list. An item
    size that is not a positive integer is refused, naming ``owner``: vLLM's iterator would
    raise a bare error on it, or yield nothing and lose the hashes."""
    data, size = getattr(packed, "data", None), getattr(packed, "item_size", None)
    if type(data) is bytes and type(size) is int and size > 0:
        return [data[i : i + size] for i in range(0, len(data), size)]
    if hasattr(packed, "item_size") and not (isinstance(size, int) and size > 0):
        raise InvalidCaptureError(f"{owner}: packed block hashes need a positive integer item size, got {size!r}")
    return list(packed)


def packed_layout(values: list) -> tuple[int, list[bytes], list[int]] | None:
    """``(item size, data, data lengths)`` of several ``PackedBlockHashes`` with one item size;
    None when any of them is not such a value (a list, a bytes-like ``data``, an item size that
    does not divide its data: vLLM's iterator would yield a short last item). Item sizes are
    compared as ints (``2.0 == 2``, ``True == 1``: a set would fold them together)."""
    try:
        sizes, datas = list(map(ITEM_SIZE, values)), list(map(DATA, values))
    except AttributeError:
        return None
    if not values:
        return 1, [], []
    size = sizes[0]
    if set(map(type, sizes)) != {int} or sizes.count(size) != len(sizes) or size <= 0:
        return None
    if not set(map(type, datas)) <= {bytes}:
        return None
    lengths = list(map(len, datas))
    if any(map(size.__rmod__, lengths)):
        return None
    return size, datas, lengths


def split_packed(size: int, datas: list[bytes], lengths: list[int]) -> list[list[bytes]]:
    """The hash lists of a ``packed_layout``: a value of one hash is that hash (a decode step's
    common case); few hashes are sliced; many go through one numpy conversion of their joined
    bytes (an ``S`` dtype would strip trailing zero bytes; ``V`` keeps every byte)."""
    if lengths.count(size) == len(lengths):
        return [[data] for data in datas]
    if sum(lengths) < SLICED_ITEMS * size:
        return [[data[i : i + size] for i in range(0, len(data), size)] for data in datas]
    flat = np.frombuffer(b"".join(datas), dtype=f"V{size}").tolist()
    ends = list(accumulate(map(size.__rfloordiv__, lengths)))
    return list(map(flat.__getitem__, map(slice, [0, *ends[:-1]], ends)))


class StepHashes:
    """A step's block hashes per request (``request_ids``, ``hash_lists``) and its retained and
    released hashes (``retained``, ``released``). Built on the model thread, where a bad value
    refuses the step (non-empty bytes; the first bad one named); packed values are split on
    first use of any of the lists, once."""

    def __init__(self, metadata) -> None:
        self.request_ids = list(metadata.block_hashes)
        pins = [getattr(metadata, name, None) for name in ("retained_block_hashes", "released_block_hashes")]
        self._has_pins = [bool(values) for values in pins]
        values = [*metadata.block_hashes.values(), *filter(None, pins)]
        self._layout = packed_layout(values)
        self._lists: list[list[bytes]] | None = None
        if self._layout is None:  # not vLLM's packed values: unpacked and checked now
            owners = [*(f"request {request_id!r}" for request_id in self.request_ids),
                      *(name for name, value in zip(("retained hashes", "released hashes"), pins) if value)]
            self._lists = list(map(unpack_hashes, values, owners))
            if not all_hashes(list(chain.from_iterable(self._lists))):
                checked_hash_lists(self.request_ids, self.hash_lists)
                check_hashes(self.retained, "retained hashes")
                check_hashes(self.released, "released hashes")

    def __bool__(self) -> bool:
        """Whether the step has any block hashes or pins."""
        return bool(self.request_ids) or any(self._has_pins)

    def drop_pins(self) -> None:
        """Forget the step's retained and released hashes (a new generation drops them)."""
        self._has_pins = [False, False]

    def _unpacked(self) -> list[list[bytes]]:
        if self._lists is None:
            self._lists = split_packed(*self._layout)
        return self._lists

    @property
    def hash_lists(self) -> list[list[bytes]]:
        return self._unpacked()[: len(self.request_ids)]

    @property
    def retained(self) -> list[bytes]:
        return self._unpacked()[len(self.request_ids)] if self._has_pins[0] else []

    @property
    def released(self) -> list[bytes]:
        if not self._has_pins[1]:
            return []
        return self._unpacked()[len(self.request_ids) + self._has_pins[0]]
