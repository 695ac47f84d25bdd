"""Pytrees of mixed leaves: one collective per dtype bucket, leaves where they are.

Every context the single-array tests cover, with a pytree of mixed leaves (float32 of several shapes,
zero-size, int32, bool, bfloat16, a Python scalar): equal to ``lax.psum`` (ints exactly, floats to
float32 rounding), bitwise identical on every device. The lowering: one custom call per dtype
bucket taking the leaves as operands (no concatenate / slice), results aliased to operands that are
computed in the function. The native executor: tiles split at leaf boundaries, in == out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
import jax_blink.api  # noqa: F401  (registers the lowerings, "ffi" included, before IMPLS is read)
from jax_blink import _native, lowering
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule, execute
from jax_blink.topology import Topology

IMPLS = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
N = 8
PERM8 = [3, 1, 0, 2, 7, 5, 4, 6]


def tree_inputs(n=N, seed=0):
    """Per-device stacked pytree [n, ...] of mixed leaves (numpy)."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((n, 33, 7)).astype(np.float32),
        "b": rng.standard_normal((n, 7)).astype(np.float32),
        "empty": np.zeros((n, 0, 3), np.float32),
        "big": rng.standard_normal((n, 5000)).astype(np.float32),
        "count": rng.integers(-1000, 1000, (n, 4)).astype(np.int32),
        "flag": rng.random((n, 3)) < 0.5,
        "half": rng.standard_normal((n, 9)).astype(jnp.bfloat16),
        "nested": [rng.standard_normal((n, 2)).astype(np.float32)],
    }


def assert_tree_equal(got, want, *, rtol=2e-6, identical=True):
    """Leaves equal to lax's; with ``identical``, bitwise the same on every device (full-mesh sums)."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(got_l, want_l):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        for d in range(1, g.shape[0] if g.ndim and identical else 1):
            assert g[d].tobytes() == g[0].tobytes()
        if g.dtype == jnp.bfloat16:  # rounded per tree hop (documented): a few ulps
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=3e-2, atol=3e-2)
        elif np.issubdtype(g.dtype, np.floating):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w).max(initial=0))))
        else:
            np.testing.assert_array_equal(g, w)


def smap(f, mesh, check_vma):
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))


def squeeze(t):
    return jax.tree.map(lambda v: v[0], t)


def unsqueeze(t):
    return jax.tree.map(lambda v: v[None], t)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("perm", [list(range(N)), PERM8], ids=["mesh", "permuted"])
@pytest.mark.slow
def test_pytree_psum_shard_map(impl, check_vma, perm):
    mesh = Mesh(np.array(jax.devices())[perm], ("i",))
    x = tree_inputs()
    got = smap(lambda t: unsqueeze(jax_blink.psum(squeeze(t), "i", impl=impl)), mesh, check_vma)(x)
    want = smap(lambda t: unsqueeze(lax.psum(squeeze(t), "i")), mesh, check_vma)(x)
    assert_tree_equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_pytree_pmean_pmap_with_python_scalar(impl):
    x = tree_inputs()
    def f(t):
        return (jax_blink.pmean(t, "i", impl=impl), jax_blink.psum({"s": 2.5, "t": t["b"]}, "i", impl=impl))
    def g(t):
        return (lax.pmean(t, "i"), lax.psum({"s": 2.5, "t": t["b"]}, "i"))
    got, want = jax.pmap(f, axis_name="i")(x), jax.pmap(g, axis_name="i")(x)
    assert_tree_equal(got[0], want[0])
    assert float(got[1]["s"][0]) == 2.5 * N
    assert_tree_equal(got[1]["t"], want[1]["t"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_pytree_2d_mesh_tuple_axes_and_groups(impl):
    devs = np.array(jax.devices())[PERM8].reshape(2, 4)
    mesh = Mesh(devs, ("a", "b"))
    x = tree_inputs()
    for axes in ("b", ("a", "b")):
        got = smap(lambda t, axes=axes: unsqueeze(jax_blink.psum(squeeze(t), axes, impl=impl)), mesh, True)(x)
        want = smap(lambda t, axes=axes: unsqueeze(lax.psum(squeeze(t), axes)), mesh, True)(x)
        assert_tree_equal(got, want, identical=axes != "b")
    groups = [[0, 2], [1, 3]]
    got = smap(lambda t: unsqueeze(jax_blink.psum(squeeze(t), "b", axis_index_groups=groups, impl=impl)),
               mesh, False)(x)
    want = smap(lambda t: unsqueeze(lax.psum(squeeze(t), "b", axis_index_groups=groups)), mesh, False)(x)
    assert_tree_equal(got, want, identical=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_pytree_grad_both_vma_modes(impl):
    # d/dw sum_i psum(w_i**2 + v_i) : 2w (check_vma=True: transpose is pvary) or n*2w (False)
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = tree_inputs()
    params = {"w": x["w"], "b": x["b"], "e": x["empty"]}

    def loss(psum, t):
        s = psum({"a": t["w"] ** 2, "b": t["b"] * 3.0, "e": t["e"]}, "i")
        return s["a"].sum() + s["b"].sum() + s["e"].sum()

    for check_vma in (True, False):
        def run(psum, check_vma=check_vma):
            g = jax.grad(lambda t: loss(psum, t))
            return smap(lambda t: unsqueeze(g(squeeze(t))), mesh, check_vma)(params)

        got = run(lambda t, a: jax_blink.psum(t, a, impl=impl))
        want = run(lax.psum)
        assert_tree_equal(got, want, identical=False)  # per-device gradients
        scale = 1.0 if check_vma else float(N)
        np.testing.assert_allclose(np.asarray(got["w"]), scale * 2 * params["w"], rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_pytree_vmap_and_scan(impl):
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = tree_inputs()
    sub = {"w": x["w"], "count": x["count"], "flag": x["flag"]}

    # vmap over an inner named axis (reduced locally) around the mesh collective
    def vm(psum):
        def body(t):
            t = squeeze(t)
            inner = jax.tree.map(lambda v: jnp.stack([v, v + 1]), t)
            out = jax.vmap(lambda u: psum(u, ("j", "i")), axis_name="j")(inner)
            return unsqueeze(jax.tree.map(lambda v: v[0], out))
        return smap(body, mesh, False)(sub)

    assert_tree_equal(vm(lambda t, a: jax_blink.psum(t, a, impl=impl)), vm(lax.psum))

    # a call site inside lax.scan: every iteration meets again (per-device generation)
    def sc(psum):
        def body(t):
            def step(c, _):
                s = psum(c, "i")
                return jax.tree.map(lambda v: v // 2 if v.dtype == jnp.int32 else v * 0.125, s), None
            c, _ = lax.scan(step, squeeze({"w": t["w"], "count": t["count"]}), None, length=5)
            return unsqueeze(c)
        return smap(body, mesh, False)(sub)

    assert_tree_equal(sc(lambda t, a: jax_blink.psum(t, a, impl=impl)), sc(lax.psum))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_pytree_broadcast_and_reduce(impl):
    mesh = Mesh(np.array(jax.devices())[PERM8], ("i",))
    x = tree_inputs()
    got = smap(lambda t: unsqueeze(jax_blink.broadcast(squeeze(t), "i", root=3, impl=impl)), mesh, False)(x)
    want = jax.tree.map(lambda v: np.broadcast_to(v[3], v.shape), x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # broadcast moves bits: exact
        assert np.asarray(g).dtype == w.dtype and np.asarray(g).tobytes() == np.ascontiguousarray(w).tobytes()
    f32 = {"w": x["w"], "b": x["b"], "big": x["big"]}
    got = smap(lambda t: unsqueeze(jax_blink.reduce(squeeze(t), "i", root=5, impl=impl)), mesh, False)(f32)
    for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(f32)):
        g = np.asarray(g)
        np.testing.assert_allclose(g[5], v.sum(0), rtol=1e-5, atol=1e-4)
        assert not np.delete(g, 5, axis=0).any()


@pytest.mark.skipif("ffi" not in IMPLS, reason="native CPU module not built")
def test_one_custom_call_per_dtype_no_concatenate_and_aliasing():
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = tree_inputs()
    f = smap(lambda t: unsqueeze(jax_blink.psum(jax.tree.map(lambda v: v * 2, squeeze(t)), "i", impl="ffi")),
             mesh, False)
    text = f.lower(x).as_text()
    calls = [line for line in text.splitlines() if "custom_call @jax_blink_cpu" in line]
    # float32 (w, b, big, nested[0]), int32 (count + flag as int32), bfloat16: three buckets, three calls
    assert len(calls) == 3, calls
    assert "stablehlo.concatenate" not in text and "stablehlo.slice" not in text
    assert all("output_operand_aliases" in c for c in calls)  # operands computed here are aliased
    assert_tree_equal(f(x), smap(lambda t: unsqueeze(lax.psum(jax.tree.map(lambda v: v * 2, squeeze(t)), "i")),
                                 mesh, False)(x))


@pytest.mark.skipif("ffi" not in IMPLS, reason="native CPU module not built")
def test_aliased_operand_still_used_after_the_call():
    # The operand lives on after the collective, and is passed twice: XLA must copy it before the
    # in-place call (aliasing is a request; XLA keeps the program's meaning).
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = tree_inputs()["big"]

    def body(v):
        u = v[0] * 3.0
        s = jax_blink.psum([u, u + 1.0, u], "i", impl="ffi")
        return (s[0] + s[1] + s[2] - u)[None], u[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    got, u = f(x)
    want = 2 * (x * 3.0).sum(0) + ((x * 3.0) + 1.0).sum(0) - x * 3.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(u), (x * 3.0).astype(np.float32))


@pytest.mark.skipif(_native.cpu is None, reason="native CPU module not built")
@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("nelems", [70_001, 600_001])  # the second moves > 32 MiB: streaming stores
@pytest.mark.slow
def test_native_leaves_virtual_concatenation(collective, in_place, nelems):
    # The executor over leaves cut at odd places (tiles split at leaf boundaries, unaligned starts),
    # in place or not, equals the NumPy reference of the schedule over the whole array, bit for bit.
    n = 8
    p = plan(Topology.preset("dgx1v"), collective, root=None if collective == "allreduce" else 2)
    sched = build_schedule(p, nelems, chunk_elems=9_000)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(nelems).astype(np.float32) for _ in range(n)]
    want = execute(sched, np.stack(xs))
    ins = [x.copy() for x in xs]
    outs = [np.full_like(x, 7) for x in xs]
    table = np.asarray([(d, 0, r) for r, d in enumerate(range(n))], np.int64).reshape(-1)
    err = _native.cpu.simulate(sched.to_array(), table, list(range(n)), ins, outs, ["float32"] * n, 5000, 77,
                               leaf_sizes=[1, 8191, 0, 8193, 30_000], in_place=in_place)
    assert err == ""
    got = np.stack(ins if in_place else outs)
    assert got.tobytes() == np.asarray(want, np.float32).tobytes()
