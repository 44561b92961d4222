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
# The package as setup.py lays it out, linked from this checkout (no install: the GPU machine has
# no internet, and its pip wants build isolation, which downloads setuptools, for an editable install).
site=$(mktemp -d)
cp -r src/routed_experts_cache "$site/"
ln -s "$PWD/kernels" "$site/routed_experts_cache/kernels"
ln -s "$PWD/connector" "$site/routed_experts_cache/connector"
export PYTHONPATH=$site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log_dir/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log_dir/gpu.txt"
status=0
ROUTED_EXPERTS_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels.py tests/test_cache.py tests/test_cache_stateful.py 2>&1 | tee "$log_dir/pytest_cuda.log" || status=1
timeout 150 python3 bench/gpu_check.py 2>&1 | tee "$log_dir/gpu_check.log" || status=1
timeout 200 python3 bench/bench_kernels.py --device cuda --sweep 2>&1 | tee "$log_dir/kernels.log" || status=1
exit $status
