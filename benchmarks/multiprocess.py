"""Collectives across processes: jax_blink (impl="auto") vs lax on P processes x L host CPU devices, gloo.

Usage: python benchmarks/multiprocess.py [--processes 2] [--local-devices 4] [--runs 3]
       [--sizes 64K..64M] [--collectives allreduce,allgather,reducescatter] [--impl auto]

Starts ``--runs`` fresh jobs of ``--processes`` processes (``jax_blink.launch``: 127.0.0.1, gloo,
``--local-devices`` host devices each). In each job, for every size (the full buffer per device, as
nccl-tests counts it: the all-reduce operand, the all-gather output, the reduce-scatter input;
float32) and collective, ``jax.jit(jax.shard_map(...))`` over a mesh of every device of every
process runs ``lax.psum`` / ``lax.all_gather(tiled=True)`` / ``lax.psum_scatter(tiled=True)`` and the
jax_blink counterpart, interleaved (lax, jax_blink, lax, ...; three warm-up calls each), and process 0
reports each side's median seconds per call and which lowering jax_blink ran (read from the compiled
HLO: native custom calls + XLA collectives (all-reduce, all-gather, all-to-all, reduce-scatter) =
"hierarchical"; collective-permutes = "ppermute").
The table gives, per size and collective, the median over the runs of the per-run ratio
t(jax_blink) / t(lax) (lower is faster), its range over the runs, and lax's median time.

Targets: <= 0.8x lax from 1 MiB per device, <= 1.0x below, on 2 x 4 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

COLLECTIVES = ("allreduce", "allgather", "reducescatter")


def _reps(nbytes: int) -> int:
    return 20 if nbytes <= 1 << 20 else 10 if nbytes <= 4 << 20 else 5 if nbytes <= 16 << 20 else 3


def worker(args) -> None:
    """One process of a job: times every (size, collective) and prints RESULT lines (process 0)."""
    from jax_blink import distributed
    distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_blink
    from jax_blink.cli.bench_cmd import parse_sizes

    devs = np.array(jax.devices())
    n = devs.size
    mesh = Mesh(devs, ("i",))
    me = jax.process_index()

    def fns(collective):
        if collective == "allreduce":
            return (lambda v: lax.psum(v, "i"), lambda v: jax_blink.psum(v, "i", impl=args.impl))
        if collective == "allgather":
            return (lambda v: lax.all_gather(v, "i", tiled=True),
                    lambda v: jax_blink.all_gather(v, "i", tiled=True, impl=args.impl))
        return (lambda v: lax.psum_scatter(v, "i", tiled=True),
                lambda v: jax_blink.psum_scatter(v, "i", tiled=True, impl=args.impl))

    for nbytes in parse_sizes(args.sizes):
        for collective in args.collectives.split(","):
            elems = nbytes // 4
            per_dev = elems // n if collective == "allgather" else elems
            per_dev -= per_dev % n  # psum_scatter: divisible by the axis size
            x = jax.make_array_from_callback((n * per_dev,), NamedSharding(mesh, P("i")),
                                             lambda idx, k=per_dev: np.ones((k,), np.float32))
            jitted = [jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
                      for f in fns(collective)]
            hlo = jitted[1].lower(x).compile().as_text()
            ran = ("hierarchical" if "custom-call" in hlo and any(op in hlo for op in (
                       "all-reduce", "all-gather", "reduce-scatter", "all-to-all"))
                   else "ppermute" if "collective-permute" in hlo else "other")
            for f in jitted:
                for _ in range(3):
                    f(x).block_until_ready()
            times = ([], [])
            for _ in range(_reps(nbytes)):
                for k, f in enumerate(jitted):
                    t0 = time.perf_counter()
                    f(x).block_until_ready()
                    times[k].append(time.perf_counter() - t0)
            del x
            if me == 0:
                print("RESULT " + json.dumps({"size": nbytes, "collective": collective, "lowering": ran,
                                              "lax_s": statistics.median(times[0]),
                                              "blink_s": statistics.median(times[1])}), flush=True)
            jnp.zeros(()).block_until_ready()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--local-devices", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="fresh jobs (default 3)")
    ap.add_argument("--sizes", default="64K..64M", help="bytes per device (default 64K..64M)")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--impl", default="auto", help="jax_blink impl (default auto)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    from jax_blink import launch
    from jax_blink.cli.bench_cmd import human_bytes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for r in range(args.runs):
        cmd = [os.path.abspath(__file__), "--worker", "--sizes", args.sizes, "--collectives", args.collectives,
               "--impl", args.impl]
        res = launch.launch(cmd, args.processes, args.local_devices, timeout_s=args.timeout, env=env)
        recs = [json.loads(ln[7:]) for ln in res.processes[0].stdout.splitlines() if ln.startswith("RESULT ")]
        runs.append({(x["size"], x["collective"]): x for x in recs})
        print(f"run {r + 1}/{args.runs}: {len(recs)} cells in {res.wall_s:.0f} s", file=sys.stderr, flush=True)
    table = Table(title=f"jax_blink impl={args.impl!r} / lax on {args.processes} processes x {args.local_devices} "
                        f"CPU devices (gloo): median ratio over {args.runs} fresh runs [range]; lax ms")
    table.add_column("bytes per device")
    for c in args.collectives.split(","):
        table.add_column(c)
    sizes = sorted({k[0] for run in runs for k in run})
    for size in sizes:
        cells = []
        for c in args.collectives.split(","):
            recs = [run[(size, c)] for run in runs if (size, c) in run]
            ratios = [x["blink_s"] / x["lax_s"] for x in recs]
            lax_ms = statistics.median(x["lax_s"] for x in recs) * 1e3
            ran = "/".join(sorted({x["lowering"] for x in recs}))
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
                         f"{ran}; lax {lax_ms:.2f} ms")
        table.add_row(human_bytes(size), *cells)
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
