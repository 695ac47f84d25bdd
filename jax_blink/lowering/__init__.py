"""Lowerings of the jax_blink primitives: a registry of :class:`Lowering` records.

A lowering is one record: its name (the ``impl`` users pass), the platform it lowers for, the rule
that emits the MLIR, and what the cost model and ``impl="auto"`` need to know about it (seconds per
schedule step, whether it pays a barrier per round, whether it runs across processes, its rank for
``auto``). ``lowering.ppermute`` registers ``"ppermute"`` for every platform; ``lowering.ffi``
registers ``"ffi"`` for ``"cpu"`` and ``"cuda"``, unavailable (with the reason) where its native
target does not exist here. ``jax_blink.dispatch`` imports them, then reads the registry:
:func:`find_lowering` in ``choose_lowering``, the record's costs and ``candidates`` in ``build_request``.

A rule is ``rule(ctx, xs, request_for) -> list[ir.Value]``: ``ctx`` is the ``mlir.LoweringRuleContext``
(its ``avals_in`` / ``avals_out`` describe ``xs``), ``xs`` a bucket of non-empty operands of one dtype
(any shapes), one result per operand, and ``request_for(nelems)`` gives the :class:`LoweringRequest`
for a schedule over ``nelems`` elements: the bucket's total (one call over the leaves as a virtual
concatenation, as the CPU ffi rule does) or one leaf's (the ppermute rule, one schedule per leaf).
This module imports no jax (the records are plain data; the rules live in the modules that register
them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from .. import collectives
from ..planner.model import Plan, Tree


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One lowering of the jax_blink primitives on one platform (a registry record).

    Attributes:
      name: the ``impl`` name users pass ("ppermute", "ffi", ...).
      platform: the XLA platform it lowers for ("cpu", "cuda", ...), or None for every platform.
      rule: ``rule(ctx, xs, request_for) -> list[ir.Value]`` (module docstring).
      step_latency_s: seconds of one schedule step (one round, or one chunk hop of a pipeline): the
        cost model's fixed cost per step (``costmodel.lowering_schedule``), > 0.
      round_synchronous: True when every schedule round ends in a barrier for all devices (the
        cost model then ranks candidates by rounds, not by the link simulator).
      multi_process: True when it runs on a mesh that spans processes (``jax.distributed``).
      auto_priority: rank for ``impl="auto"`` (lowest first among those that can run), or None:
        never chosen by ``auto``.
      auto_allowed: ``auto_allowed(platform) -> bool``, asked last before ``auto`` takes it (e.g.
        the CUDA executor's self-test gate); None: always allowed.
      candidates: ``candidates(collective, plans) -> plans``: the executor's policy over the candidate
        plans of a group (``dispatch.candidate_plans``, preferred first) before the cost model chooses
        among them and their chunk counts; None keeps them all. For an executor whose costs the link
        simulator does not model: :func:`host_memory_candidates` for one that works in host memory.
      shard_input: True when an all-gather may pass its shard as the only operand (the rule's
        executor places it), instead of a zero full buffer with the shard in place.
      shard_output: True when a reduce-scatter rule returns only the rank's shard (the executor
        sums it straight into that result), instead of a full buffer sliced after the call.
      auto_fits: ``auto_fits(site) -> str | None``: asked (with the call site's :class:`Site`, None
        inside one process) before ``auto`` takes it; a string says why it does not fit (e.g. the
        hierarchical lowering needs two or more of a group's devices in every process). None: fits.
      chunks_as_simulated: True when a chunk costs the executor its step latency and nothing else
        (the CUDA interpreter: one kernel per call, a flag hop per chunk step): the schedule takes the
        chunk counts the link simulator gives the plan (``costmodel.lowering_schedule``), not the
        round model's, which bounds chunks for executors that pay per round or per call.
      peer_routes: True when the executor moves data by peer-to-peer loads (the CUDA interpreter's pull
        model): a tree edge between two GPUs crosses the path the hardware gives that pair (the
        direct NVLink where there is one), whatever route the tree was planned on, so the cost model
        chooses the plan by simulating it on those paths (``costmodel.lowering_schedule``).
      watches_phases: True when the rule runs its waits on other processes through
        :func:`network_phase` (the hierarchical lowering), so a watch (``jax_blink.peerwatch``)
        checks each such phase by name instead of the whole rule.
      description: a few words for users ("rounds of collective_permute").
      unavailable: None when usable here; else why not (native module missing, driver too old):
        :func:`find_lowering` skips such records, error messages quote the reason.
    """

    name: str
    platform: str | None
    rule: Callable
    step_latency_s: float
    round_synchronous: bool
    multi_process: bool = False
    auto_priority: int | None = None
    auto_allowed: Callable[[str], bool] | None = None
    candidates: Callable[[str, list], list] | None = None
    shard_input: bool = False
    shard_output: bool = False
    auto_fits: Callable | None = None
    chunks_as_simulated: bool = False
    peer_routes: bool = False
    watches_phases: bool = False
    description: str = ""
    unavailable: str | None = None

    def __post_init__(self):
        if not self.step_latency_s > 0:
            raise ValueError(f"lowering {self.name!r}: step_latency_s must be > 0 s, got {self.step_latency_s!r}")


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a collective runs, as ``impl="auto"`` sees it across processes.

    Attributes:
      processes: how many processes the mesh spans (> 1).
      groups: for each group, the mesh-linear positions of its members in rank order.
      process_of: the process index of every mesh position (``mesh.devices.flat`` order).
      estimate: ``estimate(name) -> seconds``: the cost model's prediction for lowering ``name`` at
        this site (its operand size and topology), or None when unknown.
      root: the root rank (broadcast / reduce), else None.
    """

    processes: int
    groups: tuple
    process_of: tuple
    estimate: Callable | None = None
    root: int | None = None


def host_memory_candidates(collective: str, plans: list) -> list:
    """The ``candidates`` policy of an executor that works in host memory (the CPU "ffi"): the first
    candidate (the rate-optimal packing) alone, as one star per owner for a sharded collective
    (:func:`shared_memory_stars`); the cost model then chooses only its chunks.

    Why: such an executor walks each tile through the whole schedule while it is in cache, so its
    cost is memory passes, which the link simulator does not model. The packing reads every input
    once and writes every output once; a ring writes every rank twice (1.6-1.7x slower at 1-16 MiB
    per device on 8 host devices)."""
    if collectives.get(collective).sharded:
        return [shared_memory_stars(plans[0])]
    return plans[:1]


def shared_memory_stars(plan):
    """For the CPU executor: the sharded ``plan`` as one star per owner (owner -> every other rank
    directly), each with the owner's total weight.

    In host memory a tree hop is a pass over the chunk, not a link: a star makes every shard one
    fused copy (all-gather: owner -> n - 1 outputs) or one fused sum (reduce-scatter: n - 1 inputs
    added into the owner's output), the fewest memory passes, where a deeper packed tree would
    materialise a partial result at every interior rank. Data flow and results are those of any
    valid per-owner packing; only the shape of the trees differs."""
    weight = {}
    for t in plan.trees:
        weight[t.root] = weight.get(t.root, 0.0) + t.weight_gbps
    trees = tuple(Tree(d, weight.get(d, 0.0), tuple((d, c) for c in plan.devices if c != d))
                  for d in plan.devices)
    return Plan(plan.collective, None, tuple(plan.devices), trees, plan.rate_gbps, plan.bound_gbps, plan.algorithm,
                plan.notes + ("executed as one star per owner by the CPU executor (host memory)",))


# name -> platform (None: every platform) -> record
LOWERINGS: dict[str, dict[str | None, Lowering]] = {}


@dataclasses.dataclass(frozen=True)
class LoweringRequest:
    """What a lowering needs to run one collective.

    Attributes:
      collective: a name of ``jax_blink.collectives`` ("allreduce", "broadcast", "reduce",
        "allgather", "reducescatter"); sharded ones run on full buffers (``nelems`` = the full size).
      schedules: one ``jax_blink.schedule.Schedule`` per group, in group order.
      device_table: int64 array [ndevices, 3], rows (device_id, group, rank): which group and rank
        each participating JAX device (``device.id``) has. Built from the mesh, not from device ids.
      groups: for each group, the mesh-linear positions of its members in rank order (what a
        collective_permute over all mesh axes of the call needs).
      axis_names: the mesh axes the collective runs over (as given by the user, a tuple).
      timeout_ms: how long a native executor waits for peers before failing.
      plans: the ``Plan`` each group's schedule was built from (group order), for reports
        (``jax_blink.explain``, ``JAX_BLINK_LOG``); () when not recorded.
      predicted_s: the cost model's predicted seconds of each group's schedule on this lowering
        (``costmodel.lowering_schedule``); () when not recorded.
      bounds_gbps: each group's certified rate (the rate-optimal plan's ``bound_gbps``, as
        ``jax_blink.plan`` without ``nbytes`` gives it); () when not recorded.
      topology: the ``Topology`` the plans were made on (None when not recorded).
      root: the root rank (broadcast / reduce), else None.
    """

    collective: str
    schedules: tuple
    device_table: np.ndarray
    groups: tuple
    axis_names: tuple
    timeout_ms: int = 60_000
    plans: tuple = ()
    predicted_s: tuple = ()
    bounds_gbps: tuple = ()
    topology: object = None
    root: int | None = None


# The guard of the call site being lowered (set by jax_blink.callsites for a rule whose record
# watches its phases): guard(ctx, xs, avals_in, avals_out, phase, fn) -> fn(xs) bracketed by the check.
_guard = threading.local()


@contextlib.contextmanager
def guarding_phases(guard: Callable | None):
    """Inside the block, :func:`network_phase` runs its phases through ``guard`` (None: directly)."""
    before = getattr(_guard, "fn", None)
    _guard.fn = guard
    try:
        yield
    finally:
        _guard.fn = before


_site = threading.local()


@contextlib.contextmanager
def naming_site(text: str):
    """Inside the block, :func:`site_text` is ``text`` (the call site's label and source line, which
    the native executors put in their timeout messages)."""
    before = getattr(_site, "text", "")
    _site.text = text
    try:
        yield
    finally:
        _site.text = before


def site_text() -> str:
    """The call site being lowered, as :func:`naming_site` set it ("" outside one)."""
    return getattr(_site, "text", "")


def network_phase(ctx, xs: list, avals_in: list, avals_out: list, phase: str, fn: Callable) -> list:
    """``fn(xs) -> list`` of ir.Values: a phase that waits on other processes (an XLA collective
    between them), named ``phase`` for the watch of the call site (:func:`guarding_phases`).
    ``avals_in`` / ``avals_out``: the ShapedArrays of ``xs`` and of the results."""
    guard = getattr(_guard, "fn", None)
    if guard is None:
        return fn(xs)
    return guard(ctx, xs, avals_in, avals_out, phase, fn)


def register(lowering: Lowering) -> None:
    """Add ``lowering`` to the registry (replacing the record of the same name and platform)."""
    LOWERINGS.setdefault(lowering.name, {})[lowering.platform] = lowering


def record(name: str, platform: str) -> Lowering | None:
    """The record of ``name`` for ``platform`` (else its every-platform record), available or not;
    None when neither is registered."""
    table = LOWERINGS.get(name, {})
    return table.get(platform, table.get(None))


# Platforms lowered for without running (``lowering_only``) -> how many contexts hold them.
_LOWERING_ONLY: dict[str, int] = {}


@contextlib.contextmanager
def lowering_only(platform: str):
    """Within the block, records of ``platform`` count as usable even where ``unavailable`` says their
    native target cannot run here (module not built, no driver): for lowering a program for that
    platform on a machine without it (``jax_blink.lowered_text``). The rules emit the same custom
    calls (they need no driver); compiling or running such a program here still fails. Nests; not
    meant for threads lowering other programs at the same time."""
    _LOWERING_ONLY[platform] = _LOWERING_ONLY.get(platform, 0) + 1
    try:
        yield
    finally:
        _LOWERING_ONLY[platform] -= 1
        if not _LOWERING_ONLY[platform]:
            del _LOWERING_ONLY[platform]


def usable(rec: Lowering | None, platform: str) -> bool:
    """True when ``rec`` may lower for ``platform`` here (available, or inside :func:`lowering_only`)."""
    return rec is not None and (rec.unavailable is None or platform in _LOWERING_ONLY)


def find_lowering(name: str, platform: str) -> Lowering | None:
    """The usable record of ``name`` on ``platform`` (platform-specific first, then every-platform),
    or None when none is registered or usable here (:func:`usable`)."""
    table = LOWERINGS.get(name, {})
    for rec in (table.get(platform), table.get(None)):
        if usable(rec, platform):
            return rec
    return None


def names() -> list[str]:
    """Every registered lowering name (usable here or not), sorted."""
    return sorted(LOWERINGS)


def usable_names() -> list[str]:
    """Names with a record usable on some platform here, sorted."""
    return sorted(n for n, table in LOWERINGS.items() if any(r.unavailable is None for r in table.values()))
