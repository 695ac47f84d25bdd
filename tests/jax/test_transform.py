"""jax_blink.transform: a program's own lax collectives run by jax_blink.

Every collective kind inside every construct against the same program on lax (values, and the
compiled program has no XLA all-reduce / all-gather / reduce-scatter left), composition with jit,
grad and vmap, what stays on lax (reported and logged), a function traced before and after (no
stale trace), and a Flax BatchNorm(axis_name=...) model trained in lockstep with and without it.
"""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import api, lowering  # noqa: F401  (api registers the lowerings)

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("i",))
IMPL = "ffi" if lowering.find_lowering("ffi", "cpu") is not None else "ppermute"
XLA_COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter)(-start)?\(")


def _hlo(f, *args) -> str:
    return f.lower(*args).compile().as_text()


def _xla_collectives(f, *args) -> list:
    return XLA_COLLECTIVES.findall(_hlo(f, *args))


# ----------------------------------------------------------------------------- kinds x constructs
def _kind(kind):
    """One lax collective of each kind, as a function of a per-device block [N * 2] (float32)."""
    return {
        "psum": lambda v: lax.psum(v, "i"),
        "pmean": lambda v: lax.pmean(v, "i"),
        "all_gather": lambda v: lax.all_gather(v, "i", axis=0, tiled=True)[: v.shape[0]] * 2.0,
        "psum_scatter": lambda v: jnp.tile(lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True), N),
    }[kind]


def _cvjp(c):
    """custom_vjp whose primal and backward rule both run ``c`` (the rule's collective is reached
    when differentiating outside the transform)."""
    @jax.custom_vjp
    def f(v):
        return c(v)

    def fwd(v):
        return c(v), None

    def bwd(_, g):
        return (c(g),)

    f.defvjp(fwd, bwd)
    return f


def _cjvp(c):
    @jax.custom_jvp
    def f(v):
        return c(v)

    @f.defjvp
    def f_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        return c(v), c(t)

    return f


CONSTRUCTS = {
    "plain": lambda c: c,
    "jit": lambda c: jax.jit(c),
    # (c(u) + u): the carry stays varying over "i" under check_vma (a psum's result is invariant)
    "scan": lambda c: lambda v: lax.scan(lambda carry, _: ((c(carry) + carry) * 0.5, None), v, None, length=2)[0],
    "cond": lambda c: lambda v: lax.cond(v[0] > -1.0, lambda u: c(u) + u, lambda u: u * 3.0, v),
    "while": lambda c: lambda v: lax.fori_loop(0, 2, lambda _, u: (c(u) + u) * 0.5, v),
    "remat": lambda c: jax.checkpoint(c),
    "custom_vjp": _cvjp,
    "custom_jvp": _cjvp,
}


def _per_device(kind, construct):
    body = CONSTRUCTS[construct](_kind(kind))
    return lambda v: body(v * (lax.axis_index("i") + 1.0))


def _smap(f, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))


@pytest.mark.parametrize("construct", list(CONSTRUCTS))
@pytest.mark.parametrize("kind", ["psum", "pmean", "all_gather", "psum_scatter"])
def test_every_kind_in_every_construct_matches_lax(kind, construct):
    x = jnp.arange(N * N * 2, dtype=jnp.float32) / 7.0
    f = _per_device(kind, construct)
    lax_f, blink_f = _smap(f), _smap(jax_blink.transform(f, impl=IMPL))
    np.testing.assert_allclose(np.asarray(blink_f(x)), np.asarray(lax_f(x)), rtol=1e-6, atol=1e-6)
    assert _xla_collectives(lax_f, x), "the lax program should use XLA's collectives"
    assert not _xla_collectives(blink_f, x), f"{kind} in {construct} stayed on XLA"
    # the report names the collective and where it was
    g = jax_blink.transform(f, impl=IMPL)
    jax.make_jaxpr(jax.shard_map(g, mesh=MESH, in_specs=P("i"), out_specs=P("i")))(x)
    assert g.rewrites and all(r.by == "jax_blink" for r in g.rewrites), jax_blink.transform_report(g)
    if construct not in ("plain", "custom_vjp", "custom_jvp"):
        assert any("/" in r.where for r in g.rewrites), jax_blink.transform_report(g)


@pytest.mark.parametrize("construct", ["plain", "scan", "remat", "custom_vjp", "custom_jvp"])
@pytest.mark.parametrize("kind", ["psum", "all_gather", "psum_scatter"])
@pytest.mark.slow
def test_grad_outside_the_transform(kind, construct):
    """grad(transform(f)): jax_blink's primitives carry the derivative (and a custom rule's own
    collective is rewritten when the rule runs); gradients equal lax's, no XLA collective left."""
    x = jnp.arange(N * N * 2, dtype=jnp.float32) / 11.0
    f = _per_device(kind, construct)

    def grad_of(h):
        return _smap(jax.grad(lambda v: jnp.sum(h(v) ** 2) * 1e-3), check_vma=False)

    want, got = grad_of(f), grad_of(jax_blink.transform(f, impl=IMPL))
    np.testing.assert_allclose(np.asarray(got(x)), np.asarray(want(x)), rtol=1e-5, atol=1e-6)
    assert not _xla_collectives(got, x)


def test_pmap_jit_vmap_compose():
    """pmap over the transform, vmap inside and outside it, grad inside fn, jit around all."""
    def loss(w, v):
        return lax.pmean(jnp.sum((w * v) ** 2), "i")

    def step(w, v):
        return jax.vmap(lambda vi: jax.grad(loss)(w, vi))(v)  # vmap over a batch inside fn

    x = jnp.arange(N * 3 * 4, dtype=jnp.float32).reshape(N, 3, 4) / 10.0
    w = jnp.ones((N, 4))
    want = jax.pmap(step, axis_name="i")(w, x)
    t = jax_blink.transform(step, impl=IMPL)
    got = jax.pmap(t, axis_name="i")(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    # pmean's psum and, pmap's psum being transposed to a psum, its cotangent's
    assert [(r.primitive, r.by) for r in t.rewrites] == [("psum", "jax_blink")] * 2, jax_blink.transform_report(t)
    # vmap outside the transform, inside the map
    vm = jax.jit(jax.pmap(jax.vmap(t, in_axes=(None, 0)), axis_name="i"))
    np.testing.assert_allclose(np.asarray(vm(w, x[:, None])), np.asarray(want)[:, None], rtol=1e-6)
    assert not _xla_collectives(vm, w, x[:, None])


def test_transform_outside_the_map():
    """A function that calls jax.shard_map itself: the map's body is rewritten under the map."""
    x = jnp.arange(N * 4, dtype=jnp.float32)

    def prog(v):
        return jax.shard_map(lambda u: lax.psum(u, "i") + lax.all_gather(u, "i", tiled=True)[:4], mesh=MESH,
                             in_specs=P("i"), out_specs=P("i"))(v)

    t = jax.jit(jax_blink.transform(prog, impl=IMPL))
    np.testing.assert_allclose(np.asarray(t(x)), np.asarray(jax.jit(prog)(x)), rtol=1e-6)
    assert not _xla_collectives(t, x)


def test_left_on_lax_is_reported_and_logged(caplog):
    """A psum over a vmap axis (no devices) and a kind not asked for stay on lax, and say so."""
    x = jnp.arange(N * 2 * 3, dtype=jnp.float32).reshape(N * 2, 3)

    def row(r):  # vmapped with axis_name "b" inside the map: "b" is not a mesh axis
        return lax.psum(r, "b") + lax.psum(r, "i") + lax.all_gather(r, "i", tiled=True)[: r.shape[0]]

    t = jax_blink.transform(row, collectives=("psum",), impl=IMPL)

    def smap(h):
        return jax.jit(jax.shard_map(jax.vmap(h, axis_name="b"), mesh=MESH, in_specs=P("i"), out_specs=P("i"),
                                     check_vma=False))

    with caplog.at_level(logging.INFO, logger="jax_blink"):
        got = smap(t)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(smap(row)(x)), rtol=1e-6)
    by = {(r.primitive, r.axes): r for r in t.rewrites}
    assert by[("psum", ("i",))].by == "jax_blink"
    assert by[("psum", ("b",))].by == "lax" and "not mesh / pmap axes" in by[("psum", ("b",))].reason
    assert by[("all_gather", ("i",))].by == "lax" and "not asked for" in by[("all_gather", ("i",))].reason
    text = jax_blink.transform_report(t)
    assert text.startswith("transform(row): 3 lax collective(s) met, 1 run by jax_blink in 1 call(s), 2 left on lax")
    assert "axes ['b'] are not mesh / pmap axes" in text and "collectives= does not name 'all_gather'" in text
    assert "test_transform.py:" in text and "<function" not in text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("lax.psum over ('b',)" in m and "-> lax" in m for m in warnings), warnings
    assert not any("all_gather" in m for m in warnings), warnings  # not asked for: no warning
    assert any("1 lax collective(s) run by jax_blink in 1 call(s), 2 left on lax" in r.getMessage()
               for r in caplog.records)


def test_bad_arguments():
    with pytest.raises(ValueError, match="collectives must name some of"):
        jax_blink.transform(lambda v: v, collectives=("pmax",))
    with pytest.raises(ValueError, match="impl must be one of"):
        jax_blink.transform(lambda v: v, impl="nccl")
    with pytest.raises(TypeError, match="takes a function returned by jax_blink.transform"):
        jax_blink.transform_report(lambda v: v)


def test_no_stale_trace():
    """A function traced (and its inner jit cached) on lax first, then transformed, then plain again:
    each program runs what it was asked to, whichever trace JAX cached."""
    inner = jax.jit(lambda v: lax.psum(v * 2.0, "i"))

    def g(v):
        return inner(v) + lax.pmean(v, "i")

    x = jnp.arange(N * 2, dtype=jnp.float32)
    plain = _smap(g)
    want = np.asarray(plain(x))  # traced and compiled on lax: jax caches inner's jaxpr
    assert _xla_collectives(plain, x)
    t = _smap(jax_blink.transform(g, impl=IMPL))
    np.testing.assert_allclose(np.asarray(t(x)), want, rtol=1e-6)
    assert not _xla_collectives(t, x)
    again = _smap(g)  # a new jit of the same function: still lax, nothing leaked
    assert _xla_collectives(again, x)
    np.testing.assert_array_equal(np.asarray(again(x)), want)


# ----------------------------------------------------------------------------- Flax BatchNorm
@pytest.mark.slow
def test_flax_batchnorm_trains_in_lockstep():
    """A Flax model with BatchNorm(axis_name="i") (its batch statistics averaged by lax.pmean inside
    Flax) trained data-parallel under pmap, the train step with and without jax_blink.transform:
    every step's loss equal within 1e-5 relative from the same state, and the transformed step has
    no XLA all-reduce (BatchNorm's and the gradients' pmean run by jax_blink)."""
    flax_nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class Net(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x, train: bool):
            x = flax_nn.Dense(16)(x)
            x = flax_nn.BatchNorm(use_running_average=not train, axis_name="i", momentum=0.9)(x)
            return flax_nn.Dense(3)(flax_nn.relu(x))

    model, tx = Net(), optax.sgd(0.1)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(6, N, 4, 5)).astype(np.float32)
    ys = rng.integers(0, 3, size=(6, N, 4))
    variables = model.init(jax.random.PRNGKey(0), xs[0, 0], train=False)
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, stats, opt, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = lax.pmean(grads, "i")
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), new_stats, opt, lax.pmean(loss, "i")

    t = jax_blink.transform(step, impl=IMPL)
    lax_step, blink_step = jax.pmap(step, axis_name="i"), jax.pmap(t, axis_name="i")
    rep = functools.partial(jax.tree.map, lambda v: jnp.broadcast_to(v, (N, *np.shape(v))))
    state = (rep(params), rep(stats), rep(tx.init(params)))
    for k in range(len(xs)):
        *new, loss_lax = lax_step(*state, xs[k], ys[k])
        *_, loss_blink = blink_step(*state, xs[k], ys[k])
        np.testing.assert_allclose(np.asarray(loss_blink), np.asarray(loss_lax), rtol=1e-5)
        state = tuple(new)
    # BatchNorm's pmean of (mean, mean of squares), its gradient's, the gradients' and the loss's
    assert len(t.rewrites) >= 3 and all(r.by == "jax_blink" for r in t.rewrites), jax_blink.transform_report(t)
    assert not _xla_collectives(blink_step, *state, xs[0], ys[0])
    assert _xla_collectives(lax_step, *state, xs[0], ys[0])


def test_transform_validates_its_arguments_when_called():
    """Checked at transform(), before any tracing, each error naming jax_blink.transform and what is valid."""
    import pytest as _pytest

    from jax_blink.errors import TopologyError
    step = lambda v: v  # noqa: E731
    with _pytest.raises(TopologyError, match=r"jax_blink.transform: .*'nope'.*host<N>"):
        jax_blink.transform(step, topology="nope")
    with _pytest.raises(TopologyError, match=r"jax_blink.transform: preset 'host0': host<N> takes N .* in 1\.\.4096"):
        jax_blink.transform(step, topology="host0")
    with _pytest.raises(ValueError, match=r"jax_blink.transform: algorithm= must be one of"):
        jax_blink.transform(step, algorithm="fastest")
    with _pytest.raises(TypeError, match=r"jax_blink.transform: fn must be a function"):
        jax_blink.transform(3)
    with _pytest.raises(ValueError, match=r"jax_blink.transform: max_trees"):
        jax_blink.transform(step, max_trees=0)
    assert callable(jax_blink.transform(step, topology="host8"))
