"""Static figures of the segment-copy kernel on NVIDIA GPUs, compiled ahead of time on any machine.

    python bench/kernel_static.py [--arch 80 90] [--page-size 16] [--out DIR]

Compiles every variant the pool precompiles (one per row width) for each architecture with
triton's bundled ptxas (no GPU or CUDA driver needed) and writes ``kernel_static.csv``: row
width, registers, spills, shared memory, the widths of the global loads and stores in the
SASS, and SASS warp-instructions per copied row. Exits non-zero on a compile error or a spill.

Instructions per copied row are counted for a full page (``--page-size`` rows in one
segment, a prefill's or a long decode's common case): ``warps * (instructions outside the copy
loop + iterations * instructions in the loop) / page_size``. Instructions outside the loop are
all counted, including branches not taken, so the figure is an upper bound.
"""

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real compiles: set before triton is imported, it replaces the kernel

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, save_csv_to  # noqa: E402
from routed_experts_cache.kernels.rows import tile_shape  # noqa: E402
from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel  # noqa: E402

NUM_WARPS = 4
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# Row widths in bytes: Qwen3-30B-A3B (48 layers x top-8, uint8), DeepSeek-V3 (61 x 8, uint8),
# DeepSeek-V3 with a uint16 pool (more than 256 experts), and odd small rows (byte and half words).
ROW_BYTES = {
    "qwen3-30b-a3b 48x8 uint8": 384,
    "deepseek-v3 61x8 uint8": 488,
    "deepseek-v3 61x8 uint16": 976,
    "tiny 3x1 uint8": 3,
    "tiny 3x1 uint16": 6,
}


def word_layout(row_bytes: int) -> tuple[str, int]:
    """(Triton word type, words per row): the word view ``as_row_words`` picks."""
    for name, size in (("i32", 4), ("i16", 2)):
        if row_bytes % size == 0:
            return name, row_bytes // size
    return "i8", row_bytes


def compile_variant(row_bytes: int, arch: int):
    """Compile the variant a launch on this row width would use."""
    word, row_words = word_layout(row_bytes)
    segments, block_words = tile_shape(1, row_words)
    signature = {
        "source_ptr": f"*{word}", "target_ptr": f"*{word}", "seg_start_ptr": "*i32",
        "seg_source_row_ptr": "*i32", "seg_target_row_ptr": "*i32", "num_segments": "i32",
        "ROW_WORDS": "constexpr", "SEGMENTS": "constexpr", "BLOCK_WORDS": "constexpr",
    }
    constexprs = {"ROW_WORDS": row_words, "SEGMENTS": segments, "BLOCK_WORDS": block_words}
    # As a launch specializes: the pool and the packed output are 16-byte aligned tensors;
    # descriptor pointers and the segment count are not specialized (do_not_specialize).
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    source = triton.compiler.ASTSource(fn=_segment_copy_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS, "num_stages": 1})
    return compiled, row_words, block_words


def ptxas_resources(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and shared memory as ptxas reports them (-v)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        log = subprocess.run(
            [str(TOOLS / "ptxas"), f"-arch={arch_name}", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": registers, "spill_bytes": int(spills.group(1)) + int(spills.group(2))}


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) pairs from cuobjdump's SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    lines = []
    for match in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        text = re.sub(r"^@!?U?P\w+\s+", "", match.group(2).strip())
        if not text.startswith("NOP"):
            lines.append((int(match.group(1), 16), text))
    return lines


def count_instructions(lines: list[tuple[int, str]]) -> tuple[int, int]:
    """(instructions outside loops, instructions inside the copy loop).

    A loop is a backward branch; the final ``BRA`` to itself after ``EXIT`` is padding.
    """
    loops = []
    for address, text in lines:
        target = re.match(r"BRA\s+`?\(?\.?L?_?x?_?(?:0x)?([0-9a-f]+)", text)
        if text.startswith("BRA") and target:
            destination = int(target.group(1), 16)
            if destination < address:
                loops.append((destination, address))
            elif destination == address:
                continue
    body = {a for a, _ in lines for start, end in loops if start <= a <= end}
    last_exit = max(a for a, text in lines if text.startswith("EXIT"))
    padding = {a for a, text in lines if a > last_exit and text.startswith("BRA")}
    outside = sum(1 for a, _ in lines if a not in body and a not in padding)
    return outside, len(body)


def access_widths(lines: list[tuple[int, str]], op: str) -> str:
    """Widths in bits of the global loads (``LDG``) or stores (``STG``), most frequent first."""
    widths = Counter()
    for _, text in lines:
        match = re.match(rf"{op}\.E(?:\.([A-Z0-9.]+))?\s", text)
        if match:
            suffix = match.group(1) or ""
            width = re.search(r"(?:^|\.)(128|64|U16|S16|U8|S8)(?:\.|$)", suffix)
            widths[{"U16": "16", "S16": "16", "U8": "8", "S8": "8"}.get(width.group(1), width.group(1)) if width else "32"] += 1
    return " ".join(f"{w}b x{n}" for w, n in widths.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default 80 90)")
    parser.add_argument("--page-size", type=int, default=16, help="rows per page (vLLM's block size)")
    parser.add_argument("--out", type=Path, help="results folder (default: a new git-ignored bench/out/ folder)")
    args = parser.parse_args()
    rows, failures = [], []
    for arch in args.arch:
        for name, row_bytes in ROW_BYTES.items():
            try:
                compiled, row_words, block_words = compile_variant(row_bytes, arch)
            except Exception as error:  # any compile failure fails the run, after the others are tried
                failures.append(f"sm_{arch} {name}: compile error: {error!r}")
                continue
            resources = ptxas_resources(compiled.asm["ptx"], arch)
            lines = sass_lines(compiled.asm["cubin"])
            outside, loop = count_instructions(lines)
            iterations = math.ceil(args.page_size * row_words / block_words)
            per_row = NUM_WARPS * (outside + iterations * loop) / args.page_size
            rows.append({
                "arch": f"sm_{arch}", "rows": name, "row_bytes": row_bytes, "row_words": row_words,
                "block_words": block_words, "registers": resources["registers"],
                "spill_bytes": resources["spill_bytes"], "shared_bytes": compiled.metadata.shared,
                "loads": access_widths(lines, "LDG"), "stores": access_widths(lines, "STG"),
                "sass_outside_loop": outside, "sass_in_loop": loop, "loop_iterations_per_page": iterations,
                "sass_warp_instr_per_row": round(per_row, 1),
            })
            if resources["spill_bytes"]:
                failures.append(f"sm_{arch} {name}: {resources['spill_bytes']} bytes of register spills")
    if rows:
        print_table(rows, list(rows[0]))
        save_csv_to(rows, "kernel_static.csv", args.out)
    print(f"triton {triton.__version__}, {NUM_WARPS} warps, page size {args.page_size}")
    if failures:
        raise SystemExit("kernel_static: " + "; ".join(failures))


if __name__ == "__main__":
    main()
