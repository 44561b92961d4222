#!/usr/bin/env bash
# The per-step host cost on the GPU: transfers and launches alone, a decode step's scatter (the
# Triton path vs torch index copies), the connector's decode step profiled, and a mutation check
# that the CUDA tests catch a broken direct launch. One log.
#   device run:  bash bench/run_gpu_step.sh      (after bench/run_gpu.sh, from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-bench/out/$(date +%Y-%m-%dT%H%M%S)-gpu-step}
mkdir -p "$OUT"
site=$(mktemp -d)
cp -r src/routed_experts_cache "$site/"
ln -s "$PWD/connector" "$site/routed_experts_cache/connector"
cp -r kernels "$site/routed_experts_cache/kernels"
log=$OUT/step_host.log
{
  PYTHONPATH=$site timeout 100 python3 bench/bench_step_transfers.py
  PYTHONPATH=$site timeout 90 python3 bench/bench_small_scatter.py  # writes $OUT/small_scatter.csv
  PYTHONPATH=$site timeout 100 python3 bench/profile_device_step.py --requests 16 256 1024 --steps 300 --top 12
  # Mutation: the direct launch covers half the programs. The CUDA kernel tests must fail.
  sed -i 's/kernel.run(grid, 1, 1,/kernel.run(max(1, grid \/\/ 2), 1, 1,/' "$site/routed_experts_cache/kernels/segment_copy.py"
  grep -c "grid // 2" "$site/routed_experts_cache/kernels/segment_copy.py"
  if PYTHONPATH=$site ROUTED_EXPERTS_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_kernels.py -k "directly or matches_twin" 2>&1 | tail -4; then
    echo "MUTATION NOT CAUGHT"
  else
    echo "mutation caught: the CUDA kernel tests fail with a broken direct launch"
  fi
} 2>&1 | tee "$log"
