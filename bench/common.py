"""Shared by the benchmarks: where results go, how tables print, how time is measured."""

import csv
import datetime
import functools
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RUNS = Path(__file__).resolve().parent / "out"  # git-ignored; committed results go in bench/results/


def machine_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{os.cpu_count()}core-{platform.machine()}"


def results_dir(device: torch.device) -> Path:
    """``$OUT`` when set (the GPU machine, ``bench/run_*.sh``), else a new git-ignored folder
    ``bench/out/<date>T<time>-<machine>/``: a run never touches committed results."""
    path = Path(os.environ["OUT"]) if os.environ.get("OUT") else _new_run_dir(machine_label(device))
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def _new_run_dir(machine: str) -> Path:
    """One folder per process and machine, named when this process first writes."""
    return RUNS / f"{datetime.datetime.now().strftime('%Y-%m-%dT%H%M%S')}-{machine}"


def save_csv(rows: list[dict], name: str, device: torch.device) -> Path:
    """Write ``rows`` to ``<results dir>/<name>`` and say where."""
    return save_csv_to(rows, name, results_dir(device))


def save_csv_to(rows: list[dict], name: str, folder: Path | None) -> Path:
    """Write ``rows`` to ``folder/name`` (default: this machine's results folder)."""
    if folder is None:
        folder = results_dir(torch.device("cpu"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row[c]).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def time_call_graph(fn) -> float:
    """Median seconds per call replayed from a CUDA graph: GPU time alone, caches warm.

    ``fn`` must be capturable (no host synchronisation)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") / 1e3


def time_call(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds per call: CUDA via triton.testing.do_bench (L2 flushed before each
    call, so launch gaps hide), CPU via perf_counter."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)
