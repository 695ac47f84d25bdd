"""Collective time per call on 8 host CPU devices: lax vs each jax_blink impl, same run.

Usage: python benchmarks/collectives.py [--collective allreduce|allgather|reducescatter|all]
       [--min-kib 4] [--max-mib 64] [--iters N] [--topology NAME] [--impls ppermute,ffi] [--processes 5]

float32 inside jax.jit(jax.shard_map(..., check_vma=False)); the size is the full buffer per device
(all-reduce: the operand; all-gather: the gathered output, each device contributing 1/n of it;
reduce-scatter: the input, each device keeping 1/n), as nccl-tests counts it. References:
lax.psum, lax.all_gather(tiled=True), lax.psum_scatter(tiled=True). The calls of lax and every impl are
interleaved (lax, impl 1, impl 2, local, lax, ...), so load from other jobs on a shared machine hits them
alike. "local" is a local XLA op with the collective's memory traffic per device and no communication
(all-reduce: ``v + 1``; see ``_local_op``): what XLA itself takes to move those bytes on this host, a
yardstick for how close each side is to the memory system's speed. It is not a strict bound: an
executor that avoids XLA's own costs (fresh output pages, read-for-ownership of results) can beat it,
as jax_blink's does from 16 MiB.
Reports the median wall time per call (after three warm-up calls each), the ratio t(impl) / t(lax) of
the medians (lower is faster) with its spread (the 25th-75th percentile of the per-round ratios), and
lax's busbw = bytes / t * factor (nccl-tests: 2(n-1)/n for all-reduce, (n-1)/n for
all-gather and reduce-scatter; ``jax_blink.collectives``).

Page faults: from about 1 MiB a call's output is sometimes a fresh mapping from the C allocator, and
that call page-faults on it (``getrusage`` minor faults; 1024 per fresh 4 MiB) and takes up to twice
as long, on either side, so the all-call median flips between the two modes from run to run. The
"steady" columns show, per impl, how many of its calls faulted and the ratio of the medians over the
calls that did not (lax's and the impl's own), i.e. the collective without the allocator's cost.

Targets (the ffi lowering; issues of the project): all-reduce <= 0.9x lax from 1 MiB per device, <= 1.0x
below; all-gather and reduce-scatter <= 1.0x from 1 MiB, <= 1.5x below. A process's ratios move by more
than these margins from one process to the next, so by default the script runs 5 fresh processes
(``--processes``, benchmarks/repeat.py), prints the first one's tables and then every ratio's median over
the processes, which the targets are judged on.
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import resource
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import repeat  # noqa: E402  (benchmarks/repeat.py, beside this script)
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jax_blink  # noqa: E402
import jax_blink.api  # noqa: E402,F401  (registers the lowerings, "ffi" included, before impls are listed)
from jax_blink import collectives, lowering  # noqa: E402


def _time(fns: dict, x, iters: int) -> tuple[dict, dict]:
    """({name: array of wall seconds per call}, {name: array of the process's minor page faults per
    call}), the calls of ``fns`` interleaved over ``iters`` rounds (A B, B A, ...); element i of every
    array is from round i."""
    for f in fns.values():
        for _ in range(3):  # compile + warm-up (thread pools, allocator)
            jax.block_until_ready(f(x))
    ts = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    for i in range(iters):
        # order reversed every other round: the call right after another ran 1-2% slower
        for k, f in (list(fns.items()) if i % 2 == 0 else reversed(fns.items())):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts[k].append(time.perf_counter() - t0)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {k: np.asarray(v) for k, v in ts.items()}, {k: np.asarray(v) for k, v in faults.items()}


def _functions(collective: str, impls, topology):
    """{label: per-device function}: lax's reference first, then jax_blink with each impl."""
    if collective == "allreduce":
        ref = {"lax.psum": lambda v: lax.psum(v, "i")}
        blink = lambda impl: lambda v: jax_blink.psum(v, "i", impl=impl, topology=topology)  # noqa: E731
    elif collective == "allgather":
        ref = {"lax.all_gather": lambda v: lax.all_gather(v, "i", tiled=True)}
        blink = lambda impl: lambda v: jax_blink.all_gather(v, "i", tiled=True, impl=impl,  # noqa: E731
                                                            topology=topology)
    else:
        ref = {"lax.psum_scatter": lambda v: lax.psum_scatter(v, "i", tiled=True)}
        blink = lambda impl: lambda v: jax_blink.psum_scatter(v, "i", tiled=True, impl=impl,  # noqa: E731
                                                              topology=topology)
    return {**ref, **{impl: blink(impl) for impl in impls}}


def _local_op(collective: str, n: int):
    """A local XLA op with the collective's memory traffic per device and no communication: all-reduce
    ``v + 1`` (reads the operand, writes a result of its size), all-gather ``tile(v, n)`` (writes n
    copies of the shard), reduce-scatter the sum of the operand's n blocks (reads the operand, writes
    one block: n slices added). How long XLA takes to move the collective's bytes here, without any
    communication; not a strict lower bound (see the module docstring)."""
    if collective == "allreduce":
        return lambda v: v + 1
    if collective == "allgather":
        return lambda v: jnp.tile(v, n)
    # n slices added in one fused loop (XLA:CPU's reduce over a leading axis of size n is ~20x slower)
    return lambda v: functools.reduce(operator.add, [v[i * (v.size // n):(i + 1) * (v.size // n)] for i in range(n)])


def target(collective: str, impl: str, nbytes: int) -> float | None:
    """The ffi lowering's target ratio to lax: all-reduce <= 0.9 from 1 MiB per device, <= 1.0 below;
    all-gather and reduce-scatter <= 1.0 from 1 MiB, <= 1.5 below. None for other impls."""
    if impl != "ffi":
        return None
    if collective == "allreduce":
        return 0.9 if nbytes >= 1 << 20 else 1.0
    return 1.0 if nbytes >= 1 << 20 else 1.5


def _sizes(args) -> list[int]:
    """Bytes per device from --min-kib to --max-mib, x4 steps."""
    sizes, b = [], args.min_kib * 1024
    while 0 < b <= args.max_mib * 1024 * 1024:
        sizes.append(b)
        b *= 4
    return sizes


def run(collective: str, args, impls, console) -> None:
    """One table: every size from --min-kib to --max-mib (x4 steps) for ``collective``."""
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    fns = _functions(collective, impls, args.topology)
    ref_name = next(iter(fns))
    jitted = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
              for k, f in {**fns, "local": _local_op(collective, n)}.items()}
    factor = collectives.get(collective).busbw_factor(n)
    sizes = _sizes(args)
    table = Table(title=f"{collective}, float32, {n} host CPU devices (median time per call; bytes = full "
                        "buffer per device)")
    table.add_column("bytes/device", justify="right")
    table.add_column("local op ms", justify="right")
    for k in fns:
        table.add_column(f"{k} ms", justify="right")
        if k != ref_name:
            table.add_column(f"{k}/local", justify="right")
            table.add_column(f"{k}/lax", justify="right")
            table.add_column("(25-75%)", justify="right")
            table.add_column(f"steady {k}/lax", justify="right")
            table.add_column("faulting calls (lax / impl)", justify="right")
            table.add_column("target", justify="right")
    table.add_column("lax busbw GB/s", justify="right")
    for nbytes in sizes:
        nelems = nbytes // 4
        per_device = nelems // n if collective == "allgather" else nelems  # all-gather input: one shard
        x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(n * per_device), jnp.float32),
                           NamedSharding(mesh, P("i")))
        iters = args.iters or max(25, min(200, (1 << 30) // (nbytes * 4)))  # 4 MiB: 64 rounds (16 were noisy)
        ref = None
        for f in (jitted[k] for k in fns):
            out = f(x)
            if ref is None:
                ref = np.asarray(out)
            else:  # a benchmark of a wrong result is worthless
                np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            del out
        samples, faults = _time(jitted, x, iters)
        times = {k: float(np.median(v)) for k, v in samples.items()}
        steady = {k: float(np.median(v[faults[k] == 0])) if np.any(faults[k] == 0) else float("nan")
                  for k, v in samples.items()}
        row = [f"{nbytes:,}", f"{times['local'] * 1e3:.3f}"]
        for k in fns:
            row.append(f"{times[k] * 1e3:.3f}")
            if k != ref_name:
                row.append(f"{times[k] / times['local']:.2f}")
                per_round = samples[k] / samples[ref_name]
                row.append(f"{times[k] / times[ref_name]:.2f}")
                row.append(f"{np.percentile(per_round, 25):.2f}-{np.percentile(per_round, 75):.2f}")
                row.append(f"{steady[k] / steady[ref_name]:.2f}")
                row.append(f"{np.count_nonzero(faults[ref_name])} / {np.count_nonzero(faults[k])} of {iters}")
                goal = target(collective, k, nbytes)
                ratio = times[k] / times[ref_name]
                row.append("-" if goal is None else f"<= {goal:g} {'ok' if ratio <= goal else 'MISSED'}")
                if goal is not None:
                    repeat.record(collective, f"{nbytes:>10,} B {k}/lax", ratio, goal)
                    repeat.record(collective, f"{nbytes:>10,} B {k}/local", times[k] / times["local"], None)
        repeat.record(collective, f"{nbytes:>10,} B lax/local", times[ref_name] / times["local"], None)
        row.append(f"{nbytes / times[ref_name] * factor / 1e9:.2f}")
        table.add_row(*row)
        del x
    console.print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collective", choices=("allreduce", "allgather", "reducescatter", "all"),
                    default="allreduce", help="what to time (all: the three in turn)")
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=0, help="timed calls per point (default: by size)")
    ap.add_argument("--topology", default=None, help="preset / file (default: Topology.host(8))")
    ap.add_argument("--impls", default=None,
                    help="comma-separated jax_blink impls (default: ppermute, and ffi where built)")
    repeat.add_arguments(ap, default=5)
    args = ap.parse_args(argv)
    have = ["ppermute"] + (["ffi"] if lowering.find_lowering("ffi", "cpu") is not None else [])
    impls = args.impls.split(",") if args.impls else have
    missing = [i for i in impls if i not in have]
    if missing:
        ap.error(f"impl(s) {missing} not available here (available: {have})")
    if not _sizes(args):
        ap.error(f"no size from --min-kib {args.min_kib} to --max-mib {args.max_mib}: nothing to measure")
    if args.topology is not None:
        try:
            jax_blink.Topology.load(args.topology)
        except Exception as e:  # the library's own message says what was wrong with it
            ap.error(f"--topology {args.topology!r}: {e}")
    if args.processes > 1:
        return repeat.run_processes(__file__, list(sys.argv[1:] if argv is None else argv), args.processes)
    console = Console(width=max(Console().width, 160))
    for coll in (("allreduce", "allgather", "reducescatter") if args.collective == "all" else (args.collective,)):
        run(coll, args, impls, console)
    repeat.save(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
