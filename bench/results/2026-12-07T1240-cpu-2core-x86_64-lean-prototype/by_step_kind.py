"""Bookkeeping per kind of step: this project's connector, the checked prototype and vLLM's
built-in, on the steps that only decode and on those that start and finish requests.

    .venv-vllm033/bin/python bench/results/<this folder>/by_step_kind.py CONCURRENCY MIN_TOKENS MAX_TOKENS

A step's kind is read from its metadata (a request never scheduled before: it starts one;
finished ids: it finishes some); the k-th call of each hook is the k-th step, as
``bench_host.replay`` counts them. 5 interleaved rounds, the first a warm-up.
"""

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]

from bench.bench_host import BUILTIN, bookkeeping, builders, record_trace, replay_alternating  # noqa: E402
from lean_prototype import LeanConnector, pool_layout  # noqa: E402

ROUNDS = 5


def step_kinds(events) -> list[str]:
    kinds, seen = [], set()
    for event in events:
        if event[0] == "begin":
            metadata = event[1]
            starts = any(request_id not in seen for request_id in metadata.requests)
            seen.update(metadata.requests)
            kinds.append(("start" if starts else "") + ("finish" if metadata.finished_requests else "") or "decode")
    return kinds


def main() -> None:
    concurrency, output_tokens = int(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3]))
    setup, events, _ = record_trace(concurrency, 120, output_tokens=output_tokens)
    kinds = step_kinds(events)
    num_pages, page_size = pool_layout(setup)
    builds = {
        "ours": builders()["routed-experts-cache"],
        "lean, checked": lambda setup, capturer: LeanConnector(setup, capturer, num_pages, page_size, checked=True),
        "built-in": builders()[BUILTIN],
    }
    samples, _ = replay_alternating(setup, events, builds, ROUNDS)
    steps = len(samples["ours"]) // (ROUNDS - 1)
    print(f"[{concurrency} requests, outputs {output_tokens[0]}-{output_tokens[1]} tokens] bookkeeping, median ms per step")
    for kind in sorted(set(kinds)):
        index = [k for k in range(steps) if kinds[k] == kind]
        medians = {name: statistics.median(bookkeeping([per_step[r * steps + k] for r in range(ROUNDS - 1) for k in index])) * 1e3
                   for name, per_step in samples.items()}
        print(f"  {kind:12s} {len(index):4d} steps  " + "  ".join(f"{name} {value:.3f}" for name, value in medians.items())
              + f"  ours / lean {medians['ours'] / medians['lean, checked']:.2f}")


if __name__ == "__main__":
    main()
