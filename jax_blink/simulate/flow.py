"""The flow-level closed form of a plan's time (:func:`flow_time`), whose cost does not grow with chunks
or links, and the count of messages the link-level model would simulate (:func:`link_level_messages`)."""

from __future__ import annotations

import math

from .. import collectives as _collectives
from ..errors import PlanError
from ..planner.model import ComposedTrees, plan_cache, tree_shape
from ..schedule import choose_chunks
from .results import (
    _KIND_ORDER,
    CHUNK_BUDGET,
    COLLECTIVES,
    DEFAULT_LATENCY_US,
    DEFAULT_MAX_CHUNKS,
    PROTOCOL_LATENCY_US,
    SimResult,
    busbw_factor,
)

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
