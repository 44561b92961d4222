"""Host work per engine step: this project's worker connector vs vLLM 0.33's built-in one.

    .venv-vllm033/bin/python bench/bench_host.py [--concurrency 16 64 256 1024] [--steps 120]

One synthetic engine trace per concurrency level is recorded from the real vLLM 0.33
scheduler (``cpu_harness/vllm033.py``: its ``Scheduler``, ``KVCacheManager``, block hasher
and ``AuxOutputSchedulerConnector``; a simulated runner with EAGLE-style 4-token drafts and
random rejections): requests share system prefixes, prefill in chunks, finish and are
replaced. The trace (metadata, batches, snapshots, acceptance counts, in vLLM's async call
order) is then replayed through fresh instances of both connectors in the same process, and
``begin_step`` + ``process_output`` are timed per step (wall and thread CPU time). Rows are
(48, 8) uint8 (Qwen3-30B-A3B), block 16. The timed traces have lookahead block hashing off,
because vLLM's own connector crashes on a trace with it on (shown first).

On this CPU machine our connector's scatter/gather run as torch CPU ops inside
``process_output``; on a GPU they are asynchronous kernel launches. The table therefore
shows our time both in full and without the row copies (``host_only``: the bookkeeping a
GPU deployment keeps on the host); vLLM's connector does all of its work on the host on
any machine. Resident memory is measured in a separate process per connector (``--rss``).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, save_csv  # noqa: E402
from cpu_harness.vllm033 import (  # noqa: E402
    SimEngine,
    SnapshotCapturer,
    build_our_connector,
    build_vllm_connector,
    make_request,
    make_scheduler,
    random_prompt,
)

ROW_SHAPE = (48, 8)
BLOCK = 16
NUM_SPEC = 4
LOOKAHEAD_TRACE_STEPS = 120  # long enough for a full block to wait for its lookahead hash at a read


class WideCapturer(SnapshotCapturer):
    shape_per_token = ROW_SHAPE


def widen(snapshot: torch.Tensor) -> torch.Tensor:
    """(3, 2) harness rows -> (48, 8) rows, a fixed function of the original row."""
    flat = snapshot.reshape(snapshot.shape[0], -1)
    reps = -(-48 * 8 // flat.shape[1])
    return flat.repeat(1, reps)[:, : 48 * 8].reshape(-1, *ROW_SHAPE).contiguous()


class Recorder:
    """Forwards the runner's hook calls to a connector and records them in call order."""

    def __init__(self, connector) -> None:
        self.connector, self.events, self._capturer = connector, [], connector._capturer

    def begin_step(self, metadata) -> None:
        self.events.append(("begin", metadata))
        self.connector.begin_step(metadata)

    def prepare_output(self, batch):
        snapshot = self._capturer.next_snapshot
        pending = self.connector.prepare_output(batch)
        step = sum(1 for e in self.events if e[0] == "prepare")
        self.events.append(("prepare", step, batch, widen(snapshot)))
        return _RecordedPending(self, step, pending)

    def close(self) -> None:
        self.connector.close()


class _RecordedPending:
    def __init__(self, recorder: Recorder, step: int, pending) -> None:
        self.recorder, self.step, self.pending = recorder, step, pending

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self.recorder.events.append(("enqueue", self.step, num_sampled.copy(), num_rejected.copy()))
        self.pending.enqueue_cpu_copy(num_sampled, num_rejected)

    def process_output(self):
        self.recorder.events.append(("process", self.step))
        return self.pending.process_output()


def record_trace(concurrency: int, steps: int, seed: int = 0, lookahead: int = 0):
    """Run the real scheduler for ``steps`` steps at ``concurrency`` live requests."""
    rng = np.random.default_rng(seed)
    setup = make_scheduler(
        lookahead=lookahead, num_spec_tokens=NUM_SPEC, async_scheduling=True, num_blocks=concurrency * 24 + 256,
        max_num_seqs=concurrency, max_num_batched_tokens=max(2048, 8 * concurrency), max_model_len=1024,
        block_size=BLOCK,
    )
    recorder = Recorder(build_our_connector(setup, SnapshotCapturer()))
    recorder._capturer = recorder.connector._capturer
    engine = SimEngine(setup, recorder, seed=seed)
    engine.capturer = recorder._capturer
    prefixes = [random_prompt(rng, 96) for _ in range(4)]
    added = 0

    def top_up() -> None:
        nonlocal added
        live = len(engine.requests) - len(engine.finished)
        for _ in range(concurrency - live):
            prompt = prefixes[added % 4] + random_prompt(rng, int(rng.integers(16, 112)))
            engine.add(make_request(setup, f"r{added}", prompt, int(rng.integers(24, 96))))
            added += 1

    for _ in range(steps):
        top_up()
        engine.step()
    engine.drain()
    return setup, recorder.events, {"requests": added, "finished": len(engine.finished)}


def replay(setup, events, build) -> dict:
    """Replay a recorded trace through a fresh connector; time begin_step + process_output."""
    capturer = WideCapturer()
    connector = build(setup, capturer)
    copy_seconds = [0.0]  # time in our row copies: kernel launches on a GPU, torch CPU ops here
    cache = getattr(connector, "cache", None)
    if cache is not None:
        copy = cache._copy

        def timed_copy(*args):
            started = time.perf_counter()
            copy(*args)
            copy_seconds[0] += time.perf_counter() - started

        cache._copy = timed_copy
    pendings, begin, process, outputs = {}, [], [], []
    gc.collect()
    gc.freeze()
    for event in events:
        kind = event[0]
        if kind == "begin":
            wall, cpu = time.perf_counter(), time.thread_time()
            connector.begin_step(event[1])
            begin.append((time.perf_counter() - wall, time.thread_time() - cpu))
        elif kind == "prepare":
            _, step, batch, snapshot = event
            capturer.next_snapshot = snapshot
            pendings[step] = connector.prepare_output(batch)
        elif kind == "enqueue":
            _, step, num_sampled, num_rejected = event
            pendings[step].enqueue_cpu_copy(num_sampled, num_rejected)
        else:
            copy_seconds[0] = 0.0
            wall, cpu = time.perf_counter(), time.thread_time()
            out = pendings.pop(event[1]).process_output()
            process.append((time.perf_counter() - wall, time.thread_time() - cpu, copy_seconds[0]))
            outputs.append({k: (v.token_start, np.asarray(v.rows).copy()) for k, v in out.items()})
    connector.close()
    gc.unfreeze()
    # Per step: process_output(t) with the begin_step that preceded it.
    per_step = [(b[0] + p[0], b[1] + p[1], b[0] + p[0] - p[2]) for b, p in zip(begin, process)]
    return {"per_step": per_step, "outputs": outputs}


def builders():
    return {
        "routed-experts-cache": lambda setup, capturer: build_our_connector(setup, capturer),
        "vllm-0.33-builtin": build_vllm_connector,
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_rss(impl: str, concurrency: int, steps: int) -> dict:
    setup, events, _ = record_trace(concurrency, steps)
    gc.collect()
    before = rss_bytes()
    result = replay(setup, events, builders()[impl])
    del result
    return {"impl": impl, "concurrency": concurrency, "rss_growth_MiB": (rss_bytes() - before) / 2**20}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for impl in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == impl]
        points = sorted((float(r["concurrency"]), float(r["median_ms"])) for r in mine)
        line = ax.plot(*zip(*points), marker="o", label=f"{impl}: total")[0]
        if any(float(r["host_only_median_ms"]) != float(r["median_ms"]) for r in mine):
            points = sorted((float(r["concurrency"]), float(r["host_only_median_ms"])) for r in mine)
            ax.plot(*zip(*points), marker="o", linestyle="--", color=line.get_color(),
                    label=f"{impl}: bookkeeping (no row copies)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("host ms per step (median)")
    ax.set_title("begin_step + process_output per engine step (CPU machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    # One intra-op thread, as the engine's worker runs: small torch CPU ops with an idle-spinning
    # OpenMP team on a loaded 2-core machine cost milliseconds instead of microseconds.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rss", nargs=2, metavar=("IMPL", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss:
        print(json.dumps(measure_rss(args.rss[0], int(args.rss[1]), args.steps)))
        return

    # With EAGLE/MTP lookahead hashing on (vLLM 0.33's default), vLLM's own connector cannot
    # replay such a trace at all (design/vllm-aux-output.md section 4): show it, then compare
    # speed on traces with lookahead hashing off, which both connectors can run.
    setup, events, _ = record_trace(16, LOOKAHEAD_TRACE_STEPS, lookahead=1)
    for impl, build in builders().items():
        try:
            replay(setup, events, build)
            print(f"lookahead-1 trace: {impl} returned every row")
        except AssertionError as error:
            print(f"lookahead-1 trace: {impl} crashed: AssertionError: {error}")
    rows = []
    for concurrency in args.concurrency:
        started = time.perf_counter()
        setup, events, trace = record_trace(concurrency, args.steps)
        print(f"[{concurrency:5d} requests] trace: {args.steps} steps, {trace['requests']} requests, "
              f"{trace['finished']} finished ({time.perf_counter() - started:.1f} s)", flush=True)
        timings = {impl: [] for impl in builders()}
        results = {}
        for _ in range(2):  # alternate the two implementations to spread machine noise
            for impl, build in builders().items():
                results[impl] = replay(setup, events, build)
                timings[impl] += results[impl]["per_step"]
        ours, theirs = results["routed-experts-cache"]["outputs"], results["vllm-0.33-builtin"]["outputs"]
        if len(ours) != len(theirs) or any(
            a.keys() != b.keys() or any(a[k][0] != b[k][0] or not np.array_equal(a[k][1], b[k][1]) for k in a)
            for a, b in zip(ours, theirs)
        ):
            raise SystemExit(f"outputs differ between the two connectors at concurrency {concurrency}")
        for impl, samples in timings.items():
            wall = [w for w, _, _ in samples]
            cpu = [c for _, c, _ in samples]
            host_only = [h for _, _, h in samples]
            rss = json.loads(subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--rss", impl, str(concurrency)],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1])
            rows.append({
                "impl": impl, "concurrency": concurrency, "steps": len(samples) // 2,
                "median_ms": statistics.median(wall) * 1e3, "p90_ms": float(np.percentile(wall, 90)) * 1e3,
                "cpu_median_ms": statistics.median(cpu) * 1e3,
                "host_only_median_ms": statistics.median(host_only) * 1e3,
                "rss_growth_MiB": rss["rss_growth_MiB"],
            })
        ours, theirs = rows[-2], rows[-1]
        for row in (ours, theirs):
            row["ratio_to_vllm"] = row["median_ms"] / theirs["median_ms"]
            row["host_only_ratio_to_vllm"] = row["host_only_median_ms"] / theirs["median_ms"]
        print(f"    ours {ours['median_ms']:.3f} ms/step ({ours['host_only_median_ms']:.3f} without the row "
              f"copies), vLLM {theirs['median_ms']:.3f} ms/step -> ours/vLLM = {ours['ratio_to_vllm']:.2f} "
              f"({ours['host_only_ratio_to_vllm']:.2f})", flush=True)
    print()
    print_table(rows, list(rows[0]))
    csv_path = save_csv(rows, "host_overhead.csv", torch.device("cpu"))
    plot(rows, csv_path.with_suffix(".png"))
    print(f"wrote {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
