"""``jax_blink.selftest()`` / ``jax-blink selftest``: checks the native CUDA executor on this machine's
GPUs and, when it passes, records the pass so ``impl="auto"`` uses the native executor here.

What it checks (exit status 0 pass, 1 failure, 2 no GPU):
- the build runs here (``_cuda.check_compatibility()``: driver version, an architecture for every GPU);
- the executor outside XLA (``_cuda.execute``; rank r on GPU r % ndev, so one GPU hosts several ranks):
  all-reduce, broadcast and reduce, every dtype, an odd size, with peer access and with forced
  copy-engine staging (``JAX_BLINK_CUDA_FORCE_STAGING``), bitwise against ``schedule.execute``; then
  each as a bucket (``BUCKET_LEAVES``: odd leaf sizes, every leaf its own allocation, results
  separate and in place), as one custom call of a pytree gets it;
- with two or more GPUs, a jit-compiled ``shard_map`` step (``jax_blink.psum(impl="ffi")`` against
  ``lax.psum``, of one array and of a two-leaf pytree; broadcast and reduce against NumPy), one rank
  per GPU;
- an nccl-tests-style table: size, time, algbw, busbw (all-reduce: busbw = algbw * 2(n-1)/n) for the
  native executor, and with two or more GPUs for the ppermute lowering and ``lax.psum``.

The pass is recorded by ``jax_blink.lowering.selftest_record`` (``selftest.json`` in the cache
directory, keyed by the GPU names, the driver version and a hash of the CUDA module file, so a new
driver, GPU or build needs a new self-test); the FFI lowering reads it from there.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

from . import _native
from .lowering import selftest_record
from .lowering.gpu_program_check import random_operand, raw_bits

DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8",
          "uint16", "uint32", "uint64", "complex64", "complex128")


def _schedule(collective: str, n: int, nelems: int, chunk_elems: int | None = None):
    from .planning import plan
    from .schedule import build_schedule
    from .topology import Topology
    from .topology.presets import PRESETS
    topo = PRESETS["dgx1v"]().subset(list(range(n))) if n <= 8 else Topology.host(n)
    root = None if collective == "allreduce" else n - 1
    return build_schedule(plan(topo, collective, root=root), nelems, chunk_elems=chunk_elems)


_key_counter = [1 << 40]

#: Leaf sizes (elements) of the self-test's buckets: odd, the 613-element chunks span leaves.
BUCKET_LEAVES = (1, 700, 3, 2048, 5, 7250)
BUCKET_DTYPES = ("float32", "bfloat16", "int32", "complex64")


def run_executor(schedule, xs, iters: int = 0, leaf_sizes=(), in_place: bool = False) -> tuple[np.ndarray, float, str]:
    """Runs ``schedule`` on the GPUs through ``_cuda.execute``; (outputs [n, nelems], s per call, error).
    ``leaf_sizes``: each rank's array as a bucket of leaves of these sizes (separate allocations);
    ``in_place``: results alias the operands."""
    outs = [np.empty_like(x) for x in xs]
    _key_counter[0] += 1
    kw = dict(leaf_sizes=list(leaf_sizes), in_place=in_place) if len(leaf_sizes) or in_place else {}
    t, err = _native.cuda.execute(np.asarray(schedule.to_array(), np.int64), xs[0].dtype.name,
                                  [raw_bits(np.ascontiguousarray(x)) for x in xs], [raw_bits(o) for o in outs], iters,
                                  _key_counter[0], **kw)
    return np.stack(outs), t, err


def check_executor(nranks: int, out=print) -> list[str]:
    """Every collective x dtype x (peer, forced staging) against schedule.execute; the failures."""
    from .schedule import execute
    failures = []
    saved = os.environ.get("JAX_BLINK_CUDA_FORCE_STAGING")
    try:
        for staging in ("0", "1"):
            os.environ["JAX_BLINK_CUDA_FORCE_STAGING"] = staging
            for coll in ("allreduce", "broadcast", "reduce"):
                s = _schedule(coll, nranks, 10_007, chunk_elems=613)
                bad = []
                for i, dt in enumerate(DTYPES):
                    xs = [random_operand(np.random.default_rng(100 * i + r), s.nelems, dt) for r in range(nranks)]
                    got, _, err = run_executor(s, xs)
                    want = execute(s, np.stack(xs))
                    if err:
                        bad.append(f"{dt}: {err}")
                    elif got.tobytes() != want.tobytes():
                        diff = [r for r in range(nranks) if got[r].tobytes() != want[r].tobytes()]
                        bad.append(f"{dt}: ranks {diff} differ from schedule.execute")
                mode = "forced" if staging == "1" else "auto  "
                label = f"executor {coll:9s} {nranks} ranks, {len(DTYPES)} dtypes, staging {mode}"
                out(f"  {label}: {'ok' if not bad else 'FAIL ' + '; '.join(bad[:3])}")
                failures += [f"{label}: {b}" for b in bad]
            bad = []
            for coll in ("allreduce", "broadcast", "reduce"):
                s = _schedule(coll, nranks, sum(BUCKET_LEAVES), chunk_elems=613)
                for i, dt in enumerate(BUCKET_DTYPES):
                    xs = [random_operand(np.random.default_rng(7 * i + r), s.nelems, dt) for r in range(nranks)]
                    want = execute(s, np.stack(xs))
                    for in_place in (False, True):
                        got, _, err = run_executor(s, xs, leaf_sizes=BUCKET_LEAVES, in_place=in_place)
                        how = f"{coll} {dt} {'in place' if in_place else 'separate'}"
                        if err:
                            bad.append(f"{how}: {err}")
                        elif got.tobytes() != want.tobytes():
                            wrong = [r for r in range(nranks) if got[r].tobytes() != want[r].tobytes()]
                            bad.append(f"{how}: ranks {wrong} differ from schedule.execute")
            label = (f"executor buckets   {nranks} ranks, {len(BUCKET_LEAVES)} leaves, 3 collectives, "
                     f"{len(BUCKET_DTYPES)} dtypes, in place and not, staging {'forced' if staging == '1' else 'auto'}")
            out(f"  {label}: {'ok' if not bad else 'FAIL ' + '; '.join(bad[:3])}")
            failures += [f"{label}: {b}" for b in bad]
    finally:
        if saved is None:
            os.environ.pop("JAX_BLINK_CUDA_FORCE_STAGING", None)
        else:
            os.environ["JAX_BLINK_CUDA_FORCE_STAGING"] = saved
    return failures


def check_jax(out=print) -> tuple[list[str], object]:
    """With >= 2 GPUs: jit(shard_map) psum/broadcast/reduce (impl='ffi') against lax.psum / NumPy."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from . import api
    gpus = jax.devices("gpu") if any(d.platform == "gpu" for d in jax.devices()) else []
    if len(gpus) < 2:
        out(f"  jax shard_map step: skipped ({len(gpus)} GPU visible to jax; one rank per GPU needs two)")
        return [], None
    mesh = Mesh(np.array(gpus), ("i",))
    n = len(gpus)
    failures = []
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, 4099)).astype(np.float32))
    x = jax.device_put(x, NamedSharding(mesh, P("i")))

    def step(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    ours = step(lambda v: api.psum(v, "i", impl="ffi"))(x)
    ref = step(lambda v: jax.lax.psum(v, "i"))(x)
    ok = np.allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-4)
    out(f"  jax shard_map psum (impl='ffi') vs lax.psum, {n} GPUs: {'ok' if ok else 'FAIL'}")
    if not ok:
        failures.append("shard_map psum differs from lax.psum")

    def pytree(v):  # two leaves, one custom call; "b" is computed here, so its result is aliased
        return {"a": v, "b": v[:, :1031] * 2.0}

    ours = step(lambda v: api.psum(pytree(v), "i", impl="ffi"))(x)
    ref = step(lambda v: jax.lax.psum(pytree(v), "i"))(x)
    ok = all(np.allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-4) for k in ref)
    out(f"  jax shard_map psum of a 2-leaf pytree (impl='ffi') vs lax.psum, {n} GPUs: {'ok' if ok else 'FAIL'}")
    if not ok:
        failures.append("shard_map pytree psum differs from lax.psum")
    for name, fn in (("broadcast", lambda v: api.broadcast(v, "i", root=0, impl="ffi")),
                     ("reduce", lambda v: api.reduce(v, "i", root=0, impl="ffi"))):
        try:
            got = np.asarray(step(fn)(x)).reshape(n, -1)
            xs = np.asarray(x).reshape(n, -1)
            want = np.broadcast_to(xs[0], xs.shape) if name == "broadcast" else np.concatenate(
                [xs.sum(0, keepdims=True), np.zeros_like(xs[1:])])
            ok = np.allclose(got, want, rtol=1e-5, atol=1e-4)
        except Exception as e:  # noqa: BLE001 - reported as a failure line
            ok, got = False, e
        out(f"  jax shard_map {name} (impl='ffi'), {n} GPUs: {'ok' if ok else f'FAIL {got}'}")
        if not ok:
            failures.append(f"shard_map {name} wrong")
    return failures, (mesh, step)


def table(nranks: int, jax_ctx, sizes_mib=(1, 16, 128), out=print) -> None:
    """nccl-tests-style all-reduce table: native executor; ppermute and lax.psum with >= 2 GPUs."""
    out(f"  all-reduce, float32, {nranks} ranks")
    out(f"  {'size(B)':>11s} {'count':>10s} | {'native us':>10s} {'algbw':>7s} {'busbw':>7s} | "
        f"{'ppermute us':>11s} {'algbw':>7s} {'busbw':>7s} | {'lax.psum us':>11s} {'algbw':>7s} {'busbw':>7s}")
    for mib in sizes_mib:
        count = (mib << 20) // 4
        s = _schedule("allreduce", nranks, count)
        xs = [np.full(count, r + 1, np.float32) for r in range(nranks)]
        _, t, err = run_executor(s, xs, iters=10)
        cols = [f"{t * 1e6:10.1f}", *_bw(mib << 20, t, nranks)] if not err else ["FAIL", "-", "-"]
        for impl in ("ppermute", "lax"):
            cols += _jax_time(jax_ctx, impl, count)
        out(f"  {mib << 20:11d} {count:10d} | {cols[0]:>10s} {cols[1]:>7s} {cols[2]:>7s} | {cols[3]:>11s} "
            f"{cols[4]:>7s} {cols[5]:>7s} | {cols[6]:>11s} {cols[7]:>7s} {cols[8]:>7s}")


def _bw(nbytes, t, n):
    algbw = nbytes / t / 1e9
    return [f"{algbw:7.1f}", f"{algbw * 2 * (n - 1) / n:7.1f}"]


def _jax_time(jax_ctx, impl, count):
    if jax_ctx is None:
        return ["-", "-", "-"]
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from . import api
    mesh, step = jax_ctx
    n = mesh.devices.size
    fn = step((lambda v: api.psum(v, "i", impl="ppermute")) if impl == "ppermute" else (lambda v: jax.lax.psum(v, "i")))
    x = jax.device_put(jnp.ones((n * count,), jnp.float32), NamedSharding(mesh, P("i")))
    fn(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        y = fn(x)
    y.block_until_ready()
    t = (time.perf_counter() - t0) / 10
    return [f"{t * 1e6:11.1f}", *_bw(count * 4, t, n)]


@dataclasses.dataclass(frozen=True)
class SelftestResult:
    """What :func:`selftest` found. ``status``: the CLI's exit status, 0 passed (and recorded when
    asked), 1 failed, 2 nothing to test (no CUDA module or no GPU); ``problems``: one line per failed
    check. True only when it passed, so ``if jax_blink.selftest():`` reads as it should (the bare exit
    status 2 was truthy)."""

    status: int
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == 0

    def __bool__(self) -> bool:
        return self.passed


def selftest(*, nranks: int | None = None, record: bool = True, out=print) -> SelftestResult:
    """Runs the self-test (see the module docstring), printing its report through ``out``. Returns a
    :class:`SelftestResult` (``.status``: 0 pass, recorded when ``record``; 1 failure; 2 no usable CUDA
    GPU, one line and nothing else). Raises ValueError for an ``nranks`` that is not None or an
    int >= 1."""
    if nranks is not None and (isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1):
        raise ValueError(f"selftest: nranks must be None (one per GPU) or an int >= 1, got {nranks!r}")
    cuda = _native.cuda
    if cuda is None:
        out(f"jax-blink selftest: the CUDA module is not available ({_native.cuda_error}); nothing to test")
        return SelftestResult(2)
    names = list(cuda.device_names())
    if not names:
        out("jax-blink selftest: no CUDA GPU visible on this machine; nothing to test")
        return SelftestResult(2)
    why = cuda.check_compatibility()
    out(f"jax-blink selftest: {len(names)} GPU(s): {', '.join(names)}; driver {cuda.driver_version()}, module CUDA "
        f"{cuda.built_cuda_version()} [{cuda.built_architectures()}]")
    if why:
        out(f"  FAIL: this build cannot run here: {why}")
        return SelftestResult(1, (f"this build cannot run here: {why}",))
    n = nranks or (len(names) if len(names) >= 2 else 4)
    t0 = time.perf_counter()
    failures = check_executor(n, out=out)
    try:
        jax_failures, jax_ctx = check_jax(out=out)
    except Exception as e:  # noqa: BLE001 - a JAX-level failure is a test failure, reported
        jax_failures, jax_ctx = [f"jax check raised {type(e).__name__}: {e}"], None
        out(f"  jax shard_map step: FAIL {type(e).__name__}: {e}")
    failures += jax_failures
    try:
        table(n, jax_ctx, out=out)
    except Exception as e:  # noqa: BLE001
        failures.append(f"timing table raised {type(e).__name__}: {e}")
        out(f"  timing: FAIL {type(e).__name__}: {e}")
    if failures:
        out(f"jax-blink selftest: FAILED ({len(failures)} problems, {time.perf_counter() - t0:.1f} s); "
            "impl='auto' keeps using ppermute on this machine")
        return SelftestResult(1, tuple(failures))
    msg = ""
    if record:
        path = selftest_record.record_pass(selftest_record.machine_key())
        msg = f"; recorded in {path}: impl='auto' now uses the native executor here"
    out(f"jax-blink selftest: PASSED ({time.perf_counter() - t0:.1f} s){msg}")
    return SelftestResult(0)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="jax-blink selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks for the executor checks (default: GPUs, min 4 on one GPU)")
    ap.add_argument("--no-record", action="store_true", help="do not record a pass")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return selftest(nranks=a.ranks, record=not a.no_record).status


if __name__ == "__main__":
    sys.exit(main())
