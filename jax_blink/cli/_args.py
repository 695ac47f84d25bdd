"""Argument parsing and input checks shared by the ``jax-blink`` subcommands.

One definition of the job options (``--topology``, ``--devices``, ``--collective``, ``--root``) so
``plan``, ``bench`` and ``show`` accept and reject the same input, plus the file reading and the
plan-vs-topology check every command that takes a ``--plan`` file needs.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from .. import collectives
from ..errors import BlinkError, PlanError
from ..planner.facade import COLLECTIVES
from ..topology import parse_gpu_ids

TOPOLOGY_HELP = ("preset name (dgx1v, dgx-a100, ...), nvidia-smi topo -m file, NCCL topology XML file, "
                 "JSON file, 'detect', or 'probe' (measure this job's devices)")
HOST_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
    """Ask XLA for ``n`` host CPU devices, unless ``XLA_FLAGS`` already sets a count.

    Only shapes the host (CPU) platform, so it is harmless on a GPU machine; it takes effect only
    when JAX has not started its backends yet (importing jax alone does not start them), so the
    commands that run JAX (``demo``, ``bench --measure``) call it first.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_FLAG}={int(n)}".strip()


def parse_devices(text: str | None, option: str = "--devices") -> list[int] | None:
    """GPU ids from ``"0,1,4"``, ``"0-3"`` or mixes like ``"0-2,5"`` (ranges include both ends).

    None stays None. Raises BlinkError (TopologyError) naming the bad item: an empty list or item
    (``"0,,1"``), a negative id, a non-integer, a range whose end is below its start, or a repeated
    id (:func:`jax_blink.topology.parse_gpu_ids`, which the Python API uses for strings too).
    """
    return None if text is None else parse_gpu_ids(text, option)


def devices_type(text: str) -> list[int]:
    """argparse ``type=`` for a device list (see :func:`parse_devices`)."""
    try:
        return parse_devices(text, option="value")  # argparse already names the option
    except BlinkError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_gbps(text: str) -> float:
    """argparse ``type=`` for a bandwidth in GB/s: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of GB/s > 0, got {text!r}")
    return v


def number_type(kind=float, *, low=None, high=None, low_open=False, high_open=False, what="a number"):
    """argparse ``type=``: an int or a finite float in [low, high] (an end excluded when ``*_open``),
    so nan, inf, negative counts and out-of-range fractions stop at parsing with the range named."""
    lo_b, hi_b = "(" if low_open else "[", ")" if high_open else "]"
    span = f"in {lo_b}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{hi_b}"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        ok = v is not None and math.isfinite(v)
        if ok and low is not None:
            ok = v > low if low_open else v >= low
        if ok and high is not None:
            ok = v < high if high_open else v <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what} {span}, got {text!r}")
        return v
    parse.__name__ = what  # argparse names the type in its own messages
    return parse


positive_int = number_type(int, low=1, what="an integer")


def value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings (of ``parser`` and its subcommands) that take exactly one value."""
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= value_options(sub)
        elif action.option_strings and action.nargs is None and not isinstance(action, (
                argparse._StoreConstAction, argparse._VersionAction, argparse._HelpAction)):
            out.update(action.option_strings)
    return out


def join_negative_values(argv: list[str], options) -> list[str]:
    """``["--size", "-1M"]`` -> ``["--size=-1M"]`` for the value options in ``options``: argparse
    takes "-1M" for an option and says only "expected one argument"; joined, the option's own check
    says what is wrong with the value."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in options and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


PROBE_HOST_DEVICES = 8  # host CPU devices the CLI asks XLA for when it probes (XLA_FLAGS unset)


def topology_source(text: str) -> str:
    """argparse ``type=`` for --topology: the text itself; for 'probe' it first asks XLA for
    :data:`PROBE_HOST_DEVICES` host CPU devices (as `jax-blink topology probe` does), so both
    read the probe cached for the same device set."""
    if text.strip().lower() == "probe":
        force_host_devices(PROBE_HOST_DEVICES)
    return text


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Register --topology (required), --devices, --collective and --root."""
    p.add_argument("--topology", required=True, type=topology_source, metavar="SOURCE", help=TOPOLOGY_HELP)
    p.add_argument("--devices", type=devices_type, default=None, metavar="IDS",
                   help="GPU ids of the job: 0,1,4 or ranges 0-3 or both, 0-2,5 (default: all)")
    p.add_argument("--collective", choices=COLLECTIVES, default="allreduce")
    p.add_argument("--root", type=int, default=None,
                   help="root GPU for broadcast/reduce (default: first device); not for allreduce, "
                        "allgather, reducescatter")


def check_root(args: argparse.Namespace) -> None:
    """Refuse ``--root`` with a collective that has no root (all-reduce, all-gather, reduce-scatter)
    instead of ignoring it."""
    if args.root is not None and not collectives.get(args.collective).rooted:
        raise BlinkError(f"--root {args.root} is for --collective broadcast or reduce; an {args.collective} "
                         f"has no root (leave out --root)")


def read_text(path: str, option: str, what: str) -> str:
    """The UTF-8 text of the file ``path`` given to ``option``; ``what`` names the expected content.

    Raises BlinkError (not OSError/UnicodeDecodeError) for a missing file, a directory, an
    unreadable file, or bytes that are not UTF-8 text.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise BlinkError(f"{option} {path!r} is a directory, not {what}") from None
    except OSError as err:
        raise BlinkError(f"cannot read {option} {path!r}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BlinkError(f"{option} {path!r} is not {what} (not UTF-8 text)") from None


def check_plan_fits_topology(p, topo, source: str, topology_source: str) -> None:
    """Every node and directed link the plan ``p`` sends over must exist in ``topo``.

    A plan names physical links (GPU -> switch -> GPU hops); one made for another machine fails
    here with the missing nodes and links named, instead of deep in routing or simulation.
    ``source``/``topology_source``: the --plan and --topology arguments, for the message.
    Raises PlanError.
    """
    try:
        topo.check_devices(p.devices)
    except BlinkError as err:
        raise PlanError(f"--plan {source!r} does not fit topology {topo.name!r}: {err}") from None
    links = list(p.link_loads())
    nodes = {n for e in links for n in e}
    missing_nodes = sorted((n for n in nodes if n not in topo.graph), key=str)
    missing_links = [(u, v) for u, v in links if u in topo.graph and v in topo.graph
                     and not topo.graph.has_edge(u, v)]
    if not (missing_nodes or missing_links):
        return
    parts = []
    if missing_nodes:
        parts.append(f"nodes {', '.join(map(str, missing_nodes[:8]))}"
                     + (f" (+{len(missing_nodes) - 8} more)" if len(missing_nodes) > 8 else ""))
    if missing_links:
        parts.append(f"links {', '.join(f'{u}->{v}' for u, v in missing_links[:8])}"
                     + (f" (+{len(missing_links) - 8} more)" if len(missing_links) > 8 else ""))
    raise PlanError(f"--plan {source!r} was made for another topology: its {' and '.join(parts)} are "
                    f"not in topology {topo.name!r}; re-plan with `jax-blink plan --topology "
                    f"{topology_source} --json`")
