"""jax_blink: topology-aware collectives for JAX (Blink, MLSys 2020).

Pipeline: topology -> planner (plan) -> schedule -> lowering -> API.
"""

from ._native import cpu_isa
from .errors import BlinkError, PlanError, ScheduleError, TopologyError
from .topology import PRESETS, Topology, detect, load_topology, multi_node

# jax_blink.probe(...) is the measuring function of the module jax_blink.topology.probe (import that
# module for cached_probe, build_topology, ...); jax loads lazily, when a probe runs.
from .topology.probe import probe


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
         "psum_scatter": "api", "export_checks": "api", "deserialize": "api",
         "transform": "rewrite", "transform_report": "rewrite",
         "set_device_map": "mapping",
         "plan": "planning", "Plan": "planner.model", "Tree": "planner.model", "ring_rate": "planner.rings",
         "selftest": "gpu_selftest", "clear_caches": "planner.model", "explain": "explaining",
         "lowered_text": "explaining"}


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
           "psum", "pmean", "broadcast", "reduce", "all_gather", "psum_scatter", "export_checks", "deserialize",
           "transform", "explain", "lowered_text", "transform_report", "set_device_map", "plan", "Plan",
           "Tree", "ring_rate", "selftest", "clear_caches", "cpu_isa"]
