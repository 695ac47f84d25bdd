"""The CPU executor on an emulated CPU: run as a program by tests/native/test_cpu_portability.py, under
``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512) or ``-cpu SandyBridge`` (AVX, no AVX2), where an
instruction the CPU lacks raises SIGILL as on a real machine without it.

Checks, each against an independent reference, and prints one JSON line ``{"isas": ..., "active": ...,
"checks": [...]}`` (exit status 0) or a traceback (non-zero):

- the sum kernels of every instruction set this CPU runs, bit for bit against the baseline build, the
  float32 baseline against NumPy's left-to-right sum;
- every collective (psum, pmean, broadcast, reduce, all_gather, psum_scatter) through the native CPU
  executor (``impl="ffi"``) in one jitted shard_map over 8 devices, every dtype of the executor, against
  NumPy on the host (operands are small integers, so every sum is exact in every dtype and order);
- ``JAX_BLINK_CPU_ISA`` naming a set this CPU lacks is refused at lowering, naming the widest it runs;
- the CUDA executor's device interpreter in its host build (``_gpusim``, a thread per rank block):
  every collective's program on the DGX-1V plans against ``schedule.execute``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink import BlinkError, _native  # noqa: E402
from jax_blink.lowering.gpu_program_check import check_schedule, random_operand  # noqa: E402

jax.config.update("jax_enable_x64", True)  # the 64-bit dtypes as themselves

N = 8
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "complex64", "complex128"]


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def check_sum_kernels() -> str:
    cpu = _native.cpu
    isas = cpu.sum_isas()
    rng = np.random.default_rng(3)
    for dtype in DTYPES:
        for n in (1, 17, 1000):
            for k in (1, 3, 9):
                xs = [random_operand(rng, n, dtype) for _ in range(k + 1)]
                xs = [x.view(np.uint16) if dtype == "bfloat16" else x for x in xs]
                got = {}
                for isa in isas:
                    out = np.zeros_like(xs[0])
                    assert cpu.sum_with(isa, dtype, out, xs[0], xs[1:], n) == "", (isa, dtype)
                    got[isa] = out.tobytes()
                assert all(g == got["baseline"] for g in got.values()), (dtype, n, k, list(got))
                if dtype == "float32":
                    want = xs[0].copy()
                    for x in xs[1:]:
                        want = want + x
                    assert got["baseline"] == want.tobytes(), (n, k)
    return f"sum kernels {', '.join(isas)}: {len(DTYPES)} dtypes bitwise equal"


def check_collectives() -> str:
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))
    rng = np.random.default_rng(7)
    # per dtype: a (N * 2 * N,) global operand, each device's shard (2 * N,) of small integers
    xs = {}
    for name in DTYPES:
        vals = rng.integers(-3, 4, size=N * 2 * N)
        if name.startswith("u"):
            vals = np.abs(vals)
        xs[name] = vals.astype(np_dtype(name)) if "complex" not in name else (vals + 1j * vals[::-1]).astype(name)

    def body(x):
        ffi = {"impl": "ffi"}
        out = {"psum": jax_blink.psum(x, "d", **ffi),
               "broadcast": jax_blink.broadcast(x, "d", root=3, **ffi),
               "reduce": jax_blink.reduce(x, "d", root=2, **ffi),
               "all_gather": jax_blink.all_gather(x, "d", tiled=True, **ffi),
               "psum_scatter": jax_blink.psum_scatter(x, "d", tiled=True, **ffi)}
        out["pmean"] = jax_blink.pmean({k: x[k] for k in mean_dtypes}, "d", **ffi)
        return out

    # pmean divides with XLA's own code, and jaxlib's float16 arithmetic fails on CPUs without F16C
    # ("Symbols not found: __extendhfsf2"): such dtypes are left out of pmean, and said so.
    mean_dtypes, xla_fails = [], []
    for k in xs:
        if jnp.issubdtype(xs[k].dtype, jnp.inexact):
            try:
                jax.jit(lambda v: v * 0.5)(xs[k][:2]).block_until_ready()
                mean_dtypes.append(k)
            except jax.errors.JaxRuntimeError:
                xla_fails.append(k)
    spec = {k: P("d") for k in xs}
    out_specs = {"psum": spec, "broadcast": spec, "reduce": spec, "all_gather": spec, "psum_scatter": spec,
                 "pmean": {k: P("d") for k in mean_dtypes}}
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=out_specs))
    args = {k: jax.device_put(v, NamedSharding(mesh, P("d"))) for k, v in xs.items()}
    got = jax.tree.map(np.asarray, f(args))

    for name, x in xs.items():
        shards = x.reshape(N, 2 * N)
        total = shards.sum(0, dtype=x.dtype)
        want = {"psum": np.tile(total, N),
                "broadcast": np.tile(shards[3], N),
                "reduce": np.concatenate([total if r == 2 else np.zeros_like(total) for r in range(N)]),
                "all_gather": np.tile(x, N),
                "psum_scatter": total}
        if name in out_specs["pmean"]:
            want["pmean"] = np.tile((total.astype(np.complex128 if "complex" in name else np.float64) / N)
                                    .astype(x.dtype), N)
        for coll, w in want.items():
            g = got[coll][name]
            assert g.dtype == x.dtype and g.shape == w.shape, (coll, name, g.dtype, g.shape, w.shape)
            assert g.tobytes() == w.astype(x.dtype).tobytes(), (coll, name, g, w)
    note = f" (pmean without {', '.join(xla_fails)}: jaxlib's own arithmetic fails on this CPU)" if xla_fails else ""
    return f"6 collectives x {len(DTYPES)} dtypes through the native executor equal NumPy{note}"


def check_isa_refusal(isas) -> str:
    wider = [i for i in _native.CPU_ISAS if i not in isas]
    if not wider:
        return "every instruction set runs here: no refusal to check"
    os.environ["JAX_BLINK_CPU_ISA"] = wider[0]
    try:
        f = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")
        f(np.ones((N, 3), np.float32))
    except BlinkError as e:
        assert f"JAX_BLINK_CPU_ISA={wider[0]}" in str(e) and repr(isas[-1]) in str(e), str(e)
    else:
        raise AssertionError(f"JAX_BLINK_CPU_ISA={wider[0]} was accepted on a CPU running only {isas}")
    finally:
        del os.environ["JAX_BLINK_CPU_ISA"]
    return f"JAX_BLINK_CPU_ISA={wider[0]} refused at lowering"


def check_gpu_interpreter() -> str:
    from jax_blink import collectives
    from jax_blink.planning import plan
    from jax_blink.schedule import build_schedule
    topo = jax_blink.Topology.preset("dgx1v")
    k = 0
    for coll in collectives.COLLECTIVES:
        row = collectives.get(coll)
        p = plan(topo, coll, root=7 if row.rooted else None)
        s = build_schedule(p, 1024 if row.sharded else 1031, chunk_elems=29)
        for dtype in (DTYPES[k % len(DTYPES)], DTYPES[(k + 5) % len(DTYPES)]):
            k += 1
            r = check_schedule(s, dtype, seeds=2, timeout_ms=120000)  # emulated CPUs are slow
            assert r["mismatched_seeds"] == 0 and not r["error"], (coll, dtype, r)
    return f"GPU interpreter (host build): {k} programs, 0 mismatches"


def check_simulator() -> str:
    """The native event model (jax_blink._native._linksim) against its Python reference, bitwise."""
    from jax_blink import simulate as sim
    from jax_blink.planning import plan
    from jax_blink.simulate import events
    assert events._native_linksim is not None, _native.linksim_error
    topo = jax_blink.Topology.preset("dgx1v")
    p = plan(topo, "allreduce")
    native = sim.simulate(p, 4 << 20, topology=topo, method="link")
    events._native_linksim = None
    try:
        ref = sim.simulate(p, 4 << 20, topology=topo, method="link")
    finally:
        events._native_linksim = _native.linksim
    assert native.time_s == ref.time_s and native.link_bytes == ref.link_bytes, (native.time_s, ref.time_s)
    return f"simulator (native event model): {native.messages} messages, bitwise equal to the reference"


def main() -> int:
    isas = _native.cpu_isas()
    active = jax_blink.cpu_isa()
    checks = [check_sum_kernels(), check_collectives(), check_isa_refusal(isas), check_gpu_interpreter(),
              check_simulator()]
    print(json.dumps({"isas": list(isas), "active": active, "checks": checks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
