#!/usr/bin/env bash
# GPU check for the jax_blink CUDA executor (never part of CI). On a machine with an NVIDIA GPU:
# builds the CUDA module and the gpu_check harness, runs the executor for N ranks whose buffers all
# live on GPU 0, checks the results bitwise against a host execution of the schedule, and prints the
# reduction kernel's GB/s beside a device-to-device copy's GB/s. Takes well under 5 minutes.
#   scripts/gpu_check.sh [NRANKS=8]     env: PYTHON (default python3), CUDA_ARCH (default: native GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-8}"
PY="${PYTHON:-python3}"
BUILD="build/gpu_check"
command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null 2>&1 || { echo "gpu_check: nvcc not found (install the CUDA toolkit)" >&2; exit 2; }
ARCH="${CUDA_ARCH:-}"
if [[ -z "$ARCH" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')" || true
fi
ARCH="${ARCH:-90}"
cmake -S . -B "$BUILD" -G Ninja -DJAX_BLINK_CUDA=ON -DJAX_BLINK_GPU_CHECK=ON -DJAX_BLINK_CUDA_ARCH="$ARCH" \
  -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build "$BUILD" --target _cuda blink_gpu_check
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: built the CUDA module and harness, but no NVIDIA GPU is visible (nvidia-smi -L failed);" \
       "run this script on a machine with an NVIDIA GPU" >&2
  exit 3
fi
nvidia-smi -L
# A real jax_blink schedule for N ranks on a host-like topology, else the harness's built-in tree.
SCHED="$BUILD/schedule_${N}.i64"
if PYTHONPATH=. "$PY" - "$N" "$SCHED" <<'PYEOF' 2>/dev/null; then
import sys
from jax_blink.topology import Topology
from jax_blink.packing import plan
from jax_blink.schedule import build_schedule
n, path = int(sys.argv[1]), sys.argv[2]
p = plan(Topology.host(n), "allreduce")
build_schedule(p, (64 << 20) // 4, chunk_elems=(1 << 20)).to_array().tofile(path)
PYEOF
  echo "gpu_check: schedule from jax_blink.packing (Topology.host($N))"
else
  echo "gpu_check: jax_blink planner not importable here; using the harness's built-in binary tree"
  SCHED="-"
fi
"$BUILD/ffi/blink_gpu_check" "$SCHED" "$N"
