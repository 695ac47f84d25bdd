"""Flat tree packings: the exact packing over all of the job's GPUs at once (Blink, MLSys 2020, s. 4).

- broadcast from r: LP over r-rooted spanning arborescences with routes, column generation
  (:func:`jax_blink.planner.colgen.solve_packing`); certificate = Edmonds' max-flow bound. Reduce: the
  same on reversed links (tree edges are stored in broadcast direction; reduce data flows child -> parent).
- all-reduce (reduce then broadcast on the same trees, Blink s. 4.2): undirected spanning-tree packing
  where each tree uses both directions of its links; on direct-link topologies the optimum is the
  Nash-Williams value. Tree roots are spread over GPUs. A ring packing (NCCL,
  :mod:`jax_blink.planner.rings`) is planned too and chosen when its predicted time
  2(n-1)/n * S / B_ring beats S / R_trees.
- all-gather / reduce-scatter: one LP over arborescences rooted at every GPU, every root's trees
  weighing the same (:func:`jax_blink.planner.colgen.solve_rooted_packing`); certificate = the exact
  cut bound (:func:`jax_blink.planner.bounds.allgather_bound`), which the packing reaches on the presets.
- fewer trees: :mod:`jax_blink.planner.minimize` (Blink's TreeGen ILP, ``max_trees``, ``rate_tolerance``).
- relays: routes may forward through GPUs outside the job (:func:`relay_plan`).
"""

from __future__ import annotations

import numpy as np

from .. import collectives as _collectives
from ..topology.model import _key
from .bounds import certificate
from .colgen import solve_packing, solve_rooted_packing
from .minimize import drop_light_trees, fewest_trees
from .model import Plan, Tree, _column_hops, _orient, _round, cached, plan_cache
from .rings import allreduce_ring_plan, ring_packing
from .routes import RouteTable

_TREE_PLANS = plan_cache()


def _spread_roots(weights, devices) -> list:
    """Assign each all-reduce tree a root so per-GPU root load (sum of weights) is balanced:
    heaviest tree first to the least-loaded GPU, ties to the earlier device (deterministic)."""
    load = {d: 0.0 for d in devices}
    roots = [None] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-round(weights[i], 9), i)):
        d = min(devices, key=lambda d: (round(load[d], 9), devices.index(d)))
        roots[i] = d
        load[d] += weights[i]
    return roots


def _mode(collective: str) -> str:
    """The LP column kind of ``collective`` (:class:`jax_blink.planner.routes.Column`): broadcast-like collectives pack
    out-arborescences, reduce-like ones in-arborescences, all-reduce undirected spanning trees."""
    row = _collectives.get(collective)
    if row.reduces and row.broadcasts:
        return "spanning"
    return "in-arborescence" if row.reduces else "arborescence"


def tree_plan(topology, devices, collective, root, max_trees, relays=(), target=None, rate_tolerance=0.0,
              fingerprint=None):
    """:func:`_tree_plan_uncached`, memoised: plans that differ only in ``algorithm`` share it.
    ``fingerprint``: ``topology.fingerprint()`` when the caller has it already (computed otherwise)."""
    key = (fingerprint or topology.fingerprint(), tuple(devices), collective, root, max_trees, tuple(relays), target,
           rate_tolerance)
    trees, rate, dual, table, notes, exact = cached(
        _TREE_PLANS, key, lambda: _tree_plan_uncached(topology, devices, collective, root, max_trees, relays,
                                                       target, rate_tolerance))
    return list(trees), rate, dual, table, list(notes), exact


def _tree_plan_uncached(topology, devices, collective, root, max_trees, relays=(), target=None,
                        rate_tolerance=0.0):
    """Exact LP packing + tree-count ILP on one node (no hierarchy).

    ``target``: an independent upper bound (max-flow) that stops column generation once reached.
    Returns (trees, rate, dual bound, route table, notes, exact LP rate before ``rate_tolerance``)."""
    table = RouteTable.build(topology, devices, relays)
    table.check_connected(f"{collective} plan")
    mode = _mode(collective)
    if _collectives.get(collective).sharded:
        res = solve_rooted_packing(table, mode, target=target)
    else:
        res = solve_packing(table, mode, devices[0] if root is None else root, target=target)
    notes = []
    w = fewest_trees(table.cap, res.columns, res.rate, max_trees, res.weights, res.roots)
    if w is None or w.sum() < res.rate * (1 - 1e-6) and max_trees is None:
        w = res.weights
        notes.append("tree-count reduction failed; using the LP's basic solution")
    if rate_tolerance > 0 and max_trees is None:
        before = int(np.count_nonzero(w > 1e-9))
        w, dropped = drop_light_trees(table.cap, res.columns, w, res.rate, rate_tolerance, res.roots)
        if dropped:
            notes.append(f"rate_tolerance={rate_tolerance:g}: {before} -> {before - dropped} trees, rate "
                         f"{float(w.sum()):.3f} of the optimum {res.rate:.3f} GB/s")
    keep = [i for i in range(len(w)) if w[i] > 1e-9]
    if max_trees is not None and len(keep) > max_trees:  # ILP failed: keep the heaviest k
        keep = sorted(sorted(keep, key=lambda i: -w[i])[:max_trees])
    rate = float(sum(w[i] for i in keep))
    if max_trees is not None and rate < res.rate * (1 - 1e-9):
        notes.append(f"max_trees={max_trees}: rate {rate:.3f} GB/s, {100 * (1 - rate / res.rate):.2f}% below "
                     f"the optimum {res.rate:.3f} GB/s")
    ws = [_round(w[i]) for i in keep]
    if collective == "allreduce":
        roots = _spread_roots(ws, list(devices))
        trees = [Tree(r, wi, _orient(res.columns[i].edges, r), relays=relays)
                 for i, wi, r in zip(keep, ws, roots)]
    elif res.roots is not None:  # sharded: every GPU roots the trees of its own shard
        trees = [Tree(res.roots[i], wi, _column_hops(res.columns[i], mode), relays=relays)
                 for i, wi in zip(keep, ws)]
    else:
        trees = [Tree(root, wi, _column_hops(res.columns[i], mode), relays=relays) for i, wi in zip(keep, ws)]
    trees.sort(key=lambda t: (-t.weight_gbps, _key(t.root), [(_key(a), _key(b)) for a, b in t.edges]))
    return trees, float(sum(ws)), res.dual_bound, table, notes, res.rate


def flat_plan(topology, collective, devices, root, max_trees, algorithm="auto", rate_tolerance=0.0,
              fingerprint=None) -> Plan:
    """Exact packing over all job GPUs at once (``algorithm`` "auto" or "trees"), plus the ring
    alternative for all-reduce: "auto" takes the ring packing when its rate beats the trees'.
    ``fingerprint``: ``topology.fingerprint()`` when the caller has it (see :func:`tree_plan`)."""
    n = len(devices)
    # all-reduce: the min max-flow between GPUs bounds the tree packing too: column generation
    # stops as soon as it is reached, without a last pricing round to prove optimality
    bound = certificate(topology, collective, devices, root)
    trees, rate, dual, table, notes, exact = tree_plan(topology, devices, collective, root, max_trees,
                                                       target=bound, rate_tolerance=rate_tolerance,
                                                       fingerprint=fingerprint)
    if collective == "allreduce":
        # any ring crosses every directed cut between job GPUs, so B_ring <= min max-flow between GPUs
        ring_cap = n * bound / (2 * (n - 1))
        bound = dual
        if algorithm == "auto" and ring_cap <= exact * (1 + 1e-6):
            notes.append(f"trees chosen: all-reduce rate {rate:.3f} GB/s >= any ring's n*B/(2(n-1)) <= "
                         f"{ring_cap:.3f} GB/s (B <= min max-flow between GPUs; ring packing not needed)")
            return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees",
                        tuple(notes))
        b_ring, rings = ring_packing(topology, devices, table)
        ring_rate = n * b_ring / (2 * (n - 1)) if b_ring > 0 else 0.0
        ring_fits = max_trees is None or n * len(rings) <= max_trees
        faster = algorithm == "auto" and ring_rate > exact * (1 + 1e-6)
        if faster and not ring_fits:
            notes.append(f"a ring packing would reach {ring_rate:.3f} GB/s but needs {n * len(rings)} trees "
                         f"> max_trees={max_trees}")
        elif faster:
            return allreduce_ring_plan(devices, b_ring, rings, ring_cap, notes,
                                       f"ring chosen over trees ({rate:.3f} GB/s)")
        else:
            notes.append(f"trees chosen: all-reduce rate {rate:.3f} GB/s >= ring {ring_rate:.3f} GB/s "
                         f"(rings of {b_ring:.3f} GB/s, time 2(n-1)/n*S/B)")
    return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees",
                tuple(notes))


def relay_plan(topology, collective, devices, root, max_trees, relays, rate_tolerance) -> Plan:
    """Tree packing whose routes may forward through the ``relays`` GPUs (GPUs outside the job).
    Certificate: the max-flow bound over the relay-allowed graph (relays behave like switch nodes)."""
    bound = certificate(topology, collective, devices, root, relays)
    target = bound if collective != "allreduce" else None
    trees, rate, dual, _, notes, _ = tree_plan(topology, devices, collective, root, max_trees, relays, target,
                                             rate_tolerance)
    used = sorted({x for t in trees for r in t.routes() for x in r[1:-1] if x in relays})
    notes.append(f"relay GPUs {used or 'none'} of allowed {list(relays)} forward data inside routes: running "
                 f"this plan needs them to forward (simulate models it; build_schedule refuses it)")
    if collective == "allreduce":
        bound = dual
    return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees", tuple(notes),
                relays)
