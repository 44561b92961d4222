"""What the CPU stand-in for the device copies costs the bookkeeping around it.

    .venv-vllm033/bin/python bench/results/<this folder>/copies_skipped.py REQUESTS ROUNDS [OUT_MIN OUT_MAX]

``bench_host.py`` leaves the row copies' own CPU out of the bookkeeping, but on this machine
they are torch copies into a pool tensor in host memory (190 MB at 1024 requests), which
evict what the bookkeeping then reads; on a GPU they run on the device. This replays
``bench_host``'s trace through this checkout's connector twice, interleaved round by round:
once as is, once with the scatter / gather and the copy-out replaced by no-ops (the rows it
returns are then wrong: timing only), and prints the median bookkeeping per step of each.
"""

import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.bench_host import bookkeeping, record_trace, replay  # noqa: E402
from cpu_harness.vllm_scheduler import build_our_connector  # noqa: E402


def build_with_copies(setup, capturer):
    return build_our_connector(setup, capturer)


def build_without_copies(setup, capturer):
    connector = build_our_connector(setup, capturer)
    connector._cache._copy = lambda *args: None
    connector._cache._copy_rows = lambda *args: None
    buffers = {}

    def copy_out(snapshot):
        shape = tuple(snapshot.shape)
        if shape not in buffers:
            buffers[shape] = np.zeros(shape, dtype=np.uint8)
        return buffers[shape]

    connector._copy_out = copy_out
    return connector


def main() -> None:
    requests, rounds = int(sys.argv[1]), int(sys.argv[2])
    output_tokens = tuple(map(int, sys.argv[3:5])) if len(sys.argv) > 3 else (24, 96)
    setup, events, _ = record_trace(requests, 120, output_tokens=output_tokens)
    builds = {"real": build_with_copies, "nocopy": build_without_copies}
    for build in builds.values():  # warm-up
        replay(setup, events, build)
    medians = {name: [] for name in builds}
    for round_index in range(rounds):
        for name in (list(builds) if round_index % 2 == 0 else list(reversed(builds))):
            result = replay(setup, events, builds[name])
            medians[name].append(statistics.median(bookkeeping(result["per_step"])) * 1e3)
    done, skipped = (statistics.median(medians[name]) for name in builds)
    print(f"{requests} requests {output_tokens}: bookkeeping median ms/step: copies done {done:.3f}, "
          f"copies skipped {skipped:.3f}, ratio {skipped / done:.3f}  rounds {medians}")


if __name__ == "__main__":
    main()
