#!/usr/bin/env bash
# Checks the CUDA executor's GPU programs on the CPU (no GPU needed): builds the native modules
# (pip install -e ., or just the _cpu target with BUILD_ONLY_CPU=1 in an existing build tree), then
# runs python -m jax_blink.lowering.gpu_program_check: every preset and tests/data/topologies file,
# every collective, three layouts plus one bucket of odd-sized leaves (some aliased) per plan, race
# checker + stream/event emulator (random timings) + critical path. Ends with:
#   gpu program check: N programs (B bucketed, multi-leaf), R races, M mismatches, worst pipeline ratio X
#   scripts/gpu_sim_check.sh [--seeds N] [--quiet]    env: PYTHON (default python3), SKIP_BUILD=1
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . >&2
fi
exec "$PY" -m jax_blink.lowering.gpu_program_check "$@"
