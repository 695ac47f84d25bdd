"""NCCL-style baselines expressed as plans: rings and the double binary tree.

All return a :class:`jax_blink.packing.Plan` (docs/architecture.md), so the simulator, the schedule
builder, the cost model and ``jax-blink show`` treat them like a tree packing:

- :func:`ring_plan`: the best packing of directed rings (Hamiltonian cycles) over the job's GPUs,
  from :func:`jax_blink.bounds.ring_packing` (LP over rings routed over any links: NVLink, PCIe,
  host, NVSwitch). All-reduce is NCCL's ring algorithm (reduce-scatter + all-gather: per ring, one
  tree per GPU); broadcast and reduce pipeline a chain along each ring from / to the root. The LP may
  mix fractional and NVLink/PCIe rings: at least as fast as any ring on the same links.
- :func:`nccl_ring_plan`: rings on the links NCCL's search uses (:func:`nccl_links`): NVLink (direct
  or through an NVSwitch) when those links hold a ring through every GPU of the job, otherwise PCIe /
  inter-socket links only. NCCL falls back to PCIe rings when it cannot close an NVLink ring (Blink,
  MLSys 2020, s. 2: the source of its largest speedups on fragmented DGX-1 allocations).
- :func:`double_binary_tree_plan`: NCCL's double binary tree (Sanders, Speck, Traeff 2009; NCCL 2.4,
  ``src/graph/trees.cc``: ``ncclGetBtree`` / ``ncclGetDtree``): two complementary binary trees over
  the ranks, each carrying half the data, each GPU-level edge routed over the given links (direct
  link, else the fewest-hop path through switch nodes). :func:`nccl_tree_plan` builds it over the
  same links as :func:`nccl_ring_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import networkx as nx

from . import bounds as _bounds
from . import collectives
from .errors import PlanError
from .packing import Plan, Tree, _bound, _hops, job_devices, plan, ring_paths
from .simulate import route
from .topology import Topology

NVLINK_KINDS = ("nvlink", "nvswitch")


def ring_plan(topology, collective: str = "allreduce", *, devices=None, root=None) -> Plan:
    """NCCL-style ring plan for ``collective`` over ``devices`` (default: all GPUs).

    Returns a Plan with ``algorithm="ring"``. All-reduce: per ring of bandwidth b, n trees of weight
    b / (2(n-1)) (``packing._ring_trees``), so ``rate_gbps`` = n B / (2(n-1)) and the bandwidth-only
    time is 2(n-1)/n * S / B (B = total ring bandwidth). All-gather / reduce-scatter (NCCL's ring:
    each shard travels n-1 hops): per ring and GPU, a chain of weight b / (n-1) rooted at that GPU,
    ``rate_gbps`` = n B / (n-1), time (n-1)/n * S / B for the full buffer S. Broadcast / reduce: per
    ring, a chain of weight b from / to ``root`` along the ring, ``rate_gbps`` = B.
    Raises PlanError: unknown collective, bad devices or root, GPUs with no ring between them.
    """
    if collective not in collectives.COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; expected one of {tuple(collectives.COLLECTIVES)}")
    sharded = collectives.get(collective).sharded
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
        return plan(topology, collective, devices=devices, algorithm="ring")
    b_ring, rings = _bounds.ring_packing(topology, devices)
    if not rings:
        raise PlanError(f"no ring over devices {list(devices)}: some GPUs cannot reach each other")
    note = (f"ring packing: {len(rings)} ring(s), {b_ring:.3f} GB/s in total",)
    trees = []
    for cycle, routes, b in rings:
        chain, red = ring_paths(cycle, routes, root)
        # reduce flows along the ring into the root: the GPU after it -> ... -> root
        trees.append(Tree(root, b, chain) if collective == "broadcast" else Tree(root, b, chain, red))
    bound = (_bounds.broadcast_bound if collective == "broadcast" else _bounds.reduce_bound)(topology, devices, root)
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


@functools.lru_cache(maxsize=256)
def _nccl_level(topology: Topology, devices: tuple) -> str:
    """"nvlink" when NVLink links alone close a ring through ``devices``, else "pcie" when the other
    links do, else "any" (a topology without a PCIe tree: rings over every link)."""
    for level, keep in (("nvlink", True), ("pcie", False)):
        sub = _links_of_kind(topology, keep)
        if _bounds.ring_packing(sub, devices)[0] > 0:
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
        return max(p.rate_gbps, n * _bounds.allreduce_bound(topology, p.devices) / (2 * (n - 1)))
    return max(p.rate_gbps, _bound(topology, p.collective, p.devices, p.root))


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


def nccl_tree_plan(topology, *, devices=None) -> Plan:
    """NCCL's double binary tree all-reduce over the links NCCL's rings use (:func:`nccl_links`),
    except that at the "nvlink" level a pair of ranks without an NVLink route goes over PCIe (NCCL's
    tree sends between ranks over their best path). Raises PlanError like double_binary_tree_plan."""
    links, level = nccl_links(topology, devices)
    p = double_binary_tree_plan(topology if level == "nvlink" else links, devices=devices)
    if level == "pcie" and p.trees:  # the bound is over all links, not NCCL's PCIe subset
        p = dataclasses.replace(p, bound_gbps=max(p.rate_gbps, _bounds.allreduce_bound(topology, p.devices)))
    return _nccl_note(p, level, "double binary tree")


def btree_parents(nranks: int) -> list[int]:
    """Parent rank of every rank in NCCL's binary tree (``ncclGetBtree``), -1 at the root (rank 0).

    The parent of rank r is ``(r ^ bit) | (bit << 1)`` (or ``r ^ bit`` when that is out of range)
    where ``bit`` is r's lowest set bit; it alternates leaves and inner nodes so the mirrored or
    shifted second tree (:func:`dtree_parents`) makes every inner node a leaf there.
    """
    out = []
    for r in range(nranks):
        if r == 0:
            out.append(-1)
            continue
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        out.append(up if up < nranks else r ^ bit)
    return out


def dtree_parents(nranks: int) -> tuple[list[int], list[int]]:
    """The two trees of NCCL's double binary tree (``ncclGetDtree``) as parent arrays.

    Tree 0 is :func:`btree_parents`; tree 1 is its mirror (r -> n-1-r) for an even rank count and
    its shift by one (r -> r+1 mod n) for an odd count.
    """
    t0 = btree_parents(nranks)
    if nranks % 2 == 1:
        t1 = [-1] * nranks
        for r in range(nranks):
            p = t0[(r - 1) % nranks]
            t1[r] = -1 if p == -1 else (p + 1) % nranks
    else:
        t1 = [-1 if t0[nranks - 1 - r] == -1 else nranks - 1 - t0[nranks - 1 - r] for r in range(nranks)]
    return t0, t1


def double_binary_tree_plan(topology, *, devices=None) -> Plan:
    """NCCL's double binary tree all-reduce over ``devices`` (rank r <-> ``devices[r]``).

    Two trees (:func:`dtree_parents`), each carrying half the data: reduce up, broadcast down.
    Tree weights are equal and as large as the links allow when both trees run at once
    (``rate_gbps`` = 2 w with w = min over links of capacity / uses); ``bound_gbps`` is the bound
    on any all-reduce tree packing (:func:`jax_blink.bounds.allreduce_bound`). Raises PlanError on
    bad devices or a pair of GPUs with no route.
    """
    devices = job_devices(topology, devices)
    n = len(devices)
    if n == 1:
        return Plan("allreduce", None, devices, (), math.inf, math.inf, "trivial", ("one device",))
    trees = []
    for parents in dtree_parents(n):
        root = devices[parents.index(-1)]
        order, hops = [parents.index(-1)], []
        for p in order:  # breadth-first, parents before children
            for c in range(n):
                if parents[c] == p:
                    order.append(c)
                    path = [devices[p]] + [b for _, b in route(topology, devices[p], devices[c])]
                    hops.extend(_hops(path))
        trees.append(Tree(root, 1.0, tuple(hops)))
    use: dict = {}
    for t in trees:
        for e, k in t.link_usage("allreduce").items():
            use[e] = use.get(e, 0) + k
    w = min(topology.graph.edges[e]["bandwidth_gbps"] / k for e, k in use.items())
    trees = tuple(Tree(t.root, w, t.edges) for t in trees)
    # certificate of the family (any all-reduce tree packing), not these two trees' own rate
    return Plan("allreduce", None, devices, trees, 2 * w,
                max(2 * w, _bounds.allreduce_bound(topology, devices)), "double-binary-tree",
                ("NCCL double binary tree: two complementary binary trees, half the data each",))
