"""Every use of JAX internals (``jax._src``), and the check that the installed JAX is supported.

The primitives, their rules and the lowerings need parts of JAX with no public home yet (primitive
rule tables, MLIR lowering helpers, varying-axes typing, the axis environment). They import them
from here only, so a JAX release that moves one of them breaks this one module (the pattern of
mpi4jax's ``_src/jax_compat.py``). Importing this module checks the installed jax and jaxlib
versions against the range ``pyproject.toml`` pins (:data:`SUPPORTED`) and raises
:class:`UnsupportedJaxError` outside it, before touching any internal. ``import jax_blink`` does
not import this module (nor jax); the JAX-facing modules (``api``, ``primitives``, ``lowering.*``)
do, so the check runs when they are first imported.
"""

from __future__ import annotations

import re

import jax
import jaxlib

from .errors import BlinkError

#: Supported versions of jax and jaxlib: [low, high), as pinned in pyproject.toml.
SUPPORTED = ((0, 10, 2), (0, 13))


class UnsupportedJaxError(BlinkError, ImportError):
    """The installed jax or jaxlib lies outside :data:`SUPPORTED` (raised at import)."""


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string ("0.11.0.dev20260101" -> (0, 11, 0)); None if none."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def _range_text() -> str:
    low, high = SUPPORTED
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


def check_versions(jax_version: str | None = None, jaxlib_version: str | None = None) -> None:
    """Raise :class:`UnsupportedJaxError` unless jax and jaxlib both lie in :data:`SUPPORTED`.

    Args: the version strings to check; default the installed ``jax.__version__`` and
    ``jaxlib.__version__``. A pre-release of the upper bound (``0.13.0.dev``) counts as that release
    (unsupported). The message names both installed versions and the supported range.
    """
    jax_version = jax.__version__ if jax_version is None else jax_version
    jaxlib_version = jaxlib.__version__ if jaxlib_version is None else jaxlib_version
    low, high = SUPPORTED
    bad = [f"{name} {v}" for name, v in (("jax", jax_version), ("jaxlib", jaxlib_version))
           if (r := _release(v)) is None or not low <= r < high]
    if bad:
        raise UnsupportedJaxError(
            f"jax_blink supports jax and jaxlib {_range_text()}, but {' and '.join(bad)} is installed "
            f"(jax {jax_version}, jaxlib {jaxlib_version}); install a supported version, e.g. "
            f"pip install 'jax{_range_text()}' 'jaxlib{_range_text()}'")


check_versions()

# Internals below this line: the only jax._src imports of the package (tests/jax/test_jax_compat.py).
from jax._src import api_util as _api_util  # noqa: E402
from jax._src import config as _config  # noqa: E402
from jax._src import (  # noqa: E402,F401
    core,
    dispatch,
    dtypes,
    source_info_util,  # noqa: E402,F401
)
from jax._src import linear_util as lu  # noqa: E402,F401
from jax._src.interpreters import ad, batching, mlir  # noqa: E402,F401
from jax._src.interpreters import partial_eval as pe  # noqa: E402,F401
from jax._src.lax import lax as _lax  # noqa: E402
from jax._src.lax import parallel as _parallel  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402,F401
from jax._src.lib.mlir.dialects import func as _func  # noqa: E402
from jax._src.lib.mlir.dialects import hlo  # noqa: E402,F401
from jax._src.mesh import AbstractMesh, empty_abstract_mesh, get_abstract_mesh, use_abstract_mesh  # noqa: E402,F401
from jax._src.sharding_impls import SPMDAxisContext  # noqa: E402,F401

#: ``lax._const(x, value)``: ``value`` as a constant of ``x``'s dtype (weak type kept).
lax_const = _lax._const
#: lax's check of ``axis_index_groups`` (equal sizes, ints); raises ValueError as ``lax.psum``.
validate_axis_index_groups = _parallel._validate_reduce_axis_index_groups
#: lax's rule that drops size-1 axes from a collective's axis names.
skip_one_sized_axes = _parallel._maybe_skip_one_sized_axes


def check_vma() -> bool:
    """True while tracing under ``shard_map(check_vma=True)`` (varying-axes typing on)."""
    return bool(_config._check_vma.value)


def abstract_mesh():
    """The mesh being traced under (shard_map, pmap), or None (vmap alone: no mesh)."""
    mesh = get_abstract_mesh()
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def distributed_client():
    """The ``jax.distributed`` key-value client of this process, or None when not initialised."""
    from jax._src import distributed as jd
    return jd.global_state.client


#: jax's cluster environments by class name -> the launcher's name in messages
_CLUSTER_NAMES = {"SlurmCluster": "SLURM", "OmpiCluster": "Open MPI", "K8sCluster": "Kubernetes",
                  "GkeTpuCluster": "GKE TPU", "GceTpuCluster": "GCE TPU", "Mpi4pyCluster": "mpi4py"}


def detected_cluster() -> str | None:
    """The cluster environment ``jax.distributed.initialize()`` would use without arguments (the
    first of jax's ``ClusterEnv`` types, not opt-in only, whose variables are present), named for
    people ("SLURM", "Open MPI", "Kubernetes", ...), or None."""
    try:
        from jax._src import clusters
        types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # a jax without this registry: let jax itself try
        return None
    for env in types:
        try:
            if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
                return _CLUSTER_NAMES.get(env.__name__, env.__name__)
        except Exception:  # noqa: BLE001 - a detector that fails to look is not present
            continue
    return None


def cpu_collectives_implementation() -> str | None:
    """jax's ``jax_cpu_collectives_implementation`` setting (None where unset and without a default)."""
    import jax
    return getattr(jax.config, "jax_cpu_collectives_implementation", None)


# ----------------------------------------------------------------------------- lax's typing rules
#: lax's state of an operand over ``axes`` ("varying", "unreduced", "reduced" or "invarying"); raises
#: ValueError (lax's message) when the axes disagree. ``get_from(aval, axes, api_name)``.
get_from = _parallel._get_from
#: lax's check that no operand is unreduced / reduced over ``axes`` (ValueError, lax's message).
check_unreduced_args = core.check_unreduced_args
#: ``lax.preduced``-style cast Invariant -> Reduced (no communication): the transpose of an unreduced psum.
preduced = _parallel.preduced


def auto_pcast() -> bool:
    """True when lax inserts ``pvary`` before a collective on an operand not varying over its axes
    (``jax_auto_pcast``, on by default); lax's collectives then accept invariant operands."""
    return bool(_config.auto_pcast.value)


def _all_gather_to_values():
    import inspect
    if "to" not in inspect.signature(_parallel.all_gather).parameters:
        return None
    return ("varying", "reduced", "invarying")


#: The ``to=`` values ``lax.all_gather`` takes at the installed jax (None: no ``to`` keyword).
ALL_GATHER_TO = _all_gather_to_values()

#: True where ``lax.all_gather`` ignores ``to`` outside ``check_vma=True`` (a plain all-gather, whose
#: transpose is a reduce-scatter): jax 0.12; jax 0.10 binds the typed collective either way.
ALL_GATHER_TO_NEEDS_VMA = ALL_GATHER_TO is not None and "_check_vma" in __import__("inspect").getsource(
    _parallel._all_gather_is_async)

_UNREDUCED_KIND = getattr(core, "UnreducedKind", None)  # jax 0.12: sum / max / min unreduced values


def with_unreduced(mat, unreduced: frozenset, **updates):
    """``mat`` (a manual-axes type) with its unreduced axes set to ``unreduced`` (and the other
    ``updates``); where jax types the kind of unreduced values (0.12), a sum while any axis stays
    unreduced, none after (as lax's unreduced_psum / unreduced_psum_scatter)."""
    if _UNREDUCED_KIND is not None:
        updates["unreduced_kind"] = _UNREDUCED_KIND.sum if unreduced else None
    return mat.update(unreduced=frozenset(unreduced), **updates)


def check_unreduced_sum(mat, name: str) -> None:
    """Where jax types unreduced kinds (0.12): ValueError (lax's) unless ``mat``'s are sums."""
    if _UNREDUCED_KIND is not None:
        _parallel.check_unreduced_kind(name, mat, _UNREDUCED_KIND.sum)


def def_unreduced_lowering(prim, to_lo) -> None:
    """Where jax types unreduced values as "high" avals (jax >= 0.12.1: an unreduced operand is an
    ``UnreducedArray`` whose low form is a varying array, ``aval.lower_val`` / ``raise_val``), let
    ``prim`` take them as lax's unreduced collectives do (``unreduced_psum_p.to_lojax``): it is high
    when an operand is, and ``to_lo(lo_vals, hi_avals, **params)`` runs it on the low values and
    returns the low results, which are raised to ``prim``'s abstract results. Elsewhere nothing."""
    if not hasattr(core.Primitive, "to_lojax"):
        return

    def to_lojax(*hi_vals, **params):
        hi_avals = [core.typeof(v) for v in hi_vals]
        outs, _ = prim.abstract_eval(*hi_avals, **params)
        lo_vals = [v for a, x in zip(hi_avals, hi_vals) for v in a.lower_val(x)]
        lo_outs = to_lo(lo_vals, hi_avals, **params)
        if not prim.multiple_results:
            return outs.raise_val(lo_outs)
        return [a.raise_val(v) for a, v in zip(outs, lo_outs)]

    prim.is_high = lambda *avals, **_: any(getattr(a, "is_high", False) for a in avals)
    prim.to_lojax = to_lojax


def manual_axes(ctx) -> frozenset:
    """The manual mesh axes of a lowering context (shard_map); empty outside shard_map."""
    axis_ctx = ctx.module_context.axis_context
    return frozenset(getattr(axis_ctx, "manual_axes", ()) or ())


_outer_meshes: list = []  # the abstract meshes lower_fun_plain stepped out of (innermost last)


def axis_index_hlo(ctx, name):
    """lax's lowering of ``axis_index(name)`` (an i32 scalar hlo value). Under a partially manual
    shard_map it avoids a bare partition-id (ambiguous under SPMD partitioning), as lax does (by a
    nested shard_map over the call site's abstract mesh, restored here inside :func:`lower_fun_plain`)."""
    mesh = _outer_meshes[-1] if _outer_meshes else get_abstract_mesh()
    with use_abstract_mesh(mesh):
        return _parallel._build_axis_index_lowering_hlo(ctx, name, ctx.module_context.axis_context)


def lower_fun_plain(fun, multiple_results: bool = True):
    """``mlir.lower_fun`` traced outside the call site's mesh: the arrays the lowering creates (zeros,
    constant tables) are plain like the avals it is given, not typed over the mesh's explicit / manual
    axes (where mixing them would be a sharding type error)."""
    lowered = mlir.lower_fun(fun, multiple_results=multiple_results)

    def rule(ctx, *args, **params):
        _outer_meshes.append(get_abstract_mesh())
        try:
            with use_abstract_mesh(empty_abstract_mesh):
                return lowered(ctx, *args, **params)
        finally:
            _outer_meshes.pop()
    return rule


def call_in_function(ctx, xs, emit, name: str, frontend_attributes: dict[str, str]) -> list:
    """``emit(args)`` lowered inside a private function of the module, called once with ``xs``; the
    ``func.call`` carries ``frontend_attributes`` (as ``mhlo.frontend_attributes``, which become
    the HLO ``call``'s). It is the form ``jax.experimental.compute_on("gpu_stream:N")`` lowers to
    (``_compute_on_lowering``): XLA:GPU turns a call so marked into an async ``call-start`` /
    ``call-done`` pair on its own stream (``ExplicitStreamAnnotationAsyncWrapper``).

    Args: ``ctx`` the lowering rule context (its ``avals_out`` type the results); ``xs`` the
    operands (ir.Value); ``emit(args) -> list[ir.Value]`` emits the body over the function's
    arguments (same types as ``xs``) at the current insertion point; ``name`` the function's name
    (made unique in the module). Returns the call's results.
    """
    mc = ctx.module_context
    out_types = [mlir.aval_to_ir_type(mc, a) for a in ctx.avals_out]
    ftype = ir.FunctionType.get([x.type for x in xs], out_types)
    fn = _func.FuncOp(name, ftype, ip=ir.InsertionPoint(mc.module.body))
    fn.attributes["sym_visibility"] = ir.StringAttr.get("private")
    sym = mc.symbol_table.insert(fn)
    block = fn.add_entry_block()
    with ir.InsertionPoint(block):
        _func.ReturnOp(list(emit(list(block.arguments))))
    call = _func.CallOp(out_types, ir.FlatSymbolRefAttr.get(sym.value), list(xs))
    call.operation.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
        {k: ir.StringAttr.get(v) for k, v in frontend_attributes.items()})
    return list(call.results)


# ----------------------------------------------------------------------------- roofline
def _roofline_module():
    import importlib
    try:
        importlib.import_module("jax.experimental.roofline")  # registers lax's rules (rooflines.py)
        return importlib.import_module("jax.experimental.roofline.roofline")
    except ImportError:  # pragma: no cover - roofline ships with every supported jax
        return None


def lax_roofline_rule(name: str):
    """The ``jax.experimental.roofline`` rule lax registers for its primitive ``name`` (an attribute
    of ``jax._src.lax.parallel``, e.g. "psum_invariant_p"), or None (no rule, or no roofline)."""
    mod = _roofline_module()
    prim = getattr(_parallel, name, None)
    return None if mod is None or prim is None else mod._rooflines.get(prim)


def register_roofline(prim, rule) -> None:
    """Register ``rule`` as ``prim``'s ``jax.experimental.roofline`` rule (if roofline imports)."""
    mod = _roofline_module()
    if mod is not None:
        mod.register_roofline(prim)(rule)

# -------------------------------------------------------------------------------- jaxpr rewriting
# (jax_blink.transform): lax's collective primitives, and tracing a Python function to a jaxpr
# with given avals (varying-axes types kept) in the current trace context.
#: lax's collective primitives as they appear in jaxprs: psum (pmap / check_vma off), its
#: check_vma=True form, all_gather, psum_scatter; and pvary (check_vma's "make varying").
psum_p = _parallel.psum_p
psum_invariant_p = _parallel.psum_invariant_p
all_gather_p = _parallel.all_gather_p
reduce_scatter_p = _parallel.reduce_scatter_p


def convert_weak_type(x, weak_type: bool):
    """``x`` with its dtype and the given weak type (lax's internal convert_element_type)."""
    return _lax._convert_element_type(x, core.typeof(x).dtype, weak_type=weak_type)


def wrap_fun(fun, name: str, args) -> lu.WrappedFun:
    """``fun`` as a ``lu.WrappedFun`` with debug info naming it ``name`` (``args``: example arguments)."""
    return lu.wrap_init(fun, debug_info=_api_util.debug_info(name, fun, tuple(args), {}))


#: A jaxpr with its constants: ``core.ClosedJaxpr`` up to jax 0.11; jax 0.12 has one ``core.Jaxpr``
#: type that carries its constants (``Jaxpr(jaxpr, consts)`` still builds one, ``.jaxpr`` is itself).
ClosedJaxpr = getattr(core, "ClosedJaxpr", core.Jaxpr)
#: The types a primitive's jaxpr parameters have.
JAXPR_TYPES = tuple({core.Jaxpr, ClosedJaxpr})


def trace_to_closed_jaxpr(fun, in_avals, name: str = "jax_blink.transform"):
    """The closed jaxpr (:data:`ClosedJaxpr`) of ``fun(*args)`` for arguments of ``in_avals`` (their
    varying axes kept), traced in the current context (axis environment, mesh, check_vma) like a
    control-flow body."""
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrap_fun(fun, name, in_avals), list(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def lax_lowering_rule(prim, platform: str):
    """The MLIR lowering rule lax registered for its primitive ``prim`` on ``platform`` ("cpu",
    "cuda", ...): the platform's own rule where lax registered one (all-gather on GPUs), else the
    generic one. Calling it emits exactly the op ``lax`` emits (``jax.lax.psum`` -> ``all-reduce``)."""
    rules = getattr(mlir, "_platform_specific_lowerings", {}).get(platform, {})
    entry = rules.get(prim) or mlir._lowerings[prim]
    return getattr(entry, "rule", entry)  # a LoweringRuleEntry (rule, inline) in newer jax
