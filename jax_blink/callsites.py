"""What each jax_blink call site runs, recorded where it is lowered: one :class:`CallSite` per bucket.

The primitives' lowering rules hand every bucket to :func:`run_rule` instead of calling the chosen
lowering record's rule themselves. It

- names the work: the rule's ops carry the call site's label (collective, size, plan, lowering) in
  their MLIR location and name stack, which XLA keeps as the HLO ``op_name`` metadata that
  ``jax.profiler`` traces and HLO dumps show (:func:`label`);
- describes the call site from the same :class:`~jax_blink.lowering.LoweringRequest` the rule runs
  (its plans, the cost model's predicted time, the certified rate, the topology), adding the link
  simulator's times of the plan and of NCCL's ring and double binary tree at the same size, as
  ``jax_blink.plan(nbytes=)`` and ``jax-blink bench`` compute them (:func:`describe`); only when
  someone listens: :func:`collect` (``jax_blink.explain``) or the ``jax_blink`` logger at INFO;
- logs one line per call site (``JAX_BLINK_LOG=info``; ``debug`` adds the plan's trees) through
  Python's ``logging`` (logger ``"jax_blink"``); nothing is printed by default;
- in a mesh that spans processes with the peer watch on (``JAX_BLINK_WATCH=1``), brackets the
  collective with the arrival check of :mod:`jax_blink.peerwatch`.

Times are seconds, sizes bytes per device (sharded collectives: the full buffer, as ``bench``),
rates GB/s = 1e9 B/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import re
import threading

import numpy as np

from . import envvars
from . import lowering as _lowering
from ._jax_compat import ir, source_info_util

LOG = logging.getLogger("jax_blink")
ENV_LOG = "JAX_BLINK_LOG"
_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG}

#: The public function of each collective (what a user wrote).
API_NAMES = {"allreduce": "psum", "broadcast": "broadcast", "reduce": "reduce", "allgather": "all_gather",
             "reducescatter": "psum_scatter"}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_local = threading.local()


@dataclasses.dataclass
class CallSite:
    """One jax_blink call site (one bucket of one collective) as lowered.

    Attributes (times in seconds, sizes in bytes per device, rates in GB/s):
      index: position among the call sites lowered in this collection (0, 1, ...).
      api: the public function ("jax_blink.psum", ...); collective: its ``jax_blink.collectives`` name.
      axes: mesh axes; group_size: devices per group; groups: number of groups.
      dtype: element type; leaves: operands in the bucket; nbytes: bytes per device the collective
        moves (all-gather / reduce-scatter: the full buffer).
      lowering: the registry record's name ("ffi", "ppermute", ...); platform; processes: processes
        the mesh spans; why: why that lowering (``impl`` given, or ``auto``'s choice and what it skipped).
      algorithm: the plan's algorithm; shape: ``Plan.shape()`` ("trees, 8 trees", "ring, 1 ring");
      trees: trees with positive weight; chunks: chunks of the schedule; rounds: schedule rounds;
      schedules: schedules the rule ran (the ppermute rule runs one per leaf: plan, chunks and rounds
        are then the largest leaf's, ``predicted_s`` their sum, the simulated columns at ``nbytes``).
      predicted_s: the cost model's time of what the lowering runs (``costmodel.lowering_schedule``;
        the largest over groups, summed over the rule's schedules).
      sim_s: the link simulator's time of the plan at ``nbytes`` (``jax-blink bench --plan``'s blink
        column); bound_gbps: the certified rate (``jax_blink.plan(...).bound_gbps``); bound_s:
        ``nbytes / bound``; ring_s / tree_s: NCCL's rings / double binary tree (all-reduce) on the
        same links, simulated as ``bench`` does (None where they do not exist); nccl_s / nccl_choice:
        what NCCL itself runs there by its tuner (:func:`jax_blink.nccl_model.predict`: algorithm /
        protocol and its back-to-back time; None on a topology of host CPU devices); speedup: NCCL's
        time (``nccl_s``, else the faster simulated NCCL baseline) over ``sim_s``; auto_shape / auto_s:
        ``jax_blink.plan(nbytes=)``'s choice and its simulated time (``bench``'s blink column).
      source: "file:line (function)" of the call in the user's code; label: the name its ops carry.
      sources: one "file:line (function)" per collective the bucket runs (``jax_blink.transform``'s
        combined calls: each member's innermost line outside jax and jax_blink), else ``(source,)``.
      plan_why: why the lowering runs this plan where ``plan(nbytes=)`` (``auto_shape``) would choose
        another ("" when they agree or no plan); gpu_topology: the topology describes GPUs (links
        other than host memory).
      plan: the ``Plan`` of the first group (not in :meth:`to_dict`).
    """

    index: int
    api: str
    collective: str
    axes: tuple
    group_size: int
    groups: int
    dtype: str
    leaves: int
    nbytes: int
    lowering: str
    platform: str
    processes: int
    why: str
    algorithm: str
    shape: str
    trees: int
    chunks: int
    rounds: int
    schedules: int
    predicted_s: float
    sim_s: float | None
    bound_gbps: float | None
    bound_s: float | None
    ring_s: float | None
    tree_s: float | None
    speedup: float | None
    auto_shape: str | None
    auto_s: float | None
    source: str
    label: str
    sources: tuple = ()
    plan_why: str = ""
    gpu_topology: bool = False
    plan: object = dataclasses.field(default=None, repr=False)
    nccl_s: float | None = None
    nccl_choice: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready fields (no Plan object; inf becomes None)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "plan"}
        d["axes"] = list(self.axes)
        d["sources"] = list(self.sources)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    def log_line(self) -> str:
        """The ``JAX_BLINK_LOG=info`` line."""
        def t(s):
            return "-" if s is None else f"{s * 1e6:.3g} us"
        return (f"{self.api} {self.collective} over {','.join(map(str, self.axes))} (n={self.group_size}"
                f"{'' if self.groups == 1 else f' x{self.groups} groups'}) {self.dtype} {self.nbytes} B/device"
                f" [{self.leaves} leaf{'s' if self.leaves != 1 else ''}]: lowering {self.lowering} ({self.why}); "
                f"plan {self.shape}, {self.chunks} chunks, {self.rounds} rounds; predicted {t(self.predicted_s)}, "
                f"simulated {t(self.sim_s)}, bound {t(self.bound_s)}, NCCL ring {t(self.ring_s)}, "
                f"NCCL tree {t(self.tree_s)}"
                f"{'' if self.nccl_s is None else f', NCCL tuner {self.nccl_choice} {t(self.nccl_s)}'}; "
                f"at {self.source}")


# ------------------------------------------------------------------------------ listeners
@contextlib.contextmanager
def collect():
    """Collect the :class:`CallSite` of every bucket lowered in this thread inside the block.

    Yields the list the sites are appended to (in lowering order). Used by ``jax_blink.explain``.
    """
    prev = getattr(_local, "sites", None)
    _local.sites = []
    try:
        yield _local.sites
    finally:
        _local.sites = prev


def _log_level() -> int | None:
    """The level ``JAX_BLINK_LOG`` asks for (None when unset or empty). Raises EnvVarError (a
    ValueError) for another value than info / debug."""
    text = envvars.choice(ENV_LOG, casefold=True)
    return None if text is None else _LEVELS[text]


_ENV_HANDLER = logging.StreamHandler()  # stderr; attached only while JAX_BLINK_LOG is set
_ENV_HANDLER.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
_env_state = {"level": None}  # the level JAX_BLINK_LOG set on the logger (None: it set none)


def _logging_enabled() -> bool:
    """Apply ``JAX_BLINK_LOG`` to the ``jax_blink`` logger (its level and a stderr handler; undone
    when the variable is unset again, leaving levels the program set itself alone); True when the
    logger takes INFO records."""
    level = _log_level()
    if level is not None:
        if LOG.level in (logging.NOTSET, _env_state["level"]):
            LOG.setLevel(level)
            _env_state["level"] = level
        if _ENV_HANDLER not in LOG.handlers and not LOG.handlers:
            LOG.addHandler(_ENV_HANDLER)
    elif _env_state["level"] is not None:
        if LOG.level == _env_state["level"]:
            LOG.setLevel(logging.NOTSET)
        if _ENV_HANDLER in LOG.handlers:
            LOG.removeHandler(_ENV_HANDLER)
        _env_state["level"] = None
    return LOG.isEnabledFor(logging.INFO)


# ------------------------------------------------------------------------------ description
def _user_frames(traceback) -> list:
    """The frames outside jax and jax_blink, innermost first."""
    if traceback is None:
        return []
    return [f for f in source_info_util.user_frames(traceback)
            if not os.path.abspath(f.file_name).startswith(_PACKAGE_DIR)]


def innermost_source(traceback) -> str:
    """"file:line (function)" of the innermost frame outside jax and jax_blink, or "unknown"."""
    frames = _user_frames(traceback)[:1]
    return f"{frames[0].file_name}:{frames[0].start_line} ({frames[0].function_name})" if frames else "unknown"


def short_source(source: str) -> str:
    """Each "file:line (function)" of ``source`` (joined by " < ") with the file's last two path parts."""
    out = []
    for one in source.split(" < "):
        path, sep, rest = one.partition(":")
        out.append("/".join(path.replace("\\", "/").split("/")[-2:]) + sep + rest)
    return " < ".join(out)


# Buckets of combined equations (jax_blink.transform): a name-stack token -> every member's source
# line. The token is a hash of the sources, so the same program gets the same names on every trace.
_BUCKETS: dict = {}
_TOKEN = re.compile(r"jax_blink\.bucket\[([0-9a-f]{12})\]")


def bucket_scope(sources) -> str:
    """The name-stack scope to bind a bucket's call under (``jax.named_scope``; it shows in the HLO
    ``op_name`` and profiles as ``jax_blink.bucket[<hash>]``), recording that it runs collectives
    made at ``sources`` (a sequence of "file:line (function)") for its :class:`CallSite`."""
    sources = tuple(sources)
    token = hashlib.blake2b("\n".join(sources).encode(), digest_size=6).hexdigest()
    _BUCKETS[token] = sources
    return f"jax_blink.bucket[{token}]"


def bucket_sources(name_stack) -> tuple:
    """The member source lines :func:`bucket_scope` recorded for the innermost bucket scope of
    ``name_stack`` (a jax NameStack or text), or ()."""
    found = _TOKEN.findall(str(name_stack))
    return _BUCKETS.get(found[-1], ()) if found else ()


def source_of(traceback) -> str:
    """"file:line (function)" of the innermost frame outside jax and jax_blink, with its caller's
    ("... < file:line (function)") when there is one (a call through a helper shows both), or "unknown"."""
    frames = _user_frames(traceback)[:2]
    if not frames:
        return "unknown"
    return " < ".join(f"{f.file_name}:{f.start_line} ({f.function_name})" for f in frames)


def lowering_reason(impl: str, rec, platforms, processes: int) -> str:
    """Why ``rec`` lowers this call site: ``impl`` given, or ``auto``'s choice and the records of
    higher ``auto`` priority it skipped, with the reason (read from the registry, so a new lowering
    appears without changes here)."""
    where = f"{'/'.join(platforms)}, mesh in {processes} process{'es' if processes != 1 else ''}"
    if impl != "auto":
        return f"impl={impl!r} given ({where})"
    skipped = []
    for name in _lowering.names():
        recs = [_lowering.record(name, p) for p in platforms]
        r = recs[0]
        if r is None or r is rec or r.auto_priority is None or r.auto_priority > (rec.auto_priority or 0):
            continue
        if r.unavailable:
            skipped.append(f"{name}: {r.unavailable}")
        elif processes > 1 and not r.multi_process:
            skipped.append(f"{name}: mesh spans {processes} processes")
        elif r.auto_allowed is not None and not all(r.auto_allowed(p) for p in platforms):
            skipped.append(f"{name}: not allowed by auto here (e.g. the CUDA self-test has not passed)")
    first = f"auto: {rec.name} ({rec.description or 'no description'}), the first by priority that runs here"
    return f"{first} ({where}{''.join('; skipped ' + s for s in skipped)})"


def _why(info: dict, rec) -> str:
    """The report's reason for ``rec``: the dispatcher's (``auto`` handing the site to XLA's collective),
    else the registry's order, with the dispatcher's comparison appended when it kept ``rec``."""
    note = info.get("why")
    if note and rec.auto_priority is None:
        return note
    base = lowering_reason(info["impl"], rec, info["platforms"], info["processes"])
    return f"{base}; {note}" if note else base


def _sim(plan, nbytes, topology):
    # the simulator as `jax-blink bench` runs it (simulate's own method="auto"), so the row equals bench's
    from .simulate import DEFAULT_LATENCY_US, simulate
    return simulate(plan, nbytes, topology=topology, latency_us=DEFAULT_LATENCY_US).time_s


def _baseline(make, nbytes, topology):
    from .errors import PlanError
    try:
        p = make()
    except PlanError:
        return None
    return _sim(p, nbytes, topology)


def describe(info: dict, requests: list, index: int) -> CallSite:
    """The :class:`CallSite` of one bucket from the requests its rule ran (``info``: what
    :func:`run_rule` knows: collective, axes, dtype, leaves, nelems, itemsize, lowering record,
    impl, platforms, processes, traceback)."""
    from . import nccl_model
    from .costmodel import choose_plan
    from .planner.dbtree import nccl_tree_plan
    from .planner.rings import nccl_ring_plan
    from .simulate import DEFAULT_LATENCY_US

    coll = info["collective"]
    main = max(requests, key=lambda r: r.schedules[0].nelems)  # the bucket's (or largest leaf's) request
    plan = main.plans[0] if main.plans else None
    sched = main.schedules[0]
    topo = main.topology
    nbytes = int(info["nelems"]) * int(info["itemsize"])
    sim = bound = ring = tree = speed = auto_shape = auto_s = nccl_s = nccl_choice = None
    if plan is not None and topo is not None and len(plan.devices) > 1 and nbytes > 0:
        sim = _sim(plan, nbytes, topo)
        bound = float(main.bounds_gbps[0]) if main.bounds_gbps else None
        devs = list(plan.devices)
        ring = _baseline(lambda: nccl_ring_plan(topo, coll, devices=devs, root=plan.root), nbytes, topo)
        if coll == "allreduce":
            tree = _baseline(lambda: nccl_tree_plan(topo, devices=devs), nbytes, topo)
        nccl = [t for t in (ring, tree) if t is not None]
        try:
            ch = nccl_model.predict(topo, coll, nbytes, devices=devs)
        except ValueError:  # uneven nodes: no NCCL tuner figure
            ch = None
        if ch is not None:
            nccl_s, nccl_choice = ch.steady_us * 1e-6, f"{ch.algorithm}/{ch.protocol}"
            nccl = [nccl_s]
        speed = min(nccl) / sim if nccl and sim > 0 else None
        auto = choose_plan(topo, coll, nbytes, devices=devs, root=plan.root, latency_us=DEFAULT_LATENCY_US)
        auto_shape, auto_s = auto.shape(), _sim(auto, nbytes, topo)
    bound_s = nbytes / (bound * 1e9) if bound and math.isfinite(bound) and bound > 0 else None
    rec = info["record"]
    return CallSite(
        index=index, api=f"jax_blink.{API_NAMES.get(coll, coll)}", collective=coll, axes=tuple(info["axes"]),
        group_size=len(main.groups[0]), groups=len(main.groups), dtype=str(info["dtype"]),
        leaves=int(info["leaves"]), nbytes=nbytes, lowering=rec.name, platform="/".join(info["platforms"]),
        processes=int(info["processes"]),
        why=_why(info, rec),
        algorithm=plan.algorithm if plan is not None else "trivial",
        shape=plan.shape() if plan is not None else "-",
        trees=sum(1 for t in plan.trees if t.weight_gbps > 0) if plan is not None else 0,
        chunks=len(sched.chunk_seg), rounds=int(sched.num_rounds), schedules=len(requests),
        predicted_s=float(sum(max(r.predicted_s) if r.predicted_s else 0.0 for r in requests)),
        sim_s=sim, bound_gbps=bound, bound_s=bound_s, ring_s=ring, tree_s=tree, speedup=speed,
        auto_shape=auto_shape, auto_s=auto_s, source=info["source"], label=info["label"],
        sources=tuple(info.get("sources") or (info["source"],)), plan=plan,
        plan_why=_plan_why(rec, plan, auto_shape),
        gpu_topology=topo is not None and any(k != "host" for _, _, k in topo.graph.edges(data="kind")),
        nccl_s=nccl_s, nccl_choice=nccl_choice)


def _plan_why(rec, plan, auto_shape) -> str:
    """Why the lowering's plan differs from ``plan(nbytes=)``'s choice ``auto_shape`` ("" when it does not)."""
    if plan is None or auto_shape is None or plan.shape() == auto_shape:
        return ""
    if rec.candidates is _lowering.host_memory_candidates:  # the policy: lowering.host_memory_candidates
        return (f"the {rec.name} executor works in host memory, where a tree hop is a pass over the chunk, not a "
                f"link: it runs the rate-optimal packing ({plan.shape()}) at every size, which reads every input "
                f"once and writes every output once, where plan(nbytes=) would pick {auto_shape} for links "
                "(a ring writes every rank twice: 1.6-1.7x slower in host memory)")
    return (f"the lowering's cost model (its step latency and synchronisation) chose {plan.shape()}; "
            f"plan(nbytes=) (link simulator) would pick {auto_shape}")


def human_bytes(n: float) -> str:
    """1024 -> '1KiB', 1.5 MiB -> '1.5MiB'."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.3g}{unit}"
    return f"{int(n)}B"


def label(collective: str, dtype, nbytes: int, request, lowering_name: str) -> str:
    """The name a call site's ops carry: e.g. ``jax_blink.psum[allreduce f32 1.2MiB trees x8 8ch ffi]``
    (no '/', which would split the name stack)."""
    plan = request.plans[0] if request.plans else None
    what = "trivial" if plan is None else f"{plan.algorithm} x{sum(1 for t in plan.trees if t.weight_gbps > 0)}"
    dt = np.dtype(dtype).name
    return (f"jax_blink.{API_NAMES.get(collective, collective)}[{collective} {dt} {human_bytes(nbytes)} {what} "
            f"{len(request.schedules[0].chunk_seg)}ch {lowering_name}]")


# ------------------------------------------------------------------------------ the hook
def run_rule(rec, ctx, xs, request_for, *, collective: str, axes, impl: str, mesh, nelems: int,
             why: str | None = None):
    """Run lowering record ``rec``'s rule on a bucket, named, described and watched (module docstring).

    Args: ``rec`` the chosen ``Lowering``; ``ctx``, ``xs``, ``request_for`` what the rule takes;
    ``collective``, ``axes``, ``impl`` the primitive's; ``mesh`` the call site's device mesh;
    ``nelems`` the elements per device of one schedule over the bucket (sharded: the full buffer);
    ``why``: the dispatcher's reason for ``rec`` beyond the registry's order (``auto`` weighing XLA's
    collective against jax_blink's plan), shown in the report. Returns the rule's results.
    """
    dtype = ctx.avals_in[0].dtype
    itemsize = np.dtype(dtype).itemsize
    first = request_for(nelems)  # the bucket's request (the ffi rules ask for the same, cached)
    name = label(collective, dtype, nelems * itemsize, first, rec.name)
    seen = []

    def recording(n, *args, **kwargs):  # a rule may ask for its phases' requests (lowering.hierarchical)
        r = request_for(n, *args, **kwargs)
        if not args and not kwargs:
            seen.append(r)
        return r

    processes = len({d.process_index for d in mesh.devices.flat})
    source = source_of(ctx.traceback)
    frame = _user_location(ctx.traceback)
    loc = ir.Location.name(f"{ctx.name_stack}/{name}" if ctx.name_stack.stack else name, childLoc=frame)
    sub = ctx.replace(name_stack=ctx.name_stack.extend(name))
    from . import faults, peerwatch
    if processes > 1:
        if "cpu" in ctx.module_context.platforms:
            faults.check_cpu_collectives()
        faults.install()  # also where the job was joined by jax.distributed.initialize() itself
    with loc, _lowering.naming_site(f"{name} at {source}" if source else name):
        if processes > 1 and peerwatch.enabled() and rec.watches_phases:
            with _lowering.guarding_phases(peerwatch.phase_guard(mesh=mesh, groups=first.groups,
                                                                site=f"{name} at {source}")):
                outs = rec.rule(sub, xs, recording)
        elif processes > 1 and peerwatch.enabled():
            outs = peerwatch.watched(rec.rule, sub, xs, recording, mesh=mesh, groups=first.groups,
                                     site=f"{name} at {source}")
        else:
            outs = rec.rule(sub, xs, recording)
    listeners = getattr(_local, "sites", None)
    logging_on = _logging_enabled()
    if listeners is not None or logging_on:
        info = dict(collective=collective, axes=axes, dtype=np.dtype(dtype).name, leaves=len(xs), nelems=nelems,
                    itemsize=itemsize, record=rec, impl=impl, platforms=tuple(ctx.module_context.platforms),
                    processes=processes, source=source, label=name, why=why,
                    sources=bucket_sources(ctx.name_stack))
        site = describe(info, seen or [first], len(listeners) if listeners is not None else 0)
        if listeners is not None:
            listeners.append(site)
        LOG.info("%s", site.log_line())
        if LOG.isEnabledFor(logging.DEBUG) and site.plan is not None:
            LOG.debug("%s trees:\n%s", site.label, site.plan.describe())
    return outs


def _user_location(traceback):
    """The MLIR file location of the user's call (innermost frame outside jax and jax_blink)."""
    frames = _user_frames(traceback)
    if frames:
        return ir.Location.file(frames[0].file_name, frames[0].start_line, frames[0].start_column)
    return ir.Location.unknown()
