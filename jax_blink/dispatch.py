"""The call-site dispatcher: which lowering runs a jax_blink collective and on which schedule.

At lowering, the primitives' rules (``jax_blink.primitives``) hand each call site here:
:func:`site_lowering` picks the lowering record (:func:`choose_lowering` over the registry
``jax_blink.lowering``; ``impl="auto"`` asks the records, and across processes the cost model's
:func:`_estimate` of each), and :func:`request_for_site` gives the rule its
:class:`~jax_blink.lowering.LoweringRequest`: the groups of the mesh, the device table and one schedule
per group, the least predicted time among the group's :func:`candidate_plans` (plan selection:
:func:`effective_algorithm`, :func:`plan_group`) for that record (:func:`build_request`, cached per
call-site shape). Where the record's executor has its own policy over the candidates (the CPU
executor in host memory), the record's ``candidates`` hook applies it. :func:`site_choice` adds
``impl="auto"``'s per-site choice of XLA's own collective (the "xla" record) where the cost model
predicts it faster than the record's schedule (:func:`jax_blink.lowering.xla.decide`), with the reason.
No JAX rule lives here.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

from . import costmodel, mapping
from . import lowering as _lowering
from ._jax_compat import AbstractMesh, SPMDAxisContext, manual_axes
from .errors import BlinkError, TopologyError, warn_user
from .lowering import ffi as _ffi  # noqa: F401  (registers the "ffi" records)
from .lowering import hierarchical as _hierarchical  # noqa: F401  (registers the "hierarchical" record)
from .lowering import ppermute as _ppermute  # noqa: F401  (registers the "ppermute" record)
from .lowering import xla as _xla  # registers the "xla" record
from .planner.model import clear_on_reset
from .planner.threephase import node_groups
from .planning import plan
from .topology import Topology

_log = logging.getLogger("jax_blink.lowering")


# ================================================================================ choice of lowering
def _usable_everywhere(platforms) -> list:
    """The records usable on every one of ``platforms`` (one record serving them all), by name."""
    out = []
    for name in _lowering.names():
        recs = [_lowering.find_lowering(name, p) for p in platforms]
        if recs and all(r is not None for r in recs) and len(set(recs)) == 1:
            out.append(recs[0])
    return out


def choose_lowering(impl: str, platforms, processes: int = 1, site: _lowering.Site | None = None
                    ) -> _lowering.Lowering:
    """The lowering record for ``impl`` on the module's platforms. Raises BlinkError if unavailable.

    "auto" = the usable record with the lowest ``auto_priority`` that is registered for every platform
    of the module, runs on ``processes`` processes (``multi_process`` when more than one) and whose
    ``auto_allowed`` predicate agrees: "ffi" (on GPUs only once the native executor passed
    ``jax_blink.selftest()`` here, ``lowering.ffi.native_auto_allowed``) when the mesh lies in one
    process; across processes "hierarchical" where every process holds two or more of each group's
    devices (its ``auto_fits`` asks the ``site``: how the groups lie over the processes), else
    "ppermute". A record's ``auto_fits`` refusal is logged (logger ``jax_blink.lowering``, INFO) with
    its reason. An explicit ``impl`` must be usable on every platform, and multi-process capable when
    ``processes > 1``.
    """
    platforms = list(platforms)
    if impl == "auto":
        candidates = [r for r in _usable_everywhere(platforms) if r.auto_priority is not None]
        for rec in sorted(candidates, key=lambda r: r.auto_priority):
            if ((processes == 1 or rec.multi_process)
                    and all(rec.auto_allowed is None or rec.auto_allowed(p) for p in platforms)):
                why = rec.auto_fits(site if processes > 1 else None) if rec.auto_fits is not None else None
                if why is None:
                    return rec
                _log.info("jax_blink impl='auto': not %r: %s", rec.name, why)
        raise BlinkError(f"jax_blink impl='auto': no registered lowering runs on platform(s) {platforms} over "
                         f"{processes} process(es) (registered impls: {_lowering.usable_names()})")
    known = _lowering.LOWERINGS.get(impl, {}).values()
    if processes > 1 and known and not any(r.multi_process for r in known):
        others = [f"impl={r.name!r} ({r.description})" for r in _usable_everywhere(platforms) if r.multi_process]
        raise BlinkError(f"jax_blink impl={impl!r} runs inside one process, but this mesh spans {processes} "
                         f"processes (jax.distributed); use impl='auto'"
                         f"{''.join(' or ' + o for o in others)}, which run across processes")
    recs = [_lowering.find_lowering(impl, p) for p in platforms]
    if any(r is None for r in recs) or len(set(recs)) != 1:
        why = [f"{impl!r} on {p}: {r.unavailable}" for p in platforms
               if (r := _lowering.record(impl, p)) is not None and r.unavailable]
        raise BlinkError(f"jax_blink impl={impl!r} has no lowering registered for platform(s) {platforms} "
                         f"(registered impls: {_lowering.usable_names()}"
                         f"{''.join('; ' + w for w in why)}). Build/install the native extension for the "
                         "'ffi' impl, or use impl='ppermute' (portable) or impl='auto'")
    return recs[0]


# ================================================================================ plan selection
#: Collectives each forced algorithm plans (``jax_blink.plan`` raises PlanError for the others).
_APPLIES = {"ring": ("allreduce", "allgather", "reducescatter"), "rsag": ("allreduce",),
            "hierarchical": ("allreduce", "broadcast", "reduce")}
_WARNED: set = set()


def effective_algorithm(key: mapping.PlanKey, topology: Topology, collective: str, gpu_ids) -> str:
    """``key.algorithm``, except that a preference from ``JAX_BLINK_ALGORITHM`` falls back to "auto"
    where it does not apply: "ring" for broadcast / reduce, "rsag" for anything but all-reduce,
    "hierarchical" for all-gather / reduce-scatter or a group on one node. Each fallback warns once
    per (algorithm, collective, reason) in the process (RuntimeWarning). An explicit ``algorithm=``
    argument is used as given (the planner raises PlanError if it cannot apply)."""
    if key.algorithm_strict or key.algorithm == "auto":
        return key.algorithm
    why = None
    if collective not in _APPLIES.get(key.algorithm, (collective,)):
        why = f"it does not apply to {collective}"
    elif key.algorithm == "hierarchical" and len(node_groups(topology, list(gpu_ids))) < 2:
        why = "the group's GPUs are on one node"
    if why is None:
        return key.algorithm
    if (key.algorithm, collective, why) not in _WARNED:
        _WARNED.add((key.algorithm, collective, why))
        warn_user(f"{mapping.ENV_ALGORITHM}={key.algorithm}: {why}; planning {collective} with 'auto' "
                  f"(pass algorithm= to a call to require it)")
    return "auto"


def plan_group(topology: Topology, collective: str, gpu_ids: list[int], root_rank: int | None,
               algorithm: str = "auto", max_trees: int | None = None):
    """The packing plan for one group (:func:`jax_blink.plan` with ``algorithm`` and
    ``max_trees``), with a clear coverage error (TopologyError); PlanError from the planner, e.g.
    "hierarchical" on one node."""
    missing = [g for g in gpu_ids if g not in set(topology.gpus)]
    if missing:
        raise TopologyError(
            f"topology {getattr(topology, 'name', '')!r} has GPUs {topology.gpus} but the mesh devices map "
            f"to GPUs {gpu_ids}; {missing} are not in it. Pass a topology covering these devices, or "
            "device_map= / jax_blink.set_device_map to map JAX devices onto its GPUs")
    root = gpu_ids[root_rank] if root_rank is not None else None
    return plan(topology, collective, devices=list(gpu_ids), root=root, algorithm=algorithm,
                max_trees=max_trees)


def candidate_plans(topology: Topology, collective: str, gpu_ids: list[int], root_rank: int | None,
                    algorithm: str = "auto", max_trees: int | None = None) -> list:
    """Plans the cost model chooses among for one group (:func:`jax_blink.costmodel.candidate_plans`
    with the group's GPUs and root): the plan of :func:`plan_group` first, then fewer trees, rings,
    NCCL's baselines and three phases as ``algorithm`` and ``max_trees`` allow."""
    best = plan_group(topology, collective, gpu_ids, root_rank, algorithm, max_trees)  # coverage errors
    return costmodel.candidate_plans(topology, collective, devices=best.devices, root=best.root,
                                     algorithm=algorithm, max_trees=max_trees)


# ================================================================================ requests of a call site
def _representatives(groups, shape, names, auto_axes) -> list[int]:
    """Per group, the index of the group holding its first member with the ``auto_axes`` coordinates
    set to 0 (itself when there are none)."""
    if not auto_axes:
        return list(range(len(groups)))
    where = {p: g for g, members in enumerate(groups) for p in members}
    auto = [names.index(a) for a in auto_axes]
    out = []
    for members in groups:
        coords = list(np.unravel_index(members[0], shape))
        for k in auto:
            coords[k] = 0
        out.append(where[int(np.ravel_multi_index(coords, shape))])
    return out


def auto_axes(ctx, mesh) -> tuple:
    """The mesh axes a call site leaves to SPMD partitioning: those not manual in a shard_map over
    some of the mesh's axes (empty when all are manual, under pmap, or outside shard_map)."""
    manual = manual_axes(ctx)
    return tuple(a for a in mesh.axis_names if a not in manual) if manual else ()


@clear_on_reset
@functools.lru_cache(maxsize=256)
def build_request(collective: str, mesh, axes: tuple, axis_index_groups, root, key,
                  nelems: int, itemsize: int, platform: str, impl: str = "ppermute",
                  auto_axes: tuple = (), by_process: bool = False,
                  schedules: bool = True) -> _lowering.LoweringRequest:
    """The LoweringRequest for one call site: groups, device table, one schedule per group.

    ``by_process``: the groups are each group's members inside each process (a group spanning P
    processes gives P local groups, members in rank order, every process's listed so that all
    processes lower one program; ``root`` is then a rank of a local group): the request of a
    native executor's intra-node phase (``lowering.hierarchical``, Blink section 5). Without a
    given topology, a local group on host CPU devices plans on ``Topology.host(len(group))``.
    ``schedules=False``: groups and device table only (no plan, ``schedules=()``), for a rule that
    builds its phases from other requests.

    Each group's schedule is the least predicted time over :func:`candidate_plans` and chunk
    counts (:func:`jax_blink.costmodel.lowering_schedule` with the step latency and round-synchronous
    flag of lowering ``impl``'s record on ``platform``, usable here or not), among the candidates the
    record's ``candidates`` hook keeps (the CPU "ffi": the packing only, its chunks chosen).
    Raises BlinkError for an ``impl`` with no record.
    ``auto_axes``: mesh axes left to SPMD partitioning (a shard_map over the other axes): devices that
    differ only along them run one program with no partition id to tell them apart (lowering.ppermute's
    ``mesh_position``), so every group takes the schedule of its representative, the group at
    coordinate 0 of those axes (ranks correspond: the collective's axes are manual)."""
    rec = _lowering.record(impl, platform)
    if rec is None:
        raise BlinkError(f"jax_blink: no lowering {impl!r} is registered (registered: {_lowering.names()})")
    groups = mapping.mesh_groups(tuple(mesh.devices.shape), tuple(mesh.axis_names), axes,
                                 axis_index_groups)
    rep = _representatives(groups, tuple(mesh.devices.shape), tuple(mesh.axis_names), auto_axes)
    flat = list(mesh.devices.flat)
    if by_process:
        # Every process's part of every group, not only this process's: each process then lowers the
        # same program (jaxlib 0.12.1's cross-process collectives hang when the processes' programs
        # differ; scripts/repro_jaxlib_0121_gloo_hang.py). A process's calls meet its own devices only.
        groups = [part for split in mapping.split_by_process(flat, groups) for part in split.values()]
        rep = list(range(len(groups)))  # each local group plans for itself
    table = mapping.device_table(flat, groups)
    if not schedules:
        return _lowering.LoweringRequest(collective=collective, schedules=(), device_table=table,
                                         groups=tuple(tuple(g) for g in groups), axis_names=tuple(axes), root=root)
    all_ids = mapping.map_devices(flat, key)
    if (key.topology is None and key.device_map is None and platform not in ("cuda", "rocm", "gpu")
            and len({d.process_index for d in flat}) > 1):
        # host CPU devices of several processes have sparse global ids (process p from p * 2048):
        # Topology.host is symmetric, so number them densely by id
        dense = {i: k for k, i in enumerate(sorted(all_ids))}
        all_ids = [dense[i] for i in all_ids]
    host_local = by_process and key.topology is None and platform not in ("cuda", "rocm", "gpu")
    topo = (mapping.resolve_topology(None, platform, [max(len(g) for g in groups) - 1]) if host_local
            else mapping.resolve_topology(key.topology, platform, all_ids))
    schedules, cache = [], {}
    for g in range(len(groups)):
        members = groups[rep[g]]
        gpus = tuple(range(len(members))) if host_local else tuple(all_ids[p] for p in members)
        if gpus not in cache:
            algorithm = effective_algorithm(key, topo, collective, gpus)
            if by_process and algorithm == "hierarchical":
                algorithm = "auto"  # the local phase of the three phases: the node's own plan
            plans = candidate_plans(topo, collective, list(gpus), root, algorithm, key.max_trees)
            bound = plans[0].bound_gbps  # the rate-optimal plan's certificate (jax_blink.plan's)
            if rec.candidates is not None:  # the executor's own policy (lowering.Lowering.candidates)
                plans = rec.candidates(collective, plans)
            chosen, sched, t = costmodel.lowering_schedule(
                plans, nelems, itemsize=itemsize, step_latency_s=rec.step_latency_s,
                round_synchronous=rec.round_synchronous, topology=topo, chunk_elems=key.chunk_elems,
                chunks_as_simulated=rec.chunks_as_simulated, peer_routes=rec.peer_routes)
            cache[gpus] = (sched, chosen, t, bound)
        schedules.append(cache[gpus])
    return _lowering.LoweringRequest(collective=collective, schedules=tuple(s[0] for s in schedules),
                                     device_table=table, groups=tuple(tuple(g) for g in groups),
                                     axis_names=tuple(axes), plans=tuple(s[1] for s in schedules),
                                     predicted_s=tuple(s[2] for s in schedules),
                                     bounds_gbps=tuple(s[3] for s in schedules), topology=topo,
                                     root=root)


def concrete_mesh(collective, ctx):
    """The device mesh of a call site; BlinkError when it has none (an abstract mesh, no mesh)."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext) or isinstance(axis_ctx.mesh, AbstractMesh):
        raise BlinkError(f"jax_blink.{collective} needs a concrete device mesh at lowering (jax.pmap or "
                         f"jax.shard_map with a jax.sharding.Mesh); got axis context {type(axis_ctx).__name__}")
    return axis_ctx.mesh


def site_lowering(ctx, mesh, impl, axes=None, axis_index_groups=None, collective=None, key=None, root=None,
                   nbytes=0) -> _lowering.Lowering:
    """The lowering record for ``impl`` at a call site (its platforms, its mesh's process count and,
    across processes, how the collective's groups lie over the processes: ``site``, with the cost
    model's estimate of each lowering there: :func:`_estimate`)."""
    nproc = len({d.process_index for d in mesh.devices.flat})
    site = None
    if nproc > 1 and axes is not None:
        groups = mapping.mesh_groups(tuple(mesh.devices.shape), tuple(mesh.axis_names), tuple(axes),
                                     axis_index_groups)
        estimate = None
        if collective is not None and key is not None:
            estimate = functools.partial(_estimate, collective, mesh, tuple(axes), axis_index_groups, root, key,
                                         int(nbytes), ctx.module_context.platforms[0])
        site = _lowering.Site(processes=nproc, groups=tuple(map(tuple, groups)),
                              process_of=tuple(int(d.process_index) for d in mesh.devices.flat),
                              estimate=estimate, root=root)
    return choose_lowering(impl, ctx.module_context.platforms, nproc, site=site)


def site_choice(ctx, mesh, impl, axes, axis_index_groups, collective, key, root, nbytes):
    """(record, reason or None) for a call site: :func:`site_lowering`'s record, or under ``impl="auto"``
    XLA's own collective (the "xla" record) where :func:`jax_blink.lowering.xla.decide` predicts it
    strictly faster than that record's schedule (:func:`build_request`'s predicted time). Only inside one
    process, one platform, and with ``algorithm`` left to ``auto`` (a forced algorithm is a jax_blink
    plan). The reason (kept or handed over, with both times) goes to the call-site report and is
    logged (logger ``jax_blink.lowering``, INFO)."""
    rec = site_lowering(ctx, mesh, impl, axes, axis_index_groups, collective, key, root, nbytes)
    platforms = list(ctx.module_context.platforms)
    xla_rec = _lowering.find_lowering(_xla.NAME, platforms[0])
    nproc = len({d.process_index for d in mesh.devices.flat})
    if (impl != "auto" or xla_rec is None or rec.name == _xla.NAME or nproc > 1 or len(platforms) != 1
            or (key.algorithm != "auto" and key.algorithm_strict) or nbytes <= 0):
        return rec, None
    itemsize = np.dtype(ctx.avals_in[0].dtype).itemsize
    req = build_request(collective, mesh, tuple(axes), axis_index_groups, root, key, max(1, nbytes // itemsize),
                        itemsize, platforms[0], rec.name, auto_axes(ctx, mesh))
    if not req.predicted_s or len(req.groups[0]) < 2:
        return rec, None
    devices = list(req.plans[0].devices) if req.plans else None
    use, why = _xla.decide(platforms[0], collective, nbytes, len(req.groups[0]), rec.name, max(req.predicted_s),
                           req.topology, devices)
    _log.info("jax_blink impl='auto' at %s %d B: %s", collective, nbytes, why)
    return (xla_rec, why) if use else (rec, why)


@functools.lru_cache(maxsize=256)
def _estimate(collective, mesh, axes, axis_index_groups, root, key, nbytes, platform, impl) -> float:
    """Predicted seconds of lowering ``impl`` at a call site of ``nbytes`` per device (the slowest
    group): a tree-schedule lowering by ``costmodel.lowering_schedule`` with its record's step latency
    over the group's candidate plans; a multi-process one (``multi_process`` and not round-synchronous:
    "hierarchical") by ``costmodel.process_phases`` on the topology's NIC rates (inf on a topology
    without a network, e.g. the default host CPU one)."""
    rec = _lowering.record(impl, platform)
    groups = mapping.mesh_groups(tuple(mesh.devices.shape), tuple(mesh.axis_names), axes, axis_index_groups)
    flat = list(mesh.devices.flat)
    ids = mapping.map_devices(flat, key)
    topo = mapping.named_topology(key.topology)
    if topo is None:
        return math.inf if not rec.round_synchronous else 0.0
    worst = 0.0
    for members in groups:
        gpus = [ids[p] for p in members]
        if rec.round_synchronous:
            plans = candidate_plans(topo, collective, gpus, root, key.algorithm if key.algorithm_strict
                                            else "auto", key.max_trees)
            itemsize = 4
            _, _, t = costmodel.lowering_schedule(plans, max(1, nbytes // itemsize), itemsize=itemsize,
                                                  step_latency_s=rec.step_latency_s, round_synchronous=True,
                                                  topology=topo, chunk_elems=key.chunk_elems)
        else:
            phases = costmodel.process_phases(topo, collective, nbytes, devices=gpus)
            t = math.inf if phases is None else phases.total_s
        worst = max(worst, t)
    return worst


def request_for_site(collective, mesh, axes, axis_index_groups, root, key, itemsize, platform, impl, auto_axes_=()):
    """``request_for(nelems, collective_=None, *, by_process=False, impl_=None, root_=...,
    schedules=True)`` of a call site: the (cached) :func:`build_request`. A rule may ask for
    another collective over the same groups (the phases of a hierarchical lowering), for this
    process's part of each group, and for the groups alone (no schedules)."""
    def request_for(nelems: int, collective_: str | None = None, *, by_process: bool = False,
                    impl_: str | None = None, root_=..., schedules: bool = True) -> _lowering.LoweringRequest:
        if root_ is ...:  # the call site's root for its own collective, none for another one
            root_ = root if collective_ in (None, collective) else None
        return build_request(collective_ or collective, mesh, tuple(axes), axis_index_groups, root_, key,
                             nelems, itemsize, platform, impl_ or impl, auto_axes_, by_process=by_process,
                             schedules=schedules)
    return request_for
