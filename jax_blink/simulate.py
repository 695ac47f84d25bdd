"""Link-level event simulation of tree, ring and double-binary-tree collectives.

The model (an alpha-beta model per link, evaluated as a discrete event simulation):

* Every directed physical edge of the :class:`~jax_blink.topology.Topology` is a FIFO queue that
  serves one message at a time at its ``bandwidth_gbps`` (GB/s = 1e9 B/s; the link's achieved rate:
  line rate x the achieved fraction of its kind, set by the topology sources, see
  :mod:`jax_blink.topology.presets`). Switch, PCIe, CPU and host nodes are ordinary nodes, so transfers routed
  through them share their edges' capacity.
* The data of a plan is split across its trees in proportion to the tree weights (Blink, MLSys 2020,
  section 4.1) and each tree's segment is cut into chunks.
* A chunk crossing a GPU-level tree edge is one *message*. It crosses each physical edge of its
  route store-and-forward (a hop starts when the whole chunk has arrived and the edge is free) and,
  after its last hop, pays ``latency_us`` once (the alpha term of a GPU-to-GPU send) plus the
  per-chunk protocol latency of its route's slowest link kind (:data:`PROTOCOL_LATENCY_US`). That
  term delays the chunk but does not hold the links: the sender's next chunks are already queued
  (NCCL keeps NCCL_STEPS = 8 chunk slots in flight per connection for the same reason).
* Host staging: a send between GPUs without peer access (GPU node attribute ``no_p2p``, set by
  :mod:`jax_blink.topology.nvsmi` and NVML discovery from ``topo -p2p``) is two copies through host memory:
  GPU -> host memory over the sender's PCIe path to its CPU, then host memory -> GPU down the
  receiver's path. Each copy is its own send (it pays the latencies) and both pass the socket's
  host-memory staging queue (:data:`HOST_STAGING_GBPS`, shared by every staged copy of that socket,
  in both directions), as the CUDA driver's and NCCL's shared-memory transport stage them.
* Reduce: a GPU forwards chunk j to its parent when chunk j arrived from all its reduce children.
  Broadcast: a GPU forwards chunk j to its children when it holds chunk j. All-reduce: a tree's
  broadcast of chunk j starts at the root as soon as the root finished reducing chunk j, so chunks
  pipeline up and down every tree at once (Blink section 4.2).
* Messages are served in order of readiness; ties go to the earlier chunk, then creation order, so
  the simulation is deterministic.
* Engine: the event loop runs in native code (``jax_blink._native._linksim``, ffi/src/linksim.cc)
  over messages as arrays; a plan's are one chunk template per tree tiled by numpy, so neither cost
  grows with Python objects per chunk (about 0.65 us per message on one core: a 64-GPU cluster's
  258,000 messages in 0.17 s, 17x the Python loop; benchmarks/simulator.py). The Python event
  loop ``_run`` is its reference and runs where the module is not built; both give the same floats
  (tests/test_linksim.py).

Closed forms it reproduces exactly (tests/test_simulate.py; ``alpha`` = ``latency_us`` + the protocol
latency): one link ``S/B + alpha``; a pipelined chain broadcast of k chunks over n GPUs
``(k + n - 2) c/B + (n - 1) alpha``; an unpipelined ring all-reduce ``2(n-1) (S/(n B) + alpha)``
(Patarasuk & Yuan 2009; NCCL's ring); a send without peer access ``2 S/B + 2 S/H + 2 alpha`` over
PCIe links of B and the staging path H (tests/test_fidelity.py). Agreement with measured machines:
``benchmarks/fidelity.py``.

Bandwidth figures follow nccl-tests (doc/PERFORMANCE.md): ``algbw = S / t``; all-reduce
``busbw = algbw * 2(n-1)/n``; all-gather and reduce-scatter ``busbw = algbw * (n-1)/n`` (S the full
buffer); broadcast and reduce ``busbw = algbw``. All-gather broadcasts each shard down its owner's
trees; reduce-scatter reduces each shard up its owner's in-trees (phases from ``collectives.get``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any

import numpy as np

from . import collectives as _collectives
from ._native import linksim as _native_linksim
from .errors import BlinkError, PlanError, ScheduleError
from .planner.model import ComposedTrees, plan_cache, tree_shape
from .planner.routes import route
from .schedule import COPY, REDUCE, Schedule, choose_chunks

DEFAULT_LATENCY_US = 2.0

#: Per-chunk protocol latency in microseconds by link kind, paid once per GPU-to-GPU send for the
#: slowest kind on its route (net > pcie/host > nvlink/nvswitch). Source: NCCL src/graph/tuning.cc,
#: ``hwLat`` for the ring algorithm and the LL protocol (NVLink 0.6, PCI 1.0, network 2.7 us per step).
PROTOCOL_LATENCY_US = {"nvlink": 0.6, "nvswitch": 0.6, "pcie": 1.0, "host": 1.0, "net": 2.7}

#: GB/s of one CPU socket's host-memory staging path, shared by every copy staged through it (both
#: the GPU -> host and the host -> GPU copy of each send). Calibrated: 2x RTX 2080 Ti on one PCIe
#: switch without peer access reach an all-reduce busbw of 4.0 GB/s (Anthony-Hoo.github.io,
#: posts/AutoDL_Multi-GPU_Interconnection_Test.md); that all-reduce stages 2S bytes of sends, each
#: written to and read from host memory, so 4S bytes cross the path in S / 4.0 GB/s seconds.
HOST_STAGING_GBPS = 16.0
_HOST_MEMORY = "host-memory"  # first element of the virtual staging queue's key (_HOST_MEMORY, cpu)
_KIND_ORDER = ("nvswitch", "nvlink", "host", "pcie", "net")
DEFAULT_MAX_CHUNKS = 64
CHUNK_BUDGET = 2048  # default chunking keeps about this many chunks per plan (simulation cost)
COLLECTIVES = tuple(_collectives.COLLECTIVES)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated collective.

    Attributes:
      collective: "allreduce" | "broadcast" | "reduce" | "allgather" | "reducescatter".
      algorithm: the plan's algorithm ("trees", "ring", "double-binary-tree", "schedule", ...).
      nranks: number of GPUs taking part.
      nbytes: bytes per rank (the operand size S; all-gather / reduce-scatter: the full buffer, n shards).
      time_s: completion time of the last message, seconds (0.0 for one GPU).
      algbw_gbps: S / time_s in GB/s (inf for one GPU).
      busbw_gbps: nccl-tests bus bandwidth in GB/s (algbw * :func:`busbw_factor`).
      link_bytes: {(u, v): bytes carried} per directed physical edge that carried data.
      link_util: {(u, v): busy time / time_s} per directed physical edge of the topology (0..1).
      messages: number of chunk transfers simulated.
    """

    collective: str
    algorithm: str
    nranks: int
    nbytes: float
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    link_bytes: dict
    link_util: dict
    messages: int


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor (``collectives.Collective.busbw_factor``): 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and reduce."""
    return _collectives.get(collective).busbw_factor(n)


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
        flow = (link_level_messages(plan_or_schedule, nbytes, latency_us=latency_us, max_chunks=max_chunks)
                > LINK_LEVEL_MAX_MESSAGES and not any(d.get("no_p2p") for _, d in topology.graph.nodes(data=True)))
    else:
        flow = method == "flow"
    if flow:
        return _flow_result(plan_or_schedule, float(nbytes), topology, latency_us, max_chunks)
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
        if _native_linksim is not None:  # per-tree chunk templates tiled into arrays: no message objects
            segs = [s for _, s in _plan_segments(plan, float(nbytes), topology, latency_s, chunk_bytes,
                                                 max_chunks, peer_routes)]
            msgs = _tiled_arrays(segs, topology, protocol_latency_us)
        else:
            msgs = _plan_messages(plan, float(nbytes), topology, latency_s, chunk_bytes, max_chunks, peer_routes)
    if isinstance(msgs, list):
        msgs = _stage_through_host(msgs, topology)
        _set_protocol_latency(msgs, topology, protocol_latency_us)
    time_s, busy, carried = _run_any(msgs, topology, latency_s)
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


# --------------------------------------------------------------------------- routing

def tree_gpu_edges(tree, devices, *, reduce: bool = False) -> list[tuple]:
    """GPU-level edges of a tree as ``(parent_gpu, child_gpu, route)``, parents before children.

    ``route`` is the node path from the parent GPU through switch nodes to the child GPU
    (``Tree.routes``, docs/architecture.md). With ``reduce=True`` the reduce tree is returned
    (``tree.reduce_edges`` when given, else ``tree.edges``), still parent -> child; a reduce's data
    flows along the route reversed. GPUs outside ``devices`` may appear as relays (they store and
    forward, and add in a reduce). Raises PlanError when the routes do not form a tree from
    ``tree.root`` reaching every device exactly once.
    """
    routes = tree.routes(reduce)
    devs = set(devices)
    kids: dict = {}
    seen = {tree.root}
    for r in routes:
        if r[-1] in seen:
            raise PlanError(f"tree rooted at {tree.root} reaches GPU {r[-1]} twice; its routes "
                            f"{routes} are not a tree")
        seen.add(r[-1])
        kids.setdefault(r[0], []).append(r)
    out, queue = [], [tree.root]
    while queue:
        p = queue.pop(0)
        for r in kids.get(p, ()):
            out.append((p, r[-1], tuple(r)))
            queue.append(r[-1])
    if len(out) != len(routes):
        raise PlanError(f"tree rooted at {tree.root}: routes {routes} are not connected to the root")
    missing = devs - {tree.root} - {c for _, c, _ in out}
    if missing:
        raise PlanError(f"tree rooted at {tree.root} does not reach GPUs {sorted(missing)} of "
                        f"devices {sorted(devs)}")
    return out


def _hops(topology, path) -> tuple:
    """Physical hops of a node path; a pair with no edge is routed through switches."""
    hops = []
    g = topology.graph
    for a, b in zip(path, path[1:]):
        if g.has_edge(a, b):
            hops.append((a, b))
        else:
            hops.extend(route(topology, a, b))
    return tuple(hops)


# --------------------------------------------------------------------------- messages
@dataclasses.dataclass
class _Msg:
    nbytes: float
    hops: tuple
    deps: list
    prio: tuple  # served first when smaller: (fraction of its segment done, creation order)
    extra_s: float = 0.0  # per-chunk protocol latency, paid with the alpha term after the last hop


def plan_chunks(plan, nbytes: float, topology, *, latency_us: float = DEFAULT_LATENCY_US,
                max_chunks: int = DEFAULT_MAX_CHUNKS, peer_routes: bool = False) -> dict:
    """{tree: chunks} into which :func:`simulate`'s link-level model cuts each positive-weight tree's
    segment of ``plan`` at ``nbytes`` bytes per rank (:func:`jax_blink.schedule.choose_chunks` over
    the physical hops of its deepest reduce and broadcast paths; ``peer_routes`` as in
    :func:`simulate`), so a lowering can build the schedule it timed
    (``build_schedule(tree_chunks=...)``). Trees equal in value get one entry (their chunking is the
    same). Raises PlanError as :func:`simulate`."""
    segs = _plan_segments(plan, float(nbytes), topology, latency_us * 1e-6, None, max_chunks, peer_routes)
    return {t: k for t, (_, _, _, _, k) in segs}


def _plan_messages(plan, nbytes, topology, latency_s, chunk_bytes, max_chunks, peer_routes=False) -> list[_Msg]:
    """The plan's messages as objects (the reference form; :func:`_tiled_arrays` is the array form):
    chunk j of every tree in turn, each chunk its tree's :func:`_chunk_template` at priority
    ((j + 1) / k, creation order)."""
    segs = [s for _, s in _plan_segments(plan, nbytes, topology, latency_s, chunk_bytes, max_chunks, peer_routes)]
    if not segs:
        return []
    templates = [_chunk_template(root, red, bc, cbytes) for root, red, bc, cbytes, _ in segs]
    msgs: list[_Msg] = []
    for j in range(max(s[4] for s in segs)):
        for (*_, k), tmpl in zip(segs, templates):
            if j >= k:
                continue
            base = len(msgs)
            msgs.extend(_Msg(m.nbytes, m.hops, [d + base for d in m.deps], ((j + 1) / k, base + i))
                        for i, m in enumerate(tmpl))
    return msgs


def _chunk_template(root, red, bc, cbytes) -> list[_Msg]:
    """One chunk of one tree: its reduce sends, children before parents (a parent's send depends on
    its children's), then its broadcast sends from the root down; deps are indices into the list."""
    tmpl: list[_Msg] = []
    into: dict = {}  # GPU -> reduce sends arriving there
    for c, p, hops in reversed(red):
        tmpl.append(_Msg(cbytes, hops, list(into.get(c, ())), (0.0, len(tmpl))))
        into.setdefault(p, []).append(len(tmpl) - 1)
    have = {root: list(into.get(root, ()))}
    for p, c, hops in bc:
        tmpl.append(_Msg(cbytes, hops, list(have[p]), (0.0, len(tmpl))))
        have[c] = [len(tmpl) - 1]
    return tmpl


def _plan_segments(plan, nbytes, topology, latency_s, chunk_bytes, max_chunks, peer_routes) -> list:
    """[(tree, (root, reduce edges, broadcast edges, chunk bytes, chunks))] per positive-weight tree."""
    devices = list(plan.devices)
    trees = [t for t in plan.trees if t.weight_gbps > 0]
    if len(devices) <= 1:
        return []
    if not trees:
        raise PlanError(f"plan for devices {devices} has no trees with positive weight")
    row = _collectives.get(plan.collective)
    do_reduce, do_bcast = row.reduces, row.broadcasts
    wsum = math.fsum(t.weight_gbps for t in trees)  # exact: sum() rounds otherwise from Python 3.12
    if row.sharded:  # segments never cross shards: root r's trees share shard r (nbytes / n)
        per_root: dict = {}
        for t in trees:
            per_root[t.root] = per_root.get(t.root, 0.0) + t.weight_gbps
        missing = [d for d in devices if d not in per_root]
        if missing:
            raise PlanError(f"{plan.collective} plan has no tree rooted at GPUs {missing}: every rank's shard "
                            f"needs trees from its owner")
    max_chunks = max(1, min(max_chunks, CHUNK_BUDGET // len(trees)))
    known: dict = {}  # path (or peer pair) -> physical hops

    def hops_of(path):  # the tree's route, or (peer_routes) the pair's peer-to-peer path
        if not peer_routes:  # trees share routes (and each route's hops tuple, for _set_protocol_latency)
            if path not in known:
                known[path] = _hops(topology, path)
            return known[path]
        key = (path[0], path[-1])
        if key not in known:
            known[key] = tuple(route(topology, *key))
        return known[key]

    segs = []
    for t in trees:
        if t.root not in devices:
            raise PlanError(f"tree root {t.root} is not one of the plan's devices {devices}")
        red = [(c, p, hops_of(path[::-1]))
               for p, c, path in tree_gpu_edges(t, devices, reduce=True)] if do_reduce else []
        bc = [(p, c, hops_of(path))
              for p, c, path in tree_gpu_edges(t, devices)] if do_bcast else []
        seg_bytes = (nbytes / len(devices) * t.weight_gbps / per_root[t.root] if row.sharded
                     else nbytes * t.weight_gbps / wsum)
        if chunk_bytes is not None:
            k = max(1, math.ceil(seg_bytes / chunk_bytes - 1e-9))
        else:
            # store-and-forward stages: physical hops on the deepest reduce and broadcast paths
            depth = _depth([(p, c, len(h)) for c, p, h in red], t.root) + \
                _depth([(p, c, len(h)) for p, c, h in bc], t.root)
            k = choose_chunks(seg_bytes, depth, t.weight_gbps,
                              step_latency_s=max(latency_s, 1e-7), max_chunks=max_chunks)
        segs.append((t, (t.root, red, bc, seg_bytes / k, k)))
    return segs


def _depth(pc_len, root) -> int:
    """Largest sum of hop counts on a root-to-leaf path of (parent, child, hops) edges."""
    parent = {c: (p, n) for p, c, n in pc_len}
    best = 0
    for v in parent:
        d = 0
        while v != root and v in parent:
            v, n = parent[v]
            d += n
        best = max(best, d)
    return best


def _schedule_devices(sched, topology, devices) -> list:
    devs = list(topology.gpus if devices is None else devices)
    topology.check_devices(devs)
    if len(devs) != sched.nranks:
        raise ScheduleError(f"schedule has {sched.nranks} ranks but {len(devs)} devices were given "
                            f"({devs}); pass devices= with one topology GPU per rank")
    return devs


def _schedule_messages(sched, nbytes, topology, devs, free_running=False) -> list[_Msg]:
    if sched.nelems == 0:
        return []
    itemsize = nbytes / sched.nelems
    segs = sched.chunk_seg.tolist()
    of_seg = [0] * len(sched.seg_root)
    nth = []  # chunk -> its position in its segment
    for s in segs:
        nth.append(of_seg[s])
        of_seg[s] += 1
    size = _tied_sizes(sched.chunk_length.tolist(), itemsize)
    writers: dict = {}  # (rank, chunk) -> rows that wrote it so far
    cache: dict = {}
    msgs = []
    for i, (_, op, src, dst, c) in enumerate(sched.transfers.tolist()):
        if op not in (REDUCE, COPY):
            raise ScheduleError(f"transfer row {i}: unknown op {op}")
        key = (devs[src], devs[dst])
        if key not in cache:
            cache[key] = route(topology, *key)
        # free-running: by segment progress, ties by chunk position, then segment (as a Plan's)
        prio = (((nth[c] + 1) / of_seg[segs[c]], nth[c], segs[c], i) if free_running
                else (i / len(sched.transfers), i))
        msgs.append(_Msg(size[c], cache[key], list(writers.get((src, c), ())), prio))
        writers.setdefault((dst, c), []).append(i)
    return msgs


def _tied_sizes(lengths: list, itemsize: float) -> list:
    """Bytes of each chunk as simulated: chunk lengths one element apart (the integer rounding of
    equal shares: a segment's k chunks, segments of equal weight) at their mean size, others as they
    are. The event model serves sends that arrive together by priority, so a one-element lead
    (nanoseconds) would reorder sends that equal shares tie, and the same plan and chunk counts would
    simulate up to 4% slower as a schedule than as a plan (dgx1v all-reduce, NCCL's ring, 4 MiB:
    81.9 vs 78.6 us; 256 MiB: 3.54 vs 3.52 ms)."""
    count: dict = {}
    for n in lengths:
        count[n] = count.get(n, 0) + 1
    mean, prev = {}, None
    for n in sorted(count):
        if prev is not None and n == prev + 1 and prev not in mean:  # pair {L, L + 1} once
            m = (prev * count[prev] + n * count[n]) / (count[prev] + count[n]) * itemsize
            mean[prev] = mean[n] = m
        prev = n
    return [float(mean.get(n, n * itemsize)) for n in lengths]


# --------------------------------------------------------------------------- timing
def _stage_through_host(msgs: list[_Msg], topology) -> list[_Msg]:
    """Split every send between GPUs without peer access into two copies through host memory.

    The first copy takes the route up to its first CPU node and then the socket's staging queue
    ``(_HOST_MEMORY, cpu)``; the second depends on it and takes the queue, then the rest of the route.
    Dependents of the send wait for the second copy. Raises PlanError when such a route passes no CPU.
    """
    g = topology.graph
    cut = {}
    for i, m in enumerate(msgs):
        if m.hops and m.hops[-1][1] in g.nodes[m.hops[0][0]].get("no_p2p", ()):
            k = next((k for k, (_, b) in enumerate(m.hops) if g.nodes[b].get("kind") == "cpu"), None)
            if k is None:
                raise PlanError(f"GPUs {m.hops[0][0]} and {m.hops[-1][1]} have no peer access but their "
                                f"route {m.hops} passes no CPU node to stage through; give the topology "
                                f"its PCIe tree up to the CPU")
            cut[i] = k
    if not cut:
        return msgs
    last, n = [], 0  # index of each send's final copy in the new list
    for i in range(len(msgs)):
        n += 2 if i in cut else 1
        last.append(n - 1)
    out = []
    for i, m in enumerate(msgs):
        deps = [last[d] for d in m.deps]
        if i not in cut:
            out.append(_Msg(m.nbytes, m.hops, deps, m.prio, m.extra_s))
            continue
        k = cut[i]
        q = (_HOST_MEMORY, m.hops[k][1])
        out.append(_Msg(m.nbytes, m.hops[:k + 1] + (q,), deps, m.prio, m.extra_s))
        out.append(_Msg(m.nbytes, (q,) + m.hops[k + 1:], [len(out) - 1], m.prio, m.extra_s))
    return out


def _set_protocol_latency(msgs: list[_Msg], topology, protocol_latency_us, by_route=None) -> None:
    """Set each send's protocol latency: the given value, or that of its slowest link kind
    (``by_route``: {route: seconds} found so far, shared by calls on one topology)."""
    if protocol_latency_us is not None:
        for m in msgs:
            m.extra_s = protocol_latency_us * 1e-6
        return
    g = topology.graph
    by_route = {} if by_route is None else by_route  # sends of one tree edge share a route: look it up once
    for m in msgs:
        extra = by_route.get(m.hops)
        if extra is None:
            kinds = [g.edges[e]["kind"] for e in m.hops if e[0] != _HOST_MEMORY and g.has_edge(*e)]
            slowest = max(kinds, key=lambda k: _KIND_ORDER.index(k) if k in _KIND_ORDER else -1, default=None)
            extra = by_route[m.hops] = PROTOCOL_LATENCY_US.get(slowest, 0.0) * 1e-6
        m.extra_s = extra


@dataclasses.dataclass
class _Arrays:
    """Messages as arrays, the native event model's input (ffi/src/linksim.h): per message its bytes,
    protocol latency (s) and priority ``rank`` (served first when smaller); its links
    ``hop_edge[hop_ptr[i]:hop_ptr[i + 1]]`` (indices into ``edges``) and the messages it waits for
    ``dep[dep_ptr[i]:dep_ptr[i + 1]]``."""

    nbytes: np.ndarray
    extra_s: np.ndarray
    hop_ptr: np.ndarray
    hop_edge: np.ndarray
    dep_ptr: np.ndarray
    dep: np.ndarray
    rank: np.ndarray
    edges: list

    def __len__(self) -> int:
        return len(self.nbytes)


def _msg_arrays(msgs: list[_Msg]) -> _Arrays:
    """:class:`_Arrays` of message objects; ranks in the order of (prio, index), the reference's."""
    eid: dict = {}
    hop_edge = np.fromiter((eid.setdefault(e, len(eid)) for m in msgs for e in m.hops), dtype=np.int32)
    hop_ptr = np.zeros(len(msgs) + 1, dtype=np.int64)
    np.cumsum([len(m.hops) for m in msgs], out=hop_ptr[1:])
    dep = np.fromiter((d for m in msgs for d in m.deps), dtype=np.int64)
    dep_ptr = np.zeros(len(msgs) + 1, dtype=np.int64)
    np.cumsum([len(m.deps) for m in msgs], out=dep_ptr[1:])
    rank = np.zeros(len(msgs), dtype=np.int64)
    if msgs:  # prio tuples compare as their float columns (ints below 2^53 are exact), index last
        prio = np.array([m.prio for m in msgs], dtype=np.float64).reshape(len(msgs), -1)
        order = np.lexsort((np.arange(len(msgs)),) + tuple(prio[:, c] for c in reversed(range(prio.shape[1]))))
        rank[order] = np.arange(len(msgs))
    return _Arrays(np.array([m.nbytes for m in msgs], dtype=np.float64),
                   np.array([m.extra_s for m in msgs], dtype=np.float64), hop_ptr, hop_edge, dep_ptr, dep, rank,
                   list(eid))


def _gather(ptr: np.ndarray, values: np.ndarray, rows: np.ndarray):
    """(new ptr, values) of the CSR rows ``rows`` (``values[ptr[r]:ptr[r + 1]]`` each), in that order."""
    counts = (ptr[1:] - ptr[:-1])[rows]
    out_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=out_ptr[1:])
    at = np.repeat(ptr[:-1][rows] - out_ptr[:-1], counts) + np.arange(out_ptr[-1], dtype=np.int64)
    return out_ptr, values[at], counts


def _tiled_arrays(segs, topology, protocol_latency_us) -> _Arrays:
    """:class:`_Arrays` of a plan's segments (:func:`_plan_segments`), equal to
    ``_msg_arrays`` of :func:`_plan_messages` staged and timed as :func:`simulate` does
    (tests/test_linksim.py checks every float): each tree's :func:`_chunk_template` is staged and
    given its protocol latencies once, then tiled over its chunks by numpy, chunk j of every tree in
    turn. A staged send's two copies share its priority, so the reference orders them by index, as
    (fraction, index) of the tiled list does."""
    if not segs:
        return _msg_arrays([])
    tmpls, by_route = [], {}
    for root, red, bc, cbytes, _ in segs:
        t = _stage_through_host(_chunk_template(root, red, bc, cbytes), topology)
        _set_protocol_latency(t, topology, protocol_latency_us, by_route)
        tmpls.append(t)
    flat = _msg_arrays([m for t in tmpls for m in t])  # deps local to each template
    size = np.array([len(t) for t in tmpls], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(size)[:-1]))
    ks = np.array([s[4] for s in segs], dtype=np.int64)
    active = [np.flatnonzero(ks > j) for j in range(int(ks.max()))]  # trees with a chunk j, in order
    blk_seg = np.concatenate(active)
    blk_j = np.repeat(np.arange(len(active), dtype=np.int64), [len(a) for a in active])
    blk_size = size[blk_seg]
    blk_base = np.concatenate(([0], np.cumsum(blk_size)[:-1]))
    total = int(blk_size.sum())
    msg_blk = np.repeat(np.arange(len(blk_seg)), blk_size)
    rows = np.arange(total, dtype=np.int64) - blk_base[msg_blk] + start[blk_seg][msg_blk]
    hop_ptr, hop_edge, _ = _gather(flat.hop_ptr, flat.hop_edge, rows)
    dep_ptr, dep, dcount = _gather(flat.dep_ptr, flat.dep, rows)
    dep = dep + np.repeat(blk_base[msg_blk], dcount)
    frac = ((blk_j + 1) / ks[blk_seg])[msg_blk]  # (j + 1) / k, correctly rounded as Python's
    rank = np.empty(total, dtype=np.int64)
    rank[np.lexsort((np.arange(total), frac))] = np.arange(total)
    return _Arrays(flat.nbytes[rows], flat.extra_s[rows], hop_ptr, np.ascontiguousarray(hop_edge, dtype=np.int32),
                   dep_ptr, np.ascontiguousarray(dep, dtype=np.int64), rank, flat.edges)


# --------------------------------------------------------------------------- engine
_ARRIVE, _SERVE = 0, 1


def _bytes_per_s(e, topology) -> float:
    if e[0] == _HOST_MEMORY:
        return HOST_STAGING_GBPS * 1e9
    d = topology.graph.get_edge_data(*e)
    if d is None:
        raise PlanError(f"message routed over {e}, which is not a link of {topology.name!r}")
    return d["bandwidth_gbps"] * 1e9


def _run_any(msgs, topology, latency_s: float):
    """:func:`_run` of message objects or :class:`_Arrays`, in native code (ffi/src/linksim.cc, the
    same event order and floats) where the module is built."""
    if _native_linksim is None:
        return _run(msgs, topology, latency_s)
    a = msgs if isinstance(msgs, _Arrays) else _msg_arrays(msgs)
    bw = np.array([_bytes_per_s(e, topology) for e in a.edges], dtype=np.float64)
    end, busy, carried, first, done = _native_linksim.run(a.nbytes, a.extra_s, a.hop_ptr, a.hop_edge, a.dep_ptr,
                                                          a.dep, a.rank, bw, float(latency_s))
    if done != len(a):
        raise ScheduleError(f"{len(a) - done} transfers never became ready (cyclic dependencies)")
    return end, {a.edges[e]: busy[e] for e in first}, {a.edges[e]: carried[e] for e in first}


def _run(msgs: list[_Msg], topology, latency_s: float):
    """Event loop over per-link queues. Returns (finish time, {edge: busy s}, {edge: bytes}).
    The reference of the native model (ffi/src/linksim.cc), run where that is not built.

    A link that falls free serves the waiting message with the smallest ``prio`` (all arrivals at
    the same instant are queued first), so trees of different weights progress in proportion and
    finish together, as Blink's weight-proportional split intends.
    """
    bw = {}
    for m in msgs:
        for e in m.hops:
            if e not in bw:
                bw[e] = _bytes_per_s(e, topology)
    waiting = [len(m.deps) for m in msgs]
    ready_at = [0.0] * len(msgs)
    dependents: list[list[int]] = [[] for _ in msgs]
    for i, m in enumerate(msgs):
        for d in m.deps:
            dependents[d].append(i)
    events = []  # (time, kind, tiebreak, payload)
    seq = 0
    for i, m in enumerate(msgs):
        if not m.deps:
            events.append((0.0, _ARRIVE, seq, (i, 0)))
            seq += 1
    heapq.heapify(events)
    queue: dict = {e: [] for e in bw}  # edge -> heap of (prio, msg, hop)
    idle = {e: True for e in bw}
    busy: dict = {}
    carried: dict = {}
    end, done = 0.0, 0
    while events:
        t, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            i, h = payload
            m = msgs[i]
            if h < len(m.hops):
                e = m.hops[h]
                heapq.heappush(queue[e], (m.prio, i, h))
                if idle[e]:
                    idle[e] = False  # claim now, choose at _SERVE once all arrivals at t are in
                    heapq.heappush(events, (t, _SERVE, seq, e))
                    seq += 1
                continue
            finish = t + latency_s + m.extra_s  # alpha + protocol: once per send, not holding links
            done += 1
            end = max(end, finish)
            for d in dependents[i]:
                waiting[d] -= 1
                ready_at[d] = max(ready_at[d], finish)
                if waiting[d] == 0:
                    heapq.heappush(events, (ready_at[d], _ARRIVE, seq, (d, 0)))
                    seq += 1
            continue
        e = payload
        if not queue[e]:
            idle[e] = True
            continue
        _, i, h = heapq.heappop(queue[e])
        dt = msgs[i].nbytes / bw[e]
        busy[e] = busy.get(e, 0.0) + dt
        carried[e] = carried.get(e, 0.0) + msgs[i].nbytes
        heapq.heappush(events, (t + dt, _ARRIVE, seq, (i, h + 1)))
        heapq.heappush(events, (t + dt, _SERVE, seq + 1, e))
        seq += 2
    if done != len(msgs):
        raise ScheduleError(f"{len(msgs) - done} transfers never became ready (cyclic dependencies)")
    return end, busy, carried


# --------------------------------------------------------------------------- flow-level model
#: ``simulate(method="auto")`` runs the link-level event model up to about this many messages
#: (chunks x GPU-level tree edges), the flow-level closed form above.
LINK_LEVEL_MAX_MESSAGES = 1_000_000
_KIND_RANK = {k: i for i, k in enumerate(_KIND_ORDER)}
_PROTO_BY_RANK = {-1: 0.0, **{i: PROTOCOL_LATENCY_US.get(k, 0.0) * 1e-6 for i, k in enumerate(_KIND_ORDER)}}


def _walk(hops, root, links, relays=()):
    """Per GPU of one tree's hop list (consecutive routes, parents before children; others resolved
    after): physical hops, sum of 1 / GB/s over the hops and protocol latency (s) from the root.
    ``links``: {(u, v): (GB/s, 1 / GB/s, rank of its kind in _KIND_ORDER)}.
    Returns (max hops, [(sum 1/B, protocol s, GPU sends) per GPU], slowest link GB/s)."""
    at = {root: (0, 0.0, 0.0, 0)}
    pending, cur = [], None
    slow = math.inf
    n, inv, worst = 0, 0.0, -1
    for h in hops:
        a, b = h
        if a.__class__ is int and a not in relays:
            cur, n, inv, worst = a, 0, 0.0, -1
        e = links.get(h)
        if e is None:
            raise PlanError(f"tree hop {h} is not a link of the topology")
        n += 1
        inv += e[1]
        if e[0] < slow:
            slow = e[0]
        if e[2] > worst:
            worst = e[2]
        if b.__class__ is int and b not in relays:
            proto = _PROTO_BY_RANK[worst]
            prev = at.get(cur)
            if prev is not None:
                at[b] = (prev[0] + n, prev[1] + inv, prev[2] + proto, prev[3] + 1)
            else:
                pending.append((cur, b, (n, inv, proto)))
    while pending:  # only for hop lists not in breadth-first order
        left = [x for x in pending if x[0] not in at]
        if len(left) == len(pending):
            raise PlanError(f"tree rooted at {root}: routes not connected to the root")
        for p, c, step in pending:
            if p in at:
                h0, i0, p0, g0 = at[p]
                at[c] = (h0 + step[0], i0 + step[1], p0 + step[2], g0 + 1)
        pending = left
    vals = list(at.values())
    return max(v[0] for v in vals), [v[1:] for v in vals], slow


_FLOW_TREES = plan_cache()  # emptied by clear_caches(), as the plans are


def _frontier(points) -> list:
    """The points (sum 1/B, protocol s, sends) not dominated in all three by another: the deepest
    path for any chunk size and latency is among them (few, where a tree has thousands of GPUs)."""
    out = []
    for p in sorted(set(points), reverse=True):
        if not any(q[0] >= p[0] and q[1] >= p[1] and q[2] >= p[2] for q in out):
            out.append(p)
    return out


def _tree_metrics(tree, links, reduces: bool, broadcasts: bool, symmetric: bool):
    """(depth in hops, paths [(sum 1/B, protocol s, sends)] of the reduce and broadcast phases, slowest
    link) of a tree, cached by identity. ``symmetric``: every link's reverse has its bandwidth and
    kind, so a reduce on the broadcast hops reversed has the broadcast's metrics."""
    shape = tree_shape(tree)
    key = (id(tree) if shape is None else shape, reduces, broadcasts, symmetric)
    hit = _FLOW_TREES.get(key)
    if hit is not None and (shape is not None or hit[0] is tree):
        return hit[1]
    parts = []
    if reduces:
        parts.append(tree.reduce_edges if tree.reduce_edges is not None else tree.edges)
    if broadcasts:
        parts.append(tree.edges)
    d, paths, slow = 0, [], math.inf
    done = None
    for hops in parts:
        if done is not None and symmetric and (hops is done[0] or hops == done[0]):
            pd, ps, s = done[1]
        else:
            pd, ps, s = _walk(hops, tree.root, links, tree.relays)
            done = (hops, (pd, ps, s))
        d, slow = d + pd, min(slow, s)
        paths.append(ps)
    paths = [_frontier(ps) for ps in paths]
    if len(_FLOW_TREES) > 65536:
        _FLOW_TREES.clear()
    _FLOW_TREES[key] = (tree, (d, paths, slow))
    return d, paths, slow


def flow_time(plan, nbytes: float, topology, *, latency_us: float = DEFAULT_LATENCY_US,
              max_chunks: int = DEFAULT_MAX_CHUNKS) -> float:
    """Seconds of one ``plan`` collective of ``nbytes`` bytes per rank by the flow-level closed form.

    Every tree t of weight w_t carries its segment s_t (S w_t / W; all-gather / reduce-scatter: its
    root's shard S / n split by weight) in k_t chunks (:func:`jax_blink.schedule.choose_chunks`, the
    same chunking as the link-level model) through a pipeline of d_t store-and-forward hops (reduce
    plus broadcast depth) and g_t GPU-level sends on its deepest path:

        T_t = s_t / w_t + max_paths sum_phases (c_t sum_hops 1 / B_h + sum_sends alpha) - c_t / B_t,
        time = max_t T_t

    (c_t = s_t / k_t; the deepest path of the reduce and of the broadcast phase; alpha =
    ``latency_us`` + the protocol latency of the send's slowest link kind, :data:`PROTOCOL_LATENCY_US`;
    B_t the tree's slowest link, whose chunk time is already in the bandwidth term). The weights keep
    every link within capacity (the planner's LP), so s_t / w_t is the bandwidth term; the rest is
    the pipeline fill (Johnsson & Ho 1989; Blink s. 4.2). Cost: one pass over each tree's hops
    (cached per tree, or per shape: :func:`jax_blink.planner.model.tree_shape`), independent of the
    chunk count and of the link count. Agreement with :func:`simulate`'s link-level model:
    ``tests/test_flow_model.py``. Host staging (GPUs without peer access) is not modelled: plans
    with such sends should use ``method="link"``.
    """
    return max((tt for tt, _ in _flow_trees(plan, nbytes, topology, latency_us, max_chunks)), default=0.0)


def _flow_trees(plan, nbytes, topology, latency_us, max_chunks) -> list:
    """[(T_t seconds, chunks k_t)] per tree of positive weight (:func:`flow_time`); [] when nothing moves."""
    devices = list(plan.devices)
    if isinstance(plan.trees, ComposedTrees):  # weights, roots and shapes without building the trees
        composed = plan.trees
        trees = [(w, r, i) for i, (w, r, _) in enumerate(composed.pieces) if w > 0]
    else:
        composed = None
        trees = [(t.weight_gbps, t.root, t) for t in plan.trees if t.weight_gbps > 0]
    if len(devices) <= 1 or not trees:
        return []
    row = _collectives.get(plan.collective)
    g = topology.graph
    links = {(u, v): (d["bandwidth_gbps"], 1.0 / d["bandwidth_gbps"], _KIND_RANK.get(d["kind"], -1))
             for u, v, d in g.edges(data=True)}
    symmetric = all(links.get((v, u)) == x for (u, v), x in links.items())
    wsum = math.fsum(w for w, _, _ in trees)  # as _plan_segments: the same on every Python
    per_root: dict = {}
    for w, r, _ in trees:
        per_root[r] = per_root.get(r, 0.0) + w
    latency_s = latency_us * 1e-6
    mc = max(1, min(max_chunks, CHUNK_BUDGET // len(trees)))
    out = []
    for w, r, t in trees:
        if composed is not None:  # one tree built per shape
            hit = _FLOW_TREES.get((composed.pieces[t][2], row.reduces, row.broadcasts, symmetric))
            d, paths, slow = hit[1] if hit is not None else _tree_metrics(
                composed.sample(t), links, row.reduces, row.broadcasts, symmetric)
        else:
            d, paths, slow = _tree_metrics(t, links, row.reduces, row.broadcasts, symmetric)
        seg = nbytes / len(devices) * w / per_root[r] if row.sharded else nbytes * w / wsum
        k = choose_chunks(seg, d, w, step_latency_s=max(latency_s, 1e-7), max_chunks=mc)
        c = seg / k / 1e9
        # deepest path of each phase: chunk store-and-forward over its hops plus its sends' latencies
        fill = sum(max(c * inv + proto + sends * latency_s for inv, proto, sends in ps) for ps in paths)
        tt = seg / (w * 1e9) + max(fill - c / slow, 0.0)
        out.append((tt, k))
    return out


def link_level_messages(plan, nbytes: float, topology=None, *, latency_us: float = DEFAULT_LATENCY_US,
                        max_chunks: int = DEFAULT_MAX_CHUNKS) -> int:
    """The messages (chunk sends over one GPU-level tree edge) the link-level model simulates for
    ``plan``: chunks per tree x GPU-level edges x phases (reduce, broadcast). With ``topology``, the
    chunk counts are the model's own (:func:`jax_blink.schedule.choose_chunks`, from the flow model's
    tree depths: cheap, one tree per shape); without, an upper estimate (``max_chunks``, about
    CHUNK_BUDGET over all trees). No routes are parsed."""
    trees = [t for t in plan.trees if t.weight_gbps > 0] if topology is None else None
    row = _collectives.get(plan.collective)
    per_edge = (len(plan.devices) - 1) * (int(row.reduces) + int(row.broadcasts))
    if topology is not None:
        return sum(k for _, k in _flow_trees(plan, nbytes, topology, latency_us, max_chunks)) * per_edge
    if not trees:
        return 0
    mc = max(1, min(max_chunks, CHUNK_BUDGET // len(trees)))
    return len(trees) * mc * per_edge


def _flow_result(plan, nbytes, topology, latency_us, max_chunks) -> SimResult:
    """:class:`SimResult` of :func:`flow_time` (bytes per link: the plan's link loads x S / rate)."""
    if plan.collective not in COLLECTIVES:
        raise PlanError(f"unknown collective {plan.collective!r}; expected one of {COLLECTIVES}")
    topology.check_devices(plan.devices)
    n = len(plan.devices)
    t = flow_time(plan, nbytes, topology, latency_us=latency_us, max_chunks=max_chunks)
    algorithm = getattr(plan, "algorithm", "trees")
    if n <= 1 or t == 0.0:
        return SimResult(plan.collective, algorithm, n, nbytes, 0.0, math.inf, math.inf, {}, {}, 0)
    wsum = math.fsum(tr.weight_gbps for tr in plan.trees if tr.weight_gbps > 0)
    carried = {e: gbps * nbytes / wsum for e, gbps in plan.link_loads().items() if gbps > 0}
    g = topology.graph
    util = {(u, v): carried.get((u, v), 0.0) / (g.edges[u, v]["bandwidth_gbps"] * 1e9 * t) for u, v in g.edges}
    algbw = nbytes / t / 1e9
    return SimResult(plan.collective, algorithm, n, nbytes, t, algbw, algbw * busbw_factor(plan.collective, n),
                     carried, util, 0)
