"""The host-overhead benchmark runs end to end in the vLLM 0.33 and 0.34 environments (small sizes).

It must show vLLM 0.33's own connector crashing on a lookahead-hashing trace that this
project's connector serves (0.34's serves it too), and write both connectors' timings, labelled
with the installed vLLM version, and the output-contract floor's (speed is not asserted here).
"""

import csv
import os
import subprocess
import sys
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
    assert (tmp_path / f"host_overhead_vllm{VLLM_VERSION}.png").stat().st_size > 0


def test_host_ab_benchmark_compares_with_a_revision(tmp_path):
    """bench_host_ab.py against HEAD: the revision's package is imported from git beside this
    checkout's, both replay one trace and return identical rows; a CSV names the revision."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_host_ab.py"), "--against", "HEAD", "--concurrency", "16",
         "--steps", "12", "--rounds", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "identical rows" in done.stdout
    with open(tmp_path / f"host_ab_vllm{VLLM_VERSION}.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["against"] == "HEAD" and int(row["concurrency"]) == 16 and int(row["step_samples"]) > 0
    assert float(row["bookkeeping_ratio"]) > 0 and float(row["begin_step_ratio"]) > 0
