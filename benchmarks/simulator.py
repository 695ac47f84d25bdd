"""The link-level simulator's cost: the native event model against the Python reference, same run.

For each case (a topology, the plan ``jax_blink.plan(topo, nbytes=S)`` or an ``algorithm=`` plan, a
size S per GPU), ``simulate(plan, S, method="link")`` timed twice in this process: with the native
event model (``jax_blink._native._linksim``; messages as arrays, a plan's tiled from one chunk
template per tree) and with the Python reference (``jax_blink.simulate.events._native_linksim = None``: the
message objects and the Python event loop). Columns: messages, CPU seconds of each (the least of
``--reps`` runs; ``time.process_time``), reference / native, and whether the two simulated times and
per-link bytes are bitwise equal. Exit status 1 if any case differs.

Run: python benchmarks/simulator.py [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["JAX_BLINK_PLAN_CACHE"] = "0"

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink import simulate as sim  # noqa: E402
from jax_blink.topology.presets import multi_node, preset  # noqa: E402

CASES = [  # (label, topology maker, algorithm or None for plan(nbytes=), bytes per GPU)
    ("dgx1v, 8 GPUs", lambda: preset("dgx1v"), None, 256 << 20),
    ("2 x dgx-h100 (8 NICs), 16 GPUs", lambda: multi_node("dgx-h100", 2, 12.5, 8), "trees", 256 << 20),
    ("2 x dgx-h100 (8 NICs), 16 GPUs", lambda: multi_node("dgx-h100", 2, 12.5, 8), "rsag", 256 << 20),
    ("8 x pcie-2socket (2 NICs), 64 GPUs", lambda: multi_node("pcie-2socket", 8, 12.5, 2), "rsag", 64 << 10),
    ("8 x dgx-h100 (8 NICs), 64 GPUs", lambda: multi_node("dgx-h100", 8, 12.5, 8), "trees", 256 << 20),
    ("8 x dgx-h100 (8 NICs), 64 GPUs", lambda: multi_node("dgx-h100", 8, 12.5, 8), "rsag", 256 << 20),
]


def best_cpu(fn, reps: int):
    out, best = None, float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the cases up to 16 GPUs only")
    a = ap.parse_args(argv)
    if sim.events._native_linksim is None:
        print(f"the native event model is not built: {jax_blink._native.linksim_error}", file=sys.stderr)
        return 1
    table = Table(title=f"simulate(method='link'): native event model vs Python reference (CPU s, least of {a.reps})")
    for c in ("case", "plan", "size", "messages", "native s", "reference s", "reference / native", "bitwise equal"):
        table.add_column(c, justify="right")
    load0, bad = os.getloadavg(), 0
    for label, make, alg, nbytes in CASES[:4] if a.quick else CASES:
        topo = make()
        p = jax_blink.plan(topo, "allreduce", nbytes=nbytes) if alg is None else jax_blink.plan(topo, algorithm=alg)
        run = lambda p=p, b=nbytes, t=topo: sim.simulate(p, b, topology=t, method="link")  # noqa: E731
        t_nat, nat = best_cpu(run, a.reps)
        sim.events._native_linksim = None
        try:
            t_ref, ref = best_cpu(run, a.reps)
        finally:
            sim.events._native_linksim = jax_blink._native.linksim
        same = nat.time_s == ref.time_s and list(nat.link_bytes.items()) == list(ref.link_bytes.items())
        bad += not same
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        table.add_row(label, f"{p.algorithm} ({len(p.trees)})", size, f"{nat.messages:,}", f"{t_nat:.3f}",
                      f"{t_ref:.3f}", f"{t_ref / t_nat:.1f}", "yes" if same else "NO")
    console = Console(width=200, highlight=False)
    console.print(table)
    console.print(f"load average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, at end "
                  f"{tuple(round(x, 2) for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
