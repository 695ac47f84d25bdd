"""Blink's motivation on a DGX-1V: tree packings vs rings on fragmented allocations (simulated).

For every allocation of 3..8 GPUs of the ``dgx1v`` preset (NVLink cube-mesh + PCIe tree): the
simulated broadcast (root = first GPU) and all-reduce time at 256 MiB of the tree plan
(``jax_blink.plan``) and of the ring baseline (``jax_blink.baselines.ring_plan``), both on the same
link-level model (``jax_blink.simulate``). Prints min / median / max speedup per GPU count, saves a
plot (docs/fragmentation.png by default).

Then the single-pair case of shared/topologies/README.md (DGX-1V, NCCL 2.7.8, 1 GiB): broadcast
0 -> 1 over the direct NVLink measured 22.90 GB/s; over three paths at once (direct, via GPU 2, via
GPU 3) 66.63 GB/s (2.91x).

Run: python benchmarks/fragmentation.py [--png docs/fragmentation.png] [--size 256M]
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys
import time

from jax_blink.baselines import ring_plan
from jax_blink.cli.bench_cmd import human_bytes, parse_size
from jax_blink.packing import Plan, Tree, plan
from jax_blink.presets import preset
from jax_blink.simulate import simulate


def sweep(topo, size, progress=True):
    rows = []
    allocs = [c for k in range(3, 9) for c in itertools.combinations(topo.gpus, k)]
    it = allocs
    if progress:
        from tqdm import tqdm
        it = tqdm(allocs, desc="allocations", file=sys.stderr, leave=False)
    for devs in it:
        row = {"devices": devs}
        for coll in ("broadcast", "allreduce"):
            bp = plan(topo, coll, devices=devs)
            rp = ring_plan(topo, coll, devices=devs)
            tb = simulate(bp, size, topology=topo).time_s
            tr = simulate(rp, size, topology=topo).time_s
            row[coll] = (tr / tb, bp.rate_gbps, rp.rate_gbps, size / tb / 1e9, size / tr / 1e9)
        rows.append(row)
    return rows


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
        f"speedup of the tree plan over the ring baseline ({time.time() - t0:.0f} s)")
    out(f"{'GPUs':>4} {'allocs':>6} | {'broadcast min':>13} {'median':>7} {'max':>6} | "
        f"{'allreduce min':>13} {'median':>7} {'max':>6}")
    summary = {}
    for k in list(range(3, 9)) + ["all"]:
        sel = [r for r in rows if k == "all" or len(r["devices"]) == k]
        line = f"{str(k):>4} {len(sel):>6} |"
        for coll in ("broadcast", "allreduce"):
            sp = [r[coll][0] for r in sel]
            summary[k, coll] = (min(sp), statistics.median(sp), max(sp))
            line += f" {min(sp):12.2f}x {statistics.median(sp):6.2f}x {max(sp):5.2f}x |"
        out(line.rstrip("|"))
    for coll in ("broadcast", "allreduce"):
        best = max(rows, key=lambda r: r[coll][0])
        s, b_rate, r_rate, b_bw, r_bw = best[coll]
        out(f"largest {coll} speedup: GPUs {list(best['devices'])}: {s:.2f}x (trees {b_bw:.1f} GB/s "
            f"algbw vs ring {r_bw:.1f}; planned {b_rate:.1f} vs {r_rate:.1f} GB/s)")
    pair_case(out)
    _plot(rows, args.png, size)
    out(f"\nwrote {args.png}")
    return 0


def _plot(rows, path, size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, coll in zip(axes, ("broadcast", "allreduce")):
        for k in range(3, 9):
            sp = sorted(r[coll][0] for r in rows if len(r["devices"]) == k)
            xs = [k + (i / max(1, len(sp) - 1) - 0.5) * 0.6 for i in range(len(sp))]
            ax.scatter(xs, sp, s=10, alpha=0.7)
            ax.plot([k - 0.35, k + 0.35], [statistics.median(sp)] * 2, color="black", lw=1.5)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{coll}, {human_bytes(size)} per GPU")
        ax.set_xlabel("GPUs in the allocation (every subset of a DGX-1V)")
        ax.set_xticks(range(3, 9))
    axes[0].set_ylabel("simulated speedup: tree plan / ring")
    fig.suptitle("Blink-style tree packing vs NCCL-style rings on fragmented DGX-1V allocations "
                 "(black: median)", fontsize=10)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
