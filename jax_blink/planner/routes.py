"""GPU-level routes over a physical topology, and the pricing of trees under link prices.

A *route* from GPU u to GPU v is a direct edge u->v or a simple path whose intermediate nodes are all
shared resources (switch, host, cpu, nic, network). Switches do not replicate data (a PCIe switch
cannot), so a tree edge u->v routed through a switch uses every physical link of its route, and two
children under one switch are two routes (Blink, MLSys 2020, section 3.2: trees over PCIe switches).

:class:`RouteTable` enumerates the routes of a job; :func:`price_tree` is the pricing step of column
generation (:mod:`jax_blink.planner.colgen`): the cheapest spanning tree over the job's GPUs under
dual link prices, each tree edge with its cheapest route: a minimum-weight spanning arborescence
(Edmonds 1967, :func:`min_arborescence`) for broadcast/reduce, a minimum spanning tree for
all-reduce. :func:`route` is the one fewest-hop path between two GPUs (the simulator's and NCCL's
double binary tree's).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import networkx as nx
import numpy as np

from ..errors import PlanError
from ..topology.model import Topology, _key

MAX_ROUTES_PER_PAIR = 6     # shortest routes kept per ordered GPU pair
MAX_SWITCH_NODES = 16       # most switch nodes inside one route
ARBORESCENCE_LIST_MAX = 16  # min_arborescence on Python lists up to this many nodes, NumPy above


def _is_forest(nodes, edges) -> bool:
    """Whether the undirected graph of ``nodes`` and directed ``edges`` (u, v) (a link both ways counts
    once) has no cycle: union-find over the undirected edges (no networkx undirected copy)."""
    comp = {n: n for n in nodes}

    def find(a):
        while comp[a] != a:
            comp[a] = comp[comp[a]]
            a = comp[a]
        return a

    for u, v in {(u, v) if _key(u) <= _key(v) else (v, u) for u, v in edges}:
        ru, rv = find(u), find(v)
        if ru == rv:
            return False
        comp[ru] = rv
    return True


@dataclasses.dataclass(eq=False)
class RouteTable:
    """Routes between the job's GPUs over the job's physical links.

    Attributes:
      devices: GPU ids of the job (order kept).
      graph: the job's physical ``nx.DiGraph`` (``Topology.subset(devices)``: the GPUs plus the switch
        nodes that join two of them; other GPUs never relay).
      links: directed physical edges (u, v) in a stable order; ``cap[i]`` their GB/s (float64 [L]).
      routes: (u, v) -> list of node paths (tuples, u first, v last), shortest first.
      inc: (u, v) -> int array [R_uv, L]: how many times each route uses each link (0/1).
      relays: GPUs outside the job allowed to forward inside routes (treated like switch nodes:
        they are not ranks and only appear between a route's two job GPUs).
    """

    devices: tuple
    graph: nx.DiGraph
    links: list
    cap: np.ndarray
    routes: dict
    inc: dict
    relays: tuple = ()

    @classmethod
    def build(cls, topology: Topology, devices, relays=()) -> RouteTable:
        """Enumerate routes for every ordered pair of ``devices`` (at most MAX_ROUTES_PER_PAIR each,
        ordered by hop count, then by bottleneck bandwidth descending, then by node ids).
        ``relays``: extra GPU ids that may forward inside routes (like a switch node)."""
        devices, relays = tuple(devices), tuple(relays)
        g = topology.subset(devices + relays).graph
        links = sorted(g.edges(), key=lambda e: (_key(e[0]), _key(e[1])))
        index = {e: i for i, e in enumerate(links)}
        cap = np.array([g.edges[e]["bandwidth_gbps"] for e in links], dtype=np.float64)
        switches = sorted((n for n in g if g.nodes[n]["kind"] != "gpu" or n in relays), key=_key)
        # relay GPUs form a mesh of paths: keep more routes so path flows can reach the max-flow bound
        max_routes = MAX_ROUTES_PER_PAIR * (1 + len(relays))
        sw = g.subgraph(switches)
        # switch-only simple paths between the switch neighbours of GPUs, computed once.
        starts = sorted({s for d in devices for s in g.successors(d) if s in sw}, key=_key)
        ends = sorted({s for d in devices for s in g.predecessors(d) if s in sw}, key=_key)
        sw_paths: dict = {}
        # a switch forest (PCIe trees, NVSwitch planes) has at most one simple path per pair: one BFS
        # per start finds them all (Yen's algorithm per pair below cost ~40% of a dgx1v plan)
        forest = _is_forest(switches, sw.edges())
        for a in starts:
            reach = nx.single_source_shortest_path(sw, a) if forest else None
            for b in ends:
                if a == b:
                    sw_paths[a, b] = [(a,)]
                elif forest:
                    p = reach.get(b)
                    sw_paths[a, b] = [tuple(p)] if p is not None and len(p) <= MAX_SWITCH_NODES else []
                else:
                    # Yen's k shortest simple paths: ordered and bounded even on meshy switch graphs
                    try:
                        ps = itertools.islice(nx.shortest_simple_paths(sw, a, b), max_routes)
                        sw_paths[a, b] = [tuple(p) for p in ps if len(p) <= MAX_SWITCH_NODES]
                    except nx.NetworkXNoPath:
                        sw_paths[a, b] = []
        routes, inc = {}, {}
        for u in devices:
            for v in devices:
                if u == v:
                    continue
                cands = []
                if g.has_edge(u, v):
                    cands.append((u, v))
                for a in g.successors(u):
                    if a not in sw:
                        continue
                    for b in g.predecessors(v):
                        if b in sw:
                            cands.extend((u,) + p + (v,) for p in sw_paths.get((a, b), ()))

                def rank(p):
                    bott = min(g.edges[e]["bandwidth_gbps"] for e in zip(p, p[1:]))
                    return (len(p), -bott, [_key(x) for x in p])

                cands = sorted(set(cands), key=rank)[:max_routes]
                routes[u, v] = cands
                m = np.zeros((len(cands), len(links)), dtype=np.int64)
                for i, p in enumerate(cands):
                    for e in zip(p, p[1:]):
                        m[i, index[e]] += 1
                inc[u, v] = m
        return cls(devices, g, links, cap, routes, inc, relays)

    def check_connected(self, what: str) -> None:
        """Raise PlanError naming GPUs that cannot reach each other over the job's links."""
        h = nx.DiGraph([(u, v) for (u, v), r in self.routes.items() if r])
        h.add_nodes_from(self.devices)
        comps = list(nx.strongly_connected_components(h))
        if len(comps) > 1:
            groups = sorted((sorted(c) for c in comps), key=lambda c: c[0])
            raise PlanError(f"{what}: devices {list(self.devices)} are not all connected over their links; "
                            f"groups that reach each other both ways: {groups}. Allocate GPUs that share "
                            f"links or a switch, or give the topology the missing links.")


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a packing LP (:mod:`jax_blink.planner.colgen`): a tree, a three-phase tree or a ring.

    ``edges``: what the column is (its identity in the LP). For a tree, a tuple of (parent, child,
    route) with route a node path: for ``mode="arborescence"`` the route runs parent -> child
    (broadcast); for ``"in-arborescence"`` child -> parent (reduce); for ``"spanning"`` the route runs
    parent -> child and its reverse is used too (all-reduce). A three-phase tree lists the edges of
    its parts; a ring is (GPU cycle, route per hop).
    ``usage``: int array [L], how many times the column uses each link.
    """

    edges: tuple
    usage: np.ndarray


class _Pricer:
    """Route-cost arrays of one RouteTable for one LP ``mode``, built once per table and mode.

    Every GPU-level edge (parent, child) with at least one route is one row of a padded incidence
    tensor [P, R, L] (R = most routes of a pair; padding costs inf), so one batched matrix product
    prices every route under link prices y. "spanning" rows are a route u->v plus its reverse
    v->u (u before v in ``table.devices``); "in-arborescence" rows are the route child -> parent."""

    def __init__(self, table: RouteTable, mode: str):
        pos = {d: i for i, d in enumerate(table.devices)}
        n = len(pos)
        # position -> rank of the GPU in node order (children are visited in this order)
        self.rank = {i: k for k, i in enumerate(sorted(range(n), key=lambda i: _key(table.devices[i])))}
        self.n, self.mode = n, mode
        pairs, routes, rows = [], [], []
        for (u, v), m in table.inc.items():
            if not len(m):
                continue
            if mode == "spanning":
                if pos[u] > pos[v]:
                    continue
                rev = {r: i for i, r in enumerate(table.routes[v, u])}
                keep = [(i, rev[r[::-1]]) for i, r in enumerate(table.routes[u, v]) if r[::-1] in rev]
                if not keep:
                    continue
                pairs.append((pos[u], pos[v]))
                routes.append([table.routes[u, v][i] for i, _ in keep])
                rows.append(np.stack([m[i] + table.inc[v, u][j] for i, j in keep]))
            else:
                # reduce: tree edge (parent=v, child=u) uses the route u -> v
                pairs.append((pos[u], pos[v]) if mode == "arborescence" else (pos[v], pos[u]))
                routes.append(table.routes[u, v])
                rows.append(m)
        nr = max((len(r) for r in rows), default=1)
        self.inc = np.zeros((len(rows), nr, len(table.links)))
        self.pad = np.full((len(rows), nr), np.inf)
        for k, m in enumerate(rows):
            self.inc[k, :len(m)] = m
            self.pad[k, :len(m)] = 0.0
        self.rows, self.routes = rows, routes
        self.par = np.array([p for p, _ in pairs], dtype=np.int64)
        self.kid = np.array([c for _, c in pairs], dtype=np.int64)
        self.index = np.full((n, n), -1, dtype=np.int64)
        if len(pairs):
            self.index[self.par, self.kid] = np.arange(len(pairs))
            if mode == "spanning":
                self.index[self.kid, self.par] = np.arange(len(pairs))

    def costs(self, y: np.ndarray):
        """Cheapest route per GPU-level edge under link prices ``y`` [L]: (matrix [n, n] of costs,
        inf where no route, rows parents; pick [P], the chosen route of each edge: the first within
        1e-15 of the cheapest, as the loop over routes did)."""
        c = self.inc @ y + self.pad
        best = c.min(axis=1)
        pick = np.argmax(c <= best[:, None] + 1e-15, axis=1)
        w = np.full((self.n, self.n), np.inf)
        w[self.par, self.kid] = best
        if self.mode == "spanning":
            w[self.kid, self.par] = best
        return w, pick

    def edge(self, p: int, c: int, pick: np.ndarray):
        """(route in the Column's direction, usage [L]) of GPU-level tree edge p -> c (positions)."""
        k = int(self.index[p, c])
        i = int(pick[k])
        r = self.routes[k][i]
        if self.mode == "spanning" and self.par[k] != p:
            r = r[::-1]
        return r, self.rows[k][i]


def pricer(table: RouteTable, mode: str) -> _Pricer:
    """The table's :class:`_Pricer` for ``mode`` (kept on the table: a replaced table gets its own)."""
    cache = table.__dict__.setdefault("_pricers", {})
    if mode not in cache:
        cache[mode] = _Pricer(table, mode)
    return cache[mode]


def min_arborescence(w: np.ndarray, root: int):
    """Minimum-weight spanning arborescence rooted at ``root`` on a dense weight matrix.

    Chu-Liu/Edmonds (Edmonds 1967, "Optimum branchings"), O(n^3); ties go to the lowest index, so
    the result is deterministic. ``w``: float64 [n, n], w[u, v] = weight of u->v, ``inf`` where
    there is no edge. Returns an int array [n] of parents (-1 at the root) or None when some node
    cannot be reached from ``root``. Up to ARBORESCENCE_LIST_MAX nodes it runs on Python lists
    (:func:`_arborescence`; per-call NumPy overhead cost ~5x the arithmetic there), above with NumPy
    (:func:`_arborescence_np`); both take the same steps and ties, so they return the same tree.
    """
    w = np.asarray(w, dtype=np.float64)
    if len(w) > ARBORESCENCE_LIST_MAX:
        return _arborescence_np(w, root)
    par = _arborescence(w.tolist(), root)
    return None if par is None else np.array(par, dtype=np.int64)


def _arborescence_np(w: np.ndarray, root: int):
    """:func:`min_arborescence` with NumPy row and column operations (large ``w``); the contracted
    problem goes back through :func:`min_arborescence`."""
    n = w.shape[0]
    w = w.copy()
    w[:, root] = np.inf
    np.fill_diagonal(w, np.inf)
    par = np.argmin(w, axis=0)
    if np.isinf(w[par, np.arange(n)])[np.arange(n) != root].any():
        return None
    # pointer doubling: z[v] = par^(2^k)(v) with 2^k >= n lies on v's cycle (or is the root); the
    # cycle reached from the lowest-numbered node is contracted (the one a walk in node order meets first)
    z = par.copy()
    z[root] = root
    for _ in range(max(1, int(n - 1).bit_length())):
        z = z[z]
    par[root] = -1
    off = np.flatnonzero(z != root)
    if not len(off):
        return par
    v = int(z[off[0]])
    cyc = [v]
    u = int(par[v])
    while u != v:
        cyc.append(u)
        u = int(par[u])
    cyc = np.array(sorted(cyc))
    incyc = np.zeros(n, dtype=bool)
    incyc[cyc] = True
    rest = np.flatnonzero(~incyc)
    m = len(rest)
    w2 = np.full((m + 1, m + 1), np.inf)
    w2[:m, :m] = w[rest][:, rest]
    cin = w[rest][:, cyc] - w[par[cyc], cyc][None, :]
    best_in = np.argmin(cin, axis=1)
    w2[:m, m] = cin[np.arange(m), best_in]
    cout = w[cyc][:, rest]
    best_out = np.argmin(cout, axis=0)
    w2[m, :m] = cout[best_out, np.arange(m)]
    p2 = min_arborescence(w2, int(np.flatnonzero(rest == root)[0]))
    if p2 is None:
        return None
    out = np.empty(n, dtype=np.int64)
    for j, v in enumerate(rest):
        pj = p2[j]
        out[v] = -1 if pj == -1 else (rest[pj] if pj < m else cyc[best_out[j]])
    out[cyc] = par[cyc]
    out[cyc[best_in[p2[m]]]] = rest[p2[m]]
    return out


def _first_min(xs) -> int:
    """Index of the first smallest entry of ``xs`` (NumPy's argmin tie rule)."""
    best, k = xs[0], 0
    for i in range(1, len(xs)):
        if xs[i] < best:
            best, k = xs[i], i
    return k


def _arborescence(w: list, root: int):
    """:func:`min_arborescence` on a list of rows (``w`` is not modified): the cheapest in-edge of
    every node; the cycle met first from the lowest-numbered node (pointer doubling) is contracted
    into one node and the contracted problem solved recursively."""
    n = len(w)
    inf = math.inf
    w = [[inf if (v == root or u == v) else x for v, x in enumerate(row)] for u, row in enumerate(w)]
    par = [_first_min([w[u][v] for u in range(n)]) for v in range(n)]
    if any(w[par[v]][v] == inf for v in range(n) if v != root):
        return None
    z = list(par)
    z[root] = root
    for _ in range(max(1, int(n - 1).bit_length())):
        z = [z[x] for x in z]
    par[root] = -1
    off = [v for v in range(n) if z[v] != root]
    if not off:
        return par
    v = z[off[0]]
    cyc = [v]
    u = par[v]
    while u != v:
        cyc.append(u)
        u = par[u]
    cyc.sort()
    incyc = set(cyc)
    rest = [x for x in range(n) if x not in incyc]
    m = len(rest)
    w2 = [[w[a][b] for b in rest] + [inf] for a in rest] + [[inf] * (m + 1)]
    best_in = []
    for i, a in enumerate(rest):
        cin = [w[a][c] - w[par[c]][c] for c in cyc]
        k = _first_min(cin)
        best_in.append(k)
        w2[i][m] = cin[k]
    best_out = []
    for j, b in enumerate(rest):
        cout = [w[c][b] for c in cyc]
        k = _first_min(cout)
        best_out.append(k)
        w2[m][j] = cout[k]
    p2 = _arborescence(w2, rest.index(root))
    if p2 is None:
        return None
    out = [0] * n
    for j, x in enumerate(rest):
        pj = p2[j]
        out[x] = -1 if pj == -1 else (rest[pj] if pj < m else cyc[best_out[j]])
    for c in cyc:
        out[c] = par[c]
    out[cyc[best_in[p2[m]]]] = rest[p2[m]]
    return out


def price_tree(table: RouteTable, y: np.ndarray, mode: str, root) -> Column | None:
    """The minimum-price tree under link prices ``y`` (None if no spanning tree exists)."""
    pr = pricer(table, mode)
    w, pick = pr.costs(y)
    return tree_from_costs(table, pr, w, pick, root)


def _spanning_parents(w: np.ndarray, root: int, rank):
    """Minimum spanning tree (Kruskal over the pairs i < j in order, stable by weight: the tree
    networkx's kruskal gives on the same graph) of symmetric ``w`` [n, n] (inf: no edge), as
    breadth-first (parent, child) position pairs from ``root``, children by ``rank`` (position ->
    sort key); None when disconnected."""
    n = len(w)
    ii, jj = np.triu_indices(n, 1)
    ww = w[ii, jj]
    ok = np.isfinite(ww)
    ii, jj, ww = ii[ok], jj[ok], ww[ok]
    comp = list(range(n))

    def find(a):
        while comp[a] != a:
            comp[a] = comp[comp[a]]
            a = comp[a]
        return a

    adj = [[] for _ in range(n)]
    left = n - 1
    for k in np.argsort(ww, kind="stable").tolist():
        a, b = int(ii[k]), int(jj[k])
        ra, rb = find(a), find(b)
        if ra != rb:
            comp[ra] = rb
            adj[a].append(b)
            adj[b].append(a)
            left -= 1
            if not left:
                break
    if left:
        return None
    out, queue, seen = [], [root], {root}
    while queue:
        p = queue.pop(0)
        for c in sorted(adj[p], key=rank.get):
            if c not in seen:
                seen.add(c)
                queue.append(c)
                out.append((p, c))
    return out


def tree_from_costs(table: RouteTable, pricer: _Pricer, w: np.ndarray, pick: np.ndarray, root) -> Column | None:
    """The minimum-price tree rooted at ``root`` over GPU-level edge costs ``w`` [n, n] and route
    choices ``pick`` from :meth:`_Pricer.costs` (one pricing serves every root of a round)."""
    devs = table.devices
    rank = pricer.rank
    r = devs.index(root)
    if pricer.mode == "spanning":
        pairs = _spanning_parents(w, r, rank)
        if pairs is None:
            return None
    else:
        par = min_arborescence(w, r)
        if par is None:
            return None
        kids = [[] for _ in devs]
        for i in range(len(devs)):
            if par[i] >= 0:
                kids[par[i]].append(i)
        pairs, queue = [], [r]
        while queue:  # breadth-first, children in node order (deterministic hop order)
            p = queue.pop(0)
            for c in sorted(kids[p], key=rank.get):
                queue.append(c)
                pairs.append((p, c))
    edges, usage = [], np.zeros(len(table.links), dtype=np.int64)
    for p, c in pairs:
        route, use = pricer.edge(p, c, pick)
        edges.append((devs[p], devs[c], route))
        usage += use
    return Column(tuple(edges), usage)


def route(topology, src, dst, *, via=None) -> tuple:
    """Physical hops [(a, b), ...] from GPU ``src`` to GPU ``dst``.

    The direct edge when there is one; otherwise a fewest-hop path whose intermediate nodes are
    switch/host nodes (or the GPUs in ``via``), ties broken by the widest bottleneck, then by node
    order. Raises PlanError when no such path exists (e.g. no PCIe tree in the topology).
    """
    g = topology.graph
    if g.has_edge(src, dst):
        return ((src, dst),)
    allowed = set(topology.switches) | set(via or ()) | {src, dst}
    sub = g.subgraph(allowed)
    try:
        paths = list(nx.all_shortest_paths(sub, src, dst))
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        raise PlanError(f"no route from GPU {src} to GPU {dst} in topology {topology.name!r} through "
                        f"switch nodes; add the PCIe/host tree to the topology or use GPUs that are "
                        f"linked") from None
    # widest bottleneck first, then the smallest node sequence (GPUs before switches, by id/name)
    best = min(paths, key=lambda p: (-min(g.edges[a, b]["bandwidth_gbps"] for a, b in zip(p, p[1:])),
                                     [_key(x) for x in p]))
    return tuple(zip(best, best[1:]))
