"""Across processes: the native executor inside each process, XLA's own collective between them.

Blink's three phases (Wang et al., MLSys 2020, section 5) with one process per node. For a group
of ``N = P x L`` devices, ``L`` of them in each of ``P`` processes (local rank ``i`` = the ``i``-th
member of the group inside its process, in rank order):

- all-reduce (``psum``): (a) inside each process the native executor (``lowering.ffi``, the node's
  packing) reduce-scatters the bucket, so local rank ``i`` owns partition ``i`` (``ceil(n / L)``
  elements, the last one zero-padded: uneven partitions); (b) one XLA ``all-reduce`` on the
  partition, whose replica groups are the devices of one local position in every process (one
  replica group per partition; gloo on CPU, NCCL on GPU, scheduled by XLA like its own
  collectives); (c) the native executor all-gathers the partitions back.
- all-gather: (b) XLA ``all-gather`` of the shard over the devices of one local position, then (c)
  a native all-gather of those ``P`` shards inside the process, whose schedule runs over the blocks
  in (local rank, process) order while the CPU executor writes each block at its place in rank
  order (its ``block_order``: no reorder copy). reduce-scatter: the transpose: (a) native
  reduce-scatter inside the process, reading the blocks in (local rank, process) order from the
  rank-ordered operand, (b) XLA ``reduce-scatter`` over one local position (on CPU an XLA
  ``all-to-all`` of the ``P`` blocks and their sum in process order: see the gloo rules
  below). Where the executor
  cannot order the blocks itself (the CUDA executor; groups whose ranks lie over the processes in
  different orders), one XLA copy (``jnp.take``) reorders them.
- broadcast: (a) native broadcast inside each process from the root's local rank; (b) XLA
  ``all-reduce`` of each partition as unsigned integers with zeros from every process but the
  root's (so the root's bits arrive exactly, -0.0 and NaN payloads included); (c) native all-gather.
  reduce: the all-reduce phases, then zeros on every device but the root.

Network-phase results are the same on every member of a replica group (one XLA collective), and the
local phases copy them, so an all-reduce ends bitwise identical on every rank. With ``L = 1`` (one
device per process) only XLA's collective runs; with ``P = 1`` only the native phases.
Requirements (else :func:`fits` says why and ``impl="auto"`` keeps ``ppermute``): every group has
the same number ``L`` of devices in each of its processes and spans the same number of processes.

Device tables: each process's custom calls meet in its own memory; the local phases' requests
(``request_for(n, collective, by_process=True)``) list every process's part of every group, so that
every process lowers the same program (jaxlib 0.12.1's cross-process collectives hang when the
processes' programs differ: ``scripts/repro_jaxlib_0121_gloo_hang.py``), and a process's calls meet
only the groups of its own devices. Device ids are global in multi-process jobs, and XLA:CPU's FFI
device ordinal is the global ``Device.id`` (checked on 2 processes x 4 devices: ids 0-3 and
2048-2051). The CUDA table keeps this process's groups' rows (``lowering.ffi.cuda_device_table``).

Two gloo rules (XLA:CPU's cross-process collectives; the observations behind them:
docs/benchmarks-notes.md, "gloo on XLA:CPU"): the CPU form runs the network reduce-scatter as an
XLA all-to-all plus a local sum, because gloo's reduce-scatter stalls from ~128 KiB per partition
and slows the collectives after it on the same pairs; and XLA:CPU's gloo communicator sets no tags,
so two network phases of one kind on one replica group are matched by order alone: if gloo reports
mismatched sizes, order those phases by data (an optimization barrier does not: XLA:CPU drops it).
"""

from __future__ import annotations

import functools
import logging
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax_compat import SPMDAxisContext, core, hlo, ir, mlir
from ..errors import BlinkError
from . import Lowering, LoweringRequest, Site, find_lowering, network_phase, register
from . import ffi as _ffi
from .ppermute import _position_p

NAME = "hierarchical"
_log = logging.getLogger("jax_blink.lowering")


# ----------------------------------------------------------------------------- group layout
class Layout:
    """How the groups of a request lie over the processes.

    Attributes:
      procs: per group, its processes in increasing order (P of them).
      local: per group, ``{process: members in rank order}`` (L each; mesh positions).
      P, L: processes per group and devices per process per group.
      network: replica groups of the network phase (mesh positions): for each group and local rank
        ``i``, the ``i``-th member in each of its processes (process order).
    """

    def __init__(self, request: LoweringRequest, process_of):
        self.local, self.procs = [], []
        for members in request.groups:
            split: dict[int, list[int]] = {}
            for p in members:
                split.setdefault(int(process_of[p]), []).append(int(p))
            self.local.append(dict(sorted(split.items())))
            self.procs.append(sorted(split))
        why = layout_problem(request.groups, process_of)
        if why:
            raise BlinkError(f"jax_blink impl='hierarchical': {why}; use impl='ppermute' or impl='auto'")
        self.P = len(self.procs[0])
        self.L = len(request.groups[0]) // self.P
        self.network = [[loc[q][i] for q in procs] for loc, procs in zip(self.local, self.procs)
                        for i in range(self.L)]

    def rank_of(self, g: int, qi: int, i: int, members) -> int:
        """Rank (in group ``g``) of local rank ``i`` of the group's ``qi``-th process."""
        return members.index(self.local[g][self.procs[g][qi]][i])

    def block_order(self, request: LoweringRequest) -> np.ndarray:
        """int32 [ngroups, N]: ``order[g, j]`` = the rank whose block sits at ``j = i * P + qi`` of
        the (local rank, process) layout the phases produce (all-gather) or consume (reduce-scatter)."""
        out = np.zeros((len(request.groups), self.P * self.L), np.int32)
        for g, members in enumerate(request.groups):
            members = list(members)
            for i in range(self.L):
                for qi in range(self.P):
                    out[g, i * self.P + qi] = self.rank_of(g, qi, i, members)
        return out


def layout_problem(groups, process_of) -> str | None:
    """Why the groups cannot run hierarchically (None when they can): every group must have the
    same number of devices in each of its processes, and span the same number of processes."""
    shapes = set()
    for members in groups:
        counts: dict[int, int] = {}
        for p in members:
            counts[int(process_of[p])] = counts.get(int(process_of[p]), 0) + 1
        if len(set(counts.values())) != 1:
            return (f"a group has {sorted(counts.values())} devices in its processes {sorted(counts)}; the "
                    "three phases need the same number of the group's devices in every process")
        shapes.add((len(counts), next(iter(counts.values()))))
    if len(shapes) > 1:
        return f"the groups span different (processes, devices per process): {sorted(shapes)}"
    return None


def root_places(groups, process_of, root: int) -> set:
    """{(index of the root's process among its group's processes, the root's local rank)} over the groups."""
    places = set()
    for members in groups:
        procs = sorted({int(process_of[p]) for p in members})
        q = int(process_of[members[root]])
        local = [p for p in members if int(process_of[p]) == q]
        places.add((procs.index(q), local.index(members[root])))
    return places


def fits(site: Site | None) -> str | None:
    """``impl="auto"`` test (the record's ``auto_fits``): None when the hierarchical lowering is the
    choice at ``site``, else why not. Inside one process the native executor runs everything
    ("ffi"); across processes this lowering needs two or more of every group's devices in each
    process (with one device per process there is no intra-node phase: ``ppermute``)."""
    if site is None:
        return "the mesh lies in one process (the native executor runs the whole collective)"
    why = layout_problem(site.groups, site.process_of)
    if why:
        return why
    if site.root is not None and len(root_places(site.groups, site.process_of, site.root)) > 1:
        return "the root lies at different (process, local rank) places in different groups"
    members = site.groups[0]
    per = len(members) // len({site.process_of[p] for p in members})
    if per >= 2:
        return None
    # one device of each group per process: XLA's collective alone against the tree schedule on
    # collective_permute, as the cost model predicts them (NIC rates of the topology)
    if site.estimate is not None:
        xla, tree = site.estimate(NAME), site.estimate("ppermute")
        if xla < tree:
            _log.info("jax_blink impl='auto': one device per process; XLA's collective (%.1f us predicted at the "
                      "topology's NIC rates) beats the ppermute tree schedule (%.1f us)", xla * 1e6, tree * 1e6)
            return None
        return (f"one device of each group per process: no intra-node phase, and the ppermute tree schedule "
                f"({tree * 1e6:.1f} us predicted) is not slower than XLA's collective alone "
                f"({xla * 1e6:.1f} us{'' if xla < float('inf') else ': the topology has no network rates'})")
    return ("one device of each group per process: no intra-node phase (the portable ppermute lowering "
            "runs the tree schedule)")


# ----------------------------------------------------------------------------- XLA's collectives
def _channel(ctx) -> dict:
    axis_ctx = ctx.module_context.axis_context
    if isinstance(axis_ctx, SPMDAxisContext):
        return dict(channel_handle=hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID, mlir.DEVICE_TO_DEVICE_TYPE),
                    use_global_device_ids=ir.BoolAttr.get(True))
    return {}


def _groups_attr(groups) -> ir.DenseElementsAttr:
    return ir.DenseIntElementsAttr.get(np.ascontiguousarray(np.asarray(groups, np.int64)))


def _sum_region(op, element_type) -> None:
    scalar = ir.RankedTensorType.get([], element_type)
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        a, b = block.arguments  # the public API turns bool into int32: always a sum
        hlo.return_([hlo.add(a, b)])


def all_reduce(ctx, x, groups):
    """XLA ``all-reduce`` (sum) of ``x`` over ``groups`` (mesh positions; one replica group each)."""
    op = hlo.AllReduceOp([x.type], [x], replica_groups=_groups_attr(groups), **_channel(ctx))
    _sum_region(op, ir.RankedTensorType(x.type).element_type)
    return op.result


def all_gather(ctx, x, groups, n: int):
    """XLA ``all-gather`` of the 1-D ``x`` over ``groups`` (``n`` members each), member order."""
    t = ir.RankedTensorType(x.type)
    out = ir.RankedTensorType.get([t.shape[0] * n], t.element_type)
    return hlo.AllGatherOp([out], [x], all_gather_dim=mlir.i64_attr(0), replica_groups=_groups_attr(groups),
                           **_channel(ctx)).results[0]


def reduce_scatter(ctx, x, groups, n: int):
    """XLA ``reduce-scatter`` (sum) of the 1-D ``x`` over ``groups`` (``n`` members each): member k
    gets block k."""
    t = ir.RankedTensorType(x.type)
    out = ir.RankedTensorType.get([t.shape[0] // n], t.element_type)
    op = hlo.ReduceScatterOp(out, x, scatter_dimension=mlir.i64_attr(0), replica_groups=_groups_attr(groups),
                             **_channel(ctx))
    _sum_region(op, t.element_type)
    return op.result


def all_to_all(ctx, x, groups, n: int):
    """XLA ``all-to-all`` of the 1-D ``x`` ([n*m]) over ``groups`` (``n`` members each): member k
    sends its block j to member j and gets, as its block j, member j's block k (as ``lax.all_to_all``
    lowers it: a channel id in SPMD, groups = mesh positions)."""
    kw = {}
    if isinstance(ctx.module_context.axis_context, SPMDAxisContext):
        kw = dict(channel_handle=hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID, mlir.DEVICE_TO_DEVICE_TYPE))
    return hlo.AllToAllOp([x], split_dimension=mlir.i64_attr(0), concat_dimension=mlir.i64_attr(0),
                          split_count=mlir.i64_attr(n), replica_groups=_groups_attr(groups), **kw).results[0]


# ----------------------------------------------------------------------------- helpers
def _plain(shape, dtype):
    return core.ShapedArray(tuple(shape), dtype)


def _fun(ctx, f, ins, avals_in, aval_out):
    """Lower the jnp function ``f`` (one result) on ``ins`` in place."""
    out, = mlir.lower_fun(f, multiple_results=False)(
        ctx.replace(primitive=None, avals_in=list(avals_in), avals_out=[aval_out]), *ins)
    return out


def _funs(ctx, f, ins, avals_in, avals_out):
    return list(mlir.lower_fun(f, multiple_results=True)(
        ctx.replace(primitive=None, avals_in=list(avals_in), avals_out=list(avals_out)), *ins))


def _between(ctx, op: str, x, aval_in, aval_out, fn):
    """Phase (b): ``fn(x)``, XLA's collective ``op`` between the processes, as a named network phase
    (``lowering.network_phase``: the watch checks that every process arrives here)."""
    return network_phase(ctx, [x], [aval_in], [aval_out], f"(b) XLA {op} between processes",
                         lambda vs: [fn(vs[0])])[0]


def _me():
    return _position_p.bind()


def _native(ctx):
    rec = find_lowering("ffi", ctx.module_context.platforms[0])
    if rec is None:
        why = _ffi.UNAVAILABLE.get(ctx.module_context.platforms[0], "not registered for this platform")
        raise BlinkError(f"jax_blink impl='hierarchical' runs its intra-process phases on the native executor, "
                         f"which is unavailable here: {why}. Use impl='ppermute'")
    return rec


def _local_rank_table(layout: Layout, ndevices: int) -> np.ndarray:
    """int32 [ndevices]: each mesh position's local rank (position inside its process's part)."""
    t = np.zeros(ndevices, np.int32)
    for loc in layout.local:
        for members in loc.values():
            for i, p in enumerate(members):
                t[p] = i
    return t


def _ordered(block_order) -> dict:
    """The native rule's keyword for a block order (CPU executor only; None: none needed)."""
    return {} if block_order is None else {"block_order": block_order}


def _native_reduce_scatter(ctx, x, dtype, L, m, request_for, local_rank, block_order=None):
    """Native reduce-scatter of the flat [L*m] ``x`` over the process's part of each group -> [m].
    ``block_order``: the blocks of ``x`` the schedule reads as its virtual blocks (lowering.ffi)."""
    if L == 1:
        return x
    rec = _native(ctx)
    full, shard = _plain((L * m,), dtype), _plain((m,), dtype)

    def req(n):
        return request_for(n, "reducescatter", by_process=True, impl_="ffi")
    if rec.shard_output:
        out, = rec.rule(ctx.replace(avals_in=[full], avals_out=[shard]), [x], req, **_ordered(block_order))
        return out
    out, = rec.rule(ctx.replace(avals_in=[full], avals_out=[full]), [x], req)
    return _fun(ctx, lambda v: lax.dynamic_slice(v, (jnp.asarray(local_rank)[_me()] * m,), (m,)),
                [out], [full], shard)


def _native_all_gather(ctx, x, dtype, L, m, request_for, local_rank, block_order=None):
    """Native all-gather of the [m] ``x`` over the process's part of each group -> [L*m].
    ``block_order``: where the schedule's virtual blocks land in the result (lowering.ffi)."""
    if L == 1:
        return x
    rec = _native(ctx)
    full, shard = _plain((L * m,), dtype), _plain((m,), dtype)

    def req(n):
        return request_for(n, "allgather", by_process=True, impl_="ffi")
    if rec.shard_input:
        out, = rec.rule(ctx.replace(avals_in=[shard], avals_out=[full]), [x], req, **_ordered(block_order))
        return out
    placed = _fun(ctx, lambda v: lax.dynamic_update_slice(jnp.zeros((L * m,), v.dtype), v,
                                                           (jnp.asarray(local_rank)[_me()] * m,)),
                  [x], [shard], full)
    out, = rec.rule(ctx.replace(avals_in=[full], avals_out=[full]), [placed], req)
    return out


def _pack(ctx, xs, avals, total, dtype):
    """The bucket's leaves as one flat [total] buffer (zero-padded): a reshape for one leaf that fills it."""
    sizes = [math.prod(a.shape) for a in avals]
    if len(xs) == 1 and sizes[0] == total:
        return mlir.reshape(ctx, xs[0], _plain((total,), dtype))

    def f(*vs):
        flat = [v.reshape(-1) for v in vs]
        pad = total - sum(sizes)
        return jnp.concatenate(flat + ([jnp.zeros((pad,), dtype)] if pad else []))
    return _fun(ctx, f, xs, [_plain(a.shape, dtype) for a in avals], _plain((total,), dtype))


def _unpack(ctx, flat, avals, total, dtype):
    sizes = [math.prod(a.shape) for a in avals]
    if len(avals) == 1 and sizes[0] == total:
        return [mlir.reshape(ctx, flat, _plain(avals[0].shape, dtype))]

    def f(v):
        out, off = [], 0
        for a, n in zip(avals, sizes):
            out.append(v[off:off + n].reshape(a.shape))
            off += n
        return out
    return _funs(ctx, f, [flat], [_plain((total,), dtype)], [_plain(a.shape, dtype) for a in avals])


def _uint(dtype):
    """The unsigned integer dtype of ``dtype``'s width (bit-exact transport through a sum with zeros)."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


# ----------------------------------------------------------------------------- the rule
def hierarchical_lowering(ctx, xs, request_for):
    """Registry rule (impl "hierarchical"): the three phases above for one bucket (or, for the
    sharded collectives, the one operand: the shard for all-gather, the [n x shard] buffer for
    reduce-scatter, whose result is the rank's shard: the record's ``shard_input`` / ``shard_output``)."""
    mesh = ctx.module_context.axis_context.mesh
    process_of = [int(d.process_index) for d in mesh.devices.flat]
    avals = list(ctx.avals_in)
    dtype = avals[0].dtype
    sizes = [math.prod(a.shape) for a in avals]
    nreq = sum(max(math.prod(a.shape), math.prod(b.shape)) for a, b in zip(ctx.avals_in, ctx.avals_out))
    request = request_for(nreq, schedules=False)
    collective = request.collective
    layout = Layout(request, process_of)
    P, L = layout.P, layout.L
    local_rank = _local_rank_table(layout, mesh.size)
    if collective == "allgather":
        return [_all_gather_phases(ctx, xs[0], avals[0], ctx.avals_out[0], layout, request, request_for, local_rank)]
    if collective == "reducescatter":
        return [_reduce_scatter_phases(ctx, xs[0], avals[0], ctx.avals_out[0], layout, request, request_for,
                                       local_rank)]
    n = sum(sizes)
    m = -(-n // L)
    flat = _pack(ctx, xs, avals, L * m, dtype)
    part = _plain((m,), dtype)
    if collective in ("allreduce", "reduce"):
        mine = _native_reduce_scatter(ctx, flat, dtype, L, m, request_for, local_rank)
        if P > 1:
            mine = _between(ctx, "all-reduce", mine, part, part, lambda v: all_reduce(ctx, v, layout.network))
    elif collective == "broadcast":
        root = _root_rank(request)
        _, root_q, root_i = _root_place(layout, request, root)
        local = flat
        if L > 1:
            rec = _native(ctx)

            def req(k):
                return request_for(k, "broadcast", by_process=True, impl_="ffi", root_=root_i)
            full = _plain((L * m,), dtype)
            local, = rec.rule(ctx.replace(avals_in=[full], avals_out=[full]), [flat], req)
        mine = _fun(ctx, lambda v: lax.dynamic_slice(v, (jnp.asarray(local_rank)[_me()] * m,), (m,)),
                    [local], [_plain((L * m,), dtype)], part)
        if P > 1:
            mine = _broadcast_network(ctx, mine, dtype, m, layout, root_q, process_of)
    else:
        raise BlinkError(f"jax_blink impl='hierarchical' has no phases for {collective!r}")
    full = _native_all_gather(ctx, mine, dtype, L, m, request_for, local_rank)
    if collective == "reduce":
        keep = np.zeros(mesh.size, np.int32)
        root = _root_rank(request)
        for members in request.groups:
            keep[members[root]] = 1
        full = _fun(ctx, lambda v: jnp.where(jnp.asarray(keep)[_me()] != 0, v, jnp.zeros_like(v)),
                    [full], [_plain((L * m,), dtype)], _plain((L * m,), dtype))
    return _unpack(ctx, full, avals, L * m, dtype)


def _root_rank(request: LoweringRequest) -> int:
    return int(request.root or 0)


def _root_place(layout: Layout, request: LoweringRequest, root: int):
    """(group 0's root position, the root's process index within each group's processes, its local
    rank), the last two the same in every group (else BlinkError)."""
    places = set()
    for g, members in enumerate(request.groups):
        p = members[root]
        for qi, q in enumerate(layout.procs[g]):
            if p in layout.local[g][q]:
                places.add((qi, layout.local[g][q].index(p)))
    if len(places) != 1:
        raise BlinkError("jax_blink impl='hierarchical': the root lies at different (process, local rank) "
                         f"places in different groups {sorted(places)}; use impl='ppermute'")
    qi, i = places.pop()
    return request.groups[0][root], qi, i


def _broadcast_network(ctx, mine, dtype, m, layout, root_q, process_of):
    """The root's process's partition to every process: an integer all-reduce with zeros elsewhere
    (exact bits for any dtype)."""
    is_root = np.zeros(len(process_of), np.int32)
    for g, loc in enumerate(layout.local):
        for p in loc[layout.procs[g][root_q]]:
            is_root[p] = 1
    cplx = np.issubdtype(dtype, np.complexfloating)
    real = np.finfo(dtype).dtype if cplx else np.dtype(dtype)  # complex: its real and imaginary parts
    ut = _uint(real)
    k = 2 * m if cplx else m
    part, upart = _plain((m,), dtype), _plain((k,), ut)

    def to_bits(v):
        if cplx:
            v = jnp.concatenate([jnp.real(v), jnp.imag(v)])
        return jnp.where(jnp.asarray(is_root)[_me()] != 0, lax.bitcast_convert_type(v, ut), jnp.zeros((k,), ut))

    def from_bits(u):
        f = lax.bitcast_convert_type(u, real)
        return lax.complex(f[:m], f[m:]) if cplx else f
    bits = _fun(ctx, to_bits, [mine], [part], upart)
    got = _between(ctx, "all-reduce (broadcast bits)", bits, upart, upart, lambda v: all_reduce(ctx, v, layout.network))
    return _fun(ctx, from_bits, [got], [upart], part)


def _reorder(ctx, x, order_rows, nblocks, m, dtype, inverse: bool, group_of=()):
    """Blocks of the flat ``x`` ([nblocks*m]) moved between rank order and the phases' (local rank,
    process) order: out[rank] = x[j] (``inverse`` False, after an all-gather) or out[j] = x[rank]
    (``inverse`` True, before a reduce-scatter), where order_rows[g, j] = rank. ``group_of``: each
    mesh position's group (-1: none), for groups whose orders differ."""
    rows = np.asarray(order_rows)
    src = np.argsort(rows, axis=1) if not inverse else rows
    aval = _plain((nblocks * m,), dtype)
    if (src == np.arange(nblocks)).all():
        return x
    if (src == src[0]).all():
        idx = src[0]
        return _fun(ctx, lambda v: jnp.take(v.reshape(nblocks, m), jnp.asarray(idx), axis=0).reshape(-1),
                    [x], [aval], aval)
    # groups that lay their ranks over the processes differently: each device's own order
    table = np.zeros((len(group_of), nblocks), np.int32)
    for p, g in enumerate(group_of):
        table[p] = src[max(g, 0)]
    return _fun(ctx, lambda v: jnp.take(v.reshape(nblocks, m), jnp.asarray(table)[_me()], axis=0).reshape(-1),
                [x], [aval], aval)


def _group_of(request: LoweringRequest, ndevices: int) -> list:
    out = [-1] * ndevices
    for g, members in enumerate(request.groups):
        for p in members:
            out[p] = g
    return out


def _executor_order(ctx, order_rows, L) -> np.ndarray | None:
    """The block order the native executor applies itself (one row for every group, the CPU
    executor, a shard-form call): then no XLA reorder copy is needed. None otherwise."""
    rows = np.asarray(order_rows)
    if L == 1 or not (rows == rows[0]).all() or (rows[0] == np.arange(rows.shape[1])).all():
        return None
    rec = _native(ctx)
    if rec.platform != "cpu" or not (rec.shard_input and rec.shard_output):
        return None
    return rows[0].astype(np.int64)


def _all_gather_phases(ctx, x, aval_in, aval_out, layout, request, request_for, local_rank):
    P, L = layout.P, layout.L
    dtype = aval_in.dtype
    m = math.prod(aval_in.shape)
    v = mlir.reshape(ctx, x, _plain((m,), dtype))
    if P > 1:  # [P*m]: process order
        v = _between(ctx, "all-gather", v, _plain((m,), dtype), _plain((P * m,), dtype),
                     lambda u: all_gather(ctx, u, layout.network, P))
    order = layout.block_order(request)
    placed = _executor_order(ctx, order, L)  # the executor writes the blocks in rank order itself
    v = _native_all_gather(ctx, v, dtype, L, P * m, request_for, local_rank, placed)  # [L*P*m]: (i, qi)
    if placed is None:
        v = _reorder(ctx, v, order, P * L, m, dtype, inverse=False,
                     group_of=_group_of(request, ctx.module_context.axis_context.mesh.size))
    return mlir.reshape(ctx, v, _plain(aval_out.shape, dtype))


def _reduce_scatter_phases(ctx, x, aval_in, aval_out, layout, request, request_for, local_rank):
    P, L = layout.P, layout.L
    dtype = aval_in.dtype
    n = math.prod(aval_in.shape)
    m = n // (P * L)
    v = mlir.reshape(ctx, x, _plain((n,), dtype))
    order = layout.block_order(request)
    placed = _executor_order(ctx, order, L)  # the executor reads the blocks in (i, qi) order itself
    if placed is None:
        v = _reorder(ctx, v, order, P * L, m, dtype, inverse=True,
                     group_of=_group_of(request, ctx.module_context.axis_context.mesh.size))  # (i, qi) order
    v = _native_reduce_scatter(ctx, v, dtype, L, P * m, request_for, local_rank, placed)  # [P*m]
    if P > 1 and ctx.module_context.platforms[0] == "cpu":
        # gloo: XLA:CPU's reduce-scatter stalls itself and later collectives (module docstring,
        # "gloo's reduce-scatter"); an all-to-all of the P blocks (the same bytes), then their sum
        full = _plain((P * m,), dtype)
        v = _between(ctx, "all-to-all (reduce-scatter)", v, full, full, lambda u: all_to_all(ctx, u, layout.network, P))
        v = _fun(ctx, lambda u: functools.reduce(lambda a, b: a + b, [u[k * m:(k + 1) * m] for k in range(P)]),
                 [v], [full], _plain((m,), dtype))
    elif P > 1:
        v = _between(ctx, "reduce-scatter", v, _plain((P * m,), dtype), _plain((m,), dtype),
                     lambda u: reduce_scatter(ctx, u, layout.network, P))
    return mlir.reshape(ctx, v, _plain(aval_out.shape, dtype))



# XLA's collective per network phase plus the native phases; the cost model sees its intra-node
# steps at the native executor's step latency (its local requests are the "ffi" record's).
# One record per platform of the native executor, unavailable (saying why) where its target is.
for _platform in ("cpu", "cuda"):
    _why = _ffi.UNAVAILABLE.get(_platform)
    register(Lowering(NAME, _platform, hierarchical_lowering, step_latency_s=5e-6, round_synchronous=False,
                      multi_process=True, auto_priority=0, auto_allowed=_ffi.native_auto_allowed, auto_fits=fits,
                      shard_input=True, shard_output=True, watches_phases=True,
                      description="native trees inside each process, XLA's collective between processes",
                      unavailable=None if _why is None else f"its intra-process phases need the native executor: "
                                                            f"{_why}"))
