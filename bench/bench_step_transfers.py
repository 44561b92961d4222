"""Host cost of the small transfers and launches one engine step makes on a GPU.

    python bench/bench_step_transfers.py [--requests 16 256 1024] [--iters 300]   (needs CUDA)

The connector's per-step device calls are a descriptor upload (3 int32 per segment), one Triton
launch (through Triton's JIT, or of the kept compiled variant as ``copy_segments`` does) and
the step rows' copy-out (one row per decoding request); at small batches their fixed costs are
the step's cost. Each is timed alone (median host CPU of the calling thread and
wall time to completion) in the ways it can be done: descriptor from pageable or pinned host
memory, copy-out into pageable memory or through a pinned buffer and an event.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from routed_experts_cache.kernels import as_row_words, load_triton_copy  # noqa: E402
from routed_experts_cache.kernels.rows import tile_shape  # noqa: E402


def timed(fn, iters: int) -> tuple[float, float]:
    cpu_ns, wall_ns = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        torch.cuda.synchronize()
        cpu_ns.append(time.thread_time_ns() - cpu)
        wall_ns.append(time.perf_counter_ns() - wall)
    return statistics.median(cpu_ns) / 1e3, statistics.median(wall_ns) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_transfers.py needs CUDA")
    device, copy = torch.device("cuda"), load_triton_copy()
    print(f"{'requests':>8s}  {'operation':46s} {'host CPU us':>11s} {'wall us':>9s}")
    for n in args.requests:
        descriptor = np.arange(3 * n + 1, dtype=np.int32)
        staging = torch.empty(3 * n + 1, dtype=torch.int32, pin_memory=True)
        snapshot = torch.randint(0, 128, (n, 48, 8), dtype=torch.uint8, device=device)
        pool = torch.zeros((4 * n * 16, 48, 8), dtype=torch.uint8, device=device)
        out_pinned = torch.empty((n, 48, 8), dtype=torch.uint8, pin_memory=True)
        done = torch.cuda.Event()
        seg_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        targets = torch.arange(n, dtype=torch.int32, device=device) * 16

        def launch_through_jit():  # what every launch cost before compiled variants were kept
            from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel

            words = as_row_words(snapshot).shape[1]
            segments, block = tile_shape(n, words)
            _segment_copy_kernel[(triton.cdiv(n, segments),)](
                as_row_words(snapshot), as_row_words(pool), seg_start, seg_start[:-1], targets, n,
                ROW_WORDS=words, SEGMENTS=segments, BLOCK_WORDS=block, num_stages=1)

        def upload_pinned():
            staging.numpy()[:] = descriptor
            return staging.to(device, non_blocking=True)

        def copy_out_pinned():
            out_pinned.copy_(snapshot, non_blocking=True)
            done.record()
            done.synchronize()
            return out_pinned.numpy().copy()

        operations = {
            "descriptor upload, pageable (now)": lambda: torch.from_numpy(descriptor).to(device, non_blocking=True),
            "descriptor upload, pinned staging": upload_pinned,
            "descriptor upload, torch.tensor(list)": lambda: torch.tensor(descriptor.tolist(), dtype=torch.int32, device=device),
            "triton launch through the JIT": launch_through_jit,
            "triton launch, compiled variant kept (now)": lambda: copy(
                as_row_words(snapshot), as_row_words(pool), seg_start, seg_start[:-1], targets, n),
            "copy-out, pageable (now)": lambda: snapshot.to(device="cpu", copy=True).numpy(),
            "copy-out, pinned + event + host copy": copy_out_pinned,
            "empty step: synchronize only": lambda: None,
        }
        for name, fn in operations.items():
            cpu, wall = timed(fn, args.iters)
            print(f"{n:8d}  {name:46s} {cpu:11.1f} {wall:9.1f}", flush=True)


if __name__ == "__main__":
    main()
