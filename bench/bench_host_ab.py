"""Host work per engine step: this checkout's connector against an earlier revision's, A/B.

    .venv-vllm033/bin/python bench/bench_host_ab.py --against HEAD~1 [--concurrency 16 64 256 1024]
        [--output-tokens 24 96] [--prompt-tokens 16 112] [--rounds 4] [--page-pool]

Both connectors replay the same recorded trace (``bench_host.record_trace``) in one process,
interleaved round by round in alternating order, so that the machine's load falls on both
alike; the first round of each is a warm-up. The revision's package is taken from git
(``git archive``) into a temporary folder and imported under another name. The figure is the
median per step of all four hooks' thread-CPU time without the row copies (bench_host's
"bookkeeping"), its mean (work done once every few steps, such as deferred work applied at
once, shows there and not in the median), and the median of ``begin_step``; both replays must
return the same rows. Results go to a new git-ignored folder under bench/out/ (or ``$OUT``).

``--page-pool`` compares the page pool alone, where a change to it is a few percent of a step
and whole steps cannot resolve it on a shared machine: both replays run this checkout's
connector and cache, one with the revision's ``PagePool`` (same interface), and the figure is
the thread-CPU inside the pool's calls (outermost calls only) per step, a replay's mean, the
median over rounds.
"""

import argparse
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_host import (  # noqa: E402
    HOOKS, parse_replay_arguments, record_trace, replay_alternating, same_outputs, trace_columns, trace_of, trace_suffix,
)
from bench.common import print_table, save_csv  # noqa: E402
from cpu_harness.vllm_scheduler import VLLM_VERSION, build_our_connector  # noqa: E402
from routed_experts_cache.connector import cache as cache_module  # noqa: E402

PACKAGE = "routed_experts_cache_against"


def import_revision(revision: str, into: Path, module: str = "connector.vllm.worker"):
    """``module`` of ``revision``'s package, imported as ``PACKAGE`` from ``into``."""
    archive = subprocess.run(["git", "archive", revision, "src/routed_experts_cache", "connector", "kernels"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    package = into / PACKAGE
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile():
                continue
            # src/routed_experts_cache/x -> x; connector/... and kernels/... stay (the package's layout)
            target = package.joinpath(*parts[2:]) if parts[0] == "src" else package.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{PACKAGE}.{module}")


class PoolTimer:
    """Thread-CPU seconds spent in a page pool class's outermost method calls, and the modules
    of the pool classes that ran them (which pool a replay really used)."""

    def __init__(self) -> None:
        self.seconds, self._depth, self.modules = 0.0, 0, set()

    def timed(self, pool_class: type) -> type:
        """A subclass of ``pool_class`` whose methods charge their time here."""
        def wrap(method):
            def timed_method(*args, **kwargs):
                self._depth += 1
                started = time.thread_time()
                try:
                    return method(*args, **kwargs)
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self.seconds += time.thread_time() - started
                        self.modules.add(pool_class.__module__)
            return timed_method

        methods = {name: wrap(value) for name, value in vars(pool_class).items()
                   if callable(value) and not name.startswith("__")}
        return type(pool_class.__name__, (pool_class,), methods)


def compare_page_pools(args, against_pool: type) -> list[dict]:
    """Per size: this checkout's connector replayed with each page pool, interleaved."""
    timer, ours = PoolTimer(), cache_module.PagePool
    pools = {"this checkout": timer.timed(ours), args.against: timer.timed(against_pool)}
    per_replay, modules = {}, {}  # per pool, for the size being replayed: ms per step, pool module

    def build_with(pool: type):
        def build(setup, capturer):
            cache_module.PagePool, timer.seconds, timer.modules = pool, 0.0, set()
            return build_our_connector(setup, capturer)
        return build

    def measured(name: str, result: dict) -> None:
        per_replay[name].append(timer.seconds / len(result["per_step"]) * 1e3)
        modules[name] = " ".join(sorted(timer.modules))

    rows = []
    for concurrency in args.concurrency:
        setup, events, _ = record_trace(concurrency, args.steps, **trace_of(args))
        per_replay.update({name: [] for name in pools})
        try:
            builds = {name: build_with(pool) for name, pool in pools.items()}
            _, outputs = replay_alternating(setup, events, builds, args.rounds, measured)
        finally:
            cache_module.PagePool = ours
        if not same_outputs(*outputs.values()):
            raise SystemExit(f"{concurrency} requests: the two page pools returned different rows")
        new, old = (statistics.median(per_replay[name]) for name in pools)
        rows.append({
            "vllm": VLLM_VERSION, "concurrency": concurrency, **trace_columns(trace_of(args)),
            "against": args.against, "page_pool_ms": new, "against_page_pool_ms": old, "page_pool_ratio": new / old,
            "replays": len(per_replay["this checkout"]), "page_pool_module": modules["this checkout"],
            "against_page_pool_module": modules[args.against],
        })
        print(f"[{concurrency:>5} requests] page pool {new:.3f} vs {old:.3f} ms per step -> {new / old:.3f}; "
              f"identical rows", flush=True)
    return rows


def main() -> None:
    torch.set_num_threads(1)  # as bench_host: one intra-op thread, as the engine's worker runs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="git revision to compare with (default: HEAD)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--page-pool", action="store_true", help="time the page pool alone (see above)")
    args = parse_replay_arguments(parser, rounds=4)
    with tempfile.TemporaryDirectory() as scratch:
        if args.page_pool:
            rows = compare_page_pools(args, import_revision(args.against, Path(scratch), "connector.page_pool").PagePool)
            print_table(rows, list(rows[0]))
            save_csv(rows, f"page_pool_ab_vllm{VLLM_VERSION}{trace_suffix(**trace_of(args))}.csv", torch.device("cpu"))
            return
        against = import_revision(args.against, Path(scratch))

        def build_against(setup, capturer):
            cache = against.build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
            return against.CacheWorkerConnector(capturer=capturer, cache=cache,
                                                max_concurrent_batches=setup.vllm_config.max_concurrent_batches)

        builds = {"this checkout": lambda setup, capturer: build_our_connector(setup, capturer), args.against: build_against}
        rows = []
        for concurrency in args.concurrency:
            setup, events, _ = record_trace(concurrency, args.steps, **trace_of(args))
            samples, outputs = replay_alternating(setup, events, builds, args.rounds)
            if not same_outputs(*outputs.values()):
                raise SystemExit(f"{concurrency} requests: the two revisions returned different rows")
            figures = {}
            for name, steps in samples.items():
                per_step = [sum(s[h][1] - s[h][2] for h in HOOKS) for s in steps]
                figures[name] = {
                    "bookkeeping": statistics.median(per_step) * 1e3, "bookkeeping_mean": statistics.fmean(per_step) * 1e3,
                    "begin_step": statistics.median(s["begin_step"][1] for s in steps) * 1e3,
                }
            new, old = figures["this checkout"], figures[args.against]
            rows.append({
                "vllm": VLLM_VERSION, "concurrency": concurrency, **trace_columns(trace_of(args)),
                "against": args.against, "bookkeeping_ms": new["bookkeeping"], "against_bookkeeping_ms": old["bookkeeping"],
                "bookkeeping_ratio": new["bookkeeping"] / old["bookkeeping"],
                "bookkeeping_mean_ms": new["bookkeeping_mean"], "against_bookkeeping_mean_ms": old["bookkeeping_mean"],
                "bookkeeping_mean_ratio": new["bookkeeping_mean"] / old["bookkeeping_mean"], "begin_step_ms": new["begin_step"],
                "against_begin_step_ms": old["begin_step"], "begin_step_ratio": new["begin_step"] / old["begin_step"],
                "step_samples": len(samples["this checkout"]),
            })
            print(f"[{concurrency:>5} requests] bookkeeping {new['bookkeeping']:.3f} vs {old['bookkeeping']:.3f} ms "
                  f"-> {rows[-1]['bookkeeping_ratio']:.3f} (means {new['bookkeeping_mean']:.3f} vs "
                  f"{old['bookkeeping_mean']:.3f} -> {rows[-1]['bookkeeping_mean_ratio']:.3f}); begin_step {new['begin_step']:.3f} vs {old['begin_step']:.3f} ms; "
                  f"identical rows", flush=True)
    print_table(rows, list(rows[0]))
    save_csv(rows, f"host_ab_vllm{VLLM_VERSION}{trace_suffix(**trace_of(args))}.csv", torch.device("cpu"))


if __name__ == "__main__":
    main()
