"""The public planner entry point, :func:`plan` (``jax_blink.plan``).

Without ``nbytes`` it is the planner's rate-optimal facade (:func:`jax_blink.planner.facade.plan`);
with ``nbytes`` and ``algorithm="auto"`` the cost model (:func:`jax_blink.costmodel.choose_plan`)
chooses the plan with the least simulated time at that size. It sits after the cost model in the
layering (the cost model builds schedules and simulates them), so neither imports the other back.
"""

from __future__ import annotations

import math
import os

from . import costmodel
from .errors import PlanError
from .planner import facade
from .planner.model import Plan
from .topology.model import Topology


def plan(topology: Topology | str | os.PathLike, collective: str = "allreduce", *, devices=None, root=None,
         max_trees: int | None = None, algorithm: str = "auto", relays=None,
         rate_tolerance: float = 0.0, nbytes: float | None = None) -> Plan:
    """Plan a tree packing for ``collective`` over ``devices`` of ``topology``.

    Args:
      topology: the machine: a ``jax_blink.Topology``, or what ``jax_blink.load_topology`` takes (a
        preset name such as "dgx1v", the path of an ``nvidia-smi topo -m`` output, NCCL topology XML or
        JSON model), as the collectives' ``topology=`` does.
      collective: "broadcast" | "reduce" | "allreduce" | "allgather" | "reducescatter".
      devices: GPU ids of the job (rank r <-> devices[r]; all-gather / reduce-scatter: rank r owns
        shard r), or a string like the CLI's ``--devices`` ("0,1,4", "0-3"); default all GPUs of
        the topology.
      root: GPU id (broadcast/reduce; default ``devices[0]``); must be None or ignored for all-reduce;
        must be None for all-gather / reduce-scatter (every rank roots the trees of its shard).
      max_trees: at most this many trees (rate may drop; the loss is in ``notes``); all-gather /
        reduce-scatter need at least one per rank (``len(devices)``).
      algorithm: "auto" (the fastest: with ``nbytes``, the least predicted time at that size over
        trees, fewer trees, rings, NCCL's rings and double binary tree, three phases, by
        :func:`jax_blink.costmodel.choose_plan`: the link-level simulator inside one node, the
        flow-level closed form across nodes (the close candidates ranked again link-level where that is
        cheap), where identical nodes are planned on one node; without,
        the highest rate, i.e. the large-operand limit, trees or the ring packing; the reason in
        ``notes``), or force one:
        "trees" (exact packing over all devices), "ring" (all-reduce, all-gather, reduce-scatter),
        "hierarchical" (Blink's three phases, section 5; needs devices on two or more nodes; not for
        all-gather / reduce-scatter), "rsag" (all-reduce only: the reduce-scatter forest then the
        all-gather forest, paired per root into one executable all-reduce plan, time S / B_rs + S /
        B_ag; chosen by ``auto`` only with ``nbytes``, through the cost model). Without ``nbytes``,
        "auto" for all-gather / reduce-scatter is the tree packing (it reaches the cut bound, which
        no ring beats).
      relays: GPUs outside ``devices`` that may forward data inside routes (NCCL-style
        forwarding through a GPU that is not a rank): None or "none" (default), "gpus"
        (every other GPU of the topology), or an iterable of GPU ids. Relay GPUs act like switch
        nodes: routes pass through them, they never own data. The certificate becomes the max-flow
        bound over the relay-allowed graph. Executing such a plan needs the relay GPUs to run the
        forwarding: ``simulate`` models it, ``schedule.build_schedule`` (the JAX lowerings, which only
        run on job devices) raises ScheduleError. With relays only tree packings are planned (no
        ring alternative, no three-phase plan).
      rate_tolerance: 0.0 (default: exact optimum). A fraction in [0, 1): drop the lightest trees
        while the re-optimised rate stays >= (1 - rate_tolerance) * optimum (fewer, larger trees;
        the loss is in ``notes``). Ignored when ``max_trees`` is given.
      nbytes: operand bytes per GPU for ``algorithm="auto"`` (see there); ignored with ``relays`` or
        ``rate_tolerance``.

    Returns a :class:`Plan` (cached; identical inputs give the identical object and JSON). One device:
    a trivial plan with no trees and ``rate_gbps = bound_gbps = inf``.

    Raises TopologyError: a name or file that is no topology (the message lists what is accepted).
    Raises PlanError: unknown collective, devices not GPUs of the topology, duplicate devices, root not
    among the devices (or any root for all-gather / reduce-scatter), GPUs that cannot reach each other,
    bad ``max_trees`` (fewer than one tree per rank for all-gather / reduce-scatter), ``relays`` or
    ``rate_tolerance``, an algorithm that does not apply to the collective.

    Example: four GPUs of a DGX-1V (rates in GB/s; the packing meets its certificate), and the cost
    model's choice for a 1 MiB all-reduce::

        >>> from jax_blink import Topology, plan
        >>> topo = Topology.preset("dgx1v")
        >>> p = plan(topo, "broadcast", devices=[0, 1, 2, 3], root=0)
        >>> p.algorithm, round(p.rate_gbps, 1), round(p.bound_gbps, 1)
        ('trees', 103.6, 103.6)
        >>> p = plan(topo, "allreduce", devices=[0, 1, 2, 3])
        >>> p.algorithm, round(p.rate_gbps, 1), round(p.bound_gbps, 1)
        ('trees', 76.7, 76.7)
        >>> plan(topo, "allreduce", devices=[0, 1, 2, 3], nbytes=1 << 20).algorithm
        'ring'
    """
    if isinstance(topology, (str, os.PathLike)):
        topology = Topology.load(topology)
    devices, root, relays, rate_tolerance = facade.check_request(topology, collective, devices, root, max_trees,
                                                                 algorithm, relays, rate_tolerance)
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not (0 < nbytes < math.inf):
            raise PlanError(f"nbytes must be a positive number of bytes per GPU, got {nbytes!r}")
        if algorithm == "auto" and not relays and not rate_tolerance:
            return costmodel.choose_plan(topology, collective, nbytes, devices=devices, root=root,
                                         max_trees=max_trees)
    return facade.planned(topology, collective, devices, root, max_trees, algorithm, relays, rate_tolerance)
