"""Loader for the native extension modules built from ``ffi/`` (scikit-build-core + CMake + nanobind).

``cpu``: ``jax_blink._native._cpu`` (XLA FFI handler for platform "cpu") or None.
``cuda``: ``jax_blink._native._cuda`` (XLA FFI handler for platform "CUDA") or None; built only where a
CUDA compiler was found (``JAX_BLINK_CUDA=AUTO|ON|OFF`` at build time).
``linksim``: ``jax_blink._native._linksim`` (the simulator's link-level event model, ffi/src/linksim.h) or
None (then :mod:`jax_blink.simulate` runs its Python reference of the same model).
``cpu_error`` / ``cuda_error`` / ``linksim_error``: why a module is missing (an ImportError message), or None.
"""

from __future__ import annotations

import importlib


def _load(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}"), None
    except ImportError as e:  # not built (e.g. sdist without a compiler) or built for another Python
        if name == "_cuda" and isinstance(e, ModuleNotFoundError):
            # skipped on purpose where the build found no NVIDIA driver (JAX_BLINK_CUDA=AUTO)
            return None, ("jax_blink's CUDA module is not built: the default build (JAX_BLINK_CUDA=AUTO) makes it "
                          "only where an NVIDIA driver and a CUDA compiler are found; on a GPU machine reinstall "
                          "there, or build it anyway with `JAX_BLINK_CUDA=ON pip install -e .` (docs/cuda.md)")
        return None, (f"jax_blink native module {name!r} is not available ({e}); reinstall with "
                      "`pip install -e .` (needs a C++17 compiler and CMake >= 3.24)")


cpu, cpu_error = _load("_cpu")
cuda, cuda_error = _load("_cuda")
linksim, linksim_error = _load("_linksim")

#: The CPU executor's instruction sets, lowest first (ffi/src/cpu_sum.h, SumIsa).
CPU_ISAS = ("baseline", "avx2", "avx512")


def cpu_isa() -> str:
    """The instruction set of the CPU executor's sum kernels in this process.

    ``"baseline"`` (what the compiler targets by default: SSE2 on x86-64, the plain ISA elsewhere),
    ``"avx2"`` (AVX2 + FMA + F16C, e.g. Haswell and later, AMD Zen 1-3) or ``"avx512"`` (F, BW, VL, DQ;
    e.g. Skylake-SP, Ice Lake, AMD Zen 4): the widest this build holds and this CPU runs (checked at
    run time with the CPU's feature bits and the OS's register state), capped by
    ``JAX_BLINK_CPU_ISA``. Every choice gives the same bits (tests/native/test_ffi.py).

    Raises:
      RuntimeError: the native CPU module is not built (``cpu_error`` says why).
    """
    if cpu is None:
        raise RuntimeError(cpu_error)
    return cpu.sum_isa()


def cpu_isas() -> tuple[str, ...]:
    """The instruction sets of :data:`CPU_ISAS` that this build holds and this CPU runs, lowest first
    (``()`` when the native CPU module is not built)."""
    return tuple(cpu.sum_isas()) if cpu is not None else ()
