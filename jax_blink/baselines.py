"""NCCL-style baselines expressed as plans: rings and the double binary tree.

Both return a :class:`jax_blink.packing.Plan` (docs/architecture.md), so the simulator, the schedule
builder and ``jax-blink show`` treat them like a tree packing:

- :func:`ring_plan`: the best packing of directed rings (Hamiltonian cycles) over the job's GPUs,
  from :func:`jax_blink.bounds.ring_packing` (LP over rings routed over NVLink where the allocation has
  such cycles, otherwise through PCIe/host/NVSwitch routes). All-reduce is NCCL's ring algorithm
  (reduce-scatter + all-gather: per ring, one tree per GPU); broadcast and reduce pipeline a chain
  along each ring from / to the root (NCCL's ring broadcast and reduce). Since the LP may combine
  fractional rings and mixed NVLink/PCIe rings, this baseline is at least as fast as the rings NCCL
  would build on the same links: speedups over it are conservative.
- :func:`double_binary_tree_plan`: NCCL's double binary tree (Sanders, Speck, Traeff 2009; NCCL 2.4,
  ``src/graph/trees.cc``: ``ncclGetBtree`` / ``ncclGetDtree``): two complementary binary trees over
  the ranks, each carrying half the data, each GPU-level edge routed over the topology (direct link,
  else the fewest-hop path through switch nodes).
"""

from __future__ import annotations

import math

from . import bounds as _bounds
from .errors import PlanError
from .packing import Plan, Tree, _hops, _ring_trees, job_devices, ring_paths
from .simulate import route


def ring_plan(topology, collective: str = "allreduce", *, devices=None, root=None) -> Plan:
    """NCCL-style ring plan for ``collective`` over ``devices`` (default: all GPUs).

    Returns a Plan with ``algorithm="ring"``. All-reduce: per ring of bandwidth b, n trees of weight
    b / (2(n-1)) (``packing._ring_trees``), so ``rate_gbps`` = n B / (2(n-1)) and the bandwidth-only
    time is 2(n-1)/n * S / B (B = total ring bandwidth). Broadcast / reduce: per ring, a chain of
    weight b from / to ``root`` along the ring, ``rate_gbps`` = B.
    Raises PlanError: unknown collective, bad devices or root, GPUs with no ring between them.
    """
    if collective not in ("allreduce", "broadcast", "reduce"):
        raise PlanError(f"unknown collective {collective!r}; expected allreduce, broadcast or reduce")
    devices = job_devices(topology, devices)
    n = len(devices)
    if collective != "allreduce":
        root = devices[0] if root is None else root
        if root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}")
    else:
        root = None
    if n == 1:
        return Plan(collective, root, devices, (), math.inf, math.inf, "trivial", ("one device",))
    b_ring, rings = _bounds.ring_packing(topology, devices)
    if not rings:
        raise PlanError(f"no ring over devices {list(devices)}: some GPUs cannot reach each other")
    note = (f"ring packing: {len(rings)} ring(s), {b_ring:.3f} GB/s in total",)
    if collective == "allreduce":
        trees = tuple(_ring_trees(rings, n))
        rate = n * b_ring / (2 * (n - 1))
        return Plan(collective, None, devices, trees, rate, rate, "ring", note)
    trees = []
    for cycle, routes, b in rings:
        chain, red = ring_paths(cycle, routes, root)
        # reduce flows along the ring into the root: the GPU after it -> ... -> root
        trees.append(Tree(root, b, chain) if collective == "broadcast" else Tree(root, b, chain, red))
    return Plan(collective, root, devices, tuple(trees), b_ring, b_ring, "ring", note)


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
    (``rate_gbps`` = 2 w with w = min over links of capacity / uses). Raises PlanError on bad devices
    or a pair of GPUs with no route.
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
    return Plan("allreduce", None, devices, trees, 2 * w, 2 * w, "double-binary-tree",
                ("NCCL double binary tree: two complementary binary trees, half the data each",))
