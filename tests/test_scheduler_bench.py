"""The host-overhead benchmark runs end to end in the vLLM 0.33 and 0.34 environments (small sizes).

It must show vLLM 0.33's own connector crashing on a lookahead-hashing trace that this
project's connector serves (0.34's serves it too), and write both connectors' timings, labelled
with the installed vLLM version, and the output-contract floor's (speed is not asserted here).
"""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

from cpu_harness.vllm_scheduler import CONTRACT, VLLM_VERSION  # first: fails outside vLLM 0.33 and 0.34

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = f"vllm-{VLLM_VERSION}-builtin"


def test_host_benchmark_small_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_host.py"), "--concurrency", "16", "--steps", "12"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "lookahead-1 trace: routed-experts-cache returned every row exactly" in done.stdout
    if CONTRACT.builtin_reads_pending_blocks:
        assert f"lookahead-1 trace: {BUILTIN} returned every row exactly" in done.stdout
    else:
        assert f"lookahead-1 trace: {BUILTIN} crashed: AssertionError" in done.stdout
    with open(tmp_path / f"host_overhead_vllm{VLLM_VERSION}.csv") as f:
        rows = {r["impl"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"routed-experts-cache", BUILTIN, "output-contract floor"}
    hooks = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
    for row in rows.values():
        assert int(row["concurrency"]) == 16 and float(row["median_ms"]) > 0
        assert all(float(row[f"{hook}_cpu_ms"]) >= 0 for hook in hooks)
        assert float(row["host_only_cpu_median_ms"]) <= float(row["cpu_median_ms"])
    assert float(rows[BUILTIN]["cpu_ratio_to_vllm"]) == 1.0
    assert float(rows["routed-experts-cache"]["cpu_ratio_to_vllm"]) > 0
    assert float(rows["output-contract floor"]["cpu_ratio_to_vllm"]) > 0
    assert rows["output-contract floor"]["rss_growth_MiB"] == "nan"  # not measured: not a connector
    # vLLM's connector applies its store updates on a writer thread: its CPU counts too.
    # (the mean: the writer may wake once for several of 12 steps, leaving the median at 0)
    assert float(rows[BUILTIN]["background_threads_cpu_mean_ms"]) > 0
    assert float(rows[BUILTIN]["cpu_median_ms"]) >= float(rows[BUILTIN]["hook_thread_cpu_median_ms"])
    assert float(rows["routed-experts-cache"]["background_threads_cpu_mean_ms"]) == 0  # no thread of its own on CPU
    assert (tmp_path / f"host_overhead_vllm{VLLM_VERSION}.png").stat().st_size > 0


def test_host_ab_benchmark_compares_with_a_revision(tmp_path):
    """bench_host_ab.py against HEAD: the revision's package is imported from git beside this
    checkout's, both replay one trace and return identical rows; a CSV names the revision and
    the trace (here with long prompts: prefill chunks of many blocks)."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_host_ab.py"), "--against", "HEAD", "--concurrency", "16",
         "--steps", "12", "--rounds", "2", "--prompt-tokens", "300", "600"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "identical rows" in done.stdout
    with open(tmp_path / f"host_ab_vllm{VLLM_VERSION}_prompt300-600.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["against"] == "HEAD" and int(row["concurrency"]) == 16 and int(row["step_samples"]) > 0
    assert row["prompt_tokens"] == "300-600" and row["output_tokens"] == "24-96"
    assert float(row["bookkeeping_ratio"]) > 0 and float(row["begin_step_ratio"]) > 0


def test_host_ab_benchmark_times_the_page_pools_alone(tmp_path):
    """``--page-pool``: this checkout's connector replays the trace once with each revision's
    page pool; both pools' calls are timed, each replay's in its own pool's module."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_host_ab.py"), "--against", "HEAD", "--page-pool",
         "--concurrency", "16", "--steps", "12", "--rounds", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "identical rows" in done.stdout
    with open(tmp_path / f"page_pool_ab_vllm{VLLM_VERSION}.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["against"] == "HEAD" and int(row["replays"]) == 1
    assert float(row["page_pool_ms"]) > 0 and float(row["against_page_pool_ms"]) > 0
    assert row["page_pool_module"] == "routed_experts_cache.connector.page_pool"
    assert row["against_page_pool_module"] == "routed_experts_cache_against.connector.page_pool"


def test_steps_are_classified_by_what_their_metadata_starts_and_finishes():
    from types import SimpleNamespace

    from bench.bench_host_steps import step_kinds

    def begin(requests, finished=()):
        return ("begin", SimpleNamespace(requests=dict.fromkeys(requests, 0), finished_requests=tuple(finished)))

    events = [begin(["a", "b"]), ("prepare", 0, None, None), begin(["a", "b"]), begin(["b", "c"], ["a"]),
              begin(["b"], ["c"]), ("begin", None), begin(["c"])]  # "c" again: seen before, not a start
    assert step_kinds(events) == ["starts", "neither", "starts and finishes", "finishes", "neither", "neither"]


def test_host_steps_benchmark_reports_each_kind_for_both_connectors(tmp_path):
    """bench_host_steps.py: one row per connector and kind of step, the same step counts for
    both, every step counted once, and a trace's first step starts requests."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_host_steps.py"), "--concurrency", "16", "--steps", "12",
         "--rounds", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(tmp_path / f"host_steps_16_requests_vllm{VLLM_VERSION}.csv") as f:
        rows = list(csv.DictReader(f))
    counts = {impl: {r["kind"]: int(r["steps"]) for r in rows if r["impl"] == impl} for impl in {r["impl"] for r in rows}}
    assert set(counts) == {"routed-experts-cache", BUILTIN}
    assert counts["routed-experts-cache"] == counts[BUILTIN]
    assert {"starts", "starts and finishes"} & set(counts[BUILTIN]) and sum(counts[BUILTIN].values()) >= 12
    assert all(float(r["bookkeeping_ms"]) > 0 for r in rows)


def test_host_profile_names_where_each_step_goes(tmp_path):
    """profile_host.py writes, per size, self time and calls per step of the connector's and
    the cache's methods: every hook is there, once per step."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "profile_host.py"), "--concurrency", "16", "--steps", "12"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = (tmp_path / f"profile_16_requests_vllm{VLLM_VERSION}.txt").read_text().splitlines()
    calls = {line.split()[0]: float(line.split()[-1]) for line in lines[:-1]}
    for hook in ("begin_step", "prepare_output", "process_output"):
        assert calls[f"CacheWorkerConnector.{hook}"] == 1.0
    assert calls["RoutedExpertsCache.capture_step_small"] > 0 and lines[-1].startswith("total ")  # 16 requests: the small-batch commit


def test_self_time_charges_a_call_to_itself_not_its_caller():
    """A caller that spends its time in a callee gets little of it (thread CPU, not wall)."""
    from bench.profile_host import SelfTime

    timer = SelfTime()

    def busy(seconds):
        started = time.thread_time()
        while time.thread_time() - started < seconds:
            pass

    inner = timer.wrap("inner", busy)
    outer = timer.wrap("outer", lambda: (busy(0.002), inner(0.05), inner(0.05)))
    outer()
    assert timer.calls == {"outer": 1, "inner": 2}
    assert timer.seconds["inner"] >= 0.1 and timer.seconds["outer"] < 0.05


def test_background_threads_count_only_threads_started_after_the_snapshot():
    """The CPU clock of a thread started after the snapshot is read; one that ran before is not."""
    import threading

    from bench.bench_host import BackgroundThreads

    def burn(seconds, done=None):
        started = time.thread_time()
        while time.thread_time() - started < seconds:
            pass
        if done is not None:
            done.wait()

    release = threading.Event()
    earlier = threading.Thread(target=burn, args=(0.0, release))
    earlier.start()
    background = BackgroundThreads(set(threading.enumerate()))
    assert background.cpu_seconds() == 0.0
    later = threading.Thread(target=burn, args=(0.1, release))
    later.start()
    time.sleep(0.01)
    first = background.cpu_seconds()  # found: counted from its start
    while later.is_alive() and background.cpu_seconds() < 0.1:
        time.sleep(0.01)
    assert background.cpu_seconds() >= 0.1 > first - 1e-9
    release.set()
    earlier.join()
    later.join()


def test_host_budget_splits_our_bookkeeping_into_parts_against_the_target(tmp_path):
    """host_budget.py: per size, the target in milliseconds from the built-in's median, each
    part's time and calls per step (three hook calls a step for the connector; the capture
    and the row copies run every step), and a CSV row with the same figures."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_budget.py"), "--concurrency", "16", "--steps", "12", "--rounds", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    from bench.host_budget import COPIES, PARTS

    text = (tmp_path / f"host_budget_vllm{VLLM_VERSION}.txt").read_text()
    assert all(part in text for part in [*PARTS, COPIES]) and "target 0.5" in text
    with open(tmp_path / f"host_budget_vllm{VLLM_VERSION}.csv") as f:
        (row,) = csv.DictReader(f)
    figures = {key: float(value) for key, value in row.items() if key not in ("output_tokens", "prompt_tokens")}
    assert figures["target_ms"] == figures["target_ratio"] * figures["builtin_ms"] and figures["target_ratio"] == 0.5
    assert abs(figures["over_target_ms"] - (figures["ours_bookkeeping_ms"] - figures["target_ms"])) < 1e-9
    assert figures["connector: checks, cursors, commit loop, outputs calls"] == 3.0
    capture = "cache: capture planning (segments, pages, block table)"
    assert figures[f"{capture} calls"] == 1.0 and figures[capture] > 0 and figures[COPIES] > 0
    assert 0 < figures["timer_us_per_call"] < 100 and figures[f"{capture} less timers"] < figures[capture]


def test_part_timers_charge_each_step_its_parts_and_restore_every_method():
    """A step's parts are its own hook calls' (the k-th call of each hook), and the timers
    leave the classes and the copy function as they found them."""
    from bench.host_budget import PARTS, PartTimers, middle_half
    from routed_experts_cache.connector import cache as cache_module
    from routed_experts_cache.connector.cache import RoutedExpertsCache
    from routed_experts_cache.connector.page_pool import PagePool
    from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector

    owners = (CacheWorkerConnector, RoutedExpertsCache, PagePool)
    before = [dict(vars(owner)) for owner in owners], cache_module.copy_segments_torch
    pool_part = next(part for part, (cls, _) in PARTS.items() if cls is PagePool)
    parts = PartTimers()
    with parts:
        assert vars(PagePool)["unpin"] is not before[0][2]["unpin"]
        pool = PagePool(8)
        step_calls = [  # per step, what each hook does: three pool calls, then two
            {"begin_step": lambda: pool.allocate_many(2), "prepare_output": pool.room, "process_output": pool.allocate},
            {"begin_step": pool.room, "prepare_output": lambda: None, "process_output": pool.allocate},
        ]
        for calls in step_calls:
            for hook, body in calls.items():
                parts._kept(hook, body)()
    assert ([dict(vars(owner)) for owner in owners], cache_module.copy_segments_torch) == before
    steps = parts.steps()
    assert [step[f"{pool_part} calls"] for step in steps] == [3, 2] and all(step[pool_part] > 0 for step in steps)
    assert parts.steps() == []  # handed out once
    assert middle_half([5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 0.0, 6.0]) == [3, 2, 4, 0]
