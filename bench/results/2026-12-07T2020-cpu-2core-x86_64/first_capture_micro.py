"""What the cache's small-batch capture costs the host on a step that starts requests, with the
row copies made no-ops: the one-pass plan (``_segments_small``, first captures on free pages)
against ``_write``'s (the same cache with ``_first_capture_pages`` declining every step).

    .venv/bin/python bench/results/<this folder>/first_capture_micro.py

Each step: 8 requests continue (3 rows each) and 8 start, each after a 2-block prefix hit
(start 32, page 16) with 24 rows of its prompt; the oldest continuing ones finish. Thread CPU
of ``capture_step_small`` per step, mean over 350 steps after 50 warm-up ones, the two plans
interleaved in 5 rounds.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from routed_experts_cache import RoutedExpertsCache  # noqa: E402

PAGE, CONTINUING, STARTING, HIT, PROMPT_ROWS, STEPS, WARM_UP = 16, 8, 8, 32, 24, 400, 50


def run(one_pass: bool) -> float:
    cache = RoutedExpertsCache(8192, PAGE, (48, 8))
    cache._copy_rows = cache._copy = lambda *args: None  # the copies themselves are not bookkeeping
    if not one_pass:
        cache._first_capture_pages = lambda *args: None
    source = torch.zeros((CONTINUING * 3 + STARTING * PROMPT_ROWS, 48, 8), dtype=torch.uint8)
    live, spent = {}, 0.0  # request id -> next position
    for step in range(STEPS):
        new = [f"s{step}-{j}" for j in range(STARTING)]
        cache.slots_step(new)
        cache.add_block_hashes_step(new, [[b"prefix-0", b"prefix-1", f"s{step}-{j}-2".encode()] for j in range(STARTING)])
        continuing = list(live)[:CONTINUING]
        ids = continuing + new
        counts = [3] * len(continuing) + [PROMPT_ROWS] * STARTING
        starts = [live[request_id] for request_id in continuing] + [HIT] * STARTING
        source_starts = [sum(counts[:i]) for i in range(len(counts))]
        ends = [start + count for start, count in zip(starts, counts)]
        slots = cache.slots(ids).tolist()
        started = time.thread_time()
        cache.capture_step_small(source, ids, slots, starts, source_starts, counts, ends)
        if step >= WARM_UP:
            spent += time.thread_time() - started
        live.update(zip(ids, ends))
        if len(live) > 2 * CONTINUING:
            cache.finish_step(continuing)
            for request_id in continuing:
                del live[request_id]
    return spent / (STEPS - WARM_UP) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    times = {True: [], False: []}
    for _ in range(5):
        for one_pass in (True, False):
            times[one_pass].append(run(one_pass))
    ours, write = statistics.median(times[True]), statistics.median(times[False])
    print(f"capture_step_small, {CONTINUING} continuing + {STARTING} starting: one pass {ours:.1f} us, "
          f"_write {write:.1f} us a step ({ours / write:.2f}x; medians of 5 rounds)")


if __name__ == "__main__":
    main()
