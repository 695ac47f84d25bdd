"""Identical nodes of a cluster: which GPUs form N copies of one node around one network node.

A job whose GPUs lie in N nodes that are the same up to relabelling (GPUs by position, switches,
links and NIC links) joined through exactly one network node (``multi_node``'s ``"network"``) is
symmetric under any permutation of its nodes: :func:`node_structure` finds that structure
(:class:`NodeStructure`: the groups, an isomorphism of every node onto node 0, node 0 plus the
network node as a template topology) and :func:`node_topology` gives node 0 alone. The planner's
symmetric algorithms (``jax_blink.planner.symmetric``) plan one node and compose; the cost model
plans one node's collectives on :func:`node_topology`.

Isomorphism: multi_node's ``n<k>-`` switch names give a candidate map that is checked link by
link; otherwise networkx's VF2 (``DiGraphMatcher``) with GPUs pinned by position, links matched by
bandwidth, kind and link count.
"""

from __future__ import annotations

import dataclasses
import re

import networkx as nx

from .model import Topology, cached, derived_cache

_STRUCTURES = derived_cache()
_NODE_PREFIX = re.compile(r"^n(\d+)-(.+)$")


@dataclasses.dataclass(frozen=True)
class NodeStructure:
    """The job's GPUs as N identical nodes around one network node.

    Attributes:
      groups: GPU ids per node (node order of ``devices``; each sorted), all the same length G.
      network: id of the network node X (kind "network").
      maps: per node, {template node id: this node's id} for node 0's GPUs and switches (the
        template is node 0; ``maps[0]`` is the identity); X maps to itself.
      template: node 0's job graph plus X as a ``Topology`` in which X is GPU ``x_id`` (so routes
        GPU -> X come from :class:`~jax_blink.planner.routes.RouteTable`).
      x_id: the integer id X has in ``template``.
      fingerprint: the cluster topology's fingerprint (the structure's cache key; composed plans'
        identity, computed once: a pass over every link of the cluster).
    """

    groups: tuple
    network: str
    maps: tuple
    template: Topology
    x_id: int
    fingerprint: str = ""

    @property
    def n_nodes(self) -> int:
        return len(self.groups)


def _label(g, n, pos):
    kind = g.nodes[n]["kind"]
    return ("gpu", pos[n]) if kind == "gpu" else (kind,)


def _edge_sig(d):
    return (round(float(d["bandwidth_gbps"]), 9), d.get("kind"), d.get("links"))


def _node_edges(g, nodes: set, net) -> list:
    """(u, v, signature) of the links among ``nodes`` and between them and the network node ``net``
    (networkx's adjacency dicts directly: this runs over every node of a 1,024-GPU cluster, where
    the edge views cost several times more)."""
    succ = g._succ
    out = [(u, v, _edge_sig(d)) for u in nodes for v, d in succ[u].items() if v in nodes or v == net]
    out += [(net, v, _edge_sig(succ[net][v])) for v in nodes if v in succ[net]]
    return out


def _map_node(g, comp0, comp_k, pos0, posk, net, e0=None):
    """{node-0 id: node-k id} for an isomorphism of the two nodes that keeps GPU positions, or None.
    Fast path: multi_node's "n<k>-" switch names; else networkx's VF2 with GPUs pinned by position.
    ``e0``: :func:`_node_edges` of node 0 (computed when None)."""
    inv0 = {p: n for n, p in pos0.items()}
    m = {inv0[p]: n for n, p in posk.items()}
    m[net] = net
    by_rest = {}
    for s in comp_k:
        if not isinstance(s, int):
            hit = _NODE_PREFIX.match(str(s))
            if hit:
                by_rest[hit.group(2)] = s
    fast = dict(m)
    for s in comp0:
        if isinstance(s, int):
            continue
        hit = _NODE_PREFIX.match(str(s))
        if not hit or hit.group(2) not in by_rest:
            fast = None
            break
        fast[s] = by_rest[hit.group(2)]
    nodes0 = set(comp0) | {net}
    nodes_k = set(comp_k) | {net}
    if e0 is None:
        e0 = _node_edges(g, set(comp0), net)
    kinds = g._node

    def valid(mp):
        if len(set(mp.values())) != len(mp) or set(mp.values()) != nodes_k:
            return False
        for n in comp0:
            a, b = kinds[n]["kind"], kinds[mp[n]]["kind"]
            if a != b or (a == "gpu" and pos0[n] != posk[mp[n]]):
                return False
        ek = _node_edges(g, set(comp_k), net)
        if len(e0) != len(ek):
            return False
        succ = g._succ
        for u, v, sig in e0:
            d = succ[mp[u]].get(mp[v])
            if d is None or _edge_sig(d) != sig:
                return False
        return True

    if fast is not None and valid(fast):
        return fast
    lab = {**{n: _label(g, n, pos0) for n in comp0}, **{n: _label(g, n, posk) for n in comp_k}, net: ("x",)}
    h0, hk = nx.DiGraph(g.subgraph(nodes0)), nx.DiGraph(g.subgraph(nodes_k))
    nx.set_node_attributes(h0, {n: lab[n] for n in h0}, "_l")
    nx.set_node_attributes(hk, {n: lab[n] for n in hk}, "_l")
    gm = nx.algorithms.isomorphism.DiGraphMatcher(
        h0, hk, node_match=lambda a, b: a["_l"] == b["_l"], edge_match=lambda a, b: _edge_sig(a) == _edge_sig(b))
    for iso in gm.isomorphisms_iter():
        return dict(iso)
    return None


def node_structure(topology: Topology, devices, fingerprint: str | None = None) -> NodeStructure | None:
    """The :class:`NodeStructure` of ``devices`` on ``topology``, or None when the job is not two or
    more identical nodes (same GPUs by position, switches, links and NIC links) around exactly one
    network node. Cached by (topology fingerprint, devices); ``fingerprint``: ``topology.fingerprint()``
    when the caller has it (a pass over every link of the cluster otherwise)."""
    devices = tuple(devices)
    key = (fingerprint or topology.fingerprint(), devices)
    return cached(_STRUCTURES, key, lambda: _node_structure(topology, devices, key[0]))


def _job_graph(topology, devices):
    # every GPU: the whole graph, not a copy (subset's dead-end pruning only matters for some GPUs)
    return topology.graph if len(devices) == len(topology.gpus) else topology.subset(devices).graph


def _template(topology, job, comp0, net, x_id) -> Topology:
    """Node 0 (``comp0``: its GPUs and switches) and the network node ``net`` of ``job`` as a Topology
    in which ``net`` is GPU ``x_id``."""
    t = Topology(f"{topology.name}:node")
    sub = job.subgraph(set(comp0) | {net})
    for n, d in sub.nodes(data=True):
        if n == net:
            t.graph.add_node(x_id, **{**d, "kind": "gpu"})
        else:
            t.graph.add_node(n, **d)
    for u, v, d in sub.edges(data=True):
        t.graph.add_edge(x_id if u == net else u, x_id if v == net else v, **d)
    return t


def _node_structure(topology, devices, fingerprint):
    kinds = topology.graph.nodes(data="kind")
    nets = [n for n, k in kinds if k == "network"]
    if len(nets) != 1:
        return None
    gpus = topology.gpus
    job = _job_graph(topology, devices)
    if nets[0] not in job:
        return None
    net = nets[0]
    comps, seen = [], {net}
    succ, pred = job._succ, job._pred  # plain dicts: a breadth-first pass, not a networkx view's
    for s in job:
        if s in seen:
            continue
        seen.add(s)
        comp, queue = {s}, [s]
        while queue:
            u = queue.pop()
            for v in (*succ[u], *pred[u]):
                if v not in seen:
                    seen.add(v)
                    comp.add(v)
                    queue.append(v)
        comps.append(comp)
    dev_pos = {d: i for i, d in enumerate(devices)}
    comps = [c for c in comps if any(isinstance(n, int) for n in c)]
    if len(comps) < 2:  # (the network node is in none: the search starts with it seen)
        return None
    comps.sort(key=lambda c: min(dev_pos[n] for n in c if isinstance(n, int)))
    groups = [tuple(sorted(n for n in c if isinstance(n, int))) for c in comps]
    if len({len(gs) for gs in groups}) != 1:
        return None
    pos = [{d: i for i, d in enumerate(gs)} for gs in groups]
    maps = []
    e0 = _node_edges(job, set(comps[0]), net)
    for k, comp in enumerate(comps):
        m = _map_node(job, comps[0], comp, pos[0], pos[k], net, e0)
        if m is None:
            return None
        maps.append(m)
    x_id = max(gpus) + 1
    return NodeStructure(tuple(groups), net, tuple(maps), _template(topology, job, comps[0], net, x_id), x_id,
                         fingerprint)


_NODES = derived_cache()


def node_topology(struct: NodeStructure) -> Topology:
    """Node 0 of ``struct`` alone (its GPUs, switches and links; no NICs' network), as a Topology: what
    one node's own collectives run on, the same for every cluster size (cached per template). Its
    GPU and switch ids are node 0's ids in the cluster topology."""
    def make():
        t = Topology(f"{struct.template.name}0")
        t.graph = nx.DiGraph(struct.template.graph.subgraph([v for v in struct.template.graph if v != struct.x_id]))
        return t.subset(struct.groups[0])
    return cached(_NODES, struct.template.fingerprint(), make)
