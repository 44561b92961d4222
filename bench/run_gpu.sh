#!/usr/bin/env bash
# Every GPU check and benchmark in one run (a few minutes on the H200; torch 2.11, triton 3.6,
# pytest and hypothesis, no vLLM, no internet): the core test suites on CUDA with compiled
# kernels, the differential check against the CPU path, the kernel benchmark and tile sweep.
# Writes logs, CSV and PNG into $OUT (default bench/out/<date>T<time>-<gpu>/, git-ignored).
#   device run:  bash bench/run_gpu.sh        (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# $OUT on the device machine; elsewhere a dated folder, for logs and results alike.
export OUT=${OUT:-bench/out/$(date +%Y-%m-%dT%H%M%S)-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')}
log_dir=$OUT
mkdir -p "$log_dir"
# At most 8 files come back from the device machine: the install log only when it failed.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$log_dir/install.log" 2>&1 \
  || { cat "$log_dir/install.log"; exit 1; }
rm "$log_dir/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log_dir/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log_dir/gpu.txt"
status=0
ROUTED_EXPERTS_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels.py tests/test_cache.py tests/test_cache_stateful.py 2>&1 | tee "$log_dir/pytest_cuda.log" || status=1
timeout 120 python3 bench/gpu_check.py 2>&1 | tee "$log_dir/gpu_check.log" || status=1
timeout 200 python3 bench/bench_kernels.py --device cuda --sweep 2>&1 | tee "$log_dir/kernels.log" || status=1
exit $status
