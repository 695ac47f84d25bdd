"""Cases for tests/jax/test_rendezvous.py, run in a subprocess so that a deadlock fails within a time limit.

A jax_blink FFI collective once deadlocked when an XLA collective consumed its result: completing
one device's future ran that device's program inline, straight into XLA's rendezvous, on the thread
that still had to release the other devices (docs/architecture.md, "Rendezvous"). XLA then aborts
the whole process, so the cases cannot run inside pytest's own process.

Usage: python tests/jax/rendezvous_cases.py BATCH[:TEXT] ...   (batches: BATCHES at the end; TEXT: only
the cases whose name contains it)
Prints "START <case>" before and "OK <case>" / "FAIL <case>: <why>" after each case (flushed), so
the parent can name the case that hung. Each case compiles ONE program that computes the jax_blink
chain and the same chain with lax only, and compares the two with numpy.
"""

import dataclasses
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import lowering
from jax_blink.lowering import ffi as ffi_lowering

N = 8
AX = "i"
# A permuted mesh: device ids differ from axis indices (the device table must map them).
MESH = Mesh(np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 4, 6]], (AX,))
ROOT_B, ROOT_R = 3, 5
SHIFT = [(j, (j + 1) % N) for j in range(N)]

# Small integers as float32: every summation order gives the same bits, so the jax_blink chain
# must equal the lax chain exactly.
X = np.random.default_rng(0).integers(-8, 9, size=(N * N, 3)).astype(np.float32)


def _idx():
    return lax.axis_index(AX)


# jax_blink collectives and their lax-only equivalents (lax has no broadcast/reduce: psum of the
# root's operand, and the root's psum with zeros elsewhere).
def blink_ops(impl):
    return {
        "psum": lambda v: jax_blink.psum(v, AX, impl=impl),
        "pmean": lambda v: jax_blink.pmean(v, AX, impl=impl),
        "broadcast": lambda v: jax_blink.broadcast(v, AX, ROOT_B, impl=impl),
        "reduce": lambda v: jax_blink.reduce(v, AX, ROOT_R, impl=impl),
        # sharded collectives, cut back to the operand's shape
        "all_gather": lambda v: jax_blink.all_gather(v, AX, tiled=True, impl=impl)[N * ROOT_R:N * ROOT_R + N],
        "psum_scatter": lambda v: jnp.tile(jax_blink.psum_scatter(v, AX, tiled=True, impl=impl), (N, 1)),
    }


LAX_EQUIV = {
    "psum": lambda v: lax.psum(v, AX),
    "pmean": lambda v: lax.pmean(v, AX),
    "broadcast": lambda v: lax.psum(jnp.where(_idx() == ROOT_B, v, jnp.zeros_like(v)), AX),
    "reduce": lambda v: jnp.where(_idx() == ROOT_R, lax.psum(v, AX), jnp.zeros_like(v)),
    "all_gather": lambda v: lax.all_gather(v, AX, tiled=True)[N * ROOT_R:N * ROOT_R + N],
    "psum_scatter": lambda v: jnp.tile(lax.psum_scatter(v, AX, tiled=True), (N, 1)),
}

# XLA collectives (operands have a leading dimension of N, for psum_scatter and all_to_all).
XLA_OPS = {
    "psum": lambda v: lax.psum(v, AX),
    "pmean": lambda v: lax.pmean(v, AX),
    "pmax": lambda v: lax.pmax(v, AX),
    "all_gather": lambda v: lax.all_gather(v, AX, tiled=True)[N * ROOT_B:N * ROOT_B + N],
    "ppermute": lambda v: lax.ppermute(v, AX, SHIFT),
    "psum_scatter": lambda v: jnp.tile(lax.psum_scatter(v, AX, scatter_dimension=0, tiled=True), (N, 1)),
    "all_to_all": lambda v: lax.all_to_all(v, AX, 0, 0, tiled=True),
}

MODES = ("pmap", "smap_vma", "smap_novma")
SHARDED = P(AX)  # blocks along the mesh axis


def compile_mode(fn, mode, in_specs=SHARDED, out_specs=SHARDED):
    """fn over one device's block -> a jitted function over global arrays (pmap: leading axis N)."""
    if mode == "pmap":
        return jax.pmap(fn, axis_name=AX, devices=list(MESH.devices))
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=(mode == "smap_vma")))


def mode_input(x, mode):
    return x.reshape(N, -1, *x.shape[1:]) if mode == "pmap" else x


def run_pair(name, mode, chain_blink, chain_lax, x=X, exact=True):
    """Compile one program computing both chains; the jax_blink one must equal the lax one."""
    f = compile_mode(lambda v: (chain_blink(v), chain_lax(v)), mode)
    got, want = jax.block_until_ready(f(mode_input(x, mode)))
    got, want = np.asarray(got), np.asarray(want)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def check_lowering(mode, impl):
    """impl "auto" must be the FFI custom call on CPU (else these cases would test nothing new)."""
    f = compile_mode(lambda v: jax_blink.psum(v, AX, impl=impl), mode)
    text = f.lower(mode_input(X, mode)).as_text()
    assert ("jax_blink_cpu" in text) == (impl != "ppermute"), f"impl={impl!r} lowered unexpectedly"


def pairs_cases(mode, impl, blinks=None, xlas=None):
    """Each jax_blink collective followed by, and preceded by, each XLA collective."""
    ops = blink_ops(impl)
    yield f"{mode}/{impl}/lowering", lambda: check_lowering(mode, impl)
    for b in blinks or ops:
        for o in xlas or XLA_OPS:
            xo = XLA_OPS[o]
            bf, bl = ops[b], LAX_EQUIV[b]
            yield (f"{mode}/{impl}/{b}->{o}",
                   lambda bf=bf, bl=bl, xo=xo: run_pair("", mode, lambda v: xo(bf(v)), lambda v: xo(bl(v))))
            yield (f"{mode}/{impl}/{o}->{b}",
                   lambda bf=bf, bl=bl, xo=xo: run_pair("", mode, lambda v: bf(xo(v)), lambda v: bl(xo(v))))


def chain_cases(mode, impl="auto"):
    """blink -> lax -> blink, each collective consuming the previous one's result."""
    ops = blink_ops(impl)
    chains = [("psum", "all_gather", "pmean"), ("broadcast", "ppermute", "reduce"),
              ("reduce", "psum_scatter", "psum"), ("pmean", "all_to_all", "broadcast"),
              ("psum", "pmax", "psum"), ("all_gather", "psum", "psum_scatter"),
              ("psum_scatter", "all_gather", "all_gather")]
    for b1, o, b2 in chains:
        xo = XLA_OPS[o]
        yield (f"{mode}/chain/{b1}->{o}->{b2}",
               lambda b1=b1, b2=b2, xo=xo: run_pair(
                   "", mode, lambda v: ops[b2](xo(ops[b1](v))), lambda v: LAX_EQUIV[b2](xo(LAX_EQUIV[b1](v)))))


def scan_case(mode):
    """A call site executed 64 times per run, interleaved with XLA collectives both ways."""
    def body(psum):
        def step(c, _):
            m = lax.pmax(psum(c), AX)            # blink -> lax
            c = psum(lax.ppermute(c, AX, SHIFT))  # lax -> blink
            c = jnp.clip(c - m + _idx(), -64.0, 64.0)  # + axis index: varying again, devices differ
            return c, m.sum()

        def run(v):
            c, ms = lax.scan(step, v, None, length=64)
            return jnp.concatenate([c.reshape(-1), ms])[None]
        return run
    run_pair(f"{mode}/scan", mode, body(lambda v: jax_blink.psum(v, AX)), body(lambda v: lax.psum(v, AX)))


def checkpoint_case(mode):
    """jax.checkpoint around blink + lax collectives, differentiated (the rematerialised forward
    runs the collectives a second time, inside the backward pass)."""
    def make(psum):
        @jax.checkpoint
        def f(w, v):
            h = psum(v * w)
            return lax.pmean(h * h, AX)
        return lambda v: jax.grad(lambda w: f(w, v).sum())(jnp.float32(0.5)) + 0 * v
    run_pair(f"{mode}/checkpoint", mode, make(lambda v: jax_blink.psum(v, AX)),
             make(lambda v: lax.psum(v, AX)), exact=False)


def replicated_grad_case():
    """grad of a replicated parameter under check_vma=True: JAX inserts an XLA psum in the backward
    pass after the jax_blink collective (a synced-centering layer, as users write one)."""
    x = np.arange(N * 4, dtype=np.float32)

    def loss(mean):
        def body(w, v):
            h = v * w
            h = h - mean(h.mean())
            return lax.psum((h ** 2).sum(), AX)
        return lambda w, v: jax.shard_map(body, mesh=MESH, in_specs=(P(), P(AX)), out_specs=P(),
                                          check_vma=True)(w, v)

    g = jax.jit(lambda w, v: (jax.grad(loss(lambda a: jax_blink.pmean(a, AX)))(w, v),
                              jax.grad(loss(lambda a: lax.pmean(a, AX)))(w, v)))
    got, want = jax.block_until_ready(g(np.float32(3.0), x))
    ref = 2 * 3.0 * ((x.reshape(N, -1) - x.reshape(N, -1).mean()) ** 2).sum()  # d/dw of w^2 * sum(c^2)
    np.testing.assert_allclose(np.asarray(want), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def custom_vjp_case(mode):
    """A custom_vjp whose backward all-reduces the cotangent with jax_blink (a "copy to a
    tensor-parallel region" op), between two XLA collectives of the backward pass: the transposes
    of lax.pmean (before) and of lax.psum (after, consuming the jax_blink result)."""
    def make(psum):
        @jax.custom_vjp
        def copy_in(v):
            return v

        copy_in.defvjp(lambda v: (v, None), lambda _, g: (psum(g),))

        def loss(w, v):
            u = lax.psum(w * v[0], AX)
            return lax.pmean((copy_in(u) * v).sum() ** 2, AX)
        return lambda v: jax.grad(loss)(jnp.ones((3,), jnp.float32), v)[None] + 0 * v
    run_pair(f"{mode}/custom_vjp", mode, make(lambda g: jax_blink.psum(g, AX)),
             make(lambda g: lax.psum(g, AX)), exact=False)


def train_step_case(mode):
    """Data-parallel SGD on an MLP: jax_blink.pmean of the gradient pytree, then its norm logged
    through lax.pmean; 5 steps in one program (lax.fori_loop), params compared with lax."""
    rng = np.random.default_rng(1)
    params = {"w1": rng.standard_normal((3, 16)).astype(np.float32) * 0.3,
              "b1": np.zeros(16, np.float32),
              "w2": rng.standard_normal((16, 1)).astype(np.float32) * 0.3}
    y = rng.standard_normal((N * N, 1)).astype(np.float32)

    def loss(p, v, t):
        h = jnp.tanh(v @ p["w1"] + p["b1"])
        return ((h @ p["w2"] - t) ** 2).mean()

    def make(pmean):
        def train(v, t):
            def step(_, carry):
                p, _ = carry
                g = pmean(jax.grad(loss)(p, v, t))
                norm = lax.pmean(jnp.sqrt(sum((a ** 2).sum() for a in jax.tree_util.tree_leaves(g))), AX)
                return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), norm
            p, norm = lax.fori_loop(0, 5, step, (params, jnp.float32(0)))
            return jnp.concatenate([a.reshape(-1) for a in jax.tree_util.tree_leaves(p)] + [norm[None]])[None]
        return train

    in_specs = (P(AX), P(AX))
    f = compile_mode(lambda v, t: (make(lambda g: jax_blink.pmean(g, AX))(v, t),
                                   make(lambda g: lax.pmean(g, AX))(v, t)), mode, in_specs=in_specs)
    got, want = jax.block_until_ready(f(mode_input(X, mode), mode_input(y, mode)))
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.all(got[..., -1] > 0) and np.all(got == got[:1]), "every device must hold the same params"


def fail_fast_case():
    """A device that cannot join (here: device 5 is missing from the call's device table, whose rank 5
    names a device id that does not exist) fails the whole call at once with its own error, although
    the peer-wait timeout is 60 s; a lax.psum after the collective must not hang either. (Rank 5 stays
    in the group, so the other seven can never complete the meeting without device 5: dropping the
    rank instead would let them finish a valid 7-rank meeting before device 5 fails, and then wait for
    it in the lax.psum.)"""
    ffi_cpu = lowering.find_lowering("ffi", "cpu")
    assert ffi_cpu is not None, ffi_lowering.UNAVAILABLE

    def drop5(ctx, xs, request_for):
        import dataclasses

        def drop(nelems):
            request = request_for(nelems)
            table = np.asarray(request.device_table).reshape(-1, 3).copy()
            table[table[:, 0] == 5, 0] = 99  # rank 5 is now a device that never calls
            return dataclasses.replace(request, timeout_ms=60_000, device_table=table)
        return ffi_cpu.rule(ctx, xs, drop)

    lowering.register(dataclasses.replace(ffi_cpu, name="ffi_drop5", rule=drop5))
    f = compile_mode(lambda v: lax.psum(jax_blink.psum(v, AX, impl="ffi_drop5"), AX), "smap_novma")
    f = f.lower(X).compile()
    t0 = time.monotonic()
    try:
        jax.block_until_ready(f(X))
    except Exception as e:  # XlaRuntimeError
        msg = str(e)
    else:
        raise AssertionError("the call with device 5 missing from the device table succeeded")
    took = time.monotonic() - t0
    assert "device 5 cannot join the collective: it is not in the collective's device table" in msg, msg
    assert took < 10, f"failing took {took:.1f} s (the peer timeout is 60 s): not at once"
    print(f"  (failed after {took:.2f} s)", flush=True)


def batch_cases(batch):
    if batch in MODES:  # every pair, default impl ("auto": the FFI custom call on CPU)
        yield from pairs_cases(batch, "auto")
        yield from chain_cases(batch)
        return
    if batch == "ppermute":  # the portable lowering, a subset
        yield from pairs_cases("smap_vma", "ppermute", blinks=["psum", "broadcast"])
        return
    if batch == "transforms":
        for mode in MODES:
            yield f"{mode}/scan", lambda mode=mode: scan_case(mode)
        yield "smap_vma/checkpoint", lambda: checkpoint_case("smap_vma")
        yield "pmap/checkpoint", lambda: checkpoint_case("pmap")
        yield "smap_vma/replicated_grad", replicated_grad_case
        yield "pmap/custom_vjp", lambda: custom_vjp_case("pmap")
        yield "smap_novma/custom_vjp", lambda: custom_vjp_case("smap_novma")
        yield "pmap/train_step", lambda: train_step_case("pmap")
        yield "smap_novma/train_step", lambda: train_step_case("smap_novma")
        return
    if batch == "fail_fast":
        yield "fail_fast/not_in_table", fail_fast_case
        return
    raise SystemExit(f"unknown batch {batch!r}")


BATCHES = MODES + ("ppermute", "transforms", "fail_fast")


def main(argv, cases=None, batches=None):
    """Runs the named batches (default all) of ``cases`` (default this module's ``batch_cases``)."""
    cases = cases or batch_cases
    failed = 0
    for arg in argv or batches or BATCHES:
        batch, _, only = arg.partition(":")  # "batch:text" runs the cases whose name contains text
        for name, fn in cases(batch):
            if only not in name:
                continue
            print(f"START {name}", flush=True)
            t0 = time.monotonic()
            try:
                fn()
            except Exception as e:  # report and go on: one failing case must not hide the others
                failed += 1
                lines = traceback.format_exception_only(type(e), e)
                print(f"FAIL {name}: {''.join(lines).strip()[:2000]}", flush=True)
            else:
                print(f"OK {name} {time.monotonic() - t0:.2f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
