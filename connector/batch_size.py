"""Where plain Python over a batch costs less than array passes over it.

A numpy call costs about a microsecond to set up (a reduction several), whatever its size, so
below a few dozen items Python over a list is cheaper; above that, array passes win. The
cache's page splitting and reads choose their path by ``SMALL_BATCH`` (measured with
``bench/bench_host.py``); the reductions here do the same.
"""

import numpy as np

SMALL_BATCH = 48


def smallest(values: np.ndarray) -> int:
    return min(values.tolist()) if len(values) <= SMALL_BATCH else int(values.min())


def largest(values: np.ndarray) -> int:
    return max(values.tolist()) if len(values) <= SMALL_BATCH else int(values.max())


def total(values: np.ndarray) -> int:
    return sum(values.tolist()) if len(values) <= SMALL_BATCH else int(values.sum())
