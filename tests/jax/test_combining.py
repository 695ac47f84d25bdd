"""Combining independent collectives into buckets (jax_blink.combining, through jax_blink.transform).

Hand-counted programs (which psums depend on which) against the calls in the compiled HLO and the
call sites the lowering reports; values against the same program on lax; the byte threshold (argument
and environment variable) splitting buckets; a multi-operand bind as one custom call; sub-jaxprs
(scan, jit) combined inside; a model with many gradient leaves; the order planner on its own.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import api, callsites, combining, lowering  # noqa: F401  (api registers the lowerings)

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("i",))
FFI = lowering.find_lowering("ffi", "cpu") is not None
IMPL = "ffi" if FFI else "ppermute"
CUSTOM_CALL = re.compile(r'custom_call_target="jax_blink_cpu"')
ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")


def _smap(f, check_vma=False):
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))


def _calls(f, *args) -> tuple[int, int, int]:
    """(call sites the lowering reported, jax_blink custom calls, XLA all-reduces) of jitted ``f``."""
    jax.clear_caches()
    with callsites.collect() as sites:
        lowered = f.lower(*args)
    text = lowered.compile().as_text()
    return len(sites), len(CUSTOM_CALL.findall(text)), len(ALL_REDUCE.findall(text))


def _program(a, b, c):
    """Five psums; s3 depends on s1, the others on none: buckets {s1} and {s2, s3, s4, s5}, in program
    order s2, s3, s4, s5 at the same height (nothing after them). s5 is jax_blink's own call."""
    s1 = lax.psum(a, "i")
    s2 = lax.psum(b, "i")
    s3 = lax.psum(s1 * 2.0 + 1.0, "i")
    s4 = lax.psum(c * 3.0, "i")
    s5 = jax_blink.psum(b + 1.0, "i", impl=IMPL)
    return s3 + s2 + s4 + s5


ARGS = [jnp.arange(N * 256, dtype=jnp.float32) * (k + 1) / 100.0 for k in range(3)]  # 1 KiB per device each


@pytest.mark.parametrize("threshold, buckets", [(None, 2), (0, 5), (2048, 3), (1024, 5)])
def test_hand_counted_buckets(threshold, buckets):
    """Default threshold: 2 calls; 0: none combined (5); 2 KiB: {s1}, {s2, s3}, {s4, s5} (3); 1 KiB:
    each operand alone reaches it (5). Values as lax's, no XLA all-reduce left."""
    t = jax_blink.transform(_program, impl=IMPL, combine_threshold_bytes=threshold)
    f = _smap(t)
    sites, custom, ar = _calls(f, *ARGS)
    assert sites == buckets
    if FFI:
        assert custom == buckets
    assert ar == 0
    np.testing.assert_allclose(np.asarray(f(*ARGS)), np.asarray(_smap(_program)(*ARGS)), rtol=1e-6)
    assert t.calls == {None: 2, 0: 4, 2048: 3, 1024: 4}[threshold]  # calls running lax's psums (s5 is not)
    merged = [c.equations for c in t.combined]
    assert sorted(merged) == {None: [4], 0: [], 2048: [2, 2], 1024: []}[threshold]


def test_threshold_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_COMBINE_THRESHOLD_BYTES", "2048")
    assert _calls(_smap(jax_blink.transform(_program, impl=IMPL)), *ARGS)[0] == 3
    monkeypatch.setenv("JAX_BLINK_COMBINE_THRESHOLD_BYTES", "0")
    assert _calls(_smap(jax_blink.transform(_program, impl=IMPL)), *ARGS)[0] == 5
    monkeypatch.setenv("JAX_BLINK_COMBINE_THRESHOLD_BYTES", "2 MiB")
    with pytest.raises(ValueError, match=r"JAX_BLINK_COMBINE_THRESHOLD_BYTES=.*takes an integer in 0\.\."):
        _smap(jax_blink.transform(_program, impl=IMPL)).lower(*ARGS)
    for bad in (-1, 1.5, True, "1024"):
        with pytest.raises(ValueError, match="combine_threshold_bytes= must be an integer"):
            jax_blink.transform(_program, combine_threshold_bytes=bad)


def test_dependent_chain_stays_apart_and_crossing_keys_do_not_cycle():
    """A chain of psums cannot combine (3 calls); two keys (float32, int32) whose members feed each
    other crosswise (a1 -> b2, b1 -> a2) would form a cycle if merged naively: 4 calls, right values."""
    def chain(a, b, c):
        return lax.psum(lax.psum(lax.psum(a, "i") * 0.5, "i") + b, "i") + c

    assert _calls(_smap(jax_blink.transform(chain, impl=IMPL)), *ARGS)[0] == 3

    def crossing(a, b, c):
        i = (b * 10).astype(jnp.int32)
        a1, b1 = lax.psum(jnp.round(a), "i"), lax.psum(i, "i")  # integral floats: sums exact in any order
        b2 = lax.psum(a1.astype(jnp.int32), "i")
        a2 = lax.psum(b1.astype(jnp.float32), "i")
        return a2 + b2.astype(jnp.float32) + c

    f = _smap(jax_blink.transform(crossing, impl=IMPL))
    assert _calls(f, *ARGS)[0] == 4
    np.testing.assert_array_equal(np.asarray(f(*ARGS)), np.asarray(_smap(crossing)(*ARGS)))


def test_multi_operand_bind_is_one_custom_call():
    """jax_blink.psum of three leaves of one dtype: one primitive bind, one FFI custom call in the module
    every device runs (SPMD: one call per device)."""
    if not FFI:
        pytest.skip("the native CPU module is not built (the ffi lowering is what is counted)")
    f = _smap(lambda a, b, c: sum(jax_blink.psum([a, b, c], "i", impl="ffi")))
    text = f.lower(*ARGS).as_text(dialect="hlo")
    assert len(CUSTOM_CALL.findall(text)) == 1
    np.testing.assert_allclose(np.asarray(f(*ARGS)), np.asarray(_smap(lambda a, b, c: lax.psum(a + b + c, "i"))(*ARGS)),
                               rtol=1e-6)


def test_inside_scan_and_jit_bodies():
    """Two independent psums inside a scan body and two inside an inner jit combine there (one call
    each); the body's psums cannot join the outside ones."""
    def body(carry, _):
        return (lax.psum(carry, "i") * 0.1 + lax.psum(carry * 2.0, "i") * 0.1), None

    inner = jax.jit(lambda v: lax.psum(v, "i") - lax.psum(v * v, "i"))

    def prog(a, b, c):
        return lax.scan(body, a, None, length=3)[0] + inner(b) + lax.psum(c, "i")

    t = jax_blink.transform(prog, impl=IMPL)
    f = _smap(t)
    assert _calls(f, *ARGS)[0] == 3  # scan body 1, jit body 1, outside 1
    assert sorted(c.where for c in t.combined) in (["prog/jit", "prog/scan"], ["prog/pjit", "prog/scan"])
    np.testing.assert_allclose(np.asarray(f(*ARGS)), np.asarray(_smap(prog)(*ARGS)), rtol=1e-5)


def test_many_leaves_gradient_pmean_is_one_call():
    """A 64-leaf parameter tree, ``lax.pmean`` of its gradient (one psum per leaf on jax 0.10) and of
    the loss: all at the end of the step, independent: one call, results within float tolerance of lax."""
    rng = np.random.default_rng(0)
    params = {f"w{k}": jnp.asarray(rng.standard_normal((3 + k % 5,)), jnp.float32) for k in range(64)}
    x = jnp.asarray(rng.standard_normal((N * 2, 8)), jnp.float32)

    def step(p, xb):
        def loss(q):
            return sum(jnp.sum(jnp.tanh(xb[:, : v.shape[0]] * v)) for v in q.values())
        value, g = jax.value_and_grad(loss)(p)
        return lax.pmean(g, "i"), lax.pmean(value, "i")

    def smap(h):
        return jax.jit(jax.shard_map(h, mesh=MESH, in_specs=(P(), P("i")), out_specs=(P(), P()), check_vma=False))

    t = jax_blink.transform(step, impl=IMPL)
    sites, custom, ar = _calls(smap(t), params, x)
    assert (sites, ar) == (1, 0) and (custom == 1 or not FFI)
    assert sum(r.by == "jax_blink" for r in t.rewrites) == 65 and t.calls == 1
    got, want = smap(t)(params, x), smap(step)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_check_vma_program_combines():
    """Under shard_map(check_vma=True) (psum_invariant equations) the same buckets form."""
    f = _smap(jax_blink.transform(_program, impl=IMPL), check_vma=True)
    assert _calls(f, *ARGS)[0] == 2
    np.testing.assert_allclose(np.asarray(f(*ARGS)), np.asarray(_smap(_program, check_vma=True)(*ARGS)), rtol=1e-6)


def test_plan_orders_a_bucket_before_its_first_consumer():
    """combining.plan on a jaxpr alone: the bucket of two independent psums comes before the
    equation that consumes the first one's result, and after both operands exist."""
    def prog(a, b):
        s = lax.psum(a, "i")
        u = s * 2.0  # consumes s before t is computed in program order
        v = jnp.sin(b)
        t = lax.psum(v, "i")
        return u + t

    closed = jax.make_jaxpr(jax.shard_map(prog, mesh=MESH, in_specs=P("i"), out_specs=P("i"), check_vma=False))(
        ARGS[0], ARGS[1])
    body = closed.jaxpr.eqns[0].params["jaxpr"]
    names = [e.primitive.name for e in body.eqns]

    def key(e):
        return "psum" if e.primitive.name == "psum" else None

    steps, buckets = combining.plan(body, key)
    assert len(buckets) == 1 and [names[i] for i in buckets[0].eqns] == ["psum", "psum"]
    order = [s.eqns if isinstance(s, combining.Bucket) else (s,) for s in steps]
    flat = [i for s in order for i in s]
    assert sorted(flat) == list(range(len(body.eqns)))
    where = {i: k for k, s in enumerate(order) for i in s}
    sin, mul = names.index("sin"), names.index("mul")
    assert where[sin] < where[buckets[0].eqns[0]] < where[mul]
    assert combining.plan(body, key, threshold_bytes=0) == (list(range(len(body.eqns))), [])
