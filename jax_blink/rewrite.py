"""``jax_blink.transform(fn)``: run a program's own ``lax`` collectives through jax_blink.

Library code calls ``lax`` itself (Flax's ``BatchNorm(axis_name=...)`` averages its batch statistics
with ``lax.pmean``), so renaming calls cannot reach it. ``transform`` works on the traced program
instead: each call traces ``fn`` to a jaxpr in the caller's context (the pmap / shard_map body being
traced, its axis names, mesh and ``check_vma``), then evaluates that jaxpr equation by equation,
binding every primitive as it is except the collectives it was asked to take over, which it calls
as ``jax_blink.psum`` / ``all_gather`` / ``psum_scatter`` with the equation's parameters. Sub-jaxprs
(``scan``, ``cond``, ``while``, ``jit``, ``checkpoint`` / ``remat``, ``custom_jvp`` / ``custom_vjp``
bodies and their rules, ``shard_map``) that contain such a collective are rewritten the same way
and the primitive rebound with them. This is the "custom interpreter" of the JAX docs ("Writing
custom Jaxpr interpreters in JAX"); since it rewrites whatever jaxpr JAX hands back, a jaxpr that
JAX cached from an earlier trace (an inner ``jax.jit``, a traced function traced before) is
rewritten too: no stale ``lax`` trace can survive, as it does when ``jax.lax`` is monkeypatched.

The rewritten program is built from jax_blink's primitives, which have JVP, transpose and batching
rules, so ``jax.jit``, ``jax.grad``, ``jax.vmap`` compose with it inside and outside.

What stays on ``lax`` (reported, see below): a collective over an axis that is not a mesh / pmap
axis (a ``vmap`` axis name: no devices to plan for), a dtype jax_blink does not support (e.g.
float8), a collective kind not in ``collectives=``, ``lax.all_gather_invariant`` (no jax_blink
form), a collective inside a higher-order primitive this module does not know how to rebind, and
inside a ``custom_vjp`` backward rule with ``symbolic_zeros=True``. ``pmax`` / ``pmin`` /
``ppermute`` / ``all_to_all`` are not jax_blink collectives and are left alone.

Combining: within each jaxpr evaluated (the function's and every rewritten sub-jaxpr's), psums that
do not depend on each other run as one jax_blink call (:mod:`jax_blink.combining`), lax's taken-over
ones and ``jax_blink.psum`` / ``pmean`` / ``broadcast`` / ``reduce`` calls of the program alike, as
XLA's combiner merges all-reduces; the threshold is ``transform``'s ``combine_threshold_bytes`` or
``JAX_BLINK_COMBINE_THRESHOLD_BYTES``. Not inside a ``custom_jvp`` rule (a primal's and a tangent's
psum in one call would tie the primal to the tangent).

Reports: every trace records one :class:`Rewrite` per collective equation met (with its source line
and the call it ran in) in ``transformed.rewrites``, one :class:`Combined` per call running several
in ``transformed.combined``, and :func:`transform_report` prints them grouped by collective and
source line; a collective jax_blink could not take is logged at WARNING on the ``"jax_blink"``
logger, one it leaves alone by design (``pmax``, a kind not asked for) and the summary at INFO.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import numpy as np

from . import api, callsites, combining, envvars, mapping
from ._jax_compat import (
    JAXPR_TYPES,
    ClosedJaxpr,
    abstract_mesh,
    ad,
    all_gather_p,
    convert_weak_type,
    core,
    lu,
    pe,
    psum_invariant_p,
    psum_p,
    reduce_scatter_p,
    source_info_util,
    trace_to_closed_jaxpr,
)
from .errors import TopologyError

log = logging.getLogger("jax_blink")

#: ``collectives=`` names -> the lax primitive names they select. ``lax.pmean`` traces to a psum
#: followed by a division, so "pmean" and "psum" select the same equations.
KINDS = {"psum": ("psum", "psum_invariant"), "pmean": ("psum", "psum_invariant"),
         "all_gather": ("all_gather",), "psum_scatter": ("reduce_scatter",),
         "reduce_scatter": ("reduce_scatter",)}
_COLLECTIVE_PRIMS = {psum_p, psum_invariant_p, all_gather_p, reduce_scatter_p}
_LAX_ONLY = {"all_gather_invariant"}  # lax collectives jax_blink has no form of (reported)
#: lax collectives outside jax_blink's scope: left alone, and reported as such.
_NOT_JAX_BLINK = {"pmax": "a max-reduction", "pmin": "a min-reduction", "ppermute": "a permutation",
                  "all_to_all": "an all-to-all", "ragged_all_to_all": "an all-to-all", "pgather": "a gather"}
#: jax_blink's psum primitives (by name): their equations combine with each other and with lax psums.
_BLINK_PSUMS = {"blink_psum": "plain", "blink_psum_invariant": "invariant", "blink_unreduced_psum": "invariant"}
_BLINK_ROOTED = {"blink_broadcast", "blink_reduce"}
ENV_THRESHOLD = "JAX_BLINK_COMBINE_THRESHOLD_BYTES"
# Higher-order primitives whose sub-jaxprs are rewritten by replacing the jaxpr params and binding again.
_REBIND = {"pjit", "jit", "scan", "cond", "while", "checkpoint", "remat", "remat2", "closed_call",
           "core_call", "custom_lin"}


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One lax collective equation met while tracing.

    ``primitive``: the lax primitive ("psum", "psum_invariant", "all_gather", "reduce_scatter", "pmax",
    ...); ``axes``: its axis names; ``where``: the path of sub-jaxprs to it ("fn", "fn/scan",
    "fn/cond[1]", "fn/custom_vjp_call/bwd", ...); ``operands``: shapes and dtypes as text; ``by``:
    "jax_blink" or "lax"; ``reason``: why it stayed on lax ("" when rewritten); ``source``: "file:line
    (function)" of the innermost frame outside jax and jax_blink that made it (a library's line, e.g.
    Flax's BatchNorm, when the user's code called the library), "unknown" when JAX kept none;
    ``call``: the number of the jax_blink call it runs in, within this trace (equations combined into
    one bucket share it; None on lax)."""

    primitive: str
    axes: tuple
    where: str
    operands: str
    by: str
    reason: str = ""
    source: str = "unknown"
    call: int | None = None

    def __str__(self) -> str:
        s = f"{self.where}: lax.{self.primitive} over {self.axes} of {self.operands} at {self.source} -> {self.by}"
        return s + (f" ({self.reason})" if self.reason else "")


@dataclasses.dataclass(frozen=True)
class Combined:
    """One jax_blink call of a trace that runs several collective equations (a bucket, module
    :mod:`jax_blink.combining`): ``where`` as :attr:`Rewrite.where`; ``kind`` "psum", "broadcast" or
    "reduce"; ``axes``; ``equations``: how many equations it runs (lax ones rewritten and jax_blink
    ones); ``leaves``: operands; ``nbytes``: operand bytes per device; ``sources``: each member's
    source line ("file:line (function)"), in program order."""

    where: str
    kind: str
    axes: tuple
    equations: int
    leaves: int
    nbytes: int
    sources: tuple


class _Rewriter:
    """The state of one trace: which kinds to take over, jax_blink's keyword arguments, the combine
    threshold, the report."""

    def __init__(self, prims: frozenset, kwargs: dict, name: str, threshold: int = 0):
        self.prims, self.kwargs, self.name, self.threshold = prims, kwargs, name, threshold
        self.rewrites: list[Rewrite] = []
        self.combined: list[Combined] = []
        self.calls = 0
        self.plan_key = mapping.make_plan_key(kwargs["topology"], kwargs["device_map"], kwargs["chunk_elems"],
                                              kwargs["algorithm"], kwargs["max_trees"])

    # ---------------------------------------------------------------- finding collectives
    def wanted(self, jaxpr, blink: bool = True) -> bool:
        """Whether ``jaxpr`` (open or closed) holds a collective to take over (or, combining and with
        ``blink``, one of jax_blink's own to combine), at any depth (custom derivative rules are opaque
        functions and always wrapped, so they do not count here; their jaxprs are rewritten for lax
        collectives only, ``blink=False``: re-tracing a rule's jaxpr for combining alone would only
        risk its linearization)."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in self.prims or name in _LAX_ONLY or (blink and self.threshold and name in _BLINK_PSUMS):
                return True
            if any(self.wanted(j, blink) for j in _sub_jaxprs(eqn.params)):
                return True
        return False

    def note(self, eqn_name, axes, vals, where, reason="", source="unknown", call=None) -> None:
        ops = ", ".join((v if isinstance(v, core.AbstractValue) else core.typeof(v)).str_short() for v in vals)
        self.rewrites.append(Rewrite(eqn_name, tuple(axes), where, ops, "lax" if reason else "jax_blink", reason,
                                     source, call))

    def next_call(self) -> int:
        self.calls += 1
        return self.calls - 1

    def combine_key(self, eqn):
        """The bucket key of ``eqn`` (equal keys may run as one call), or None when it does not combine:
        (kind, psum flavour, axes, groups, impl, plan key, operand (dtype, varying axes) classes)."""
        prim, p = eqn.primitive, eqn.params
        avals = [v.aval for v in eqn.invars]
        if prim in (psum_p, psum_invariant_p):
            axes = _axes_of(p)
            if prim.name not in self.prims or _unsupported(axes, avals):
                return None
            kind = ("psum", "plain" if prim is psum_p else "invariant")
            impl, key = self.kwargs["impl"], self.plan_key
        elif prim.name in _BLINK_PSUMS:
            axes, impl, key = tuple(p["axes"]), p["impl"], p["key"]
            kind = ("psum", _BLINK_PSUMS[prim.name])
        elif prim.name in _BLINK_ROOTED:
            return (prim.name, tuple(p["axes"]), p["root"], p["impl"], p["key"], p["vma"], _classes(avals, ()))
        else:
            return None
        return (*kind, tuple(axes), p.get("axis_index_groups"), impl, key, _classes(avals, axes))

    # ---------------------------------------------------------------- evaluation
    def eval(self, jaxpr, consts, args, where):
        """Evaluate ``jaxpr`` on ``args`` (core.eval_jaxpr's loop) with the collectives taken over and
        independent ones combined (:func:`jax_blink.combining.plan`)."""
        env = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]):
            env[v] = x
        steps, _ = combining.plan(jaxpr, self.combine_key, self.threshold)
        for step in steps:
            if isinstance(step, combining.Bucket):
                members = [jaxpr.eqns[i] for i in step.eqns]
                first = members[0]
                name_stack = source_info_util.current_name_stack() + first.source_info.name_stack
                name_stack = name_stack.extend(callsites.bucket_scope(_source(e) for e in members))
                with source_info_util.user_context(first.source_info.traceback, name_stack=name_stack), \
                        first.ctx.manager:
                    results = self.bucket(members, step, [[read(v) for v in e.invars] for e in members], where)
                for eqn, outs in zip(members, results):
                    for v, x in zip(eqn.outvars, outs):
                        env[v] = x
                continue
            eqn = jaxpr.eqns[step]
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                outs = self.eqn(eqn, invals, where)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, invals, where):
        prim, params = eqn.primitive, eqn.params
        if prim in _COLLECTIVE_PRIMS:
            return self.collective(eqn, invals, where)
        if prim.name in _LAX_ONLY:
            self.note(prim.name, _axes_of(params), invals, where, "jax_blink has no invariant all-gather",
                      _source(eqn))
        elif prim.name in _NOT_JAX_BLINK:
            self.note(prim.name, _axes_of(params), invals, where,
                      f"{_NOT_JAX_BLINK[prim.name]}: not a jax_blink collective", _source(eqn))
        elif prim.name == "custom_jvp_call":
            return self.custom_jvp(eqn, invals, where)
        elif prim.name == "custom_vjp_call":
            return self.custom_vjp(eqn, invals, where)
        elif any(self.wanted(j) for j in _sub_jaxprs(params)):
            if prim.name == "shard_map":
                return self.shard_map(eqn, invals, where)
            if prim.name in _REBIND:
                return self.rebind(eqn, invals, where)
            self._leave_inside(eqn, where, f"inside {prim.name}, which jax_blink.transform cannot rebind")
        else:
            self._note_left_alone(eqn, where)
        return _bind(prim, params, invals)

    def _leave_inside(self, eqn, where, reason):
        for j in _sub_jaxprs(eqn.params):
            for e in _collective_eqns(getattr(j, "jaxpr", j), self.prims):
                self.note(e.primitive.name, _axes_of(e.params), [v.aval for v in e.invars],
                          f"{where}/{eqn.primitive.name}", reason, _source(e))

    def _note_left_alone(self, eqn, where):
        """Report the collectives jax_blink does not run inside the sub-jaxprs of ``eqn`` (not rewritten)."""
        for j in _sub_jaxprs(eqn.params):
            for e in _collective_eqns(getattr(j, "jaxpr", j), frozenset(_NOT_JAX_BLINK)):
                if e.primitive.name in _NOT_JAX_BLINK:
                    self.note(e.primitive.name, _axes_of(e.params), [v.aval for v in e.invars],
                              f"{where}/{eqn.primitive.name}",
                              f"{_NOT_JAX_BLINK[e.primitive.name]}: not a jax_blink collective", _source(e))

    # ---------------------------------------------------------------- the collectives
    def collective(self, eqn, invals, where):
        prim, params = eqn.primitive, eqn.params
        axes = _axes_of(params)
        if prim.name not in self.prims:
            wanted = sorted(k for k, v in KINDS.items() if prim.name in v)
            self.note(prim.name, axes, invals, where, f"not asked for (collectives= does not name "
                      f"{' or '.join(repr(w) for w in wanted)})", _source(eqn))
            return _bind(prim, params, invals)
        reason = _unsupported(axes, invals)
        if reason:
            self.note(prim.name, axes, invals, where, reason, _source(eqn))
            return _bind(prim, params, invals)
        self.note(prim.name, axes, invals, where, source=_source(eqn), call=self.next_call())
        kw, groups = self.kwargs, params.get("axis_index_groups")
        if prim in (psum_p, psum_invariant_p):
            outs = api.psum(list(invals), axes, axis_index_groups=groups, **kw)
        elif prim is all_gather_p:
            outs = [api.all_gather(invals[0], axes, axis=params["all_gather_dimension"], tiled=params["tiled"],
                                   axis_index_groups=groups, **kw)]
        else:
            outs = [api.psum_scatter(invals[0], axes, scatter_dimension=params["scatter_dimension"],
                                     tiled=params["tiled"], axis_index_groups=groups, **kw)]
        outs = [_match_weak_type(o, v.aval) for o, v in zip(outs, eqn.outvars)]
        return outs if prim.multiple_results else outs[0]  # psum_invariant binds one operand

    def bucket(self, eqns, bucket, invals, where):
        """Run the equations ``eqns`` of :class:`~jax_blink.combining.Bucket` ``bucket`` (``invals``: each
        one's operands) as one jax_blink call; returns each equation's results (lists)."""
        key = bucket.key
        call = self.next_call() if any(e.primitive in _COLLECTIVE_PRIMS for e in eqns) else None
        sources = tuple(_source(e) for e in eqns)
        for e, vals, src in zip(eqns, invals, sources):
            if e.primitive in _COLLECTIVE_PRIMS:
                self.note(e.primitive.name, _axes_of(e.params), vals, where, source=src, call=call)
        flat = [x for vals in invals for x in vals]
        if key[0] == "psum":
            _, _, axes, groups, impl, plan_key, _ = key
            api._check_topology(plan_key, axes, "jax_blink.psum")
            outs = api.psum_leaves(flat, axes, groups, impl, plan_key)
            kind = "psum"
        else:
            first = eqns[0]
            outs = _bind(first.primitive, first.params, flat)
            axes, kind = key[1], key[0].removeprefix("blink_")
        self.combined.append(Combined(where, kind, tuple(axes), len(eqns), len(flat), bucket.nbytes, sources))
        results, k = [], 0
        for e in eqns:
            m = len(e.outvars)
            results.append([_match_weak_type(o, v.aval) for o, v in zip(outs[k:k + m], e.outvars)])
            k += m
        return results

    # ---------------------------------------------------------------- sub-jaxprs
    def closed(self, cj, where) -> ClosedJaxpr:
        """``cj`` (ClosedJaxpr) rewritten: traced again through :meth:`eval` with the same input types."""
        return trace_to_closed_jaxpr(lambda *a: self.eval(cj.jaxpr, cj.consts, a, where),
                                     [v.aval for v in cj.jaxpr.invars])

    def open(self, jaxpr, consts, where):
        """An open ``jaxpr`` (``consts`` for its leading constant inputs) rewritten: (jaxpr, consts)."""
        ins = [*jaxpr.constvars, *jaxpr.invars][len(consts):]  # jax 0.12: unattached constvars are invars
        cj = trace_to_closed_jaxpr(lambda *a: self.eval(jaxpr, consts, a, where), [v.aval for v in ins])
        return cj.jaxpr, list(cj.consts)

    def rebind(self, eqn, invals, where):
        name = eqn.primitive.name
        new, extra = {}, []
        remat = name in ("checkpoint", "remat", "remat2")
        for k, v in eqn.params.items():
            if isinstance(v, ClosedJaxpr) and not remat:
                new[k] = self.closed(v, f"{where}/{name}") if self.wanted(v) else v
            elif isinstance(v, core.Jaxpr):
                if not self.wanted(v):
                    new[k] = v
                    continue
                j, consts = self.open(v, getattr(v, "consts", ()), f"{where}/{name}")
                if consts:  # checkpoint's body is an open jaxpr: its new constants become leading inputs
                    if not remat:
                        self._leave_inside(eqn, where, f"rewriting {name}'s body made constants it cannot take")
                        return _bind(eqn.primitive, eqn.params, invals)
                    j, extra = pe.convert_constvars_jaxpr(j), consts
                new[k] = j
            elif isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
                new[k] = tuple(self.closed(b, f"{where}/{name}[{i}]") if self.wanted(b) else b
                               for i, b in enumerate(v))
            else:
                new[k] = v
        return _bind(eqn.primitive, new, [*extra, *invals])

    def call_jaxpr(self, p, invals, here):
        """A custom_jvp / custom_vjp equation's ``call_jaxpr`` rewritten in ``p`` (ClosedJaxpr on jax
        0.10, an open Jaxpr on 0.12: new constants become leading inputs, counted in num_consts, which
        the rules skip); returns the inputs to bind."""
        cj = p["call_jaxpr"]
        if not self.wanted(cj, blink=False):
            return invals
        if isinstance(cj, ClosedJaxpr):
            p["call_jaxpr"] = self.closed(cj, here)
            return invals
        j, consts = self.open(cj, (), here)
        p["call_jaxpr"] = pe.convert_constvars_jaxpr(j) if consts else j
        p["num_consts"] = p["num_consts"] + len(consts)
        return [*consts, *invals]

    def custom_jvp(self, eqn, invals, where):
        p = dict(eqn.params)
        here = f"{where}/custom_jvp_call"
        invals = self.call_jaxpr(p, invals, here)
        jvp = p["jvp_jaxpr_fun"]

        def jvp_jaxpr_fun(*zeros):  # the JVP rule's jaxpr, built when differentiated: rewrite it then
            jaxpr, consts, out_zeros = jvp.call_wrapped(*zeros)
            if self.wanted(jaxpr, blink=False):
                # not combined: a bucket of a primal's and a tangent's psum would make the primal
                # output depend on the tangent, which linearization cannot split again
                saved, self.threshold = self.threshold, 0
                try:
                    jaxpr, consts = self.open(jaxpr, consts, f"{here}/jvp")
                finally:
                    self.threshold = saved
            return jaxpr, consts, out_zeros

        p["jvp_jaxpr_fun"] = lu.wrap_init(jvp_jaxpr_fun, debug_info=jvp.debug_info)
        return _bind(eqn.primitive, p, invals)

    def custom_vjp(self, eqn, invals, where):
        p = dict(eqn.params)
        here = f"{where}/custom_vjp_call"
        invals = self.call_jaxpr(p, invals, here)
        fwd, bwd = p["fwd_jaxpr_thunk"], p["bwd"]

        def fwd_jaxpr_thunk(*nonzeros):
            jaxpr, consts = fwd.call_wrapped(*nonzeros)
            if self.wanted(jaxpr, blink=False):
                jaxpr, consts = self.open(jaxpr, consts, f"{here}/fwd")
            return jaxpr, consts

        symbolic = p.get("symbolic_zeros", False)

        def bwd_fun(*args):  # residuals and cotangents -> input cotangents (ad.Zero where none)
            if symbolic or not all(_is_value(a) for a in args):
                self.rewrites.append(Rewrite("?", (), f"{here}/bwd", "", "lax",
                                             "custom_vjp backward rule with symbolic zeros is not rewritten"))
                log.warning("jax_blink.transform(%s): the backward rule of a custom_vjp with symbolic zeros at %s "
                            "is not rewritten: its collectives run on lax", self.name, here)
                return bwd.call_wrapped(*args)
            zeros, logs = [], []

            def traced(*a):
                res = bwd.call_wrapped(*a)
                # jax 0.12's rule returns (cotangents, logs), jax 0.10's the cotangents
                paired = isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], (list, tuple))
                outs, lg = (list(res[0]), res[1]) if paired else (list(res), None)
                leaves, tree = jax.tree_util.tree_flatten(lg)
                zeros[:] = [o if type(o) is ad.Zero else None for o in outs]
                logs[:] = [paired, tree]
                return [o for o in outs if type(o) is not ad.Zero] + leaves

            cj = trace_to_closed_jaxpr(traced, [core.typeof(a) for a in args])
            vals = iter(self.eval(cj.jaxpr, cj.consts, args, f"{here}/bwd") if self.wanted(cj, blink=False)
                        else core.eval_jaxpr(cj.jaxpr, cj.consts, *args))
            cts = [z if z is not None else next(vals) for z in zeros]
            paired, tree = logs
            return (cts, jax.tree_util.tree_unflatten(tree, list(vals))) if paired else cts

        p["fwd_jaxpr_thunk"] = lu.wrap_init(fwd_jaxpr_thunk, debug_info=fwd.debug_info)
        p["bwd"] = lu.wrap_init(bwd_fun, debug_info=bwd.debug_info)
        return _bind(eqn.primitive, p, invals)

    def shard_map(self, eqn, invals, where):
        """A shard_map inside ``fn`` (``transform`` applied outside the map): the body is rewritten
        under jax.shard_map with the equation's mesh, specs and check_vma, so it traces in the map's
        context (axis names, manual mesh, varying-axes typing)."""
        p = eqn.params
        body, consts = getattr(p["jaxpr"], "jaxpr", p["jaxpr"]), getattr(p["jaxpr"], "consts", ())
        manual = p.get("newly_manual_axes") or p.get("manual_axes") or frozenset(p["mesh"].axis_names)
        f = jax.shard_map(lambda *a: tuple(self.eval(body, consts, a, f"{where}/shard_map")), mesh=p["mesh"],
                          in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                          check_vma=p["check_vma"], axis_names=set(manual))
        return list(f(*invals))


# -------------------------------------------------------------------------------- helpers
def _sub_jaxprs(params):
    for v in params.values():
        if isinstance(v, JAXPR_TYPES):
            yield v
        elif isinstance(v, tuple):
            yield from (b for b in v if isinstance(b, JAXPR_TYPES))


def _collective_eqns(jaxpr, prims):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in prims or eqn.primitive.name in _LAX_ONLY:
            yield eqn
        for j in _sub_jaxprs(eqn.params):
            yield from _collective_eqns(getattr(j, "jaxpr", j), prims)


def _axes_of(params) -> tuple:
    a = params.get("axes", params.get("axis_name", ()))
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def _is_value(x) -> bool:
    return isinstance(x, core.Tracer) or core.valid_jaxtype(x)


def _unsupported(axes, vals) -> str:
    """Why jax_blink cannot take this collective ("" when it can)."""
    mesh = abstract_mesh()
    names = set(mesh.axis_names) if mesh is not None else set()
    not_mesh = [a for a in axes if a not in names]
    if not_mesh:
        return (f"axes {not_mesh} are not mesh / pmap axes (a vmap axis name?): no devices to plan for")
    for v in vals:
        dt = np.dtype((v if isinstance(v, core.AbstractValue) else core.typeof(v)).dtype)
        if dt != np.bool_ and dt not in api._SUPPORTED:
            return f"dtype {dt.name} is not supported by jax_blink"
    return ""


def _classes(avals, axes) -> tuple:
    """The (dtype, varying axes) classes of a collective's operands as jax_blink buckets them (bool
    as int32, the collective's axes added to the varying ones, as the public API's pvary does)."""
    out = set()
    for a in avals:
        dt = np.dtype(a.dtype)
        mat = getattr(a, "mat", None)
        varying = frozenset(getattr(mat, "varying", ())) | frozenset(axes) if mat is not None else frozenset()
        out.add((np.dtype(np.int32) if dt == np.bool_ else dt, varying))
    return tuple(sorted(out, key=repr))


def _source(eqn) -> str:
    """"file:line (function)" of the innermost frame outside jax and jax_blink that made ``eqn``."""
    return callsites.innermost_source(eqn.source_info.traceback)


def _match_weak_type(x, aval):
    """jax_blink's results are never weakly typed; restore lax's weak type so a scan carry or a
    cond branch keeps the type its other side has."""
    have = core.typeof(x)
    if have.weak_type != aval.weak_type and have.dtype == aval.dtype:
        return convert_weak_type(x, aval.weak_type)
    return x


def _bind(prim, params, invals):
    return prim.bind(*invals, **prim.get_bind_params(params))  # as core.eval_jaxpr


def _names(collectives) -> frozenset:
    if isinstance(collectives, str):
        collectives = (collectives,)
    bad = [c for c in collectives if c not in KINDS]
    if bad or not collectives:
        raise ValueError(f"jax_blink.transform: collectives must name some of {sorted(KINDS)}, got "
                         f"{collectives!r}")
    return frozenset(p for c in collectives for p in KINDS[c])


# -------------------------------------------------------------------------------- public
def combine_threshold(value=None) -> int:
    """The combine threshold in bytes: ``value`` when given, else ``JAX_BLINK_COMBINE_THRESHOLD_BYTES``,
    else :data:`jax_blink.combining.DEFAULT_THRESHOLD_BYTES` (XLA:GPU's all-reduce combiner default,
    30 MiB). 0 turns combining off. Raises ValueError for anything but an integer >= 0 (a bool, a
    float, a negative number, text that is not one), naming where it came from."""
    where = "combine_threshold_bytes="
    if value is None:
        value = envvars.integer(ENV_THRESHOLD)
        if value is None:
            return combining.DEFAULT_THRESHOLD_BYTES
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"jax_blink.transform: {where} must be an integer number of bytes >= 0 (0: do not "
                         f"combine), got {value!r}")
    return int(value)


def transform(fn, *, collectives=("psum", "pmean", "all_gather", "psum_scatter"), topology=None, impl=None,
              device_map=None, chunk_elems=None, algorithm=None, max_trees=None, combine_threshold_bytes=None):
    """``fn`` with its own ``lax`` collectives over mesh / pmap axes executed by jax_blink, independent
    ones combined into one call.

    Every ``lax.psum`` / ``lax.pmean`` / ``lax.all_gather`` / ``lax.psum_scatter`` that ``fn`` runs,
    including inside libraries (Flax ``BatchNorm(axis_name=...)``) and inside ``scan`` / ``cond`` /
    ``while_loop`` / ``jit`` / ``checkpoint`` / ``custom_jvp`` / ``custom_vjp`` bodies and rules,
    becomes :func:`jax_blink.psum` / :func:`~jax_blink.all_gather` / :func:`~jax_blink.psum_scatter`
    with the same axes, ``axis_index_groups``, ``axis`` / ``scatter_dimension`` and ``tiled``. The
    rewrite works on the traced jaxpr (module docstring), so JAX's trace caches cannot defeat it.

    Psums (``lax`` ones taken over and ``jax_blink.psum`` / ``pmean`` calls alike) and jax_blink
    broadcasts / reduces of one jaxpr that do not depend on each other and share axes, groups,
    dtypes and lowering arguments run as one bucketed call, as XLA's all-reduce combiner merges
    all-reduces (:mod:`jax_blink.combining`: a dependency analysis of the jaxpr; dependent ones, such
    as BatchNorm's statistics feeding the next layer, stay apart), up to ``combine_threshold_bytes``
    of operands and 256 operands per call. All-gathers and reduce-scatters are not combined.

    Args:
      fn: the function to transform; called as ``fn(*args, **kwargs)`` with pytrees of arrays (as for
        ``jax.jit``: bind other arguments with ``functools.partial``). Usually the per-device body
        of a ``jax.pmap`` / ``jax.shard_map`` (``jax.pmap(jax_blink.transform(step), axis_name="i")``);
        a function that itself calls ``jax.shard_map`` or ``jax.pmap`` works too.
      collectives: which lax collectives to take over: any of "psum", "pmean" (the same equations:
        ``lax.pmean`` is a psum and a division), "all_gather", "psum_scatter" (alias "reduce_scatter").
      topology, impl, device_map, chunk_elems, algorithm, max_trees: passed to every jax_blink
        collective (see :func:`jax_blink.psum`).
      combine_threshold_bytes: most operand bytes per device of one combined call (an int >= 0; 0: no
        combining). Default ``$JAX_BLINK_COMBINE_THRESHOLD_BYTES``, else 30 MiB (XLA:GPU's default).

    Returns: a function with ``fn``'s signature and results (values equal to ``fn``'s up to
    summation order; all-gathers bitwise). Each call traces ``fn`` once (call it under ``jax.jit`` /
    ``pmap`` / ``shard_map``, which trace once per compilation; an eager call traces every time).
    Its attributes hold the last trace's records: ``rewrites`` a :class:`Rewrite` per lax collective
    met, ``combined`` a :class:`Combined` per call that runs several; :func:`transform_report` prints
    them. Collectives left on lax are logged at WARNING on logger "jax_blink" (the module docstring
    lists when that happens).
    Raises, at the call (each message begins ``jax_blink.transform:``): TypeError for an ``fn`` that is
    not callable or an argument of the wrong type; ValueError for unknown ``collectives``, jax_blink
    arguments or a bad threshold; TopologyError for a ``topology`` that does not load. While tracing:
    the environment variables' errors and jax_blink's errors for a topology that does not cover the
    mesh.
    Composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap`` inside and outside.
    Method: a custom jaxpr interpreter ("Writing custom Jaxpr interpreters in JAX", JAX docs).
    """
    if not callable(fn):
        raise TypeError(f"jax_blink.transform: fn must be a function (the per-device step), got "
                        f"{type(fn).__name__}")
    prims = _names(collectives)
    try:
        kwargs = dict(topology=topology, impl=api._impl(impl), device_map=device_map, chunk_elems=chunk_elems,
                      algorithm=algorithm, max_trees=max_trees)
        # what the call sites will be given, checked now rather than when fn is first traced
        mapping.make_plan_key(topology, device_map, chunk_elems, algorithm, max_trees)
        if isinstance(topology, (str, os.PathLike)):
            mapping.named_topology(os.fspath(topology))
    except (ValueError, TypeError, TopologyError) as err:
        raise type(err)(f"jax_blink.transform: {err}") from None
    if combine_threshold_bytes is not None:
        combine_threshold(combine_threshold_bytes)
    name = _fn_name(fn)

    @functools.wraps(fn)
    def transformed(*args, **kw):
        rw = _Rewriter(prims, kwargs, name, combine_threshold(combine_threshold_bytes))
        transformed.rewrites, transformed.combined = rw.rewrites, rw.combined
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kw)
        flat = jax.tree_util.tree_leaves((args, kw))
        out = rw.eval(closed.jaxpr, closed.consts, flat, name)
        transformed.calls = rw.calls
        _log(rw)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    transformed.rewrites, transformed.combined, transformed.calls = [], [], 0
    transformed.__wrapped_by_jax_blink__ = True
    transformed.__jax_blink_name__ = name
    return transformed


def _left_alone(r: Rewrite) -> bool:
    """Left on lax by design (a collective jax_blink has none of, or a kind not asked for), not
    because jax_blink could not take it."""
    return r.primitive in _NOT_JAX_BLINK or r.reason.startswith("not asked for")


def _log(rw: _Rewriter) -> None:
    left = [r for r in rw.rewrites if r.by == "lax"]
    for r in left:
        log.log(logging.INFO if _left_alone(r) else logging.WARNING, "jax_blink.transform(%s): %s", rw.name, r)
    log.info("jax_blink.transform(%s): %d lax collective(s) run by jax_blink in %d call(s), %d left on lax",
             rw.name, len(rw.rewrites) - len(left), rw.calls, len(left))


def transform_report(transformed) -> str:
    """What the last trace of ``transformed`` (a :func:`transform` result) did with the lax collectives
    it met, as text for people: a summary line (equations met, run by jax_blink, in how many calls
    after combining, left on lax), then one line per (collective, source line) with its count, what
    ran it and, for those left on lax (``pmax``, a vmap axis, a kind not asked for...), why. Sources
    are "file:line (function)" with the file's last two path parts. Raises TypeError for a function
    that did not come from :func:`transform`."""
    if not getattr(transformed, "__wrapped_by_jax_blink__", False):
        raise TypeError("jax_blink.transform_report takes a function returned by jax_blink.transform, "
                        f"got {type(transformed).__name__} {getattr(transformed, '__name__', '')!r}".rstrip(" '"))
    rs, name = transformed.rewrites, transformed.__jax_blink_name__
    if not rs:
        return f"transform({name}): no lax collective met (not traced yet, or none in the function)"
    done = [r for r in rs if r.by == "jax_blink"]
    combined = [c for c in transformed.combined]
    head = (f"transform({name}): {len(rs)} lax collective(s) met, {len(done)} run by jax_blink in "
            f"{transformed.calls} call(s)")
    if combined:
        head += (f"; {len(combined)} of the calls combine {sum(c.equations for c in combined)} collectives "
                 f"(jax_blink's own included)")
    head += f", {len(rs) - len(done)} left on lax"
    groups: dict = {}
    for r in rs:
        g = groups.setdefault((r.by, r.primitive, r.axes, _short_function(callsites.short_source(r.source)), r.reason),
                              [0, set()])
        g[0] += 1
        if r.call is not None:
            g[1].add(r.call)
    rows = sorted(groups.items(), key=lambda kv: (kv[0][0] != "jax_blink", -kv[1][0], kv[0][1], _line_key(kv[0][3])))
    width = max(len(f"lax.{k[1]} over {','.join(map(str, k[2]))}") for k, _ in rows)
    lines = [head]
    for by in ("jax_blink", "lax"):
        sel = [(k, v) for k, v in rows if k[0] == by]
        if not sel:
            continue
        lines.append("run by jax_blink (count, collective, source, calls):" if by == "jax_blink"
                     else "left on lax (count, collective, source: why):")
        for (_, prim, axes, src, reason), (count, calls) in sel:
            what = f"lax.{prim} over {','.join(map(str, axes))}".ljust(width)
            tail = f"in {len(calls)} call(s)" if by == "jax_blink" else reason
            lines.append(f"  {count:4d}  {what}  {src}: {tail}")
    return "\n".join(lines)


def _line_key(source: str) -> tuple:
    """Sort key of "file:line (function)": the file, then the line as a number."""
    path, _, rest = source.partition(":")
    line = rest.split(" ", 1)[0]
    return (path, int(line) if line.isdigit() else 0, rest)


def _short_function(source: str) -> str:
    """"file:line (a.<locals>.b)" -> "file:line (b)"."""
    head, sep, fn = source.partition(" (")
    return head + (f" ({fn.rstrip(')').split('.')[-1]})" if sep else "")


def _fn_name(fn) -> str:
    """A function's name for reports: ``functools.partial`` unwrapped, no object repr."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__
