"""Where this project's host work per step goes: self thread-CPU time per method, per step.

    .venv-vllm033/bin/python bench/profile_host.py [--concurrency 16 1024] [--steps 120]
        [--output-tokens 24 96] [--prompt-tokens 16 112]

Replays ``bench_host``'s trace (the installed vLLM's real scheduler) through this project's
connector with every method of the connector, the cache, its page pool and its slot arrays
wrapped by a timer that charges each call's thread-CPU time to the method itself, less the
time of the wrapped calls it makes ("self" time, as in a flat profile). The wrapper costs a
few microseconds per call, so totals run above ``bench_host.py``'s; use it for shares, not
for ratios. The row copies are the ``_copy_on_device`` / ``_copy_out`` lines (kernel
launches and a DMA on a GPU, torch CPU copies here). One text file per size and trace goes
to a new git-ignored folder under bench/out/ (or ``$OUT``).
"""

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_host import add_trace_arguments, record_trace, replay, trace_of, trace_suffix  # noqa: E402
from bench.common import results_dir  # noqa: E402
from cpu_harness.vllm_scheduler import VLLM_VERSION, build_our_connector  # noqa: E402
from routed_experts_cache.connector.cache import RoutedExpertsCache  # noqa: E402
from routed_experts_cache.connector.page_pool import PagePool  # noqa: E402
from routed_experts_cache.connector.request_slots import RequestSlots  # noqa: E402
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector  # noqa: E402

PROFILED = (CacheWorkerConnector, RoutedExpertsCache, PagePool, RequestSlots)


class SelfTime:
    """Per qualified method name: calls and thread-CPU seconds spent in it, callees excluded."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # per open call: time charged to the calls it made

    def wrap(self, name: str, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - started
                inner = self._stack.pop()
                self.seconds[name] += elapsed - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def install(self) -> list[tuple[type, str, object]]:
        """Wrap every plain method of the profiled classes; returns what to restore."""
        originals = []
        for cls in PROFILED:
            for attr, value in list(vars(cls).items()):
                if callable(value) and not isinstance(value, (type, staticmethod, classmethod)) and attr != "__init__":
                    originals.append((cls, attr, value))
                    setattr(cls, attr, self.wrap(f"{cls.__name__}.{attr}", value))
        return originals


def profile(concurrency: int, steps: int, trace: dict) -> str:
    setup, events, _ = record_trace(concurrency, steps, **trace)
    replay(setup, events, build_our_connector)  # warm-up, unprofiled
    timer = SelfTime()
    originals = timer.install()
    try:
        replayed = replay(setup, events, build_our_connector)
    finally:
        for cls, attr, value in originals:
            setattr(cls, attr, value)
    num_steps = len(replayed["per_step"])
    lines = [
        f"{name:48s} {seconds / num_steps * 1e3:7.3f} ms/step  calls/step {timer.calls[name] / num_steps:6.2f}"
        for name, seconds in sorted(timer.seconds.items(), key=lambda item: -item[1])
    ]
    lines.append(f"total {sum(timer.seconds.values()) / num_steps * 1e3:.3f} ms/step over {num_steps} steps")
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--steps", type=int, default=120)
    add_trace_arguments(parser)
    args = parser.parse_args()
    trace = trace_suffix(**trace_of(args))
    for concurrency in args.concurrency:
        text = profile(concurrency, args.steps, trace_of(args))
        print(f"[{concurrency} requests]\n{text}\n", flush=True)
        path = results_dir(torch.device("cpu")) / f"profile_{concurrency}_requests_vllm{VLLM_VERSION}{trace}.txt"
        path.write_text(text + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
