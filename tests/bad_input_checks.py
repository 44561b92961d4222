"""Every public cache call with bad input raises the project's typed error and changes nothing.

Run as a script (``python -O tests/bad_input_checks.py``) by ``test_bad_input.py``: under
``-O`` plain ``assert`` statements vanish, in the library and here alike, so this script
checks with explicit comparisons and reports through its exit code.
"""

import sys

import numpy as np
import torch

from routed_experts_cache import (
    CacheFullError,
    InvalidCaptureError,
    RangeUnavailableError,
    RoutedExpertsCache,
    RoutedExpertsCacheError,
)

ROW = (2, 3)


def rows(n: int, dtype=torch.int64, shape=ROW) -> torch.Tensor:
    return (torch.arange(n * 6, dtype=torch.int64).reshape(n, *shape) % 200).to(dtype)


def populated_cache() -> RoutedExpertsCache:
    cache = RoutedExpertsCache(8, 4, ROW)
    cache.capture("a", 0, rows(6))
    cache.add_block_hashes("a", [b"a0"])
    cache.capture("b", 0, rows(4))
    return cache


def snapshot(cache: RoutedExpertsCache):
    stats = cache.stats()
    del stats["read_rows"]  # the reads below count themselves
    return stats, cache.pages.clone(), cache.read("a", 0, 6), cache.read("b", 0, 4)


def same(one, other) -> bool:
    stats1, pages1, *reads1 = one
    stats2, pages2, *reads2 = other
    return stats1 == stats2 and torch.equal(pages1, pages2) and all(torch.equal(x, y) for x, y in zip(reads1, reads2))


BAD_CALLS = {
    # capture / capture_batch
    "capture float rows": (lambda c: c.capture("a", 6, rows(2).float()), InvalidCaptureError),
    "capture bool rows": (lambda c: c.capture("a", 6, rows(2) > 0), InvalidCaptureError),
    "capture numpy rows": (lambda c: c.capture("a", 6, rows(2).numpy()), InvalidCaptureError),
    "capture wrong row shape": (lambda c: c.capture("a", 6, rows(2, shape=(3, 2))), InvalidCaptureError),
    "capture 1-d rows": (lambda c: c.capture("a", 6, torch.zeros(6, dtype=torch.int64)), InvalidCaptureError),
    "capture gap": (lambda c: c.capture("a", 7, rows(2)), InvalidCaptureError),
    "capture overlap": (lambda c: c.capture("a", 5, rows(2)), InvalidCaptureError),
    "capture unaligned first": (lambda c: c.capture("new", 3, rows(2)), InvalidCaptureError),
    "capture negative start": (lambda c: c.capture("new", -4, rows(2)), InvalidCaptureError),
    "capture float start": (lambda c: c.capture("a", 6.0, rows(2)), RoutedExpertsCacheError),
    "capture bool start": (lambda c: c.capture("a", True, rows(2)), RoutedExpertsCacheError),
    "capture numpy start": (lambda c: c.capture("a", np.int64(6), rows(2)), RoutedExpertsCacheError),
    "capture start past int64": (lambda c: c.capture("a", 2**63, rows(2)), InvalidCaptureError),
    "capture list id": (lambda c: c.capture(["a"], 6, rows(2)), RoutedExpertsCacheError),
    "capture None id": (lambda c: c.capture(None, 0, rows(2)), RoutedExpertsCacheError),
    "capture id above uint8": (lambda c: c.capture("a", 6, rows(2) + 250), InvalidCaptureError),
    "capture negative id": (lambda c: c.capture("a", 6, rows(2) - 1), InvalidCaptureError),
    "capture too big": (lambda c: c.capture("new", 0, rows(40)), CacheFullError),
    "capture_batch bad second span": (lambda c: c.capture_batch(rows(3), ["a", "b"], [6, 9], [0, 2], [2, 1]),
                                      InvalidCaptureError),
    "capture_batch ids as one str": (lambda c: c.capture_batch(rows(3), "a", [6], [0], [2]), InvalidCaptureError),
    "capture_batch span beyond source": (lambda c: c.capture_batch(rows(3), ["a"], [6], [2], [2]), InvalidCaptureError),
    "capture_batch counts missing": (lambda c: c.capture_batch(rows(3), ["a"], [6], [0], []), InvalidCaptureError),
    "capture_batch negative count": (lambda c: c.capture_batch(rows(3), ["a"], [6], [0], [-1]), InvalidCaptureError),
    "capture_batch float starts": (lambda c: c.capture_batch(rows(3), ["a"], [6.0], [0], [1]), InvalidCaptureError),
    "capture_batch float source": (lambda c: c.capture_batch(rows(3).double(), ["a"], [6], [0], [1]),
                                   InvalidCaptureError),
    "capture_batch stale slot": (lambda c: c.capture_batch(rows(3), ["b"], [4], [0], [1], slots=[0]),
                                 RoutedExpertsCacheError),
    # hashes and pins
    "hashes as one bytes value": (lambda c: c.add_block_hashes("a", b"a1"), InvalidCaptureError),
    "hashes with a str": (lambda c: c.add_block_hashes("a", [b"a1", "a2"]), InvalidCaptureError),
    "hashes with empty bytes": (lambda c: c.add_block_hashes("a", [b""]), InvalidCaptureError),
    "hashes with bad id": (lambda c: c.add_block_hashes(3.5, [b"x"]), RoutedExpertsCacheError),
    "retain str": (lambda c: c.retain(["a0"]), InvalidCaptureError),
    "release never retained": (lambda c: c.release([b"a0"]), RoutedExpertsCacheError),
    "release str": (lambda c: c.release(["a0"]), InvalidCaptureError),
    # reads
    "read unknown request": (lambda c: c.read("zz", 0, 1), RangeUnavailableError),
    "read beyond cursor": (lambda c: c.read("a", 0, 7), RangeUnavailableError),
    "read reversed range": (lambda c: c.read("a", 4, 2), RangeUnavailableError),
    "read negative start": (lambda c: c.read("a", -1, 2), RangeUnavailableError),
    "read float end": (lambda c: c.read("a", 0, 2.0), RoutedExpertsCacheError),
    "read numpy end": (lambda c: c.read("a", 0, np.int64(2)), RoutedExpertsCacheError),
    "read end past int64": (lambda c: c.read("a", 0, 2**64), RangeUnavailableError),
    "read bad id": (lambda c: c.read(b"a", 0, 1), RoutedExpertsCacheError),
    "read_batch one bad interval": (lambda c: c.read_batch(["a", "b"], [0, 0], [2, 5]), RangeUnavailableError),
    "read_batch ends missing": (lambda c: c.read_batch(["a"], [0], []), RangeUnavailableError),
    "read_batch stale slot": (lambda c: c.read_batch(["b"], [0], [1], slots=[0]), RoutedExpertsCacheError),
    "finish bad id": (lambda c: c.finish(["a"]), RoutedExpertsCacheError),
    # construction
    "zero pages": (lambda c: RoutedExpertsCache(0, 4, ROW), RoutedExpertsCacheError),
    "bool page size": (lambda c: RoutedExpertsCache(4, True, ROW), RoutedExpertsCacheError),
    "float dtype": (lambda c: RoutedExpertsCache(4, 4, ROW, dtype=torch.float32), RoutedExpertsCacheError),
    "empty row shape": (lambda c: RoutedExpertsCache(4, 4, ()), RoutedExpertsCacheError),
    "unknown backend": (lambda c: RoutedExpertsCache(4, 4, ROW, backend="cuda"), RoutedExpertsCacheError),
}


def main() -> int:
    failures = []
    for name, (call, expected) in BAD_CALLS.items():
        cache = populated_cache()
        before = snapshot(cache)
        try:
            call(cache)
        except expected as error:
            if not isinstance(error, RoutedExpertsCacheError):
                failures.append(f"{name}: {type(error).__name__} is not a RoutedExpertsCacheError")
        except Exception as error:  # noqa: BLE001 - any other error type is a failure
            failures.append(f"{name}: raised {type(error).__name__}: {error}, expected {expected.__name__}")
        else:
            failures.append(f"{name}: no error, expected {expected.__name__}")
        if not same(before, snapshot(cache)):
            failures.append(f"{name}: the refused call changed the cache")
        cache.check_consistency()
    print(f"optimize={sys.flags.optimize} checked={len(BAD_CALLS)} failures={len(failures)}")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
