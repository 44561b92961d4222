"""The split of a step's first captures into page runs, by loops or by list extensions.

    .venv/bin/python bench/results/<this folder>/page_runs_micro.py

Twelve first captures (a step's prompt chunks) of 100 or 2048 rows each, page size 16, each
planned by ``_plan_segments`` (``_write``'s plan) and by ``_segments_small`` (the one-pass plan
of a small step); spans longer than ``SHORT_SPAN_PAGES`` blocks are split by list extensions
(``_append_page_runs``), and, for the comparison, by the loops that split short spans
(``SHORT_SPAN_PAGES`` set past every span). Thread CPU per call, the best of 7 rounds of 200
calls, the two ways alternating.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from routed_experts_cache import RoutedExpertsCache  # noqa: E402
from routed_experts_cache.connector import cache as cache_module  # noqa: E402
from routed_experts_cache.connector.cache import _Request  # noqa: E402

PAGE, SPANS, HIT = 16, 12, 32


def best_us(plan) -> float:
    best = float("inf")
    for _ in range(7):
        started = time.thread_time()
        for _ in range(200):
            plan()
        best = min(best, (time.thread_time() - started) / 200 * 1e6)
    return best


def main() -> None:
    cache = RoutedExpertsCache(1 << 14, PAGE, (48, 8))
    list_extensions = cache_module.SHORT_SPAN_PAGES
    for rows in (100, 2048):
        num_new = -(-rows // PAGE)
        plans = [(f"r{j}", _Request(), HIT, j * rows, rows, num_new) for j in range(SPANS)]
        new_pages = list(range(5000, 5000 + SPANS * num_new))
        slots = cache.slots_step([f"s{rows}-{j}" for j in range(SPANS)])  # registered, nothing captured
        calls = {
            "_plan_segments": lambda: cache._plan_segments(plans, new_pages),
            "_segments_small": lambda: cache._segments_small(
                slots, [HIT] * SPANS, [j * rows for j in range(SPANS)], [rows] * SPANS, new_pages, None, len(new_pages)),
        }
        for name, plan in calls.items():
            times = {}
            for threshold, label in ((list_extensions, "list extensions"), (10**9, "loops")):
                cache_module.SHORT_SPAN_PAGES = threshold
                times[label] = best_us(plan)
            cache_module.SHORT_SPAN_PAGES = list_extensions
            print(f"{name}, {SPANS} first captures of {rows} rows ({num_new} blocks each): loops "
                  f"{times['loops']:.1f} us, list extensions {times['list extensions']:.1f} us "
                  f"({times['list extensions'] / times['loops']:.2f}x)")


if __name__ == "__main__":
    main()
