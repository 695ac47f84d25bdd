"""``jax-blink topology SOURCE [--json]``: show a topology (preset, ``topo -m`` file, NCCL XML, JSON, detect)."""

from __future__ import annotations

import argparse
import sys

from ..discovery import load_topology
from ..errors import BlinkError
from ..presets import is_preset
from ..topology import Topology
from ._args import TOPOLOGY_HELP, positive_gbps


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register SOURCE, --json and the parser's bandwidth options."""
    p.add_argument("source", metavar="SOURCE", help=TOPOLOGY_HELP)
    p.add_argument("--json", action="store_true", help="print the model as JSON (Topology.to_json)")
    p.add_argument("--nvlink-gbps", type=positive_gbps, default=None,
                   help="GB/s per NVLink per direction when parsing a topo -m file (default 25) or an "
                        "NCCL XML file (default: from each GPU's sm)")
    p.add_argument("--pcie-gbps", type=positive_gbps, default=None,
                   help="GB/s per PCIe hop per direction when parsing a topo -m file (default 12) or an "
                        "NCCL XML file (default: from each link's link_speed and link_width)")


def run(args: argparse.Namespace) -> int:
    """Load SOURCE and print it; returns 0 (errors surface as TopologyError to the dispatcher)."""
    kw = {k: v for k, v in (("nvlink_gbps", args.nvlink_gbps), ("pcie_gbps", args.pcie_gbps)) if v is not None}
    src = args.source.strip()
    if kw and (is_preset(src) or src.lower().endswith(".json")):
        # presets and JSON models carry their own bandwidths; silently ignoring the option misleads
        what = "preset" if is_preset(src) else "JSON model"
        raise BlinkError(f"--nvlink-gbps/--pcie-gbps apply to an nvidia-smi topo -m file, an NCCL XML "
                         f"file or 'detect'; "
                         f"the {what} {src!r} has fixed bandwidths")
    t = load_topology(args.source, **kw)
    if args.json:
        print(t.to_json(indent=2))
    else:
        print_table(t)
    return 0


def undirected_links(t: Topology) -> list[tuple]:
    """(u, v, kind, links, gbps_uv, gbps_vu) once per joined pair, in :meth:`Topology.links` order."""
    out, seen = [], set()
    for u, v, bw, kind, links in t.links():
        if frozenset((u, v)) in seen:
            continue
        seen.add(frozenset((u, v)))
        out.append((u, v, kind, links, bw, t.bandwidth(v, u)))
    return out


def print_table(t: Topology, file=None) -> None:
    """Readable summary: GPUs with their peers and total NVLink/PCIe bandwidth, then every link."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=120)
    console.print(f"[bold]{t.name}[/bold]: {len(t.gpus)} GPUs, {len(t.switches)} shared nodes "
                  f"({', '.join(sorted({t.kind(s) for s in t.switches})) or 'none'}), "
                  f"fingerprint {t.fingerprint()}")
    for note in t.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    gt = Table(title="GPUs", title_justify="left")
    for col in ("GPU", "neighbours (links)", "out GB/s"):
        gt.add_column(col, justify="right" if col != "neighbours (links)" else "left")
    for g in t.gpus:
        nbrs = [f"{v}({d['kind']} x{d['links']})" for _, v, d in t.graph.out_edges(g, data=True)]
        out = sum(d["bandwidth_gbps"] for _, _, d in t.graph.out_edges(g, data=True))
        gt.add_row(str(g), ", ".join(nbrs), f"{out:g}")
    console.print(gt)
    lt = Table(title="Links (GB/s per direction)", title_justify="left")
    for col in ("a", "b", "kind", "links", "a->b GB/s", "b->a GB/s"):
        lt.add_column(col, justify="right" if "GB/s" in col or col == "links" else "left")
    for u, v, kind, links, ab, ba in undirected_links(t):
        lt.add_row(str(u), str(v), kind, str(links), f"{ab:g}", f"{ba:g}")
    console.print(lt)
