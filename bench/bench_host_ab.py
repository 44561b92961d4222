"""Host work per engine step: this checkout's connector against an earlier revision's, A/B.

    .venv-vllm033/bin/python bench/bench_host_ab.py --against HEAD~1 [--concurrency 16 64 256 1024]
        [--output-tokens 24 96] [--rounds 4]

Both connectors replay the same recorded trace (``bench_host.record_trace``) in one process,
interleaved round by round in alternating order, so that the machine's load falls on both
alike; the first round of each is a warm-up. The revision's package is taken from git
(``git archive``) into a temporary folder and imported under another name. The figure is the
median per step of all four hooks' thread-CPU time without the row copies (bench_host's
"bookkeeping"), and of ``begin_step``; both replays must return the same rows. Results go to a
new git-ignored folder under bench/out/ (or ``$OUT``).
"""

import argparse
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_host import HOOKS, parse_replay_arguments, record_trace, replay_alternating, same_outputs, trace_suffix  # noqa: E402
from bench.common import print_table, save_csv  # noqa: E402
from cpu_harness.vllm_scheduler import VLLM_VERSION, build_our_connector  # noqa: E402

PACKAGE = "routed_experts_cache_against"


def import_revision(revision: str, into: Path):
    """The worker module of ``revision``'s package, imported as ``PACKAGE`` from ``into``."""
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
    return importlib.import_module(f"{PACKAGE}.connector.vllm.worker")


def main() -> None:
    torch.set_num_threads(1)  # as bench_host: one intra-op thread, as the engine's worker runs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="git revision to compare with (default: HEAD)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parse_replay_arguments(parser, rounds=4)
    with tempfile.TemporaryDirectory() as scratch:
        against = import_revision(args.against, Path(scratch))

        def build_against(setup, capturer):
            cache = against.build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
            return against.CacheWorkerConnector(capturer=capturer, cache=cache,
                                                max_concurrent_batches=setup.vllm_config.max_concurrent_batches)

        builds = {"this checkout": lambda setup, capturer: build_our_connector(setup, capturer), args.against: build_against}
        rows = []
        for concurrency in args.concurrency:
            setup, events, _ = record_trace(concurrency, args.steps, output_tokens=tuple(args.output_tokens))
            samples, outputs = replay_alternating(setup, events, builds, args.rounds)
            if not same_outputs(*outputs.values()):
                raise SystemExit(f"{concurrency} requests: the two revisions returned different rows")
            median = {name: {
                "bookkeeping": statistics.median(sum(s[h][1] - s[h][2] for h in HOOKS) for s in steps) * 1e3,
                "begin_step": statistics.median(s["begin_step"][1] for s in steps) * 1e3,
            } for name, steps in samples.items()}
            new, old = median["this checkout"], median[args.against]
            rows.append({
                "vllm": VLLM_VERSION, "concurrency": concurrency, "output_tokens": "-".join(map(str, args.output_tokens)),
                "against": args.against, "bookkeeping_ms": new["bookkeeping"], "against_bookkeeping_ms": old["bookkeeping"],
                "bookkeeping_ratio": new["bookkeeping"] / old["bookkeeping"], "begin_step_ms": new["begin_step"],
                "against_begin_step_ms": old["begin_step"], "begin_step_ratio": new["begin_step"] / old["begin_step"],
                "step_samples": len(samples["this checkout"]),
            })
            print(f"[{concurrency:>5} requests] bookkeeping {new['bookkeeping']:.3f} vs {old['bookkeeping']:.3f} ms "
                  f"-> {rows[-1]['bookkeeping_ratio']:.3f}; begin_step {new['begin_step']:.3f} vs {old['begin_step']:.3f} ms; "
                  f"identical rows", flush=True)
    print_table(rows, list(rows[0]))
    save_csv(rows, f"host_ab_vllm{VLLM_VERSION}{trace_suffix(args.output_tokens)}.csv", torch.device("cpu"))


if __name__ == "__main__":
    main()
