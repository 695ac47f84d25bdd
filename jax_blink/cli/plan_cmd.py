"""``jax-blink plan --topology SOURCE [--devices 0,1,2] [--collective C] [--root R] [--max-trees K]
[--size BYTES] [--json]``: plan a tree packing (or the fastest candidate at ``--size``) and print its
trees, rate, certificate and the ring rate for comparison."""

from __future__ import annotations

import argparse
import math
import sys

from .. import collectives
from ..errors import BlinkError, PlanError
from ..planner.facade import ALGORITHMS
from ..planner.rings import ring_rate
from ..planning import plan
from ..topology.load import load_topology
from ._args import add_job_arguments, check_root, number_type, parse_devices, positive_int

FRACTION = number_type(float, low=0, high=1, high_open=True, what="a fraction")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register --topology, --devices, --collective, --root, --max-trees, --algorithm,
    --rate-tolerance, --relays, --json."""
    add_job_arguments(p)
    p.add_argument("--max-trees", type=positive_int, default=None,
                   help="use at most K trees (the rate loss is reported)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                   help="force an algorithm (default: the fastest on predicted time)")
    p.add_argument("--rate-tolerance", type=FRACTION, default=0.0, metavar="F",
                   help="drop the lightest trees while the rate stays within this fraction (e.g. 0.01)")
    p.add_argument("--relays", default=None, metavar="IDS|gpus",
                   help="GPUs outside --devices that may forward data (comma list, or 'gpus' for all); "
                        "such plans can be simulated (jax-blink bench) but not run by JAX")
    p.add_argument("--size", default=None, metavar="BYTES",
                   help="operand bytes per GPU (4K, 1M, 1G): --algorithm auto picks the fastest plan at "
                        "this size by the simulator (trees, fewer trees, rings, NCCL's baselines); "
                        "default: the highest rate (large operands)")
    p.add_argument("--json", action="store_true", help="print Plan.to_json() (infinite rates as null)")


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns 0. Bad input raises PlanError/TopologyError (exit status 2)."""
    check_root(args)
    t = load_topology(args.topology)
    if args.max_trees is not None and args.max_trees < 1:
        raise PlanError(f"--max-trees must be >= 1, got {args.max_trees}")
    if not 0.0 <= args.rate_tolerance < 1.0:
        raise PlanError(f"--rate-tolerance must be in [0, 1), got {args.rate_tolerance}")
    relays = args.relays
    if relays not in (None, "gpus", "none"):
        try:
            relays = parse_devices(relays, "--relays")
        except BlinkError as err:
            raise PlanError(f"--relays takes GPU ids (0,1,4 or 0-3) or 'gpus': {err}") from None
    from .bench_cmd import parse_size
    nbytes = None if args.size is None else parse_size(args.size)
    p = plan(t, args.collective, devices=args.devices, root=args.root, max_trees=args.max_trees,
             algorithm=args.algorithm, rate_tolerance=args.rate_tolerance, relays=relays, nbytes=nbytes)
    if args.json:
        print(p.to_json(indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=140)
    fmt = lambda x: "inf" if math.isinf(x) else f"{x:.3f}"  # noqa: E731
    b_ring = ring_rate(t, p.devices) if len(p.devices) > 1 else float("inf")
    n = len(p.devices)
    row = collectives.get(p.collective)
    # rings of total bandwidth B reach algbw B / busbw factor (nccl-tests): all-reduce n B / (2(n-1)),
    # all-gather / reduce-scatter n B / (n-1), broadcast / reduce B
    ring_eff = b_ring / row.busbw_factor(n) if n > 1 and row.busbw_factor(n) > 0 else b_ring
    root = "" if p.root is None else f" root {p.root}"
    console.print(f"[bold]{p.collective}[/bold]{root} on {t.name} GPUs {list(p.devices)}: "
                  f"[bold]{p.shape()}[/bold]")
    ratio = "" if math.isinf(p.rate_gbps) or p.bound_gbps == 0 else f" ({p.rate_gbps / p.bound_gbps:.3f} of bound)"
    # whose upper bound bound_gbps is: NCCL's rings and tree are compared with their whole family
    bound = {"ring": "ring bound", "double-binary-tree": "max-flow bound",
             "rsag": "RS+AG bound"}.get(p.algorithm, "cut bound" if row.sharded else "bound")
    console.print(f"rate {fmt(p.rate_gbps)} GB/s, {bound} {fmt(p.bound_gbps)} GB/s{ratio}; "
                  f"rings at most {fmt(ring_eff)} GB/s (the best ring packing, rings of {fmt(b_ring)} GB/s in "
                  "total: no ring schedule, NCCL's included, exceeds it)")
    for note in p.notes:
        console.print(f"  note: {note}")
    if args.algorithm != "auto":
        console.print(f"  note: --algorithm {args.algorithm}: the family you asked for (without it, auto picks "
                      "the fastest)")
    if nbytes is None and args.algorithm == "auto" and n > 1:
        console.print("  note: no --size: the highest-rate plan (large operands); --size BYTES gives the plan "
                      "auto runs at that size (fewer trees, rings or NCCL's double binary tree may be faster)")
    rings = p.rings()
    if rings:  # a ring plan: one row per ring (its trees are the ring's n rotations)
        tab = Table(title="rings", title_justify="left")
        for col in ("#", "GB/s", "share", "GPU order", "via"):
            tab.add_column(col, justify="right" if col in ("#", "GB/s", "share") else "left")
        total = sum(b for _, b in rings)
        for i, (hops, b) in enumerate(sorted(rings, key=lambda r: -r[1])):
            order = [hops[0][0]] + [v for _, v in hops if isinstance(v, int)]
            via = ",".join(sorted({str(x) for h in hops for x in h if not isinstance(x, int)}))
            tab.add_row(str(i), f"{b:.3f}", f"{b / total:.3f}", " -> ".join(map(str, order)), via or "-")
        console.print(tab)
    elif p.trees:
        tab = Table(title="trees", title_justify="left")
        for col in ("#", "root", "GB/s", "share", "edges (parent->child)", "via", "reduce"):
            tab.add_column(col, justify="right" if col in ("#", "root", "GB/s", "share") else "left")
        for i, tr in enumerate(p.trees):
            par = tr.gpu_parents()
            edges = " ".join(f"{a}->{c}" for c, a in par.items())
            via = ",".join(sorted({str(x) for r in tr.routes() for x in r[1:-1]}))
            red = "reversed" if tr.reduce_edges is None else " ".join(
                f"{c}->{a}" for c, a in tr.gpu_parents(reduce=True).items())
            tab.add_row(str(i), str(tr.root), f"{tr.weight_gbps:.3f}", f"{tr.weight_gbps / p.rate_gbps:.3f}",
                        edges, via or "-", red if row.reduces else "-")
        console.print(tab)
    return 0
