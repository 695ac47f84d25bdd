"""jax_blink where JAX's own tests (scripts/jax_test_suite.py) found it differing from lax: values,
varying / unreduced / reduced types and gradients next to lax's on 8 CPU devices.

- ``all_gather(..., to=...)`` ("invarying", "reduced") as ``lax.all_gather`` takes it at the installed jax;
- operands unreduced over the axes (explicit-sharding ``{U: x}`` types) into psum / psum_scatter, and the
  transposes (preduced, all_gather to "reduced");
- ``axis_index_groups`` under ``check_vma=True`` for all_gather / psum_scatter;
- ``jax.experimental.roofline`` communication bytes equal to lax's;
- the ppermute lowering in a shard_map over some mesh axes (vmap of a shard_map; ``axis_names``), where
  a partition id is ambiguous under SPMD partitioning.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import _jax_compat, lowering, primitives  # noqa: F401  (primitives registers the lowerings)

IMPLS = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
MESH4 = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
MESH22 = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4], axis_types=(AxisType.Explicit,) * 2)


def _gather(impl):
    return lambda v, *a, **k: jax_blink.all_gather(v, *a, impl=impl, **k)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_gather_to_invarying_matches_lax(impl):
    """Varying -> Invariant: value, type (no varying axes), first and second order grads like lax's."""
    if _jax_compat.ALL_GATHER_TO is None:
        pytest.skip("the installed lax.all_gather has no to=")
    arr = jnp.arange(8.0) ** 2

    def make(ag):
        @jax.jit
        @jax.shard_map(mesh=MESH4, in_specs=P("x"), out_specs=P())
        def f(a):
            out = ag(a, "x", tiled=True, to="invarying")
            assert jax.typeof(out).mat.varying == frozenset()
            return jnp.sin(out)
        return f

    ours, theirs = make(_gather(impl)), make(lax.all_gather)
    np.testing.assert_array_equal(ours(arr), theirs(arr))
    for order in (jax.grad, lambda g: jax.grad(lambda v: jnp.sum(jax.grad(g)(v) ** 2))):
        got = jax.jit(order(lambda v: ours(v).sum()))(arr)
        want = jax.jit(order(lambda v: theirs(v).sum()))(arr)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    g = jax.jit(jax.grad(lambda v: ours(v).sum()))(arr)
    np.testing.assert_allclose(g, np.cos(np.arange(8.0) ** 2), rtol=1e-6)  # each rank's own block, not x4
    assert g.sharding == NamedSharding(MESH4, P("x"))


@pytest.mark.parametrize("impl", IMPLS)
def test_all_gather_to_reduced_and_unreduced_psum_scatter_transpose(impl):
    """FSDP with explicit sharding: all_gather(to="reduced") forward (type {R: x}), whose transpose
    reduce-scatters the unreduced cotangent (ours, not lax's), values and grads equal to lax's."""
    if _jax_compat.ALL_GATHER_TO is None:
        pytest.skip("the installed lax.all_gather has no to=")
    x = np.arange(8.0).reshape(4, 2) - 3.0
    w = np.arange(12.0).reshape(2, 6) / 7.0

    def make(ag):
        @jax.shard_map(in_specs=P("x", None), out_specs=P(None, None, reduced={"x"}))
        def gather(a):
            out = ag(a, axis_name="x", tiled=True, to="reduced")
            assert jax.typeof(out).mat.reduced == {"x"} and not jax.typeof(out).mat.varying
            return out

        def loss(a, b):
            return jnp.sin(jnp.einsum("td,df->tf", a, gather(b))).sum()
        return loss

    with jax.set_mesh(MESH22):
        arr_x = jax.device_put(x, P("x", None))
        arr_w = jax.device_put(w, P("x", None))
        for f in (lambda L: L, lambda L: jax.grad(L, argnums=(0, 1))):
            got = jax.jit(f(make(_gather(impl))))(arr_x, arr_w)
            want = jax.jit(f(make(lax.all_gather)))(arr_x, arr_w)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
        jaxpr = str(jax.make_jaxpr(jax.grad(make(_gather(impl)), argnums=1))(arr_x, arr_w))
    assert "blink_unreduced_reduce_scatter" in jaxpr and "blink_all_gather_reduced" in jaxpr
    np.testing.assert_allclose(got[1], x.T @ np.cos(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_unreduced_psum_and_psum_scatter_match_lax(impl):
    """{U: x} operands (an einsum's unreduced partial sums) into psum (-> invariant; transpose preduced)
    and psum_scatter (-> varying; transpose all_gather to reduced), not pvaried: values and grads."""
    a = np.arange(8.0).reshape(2, 4) / 3.0
    b = np.arange(24.0).reshape(4, 6) - 5.0

    def make(reduce_fn, out_spec):
        @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=out_spec)
        def collective(z):
            assert jax.typeof(z).mat.unreduced == {"x"}
            out = reduce_fn(z)
            assert jax.typeof(out).mat.unreduced == frozenset()
            return out

        def f(x, y):
            z = jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))
            return jnp.sum(collective(z) ** 2)
        return f

    cases = [(lambda z: jax_blink.psum(z, "x", impl=impl), lambda z: lax.psum(z, "x"), P()),
             (lambda z: jax_blink.psum_scatter(z, "x", scatter_dimension=1, tiled=True, impl=impl),
              lambda z: lax.psum_scatter(z, "x", scatter_dimension=1, tiled=True), P(None, "x"))]
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        arr_a, arr_b = jax.device_put(a, P(None, "x")), jax.device_put(b, P("x", None))
        for ours, theirs, spec in cases:
            for wrap in (lambda f: f, lambda f: jax.grad(f, argnums=(0, 1))):
                got = jax.jit(wrap(make(ours, spec)))(arr_a, arr_b)
                want = jax.jit(wrap(make(theirs, spec)))(arr_a, arr_b)
                jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), got, want)
            np.testing.assert_allclose(got[0], 2 * (a @ b) @ b.T, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_sharded_axis_index_groups_under_check_vma(impl):
    """all_gather / psum_scatter with axis_index_groups in shard_map(check_vma=True), as lax takes them."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    groups = ((0, 2), (3, 1))

    def run(ag, rs):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=P("x", "y"), out_specs=(P("x", "y"), P("x", "y")), check_vma=True)
        def f(v):
            return (ag(v, "y", axis_index_groups=groups, axis=1, tiled=True),
                    rs(v, "y", axis_index_groups=groups, scatter_dimension=0, tiled=True))
        return f(a)

    got = run(_gather(impl), lambda v, *ax, **k: jax_blink.psum_scatter(v, *ax, impl=impl, **k))
    want = run(lax.all_gather, lax.psum_scatter)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # block (0, 0) of the gather: ranks 0 and 2 of axis y (columns 0:4 and 8:12) of row block 0
    np.testing.assert_array_equal(got[0][:4, :8], np.concatenate([a[:4, 0:4], a[:4, 8:12]], axis=1))


def test_to_and_groups_errors_as_lax():
    if _jax_compat.ALL_GATHER_TO is None:
        pytest.skip("the installed lax.all_gather has no to=")
    def call(**kw):
        return jax.jit(jax.shard_map(lambda v: jax_blink.all_gather(v, "x", **kw), mesh=MESH4,
                                     in_specs=P("x"), out_specs=P()))(jnp.arange(4.0))
    with pytest.raises(ValueError, match="to"):
        call(to="sharded")
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        call(to="invarying", axis_index_groups=[[0, 1], [2, 3]])


def test_roofline_counts_communication_as_lax():
    """jax.experimental.roofline: the same ICI bytes / latency for jax_blink's collectives as for lax's."""
    from jax.experimental import roofline

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    a = jnp.ones((8, 16), jnp.float32)

    def result(ps, ag, rs):
        def f(v):
            return ps(v, ("x", "y")), ag(v, "y", tiled=True), rs(v, "y", tiled=True)
        _, res = roofline.roofline(f, mesh=mesh, in_specs=P("x", "y"), out_specs=(P(), P("x", "y"), P("x", "y")))(a)
        return res

    ours = result(jax_blink.psum, jax_blink.all_gather, jax_blink.psum_scatter)
    theirs = result(lax.psum, lax.all_gather, lax.psum_scatter)
    assert ours.ici_bytes == theirs.ici_bytes and ours.ici_latency == theirs.ici_latency
    assert ours.ici_bytes["y"] > 0 and ours.ici_bytes["x"] > 0  # lax's ring model counts every axis


@pytest.mark.parametrize("impl", IMPLS)
def test_ppermute_in_partially_manual_shard_map(impl):
    """vmap of a shard_map over 'y' of a 2x2 mesh (batch sharded over 'x', left to SPMD), and a
    shard_map(axis_names={'y'}): psum / all_gather / psum_scatter equal lax's (XLA refuses a
    partition id there)."""
    arr = np.arange(32, dtype=np.float32).reshape(2, 16) ** 1.5
    with jax.set_mesh(MESH22):
        x = jax.device_put(arr, P("x", "y"))

        def body(ps):
            return jax.shard_map(lambda v: ps(v, axis_name="y"), in_specs=P("y"), out_specs=P(None))

        for wrap in (lambda f: f, jax.jit):
            got = wrap(jax.vmap(body(lambda v, axis_name: jax_blink.psum(v, axis_name, impl=impl))))(x)
            want = wrap(jax.vmap(body(lax.psum)))(x)
            np.testing.assert_allclose(got, want, rtol=1e-6)
            assert got.sharding == NamedSharding(MESH22, P("x", None))
        np.testing.assert_allclose(got, arr.reshape(2, 2, 8).sum(1), rtol=1e-6)


    auto = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[4:], axis_types=(AxisType.Auto,) * 2)

    def partial_auto(ag, rs):
        @jax.jit
        @jax.shard_map(mesh=auto, in_specs=P(None, "y"), out_specs=(P(None, "y"), P(None, "y")), axis_names={"y"})
        def f(v):
            return ag(v, "y", axis=1, tiled=True)[:, ::2], rs(v * 2, "y", scatter_dimension=1, tiled=True)
        return f(arr)

    got = partial_auto(_gather(impl), lambda v, *ax, **k: jax_blink.psum_scatter(v, *ax, impl=impl, **k))
    want = partial_auto(lax.all_gather, lax.psum_scatter)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    np.testing.assert_allclose(got[1], 2 * arr.reshape(2, 2, 8).sum(1), rtol=1e-6)


def test_unreduced_kind_checked_as_lax():
    """jax 0.12 types what an unreduced value awaits (sum / max / min): psum and psum_scatter take
    sums only, with lax's message (jax 0.10 has no kinds: nothing to check)."""
    kind = getattr(jax.sharding, "UnreducedKind", None)
    if kind is None:
        pytest.skip("the installed jax has no unreduced kinds")
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        arr = jax.device_put(np.arange(8.0).reshape(4, 2), P("x", None))
        spec = P(None, unreduced={"x"}, unreduced_kind=kind.max)
        part = jax.jit(lambda v: lax.reduce_max(v, axes=(0,), out_sharding=spec))(arr)
        for call in (lambda z: jax_blink.psum(z, "x"), lambda z: jax_blink.psum_scatter(z, "x", tiled=True)):
            f = jax.jit(jax.shard_map(call, out_specs=P()))
            with pytest.raises(ValueError, match="cannot accept args with unreduced_kind"):
                f(part)
