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

Reports: every trace records one :class:`Rewrite` per collective equation met, in
``transformed.rewrites`` (the last trace's) and as text by :func:`transform_report`; each collective left on
lax is logged at WARNING on the ``"jax_blink"`` logger, the summary at INFO.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np

from . import api
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

log = logging.getLogger("jax_blink")

#: ``collectives=`` names -> the lax primitive names they select. ``lax.pmean`` traces to a psum
#: followed by a division, so "pmean" and "psum" select the same equations.
KINDS = {"psum": ("psum", "psum_invariant"), "pmean": ("psum", "psum_invariant"),
         "all_gather": ("all_gather",), "psum_scatter": ("reduce_scatter",),
         "reduce_scatter": ("reduce_scatter",)}
_COLLECTIVE_PRIMS = {psum_p, psum_invariant_p, all_gather_p, reduce_scatter_p}
_LAX_ONLY = {"all_gather_invariant"}  # lax collectives jax_blink has no form of (reported)
# Higher-order primitives whose sub-jaxprs are rewritten by replacing the jaxpr params and binding again.
_REBIND = {"pjit", "jit", "scan", "cond", "while", "checkpoint", "remat", "remat2", "closed_call",
           "core_call", "custom_lin"}


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One lax collective equation met while tracing.

    ``primitive``: the lax primitive ("psum", "psum_invariant", "all_gather", "reduce_scatter", ...);
    ``axes``: its axis names; ``where``: the path of sub-jaxprs to it ("fn", "fn/scan", "fn/cond[1]",
    "fn/custom_vjp_call/bwd", ...); ``operands``: shapes and dtypes as text; ``by``: "jax_blink" or
    "lax"; ``reason``: why it stayed on lax ("" when rewritten)."""

    primitive: str
    axes: tuple
    where: str
    operands: str
    by: str
    reason: str = ""

    def __str__(self) -> str:
        s = f"{self.where}: lax.{self.primitive} over {self.axes} of {self.operands} -> {self.by}"
        return s + (f" ({self.reason})" if self.reason else "")


class _Rewriter:
    """The state of one trace: which kinds to take over, jax_blink's keyword arguments, the report."""

    def __init__(self, prims: frozenset, kwargs: dict, name: str):
        self.prims, self.kwargs, self.name = prims, kwargs, name
        self.rewrites: list[Rewrite] = []

    # ---------------------------------------------------------------- finding collectives
    def wanted(self, jaxpr) -> bool:
        """Whether ``jaxpr`` (open or closed) holds a collective to take over, at any depth (custom
        derivative rules are opaque functions and always wrapped, so they do not count here)."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in self.prims or eqn.primitive.name in _LAX_ONLY:
                return True
            if any(self.wanted(j) for j in _sub_jaxprs(eqn.params)):
                return True
        return False

    def note(self, eqn_name, axes, vals, where, reason="") -> None:
        ops = ", ".join((v if isinstance(v, core.AbstractValue) else core.typeof(v)).str_short() for v in vals)
        self.rewrites.append(Rewrite(eqn_name, tuple(axes), where, ops, "lax" if reason else "jax_blink", reason))

    # ---------------------------------------------------------------- evaluation
    def eval(self, jaxpr, consts, args, where):
        """Evaluate ``jaxpr`` on ``args`` (core.eval_jaxpr's loop) with the collectives taken over."""
        env = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]):
            env[v] = x
        for eqn in jaxpr.eqns:
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
            self.note(prim.name, _axes_of(params), invals, where, "jax_blink has no invariant all-gather")
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
        return _bind(prim, params, invals)

    def _leave_inside(self, eqn, where, reason):
        for j in _sub_jaxprs(eqn.params):
            for e in _collective_eqns(getattr(j, "jaxpr", j), self.prims):
                self.note(e.primitive.name, _axes_of(e.params), [v.aval for v in e.invars],
                          f"{where}/{eqn.primitive.name}", reason)

    # ---------------------------------------------------------------- the collectives
    def collective(self, eqn, invals, where):
        prim, params = eqn.primitive, eqn.params
        axes = _axes_of(params)
        if prim.name not in self.prims:
            return _bind(prim, params, invals)
        reason = _unsupported(axes, invals)
        if reason:
            self.note(prim.name, axes, invals, where, reason)
            return _bind(prim, params, invals)
        self.note(prim.name, axes, invals, where)
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
        if not self.wanted(cj):
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
            if self.wanted(jaxpr):
                jaxpr, consts = self.open(jaxpr, consts, f"{here}/jvp")
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
            if self.wanted(jaxpr):
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
            vals = iter(self.eval(cj.jaxpr, cj.consts, args, f"{here}/bwd") if self.wanted(cj)
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
        dt = np.dtype(core.typeof(v).dtype)
        if dt != np.bool_ and dt not in api._SUPPORTED:
            return f"dtype {dt.name} is not supported by jax_blink"
    return ""


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
def transform(fn, *, collectives=("psum", "pmean", "all_gather", "psum_scatter"), topology=None, impl=None,
              device_map=None, chunk_elems=None, algorithm=None, max_trees=None):
    """``fn`` with its own ``lax`` collectives over mesh / pmap axes executed by jax_blink.

    Every ``lax.psum`` / ``lax.pmean`` / ``lax.all_gather`` / ``lax.psum_scatter`` that ``fn`` runs,
    including inside libraries (Flax ``BatchNorm(axis_name=...)``) and inside ``scan`` / ``cond`` /
    ``while_loop`` / ``jit`` / ``checkpoint`` / ``custom_jvp`` / ``custom_vjp`` bodies and rules,
    becomes :func:`jax_blink.psum` / :func:`~jax_blink.all_gather` / :func:`~jax_blink.psum_scatter`
    with the same axes, ``axis_index_groups``, ``axis`` / ``scatter_dimension`` and ``tiled``. The
    rewrite works on the traced jaxpr (module docstring), so JAX's trace caches cannot defeat it.

    Args:
      fn: the function to transform; called as ``fn(*args, **kwargs)`` with pytrees of arrays (as for
        ``jax.jit``: bind other arguments with ``functools.partial``). Usually the per-device body
        of a ``jax.pmap`` / ``jax.shard_map`` (``jax.pmap(jax_blink.transform(step), axis_name="i")``);
        a function that itself calls ``jax.shard_map`` or ``jax.pmap`` works too.
      collectives: which lax collectives to take over: any of "psum", "pmean" (the same equations:
        ``lax.pmean`` is a psum and a division), "all_gather", "psum_scatter" (alias "reduce_scatter").
      topology, impl, device_map, chunk_elems, algorithm, max_trees: passed to every jax_blink
        collective (see :func:`jax_blink.psum`).

    Returns: a function with ``fn``'s signature and results (values equal to ``fn``'s up to
    summation order; all-gathers bitwise). Each call traces ``fn`` once (call it under ``jax.jit`` /
    ``pmap`` / ``shard_map``, which trace once per compilation; an eager call traces every time).
    Its attribute ``rewrites`` holds the last trace's list of :class:`Rewrite` records, and
    :func:`transform_report` prints them; collectives left on lax are logged at WARNING on logger
    "jax_blink" (the module docstring lists when that happens).
    Raises ValueError for unknown ``collectives`` or jax_blink arguments (at the call, while
    tracing); jax_blink's errors for a topology that does not cover the mesh.
    Composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap`` inside and outside.
    Method: a custom jaxpr interpreter ("Writing custom Jaxpr interpreters in JAX", JAX docs).
    """
    prims = _names(collectives)
    kwargs = dict(topology=topology, impl=api._impl(impl), device_map=device_map, chunk_elems=chunk_elems,
                  algorithm=algorithm, max_trees=max_trees)
    name = getattr(fn, "__name__", repr(fn))

    @functools.wraps(fn)
    def transformed(*args, **kw):
        rw = _Rewriter(prims, kwargs, name)
        transformed.rewrites = rw.rewrites
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kw)
        flat = jax.tree_util.tree_leaves((args, kw))
        out = rw.eval(closed.jaxpr, closed.consts, flat, name)
        _log(rw)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    transformed.rewrites = []
    transformed.__wrapped_by_jax_blink__ = True
    return transformed


def _log(rw: _Rewriter) -> None:
    left = [r for r in rw.rewrites if r.by == "lax"]
    for r in left:
        log.warning("jax_blink.transform(%s): %s", rw.name, r)
    log.info("jax_blink.transform(%s): %d lax collective(s) run by jax_blink, %d left on lax", rw.name,
             len(rw.rewrites) - len(left), len(left))


def transform_report(transformed) -> str:
    """What the last trace of ``transformed`` (a :func:`transform` result) did with each lax
    collective, one line each (:class:`Rewrite`), after a count. Raises TypeError for a function
    that did not come from :func:`transform`."""
    if not getattr(transformed, "__wrapped_by_jax_blink__", False):
        raise TypeError("jax_blink.transform_report takes a function returned by jax_blink.transform, "
                        f"got {transformed!r}")
    rs = transformed.rewrites
    if not rs:
        return "no lax collective met (not traced yet, or none in the function)"
    n = sum(r.by == "jax_blink" for r in rs)
    return "\n".join([f"{n} of {len(rs)} lax collective(s) run by jax_blink:", *map(str, rs)])
