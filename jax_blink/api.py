"""Public collectives: ``psum``, ``pmean``, ``broadcast``, ``reduce``, ``all_gather``, ``psum_scatter``
(drop-ins for ``jax.lax``).

Inside ``jax.pmap`` / ``jax.shard_map`` (check_vma on or off) / ``vmap(axis_name=...)``. The data
moves along a tree packing of the machine's topology (Blink, Wang et al., MLSys 2020, sections 3-4):
``jax_blink.plan`` -> ``jax_blink.schedule.build_schedule`` -> a lowering from
``jax_blink.lowering`` ("ppermute": rounds of collective_permute; "ffi": native custom call).

Leaves of one dtype (and one varying-axes type) form one bucket and one collective (one native call
over the leaves where they are, results aliased to operands), so a parameter tree costs one
collective per dtype and no concatenate / slice copies.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import (
    collectives,
    lowering,
    mapping,
    primitives,  # registers the lowerings (ppermute, ffi where built)
)
from ._jax_compat import (
    ALL_GATHER_TO,
    ALL_GATHER_TO_NEEDS_VMA,
    abstract_mesh,
    auto_pcast,
    check_vma,
    core,
    dtypes,
    get_from,
    lax_const,
    skip_one_sized_axes,
    validate_axis_index_groups,
)
from .errors import TopologyError
from .lowering import ffi as _ffi_lowering

_SUPPORTED = {np.dtype(t) for t in (
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)} | {np.dtype(dtypes.bfloat16)}


def _axes(axis_name) -> tuple:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if any(isinstance(a, int) for a in axes):
        raise TypeError(f"jax_blink collectives take named axes only, got positional axis in {axes}")
    repeated = sorted({str(a) for a in axes if axes.count(a) > 1})
    if repeated:
        raise ValueError(f"jax_blink collectives take each axis once, got {axes} (repeated: {', '.join(repeated)}); "
                         "name every mesh axis of the group once")
    return axes


def impls() -> list[str]:
    """The ``impl`` values the collectives take: "auto" and every lowering name of the registry
    (``jax_blink.lowering``; a name whose native target is missing here fails at lowering, saying why)."""
    return sorted({"auto", *lowering.names()})


def export_checks() -> list:
    """The ``disabled_checks`` that ``jax.export.export`` needs for a function using jax_blink:
    ``jax.export.export(jax.jit(f), disabled_checks=jax_blink.export_checks())(*args)``.

    jax.export refuses custom calls whose targets carry no compatibility guarantee, as jax_blink's
    native targets (``jax_blink_cpu``, ``jax_blink_cuda``, lowering ``impl="ffi"``) do not: the
    exported module holds the schedules planned at export time (for the mesh's devices and the
    topology then) in the native executor's format. So call a deserialized export with the same
    jax_blink version, after ``import jax_blink`` in that process (importing registers the targets;
    without it XLA fails to compile the custom call), on as many devices as the mesh had.
    ``impl="ppermute"`` exports without disabled checks (plain ``collective_permute``s, portable
    across versions). Returns a list of ``jax.export.DisabledSafetyCheck`` (one per native target).
    """
    targets = (_ffi_lowering.CPU_TARGET, _ffi_lowering.CUDA_TARGET)
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]


def deserialize(blob):
    """``jax.export.deserialize(blob)`` with jax_blink's native targets registered first (they register
    when jax_blink's collectives are imported, which ``import jax_blink`` alone does not do), so the
    result's ``.call(...)`` finds them. ``blob``: bytes / bytearray from ``Exported.serialize()`` of
    a function exported with :func:`export_checks`. Returns the ``jax.export.Exported``."""
    return jax.export.deserialize(bytearray(blob))


def _impl(impl) -> str:
    impl = "auto" if impl is None else impl
    if impl not in impls():
        raise ValueError(f"impl must be one of {impls()} or None, got {impl!r}")
    return impl


def _check_dtype(dtype, api) -> None:
    if np.dtype(dtype) not in _SUPPORTED:
        raise TypeError(f"{api} does not support dtype {np.dtype(dtype).name}; supported: bool, int8..int64, "
                        "uint8..uint64, float16, bfloat16, float32, float64, complex64, complex128 (cast a "
                        "float8 or int4 operand to bfloat16 / int8 first and back after, or use jax.lax for it)")


def _prepare(x, axes, api):
    """Flatten the pytree, bool -> int32, check dtypes; (leaves, treedef, all_constant)."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    out = []
    for leaf in leaves:
        dt = dtypes.dtype(leaf)
        if dt == np.bool_:
            leaf = lax.convert_element_type(leaf, np.int32)
        else:
            _check_dtype(dt, api)
        out.append(leaf)
    return out, treedef, all(not isinstance(leaf, core.Tracer) for leaf in out)


def _vary(leaf, axes):
    """Under check_vma, make ``leaf`` varying over ``axes`` as lax's collectives do (pvary, when
    ``jax_auto_pcast`` is on; lax's typing rules then reject an operand that is still invariant)."""
    if not check_vma() or not auto_pcast():
        return leaf
    missing = tuple(a for a in axes if a not in core.typeof(leaf).mat.varying)
    return core.pvary(leaf, axis_name=missing) if missing else leaf


def _unreduced(leaf, axes, api) -> bool:
    """True when ``leaf`` is unreduced over ``axes`` (lax's typing, check_vma on): the collective then
    takes the sum of the unreduced partial values (lax's unreduced_psum / unreduced_psum_scatter) and
    the operand is not pvaried. ValueError (lax's) when the axes' states disagree."""
    return check_vma() and get_from(core.typeof(leaf), axes, api) == "unreduced"


def _bucketed(leaves, axes, bind, api="jax_blink.psum", unreduced_bind=None):
    """Apply ``bind`` (leaves -> results) once per (dtype, vma) bucket of leaves; leaves unreduced over
    ``axes`` go to ``unreduced_bind`` instead, as they are (not pvaried).

    The leaves go to the primitive as they are: its lowering runs one schedule over their virtual
    concatenation (one custom call, or per-leaf collective_permutes), so no concatenate / slice copies.
    """
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    unred = [unreduced_bind is not None and _unreduced(leaf, axes, api) for leaf in leaves]
    leaves = [leaf if u else _vary(leaf, axes) for leaf, u in zip(leaves, unred)]
    buckets: dict = {}
    for i, leaf in enumerate(leaves):
        aval = core.typeof(leaf)
        buckets.setdefault((unred[i], aval.dtype, frozenset(aval.mat.varying), frozenset(aval.mat.unreduced)),
                           []).append(i)
    out = [None] * len(leaves)
    for (u, *_), idx in buckets.items():
        for i, r in zip(idx, (unreduced_bind if u else bind)(*[leaves[i] for i in idx])):
            out[i] = r
    return out


def _check_operand(x, api) -> None:
    """Raise lax's kind of TypeError ("... is not a valid JAX type") for a leaf of ``x`` that is not an
    array or a number (a str such as a dtype name, bytes, an arbitrary object), before anything else
    touches it. For every public collective (``api`` names it in the message)."""
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, (str, bytes)) or not core.valid_jaxtype(leaf):
            raise TypeError(f"{api}: argument {leaf!r} of type {type(leaf)} is not a valid JAX type; "
                            "pass arrays or numbers (a pytree of them)")


def _check_topology(key, axes, api) -> None:
    """Check at trace time what ``key`` lets us check without the mesh's devices: that a named
    topology loads, and that it has a GPU for every device of the collective's axes (and of the
    whole mesh, whose devices must map to distinct GPUs). Raises TopologyError saying what to pass;
    the rest (device ids, the device map) is checked at lowering."""
    spec = key.topology
    if spec is None:
        return
    try:
        topo = mapping.named_topology(spec)
    except TopologyError as err:
        raise TopologyError(f"{api}: topology={spec!r}: {err}") from None
    mesh = abstract_mesh()
    if mesh is None or not set(axes) <= set(mesh.axis_names):
        return  # a vmap axis is not devices: nothing to count
    sizes = {"axes " + ", ".join(map(repr, axes)): math.prod(primitives.axis_sizes(axes)),
             "the mesh": math.prod(mesh.axis_sizes)}
    where, n = max(sizes.items(), key=lambda kv: kv[1])
    ngpus = len(topo.gpus)
    if n > ngpus:
        raise TopologyError(
            f"{api}: topology {topo.name!r} has {ngpus} GPUs but {where} span {n} devices, and each device "
            f"needs its own GPU of the topology; pass a topology with >= {n} GPUs (e.g. topology='host{n}' "
            "on CPU devices, or a machine preset / file of this machine), or leave topology unset to use "
            "the detected one")


def _check_root(root, size, axes, api) -> int:
    """``root`` as an int rank in [0, size); TypeError for a non-integer (a str, a float, a traced
    value), ValueError for a rank out of range."""
    if isinstance(root, core.Tracer):
        raise TypeError(f"{api}: root must be a static Python int (a rank over axes {axes}), got a traced "
                        "value; pass it as a Python int (mark it static under jit)")
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{api}: root must be an int rank in [0, {size}) over axes {axes}, got {root!r} "
                        f"of type {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"{api}: root must be a rank in [0, {size}) over axes {axes}, got {root!r}")
    return int(root)


def _groups(axis_index_groups):
    if axis_index_groups is None:
        return None
    validate_axis_index_groups(axis_index_groups)
    return tuple(tuple(int(i) for i in g) for g in axis_index_groups)


def psum(x, axis_name, *, axis_index_groups=None, topology=None, impl=None, device_map=None,
         chunk_elems=None, algorithm=None, max_trees=None):
    """All-reduce sum of ``x`` over mapped axis ``axis_name`` along a tree packing (drop-in for ``lax.psum``).

    Args:
      x: pytree of arrays (any shape, including zero-size) or Python scalars. bool becomes int32;
        integer sums wrap like lax. Dtypes: bool, int8..int64, uint8..uint64, float16, bfloat16,
        float32, float64, complex64, complex128. float16/bfloat16 partial sums are rounded to the
        operand dtype at every tree hop (as NCCL's reductions do); XLA:CPU's all-reduce rounds once,
        so on CPU bf16 results differ from ``lax.psum``: each hop's rounding is half an ulp of that
        partial sum, which is many ulps of a final sum that cancels (up to 16 seen on 8 ranks of
        normal values). Cast to float32 first for float32 accumulation.
      axis_name: a mesh / pmap / vmap axis name or a tuple of them (size-1 axes are skipped as lax does).
      axis_index_groups: like ``lax.psum`` (not with ``check_vma=True``, as lax).
      topology: a ``Topology``, preset name or file path; default ``$JAX_BLINK_TOPOLOGY``, else
        detected (GPU) or ``Topology.host(n)`` (CPU). See ``jax_blink.mapping``.
      impl: "auto" (default: "ffi" where registered, else "ppermute"), "ppermute" or "ffi".
      device_map: ``{device.id: topology GPU}`` or callable; default ``jax_blink.set_device_map``'s or ids.
      chunk_elems: fixed pipeline chunk in elements (default: the schedule's cost model).
      max_trees: plan with at most this many trees (``jax_blink.plan(max_trees=)``); default None: the
        tree count and chunks with the least predicted time for this operand size and lowering
        (``jax_blink.costmodel``: few trees for small, latency-bound operands).
      algorithm: the planner's algorithm (``jax_blink.plan``): "auto" (fastest predicted),
        "trees", "ring" or "hierarchical" (Blink's three phases, section 5: needs every group to span
        two or more nodes of a multi-node topology). Default ``$JAX_BLINK_ALGORITHM``, else "auto".

    Returns: same structure/shapes as ``x``; every device holds bitwise-identical sums (all receive
    the tree roots' results). Under ``check_vma=True`` the result is invariant over ``axis_name``; a
    leaf unreduced over it (lax's ``{U: axes}`` types, explicit-sharding FSDP) is summed as it is, not
    pvaried (lax's unreduced_psum; its transpose is ``preduced``). Source: Blink (MLSys 2020) section 4:
    reduce then broadcast on the same packed spanning trees.
    Raises, when called (while tracing): NameError for an unbound axis; TypeError for a leaf that is
    not a valid JAX type (a str, a dtype name) or an unsupported dtype; ValueError for an unknown
    ``impl`` / ``algorithm`` or a bad ``chunk_elems`` / ``max_trees``; TopologyError for a
    ``topology`` (or ``$JAX_BLINK_TOPOLOGY``) that does not load or has fewer GPUs than the mesh has
    devices. At lowering: TopologyError / PlanError / BlinkError when the mesh's devices do not map
    onto the topology's GPUs.

    Example on 8 host CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before
    jax starts), under ``pmap`` and under ``jit(shard_map)`` with the DGX-1V's plan::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> import jax_blink
        >>> jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")(jnp.arange(8.0).reshape(8, 1)).ravel()
        Array([28., 28., 28., 28., 28., 28., 28., 28.], dtype=float32)
        >>> mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
        >>> f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "data", topology="dgx1v"), mesh=mesh,
        ...                           in_specs=P("data"), out_specs=P()))
        >>> f(jnp.arange(16.0))
        Array([56., 64.], dtype=float32)
    """
    _check_operand(x, "jax_blink.psum")
    axes = skip_one_sized_axes(_axes(axis_name))
    if not axes:
        return x
    primitives.check_axis_names(axes, "jax_blink.psum")
    groups = _groups(axis_index_groups)
    size = math.prod(primitives.axis_sizes(axes))
    if groups is not None and sorted(i for g in groups for i in g) != list(range(size)):
        raise ValueError(f"jax_blink.psum: axis_index_groups {[list(g) for g in groups]} must cover every "
                         f"index of axes {axes} (size {size}) exactly once")
    impl = _impl(impl)
    key = mapping.make_plan_key(topology, device_map, chunk_elems, algorithm, max_trees)
    _check_topology(key, axes, "jax_blink.psum")
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return jax.tree_util.tree_unflatten(treedef, psum_leaves(leaves, axes, groups, impl, key))


def psum_leaves(leaves, axes: tuple, groups, impl: str, key) -> list:
    """:func:`psum` of a list of leaves with checked arguments: ``axes`` (bound, size-1 axes
    skipped), ``groups`` (tuple of tuples or None), ``impl`` (a valid name), ``key`` (a
    ``mapping.PlanKey``). One primitive bind per (dtype, varying axes) bucket of the leaves, so one
    call of the lowering each. Returns the results in leaf order. ``jax_blink.transform`` calls it
    with the operands of several combined psums."""
    leaves, _, constant = _prepare(list(leaves), axes, "jax_blink.psum")
    if constant:
        size = len(groups[0]) if groups is not None else math.prod(primitives.axis_sizes(axes))
        return [lax_const(leaf, size) * leaf for leaf in leaves]
    unreduced_bind = None
    if check_vma():
        if groups is not None:
            raise NotImplementedError("axis_index_groups is not supported with shard_map(check_vma=True) "
                                      "(as lax.psum); use check_vma=False")
        bind = functools.partial(primitives.blink_psum_invariant_p.bind, axes=axes, impl=impl, key=key)
        unreduced_bind = functools.partial(primitives.blink_unreduced_psum_p.bind, axes=axes, impl=impl, key=key)
    else:
        bind = functools.partial(primitives.blink_psum_p.bind, axes=axes, impl=impl, key=key, axis_index_groups=groups)
    return _bucketed(leaves, axes, bind, "jax_blink.psum", unreduced_bind)


def pmean(x, axis_name, *, axis_index_groups=None, topology=None, impl=None, device_map=None,
          chunk_elems=None, algorithm=None, max_trees=None):
    """Mean over ``axis_name``: ``psum(x) / axis size`` (like ``lax.pmean``; ints become floats).

    Same arguments and errors as :func:`psum`.
    """
    s = psum(x, axis_name, axis_index_groups=axis_index_groups, topology=topology, impl=impl,
             device_map=device_map, chunk_elems=chunk_elems, algorithm=algorithm, max_trees=max_trees)
    axes = _axes(axis_name)
    n = len(axis_index_groups[0]) if axis_index_groups is not None else math.prod(primitives.axis_sizes(axes))
    return jax.tree_util.tree_map(lambda v: v / n, s)


def _rooted(prim_name, x, axis_name, root, topology, impl, device_map, chunk_elems, algorithm,
            max_trees=None):
    api = f"jax_blink.{prim_name}"
    _check_operand(x, api)
    axes = skip_one_sized_axes(_axes(axis_name))
    if not axes:
        return x
    primitives.check_axis_names(axes, api)
    root = _check_root(root, math.prod(primitives.axis_sizes(axes)), axes, api)
    impl = _impl(impl)
    key = mapping.make_plan_key(topology, device_map, chunk_elems, algorithm, max_trees)
    _check_topology(key, axes, api)
    if key.algorithm == "ring" and key.algorithm_strict:
        raise ValueError(f"{api}: algorithm 'ring' is an all-reduce algorithm; use "
                         "'auto', 'trees' or 'hierarchical'")
    leaves, treedef, constant = _prepare(x, axes, api)
    prim = {"broadcast": primitives.blink_broadcast_p, "reduce": primitives.blink_reduce_p}[prim_name]
    copies_only = not collectives.get(prim_name).reduces
    vma = bool(check_vma())
    if copies_only:
        # broadcast moves values without adding: a bool operand stays bool (prepared as int32).
        was_bool = [dtypes.dtype(leaf) == np.bool_ for leaf in jax.tree_util.tree_leaves(x)]
        if constant:
            out = [jnp.asarray(leaf, bool) if b else leaf for leaf, b in zip(leaves, was_bool)]
            return jax.tree_util.tree_unflatten(treedef, out)
    bind = functools.partial(prim.bind, axes=axes, root=root, impl=impl, key=key, vma=vma)
    out = _bucketed(leaves, axes, bind)
    if copies_only:
        out = [lax.convert_element_type(o, np.bool_) if b else o for o, b in zip(out, was_bool)]
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast(x, axis_name, root=0, *, topology=None, impl=None, device_map=None, chunk_elems=None,
              algorithm=None, max_trees=None):
    """Every device along ``axis_name`` gets the operand of rank ``root`` (Blink section 3, broadcast trees).

    Args: ``x`` pytree (dtypes kept, bool included); ``root`` rank over ``axis_name`` (row-major
    over a tuple, as ``lax.axis_index``); other arguments as :func:`psum`. Under ``check_vma=True`` the result is
    invariant over ``axis_name``. ``algorithm``: as :func:`psum` except "ring" (ValueError).
    Raises TypeError for a root that is not a static int, ValueError for a root out of range, plus
    :func:`psum`'s errors.
    """
    return _rooted("broadcast", x, axis_name, root, topology, impl, device_map, chunk_elems, algorithm,
                   max_trees)


def reduce(x, axis_name, root=0, *, topology=None, impl=None, device_map=None, chunk_elems=None,
           algorithm=None, max_trees=None):
    """Sum over ``axis_name`` on rank ``root``, zeros on every other device (Blink reduce trees).

    Arguments and errors as :func:`broadcast`. bool becomes int32; integer sums wrap.
    """
    return _rooted("reduce", x, axis_name, root, topology, impl, device_map, chunk_elems, algorithm,
                   max_trees)


def _sharded_setup(x, axis_name, axis_index_groups, api, impl, topology, device_map, chunk_elems, algorithm,
                   max_trees):
    """(leaves, treedef, bind params) of a sharded collective; lax's errors for bad groups; the call-time
    operand and topology checks of :func:`psum`."""
    _check_operand(x, api)
    axes = _axes(axis_name)
    primitives.check_axis_names(axes, api)
    groups = _groups(axis_index_groups)
    size = math.prod(primitives.axis_sizes(axes))
    if groups is not None:
        if sorted(i for g in groups for i in g) != list(range(size)):
            raise ValueError(f"{api}: axis_index_groups {[list(g) for g in groups]} must cover every index of "
                             f"axes {axes} (size {size}) exactly once")
        size = len(groups[0])
    key = mapping.make_plan_key(topology, device_map, chunk_elems, algorithm, max_trees)
    _check_topology(key, axes, api)
    leaves, treedef = _sharded_leaves(x, axes, api)
    params = dict(axes=axes, impl=_impl(impl), key=key, axis_index_groups=groups, axis_size=size,
                  vma=bool(check_vma()))
    return leaves, treedef, params


def _static_int(value, name, api) -> int:
    """``value`` as a Python int (an operator.index-able static value, not a bool); TypeError naming
    ``name`` otherwise (lax's shape arguments are static ints too)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{api}: {name} must be a static int, got {value!r} of type {type(value).__name__}")
    return operator.index(value)


def _sharded_leaves(x, axes, api):
    """Leaves as arrays (bool kept), dtypes checked; pvarying them is each collective's business."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    out = []
    for leaf in leaves:
        leaf = jnp.asarray(leaf)
        if leaf.dtype != np.bool_:
            _check_dtype(leaf.dtype, api)
        out.append(leaf)
    return out, treedef


def _gather_to(to, groups, api) -> str:
    """``to=`` of :func:`all_gather` checked as the installed ``lax.all_gather`` checks it."""
    if ALL_GATHER_TO is None:
        if to is not None:
            raise TypeError(f"{api}() got an unexpected keyword argument 'to' (lax.all_gather of the installed "
                            "jax has none)")
        return "varying"
    to = "varying" if to is None else to
    if to not in ALL_GATHER_TO:
        raise ValueError(f"{api}: got unexpected `to` value {to!r}; allowed `to` values are: {set(ALL_GATHER_TO)}")
    if ALL_GATHER_TO_NEEDS_VMA and not check_vma():
        return "varying"  # lax (jax 0.12) ignores ``to`` without varying-axes typing
    if to != "varying" and groups is not None:
        raise NotImplementedError(f"{api}: axis_index_groups is not supported with to={to!r} (as lax.all_gather)")
    return to


def all_gather(x, axis_name, *, axis=0, tiled=False, axis_index_groups=None, to=None, topology=None, impl=None,
               device_map=None, chunk_elems=None, algorithm=None, max_trees=None):
    """Gather every rank's ``x`` over ``axis_name`` along tree packings (drop-in for ``lax.all_gather``).

    Each rank's shard is broadcast from its owner along that owner's trees of an all-gather packing
    (ForestColl, Zhao et al. 2024, section 3: per-root trees with equal rate, reaching the cut bound).

    Args:
      x: pytree of arrays (any shape, including zero-size). Dtypes: bool (kept bool), int8..int64,
        uint8..uint64, float16, bfloat16, float32, float64, complex64, complex128.
      axis_name: a mesh / pmap / vmap axis name or a tuple of them (rank = ``lax.axis_index(axes)``).
      axis: where the gathered axis goes: non-tiled, a new axis of size n at position ``axis`` of the
        output (in [-(ndim+1), ndim]); tiled, the operand's ``axis`` is concatenated (size * n).
      tiled: as ``lax.all_gather``.
      axis_index_groups: like ``lax.all_gather`` (check_vma on or off; not with ``to`` other than "varying").
      to: the result's type over ``axis_name`` under ``check_vma=True``, as ``lax.all_gather``'s ``to``
        where the installed jax has it (jax 0.10.2: "varying" (default), "invarying": the same gathered
        value typed invariant, transpose a local slice; "reduced": typed reduced, transpose a
        reduce-scatter of an unreduced cotangent). None: the default.
      topology, impl, device_map, chunk_elems, algorithm, max_trees: as :func:`psum` (algorithm
        "auto", "trees" or "ring").

    Returns: per leaf, the gathered array, bitwise identical to ``lax.all_gather`` (data is only
    copied). Under ``check_vma=True`` it stays varying over ``axis_name`` (as lax), or is typed as ``to``.
    Raises NameError for an unbound axis, TypeError for an unsupported dtype (or ``to`` where the
    installed lax has none), ValueError for an ``axis`` out of range, bad ``axis_index_groups`` or an
    unknown ``to`` (NotImplementedError: groups with ``to`` not "varying", as lax), TopologyError /
    PlanError / BlinkError at lowering when the topology does not cover the mesh devices.
    """
    api = "jax_blink.all_gather"
    leaves, treedef, params = _sharded_setup(x, axis_name, axis_index_groups, api, impl, topology, device_map,
                                             chunk_elems, algorithm, max_trees)

    axis = _static_int(axis, "axis", api)
    to = _gather_to(to, params["axis_index_groups"], api)
    prim = {"varying": primitives.blink_all_gather_p, "invarying": primitives.blink_all_gather_invariant_p,
            "reduced": primitives.blink_all_gather_reduced_p}[to]
    axes = params["axes"]

    def one(leaf):
        nd = leaf.ndim if tiled else leaf.ndim + 1
        if not -nd <= axis < nd:
            raise ValueError(f"{api}: axis {axis} is out of range for an operand of {leaf.ndim} dimension(s) "
                             f"(tiled={tiled}: expected in [{-nd}, {nd}))")
        dim = axis % nd
        if tiled and leaf.ndim == 0:
            raise ValueError(f"{api}: tiled=True needs an operand with at least one dimension")
        was_bool = leaf.dtype == np.bool_
        v = lax.convert_element_type(leaf, np.uint8) if was_bool else leaf
        if to != "reduced":  # lax's all_gather_reduced takes its operand as it is
            v = _vary(v, axes)
        out = prim.bind(v, tiled=bool(tiled), all_gather_dimension=dim, **params)
        return lax.convert_element_type(out, np.bool_) if was_bool else out

    return jax.tree_util.tree_unflatten(treedef, [one(leaf) for leaf in leaves])


def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False, axis_index_groups=None, topology=None,
                 impl=None, device_map=None, chunk_elems=None, algorithm=None, max_trees=None):
    """Sum ``x`` over ``axis_name`` and keep this rank's block (drop-in for ``lax.psum_scatter``).

    Block r of the sum is reduced to rank r along r's trees of a reduce-scatter packing (the
    all-gather packing reversed; ForestColl, Zhao et al. 2024, section 3).

    Args:
      x: pytree of arrays. bool becomes int32 (as :func:`psum`); integer sums wrap; float16/bfloat16
        partial sums are rounded at every tree hop (see :func:`psum`).
      axis_name: as :func:`all_gather`.
      scatter_dimension: the operand dimension split into n blocks (rank r keeps block r).
      tiled: False: that dimension must have size n and is removed; True: its size must be divisible
        by n and becomes size / n.
      axis_index_groups: like ``lax.psum_scatter`` (check_vma on or off).
      topology, impl, device_map, chunk_elems, algorithm, max_trees: as :func:`all_gather`.

    Returns: per leaf, this rank's block of the sum (equal to ``lax.psum_scatter``: bitwise for
    integers, up to summation order for floats). Under ``check_vma=True`` it stays varying (as lax);
    an operand unreduced over ``axis_name`` (lax's ``{U: axes}`` types) is summed as it is and the
    result is varying (lax's unreduced_psum_scatter; its transpose an all-gather to a reduced type).
    Raises ValueError when ``scatter_dimension`` is out of range (lax: an IndexError), or (as lax) its
    size is not divisible by the axis size (tiled) or differs from it (not tiled); otherwise
    :func:`all_gather`'s errors.
    """
    api = "jax_blink.psum_scatter"
    leaves, treedef, params = _sharded_setup(x, axis_name, axis_index_groups, api, impl, topology, device_map,
                                             chunk_elems, algorithm, max_trees)

    scatter_dimension = _static_int(scatter_dimension, "scatter_dimension", api)

    def one(leaf):
        if leaf.dtype == np.bool_:
            leaf = lax.convert_element_type(leaf, np.int32)
        dim = scatter_dimension
        if leaf.ndim and -leaf.ndim <= dim < 0:
            dim %= leaf.ndim
        primitives.reduce_scatter_shape(leaf.shape, dim, params["axis_size"], bool(tiled), api)
        if _unreduced(leaf, params["axes"], api):
            if params["axis_index_groups"] is not None:
                raise NotImplementedError(f"{api}: axis_index_groups is not supported for an operand unreduced "
                                          f"over {params['axes']} (as lax.psum_scatter)")
            return primitives.blink_unreduced_reduce_scatter_p.bind(leaf, tiled=bool(tiled), scatter_dimension=dim,
                                                            **params)
        leaf = _vary(leaf, params["axes"])
        return primitives.blink_reduce_scatter_p.bind(leaf, tiled=bool(tiled), scatter_dimension=dim, **params)

    return jax.tree_util.tree_unflatten(treedef, [one(leaf) for leaf in leaves])
