"""Planner benchmark: rate vs certificate, tree counts, planning time, ring comparison.

Run: ``python benchmarks/planner.py [--quick] [--targets-only] [--reps N]``. Prints rich tables; every
number comes from this run. Plan times are first calls (``jax_blink.clear_caches()`` before each plan),
wall-clock on this machine. The first table times the planner against its targets: median over N
interleaved rounds (every case once per round, so load from other processes hits all cases alike) of
the uncached plan time; "3 GPUs" is the median over every 3-GPU dgx1v allocation whose GPUs share
NVLink, each timed N times, on the NVLink links alone (the setting of benchmarks/forestcoll.py, where
ForestColl takes about 1.3 ms) and, without a target, with the PCIe tree too.

Columns: trees @1% tol = tree count with plan(rate_tolerance=0.01) (its rate over the exact rate in
brackets); rate/bound = plan rate over its certificate (Edmonds max-flow bound for broadcast; LP dual
bound for all-reduce trees); ring = best ring packing (directed Hamiltonian cycles over NVLink and
PCIe routes, rings.ring_packing) expressed as the same collective's rate (broadcast: B_ring;
all-reduce: n*B_ring/(2(n-1)); all-gather / reduce-scatter: n*B_ring/(n-1)); speedup = plan rate /
ring rate (same predicted-time model). All-gather / reduce-scatter rows: rate against the exact cut
bound (bounds.allgather_bound / reducescatter_bound, parametric max-flow; ForestColl, Zhao et al. 2024).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import time

import networkx as nx
from rich.console import Console
from rich.table import Table

import jax_blink
from jax_blink import collectives
from jax_blink.planner import rings
from jax_blink.topology.presets import PRESETS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def timed_plan(t, coll, **kw):
    jax_blink.clear_caches()
    s = time.perf_counter()
    p = jax_blink.plan(t, coll, **kw)
    return p, (time.perf_counter() - s) * 1e3


TARGETS = (  # (label, preset, allocations (None: every GPU), target ms or None); planning-time targets
    # 3 GPUs: the setting of the ForestColl comparison (benchmarks/forestcoll.py), NVLink links only
    ("dgx1v-nvlink, 3 GPUs (NVLink-connected allocations)", "dgx1v-nvlink", "3", 2.0),
    ("dgx1v, 3 GPUs (same allocations, PCIe tree too)", "dgx1v", "3", None),
    ("dgx1v (NVLink + PCIe tree)", "dgx1v", None, 30.0),
    ("dgx2", "dgx2", None, 300.0),
    ("dgx1v-4node", "dgx1v-4node", None, 2000.0),
)


def timing_targets(console, reps: int, colls=("allreduce", "broadcast", "allgather")):
    """Median uncached plan time per target case and collective over ``reps`` interleaved rounds."""
    cases = []
    for label, preset, alloc, target in TARGETS:
        t = PRESETS[preset]()
        if alloc == "3":
            nvlink = nx.Graph([(u, v) for u, v, k in t.graph.edges(data="kind") if k == "nvlink"])
            devs = [d for d in itertools.combinations(t.gpus, 3)
                    if all(g in nvlink for g in d) and nx.is_connected(nvlink.subgraph(d))]
        else:
            devs = [None]
        for coll in colls:
            cases.append((label, t, devs, coll, target))
    times = {i: [] for i in range(len(cases))}
    for _ in range(reps):
        for i, (_, t, devs, coll, _) in enumerate(cases):
            times[i].append([timed_plan(t, coll, devices=d)[1] for d in devs])
    tab = Table(title=f"planning time against the targets: uncached, median of {reps} interleaved rounds")
    for c in ("topology", "GPUs", "collective", "median ms", "target ms", "pass"):
        tab.add_column(c, justify="right")
    for i, (label, t, devs, coll, target) in enumerate(cases):
        per_alloc = [statistics.median(r[k] for r in times[i]) for k in range(len(devs))]
        med = statistics.median(per_alloc)
        n = len(devs[0]) if devs[0] is not None else len(t.gpus)
        tab.add_row(label, f"{n}" + (f" ({len(devs)} allocations)" if len(devs) > 1 else ""), coll, f"{med:.1f}",
                    "-" if target is None else f"{target:g}",
                    "-" if target is None else "pass" if med < target else "FAIL")
    console.print(tab)
    console.print(f"load average (1 min) {os.getloadavg()[0]:.1f} after the timing on {os.cpu_count()} cores: "
                  "wall-clock targets, meaningful on a quiet machine")


def ring_equiv(t, devs, coll):
    n = len(devs)
    b = rings.ring_rate(t, devs)
    factor = collectives.get(coll).busbw_factor(n)  # rings of bandwidth B reach algbw B / factor
    return b / factor if factor > 0 else b


def stats(xs):
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def ring_stats(speed):
    """Speedup stats over allocations where a ring exists; counts those without one."""
    finite = [x for x in speed if x != float("inf")]
    none = len(speed) - len(finite)
    return (stats(finite) if finite else "-") + (f" ({none} no ring)" if none else "")


def allocation_sweep(console, name, quick, colls=("broadcast", "allreduce")):
    t = PRESETS[name]()
    tab = Table(title=f"{name}: every allocation (and every root for broadcast); min / median / max")
    for c in ("GPUs", "collective", "plans", "rate/bound", "trees", "plan ms", "speedup over ring"):
        tab.add_column(c, justify="right")
    for k in range(2, 9):
        allocs = list(itertools.combinations(range(8), k))
        for coll in colls:
            ratios, trees, ms, speed, skipped = [], [], [], [], 0
            for devs in allocs:
                if not nx.is_strongly_connected(t.subset(devs).graph):
                    skipped += 1  # e.g. NVLink-only GPUs with no link between them: PlanError
                    continue
                roots = devs if coll == "broadcast" and not quick else (devs[0],)
                ring = ring_equiv(t, devs, coll)
                for r in roots:
                    p, dt = timed_plan(t, coll, devices=devs, root=r if coll == "broadcast" else None)
                    ratios.append(p.rate_gbps / p.bound_gbps)
                    trees.append(len(p.trees))
                    ms.append(dt)
                    speed.append(p.rate_gbps / ring if ring > 0 else float("inf"))
            tab.add_row(str(k), coll, f"{len(ratios)}" + (f" ({skipped} disconnected)" if skipped else ""),
                        stats(ratios),
                        f"{min(trees)} / {statistics.median(trees):g} / {max(trees)}",
                        f"{min(ms):.1f} / {statistics.median(ms):.1f} / {max(ms):.1f}", ring_stats(speed))
    console.print(tab)


def full_box_rows(console, entries, colls=("broadcast", "reduce", "allreduce")):
    tab = Table(title=f"full machine: {', '.join(colls)} (broadcast from / reduce to GPU 0)")
    for c in ("topology", "GPUs", "collective", "algorithm", "rate GB/s", "bound GB/s", "rate/bound", "trees",
              "trees @1% tol", "plan ms", "ring GB/s", "speedup over ring"):
        tab.add_column(c, justify="right")
    for label, t in entries:
        devs = t.gpus
        for coll in colls:
            p, dt = timed_plan(t, coll)
            loose = jax_blink.plan(t, coll, rate_tolerance=0.01)
            ring = ring_equiv(t, devs, coll)
            tab.add_row(label, str(len(devs)), coll, p.algorithm, f"{p.rate_gbps:.3f}", f"{p.bound_gbps:.3f}",
                        f"{p.rate_gbps / p.bound_gbps:.3f}", str(len(p.trees)),
                        f"{len(loose.trees)} ({loose.rate_gbps / p.rate_gbps:.3f})", f"{dt:.1f}", f"{ring:.3f}",
                        f"{p.rate_gbps / ring:.3f}" if ring > 0 else "no ring")
    console.print(tab)


def relay_rows(console):
    """Single-pair broadcast with relay GPUs (plan(relays=...)) against max-flow over the relay graph."""
    t = PRESETS["dgx1v-nvlink"]()
    tab = Table(title="dgx1v-nvlink broadcast 0 -> 1 with relay GPUs (certificate: max-flow 0 -> 1 over the "
                      "job + relay graph)")
    for c in ("relays", "rate GB/s", "max-flow GB/s", "trees", "plan ms"):
        tab.add_column(c, justify="right")
    for rel in (None, [2, 3], "gpus"):
        p, dt = timed_plan(t, "broadcast", devices=[0, 1], root=0, relays=rel)
        extra = [] if rel is None else (list(rel) if rel != "gpus" else [g for g in t.gpus if g > 1])
        mf = nx.maximum_flow_value(t.subset([0, 1] + extra).graph, 0, 1, capacity="bandwidth_gbps")
        tab.add_row(str(rel), f"{p.rate_gbps:.3f}", f"{mf:.3f}", str(len(p.trees)), f"{dt:.1f}")
    console.print(tab)


def main() -> None:
    os.environ.setdefault("JAX_BLINK_PLAN_CACHE", "0")  # time planning, not loads from the disk cache
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one root per allocation (faster)")
    ap.add_argument("--targets-only", action="store_true", help="only the planning-time target table")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of the target table (default 5)")
    args = ap.parse_args()
    console = Console(width=170)
    t0 = time.perf_counter()
    timing_targets(console, args.reps)
    if args.targets_only:
        return
    entries = [(n, PRESETS[n]()) for n in ("dgx1p", "dgx1p-nvlink", "dgx1v", "dgx1v-nvlink", "dgx2", "dgx-a100",
                                           "dgx-h100", "pcie-2socket")]
    try:
        from jax_blink.topology.load import load_topology
        for f in sorted((ROOT / "tests" / "data" / "topologies").glob("*.txt")):
            entries.append((f.stem, load_topology(str(f))))
    except ImportError:
        console.print("jax_blink.topology.load missing: nvidia-smi files skipped")
    entries.append(("dgx1v-4node", PRESETS["dgx1v-4node"]()))
    full_box_rows(console, entries)
    full_box_rows(console, entries, ("allgather", "reducescatter"))
    relay_rows(console)
    allocation_sweep(console, "dgx1v", args.quick, ("broadcast", "allreduce", "allgather"))
    allocation_sweep(console, "dgx1v-nvlink", True, ("broadcast", "allreduce", "allgather"))
    console.print(f"total benchmark time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
