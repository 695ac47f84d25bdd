"""Rings: the LP ring packing, ring plans for every collective, and NCCL's ring choice.

- :func:`ring_packing`: the best packing of directed Hamiltonian cycles (rings) over the job's
  GPU-level routes (NVLink, PCIe, host, NVSwitch), by column generation
  (:func:`jax_blink.planner.colgen.column_generation`) with exact pricing (all cycles) for up to
  EXACT_RING_MAX_GPUS GPUs, nearest neighbour + 2-opt above; :func:`ring_rate` its bandwidth.
- :func:`ring_plan`: a ring packing as a :class:`~jax_blink.planner.model.Plan`. All-reduce is NCCL's
  ring algorithm (reduce-scatter + all-gather: per ring, one tree per GPU); all-gather /
  reduce-scatter send each shard n-1 hops along the ring; broadcast and reduce pipeline a chain
  along each ring from / to the root. The LP may mix fractional and NVLink/PCIe rings: at least as
  fast as any ring on the same links.
- :func:`nccl_ring_plan`: rings on the links NCCL's search uses (:func:`nccl_links`): NVLink (direct
  or through an NVSwitch) when those links hold a ring through every GPU of the job, otherwise PCIe /
  inter-socket links only. NCCL falls back to PCIe rings when it cannot close an NVLink ring (Blink,
  MLSys 2020, s. 2: the source of its largest speedups on fragmented DGX-1 allocations).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os

import networkx as nx
import numpy as np

from .. import collectives as _collectives
from ..errors import PlanError
from ..topology.model import Topology
from .bounds import _checked, allreduce_bound, broadcast_bound, certificate, reduce_bound
from .colgen import column_generation
from .minimize import fewest_trees
from .model import Plan, Tree, _hops, _parse_routes, _round, cached, clear_on_reset, job_devices, plan_cache
from .routes import Column, RouteTable, pricer

EXACT_RING_MAX_GPUS = 9
NVLINK_KINDS = ("nvlink", "nvswitch")
_RING_PLANS = plan_cache()


# ------------------------------------------------------------------------------ the ring packing
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


def ring_packing(topology: Topology, devices, table: RouteTable | None = None, max_rings: int | None = None):
    """Best packing of directed Hamiltonian cycles (rings) over the job's GPU-level routes.

    LP: maximise sum_c b_c s.t. for every directed link e, sum_c usage_c(e) b_c <= cap(e); column
    generation (:func:`jax_blink.planner.colgen.column_generation`, at most 500 rounds) with pricing =
    cheapest Hamiltonian cycle under dual link prices (exact enumeration for <= EXACT_RING_MAX_GPUS
    GPUs, nearest-neighbour + 2-opt above: then a feasible, possibly suboptimal ring packing).
    ``max_rings``: at most this many rings, the largest total bandwidth over the generated rings (the
    tree-count ILP of :func:`jax_blink.planner.minimize.fewest_trees` with ``max_trees``).
    Returns (rate_gbps, [(cycle as list of GPUs, [route per hop], b_gbps)]). Returns (0.0, []) when
    no Hamiltonian cycle exists (e.g. GPUs behind a one-way link).
    """
    devices = tuple(devices)
    n = len(devices)
    if n < 2:
        return float("inf"), []
    table = table or RouteTable.build(topology, devices)
    nl = len(table.links)
    pr = pricer(table, "arborescence")

    def cheapest(y):
        """The cheapest ring under link prices ``y`` as a Column with edges (cycle, routes); None if none."""
        w, pick = pr.costs(y)
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
            r, use = pr.edge(a, b, pick)
            routes.append(r)
            usage += use
        return Column((tuple(cycle), tuple(routes)), usage)

    first = cheapest(np.ones(nl))
    if first is None:
        return 0.0, []

    def price(y):
        col = cheapest(y)
        return [] if col is None else [(None, col)]

    res = column_generation(table.cap, price, start=[(None, first)], max_iterations=500, what="ring packing",
                            devices=devices)
    weights = res.weights
    if max_rings is not None and np.count_nonzero(weights > 1e-9) > max_rings:
        weights = fewest_trees(table.cap, res.columns, res.rate, max_rings, weights)
        if weights is None:
            raise PlanError(f"no packing of at most {max_rings} ring(s) over devices {list(devices)} found "
                            "(the count-limited ILP failed)")
    rings = [(list(c.edges[0]), list(c.edges[1]), float(x)) for c, x in zip(res.columns, weights) if x > 1e-9]
    return (res.rate if weights is res.weights else float(sum(b for *_, b in rings))), rings


def ring_rate(topology: Topology | str | os.PathLike, devices) -> float:
    """Total bandwidth B_ring (GB/s) of the best ring packing over ``devices`` (see :func:`ring_packing`).

    ``topology``: a Topology, or what ``jax_blink.load_topology`` takes (a preset name such as
    "dgx1v", a topology file), as for ``jax_blink.plan``. Ring all-reduce of S bytes then takes
    2(n-1)/n * S / B_ring (NCCL; nccl-tests PERFORMANCE.md); a ring broadcast or reduce pipelines at
    B_ring. inf for one device, 0.0 when no ring exists. Raises PlanError for anything else as
    ``topology`` and TopologyError for a name or file that does not load.
    """
    if isinstance(topology, (str, os.PathLike)):
        topology = Topology.load(topology)
    if not isinstance(topology, Topology):
        raise PlanError(f"ring_rate needs a jax_blink.Topology or a preset name / topology file, got "
                        f"{type(topology).__name__}; load one with jax_blink.load_topology(...)")
    return ring_packing(topology, _checked(topology, devices))[0]


# ------------------------------------------------------------------------------ rings as trees
def ring_paths(cycle, routes, start) -> tuple:
    """The ring ``cycle`` (GPU order, ``routes`` its hop paths to the next GPU) walked from ``start``.

    Returns ``(bcast, reduce)`` hop tuples in the Tree format: the broadcast path along the ring from
    ``start`` to the GPU before it, and the reduce in-path along the same direction ending at
    ``start`` (the data of a ring all-reduce segment, NCCL)."""
    nxt = {r[0]: r for r in routes}  # GPU -> its route to the next GPU on the ring
    k = cycle.index(start)
    order = cycle[k:] + cycle[:k]
    bcast = tuple(h for x in order[:-1] for h in _hops(nxt[x]))
    reduce = tuple(h for x in order[1:] for h in _hops(nxt[x][::-1]))
    return bcast, reduce


def _ring_trees(rings, n) -> list:
    """A ring packing as all-reduce trees: per ring of bandwidth b and per GPU v, a tree rooted at v
    of weight b / (2(n-1)) whose reduce is the in-path along the ring ending at v and whose broadcast
    is the path along the ring from v (reduce-scatter + all-gather on a ring, NCCL)."""
    trees = []
    for cycle, routes, b in rings:
        for v in cycle:
            bc, red = ring_paths(cycle, routes, v)
            trees.append(Tree(v, _round(b / (2 * (n - 1))), bc, red))
    return trees


def _sharded_ring_trees(rings, n, reduces: bool) -> list:
    """A ring packing as all-gather (``reduces=False``) or reduce-scatter trees: per ring of
    bandwidth b and per GPU v, one chain of weight b / (n - 1) rooted at v. All-gather: v's shard
    travels n - 1 hops along the ring from v; reduce-scatter: shard v is summed along the ring and
    ends at v (NCCL's ring; edges in broadcast direction, data flowing child -> parent). Every ring
    link carries n - 1 chains: load b."""
    trees = []
    for cycle, routes, b in rings:
        for v in cycle:
            bc, red = ring_paths(cycle, routes, v)
            # the in-path lists its routes leaf first; a Tree lists them root first
            hops = tuple(h for r in reversed(_parse_routes(red)) for h in _hops(r)) if reduces else bc
            trees.append(Tree(v, _round(b / (n - 1)), hops))
    return trees


def _max_rings(devices, max_trees) -> int | None:
    """The rings ``max_trees`` allows (a ring over n GPUs runs as n trees), None for no limit; PlanError
    when it allows none."""
    n = len(devices)
    if max_trees is None:
        return None
    if max_trees < n:
        raise PlanError(f"a ring over {n} GPUs runs as {n} trees (one per rank): max_trees={max_trees} allows no "
                        f"ring; use max_trees >= {n} (k rings: k*{n}) or another algorithm")
    return max_trees // n


def _check_rings(topology, devices, b_ring: float) -> None:
    """PlanError when a forced ring plan cannot be built: no ring through every GPU."""
    if b_ring <= 0:
        raise PlanError(f"no ring (cycle through every GPU) over devices {list(devices)} on the links of "
                        f"{topology.name!r}")


def _limit_note(devices, max_trees, rings) -> tuple:
    """The note of a ring plan limited by ``max_trees`` (empty without a limit)."""
    if max_trees is None:
        return ()
    return (f"max_trees={max_trees}: at most {max_trees // len(devices)} ring(s) of {len(devices)} trees each; "
            f"{len(rings)} used",)


def allreduce_ring_plan(devices, b_ring: float, rings, ring_cap: float, notes: list, what: str) -> Plan:
    """A ring packing (:func:`ring_packing`'s ``b_ring``, ``rings``) as an all-reduce plan: rate
    n B / (2(n-1)); bound max(``ring_cap``, rate) with ``ring_cap`` = n B_max / (2(n-1)), B_max <= the
    min max-flow between GPUs (no ring packing beats it). ``what`` heads the note appended to ``notes``
    (why rings: forced, or faster than the trees)."""
    n = len(devices)
    ring_rate_ = n * b_ring / (2 * (n - 1)) if b_ring > 0 else 0.0
    notes.append(f"{what}: rings of {b_ring:.3f} GB/s give all-reduce rate n*B/(2(n-1)) = {ring_rate_:.3f} GB/s")
    rtrees = _ring_trees(rings, n)
    return Plan("allreduce", None, tuple(devices), tuple(rtrees), _round(sum(t.weight_gbps for t in rtrees)),
                _round(max(ring_cap, ring_rate_)), "ring", tuple(notes))


def _forced_allreduce_ring_plan(topology, devices, max_trees) -> Plan:
    """``algorithm="ring"`` for all-reduce: the LP ring packing (no tree packing needed)."""
    n = len(devices)
    table = RouteTable.build(topology, devices)
    table.check_connected("allreduce plan")
    # any ring crosses every directed cut between job GPUs, so B_ring <= min max-flow between GPUs
    ring_cap = n * allreduce_bound(topology, devices) / (2 * (n - 1))
    b_ring, rings = ring_packing(topology, devices, table, _max_rings(devices, max_trees))
    _check_rings(topology, devices, b_ring)
    # this is also how the cost model and the baselines build their ring candidate: describe the
    # packing, never claim the user asked for it
    return allreduce_ring_plan(devices, b_ring, rings, ring_cap, list(_limit_note(devices, max_trees, rings)),
                               "ring packing (algorithm='ring')")


def _sharded_ring_plan(topology, collective, devices, max_trees) -> Plan:
    """The LP ring packing (:func:`ring_packing`) run as an all-gather / reduce-scatter ring:
    rate n B / (n - 1) for total ring bandwidth B, certificate the cut bound."""
    n = len(devices)
    bound = certificate(topology, collective, devices, None)
    table = RouteTable.build(topology, devices)
    table.check_connected(f"{collective} ring plan")
    b_ring, rings = ring_packing(topology, devices, table, _max_rings(devices, max_trees))
    _check_rings(topology, devices, b_ring)
    trees = _sharded_ring_trees(rings, n, _collectives.get(collective).reduces)
    rate = _round(sum(t.weight_gbps for t in trees))
    note = (f"ring: {len(rings)} ring(s) of {b_ring:.3f} GB/s in total; each shard travels n-1 = {n - 1} hops, "
            f"rate n*B/(n-1) = {rate:.3f} GB/s; cut bound on the links of {topology.name!r}: {bound:.3f} GB/s",
            *_limit_note(devices, max_trees, rings))
    return Plan(collective, None, devices, tuple(trees), rate, _round(bound), "ring", note)


def packed_ring_plan(topology: Topology, collective: str, devices: tuple, max_trees: int | None = None) -> Plan:
    """``plan(algorithm="ring")`` for all-reduce, all-gather or reduce-scatter over ``devices`` (a
    validated tuple of two or more GPU ids), cached: the LP ring packing as NCCL's ring algorithm.
    ``max_trees``: at most max_trees // n rings (each runs as n trees), the largest total bandwidth.
    Raises PlanError when no ring passes through every GPU or ``max_trees`` < n."""
    def make():
        if collective == "allreduce":
            return _forced_allreduce_ring_plan(topology, devices, max_trees)
        return _sharded_ring_plan(topology, collective, devices, max_trees)

    return cached(_RING_PLANS, (topology.fingerprint(), tuple(devices), collective, max_trees), make)


# ------------------------------------------------------------------------------ ring plans, NCCL's rings
def ring_plan(topology, collective: str = "allreduce", *, devices=None, root=None) -> Plan:
    """NCCL-style ring plan for ``collective`` over ``devices`` (default: all GPUs).

    Returns a Plan with ``algorithm="ring"``. All-reduce: per ring of bandwidth b, n trees of weight
    b / (2(n-1)) (:func:`_ring_trees`), so ``rate_gbps`` = n B / (2(n-1)) and the bandwidth-only
    time is 2(n-1)/n * S / B (B = total ring bandwidth). All-gather / reduce-scatter (NCCL's ring:
    each shard travels n-1 hops): per ring and GPU, a chain of weight b / (n-1) rooted at that GPU,
    ``rate_gbps`` = n B / (n-1), time (n-1)/n * S / B for the full buffer S. Broadcast / reduce: per
    ring, a chain of weight b from / to ``root`` along the ring, ``rate_gbps`` = B.
    Raises PlanError: unknown collective, bad devices or root, GPUs with no ring between them.
    """
    if collective not in _collectives.COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; expected one of {tuple(_collectives.COLLECTIVES)}")
    sharded = _collectives.get(collective).sharded
    if sharded and root is not None:
        raise PlanError(f"{collective} has no root (every rank owns one shard); got root={root!r}")
    devices = job_devices(topology, devices)
    n = len(devices)
    if collective != "allreduce" and not sharded:
        root = devices[0] if root is None else root
        if root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}")
    else:
        root = None
    if n == 1:
        return Plan(collective, root, devices, (), math.inf, math.inf, "trivial", ("one device",))
    if collective == "allreduce" or sharded:
        return packed_ring_plan(topology, collective, devices)
    b_ring, rings = ring_packing(topology, devices)
    if not rings:
        raise PlanError(f"no ring over devices {list(devices)}: some GPUs cannot reach each other")
    note = (f"ring packing: {len(rings)} ring(s), {b_ring:.3f} GB/s in total",)
    trees = []
    for cycle, routes, b in rings:
        chain, red = ring_paths(cycle, routes, root)
        # reduce flows along the ring into the root: the GPU after it -> ... -> root
        trees.append(Tree(root, b, chain) if collective == "broadcast" else Tree(root, b, chain, red))
    bound = (broadcast_bound if collective == "broadcast" else reduce_bound)(topology, devices, root)
    return Plan(collective, root, devices, tuple(trees), b_ring, bound, "ring", note)


def _links_of_kind(topology: Topology, keep) -> Topology:
    """``topology`` with only the links whose kind is in (or, ``keep=None``, not in) NVLINK_KINDS."""
    g = nx.DiGraph()
    g.add_nodes_from(topology.graph.nodes(data=True))
    g.add_edges_from((u, v, d) for u, v, d in topology.graph.edges(data=True)
                     if (d["kind"] in NVLINK_KINDS) == keep)
    t = Topology(f"{topology.name}:{'nvlink' if keep else 'pcie'}")
    t.graph = g
    return t


@clear_on_reset
@functools.lru_cache(maxsize=256)
def _nccl_level(topology: Topology, devices: tuple) -> str:
    """"nvlink" when NVLink links alone close a ring through ``devices``, else "pcie" when the other
    links do, else "any" (a topology without a PCIe tree: rings over every link)."""
    for level, keep in (("nvlink", True), ("pcie", False)):
        sub = _links_of_kind(topology, keep)
        if ring_packing(sub, devices)[0] > 0:
            return level
    return "any"


def nccl_links(topology: Topology, devices=None) -> tuple[Topology, str]:
    """The links NCCL builds rings on for ``devices``: (topology restricted to them, level).

    Level "nvlink": NVLink / NVSwitch links only (they hold a ring through every GPU); "pcie": PCIe,
    CPU and inter-socket links only (NCCL's fallback when no NVLink ring exists); "any": every link
    (neither alone holds a ring). Raises PlanError for bad devices.
    """
    devices = job_devices(topology, devices)
    if len(devices) < 2:
        return topology, "any"
    level = _nccl_level(topology, devices)
    return (topology if level == "any" else _links_of_kind(topology, level == "nvlink")), level


def _nccl_note(plan_: Plan, level: str, what: str) -> Plan:
    why = {"nvlink": "NVLink links close a ring through every GPU",
           "pcie": "no NVLink ring through every GPU: NCCL falls back to PCIe / inter-socket links",
           "any": "neither NVLink nor PCIe links alone close a ring: every link"}[level]
    return dataclasses.replace(plan_, notes=(f"NCCL {what} on {level} links ({why})",) + plan_.notes)


def _ring_family_bound(topology: Topology, p: Plan) -> float:
    """Upper bound on any ring plan's rate for ``p``'s collective over all links of ``topology``:
    all-reduce n B / (2(n-1)) with B <= the min max-flow between GPUs; all-gather / reduce-scatter
    the cut bound; broadcast / reduce the max-flow bound from / to the root."""
    n = len(p.devices)
    if p.collective == "allreduce":
        return max(p.rate_gbps, n * allreduce_bound(topology, p.devices) / (2 * (n - 1)))
    return max(p.rate_gbps, certificate(topology, p.collective, p.devices, p.root))


def nccl_ring_plan(topology, collective: str = "allreduce", *, devices=None, root=None) -> Plan:
    """NCCL's rings: :func:`ring_plan` over the links of :func:`nccl_links` (the LP packing on those
    links, so at least as fast as NCCL's own equal-speed channels on them). ``bound_gbps`` is the
    bound for rings over all links of ``topology`` (:func:`_ring_family_bound`), not the rate of
    the rings NCCL's restricted search finds. Raises like ring_plan."""
    links, level = nccl_links(topology, devices)
    p = ring_plan(links, collective, devices=devices, root=root)
    if links is not topology and p.trees:
        p = dataclasses.replace(p, bound_gbps=_ring_family_bound(topology, p))
    return _nccl_note(p, level, "rings")
