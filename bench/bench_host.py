"""Host work per engine step: this project's worker connector vs the installed vLLM's built-in one.

    .venv-vllm033/bin/python bench/bench_host.py [--concurrency 16 64 256 1024] [--steps 120]
        [--output-tokens 24 96] [--prompt-tokens 16 112]
    .venv-vllm034/bin/python bench/bench_host.py ...   (the same against vLLM 0.34)

The built-in connector is labelled with the installed version (``vllm-0.34.0-builtin``). One
synthetic engine trace per concurrency level is recorded from the installed vLLM's real
scheduler (``cpu_harness/vllm_scheduler/``: its ``Scheduler``, ``KVCacheManager``, block hasher
and ``AuxOutputSchedulerConnector``; a simulated runner with EAGLE-style 4-token drafts and
random rejections): requests share system prefixes, prefill in chunks, finish and are
replaced. The trace (metadata, batches, snapshots, acceptance counts, in vLLM's async call
order) is then replayed through fresh instances of both connectors in the same process,
interleaved (``--rounds``), and all four hooks (``begin_step``, ``prepare_output``,
``enqueue_cpu_copy``, ``process_output``) are timed per step, in thread CPU time and wall
time, plus the CPU time of any thread the connector started (vLLM's own connector, 0.32-0.34,
applies its store updates on a writer thread); the figure compared is the CPU time of both. Rows are (48, 8) uint8 (Qwen3-30B-A3B), block 16. The timed
traces have lookahead block hashing off, because vLLM 0.33's own connector crashes on a trace
with it on (shown first, with our rows checked against the rows the trace captured; 0.34's
serves that trace).

On this CPU machine our connector's scatter/gather run as torch CPU ops inside
``process_output``, and its copy-out of the step's rows (a device-to-host copy on a GPU, as
vLLM's own connector makes) is a host memcpy; on a GPU they are asynchronous kernel launches
and a DMA. The table therefore
shows our CPU time both in full and without the row copies (``host_only``: the bookkeeping a
GPU deployment keeps on the host); vLLM's connector does all of its work on the host on
any machine. Resident memory is measured in a separate process per connector (``--rss``).
Results go to a new git-ignored folder under bench/out/ (or ``$OUT``).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, save_csv  # noqa: E402
from cpu_harness.vllm_scheduler import (  # noqa: E402
    VLLM_VERSION,
    SimEngine,
    SnapshotCapturer,
    build_our_connector,
    build_vllm_connector,
    make_request,
    make_scheduler,
    random_prompt,
)
from routed_experts_cache.connector.vllm.step_hashes import unpack_hashes  # noqa: E402
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402

ROW_SHAPE = (48, 8)
BLOCK = 16
BUILTIN = f"vllm-{VLLM_VERSION}-builtin"
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
        self.outputs = []  # what each process_output returned (rows checked by the harness)

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
        out = self.pending.process_output()
        self.recorder.outputs.append(
            {k: (v.token_start, widen(torch.from_numpy(np.asarray(v.rows))).numpy()) for k, v in out.items()}
        )
        return out


OUTPUT_TOKENS, PROMPT_PREFIX_TOKENS, PROMPT_TOKENS = (24, 96), 96, (16, 112)  # the default trace


def record_trace(concurrency: int, steps: int, seed: int = 0, lookahead: int = 0, output_tokens=OUTPUT_TOKENS,
                 prompt_tokens=PROMPT_TOKENS):
    """Run the real scheduler for ``steps`` steps at ``concurrency`` live requests, each
    generating a random number of tokens in ``output_tokens`` (short outputs: many requests
    start and finish every step). A prompt is one of four shared 96-token prefixes and a
    random number of its own tokens in ``prompt_tokens``."""
    prompt_blocks = -(-(PROMPT_PREFIX_TOKENS + prompt_tokens[1]) // BLOCK)
    kv_blocks_per_request = max(24, prompt_blocks + 4) + output_tokens[1] // BLOCK
    rng = np.random.default_rng(seed)
    setup = make_scheduler(
        lookahead=lookahead, num_spec_tokens=NUM_SPEC, async_scheduling=True, num_blocks=concurrency * kv_blocks_per_request + 256,
        max_num_seqs=concurrency, max_num_batched_tokens=max(2048, 8 * concurrency),
        max_model_len=max(1024, PROMPT_PREFIX_TOKENS + prompt_tokens[1] + output_tokens[1] + 2 * NUM_SPEC),
        block_size=BLOCK,
    )
    recorder = Recorder(build_our_connector(setup, SnapshotCapturer()))
    recorder._capturer = recorder.connector._capturer
    engine = SimEngine(setup, recorder, seed=seed)
    engine.capturer = recorder._capturer
    prefixes = [random_prompt(rng, PROMPT_PREFIX_TOKENS) for _ in range(4)]
    added = 0

    def top_up() -> None:
        nonlocal added
        live = len(engine.requests) - len(engine.finished)
        for _ in range(concurrency - live):
            prompt = prefixes[added % 4] + random_prompt(rng, int(rng.integers(*prompt_tokens)))
            engine.add(make_request(setup, f"r{added}", prompt, int(rng.integers(*output_tokens))))
            added += 1

    for _ in range(steps):
        top_up()
        engine.step()
    engine.drain()
    trace = {"requests": added, "finished": len(engine.finished), "outputs": recorder.outputs}
    return setup, recorder.events, trace


HOOKS = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
BACKGROUND = "background_threads"  # CPU of threads the connector started, per step (no wall time)
TIMED = (*HOOKS, BACKGROUND)
FLOOR = "output-contract floor"


class BackgroundThreads:
    """The CPU time of the threads started since ``threads_before`` was taken (a connector's
    workers), read from each thread's own CPU clock; threads that start later are found at
    the next reading, one that has ended keeps its last reading."""

    def __init__(self, threads_before: set) -> None:
        self._before, self._clocks, self._last = threads_before, {}, {}

    def cpu_seconds(self) -> float:
        for thread in threading.enumerate():
            if thread not in self._before and thread.ident not in self._clocks and thread.is_alive():
                self._clocks[thread.ident] = time.pthread_getcpuclockid(thread.ident)
        for ident, clock in self._clocks.items():
            try:
                self._last[ident] = time.clock_gettime(clock)
            except OSError:  # the thread has ended
                pass
        return sum(self._last.values())


class OutputContractFloor:
    """The host work vLLM's output contract alone costs a Python connector per step.

    Every step: the scheduled ids mapped to state (one C-level pass), each request's new
    block hashes unpacked and kept, finished ids dropped, and one ``AuxRequestOutput`` per
    request, its rows a view of one host array. No checks, no pages, no copies: not a
    connector (its rows are not the requests' rows) but a lower bound for any connector that
    builds the contract's objects in Python, replayed on the same trace.
    """

    def __init__(self, setup, capturer) -> None:
        self._capturer, self._index, self._hashes = capturer, {}, {}

    def begin_step(self, metadata) -> None:
        if metadata is None:
            return
        list(map(self._index.setdefault, metadata.requests, metadata.requests.values()))
        for request_id, packed in metadata.block_hashes.items():
            self._hashes.setdefault(request_id, []).extend(unpack_hashes(packed, f"request {request_id!r}"))
        for request_id in metadata.finished_requests:
            self._index.pop(request_id, None)
            self._hashes.pop(request_id, None)

    def prepare_output(self, batch):
        request_ids = list(batch.req_ids)
        bounds = np.array(batch.query_start_loc_np[: len(request_ids) + 1])
        starts = np.array(batch.num_computed_tokens_np[: len(request_ids)], dtype=np.int64)
        return _FloorPending(request_ids, bounds, starts, self._capturer.snapshot_routing_data(int(bounds[-1])))

    def close(self) -> None:
        self._index.clear()
        self._hashes.clear()


class _FloorPending:
    def __init__(self, request_ids, bounds, starts, snapshot) -> None:
        self.request_ids, self.bounds, self.starts, self.snapshot = request_ids, bounds, starts, snapshot

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self.num_rejected = num_rejected

    def process_output(self):
        rows = self.snapshot.numpy()
        ends = (self.bounds[1:] - self.num_rejected[: len(self.request_ids)]).tolist()
        return dict(zip(self.request_ids, map(AuxRequestOutput, self.starts.tolist(), map(
            rows.__getitem__, map(slice, self.bounds[:-1].tolist(), ends)))))


def replay(setup, events, build) -> dict:
    """Replay a recorded trace through a fresh connector, timing each of the four hooks.

    Per step (the k-th call of each hook): wall and thread-CPU seconds of every hook, and the
    thread-CPU seconds spent inside our row copies (the pool's scatter / gather and the
    copy-out: kernel launches and a DMA on a GPU, torch CPU ops here), so that the bookkeeping
    alone can be reported; and the CPU seconds of the threads the connector started
    (``BACKGROUND``), from one step's ``begin_step`` to the next's: vLLM's own connector hands
    its store updates to a writer thread ("vllm-aux-output-writer", vLLM 0.32-0.34), whose
    work the hooks' thread time alone would leave out.
    """
    capturer = WideCapturer()
    threads_before = set(threading.enumerate())
    connector = build(setup, capturer)
    background = BackgroundThreads(threads_before)
    copy_cpu = [0.0]
    cache = getattr(connector, "cache", None)
    if cache is not None:
        copy = cache._copy

        def timed_copy(*args):
            started = time.thread_time()
            copy(*args)
            copy_cpu[0] += time.thread_time() - started

        cache._copy = timed_copy
        copy_rows = cache._copy_rows  # small copies: torch index copies by row

        def timed_copy_rows(*args):
            started = time.thread_time()
            copy_rows(*args)
            copy_cpu[0] += time.thread_time() - started

        cache._copy_rows = timed_copy_rows
        copy_out = connector._copy_out

        def timed_copy_out(snapshot):
            started = time.thread_time()
            host = copy_out(snapshot)
            copy_cpu[0] += time.thread_time() - started
            return host

        connector._copy_out = timed_copy_out
    pendings, outputs = {}, []
    timed = {hook: [] for hook in TIMED}  # per hook, in call order: (wall, cpu, copy cpu)
    background_at_begin = []

    def timed_call(hook, fn, *args):
        copy_cpu[0] = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn(*args)
        timed[hook].append((time.perf_counter() - wall, time.thread_time() - cpu, copy_cpu[0]))
        return result

    gc.collect()
    gc.freeze()
    for event in events:
        kind = event[0]
        if kind == "begin":
            background_at_begin.append(background.cpu_seconds())
            timed_call("begin_step", connector.begin_step, event[1])
        elif kind == "prepare":
            _, step, batch, snapshot = event
            capturer.next_snapshot = snapshot
            pendings[step] = timed_call("prepare_output", connector.prepare_output, batch)
        elif kind == "enqueue":
            _, step, num_sampled, num_rejected = event
            timed_call("enqueue_cpu_copy", pendings[step].enqueue_cpu_copy, num_sampled, num_rejected)
        else:
            out = timed_call("process_output", pendings.pop(event[1]).process_output)
            outputs.append({k: (v.token_start, np.asarray(v.rows).copy()) for k, v in out.items()})
    background_at_begin.append(background.cpu_seconds())  # the last step's, before close() ends the threads
    connector.close()
    gc.unfreeze()
    timed[BACKGROUND] = [(0.0, b - a, 0.0) for a, b in zip(background_at_begin, background_at_begin[1:])]
    steps = min(len(samples) for samples in timed.values())
    per_step = [
        {hook: timed[hook][k] for hook in TIMED} for k in range(steps)
    ]
    return {"per_step": per_step, "outputs": outputs}


def replay_alternating(setup, events, builds: dict, rounds: int, measured=None) -> tuple[dict[str, list], dict[str, list]]:
    """``replay`` through each of ``builds`` (name -> build) ``rounds`` times, their order
    reversed every other round so that the machine's load falls on all alike; the first round
    warms up. Returns per name the later rounds' steps (concatenated) and its last replay's
    outputs; ``measured(name, result)``, if given, sees each of the later rounds' replays."""
    samples, outputs = {name: [] for name in builds}, {}
    for round_ in range(rounds):
        for name in (list(builds) if round_ % 2 else list(builds)[::-1]):
            result = replay(setup, events, builds[name])
            outputs[name] = result["outputs"]
            if round_:
                samples[name] += result["per_step"]
                if measured is not None:
                    measured(name, result)
    return samples, outputs


def trace_suffix(output_tokens, prompt_tokens=PROMPT_TOKENS) -> str:
    """The file-name suffix of a trace: none for the default outputs (24-96 tokens) and prompts."""
    suffix = "" if tuple(output_tokens) == OUTPUT_TOKENS else "_out{}-{}".format(*output_tokens)
    return suffix + ("" if tuple(prompt_tokens) == PROMPT_TOKENS else "_prompt{}-{}".format(*prompt_tokens))


def trace_of(args: argparse.Namespace) -> dict:
    """``record_trace``'s and ``trace_suffix``'s trace options from parsed arguments."""
    return {"output_tokens": tuple(args.output_tokens), "prompt_tokens": tuple(args.prompt_tokens)}


def trace_columns(trace: dict) -> dict:
    """A result row's columns naming its trace (``trace_of``'s options as ``MIN-MAX``)."""
    return {name: "{}-{}".format(*tokens) for name, tokens in trace.items()}


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-tokens", type=int, nargs=2, default=list(OUTPUT_TOKENS), metavar=("MIN", "MAX"),
                        help="tokens each request generates (default 24 96: many arrivals and finishes per step)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=list(PROMPT_TOKENS), metavar=("MIN", "MAX"),
                        help="prompt tokens after the shared 96-token prefix (default 16 112; long prompts: "
                             "prefill chunks of many blocks)")


def bookkeeping(per_step: list[dict]) -> list[float]:
    """Per step: all hooks and the connector's threads, thread CPU, without our row copies."""
    return [sum(step[hook][1] - step[hook][2] for hook in TIMED) for step in per_step]


def total_cpu(per_step: list[dict]) -> list[float]:
    """Per step: all hooks and the connector's threads, thread CPU."""
    return [sum(step[hook][1] for hook in TIMED) for step in per_step]


def parse_replay_arguments(parser: argparse.ArgumentParser, rounds: int) -> argparse.Namespace:
    """Add the trace and interleaving options of the benchmarks that replay through
    ``replay_alternating`` (``--steps``, ``--output-tokens``, ``--prompt-tokens``, ``--rounds``), parse, and refuse
    fewer than two rounds (the first warms up)."""
    parser.add_argument("--steps", type=int, default=120)
    add_trace_arguments(parser)
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved replays per connector (the first warms up)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first round is a warm-up)")
    return args


def summarize(impl: str, concurrency: int, samples: list[dict]) -> dict:
    """Medians over steps: all hooks and the connector's own threads together (wall: the
    hooks only; CPU; CPU without row copies; CPU of the hooks' thread alone) and per hook; and
    the means of CPU with and without the row copies."""
    wall = [sum(s[h][0] for h in HOOKS) for s in samples]
    cpu, host_only = total_cpu(samples), bookkeeping(samples)
    row = {
        "impl": impl, "concurrency": concurrency, "step_samples": len(samples),
        "median_ms": statistics.median(wall) * 1e3, "p90_ms": float(np.percentile(wall, 90)) * 1e3,
        "cpu_median_ms": statistics.median(cpu) * 1e3,
        "host_only_cpu_median_ms": statistics.median(host_only) * 1e3,
        # Means too: work done once every few steps (deferred work applied at once, vLLM's writer
        # thread) weighs in full there and hardly in the median.
        "cpu_mean_ms": statistics.fmean(cpu) * 1e3, "host_only_cpu_mean_ms": statistics.fmean(host_only) * 1e3,
        "hook_thread_cpu_median_ms": statistics.median(sum(s[h][1] for h in HOOKS) for s in samples) * 1e3,
    }
    for hook in TIMED:
        row[f"{hook}_cpu_ms"] = statistics.median(s[hook][1] for s in samples) * 1e3
    # Its mean too: a writer thread that wakes once for several steps leaves most steps at 0.
    row[f"{BACKGROUND}_cpu_mean_ms"] = statistics.fmean(s[BACKGROUND][1] for s in samples) * 1e3
    for hook in TIMED:  # per hook without the row copies: what the per-hook table compares
        row[f"{hook}_host_only_cpu_ms"] = statistics.median(s[hook][1] - s[hook][2] for s in samples) * 1e3
    return row


def same_outputs(a: list[dict], b: list[dict]) -> bool:
    """Two replays returned the same rows at the same positions for the same requests."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k][0] == y[k][0] and np.array_equal(x[k][1], y[k][1]) for k in x)
        for x, y in zip(a, b)
    )


def builders():
    return {
        "routed-experts-cache": lambda setup, capturer: build_our_connector(setup, capturer),
        BUILTIN: build_vllm_connector,
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_rss(impl: str, concurrency: int, steps: int, trace: dict) -> dict:
    setup, events, _ = record_trace(concurrency, steps, **trace)
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
        points = sorted((float(r["concurrency"]), float(r["cpu_median_ms"])) for r in mine)
        line = ax.plot(*zip(*points), marker="o", label=f"{impl}: total")[0]
        if any(float(r["host_only_cpu_median_ms"]) != float(r["cpu_median_ms"]) for r in mine):
            points = sorted((float(r["concurrency"]), float(r["host_only_cpu_median_ms"])) for r in mine)
            ax.plot(*zip(*points), marker="o", linestyle="--", color=line.get_color(),
                    label=f"{impl}: bookkeeping (no row copies)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("host CPU ms per step (median)")
    ax.set_title("connector hooks + its threads per engine step (CPU machine)")
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
    parser.add_argument("--rounds", type=int, default=3, help="interleaved replays per connector")
    add_trace_arguments(parser)
    parser.add_argument("--rss", nargs=2, metavar=("IMPL", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss:
        print(json.dumps(measure_rss(args.rss[0], int(args.rss[1]), args.steps, trace_of(args))))
        return

    # With EAGLE/MTP lookahead hashing on (the default since 0.33), vLLM 0.33's own connector
    # cannot replay such a trace at all (design/vllm-aux-output.md section 4; 0.34 fixed it):
    # show it, then compare speed on traces with lookahead hashing off, which every release runs.
    setup, events, trace = record_trace(16, LOOKAHEAD_TRACE_STEPS, lookahead=1)
    for impl, build in builders().items():
        try:
            outputs = replay(setup, events, build)["outputs"]
        except AssertionError as error:
            print(f"lookahead-1 trace: {impl} crashed: AssertionError: {error}")
            continue
        if not same_outputs(outputs, trace["outputs"]):
            raise SystemExit(f"lookahead-1 trace: {impl} returned rows that differ from the recorded ones")
        rows = sum(len(rows) for out in outputs for _, rows in out.values())
        print(f"lookahead-1 trace: {impl} returned every row exactly ({rows} rows, checked against the oracle)")
    rows = []
    for concurrency in args.concurrency:
        started = time.perf_counter()
        setup, events, trace = record_trace(concurrency, args.steps, **trace_of(args))
        print(f"[{concurrency:5d} requests] trace: {args.steps} steps, {trace['requests']} requests, "
              f"{trace['finished']} finished ({time.perf_counter() - started:.1f} s)", flush=True)
        timed_builders = {**builders(), FLOOR: OutputContractFloor}
        timings = {impl: [] for impl in timed_builders}
        results = {}
        for _ in range(args.rounds):  # alternate the implementations to spread machine noise
            for impl, build in timed_builders.items():
                results[impl] = replay(setup, events, build)
                timings[impl] += results[impl]["per_step"]
        ours, theirs = results["routed-experts-cache"]["outputs"], results[BUILTIN]["outputs"]
        if not same_outputs(ours, theirs) or not same_outputs(ours, trace["outputs"]):
            raise SystemExit(f"outputs differ between the two connectors at concurrency {concurrency}")
        for impl in timed_builders:  # the floor is no connector: its memory is not measured
            rss = float("nan") if impl == FLOOR else json.loads(subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--rss", impl, str(concurrency),
                 "--output-tokens", *map(str, args.output_tokens), "--prompt-tokens", *map(str, args.prompt_tokens)],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1])["rss_growth_MiB"]
            rows.append({
                **summarize(impl, concurrency, timings[impl]), **trace_columns(trace_of(args)),
                "requests_in_trace": trace["requests"], "rss_growth_MiB": rss,
            })
        ours, theirs, floor = rows[-3:]
        for row in (ours, theirs, floor):
            row["cpu_ratio_to_vllm"] = row["cpu_median_ms"] / theirs["cpu_median_ms"]
            row["host_only_cpu_ratio_to_vllm"] = row["host_only_cpu_median_ms"] / theirs["cpu_median_ms"]
            row["host_only_cpu_mean_ratio_to_vllm"] = row["host_only_cpu_mean_ms"] / theirs["cpu_mean_ms"]
            row["host_only_cpu_ratio_to_vllm_hook_thread"] = row["host_only_cpu_median_ms"] / theirs["hook_thread_cpu_median_ms"]
            row["wall_ratio_to_vllm"] = row["median_ms"] / theirs["median_ms"]
        print(f"    CPU per step, all four hooks and the connector's threads: ours {ours['cpu_median_ms']:.3f} ms "
              f"({ours['host_only_cpu_median_ms']:.3f} without the row copies), vLLM {theirs['cpu_median_ms']:.3f} ms "
              f"(its writer thread {theirs[f'{BACKGROUND}_cpu_ms']:.3f}) -> ours/vLLM = {ours['cpu_ratio_to_vllm']:.3f} "
              f"(bookkeeping {ours['host_only_cpu_ratio_to_vllm']:.3f}, by means {ours['host_only_cpu_mean_ratio_to_vllm']:.3f}; "
              f"against vLLM's hook thread alone "
              f"{ours['host_only_cpu_ratio_to_vllm_hook_thread']:.3f}); wall {ours['wall_ratio_to_vllm']:.3f}; the output "
              f"contract alone: {floor['cpu_ratio_to_vllm']:.3f}; begin_step ours {ours['begin_step_cpu_ms']:.3f} ms, "
              f"vLLM {theirs['begin_step_cpu_ms']:.3f} ms", flush=True)
    print()
    print_table(rows, list(rows[0]))
    name = f"host_overhead_vllm{VLLM_VERSION}{trace_suffix(**trace_of(args))}.csv"  # one file per vLLM release and trace
    csv_path = save_csv(rows, name, torch.device("cpu"))
    plot(rows, csv_path.with_suffix(".png"))
    print(f"wrote {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
