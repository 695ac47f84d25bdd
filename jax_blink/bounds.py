"""Certificates and baselines for tree packings: max-flow bounds, the Nash-Williams value, ring rate.

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
- :func:`ring_rate`: the best packing of directed Hamiltonian cycles (NCCL-style rings), by column
  generation with exact pricing (all cycles) for up to 9 GPUs, a 2-opt heuristic above that.
"""

from __future__ import annotations

import functools
import itertools

import networkx as nx
import numpy as np
from networkx.algorithms.flow import build_residual_network, edmonds_karp, preflow_push
from scipy.optimize import linprog
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from .errors import PlanError, TopologyError
from .routes import RouteTable, _pricer
from .topology import Topology

EXACT_RING_MAX_GPUS = 9
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


def sharded_cut(topology: Topology, devices, *, reverse: bool = False, relays=()) -> tuple[float, frozenset]:
    """The exact all-gather cut bound per root and a node set attaining it.

    x* = min over node sets T of the job graph (GPUs and switch nodes, ``topology.subset(devices +
    relays)``) holding some but not all ranks of B_out(T) / |T & ranks| (GB/s per root); with
    ``reverse=True`` B_in(T) (reduce-scatter: all-gather on the reversed graph). Exact method
    (ForestColl, Zhao et al. 2024, section 5): add a source s with an arc s -> r of capacity y to
    every rank r; y is feasible iff maxflow(s, t) >= n y for every rank t (a cut {s} u T, t not in
    T, costs y (n - |T & ranks|) + B_out(T)). Dinkelbach iteration: start at the best single-rank
    ratio; while some rank t has maxflow(s, t) < n y, its minimum cut T has a smaller ratio: y :=
    ratio(T). Each y is the ratio of a real set, so the final y is the exact minimum.

    Returns (x*, T) with T the minimising node set; (inf, frozenset()) for one rank.
    """
    devices = list(devices)
    n = len(devices)
    if n < 2:
        return float("inf"), frozenset()
    g = _job_graph(topology, devices, relays)
    if reverse:
        g = g.reverse(copy=True)
    g = nx.DiGraph(g)
    src = ("cut-source",)
    cap = lambda a, b: g.edges[a, b]["bandwidth_gbps"]  # noqa: E731

    def ratio(t_set):
        out = sum(cap(a, b) for a in t_set for b in g.successors(a) if b not in t_set)
        return out / len(t_set.intersection(devices))

    # start from the best of the usual binding sets (one rank; everything but one rank), so the
    # iteration mostly only verifies: n max-flows
    everything = frozenset(g)
    starts = [frozenset([r]) for r in devices] + [everything - {r} for r in devices]
    best = min(starts, key=ratio)
    y = ratio(best)
    while True:
        for r in devices:
            g.add_edge(src, r, bandwidth_gbps=y)
        residual = build_residual_network(g, "bandwidth_gbps")
        for t in devices:
            val, (side, _) = nx.minimum_cut(g, src, t, capacity="bandwidth_gbps", flow_func=edmonds_karp,
                                            residual=residual)
            if val < n * y * (1 - 1e-12):
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


# ----------------------------------------------------------------------------- rings
@functools.lru_cache(maxsize=16)
def _cycles(n: int) -> np.ndarray:
    """All directed Hamiltonian cycles on 0..n-1 starting at 0: int array [(n-1)!, n]."""
    return np.array([(0,) + p for p in itertools.permutations(range(1, n))], dtype=np.int64)


def _two_opt_cycle(w: np.ndarray) -> list | None:
    """A cheap directed Hamiltonian cycle on cost matrix ``w`` (inf = no route): nearest neighbour
    from up to 4 starts, then best-improvement 2-opt (segment reversal, asymmetric costs, all moves
    scored at once with NumPy). Deterministic; None when no finite cycle is found."""
    n = len(w)
    big = np.where(np.isfinite(w), w, 1e12)
    best, best_cost = None, np.inf
    ii, jj = np.triu_indices(n, 1)
    keep = (ii >= 1) & (jj <= n - 1)
    ii, jj = ii[keep], jj[keep]
    for s in range(min(n, 4)):
        tour, left = [s], set(range(n)) - {s}
        while left:
            nxt = min(left, key=lambda j: (big[tour[-1], j], j))
            tour.append(nxt)
            left.discard(nxt)
        t = np.array(tour)
        for _ in range(10 * n):
            nx_ = np.roll(t, -1)
            f = big[t, nx_]                        # f[k] = cost t[k] -> t[k+1]
            bk = big[nx_, t]                       # reversed edge cost
            d = np.concatenate([[0.0], np.cumsum(bk - f)])
            prev, nxtj = t[ii - 1], t[(jj + 1) % n]
            delta = (big[prev, t[jj]] + big[t[ii], nxtj] - f[ii - 1] - f[jj] + d[jj] - d[ii])
            k = int(np.argmin(delta))
            if delta[k] >= -1e-9:
                break
            i, j = ii[k], jj[k]
            t = np.concatenate([t[:i], t[i:j + 1][::-1], t[j + 1:]])
        c = float(big[t, np.roll(t, -1)].sum())
        if c < best_cost - 1e-12:
            best, best_cost = [int(x) for x in t], c
    return best if best_cost < 1e11 else None


def ring_packing(topology: Topology, devices, table: RouteTable | None = None):
    """Best packing of directed Hamiltonian cycles (rings) over the job's GPU-level routes.

    LP: maximise sum_c b_c s.t. for every directed link e, sum_c usage_c(e) b_c <= cap(e); column
    generation with pricing = cheapest Hamiltonian cycle under dual link prices (exact enumeration
    for <= EXACT_RING_MAX_GPUS GPUs, nearest-neighbour + 2-opt above: then a feasible, possibly
    suboptimal ring packing). Returns (rate_gbps, [(cycle as list of GPUs, [route per hop], b_gbps)]).
    Returns (0.0, []) when no Hamiltonian cycle exists (e.g. GPUs behind a one-way link).
    """
    devices = tuple(devices)
    n = len(devices)
    if n < 2:
        return float("inf"), []
    table = table or RouteTable.build(topology, devices)
    nl = len(table.links)
    pricer = _pricer(table, "arborescence")

    def price(y):
        w, pick = pricer.costs(y)
        if n <= EXACT_RING_MAX_GPUS:
            cyc = _cycles(n)
            tot = w[cyc, np.roll(cyc, -1, axis=1)].sum(axis=1)
            i = int(np.argmin(tot))
            if not np.isfinite(tot[i]):
                return None
            tour = list(cyc[i])
        else:
            tour = _two_opt_cycle(w)
            if tour is None:
                return None
        cycle = [devices[i] for i in tour]
        routes, usage = [], np.zeros(nl, dtype=np.int64)
        for a, b in zip(tour, tour[1:] + tour[:1]):
            r, use = pricer.edge(a, b, pick)
            routes.append(r)
            usage += use
        return (tuple(cycle), tuple(routes)), usage

    first = price(np.ones(nl))
    if first is None:
        return 0.0, []
    cols, seen = [first], {first[0]}
    for _ in range(500):
        a = np.stack([c[1] for c in cols], axis=1).astype(np.float64)
        res = linprog(-np.ones(len(cols)), A_ub=a, b_ub=table.cap, bounds=(0, None), method="highs")
        y = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)
        col = price(y)
        if col is None or float(col[1] @ y) >= 1.0 - 1e-9 or col[0] in seen:
            break
        cols.append(col)
        seen.add(col[0])
    rings = [(list(c[0][0]), list(c[0][1]), float(x)) for c, x in zip(cols, res.x) if x > 1e-9]
    return float(-res.fun), rings


def ring_rate(topology: Topology, devices) -> float:
    """Total bandwidth B_ring (GB/s) of the best ring packing over ``devices`` (see :func:`ring_packing`).

    Ring all-reduce of S bytes then takes 2(n-1)/n * S / B_ring (NCCL; nccl-tests PERFORMANCE.md);
    a ring broadcast or reduce pipelines at B_ring. inf for one device, 0.0 when no ring exists.
    """
    if not isinstance(topology, Topology):
        raise PlanError(f"ring_rate needs a jax_blink.Topology, got {type(topology).__name__}; load one with "
                        "jax_blink.load_topology(...)")
    return ring_packing(topology, _checked(topology, devices))[0]
