"""jax_blink: topology-aware collectives for JAX (Blink, MLSys 2020).

Pipeline: topology -> packing (plan) -> schedule -> lowering -> API.
"""

from .errors import BlinkError, PlanError, ScheduleError, TopologyError
from .topology import Topology
from .presets import PRESETS, multi_node
from .discovery import detect, load_topology
# the function shadows its module on purpose (jax_blink.probe(...)); the module stays importable with
# importlib.import_module("jax_blink.probe") and `from jax_blink.probe import ...`; jax loads lazily.
from .probe import probe

def _installed_version() -> str:
    """The version in pyproject.toml, as installed (one source of truth); '0+unknown' for a source
    tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("jax_blink")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

# JAX-facing API, imported lazily so the CLI and planners load without importing jax.
_LAZY = {"psum": "api", "pmean": "api", "broadcast": "api", "reduce": "api", "all_gather": "api",
         "psum_scatter": "api", "set_device_map": "mapping",
         "plan": "packing", "Plan": "packing", "Tree": "packing", "ring_rate": "bounds",
         "selftest": "gpu_selftest", "clear_caches": "packing"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    """The module's names, including the lazily imported ones (so completion and dir() show them)."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["BlinkError", "PlanError", "ScheduleError", "Topology", "TopologyError", "__version__",
           "PRESETS", "multi_node", "detect", "load_topology", "probe",
           "psum", "pmean", "broadcast", "reduce", "all_gather", "psum_scatter", "set_device_map", "plan", "Plan",
           "Tree", "ring_rate", "selftest", "clear_caches"]
