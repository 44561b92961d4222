"""Host work per engine step, by kind of step: steps that start requests, finish them, both, or
neither.

    .venv-vllm033/bin/python bench/bench_host_steps.py [--concurrency 16] [--steps 120]
        [--output-tokens 24 96] [--rounds 4]

``bench_host.py`` reports the median step. Where most steps are alike that says what a step
costs; where half the steps start and finish requests and half only decode (16 requests with
short outputs), the median lies at the edge of one group and hides what the other costs. This
replays the same trace (``bench_host.record_trace``) through this project's connector and
vLLM's built-in, interleaved round by round (the first round warms up), classifies each step
by its scheduler metadata (a request seen for the first time: "starts"; a finished request:
"finishes") and reports, per kind, the number of steps and the medians of the bookkeeping (all
hooks and the connector's threads, thread CPU, without our row copies) and of each hook.
Results go to a new git-ignored folder under bench/out/ (or ``$OUT``).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_host import (  # noqa: E402
    TIMED, bookkeeping, builders, parse_replay_arguments, record_trace, replay_alternating, trace_columns, trace_of, trace_suffix,
)
from bench.common import print_table, save_csv  # noqa: E402
from cpu_harness.vllm_scheduler import VLLM_VERSION  # noqa: E402

KINDS = ("neither", "starts", "finishes", "starts and finishes")


def step_kinds(events) -> list[str]:
    """The kind of each step of a recorded trace, in step order (one per ``begin`` event)."""
    seen, kinds = set(), []
    for event in events:
        if event[0] != "begin":
            continue
        metadata = event[1]
        starts = metadata is not None and not seen.issuperset(metadata.requests)
        finishes = metadata is not None and bool(metadata.finished_requests)
        if metadata is not None:
            seen.update(metadata.requests)
        kinds.append(KINDS[starts + 2 * finishes])
    return kinds


def by_kind(kinds: list[str], per_step: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind of step: its count and the medians (ms) of the bookkeeping and of each hook,
    over the steps of that kind in every round (``per_step``: rounds' samples, concatenated)."""
    rows = {}
    for kind in KINDS:
        steps = [s for k, s in zip(kinds * (len(per_step) // len(kinds)), per_step) if k == kind]
        if not steps:
            continue
        rows[kind] = {
            "steps": kinds.count(kind),
            "bookkeeping_ms": statistics.median(bookkeeping(steps)) * 1e3,
            **{f"{hook}_ms": statistics.median(s[hook][1] - s[hook][2] for s in steps) * 1e3 for hook in TIMED},
        }
    return rows


def main() -> None:
    torch.set_num_threads(1)  # as bench_host: one intra-op thread, as the engine's worker runs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    args = parse_replay_arguments(parser, rounds=4)
    setup, events, _ = record_trace(args.concurrency, args.steps, **trace_of(args))
    kinds = step_kinds(events)
    builds = builders()
    samples, _ = replay_alternating(setup, events, builds, args.rounds)
    for name, per_step in samples.items():
        if len(per_step) != len(kinds) * (args.rounds - 1):
            raise SystemExit(f"{name}: {len(per_step)} steps timed in {args.rounds - 1} rounds, {len(kinds)} in the trace")
    rows = []
    for name, per_step in samples.items():
        for kind, row in by_kind(kinds, per_step).items():
            rows.append({"vllm": VLLM_VERSION, "impl": name, "concurrency": args.concurrency,
                         **trace_columns(trace_of(args)), "kind": kind, **row})
    ours, builtin = (by_kind(kinds, samples[name]) for name in builds)
    for kind in ours:
        print(f"[{kind:>19}] {ours[kind]['steps']:>4} steps: bookkeeping {ours[kind]['bookkeeping_ms']:.3f} ms, "
              f"built-in {builtin[kind]['bookkeeping_ms']:.3f} ms -> "
              f"{ours[kind]['bookkeeping_ms'] / builtin[kind]['bookkeeping_ms']:.2f}", flush=True)
    print_table(rows, list(rows[0]))
    save_csv(rows, f"host_steps_{args.concurrency}_requests_vllm{VLLM_VERSION}{trace_suffix(**trace_of(args))}.csv",
             torch.device("cpu"))


if __name__ == "__main__":
    main()
