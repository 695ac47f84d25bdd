"""Multi-node all-reduce on DGX-1V nodes joined by NICs (simulated): Blink's three-phase plan vs the
planner's choice vs a flat ring vs the bound.

For N in {2, 4, 8} nodes of the ``dgx1v`` preset and 1..4 NICs of 12.5 GB/s (100 Gb/s) per node
(``jax_blink.topology.presets.multi_node``; NICs hang off the node's PCIe switches), all GPUs of all nodes:

- max-flow bound: ``bounds.allreduce_bound`` (min over GPU pairs of the max-flow, GB/s) and LP bound:
  the planner's certificate (``Plan.bound_gbps``, LP dual of the tree packing); a plan's time for S
  bytes is S / rate;
- planner: ``jax_blink.plan(topology, "allreduce")`` (what ``jax_blink.psum`` runs);
- three-phase: ``jax_blink.distributed.three_phase_plan`` = ``plan(..., algorithm="hierarchical")``
  (Blink, MLSys 2020, section 5: data partitioned over a node's GPUs; partition i reduced on
  intra-node trees onto GPU i, exchanged among the GPU i's of all nodes over their NICs, broadcast
  inside nodes; tree weights by an LP over such trees);
- ring: ``jax_blink.planner.rings.ring_plan`` over all GPUs (NCCL's flat ring; rate n b / (2(n-1))).

Each plan's rate (GB/s, S / predicted time) and its simulated algbw (``jax_blink.simulate``,
link-level event model, ``--size`` bytes per GPU, 2 us per message) are printed in one table, with
the simulated speedups over the ring measured in the same run.

Run: python benchmarks/multinode.py [--nodes 2 4 8] [--nics 1 2 3 4] [--size 256M]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console
from rich.table import Table

from jax_blink.cli.bench_cmd import human_bytes, parse_size
from jax_blink.distributed import three_phase_plan
from jax_blink.planner import bounds
from jax_blink.planner.rings import ring_plan
from jax_blink.planning import plan
from jax_blink.simulate import simulate
from jax_blink.topology.presets import multi_node

NIC_GBPS = 12.5


def row(nodes: int, nics: int, size: float, node: str = "dgx1v") -> dict:
    """Plans and simulated algbw for one configuration (GB/s everywhere)."""
    topo = multi_node(node, nodes, NIC_GBPS, nics)
    out = {"nodes": nodes, "nics": nics, "gpus": len(topo.gpus),
           "bound": bounds.allreduce_bound(topo, topo.gpus)}
    t0 = time.perf_counter()
    plans = {"planner": plan(topo, "allreduce"), "three-phase": three_phase_plan(topo),
             "ring": ring_plan(topo, "allreduce")}
    out["plan_s"] = time.perf_counter() - t0
    out["lp_bound"] = plans["planner"].bound_gbps
    for name, p in plans.items():
        sim = simulate(p, size, topology=topo)
        out[name] = (p.algorithm, p.rate_gbps, sim.algbw_gbps, len(p.trees))
    return out


def main(argv=None) -> int:
    os.environ.setdefault("JAX_BLINK_PLAN_CACHE", "0")  # time planning, not loads from the disk cache
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--nics", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--size", default="256M", help="bytes per GPU (suffix K/M/G = KiB/MiB/GiB)")
    ap.add_argument("--node", default="dgx1v", help="node preset (default dgx1v)")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    if any(n < 2 for n in a.nodes) or any(k < 1 for k in a.nics):
        ap.error("--nodes must be >= 2 and --nics >= 1")
    console = Console(width=200, highlight=False)
    table = Table(title=f"all-reduce of {human_bytes(size)} per GPU on N x {a.node} nodes, NICs of "
                        f"{NIC_GBPS} GB/s (rate = S / predicted time; sim = simulated algbw), GB/s")
    for col in ("nodes", "NICs", "GPUs", "max-flow bound", "LP bound", "planner", "rate", "sim", "3-phase rate", "sim",
                "ring rate", "sim", "planner/ring", "3-phase/ring", "plan s"):
        table.add_column(col, justify="right")
    for nodes in a.nodes:
        for nics in a.nics:
            r = row(nodes, nics, size, a.node)
            pa, pr, ps, pt = r["planner"]
            _, hr, hs, ht = r["three-phase"]
            _, rr, rs, _ = r["ring"]
            table.add_row(str(nodes), str(nics), str(r["gpus"]), f"{r['bound']:.2f}", f"{r['lp_bound']:.2f}",
                          f"{pa} ({pt})", f"{pr:.2f}", f"{ps:.2f}", f"{hr:.2f} ({ht})", f"{hs:.2f}",
                          f"{rr:.2f}", f"{rs:.2f}", f"{ps / rs:.2f}x", f"{hs / rs:.2f}x", f"{r['plan_s']:.1f}")
            print(f"done: {nodes} nodes, {nics} NICs", file=sys.stderr, flush=True)
    console.print(table)
    console.print("planner/ring and 3-phase/ring: ratios of simulated algbw in this run. (k) = trees.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
