"""``simulate``: one collective on a topology's links, by the link-level event model or the flow-level
closed form (package docstring)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import BlinkError, PlanError
from ..schedule import Schedule
from . import events as _events
from . import flow as _flow
from .messages import (
    _plan_messages,
    _plan_segments,
    _schedule_devices,
    _schedule_messages,
    _set_protocol_latency,
    _stage_through_host,
)
from .results import (
    _HOST_MEMORY,
    COLLECTIVES,
    DEFAULT_LATENCY_US,
    DEFAULT_MAX_CHUNKS,
    SimResult,
    busbw_factor,
)


def simulate(plan_or_schedule: Any, nbytes: float, *, latency_us: float = DEFAULT_LATENCY_US,
             chunk_bytes: float | None = None, topology=None, devices=None,
             max_chunks: int = DEFAULT_MAX_CHUNKS, protocol_latency_us: float | None = None,
             method: str = "auto", peer_routes: bool = False, free_running: bool = False) -> SimResult:
    """Simulate one collective of ``nbytes`` bytes per rank on a topology's links.

    Args:
      plan_or_schedule: a ``jax_blink.planner.model.Plan`` (trees, possibly relaying through switch nodes or
        through GPUs outside ``plan.devices``; edges with no physical link are routed over the
        topology through switch nodes), or a :class:`~jax_blink.schedule.Schedule` (its chunks and
        transfer rows are simulated as given, rows ordered by data dependencies instead of rounds;
        each rank-to-rank send is routed over the topology; chunk lengths one element apart, the
        rounding of equal shares, at their mean size: :func:`_tied_sizes`).
      nbytes: operand size per rank in bytes (> 0). All-gather / reduce-scatter: the full buffer
        (gathered output / reduce-scatter input), ``n`` shards of ``nbytes / n``; a root's trees split
        its own shard in proportion to their weights (ForestColl, Zhao et al. 2024).
      latency_us: per-message startup cost alpha in microseconds (>= 0).
      chunk_bytes: chunk size for a Plan (None: per tree, the pipelining optimum of
        :func:`jax_blink.schedule.choose_chunks` with this latency, at most ``max_chunks`` chunks
        and about CHUNK_BUDGET chunks over all trees). Ignored for a Schedule (its chunks are used).
      topology: the :class:`~jax_blink.topology.Topology` whose links carry the data (required
        unless the plan has a ``topology`` attribute).
      devices: for a Schedule, the topology GPU of each rank (default: ``plan``-less schedules use
        the topology's GPUs in sorted order; must have ``nranks`` entries).
      max_chunks: upper bound on chunks per tree for a Plan when ``chunk_bytes`` is None.
      protocol_latency_us: per-chunk protocol latency of every send in microseconds (>= 0); None:
        :data:`PROTOCOL_LATENCY_US` of the slowest link kind on the send's route.
      method: "link" (the event model of the module docstring), "flow" (a Plan only: the closed
        form of :func:`flow_time`, cost independent of chunks and links; ``link_bytes`` and
        ``link_util`` from the plan's link loads, ``messages`` 0), or "auto" (default): "link" unless
        a Plan would need more than LINK_LEVEL_MAX_MESSAGES messages (about 1,000 GPUs) and no GPU
        lacks peer access, so a 1,024-GPU simulation takes seconds.
      peer_routes: a Plan's GPU-level tree edge u -> v crosses :func:`~jax_blink.planner.routes.route`
        (u, v), the path a peer-to-peer access takes (the direct link where there is one, else the
        fewest hops through switches; host staging where peer access is missing), instead of the
        tree's own route. An executor that loads its peers' memory (the CUDA interpreter) cannot
        steer a transfer between two NVLink peers over their PCIe switch: this times what it runs.
        A Schedule always takes these routes. Implies the link-level model.
      free_running: a Schedule's sends share links by the progress of their segment (chunk j of k
        served at (j + 1) / k, as a Plan's), not by row (round) order: an executor that runs each
        tree's chunks on blocks of their own (the CUDA interpreter), with no rounds.

    Returns: a :class:`SimResult`.

    Raises:
      BlinkError: bad sizes or latency, a missing topology, devices not in the topology.
      PlanError: a tree that does not span the plan's devices, an edge with no route, or a send
        between GPUs without peer access whose route passes no CPU node (nowhere to stage it).
      ScheduleError: a schedule whose rank count does not match ``devices``.

    Method: discrete event simulation of per-link FIFO queues (module docstring); Blink (Wang et
    al., MLSys 2020) sections 4.1-4.2 for splitting and pipelining; host staging and the protocol
    latency as in the module docstring.
    """
    if not all(hasattr(plan_or_schedule, a) for a in ("collective", "devices", "trees")) \
            and not isinstance(plan_or_schedule, Schedule):
        raise BlinkError(f"simulate needs a jax_blink.Plan or a Schedule, got {type(plan_or_schedule).__name__}")
    if isinstance(nbytes, bool) or not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes > 0):
        raise BlinkError(f"nbytes must be a positive number of bytes, got {nbytes!r}")
    if not (isinstance(latency_us, (int, float)) and math.isfinite(latency_us) and latency_us >= 0):
        raise BlinkError(f"latency_us must be >= 0, got {latency_us!r}")
    if protocol_latency_us is not None and not (isinstance(protocol_latency_us, (int, float))
                                                and math.isfinite(protocol_latency_us) and protocol_latency_us >= 0):
        raise BlinkError(f"protocol_latency_us must be >= 0 or None, got {protocol_latency_us!r}")
    if chunk_bytes is not None and not (math.isfinite(chunk_bytes) and chunk_bytes > 0):
        raise BlinkError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    if topology is None:
        topology = getattr(plan_or_schedule, "topology", None)
    if topology is None:
        raise BlinkError("simulate needs the topology whose links carry the data: pass topology=...")
    if not hasattr(topology, "check_devices"):
        raise BlinkError(f"topology must be a jax_blink.Topology (e.g. jax_blink.load_topology('dgx1v')), "
                         f"got {type(topology).__name__}")
    if method not in ("auto", "link", "flow"):
        raise BlinkError(f"method must be 'auto', 'link' or 'flow', got {method!r}")
    if method == "flow" and isinstance(plan_or_schedule, Schedule):
        raise BlinkError("method='flow' simulates a Plan; a Schedule runs on the link-level model (method='link')")
    if isinstance(plan_or_schedule, Schedule) or protocol_latency_us is not None or chunk_bytes is not None \
            or peer_routes:
        flow = False
    elif method == "auto":
        n_messages = _flow.link_level_messages(plan_or_schedule, nbytes, latency_us=latency_us, max_chunks=max_chunks)
        flow = (n_messages > _flow.LINK_LEVEL_MAX_MESSAGES
                and not any(d.get("no_p2p") for _, d in topology.graph.nodes(data=True)))
    else:
        flow = method == "flow"
    if flow:
        return _flow._flow_result(plan_or_schedule, float(nbytes), topology, latency_us, max_chunks)
    latency_s = latency_us * 1e-6
    if isinstance(plan_or_schedule, Schedule):
        sched = plan_or_schedule
        devs = _schedule_devices(sched, topology, devices)
        msgs = _schedule_messages(sched, float(nbytes), topology, devs, free_running)
        collective, algorithm, n = sched.collective, "schedule", sched.nranks
    else:
        plan = plan_or_schedule
        if plan.collective not in COLLECTIVES:
            raise PlanError(f"unknown collective {plan.collective!r}; expected one of {COLLECTIVES}")
        topology.check_devices(plan.devices)
        collective, algorithm, n = plan.collective, getattr(plan, "algorithm", "trees"), len(plan.devices)
        if _events._native_linksim is not None:  # per-tree chunk templates tiled into arrays: no message objects
            segs = [s for _, s in _plan_segments(plan, float(nbytes), topology, latency_s, chunk_bytes,
                                                 max_chunks, peer_routes)]
            msgs = _events._tiled_arrays(segs, topology, protocol_latency_us)
        else:
            msgs = _plan_messages(plan, float(nbytes), topology, latency_s, chunk_bytes, max_chunks, peer_routes)
    if isinstance(msgs, list):
        msgs = _stage_through_host(msgs, topology)
        _set_protocol_latency(msgs, topology, protocol_latency_us)
    time_s, busy, carried = _events._run_any(msgs, topology, latency_s)
    carried = {e: b for e, b in carried.items() if e[0] != _HOST_MEMORY}
    if n <= 1 or time_s == 0.0:
        algbw = math.inf
        busbw = math.inf if busbw_factor(collective, max(n, 1)) > 0 else 0.0
        time_s = 0.0
    else:
        algbw = nbytes / time_s / 1e9
        busbw = algbw * busbw_factor(collective, n)
    util = {(u, v): (busy.get((u, v), 0.0) / time_s if time_s > 0 else 0.0)
            for u, v in topology.graph.edges}
    return SimResult(collective, algorithm, n, float(nbytes), time_s, algbw, busbw, carried, util, len(msgs))
