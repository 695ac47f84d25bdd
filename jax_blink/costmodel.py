"""The one cost model: which plan (and chunk count) is fastest for an operand size.

``algorithm="auto"`` means the least predicted time over :func:`candidate_plans`: the
bandwidth-optimal tree packing, the same with fewer trees (``max_trees`` in CANDIDATE_MAX_TREES;
all-gather / reduce-scatter: n and 2n trees, one per rank at least), the LP-optimal ring packing,
NCCL's rings and double binary tree (:mod:`jax_blink.planner.rings`, :mod:`jax_blink.planner.dbtree`),
for all-reduce the reduce-scatter + all-gather forests ("rsag", :func:`jax_blink.planner.facade.plan`;
its time is the reduce-scatter time plus the all-gather time) and, across nodes, Blink's three phases.
Every baseline and "rsag" is a Plan the schedule format runs (one tree per segment, reduce and
broadcast phases), so whichever wins runs as a schedule.
Users: ``jax_blink.plan(nbytes=...)`` and ``jax-blink plan --size`` (:func:`choose_plan`),
``jax-blink bench`` (blink column = :func:`choose_plan` per size), and the lowerings
(:func:`lowering_schedule`, from ``dispatch.build_request``).

Predicted time of a plan (:func:`simulated_time`): the link-level simulator
(:func:`jax_blink.simulate.simulate`, per-send latency ``latency_us``). Lowerings without a global
barrier (native per-tree pipelines) use it with their step latency as the per-send latency. A
round-synchronous lowering (such as "ppermute") pays a barrier per schedule round, which the
simulator does not model; it uses the round model below over the same candidates. The step latency
and the round-synchronous flag are properties of the lowering (its ``jax_blink.lowering.Lowering``
record); this module takes them as arguments and knows no lowering by name.

Round model (round-synchronous lowerings):

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

import collections
import concurrent.futures
import dataclasses
import math
import os

import numpy as np

from . import collectives
from .errors import PlanError, ScheduleError
from .planner import dbtree, facade, rings, store, threephase
from .planner.model import cached, plan_cache
from .schedule import DEFAULT_MAX_TOTAL_CHUNKS, DEFAULT_STEP_LATENCY_S, Schedule, _depth, build_schedule
from .simulate import CHUNK_BUDGET, DEFAULT_LATENCY_US, flow_time, link_level_messages, plan_chunks, simulate
from .simulate import DEFAULT_MAX_CHUNKS as SIM_MAX_CHUNKS
from .topology import symmetry

#: ``plan(max_trees=k)`` candidates; None is the bandwidth-optimal packing.
CANDIDATE_MAX_TREES = (None, 4, 2, 1)
#: ``cost="auto"`` across nodes: candidates within this fraction of the fastest by the flow-level
#: closed form are ranked again by the link-level simulator (its fill estimate is off by up to ~16%
#: at 64 KiB against the link-level model, tests/simulate/test_flow_model.py), when that simulates at most
#: LINK_RANK_MAX_MESSAGES messages over the candidates: the native event model (ffi/src/linksim.cc)
#: takes about 0.65 us per message with the messages' construction, and the candidates run in
#: threads (:func:`_link_times`), so the budget costs about 0.25 s of wall time on two cores (0.4 s
#: on one; benchmarks/simulator.py):
#: clusters up to 64 GPUs at every size. Above LINK_RANK_MAX_GPUS the candidates' messages are not
#: built at all: one send template per tree and GPU costs about 6 us in Python, 0.2-0.4 s for one
#: 128-GPU candidate of 128-192 trees.
LINK_RANK_MARGIN = 0.25
LINK_RANK_MAX_MESSAGES = 600_000
LINK_RANK_MAX_GPUS = 64
#: A free-running executor's lowering (the CUDA interpreter: ``lowering_schedule`` with
#: ``chunks_as_simulated`` and ``peer_routes``) simulates the schedules of the plans within this
#: fraction of the fastest plan and runs the fastest schedule (schedules and their plans differ by up
#: to 4%: tests/simulate/test_simulate.py).
SCHEDULE_RANK_MARGIN = 0.05
#: ... and it searches the schedules of every plan within this fraction of the fastest plan: a schedule
#: runs up to 18% slower than its plan's exact shares (dgx2 reduce-scatter at 1 MiB: 26 trees, 21.2 us
#: as a plan, 25.0 us as chunked), so a plan that ranks 6% behind can run fastest
#: (benchmarks/never_slower.py compares auto with every candidate's schedule).
SCHEDULE_SEARCH_MARGIN = 0.25
#: The cost model's default predictor, "auto": "flow" (:func:`jax_blink.simulate.flow_time`, the
#: closed form, cost independent of chunks and links) on topologies with a network (several nodes),
#: with the close candidates ranked again link-level where affordable (:func:`ranked`), "link" (the
#: link-level event model) inside one node, where it takes milliseconds.
DEFAULT_COST = "auto"

_CHOICES: collections.OrderedDict = plan_cache()
_TIMES: collections.OrderedDict = plan_cache()
_CACHE_SIZE = 4096


def plan_rate_gbps(plan) -> float:
    """Sum of the tree weights (GB/s) the schedule splits data over."""
    return float(sum(t.weight_gbps for t in plan.trees if t.weight_gbps > 0))


def predicted_time(schedule: Schedule, plan, itemsize: int, step_latency_s: float) -> float:
    """Predicted seconds of one call of ``schedule`` (built from ``plan``), by the model above.

    Args: schedule: the built schedule; plan: its ``Plan``; itemsize: bytes per element;
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
      plans: candidate ``Plan`` objects over the same devices (e.g. ``plan(max_trees=k)`` for
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


# ------------------------------------------------------------------------------ plan choice
def candidate_plans(topology, collective: str, *, devices=None, root=None, algorithm: str = "auto",
                    max_trees: int | None = None) -> list:
    """The plans ``auto`` chooses among, bandwidth-optimal packing first (it wins ties).

    "auto": tree packings with at most k trees (k in CANDIDATE_MAX_TREES, below the optimal count;
    all-gather / reduce-scatter: k in (n, 2n)), the LP ring packing, NCCL's rings, for all-reduce
    NCCL's double binary tree and the reduce-scatter + all-gather forests ("rsag"), and Blink's
    three phases when ``devices`` span several nodes. All-reduce over identical nodes
    (:func:`jax_blink.planner.facade.structure`): the plans of :mod:`jax_blink.planner.symmetric` only
    (the exact tree packing, three phases, and "rsag"), each planned on one node and composed
    (:class:`~jax_blink.planner.model.ComposedTrees`, built on use); the flat-packing, ring and NCCL
    candidates, planned over all GPUs at once, are left out there. A forced ``algorithm`` keeps its
    family: "trees" (packings), "ring" (the LP ring packing), "hierarchical". ``max_trees`` given:
    ``plan(max_trees=...)`` only (an explicit choice, like a forced algorithm). Candidates that cannot be built on these
    devices (PlanError) are left out; duplicates are dropped. Raises PlanError when the
    bandwidth-optimal plan itself fails (bad devices, root, unreachable GPUs).
    """
    devices = facade.job_devices(topology, devices)
    sharded = collectives.get(collective).sharded if collective in collectives.COLLECTIVES else False
    first = facade.plan(topology, collective, devices=devices, root=root, algorithm=algorithm,
                         max_trees=max_trees)  # rate-optimal: wins ties
    out = [first]
    if len(devices) == 1 or max_trees is not None:
        return out
    makers = []
    struct = facade.structure(topology, collective, devices, max_trees)
    if struct is not None:  # identical nodes: every candidate planned on one node (planner/symmetric.py)
        if algorithm in ("auto", "trees"):
            makers.append(lambda: facade.plan(topology, collective, devices=devices, algorithm="trees"))
        if algorithm == "auto":
            makers.append(lambda: facade.plan(topology, collective, devices=devices, algorithm="hierarchical"))
            makers.append(lambda: facade.plan(topology, collective, devices=devices, algorithm="rsag"))
        return _dedupe(first, makers)
    if algorithm in ("auto", "trees"):
        opt = facade.plan(topology, collective, devices=devices, root=root, algorithm="trees")
        if sharded:  # one tree per rank (the max-rate choice of n trees may differ from an n-tree optimum)
            ks = [k for k in (len(devices), 2 * len(devices)) if k <= len(opt.trees)]
        else:
            ks = [k for k in CANDIDATE_MAX_TREES if k is not None and k < len(opt.trees)]
        makers.append(lambda: opt)
        makers += [lambda k=k: facade.plan(topology, collective, devices=devices, root=root,
                                            algorithm="trees", max_trees=k) for k in ks]
    if algorithm == "auto":
        if collective == "allreduce":
            makers.append(lambda: facade.plan(topology, collective, devices=devices, algorithm="ring"))
            makers.append(lambda: dbtree.nccl_tree_plan(topology, devices=devices))
        else:
            makers.append(lambda: rings.ring_plan(topology, collective, devices=devices, root=root))
        makers.append(lambda: rings.nccl_ring_plan(topology, collective, devices=devices, root=root))
        if collective == "allreduce":
            makers.append(lambda: facade.plan(topology, collective, devices=devices, algorithm="rsag"))
        if len(threephase.node_groups(topology, list(devices))) > 1:
            makers.append(lambda: facade.plan(topology, collective, devices=devices, root=root,
                                               algorithm="hierarchical"))
    return _dedupe(first, makers)


def _dedupe(first, makers) -> list:
    """``first`` and the plans ``makers`` build, without failures (PlanError) and duplicates."""
    out, seen = [first], {first.trees}
    for make in makers:
        try:
            p = make()
        except PlanError:
            continue
        if p.trees in seen:
            continue
        seen.add(p.trees)
        out.append(p)
    return out


def resolve_cost(cost: str, topology) -> str:
    """"flow" or "link" for ``cost`` ("auto": "flow" when ``topology`` has a network node). Raises
    PlanError for anything else."""
    if cost not in ("auto", "flow", "link"):
        raise PlanError(f"cost must be 'auto', 'flow' or 'link', got {cost!r}")
    if cost == "auto":
        return "flow" if any(k == "network" for _, k in topology.graph.nodes(data="kind")) else "link"
    return cost


def simulated_time(plan, nbytes: float, topology, latency_us: float = DEFAULT_LATENCY_US,
                   cost: str = DEFAULT_COST, peer_routes: bool = False) -> float:
    """Seconds of one ``plan`` collective of ``nbytes`` bytes per GPU on ``topology`` (per-send latency
    ``latency_us``), by ``cost``: "flow" (:func:`jax_blink.simulate.flow_time`, the closed form),
    "link" (the link-level simulator, its own chunking) or "auto" (:func:`resolve_cost`).
    ``peer_routes``: the link-level model sends every tree edge over the pair's peer-to-peer path
    (``simulate(peer_routes=True)``: what an executor that loads its peers' memory runs); the closed
    form keeps the trees' routes. Cached."""
    cost = resolve_cost(cost, topology)
    key = _time_key(plan, nbytes, topology, latency_us, cost, peer_routes)
    if cost == "flow":
        return cached(_TIMES, key, lambda: flow_time(plan, nbytes, topology, latency_us=latency_us), _CACHE_SIZE)
    return cached(_TIMES, key, lambda: simulate(plan, nbytes, topology=topology, latency_us=latency_us,
                                                method="link", peer_routes=peer_routes).time_s, _CACHE_SIZE)


def _time_key(plan, nbytes, topology, latency_us, cost, peer_routes) -> tuple:
    return (topology.fingerprint(), plan, float(nbytes), float(latency_us), cost, cost == "link" and peer_routes)


def _link_times(plans, nbytes, topology, latency_us, peer_routes) -> list:
    """:func:`simulated_time` by the link-level model of each plan. The uncached ones are simulated in
    threads, at most one per CPU this process may run on: the native event model releases the GIL, so
    on two cores two candidates take about the wall time of one. Results enter the cache here, in
    this thread. A plan the link-level model refuses (PlanError) gets ``math.inf``."""
    keys = [_time_key(p, nbytes, topology, latency_us, "link", peer_routes) for p in plans]
    todo = [i for i, k in enumerate(keys) if k not in _TIMES]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    done = {}
    if len(todo) > 1 and cpus > 1:
        with concurrent.futures.ThreadPoolExecutor(min(len(todo), cpus)) as pool:
            futures = {i: pool.submit(simulate, plans[i], nbytes, topology=topology, latency_us=latency_us,
                                      method="link", peer_routes=peer_routes) for i in todo}
            for i, f in futures.items():
                try:
                    done[i] = f.result().time_s
                except PlanError:  # the link-level model refuses it: left to the caller's next look
                    pass
    out = []
    for i, (p, k) in enumerate(zip(plans, keys)):
        try:
            out.append(cached(_TIMES, k, lambda t=done[i]: t, _CACHE_SIZE) if i in done
                       else simulated_time(p, nbytes, topology, latency_us, "link", peer_routes))
        except PlanError:  # a candidate the closed form timed but that cannot run (e.g. a shard without
            out.append(math.inf)  # a tree from its owner): ranked last, never chosen over a valid one
    return out


def ranked(plans, nbytes: float, topology, latency_us: float = DEFAULT_LATENCY_US, cost: str = DEFAULT_COST,
           peer_routes: bool = False):
    """[(plan, seconds)] of ``plans`` by predicted time (earlier wins ties) and the predictor used,
    "flow" or "link". ``cost`` "flow" / "link": :func:`simulated_time` by that model. "auto": inside one
    node the link-level model; across nodes the flow-level closed form, then the candidates within
    LINK_RANK_MARGIN of the fastest by it are ranked again by the link-level model when that costs at
    most LINK_RANK_MAX_MESSAGES simulated messages (:func:`jax_blink.simulate.link_level_messages`) over
    at most LINK_RANK_MAX_GPUS GPUs:
    where the closed form's pipeline-fill estimate can misorder close candidates (mid sizes, many
    trees; tests/simulate/test_flow_model.py), the link-level simulator decides wherever it is affordable.
    ``peer_routes``: the link-level timings send tree edges over peer-to-peer paths (:func:`simulated_time`)."""
    plans = list(plans)
    if not plans:
        raise PlanError("fastest needs at least one plan (e.g. from candidate_plans)")
    model = resolve_cost(cost, topology)
    timed = [(p, simulated_time(p, nbytes, topology, latency_us, model, peer_routes)) for p in plans]
    if cost == "auto" and model == "flow" and len(plans) > 1:
        best = min(t for _, t in timed)
        close = [p for p, t in timed if t <= best * (1 + LINK_RANK_MARGIN)]
        affordable = len(close[0].devices) <= LINK_RANK_MAX_GPUS and sum(
            link_level_messages(p, nbytes, topology, latency_us=latency_us) for p in close) <= LINK_RANK_MAX_MESSAGES
        if len(close) > 1 and affordable:
            timed = list(zip(close, _link_times(close, nbytes, topology, latency_us, peer_routes)))
            model = "link"
    order = sorted(range(len(timed)), key=lambda i: (timed[i][1], i))
    return [timed[i] for i in order], model


def fastest(plans, nbytes: float, topology, latency_us: float = DEFAULT_LATENCY_US, cost: str = DEFAULT_COST,
            peer_routes: bool = False):
    """(plan, seconds) with the least predicted time among ``plans`` (earlier wins ties; :func:`ranked`,
    ``peer_routes`` as there). Raises PlanError for no plans."""
    return ranked(plans, nbytes, topology, latency_us, cost, peer_routes)[0][0]


def choose_plan(topology, collective: str, nbytes: float, *, devices=None, root=None,
                algorithm: str = "auto", max_trees: int | None = None,
                latency_us: float = DEFAULT_LATENCY_US, cost: str = DEFAULT_COST):
    """The fastest of :func:`candidate_plans` at ``nbytes`` bytes per GPU, by :func:`simulated_time`
    (``cost``: "flow", the closed form; "link", the link-level simulator; "auto" (default): flow
    across nodes, link inside one, :func:`resolve_cost`).

    Returns the Plan with a note saying that ``auto`` chose it, its predicted time and the runner-up
    (cached: the same inputs give the same object). Raises PlanError like ``jax_blink.plan``.
    """
    fp = topology.fingerprint()
    key = (fp, collective, devices if devices is None else tuple(devices), root,
           algorithm, max_trees, float(nbytes), float(latency_us), cost)
    devs = facade.job_devices(topology, devices)
    disk = {"kind": "choice", "topology": fp, "collective": collective, "devices": devs, "root": root,
            "algorithm": algorithm, "max_trees": max_trees, "size": float(nbytes), "latency_us": float(latency_us),
            "cost": resolve_cost(cost, topology)}
    return cached(_CHOICES, key, lambda: store.disk_cached(disk, topology, collective, devs, lambda: _choose_plan(
        topology, candidate_plans(topology, collective, devices=devices, root=root, algorithm=algorithm,
                                  max_trees=max_trees), nbytes, latency_us, algorithm, cost)), _CACHE_SIZE)


def _choose_plan(topology, plans, nbytes, latency_us, algorithm="auto", cost=DEFAULT_COST):
    order, model = ranked(plans, nbytes, topology, latency_us, cost)
    best, t = order[0]
    if len(plans) == 1:
        return best
    who = "auto" if algorithm == "auto" else f"algorithm={algorithm!r}"
    how = "flow-level closed form" if model == "flow" else "link-level simulator"
    if model == "link" and resolve_cost(cost, topology) == "flow":
        how = (f"link-level simulator over the {len(order)} candidates within {LINK_RANK_MARGIN:.0%} of the "
               f"fastest by the flow-level closed form")
    nxt = (f"next: {order[1][0].shape()}, {order[1][1] * 1e6:.1f} us" if len(order) > 1
           else "the others slower by the closed form")
    note = (f"{who}: chosen for {nbytes:.0f} B per GPU by the cost model ({how}): "
            f"{t * 1e6:.1f} us, the least of {len(plans)} candidates ({nxt})")
    notes = (note,)
    if best.collective in ("allreduce", "broadcast", "reduce", "allgather", "reducescatter"):
        phases = process_phases(topology, best.collective, nbytes, devices=best.devices, latency_us=latency_us)
        if phases is not None:  # what a multi-process job runs instead of this plan's schedule
            notes += (phases.describe(),)
    return dataclasses.replace(best, notes=best.notes + notes)


def lowering_schedule(plans, nelems: int, *, itemsize: int, step_latency_s: float, round_synchronous: bool,
                      topology, chunk_elems: int | None = None, chunks_as_simulated: bool = False,
                      peer_routes: bool = False):
    """(plan, schedule, predicted seconds) a lowering runs, among ``plans`` (candidates).

    Args:
      plans: candidate ``jax_blink.Plan`` objects (e.g. ``candidate_plans``), preferred first.
      nelems: elements per rank; itemsize: bytes per element.
      step_latency_s: the lowering's seconds per schedule step (> 0).
      round_synchronous: the lowering pays a barrier per round: :func:`choose_schedule` (round
        model) over all plans and chunk counts. Otherwise the plan :func:`fastest` by the simulator
        with ``step_latency_s`` as per-send latency, then its chunk count by :func:`choose_schedule`.
      topology: the ``Topology`` the plans were made on (for the simulator).
      chunk_elems: fixed chunk size in elements, or None (chosen).
      chunks_as_simulated: (asynchronous lowerings) chunk the chosen plan as the link simulator did
        when it timed it (:func:`jax_blink.schedule.choose_chunks` per tree at ``step_latency_s``, at
        most ``simulate.DEFAULT_MAX_CHUNKS`` per tree and ``simulate.CHUNK_BUDGET`` in all) instead of
        :func:`choose_schedule`'s round model under ``DEFAULT_MAX_TOTAL_CHUNKS``; the predicted
        seconds are then the simulated ones. For executors whose chunk costs only the step latency.
      peer_routes: (asynchronous lowerings) time the candidates with every tree edge on the pair's
        peer-to-peer path (:func:`simulated_time`): the executor loads its peers' memory, so a tree
        routed over a PCIe switch between two NVLink peers runs over their NVLink (the CUDA interpreter).
        With ``chunks_as_simulated`` too (a free-running executor): the schedules of the plans within
        SCHEDULE_SEARCH_MARGIN of the fastest are simulated as it runs them (peer-to-peer sends, each
        tree's chunks free-running: ``simulate(schedule, free_running=True)``), and the fastest
        schedule is returned with that time as the predicted seconds.

    Plans the schedule cannot run (relays) are skipped; raises ScheduleError when none is left.
    """
    plans = [p for p in plans if not p.relays]
    if not plans:
        raise ScheduleError("no candidate plan can be scheduled on the job's devices")
    if not round_synchronous and chunks_as_simulated and chunk_elems is None:
        nbytes = nelems * itemsize
        order, _ = ranked(plans, nbytes, topology, step_latency_s * 1e6, peer_routes=peer_routes)
        if not peer_routes:
            best, t = order[0]
            return best, _simulated_chunks_schedule(best, nelems, itemsize, step_latency_s, topology, False), t
        # The executor runs the schedule, each tree's chunks free-running: among the plans within
        # SCHEDULE_SEARCH_MARGIN of the fastest, the schedule that simulates fastest so (a schedule's
        # whole-element chunks, under the chunk budget, run slower than its plan's exact shares).
        picks = []
        for i, (p, t_plan) in enumerate(order):
            if t_plan > order[0][1] * (1 + SCHEDULE_SEARCH_MARGIN):
                break
            sched = _simulated_chunks_schedule(p, nelems, itemsize, step_latency_s, topology, True)
            t = simulate(sched, nbytes, topology=topology, latency_us=step_latency_s * 1e6, devices=list(p.devices),
                         free_running=True).time_s
            picks.append((t, i, p, sched))
        t, _, best, sched = min(picks, key=lambda x: x[:2])
        return best, sched, t
    if not round_synchronous and len(plans) > 1:
        plans = [fastest(plans, nelems * itemsize, topology, step_latency_s * 1e6, peer_routes=peer_routes)[0]]
    return choose_schedule(plans, nelems, itemsize=itemsize, step_latency_s=step_latency_s,
                           chunk_elems=chunk_elems)


def _simulated_chunks_schedule(plan, nelems, itemsize, step_latency_s, topology, peer_routes) -> Schedule:
    """``plan``'s schedule with the chunk counts the link simulator timed it with (physical hops of
    the routes the executor takes; :func:`jax_blink.simulate.plan_chunks`)."""
    ntrees = max(1, sum(1 for tr in plan.trees if tr.weight_gbps > 0))
    ks = plan_chunks(plan, nelems * itemsize, topology, latency_us=step_latency_s * 1e6, peer_routes=peer_routes)
    return build_schedule(plan, nelems, itemsize=itemsize, step_latency_s=step_latency_s,
                          max_chunks=max(1, min(SIM_MAX_CHUNKS, CHUNK_BUDGET // ntrees)),
                          max_total_chunks=CHUNK_BUDGET, tree_chunks=ks)


# ------------------------------------------------------------------------------ across processes
#: Seconds of one step of XLA's own collective between processes (one message of a ring over the
#: network; an estimate for gloo / NCCL over a NIC).
NETWORK_STEP_S = 20e-6


@dataclasses.dataclass(frozen=True)
class ProcessPhases:
    """Predicted time of the ``"hierarchical"`` lowering (one process per node; Blink, MLSys 2020,
    section 5) for one collective, in seconds.

    Attributes:
      local_s: the intra-node phases (the native executor on the node's packing: the link simulator
        over the node's reduce-scatter / all-gather / broadcast plans).
      network_s: XLA's collective between the nodes, one ring per partition, all partitions sharing
        the node's NIC rate: ``bytes through a node's NICs / nic_gbps + steps * NETWORK_STEP_S``.
      nodes, per_node: P processes (nodes) of ``per_node`` GPUs each.
      nic_gbps: GB/s per direction out of one node into the network (all its NICs).
    """

    local_s: float
    network_s: float
    nodes: int
    per_node: int
    nic_gbps: float

    @property
    def total_s(self) -> float:
        return self.local_s + self.network_s

    def describe(self) -> str:
        return (f"a job with one process per node runs impl='hierarchical' (native trees inside each of the "
                f"{self.nodes} nodes x {self.per_node} GPUs, XLA's collective between them): predicted "
                f"{self.total_s * 1e6:.1f} us = intra-node {self.local_s * 1e6:.1f} us + network "
                f"{self.network_s * 1e6:.1f} us at {self.nic_gbps:g} GB/s per node")


def process_phases(topology, collective: str, nbytes: float, *, devices=None,
                   latency_us: float = DEFAULT_LATENCY_US) -> ProcessPhases | None:
    """:class:`ProcessPhases` of ``collective`` on ``nbytes`` bytes per GPU (all-reduce, broadcast
    and reduce: the operand; all-gather: the gathered output; reduce-scatter: the input) over
    ``devices`` (default every GPU) of a multi-node ``topology`` (``presets.multi_node``,
    ``distributed.cluster_topology``), or None when the devices lie on one node or the nodes hold
    different numbers of them (the lowering then does not apply).

    Network phase (units: bytes, GB/s): with P nodes of L GPUs and the node's NIC rate B, an all-reduce
    moves 2 (P-1)/P x nbytes through each node's NICs (L rings of nbytes / L, the ring all-reduce
    volume), an all-gather or reduce-scatter (P-1)/P x nbytes; time = volume / B + 2 (P-1) (or P-1)
    steps of NETWORK_STEP_S. Raises PlanError as ``jax_blink.plan`` for bad devices.
    """
    devices = facade.job_devices(topology, devices)
    nodes = threephase.node_groups(topology, list(devices))
    if len(nodes) < 2 or len({len(g) for g in nodes}) != 1:
        return None
    P, L = len(nodes), len(nodes[0])
    node = nodes[0]
    net = {n for n, k in topology.graph.nodes(data="kind") if k == "network"}
    nic = sum(d.get("bandwidth_gbps", 0.0) for u, v, d in topology.graph.edges(data=True)
              if v in net and u not in net) / P
    sharded = collective in ("allgather", "reducescatter")
    ring_volume = (P - 1) / P * nbytes * (1 if sharded else 2)
    network = ring_volume / (nic * 1e9) + (P - 1) * (1 if sharded else 2) * NETWORK_STEP_S if nic > 0 else math.inf
    phases = {"allreduce": ("reducescatter", "allgather"), "reduce": ("reducescatter", "allgather"),
              "broadcast": ("broadcast", "allgather"), "allgather": ("allgather",),
              "reducescatter": ("reducescatter",)}[collective]
    local = 0.0
    if L > 1:
        # identical nodes: node 0 alone, as "rsag" plans it (not the whole cluster, whose NICs give
        # detours through the network and other nodes' switches), so its packings are shared
        struct = symmetry.node_structure(topology, devices)
        view = topology if struct is None else symmetry.node_topology(struct)
        node = node if struct is None else list(struct.groups[0])
        for phase in phases:
            # the node's share: an all-reduce's local phases run on the full operand; an all-gather's on
            # the gathered output; a reduce-scatter's on the input
            p = facade.plan(view, phase, devices=node, root=node[0] if phase == "broadcast" else None)
            local += simulated_time(p, nbytes, view, latency_us, resolve_cost("auto", topology))  # as across nodes
    return ProcessPhases(local, network, P, L, nic)
