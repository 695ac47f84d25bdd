"""XLA's own collective as a jax_blink lowering (impl ``"xla"``): the call site runs the op
``jax.lax`` emits (``all-reduce`` / ``all-gather`` / ``reduce-scatter``: NCCL on GPUs, XLA:CPU's
in-process collectives in host memory, gloo or NCCL across processes), so its results are lax's bit
for bit. ``impl="auto"`` takes it at a call site where the cost model predicts it faster than every
jax_blink plan (``jax_blink.dispatch``: the NCCL tuner model, :mod:`jax_blink.nccl_model`, on GPUs;
a calibration of this machine, :mod:`jax_blink.calibration`, where one exists).

Per collective, over the call's groups (their axis indices as ``axis_index_groups`` when they are not
the whole axes):

- all-reduce (psum): lax's psum lowering per leaf;
- reduce: psum, then zeros on every rank but the root (jax_blink.reduce's result);
- all-gather: lax's tiled all-gather of the rank's shard along dimension 0 (the record's
  ``shard_input``: the primitive folds the gathered blocks to its output shape);
- reduce-scatter: lax's tiled reduce-scatter of the laid-out operand along dimension 0 (the record's
  ``shard_output``: the result is the rank's shard);
- broadcast: an all-gather of the operand, then the root's block (a copy: the root's bits; XLA has
  no broadcast collective on every platform).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .. import calibration, nccl_model
from .._jax_compat import all_gather_p, core, ir, lax_lowering_rule, lower_fun_plain, mlir, psum_p, reduce_scatter_p
from . import Lowering, register
from .ppermute import _position_p

NAME = "xla"


def axis_index_groups(mesh, axes: tuple, groups) -> list | None:
    """lax's ``axis_index_groups`` for the collective's ``groups`` (mesh-linear positions per group,
    rank order) over mesh ``axes``: each group's members as indices along ``axes`` (row-major over
    them), taken from the groups at the first combination of the other axes; None when every group is
    the whole of its axes (no groups)."""
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    dims = [names.index(a) for a in axes]
    others = [i for i in range(len(shape)) if i not in dims]
    size = math.prod(shape[d] for d in dims)
    out, first = [], None
    for members in groups:
        coords = [np.unravel_index(int(p), shape) for p in members]
        key = tuple(int(coords[0][i]) for i in others)
        first = key if first is None else first
        if key != first:
            continue
        out.append([int(np.ravel_multi_index([c[d] for d in dims], [shape[d] for d in dims])) for c in coords])
    if len(out) == 1 and out[0] == list(range(size)):
        return None
    return out


def _emit(prim, ctx, x, aval_in, aval_out, **params):
    rule = lax_lowering_rule(prim, ctx.module_context.platforms[0])
    out = rule(ctx.replace(primitive=None, avals_in=[aval_in], avals_out=[aval_out]), x, **params)
    return out if isinstance(out, ir.Value) else out[0]  # a list / OpResultList of one


def _plain(aval):
    return core.ShapedArray(aval.shape, aval.dtype)


def _keep_root(ctx, x, aval, keep):
    """``x`` on the ranks where ``keep`` (per mesh position) is set, zeros elsewhere."""
    def body(v):
        return jnp.where(jnp.asarray(keep)[_position_p.bind()] != 0, v, jnp.zeros_like(v))
    out, = lower_fun_plain(body, multiple_results=False)(ctx.replace(primitive=None, avals_in=[aval],
                                                                     avals_out=[aval]), x)
    return out


def xla_lowering(ctx, xs, request_for):
    """Registry rule (impl "xla", every platform): lax's collective op over the call's groups."""
    total = sum(int(np.prod(a.shape)) for a in ctx.avals_in)
    req = request_for(total, schedules=False)
    mesh = ctx.module_context.axis_context.mesh
    axes = tuple(req.axis_names)
    aig = axis_index_groups(mesh, axes, req.groups)
    n = len(req.groups[0])
    coll = req.collective
    outs = []
    for x, a_in, a_out in zip(xs, ctx.avals_in, ctx.avals_out):
        a_in, a_out = _plain(a_in), _plain(a_out)
        if coll in ("allreduce", "reduce"):
            y = _emit(psum_p, ctx, x, a_in, a_in, axes=axes, axis_index_groups=aig)
            if coll == "reduce":
                keep = np.zeros(mesh.size, np.int32)
                for members in req.groups:
                    keep[members[req.root or 0]] = 1
                y = _keep_root(ctx, y, a_in, keep)
        elif coll == "allgather":
            y = _emit(all_gather_p, ctx, x, a_in, a_out, all_gather_dimension=0, axis_name=axes,
                      axis_index_groups=aig, axis_size=n, tiled=True)
        elif coll == "reducescatter":
            y = _emit(reduce_scatter_p, ctx, x, a_in, a_out, scatter_dimension=0, axis_name=axes,
                      axis_index_groups=aig, axis_size=n, tiled=True)
        elif coll == "broadcast":
            m = int(np.prod(a_in.shape))
            flat = core.ShapedArray((m,), a_in.dtype)
            full = core.ShapedArray((n * m,), a_in.dtype)
            g = _emit(all_gather_p, ctx, mlir.reshape(ctx, x, flat), flat, full, all_gather_dimension=0,
                      axis_name=axes, axis_index_groups=aig, axis_size=n, tiled=True)
            r = int(req.root or 0)

            def pick(v, r=r, m=m, shape=a_in.shape):
                return v[r * m:(r + 1) * m].reshape(shape)
            y, = lower_fun_plain(pick, multiple_results=False)(
                ctx.replace(primitive=None, avals_in=[full], avals_out=[a_in]), g)
        else:  # pragma: no cover - the primitives bind only the collectives above
            raise NotImplementedError(f"impl='xla': no XLA lowering for {coll!r}")
        outs.append(y)
    return outs


#: Platforms whose XLA collective is NCCL (the tuner model predicts it).
NCCL_PLATFORMS = ("cuda", "gpu")


def xla_time_s(platform: str, collective: str, nbytes: float, group_size: int, topology=None, devices=None,
               cal: calibration.Calibration | None = None) -> tuple[float | None, str]:
    """Predicted seconds of XLA's collective at a call site and where the figure comes from: this
    machine's calibration (``cal``, :mod:`jax_blink.calibration`) when it has a fit for the collective
    and group size; else on GPUs NCCL's tuner model (:func:`jax_blink.nccl_model.predict`, its
    back-to-back time) over ``devices`` of ``topology``; else (None, why). Broadcast runs as an
    all-gather of ``group_size x nbytes`` (what this lowering emits), reduce as an all-reduce."""
    if cal is not None:
        t = cal.time_s(NAME, collective, group_size, nbytes)
        if t is not None:
            return t, "this machine's calibration"
    if platform not in NCCL_PLATFORMS:
        return None, f"no calibration of XLA's {platform} collectives here (run `jax-blink calibrate`)"
    if topology is None:
        return None, "no topology to model NCCL on"
    coll, size = {"broadcast": ("allgather", nbytes * group_size), "reduce": ("allreduce", nbytes)}.get(
        collective, (collective, nbytes))
    try:
        ch = nccl_model.predict(topology, coll, size, devices=devices)
    except ValueError as err:
        return None, f"NCCL's tuner model does not apply ({err})"
    if ch is None:
        return None, "the topology describes no GPUs (no NCCL to model)"
    return ch.steady_us * 1e-6, f"NCCL's tuner model: {ch.algorithm}/{ch.protocol}"


#: With both lowerings measured by ``jax-blink calibrate``, jax_blink keeps a call site only when its
#: measured time is this fraction below XLA's: repeated calibrations on a loaded 2-core machine moved a
#: 4 MiB all-reduce's ffi/xla ratio between 0.95 and 1.06 (benchmarks/cpu_never_slower.py).
MEASURED_TIE_MARGIN = 0.05


def decide(platform: str, collective: str, nbytes: float, group_size: int, blink_name: str,
           blink_predicted_s: float, topology=None, devices=None) -> tuple[bool, str]:
    """Whether ``impl="auto"`` hands a call site to XLA's collective instead of jax_blink's lowering
    ``blink_name`` (its cost model's ``blink_predicted_s``), and the reason (for ``explain`` and
    ``JAX_BLINK_LOG``). With a calibration of this machine holding fits of both lowerings, the fits
    decide; otherwise XLA's :func:`xla_time_s` against ``blink_predicted_s``. XLA takes the site when
    predicted strictly faster, and, where both times are measured, also when jax_blink is less than
    ``MEASURED_TIE_MARGIN`` faster (a tie within the measurement's noise goes to lax's own op)."""
    cal = calibration.load(platform)
    t_blink, how, margin = blink_predicted_s, "cost model", 0.0
    if cal is not None:
        fitted = cal.time_s(blink_name, collective, group_size, nbytes)
        if fitted is not None:
            t_blink, how = fitted, "this machine's calibration"
    t_xla, src = xla_time_s(platform, collective, nbytes, group_size, topology, devices, cal)
    if how != "cost model" and "calibration" in src:
        margin = MEASURED_TIE_MARGIN  # both measured: ties (within the noise) go to lax's own op
    note = "" if calibration.note() is None else f" ({calibration.note()})"
    if t_xla is None:
        return False, f"XLA's collective not modelled: {src}{note}"
    us = f"{nbytes:.0f} B: XLA {t_xla * 1e6:.3g} us ({src}) vs {blink_name} {t_blink * 1e6:.3g} us ({how})"
    if t_xla < t_blink:
        return True, f"auto: xla, XLA's collective predicted faster than every jax_blink plan at {us}{note}"
    if t_blink > t_xla * (1 - margin):
        return True, (f"auto: xla, jax_blink measured less than {margin:.0%} faster than XLA's collective "
                      f"(within the calibration's noise: lax's own op) at {us}{note}")
    return False, f"jax_blink predicted no slower than XLA at {us}{note}"


# step_latency_s only sizes the jax_blink schedule the call-site report describes beside it; XLA runs
# no schedule. Multi-process: XLA's collectives run across processes (gloo on CPU, NCCL on GPUs).
register(Lowering(NAME, None, xla_lowering, step_latency_s=5e-6, round_synchronous=False, multi_process=True,
                  shard_input=True, shard_output=True,
                  description="XLA's own collective (lax's op: NCCL on GPUs, XLA:CPU in host memory)"))
