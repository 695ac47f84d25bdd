"""All-reduce time per call on 8 host CPU devices: lax.psum vs each jax_blink impl, same run.

Usage: python benchmarks/collectives.py [--min-kib 4] [--max-mib 64] [--iters N] [--topology NAME]

float32 operand of the given size per device inside jax.jit(jax.shard_map(..., check_vma=False)).
Reports the median wall time per call (after one warm-up), algbw = bytes / t and the ratio
t(impl) / t(lax.psum) measured in the same process (lower is faster). busbw = algbw * 2(n-1)/n
(nccl-tests convention for all-reduce).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink import lowering  # noqa: E402
import jax_blink.api  # noqa: E402,F401  (registers the lowerings, "ffi" included, before impls are listed)


def _time(f, x, iters: int) -> float:
    jax.block_until_ready(f(x))  # compile + warm-up
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=0, help="timed calls per point (default: by size)")
    ap.add_argument("--topology", default=None, help="preset / file (default: Topology.host(8))")
    args = ap.parse_args(argv)

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    impls = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
    fns = {"lax.psum": lambda v: lax.psum(v, "i")}
    for impl in impls:
        fns[impl] = (lambda impl: lambda v: jax_blink.psum(v, "i", impl=impl, topology=args.topology))(impl)
    jitted = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
              for k, f in fns.items()}

    sizes = []
    b = args.min_kib * 1024
    while b <= args.max_mib * 1024 * 1024:
        sizes.append(b)
        b *= 4
    table = Table(title=f"all-reduce, float32, {n} host CPU devices (median time per call)")
    table.add_column("bytes/device", justify="right")
    for k in fns:
        table.add_column(f"{k} ms", justify="right")
        if k != "lax.psum":
            table.add_column(f"{k}/lax", justify="right")
    table.add_column("lax busbw GB/s", justify="right")
    console = Console()
    for nbytes in sizes:
        nelems = nbytes // 4
        x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(n * nelems), jnp.float32),
                           NamedSharding(mesh, P("i")))
        iters = args.iters or max(3, min(50, (64 << 20) // (nbytes * 4)))
        ref = None
        row = [f"{nbytes:,}"]
        times = {}
        for k, f in jitted.items():
            out = f(x)
            if ref is None:
                ref = np.asarray(out)
            else:  # a benchmark of a wrong result is worthless
                np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            times[k] = _time(f, x, iters)
            row.append(f"{times[k] * 1e3:.3f}")
            if k != "lax.psum":
                row.append(f"{times[k] / times['lax.psum']:.2f}")
        row.append(f"{nbytes / times['lax.psum'] * 2 * (n - 1) / n / 1e9:.2f}")
        table.add_row(*row)
        del x
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
