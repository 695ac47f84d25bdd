#!/usr/bin/env bash
# GPU check for the jax_blink CUDA executor: ONE command, never part of CI, < 5 minutes on one GPU.
#   bash scripts/gpu_check.sh            env: PYTHON (default python3), JAX_BLINK_CUDA_ARCH (default: the
#                                        GPUs' compute capability), CUDACXX (nvcc to use), OUT (log folder)
# Stages (each one's failure is reported; later stages still run):
#   build      cmake: the _cpu and _cuda modules and the blink_gpu_check harness (system nvcc by default:
#              its CUDA major should match the jax CUDA plugin's, e.g. 13 with jax-cuda13-plugin)
#   harness    ffi/tests/gpu_check.cu: the interpreter kernel (one launch per rank and call) on 8 ranks,
#              rank r on GPU r % ndev (on one GPU all 8 share it: real weak memory ordering between the
#              ranks' blocks), all-reduce / broadcast / reduce bitwise against the host, then timed
#              (its algbw: the kernel's GB/s); int32 too; plus a pointer change
#   staging    the same with JAX_BLINK_CUDA_FORCE_STAGING=1 (no peer loads: host-pinned staging)
#   selftest   jax-blink selftest (executor for every dtype, buckets of odd leaves in place and not, shard_map step and a 2-leaf pytree psum with >= 2 GPUs, table)
#   sanitizer  compute-sanitizer memcheck, racecheck, synccheck on a small harness run (if installed)
#   xla        scripts/gpu_xla_check.py: the XLA handler on a 1-device mesh (bitwise, aliased and not),
#              the compiled HLO's async call-start on the annotated stream, launch to completion at
#              4 KiB, device-to-device copy GB/s, whether an independent matmul overlaps the collective
#              (annotation on and off, JAX_BLINK_CUDA_STREAM=0); a jax.profiler trace in $LOGS/profile
#   profile    with nsys: the same run profiled, InterpKernel's stream and time span against the
#              matmul's (the stream annotation seen in a profile); skipped without nsys
#   emulator   the interpreter's host build over every preset / topology file (CPU; CI runs it too)
# The whole run is bounded by GPU_CHECK_BUDGET_S (default 420 s): each stage's timeout is cut to what
# is left, and stages that no longer fit are reported as skipped. Prints one summary table; logs go to $OUT/gpu_check (or build/gpu_check/logs). Exit 0 when all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
BUILD="$ROOT/build/gpu_check"
LOGS="${OUT:+$OUT/gpu_check}"
LOGS="${LOGS:-$BUILD/logs}"
mkdir -p "$BUILD" "$LOGS"
T_START=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET_S:-420}"   # whole script, seconds: stages are cut to what is left
declare -a ROWS=()
FAILED=0

# stage NAME TIMEOUT_S CMD...: runs CMD with a timeout, logs to $LOGS/NAME.log, records a summary row
# (status, seconds, the last "detail" line the command printed: a line starting with "gpu_check:" /
# "gpu program check:" / "jax-blink selftest:", else the last line).
stage() {
  local name="$1" limit="$2"
  shift 2
  local left=$(( BUDGET - ($(date +%s) - T_START) ))
  if (( left < 15 )); then
    skip "$name" "out of the time budget (GPU_CHECK_BUDGET_S=$BUDGET)"
    FAILED=1
    return 1
  fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s) rc
  echo "=== $name: $*" > "$LOGS/$name.log"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >>"$LOGS/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local detail
  detail="$(grep -E '^(gpu_check: (PASS|FAIL)|gpu program check:|jax-blink selftest: (PASSED|FAILED)|=========)' "$LOGS/$name.log" | tail -1)"
  [[ -z "$detail" ]] && detail="$(grep -v '^\s*$' "$LOGS/$name.log" | tail -1)"
  local status=PASS
  if (( rc == 124 || rc == 137 )); then status=TIMEOUT; elif (( rc != 0 )); then status="FAIL($rc)"; fi
  [[ "$status" != PASS ]] && FAILED=1
  ROWS+=("$(printf '%-22s %-9s %5ss  %s' "$name" "$status" "$dt" "${detail:0:150}")")
  tail -n 25 "$LOGS/$name.log"
  return $rc
}

skip() {
  ROWS+=("$(printf '%-22s %-9s %5ss  %s' "$1" SKIP 0 "$2")")
}

# ------------------------------------------------------------------ environment
command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"
[[ -n "${CUDACXX:-}" ]] || CUDACXX="$(command -v nvcc || true)"
{
  echo "python: $(command -v "$PY") $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
  echo "nvcc: ${CUDACXX:-none} $("${CUDACXX:-false}" --version 2>/dev/null | tail -1)"
  "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)' 2>&1
  nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total --format=csv 2>&1
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "no compute-sanitizer"
} | tee "$LOGS/environment.log"
ARCH="${JAX_BLINK_CUDA_ARCH:-}"
if [[ -z "$ARCH" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd';')"
fi
ARCH="${ARCH:-90}"
NDEV="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"

# ------------------------------------------------------------------ build
build() {
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_BLINK_CUDA=ON -DJAX_BLINK_GPU_CHECK=ON \
    -DJAX_BLINK_CUDA_ARCH="$ARCH" -DCMAKE_CUDA_COMPILER="$CUDACXX" \
    -DPython_EXECUTABLE="$(command -v "$PY")" &&
  cmake --build "$BUILD" --target _cpu _cuda blink_gpu_check -j "$(nproc)" &&
  cp "$BUILD"/ffi/_cpu*.so "$BUILD"/ffi/_cuda*.so "$ROOT/jax_blink/_native/" &&
  echo "gpu_check: PASS built _cpu, _cuda and blink_gpu_check for architectures $ARCH"
}
export ROOT PY BUILD ARCH CUDACXX NDEV
export -f build
stage build 240 build
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
HARNESS="$BUILD/ffi/blink_gpu_check"
export HARNESS

# ------------------------------------------------------------------ schedules for the harness
make_schedules() {
  "$PY" - "$BUILD" "${NDEV:-1}" <<'PYEOF'
import sys
from jax_blink.topology.presets import PRESETS
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule
from jax_blink.topology import Topology
out, ndev = sys.argv[1], int(sys.argv[2])
n = 8 if ndev <= 8 else ndev
topo = PRESETS["dgx1v"]() if n == 8 else Topology.host(n)
for coll in ("allreduce", "broadcast", "reduce"):
    root = None if coll == "allreduce" else n - 1
    p = plan(topo, coll, root=root)
    for tag, nelems, chunk in (("big", (64 << 20) // 4 + 3, None), ("small", (1 << 20) // 4 + 5, 8191)):
        s = build_schedule(p, nelems, chunk_elems=chunk)
        s.to_array().tofile(f"{out}/{coll}_{tag}.i64")
    print(f"gpu_check: PASS {coll}: {n} ranks, {len(p.trees)} trees ({p.algorithm})")
PYEOF
}
export -f make_schedules
stage schedules 60 make_schedules

# ------------------------------------------------------------------ harness on the GPU(s)
harness() {
  local ok=0
  for coll in allreduce broadcast reduce; do
    "$HARNESS" "$BUILD/${coll}_big.i64" float32 20 || ok=1
  done
  "$HARNESS" "$BUILD/allreduce_big.i64" int32 5 || ok=1
  "$HARNESS" "$BUILD/allreduce_small.i64" float32 50 || ok=1
  return $ok
}
export -f harness
if [[ -x "$HARNESS" ]]; then stage harness 120 harness; else skip harness "harness not built"; fi
if [[ -x "$HARNESS" ]]; then
  staged() {
    local ok=0
    for coll in allreduce broadcast reduce; do
      JAX_BLINK_CUDA_FORCE_STAGING=1 "$HARNESS" "$BUILD/${coll}_big.i64" float32 5 || ok=1
    done
    return $ok
  }
  export -f staged
  stage staging 90 staged
else
  skip staging "harness not built"
fi

# ------------------------------------------------------------------ self-test (through jax)
stage selftest 150 "$PY" -m jax_blink selftest

# ------------------------------------------------------------------ compute-sanitizer
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if [[ -n "$SAN" && -x "$HARNESS" ]]; then
  for tool in memcheck racecheck synccheck; do
    stage "sanitizer-$tool" 60 "$SAN" --tool "$tool" --error-exitcode 9 "$HARNESS" "$BUILD/allreduce_small.i64" float32 1
  done
  stage "sanitizer-staging" 60 env JAX_BLINK_CUDA_FORCE_STAGING=1 "$SAN" --tool memcheck --error-exitcode 9 \
    "$HARNESS" "$BUILD/reduce_small.i64" float32 1
else
  skip sanitizer "compute-sanitizer not installed or harness not built"
fi

# ------------------------------------------------------------------ inside XLA: 1-device mesh, stream, overlap
stage xla 150 "$PY" "$ROOT/scripts/gpu_xla_check.py" --profile "$LOGS/profile"

# ------------------------------------------------------------------ the stream annotation in a profile (nsys)
NSYS="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)"
profile_overlap() {
  "$NSYS" profile -t cuda -f true -o "$LOGS/overlap" "$PY" "$ROOT/scripts/gpu_xla_check.py" --iters 20 >/dev/null &&
  "$NSYS" stats -q -r cuda_gpu_trace -f csv -o "$LOGS/overlap" "$LOGS/overlap.nsys-rep" >/dev/null &&
  "$PY" - "$LOGS"/overlap_cuda_gpu_trace.csv <<'PYEOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
col = lambda r, key: next(v for k, v in r.items() if k and key in k)
kern = [(int(col(r, "Start")), int(col(r, "Duration")), col(r, "Strm")) for r in rows if "InterpKernel" in col(r, "Name")]
gemm = [(int(col(r, "Start")), int(col(r, "Duration")), col(r, "Strm")) for r in rows
        if any(k in col(r, "Name").lower() for k in ("gemm", "cutlass", "nvjet", "xmma", "sm90"))]
if not kern or not gemm:
    print(f"gpu_check: FAIL profile: {len(kern)} InterpKernel and {len(gemm)} matmul kernels found")
    sys.exit(1)
streams = sorted({s for _, _, s in kern})
both = sum(1 for s0, d0, _ in kern for s1, d1, _ in gemm if s0 < s1 + d1 and s1 < s0 + d0)
print(f"gpu_check: {'PASS' if both else 'FAIL'} profile: InterpKernel on stream(s) {','.join(streams)}, matmuls on "
      f"{','.join(sorted({s for _, _, s in gemm}))}; {both} InterpKernel/matmul pairs overlap in time")
sys.exit(0 if both else 1)
PYEOF
}
export NSYS
export -f profile_overlap
if [[ -n "$NSYS" ]]; then stage profile 150 profile_overlap; else skip profile "nsys not installed (the jax.profiler trace of stage xla is in $LOGS/profile)"; fi

# ------------------------------------------------------------------ emulator (no GPU needed; CI runs it too)
stage emulator 90 "$PY" -m jax_blink.lowering.gpu_program_check --quiet --seeds 8

# ------------------------------------------------------------------ summary
echo
echo "jax_blink gpu_check summary ($(( $(date +%s) - T_START )) s total; logs in $LOGS)"
printf '%-22s %-9s %6s  %s\n' stage status time detail
for r in "${ROWS[@]}"; do echo "$r"; done
grep -h '^gpu_check: PASS .*algbw' "$LOGS"/harness.log "$LOGS"/staging.log 2>/dev/null | sed 's/^/  /'
grep -h -E '^gpu_check: (graph vs op|PASS .*graph pointer change|FAIL .*graph)' "$LOGS"/harness.log "$LOGS"/staging.log 2>/dev/null | sed 's/^/  /'
grep -h '^gpu_check: kernel' "$LOGS"/harness.log 2>/dev/null | head -1 | sed 's/^/  /'
grep -h -E '^gpu_check: (launch to completion|device-to-device|overlap|copies|PASS compiled|FAIL compiled|PASS profile|FAIL profile)' \
  "$LOGS"/xla.log "$LOGS"/profile.log 2>/dev/null | sed 's/^/  /'
# the kernel's best algbw (harness, 8 ranks on the GPU(s)) against the device-to-device copy
"$PY" - "$LOGS/harness.log" "$LOGS/xla.log" <<'PYEOF' 2>/dev/null || true
import re, sys
h, x = (open(f).read() if __import__("os").path.exists(f) else "" for f in sys.argv[1:3])
bw = [float(v) for v in re.findall(r"algbw\D{0,3}([\d.]+)\s*GB/s", h)]
cp = re.search(r"device-to-device copy (\d+) GB/s", x)
if bw and cp:
    print(f"  kernel {max(bw):.0f} GB/s (best harness algbw) vs device-to-device copy {cp.group(1)} GB/s: "
          f"{max(bw) / float(cp.group(1)):.2f}x (target >= 0.85)")
PYEOF
sed -n '/all-reduce, float32/,/^jax-blink selftest: /p' "$LOGS/selftest.log" 2>/dev/null | sed 's/^/  /'
{ echo "stage status time detail"; for r in "${ROWS[@]}"; do echo "$r"; done; } > "$LOGS/summary.txt"
exit $FAILED
