"""The planner's facade: validate a request, dispatch it to the algorithm, cache the plan.

:func:`plan` is the rate-optimal planner (the large-operand limit): ``algorithm`` "auto" takes the
highest rate among the flat tree packing (:mod:`.trees`), the ring packing (:mod:`.rings`) and, for
devices on several nodes, Blink's three phases (:mod:`.threephase`); "rsag" pairs the
reduce-scatter and all-gather forests (:mod:`.sharded`). The public :func:`jax_blink.plan`
(:mod:`jax_blink.planning`) validates through :func:`check_request` too and, given ``nbytes``, lets
the cost model choose instead; the cost model's candidates come from here.

Every algorithm returns a :class:`~jax_blink.planner.model.Plan` that keeps the contract of
docs/architecture.md: weighted trees over the job's GPUs, link loads within capacity, ``rate_gbps``
<= ``bound_gbps``. Plans are deterministic and cached by (topology fingerprint, devices, collective,
root, max_trees, algorithm, relays, rate_tolerance).
"""

from __future__ import annotations

import dataclasses
import numbers

from .. import collectives as _collectives
from ..errors import PlanError
from ..topology.model import Topology
from ..topology.symmetry import node_structure
from . import store
from .model import COLLECTIVES, Plan, cached, clear_caches, job_devices, plan_cache
from .rings import packed_ring_plan
from .sharded import rsag_plan
from .symmetric import symmetric_plan, symmetric_rsag_plan
from .threephase import hierarchical_plan, node_groups
from .trees import flat_plan, relay_plan

ALGORITHMS = ("auto", "trees", "ring", "hierarchical", "rsag")
_CACHE = plan_cache()

__all__ = ["ALGORITHMS", "COLLECTIVES", "Plan", "check_request", "clear_caches", "job_devices", "plan", "planned",
           "structure"]


def check_request(topology: Topology, collective: str, devices, root, max_trees, algorithm: str, relays,
                  rate_tolerance) -> tuple:
    """Validate a planning request (the arguments of :func:`jax_blink.plan`, which documents them).

    Returns ``(devices, root, relays, rate_tolerance)`` normalised: the job's GPU ids as a tuple,
    the root (``devices[0]`` by default for broadcast / reduce, None otherwise), the relay GPUs as
    a sorted tuple, the tolerance as a float. Raises PlanError naming what is wrong.
    """
    if collective not in COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    if not isinstance(topology, Topology):
        raise PlanError(f"plan needs a jax_blink.Topology (e.g. jax_blink.load_topology('dgx1v')), got "
                        f"{type(topology).__name__}")
    devices = job_devices(topology, devices)
    if isinstance(root, bool) or not (root is None or isinstance(root, numbers.Integral)):
        raise PlanError(f"root must be a GPU id (int) among devices {list(devices)} or None, got {root!r}")
    root = None if root is None else int(root)
    row = _collectives.get(collective)
    if collective == "allreduce":
        if root is not None and root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}")
        root = None
    elif row.sharded:
        if root is not None:
            raise PlanError(f"{collective} has no root (every rank owns one shard); got root={root!r}, pass None")
        if max_trees is not None and not isinstance(max_trees, bool) and isinstance(max_trees, int) \
                and 1 <= max_trees < len(devices):
            raise PlanError(f"{collective} needs at least one tree per rank: max_trees={max_trees} < "
                            f"{len(devices)} devices")
    else:
        root = devices[0] if root is None else root
        if root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}; pass one of them")
    if max_trees is not None and (isinstance(max_trees, bool) or not isinstance(max_trees, int) or max_trees < 1):
        raise PlanError(f"max_trees must be a positive int or None, got {max_trees!r}")
    if algorithm not in ALGORITHMS:
        raise PlanError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if algorithm == "ring" and collective not in ("allreduce", "allgather", "reducescatter"):
        raise PlanError(f"algorithm 'ring' is an all-reduce algorithm (and an all-gather / reduce-scatter one), "
                        f"not for {collective!r}")
    if algorithm == "rsag" and collective != "allreduce":
        raise PlanError(f"algorithm 'rsag' (reduce-scatter then all-gather) is an all-reduce algorithm, "
                        f"not for {collective!r}")
    if algorithm == "hierarchical" and row.sharded:
        raise PlanError(f"algorithm 'hierarchical' (Blink's three phases) is not planned for {collective!r}; "
                        f"use 'auto', 'trees' or 'ring'")
    if isinstance(rate_tolerance, bool) or not isinstance(rate_tolerance, (int, float)) \
            or not 0.0 <= rate_tolerance < 1.0:
        raise PlanError(f"rate_tolerance must be a number in [0, 1), got {rate_tolerance!r}")
    relays = _check_relays(topology, devices, relays)
    if relays and algorithm in ("ring", "hierarchical", "rsag"):
        raise PlanError(f"relays={list(relays)} work with tree packings only; use algorithm='auto' or "
                        f"'trees' (got {algorithm!r})")
    return devices, root, relays, float(rate_tolerance)


def plan(topology: Topology, collective: str = "allreduce", *, devices=None, root=None,
         max_trees: int | None = None, algorithm: str = "auto", relays=None, rate_tolerance: float = 0.0) -> Plan:
    """The rate-optimal plan: :func:`jax_blink.plan` without ``nbytes`` (same arguments, results and
    errors; "auto" takes the highest rate). Cached: identical inputs give the identical object."""
    devices, root, relays, rate_tolerance = check_request(topology, collective, devices, root, max_trees,
                                                          algorithm, relays, rate_tolerance)
    return planned(topology, collective, devices, root, max_trees, algorithm, relays, rate_tolerance)


def planned(topology: Topology, collective: str, devices: tuple, root, max_trees, algorithm: str, relays: tuple,
            rate_tolerance: float) -> Plan:
    """The cached plan of a request :func:`check_request` has validated and normalised: from memory,
    else from disk (:mod:`.store`, validated before use), else planned and stored."""
    fp = topology.fingerprint()
    key = (fp, devices, collective, root, max_trees, algorithm, relays, rate_tolerance)
    disk = {"kind": "plan", "topology": fp, "collective": collective, "devices": devices, "root": root,
            "max_trees": max_trees, "algorithm": algorithm, "relays": relays, "rate_tolerance": rate_tolerance,
            "size": None}
    return cached(_CACHE, key, lambda: store.disk_cached(
        disk, topology, collective, devices,
        lambda: _plan_uncached(topology, collective, devices, root, max_trees, algorithm, relays, rate_tolerance, fp)))


def _check_relays(topology, devices, relays) -> tuple:
    """Normalise ``plan(relays=...)`` to a sorted tuple of GPU ids outside ``devices``."""
    if relays is None or relays == "none":
        return ()
    if relays == "gpus":
        return tuple(g for g in topology.gpus if g not in devices)
    if isinstance(relays, str):
        raise PlanError(f"relays must be None, 'none', 'gpus' or a list of GPU ids, got {relays!r}")
    try:
        rel = list(relays)
    except TypeError:
        raise PlanError(f"relays must be None, 'none', 'gpus' or a list of GPU ids, got {relays!r}") from None
    bad = [r for r in rel if isinstance(r, bool) or r not in set(topology.gpus)]
    if bad:
        raise PlanError(f"relays {bad} are not GPUs of topology {topology.name!r} (GPUs {topology.gpus})")
    inside = [r for r in rel if r in devices]
    if inside:
        raise PlanError(f"relays {inside} are job devices {list(devices)}; relays must be other GPUs")
    if len(set(rel)) != len(rel):
        raise PlanError(f"relays {rel} list a GPU twice")
    return tuple(sorted(rel))


def _plan_uncached(topology, collective, devices, root, max_trees, algorithm, relays, rate_tolerance,
                   fingerprint=None) -> Plan:
    """Dispatch a validated request to its algorithm (``fingerprint``: the topology's, computed once)."""
    n = len(devices)
    if relays and n > 1:
        return relay_plan(topology, collective, devices, root, max_trees, relays, rate_tolerance)
    if n == 1:
        return Plan(collective, root, devices, (), float("inf"), float("inf"), "trivial",
                    ("one device: nothing to send (rate is infinite)",))
    if algorithm == "ring":
        return packed_ring_plan(topology, collective, devices, max_trees)
    if _collectives.get(collective).sharded:  # no three-phase variant: the flat packing is exact
        return flat_plan(topology, collective, devices, root, max_trees, algorithm, rate_tolerance, fingerprint)
    struct = structure(topology, collective, devices, max_trees)
    if struct is not None and algorithm in ("auto", "trees", "hierarchical", "rsag"):
        return _structured(topology, devices, algorithm, struct)
    if algorithm == "rsag":
        rs = planned(topology, "reducescatter", devices, None, None, "trees", (), 0.0)
        ag = planned(topology, "allgather", devices, None, None, "trees", (), 0.0)
        return rsag_plan(devices, rs, ag, max_trees)
    groups = node_groups(topology, list(devices))
    if algorithm == "hierarchical" and len(groups) == 1:
        raise PlanError(f"algorithm 'hierarchical' needs devices on two or more nodes; {list(devices)} "
                        f"are on one node of {topology.name!r}")
    if algorithm != "hierarchical":
        flat = flat_plan(topology, collective, devices, root, max_trees, algorithm, rate_tolerance, fingerprint)
        if len(groups) == 1 or algorithm != "auto":
            return flat
    hier = hierarchical_plan(topology, devices, collective, root, groups, max_trees)
    if algorithm == "hierarchical":
        return dataclasses.replace(hier, notes=hier.notes + (
            "three-phase plan (algorithm='hierarchical'; the flat packing was not compared)",))
    if hier.rate_gbps > flat.rate_gbps * (1 + 1e-6):
        return dataclasses.replace(hier, notes=hier.notes + (
            f"three-phase plan {hier.rate_gbps:.3f} GB/s beats the flat packing over all nodes "
            f"{flat.rate_gbps:.3f} GB/s ({flat.algorithm})",))
    return dataclasses.replace(flat, notes=flat.notes + (
        f"{len(groups)} nodes: the flat packing over all GPUs ({flat.rate_gbps:.3f} GB/s) is at least as fast "
        f"as Blink's three-phase hierarchical plan ({hier.rate_gbps:.3f} GB/s: leaders feed the NICs through "
        f"one GPU each, while flat trees spread NIC traffic over every GPU of a node)",))


def structure(topology, collective, devices, max_trees):
    """The job's :class:`~jax_blink.topology.symmetry.NodeStructure` when an all-reduce over identical
    nodes can be planned by symmetry (no ``max_trees``: the tree-count ILP is the flat packing's), else None."""
    if collective != "allreduce" or max_trees is not None or len(devices) < 2:
        return None
    if all(k != "network" for _, k in topology.graph.nodes(data="kind")):
        return None
    return node_structure(topology, devices)


def _structured(topology, devices, algorithm, struct) -> Plan:
    """All-reduce over identical nodes planned on one node and the network (:mod:`.symmetric`)."""
    if algorithm == "rsag":
        return symmetric_rsag_plan(topology, devices, struct)
    flat = symmetric_plan(topology, devices, struct, leader="any")
    if algorithm == "trees":
        return flat
    hier = symmetric_plan(topology, devices, struct, leader="one", bound=flat.bound_gbps)
    if algorithm == "hierarchical":
        return dataclasses.replace(hier, notes=hier.notes + (
            "three-phase plan (algorithm='hierarchical'; the flat packing was not compared)",))
    if hier.rate_gbps > flat.rate_gbps * (1 + 1e-6):
        return dataclasses.replace(hier, notes=hier.notes + (
            f"three-phase plan {hier.rate_gbps:.3f} GB/s beats the tree packing {flat.rate_gbps:.3f} GB/s",))
    return dataclasses.replace(flat, notes=flat.notes + (
        f"{struct.n_nodes} nodes: the tree packing over all GPUs ({flat.rate_gbps:.3f} GB/s) is at least as fast as "
        f"Blink's three-phase plan ({hier.rate_gbps:.3f} GB/s)",))
