"""Loader for the native extension modules built from ``ffi/`` (scikit-build-core + CMake + nanobind).

``cpu``: ``jax_blink._native._cpu`` (XLA FFI handler for platform "cpu") or None.
``cuda``: ``jax_blink._native._cuda`` (XLA FFI handler for platform "CUDA") or None; built only where a
CUDA compiler was found (``JAX_BLINK_CUDA=AUTO|ON|OFF`` at build time).
``cpu_error`` / ``cuda_error``: why a module is missing (an ImportError message), or None.
"""

from __future__ import annotations

import importlib


def _load(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}"), None
    except ImportError as e:  # not built (e.g. sdist without a compiler) or built for another Python
        return None, (f"jax_blink native module {name!r} is not available ({e}); reinstall with "
                      "`pip install -e .` (needs a C++17 compiler and CMake >= 3.24)")


cpu, cpu_error = _load("_cpu")
cuda, cuda_error = _load("_cuda")
