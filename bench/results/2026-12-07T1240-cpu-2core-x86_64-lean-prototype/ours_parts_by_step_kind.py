"""This project's bookkeeping per part (``bench/host_budget.py``'s parts and timers) on the
steps that only decode and on those that start and finish requests.

    .venv-vllm033/bin/python bench/results/<this folder>/ours_parts_by_step_kind.py CONCURRENCY MIN_TOKENS MAX_TOKENS

Medians over 4 timed replays (after one warm-up), less the timer's own cost per call.
"""

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]

from bench.bench_host import builders, record_trace, replay  # noqa: E402
from bench.host_budget import COPIES, PARTS, PartTimers, timer_cost  # noqa: E402
from by_step_kind import step_kinds  # noqa: E402


def main() -> None:
    concurrency, output_tokens = int(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3]))
    setup, events, _ = record_trace(concurrency, 120, output_tokens=output_tokens)
    kinds = step_kinds(events)
    build = builders()["routed-experts-cache"]
    replay(setup, events, build)
    cost, replays = timer_cost(), []
    for _ in range(4):
        with PartTimers() as timers:
            replay(setup, events, build)
            replays.append(timers.steps())
    print(f"[{concurrency} requests, outputs {output_tokens[0]}-{output_tokens[1]} tokens] ms per step, medians")
    for kind in ("decode", "startfinish"):
        index = [k for k in range(len(replays[0])) if kinds[k] == kind]
        print(f"  {kind}: {len(index)} steps")
        if not index:  # a trace without steps of this kind (steady decoding starts none)
            continue
        for part in [*PARTS, COPIES]:
            values = [(steps[k][part] - cost * steps[k][f"{part} calls"]) * 1e3 for steps in replays for k in index]
            print(f"    {part:58s} {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
