"""Plans on disk: the processes of one job, and the next run of it, load a plan instead of planning.

One JSON file per request in ``<cache dir>/plans/`` (``$JAX_BLINK_CACHE_DIR``, else
``$XDG_CACHE_HOME/jax_blink``, else ``~/.cache/jax_blink``: :func:`jax_blink.topology.probe.cache_dir`),
named by the SHA-256 of the request key: planner version (:func:`planner_version`, a digest of
the planning code), topology
fingerprint, collective, devices, root, algorithm, the other planning arguments and the size class
(the operand bytes the cost model chose for, or None for the rate-optimal plan). ``JAX_BLINK_PLAN_CACHE=0``
turns it off.

An entry is never trusted: it is read only when it is a regular file of at most ``MAX_ENTRY_BYTES``
(opened without blocking: a FIFO or a link to a device is refused), and used only when its envelope's
version and key equal the request's, the SHA-256 of its plan text matches, the plan parses
(:meth:`Plan.from_json`), is over the request's collective and devices, and passes the checks a fresh
plan passes (:func:`check_plan`, recomputed, not read: every hop a link of the topology, every tree's
routes reach all devices from its root, weights finite and > 0, link loads within capacity, rate the
sum of the weights and at most the bound, a tree packing's bound the max-flow / cut certificate
recomputed on the topology, and its rate that certificate where the request was for the rate-optimal
packing). The SHA-256 catches torn writes, not edits (anyone can recompute it): the checks catch
edits. Anything else (a torn write, a file of another version, an edited plan) is ignored and the plan
is planned again and written over it (atomically: a temporary file, then a rename, so concurrent
processes read a whole file or none).

A composed plan (:class:`~jax_blink.planner.model.ComposedTrees`: identical nodes, planned on one node)
is written as its rule, O(N) in size instead of the O(N^2) hops of its trees, and checked by the
rule's decoder (:func:`~jax_blink.planner.model.register_composition`) on one node: every route a path of
the node's links, every column a spanning forest, every link of every node within capacity; its
trees are built on use. The entry also keeps the node structure (each node's GPU and switch ids, so a
load skips the per-node isomorphism test, a pass over every link of the cluster), checked in O(ids +
nodes x the plan's hops): ids of node 0's kinds, no id in two nodes, the nodes' GPUs the devices,
every hop the trees use a link of every node (:func:`~jax_blink.planner.symmetric.stored_structure`).
The topology fingerprint is computed once per load (the request key holds it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import stat

from .. import envvars
from ..errors import PlanError
from ..topology.probe import cache_dir
from .bounds import certificate
from .model import ComposedTrees, Plan, decode_composition

ENV_PLAN_CACHE = "JAX_BLINK_PLAN_CACHE"
#: The largest entry read (bytes): flat plans of 64 GPUs with hundreds of trees are a few MiB, composed
#: plans of 1,024 GPUs are O(N); anything larger is not a plan this planner wrote.
MAX_ENTRY_BYTES = 64 << 20
_LOG = logging.getLogger(__name__)
#: The code that decides a plan: any edit to it makes older entries stale.
_PLANNING_CODE = ("planner", "costmodel.py", "simulate", "schedule.py", "collectives.py", "topology/symmetry.py")


@functools.lru_cache(maxsize=1)
def planner_version() -> str:
    """Hex digest of the source of the planning code (the planner package, cost model, simulator,
    schedule, collectives, node symmetry), so a changed planner never reads an older one's plans."""
    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in _PLANNING_CODE:
        p = root / name
        for f in sorted(p.glob("*.py")) if p.is_dir() else [p]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def enabled() -> bool:
    """Whether plans are cached on disk: ``$JAX_BLINK_PLAN_CACHE`` unset, empty or "1" (on), "0" (off).

    Raises:
      PlanError: ``$JAX_BLINK_PLAN_CACHE`` is set to anything else.
    """
    try:
        return envvars.flag(ENV_PLAN_CACHE) is not False
    except envvars.EnvVarError as err:
        raise PlanError(str(err)) from None


def entry_path(key: dict):
    """The file of request ``key`` (a JSON-able dict; the planner version is part of it)."""
    digest = hashlib.sha256(json.dumps(_key(key), sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / "plans" / f"{digest}.json"


def _key(key: dict) -> dict:
    """``key`` with the planner version, as JSON would give it back (lists, not tuples)."""
    return json.loads(json.dumps({"version": planner_version(), **key}, sort_keys=True, default=str))


def check_plan(plan: Plan, topology, collective: str, devices, *, exact: bool = False) -> None:
    """Raise PlanError unless ``plan`` is a valid plan of ``collective`` over ``devices`` on
    ``topology``: hops are links, each tree's routes reach every device from its root (broadcast
    and reduce trees alike), weights finite and > 0, link loads within capacity (1e-6 relative),
    rate = sum of weights, rate <= bound, and, for tree packings, the bound recomputed: a broadcast,
    reduce, all-gather or reduce-scatter packing's bound is the max-flow / cut certificate
    (:func:`jax_blink.planner.bounds.certificate`: Edmonds' theorem, ForestColl's cut bound), an
    all-reduce packing's rate at most that certificate. ``exact``: the request asked for the
    rate-optimal packing (no ``max_trees``, no ``rate_tolerance``), so such a packing's rate must
    equal its certificate (the planner meets it exactly: Edmonds; ForestColl, theorem 1)."""
    if plan.collective != collective or tuple(plan.devices) != tuple(devices):
        raise PlanError(f"cached plan is for {plan.collective} over {list(plan.devices)}, not {collective} over "
                        f"{list(devices)}")
    _check_numbers(plan)
    g = topology.graph
    devs = set(devices)
    load = collections.Counter()
    for t in plan.trees:
        phases = [t.edges] if t.reduce_edges is None or t.reduce_edges == t.edges else [t.edges, t.reduce_edges]
        for hops in phases:
            _check_tree(hops, t.root, devs, set(t.relays))
        for e, k in t.link_usage(plan.collective).items():
            load[e] += k * t.weight_gbps
    for e, v in load.items():
        if not g.has_edge(*e):
            raise PlanError(f"cached plan uses {e}, which is not a link of the topology")
        if v > g.edges[e]["bandwidth_gbps"] * (1 + 1e-6) + 1e-9:
            raise PlanError(f"cached plan loads link {e} with {v:.3f} GB/s > its {g.edges[e]['bandwidth_gbps']} GB/s")
    total = sum(t.weight_gbps for t in plan.trees)
    if plan.trees and not abs(total - plan.rate_gbps) <= 1e-6 * max(1.0, total):
        raise PlanError(f"cached plan: rate {plan.rate_gbps} GB/s is not the sum of its weights {total}")
    if plan.algorithm == "trees" and plan.trees and len(devs) > 1:
        cert = certificate(topology, collective, list(devices), plan.root, tuple(plan.relays))
        tol = 1e-6 * max(1.0, cert)
        if collective != "allreduce" and not abs(plan.bound_gbps - cert) <= tol:
            raise PlanError(f"cached plan: bound {plan.bound_gbps} GB/s is not the recomputed certificate {cert}")
        if not plan.rate_gbps <= cert + tol:
            raise PlanError(f"cached plan: rate {plan.rate_gbps} GB/s exceeds the max-flow certificate {cert}")
        if exact and collective != "allreduce" and not plan.rate_gbps >= cert - tol:
            raise PlanError(f"cached plan: rate {plan.rate_gbps} GB/s is below the certificate {cert} that the "
                            f"rate-optimal packing it stands for reaches")


def _check_numbers(plan: Plan) -> None:
    """Raise PlanError unless the plan's weights are finite and > 0, its rate > 0 (finite, or inf for
    one device) and at most its bound: NaN compares false, so each test is written to fail on it."""
    for t in plan.trees:
        if not (isinstance(t.weight_gbps, (int, float)) and 0 < t.weight_gbps < math.inf):
            raise PlanError(f"cached plan: tree weight {t.weight_gbps!r} GB/s is not a finite positive number")
    rate, bound = plan.rate_gbps, plan.bound_gbps
    one = len(plan.devices) <= 1
    if not (0 < rate < math.inf or (one and rate == math.inf)):
        raise PlanError(f"cached plan: rate {rate!r} GB/s is not a finite positive number")
    if not rate <= bound * (1 + 1e-6):
        raise PlanError(f"cached plan: rate {rate!r} GB/s exceeds its bound {bound!r} GB/s (or either is NaN)")


def _check_tree(hops, root, devs: set, relays: set) -> None:
    """Raise PlanError unless ``hops`` are consecutive routes forming a tree from ``root`` that
    reaches every GPU of ``devs`` once (one pass: each route's GPU child gets its parent)."""
    parent, cur = {}, None
    for a, b in hops:
        if isinstance(a, int) and a not in relays:
            cur = a
        if isinstance(b, int) and b not in relays:
            if b in parent or b == root or cur is None:
                raise PlanError(f"cached plan: tree rooted at {root} reaches GPU {b} twice or from nowhere")
            parent[b] = cur
            cur = None
    if len(devs) > 1 and set(parent) != devs - {root}:
        raise PlanError(f"cached plan: tree rooted at {root} does not span GPUs {sorted(devs)}")
    done = {root}
    for v in parent:  # every GPU reaches the root: no cycle
        path = []
        while v not in done:
            path.append(v)
            v = parent.get(v)
            if v is None or len(path) > len(parent):
                raise PlanError(f"cached plan: tree rooted at {root} has a cycle or a detached part")
        done.update(path)


def _encode(plan: Plan) -> dict:
    """The entry's plan: :meth:`Plan.to_dict`, or for a composed plan (:class:`ComposedTrees`) its
    fields without trees and the composition's spec (O(N) instead of the trees' O(N^2) hops)."""
    if isinstance(plan.trees, ComposedTrees):
        d = dataclasses.replace(plan, trees=()).to_dict()
        del d["trees"]
        d["composed"] = {"kind": plan.trees.kind, "spec": plan.trees.spec}
        return d
    return plan.to_dict()


def _decode(d, topology, collective: str, devices, fingerprint: str | None = None, exact: bool = False) -> Plan:
    """The checked plan of an entry's dict (:func:`_encode`): PlanError (or a lookup / type error on a
    malformed dict) unless valid: a composed plan's spec is checked by its decoder on one node
    (:func:`jax_blink.planner.model.decode_composition`), its rate against the pieces' weights; any
    other plan by :func:`check_plan`."""
    if not isinstance(d, dict) or "composed" not in d:
        plan = Plan.from_dict(d)
        check_plan(plan, topology, collective, devices, exact=exact)
        return plan
    plan = Plan.from_dict({**d, "trees": []})
    if plan.collective != collective or tuple(plan.devices) != tuple(devices):
        raise PlanError(f"cached plan is for {plan.collective} over {list(plan.devices)}, not {collective} over "
                        f"{list(devices)}")
    _check_numbers(plan)
    trees = decode_composition(d["composed"]["kind"], topology, devices, d["composed"]["spec"], fingerprint)
    total = sum(p[0] for p in trees.pieces)
    if not all(0 < p[0] < math.inf for p in trees.pieces):
        raise PlanError("cached plan: a composed piece's weight is not a finite positive number")
    if not abs(total - plan.rate_gbps) <= 1e-6 * max(1.0, total):
        raise PlanError(f"cached plan: rate {plan.rate_gbps} GB/s is not the sum of its weights {total}")
    return dataclasses.replace(plan, trees=trees)


def load(key: dict, topology, collective: str, devices) -> Plan | None:
    """The cached plan of ``key``, or None when absent or not valid (module docstring; the reason is
    logged at DEBUG)."""
    path = entry_path(key)
    try:
        raw = _read_entry(path)
        head, _, text = raw.partition(b"\n")
        data = json.loads(head)
        if not isinstance(data, dict) or data.get("key") != _key(key):
            raise ValueError("another version or request")
        if hashlib.sha256(text).hexdigest() != data["sha256"]:
            raise ValueError("checksum mismatch")
        # the key's topology fingerprint is the request's (just compared): computed once per load
        fp = key.get("topology")
        exact = key.get("kind") == "plan" and key.get("max_trees") is None and not key.get("rate_tolerance")
        return _decode(json.loads(text), topology, collective, devices, fp if isinstance(fp, str) else None, exact)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError, PlanError) as err:
        _LOG.debug("ignoring plan cache entry %s: %s", path, err)
        return None


def _read_entry(path) -> bytes:
    """The bytes of a cache entry that is a regular file of at most ``MAX_ENTRY_BYTES``: opened without
    blocking (a FIFO put in its place would otherwise wait for a writer) and checked by ``fstat`` on
    the open file (no race with a rename), read to at most the limit (a link to /dev/zero is not a
    regular file). Raises OSError (FileNotFoundError when absent) or ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > MAX_ENTRY_BYTES:
            raise ValueError(f"{st.st_size} bytes > the {MAX_ENTRY_BYTES}-byte limit of an entry")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            raw = f.read(MAX_ENTRY_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > MAX_ENTRY_BYTES:
        raise ValueError(f"grew past the {MAX_ENTRY_BYTES}-byte limit of an entry while read")
    return raw


def store(key: dict, plan: Plan) -> None:
    """Write ``plan`` as the entry of ``key`` (atomic rename; an unwritable directory is logged and
    skipped: the cache is an optimisation)."""
    path = entry_path(key)
    text = json.dumps(_encode(plan)).encode()
    head = json.dumps({"key": _key(key), "sha256": hashlib.sha256(text).hexdigest()}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(head + b"\n" + text)
        tmp.replace(path)
    except OSError as err:
        _LOG.debug("plan cache: cannot write %s: %s", path, err)


def disk_cached(key: dict, topology, collective: str, devices, make) -> Plan:
    """The plan of request ``key``: loaded when a valid entry exists, else ``make()`` (then stored).
    Plans with relays, and trivial plans, are stored like any other."""
    if not enabled():
        return make()
    hit = load(key, topology, collective, devices)
    if hit is not None:
        return hit
    plan = make()
    store(key, plan)
    return plan
