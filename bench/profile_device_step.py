"""Where the host time of the connector's per-step device calls goes: cProfile of steady decode.

    python bench/profile_device_step.py [--device cuda] [--requests 16 1024] [--steps 300]

Runs ``capture_step`` (one row per request from the step's snapshot) and the snapshot's
copy-out, as the connector does each decode step, on the Triton backend on ``--device`` (CUDA:
compiled kernels) and on the torch backend on CPU, and prints each one's functions by self
time per step. ``gpu_check.py`` times the same steps; this says what the time is.
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import decode_setup  # noqa: E402


def profile(backend: str, device: torch.device, n: int, steps: int, top: int) -> None:
    cache, step_arguments = decode_setup(backend, device, n, steps + 20)
    for step in range(20):  # warm: kernel compiled, allocator primed
        cache.capture_step(*step_arguments(step))
    profiler = cProfile.Profile()
    for step in range(20, 20 + steps):
        arguments = step_arguments(step)
        profiler.enable()
        cache.capture_step(*arguments)
        arguments[0].to(device="cpu", dtype=cache.dtype, copy=True).numpy()
        profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())
    print(f"\n== {backend} on {device.type}, {n} requests: {total / steps * 1e6:.1f} us per step (self time, profiled)")
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    for (filename, line, name), (_, calls, self_time, cumulative, _) in rows:
        where = f"{Path(filename).name}:{line}" if line else filename
        print(f"  {self_time / steps * 1e6:8.1f} us self {cumulative / steps * 1e6:8.1f} us cum {calls / steps:5.1f} calls  {name} ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    device = torch.device(args.device)
    setups = [("torch", torch.device("cpu"))] + ([("triton", device)] if device.type == "cuda" else [])
    for backend, where in setups:
        for n in args.requests:
            profile(backend, where, n, args.steps, args.top)


if __name__ == "__main__":
    main()
