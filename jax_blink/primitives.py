"""JAX primitives for tree all-reduce, broadcast, reduce, all-gather and reduce-scatter, with rules
written like ``lax.psum``'s.

Laid out as ``jax/_src/lax/parallel.py`` (jax 0.10) lays out ``psum_p`` / ``pmax_p``: the helpers the
rules share first (axis checks, varying-axes typing, batching helpers, the two lowering rules), then
one block per primitive: its abstract eval, transpose, batcher and lowering, ending in one
:func:`_define` call that creates the primitive and registers them all. Which lowering runs a call
site and on which schedule is ``jax_blink.dispatch``'s (the lowering rules ask it). Rules shared
by primitives are one function bound with ``functools.partial``.

- ``blink_psum_p``: ``psum_p`` semantics (``shard_map(check_vma=False)`` and ``pmap``): each
  device's output cotangent is its own, so the transpose is again a psum.
- ``blink_psum_invariant_p``: ``psum_invariant_p`` semantics (``check_vma=True``): the output is
  invariant over ``axes`` (its vma drops them) and the transpose is ``pvary`` (no communication).
- ``blink_broadcast_p``: every device gets the root's operand. With ``vma=True`` the output is
  invariant over ``axes`` and the transpose is "cotangent on the root, zeros elsewhere"; otherwise the
  transpose is a reduce to the root.
- ``blink_reduce_p``: sum on the root, zeros elsewhere (output keeps the operand's vma); transpose is
  a broadcast from the root.
- ``blink_all_gather_p`` / ``blink_reduce_scatter_p``: ``lax.all_gather`` / ``lax.psum_scatter``
  (one operand per bind), each the other's transpose.

The first four take a bucket of leaves of one dtype (``bind(*leaves)``, one result per leaf): the
public API binds once per (dtype, varying axes) bucket, and the lowering runs one schedule over the
bucket's total element count with the leaves where they are (no concatenate, no slices).
All are linear (JVP applies the primitive to the tangents). Batching: a vmapped axis named in
``axes`` is reduced / selected locally on the batch dimension and the rest runs as a collective.
Lowering: the schedule for each group (``jax_blink.schedule``) through a record of the registry
``jax_blink.lowering`` (``impl``: "auto" | "ppermute" | "ffi" | any registered name), both chosen by
``jax_blink.dispatch``.
Params: ``axes`` (tuple of mesh axis names), ``impl`` (str), ``key`` (:class:`mapping.PlanKey`),
``root`` (rank over ``axes``, broadcast/reduce), ``axis_index_groups`` (``blink_psum_p`` and the
sharded ones), ``vma`` (broadcast/reduce/sharded: check_vma on).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import callsites, collectives, dispatch
from ._jax_compat import (
    ad,
    batching,
    check_unreduced_args,
    check_unreduced_sum,
    core,
    def_unreduced_lowering,
    lax_const,
    lower_fun_plain,
    mlir,
    preduced,
    with_unreduced,
)
from ._jax_compat import dispatch as _jax_dispatch
from ._jax_compat import lax_roofline_rule as _compat_roofline_rule
from ._jax_compat import register_roofline as _compat_register_roofline
from .errors import BlinkError
from .lowering import ppermute as _ppermute

# ================================================================================ shared helpers
# -------------------------------------------------------------------------------- axes


def check_axis_names(axes, api_name: str) -> None:
    """Raise NameError (like lax) for an axis name not bound by pmap / shard_map / vmap."""
    env = core.get_axis_env()
    for name in axes:
        if not env.axis_exists(name):
            raise NameError(f"Found an unbound axis name: {name}. To fix this, please call "
                            f"{api_name} under `jax.shard_map` or `jax.pmap` with that axis name.")


def axis_sizes(axes) -> list[int]:
    """Sizes of bound named axes (from the current axis environment)."""
    env = core.get_axis_env()
    return [env.axis_size(a) for a in axes]


def _effects(axes):
    return {core.NamedAxisEffect(a) for a in axes}


# -------------------------------------------------------------------------------- varying-axes typing
def _plain(aval):
    # check_vma off: no varying-axes typing (as lax's _allreduce_effectful_abstract_eval).
    return core.ShapedArray(aval.shape, aval.dtype, sharding=aval.sharding)


def _drop_vma(aval, axes):
    vma = frozenset(a for a in aval.mat.varying if a not in axes)
    return aval.update(manual_axis_type=aval.mat.update(varying=vma))


def _require_varying(aval, axes, name):
    if not set(axes) <= set(aval.mat.varying):
        raise ValueError(f"{name} with check_vma=True needs an operand varying over {axes}; got "
                         f"varying={set(aval.mat.varying)} (jax_blink's public API inserts pvary)")


def _typed_avals(avals, axes, api, *, vma: bool, invariant: bool) -> list:
    """Output avals of a bucket collective: plain ones with check_vma off; with it on, operands must
    vary over ``axes`` and the outputs are invariant over them (``invariant``) or keep their vma."""
    if not vma:
        return [_plain(a) for a in avals]
    for a in avals:
        _require_varying(a, axes, api)
    return [_drop_vma(a, axes) for a in avals] if invariant else list(avals)


# -------------------------------------------------------------------------------- AD and batching
def _cts(cts, xs):
    # symbolic-zero cotangents become zeros: the bucket's call needs every operand
    return [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]


def _root_mask(v, axes, root):
    """v on the device of rank ``root`` over ``axes``, zeros elsewhere (no communication)."""
    return jnp.where(lax.axis_index(axes) == root, v, jnp.zeros_like(v))


def _local_sum(v, d, size: int):
    """Sum of ``v`` over its batch dimension ``d`` (None: ``v`` is the same on all ``size`` entries)."""
    return lax_const(v, size) * v if d is None else lax.reduce_sum(v, (d,))


def _split_root(axes, root, name, size):
    """(batch index of the root, remaining axes, root rank over them) when ``name`` is vmapped."""
    sizes = [size if a == name else s for a, s in zip(axes, axis_sizes(axes))]
    coords = list(np.unravel_index(root, sizes)) if sizes else []
    k = axes.index(name)
    rest = tuple(a for a in axes if a != name)
    rest_sizes = [s for a, s in zip(axes, sizes) if a != name]
    rest_coords = [c for i, c in enumerate(coords) if i != k]
    rest_root = int(np.ravel_multi_index(rest_coords, rest_sizes)) if rest else 0
    return int(coords[k]), rest, rest_root


def _only_axis(axis_data, params, api):
    """lax's limits for vmap over a collective axis of a sharded collective."""
    if params["axis_index_groups"] is not None:
        raise NotImplementedError(f"{api}: axis_index_groups not supported in vmap (as lax)")
    if len(params["axes"]) > 1:
        raise NotImplementedError(f"{api} over several axes where one is a vmap axis is not supported (as lax)")


def _batch_dims(dim, d, tiled, shift):
    """A batch dimension ``d`` outside the collective's axes (lax's rule): (collective dimension,
    output batch dimension). ``shift``: how the untiled collective changes the rank (+1 gather, -1
    scatter), moving a batch dimension after it."""
    if d is None:
        return dim, d
    if d <= dim:
        return dim + 1, d
    return dim, d if tiled else d + shift


# -------------------------------------------------------------------------------- sharded shapes
def all_gather_shape(shape, dim: int, n: int, tiled: bool) -> tuple:
    """Output shape of all-gathering a ``shape`` shard over ``n`` ranks at ``dim`` (lax.all_gather)."""
    shape = list(shape)
    if tiled:
        shape[dim] *= n
    else:
        shape.insert(dim, n)
    return tuple(shape)


def reduce_scatter_shape(shape, dim: int, n: int, tiled: bool, api: str = "jax_blink.psum_scatter") -> tuple:
    """Output shape of reduce-scattering ``shape`` over ``n`` ranks at ``dim`` (lax.psum_scatter).

    Raises ValueError for ``dim`` out of range (lax: an IndexError), a tiled dimension not divisible
    by ``n`` or an untiled dimension whose size is not ``n`` (as lax)."""
    shape = list(shape)
    if not shape:
        raise ValueError(f"{api}: a scalar operand has no dimension to scatter; pass an array with a "
                         f"dimension of the axis size {n} (or divisible by it with tiled=True)")
    if not 0 <= dim < len(shape):
        raise ValueError(f"{api}: scatter_dimension must be in [-{len(shape)}, {len(shape)}) for an operand "
                         f"of shape {tuple(shape)}, got {dim}")
    if tiled:
        if shape[dim] % n:
            raise ValueError(f"{api}: tiled operand dimension {dim} of size {shape[dim]} must be divisible by "
                             f"the axis size {n}")
        shape[dim] //= n
    else:
        if shape[dim] != n:
            raise ValueError(f"{api}: operand dimension {dim} of size {shape[dim]} must equal the axis size {n} "
                             "(or pass tiled=True to split it into equal blocks)")
        del shape[dim]
    return tuple(shape)


def _sharded_out(aval, shape, axes, vma, name="jax_blink sharded collective"):
    if vma:
        check_unreduced_args([aval], axes, name)
        _require_varying(aval, axes, name)
        return aval.update(shape=shape)
    return core.ShapedArray(shape, aval.dtype, sharding=aval.sharding)


def _typed_out(aval, shape, vma, **mat):
    """``aval`` reshaped with its manual-axes type updated (``varying=``, ``reduced=``, ``unreduced=``
    as frozensets); check_vma off: a plain aval."""
    if not vma:
        return core.ShapedArray(shape, aval.dtype, sharding=aval.sharding)
    return aval.update(shape=shape, manual_axis_type=aval.mat.update(**mat))


def _check_unreduced_in(aval, axes, name, to):
    """lax's rules for an Unreduced -> ``to`` collective (unreduced_psum, unreduced_psum_scatter):
    the operand is unreduced over ``axes`` and not varying over them. ValueError otherwise."""
    if not aval.mat.unreduced & frozenset(axes):
        raise ValueError(f"{name} is a Unreduced -> {to} collective: the axes {axes} must be in "
                         f"jax.typeof(x).mat.unreduced, got {aval.str_short(True)}")
    if aval.mat.varying & set(axes):
        raise ValueError(f"{name}'s input cannot be varying across the axes {axes}; got {aval.str_short(True)}")
    check_unreduced_sum(aval.mat, name)


def _no_batching(name):
    def batcher(prim, axis_data, vals_in, dims_in, **params):
        raise NotImplementedError(f"{name} under vmap is not supported (as lax's {name})")
    return batcher


# -------------------------------------------------------------------------------- lowering rules
def _lower(collective, ctx, *xs, axes, impl, key, root=None, axis_index_groups=None, vma=None):
    """Lowering of the bucket primitives: the chosen record's rule over the non-empty leaves."""
    mesh = dispatch.concrete_mesh(collective, ctx)
    nbytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in ctx.avals_in)
    rec, why = dispatch.site_choice(ctx, mesh, impl, axes, axis_index_groups, collective, key, root, nbytes)
    # Zero-size leaves take no part (their results are themselves); the rest go to the rule as they are.
    live = [i for i, a in enumerate(ctx.avals_in) if math.prod(a.shape) > 0]
    outs = list(xs)
    if not live:
        return outs
    avals = [ctx.avals_in[i] for i in live]
    dtype = avals[0].dtype
    if any(a.dtype != dtype for a in avals):
        raise BlinkError(f"jax_blink.{collective}: one call takes leaves of one dtype, got "
                         f"{sorted({str(a.dtype) for a in avals})} (the public API buckets by dtype)")

    request_for = dispatch.request_for_site(collective, mesh, axes, axis_index_groups, root, key,
                                            np.dtype(dtype).itemsize, ctx.module_context.platforms[0], rec.name,
                                            dispatch.auto_axes(ctx, mesh))

    sub = ctx.replace(avals_in=avals, avals_out=[ctx.avals_out[i] for i in live])
    total = sum(math.prod(a.shape) for a in avals)
    for i, o in zip(live, callsites.run_rule(rec, sub, [xs[i] for i in live], request_for, collective=collective,
                                             axes=axes, impl=impl, mesh=mesh, nelems=total, why=why)):
        outs[i] = o
    return outs


def _rank_table(request, ndevices: int) -> np.ndarray:
    """int32 [ndevices]: each mesh position's rank in its group (0 outside every group)."""
    ranks = np.zeros(ndevices, np.int32)
    for members in request.groups:
        for r, p in enumerate(members):
            ranks[p] = r
    return ranks


def _rs_layout(v, dim, n, tiled):
    """The reduce-scatter operand as [n, *shard shape]: shard r = block r along ``dim``."""
    shape = v.shape
    k = shape[dim] // n if tiled else 1
    y = v.reshape(shape[:dim] + (n, k) + shape[dim + 1:])
    return jnp.moveaxis(y, dim, 0)


def _lower_sharded(collective, ctx, x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma,
                   all_gather_dimension=None, scatter_dimension=None):
    """All-gather: place the shard at the rank's position of a zero full buffer, run the schedule,
    fold to the output shape. Reduce-scatter: lay the operand out as n shards, run, slice the own shard.
    The lowering rules see full buffers, except where the record says ``shard_input`` (an all-gather
    rule takes the rank's shard as its operand and places it itself) or ``shard_output`` (a
    reduce-scatter rule returns the rank's shard as its result: no full-size result, no slice)."""
    mesh = dispatch.concrete_mesh(collective, ctx)
    aval_in, aval_out = ctx.avals_in[0], ctx.avals_out[0]
    n = axis_size
    gather = collectives.get(collective).input == "shard"  # all-gather: shard in, whole out
    shard_shape = aval_in.shape if gather else aval_out.shape
    m = math.prod(shard_shape)
    full = core.ShapedArray((n * m,), aval_in.dtype)
    if m == 0 or n == 1:  # nothing moves: local reshapes only
        def f(v):
            if gather:
                return v.reshape(aval_out.shape)
            return _rs_layout(v, scatter_dimension, n, tiled)[0].reshape(aval_out.shape)
        return lower_fun_plain(f, multiple_results=False)(
            ctx.replace(primitive=None, avals_in=[core.ShapedArray(aval_in.shape, aval_in.dtype)],
                        avals_out=[core.ShapedArray(aval_out.shape, aval_out.dtype)]), x)
    rec, why = dispatch.site_choice(ctx, mesh, impl, axes, axis_index_groups, collective, key, None,
                                    n * m * np.dtype(aval_in.dtype).itemsize)
    request_for = dispatch.request_for_site(collective, mesh, axes, axis_index_groups, None, key,
                                            np.dtype(aval_in.dtype).itemsize, ctx.module_context.platforms[0],
                                            rec.name, dispatch.auto_axes(ctx, mesh))

    ranks = _rank_table(request_for(n * m, schedules=False), mesh.size)
    plain_in = core.ShapedArray(aval_in.shape, aval_in.dtype)
    plain_out = core.ShapedArray(aval_out.shape, aval_out.dtype)
    if gather:
        def pre(v):
            me = jnp.asarray(ranks)[_ppermute._position_p.bind()]
            return lax.dynamic_update_slice(jnp.zeros((n * m,), v.dtype), v.reshape(-1), (me * m,))

        def post(v):
            y = jnp.moveaxis(v.reshape((n,) + tuple(shard_shape)), 0, all_gather_dimension)
            return y.reshape(aval_out.shape)
    else:
        def pre(v):
            return _rs_layout(v, scatter_dimension, n, tiled).reshape(-1)

        def post(v):
            me = jnp.asarray(ranks)[_ppermute._position_p.bind()]
            return lax.dynamic_slice(v, (me * m,), (m,)).reshape(aval_out.shape)
    shard = core.ShapedArray((m,), aval_in.dtype)
    site = dict(collective=collective, axes=axes, impl=impl, mesh=mesh, nelems=n * m, why=why)
    if gather and rec.shard_input:  # the executor places the shard itself
        out, = callsites.run_rule(rec, ctx.replace(avals_in=[shard], avals_out=[full]), [mlir.reshape(ctx, x, shard)],
                                  request_for, **site)
    else:
        own_shard = not gather and rec.shard_output  # the executor writes only the own shard
        placed, = lower_fun_plain(pre, multiple_results=False)(
            ctx.replace(primitive=None, avals_in=[plain_in], avals_out=[full]), x)
        out, = callsites.run_rule(rec, ctx.replace(avals_in=[full], avals_out=[shard if own_shard else full]), [placed],
                                  request_for, **site)
        if own_shard:
            return mlir.reshape(ctx, out, plain_out)
    return lower_fun_plain(post, multiple_results=False)(
        ctx.replace(primitive=None, avals_in=[full], avals_out=[plain_out]), out)


# -------------------------------------------------------------------------------- registration
def _define(name: str, *, multiple_results: bool, abstract_eval, transpose, batcher, lowering) -> core.Primitive:
    """A new primitive ``name`` with its rules registered: ``batcher(prim, axis_data, vals, dims,
    **params)`` gets the primitive first. Lowered with ``cacheable=False``: every call site gets its
    own lowering (the ffi lowering numbers call sites, so two identical psums in one program never
    share a meeting)."""
    prim = core.Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(functools.partial(_jax_dispatch.apply_primitive, prim))
    prim.def_effectful_abstract_eval(abstract_eval)
    ad.deflinear2(prim, transpose)
    batching.fancy_primitive_batchers[prim] = functools.partial(batcher, prim)
    mlir.register_lowering(prim, lowering, cacheable=False)
    return prim


# ================================================================================ psum (check_vma off)
def _psum_abstract(*avals, axes, impl, key, axis_index_groups):
    check_axis_names(axes, "jax_blink.psum")
    return _typed_avals(avals, axes, "jax_blink.psum", vma=False, invariant=True), _effects(axes)


def _psum_transpose(cts, *xs, axes, impl, key, axis_index_groups):
    # psum = psum + pbroadcast (lax's view), so its transpose sums the cotangents again.
    return blink_psum_p.bind(*_cts(cts, xs), axes=axes, impl=impl, key=key, axis_index_groups=axis_index_groups)


def _psum_batcher(prim, axis_data, vals_in, dims_in, **params):
    """Both psums: a vmapped axis of ``axes`` is summed locally, the other axes run as a collective."""
    axes = params["axes"]
    if axis_data.name not in axes:
        return prim.bind(*vals_in, **params), list(dims_in)
    if params.get("axis_index_groups") is not None:
        raise NotImplementedError("axis_index_groups not supported in vmap collectives (as lax.psum)")
    rest = tuple(a for a in axes if a != axis_data.name)
    vs = [_local_sum(v, d, axis_data.size) for v, d in zip(vals_in, dims_in)]
    if rest:
        vs = prim.bind(*vs, **{**params, "axes": rest})
    return list(vs), [None] * len(vs)


blink_psum_p = _define("blink_psum", multiple_results=True, abstract_eval=_psum_abstract,
                       transpose=_psum_transpose, batcher=_psum_batcher,
                       lowering=functools.partial(_lower, "allreduce"))


# ================================================================================ psum (check_vma on)
def _psum_invariant_abstract(*avals, axes, impl, key):
    check_axis_names(axes, "jax_blink.psum")
    return _typed_avals(avals, axes, "jax_blink.psum", vma=True, invariant=True), _effects(axes)


def _psum_invariant_transpose(cts, *xs, axes, impl, key):
    return [core.pvary(ct, axis_name=axes) for ct in _cts(cts, xs)]


blink_psum_invariant_p = _define("blink_psum_invariant", multiple_results=True,
                                 abstract_eval=_psum_invariant_abstract, transpose=_psum_invariant_transpose,
                                 batcher=_psum_batcher, lowering=functools.partial(_lower, "allreduce"))


# ================================================================================ psum of unreduced operands
# lax's unreduced_psum (jax/_src/lax/parallel.py): Unreduced -> Invariant over ``axes`` (the operand
# holds per-device partial values of one sum, as explicit-sharding FSDP leaves them); the operand is
# not pvaried; the transpose is ``preduced`` (Invariant -> Reduced, no communication).
def _unreduced_psum_abstract(*avals, axes, impl, key):
    check_axis_names(axes, "jax_blink.psum")
    out = []
    for a in avals:
        _check_unreduced_in(a, axes, "jax_blink.psum: unreduced_psum", "Invariant")
        out.append(a.update(manual_axis_type=with_unreduced(a.mat, a.mat.unreduced - frozenset(axes))))
    return out, _effects(axes)


def _unreduced_psum_transpose(cts, *xs, axes, impl, key):
    return [preduced(ct, axis_name=tuple(axes)) for ct in _cts(cts, xs)]


blink_unreduced_psum_p = _define("blink_unreduced_psum", multiple_results=True,
                                 abstract_eval=_unreduced_psum_abstract, transpose=_unreduced_psum_transpose,
                                 batcher=_no_batching("unreduced_psum"),
                                 lowering=functools.partial(_lower, "allreduce"))
# jax >= 0.12.1 passes unreduced operands as high values: the low form is varying over the axes, so
# the sum is the invariant psum of the low values (lax's unreduced_psum_p.to_lojax).
def_unreduced_lowering(blink_unreduced_psum_p, lambda lo, _hi, **params: blink_psum_invariant_p.bind(*lo, **params))


# ================================================================================ broadcast
def _broadcast_abstract(*avals, axes, root, impl, key, vma):
    check_axis_names(axes, "jax_blink.broadcast")
    return _typed_avals(avals, axes, "jax_blink.broadcast", vma=vma, invariant=True), _effects(axes)


def _broadcast_transpose(cts, *xs, axes, root, impl, key, vma):
    cts = _cts(cts, xs)
    if vma:  # one invariant cotangent: it flows to the root's operand only
        return [_root_mask(core.pvary(ct, axis_name=axes), axes, root) for ct in cts]
    return blink_reduce_p.bind(*cts, axes=axes, root=root, impl=impl, key=key, vma=False)


def _broadcast_batcher(prim, axis_data, vals_in, dims_in, *, axes, root, **params):
    if axis_data.name not in axes:
        return prim.bind(*vals_in, axes=axes, root=root, **params), list(dims_in)
    b, rest, rest_root = _split_root(axes, root, axis_data.name, axis_data.size)
    vs = [v if d is None else lax.index_in_dim(v, b, d, keepdims=False) for v, d in zip(vals_in, dims_in)]
    if rest:
        vs = prim.bind(*vs, axes=rest, root=rest_root, **params)
    return list(vs), [None] * len(vs)


blink_broadcast_p = _define("blink_broadcast", multiple_results=True, abstract_eval=_broadcast_abstract,
                            transpose=_broadcast_transpose, batcher=_broadcast_batcher,
                            lowering=functools.partial(_lower, "broadcast"))


# ================================================================================ reduce
def _reduce_abstract(*avals, axes, root, impl, key, vma):
    check_axis_names(axes, "jax_blink.reduce")
    return _typed_avals(avals, axes, "jax_blink.reduce", vma=vma, invariant=False), _effects(axes)


def _reduce_transpose(cts, *xs, axes, root, impl, key, vma):
    out = blink_broadcast_p.bind(*_cts(cts, xs), axes=axes, root=root, impl=impl, key=key, vma=vma)
    return [core.pvary(o, axis_name=axes) for o in out] if vma else out


def _reduce_batcher(prim, axis_data, vals_in, dims_in, *, axes, root, **params):
    if axis_data.name not in axes:
        return prim.bind(*vals_in, axes=axes, root=root, **params), list(dims_in)
    b, rest, rest_root = _split_root(axes, root, axis_data.name, axis_data.size)
    ss = [_local_sum(v, d, axis_data.size) for v, d in zip(vals_in, dims_in)]
    if rest:
        ss = prim.bind(*ss, axes=rest, root=rest_root, **params)
    out = []
    for s in ss:
        here = (lax.iota(np.int32, axis_data.size) == b).reshape((axis_data.size,) + (1,) * s.ndim)
        out.append(jnp.where(here, s[None], jnp.zeros_like(s)[None]))
    return out, [0] * len(out)


blink_reduce_p = _define("blink_reduce", multiple_results=True, abstract_eval=_reduce_abstract,
                         transpose=_reduce_transpose, batcher=_reduce_batcher,
                         lowering=functools.partial(_lower, "reduce"))


# ================================================================================ all-gather
# All-gather and reduce-scatter (ForestColl, Zhao et al. 2024, section 3: each shard broadcast from /
# reduced to its owner along its own trees), with ``lax.all_gather`` / ``lax.psum_scatter``'s rules
# (jax/_src/lax/parallel.py: all_gather_p, reduce_scatter_p): one operand per bind, output keeps the
# operand's varying axes (check_vma on; the public API pvaries the operand first), transpose of one is
# the other, vmap over a collective axis is local (stack / sum-and-split).
# Params: axes, impl, key, axis_index_groups, axis_size (ranks per group), tiled, vma, and
# all_gather_dimension / scatter_dimension.
def _all_gather_abstract(x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma, all_gather_dimension):
    check_axis_names(axes, "jax_blink.all_gather")
    shape = all_gather_shape(x.shape, all_gather_dimension, axis_size, tiled)
    return _sharded_out(x, shape, axes, vma, "jax_blink.all_gather"), _effects(axes)


def _all_gather_transpose(ct, x, *, all_gather_dimension, **params):
    ct = ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
    return [blink_reduce_scatter_p.bind(ct, scatter_dimension=all_gather_dimension, **params)]


def _all_gather_batcher(prim, axis_data, vals_in, dims_in, *, all_gather_dimension, **params):
    (x,), (d,) = vals_in, dims_in
    dim, tiled = all_gather_dimension, params["tiled"]
    if axis_data.name not in params["axes"]:
        dim, d = _batch_dims(dim, d, tiled, +1)
        return prim.bind(x, all_gather_dimension=dim, **params), d
    _only_axis(axis_data, params, "jax_blink.all_gather")
    n = axis_data.size
    if d is None:
        shape = list(x.shape)
        shape.insert(dim, n)
        y = lax.broadcast_in_dim(x, shape, [i for i in range(len(shape)) if i != dim])
    else:
        y = jnp.moveaxis(x, d, dim)
    if tiled:  # fold the gathered axis into the next one
        y = y.reshape(y.shape[:dim] + (y.shape[dim] * y.shape[dim + 1],) + y.shape[dim + 2:])
    return y, None


blink_all_gather_p = _define("blink_all_gather", multiple_results=False, abstract_eval=_all_gather_abstract,
                             transpose=_all_gather_transpose, batcher=_all_gather_batcher,
                             lowering=functools.partial(_lower_sharded, "allgather"))


# all_gather(to="invarying"): lax's all_gather_invariant, Varying -> Invariant over ``axes`` (every rank
# holds the same gathered value); the transpose is the rank's own block of the (invariant) cotangent,
# a local slice (Invariant -> Varying).
def _all_gather_invariant_abstract(x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma,
                                   all_gather_dimension):
    check_axis_names(axes, "jax_blink.all_gather")
    if vma:
        check_unreduced_args([x], axes, "jax_blink.all_gather(to='invarying')")
    shape = all_gather_shape(x.shape, all_gather_dimension, axis_size, tiled)
    return _typed_out(x, shape, vma, varying=x.mat.varying - frozenset(axes)), _effects(axes)


def _all_gather_invariant_transpose(ct, x, *, axes, axis_size, tiled, all_gather_dimension, **params):
    ct = ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
    block = ct.shape[all_gather_dimension] // axis_size
    out = lax.dynamic_slice_in_dim(ct, lax.axis_index(tuple(axes)) * block, block, all_gather_dimension)
    return [out if tiled else lax.squeeze(out, [all_gather_dimension])]


blink_all_gather_invariant_p = _define(
    "blink_all_gather_invariant", multiple_results=False, abstract_eval=_all_gather_invariant_abstract,
    transpose=_all_gather_invariant_transpose, batcher=_all_gather_batcher,
    lowering=functools.partial(_lower_sharded, "allgather"))


# all_gather(to="reduced"): lax's all_gather_reduced, Varying -> Reduced over ``axes``; the operand is
# not pvaried; the transpose reduce-scatters the (unreduced) cotangent (blink_unreduced_reduce_scatter).
def _all_gather_reduced_abstract(x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma,
                                 all_gather_dimension):
    check_axis_names(axes, "jax_blink.all_gather")
    if vma:
        if x.mat.unreduced:
            raise ValueError(f"jax_blink.all_gather(to='reduced') only accepts inputs that are not unreduced; "
                             f"got {x.str_short(True)}")
        if not set(axes) <= x.mat.varying:
            raise ValueError(f"jax_blink.all_gather(to='reduced') is a Varying -> Reduced collective: the axes "
                             f"{axes} must be in jax.typeof(x).mat.varying, got {x.str_short(True)}")
        if x.mat.reduced & set(axes):
            raise ValueError(f"jax_blink.all_gather(to='reduced')'s input cannot be reduced across {axes}; got "
                             f"{x.str_short(True)}")
    shape = all_gather_shape(x.shape, all_gather_dimension, axis_size, tiled)
    return _typed_out(x, shape, vma, varying=x.mat.varying - frozenset(axes),
                      reduced=x.mat.reduced | frozenset(axes)), _effects(axes)


def _all_gather_reduced_transpose(ct, x, *, all_gather_dimension, **params):
    ct = ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
    return [blink_unreduced_reduce_scatter_p.bind(ct, scatter_dimension=all_gather_dimension, **params)]


blink_all_gather_reduced_p = _define(
    "blink_all_gather_reduced", multiple_results=False, abstract_eval=_all_gather_reduced_abstract,
    transpose=_all_gather_reduced_transpose, batcher=_no_batching("all_gather_reduced"),
    lowering=functools.partial(_lower_sharded, "allgather"))


# ================================================================================ reduce-scatter
def _reduce_scatter_abstract(x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma, scatter_dimension):
    check_axis_names(axes, "jax_blink.psum_scatter")
    shape = reduce_scatter_shape(x.shape, scatter_dimension, axis_size, tiled)
    return _sharded_out(x, shape, axes, vma, "jax_blink.psum_scatter"), _effects(axes)


def _reduce_scatter_transpose(ct, x, *, scatter_dimension, **params):
    ct = ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
    return [blink_all_gather_p.bind(ct, all_gather_dimension=scatter_dimension, **params)]


def _reduce_scatter_batcher(prim, axis_data, vals_in, dims_in, *, scatter_dimension, **params):
    (x,), (d,) = vals_in, dims_in
    dim, tiled = scatter_dimension, params["tiled"]
    if axis_data.name not in params["axes"]:
        dim, d = _batch_dims(dim, d, tiled, -1)
        return prim.bind(x, scatter_dimension=dim, **params), d
    _only_axis(axis_data, params, "jax_blink.psum_scatter")
    n = axis_data.size
    s = _local_sum(x, d, n)
    reduce_scatter_shape(s.shape, dim, n, tiled)  # lax's shape errors
    if tiled:  # split the scattered axis into (ranks, block): the ranks axis is the batch axis
        s = s.reshape(s.shape[:dim] + (n, s.shape[dim] // n) + s.shape[dim + 1:])
    return s, dim


blink_reduce_scatter_p = _define("blink_reduce_scatter", multiple_results=False,
                                 abstract_eval=_reduce_scatter_abstract, transpose=_reduce_scatter_transpose,
                                 batcher=_reduce_scatter_batcher,
                                 lowering=functools.partial(_lower_sharded, "reducescatter"))


# psum_scatter of an operand unreduced over ``axes``: lax's unreduced_psum_scatter, Unreduced -> Varying;
# the operand is not pvaried; the transpose is all_gather(to="reduced").
def _unreduced_reduce_scatter_abstract(x, *, axes, impl, key, axis_index_groups, axis_size, tiled, vma,
                                       scatter_dimension):
    check_axis_names(axes, "jax_blink.psum_scatter")
    _check_unreduced_in(x, axes, "jax_blink.psum_scatter: unreduced_psum_scatter", "Varying")
    shape = reduce_scatter_shape(x.shape, scatter_dimension, axis_size, tiled)
    mat = with_unreduced(x.mat, x.mat.unreduced - frozenset(axes), varying=x.mat.varying | frozenset(axes))
    return x.update(shape=shape, manual_axis_type=mat), _effects(axes)


def _unreduced_reduce_scatter_transpose(ct, x, *, scatter_dimension, **params):
    ct = ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
    return [blink_all_gather_reduced_p.bind(ct, all_gather_dimension=scatter_dimension, **params)]


blink_unreduced_reduce_scatter_p = _define(
    "blink_unreduced_reduce_scatter", multiple_results=False, abstract_eval=_unreduced_reduce_scatter_abstract,
    transpose=_unreduced_reduce_scatter_transpose, batcher=_no_batching("unreduced_psum_scatter"),
    lowering=functools.partial(_lower_sharded, "reducescatter"))


def _unreduced_reduce_scatter_lo(lo, hi, *, scatter_dimension, **params):
    # the low form leads with one dimension per unreduced mesh axis of the sharding (as lax's rule)
    dim = scatter_dimension + len(hi[0].sharding.spec.unreduced)
    return blink_reduce_scatter_p.bind(*lo, scatter_dimension=dim, **params)


def_unreduced_lowering(blink_unreduced_reduce_scatter_p, _unreduced_reduce_scatter_lo)


# ================================================================================ roofline
# ``jax.experimental.roofline`` counts a collective's communication with lax's rules; each of ours uses
# the rule of the lax primitive it stands in for (ring bytes per mesh axis, as lax's model), so a
# roofline of a program is the same whether it calls lax or jax_blink. Broadcast and reduce (no lax
# counterpart) count as one phase of an all-reduce: lax's reduce-scatter bytes of the operand.
def _roofline_as(lax_name: str, axes_kw: str):
    rule = _compat_roofline_rule(lax_name)
    if rule is None:
        return None

    def stand_in(ctx, *args, axes, **params):
        return rule(ctx, *args, **{axes_kw: tuple(axes)})
    return stand_in


def _register_rooflines():
    table = {
        "psum_invariant_p": ("axes", (blink_psum_p, blink_psum_invariant_p, blink_unreduced_psum_p)),
        "all_gather_p": ("axis_name", (blink_all_gather_p, blink_all_gather_invariant_p, blink_all_gather_reduced_p)),
        "reduce_scatter_p": ("axis_name", (blink_reduce_scatter_p, blink_unreduced_reduce_scatter_p,
                                           blink_broadcast_p, blink_reduce_p)),
    }
    for lax_name, (kw, prims) in table.items():
        rule = _roofline_as(lax_name, kw)
        if rule is not None:
            for prim in prims:
                _compat_register_roofline(prim, rule)


_register_rooflines()
