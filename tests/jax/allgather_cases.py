"""Cases for tests/jax/test_allgather.py: jax_blink.all_gather / psum_scatter against lax.all_gather /
lax.psum_scatter, run in a subprocess per batch (as tests/jax/rendezvous_cases.py, whose protocol and
``main`` this reuses) so that a hang fails within a time limit.

Usage: python tests/jax/allgather_cases.py BATCH[:TEXT] ...   (BATCHES at the end)
Integers (and small-integer floats) must match bitwise, other floats to rounding.
"""

import importlib.util
import pathlib
import sys

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "rendezvous_cases", pathlib.Path(__file__).resolve().parent / "rendezvous_cases.py")
rc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rc)  # sets XLA_FLAGS (8 CPU devices) before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink import lowering  # noqa: E402

IMPLS = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
DEV = np.array(jax.devices())
MESH1 = Mesh(DEV[[3, 1, 0, 2, 7, 5, 4, 6]], ("i",))             # permuted 1-D
MESH2 = Mesh(DEV[[5, 0, 2, 7, 1, 4, 6, 3]].reshape(2, 4), ("x", "y"))  # permuted 2-D
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128")


def operand(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "bfloat16":
        return jnp.asarray(rng.integers(-8, 9, shape).astype(np.float32), jnp.bfloat16)
    if dtype.startswith("complex"):
        return (rng.integers(-8, 9, shape) + 1j * rng.integers(-8, 9, shape)).astype(dtype)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def same(got, want, name, exact):
    got = jax.tree.map(np.asarray, got)
    want = jax.tree.map(np.asarray, want)
    assert jax.tree.structure(got) == jax.tree.structure(want), name
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.shape} {g.dtype} vs lax {w.shape} {w.dtype}"
        if exact or g.dtype.kind in "biu" or g.dtype == bool:
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            tol = 2e-2 if g.dtype in (np.float16, jnp.bfloat16) else 1e-5
            np.testing.assert_allclose(g.astype(np.complex128), w.astype(np.complex128), rtol=tol, atol=tol,
                                       err_msg=name)


def smap(fn, mesh, vma, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=vma))


def pair(fn_blink, fn_lax, mesh, vma, x, in_specs, out_specs, exact, name):
    """One program computing both; compared."""
    f = smap(lambda v: (fn_blink(v), fn_lax(v)), mesh, vma, in_specs, (out_specs, out_specs))
    got, want = jax.block_until_ready(f(x))
    same(got, want, name, exact)


# ----------------------------------------------------------------------------- cases
def shapes_case(impl, vma):
    """Every axis / tiled combination on a permuted 1-D mesh; gathered outputs stay varying."""
    x = operand((8 * 4, 6, 2), "int32")
    for axis_ in (0, 1, 2, -1):
        for tiled in (False, True):
            axis = 3 if not tiled and axis_ == -1 else axis_
            name = f"all_gather axis={axis} tiled={tiled}"
            pair(lambda v, axis=axis, tiled=tiled: jax_blink.all_gather(v, "i", axis=axis, tiled=tiled, impl=impl),
                 lambda v, axis=axis, tiled=tiled: lax.all_gather(v, "i", axis=axis, tiled=tiled),
                 MESH1, vma, x, P("i"), P("i"), True, name)
    y = operand((8 * 8, 8, 16), "int32")
    for dim in (0, 1, 2):
        for tiled in (False, True):
            if not tiled and dim == 2:
                continue
            name = f"psum_scatter dim={dim} tiled={tiled}"
            pair(lambda v, dim=dim, tiled=tiled: jax_blink.psum_scatter(v, "i", scatter_dimension=dim, tiled=tiled,
                                                                         impl=impl),
                 lambda v, dim=dim, tiled=tiled: lax.psum_scatter(v, "i", scatter_dimension=dim, tiled=tiled),
                 MESH1, vma, y, P("i"), P("i"), True, name)
    if vma:  # the varying-axes type is lax's (typeof inside the traced body)
        seen = {}

        def body(v):
            seen["ag"] = jax.typeof(jax_blink.all_gather(v, "i", impl=impl)).mat.varying
            seen["ag_lax"] = jax.typeof(lax.all_gather(v, "i")).mat.varying
            seen["rs"] = jax.typeof(jax_blink.psum_scatter(v[:8], "i", impl=impl)).mat.varying
            seen["rs_lax"] = jax.typeof(lax.psum_scatter(v[:8], "i")).mat.varying
            seen["inv"] = jax.typeof(jax_blink.all_gather(jnp.float32(1.0), "i", impl=impl)).mat.varying
            seen["inv_lax"] = jax.typeof(lax.all_gather(jnp.float32(1.0), "i")).mat.varying
            return v
        jax.make_jaxpr(jax.shard_map(body, mesh=MESH1, in_specs=P("i"), out_specs=P("i"), check_vma=True))(
            jnp.zeros((64,), jnp.float32))
        assert seen["ag"] == seen["ag_lax"] and seen["rs"] == seen["rs_lax"] and seen["inv"] == seen["inv_lax"], seen


def dtypes_case(impl):
    for dt in DTYPES:
        x = operand((8 * 8, 3), dt, seed=3)
        pair(lambda v: jax_blink.all_gather(v, "i", impl=impl), lambda v: lax.all_gather(v, "i"),
             MESH1, False, x, P("i"), P("i"), True, f"all_gather {dt}")
        def want(v, as_int=dt == "bool"):
            return lax.psum_scatter(v.astype(np.int32) if as_int else v, "i")

        pair(lambda v: jax_blink.psum_scatter(v, "i", impl=impl), want, MESH1, False, x, P("i"), P("i"),
             False, f"psum_scatter {dt}")


def mesh2d_case(impl, vma):
    x = operand((8 * 8, 4), "int64", seed=5)
    for axes in ("x", "y", ("x", "y"), ("y", "x")):
        pair(lambda v, axes=axes: jax_blink.all_gather(v, axes, axis=1, impl=impl),
             lambda v, axes=axes: lax.all_gather(v, axes, axis=1),
             MESH2, vma, x, P(("x", "y")), P(("x", "y")), True, f"all_gather {axes}")
        k = 2 if axes == "x" else 4 if axes == "y" else 8
        pair(lambda v, axes=axes: jax_blink.psum_scatter(v, axes, tiled=True, impl=impl),
             lambda v, axes=axes: lax.psum_scatter(v, axes, tiled=True), MESH2, vma, operand((8 * k * 3, 5), "int32"),
             P(("x", "y")), P(("x", "y")), True, f"psum_scatter {axes} (k={k})")


def zero_size(fn_blink, fn_lax, mesh, vma, x, name):
    """Zero-size leaves (XLA rejects lax's all-gather of them): jax_blink's results have lax's
    abstract shapes and dtypes (``jax.eval_shape``) and no elements."""
    got = smap(fn_blink, mesh, vma, P("i"), P("i"))(x)
    want = jax.eval_shape(smap(fn_lax, mesh, vma, P("i"), P("i")), x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype and g.size == 0, f"{name}: {g.shape} vs lax {w.shape}"


def pytree_zero_size_case(impl, vma):
    tree = {"a": operand((8 * 2, 3), "float32"), "b": [operand((8 * 5,), "int16"), operand((8 * 1, 4), "bool")]}
    pair(lambda t: jax_blink.all_gather(t, "i", tiled=True, impl=impl), lambda t: lax.all_gather(t, "i", tiled=True),
         MESH1, vma, tree, P("i"), P("i"), True, "all_gather pytree")
    tree2 = {"a": operand((8 * 8, 3), "float32"), "b": operand((8 * 16,), "uint32")}
    pair(lambda t: jax_blink.psum_scatter(t, "i", tiled=True, impl=impl),
         lambda t: lax.psum_scatter(t, "i", tiled=True), MESH1, vma, tree2, P("i"), P("i"), False,
         "psum_scatter pytree")
    empty = {"a": operand((8 * 0, 4), "float32"), "c": operand((8, 0), "int32")}
    for tiled in (False, True):
        zero_size(lambda t, tiled=tiled: jax_blink.all_gather(t, "i", tiled=tiled, impl=impl),
                  lambda t, tiled=tiled: lax.all_gather(t, "i", tiled=tiled), MESH1, vma, empty,
                  f"all_gather zero-size {tiled}")
    zero_size(lambda t: jax_blink.psum_scatter(t, "i", tiled=True, impl=impl),
              lambda t: lax.psum_scatter(t, "i", tiled=True), MESH1, vma, {"c": operand((8 * 8, 0), "int32")},
              "psum_scatter zero-size")


def groups_case(impl):
    groups = [[0, 3, 5, 6], [1, 2, 4, 7]]
    x = operand((8 * 4, 3), "int32", seed=7)
    pair(lambda v: jax_blink.all_gather(v, "i", axis_index_groups=groups, impl=impl),
         lambda v: lax.all_gather(v, "i", axis_index_groups=groups), MESH1, False, x, P("i"), P("i"), True,
         "all_gather groups")
    pair(lambda v: jax_blink.psum_scatter(v, "i", axis_index_groups=groups, impl=impl),
         lambda v: lax.psum_scatter(v, "i", axis_index_groups=groups), MESH1, False, x, P("i"), P("i"), True,
         "psum_scatter groups")


def grad_case(impl, vma):
    """grad through all_gather is psum_scatter and the reverse (as lax), first and second order."""
    w = operand((8 * 3, 2), "float32", seed=11)
    c = operand((8 * 8 * 3, 2), "float32", seed=12)

    def loss(ag, ps):
        def f(w, c):
            full = ag(w)  # [24, 2] per device
            return jnp.sum(jnp.sin(full) * c[:24]) + jnp.sum(ps(c * full.sum()) ** 2)
        return f

    blink = loss(lambda v: jax_blink.all_gather(v, "i", tiled=True, impl=impl),
                 lambda v: jax_blink.psum_scatter(v, "i", tiled=True, impl=impl))
    ref = loss(lambda v: lax.all_gather(v, "i", tiled=True), lambda v: lax.psum_scatter(v, "i", tiled=True))
    for order in (1, 2):
        def g(f, order=order):
            h = jax.grad(f)
            if order == 2:
                h = jax.grad(lambda w, c: jnp.sum(jax.grad(f)(w, c)))
            return h
        f = smap(lambda w, c: (g(blink)(w, c), g(ref)(w, c)), MESH1, vma, (P("i"), P("i")), (P("i"), P("i")))
        got, want = f(w, c)
        same(got, want, f"grad order {order}", False)


def vmap_case(impl):
    x = jnp.asarray(operand((4, 3, 2), "int32", seed=13))
    for tiled in (False, True):
        for axis in (0, 1):
            same(jax.vmap(lambda v, axis=axis, tiled=tiled: jax_blink.all_gather(v, "b", axis=axis, tiled=tiled,
                                                                                 impl=impl), axis_name="b")(x),
                 jax.vmap(lambda v, axis=axis, tiled=tiled: lax.all_gather(v, "b", axis=axis, tiled=tiled),
                          axis_name="b")(x),
                 f"vmap all_gather axis={axis} tiled={tiled}", True)
    y = jnp.asarray(operand((4, 4, 8), "int32", seed=14))
    for tiled, dim in ((False, 0), (True, 0), (True, 1)):
        same(jax.vmap(lambda v, dim=dim, tiled=tiled: jax_blink.psum_scatter(v, "b", scatter_dimension=dim,
                                                                             tiled=tiled, impl=impl),
                      axis_name="b")(y),
             jax.vmap(lambda v, dim=dim, tiled=tiled: lax.psum_scatter(v, "b", scatter_dimension=dim, tiled=tiled),
                      axis_name="b")(y),
             f"vmap psum_scatter dim={dim} tiled={tiled}", True)
    # unmapped operand over the vmap axis
    same(jax.vmap(lambda v: jax_blink.all_gather(x[0], "b", impl=impl), axis_name="b")(x),
         jax.vmap(lambda v: lax.all_gather(x[0], "b"), axis_name="b")(x), "vmap all_gather unmapped", True)
    # vmap (batch dimension, no axis name) inside shard_map: the collective runs on the batched operand
    z = operand((8 * 2, 5, 3), "int32", seed=15)
    for dim_b in (0, 1):
        pair(lambda v, dim_b=dim_b: jax.vmap(lambda u: jax_blink.all_gather(u, "i", axis=1, impl=impl),
                                             in_axes=dim_b)(v),
             lambda v, dim_b=dim_b: jax.vmap(lambda u: lax.all_gather(u, "i", axis=1), in_axes=dim_b)(v),
             MESH1, False, z, P("i"), P("i"), True, f"batched all_gather in_axes={dim_b}")
    r = operand((8 * 2, 8, 3), "int32", seed=16)
    for tiled in (False, True):
        pair(lambda v, tiled=tiled: jax.vmap(lambda u: jax_blink.psum_scatter(u, "i", tiled=tiled, impl=impl))(v),
             lambda v, tiled=tiled: jax.vmap(lambda u: lax.psum_scatter(u, "i", tiled=tiled))(v),
             MESH1, False, r, P("i"), P("i"), True, f"batched psum_scatter tiled={tiled}")
        pair(lambda v, tiled=tiled: jax.vmap(lambda u: jax_blink.psum_scatter(u, "i", tiled=tiled, impl=impl),
                                             in_axes=1)(v),
             # (lax's own batcher fails on in_axes=1 here: the same map over the moved axis)
             lambda v, tiled=tiled: jax.vmap(lambda u: lax.psum_scatter(u, "i", tiled=tiled))(jnp.moveaxis(v, 1, 0)),
             MESH1, False, operand((8 * 8, 3, 8), "int32"), P("i"), P("i"), True,
             f"batched psum_scatter in_axes=1 tiled={tiled}")


def scan_pmap_case(impl):
    x = operand((8 * 4, 3), "int32", seed=17)

    def step(ag, ps):
        def body(c, _):
            full = ag(c)
            return ps(full * 2) // 8 + 1, full.sum()
        return lambda v: lax.scan(body, v, None, length=5)
    pair(step(lambda v: jax_blink.all_gather(v, "i", tiled=True, impl=impl),
              lambda v: jax_blink.psum_scatter(v, "i", tiled=True, impl=impl)),
         step(lambda v: lax.all_gather(v, "i", tiled=True), lambda v: lax.psum_scatter(v, "i", tiled=True)),
         MESH1, True, x, P("i"), P("i"), True, "scan")
    xp = x.reshape(8, 4, 3)
    f = jax.pmap(lambda v: (jax_blink.all_gather(v, "i", axis=1, impl=impl), lax.all_gather(v, "i", axis=1),
                            jax_blink.psum_scatter(v[:2].repeat(4, 0), "i", impl=impl),
                            lax.psum_scatter(v[:2].repeat(4, 0), "i")),
                 axis_name="i", devices=list(MESH1.devices))
    a, b, c, d = f(xp)
    same((a, c), (b, d), "pmap", True)


def errors_case():
    """Shape errors as lax (ValueError), unknown axes (NameError)."""
    x = jnp.zeros((8 * 6, 3))
    bad = [
        (lambda ps: lambda v: ps(v, "i", scatter_dimension=0), "non-tiled size != axis size"),
        (lambda ps: lambda v: ps(v[:5], "i", scatter_dimension=0, tiled=True), "tiled not divisible"),
        (lambda ps: lambda v: ps(v, "i", scatter_dimension=2, tiled=True), "dimension out of range"),
    ]
    for make, why in bad:
        for ps in (jax_blink.psum_scatter, lax.psum_scatter):
            try:
                jax.jit(jax.shard_map(make(ps), mesh=MESH1, in_specs=P("i"), out_specs=P("i")))(x)
            except (ValueError, IndexError) as e:  # lax: IndexError for a dimension out of range
                if ps is jax_blink.psum_scatter:
                    assert type(e) is ValueError and "jax_blink.psum_scatter" in str(e), e
            else:
                raise AssertionError(f"{ps.__module__}.psum_scatter accepted: {why}")
    try:
        jax_blink.all_gather(jnp.zeros(3), "nope")
    except NameError:
        pass
    else:
        raise AssertionError("unbound axis accepted")


# batch -> (name, case, takes check_vma): every case runs per impl, with check_vma on and off where it takes it
_TABLE = {
    "shapes": [("shapes", shapes_case, True)],
    "dtypes": [("dtypes", dtypes_case, False)],
    "meshes": [("mesh2d", mesh2d_case, True), ("pytree_zero_size", pytree_zero_size_case, True),
               ("groups", groups_case, False)],
    "transforms": [("grad", grad_case, True), ("vmap", vmap_case, False), ("scan_pmap", scan_pmap_case, False)],
}


def batch_cases(batch):
    if batch not in _TABLE:
        raise SystemExit(f"unknown batch {batch!r}")
    for impl in IMPLS:
        for name, case, with_vma in _TABLE[batch]:
            if with_vma:
                for vma in (True, False):
                    yield f"{impl}/vma={vma}/{name}", lambda case=case, impl=impl, vma=vma: case(impl, vma)
            else:
                yield f"{impl}/{name}", lambda case=case, impl=impl: case(impl)
    if batch == "transforms":
        yield "errors", errors_case


BATCHES = ("shapes", "dtypes", "meshes", "transforms")

if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)  # 64-bit dtypes as they are (only in the worker process)
    sys.exit(rc.main(sys.argv[1:], batch_cases, BATCHES))
