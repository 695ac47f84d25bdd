"""A plan's or a schedule's chunk sends as messages over physical hops (the link-level model's input):
GPU-level tree edges and their routes, per-tree chunk templates and segments, a schedule's rows, host
staging of sends without peer access and each send's protocol latency."""

from __future__ import annotations

import dataclasses
import math

from .. import collectives as _collectives
from ..errors import PlanError, ScheduleError
from ..planner.routes import route
from ..schedule import COPY, REDUCE, choose_chunks
from .results import (
    _HOST_MEMORY,
    _KIND_ORDER,
    CHUNK_BUDGET,
    DEFAULT_LATENCY_US,
    DEFAULT_MAX_CHUNKS,
    PROTOCOL_LATENCY_US,
)

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
