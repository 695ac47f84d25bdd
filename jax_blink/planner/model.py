"""The planner's data model: :class:`Tree` and :class:`Plan` (with their JSON), the hop helpers
shared by every planning algorithm, job-device validation and the plan caches.

A plan is a set of weighted trees over the job's GPUs whose edges may relay through switch nodes
(docs/architecture.md); every algorithm of :mod:`jax_blink.planner` returns one.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import json
import math
import numbers

from .. import collectives as _collectives
from ..errors import PlanError, TopologyError
from ..topology.model import (
    _CACHES,
    Topology,
    _key,
    cached,  # noqa: F401  (re-exported: the planner modules and the cost model use it)
    derived_cache,
)

COLLECTIVES = tuple(_collectives.COLLECTIVES)
#: The fields of a plan JSON (:meth:`Plan.to_dict`); "relays" is optional.
PLAN_FIELDS = ("collective", "root", "devices", "rate_gbps", "bound_gbps", "algorithm", "trees")
WEIGHT_DECIMALS = 9
_CLEARERS: list = []  # functools caches of later stages (cost model, call sites), cleared with the plans


def plan_cache() -> collections.OrderedDict:
    """A new LRU plan cache (an OrderedDict), emptied by :func:`clear_caches` with every other
    (``topology.model.derived_cache``, whose LRU :func:`cached` reads)."""
    return derived_cache()


_SHAPES: dict = {}  # id(tree) -> (tree, shape key): trees equal up to relabelling identical nodes


def set_shape(tree, key) -> None:
    """Record that ``tree`` has the shape ``key`` (a hashable value): trees of one shape are equal up
    to a relabelling of identical nodes (:mod:`jax_blink.planner.symmetric`), so per-tree metrics
    that depend only on link rates and kinds (the flow-level cost model) are computed once per shape."""
    if len(_SHAPES) > 200_000:
        _SHAPES.clear()
    _SHAPES[id(tree)] = (tree, key)


def tree_shape(tree):
    """The shape key :func:`set_shape` recorded for ``tree``, or None."""
    hit = _SHAPES.get(id(tree))
    return hit[1] if hit is not None and hit[0] is tree else None


class ComposedTrees(collections.abc.Sequence):
    """A plan's trees given by a composition rule (:mod:`jax_blink.planner.symmetric`: one node's plan
    and the network's, composed over N identical nodes), built on first use.

    A composed plan over N nodes has O(N) trees of N G GPUs each, O(N^2) hops in all; planning,
    ranking (the flow-level cost model) and the disk cache need only the rule, so the trees are
    built when something iterates them (the simulator, a schedule, JSON), once, and kept.

    Attributes:
      kind: the rule's name, as :func:`register_composition` knows it ("symmetric", "rsag").
      spec: the rule's data as JSON-able values (what the disk cache writes; decoded and checked by
        the rule's decoder).
      pieces: one (weight GB/s, root GPU, shape key) per tree, in the trees' order; trees of one shape
        are equal up to relabelling the nodes (:func:`set_shape`).
      make: ``make(i)`` builds tree i alone (O(N G) hops).

    Sequence of :class:`Tree` (len, index, iterate); equal (and hash) by (kind, key) among composed
    trees, by their trees against a tuple. Pickles as a plain tuple of trees.
    """

    __slots__ = ("kind", "spec", "pieces", "_key", "_hash", "_make", "_trees")

    def __init__(self, kind: str, spec, pieces, make, key):
        self.kind, self.spec, self.pieces = kind, spec, tuple(pieces)
        self._make, self._key, self._trees = make, key, None
        self._hash = hash((kind, key))

    def materialize(self) -> tuple:
        """The trees as a tuple (built once)."""
        if self._trees is None:
            trees = tuple(self._make(i) for i in range(len(self.pieces)))
            for t, (_, _, shape) in zip(trees, self.pieces):
                set_shape(t, shape)
            self._trees = trees
        return self._trees

    def sample(self, i: int) -> Tree:
        """Tree i (from the built tuple when built, else built alone; its shape recorded)."""
        t = self._trees[i] if self._trees is not None else self._make(i)
        set_shape(t, self.pieces[i][2])
        return t

    def __len__(self):
        return len(self.pieces)

    def __getitem__(self, i):
        return self.materialize()[i]

    def __iter__(self):
        return iter(self.materialize())

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if isinstance(other, ComposedTrees):
            return self._hash == other._hash and self.kind == other.kind and self._key == other._key
        if isinstance(other, tuple):
            return self.materialize() == other
        return NotImplemented

    def __reduce__(self):
        return (tuple, (self.materialize(),))

    def __repr__(self):
        return f"ComposedTrees({self.kind!r}, {len(self.pieces)} trees)"


_COMPOSITIONS: dict = {}


def register_composition(kind: str, decode) -> None:
    """Register ``decode(topology, devices, spec, fingerprint) -> ComposedTrees`` for
    :attr:`ComposedTrees.kind` ``kind`` (the disk cache rebuilds composed plans with it; it raises
    PlanError on a spec that is not a valid plan of ``devices`` on ``topology``; ``fingerprint`` is
    ``topology.fingerprint()``, or None for the decoder to compute it)."""
    _COMPOSITIONS[kind] = decode


def decode_composition(kind: str, topology, devices, spec, fingerprint: str | None = None) -> ComposedTrees:
    """Composed trees from a spec written by :attr:`ComposedTrees.spec` (PlanError when ``kind`` is
    unknown or the spec invalid); ``fingerprint``: the topology's, when the caller has it."""
    if kind not in _COMPOSITIONS:
        raise PlanError(f"unknown plan composition {kind!r}; known: {sorted(_COMPOSITIONS)}")
    if not isinstance(spec, dict):
        raise PlanError(f"plan composition {kind!r}: the spec must be an object, got {type(spec).__name__}")
    return _COMPOSITIONS[kind](topology, tuple(devices), spec, fingerprint)


def clear_on_reset(fn):
    """Register ``fn`` (a ``functools.lru_cache``-wrapped function) so :func:`clear_caches` empties its
    cache too; returns ``fn``, so it can decorate."""
    _CLEARERS.append(fn.cache_clear)
    return fn


def clear_caches() -> None:
    """Forget every cached plan and what was derived from plans: the planner's packings, the cost
    model's choices and simulated times, NCCL's ring level per allocation, loaded topology files and
    the per-call-site lowering requests (for uncached timing, or after editing a topology file)."""
    _SHAPES.clear()
    for cache in _CACHES:
        cache.clear()
    for clear in _CLEARERS:
        clear()


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
            # map(len) in C: trees over 1,024 GPUs have thousands of hops each
            if hops is not None and (isinstance(hops, str) or not set(map(len, hops)) <= {2}):
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
        same = self.reduce_edges is not None and (self.reduce_edges is self.edges or self.reduce_edges == self.edges)
        d = {"root": self.root, "weight_gbps": self.weight_gbps,
             "edges": [list(e) for e in self.edges],
             # "edges": the reduce runs on the broadcast hops (rsag trees of symmetric forests): written once
             "reduce_edges": None if self.reduce_edges is None else "edges" if same
             else [list(e) for e in self.reduce_edges]}
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
        forests) | "double-binary-tree" (NCCL's, from ``plan(nbytes=...)`` or
        :mod:`jax_blink.planner.dbtree`) | "trivial".
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
    def from_dict(cls, d: dict) -> Plan:
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
            trees = tuple(_tree_from_dict(t) for t in d["trees"])
            return cls(d["collective"], d["root"], tuple(d["devices"]), trees, inf(d["rate_gbps"]),
                       inf(d["bound_gbps"]), d["algorithm"], tuple(d.get("notes", ())),
                       tuple(d.get("relays", ())))
        except KeyError as err:
            raise PlanError(f"plan JSON: a tree lacks {err.args[0]!r}; every tree holds root, weight_gbps, "
                            f"edges and reduce_edges (null or a list)") from None
        except (TypeError, IndexError, ValueError) as err:
            raise PlanError(f"malformed plan JSON: {err!r}; see Plan.to_dict for the format") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"plan JSON is not valid JSON: {err}") from None

    def describe(self) -> str:
        """Readable multi-line summary: algorithm, rate vs bound, notes, one line per tree."""
        fmt = lambda x: "inf" if math.isinf(x) else f"{x:.3f}"  # noqa: E731
        root = "" if self.root is None else f" root {self.root}"
        relay = f" (relay GPUs {list(self.relays)})" if self.relays else ""
        lines = [f"{self.collective}{root} over GPUs {list(self.devices)}{relay}: {self.shape()}, "
                 f"rate {fmt(self.rate_gbps)} GB/s, bound {fmt(self.bound_gbps)} GB/s"]
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
def _tree_from_dict(t: dict) -> Tree:
    """Inverse of :meth:`Tree.to_dict` ("reduce_edges": "edges" means the broadcast hops)."""
    edges = tuple(map(tuple, t["edges"]))  # in C: a 1,024-GPU plan has ~10^5 hops
    red = t.get("reduce_edges")
    red = None if red is None else edges if red == "edges" else tuple(map(tuple, red))
    return Tree(t["root"], float(t["weight_gbps"]), edges, red, tuple(t.get("relays", ())))


def _round(x: float) -> float:
    """Weights are rounded down to 1e-9 GB/s so JSON is short and the rounding never overloads a link."""
    return float(math.floor(x * 10 ** WEIGHT_DECIMALS + 1e-6) / 10 ** WEIGHT_DECIMALS)


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
    """Broadcast-direction hops of an LP column (see :class:`jax_blink.planner.routes.Column`)."""
    hops = []
    for _parent, _child, r in col.edges:
        hops.extend(_hops(r[::-1] if mode == "in-arborescence" else r))
    return tuple(hops)
