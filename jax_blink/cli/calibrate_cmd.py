"""``jax-blink calibrate``: measure this machine's collectives and fit the costs ``auto`` weighs.

Times jax_blink's executor (``impl="ffi"``: the CPU executor in host memory, the CUDA interpreter on
GPUs) and XLA's own collective (``impl="xla"``: lax's op) for all-reduce, all-gather and
reduce-scatter over the local JAX devices at a few sizes (``jax.jit(jax.shard_map(...))`` over a 1-D
mesh, three warm-up calls, then the two lowerings' programs called alternately, medians), fits
``time = latency + bytes * seconds_per_byte`` per lowering x collective by least squares
(:func:`jax_blink.calibration.fit`) and writes them beside the plan cache
(:func:`jax_blink.calibration.path`). ``impl="auto"`` then hands a call site to XLA's collective where
the fits say it is faster (``jax_blink.lowering.xla.decide``). A few seconds on 8 host CPU devices.
"""

from __future__ import annotations

import json
import time

import numpy as np

from ..errors import BlinkError
from ._args import force_host_devices, positive_int

#: Host CPU devices to ask XLA for when nothing else sets a count (8: as ``bench --measure``'s default job).
HOST_DEVICES = 8

COLLECTIVES = ("allreduce", "allgather", "reducescatter")
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
LOWERINGS = ("ffi", "xla")


def add_arguments(p) -> None:
    p.add_argument("--sizes", default=None,
                   help="bytes per device to time (all-gather / reduce-scatter: the full buffer), a list like "
                        "4K,64K,1M,4M,16M (default); K/M/G = KiB/MiB/GiB")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed calls per size and lowering (default 7)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help=f"comma-separated, some of {', '.join(COLLECTIVES)} (default: all)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")


def _sizes(text):
    if text is None:
        return list(DEFAULT_SIZES)
    from .bench_cmd import parse_sizes
    return parse_sizes(text)


def _program(impl: str, collective: str, mesh):
    import jax
    from jax.sharding import PartitionSpec as P

    from .. import api
    f = {"allreduce": lambda v: api.psum(v, "i", impl=impl),
         "allgather": lambda v: api.all_gather(v, "i", tiled=True, impl=impl),
         "reducescatter": lambda v: api.psum_scatter(v, "i", tiled=True, impl=impl)}[collective]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))


def measure(collectives, sizes, devices, repeats: int) -> list[dict]:
    """Median seconds per call of each lowering of :data:`LOWERINGS` usable here, per collective and
    size (bytes per device; sharded: the full buffer), as dicts: lowering, collective, size, time_s."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from .. import collectives as table
    from .. import lowering, primitives  # noqa: F401  (primitives registers the lowering records)

    platform = devices[0].platform
    impls = [i for i in LOWERINGS if lowering.find_lowering(i, platform) is not None]
    if "xla" not in impls or len(impls) < 2:
        raise BlinkError(f"jax-blink calibrate compares jax_blink's executor with XLA's collective; on {platform} "
                         f"only {impls} can run here (build the native extension: pip install -e .)")
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("i",))
    spec = NamedSharding(mesh, P("i"))
    out = []
    for coll in collectives:
        row = table.get(coll)
        for size in sizes:
            count = max(n, size // 4)
            count -= count % n
            per_dev = count // n if row.input == "shard" else count
            x = jax.device_put(jnp.asarray(np.arange(n * per_dev) % 7, jnp.float32), spec)
            progs = {i: _program(i, coll, mesh).lower(x).compile() for i in impls}
            for f in progs.values():
                for _ in range(3):
                    jax.block_until_ready(f(x))
            ts = {i: [] for i in impls}
            for r in range(repeats):
                for i in (impls if r % 2 == 0 else impls[::-1]):
                    t0 = time.perf_counter()
                    jax.block_until_ready(progs[i](x))
                    ts[i].append(time.perf_counter() - t0)
            for i in impls:
                out.append({"lowering": i, "collective": coll, "size": count * 4, "time_s": float(np.median(ts[i]))})
    return out


def calibrate(collectives, sizes, repeats: int, devices=None):
    """Measure (:func:`measure`) on ``devices`` (default: every local JAX device) and fit: a
    :class:`jax_blink.calibration.Calibration`, with the measured rows."""
    import jax

    from .. import calibration
    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) < 2:
        raise BlinkError("jax-blink calibrate needs at least 2 local JAX devices (on CPU: "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    rows = measure(collectives, sizes, devices, repeats)
    fits = []
    for low in sorted({r["lowering"] for r in rows}):
        for coll in collectives:
            pts = [(r["size"], r["time_s"]) for r in rows if r["lowering"] == low and r["collective"] == coll]
            fits.append(calibration.fit(low, coll, len(devices), [p[0] for p in pts], [p[1] for p in pts]))
    return calibration.Calibration(devices[0].platform, tuple(fits)), rows


def run(args) -> int:
    from .. import calibration
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in colls if c not in COLLECTIVES]
    if bad or not colls:
        raise BlinkError(f"--collectives: {bad or colls} not among {', '.join(COLLECTIVES)}")
    sizes = _sizes(args.sizes)
    if len(sizes) < 2:
        raise BlinkError("--sizes: give two or more sizes (the fit has a latency and a bandwidth term)")
    force_host_devices(HOST_DEVICES)
    t0 = time.perf_counter()
    cal, rows = calibrate(colls, sizes, args.repeats)
    took = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"calibration": cal.to_dict(), "measured": rows}, indent=1))
    else:
        print(f"{'collective':14} {'lowering':8} {'latency':>10} {'GB/s':>8}   measured (size: us)")
        for f in cal.fits:
            gbps = 1 / f.seconds_per_byte / 1e9 if f.seconds_per_byte > 0 else float("inf")
            pts = ", ".join(f"{s >> 10}K: {t * 1e6:.0f}" for s, t in zip(f.sizes, f.times_s))
            print(f"{f.collective:14} {f.lowering:8} {f.latency_s * 1e6:8.1f}us {gbps:8.2f}   {pts}")
        print(f"measured in {took:.1f} s on {len(cal.fits) and cal.fits[0].group_size} {cal.platform} devices")
    if not args.dry_run:
        print(f"written to {calibration.save(cal)}")
    return 0
