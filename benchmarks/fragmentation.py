"""Blink's motivation on a DGX-1V: tree packings vs NCCL on fragmented allocations (simulated).

For every allocation of 3..8 GPUs of the ``dgx1v`` preset (NVLink cube-mesh + PCIe tree): the
simulated broadcast (root = first GPU), all-reduce and all-gather (256 MiB gathered) time at 256 MiB of
jax_blink's choice (``jax_blink.plan(nbytes=size)``: the fastest candidate by the simulator) and of
NCCL's baselines as NCCL builds them (``jax_blink.planner.rings``, ``jax_blink.planner.dbtree``): rings
over NVLink, or over PCIe / inter-socket links when the allocation has no NVLink ring, and (all-reduce)
the double binary tree over the same links; all on the same link-level model (``jax_blink.simulate``).
Prints min / median / max speedup per GPU count over each baseline, saves a plot of the speedup over
NCCL's rings (docs/fragmentation.png by default).

Then the single-pair case of shared/topologies/README.md (DGX-1V, NCCL 2.7.8, 1 GiB): broadcast
0 -> 1 over the direct NVLink measured 22.90 GB/s; over three paths at once (direct, via GPU 2, via
GPU 3) 66.63 GB/s (2.91x).

Run: python benchmarks/fragmentation.py [--png docs/fragmentation.png] [--size 256M]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import pathlib
import statistics
import sys
import time

from jax_blink import costmodel
from jax_blink.cli.bench_cmd import human_bytes, parse_size
from jax_blink.planner.dbtree import nccl_tree_plan
from jax_blink.planner.model import Plan, Tree
from jax_blink.planner.rings import nccl_ring_plan
from jax_blink.planning import plan
from jax_blink.simulate import simulate
from jax_blink.topology.presets import preset

COLLS = ("broadcast", "allreduce", "allgather")


def sweep(topo, size, progress=True):
    """Rows {"devices", coll: {"blink"|"ring"|"tree": (seconds, plan)}}; "tree" only for all-reduce."""
    rows = []
    allocs = [c for k in range(3, 9) for c in itertools.combinations(topo.gpus, k)]
    it = allocs
    if progress:
        from tqdm import tqdm
        it = tqdm(allocs, desc="allocations", file=sys.stderr, leave=False)
    for devs in it:
        row = {"devices": devs}
        for coll in COLLS:
            plans = {"blink": plan(topo, coll, devices=devs, nbytes=size),
                     "ring": nccl_ring_plan(topo, coll, devices=devs, root=devs[0] if coll == "broadcast" else None)}
            if coll == "allreduce":
                plans["tree"] = nccl_tree_plan(topo, devices=devs)
            row[coll] = {k: (costmodel.simulated_time(p, size, topo), p) for k, p in plans.items()}
        rows.append(row)
    return rows


def speedup(row, coll, base):
    return row[coll][base][0] / row[coll]["blink"][0]


def pair_case(out):
    topo = preset("dgx1v")
    S = 1 << 30
    B = 25.0
    direct = Plan("broadcast", 0, (0, 1), (Tree(0, B, ((0, 1),)),), B, B, "trees")
    three = Plan("broadcast", 0, (0, 1), (Tree(0, B, ((0, 1),)), Tree(0, B, ((0, 2), (2, 1))),
                                         Tree(0, B, ((0, 3), (3, 1)))), 3 * B, 3 * B, "trees")
    rd = simulate(direct, S, topology=topo)
    r3 = simulate(three, S, topology=topo)
    out("\nDGX-1V broadcast 0 -> 1, 1 GiB (measured, NCCL 2.7.8: direct 22.90 GB/s, three paths "
        "66.63 GB/s, ratio 2.91x)")
    out(f"  simulated, direct NVLink only              : {rd.algbw_gbps:7.2f} GB/s")
    out(f"  simulated, three paths (direct, via 2, via 3): {r3.algbw_gbps:7.2f} GB/s  "
        f"ratio {r3.algbw_gbps / rd.algbw_gbps:.2f}x")
    p01 = plan(topo, "broadcast", devices=[0, 1], root=0)
    r01 = simulate(p01, S, topology=topo)
    out(f"  planner, job = GPUs [0, 1] (only their links: NVLink + shared PCIe switch): "
        f"{p01.rate_gbps:.2f} GB/s planned, {r01.algbw_gbps:.2f} simulated ({len(p01.trees)} trees)")
    p4 = plan(topo, "broadcast", devices=[0, 1, 2, 3], root=0)
    r4 = simulate(p4, S, topology=topo)
    out(f"  planner, job = GPUs [0, 1, 2, 3], broadcast from 0 (2, 3 relay and receive): "
        f"{p4.rate_gbps:.2f} GB/s planned, {r4.algbw_gbps:.2f} simulated -> "
        f"{r4.algbw_gbps / rd.algbw_gbps:.2f}x direct")
    nv = preset("dgx1v-nvlink")
    for relays, what in (([2, 3], "GPUs 2, 3 (NVLink only)"), ("gpus", "GPUs 2-7 (NVLink only)")):
        pr = plan(nv, "broadcast", devices=[0, 1], root=0, relays=relays)
        rr = simulate(pr, S, topology=nv)
        out(f"  planner, job = GPUs [0, 1], relays {what}: {pr.rate_gbps:.2f} GB/s planned "
            f"(max-flow {pr.bound_gbps:.2f}), {rr.algbw_gbps:.2f} simulated -> "
            f"{rr.algbw_gbps / rd.algbw_gbps:.2f}x direct ({len(pr.trees)} trees)")


def main(argv=None) -> int:
    os.environ.setdefault("JAX_BLINK_PLAN_CACHE", "0")  # time planning, not loads from the disk cache
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default=str(pathlib.Path(__file__).resolve().parents[1] / "docs" / "fragmentation.png"))
    ap.add_argument("--size", default="256M")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    topo = preset("dgx1v")
    t0 = time.time()
    rows = sweep(topo, size)
    out = print
    out(f"dgx1v, every allocation of 3..8 GPUs ({len(rows)}), {human_bytes(size)} per GPU, simulated "
        f"speedup of jax_blink (auto) over NCCL's rings and double binary tree ({time.time() - t0:.0f} s)")
    cols = [("broadcast", "ring"), ("allreduce", "ring"), ("allreduce", "tree"), ("allgather", "ring")]
    out(f"{'GPUs':>4} {'allocs':>6} | " + " | ".join(f"{c + ' vs ' + b + ', min / median / max':<40}"
                                                   for c, b in cols))
    for k in list(range(3, 9)) + ["all"]:
        sel = [r for r in rows if k == "all" or len(r["devices"]) == k]
        cells = []
        for coll, base in cols:
            sp = [speedup(r, coll, base) for r in sel]
            cells.append(f"{min(sp):.2f} / {statistics.median(sp):.2f} / {max(sp):.2f}x".ljust(40))
        out(f"{str(k):>4} {len(sel):>6} | " + " | ".join(cells))
    levels = collections.Counter(r["allreduce"]["ring"][1].notes[0].split(" on ")[1].split(" links")[0] for r in rows)
    out(f"NCCL ring links per allocation: {dict(levels)} (pcie: no NVLink ring through the GPUs)")
    for coll, base in cols:
        best = max(rows, key=lambda r: speedup(r, coll, base))
        (tb, bp), (tr, rp) = best[coll]["blink"], best[coll][base]
        out(f"largest {coll} speedup over NCCL's {base}: GPUs {list(best['devices'])}: {tr / tb:.2f}x "
            f"({bp.shape()} {size / tb / 1e9:.1f} GB/s algbw vs {rp.shape()} {size / tr / 1e9:.1f})")
    slower = sum(speedup(r, c, b) < 1 - 1e-9 for r in rows for c, b in cols)
    out(f"cells where jax_blink is slower than a baseline: {slower}")
    pair_case(out)
    _plot(rows, args.png, size)
    out(f"\nwrote {args.png}")
    return 0


def _plot(rows, path, size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COLLS), figsize=(5.5 * len(COLLS), 4.2), sharey=True)
    for ax, coll in zip(axes, COLLS):
        for k in range(3, 9):
            sp = sorted(speedup(r, coll, "ring") for r in rows if len(r["devices"]) == k)
            xs = [k + (i / max(1, len(sp) - 1) - 0.5) * 0.6 for i in range(len(sp))]
            ax.scatter(xs, sp, s=10, alpha=0.7)
            ax.plot([k - 0.35, k + 0.35], [statistics.median(sp)] * 2, color="black", lw=1.5)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{coll}, {human_bytes(size)} per GPU")
        ax.set_xlabel("GPUs in the allocation (every subset of a DGX-1V)")
        ax.set_xticks(range(3, 9))
    axes[0].set_ylabel("simulated speedup: jax_blink / NCCL rings")
    fig.suptitle("jax_blink (auto) vs NCCL's rings (NVLink, else PCIe) on fragmented DGX-1V allocations "
                 "(black: median)", fontsize=10)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
