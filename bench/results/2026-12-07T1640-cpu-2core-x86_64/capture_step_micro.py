"""What the cache's small-batch capture costs the host, by part, with the row copies made no-ops.

    .venv/bin/python bench/results/<this folder>/capture_step_micro.py

16 requests continue decoding, 3 accepted rows each per step (a decode step under 4-token
drafts), on a pool of free pages; ``capture_step_small`` as the connector calls it, then its
parts on one step's spans: the page runs (``_segments_small``) and the copy set-up
(``_copy_on_device``: per-row indices, counted as bookkeeping by ``bench_host``; only the
torch copies themselves are not). Thread CPU per call, mean over 1000 calls.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from routed_experts_cache import RoutedExpertsCache  # noqa: E402

REQUESTS, PAGE, ROWS, CALLS = 16, 16, 3, 1000


def per_call_us(fn) -> float:
    started = time.thread_time()
    for _ in range(CALLS):
        fn()
    return (time.thread_time() - started) / CALLS * 1e6


def main() -> None:
    torch.set_num_threads(1)
    cache = RoutedExpertsCache(8192, PAGE, (48, 8))
    cache._copy_rows = cache._copy = lambda *args: None  # the copies themselves are not bookkeeping
    ids = [f"r{i}" for i in range(REQUESTS)]
    slots = cache.slots_step(ids)
    source = torch.zeros((REQUESTS * 5, 48, 8), dtype=torch.uint8)
    source_starts = list(range(0, 5 * REQUESTS, 5))
    cache.capture_step_small(source, ids, slots, [0] * REQUESTS, source_starts, [5] * REQUESTS, [5] * REQUESTS)
    positions = [5] * REQUESTS

    def step() -> None:
        nonlocal positions
        ends = [position + ROWS for position in positions]
        cache.capture_step_small(source, ids, slots, positions, source_starts, [ROWS] * REQUESTS, ends)
        positions = ends

    for _ in range(50):
        step()
    print(f"capture_step_small, {REQUESTS} spans of {ROWS} rows: {per_call_us(step):6.1f} us a step")
    counts = [ROWS] * REQUESTS
    segments = cache._segments_small(slots, positions, source_starts, counts, cache._pages.free, cache.max_position)
    print(f"  page runs (_segments_small):     {per_call_us(lambda: cache._segments_small(slots, positions, source_starts, counts, cache._pages.free, cache.max_position)):6.1f} us")
    source_rows, target_rows, lengths = segments[:3]
    words = cache._source_words(source)
    print(f"  copy set-up (_copy_on_device, no copy):    {per_call_us(lambda: cache._copy_on_device(words, cache._pool_words, lengths, source_rows, target_rows)):6.1f} us"
          f" ({len(lengths)} segments, {sum(lengths)} rows)")


if __name__ == "__main__":
    main()
