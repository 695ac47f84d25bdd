"""NCCL's double binary tree as a plan (Sanders, Speck, Traeff 2009; NCCL 2.4, ``src/graph/trees.cc``:
``ncclGetBtree`` / ``ncclGetDtree``).

:func:`double_binary_tree_plan`: two complementary binary trees over the ranks, each carrying half
the data, each GPU-level edge routed over the given links (direct link, else the fewest-hop path
through switch nodes, :func:`jax_blink.planner.routes.route`). :func:`nccl_tree_plan` builds it over
the links NCCL's rings use (:func:`jax_blink.planner.rings.nccl_links`). Like every baseline it is a
:class:`~jax_blink.planner.model.Plan`, so the simulator, the schedule builder, the cost model and
``jax-blink show`` treat it like a tree packing.
"""

from __future__ import annotations

import dataclasses
import math

from .bounds import allreduce_bound
from .model import Plan, Tree, _hops, job_devices
from .rings import _nccl_note, nccl_links
from .routes import route


def nccl_tree_plan(topology, *, devices=None) -> Plan:
    """NCCL's double binary tree all-reduce over the links NCCL's rings use (:func:`nccl_links`),
    except that at the "nvlink" level a pair of ranks without an NVLink route goes over PCIe (NCCL's
    tree sends between ranks over their best path). Raises PlanError like double_binary_tree_plan."""
    links, level = nccl_links(topology, devices)
    p = double_binary_tree_plan(topology if level == "nvlink" else links, devices=devices)
    if level == "pcie" and p.trees:  # the bound is over all links, not NCCL's PCIe subset
        p = dataclasses.replace(p, bound_gbps=max(p.rate_gbps, allreduce_bound(topology, p.devices)))
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
    on any all-reduce tree packing (:func:`jax_blink.planner.bounds.allreduce_bound`). Raises PlanError on
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
                max(2 * w, allreduce_bound(topology, devices)), "double-binary-tree",
                ("NCCL double binary tree: two complementary binary trees, half the data each",))
