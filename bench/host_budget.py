"""Host work per engine step against the targets: how far each size is from its target, and
what each part of this project's bookkeeping costs, in thread-CPU time per step.

    .venv-vllm033/bin/python bench/host_budget.py [--concurrency 16 64 256 1024] [--steps 120]
        [--output-tokens 24 96] [--rounds 3]

``profile_host.py`` times every method, and its timer's cost (a few microseconds a call, a
hundred calls a step and more) inflates the small ones: shares, not milliseconds. Here a timer
sits only where a part begins (a hook, the cache's step calls, the page pool, the row copies),
so it runs a few times per step, per request that starts or finishes and per pool call, and
each part is charged its self time: the hooks' own Python ("connector"), the cache's request bookkeeping
(slots, block hashes, pins, finishes), capture planning, reads of earlier rows, the page pool
and the row copies (left out of the bookkeeping, as in ``bench_host.py``). The same trace is
replayed, round by round in alternating order, through vLLM's built-in connector, the output
contract's floor (``bench_host.OutputContractFloor``) and this project's with and without the
timers (the first round warms up): the unwrapped replays give the bookkeeping and the ratio,
the wrapped ones the parts and, by their total against the unwrapped one, what the timers
themselves cost. The bookkeeping and the ratio are medians per step, as in ``bench_host.py``;
the parts are means (they add up) over the typical steps, those between the quartiles of the
bookkeeping with the timers (the first steps' prefill and the machine's outliers left out).
Each part is less the timer's own cost, measured per call. One text file and one CSV per trace go to a new git-ignored folder under
bench/out/ (or ``$OUT``).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_host import (  # noqa: E402
    BUILTIN, PROMPT_PREFIX_TOKENS, OutputContractFloor, bookkeeping, builders, parse_replay_arguments, record_trace,
    replay, total_cpu, trace_columns, trace_of, trace_suffix,
)
from bench.common import results_dir, save_csv  # noqa: E402
from bench.profile_host import SelfTime  # noqa: E402
from cpu_harness.vllm_scheduler import VLLM_VERSION  # noqa: E402
from routed_experts_cache.connector import cache as cache_module  # noqa: E402
from routed_experts_cache.connector.cache import RoutedExpertsCache  # noqa: E402
from routed_experts_cache.connector.page_pool import PagePool  # noqa: E402
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector  # noqa: E402

OURS = "routed-experts-cache"
COPIES = "row copies (not bookkeeping)"
PARTS = {  # part -> where it begins: (class, methods); every PagePool method is the page pool
    "connector: checks, cursors, commit loop, outputs": (CacheWorkerConnector, ("begin_step", "prepare_output", "process_output")),
    "cache: slots, block hashes, pins, finishes": (
        RoutedExpertsCache, ("slots_step", "add_block_hashes_step", "pin_step", "check_pin_step", "finish", "finish_step", "rewind")),
    "cache: capture planning (segments, pages, block table)": (RoutedExpertsCache, ("capture_step", "capture_step_small")),
    "cache: reads of earlier rows": (RoutedExpertsCache, ("read_step",)),
    "page pool: per-hash index, pins, eviction order": (PagePool, None),
}


def target_ratio(concurrency: int) -> float:
    """Issue 25's target for bookkeeping / built-in: 0.5 up to 64 requests, 0.25 from 256."""
    return 0.5 if concurrency < 256 else 0.25


class PartTimers:
    """A ``SelfTime`` whose names are the parts, installed on the methods where each part begins
    and on the row copies (a static method and the module's torch copy function); each hook
    call's seconds per part are kept, in call order, so that a replay's k-th step (the k-th
    call of each hook, as ``bench_host.replay`` counts) gets its own parts."""

    HOOKS = ("begin_step", "prepare_output", "process_output")

    def __init__(self) -> None:
        self.timer = SelfTime()
        self.by_call: dict[str, list[dict[str, float]]] = {hook: [] for hook in self.HOOKS}
        self._restore: list = []

    def __enter__(self) -> "PartTimers":
        for part, (cls, methods) in PARTS.items():
            names = methods or [attr for attr, value in vars(cls).items() if callable(value) and attr != "__init__"]
            for attr in names:
                self._swap(cls, attr, self.timer.wrap(part, vars(cls)[attr]))
        for hook in self.HOOKS:
            self._swap(CacheWorkerConnector, hook, self._kept(hook, vars(CacheWorkerConnector)[hook]))
        self._swap(CacheWorkerConnector, "_copy_out", self.timer.wrap(COPIES, vars(CacheWorkerConnector)["_copy_out"]))
        self._swap(RoutedExpertsCache, "_copy_rows", staticmethod(self.timer.wrap(COPIES, vars(RoutedExpertsCache)["_copy_rows"].__func__)))
        self._swap(cache_module, "copy_segments_torch", self.timer.wrap(COPIES, cache_module.copy_segments_torch))
        return self

    def _kept(self, hook: str, method):
        seconds, calls, kept_calls = self.timer.seconds, self.timer.calls, self.by_call[hook]

        def kept(*args, **kwargs):
            before, calls_before = dict(seconds), dict(calls)
            try:
                return method(*args, **kwargs)
            finally:
                kept_calls.append({
                    **{part: seconds[part] - before.get(part, 0.0) for part in seconds},
                    **{f"{part} calls": calls[part] - calls_before.get(part, 0) for part in calls},
                })
        return kept

    def steps(self) -> list[dict[str, float]]:
        """Seconds and calls per part of each step so far (the k-th call of each hook), and
        forget them."""
        keys = [*PARTS, COPIES, *(f"{part} calls" for part in [*PARTS, COPIES])]
        steps = [{key: sum(call.get(key, 0) for call in calls) for key in keys} for calls in zip(*self.by_call.values())]
        for calls in self.by_call.values():
            calls.clear()
        return steps

    def _swap(self, owner, attr: str, value) -> None:
        self._restore.append((owner, attr, vars(owner)[attr]))
        setattr(owner, attr, value)

    def __exit__(self, *exc) -> None:
        for owner, attr, value in reversed(self._restore):
            setattr(owner, attr, value)
        self._restore.clear()


def timer_cost() -> float:
    """Thread-CPU seconds one timed call adds (a wrapped empty function, called in a loop)."""
    timer = SelfTime()
    empty = timer.wrap("empty", lambda: None)
    calls, best = 20000, float("inf")
    for _ in range(5):
        started = time.thread_time()
        for _ in range(calls):
            empty()
        elapsed = time.thread_time() - started
        started = time.thread_time()
        for _ in range(calls):
            pass
        best = min(best, (elapsed - (time.thread_time() - started)) / calls)
    return best


def middle_half(values: list[float]) -> list[int]:
    """Indices of the values between the quartiles: the typical steps, without the prefill of
    the first steps and the machine's outliers, whose parts still add up."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[len(order) // 4 : len(order) - len(order) // 4]


def budget(concurrency: int, steps: int, trace: dict, rounds: int) -> dict:
    """One size: the built-in's CPU and ours (medians, as ``bench_host.py``), and the parts of
    ours over its typical steps (ms per step)."""
    setup, events, _ = record_trace(concurrency, steps, **trace)
    builds = {"builtin": builders()[BUILTIN], "ours": builders()[OURS], "floor": OutputContractFloor}
    samples = {"builtin": [], "ours": [], "floor": [], "wrapped": []}
    parts, part_steps = PartTimers(), []
    for round_ in range(rounds):
        order = ["builtin", "floor", "ours", "wrapped"] if round_ % 2 else ["wrapped", "ours", "floor", "builtin"]
        for name in order:
            if name == "wrapped":
                with parts:
                    per_step = replay(setup, events, builds["ours"])["per_step"]
                replayed_parts = parts.steps()
                part_steps += replayed_parts[: len(per_step)] if round_ else []
            else:
                per_step = replay(setup, events, builds[name])["per_step"]
            if round_:
                samples[name] += per_step
    builtin = statistics.median(total_cpu(samples["builtin"]))
    ours = statistics.median(bookkeeping(samples["ours"]))
    floor = statistics.median(total_cpu(samples["floor"]))
    wrapped = bookkeeping(samples["wrapped"])
    typical = middle_half(wrapped)
    row = {
        "concurrency": concurrency, **trace_columns(trace), "steps": len(wrapped),
        "builtin_ms": builtin * 1e3, "ours_bookkeeping_ms": ours * 1e3, "ratio": ours / builtin,
        "target_ratio": target_ratio(concurrency), "target_ms": target_ratio(concurrency) * builtin * 1e3,
        "over_target_ms": (ours - target_ratio(concurrency) * builtin) * 1e3,
        "floor_ms": floor * 1e3, "wrapped_bookkeeping_ms": statistics.median(wrapped) * 1e3,
        "typical_steps": len(typical), "typical_wrapped_bookkeeping_ms": statistics.fmean(wrapped[i] for i in typical) * 1e3,
    }
    cost = timer_cost()
    row["timer_us_per_call"] = cost * 1e6
    for part in [*PARTS, COPIES]:
        row[part] = statistics.fmean(part_steps[i][part] for i in typical) * 1e3
        row[f"{part} calls"] = statistics.fmean(part_steps[i][f"{part} calls"] for i in typical)
        row[f"{part} less timers"] = row[part] - row[f"{part} calls"] * cost * 1e3
    return row


def report(row: dict) -> str:
    over = row["over_target_ms"]
    lines = [
        f"[{row['concurrency']} requests, outputs {row['output_tokens']} tokens, prompts {PROMPT_PREFIX_TOKENS} + {row['prompt_tokens']}, vLLM {VLLM_VERSION}; {row['steps']} steps]",
        f"medians: built-in {row['builtin_ms']:.3f} ms/step, ours {row['ours_bookkeeping_ms']:.3f} (ratio "
        f"{row['ratio']:.2f}); target {row['target_ratio']} -> {row['target_ms']:.3f} ms: "
        + (f"{over:.3f} ms over" if over > 0 else f"met by {-over:.3f} ms") + f"; the output contract alone "
        f"{row['floor_ms']:.3f}; ours with the timers {row['wrapped_bookkeeping_ms']:.3f}",
        f"parts, means over the {row['typical_steps']} typical steps (between the quartiles of ours with the timers):",
    ]
    lines.append(f"  {'part':56s} {'ms/step':>8s} {'calls':>7s} {'less the timers':>16s}")
    part_line = "  {:56s} {:8.3f} {:>7} {:16.3f}".format
    for part in PARTS:
        lines.append(part_line(part, row[part], f"{row[f'{part} calls']:.1f}", row[f"{part} less timers"]))
    lines.append(part_line("sum of the parts", sum(row[p] for p in PARTS), "", sum(row[f"{p} less timers"] for p in PARTS)))
    lines.append(part_line(COPIES, row[COPIES], f"{row[f'{COPIES} calls']:.1f}", row[f"{COPIES} less timers"]))
    lines.append(f"  (those steps with the timers {row['typical_wrapped_bookkeeping_ms']:.3f} ms; a timed call "
                 f"costs {row['timer_us_per_call']:.2f} us, subtracted per call in the last column)")
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)  # as bench_host: one intra-op thread, as the engine's worker runs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parse_replay_arguments(parser, rounds=3)
    rows, texts = [], []
    for concurrency in args.concurrency:
        rows.append(budget(concurrency, args.steps, trace_of(args), args.rounds))
        texts.append(report(rows[-1]))
        print(texts[-1] + "\n", flush=True)
    suffix = f"vllm{VLLM_VERSION}{trace_suffix(**trace_of(args))}"
    text_path = results_dir(torch.device("cpu")) / f"host_budget_{suffix}.txt"
    text_path.write_text("\n\n".join(texts) + "\n")
    print(f"wrote {text_path}")
    save_csv(rows, f"host_budget_{suffix}.csv", torch.device("cpu"))


if __name__ == "__main__":
    main()
