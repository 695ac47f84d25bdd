"""jax_blink: topology-aware collectives for JAX (Blink, MLSys 2020).

Pipeline: topology -> packing (plan) -> schedule -> lowering -> API.
"""

from .errors import BlinkError, PlanError, ScheduleError, TopologyError
from .topology import Topology
from .presets import PRESETS, multi_node
from .discovery import detect, load_topology

__version__ = "0.1.0"

__all__ = ["BlinkError", "PlanError", "ScheduleError", "Topology", "TopologyError", "__version__",
           "PRESETS", "multi_node", "detect", "load_topology"]
