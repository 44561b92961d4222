"""Where plain Python over a batch costs less than array passes over it.

A numpy call costs about a microsecond to set up (a reduction several), whatever its size, so
below a few dozen items Python over a list is cheaper; above that, array passes win. The
cache's page splitting and reads choose their path by ``SMALL_BATCH``, the reductions here
do the same, and the connector keeps its request state in objects or in slot arrays by
``stays_small``. Measured with ``bench/bench_host_ab.py`` (whole steps, vLLM 0.33): at 64
requests the Python paths took 0.93-0.97x the array paths' CPU, at 96 1.0-1.1x, at 128
1.03-1.09x (state in slot arrays either way); the state in objects took 0.85-0.90x at 16
requests and 0.91-1.06x at 64 (2026-12-07).
"""

import numpy as np

SMALL_BATCH = 64


def stays_small(num_requests: int, small_now: bool) -> bool:
    """Whether steps with ``num_requests`` tracked keep the small-batch state (the connector's
    per-request objects): above ``SMALL_BATCH`` and a quarter no (the tracked requests run a
    few above the batch: arrivals, finishes with outputs in flight); back to it at
    ``SMALL_BATCH``, so that a batch size near a bound does not move every request's state
    across step after step. ``SMALL_BATCH`` 0: never."""
    return 0 < SMALL_BATCH and num_requests <= (SMALL_BATCH + SMALL_BATCH // 4 if small_now else SMALL_BATCH)


def smallest(values: np.ndarray) -> int:
    return min(values.tolist()) if len(values) <= SMALL_BATCH else int(values.min())


def largest(values: np.ndarray) -> int:
    return max(values.tolist()) if len(values) <= SMALL_BATCH else int(values.max())


def total(values) -> int:
    """The sum of an array, or of a list (the small-batch paths' spans)."""
    if type(values) is list:
        return sum(values)
    return sum(values.tolist()) if len(values) <= SMALL_BATCH else int(values.sum())


def as_plain_list(values) -> list:
    """A list of the values: the list itself, or an array's ``tolist()``."""
    return values if type(values) is list else values.tolist()
