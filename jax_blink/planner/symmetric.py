"""All-reduce over identical nodes by symmetry: plan one node, compose (Blink s. 5; SyCCL, SIGCOMM 2025).

A cluster of N identical nodes joined through one network fabric (the ``"network"`` node of
:func:`jax_blink.topology.presets.multi_node`; every cross-node route is GPU -> NIC -> network ->
NIC -> GPU) is symmetric under any permutation of its nodes (which GPUs form the nodes, and how
each maps onto node 0: :mod:`jax_blink.topology.symmetry`). The all-reduce tree-packing LP (Blink
s. 4: maximise the total weight of spanning trees, every directed link within capacity) is convex
and invariant under these permutations, so averaging an optimal solution over them gives an
optimal *symmetric* solution, and its dual can be taken symmetric too: one price per link of ONE
node (its GPUs, switches, NICs and NIC-network links; the "contracted graph": the other nodes are
copies, the network one vertex X). The LP then has one row per link of one node, the columns are
trees priced under symmetric prices, and a column's row coefficient is its usage averaged over the
N nodes.

Pricing (exact). Let p(a) be the cheapest price of a route GPU a -> X and back (both directions:
an all-reduce tree uses each of its links both ways) and p* = min_a p(a) at GPU a*. Cut a spanning
tree of all N G GPUs into its intra-node forest (c components per node) and its M - 1 cross edges
(M = N c components; a cross edge a -X- b costs p(a) + p(b)). The cross edges form a tree on the M
components, so their cost is at least sum_C deg(C) p(C) >= sum_C p(C) + (M - 2) p*, with equality
for a star centred at a*. Hence the cheapest tree costs N * MST(H) - 2 p*, where H is ONE node's GPUs
plus X with GPU-X edges of cost p(a) + p*; its averaged usage is that tree's usage minus 2/N of
a*'s route. ``leader="one"`` restricts the columns to one component per node (Blink's three
phases: reduce inside each node onto its leader, exchange among the leaders, broadcast inside):
cost MST(intra) + (2 - 2/N) p*.

Composition. A column is a star of components centred at a* of one node; its usage equals the
average only when every node is the centre for 1/N of the column's weight. Columns with the same
centre route and component count are laid end to end and cut into N equal pieces, piece k
centred at node k (at most columns + N - 1 trees per such group), so every node carries exactly
the averaged load: the plan meets the LP bound, and the bound (the LP dual) is the exact optimum of
the flat packing over all GPUs on the route model of one node (``tests/test_symmetric.py`` checks it
against the flat LP certificate at 2-4 nodes). Cost: an LP over one node's links, pricing on G + 1
vertices, whatever N is. The plan keeps the composition (:class:`~jax_blink.planner.model.ComposedTrees`:
the columns, their weights and the node maps); its O(N) trees of N G GPUs, O(N^2) hops in all, are
built when something iterates them (a schedule, the link-level simulator, JSON). The flow-level cost
model needs one tree per column, the disk cache the columns and weights (checked on one node).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..errors import PlanError
from ..topology.model import Topology, _key
from ..topology.symmetry import NodeStructure, _template, node_structure, node_topology
from .bounds import sharded_cut
from .colgen import column_generation
from .model import WEIGHT_DECIMALS, ComposedTrees, Plan, Tree, _hops, _round, cached, plan_cache, register_composition
from .routes import Column, RouteTable, _spanning_parents, pricer
from .store import _check_tree
from .trees import flat_plan


def encode_structure(struct: NodeStructure) -> dict | None:
    """The JSON-able form of ``struct`` a composed plan's disk-cache entry keeps (:func:`stored_structure`
    reads it back): the network node and, per node, its ids in the order of node 0's (GPUs and
    switches); None when an id is neither an int nor a str (JSON would not give it back)."""
    ids = [v for v in struct.maps[0] if v != struct.network]
    rows = [[m[v] for v in ids] for m in struct.maps]
    if not isinstance(struct.network, str) or any(type(v) not in (int, str) for r in rows for v in r):
        return None
    return {"network": struct.network, "nodes": rows}


def stored_structure(topology: Topology, devices, fingerprint: str, enc) -> tuple:
    """(:class:`NodeStructure`, ``check``) of a composed plan's disk-cache entry: ``enc`` from
    :func:`encode_structure`, or None (then computed: :func:`node_structure`, and ``check`` does
    nothing).

    The entry's key holds the topology's fingerprint, so the structure was computed on this very
    topology when it was written; reading it back costs O(ids) instead of an isomorphism test per node
    (a pass over every link of the cluster). It is checked, not trusted: the network node is one,
    every node's ids exist with node 0's kinds, no id belongs to two nodes, the nodes' GPUs are the
    devices, each node's sorted; ``check(hops)`` (the decoder calls it with every template hop the
    plan's trees use) raises PlanError unless each hop, both ways, is a link of every node with at
    least the template link's bandwidth: with the ids disjoint, each node then carries node 0's load.
    Raises PlanError (or a lookup / type error on a malformed ``enc``) otherwise."""
    if enc is None:
        struct = node_structure(topology, devices, fingerprint)
        if struct is None:
            raise PlanError("composed plan entry: the devices are not identical nodes on this topology")
        return struct, lambda hops: None
    g = topology.graph
    kinds = g._node
    net, rows = enc["network"], [list(r) for r in enc["nodes"]]
    if kinds[net]["kind"] != "network" or len(rows) < 2 or len({len(r) for r in rows}) != 1:
        raise PlanError("composed plan entry: bad node structure (network node or node sizes)")
    flat = [v for r in rows for v in r]
    if len(set(flat)) != len(flat) or net in set(flat):
        raise PlanError("composed plan entry: an id belongs to two nodes")
    kind0 = [kinds[v]["kind"] for v in rows[0]]
    gpu_at = sorted((i for i, k in enumerate(kind0) if k == "gpu"), key=lambda i: rows[0][i])
    # switch positions: looked up per node; GPU positions: the devices exactly (checked below), all GPUs
    other_at = [i for i, k in enumerate(kind0) if k != "gpu"]
    other_kinds = [kind0[i] for i in other_at]
    groups = []
    for r in rows:
        if [kinds[r[i]]["kind"] for i in other_at] != other_kinds:
            raise PlanError("composed plan entry: a node's ids are not of node 0's kinds")
        gs = tuple(r[i] for i in gpu_at)
        if list(gs) != sorted(gs):
            raise PlanError("composed plan entry: a node's GPUs are not in node 0's order")
        groups.append(gs)
    devices = tuple(devices)
    gpus = topology.gpus
    if sorted(d for gs in groups for d in gs) != sorted(devices) or len(set(devices)) != len(devices) \
            or not set(devices) <= set(gpus):
        raise PlanError("composed plan entry: the nodes' GPUs are not the devices")
    x_id = max(gpus) + 1
    job = topology.graph if len(devices) == len(gpus) else topology.subset(devices).graph  # as _job_graph
    maps = tuple({**dict(zip(rows[0], r)), net: net} for r in rows)
    struct = NodeStructure(tuple(groups), net, maps, _template(topology, job, rows[0], net, x_id), x_id, fingerprint)
    succ, tg = g._succ, struct.template.graph

    at = {v: i for i, v in enumerate(rows[0])}
    ids = {}  # template id -> its id in every node (columns of ``rows``; X is X in all)

    def across(v):
        if v not in ids:
            ids[v] = [net] * len(rows) if v == x_id else [r[at[v]] for r in rows]
        return ids[v]

    def check(hops):
        for a, b in {h for ab in hops for h in (ab, ab[::-1])}:
            cap = tg.edges[a, b]["bandwidth_gbps"] * (1 - 1e-9)
            # one comprehension per hop over the nodes (the hot loop of a 1,024-GPU load)
            bad = [(u, v) for u, v in zip(across(a), across(b))
                   if (d := succ[u].get(v)) is None or not d["bandwidth_gbps"] >= cap]
            if bad:
                u, v = bad[0]
                raise PlanError(f"composed plan entry: hop {u}->{v} is not a link of the node's bandwidth")
    return struct, check


# ------------------------------------------------------------------------------ the symmetric LP
@dataclasses.dataclass(frozen=True)
class _SymColumn:
    intra: tuple    # (u, v, route) template edges inside the node
    attach: tuple   # (b, route b -> X) per component (a* first)
    center: int     # a*: the GPU whose route carries the star's cross edges


def _solve(struct: NodeStructure, leader: str):
    """Column generation over symmetric columns: (columns, weights, rate, dual bound, table)."""
    n = struct.n_nodes
    devs0 = struct.groups[0]
    x = struct.x_id
    table = RouteTable.build(struct.template, devs0 + (x,))
    table.check_connected("symmetric all-reduce plan (one node and the network)")
    pr = pricer(table, "spanning")
    xi = len(devs0)
    g = len(devs0)
    meta = {}

    def price(y):
        w, pick = pr.costs(y)
        p = w[:g, xi].copy()
        if not np.isfinite(p).any():
            raise PlanError(f"symmetric plan: no GPU of node {list(devs0)} reaches the network")
        w2 = w.copy()
        if leader == "one":
            star = int(np.argmin(p))
            pairs = _spanning_parents(w2[:g, :g], star, pr.rank)
            if pairs is None:
                raise PlanError(f"three-phase plan: GPUs {list(devs0)} of a node cannot all reach each other "
                                f"inside the node")
            xs = [star]
        else:
            pmin = float(np.min(p))
            w2[:g, xi] = p + pmin
            w2[xi, :g] = p + pmin
            pairs = _spanning_parents(w2, xi, {**pr.rank, xi: -1})
            if pairs is None:
                raise PlanError(f"symmetric plan: GPUs {list(devs0)} cannot all reach each other or the network")
            xs = sorted((c for a, c in pairs if a == xi), key=lambda b: (p[b], b))
            pairs = [(a, c) for a, c in pairs if a != xi]
        usage = np.zeros(len(table.links))
        intra = []
        for a, b in pairs:
            r, u = pr.edge(a, b, pick)
            usage += u
            intra.append((devs0[a], devs0[b], r))
        attach = []
        for b in xs:
            r, u = pr.edge(b, xi, pick)
            usage += u
            attach.append((devs0[b], r))
        star = xs[0]
        _, ustar = pr.edge(star, xi, pick)
        usage += (len(xs) - 2.0 / n) * ustar
        col = _SymColumn(tuple(intra), tuple(attach), devs0[star])
        edges = (col.intra, col.attach)
        meta[edges] = col
        return [("sym", Column(edges, usage))]

    res = column_generation(table.cap, price, warm_rounds=4, what="symmetric all-reduce packing",
                            devices=list(devs0))
    cols = [meta[c.edges] for c in res.columns]
    return cols, res.weights, res.rate, res.dual_bound, table


def _pieces(n: int, cols, weights) -> list:
    """[(column, centre node, weight)]: per (centre route, component count) group, the columns end to
    end, cut into N equal pieces centred at nodes 0..N-1 (at most columns + N - 1 per group).

    Piece (column i, node k) is [max(total k / N, e_i), min(total (k + 1) / N, e_(i+1))] (e: the
    columns' cumulative weights), kept when longer than 1e-12, weights rounded down (``_round``); in
    order of k, then i. Vectorised: only the columns each cut overlaps are formed (O(columns + N) per
    group, not O(columns x N): a cached 1,024-GPU plan is cut on every load)."""
    groups = collections.OrderedDict()
    for j, col in enumerate(cols):
        if weights[j] <= 1e-12:
            continue
        groups.setdefault((col.attach[0], len(col.attach)), []).append(j)
    pieces = []
    scale = 10 ** WEIGHT_DECIMALS
    for js in groups.values():
        w = [float(weights[j]) for j in js]
        total = float(sum(w))
        edges = np.cumsum([0.0] + w)
        cuts = total * np.arange(n + 1, dtype=float) / n
        # columns i overlapping cut k: from the last with e_i <= lo to the last with e_i < hi
        first = np.maximum(np.searchsorted(edges, cuts[:-1], "right") - 1, 0)
        last = np.minimum(np.searchsorted(edges, cuts[1:], "left"), len(js)) - 1
        count = np.maximum(last - first + 1, 0)
        k = np.repeat(np.arange(n), count)
        i = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
        length = np.minimum(cuts[k + 1], edges[i + 1]) - np.maximum(cuts[k], edges[i])
        keep = length > 1e-12
        wt = np.floor(length[keep] * scale + 1e-6) / scale  # _round, element-wise
        col = np.asarray(js)[i[keep]]
        pieces += list(zip(col.tolist(), k[keep].tolist(), wt.tolist()))
    return pieces


def _composed(topology, devices, struct: NodeStructure, cols, weights, pieces=None, enc=None) -> ComposedTrees:
    """The trees over all GPUs of the symmetric columns (:func:`_pieces`, or ``pieces`` when the caller
    has them), as :class:`ComposedTrees`: a piece (column j, centre node k) is the star of column j's
    components in every node, centred at j's centre GPU of node k, its cross edges through that GPU's
    network route. ``enc``: :func:`encode_structure` of ``struct`` when the caller has it (a load)."""
    n = struct.n_nodes
    fp = struct.fingerprint  # the cluster's (computed once; a fresh template's digest costs a to_dict)
    maps = [{**m, struct.x_id: struct.network} for m in struct.maps]
    pieces = list(_pieces(n, cols, weights) if pieces is None else pieces)
    centre = [maps[k][cols[j].center] for j, k, _ in pieces]
    if all(type(c) is int for c in centre):  # GPU ids: (-weight, id) by a stable numpy sort, no key calls
        order = np.lexsort((np.asarray(centre, dtype=np.int64), -np.asarray([p[2] for p in pieces], dtype=float)))
        pieces, centre = [pieces[i] for i in order], [centre[i] for i in order]
    else:
        order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][2], _key(centre[i])))
        pieces, centre = [pieces[i] for i in order], [centre[i] for i in order]
    built = {}  # per column: each component's intra hops (oriented away from its attach GPU), per node

    def column(j):
        if j not in built:
            col = cols[j]
            comp_of = {b: b for b, _ in col.attach}
            per = {b: [] for b, _ in col.attach}
            for u, v, r in col.intra:  # breadth-first from the attach GPUs: parents come first
                comp_of[v] = comp_of[u]
                per[comp_of[u]].extend(_hops(r))
            built[j] = ([{b: [(m[x], m[y]) for x, y in per[b]] for b, _ in col.attach} for m in maps],
                        [{b: [(m[x], m[y]) for x, y in _hops(r[::-1])] for b, r in col.attach} for m in maps])
        return built[j]

    def make(i):
        j, k, wt = pieces[i]
        col = cols[j]
        intra, down = column(j)
        star, up_route = col.attach[0]
        up = [(maps[k][x], maps[k][y]) for x, y in _hops(up_route)]
        hops = list(intra[k][star])
        for m_i in range(n):
            for idx, (b, _) in enumerate(col.attach):
                if m_i == k and idx == 0:
                    continue  # the centre's own component: the root of the star
                hops.extend(up)
                hops.extend(down[m_i][b])
                hops.extend(intra[m_i][b])
        return Tree(maps[k][star], wt, tuple(hops))

    spec = {"columns": [[[list(e[:2]) + [list(e[2])] for e in c.intra], [[b, list(r)] for b, r in c.attach]]
                        for c in cols],
            "weights": [float(x) for x in weights], "structure": enc or encode_structure(struct)}
    shapes = [("symmetric", fp, n, c.intra, c.attach) for c in cols]  # the same for every centre node
    info = [(wt, c, shapes[j]) for (j, _, wt), c in zip(pieces, centre)]
    key = (struct.fingerprint, tuple(devices), tuple((c.intra, c.attach) for c in cols), tuple(pieces))
    return ComposedTrees("symmetric", spec, info, make, key)


def _route_ok(tg, route, a, b) -> bool:
    """``route`` runs a -> b over links of ``tg`` through switches only (no GPU inside)."""
    return (len(route) >= 2 and route[0] == a and route[-1] == b and all(tg.has_edge(x, y) for x, y in _hops(route))
            and not any(isinstance(v, int) for v in route[1:-1]))


def _decode_symmetric(topology, devices, spec, fingerprint=None) -> ComposedTrees:
    """:class:`ComposedTrees` of a "symmetric" spec (the disk cache), checked: the node structure
    (:func:`stored_structure`: every hop of the routes a link of every node), every route a path of
    the node's links, every column a spanning forest of one node's GPUs with one network route per
    component, and every link of every node loaded within capacity (computed on one node per centre:
    the composition's load on node m is the columns' usage plus, for pieces centred at m, the
    centre route's (N c - 2) extra uses). Raises PlanError otherwise."""
    struct, check_hops = stored_structure(topology, devices, fingerprint or topology.fingerprint(),
                                          spec.get("structure"))
    tg, x, devs0 = struct.template.graph, struct.x_id, set(struct.groups[0])
    n = struct.n_nodes
    cols = []
    for intra, attach in spec["columns"]:
        intra = tuple((u, v, tuple(r)) for u, v, r in intra)
        attach = tuple((b, tuple(r)) for b, r in attach)
        comp = {}
        for b, r in attach:
            if b not in devs0 or b in comp or not _route_ok(tg, r, b, x):
                raise PlanError(f"symmetric plan entry: bad network route {r} of GPU {b}")
            comp[b] = b
        for u, v, r in intra:
            if u not in comp or v not in devs0 or v in comp or not _route_ok(tg, r, u, v):
                raise PlanError(f"symmetric plan entry: bad intra-node edge {u}->{v} over {r}")
            comp[v] = comp[u]
        if set(comp) != devs0 or not attach:
            raise PlanError("symmetric plan entry: a column does not span the node's GPUs")
        cols.append(_SymColumn(intra, attach, attach[0][0]))
    check_hops({h for c in cols for route in [r for *_, r in c.intra] + [r for _, r in c.attach] for h in _hops(route)})
    weights = np.asarray(spec["weights"], dtype=float)
    if weights.shape != (len(cols),) or not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise PlanError("symmetric plan entry: weights must be one finite number >= 0 per column")
    links = {e: i for i, e in enumerate(tg.edges)}
    cap = np.array([tg.edges[e]["bandwidth_gbps"] for e in links])
    base, star = np.zeros((len(cols), len(links))), np.zeros((len(cols), len(links)))
    for j, c in enumerate(cols):
        for route, row in [(r, base) for *_, r in c.intra] + [(r, base) for _, r in c.attach] \
                + [(c.attach[0][1], star)]:
            for a, b in _hops(route):
                row[j, links[a, b]] += 1
                row[j, links[b, a]] += 1
    pieces = _pieces(n, cols, weights)
    total = np.zeros(len(cols))
    extra = np.zeros((n, len(cols)))
    for j, k, wt in pieces:
        total[j] += wt
        extra[k, j] += wt * (n * len(cols[j].attach) - 2)
    load = total @ base + extra @ star
    over = np.argwhere(load > cap * (1 + 1e-6) + 1e-9)
    if len(over):
        m, i = over[0]
        raise PlanError(f"symmetric plan entry loads link {list(links)[i]} of node {m} with {load[m, i]:.3f} GB/s "
                        f"> its {cap[i]} GB/s")
    return _composed(topology, devices, struct, cols, weights, pieces, spec.get("structure"))


register_composition("symmetric", _decode_symmetric)


def symmetric_plan(topology: Topology, devices, struct: NodeStructure, *, leader: str = "any",
                   bound: float | None = None) -> Plan:
    """All-reduce plan over ``devices`` (N identical nodes, ``struct`` from :func:`node_structure`)
    planned on one node and the network, composed over the nodes (module docstring; Blink, MLSys 2020,
    s. 4-5; symmetry decomposition as SyCCL, SIGCOMM 2025).

    Args:
      leader: "any" (algorithm "trees": every spanning tree of all GPUs, exact: the rate is the
        optimum of the flat packing, certified by the LP dual) or "one" (algorithm "hierarchical":
        Blink's three phases, one intra-node tree and leader per node and tree; certificate: the
        exact flat bound ``bound`` (computed here when None); the shortfall is in ``notes``).

    Returns the Plan (rate and bound in GB/s). Raises PlanError when a node's GPUs cannot reach each
    other or the network.
    """
    cols, w, rate, dual, _ = _solve(struct, leader)
    trees = _composed(topology, devices, struct, cols, w)
    total = _round(sum(p[0] for p in trees.pieces))
    n, g = struct.n_nodes, len(struct.groups[0])
    what = (f"symmetric decomposition: {n} identical nodes of {g} GPUs around network {struct.network!r}; one LP "
            f"over one node's {len(struct.template.graph.edges)} links (usage averaged over the nodes), "
            f"{len(cols)} columns composed into {len(trees)} trees (N = {n} pieces per centre group)")
    if leader == "one":
        flat = exact_allreduce_bound(struct) if bound is None else bound
        gap = 100.0 * (1.0 - total / flat) if flat > 0 else 0.0
        notes = (f"three phases (Blink s. 5) by symmetry: reduce inside each node onto its leader, cross-node "
                 f"star among the leaders, broadcast inside; {total:.3f} GB/s, {gap:.2f}% below the exact flat "
                 f"bound {flat:.3f} GB/s (three-phase LP optimum {rate:.3f}, dual {dual:.3f})", what)
        return Plan("allreduce", None, tuple(devices), trees, total, _round(flat), "hierarchical", notes)
    notes = (f"tree packing by symmetry: {total:.3f} GB/s of the exact bound {dual:.3f} GB/s (the flat LP's "
             f"optimum: symmetric LP dual)", what)
    return Plan("allreduce", None, tuple(devices), trees, total, _round(max(dual, total)), "trees", notes)


_BOUNDS = plan_cache()


def exact_allreduce_bound(struct: NodeStructure) -> float:
    """The exact all-reduce tree-packing optimum over all GPUs of the N nodes, GB/s: the symmetric
    LP's dual (module docstring), cached per template and N."""
    key = (struct.template.fingerprint(), struct.n_nodes)
    return cached(_BOUNDS, key, lambda: float(_solve(struct, "any")[3]))


# ------------------------------------------------------------------------------ reduce-scatter + all-gather
def sharded_bounds(struct: NodeStructure) -> tuple[float, float]:
    """(reduce-scatter, all-gather) cut bounds over all N G GPUs, GB/s of the full buffer, on one node.

    The all-gather cut bound (ForestColl, Zhao et al. 2024) is N G min over node sets T holding some
    but not all ranks of B_out(T) / |T & ranks|. With the network node X a cut vertex and the nodes
    identical, a minimising T either avoids X (then one node's part alone is as good: the ratio of
    a union is a mediant) or holds X and all nodes but one, which holds a part S: B_out(S + X) /
    ((N - 1) G + |S|). Both are the weighted cut of ONE node plus X as a rank of weight (N - 1) G
    (:func:`jax_blink.planner.bounds.sharded_cut` with ``weights``); reduce-scatter on reversed links.
    """
    n, g = struct.n_nodes, len(struct.groups[0])
    devs = struct.groups[0] + (struct.x_id,)
    w = {d: 1.0 for d in struct.groups[0]}
    w[struct.x_id] = float((n - 1) * g)
    ag = sharded_cut(struct.template, devs, weights=w)[0] * n * g
    rs = sharded_cut(struct.template, devs, weights=w, reverse=True)[0] * n * g
    return rs, ag


def _rsag_load(struct: NodeStructure, forest, up) -> dict:
    """{template link: uses per unit of the root weight x} of the composed rsag plan on ANY one node
    (the same on every node by symmetry): n times each position's one-node forest (shares of its
    root's trees) plus (N - 1) uses of each position's network route each way, both directions."""
    n = struct.n_nodes
    wsum = collections.Counter()
    for d, w, _ in forest:
        wsum[d] += w
    load = collections.Counter()
    for d, w, edges in forest:
        for h in edges:
            load[h] += n * w / wsum[d]
            load[h[::-1]] += n * w / wsum[d]
    for d in wsum:
        for h in _hops(up[d]):
            load[h] += 2 * (n - 1)
            load[h[::-1]] += 2 * (n - 1)
    return load


def _composed_rsag(topology, devices, struct: NodeStructure, forest, up, x: float, enc=None) -> ComposedTrees:
    """The rsag trees over all GPUs (:func:`symmetric_rsag_plan`) as :class:`ComposedTrees`: for node
    k, root position d and one-node tree t of d (``forest``: (d, weight, hops) on node 0), t in node
    k, then d's route up and down into every other node and t there; weight x * t's share of d.
    ``enc``: :func:`encode_structure` of ``struct`` when the caller has it (a load)."""
    n = struct.n_nodes
    maps = [{**m, struct.x_id: struct.network} for m in struct.maps]
    fp = struct.fingerprint  # the cluster's (computed once; a fresh template's digest costs a to_dict)
    wsum = collections.Counter()
    for d, w, _ in forest:
        wsum[d] += w
    pieces = [(k, i) for k in range(n) for i in range(len(forest))]
    mapped, downs = {}, {}

    def per_node(i, m):
        if (i, m) not in mapped:
            mapped[i, m] = [(maps[m][a], maps[m][b]) for a, b in forest[i][2]]
        return mapped[i, m]

    def down(d, m):
        if (d, m) not in downs:
            downs[d, m] = [(maps[m][a], maps[m][b]) for a, b in _hops(up[d][::-1])]
        return downs[d, m]

    def make(p):
        k, i = pieces[p]
        d, w, _ = forest[i]
        hops = list(per_node(i, k))
        upk = [(maps[k][a], maps[k][b]) for a, b in _hops(up[d])]
        for m_i in range(n):
            if m_i != k:
                hops.extend(upk)
                hops.extend(down(d, m_i))
                hops.extend(per_node(i, m_i))
        hops = tuple(hops)
        return Tree(maps[k][d], _round(x * w / wsum[d]), hops, hops)

    info = [(_round(x * forest[i][1] / wsum[forest[i][0]]), maps[k][forest[i][0]],
             ("rsag", fp, n, forest[i][0], forest[i][2])) for k, i in pieces]  # one shape per root position
    spec = {"forest": [[d, w, [list(h) for h in e]] for d, w, e in forest],
            "up": [[d, list(r)] for d, r in up.items()], "x": x, "structure": enc or encode_structure(struct)}
    key = (struct.fingerprint, tuple(devices), tuple(forest), tuple(sorted(up.items(), key=lambda kv: kv[0])), x)
    return ComposedTrees("rsag", spec, info, make, key)


def _decode_rsag(topology, devices, spec, fingerprint=None) -> ComposedTrees:
    """:class:`ComposedTrees` of an "rsag" spec (the disk cache), checked: the node structure
    (:func:`stored_structure`: every hop a link of every node), each one-node tree spans node 0's
    GPUs from its root over the node's links, each position's network route is a path of links, and
    x times :func:`_rsag_load` is within every link's capacity. Raises PlanError otherwise."""
    struct, check_hops = stored_structure(topology, devices, fingerprint or topology.fingerprint(),
                                          spec.get("structure"))
    tg, devs0 = struct.template.graph, set(struct.groups[0])
    forest = tuple((d, float(w), tuple(tuple(h) for h in e)) for d, w, e in spec["forest"])
    up = {d: tuple(r) for d, r in spec["up"]}
    x = float(spec["x"])
    if set(up) != devs0 or {d for d, _, _ in forest} != devs0 or not (0 < x < float("inf")):
        raise PlanError("rsag plan entry: one network route and one or more trees per GPU of a node, x > 0")
    for d, w, e in forest:
        if not (0 < w < float("inf")) or any(not tg.has_edge(*h) or struct.x_id in h for h in e):
            raise PlanError(f"rsag plan entry: tree of GPU {d} has a bad weight or a hop that is no node link")
        _check_tree(e, d, devs0, set())
    for d, r in up.items():
        if not _route_ok(tg, r, d, struct.x_id):
            raise PlanError(f"rsag plan entry: bad network route {r} of GPU {d}")
    check_hops({h for _, _, e in forest for h in e} | {h for r in up.values() for h in _hops(r)})
    for h, v in _rsag_load(struct, forest, up).items():
        if x * v > tg.edges[h]["bandwidth_gbps"] * (1 + 1e-6) + 1e-9:
            raise PlanError(f"rsag plan entry loads link {h} with {x * v:.3f} GB/s > its capacity")
    return _composed_rsag(topology, devices, struct, forest, up, x, spec.get("structure"))


register_composition("rsag", _decode_rsag)


def symmetric_rsag_plan(topology: Topology, devices, struct: NodeStructure) -> Plan:
    """All-reduce as reduce-scatter + all-gather forests over N identical nodes, composed from one node
    (ForestColl's forests, Zhao et al. 2024, composed by symmetry as SyCCL does).

    Root r at position i of node k: its shard is broadcast inside node k on the node's own
    all-gather trees of GPU i (weights of the one-node packing), sent over r's route to the network
    to GPU i of every other node, and broadcast there on the same tree; the reduce-scatter in-tree is
    the same tree reversed. Every node then carries, per root weight x, n times its one-node forest
    plus (N - 1) uses of each position's NIC route each way, so x is the least capacity / load over
    ONE node's links (exact for the whole cluster by symmetry) and the rate N x. Certificate:
    1 / (1 / B_rs + 1 / B_ag) of :func:`sharded_bounds`; the shortfall is in ``notes``. The N G
    trees of N G GPUs each are :class:`ComposedTrees` (built on use). Raises PlanError when a GPU
    cannot reach the network.
    """
    n, g = struct.n_nodes, len(struct.groups[0])
    devs0 = struct.groups[0]
    node = node_topology(struct)  # node 0 without the network: the same for every cluster size
    per_root = collections.defaultdict(list)
    if g == 1:  # one GPU per node: no intra-node phase
        local = Plan("allgather", None, devs0, (Tree(devs0[0], 1.0, ()),), 1.0, 1.0, "trivial")
    else:
        local = flat_plan(node, "allgather", devs0, None, None, "trees")
    for t in local.trees:
        per_root[t.root].append(t)
    table = RouteTable.build(struct.template, devs0 + (struct.x_id,))
    up = {}
    for d in devs0:
        rs = table.routes.get((d, struct.x_id)) or []
        if not rs:
            raise PlanError(f"rsag over {n} nodes: GPU {d} of node {list(devs0)} has no route to the network")
        up[d] = tuple(rs[0])

    def rate_of(per):
        forest = [(d, t.weight_gbps, t.edges) for d, ts in per.items() for t in ts]
        load = _rsag_load(struct, forest, up)
        return min(struct.template.graph.edges[e]["bandwidth_gbps"] / v for e, v in load.items() if v > 0)

    # one tree per root (its heaviest) when the network binds anyway: fewer, longer-pipelined trees
    x = rate_of(per_root)
    heavy = {d: [max(ts, key=lambda t: t.weight_gbps)] for d, ts in per_root.items()}
    xh = rate_of(heavy)
    if xh >= x * (1 - 1e-9):
        per_root, x = heavy, xh
    forest = tuple((d, t.weight_gbps, tuple(t.edges)) for d, ts in per_root.items() for t in ts)
    trees = _composed_rsag(topology, devices, struct, forest, up, float(x))
    rate = _round(sum(p[0] for p in trees.pieces))
    b_rs, b_ag = sharded_bounds(struct)
    bound = 1.0 / (1.0 / b_rs + 1.0 / b_ag)
    gap = 100.0 * (1.0 - rate / bound) if bound > 0 else 0.0
    used = sum(len(v) for v in per_root.values())
    note = (f"rsag by symmetry: one-node all-gather forest ({used} of its {len(local.trees)} trees) composed over "
            f"{n} nodes through "
            f"each GPU's network route; all-reduce rate {rate:.3f} GB/s, {gap:.2f}% below 1/(1/B_rs + 1/B_ag) = "
            f"{bound:.3f} GB/s (cut bounds {b_rs:.3f}, {b_ag:.3f} on one node with the other nodes contracted)",)
    return Plan("allreduce", None, tuple(devices), trees, rate, _round(max(bound, rate)), "rsag", note)
