"""All-reduce as reduce-scatter then all-gather on the optimal forests ("rsag"; ForestColl, Zhao et
al. 2024, section 3).

The all-gather and reduce-scatter packings themselves (arborescences rooted at every shard owner,
every owner's trees weighing the same) are :func:`jax_blink.planner.colgen.solve_rooted_packing`
run by :func:`jax_blink.planner.trees.flat_plan`; this module pairs the two forests into one
executable all-reduce plan.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .model import Plan, Tree, _round


def rsag_plan(devices, rs: Plan, ag: Plan, max_trees) -> Plan:
    """All-reduce as reduce-scatter then all-gather on the optimal forests (ForestColl, Zhao et al.
    2024, section 3), as one executable all-reduce plan.

    Per root r, the reduce-scatter in-trees of r (weights a_i, sum x_rs) and the all-gather trees of
    r (weights b_j, sum x_ag) are paired over the common refinement of their weight fractions: each
    pair is one Tree rooted at r whose ``reduce_edges`` is the in-tree and ``edges`` the out-tree
    (the format of ring all-reduce trees), so the schedule reduces r's part of the buffer to r and
    broadcasts it back. Weights: fraction * x with 1/x = 1/x_rs + 1/x_ag, so both forests run at
    once within every link's capacity (loads x (U_rs / x_rs + U_ag / x_ag) <= cap); the rate n x
    gives the time S / (n x_rs) + S / (n x_ag): reduce-scatter time plus all-gather time. Certificate:
    1 / (1 / B_rs + 1 / B_ag) with B the two cut bounds (no RS + AG pair of packings is faster).

    ``rs``, ``ag``: the reduce-scatter and all-gather tree plans over ``devices``. Raises PlanError
    when the pairing has more than ``max_trees`` trees."""
    n = len(devices)
    x = 1.0 / (n / rs.rate_gbps + n / ag.rate_gbps)
    trees = []
    for d in devices:
        a = [t for t in rs.trees if t.root == d]
        b = [t for t in ag.trees if t.root == d]
        ca = np.cumsum([t.weight_gbps for t in a]) / sum(t.weight_gbps for t in a)
        cb = np.cumsum([t.weight_gbps for t in b]) / sum(t.weight_gbps for t in b)
        prev = 0.0
        for c in sorted(set(np.round(np.concatenate([ca, cb]), 12).tolist())):
            if c - prev > 1e-12:
                mid = (prev + c) / 2
                i = min(int(np.searchsorted(ca, mid)), len(a) - 1)
                j = min(int(np.searchsorted(cb, mid)), len(b) - 1)
                trees.append(Tree(d, _round((c - prev) * x), b[j].edges, a[i].edges))
            prev = c
    if max_trees is not None and len(trees) > max_trees:
        raise PlanError(f"the reduce-scatter + all-gather plan over devices {list(devices)} has {len(trees)} "
                        f"trees > max_trees={max_trees}")
    rate = _round(sum(t.weight_gbps for t in trees))
    bound = 1.0 / (1.0 / rs.bound_gbps + 1.0 / ag.bound_gbps)
    note = (f"rsag: reduce-scatter forest {rs.rate_gbps:.3f} GB/s ({len(rs.trees)} trees) then all-gather forest "
            f"{ag.rate_gbps:.3f} GB/s ({len(ag.trees)} trees), paired per root and run pipelined: all-reduce "
            f"rate 1/(1/{rs.rate_gbps:.3f} + 1/{ag.rate_gbps:.3f}) = {rate:.3f} GB/s",)
    return Plan("allreduce", None, devices, tuple(trees), rate, _round(bound), "rsag", note)
