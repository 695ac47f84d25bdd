"""Fewer trees for a packing's rate (Blink's TreeGen ILP step) and dropping light trees.

Column generation (:mod:`jax_blink.planner.colgen`) returns an optimal basic solution, often with more
trees than needed. :func:`fewest_trees` picks few trees among the generated columns: reweighted-L1 LPs
and, over small column sets, the exact minimum-count ILP (HiGHS through ``highspy``); with
``max_trees=k`` the ILP maximises the rate with at most k trees. :func:`drop_light_trees` trades a
bounded rate loss for fewer, larger trees (``plan(rate_tolerance=...)``). Both re-optimise the
weights of the kept trees with the rate LP (:func:`jax_blink.planner.colgen.rate_lp`).
"""

from __future__ import annotations

import numpy as np

from .colgen import rate_lp, solve_lp

MILP_NODE_LIMIT = 200
#: HiGHS options of the max_trees ILP (the best rate with at most k trees): node-limited
#: (deterministic); the feasibility-jump heuristic and symmetry detection off (on these ILPs, <= 48
#: columns, they took ~90% of a 10-20 ms solve). It often stops at the node limit, so it keeps the
#: RINS / RENS sub-MIP heuristics, which find its incumbents (without them dgx1v max_trees=6 fell
#: from 80.33 to 74.70 GB/s).
MAX_TREES_ILP_OPTIONS = {"mip_max_nodes": MILP_NODE_LIMIT, "presolve": "on",
                         "mip_heuristic_run_feasibility_jump": False, "mip_detect_symmetry": False}
#: HiGHS options of the minimum-count ILP: as above, and without RINS / RENS and restarts, which cost
#: more than they found there: with the saturation rows, over the 161 ILPs of dgx1v allocations 1200 ->
#: 730 ms in all (max 132 -> 97 ms), the same minimum count in every one
ILP_OPTIONS = {**MAX_TREES_ILP_OPTIONS, "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
               "mip_allow_restart": False}
L1_ROUNDS = 6            # most reweighted-L1 LPs in the tree-count reduction
MILP_MAX_COLUMNS = 24    # exact min-count ILP only over at most this many generated trees (its root LP


def _equal_share_rows(groups, cols) -> np.ndarray | None:
    """Rows D with D w = 0 iff every group (root) of the columns ``cols`` carries the same total
    weight (sharded collectives: one group per shard owner); None for one group."""
    if groups is None:
        return None
    g = np.asarray(groups)[cols]
    ids = sorted(set(g.tolist()))
    if len(ids) < 2:
        return None
    member = (g[None, :] == np.array(ids)[:, None]).astype(np.float64)
    return member[:-1] - member[1:]


def _reoptimise(a: np.ndarray, cap: np.ndarray, keep, groups=None) -> np.ndarray | None:
    """LP (HiGHS): the largest total weight of the columns ``keep`` within the link capacities,
    every group carrying the same total (see :func:`_equal_share_rows`). Weights [len(keep)], or None
    when the LP fails or some group has no column in ``keep``."""
    if groups is not None and set(np.asarray(groups)[keep].tolist()) != set(groups):
        return None
    eq = _equal_share_rows(groups, keep)
    lp = rate_lp(a[:, keep], cap, eq)
    return None if lp.status != 0 else np.asarray(lp.x, dtype=np.float64)


def _fewest_possible(a: np.ndarray, cap: np.ndarray, rate: float, groups=None) -> int:
    """A lower bound on the number of trees (columns of usage matrix ``a`` [L, T]) that carry
    ``rate`` (1 - 1e-7) within the link capacities ``cap`` [L]: a tree weighs at most its bottleneck
    min cap / usage, so per group (root; one group when ``groups`` is None) at least as many trees
    as the heaviest bottlenecks needed to sum to the group's share. Lets the tree-count reduction
    stop when a solution already has this many trees."""
    with np.errstate(divide="ignore"):
        bott = np.min(np.where(a > 0, cap[:, None] / np.maximum(a, 1), np.inf), axis=0)
    g = np.zeros(a.shape[1], dtype=np.int64) if groups is None else np.asarray(groups)
    ids = sorted(set(g.tolist()))
    need = 0
    for i in ids:
        top = np.cumsum(np.sort(bott[g == i])[::-1])
        need += min(int(np.searchsorted(top, rate / len(ids) * (1 - 1e-7))) + 1, len(top))
    return need


def _saturation_rows(a: np.ndarray, cap: np.ndarray, rate: float):
    """Rows that keep the links the rate LP prices full, for the tree-count ILP: (rows [K, 2T] over
    [w, z], right-hand sides [K]) with -A_l w <= -(cap_l - (R - r) / y_l) for every link l of dual
    price y_l > 0, where R is the rate LP's optimum over the columns of ``a`` [L, T] and r = ``rate``
    (1 - 1e-7) the least total the ILP accepts. Valid for every w with A w <= ``cap`` and sum w >= r,
    by weak duality: R - sum w = y . (cap - A w) + sum_t (y . a_t - 1) w_t, every term >= 0, so link
    l's slack is at most (R - r) / y_l. Implied by the ILP's LP relaxation, so the minimum count is
    unchanged; HiGHS's presolve uses them (the 21-column ILP of dgx1v GPUs 1,2,3,5,6,7: 17 -> 8 ms).
    None when the LP fails or prices no link."""
    lp = rate_lp(a, cap)
    if lp.status != 0:
        return None
    y = -lp.duals[: a.shape[0]]
    priced = np.flatnonzero(y > 1e-9)
    if not len(priced):
        return None
    slack = max(-lp.fun - rate * (1 - 1e-7), 0.0) / y[priced] + 1e-9 * cap[priced]  # + rounding room
    rows = np.hstack([-a[priced], np.zeros((len(priced), a.shape[1]))])
    return rows, -(cap[priced] - slack)


def _tree_count_ilp(c, a, cap, rate, a_more, b_more, a_eq=None, options=None):
    """The tree-count ILP (HiGHS, node-limited so deterministic): minimise ``c`` over [w, z] (weights
    [T], 0/1 tree indicators [T]) subject to the link capacities ``a`` w <= ``cap``, w_t <= ``rate`` z_t,
    ``a_more`` [w, z] <= ``b_more`` and ``a_eq`` [w, z] = 0 (both over 2T columns); HiGHS ``options``
    (default :data:`ILP_OPTIONS`)."""
    t = a.shape[1]
    a_ub = np.vstack([np.hstack([a, np.zeros((a.shape[0], t))]), np.hstack([np.eye(t), -rate * np.eye(t)]),
                      np.asarray(a_more, dtype=np.float64)])
    b_ub = np.concatenate([cap, np.zeros(t), np.asarray(b_more, dtype=np.float64)])
    return solve_lp(c, a_ub, b_ub, a_eq, upper=np.concatenate([np.full(t, rate), np.ones(t)]),
                    integrality=np.concatenate([np.zeros(t), np.ones(t)]),
                    options=ILP_OPTIONS if options is None else options)


def fewest_trees(cap: np.ndarray, cols, rate: float, max_trees: int | None, lp_weights, groups=None):
    """Fewer trees over the generated columns (Blink's TreeGen ILP step).

    Without ``max_trees``: reweighted-L1 LPs (Candes, Wakin, Boyd 2008) minimise sum w_t / (w_t' + eps)
    subject to the link capacities and total rate >= ``rate`` (1 - 1e-7), keeping the sparsest
    support found; then, over at most MILP_MAX_COLUMNS trees, the exact minimum-count ILP (larger
    column sets, e.g. with PCIe links: the ILP took 0.1-1 s, so the L1 result stands). With
    ``max_trees=k``: the ILP (:func:`_tree_count_ilp`) maximising
    the total weight using at most k trees, or the LP's k heaviest trees re-optimised when those carry
    more (the ILP is node-limited).
    ``groups`` (sharded collectives): the root of each column; every root then carries rate / (number
    of roots) and the same share of any re-optimised total.
    ``cap``: float64 [L], the link capacities (GB/s); ``cols``: the columns (``usage`` int [L] each);
    ``lp_weights``: the LP's weights [T].
    Returns weights [T] re-optimised by an LP on the chosen trees, or None on failure.
    """
    t = len(cols)
    a = np.stack([c.usage for c in cols], axis=1).astype(np.float64)
    allcols = np.arange(t)
    eq = _equal_share_rows(groups, allcols)
    if groups is None:
        share_rows, share = -np.ones((1, t)), np.array([-rate * (1 - 1e-7)])
    else:
        ids = sorted(set(groups))
        share_rows = -(np.asarray(groups)[None, :] == np.array(ids)[:, None]).astype(np.float64)
        share = np.full(len(ids), -rate / len(ids) * (1 - 1e-7))
    if max_trees is None:
        fewest = _fewest_possible(a, cap, rate, groups)
        if np.count_nonzero(lp_weights > 1e-9) <= fewest:  # the LP's basic solution is already minimal
            return np.where(lp_weights > 1e-9, lp_weights, 0.0)
        best = lp_weights
        w = lp_weights
        for _ in range(L1_ROUNDS):
            cost = 1.0 / (w + 1e-3 * rate / t)
            res = solve_lp(cost, np.vstack([a, share_rows]), np.concatenate([cap, share]))
            if res.status != 0:
                break
            w = res.x
            if np.count_nonzero(w > 1e-9) < np.count_nonzero(best > 1e-9):
                best = w
            else:  # no sparser support this round: the reweighting has settled
                break
        chosen = np.flatnonzero(best > 1e-9)
        if t <= MILP_MAX_COLUMNS and len(chosen) > fewest:
            # exact minimum count over the generated trees while the ILP is small (milliseconds)
            more, more_b = np.hstack([share_rows, np.zeros_like(share_rows)]), share
            sat = _saturation_rows(a, cap, rate) if groups is None else None
            if sat is not None:
                more, more_b = np.vstack([more, sat[0]]), np.concatenate([more_b, sat[1]])
            res = _tree_count_ilp(np.concatenate([np.zeros(t), np.ones(t)]), a, cap, rate, more, more_b)
            if res.feasible and np.count_nonzero(res.x[t:] > 0.5) < len(chosen):
                chosen = np.flatnonzero(res.x[t:] > 0.5)
    else:
        count = np.concatenate([np.zeros(t), np.ones(t)])[None, :]
        res = _tree_count_ilp(np.concatenate([-np.ones(t), np.zeros(t)]), a, cap, rate, count, [max_trees],
                              None if eq is None else np.hstack([eq, np.zeros_like(eq)]), MAX_TREES_ILP_OPTIONS)
        chosen = np.flatnonzero(res.x[t:] > 0.5) if res.feasible else np.zeros(0, dtype=np.int64)
        # the ILP stops at its node limit with its best so far; the LP's max_trees heaviest columns,
        # re-optimised, can do better when max_trees is close to the LP's support (many columns)
        heavy = np.sort(np.argsort(-np.asarray(lp_weights), kind="stable")[:max_trees])
        best = None
        for keep in (chosen, heavy):  # each re-optimised once; the heavy set only when strictly better
            x = _reoptimise(a, cap, keep, groups) if len(keep) else None
            if x is not None and (best is None or x.sum() > best.sum() + 1e-9):
                best = np.zeros(t)
                best[keep] = x
        return best
    if not len(chosen):
        return None
    if max_trees is None and np.array_equal(chosen, np.flatnonzero(lp_weights > 1e-9)):
        return np.where(lp_weights > 1e-9, lp_weights, 0.0)  # no fewer trees: the LP's weights stand
    x = _reoptimise(a, cap, chosen, groups)
    if x is None:
        return None
    w = np.zeros(t)
    w[chosen] = x
    return w


def drop_light_trees(cap: np.ndarray, cols, w, rate: float, tolerance: float, groups=None):
    """Drop the lightest trees while the re-optimised rate of the rest stays >= (1 - tolerance) * rate.

    Trees sorted by weight (ties by index); binary search on how many of the lightest to drop, each
    probe an LP (HiGHS) re-optimising the weights of the kept trees (``groups``: equal per-root
    totals, see :func:`_reoptimise`). Returns (weights [T], dropped)."""
    order = sorted((i for i in range(len(w)) if w[i] > 1e-9), key=lambda i: (w[i], i))
    a = np.stack([c.usage for c in cols], axis=1).astype(np.float64)

    def solve(k):
        keep = sorted(order[k:])
        x = _reoptimise(a, cap, keep, groups)
        if x is None or x.sum() < rate * (1 - tolerance) - 1e-9:
            return None
        out = np.zeros(len(w))
        out[keep] = x
        return out

    lo, hi, best = 0, len(order) - 1, w  # invariant: dropping lo trees is fine
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = solve(mid)
        if got is None:
            hi = mid - 1
        else:
            lo, best = mid, got
    return best, lo
