"""Blink's three phases (MLSys 2020, section 5) for GPUs on several nodes joined by a network, as
one tree packing ("hierarchical").

The data is partitioned over the GPU positions of a node; each tree of partition i is an intra-node
tree per node joined at GPU i by a cross-node tree among the GPU i's over the NICs; the weights come
from the same column generation as every packing (:func:`jax_blink.planner.colgen.column_generation`),
with pricing split into independent minimum trees per node and per cross-node part.
"""

from __future__ import annotations

import collections
import dataclasses

import networkx as nx
import numpy as np

from ..errors import PlanError
from ..topology.model import Topology, _key
from .bounds import certificate
from .colgen import column_generation
from .minimize import fewest_trees
from .model import Plan, Tree, _hops, _orient, _round
from .routes import Column, RouteTable, price_tree
from .trees import _mode, _spread_roots


def node_groups(topology: Topology, devices) -> list:
    """GPUs of ``devices`` grouped by node: components of the job graph without "network" nodes."""
    if all(k != "network" for _, k in topology.graph.nodes(data="kind")):
        return [list(devices)]
    g = topology.subset(devices).graph
    net = [n for n in g if g.nodes[n]["kind"] == "network"]
    if not net:
        return [list(devices)]
    h = g.subgraph([n for n in g if n not in net]).to_undirected(as_view=True)
    groups = []
    for comp in nx.connected_components(h):
        gs = [d for d in devices if d in comp]
        if gs:
            groups.append(gs)
    return sorted(groups, key=lambda gs: devices.index(gs[0]))


class _Part:
    """One part of a three-phase tree (one node's intra-node tree, or the cross-node tree among the
    partition's leaders): a RouteTable and the map of its links into the plan's global link index."""

    def __init__(self, table: RouteTable, index: dict, intra: bool):
        if intra:  # intra-node trees stay inside the node: no route through the network
            net = {n for n in table.graph if table.graph.nodes[n]["kind"] == "network"}
            keep = {k: [i for i, r in enumerate(rs) if not net.intersection(r)] for k, rs in table.routes.items()}
            table = dataclasses.replace(table, routes={k: [table.routes[k][i] for i in v] for k, v in keep.items()},
                                        inc={k: table.inc[k][v] for k, v in keep.items()})
        self.table = table
        self.glob = np.array([index[e] for e in table.links], dtype=np.int64)

    def price(self, y: np.ndarray, mode: str, root, nlinks: int):
        """(edges, usage int [nlinks] over the global links) of the cheapest tree of this part under
        global prices y."""
        col = price_tree(self.table, y[self.glob], mode, root)
        if col is None:
            raise PlanError(f"three-phase plan: GPUs {list(self.table.devices)} cannot all reach GPU {root} "
                            f"over their links")
        usage = np.zeros(nlinks, dtype=np.int64)
        np.add.at(usage, self.glob, col.usage)
        return col.edges, usage


def hierarchical_plan(topology, devices, collective, root, groups, max_trees) -> Plan:
    """Blink's three phases (MLSys 2020, s. 5) as one tree packing, with the data partitioned by GPU.

    Partition i (position i of each node's GPUs, sorted by id; ``gs[i % len(gs)]`` in smaller nodes)
    is reduced inside every node onto that node's GPU i on an intra-node tree, exchanged among the
    GPU i's of all nodes on a cross-node tree through their NIC routes, then broadcast inside every
    node from GPU i (for broadcast/reduce: the root's node runs its intra-node tree from/to the root,
    the cross-node tree starts/ends at that node's GPU i). Each column of the LP is one such tree:
    the union of one intra-node tree per node and one cross-node tree for one partition i. The LP
    (maximise the total weight; every physical link, intra-node and NIC alike, within capacity) is
    solved by column generation with HiGHS; pricing splits exactly into independent minimum trees
    per node and per cross-node part (its cost is additive over the parts' links), so the result
    is the optimum over three-phase trees. Partition sizes are the LP's weights per i, not equal
    shares as in the paper. The tree count is reduced like the flat packing
    (:func:`jax_blink.planner.minimize.fewest_trees`). ``groups``: the job's GPUs by node
    (:func:`node_groups`).

    Returns the Plan (algorithm "hierarchical", bound: the max-flow bound). Raises PlanError when a
    node's GPUs or the partition leaders cannot reach each other.
    """
    mode = _mode(collective)
    groups = [sorted(gs) for gs in groups]
    npos = max(len(gs) for gs in groups)
    leaders = [[gs[i % len(gs)] for gs in groups] for i in range(npos)]
    root_node = next((k for k, gs in enumerate(groups) if root in gs), 0)
    job = topology.subset(devices).graph
    links = sorted(job.edges(), key=lambda e: (_key(e[0]), _key(e[1])))
    index = {e: j for j, e in enumerate(links)}
    cap = np.array([job.edges[e]["bandwidth_gbps"] for e in links], dtype=np.float64)
    nl = len(links)
    intra = [_Part(RouteTable.build(topology, gs), index, True) if len(gs) > 1 else None for gs in groups]
    cross = [_Part(RouteTable.build(topology, ld), index, False) if len(set(ld)) > 1 else None for ld in leaders]
    bound = certificate(topology, collective, devices, root)

    def price(y):
        """Cheapest three-phase tree per partition i under link prices y: [(i, Column)]."""
        memo, out = {}, []
        for i, ld in enumerate(leaders):
            edges, usage = [], np.zeros(nl, dtype=np.int64)
            for k, part in enumerate(intra):
                if part is None:
                    continue
                r = root if (k == root_node and mode != "spanning") else (ld[k] if mode != "spanning" else None)
                r = part.table.devices[0] if r is None else r
                if (k, r) not in memo:
                    memo[k, r] = part.price(y, mode, r, nl)
                e, u = memo[k, r]
                usage = usage + u
                edges.extend(e)
            if cross[i] is not None:
                e, u = cross[i].price(y, mode, ld[root_node], nl)
                usage = usage + u
                edges.extend(e)
            out.append((i, Column(tuple(edges), usage)))
        return out

    # warm start: multiplicative-weights rounds (Garg-Koenemann, as Blink's TreeGen), all partitions
    res = column_generation(cap, price, warm_rounds=4, target=bound, what="three-phase packing", devices=devices)
    cols, part_of, rate, x = res.columns, res.labels, res.rate, res.weights
    it, dual = res.iterations, res.dual_bound
    w = fewest_trees(cap, cols, rate, max_trees, x)
    notes = []
    if w is None or (max_trees is None and w.sum() < rate * (1 - 1e-6)):
        w = x
        notes.append("tree-count reduction failed; using the LP's basic solution")
    keep = [j for j in range(len(w)) if w[j] > 1e-9]
    if max_trees is not None and len(keep) > max_trees:
        keep = sorted(sorted(keep, key=lambda j: -w[j])[:max_trees])
    kept = float(sum(w[j] for j in keep))
    if max_trees is not None and kept < rate * (1 - 1e-9):
        notes.append(f"max_trees={max_trees}: rate {kept:.3f} GB/s, {100 * (1 - kept / rate):.2f}% below "
                     f"the three-phase optimum {rate:.3f} GB/s")
    trees = []
    for i in range(npos):
        mine = [j for j in keep if part_of[j] == i]
        ws = [_round(w[j]) for j in mine]
        # all-reduce: the partition's trees are rooted at its leaders, load spread over the nodes
        roots = _spread_roots(ws, leaders[i]) if mode == "spanning" else [root] * len(ws)
        for j, wi, r in zip(mine, ws, roots):
            if mode == "spanning":
                hops = _orient(cols[j].edges, r)
            else:
                hops = _rooted_hops(cols[j].edges, mode, r)
            trees.append(Tree(r, wi, hops))
    trees.sort(key=lambda t: (-t.weight_gbps, _key(t.root), [(_key(a), _key(b)) for a, b in t.edges]))
    share = collections.Counter()
    for j in keep:
        share[part_of[j]] += _round(w[j])
    total = sum(share.values())
    notes.insert(0, f"three phases (Blink s. 5): data partitioned over the {npos} GPU positions of a node "
                    f"(shares GB/s {[round(share[i], 3) for i in range(npos)]}); partition i reduced inside "
                    f"each node onto GPU i, exchanged among the GPU i's {leaders[0]}.. across the network, "
                    f"broadcast inside each node; {len(trees)} trees, {total:.3f} GB/s of the max-flow bound "
                    f"{bound:.3f} (LP over three-phase trees: {it} rounds, dual bound {dual:.3f})")
    return Plan(collective, root, devices, tuple(trees), _round(sum(t.weight_gbps for t in trees)), _round(bound),
                "hierarchical", tuple(notes))


def _rooted_hops(edges, mode: str, root) -> tuple:
    """Broadcast-direction hops of (parent, child, route) edges, breadth-first from ``root`` (routes
    run child -> parent for ``mode="in-arborescence"``, see :class:`jax_blink.planner.routes.Column`)."""
    kids = collections.defaultdict(list)
    for p, c, r in edges:
        kids[p].append((c, tuple(r[::-1] if mode == "in-arborescence" else r)))
    hops, queue = [], [root]
    while queue:
        p = queue.pop(0)
        for c, r in sorted(kids[p], key=lambda x: (_key(x[0]), [_key(n) for n in x[1]])):
            queue.append(c)
            hops.extend(_hops(r))
    if len(hops) < sum(len(r) - 1 for _, _, r in edges):
        raise PlanError(f"three-phase tree rooted at {root} does not reach all of its edges")
    return tuple(hops)
