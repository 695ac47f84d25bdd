#!/usr/bin/env bash
# Build the CUDA module for the GPUs and drivers users have: CUDA 11.8 (Debian bookworm's non-free
# nvidia-cuda-toolkit, host compiler g++-11) gives cubins for sm_70 (V100) through sm_90 (H100/H200)
# and a static CUDA 11.8 runtime that runs on R450+ drivers (minor-version compatibility), where
# nvcc 13 has no sm_70 and its runtime needs R580+ (docs/cuda.md).
#
#   bash scripts/build_cuda118.sh            # toolkit (cached) + build + cubin check
#   bash scripts/build_cuda118.sh --toolkit  # only lay out the toolkit, print its nvcc
#
# .ci/run runs it once per CI run (x86_64): 827 MB of .deb (12 s here), the layout (65 s) and the
# module's compile (1-2 min on 2 cores), then the cubin list and an import of the module.
# Nothing of the toolkit is committed: it lives in $JAX_BLINK_CUDA118_DIR
# (default ~/.cache/jax_blink/cuda118). The package lists are fetched into that folder too; the
# system's apt sources are left as they are. Needs root for `apt-get install g++-11` when g++-11 is
# missing. Environment: PYTHON (default: python3 on PATH, with jaxlib and nanobind installed),
# BUILD_DIR (default build/cuda118), CMAKE_BUILD_PARALLEL_LEVEL (default 1).
set -euo pipefail

ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${JAX_BLINK_CUDA118_DIR:-$HOME/.cache/jax_blink/cuda118}
TK=$CACHE/toolkit           # a standard CUDA layout: bin/ nvvm/ include/ lib64/
PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-$ROOT_DIR/build/cuda118}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
NEED_ARCHS="sm_70 sm_80 sm_90"

say() { printf '%s\n' "build_cuda118: $*" >&2; }
die() { say "error: $*"; exit 1; }

toolkit() {
  if [[ -x $TK/bin/nvcc && -f $TK/lib64/libcudart_static.a ]]; then
    return
  fi
  command -v apt-get >/dev/null || die "apt-get not found: this script needs Debian bookworm (or lay out a CUDA 11.8 toolkit yourself and pass CUDACXX)"
  mkdir -p "$CACHE/lists/partial" "$CACHE/cache/archives/partial" "$CACHE/debs"
  echo "deb http://deb.debian.org/debian bookworm main contrib non-free" > "$CACHE/sources.list"
  local o=(-o "Dir::Etc::SourceList=$CACHE/sources.list" -o Dir::Etc::SourceParts=/dev/null
           -o "Dir::State::Lists=$CACHE/lists" -o "Dir::Cache=$CACHE/cache")
  local t0=$SECONDS pkgs=(nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 libcudart11.0 libcu++-dev) p
  for p in "${pkgs[@]}"; do
    if ! compgen -G "$CACHE/debs/${p}_*.deb" >/dev/null; then
      apt-get "${o[@]}" -qq update
      (cd "$CACHE/debs" && apt-get "${o[@]}" -qq download "${pkgs[@]}" 2>/dev/null)
      say "downloaded $(du -sh "$CACHE/debs" | cut -f1) of .deb in $((SECONDS - t0)) s"
      break
    fi
  done
  if ! command -v g++-11 >/dev/null; then
    local as_root=""; [[ $(id -u) == 0 ]] || as_root=sudo
    $as_root apt-get -qq update && $as_root apt-get install -y -qq g++-11 >/dev/null
  fi
  t0=$SECONDS
  local x=$CACHE/x
  rm -rf "$x" "$TK" && mkdir -p "$x" "$TK"/{bin,nvvm/bin,nvvm/lib64,lib64/stubs}
  dpkg-deb -x "$CACHE"/debs/nvidia-cuda-toolkit_*.deb "$x"
  dpkg-deb -x "$CACHE"/debs/libnvvm4_*.deb "$x"
  dpkg-deb -x "$CACHE"/debs/libcudart11.0_*.deb "$x"
  dpkg-deb -x "$CACHE"/debs/libcu++-dev_*.deb "$x"   # <cuda/atomic> (libcu++ 1.8), packaged apart in Debian
  # nvidia-cuda-dev is 2.8 GB unpacked (every CUDA library): only the headers and the runtime.
  local lib=./usr/lib/x86_64-linux-gnu
  dpkg-deb --fsys-tarfile "$CACHE"/debs/nvidia-cuda-dev_*.deb | tar -x -C "$x" --wildcards './usr/include/*' \
    "$lib/libcudart_static.a" "$lib/libcudadevrt.a" "$lib/libculibos.a" "$lib/stubs/libcuda.so"
  local tkbin=$x/usr/lib/nvidia-cuda-toolkit/bin
  cp -a "$tkbin/nvcc" "$tkbin/crt" "$TK/bin/"
  for b in ptxas fatbinary nvlink cudafe++ bin2c cuobjdump nvdisasm nvprune cu++filt; do cp -a "$x/usr/bin/$b" "$TK/bin/"; done
  cp -a "$tkbin/cicc" "$TK/nvvm/bin/"
  cp -a "$x"/usr/lib/x86_64-linux-gnu/libnvvm.so* "$TK/nvvm/lib64/"
  cp -a "$x/usr/lib/nvidia-cuda-toolkit/libdevice" "$TK/nvvm/"
  cp -a "$x/usr/include" "$TK/include"
  cp -a "$x"/usr/lib/x86_64-linux-gnu/{libcudart_static.a,libcudadevrt.a,libculibos.a,libcudart.so.11*} "$TK/lib64/"
  ln -sf libcudart.so.11.0 "$TK/lib64/libcudart.so"  # what CMake's FindCUDAToolkit looks for
  cp -a "$x/usr/lib/x86_64-linux-gnu/stubs/libcuda.so" "$TK/lib64/stubs/"
  # NVIDIA's own profile for this layout (Debian's points into /usr).
  cat > "$TK/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:$(TOP)/nvvm/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
  rm -rf "$x"
  say "toolkit laid out in $TK ($(du -sh "$TK" | cut -f1)) in $((SECONDS - t0)) s"
}

"$PYTHON" -c "import nanobind, jaxlib" 2>/dev/null ||
  die "$PYTHON cannot import nanobind and jaxlib, which the build needs: $PYTHON -m pip install 'nanobind>=2.0,<4' jaxlib (or set PYTHON)"
toolkit
"$TK/bin/nvcc" --version | tail -1 >&2
if [[ ${1:-} == --toolkit ]]; then
  echo "$TK/bin/nvcc"
  exit 0
fi

t0=$SECONDS
cmake -S "$ROOT_DIR" -B "$BUILD_DIR" -DJAX_BLINK_CUDA=ON -DCMAKE_CUDA_COMPILER="$TK/bin/nvcc" \
  -DCMAKE_CUDA_HOST_COMPILER=g++-11 -DCUDAToolkit_ROOT="$TK" -DPython_EXECUTABLE="$(command -v "$PYTHON")" >/dev/null
# The compiler's output (jaxlib's FFI headers give nvcc 11.8 some warnings) goes to a log, shown on failure.
cmake --build "$BUILD_DIR" --target _cuda >"$BUILD_DIR/cuda118-build.log" 2>&1 ||
  { cat "$BUILD_DIR/cuda118-build.log" >&2; die "the compile failed (log above, $BUILD_DIR/cuda118-build.log)"; }
so=$(find "$BUILD_DIR" -name '_cuda*.so' | head -1)
[[ -n $so ]] || die "no _cuda module under $BUILD_DIR"
say "built $so in $((SECONDS - t0)) s"

# The cubins the module holds (cuobjdump lists one ELF per architecture).
elfs=$("$TK/bin/cuobjdump" --list-elf "$so")
printf '%s\n' "$elfs" >&2
missing=()
for a in $NEED_ARCHS; do
  grep -q "\.$a\." <<<"$elfs" || missing+=("$a")
done
if ((${#missing[@]})); then
  die "the module has no cubin for ${missing[*]}"
fi
# The module loads here and reports what the import-time check (jax_blink.lowering.ffi) reads: the
# build's CUDA version and architectures, and why it cannot run on this machine (no driver on CI).
"$PYTHON" - "$so" <<'EOF' || die "the built module failed its import check"
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_cuda", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
version, archs = m.built_cuda_version(), m.built_architectures()
assert version == 11080, f"built with CUDA {version}, expected 11080 (11.8)"
assert "70-real" in archs.split(","), f"architectures {archs} lack 70-real"
print(f"cuda118 build: imports; CUDA {version}, architectures {archs}; "
      f"here: {m.check_compatibility() or 'runs'}", file=sys.stderr)
EOF
echo "cuda118 build: $so holds cubins for $NEED_ARCHS (CUDA 11.8 runtime: drivers R450+)"
echo "install it with: cp $so $ROOT_DIR/jax_blink/_native/  (or pip install with CUDACXX=$TK/bin/nvcc CUDAHOSTCXX=g++-11 JAX_BLINK_CUDA=ON)"
