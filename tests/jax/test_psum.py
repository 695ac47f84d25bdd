"""jax_blink.psum / pmean / broadcast / reduce against lax on 8 host CPU devices.

Tolerances (random normal inputs): float16 2e-2, bfloat16 6e-2, float32 1e-5, float64 1e-12
(relative to the sum of absolute values); ints and bool exact (integer sums wrap like lax).
Every device must hold bitwise-identical results. Parametrised over ``IMPLS`` ("ffi" joins when a
native CPU lowering is registered).
"""


import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
import jax_blink.api  # noqa: F401  (imports the lowerings, so "ffi" is registered before IMPLS is read)
from jax_blink import dispatch, lowering

IMPLS = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
PERM8 = [3, 1, 0, 2, 7, 5, 4, 6]
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-5, "float64": 1e-12,
       "complex64": 1e-5, "complex128": 1e-12}
DTYPES32 = ["bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "bfloat16",
            "float32", "complex64"]
SHAPES = [(0,), (0, 5), (), (7,), (3, 5), (1001,)]


def mesh1(perm, name="i"):
    return Mesh(np.array(jax.devices())[list(perm)], (name,))


def rand(rng, shape, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)  # full range: sums overflow and must wrap like lax
        return rng.integers(info.min, info.max, size=shape, dtype=np.dtype(dtype.name), endpoint=True)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def per_device(n, shape, dtype, seed=0):
    """[n, *shape] host array: row d is device position d's operand."""
    return rand(np.random.default_rng(seed), (n, *shape), dtype)


def assert_allreduce(got, x):
    """got: [n, ...] per-device results; x: [n, ...] inputs. Checks value and bitwise identity."""
    got = np.asarray(got)
    for d in range(1, got.shape[0]):
        assert got[d].tobytes() == got[0].tobytes(), f"device {d} differs from device 0"
    dtype = np.asarray(x).dtype
    if dtype == np.bool_ or np.issubdtype(dtype, np.integer):
        want = np.sum(np.asarray(x).astype(np.int32 if dtype == np.bool_ else dtype), axis=0, dtype=(
            np.int32 if dtype == np.bool_ else dtype))
        np.testing.assert_array_equal(got[0], want)
    else:
        xs = np.asarray(x).astype(np.complex128 if np.iscomplexobj(x) else np.float64)
        want = xs.sum(0)
        scale = np.abs(xs).sum(0) + 1e-30
        err = np.abs(got[0].astype(want.dtype) - want) / scale
        assert err.size == 0 or err.max() <= TOL[jnp.dtype(dtype).name], err.max()


def shard_psum(mesh, impl, check_vma):
    """jit(shard_map) running jax_blink.psum over axis 'i' on a pytree of per-device blocks."""
    def body(tree):
        out = jax_blink.psum(jax.tree.map(lambda v: v[0], tree), "i", impl=impl)
        return jax.tree.map(lambda v: v[None], out)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))


# the portable lowering's matrix is slow (one collective_permute program per case): the quick loop keeps ffi's
@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i == "ppermute" else i for i in IMPLS])
@pytest.mark.parametrize("check_vma", [True, False])
def test_dtypes_shapes_8_devices_permuted(impl, check_vma):
    mesh = mesh1(PERM8)
    tree = {f"{dt}{i}": per_device(8, shape, dt, seed=i) for dt in DTYPES32
            for i, shape in enumerate(SHAPES[:4] if dt != "float32" else SHAPES)}
    out = shard_psum(mesh, impl, check_vma)(tree)
    ref = jax.jit(jax.shard_map(lambda t: jax.tree.map(lambda v: lax.psum(v[0], "i")[None], t), mesh=mesh,
                                in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))(tree)
    for k in tree:
        assert out[k].dtype == ref[k].dtype and out[k].shape == ref[k].shape, k
        assert_allreduce(out[k], tree[k])
        if not jnp.issubdtype(out[k].dtype, jnp.inexact):
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))


@pytest.mark.parametrize("impl", IMPLS)
def test_x64_dtypes(impl):
    with jax.enable_x64(True):  # jax 0.10: the config state is a context manager
        mesh = mesh1(PERM8)
        tree = {dt: per_device(8, (9,), dt, seed=3) for dt in ("int64", "uint64", "float64", "complex128")}
        out = shard_psum(mesh, impl, False)(tree)
        for k in tree:
            assert out[k].dtype == jnp.dtype(k)
            assert_allreduce(out[k], tree[k])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("perm", [[5, 2, 7], [6, 0, 3, 1, 4], [1, 2, 3, 4, 5, 6, 7]], ids=["3", "5", "7"])
@pytest.mark.slow
def test_sub_meshes_odd_sizes(impl, perm):
    mesh = mesh1(perm)
    n = len(perm)
    tree = {"f": per_device(n, (1001,), "float32"), "i": per_device(n, (3, 5), "int32"),
            "z": per_device(n, (0, 5), "float32"), "b": per_device(n, (7,), "bool")}
    out = shard_psum(mesh, impl, True)(tree)
    for k in tree:
        assert_allreduce(out[k], tree[k])


@pytest.mark.parametrize("impl", IMPLS)
def test_pmap_and_pmean(impl):
    x = per_device(8, (13,), "float32")
    got = jax.pmap(lambda v: jax_blink.psum(v, "i", impl=impl), axis_name="i")(x)
    assert_allreduce(got, x)
    m = jax.pmap(lambda v: jax_blink.pmean(v, "i", impl=impl), axis_name="i")(x)
    np.testing.assert_allclose(np.asarray(m)[0], x.mean(0), rtol=1e-5, atol=1e-6)
    xi = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    mi = jax.pmap(lambda v: jax_blink.pmean(v, "i", impl=impl), axis_name="i")(xi)
    ref = jax.pmap(lambda v: lax.pmean(v, "i"), axis_name="i")(xi)
    assert mi.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(mi), np.asarray(ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axes", ["a", "b", ("a", "b"), ("b", "a")])
def test_2d_mesh_permuted(impl, axes):
    devs = np.array(jax.devices())[PERM8].reshape(2, 4)
    mesh = Mesh(devs, ("a", "b"))
    x = per_device(8, (2, 11), "int32").reshape(2, 4, 2, 11).transpose(0, 2, 1, 3).reshape(4, 44)
    def f(m):
        return jax.jit(jax.shard_map(lambda v: m(v, axes), mesh=mesh, in_specs=P("a", "b"),
                                     out_specs=P("a", "b"), check_vma=False))

    got = f(lambda v, ax: jax_blink.psum(v, ax, impl=impl))(x)
    want = f(lax.psum)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_hlo_one_collective_permute_per_round():
    """A 2x4 mesh reducing over 'b': both groups' round r share one collective_permute."""
    from jax_blink.dispatch import build_request
    devs = np.array(jax.devices())[PERM8].reshape(2, 4)
    mesh = Mesh(devs, ("a", "b"))
    f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "b", impl="ppermute", chunk_elems=16), mesh=mesh,
                              in_specs=P("a", "b"), out_specs=P("a", "b"), check_vma=False))
    text = f.lower(jnp.zeros((2, 4 * 100), jnp.float32)).as_text()
    key = jax_blink.mapping.make_plan_key(None, None, 16)
    req = build_request("allreduce", mesh, ("b",), None, None, key, 100, 4, "cpu")
    assert len(req.groups) == 2 and len(req.device_table) == 8
    # device table rows (device_id, group, rank) follow the mesh, not device ids
    assert [tuple(r) for r in req.device_table[:4]] == [(3, 0, 0), (1, 0, 1), (0, 0, 2), (2, 0, 3)]
    rounds = max(s.num_rounds for s in req.schedules)
    assert rounds >= 2
    assert text.count("collective_permute") == rounds


@pytest.mark.parametrize("impl", IMPLS)
def test_broadcast_and_reduce(impl):
    mesh = mesh1(PERM8)
    x = per_device(8, (5,), "int32")
    for cv in (True, False):
        b = jax.jit(jax.shard_map(lambda v: jax_blink.broadcast(v[0], "i", root=5, impl=impl)[None],
                                  mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=cv))(x)
        np.testing.assert_array_equal(np.asarray(b), np.broadcast_to(x[5], (8, 5)))
        r = jax.jit(jax.shard_map(lambda v: jax_blink.reduce(v[0], "i", root=2, impl=impl)[None],
                                  mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=cv))(x)
        want = np.zeros((8, 5), np.int32)
        want[2] = x.sum(0, dtype=np.int32)
        np.testing.assert_array_equal(np.asarray(r), want)


def test_bucketing_one_collective_per_dtype():
    params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}, "emb": jnp.ones((5, 2)),
              "step": jnp.ones((), jnp.int32), "count": jnp.ones(3, jnp.int32)}
    jaxpr = jax.make_jaxpr(jax.pmap(lambda t: jax_blink.psum(t, "i"), axis_name="i"))(
        jax.tree.map(lambda v: jnp.stack([v] * 2), params))
    text = str(jaxpr)
    assert text.count("blink_psum[") == 2, text


def test_algorithm_argument_and_env(monkeypatch):
    """psum(algorithm=...) / $JAX_BLINK_ALGORITHM reach the planner: on 2 nodes x 4 host devices the
    forced three-phase plan (Blink s. 5) runs and sums int32 exactly; bad values fail clearly."""
    from jax_blink.errors import PlanError
    from jax_blink.planner import facade
    from jax_blink.topology import Topology
    from jax_blink.topology.presets import multi_node

    topo = multi_node(Topology.host(4), 2, 12.5, 1)
    mesh = mesh1(range(8))
    x = per_device(8, (3, 11), "int32", seed=5)

    def run(x=x, **kw):
        def f(v):
            return jax_blink.psum(v[0], "i", topology=topo, impl="ppermute", **kw)[None]
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)

    # distinct shapes: the lowering caches its request per shape, so each run plans afresh
    for kw, env, xi in (({"algorithm": "hierarchical"}, None, x), ({}, "hierarchical", x[:, :2])):
        if env:
            monkeypatch.setenv("JAX_BLINK_ALGORITHM", env)
        facade._CACHE.clear()
        assert_allreduce(run(xi, **kw), xi)
        assert {k[5] for k in facade._CACHE if len(k[1]) == 8} == {"hierarchical"}, list(facade._CACHE)
    monkeypatch.setenv("JAX_BLINK_ALGORITHM", "fastest")
    with pytest.raises(ValueError, match="JAX_BLINK_ALGORITHM=.*takes one of auto, trees"):
        run()
    monkeypatch.delenv("JAX_BLINK_ALGORITHM")
    with pytest.raises(ValueError, match="algorithm= must be one of"):
        run(algorithm="fastest")
    with pytest.raises(ValueError, match="'ring' is an all-reduce algorithm"):
        def bc(v):
            return jax_blink.broadcast(v, "i", topology=topo, algorithm="ring")
        jax.jit(jax.shard_map(bc, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
    def one_node(v):
        return jax_blink.psum(v[0], "i", impl="ppermute", algorithm="hierarchical")[None]
    with pytest.raises(PlanError, match="two or more nodes"):
        jax.jit(jax.shard_map(one_node, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)


def test_env_algorithm_is_a_preference_where_it_applies(monkeypatch):
    """$JAX_BLINK_ALGORITHM=ring / hierarchical must not break broadcast/reduce or one-node meshes
    (found by a user test); the explicit algorithm= argument still raises (test above)."""
    mesh = mesh1(range(8))
    x = per_device(8, (3, 7), "int32", seed=9)
    monkeypatch.setattr(dispatch, "_WARNED", set())  # each fallback warns once per process
    for env in ("ring", "hierarchical"):
        monkeypatch.setenv("JAX_BLINK_ALGORITHM", env)
        def bc(v):
            return jax_blink.broadcast(v, "i", root=2, topology="dgx1v")
        why = "does not apply to broadcast" if env == "ring" else "on one node"
        with pytest.warns(RuntimeWarning, match=f"JAX_BLINK_ALGORITHM={env}: .*{why}.*planning broadcast") as w:
            got = jax.jit(jax.shard_map(bc, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        assert [r.filename for r in w] == [__file__], [(r.filename, r.lineno) for r in w]  # the user's line
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.asarray(x)[2:3], x.shape))
        def ps(v):
            return jax_blink.psum(v, "i", topology="dgx1v")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = jax.jit(jax.shard_map(ps, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        # ring applies to all-reduce: no warning; hierarchical falls back on one node: one
        assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == (
            [] if env == "ring" else ["JAX_BLINK_ALGORITHM=hierarchical: the group's GPUs are on one node; "
                                      "planning allreduce with 'auto' (pass algorithm= to a call to require it)"])
        assert_allreduce(got, x)  # int32 sums wrap like lax
