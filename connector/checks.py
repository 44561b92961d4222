"""Argument checks of the cache's public calls.

Each check raises one of the project's typed errors naming what was wrong, and runs before the
call changes anything. The common case (well-typed input, as an engine sends it) is checked with
C-level passes over a whole batch; a Python loop runs only to name the first bad value.
"""

from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch

from ..errors import InvalidCaptureError, RoutedExpertsCacheError

BOOL_TYPES = (bool, np.bool_)
ROW_DTYPES = (
    torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32, torch.int32, torch.uint64, torch.int64,
)


def check_request_id(request_id) -> None:
    if type(request_id) is not str and type(request_id) is not int:  # bool and numpy ints are refused
        raise RoutedExpertsCacheError(f"request id must be a str or int, got {request_id!r}")


def check_request_ids(request_ids: list) -> None:
    """``check_request_id`` for each id: one C-level pass over their types, the first bad id
    named when there is one."""
    if not set(map(type, request_ids)) <= {str, int}:
        for request_id in request_ids:
            check_request_id(request_id)


def check_position(name: str, value, request_id) -> int:
    if type(value) is not int:
        raise RoutedExpertsCacheError(f"request {request_id!r}: {name} must be an int, got {value!r}")
    return value


def as_list(values, what: str, error: type[RoutedExpertsCacheError] = InvalidCaptureError) -> list:
    """``list(values)`` for a sequence argument; one value or a non-iterable is refused."""
    if isinstance(values, (bytes, bytearray, str, torch.Tensor)) or not isinstance(values, Iterable):
        raise error(f"{what} must be a sequence (a list or another iterable), got {type(values).__name__}")
    return list(values)


def index_array(values, what: str, length: int, error: type[RoutedExpertsCacheError] = RoutedExpertsCacheError) -> np.ndarray:
    """A 1-D int64 array of ``length`` integers (numpy, torch CPU or a sequence of ints)."""
    if type(values) in (list, tuple) and not set(map(type, values)).isdisjoint(BOOL_TYPES):
        raise error(f"{what} must be integers, got a bool among them: {list(values)!r}")  # numpy would fold it in
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


def all_hashes(values: list) -> bool:
    """Whether every value is non-empty bytes (two C-level passes, no Python loop)."""
    return set(map(type, values)) <= {bytes} and all(values)


def check_hashes(hashes: list, what: str, request_id=None) -> None:
    if all_hashes(hashes):
        return
    for block_hash in hashes:
        if type(block_hash) is not bytes or not block_hash:
            where = f"request {request_id!r}: " if request_id is not None else ""
            raise InvalidCaptureError(f"{where}{what} must be non-empty bytes, got {block_hash!r}")


def checked_hash_lists(request_ids, hash_lists) -> tuple[list, list[list[bytes]]]:
    """``(request_ids, hash_lists)`` as lists, each hash list a list of non-empty bytes; raise
    the error ``add_block_hashes_batch`` would, before anything is added."""
    request_ids = as_list(request_ids, "request ids for block hashes")
    hash_lists = as_list(hash_lists, "block hash lists")
    if len(hash_lists) != len(request_ids):
        raise InvalidCaptureError(f"{len(request_ids)} request ids but {len(hash_lists)} block hash lists")
    check_request_ids(request_ids)
    for i, hashes in enumerate(hash_lists):
        if type(hashes) is not list:
            hash_lists[i] = as_list(hashes, f"request {request_ids[i]!r}: block hashes")
    if not all_hashes(list(chain.from_iterable(hash_lists))):
        for request_id, hashes in zip(request_ids, hash_lists):
            check_hashes(hashes, "block hashes", request_id)  # names the first bad one
    return request_ids, hash_lists


def check_rows(request_id, rows, row_shape: tuple[int, ...]) -> None:
    """Rows to capture: a dense integer tensor ``[n, *row_shape]``."""
    if not isinstance(rows, torch.Tensor):
        raise InvalidCaptureError(f"request {request_id!r}: rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype not in ROW_DTYPES:
        raise InvalidCaptureError(f"request {request_id!r}: rows must be an integer tensor, got {rows.dtype}")
    if rows.layout != torch.strided or rows.is_meta:
        raise InvalidCaptureError(
            f"request {request_id!r}: rows must be a dense tensor holding data, got {rows.layout} on {rows.device}"
        )
    if rows.dim() != 1 + len(row_shape) or tuple(rows.shape[1:]) != row_shape:
        raise InvalidCaptureError(
            f"request {request_id!r}: rows must have shape [n, {', '.join(map(str, row_shape))}], "
            f"got {list(rows.shape)}"
        )


def fits_dtype(source: torch.dtype, pool: torch.dtype) -> bool:
    """Whether every value of ``source`` is representable in ``pool``."""
    wide, narrow = torch.iinfo(source), torch.iinfo(pool)
    return wide.min >= narrow.min and wide.max <= narrow.max


def check_row_values(source: torch.Tensor, spans, pool: torch.dtype) -> None:
    """Refuse rows whose ids do not fit the pool dtype: narrowing them would store wrong ids.

    ``spans`` are ``(request_id, start, source_start, count)``: the first bad row of a span is
    named by its request and position. Costs nothing when the source dtype fits (the vLLM
    path); otherwise one reduction and one host copy of the offending row numbers. Each bound
    is compared only where the source dtype can exceed it, so the bound itself is representable
    there (torch narrows a Python scalar to the tensor's dtype: ``int8 > 255`` would wrap).
    """
    if fits_dtype(source.dtype, pool):
        return
    wide, narrow = torch.iinfo(source.dtype), torch.iinfo(pool)
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
            column = int(bad[row].nonzero()[0])  # the first bad id of the row, not all of them
            index = tuple(int(i) for i in np.unravel_index(column, source.shape[1:]))
            raise InvalidCaptureError(
                f"request {request_id!r}: row at position {start + row - source_start} of capture "
                f"[{start}, {start + count}) holds ids outside the pool dtype {pool} "
                f"[{narrow.min}, {narrow.max}]: first at index {index} (layer, top-k slot), id "
                f"{source[row].flatten()[column].item()}; {int(bad[row].sum())} bad ids in the row"
            )
