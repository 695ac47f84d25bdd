"""The CUDA custom call inside XLA on one GPU (scripts/gpu_check.sh, stage ``xla``; needs a GPU).

On a 1-device mesh (the handler runs with one rank: its launch, pointer table and completion, no
peers), for float32 operands computed in the function (aliased, in place) and as arguments (copied):

- results bitwise equal to ``lax.psum`` (identity on one device) at 4 KiB and 64 MiB;
- the compiled HLO: is the jax_blink custom call inside an async ``call-start`` / ``call-done`` pair
  carrying ``_xla_stream_annotation`` (XLA's ExplicitStreamAnnotationAsyncWrapper), and how many
  ``copy`` instructions the program has with the annotation and without (``JAX_BLINK_CUDA_STREAM=0``):
  the memory cost of the async wrapping, if any;
- launch to completion at 4 KiB: median wall time of ``f(x).block_until_ready()`` against the same
  program with ``lax.psum`` (XLA's own, a no-op on one device) and against ``x * 2`` alone;
- device-to-device copy bandwidth (``jnp.copy`` of 256 MiB, bytes / time), the yardstick for the
  kernel's GB/s that the harness stage prints;
- overlap: ``psum`` of a 1 GiB argument (not aliased: the kernel copies it) next to an independent
  8192^3 bf16 matmul, wall time against the two alone, with the annotation and without; "overlaps"
  when the pair takes less than the sum by 20% of the shorter one. With ``--profile DIR`` also
  writes a jax.profiler trace there (the annotated stream in the trace viewer; gpu_check.sh reads
  nsys instead where it exists).

Prints lines starting with ``gpu_check:`` (PASS / FAIL / numbers); exit status 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time


def _median_s(fn, *args, iters: int) -> float:
    """Median wall seconds of ``fn(*args)`` until every output is ready (after 3 warm-up calls)."""
    import jax
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default=None, help="write a jax.profiler trace of the overlap run here")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_blink
    from jax_blink.lowering import ffi as ffi_lowering

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print("gpu_check: FAIL no GPU visible to jax")
        return 1
    if "cuda" not in ffi_lowering.REGISTERED:
        print(f"gpu_check: FAIL the CUDA target is not registered: {ffi_lowering.UNAVAILABLE.get('cuda')}")
        return 1
    mesh = Mesh(np.array(gpus[:1]), ("d",))
    topo = jax_blink.Topology.host(1)

    def program(impl, computed=True):
        def body(v):
            v = v * 2 if computed else v
            if impl == "lax":
                return jax.lax.psum(v, "d")
            return jax_blink.psum(v, "d", topology=topo, impl="ffi")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))

    failed = 0
    for nbytes in (4 << 10, 64 << 20):
        x = jnp.arange(nbytes // 4, dtype=jnp.float32)
        for computed in (True, False):
            got, want = program("ffi", computed)(x), program("lax", computed)(x)
            ok = bool(np.array_equal(np.asarray(got), np.asarray(want)))
            failed += not ok
            print(f"gpu_check: {'PASS' if ok else 'FAIL'} xla handler, 1-device mesh, {nbytes} B, "
                  f"{'computed (aliased)' if computed else 'argument'} operand")

    x = jnp.ones((1 << 20,), jnp.float32)
    hlo = program("ffi").lower(x).compile().as_text()
    start = [ln for ln in hlo.splitlines() if "call-start(" in ln and "_xla_stream_annotation" in ln]
    stream = re.search(r'_xla_stream_annotation="(\w+)"', start[0]).group(1) if start else None
    print(f"gpu_check: {'PASS' if start else 'FAIL'} compiled HLO: "
          + (f"the custom call runs in an async call-start / call-done on stream {stream}" if start else
             "no annotated call-start: XLA did not make the custom call async (stream annotation off or inlined)"))
    failed += not start
    copies_on = len(re.findall(r"\bcopy(-start)?\(", hlo))
    os.environ[ffi_lowering.ENV_STREAM] = "0"
    jax.clear_caches()
    copies_off = len(re.findall(r"\bcopy(-start)?\(", program("ffi").lower(x).compile().as_text()))
    del os.environ[ffi_lowering.ENV_STREAM]
    jax.clear_caches()
    print(f"gpu_check: copies in the compiled program: {copies_on} with the stream annotation, {copies_off} without")

    small = jnp.ones((1024,), jnp.float32)
    t_ffi = _median_s(program("ffi"), small, iters=args.iters)
    t_lax = _median_s(program("lax"), small, iters=args.iters)
    t_mul = _median_s(jax.jit(lambda v: v * 2), small, iters=args.iters)
    print(f"gpu_check: launch to completion at 4 KiB: jax_blink {t_ffi * 1e6:.1f} us, lax.psum {t_lax * 1e6:.1f} us, "
          f"x*2 alone {t_mul * 1e6:.1f} us (median of {args.iters})")

    big = jnp.ones((64 << 20,), jnp.float32)  # 256 MiB: the copy yardstick
    t_copy = _median_s(jax.jit(jnp.copy), big, iters=20)
    print(f"gpu_check: device-to-device copy {big.nbytes / t_copy / 1e9:.0f} GB/s ({big.nbytes >> 20} MiB in "
          f"{t_copy * 1e3:.3f} ms)")

    coll_in = jnp.ones((256 << 20,), jnp.float32)  # 1 GiB argument: the kernel copies it (not aliased)
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    b = jnp.ones((8192, 8192), jnp.bfloat16)

    def overlap_run(stream: str):
        os.environ[ffi_lowering.ENV_STREAM] = stream
        jax.clear_caches()

        def both(v, a, b):
            return jax_blink.psum(v, "d", topology=topo, impl="ffi"), a @ b

        def coll(v, a, b):
            return jax_blink.psum(v, "d", topology=topo, impl="ffi"), a

        def mm(v, a, b):
            return v, a @ b
        spec = (P("d"), P(), P())
        fs = [jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(P("d"), P()), check_vma=False))
              for f in (both, coll, mm)]
        ts = [_median_s(f, coll_in, a, b, iters=20) for f in fs]
        return ts, fs[0]

    results = {}
    for stream in ("1", "0"):
        (t_both, t_coll, t_mm), f_both = overlap_run(stream)
        saved = t_coll + t_mm - t_both
        over = saved > 0.2 * min(t_coll, t_mm)
        results[stream] = over
        print(f"gpu_check: overlap (JAX_BLINK_CUDA_STREAM={stream}): collective {t_coll * 1e3:.3f} ms, matmul "
              f"{t_mm * 1e3:.3f} ms, both {t_both * 1e3:.3f} ms: {'overlaps' if over else 'no overlap'} "
              f"({saved * 1e3:.3f} ms saved)")
        if args.profile and stream == "1":
            jax.profiler.start_trace(args.profile)
            for _ in range(5):
                jax.block_until_ready(f_both(coll_in, a, b))
            jax.profiler.stop_trace()
            print(f"gpu_check: profile of the overlapped run in {args.profile}")
    os.environ.pop(ffi_lowering.ENV_STREAM, None)
    print(f"gpu_check: {'PASS' if not failed else 'FAIL'} xla stage ({failed} failures); the matmul "
          f"{'overlaps' if results.get('1') else 'does not overlap'} the collective on its annotated stream")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
