"""Certificates for the planner's packings: max-flow and cut bounds, the Nash-Williams value.

- :func:`broadcast_bound` / :func:`reduce_bound`: Edmonds' branching theorem (Edmonds 1973, "Edge-disjoint
  branchings"; capacities as link multiplicities): the best fractional packing of ``root``-rooted
  spanning arborescences has rate min over v of maxflow(root -> v). With switch nodes whose in- and
  out-capacity are equal, directed splitting-off (Mader 1982; Bang-Jensen, Frank, Jackson 1995)
  keeps the bound reachable with GPU-level trees routed through non-replicating switches.
- :func:`nash_williams_value`: Nash-Williams / Tutte (1961): the best fractional packing of undirected
  spanning trees is min over partitions P of cap(edges crossing P) / (|P| - 1). Brute force.
- :func:`allreduce_bound`: an undirected tree packing can be oriented from any GPU, so its rate is at
  most the minimum max-flow between any two job GPUs.
- :func:`allgather_bound` / :func:`reducescatter_bound`: the exact cut bound of all-gather (ForestColl,
  Zhao et al. 2024): n * min over node sets T holding some but not all ranks of B_out(T) / |T & ranks|,
  by parametric max-flow (:func:`sharded_cut`); reduce-scatter on the reversed graph.
- :func:`certificate`: the bound of each collective (its ``collectives.Collective.certificate``).

The ring rate (:func:`jax_blink.planner.rings.ring_rate`) is the rings' packing, not a bound.
"""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
from networkx.algorithms.flow import build_residual_network, edmonds_karp, preflow_push
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from ..errors import PlanError, TopologyError
from ..topology.model import Topology

FLOW_SCALE = 1000  # capacities in MB/s: integral for link rates given to 1e-3 GB/s (scipy's max-flow is integral)


def _checked(topology: Topology, devices) -> list:
    """``devices`` as a list of GPU ids of ``topology`` (a string like "0,1" or "0-3" is parsed);
    PlanError for a non-Topology, ids that are not its GPUs, non-integers or duplicates."""
    if not isinstance(topology, Topology):
        raise PlanError(f"expected a jax_blink.Topology (e.g. jax_blink.load_topology('dgx1v')), got "
                        f"{type(topology).__name__}")
    try:
        return topology.check_devices(devices)
    except TopologyError as err:  # names the bad device
        raise PlanError(str(err)) from None


def _job_graph(topology: Topology, devices, relays=(), root=None) -> nx.DiGraph:
    """The job's physical graph (devices checked by :func:`_checked`); PlanError for a ``root``
    that is not one of the devices."""
    devices = _checked(topology, devices)
    if root is not None and (isinstance(root, bool) or root not in devices):
        raise PlanError(f"root {root!r} is not among devices {devices}; pass one of them")
    try:
        return topology.subset(devices + list(relays)).graph
    except TopologyError as err:  # bad relays
        raise PlanError(str(err)) from None


def _max_flows(g: nx.DiGraph, pairs) -> list:
    """Max-flow values (GB/s, capacities ``bandwidth_gbps``) of the (source, sink) ``pairs`` of ``g``.

    scipy's Dinic max-flow (C, one sparse graph for all pairs) on capacities in MB/s when every
    capacity is a whole number of MB/s (then exact); networkx's preflow-push on a reused residual
    network otherwise."""
    nodes = list(g)
    idx = {v: i for i, v in enumerate(nodes)}
    edges = list(g.edges(data="bandwidth_gbps"))
    caps = np.array([c for _, _, c in edges], dtype=np.float64)
    scaled = np.round(caps * FLOW_SCALE)
    if np.all(np.abs(scaled - caps * FLOW_SCALE) <= 1e-6 * np.maximum(1.0, scaled)) \
            and scaled.sum() < np.iinfo(np.int32).max:
        m = csr_matrix((scaled.astype(np.int32), ([idx[u] for u, _, _ in edges], [idx[v] for _, v, _ in edges])),
                       shape=(len(nodes), len(nodes)))
        return [maximum_flow(m, idx[s], idx[t]).flow_value / FLOW_SCALE for s, t in pairs]
    residual = build_residual_network(g, "bandwidth_gbps")
    return [nx.maximum_flow_value(g, s, t, capacity="bandwidth_gbps", flow_func=preflow_push, residual=residual)
            for s, t in pairs]


def broadcast_bound(topology: Topology, devices, root: int, relays=()) -> float:
    """Upper bound (and, by Edmonds, the optimum) of broadcast rate from ``root``, GB/s.

    min over v in ``devices`` minus root of maxflow(root -> v) in the job's physical graph
    (``topology.subset(devices + relays)``; capacities ``bandwidth_gbps``; ``relays``: GPUs outside
    the job allowed to forward). inf for one device.
    """
    devices = _checked(topology, devices)
    g = _job_graph(topology, devices, relays, root)
    vals = _max_flows(g, [(root, v) for v in devices if v != root])
    return float(min(vals)) if vals else float("inf")


def reduce_bound(topology: Topology, devices, root: int, relays=()) -> float:
    """Reduce-to-``root`` rate bound, GB/s: :func:`broadcast_bound` on the reversed graph."""
    devices = _checked(topology, devices)
    g = _job_graph(topology, devices, relays, root)
    vals = _max_flows(g, [(v, root) for v in devices if v != root])
    return float(min(vals)) if vals else float("inf")


def allreduce_bound(topology: Topology, devices, relays=()) -> float:
    """min over ordered GPU pairs of maxflow(u -> v), GB/s: bounds any all-reduce tree packing
    (each undirected tree is a broadcast arborescence from any of its GPUs). Uses 2(n-1) flows from a
    fixed GPU (a minimum directed cut separates that GPU from some v, one way or the other); n-1
    when every link has a reverse link of the same bandwidth (then every cut has equal capacity both
    ways, so maxflow(u -> v) = maxflow(v -> u))."""
    devices = _checked(topology, devices)
    if len(devices) < 2:
        return float("inf")
    g = _job_graph(topology, devices, relays)
    r = devices[0]
    pairs = [(r, v) for v in devices[1:]]
    bw = nx.get_edge_attributes(g, "bandwidth_gbps")
    if any(bw.get((v, u)) != c for (u, v), c in bw.items()):
        pairs += [(v, r) for v in devices[1:]]
    return float(min(_max_flows(g, pairs)))


def sharded_cut(topology: Topology, devices, *, reverse: bool = False, relays=(),
                weights=None) -> tuple[float, frozenset]:
    """The exact all-gather cut bound per root and a node set attaining it.

    x* = min over node sets T of the job graph (GPUs and switch nodes, ``topology.subset(devices +
    relays)``) holding some but not all ranks of B_out(T) / |T & ranks| (GB/s per root); with
    ``reverse=True`` B_in(T) (reduce-scatter: all-gather on the reversed graph). Exact method
    (ForestColl, Zhao et al. 2024, section 5): add a source s with an arc s -> r of capacity y to
    every rank r; y is feasible iff maxflow(s, t) >= n y for every rank t (a cut {s} u T, t not in
    T, costs y (n - |T & ranks|) + B_out(T)). Dinkelbach iteration: start at the best single-rank
    ratio; while some rank t has maxflow(s, t) < n y, its minimum cut T has a smaller ratio: y :=
    ratio(T). Each y is the ratio of a real set, so the final y is the exact minimum.

    ``weights``: {rank: positive weight} (default 1 each): the ratio's denominator is the weight of
    ``T & ranks`` (the source arcs carry y w_r). A rank of weight k stands for k ranks beyond a cut
    vertex: :func:`jax_blink.planner.symmetric.sharded_bounds` contracts the other N - 1 nodes of
    a cluster of identical nodes into the network node with weight (N - 1) G.

    Returns (x*, T) with T the minimising node set; (inf, frozenset()) for one rank.
    """
    devices = list(devices)
    n = len(devices)
    wt = {r: 1.0 for r in devices} if weights is None else {r: float(weights[r]) for r in devices}
    total = sum(wt.values())
    if n < 2:
        return float("inf"), frozenset()
    g = _job_graph(topology, devices, relays)
    if reverse:  # as g.reverse(copy=True), whose deep copy of each link's attribute dict cost 0.2 s at 64 GPUs
        r = nx.DiGraph()
        r.add_nodes_from((v, dict(d)) for v, d in g.nodes.items())
        r.add_edges_from((b, a, dict(d)) for a, b, d in g.edges(data=True))
        g = r
    else:
        g = nx.DiGraph(g)
    src = ("cut-source",)
    cap = lambda a, b: g.edges[a, b]["bandwidth_gbps"]  # noqa: E731

    def ratio(t_set):
        out = sum(cap(a, b) for a in t_set for b in g.successors(a) if b not in t_set)
        return out / sum(wt[r] for r in t_set.intersection(devices))

    # start from the best of the usual binding sets (one rank; everything but one rank), so the
    # iteration mostly only verifies: n max-flows
    everything = frozenset(g)
    starts = [frozenset([r]) for r in devices] + [everything - {r} for r in devices]
    best = min(starts, key=ratio)
    y = ratio(best)
    while True:
        for r in devices:
            g.add_edge(src, r, bandwidth_gbps=y * wt[r])
        residual = build_residual_network(g, "bandwidth_gbps")
        for t in devices:
            val, (side, _) = nx.minimum_cut(g, src, t, capacity="bandwidth_gbps", flow_func=edmonds_karp,
                                            residual=residual)
            if val < total * y * (1 - 1e-12):
                t_set = frozenset(side) - {src}
                if ratio(t_set) < y:
                    best, y = t_set, ratio(t_set)
                    break
        else:
            return y, best


def allgather_bound(topology: Topology, devices, relays=()) -> float:
    """All-gather rate bound (exact: the optimal tree packing reaches it), GB/s of gathered data.

    n * min over node sets T holding some but not all of the n ranks of B_out(T) / |T & ranks|
    (ForestColl, Zhao et al. 2024, sections 4-5; switch nodes are ordinary nodes): the ranks in T
    must send their |T & ranks| shards out of T. See :func:`sharded_cut`. inf for one device.
    """
    return len(list(devices)) * sharded_cut(topology, devices, relays=relays)[0]


def reducescatter_bound(topology: Topology, devices, relays=()) -> float:
    """Reduce-scatter rate bound, GB/s: :func:`allgather_bound` on the reversed graph (B_in(T))."""
    return len(list(devices)) * sharded_cut(topology, devices, reverse=True, relays=relays)[0]


def _partitions(items):
    """All set partitions of a list (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        yield [[first]] + p
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1:]


def nash_williams_value(topology: Topology, devices) -> float:
    """Undirected fractional spanning-tree packing optimum over the direct GPU-GPU links, GB/s.

    min over partitions P of ``devices`` with |P| >= 2 of sum of min(cap(u->v), cap(v->u)) over direct
    links crossing P, divided by |P| - 1 (Nash-Williams 1961, Tutte 1961; each all-reduce tree uses
    both directions of a link). Ignores switch nodes: it is the all-reduce optimum on direct-link
    topologies only. Brute force over Bell(n) partitions: raises PlanError above 10 devices or for
    devices that are not GPUs of ``topology``.
    """
    devices = _checked(topology, devices)
    if len(devices) > 10:
        raise PlanError(f"nash_williams_value is brute force; {len(devices)} devices is too many (max 10)")
    if len(devices) < 2:
        return float("inf")
    g = topology.graph
    pairs = [(u, v, min(g.edges[u, v]["bandwidth_gbps"], g.edges[v, u]["bandwidth_gbps"]))
             for u, v in itertools.combinations(devices, 2) if g.has_edge(u, v) and g.has_edge(v, u)]
    best = float("inf")
    for p in _partitions(devices):
        if len(p) < 2:
            continue
        part = {d: i for i, blk in enumerate(p) for d in blk}
        cross = sum(c for u, v, c in pairs if part[u] != part[v])
        best = min(best, cross / (len(p) - 1))
    return best


def certificate(topology, collective: str, devices, root, relays=()) -> float:
    """The max-flow / cut certificate of ``collective`` over ``devices`` (``collectives.Collective.certificate``),
    GB/s: :func:`broadcast_bound`, :func:`reduce_bound`, :func:`allreduce_bound`, :func:`allgather_bound` or
    :func:`reducescatter_bound`; ``relays``: GPUs outside the job allowed to forward."""
    return {"broadcast": lambda: broadcast_bound(topology, devices, root, relays),
            "reduce": lambda: reduce_bound(topology, devices, root, relays),
            "allreduce": lambda: allreduce_bound(topology, devices, relays),
            "allgather": lambda: allgather_bound(topology, devices, relays),
            "reducescatter": lambda: reducescatter_bound(topology, devices, relays)}[collective]()
