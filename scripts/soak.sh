#!/usr/bin/env bash
# Random runs of the state machines that compare the cache and the vLLM connector with their
# models: the test command runs each deterministically (the same examples every time); this
# draws new ones, SCALE times as many (ROUTED_EXPERTS_SOAK, tests/conftest.py), so every run
# looks somewhere new. A failure prints the shrunk steps and the @reproduce_failure line that
# replays them. Torch backend only (the Triton backend differs in its copies, not in the logic;
# the interpreter runs a launch's segments together, a GPU at once: see the in_order / reversed runs).
#   bash scripts/soak.sh [SCALE]     SCALE: a positive number, default 5 (SCALE 6 took 6.5 minutes on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
scale=${1:-5}
if [[ $# -gt 1 || ! "$scale" =~ ^[0-9]+([.][0-9]+)?$ || "$scale" =~ ^0+([.]0+)?$ ]]; then
  echo "usage: bash scripts/soak.sh [SCALE]   (SCALE: a positive number of times the examples; got '$*')" >&2
  exit 2
fi
scripts/setup_envs.sh all || { echo "[soak] environment setup failed" >&2; exit 1; }
export ROUTED_EXPERTS_SOAK=$scale OMP_NUM_THREADS=1
status=0
soak() {  # soak VENV TEST-FILES...
  local venv=$1; shift
  echo "[soak] $venv: $* (x$scale examples, random${ROUTED_EXPERTS_SEGMENT_ORDER:+, segments one at a time $ROUTED_EXPERTS_SEGMENT_ORDER})"
  "$venv/bin/python" -m pytest -q -k "not triton" "$@" || { echo "[soak] FAILED: $venv $*" >&2; status=1; }
}
soak .venv tests/test_cache_stateful.py tests/test_host_tier_stateful.py
# Then with every copy's segments one at a time, in order and reversed: on a GPU a launch's
# programs run at once, so a segment that writes rows another one reads must never share a launch.
for order in in_order reversed; do
  ROUTED_EXPERTS_SEGMENT_ORDER=$order soak .venv tests/test_cache_stateful.py tests/test_host_tier_stateful.py
done
soak .venv-vllm033 tests/test_scheduler_connector_stateful.py
soak .venv-vllm034 tests/test_scheduler_connector_stateful.py
# The connector's machine too, its copies one segment at a time (one release: the copies do not
# depend on it).
ROUTED_EXPERTS_SEGMENT_ORDER=reversed soak .venv-vllm034 tests/test_scheduler_connector_stateful.py
if [[ $status -eq 0 ]]; then echo "[soak] passed ($SECONDS s)"; else echo "[soak] FAILED ($SECONDS s)" >&2; fi
exit $status
