"""Host CPU cost of scattering a decode step's rows into the pool: the cache's Triton path vs torch's index copies.

    python bench/bench_small_scatter.py [--requests 16 64 256 1024] [--reps 300]   (CUDA)
    python bench/bench_small_scatter.py --device cpu --quick    (smoke run: Triton interpreted)

Why: on the H200 (torch 2.11, triton 3.6) a decode step's capture costs the model thread about
75 us of host CPU for the Triton launch and about 24 us for its descriptor upload. A decode step
copies one row per request (a one-row segment each), so a torch ``index_copy_`` of the step's
rows, by an index of their target rows, does the same work: is its launch lighter at small steps?

Each request appends its row (source row i, ``[48, 8]`` uint8 as Qwen3-30B-A3B) at a random
position of its own page. Timed, on the cache's own pool (as 32-bit words, as the Triton path
copies it): (a) the cache's ``_copy_on_device`` (descriptor -> upload -> the kernel launcher),
(b) int64 index -> upload -> ``index_copy_``, (c) the same with an int32 index, and advanced
indexing assignment, (d) uploads alone and launches alone from an already uploaded
descriptor/index. Host CPU is ``time.thread_time`` of this thread around one call (the device
is synchronised outside it): median and p10/p90 over ``--reps`` after warm-up. ``equal``: the
whole pool after one call from the same start state equals the reference (plain numpy).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import save_csv  # noqa: E402

PAGE_SIZE, ROW_SHAPE = 16, (48, 8)


def host_cpu_us(fn, reps: int, warmup: int, sync) -> list[float]:
    """Median, p10 and p90 host CPU microseconds of this thread per call of ``fn``."""
    for _ in range(warmup):
        fn()
        sync()
    samples = []
    for _ in range(reps):
        sync()
        started = time.thread_time_ns()
        fn()
        samples.append(time.thread_time_ns() - started)
    sync()
    return [round(float(v) / 1e3, 2) for v in np.percentile(samples, [50, 10, 90])]


def variants(cache, source_words, n: int, targets: np.ndarray, upload, small_batch: int) -> dict:
    """name -> (call, writes the pool). Inputs as the cache holds them: lists up to its small batch."""
    pool_words = cache._pool_words
    if n <= small_batch:  # the cache's small-batch path hands _copy_on_device lists
        lengths, source_rows, target_rows = [1] * n, list(range(n)), targets.tolist()
    else:
        lengths, source_rows, target_rows = np.ones(n, np.int64), np.arange(n, dtype=np.int64), targets
    descriptor = np.concatenate([[0], np.cumsum(lengths), source_rows, target_rows]).astype(np.int32)
    on_device = upload(descriptor)
    parts = (on_device[: n + 1], on_device[n + 1 : 2 * n + 1], on_device[2 * n + 1 :])
    index64 = np.asarray(target_rows, dtype=np.int64)
    index64_dev, index32_dev = upload(index64), upload(index64.astype(np.int32))

    def index_put(index_dev):
        pool_words[index_dev] = source_words

    def uploaded_index(dtype):  # the host index from the cache's target rows, then one upload
        return upload(np.asarray(target_rows, dtype))

    return {
        "a_triton_step (cache now)": (
            lambda: cache._copy_on_device(source_words, pool_words, lengths, source_rows, target_rows), True),
        "b_index_copy_int64": (lambda: pool_words.index_copy_(0, uploaded_index(np.int64), source_words), True),
        "c_index_copy_int32": (lambda: pool_words.index_copy_(0, uploaded_index(np.int32), source_words), True),
        "c_index_put_int64": (lambda: index_put(uploaded_index(np.int64)), True),
        "c_index_put_int32": (lambda: index_put(uploaded_index(np.int32)), True),
        "d_upload_descriptor": (lambda: upload(descriptor), False),
        "d_launch_triton": (lambda: cache._copy(source_words, pool_words, *parts, n), True),
        "d_upload_index_int64": (lambda: upload(index64), False),
        "d_index_copy_int64_launch": (lambda: pool_words.index_copy_(0, index64_dev, source_words), True),
        "d_index_put_int64_launch": (lambda: index_put(index64_dev), True),
        "d_index_put_int32_launch": (lambda: index_put(index32_dev), True),
        "empty (synchronize only)": (lambda: None, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 reps, 2 warm-up, 2048 pages (overrides those)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.warmup, args.pages = 10, 2, 2048
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs CUDA (use --device cpu --quick for a smoke run)")
    if device.type == "cpu":  # the Triton path through its interpreter; torch ops on this thread only
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    from routed_experts_cache.connector.batch_size import SMALL_BATCH
    from routed_experts_cache.connector.cache import RoutedExpertsCache
    from routed_experts_cache.kernels import as_row_words

    if max(args.requests) > args.pages:
        raise SystemExit(f"--pages {args.pages} < {max(args.requests)} requests: each needs its own page")
    cache = RoutedExpertsCache(args.pages, PAGE_SIZE, ROW_SHAPE, torch.uint8, device, backend="triton")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    upload = (lambda a: torch.from_numpy(a).to(device, non_blocking=True)) if device.type == "cuda" else torch.from_numpy
    rng = np.random.default_rng(0)
    start = torch.from_numpy(rng.integers(0, 128, cache.pages.shape, dtype=np.uint8))
    start_on_device = start.to(device)
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}: "
          f"host CPU us of the calling thread, {args.reps} reps after {args.warmup} warm-up")
    print(f"{'n':>5s}  {'variant':27s} {'median':>9s} {'p10':>9s} {'p90':>9s}  equal")
    rows = []
    for n in args.requests:
        targets = rng.choice(args.pages, n, replace=False) * PAGE_SIZE + rng.integers(0, PAGE_SIZE, n)
        snapshot = torch.from_numpy(rng.integers(0, 128, (n, *ROW_SHAPE), dtype=np.uint8))
        expected = start.numpy().reshape(args.pages * PAGE_SIZE, -1).copy()
        expected[targets] = snapshot.numpy().reshape(n, -1)
        expected = torch.from_numpy(expected).view(cache.pages.shape).to(device)
        source_words = as_row_words(snapshot.to(device))
        for name, (fn, writes) in variants(cache, source_words, n, targets, upload, SMALL_BATCH).items():
            try:
                cache.pages.copy_(start_on_device)
                fn()
                sync()
                equal = str(torch.equal(cache.pages, expected)) if writes else "n/a"
                median, p10, p90 = host_cpu_us(fn, args.reps, args.warmup, sync)
            except Exception as error:  # e.g. index_copy_ refusing an int32 index
                equal, median, p10, p90 = f"raised {type(error).__name__}: {str(error)[:80]}", "", "", ""
            rows.append({"variant": name, "n": n, "host_cpu_us_median": median, "host_cpu_us_p10": p10,
                         "host_cpu_us_p90": p90, "equal": equal})
            times = " ".join(f"{t:9.1f}" if t != "" else f"{'-':>9s}" for t in (median, p10, p90))
            print(f"{n:5d}  {name:27s} {times}  {equal}", flush=True)
    save_csv(rows, "small_scatter.csv", device)


if __name__ == "__main__":
    main()
