"""``jax-blink topology SOURCE [--json]``: show a topology (preset, ``topo -m`` file, NCCL XML, JSON, detect),
or ``jax-blink topology probe [--probe-sizes 1M,16M] [--json]``: measure this job's devices
(:mod:`jax_blink.probe`) and store the result where ``JAX_BLINK_TOPOLOGY=probe`` finds it."""

from __future__ import annotations

import argparse
import sys

from ..errors import BlinkError
from ..topology import Topology
from ..topology.load import load_topology
from ..topology.presets import (
    NVLINK_EFFICIENCY,
    NVLINK_LINE_GBPS,
    PCIE_EFFICIENCY,
    is_preset,
    nvlink_gbps,
    pcie_gen_gbps,
)
from ._args import HOST_FLAG, PROBE_HOST_DEVICES, TOPOLOGY_HELP, force_host_devices, positive_gbps, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register SOURCE, --json and the parser's bandwidth options."""
    p.add_argument("source", metavar="SOURCE", help=TOPOLOGY_HELP)
    p.add_argument("--json", action="store_true", help="print the model as JSON (Topology.to_json)")
    # defaults are achieved rates (line rate x efficiency), derived here from the presets' constants
    nv2, line2 = nvlink_gbps(2), NVLINK_LINE_GBPS[2]
    p.add_argument("--nvlink-gbps", type=positive_gbps, default=None,
                   help=f"GB/s per NVLink per direction when parsing a topo -m file (default: the achieved "
                        f"rate of the NVLink generation inferred from the links per GPU, e.g. NVLink2 "
                        f"{nv2:.1f} = {line2:g} line rate x {NVLINK_EFFICIENCY[2]:.3f}) or an NCCL XML file "
                        f"(default: from each GPU's sm)")
    p.add_argument("--pcie-gbps", type=positive_gbps, default=None,
                   help=f"GB/s per PCIe hop per direction when parsing a topo -m file (default: the achieved "
                        f"rate of the PCIe generation that goes with the NVLink one, e.g. gen3 x16 "
                        f"{pcie_gen_gbps(3):.1f} = {PCIE_EFFICIENCY:.3f} of the encoded line rate) or an NCCL "
                        f"XML file (default: from each link's link_speed and link_width)")
    p.add_argument("--probe-sizes", default=None, metavar="SIZES",
                   help="with SOURCE 'probe': bytes per timed transfer, e.g. 1M,16M (default 1M,16M; "
                        "the largest gives the capacities)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="with SOURCE 'probe': timings per transfer, the fastest counts (default 3)")


def run(args: argparse.Namespace) -> int:
    """Load SOURCE and print it; returns 0 (errors surface as TopologyError to the dispatcher)."""
    kw = {k: v for k, v in (("nvlink_gbps", args.nvlink_gbps), ("pcie_gbps", args.pcie_gbps)) if v is not None}
    src = args.source.strip()
    if src.lower() == "probe":
        return run_probe(args, kw)
    for opt, value in (("--probe-sizes", args.probe_sizes), ("--repeats", args.repeats)):
        if value is not None:
            raise BlinkError(f"{opt} applies to `jax-blink topology probe`, not to {src!r}")
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


def run_probe(args: argparse.Namespace, kw: dict) -> int:
    """Measure the devices JAX has (8 host CPU devices unless XLA_FLAGS sets a count), refresh the
    cache ``JAX_BLINK_TOPOLOGY=probe`` reads, print the result."""
    from .bench_cmd import parse_sizes
    if kw:
        raise BlinkError("--nvlink-gbps/--pcie-gbps label parsed files; `topology probe` measures the links")
    sizes = parse_sizes(args.probe_sizes) if args.probe_sizes is not None else None
    if sizes is not None and max(sizes) > 1 << 30:
        raise BlinkError(f"--probe-sizes up to 1G per transfer (each pair of devices copies it), got "
                         f"{args.probe_sizes!r}")
    force_host_devices(PROBE_HOST_DEVICES)
    import jax

    from ..topology.probe import DEFAULT_SIZES, GPU_PLATFORMS, cached_probe
    if len(jax.devices()) < 2:
        raise BlinkError(f"JAX has {len(jax.devices())} device; probing needs 2 or more (on CPU set "
                         f"XLA_FLAGS={HOST_FLAG}={PROBE_HOST_DEVICES})")
    t = cached_probe(sizes=tuple(sizes or DEFAULT_SIZES), repeats=args.repeats or 3, refresh=True)
    if args.json:
        print(t.to_json(indent=2))
    else:
        platform = jax.devices()[0].platform
        print_table(t, device_word=None if platform in GPU_PLATFORMS else f"{platform} device")
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


def print_table(t: Topology, file=None, device_word: str | None = None) -> None:
    """Readable summary: GPUs with their peers and total NVLink/PCIe bandwidth, then every link.

    ``device_word``: what the topology's nodes are when they are not GPUs (a probe of host CPU
    devices passes "cpu device"): the header and the first table name them so, and a line says
    that the figures are copy bandwidths between devices, not links."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=120)
    word = device_word or "GPU"
    console.print(f"[bold]{t.name}[/bold]: {len(t.gpus)} {word}s, {len(t.switches)} shared nodes "
                  f"({', '.join(sorted({t.kind(s) for s in t.switches})) or 'none'}), "
                  f"fingerprint {t.fingerprint()}")
    if device_word:
        console.print(f"These {word}s are not GPUs: the GB/s below are measured copy bandwidths between "
                      f"{word}s (jax.device_put, host memory), not interconnect links.", highlight=False)
    for note in t.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    gt = Table(title=f"{word}s", title_justify="left")
    for col in (word, "neighbours (links)", "out GB/s"):
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
