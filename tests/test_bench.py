"""The CPU benchmarks run end to end (small sizes) and write what the README says they write.

Speed is not asserted here (targets live in bench/); these keep the benchmark commands from
rotting: a broken script fails CI instead of the next measurement session.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_check import differential_workload

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, out: Path, *args: str) -> str:
    env = dict(os.environ, OUT=str(out))
    env.pop("TRITON_INTERPRET", None)  # the benchmarks choose their own path
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_kernel_benchmark_quick_run_writes_csv_and_plot(tmp_path):
    run_bench("bench_kernels.py", tmp_path, "--device", "cpu", "--quick")
    rows = read_csv(tmp_path / "kernels.csv")
    assert (tmp_path / "kernels.png").stat().st_size > 0
    specs = {r["rows"] for r in rows}
    assert specs == {"qwen3-30b-a3b", "deepseek-v3", "kimi-k2"}
    workloads = {r["workload"] for r in rows}
    assert {"decode", "prefill"} <= workloads
    impls = {(r["op"], r["impl"]) for r in rows}
    assert {("gather", "torch-twin (cpu path)"), ("gather", "torch-indexing"), ("copy", "device-copy")} <= impls
    for row in rows:
        assert float(row["us"]) > 0 and float(row["GBps"]) > 0 and 0 < float(row["frac_of_peak_copy"])
        assert int(row["bytes_moved"]) == 2 * int(row["total_rows"]) * int(row["row_bytes"])
    # The plot's "peak device copy" line never sits below a measured device copy.
    assert max(float(r["frac_of_peak_copy"]) for r in rows if r["op"] == "copy") <= 1.0


def test_memory_benchmark_sizes_every_model(tmp_path):
    run_bench("bench_memory.py", tmp_path)
    rows = {r["model"]: r for r in read_csv(tmp_path / "memory.csv")}
    # layers x top-k ids of one byte (<= 256 experts) or two
    assert {m: int(r["bytes_per_token"]) for m, r in rows.items()} == {
        "Qwen3-30B-A3B": 48 * 8, "DeepSeek-V3": 61 * 8, "Kimi-K2": 61 * 8 * 2,
    }
    for row in rows.values():
        assert float(row["this_cache_device_MiB"]) >= int(row["kv_tokens"]) * int(row["bytes_per_token"]) / 2**20


def test_end_to_end_benchmark_runs_all_three_modes(tmp_path):
    run_bench("bench_e2e.py", tmp_path, "--requests", "4", "--repeats", "1")
    rows = {r["mode"]: r for r in read_csv(tmp_path / "e2e_throughput.csv")}
    assert {mode: rows[mode]["connector"] for mode in rows} == {
        "routed experts off": "-",
        "vLLM built-in": "AuxOutputWorkerConnector",
        "routed-experts-cache": "CacheWorkerConnector",
    }
    assert len({int(r["output_tokens"]) for r in rows.values()}) == 1  # the same greedy workload
    assert float(rows["routed experts off"]["vs_off"]) == 1.0


def test_gpu_check_differential_workload_runs_here():
    """bench/gpu_check.py's workload, with the Triton kernel under the interpreter on CPU
    (its CUDA-only parts run on the GPU machine alone): the script itself cannot rot."""
    assert differential_workload("cpu", steps=1500) > 100  # reads compared, all equal
