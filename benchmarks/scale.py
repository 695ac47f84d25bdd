"""Planning at cluster scale: all-reduce over 2..128 identical nodes (16..1,024 GPUs), uncached.

For each node type (``multi_node(node, N, 12.5 GB/s NICs, k)``: dgx1v with 1 and 4 NICs, dgx-h100
with 8, the pcie-2socket PCIe box with 2) and node count N, all GPUs of all nodes:

- plan time per algorithm: ``plan(algorithm="trees" | "hierarchical" | "rsag")`` (planned on one node
  and the network by symmetry, ``jax_blink/planner/symmetric.py``) and ``plan(nbytes=64 KiB | 256 MiB)``
  (the cost model's choice, flow-level closed form), each the median of ``--reps`` runs with
  ``jax_blink.clear_caches()`` before each and the disk cache off (``JAX_BLINK_PLAN_CACHE=0``);
- rate / bound of each plan (the bound of "trees" is the exact optimum of the flat packing: the
  symmetric LP's dual; "hierarchical" reports against that same bound, so its gap is the cost of
  one leader per node; "rsag" against 1 / (1/B_rs + 1/B_ag) of the cut bounds) and tree counts;
- the choice at each size and, with ``--cache``, the time to load that choice from the disk cache
  (a fresh temporary ``JAX_BLINK_CACHE_DIR``; median of ``--reps`` loads after ``clear_caches()``),
  wall and CPU time of the process (on a shared machine the CPU time is what the load costs).

``--link N``: for configurations up to N GPUs, also the link-level simulator's time of the choice
(``simulate(method="link")``) next to its flow-level prediction, and the choice's link-level time over
the link-level fastest of ``candidate_plans`` (1.0000: auto picked the link-level choice; slow:
seconds per 256 MiB case).

Run: python benchmarks/scale.py [--nodes 2 4 8 16 32 64 128] [--types dgx1v:1 dgx1v:4 dgx-h100:8
pcie-2socket:2] [--reps 3] [--cache] [--link 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ["JAX_BLINK_PLAN_CACHE"] = "0"

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink.simulate import simulate  # noqa: E402
from jax_blink.topology.presets import multi_node  # noqa: E402

NIC_GBPS = 12.5
SIZES = {"64K": 64 << 10, "256M": 256 << 20}


def timed(fn, reps: int, cpu: bool = False):
    """(median seconds over ``reps`` uncached calls, last result); with ``cpu``, also the median CPU
    seconds of the process (``time.process_time``: what the call itself cost, less the waits of a
    loaded machine)."""
    ts, cs, out = [], [], None
    for _ in range(reps):
        jax_blink.clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return (statistics.median(ts), out, statistics.median(cs)) if cpu else (statistics.median(ts), out)


def ratio(p) -> str:
    return f"{p.rate_gbps / p.bound_gbps:.4f}"


def row(node: str, nics: int, n: int, reps: int, cache: bool, link_max: int) -> dict:
    topo = multi_node(node, n, NIC_GBPS, nics)
    out = {"type": f"{node} x{nics} NIC", "nodes": n, "gpus": len(topo.gpus)}
    for alg in ("trees", "hierarchical", "rsag"):
        out[alg] = timed(lambda a=alg: jax_blink.plan(topo, "allreduce", algorithm=a), reps)
    for name, nb in SIZES.items():
        out[name] = timed(lambda b=nb: jax_blink.plan(topo, "allreduce", nbytes=b), reps)
        p = out[name][1]
        out[name + "_pred"] = jax_blink.costmodel.simulated_time(p, nb, topo)
        if len(topo.gpus) <= link_max:
            out[name + "_link"] = simulate(p, nb, topology=topo, method="link").time_s
            # the link-level fastest of auto's candidates: the choice should be it (or as fast)
            out[name + "_best"] = min(jax_blink.costmodel.simulated_time(c, nb, topo, cost="link")
                                      for c in jax_blink.costmodel.candidate_plans(topo, "allreduce"))
        if cache:
            with tempfile.TemporaryDirectory() as d:
                os.environ.update(JAX_BLINK_PLAN_CACHE="1", JAX_BLINK_CACHE_DIR=d)
                try:
                    jax_blink.clear_caches()
                    jax_blink.plan(topo, "allreduce", nbytes=nb)  # plans and writes the entry
                    t, _, c = timed(lambda b=nb: jax_blink.plan(topo, "allreduce", nbytes=b), reps, cpu=True)
                    out[name + "_load"], out[name + "_load_cpu"] = t, c
                finally:
                    os.environ["JAX_BLINK_PLAN_CACHE"] = "0"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--types", nargs="+", default=["dgx1v:1", "dgx1v:4", "dgx-h100:8", "pcie-2socket:2"],
                    help="node preset:NICs per node")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", action="store_true", help="also time loading the choice from the disk cache")
    ap.add_argument("--link", type=int, default=0, metavar="GPUS",
                    help="link-level simulation of the choice up to this many GPUs")
    a = ap.parse_args(argv)
    if any(n < 2 for n in a.nodes) or a.reps < 1:
        ap.error("--nodes must be >= 2 and --reps >= 1")
    types = []
    for spec in a.types:
        node, _, k = spec.partition(":")
        types.append((node, int(k or 1)))
    jax_blink.plan(multi_node("dgx1v", 2, NIC_GBPS, 1), "allreduce", nbytes=1 << 20)  # imports, HiGHS start
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    console = Console(width=240, highlight=False)
    table = Table(title=f"all-reduce planning at scale (uncached; median of {a.reps} runs; seconds; rate/bound; "
                        f"(k) = trees)")
    cols = ["node type", "nodes x GPUs", "trees", "rate/bound", "hierarchical", "rate/bound", "rsag", "rate/bound",
            "plan(64K)", "choice 64K", "plan(256M)", "choice 256M", "256M rate/bound"]
    if a.cache:
        cols += ["load 64K", "load 256M", "load CPU 64K / 256M"]
    if a.link:
        cols += ["64K pred/link us", "256M pred/link ms", "choice/link-best 64K", "256M"]
    for c in cols:
        table.add_column(c, justify="right")
    for node, nics in types:
        for n in a.nodes:
            r = row(node, nics, n, a.reps, a.cache, a.link)
            cells = [r["type"], f"{n} x {r['gpus'] // n} = {r['gpus']}"]
            for alg in ("trees", "hierarchical", "rsag"):
                t, p = r[alg]
                cells += [f"{t:.3f} ({len(p.trees)})", ratio(p)]
            for name in SIZES:
                t, p = r[name]
                cells += [f"{t:.3f}", f"{p.algorithm} ({len(p.trees)})"]
            cells.append(ratio(r["256M"][1]))
            if a.cache:
                cells += [f"{r['64K_load'] * 1e3:.1f} ms", f"{r['256M_load'] * 1e3:.1f} ms",
                          f"{r['64K_load_cpu'] * 1e3:.1f} / {r['256M_load_cpu'] * 1e3:.1f} ms"]
            if a.link:
                cells += [f"{r['64K_pred'] * 1e6:.1f}/{r['64K_link'] * 1e6:.1f}" if "64K_link" in r else "-",
                          f"{r['256M_pred'] * 1e3:.2f}/{r['256M_link'] * 1e3:.2f}" if "256M_link" in r else "-"]
                cells += [f"{r[k + '_link'] / r[k + '_best']:.4f}" if k + "_link" in r else "-" for k in SIZES]
            table.add_row(*cells)
            print(" | ".join(cells), file=sys.stderr, flush=True)  # each row as it is measured
    console.print(table)
    load1 = os.getloadavg()
    console.print(f"load average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, at end "
                  f"{tuple(round(x, 2) for x in load1)}; {os.cpu_count()} CPUs; {time.perf_counter() - t_start:.0f} s")
    console.print("rate/bound: trees and hierarchical against the exact flat-packing bound (symmetric LP dual); "
                  "rsag against 1/(1/B_rs + 1/B_ag).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
