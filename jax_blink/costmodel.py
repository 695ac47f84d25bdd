"""Latency-aware choice of (tree packing, chunk count) per operand size.

The bandwidth-optimal packing (Blink section 4.1) often has many trees (8 on ``Topology.host(8)``,
17 for a dgx1v all-reduce), and every round of a :class:`~jax_blink.schedule.Schedule` is one
collective step with a fixed cost (one ``collective_permute`` in the "ppermute" lowering: ~100 us on
host CPU devices). Small operands are latency-bound, so fewer trees / fewer chunks (fewer rounds)
win; large operands are bandwidth-bound and keep the optimal rate (Blink section 4.2 notes the same
latency / bandwidth trade-off for the chunk size).

Model (units: seconds, bytes, GB/s = 1e9 B/s): for a schedule of ``plan`` on ``nbytes`` per rank,

    time = rounds * step_latency + nbytes / rate * max_s (k_s + d_s - 1) / k_s

``rounds`` is exact (from the list scheduler, :func:`jax_blink.schedule.build_schedule`); ``rate`` is
the plan's rate (sum of its tree weights); segment ``s`` has ``k_s`` chunks over a reduce + broadcast
depth ``d_s``, and segments are proportional to tree weights, so each tree needs ``nbytes / rate``
unpipelined and a pipeline of ``k`` chunks over ``d`` hops takes ``(k + d - 1) / k`` of that (the
classic pipelined-broadcast time, Johnsson & Ho 1989; the same model as
:func:`jax_blink.schedule.choose_chunks`).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ScheduleError
from .schedule import DEFAULT_MAX_TOTAL_CHUNKS, DEFAULT_STEP_LATENCY_S, Schedule, _depth, build_schedule

#: Fixed cost of one schedule round per lowering, seconds. "ppermute": measured on 8 host CPU devices
#: (jax 0.10.2, 2 cores): 20 chained jitted ``lax.ppermute`` of 16 bytes cost 97 us each over the
#: empty program. "ffi": an in-process barrier between the device threads, a few us (estimate).
STEP_LATENCY_S = {"ppermute": 100e-6, "ffi": 5e-6}

#: ``packing.plan(max_trees=k)`` candidates; None is the bandwidth-optimal packing.
CANDIDATE_MAX_TREES = (None, 4, 2, 1)


def step_latency(impl: str) -> float:
    """Per-round cost in seconds of lowering ``impl`` (unknown impls: the schedule's default)."""
    return STEP_LATENCY_S.get(impl, DEFAULT_STEP_LATENCY_S)


def plan_rate_gbps(plan) -> float:
    """Sum of the tree weights (GB/s) the schedule splits data over."""
    return float(sum(t.weight_gbps for t in plan.trees if t.weight_gbps > 0))


def predicted_time(schedule: Schedule, plan, itemsize: int, step_latency_s: float) -> float:
    """Predicted seconds of one call of ``schedule`` (built from ``plan``), by the model above.

    Args: schedule: the built schedule; plan: its ``packing.Plan``; itemsize: bytes per element;
    step_latency_s: cost of one round in seconds. Returns 0.0 when nothing moves.
    """
    if schedule.num_rounds == 0:
        return 0.0
    rate = plan_rate_gbps(plan)
    if not rate > 0 or not math.isfinite(rate):
        raise ScheduleError(f"plan rate {rate!r} GB/s: cannot predict a time")
    k = np.bincount(schedule.chunk_seg, minlength=len(schedule.seg_root))
    stretch = 1.0
    for s, root in enumerate(schedule.seg_root):
        d = _depth(schedule.reduce_parent[s], int(root)) + _depth(schedule.bcast_parent[s], int(root))
        stretch = max(stretch, (k[s] + max(d, 1) - 1) / k[s])
    nbytes = schedule.nelems * itemsize
    return schedule.num_rounds * step_latency_s + nbytes / (rate * 1e9) * stretch


def chunk_budgets(ntrees: int, max_total_chunks: int = DEFAULT_MAX_TOTAL_CHUNKS) -> list[int]:
    """Total-chunk caps to try: one chunk per tree, doubling up to ``max_total_chunks``."""
    out, m = [], max(1, ntrees)
    while m < max_total_chunks:
        out.append(m)
        m *= 2
    return out + [max_total_chunks]


def choose_schedule(plans, nelems: int, *, itemsize: int = 4, step_latency_s: float = DEFAULT_STEP_LATENCY_S,
                    chunk_elems: int | None = None, max_total_chunks: int = DEFAULT_MAX_TOTAL_CHUNKS):
    """The (plan, schedule, predicted seconds) with the least predicted time.

    Args:
      plans: candidate ``packing.Plan`` objects over the same devices (e.g. ``plan(max_trees=k)`` for
        k in :data:`CANDIDATE_MAX_TREES`); earlier plans win ties, so list the optimal one first.
      nelems: elements per rank; itemsize: bytes per element; step_latency_s: seconds per round.
      chunk_elems: fixed chunk size in elements (only the plan is chosen), or None: chunk counts from
        :func:`jax_blink.schedule.choose_chunks` capped at each of :func:`chunk_budgets` (up to
        ``max_total_chunks``: it bounds the program size, and so how far many-tree plans pipeline).

    Deterministic: the same inputs give the same schedule. Raises ScheduleError for no plans or
    bad arguments (from ``build_schedule``).
    """
    plans = list(plans)
    if not plans:
        raise ScheduleError("choose_schedule needs at least one plan")
    best = None
    for plan in plans:
        if chunk_elems is not None:
            caps = [None]
        else:
            caps = chunk_budgets(sum(1 for t in plan.trees if t.weight_gbps > 0), max_total_chunks)
        seen = set()
        for cap in caps:
            kw = {"chunk_elems": chunk_elems} if cap is None else {"max_total_chunks": cap}
            sched = build_schedule(plan, nelems, itemsize=itemsize, step_latency_s=step_latency_s, **kw)
            sig = len(sched.chunk_seg)
            if sig in seen:  # the cap did not bind: same schedule as a smaller cap
                continue
            seen.add(sig)
            t = predicted_time(sched, plan, itemsize, step_latency_s)
            if best is None or t < best[2] * (1 - 1e-9):
                best = (plan, sched, t)
    return best
