"""``jax-blink show``: draw a plan's trees over the topology, plus link utilisation, to a PNG."""

from __future__ import annotations

import argparse
import os

from ..errors import BlinkError
from .bench_cmd import add_common, human_bytes, load_inputs, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register --topology/--devices/--collective/--root/--plan, --png, --algorithm, --size."""
    add_common(p)
    p.add_argument("--png", required=True, metavar="FILE",
                   help="output PNG file; '.png' is appended when FILE has no suffix (other image suffixes "
                        "such as .jpg are refused)")
    p.add_argument("--algorithm", default="blink", choices=("blink", "ring", "tree"),
                   help="which plan to draw: the tree packing (default), NCCL's rings (NVLink, else "
                        "PCIe links), or NCCL's double binary tree (all-reduce)")
    p.add_argument("--size", default="256M",
                   help="bytes per GPU: blink draws the plan auto picks at this size; the link utilisation "
                        "panel is simulated at it (default 256M)")


def png_path(text: str) -> str:
    """The file ``--png text`` writes: ``text`` itself when it ends in .png, else ``text + '.png'``
    (matplotlib would append it anyway). Raises BlinkError for an empty name, a directory, or a name
    ending in another image format's suffix (trees.jpg would have become trees.jpg.png)."""
    if not text.strip():
        raise BlinkError("--png is empty: give an output file name such as trees.png")
    if text.endswith((os.sep, "/")) or os.path.isdir(text):
        raise BlinkError(f"--png {text!r} is a directory: give a file name such as "
                         f"{os.path.join(text, 'trees.png')}")
    suffix = os.path.splitext(text)[1].lower()
    if suffix in _OTHER_IMAGE_SUFFIXES:
        raise BlinkError(f"--png {text!r}: the figure is written as PNG only; give a name ending in .png, "
                         f"e.g. {os.path.splitext(text)[0]}.png")
    return text if suffix == ".png" else text + ".png"


_OTHER_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp", ".svg", ".pdf", ".eps", ".ps")


def run(args: argparse.Namespace) -> int:
    """Plan for --size (or load --plan), simulate at --size for the utilisation panel, write --png."""
    from ..planner.dbtree import nccl_tree_plan
    from ..planner.rings import nccl_ring_plan
    from ..plot import draw_plan
    from ..simulate import simulate

    size = parse_size(args.size)
    png = png_path(args.png)
    if args.algorithm == "ring" and args.collective not in ("allreduce", "allgather", "reducescatter"):
        raise BlinkError(f"--algorithm ring is an all-reduce algorithm (and an all-gather / reduce-scatter one), "
                         f"not for {args.collective!r}; use --collective allreduce")
    topo, devices, p = load_inputs(args)
    if args.algorithm == "blink" and args.plan is None:  # what auto runs at --size
        from ..planning import plan
        p = plan(topo, args.collective, devices=devices, root=p.root, nbytes=size)
    if args.algorithm == "ring":
        p = nccl_ring_plan(topo, args.collective, devices=devices, root=p.root)
    elif args.algorithm == "tree":
        if args.collective != "allreduce":
            raise BlinkError("--algorithm tree is NCCL's double binary tree, an all-reduce; "
                             "use --collective allreduce")
        p = nccl_tree_plan(topo, devices=devices)
    if not p.trees:
        raise BlinkError(f"plan over devices {devices} has no trees to draw (one device)")
    res = simulate(p, size, topology=topo)
    root = "" if p.root is None else f" root {p.root}"
    title = (f"{p.collective}{root} on {topo.name} GPUs {devices}: {p.shape()}, "
             f"planned {p.rate_gbps:.2f} GB/s, simulated algbw {res.algbw_gbps:.2f} GB/s at "
             f"{human_bytes(size)}")
    try:
        panels = draw_plan(topo, p, png, link_util=res.link_util, title=title)
    except OSError as err:
        raise BlinkError(f"cannot write --png {png!r}: {err.strerror or err}") from None
    print(f"wrote {png}: {panels} panels ({p.shape().split(', ')[1]}); {title}")
    return 0
