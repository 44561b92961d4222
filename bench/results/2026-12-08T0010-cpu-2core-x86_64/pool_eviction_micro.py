"""The page pool's path when a full pool evicts while the scheduler retains blocks: this
checkout's ``PagePool`` against 13a38a4's (before ``unpin`` placed unpinned device hashes
inline beside a non-empty demotion order, and ``allocate_many`` evicted without a call per page).

    .venv/bin/python bench/results/<this folder>/pool_eviction_micro.py

Each step: a finished request unpins its 32 published hashes (newest first, as ``finish``
does), then a step's 32 new pages are allocated, all by eviction, and published and pinned by
a new request; 64 hashes of finished requests stay retained (the demotion order holds them,
so it is never empty). Thread CPU per
step, the best of 7 rounds of 300 steps, the two pools alternating; the pools end equal.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from routed_experts_cache.connector.page_pool import PagePool  # noqa: E402

BEFORE, PAGES, BLOCKS, RETAINED, STEPS = "13a38a4", 4096, 32, 64, 300


def pool_before() -> type:
    """``PagePool`` as 13a38a4 had it, from git."""
    source = subprocess.run(["git", "show", f"{BEFORE}:connector/page_pool.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    folder = tempfile.mkdtemp()
    (Path(folder) / "page_pool_before.py").write_text(source)
    sys.path.insert(0, folder)
    import page_pool_before
    return page_pool_before.PagePool


def run(pool_class: type) -> tuple[float, tuple]:
    pool = pool_class(PAGES)
    live = []
    for r in range(PAGES // BLOCKS):  # fill the pool: every page published by a live request
        hashes = [f"{r}-{b}".encode() for b in range(BLOCKS)]
        pool.publish_many(hashes, pool.allocate_many(BLOCKS))
        live.append(hashes)
    retained = [block_hash for hashes in live[: RETAINED // BLOCKS] for block_hash in hashes]
    pool.retain(retained)
    pool.unpin(retained)  # their requests finished: held by the retains alone, demotable
    del live[: RETAINED // BLOCKS]
    spent = 0.0
    for step in range(STEPS):
        started = time.thread_time()
        pool.unpin(reversed(live.pop(0)))  # a finish: the newest block first
        hashes = [f"new{step}-{b}".encode() for b in range(BLOCKS)]
        pool.publish_many(hashes, pool.allocate_many(BLOCKS))  # all by eviction
        spent += time.thread_time() - started
        live.append(hashes)
    if len(pool.demotable) != RETAINED:
        raise SystemExit(f"{len(pool.demotable)} demotable hashes, {RETAINED} expected")
    state = (list(pool.free), dict(pool.published), dict(pool.pins), list(pool.evictable), list(pool.demotable))
    return spent / STEPS * 1e6, state


def main() -> None:
    pools = {"this checkout": PagePool, BEFORE: pool_before()}
    best, states = {name: float("inf") for name in pools}, {}
    for _ in range(7):
        for name, pool_class in pools.items():
            us, states[name] = run(pool_class)
            best[name] = min(best[name], us)
    if states["this checkout"] != states[BEFORE]:
        raise SystemExit("the two pools ended in different states")
    print(f"unpin {BLOCKS} hashes + allocate {BLOCKS} pages by eviction + publish, {RETAINED} hashes retained: "
          f"this checkout {best['this checkout']:.1f} us a step, {BEFORE} {best[BEFORE]:.1f} us "
          f"({best['this checkout'] / best[BEFORE]:.2f}x); equal pools")


if __name__ == "__main__":
    main()
