"""Each hook's thread CPU (row copies left out) on the steps that only decode and on those that
start and finish requests: this project's connector against the checked lean prototype
(``2026-12-07T1240-cpu-2core-x86_64-lean-prototype/``), interleaved, 5 rounds (the first warms up).

    .venv-vllm033/bin/python bench/results/<this folder>/hooks_by_step_kind.py CONCURRENCY MIN_TOKENS MAX_TOKENS

Prints, per kind of step, each hook's median in microseconds: ours / the prototype's.
"""

import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROTOTYPE = HERE.parent / "2026-12-07T1240-cpu-2core-x86_64-lean-prototype"
sys.path[:0] = [str(HERE.parents[2]), str(PROTOTYPE)]

import lean_prototype  # noqa: E402
from bench.bench_host import TIMED, builders, record_trace, replay_alternating  # noqa: E402
from by_step_kind import step_kinds  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    concurrency, output_tokens = int(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3]))
    setup, events, _ = record_trace(concurrency, 120, output_tokens=output_tokens)
    kinds = step_kinds(events)
    num_pages, page_size = lean_prototype.pool_layout(setup)
    builds = {
        "ours": builders()["routed-experts-cache"],
        "prototype": lambda setup, capturer: lean_prototype.LeanConnector(setup, capturer, num_pages, page_size, checked=True),
    }
    samples, _ = replay_alternating(setup, events, builds, 5)
    print(f"[{concurrency} requests, outputs {output_tokens[0]}-{output_tokens[1]} tokens] us per step, medians, ours / prototype")
    for kind in ("decode", "startfinish"):
        steps = [k for k in range(len(samples["ours"])) if kinds[k % len(kinds)] == kind]
        if not steps:
            continue
        cells = []
        for hook in TIMED:
            ours, prototype = (
                statistics.median(samples[name][k][hook][1] - samples[name][k][hook][2] for k in steps) * 1e6
                for name in ("ours", "prototype"))
            cells.append(f"{hook} {ours:6.1f} / {prototype:6.1f}")
        print(f"  {kind:12s} ({len(steps) // 4} steps) " + " | ".join(cells))


if __name__ == "__main__":
    main()
