#!/usr/bin/env bash
# Checks the CUDA executor's device interpreter on the CPU (no GPU needed): builds the native modules
# (pip install -e .), then runs python -m jax_blink.lowering.gpu_program_check: the interpreter's host
# build (a thread per rank block, acquire/release flags) on every preset and tests/data/topologies file,
# every collective, dtypes rotating, three peer layouts plus one bucket of odd-sized leaves (some
# aliased) and one never-arriving rank per plan, random delays, two calls per run; the pipeline ratio
# per block cap; and a ThreadSanitizer build of ffi/tests/interp_stress.cc (system g++). Ends with:
#   gpu program check: N programs, R races, M mismatches, worst pipeline ratio X.XX (caps 1, 8, unlimited), host calls per collective <= K per device
#   scripts/gpu_sim_check.sh [--seeds N] [--quiet] [--no-tsan]    env: PYTHON (default python3), SKIP_BUILD=1
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . >&2
fi
exec "$PY" -m jax_blink.lowering.gpu_program_check "$@"
