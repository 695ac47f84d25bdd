"""The record of passed CUDA self-tests: where it is kept and how it is read and written.

``jax_blink.gpu_selftest`` (``jax-blink selftest``) writes a pass with :func:`record_pass`;
``lowering.ffi.native_auto_allowed`` reads it with :func:`has_passed` before ``impl="auto"`` uses the
native CUDA executor. Both sides share this module, so the lowering never imports the self-test.

The record is ``record_path()``: file ``selftest.json`` in the cache directory
(``$JAX_BLINK_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax_blink``, else ``~/.cache/jax_blink``), a JSON
list of ``{"key": machine_key(), "time": ...}``. The key holds the GPU names, the driver version and a
hash of the CUDA module file, so a new driver, GPU or build needs a new self-test.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

from .. import _native
from ..topology.probe import cache_dir


def record_path() -> pathlib.Path:
    """Where passes are recorded: ``selftest.json`` in the probes' cache directory."""
    return cache_dir() / "selftest.json"


def machine_key() -> dict | None:
    """{gpus, driver, build} for this machine and CUDA module, or None without the module or a GPU."""
    cuda = _native.cuda
    if cuda is None:
        return None
    names = list(cuda.device_names())
    if not names:
        return None
    h = hashlib.sha256(pathlib.Path(cuda.__file__).read_bytes()).hexdigest()[:16]
    return {"gpus": names, "driver": int(cuda.driver_version()), "build": h}


def _load() -> list:
    try:
        data = json.loads(record_path().read_text())
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def has_passed(key: dict | None = None) -> bool:
    """Has the self-test passed for ``key`` (default: this machine and build)?"""
    key = machine_key() if key is None else key
    return key is not None and any(entry.get("key") == key for entry in _load())


def record_pass(key: dict) -> pathlib.Path:
    """Adds a pass for ``key`` to the record file (replacing an older one); returns its path."""
    entries = [e for e in _load() if e.get("key") != key]
    entries.append({"key": key, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    tmp.replace(path)
    return path
