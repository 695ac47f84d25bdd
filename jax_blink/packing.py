"""TreeGen: optimal spanning-tree packings for broadcast, reduce and all-reduce (Blink, MLSys 2020, s. 4),
all-gather and reduce-scatter (ForestColl, Zhao et al. 2024).

:func:`plan` returns a :class:`Plan`: weighted trees over the job's GPUs whose edges may relay
through switch nodes, the rate they reach, and a certificate (:mod:`jax_blink.bounds`).

Method (exact, where Blink used a (1-eps) multiplicative-weights approximation):
- broadcast from r: LP over r-rooted spanning arborescences with routes (:mod:`jax_blink.routes`),
  column generation with HiGHS; certificate = Edmonds' max-flow bound. Reduce: the same on reversed
  links (tree edges are stored in broadcast direction; reduce data flows child -> parent).
- all-reduce (reduce then broadcast on the same trees, Blink s. 4.2): undirected spanning-tree packing
  where each tree uses both directions of its links; on direct-link topologies the optimum is the
  Nash-Williams value. Tree roots are spread over GPUs. A ring packing (NCCL) is planned too and
  chosen when its predicted time 2(n-1)/n * S / B_ring beats S / R_trees.
- all-gather: one LP over out-arborescences rooted at every GPU, max x with every root's trees
  weighing x in total (rate n x), column generation with one minimum arborescence per root as
  pricing (:func:`jax_blink.routes.solve_rooted_packing`); certificate = the exact cut bound
  (:func:`jax_blink.bounds.allgather_bound`), which the packing reaches on the presets. Reduce-scatter:
  the same with in-arborescences (reversed links). ``algorithm="ring"``: NCCL's ring (each shard
  travels n-1 hops). ``algorithm="rsag"``: all-reduce as reduce-scatter then all-gather forests.
- fewer trees (Blink's TreeGen ILP): ``scipy.optimize.milp`` over the generated trees minimises the
  tree count at the LP rate, or with ``max_trees=k`` maximises the rate with at most k trees.
- multi-node (GPUs in several nodes joined by a "network" node): Blink's three phases (s. 5) as
  trees: the data is partitioned over the GPU positions of a node; each tree of partition i is an
  intra-node tree per node joined at GPU i by a cross-node tree among the GPU i's over the NICs;
  weights by the same column-generation LP (algorithm "hierarchical").

Plans are deterministic and cached by (topology fingerprint, devices, collective, root, max_trees,
algorithm, relays, rate_tolerance).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import numbers
import os
import sys

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from . import bounds as _bounds
from . import collectives as _collectives
from .errors import PlanError, TopologyError
from .routes import RouteTable, solve_packing, solve_rooted_packing
from .topology import Topology, _key

COLLECTIVES = tuple(_collectives.COLLECTIVES)
#: The fields of a plan JSON (:meth:`Plan.to_dict`); "relays" is optional.
PLAN_FIELDS = ("collective", "root", "devices", "rate_gbps", "bound_gbps", "algorithm", "trees")
MILP_NODE_LIMIT = 200
L1_ROUNDS = 6            # most reweighted-L1 LPs in the tree-count reduction
MILP_MAX_COLUMNS = 24    # exact min-count ILP only over at most this many generated trees (its root LP
                         # alone took ~100 ms at 32 columns); deterministic, no wall-clock limit
WEIGHT_DECIMALS = 9
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
_CACHE_SIZE = 1024


def clear_caches() -> None:
    """Forget every cached plan (for uncached timing)."""
    _CACHE.clear()
    _TREE_PLANS.clear()


def _is_gpu(n) -> bool:
    return isinstance(n, int)


def _parse_routes(edges, relays=()) -> list:
    """Split hop list into GPU-level routes: consecutive hops from a GPU parent to a GPU child.
    GPUs in ``relays`` forward inside a route like switch nodes (they are not tree nodes)."""
    out, cur = [], None
    for a, b in edges:
        if _is_gpu(a) and a not in relays:
            cur = [a]
        if cur is None or cur[-1] != a:
            raise PlanError(f"tree hops {list(edges)} are not consecutive routes (hop {a!r}->{b!r})")
        cur.append(b)
        if _is_gpu(b) and b not in relays:
            out.append(tuple(cur))
            cur = None
    if cur is not None:
        raise PlanError(f"tree hops {list(edges)} end inside a route at {cur[-1]!r}")
    return out


def _hops(route) -> list:
    return list(zip(route, route[1:]))


@dataclasses.dataclass(frozen=True)
class Tree:
    """One weighted tree of a plan.

    Attributes:
      root: GPU id (topology id, not rank) where broadcast starts / reduce ends.
      weight_gbps: rate this tree carries, GB/s (its share of the data is weight / plan rate).
      edges: (parent, child) hops in broadcast direction. Each GPU-level tree edge appears as its
        route's consecutive hops, from the GPU parent through switch nodes to the GPU child, so a
        hop repeats when two routes share a link (count every occurrence as a use of that link).
      reduce_edges: None: reduce runs on ``edges`` reversed (Blink; hop (a, b) then uses link b->a).
        Otherwise an in-arborescence to ``root`` in the same hop format, data flowing child -> parent
        (ring plans).
      relays: GPUs outside the job that forward data inside this tree's routes (``plan(relays=...)``);
        like switch nodes they are route hops, not tree nodes. Empty for ordinary plans.
    """

    root: int
    weight_gbps: float
    edges: tuple
    reduce_edges: tuple | None = None
    relays: tuple = ()

    def __post_init__(self):
        # cheap checks: a wrong type here would otherwise fail deep in the simulator or the LP
        if isinstance(self.root, bool) or not isinstance(self.root, numbers.Integral):
            raise PlanError(f"Tree root must be a GPU id (int), got {self.root!r}")
        w = self.weight_gbps
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (0 <= w < math.inf):
            raise PlanError(f"Tree weight_gbps must be a finite number >= 0 (GB/s), got {w!r}")
        for name in ("edges", "reduce_edges"):
            hops = getattr(self, name)
            if hops is not None and (isinstance(hops, str) or any(len(h) != 2 for h in hops)):
                raise PlanError(f"Tree {name} must be (parent, child) hops like ((0, 'sw'), ('sw', 1)), "
                                f"got {hops!r}")

    def routes(self, reduce: bool = False) -> list:
        """GPU-level routes as node paths (parent first, switch or relay-GPU hops, child last)."""
        return _parse_routes(self.reduce_edges if (reduce and self.reduce_edges is not None) else self.edges,
                             self.relays)

    def gpu_parents(self, reduce: bool = False) -> dict:
        """{child GPU: parent GPU} with switch and relay-GPU hops contracted; the broadcast tree, or
        with ``reduce=True`` the reduce tree (``reduce_edges`` if set, else the same tree)."""
        return {r[-1]: r[0] for r in self.routes(reduce)}

    def link_usage(self, collective: str) -> collections.Counter:
        """Counter {(u, v): times this tree sends over physical link u->v} for ``collective``."""
        use = collections.Counter()
        row = _collectives.get(collective)
        if row.broadcasts:
            use.update(self.edges)
        if row.reduces:
            red = self.reduce_edges if self.reduce_edges is not None else self.edges
            use.update((b, a) for a, b in red)
        return use

    def to_dict(self) -> dict:
        """JSON-ready dict; "relays" is present only for trees that use relay GPUs."""
        d = {"root": self.root, "weight_gbps": self.weight_gbps,
             "edges": [list(e) for e in self.edges],
             "reduce_edges": None if self.reduce_edges is None else [list(e) for e in self.reduce_edges]}
        if self.relays:
            d["relays"] = list(self.relays)
        return d


@dataclasses.dataclass(frozen=True)
class Plan:
    """A tree packing for one collective over ``devices`` (rank r of the axis <-> ``devices[r]``).

    Attributes:
      collective: "broadcast" | "reduce" | "allreduce" | "allgather" | "reducescatter".
      root: GPU id for broadcast/reduce, None otherwise. All-gather / reduce-scatter trees are rooted
        at every rank's GPU (the owner of its shard); all-gather trees broadcast down ``edges``,
        reduce-scatter trees reduce up ``edges`` (child -> parent, like reduce).
      devices: topology GPU ids.
      trees: the weighted trees.
      rate_gbps: sum of tree weights, GB/s: the predicted time for S bytes is S / rate (all-reduce:
        reduce and broadcast pipelined on opposite link directions; all-gather / reduce-scatter: S
        is the full buffer, each root's trees carry rate / n, i.e. its shard S / n). inf for one device.
      bound_gbps: certificate: an upper bound on the rate of the chosen algorithm family (Edmonds
        max-flow bound for broadcast/reduce; LP dual bound for all-reduce trees and rings; max-flow
        orientation bound for hierarchical all-reduce; the cut bound for all-gather / reduce-scatter
        (trees and rings); 1 / (1/B_rs + 1/B_ag) of the two cut bounds for "rsag"; for NCCL's
        baselines the bound of their family over all links: rings; for the double binary tree, the
        min max-flow between GPUs, which no all-reduce tree packing exceeds).
      algorithm: "trees" | "ring" | "hierarchical" | "rsag" (all-reduce as reduce-scatter + all-gather
        forests) | "double-binary-tree" (NCCL's, from ``plan(nbytes=...)`` or ``baselines``) | "trivial".
      notes: why this algorithm, alternatives' rates, losses from ``max_trees``.
      relays: GPUs outside ``devices`` that forward data inside routes (``plan(relays=...)``). A
        relayed plan needs those GPUs to run the forwarding: the simulator models it, the JAX
        lowerings (``schedule.build_schedule``) refuse it. Empty for ordinary plans.
    """

    collective: str
    root: int | None
    devices: tuple
    trees: tuple
    rate_gbps: float
    bound_gbps: float
    algorithm: str
    notes: tuple = ()
    relays: tuple = ()

    def link_loads(self) -> dict:
        """{(u, v): GB/s the plan sends over physical link u->v} (sum of usage * tree weight)."""
        load = collections.defaultdict(float)
        for t in self.trees:
            for e, k in t.link_usage(self.collective).items():
                load[e] += k * t.weight_gbps
        return dict(sorted(load.items(), key=lambda kv: (_key(kv[0][0]), _key(kv[0][1]))))

    def rings(self) -> list:
        """For ring plans, [(hops, GB/s)] per ring: its physical hops in order and its bandwidth
        (all-reduce: n consecutive trees per ring, bandwidth 2(n-1) x tree weight; all-gather /
        reduce-scatter: n consecutive chains per ring, bandwidth (n-1) x chain weight, hops in data
        direction; broadcast / reduce: one chain per ring). [] for other plans."""
        if self.algorithm != "ring" or not self.trees:
            return []
        n = len(self.devices)
        row = _collectives.get(self.collective)
        if row.sharded:  # n chains per ring, each of weight b / (n-1); reduce-scatter sends on reversed hops
            flip = (lambda h: (h[1], h[0])) if row.reduces else (lambda h: h)
            return [(tuple(dict.fromkeys(flip(h) for t in self.trees[i:i + n] for h in t.edges)),
                     sum(t.weight_gbps for t in self.trees[i:i + n]) * (n - 1) / n)
                    for i in range(0, len(self.trees), n)]
        if self.collective != "allreduce":
            return [(t.edges, t.weight_gbps) for t in self.trees]
        return [(tuple(dict.fromkeys(h for t in self.trees[i:i + n] for h in t.edges)),
                 sum(t.weight_gbps for t in self.trees[i:i + n]) * 2 * (n - 1) / n)
                for i in range(0, len(self.trees), n)]

    def shape(self) -> str:
        """Algorithm and size: "ring, 8 rings" for ring plans, else e.g. "trees, 17 trees"."""
        rings = self.rings()
        if rings:
            return f"ring, {len(rings)} ring{'s' * (len(rings) != 1)}"
        return f"{self.algorithm}, {len(self.trees)} tree{'s' * (len(self.trees) != 1)}"

    def predicted_time_s(self, nbytes: float) -> float:
        """Bandwidth-only time for ``nbytes`` bytes: nbytes / (rate_gbps * 1e9) seconds."""
        return 0.0 if math.isinf(self.rate_gbps) else nbytes / (self.rate_gbps * 1e9)

    def to_dict(self) -> dict:
        """JSON-ready dict; an infinite rate or bound (one device) is written as null; "relays" is
        present only for plans that use relay GPUs."""
        f = lambda x: None if math.isinf(x) else x  # noqa: E731
        d = {"collective": self.collective, "root": self.root, "devices": list(self.devices),
             "rate_gbps": f(self.rate_gbps), "bound_gbps": f(self.bound_gbps),
             "algorithm": self.algorithm, "notes": list(self.notes),
             "trees": [t.to_dict() for t in self.trees]}
        if self.relays:
            d["relays"] = list(self.relays)
        return d

    def to_json(self, **kw) -> str:
        """Deterministic JSON (see :meth:`to_dict`); round-trips through :meth:`from_json`."""
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Inverse of :meth:`to_dict`. Raises PlanError on a malformed dict, naming the missing or bad
        field and what a plan holds (:data:`PLAN_FIELDS`)."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan JSON is an object with {PLAN_FIELDS}, got {type(d).__name__}")
        missing = [k for k in PLAN_FIELDS if k not in d]
        if missing:
            raise PlanError(f"plan JSON lacks {', '.join(map(repr, missing))}: a plan holds {PLAN_FIELDS} "
                            f"(as Plan.to_json writes; make one with jax-blink plan --json)")
        if d["collective"] not in COLLECTIVES:
            raise PlanError(f"plan JSON: unknown collective {d['collective']!r}; expected one of {COLLECTIVES}")
        try:
            inf = lambda x: float("inf") if x is None else float(x)  # noqa: E731
            hop = lambda e: (e[0], e[1])  # noqa: E731
            trees = tuple(Tree(t["root"], float(t["weight_gbps"]), tuple(hop(e) for e in t["edges"]),
                               None if t.get("reduce_edges") is None
                               else tuple(hop(e) for e in t["reduce_edges"]), tuple(t.get("relays", ())))
                          for t in d["trees"])
            return cls(d["collective"], d["root"], tuple(d["devices"]), trees, inf(d["rate_gbps"]),
                       inf(d["bound_gbps"]), d["algorithm"], tuple(d.get("notes", ())),
                       tuple(d.get("relays", ())))
        except KeyError as err:
            raise PlanError(f"plan JSON: a tree lacks {err.args[0]!r}; every tree holds root, weight_gbps, "
                            f"edges and reduce_edges (null or a list)") from None
        except (TypeError, IndexError, ValueError) as err:
            raise PlanError(f"malformed plan JSON: {err!r}; see Plan.to_dict for the format") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"plan JSON is not valid JSON: {err}") from None

    def describe(self) -> str:
        """Readable multi-line summary: algorithm, rate vs bound, notes, one line per tree."""
        fmt = lambda x: "inf" if math.isinf(x) else f"{x:.3f}"  # noqa: E731
        root = "" if self.root is None else f" root {self.root}"
        relay = f" (relay GPUs {list(self.relays)})" if self.relays else ""
        lines = [f"{self.collective}{root} over GPUs {list(self.devices)}{relay}: {self.shape()}, rate {fmt(self.rate_gbps)} GB/s, bound {fmt(self.bound_gbps)} GB/s"]
        lines += [f"  note: {n}" for n in self.notes]
        for i, t in enumerate(self.trees):
            par = t.gpu_parents()
            via = ",".join(sorted({str(x) for r in t.routes() for x in r[1:-1]}))
            s = " ".join(f"{p}->{c}" for c, p in sorted(par.items(), key=lambda kv: str(kv[1]) + str(kv[0])))
            red = "" if t.reduce_edges is None else "  reduce " + " ".join(
                f"{c}->{p}" for c, p in t.gpu_parents(reduce=True).items())
            lines.append(f"  tree {i}: root {t.root}, {t.weight_gbps:.3f} GB/s: {s}"
                         + (f" (via {via})" if via else "") + red)
        return "\n".join(lines)


# ------------------------------------------------------------------------------ helpers
def _orient(undirected_edges, root) -> tuple:
    """Hops of a tree given as GPU-level (u, v, route u->v) edges, oriented away from ``root``."""
    adj = collections.defaultdict(list)
    for u, v, r in undirected_edges:
        adj[u].append((v, tuple(r)))
        adj[v].append((u, tuple(r[::-1])))
    hops, seen, queue = [], {root}, [root]
    while queue:
        p = queue.pop(0)
        for c, r in sorted(adj[p], key=lambda x: (_key(x[0]), [_key(n) for n in x[1]])):
            if c not in seen:
                seen.add(c)
                queue.append(c)
                hops.extend(_hops(r))
    return tuple(hops)


def _column_hops(col, mode: str) -> tuple:
    """Broadcast-direction hops of an LP column (see routes.Column)."""
    hops = []
    for p, c, r in col.edges:
        hops.extend(_hops(r[::-1] if mode == "in-arborescence" else r))
    return tuple(hops)


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
    lp = linprog(-np.ones(len(keep)), A_ub=a[:, keep], b_ub=cap, A_eq=eq,
                 b_eq=None if eq is None else np.zeros(len(eq)), bounds=(0, None), method="highs")
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


def _fewest_trees(table: RouteTable, cols, rate: float, max_trees: int | None, lp_weights, groups=None):
    """Fewer trees over the generated columns (Blink's TreeGen ILP step).

    Without ``max_trees``: reweighted-L1 LPs (Candes, Wakin, Boyd 2008) minimise sum w_t / (w_t' + eps)
    subject to the link capacities and total rate >= ``rate`` (1 - 1e-7), keeping the sparsest
    support found; then, over at most MILP_MAX_COLUMNS trees, the exact minimum-count ILP (larger column sets, e.g. with PCIe links: the ILP took 0.1-1 s, so the L1 result stands). With ``max_trees=k``: the ILP (scipy.optimize.milp, HiGHS, node-limited so
    deterministic) maximising the total weight using at most k trees.
    ``groups`` (sharded collectives): the root of each column; every root then carries rate / (number
    of roots) and the same share of any re-optimised total.
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
        fewest = _fewest_possible(a, table.cap, rate, groups)
        if np.count_nonzero(lp_weights > 1e-9) <= fewest:  # the LP's basic solution is already minimal
            return np.where(lp_weights > 1e-9, lp_weights, 0.0)
        best = lp_weights
        w = lp_weights
        for _ in range(L1_ROUNDS):
            cost = 1.0 / (w + 1e-3 * rate / t)
            res = linprog(cost, A_ub=np.vstack([a, share_rows]),
                          b_ub=np.concatenate([table.cap, share]), bounds=(0, None), method="highs")
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
            nl = a.shape[0]
            res = _quiet_milp(np.concatenate([np.zeros(t), np.ones(t)]),
                       constraints=[LinearConstraint(np.hstack([a, np.zeros((nl, t))]), -np.inf, table.cap),
                                    LinearConstraint(np.hstack([np.eye(t), -rate * np.eye(t)]), -np.inf, 0.0),
                                    LinearConstraint(np.hstack([share_rows, np.zeros_like(share_rows)]),
                                                     -np.inf, share)],
                       integrality=np.concatenate([np.zeros(t), np.ones(t)]),
                       bounds=Bounds(np.zeros(2 * t), np.concatenate([np.full(t, rate), np.ones(t)])),
                       options={"node_limit": MILP_NODE_LIMIT, "presolve": True})
            if res.x is not None and np.count_nonzero(res.x[t:] > 0.5) < len(chosen):
                chosen = np.flatnonzero(res.x[t:] > 0.5)
    else:
        nl = a.shape[0]
        link = LinearConstraint(np.hstack([a, np.zeros((nl, t))]), -np.inf, table.cap)
        tie = LinearConstraint(np.hstack([np.eye(t), -rate * np.eye(t)]), -np.inf, 0.0)
        count = LinearConstraint(np.concatenate([np.zeros(t), np.ones(t)])[None, :], -np.inf, max_trees)
        cons = [link, tie, count]
        if eq is not None:
            cons.append(LinearConstraint(np.hstack([eq, np.zeros_like(eq)]), 0.0, 0.0))
        res = _quiet_milp(np.concatenate([-np.ones(t), np.zeros(t)]), constraints=cons,
                   integrality=np.concatenate([np.zeros(t), np.ones(t)]),
                   bounds=Bounds(np.zeros(2 * t), np.concatenate([np.full(t, rate), np.ones(t)])),
                   options={"node_limit": MILP_NODE_LIMIT, "presolve": True})
        if res.x is None:
            return None
        chosen = np.flatnonzero(res.x[t:] > 0.5)
    if not len(chosen):
        return None
    if max_trees is None and np.array_equal(chosen, np.flatnonzero(lp_weights > 1e-9)):
        return np.where(lp_weights > 1e-9, lp_weights, 0.0)  # no fewer trees: the LP's weights stand
    x = _reoptimise(a, table.cap, chosen, groups)
    if x is None:
        return None
    w = np.zeros(t)
    w[chosen] = x
    return w


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
    """The LP column kind of ``collective`` (routes.Column): broadcast-like collectives pack
    out-arborescences, reduce-like ones in-arborescences, all-reduce undirected spanning trees."""
    row = _collectives.get(collective)
    if row.reduces and row.broadcasts:
        return "spanning"
    return "in-arborescence" if row.reduces else "arborescence"


def _bound(topology, collective: str, devices, root, relays=()) -> float:
    """The max-flow certificate of ``collective`` (collectives.Collective.certificate), GB/s."""
    return {"broadcast": lambda: _bounds.broadcast_bound(topology, devices, root, relays),
            "reduce": lambda: _bounds.reduce_bound(topology, devices, root, relays),
            "allreduce": lambda: _bounds.allreduce_bound(topology, devices, relays),
            "allgather": lambda: _bounds.allgather_bound(topology, devices, relays),
            "reducescatter": lambda: _bounds.reducescatter_bound(topology, devices, relays)}[collective]()


def _round(x: float) -> float:
    """Weights are rounded down to 1e-9 GB/s so JSON is short and the rounding never overloads a link."""
    return float(math.floor(x * 10 ** WEIGHT_DECIMALS + 1e-6) / 10 ** WEIGHT_DECIMALS)


def _drop_light_trees(table: RouteTable, cols, w, rate: float, tolerance: float, groups=None):
    """Drop the lightest trees while the re-optimised rate of the rest stays >= (1 - tolerance) * rate.

    Trees sorted by weight (ties by index); binary search on how many of the lightest to drop, each
    probe an LP (HiGHS) re-optimising the weights of the kept trees (``groups``: equal per-root
    totals, see :func:`_reoptimise`). Returns (weights [T], dropped)."""
    order = sorted((i for i in range(len(w)) if w[i] > 1e-9), key=lambda i: (w[i], i))
    a = np.stack([c.usage for c in cols], axis=1).astype(np.float64)

    def solve(k):
        keep = sorted(order[k:])
        x = _reoptimise(a, table.cap, keep, groups)
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


_TREE_PLANS: "collections.OrderedDict" = collections.OrderedDict()


def _tree_plan(topology, devices, collective, root, max_trees, relays=(), target=None, rate_tolerance=0.0):
    """:func:`_tree_plan_uncached`, memoised: plans that differ only in ``algorithm`` share it."""
    key = (topology.fingerprint(), tuple(devices), collective, root, max_trees, tuple(relays), target,
           rate_tolerance)
    hit = _TREE_PLANS.get(key)
    if hit is None:
        hit = _TREE_PLANS[key] = _tree_plan_uncached(topology, devices, collective, root, max_trees, relays,
                                                     target, rate_tolerance)
        if len(_TREE_PLANS) > _CACHE_SIZE:
            _TREE_PLANS.popitem(last=False)
    trees, rate, dual, table, notes, exact = hit
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
    w = _fewest_trees(table, res.columns, res.rate, max_trees, res.weights, res.roots)
    if w is None or w.sum() < res.rate * (1 - 1e-6) and max_trees is None:
        w = res.weights
        notes.append("tree-count reduction failed; using the LP's basic solution")
    if rate_tolerance > 0 and max_trees is None:
        before = int(np.count_nonzero(w > 1e-9))
        w, dropped = _drop_light_trees(table, res.columns, w, res.rate, rate_tolerance, res.roots)
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


def ring_paths(cycle, routes, start) -> tuple:
    """The ring ``cycle`` (GPU order, ``routes`` its hop paths to the next GPU) walked from ``start``.

    Returns ``(bcast, reduce)`` hop tuples in the Tree format: the broadcast path along the ring from
    ``start`` to the GPU before it, and the reduce in-path along the same direction ending at
    ``start`` (the data of a ring all-reduce segment, NCCL)."""
    nxt = {r[0]: r for r in routes}  # GPU -> its route to the next GPU on the ring
    k = cycle.index(start)
    order = cycle[k:] + cycle[:k]
    bcast = tuple(h for x in order[:-1] for h in _hops(nxt[x]))
    reduce = tuple(h for x in order[1:] for h in _hops(nxt[x][::-1]))
    return bcast, reduce


def _ring_trees(rings, n) -> list:
    """A ring packing as all-reduce trees: per ring of bandwidth b and per GPU v, a tree rooted at v
    of weight b / (2(n-1)) whose reduce is the in-path along the ring ending at v and whose broadcast
    is the path along the ring from v (reduce-scatter + all-gather on a ring, NCCL)."""
    trees = []
    for cycle, routes, b in rings:
        for v in cycle:
            bc, red = ring_paths(cycle, routes, v)
            trees.append(Tree(v, _round(b / (2 * (n - 1))), bc, red))
    return trees


def _sharded_ring_trees(rings, n, reduces: bool) -> list:
    """A ring packing as all-gather (``reduces=False``) or reduce-scatter trees: per ring of
    bandwidth b and per GPU v, one chain of weight b / (n - 1) rooted at v. All-gather: v's shard
    travels n - 1 hops along the ring from v; reduce-scatter: shard v is summed along the ring and
    ends at v (NCCL's ring; edges in broadcast direction, data flowing child -> parent). Every ring
    link carries n - 1 chains: load b."""
    trees = []
    for cycle, routes, b in rings:
        for v in cycle:
            bc, red = ring_paths(cycle, routes, v)
            # the in-path lists its routes leaf first; a Tree lists them root first
            hops = tuple(h for r in reversed(_parse_routes(red)) for h in _hops(r)) if reduces else bc
            trees.append(Tree(v, _round(b / (n - 1)), hops))
    return trees


def _sharded_ring_plan(topology, collective, devices, max_trees, bound) -> Plan:
    """The LP ring packing (bounds.ring_packing) run as an all-gather / reduce-scatter ring:
    rate n B / (n - 1) for total ring bandwidth B, certificate the cut bound."""
    n = len(devices)
    table = RouteTable.build(topology, devices)
    table.check_connected(f"{collective} ring plan")
    b_ring, rings = _bounds.ring_packing(topology, devices, table)
    if b_ring <= 0:
        raise PlanError(f"no ring (cycle through every GPU) over devices {list(devices)} on the links of "
                        f"{topology.name!r}")
    if max_trees is not None and n * len(rings) > max_trees:
        raise PlanError(f"no ring packing over devices {list(devices)} within max_trees={max_trees} "
                        f"(it needs {n * len(rings)} trees)")
    trees = _sharded_ring_trees(rings, n, _collectives.get(collective).reduces)
    rate = _round(sum(t.weight_gbps for t in trees))
    note = (f"ring: {len(rings)} ring(s) of {b_ring:.3f} GB/s in total; each shard travels n-1 = {n - 1} hops, "
            f"rate n*B/(n-1) = {rate:.3f} GB/s; cut bound on the links of {topology.name!r}: {bound:.3f} GB/s",)
    return Plan(collective, None, devices, tuple(trees), rate, _round(bound), "ring", note)


def _rsag_plan(topology, devices, max_trees) -> Plan:
    """All-reduce as reduce-scatter then all-gather on the optimal forests (ForestColl, Zhao et al.
    2024, section 3), as one executable all-reduce plan.

    Per root r, the reduce-scatter in-trees of r (weights a_i, sum x_rs) and the all-gather trees of
    r (weights b_j, sum x_ag) are paired over the common refinement of their weight fractions: each
    pair is one Tree rooted at r whose ``reduce_edges`` is the in-tree and ``edges`` the out-tree
    (the format of ring all-reduce trees), so the schedule reduces r's part of the buffer to r and
    broadcasts it back. Weights: fraction * x with 1/x = 1/x_rs + 1/x_ag, so both forests run at
    once within every link's capacity (loads x (U_rs / x_rs + U_ag / x_ag) <= cap); the rate n x
    gives the time S / (n x_rs) + S / (n x_ag): reduce-scatter time plus all-gather time. Certificate:
    1 / (1 / B_rs + 1 / B_ag) with B the two cut bounds (no RS + AG pair of packings is faster)."""
    n = len(devices)
    rs = plan(topology, "reducescatter", devices=devices, algorithm="trees")
    ag = plan(topology, "allgather", devices=devices, algorithm="trees")
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


def _node_groups(topology: Topology, devices) -> list:
    """GPUs of ``devices`` grouped by node: components of the job graph without "network" nodes."""
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
        """(price, Column with global usage) of the cheapest tree of this part under global prices y."""
        from .routes import _price
        col = _price(self.table, y[self.glob], mode, root)
        if col is None:
            raise PlanError(f"three-phase plan: GPUs {list(self.table.devices)} cannot all reach GPU {root} "
                            f"over their links")
        usage = np.zeros(nlinks, dtype=np.int64)
        np.add.at(usage, self.glob, col.usage)
        return float(usage @ y), col.edges, usage


def _hierarchical(topology, devices, collective, root, groups, max_trees):
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
    shares as in the paper. The tree count is reduced like the flat packing (:func:`_fewest_trees`).

    Returns (trees, notes, max-flow bound GB/s). Raises PlanError when a node's GPUs or the partition leaders cannot
    reach each other.
    """
    from types import SimpleNamespace

    from .routes import MAX_ITERATIONS, PRICE_TOL, Column
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
    bound = _bound(topology, collective, devices, root)

    def price(y):
        """Cheapest three-phase tree per partition i under link prices y: [(price, i, Column)]."""
        memo, out = {}, []
        for i, ld in enumerate(leaders):
            cost, edges, usage = 0.0, [], np.zeros(nl, dtype=np.int64)
            for k, part in enumerate(intra):
                if part is None:
                    continue
                r = root if (k == root_node and mode != "spanning") else (ld[k] if mode != "spanning" else None)
                r = part.table.devices[0] if r is None else r
                if (k, r) not in memo:
                    memo[k, r] = part.price(y, mode, r, nl)
                c, e, u = memo[k, r]
                cost, usage = cost + c, usage + u
                edges.extend(e)
            if cross[i] is not None:
                c, e, u = cross[i].price(y, mode, ld[root_node], nl)
                cost, usage = cost + c, usage + u
                edges.extend(e)
            out.append((cost, i, Column(tuple(edges), usage)))
        return out

    cols, part_of, seen = [], [], set()

    def add(i, col):
        if (i, col.edges) in seen:
            return False
        seen.add((i, col.edges))
        cols.append(col)
        part_of.append(i)
        return True

    # warm start: multiplicative-weights rounds (Garg-Koenemann, as Blink's TreeGen), all partitions
    y = 1.0 / cap
    for _ in range(4):
        cands = price(y)
        for _, i, col in cands:
            add(i, col)
            used = col.usage > 0
            y = y * (1.0 + 0.5 * float(np.min(cap[used] / col.usage[used])) * col.usage / cap)
    it, dual = 0, float("inf")
    while True:
        it += 1
        a = np.stack([c.usage for c in cols], axis=1).astype(np.float64)
        res = linprog(-np.ones(len(cols)), A_ub=a, b_ub=cap, bounds=(0, None), method="highs")
        if res.status != 0:
            raise PlanError(f"three-phase packing LP failed for devices {list(devices)}: {res.message}")
        rate, x = float(-res.fun), np.asarray(res.x, dtype=np.float64)
        if rate >= bound * (1 - 1e-9):
            dual = bound
            break
        y = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)
        cands = price(y)
        best = min(c for c, _, _ in cands)
        dual = min(dual, float(cap @ y) / min(1.0, best) if best > 0 else float("inf"))
        new = [add(i, col) for c, i, col in cands if c < 1.0 - PRICE_TOL]
        if best >= 1.0 - PRICE_TOL or not any(new) or it >= MAX_ITERATIONS:
            break
    w = _fewest_trees(SimpleNamespace(cap=cap), cols, rate, max_trees, x)
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
    return trees, notes, bound


def _rooted_hops(edges, mode: str, root) -> tuple:
    """Broadcast-direction hops of (parent, child, route) edges, breadth-first from ``root`` (routes
    run child -> parent for ``mode="in-arborescence"``, see routes.Column)."""
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


# ------------------------------------------------------------------------------ public API
ALGORITHMS = ("auto", "trees", "ring", "hierarchical", "rsag")


def _quiet_milp(*args, **kw):
    """``scipy.optimize.milp`` with file descriptor 1 muted: HiGHS's MIP solver prints debug lines
    ("HighsMipSolverData::transformNewIntegerFeasibleSolution") straight to the C stdout, which
    would corrupt ``jax-blink plan --json`` and user programs' output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            return milp(*args, **kw)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def job_devices(topology: Topology, devices=None) -> tuple:
    """The job's GPU ids as a tuple of ints (default: every GPU of ``topology``), validated.

    ``devices``: GPU ids, or a string like the CLI's ``--devices`` ("0,1,4", "0-3"). Raises
    PlanError for a ``topology`` that is not a Topology, and naming the devices that are not GPUs
    of the topology, non-integer ids, duplicates, or an empty list.
    """
    if not isinstance(topology, Topology):
        raise PlanError(f"expected a jax_blink.Topology (e.g. jax_blink.load_topology('dgx1v')), got "
                        f"{type(topology).__name__}")
    try:
        devices = tuple(int(d) for d in (topology.gpus if devices is None else topology.check_devices(devices)))
    except TopologyError as err:
        raise PlanError(str(err)) from None
    if not devices:
        raise PlanError("a plan needs at least one device")
    return devices


def plan(topology: Topology, collective: str = "allreduce", *, devices=None, root=None,
         max_trees: int | None = None, algorithm: str = "auto", relays=None,
         rate_tolerance: float = 0.0, nbytes: float | None = None) -> Plan:
    """Plan a tree packing for ``collective`` over ``devices`` of ``topology``.

    Args:
      topology: the machine (``jax_blink.Topology``).
      collective: "broadcast" | "reduce" | "allreduce" | "allgather" | "reducescatter".
      devices: GPU ids of the job (rank r <-> devices[r]; all-gather / reduce-scatter: rank r owns
        shard r), or a string like the CLI's ``--devices`` ("0,1,4", "0-3"); default all GPUs of
        the topology.
      root: GPU id (broadcast/reduce; default ``devices[0]``); must be None or ignored for all-reduce;
        must be None for all-gather / reduce-scatter (every rank roots the trees of its shard).
      max_trees: at most this many trees (rate may drop; the loss is in ``notes``); all-gather /
        reduce-scatter need at least one per rank (``len(devices)``).
      algorithm: "auto" (the fastest: with ``nbytes``, the least simulated time at that size over
        trees, fewer trees, rings, NCCL's rings and double binary tree, three phases, by
        :func:`jax_blink.costmodel.choose_plan`; without, the highest rate, i.e. the large-operand
        limit, trees or the ring packing; the reason in ``notes``), or force one:
        "trees" (exact packing over all devices), "ring" (all-reduce, all-gather, reduce-scatter),
        "hierarchical" (Blink's three phases, section 5; needs devices on two or more nodes; not for
        all-gather / reduce-scatter), "rsag" (all-reduce only: the reduce-scatter forest then the
        all-gather forest, paired per root into one executable all-reduce plan, time S / B_rs + S /
        B_ag; chosen by ``auto`` only with ``nbytes``, through the cost model). Without ``nbytes``,
        "auto" for all-gather / reduce-scatter is the tree packing (it reaches the cut bound, which
        no ring beats).
      relays: GPUs outside ``devices`` that may forward data inside routes (Blink issue "relays";
        NCCL-style forwarding through a GPU that is not a rank): None or "none" (default), "gpus"
        (every other GPU of the topology), or an iterable of GPU ids. Relay GPUs act like switch
        nodes: routes pass through them, they never own data. The certificate becomes the max-flow
        bound over the relay-allowed graph. Executing such a plan needs the relay GPUs to run the
        forwarding: ``simulate`` models it, ``schedule.build_schedule`` (the JAX lowerings, which only
        run on job devices) raises ScheduleError. With relays only tree packings are planned (no
        ring alternative, no three-phase plan).
      rate_tolerance: 0.0 (default: exact optimum). A fraction in [0, 1): drop the lightest trees
        while the re-optimised rate stays >= (1 - rate_tolerance) * optimum (fewer, larger trees;
        the loss is in ``notes``). Ignored when ``max_trees`` is given.
      nbytes: operand bytes per GPU for ``algorithm="auto"`` (see there); ignored with ``relays`` or
        ``rate_tolerance``.

    Returns a :class:`Plan` (cached; identical inputs give the identical object and JSON). One device:
    a trivial plan with no trees and ``rate_gbps = bound_gbps = inf``.

    Raises PlanError: unknown collective, devices not GPUs of the topology, duplicate devices, root not
    among the devices (or any root for all-gather / reduce-scatter), GPUs that cannot reach each other,
    bad ``max_trees`` (fewer than one tree per rank for all-gather / reduce-scatter), ``relays`` or
    ``rate_tolerance``, an algorithm that does not apply to the collective.
    """
    if collective not in COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    if not isinstance(topology, Topology):
        raise PlanError(f"plan needs a jax_blink.Topology (e.g. jax_blink.load_topology('dgx1v')), got "
                        f"{type(topology).__name__}")
    devices = job_devices(topology, devices)
    if isinstance(root, bool) or not (root is None or isinstance(root, numbers.Integral)):
        raise PlanError(f"root must be a GPU id (int) among devices {list(devices)} or None, got {root!r}")
    root = None if root is None else int(root)
    row = _collectives.get(collective)
    if collective == "allreduce":
        if root is not None and root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}")
        root = None
    elif row.sharded:
        if root is not None:
            raise PlanError(f"{collective} has no root (every rank owns one shard); got root={root!r}, pass None")
        if max_trees is not None and not isinstance(max_trees, bool) and isinstance(max_trees, int) \
                and 1 <= max_trees < len(devices):
            raise PlanError(f"{collective} needs at least one tree per rank: max_trees={max_trees} < "
                            f"{len(devices)} devices")
    else:
        root = devices[0] if root is None else root
        if root not in devices:
            raise PlanError(f"root {root!r} is not among devices {list(devices)}; pass one of them")
    if max_trees is not None and (isinstance(max_trees, bool) or not isinstance(max_trees, int) or max_trees < 1):
        raise PlanError(f"max_trees must be a positive int or None, got {max_trees!r}")
    if algorithm not in ALGORITHMS:
        raise PlanError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if algorithm == "ring" and collective not in ("allreduce", "allgather", "reducescatter"):
        raise PlanError(f"algorithm 'ring' is an all-reduce algorithm (and an all-gather / reduce-scatter one), "
                        f"not for {collective!r}")
    if algorithm == "rsag" and collective != "allreduce":
        raise PlanError(f"algorithm 'rsag' (reduce-scatter then all-gather) is an all-reduce algorithm, "
                        f"not for {collective!r}")
    if algorithm == "hierarchical" and row.sharded:
        raise PlanError(f"algorithm 'hierarchical' (Blink's three phases) is not planned for {collective!r}; "
                        f"use 'auto', 'trees' or 'ring'")
    if isinstance(rate_tolerance, bool) or not isinstance(rate_tolerance, (int, float)) \
            or not 0.0 <= rate_tolerance < 1.0:
        raise PlanError(f"rate_tolerance must be a number in [0, 1), got {rate_tolerance!r}")
    relays = _check_relays(topology, devices, relays)
    if relays and algorithm in ("ring", "hierarchical", "rsag"):
        raise PlanError(f"relays={list(relays)} work with tree packings only; use algorithm='auto' or "
                        f"'trees' (got {algorithm!r})")
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not (0 < nbytes < math.inf):
            raise PlanError(f"nbytes must be a positive number of bytes per GPU, got {nbytes!r}")
        if algorithm == "auto" and not relays and not rate_tolerance:
            from . import costmodel  # the cost model (right of the planner: it simulates), imported lazily
            return costmodel.choose_plan(topology, collective, nbytes, devices=devices, root=root,
                                         max_trees=max_trees)
    key = (topology.fingerprint(), devices, collective, root, max_trees, algorithm, relays,
           float(rate_tolerance))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    if relays and len(devices) > 1:
        p = _relay_plan(topology, collective, devices, root, max_trees, relays, float(rate_tolerance))
    else:
        p = _plan_uncached(topology, collective, devices, root, max_trees, algorithm, float(rate_tolerance))
    _CACHE[key] = p
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return p


def _check_relays(topology, devices, relays) -> tuple:
    """Normalise ``plan(relays=...)`` to a sorted tuple of GPU ids outside ``devices``."""
    if relays is None or relays == "none":
        return ()
    if relays == "gpus":
        return tuple(g for g in topology.gpus if g not in devices)
    if isinstance(relays, str):
        raise PlanError(f"relays must be None, 'none', 'gpus' or a list of GPU ids, got {relays!r}")
    try:
        rel = list(relays)
    except TypeError:
        raise PlanError(f"relays must be None, 'none', 'gpus' or a list of GPU ids, got {relays!r}") from None
    bad = [r for r in rel if isinstance(r, bool) or r not in set(topology.gpus)]
    if bad:
        raise PlanError(f"relays {bad} are not GPUs of topology {topology.name!r} (GPUs {topology.gpus})")
    inside = [r for r in rel if r in devices]
    if inside:
        raise PlanError(f"relays {inside} are job devices {list(devices)}; relays must be other GPUs")
    if len(set(rel)) != len(rel):
        raise PlanError(f"relays {rel} list a GPU twice")
    return tuple(sorted(rel))


def _relay_plan(topology, collective, devices, root, max_trees, relays, rate_tolerance) -> Plan:
    """Tree packing whose routes may forward through the ``relays`` GPUs (issue 7, single-pair case).
    Certificate: the max-flow bound over the relay-allowed graph (relays behave like switch nodes)."""
    bound = _bound(topology, collective, devices, root, relays)
    target = bound if collective != "allreduce" else None
    trees, rate, dual, _, notes, _ = _tree_plan(topology, devices, collective, root, max_trees, relays, target,
                                             rate_tolerance)
    used = sorted({x for t in trees for r in t.routes() for x in r[1:-1] if x in relays})
    notes.append(f"relay GPUs {used or 'none'} of allowed {list(relays)} forward data inside routes: running "
                 f"this plan needs them to forward (simulate models it; build_schedule refuses it)")
    if collective == "allreduce":
        bound = dual
    return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees", tuple(notes),
                relays)


def _plan_uncached(topology, collective, devices, root, max_trees, algorithm="auto", rate_tolerance=0.0) -> Plan:
    n = len(devices)
    if n == 1:
        return Plan(collective, root, devices, (), float("inf"), float("inf"), "trivial",
                    ("one device: nothing to send (rate is infinite)",))
    if _collectives.get(collective).sharded:  # no three-phase variant: the flat packing is exact
        return _flat_plan(topology, collective, devices, root, max_trees, algorithm, rate_tolerance)
    if algorithm == "rsag":
        return _rsag_plan(topology, devices, max_trees)
    groups = _node_groups(topology, list(devices))
    if algorithm == "hierarchical" and len(groups) == 1:
        raise PlanError(f"algorithm 'hierarchical' needs devices on two or more nodes; {list(devices)} "
                        f"are on one node of {topology.name!r}")
    if algorithm != "hierarchical":
        flat = _flat_plan(topology, collective, devices, root, max_trees, algorithm, rate_tolerance)
        if len(groups) == 1 or algorithm != "auto":
            return flat
    trees, notes, bound = _hierarchical(topology, devices, collective, root, groups, max_trees)
    rate = _round(sum(t.weight_gbps for t in trees))
    hier = Plan(collective, root, devices, tuple(trees), rate, _round(bound), "hierarchical", tuple(notes))
    if algorithm == "hierarchical":
        return dataclasses.replace(hier, notes=hier.notes + (
            "three-phase plan (algorithm='hierarchical'; the flat packing was not compared)",))
    if hier.rate_gbps > flat.rate_gbps * (1 + 1e-6):
        return dataclasses.replace(hier, notes=hier.notes + (
            f"three-phase plan {hier.rate_gbps:.3f} GB/s beats the flat packing over all nodes "
            f"{flat.rate_gbps:.3f} GB/s ({flat.algorithm})",))
    return dataclasses.replace(flat, notes=flat.notes + (
        f"{len(groups)} nodes: the flat packing over all GPUs ({flat.rate_gbps:.3f} GB/s) is at least as fast "
        f"as Blink's three-phase hierarchical plan ({hier.rate_gbps:.3f} GB/s: leaders feed the NICs through "
        f"one GPU each, while flat trees spread NIC traffic over every GPU of a node)",))


def _flat_plan(topology, collective, devices, root, max_trees, algorithm="auto", rate_tolerance=0.0) -> Plan:
    """Exact packing over all job GPUs at once (plus the ring alternative for all-reduce)."""
    n = len(devices)
    if collective != "allreduce":
        bound = _bound(topology, collective, devices, root)
    if _collectives.get(collective).sharded and algorithm == "ring":
        return _sharded_ring_plan(topology, collective, devices, max_trees, bound)
    if collective == "allreduce" and algorithm == "ring":  # the tree packing is not needed
        trees, rate, dual, table, notes, exact = [], 0.0, 0.0, RouteTable.build(topology, devices), [], math.inf
        table.check_connected("allreduce plan")
    else:
        if collective == "allreduce":
            # the min max-flow between GPUs bounds the tree packing too: column generation stops
            # as soon as it is reached, without a last pricing round to prove optimality
            bound = _bounds.allreduce_bound(topology, devices)
        trees, rate, dual, table, notes, exact = _tree_plan(topology, devices, collective, root, max_trees,
                                                            target=bound, rate_tolerance=rate_tolerance)
    if collective == "allreduce":
        # any ring crosses every directed cut between job GPUs, so B_ring <= min max-flow between GPUs
        ring_cap = n * (bound if algorithm != "ring" else _bounds.allreduce_bound(topology, devices)) \
            / (2 * (n - 1))
        bound = dual
        if algorithm == "auto" and ring_cap <= exact * (1 + 1e-6):
            notes.append(f"trees chosen: all-reduce rate {rate:.3f} GB/s >= any ring's n*B/(2(n-1)) <= "
                         f"{ring_cap:.3f} GB/s (B <= min max-flow between GPUs; ring packing not needed)")
            return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees",
                        tuple(notes))
        b_ring, rings = _bounds.ring_packing(topology, devices, table)
        ring_rate = n * b_ring / (2 * (n - 1)) if b_ring > 0 else 0.0
        ring_fits = max_trees is None or n * len(rings) <= max_trees
        if algorithm == "ring" and b_ring <= 0:
            raise PlanError(f"no ring (cycle through every GPU) over devices {list(devices)} on the links of "
                            f"{topology.name!r}")
        if algorithm == "ring" and not ring_fits:
            raise PlanError(f"no ring packing over devices {list(devices)} within max_trees={max_trees} "
                            f"(it needs {n * len(rings)} trees)")
        if algorithm == "auto" and ring_rate > exact * (1 + 1e-6) and not ring_fits:
            notes.append(f"a ring packing would reach {ring_rate:.3f} GB/s but needs {n * len(rings)} trees "
                         f"> max_trees={max_trees}")
        elif algorithm == "ring" or (algorithm == "auto" and ring_rate > exact * (1 + 1e-6)):
            # algorithm="ring" is also how the cost model and the baselines build their ring
            # candidate: describe the packing, never claim the user asked for it
            what = ("ring packing (algorithm='ring')" if algorithm == "ring"
                    else f"ring chosen over trees ({rate:.3f} GB/s)")
            notes.append(f"{what}: rings of {b_ring:.3f} GB/s give all-reduce rate n*B/(2(n-1)) = "
                         f"{ring_rate:.3f} GB/s")
            rtrees = _ring_trees(rings, n)
            # bound in all-reduce rate units, n B / (2(n-1)) with B <= min max-flow: no ring packing beats it
            return Plan(collective, None, devices, tuple(rtrees), _round(sum(t.weight_gbps for t in rtrees)),
                        _round(max(ring_cap, ring_rate)), "ring", tuple(notes))
        else:
            notes.append(f"trees chosen: all-reduce rate {rate:.3f} GB/s >= ring {ring_rate:.3f} GB/s "
                         f"(rings of {b_ring:.3f} GB/s, time 2(n-1)/n*S/B)")
    return Plan(collective, root, devices, tuple(trees), _round(rate), _round(bound), "trees",
                tuple(notes))
