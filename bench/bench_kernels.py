"""Gather / scatter throughput of the segment-copy kernel against torch and a device copy.

    python bench/bench_kernels.py [--device cuda|cpu] [--quick] [--sweep]

Workloads (page size 16): decode (256 intervals of 1-4 rows), prefill (8 x 4096 rows), bulk
(2**20 rows) and a size sweep for the plot; row shapes (48, 8) uint8 (Qwen3-30B-A3B), (61, 8)
uint8 (DeepSeek-V3), (60, 8) uint16 (Kimi-K2-like, > 256 experts). Latency of small calls is
also timed from a CUDA graph (``us_graph``: GPU time alone, warm caches; ``us`` comes from
``do_bench``, which flushes L2 before every call). Baselines: torch advanced indexing with a
precomputed per-row index, the torch twin (the same copy from the same segment descriptor, as
the cache's torch backend runs it) on CUDA, and a contiguous device copy of the same bytes.
Bandwidth counts bytes read + written. On CUDA "ours" is the Triton kernel; on CPU it is the
torch twin (the CPU path) and every row is labelled so.
``--sweep`` (CUDA) also times the kernel over words per loop iteration and warps for the decode
and bulk gathers, to choose the compiled tile (``kernels_sweep.csv``).
"""

import argparse
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_label, print_table, save_csv, time_call, time_call_graph  # noqa: E402
from routed_experts_cache.kernels import as_row_words, copy_segments_torch, load_triton_copy  # noqa: E402
from routed_experts_cache.kernels.rows import tile_shape  # noqa: E402

PAGE = 16
ROW_SPECS = {"qwen3-30b-a3b": ((48, 8), torch.uint8), "deepseek-v3": ((61, 8), torch.uint8), "kimi-k2": ((60, 8), torch.uint16)}


def intervals_for(workload: str, generator: torch.Generator) -> list[int]:
    if workload == "decode":
        return torch.randint(1, 5, (256,), generator=generator).tolist()
    if workload == "prefill":
        return [4096] * 8
    if workload.startswith("rows-"):
        total = int(workload[5:])
        return [min(4096, total)] * max(1, total // 4096)
    raise ValueError(workload)


def build_descriptors(lengths: list[int], generator: torch.Generator, device):
    """Each interval starts at a random offset in its own randomly placed pages."""
    starts = torch.randint(0, PAGE, (len(lengths),), generator=generator).tolist()
    num_pages = sum((s + n + PAGE - 1) // PAGE for s, n in zip(starts, lengths)) + 8
    page_order = torch.randperm(num_pages, generator=generator).tolist()
    seg_start, seg_pool_row, row_index, next_page = [0], [], [], 0
    for start, length in zip(starts, lengths):
        position, end = start, start + length
        while position < end:
            page = page_order[next_page + position // PAGE]
            run = min(end, (position // PAGE + 1) * PAGE) - position
            seg_pool_row.append(page * PAGE + position % PAGE)
            seg_start.append(seg_start[-1] + run)
            row_index.extend(range(seg_pool_row[-1], seg_pool_row[-1] + run))
            position += run
        next_page += (end + PAGE - 1) // PAGE
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return num_pages, as_tensor(seg_start), as_tensor(seg_pool_row), torch.tensor(row_index, device=device), seg_start[-1]


def run(device: torch.device, quick: bool) -> list[dict]:
    ours = load_triton_copy() if device.type == "cuda" else copy_segments_torch
    ours_label = "triton" if device.type == "cuda" else "torch-twin (cpu path)"
    generator = torch.Generator().manual_seed(0)
    sweep = [2**k for k in (8, 12, 16, 20)] if not quick else [2**8, 2**14]
    workloads = ["decode", "prefill"] + [f"rows-{n}" for n in sweep]
    results = []
    for spec_name, (row_shape, dtype) in ROW_SPECS.items():
        for workload in workloads:
            lengths = intervals_for(workload, generator)
            num_pages, seg_start, seg_pool_row, row_index, total = build_descriptors(lengths, generator, device)
            pool = torch.randint(0, 250, (num_pages * PAGE, *row_shape), dtype=torch.int32, device=device).to(dtype)
            pool_flat = pool.view(pool.shape[0], -1)
            pool_words, packed = as_row_words(pool), torch.empty((total, *row_shape), dtype=dtype, device=device)
            packed_words, packed_flat = as_row_words(packed), packed.view(total, -1)
            row_bytes = pool_flat.shape[1] * pool.element_size()
            moved = 2 * total * row_bytes
            index_view = pool_flat.view(torch.uint8) if dtype == torch.uint16 else pool_flat
            packed_index_view = packed_flat.view(torch.uint8) if dtype == torch.uint16 else packed_flat
            source_copy = torch.empty_like(packed)
            candidates = {
                ("gather", ours_label): lambda: ours(pool_words, packed_words, seg_start, seg_pool_row, seg_start[:-1], total),
                ("gather", "torch-indexing"): lambda: torch.index_select(index_view, 0, row_index, out=packed_index_view),
                ("scatter", ours_label): lambda: ours(packed_words, pool_words, seg_start, seg_start[:-1], seg_pool_row, total),
                ("scatter", "torch-indexing"): lambda: index_view.index_copy_(0, row_index, packed_index_view),
                ("copy", "device-copy"): lambda: packed.copy_(source_copy),
            }
            if device.type == "cuda":
                candidates[("gather", "torch-twin")] = lambda: copy_segments_torch(
                    pool_words, packed_words, seg_start, seg_pool_row, seg_start[:-1], total
                )
            # The kernel must be right before it is timed.
            candidates[("gather", ours_label)]()
            if not torch.equal(packed_index_view, index_view[row_index]):
                raise RuntimeError(f"gather result wrong for {spec_name} {workload}")
            for (op, impl), fn in candidates.items():
                seconds = time_call(fn, device, repeats=5 if total >= 2**20 else 20)
                # Small calls again from a CUDA graph: GPU time alone. Only calls known to be
                # capturable (the twin synchronises; a failed capture could upset later timings).
                graph = device.type == "cuda" and total < 2**16 and (
                    impl == ours_label or op in ("copy", "gather") and impl != "torch-twin"
                )
                results.append({
                    "device": machine_label(device), "rows": spec_name, "row_bytes": row_bytes, "workload": workload,
                    "op": op, "impl": impl, "total_rows": total, "intervals": len(lengths),
                    "segments": int(seg_pool_row.shape[0]), "bytes_moved": moved, "us": seconds * 1e6,
                    "GBps": moved / seconds / 1e9, "us_graph": time_call_graph(fn) * 1e6 if graph else float("nan"),
                })
            print(f"  {spec_name:14s} {workload:12s} rows={total}", flush=True)
    return results


def sweep_tiles(device: torch.device, workloads=("decode", "prefill", f"rows-{2**20}")) -> list[dict]:
    """Time the compiled gather over words per loop iteration x warps (Qwen3 rows)."""
    from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel

    generator = torch.Generator().manual_seed(1)
    results = []
    row_shape, dtype = ROW_SPECS["qwen3-30b-a3b"]
    for workload in workloads:
        lengths = intervals_for(workload, generator)
        num_pages, seg_start, seg_pool_row, _, total = build_descriptors(lengths, generator, device)
        pool = torch.randint(0, 250, (num_pages * PAGE, *row_shape), dtype=torch.int32, device=device).to(dtype)
        pool_words = as_row_words(pool)
        packed = torch.empty((total, pool_words.shape[1]), dtype=pool_words.dtype, device=device)
        expected = torch.empty_like(packed)
        copy_segments_torch(pool_words, expected, seg_start, seg_pool_row, seg_start[:-1], total)
        num_segments = seg_pool_row.shape[0]
        _, default_block = tile_shape(num_segments, pool_words.shape[1])
        for block_words in (512, 1024, 2048, 4096):
            for num_warps in (1, 2, 4, 8):
                def launch():
                    _segment_copy_kernel[(num_segments,)](
                        pool_words, packed, seg_start, seg_pool_row, seg_start[:-1], num_segments,
                        ROW_WORDS=pool_words.shape[1], SEGMENTS=1, BLOCK_WORDS=block_words,
                        num_warps=num_warps, num_stages=1,
                    )

                packed.zero_()
                launch()
                if not torch.equal(packed, expected):
                    raise RuntimeError(f"sweep gather wrong: {workload} block {block_words} warps {num_warps}")
                seconds = time_call(launch, device)
                results.append({
                    "device": machine_label(device), "workload": workload, "total_rows": total,
                    "block_words": block_words, "num_warps": num_warps,
                    "default_tile": block_words == default_block and num_warps == 4,
                    "us": seconds * 1e6, "GBps": 2 * total * pool_words.shape[1] * 4 / seconds / 1e9,
                })
        print(f"  sweep {workload} rows={total}", flush=True)
    return results


def peak_copy_bandwidth(device: torch.device) -> float:
    nbytes = 2**30 if device.type == "cuda" else 2**28
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * nbytes / time_call(lambda: target.copy_(source), device, repeats=5) / 1e9


def plot(results: list[dict], peak: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("gather", "scatter")):
        for impl in sorted({r["impl"] for r in results if r["op"] in (op, "copy")}):
            for spec in ROW_SPECS:
                points = sorted(
                    (r["bytes_moved"], r["GBps"]) for r in results
                    if r["impl"] == impl and r["rows"] == spec and r["op"] in (op, "copy") and r["workload"].startswith("rows-")
                )
                if points:
                    ax.plot(*zip(*points), marker="o", label=f"{impl} {spec}")
        ax.axhline(peak, color="black", linestyle="--", label=f"peak device copy {peak:.0f} GB/s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes read + written")
        ax.set_title(f"{op} ({results[0]['device']})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the compiled tile (CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"kernel benchmark on {machine_label(device)}", flush=True)
    results = run(device, args.quick)
    # The best device copy seen, a large one or any measured point (small copies that fit a
    # cache run faster than a large one): the line never sits below a measured copy.
    peak = max([peak_copy_bandwidth(device)] + [r["GBps"] for r in results if r["op"] == "copy"])
    for row in results:
        row["frac_of_peak_copy"] = row["GBps"] / peak
    print(f"\npeak device copy: {peak:.1f} GB/s (read + written)")
    print_table(
        [r for r in results if not r["workload"].startswith("rows-") or r["total_rows"] >= 2**20],
        ["rows", "workload", "op", "impl", "total_rows", "us", "us_graph", "GBps", "frac_of_peak_copy"],
    )
    csv_path = save_csv(results, "kernels.csv", device)
    plot(results, peak, csv_path.with_suffix(".png"))
    print(f"wrote {csv_path.with_suffix('.png')}")
    if args.sweep and device.type == "cuda":
        sweep = sweep_tiles(device)
        for workload in dict.fromkeys(r["workload"] for r in sweep):
            rows = [r for r in sweep if r["workload"] == workload]
            best, default = min(rows, key=lambda r: r["us"]), next(r for r in rows if r["default_tile"])
            print(f"sweep {workload}: best {best['block_words']} words x {best['num_warps']} warps "
                  f"{best['us']:.2f} us; default {default['us']:.2f} us")
        save_csv(sweep, "kernels_sweep.csv", device)


if __name__ == "__main__":
    main()
