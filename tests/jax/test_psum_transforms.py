"""jax_blink collectives under grad (1st/2nd order), vmap, scan/fori_loop; topology choice; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import lowering
from jax_blink.errors import BlinkError, TopologyError

IMPLS = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
MESH8 = Mesh(np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 4, 6]], ("i",))


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_pmap_hand_computed_values(impl):
    """pmap over 2 devices, grad_w psum(sum(w * data)), w = ones(2), data = arange(2)."""
    g = jax.pmap(lambda w, d: jax.grad(lambda w: jax_blink.psum(jnp.sum(w * d), "i", impl=impl))(w),
                 axis_name="i", devices=jax.devices()[:2])
    out = g(jnp.ones((2, 2)), jnp.tile(jnp.arange(2.0), (2, 1)))
    np.testing.assert_array_equal(np.asarray(out), [[0.0, 2.0], [0.0, 2.0]])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_shard_map_first_and_second_order(impl, check_vma):
    """x = arange(8.), grad of psum(sum((w x)^2)) at w = 3 is 840 (check_vma on).

    With check_vma off (psum_p semantics) the transpose psums again: device d gets 8 * 2 w x_d^2.
    Second order: 2 * sum(x^2) = 280 resp. 8 * 2 x_d^2.
    """
    x = np.arange(8.0)
    def loss(w, v):
        return jax_blink.psum(jnp.sum((w * v) ** 2), "i", impl=impl)
    spec = P() if check_vma else P("i")
    g1 = jax.jit(jax.shard_map(lambda w, v: jax.grad(loss)(w, v)[None], mesh=MESH8, in_specs=(P(), P("i")),
                               out_specs=spec, check_vma=check_vma))(3.0, x)
    g2 = jax.jit(jax.shard_map(lambda w, v: jax.grad(jax.grad(loss))(w, v)[None], mesh=MESH8,
                               in_specs=(P(), P("i")), out_specs=spec, check_vma=check_vma))(3.0, x)
    if check_vma:
        np.testing.assert_allclose(np.asarray(g1), [840.0])
        np.testing.assert_allclose(np.asarray(g2), [280.0])
    else:
        np.testing.assert_allclose(np.asarray(g1), 8 * 2 * 3.0 * x ** 2)
        np.testing.assert_allclose(np.asarray(g2), 8 * 2 * x ** 2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_broadcast_reduce_grads(check_vma):
    w = jnp.arange(3.0)
    def fb(v):
        return jax.grad(lambda v: jnp.sum(jax_blink.broadcast(v, "i", root=3) * w))(v)

    def fr(v):
        return jax.grad(lambda v: jnp.sum(jax_blink.reduce(v, "i", root=3) * w * (lax.axis_index("i") + 1)))(v)

    def run(f):
        return np.asarray(jax.jit(jax.shard_map(f, mesh=MESH8, in_specs=P("i"), out_specs=P("i"),
                                                check_vma=check_vma))(jnp.ones(24))).reshape(8, 3)

    want_b = np.zeros((8, 3))
    # check_vma on: one invariant cotangent flows to the root; off: 8 per-device cotangents reduce to it
    want_b[3] = w * (1 if check_vma else 8)
    np.testing.assert_array_equal(run(fb), want_b)
    np.testing.assert_array_equal(run(fr), np.tile(4 * w, (8, 1)))  # root rank 3 scales by 4


def test_vmap_with_axis_name_matches_lax():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(jax.vmap(lambda v: jax_blink.psum(v * 2, "i"), axis_name="i")(x),
                                  jax.vmap(lambda v: lax.psum(v * 2, "i"), axis_name="i")(x))
    np.testing.assert_array_equal(jax.vmap(lambda v: jax_blink.psum(v, "i"), axis_name="i", in_axes=None,
                                           axis_size=3)(jnp.arange(2.0)), [[0.0, 3.0]] * 3)
    b = jax.vmap(lambda v: jax_blink.broadcast(v, "i", root=2), axis_name="i")(x)
    np.testing.assert_array_equal(b, np.tile(x[2], (3, 1)))
    r = jax.vmap(lambda v: jax_blink.reduce(v, "i", root=1), axis_name="i")(x)
    np.testing.assert_array_equal(r, [np.zeros(4), x.sum(0), np.zeros(4)])


def test_vmap_of_pmap_and_vmap_inside_shard_map_2d():
    x = jnp.arange(24.0).reshape(3, 8)
    got = jax.vmap(jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i"))(x)
    np.testing.assert_array_equal(got, np.tile(x.sum(1, keepdims=True), (1, 8)))
    # vmap axis 'v' and mesh axis 'i' reduced together (tuple axes), root over ('v', 'i')
    def f(t):
        return jax.vmap(lambda u: jax_blink.psum(u, ("v", "i")), axis_name="v")(t)
    out = jax.jit(jax.shard_map(f, mesh=MESH8, in_specs=P(None, "i"), out_specs=P(None, "i"),
                                check_vma=False))(x)
    np.testing.assert_array_equal(out, np.full((3, 8), x.sum()))


@pytest.mark.parametrize("impl", IMPLS)
def test_scan_and_fori_loop(impl):
    def body(c, _):
        return lax.pcast(jax_blink.psum(c, "i", impl=impl) / 8, "i", to="varying"), None
    f = jax.jit(jax.shard_map(lambda v: lax.scan(body, v, None, length=3)[0], mesh=MESH8, in_specs=P("i"),
                              out_specs=P("i"), check_vma=True))
    np.testing.assert_allclose(np.asarray(f(np.arange(8.0))), np.full(8, 3.5))
    g = jax.jit(jax.shard_map(lambda v: lax.fori_loop(0, 3, lambda i, c: jax_blink.psum(c, "i", impl=impl) + 1.0, v),
                              mesh=MESH8, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    # c1 = 28 + 1 = 29; c2 = 8*29 + 1 = 233; c3 = 8*233 + 1 = 1865
    np.testing.assert_array_equal(np.asarray(g(np.arange(8.0))), np.full(8, 1865.0))


def test_python_scalars_and_size_one_axes():
    f = jax.pmap(lambda v: (jax_blink.psum(3, "i"), jax_blink.psum(v, ("i",)), jax_blink.psum(True, "i")),
                 axis_name="i")
    a, b, c = f(jnp.arange(4.0))
    np.testing.assert_array_equal(a, [12] * 4)
    np.testing.assert_array_equal(b, [6.0] * 4)
    np.testing.assert_array_equal(c, [4] * 4)
    one = Mesh(np.array(jax.devices()[:1]), ("s",))
    out = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "s"), mesh=one, in_specs=P("s"), out_specs=P("s"),
                                check_vma=False))(jnp.arange(3.0))
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])


def test_axis_index_groups_pmap_and_refused_under_check_vma():
    groups = [[0, 2], [1, 3]]
    x = jnp.arange(4.0) + 1
    got = jax.pmap(lambda v: jax_blink.psum(v, "i", axis_index_groups=groups), axis_name="i")(x)
    want = jax.pmap(lambda v: lax.psum(v, "i", axis_index_groups=groups), axis_name="i")(x)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotImplementedError):
        jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "i", axis_index_groups=[[0, 1, 2, 3, 4, 5, 6, 7]]),
                              mesh=MESH8, in_specs=P("i"), out_specs=P(), check_vma=True))(jnp.ones(8))


@pytest.mark.slow
def test_topology_choices(monkeypatch):
    x = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    def run(**kw):
        return np.asarray(jax.pmap(lambda v: jax_blink.psum(v, "i", **kw), axis_name="i")(x))
    want = np.tile(x.sum(0), (8, 1))
    np.testing.assert_array_equal(run(topology="dgx1v"), want)
    np.testing.assert_array_equal(run(topology=jax_blink.Topology.preset("dgx1v")), want)
    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", "dgx1p")
    np.testing.assert_array_equal(run(), want)
    monkeypatch.delenv("JAX_BLINK_TOPOLOGY")
    # reversed device map onto the topology's GPUs
    np.testing.assert_array_equal(run(topology="dgx1v", device_map={i: 7 - i for i in range(8)}), want)
    # 3 devices of an 8-GPU topology: subset allocation
    sub = jax.pmap(lambda v: jax_blink.psum(v, "i", topology="dgx1v"), axis_name="i",
                   devices=[jax.devices()[i] for i in (1, 4, 6)])(x[:3])
    np.testing.assert_array_equal(np.asarray(sub), np.tile(x[:3].sum(0), (3, 1)))


def test_bad_input_errors():
    with pytest.raises(NameError):
        jax.pmap(lambda v: jax_blink.psum(v, "j"), axis_name="i")(jnp.ones(2))
    with pytest.raises(NameError):
        jax_blink.psum(jnp.ones(2), "i")
    with pytest.raises(TypeError, match="dtype float8_e4m3fn; .*cast a float8 .* to bfloat16"):
        jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")(jnp.ones((2, 2), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="impl"):
        jax.pmap(lambda v: jax_blink.psum(v, "i", impl="nccl"), axis_name="i")(jnp.ones(2))
    with pytest.raises(TopologyError, match="has 4 GPUs but axes 'i' span 8 devices"):  # at trace time
        jax.pmap(lambda v: jax_blink.psum(v, "i", topology=jax_blink.Topology.host(4)), axis_name="i")(jnp.ones(8))
    with pytest.raises(TopologyError, match="used twice"):
        jax.pmap(lambda v: jax_blink.psum(v, "i", device_map=lambda d: 0), axis_name="i")(jnp.ones(2))
    with pytest.raises(ValueError, match="root"):
        jax.pmap(lambda v: jax_blink.broadcast(v, "i", root=5), axis_name="i")(jnp.ones(2))
    if lowering.find_lowering("ffi", "cpu") is None:
        with pytest.raises(BlinkError, match="no lowering registered"):
            jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")(jnp.ones(2))


def test_user_test_regressions_bool_broadcast_groups_host_preset(monkeypatch):
    """Found by a fresh-user test: broadcast keeps bool; partial groups refused; host<N> names work."""
    import jax_blink
    from jax_blink import TopologyError

    flags = jnp.arange(8) % 3 == 0
    out = jax.pmap(lambda v: jax_blink.broadcast(v, "i", root=3), axis_name="i")(flags)
    assert out.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(out), np.full(8, True))  # rank 3: 3 % 3 == 0
    out = jax.pmap(lambda v: jax_blink.broadcast(True, "i"), axis_name="i")(flags)
    assert out.dtype == jnp.bool_
    with pytest.raises(ValueError, match="cover every index"):
        jax.pmap(lambda v: jax_blink.psum(v, "i", axis_index_groups=[[0, 1], [2, 3]]),
                 axis_name="i")(jnp.arange(8.0))
    y = jax.pmap(lambda v: jax_blink.psum(v, "i", topology="host8"), axis_name="i")(jnp.arange(8.0))
    np.testing.assert_array_equal(np.asarray(y), np.full(8, 28.0))
    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", "no-such-machine")
    with pytest.raises(TopologyError, match="JAX_BLINK_TOPOLOGY='no-such-machine'"):
        jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")(jnp.arange(8.0))
