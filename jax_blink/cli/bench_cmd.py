"""``jax-blink bench``: simulated time, algbw and busbw of blink vs NCCL's ring and double binary
tree per size (all-gather / reduce-scatter: vs NCCL's ring and the LP ring packing, sizes being the
full gathered buffer); ``--json`` prints the same as a JSON list, one object per size.

blink is ``algorithm="auto"`` at each size (:func:`jax_blink.costmodel.choose_plan`: the fastest
candidate by the simulator), or the ``--plan`` file's plan at every size. With ``--measure`` it also
runs the real collective on the local JAX devices, jax_blink and ``lax`` interleaved in one process
(:mod:`jax_blink.cli._measure`: nccl-tests' columns size, count, type, time, algbw, busbw, plus the
simulated time and the bound of the plan jax_blink lowered; ``--json`` then prints those rows).
Without GPUs it asks XLA for one host CPU device per topology GPU id first (unless ``XLA_FLAGS``
sets a count), as ``jax-blink demo`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from ..errors import BlinkError, PlanError
from ._args import (
    HOST_FLAG,
    add_job_arguments,
    check_plan_fits_topology,
    check_root,
    force_host_devices,
    number_type,
    parse_devices,
    positive_int,
    read_text,
)
from ._measure import DTYPES

__all__ = ["add_common", "human_bytes", "human_time", "load_inputs", "parse_devices", "parse_size",
           "parse_sizes", "run"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
MAX_SWEEP = 64
MEASURE_MAX_BYTES = 1 << 30
#: NCCL's ring and tree baselines are planned over all GPUs at once (their searches do not use
#: identical nodes): above this many GPUs a row would take minutes, so they are left out ("-").
BASELINE_MAX_GPUS = 128


def parse_size(text: str) -> int:
    """Bytes of one size: ``4096``, ``4K``, ``1M``, ``1.5G``, ``64KiB``, ``1T`` (K/M/G/T = KiB/MiB/GiB/TiB).

    Raises BlinkError on bad syntax or a size that is not a positive whole number of bytes.
    """
    if str(text).strip().startswith("-"):
        raise BlinkError(f"bad size {text!r}: sizes must be a positive whole number of bytes")
    m = _SIZE.match(str(text))
    if not m:
        raise BlinkError(f"bad size {text!r}: expected a number with an optional K/M/G/T suffix "
                         f"(KiB/MiB/GiB/TiB), e.g. 4K, 1M, 64M, 1G")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0 or value != int(value):
        raise BlinkError(f"bad size {text!r}: sizes must be a positive whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """Sizes in bytes from ``"1K..1G"`` (powers-of-two steps, both ends included) or ``"4K,1M,64M"``.

    Both forms mix: ``"1K..8K,1M"``. Raises BlinkError on bad syntax, zero/negative sizes, a range
    whose start exceeds its end, or more than MAX_SWEEP sizes.
    """
    if not isinstance(text, str) or not text.strip():
        raise BlinkError("empty --sizes: give e.g. 1K..1G or 4K,1M,64M")
    out: list[int] = []
    for part in text.split(","):
        if ".." in part:
            lo_s, _, hi_s = part.partition("..")
            lo, hi = parse_size(lo_s), parse_size(hi_s)
            if lo > hi:
                raise BlinkError(f"bad size range {part.strip()!r}: start {lo} B is larger than end {hi} B")
            s = lo
            while s <= hi:
                out.append(s)
                s *= 2
                if len(out) > MAX_SWEEP:
                    break
        else:
            out.append(parse_size(part))
        if len(out) > MAX_SWEEP:
            raise BlinkError(f"--sizes {text!r} gives more than {MAX_SWEEP} sizes")
    return sorted(set(out))


def human_bytes(n: float) -> str:
    """1024 -> '1K', 1.5 MiB -> '1.5M' (binary units, as --sizes takes them)."""
    for unit, k in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:g}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{int(n)}B"


def human_time(s: float) -> str:
    """Seconds in ns/us/ms/s (a bound of a few bytes on fast links is below 0.1 us)."""
    if s < 1e-6:
        return f"{s * 1e9:.1f} ns"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared by ``bench`` and ``show``: the job options of ``plan`` plus a plan file."""
    add_job_arguments(p)
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="use this plan (JSON from `jax-blink plan --json`) instead of planning")


def load_inputs(args):
    """(topology, devices, blink plan) from the common options; checks a --plan file against them.

    Raises BlinkError/PlanError for --root with an all-reduce, an unreadable or non-JSON plan
    file, and a plan for other devices, another collective or root, or another topology.
    """
    from ..planner.model import Plan
    from ..planning import plan
    from ..topology.load import load_topology

    check_root(args)
    topo = load_topology(args.topology)
    devices = args.devices
    if args.plan is None:
        p = plan(topo, args.collective, devices=devices, root=args.root)
        return topo, list(p.devices), p
    text = read_text(args.plan, "--plan", "a plan JSON file")
    try:
        p = Plan.from_json(text)
    except PlanError as err:
        raise PlanError(f"--plan {args.plan!r}: {err}") from None
    if devices is not None and list(p.devices) != devices:
        given = ",".join(map(str, devices))
        raise PlanError(f"--plan {args.plan!r} is for devices {list(p.devices)}, not the --devices "
                        f"{devices} given; re-plan with `jax-blink plan --devices {given}`")
    if p.collective != args.collective:
        raise PlanError(f"--plan {args.plan!r} is a {p.collective} plan, not {args.collective}")
    if args.root is not None and p.root != args.root:
        raise PlanError(f"--plan {args.plan!r} has root {p.root}, not --root {args.root}")
    check_plan_fits_topology(p, topo, args.plan, args.topology)
    return topo, list(p.devices), p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the bench options."""
    add_common(p)
    p.add_argument("--sizes", default="1K..1G",
                   help="bytes per GPU (allgather / reducescatter: the full buffer, n shards): a range in "
                        "powers of two (1K..1G) and/or a list (4K,1M,64M); K/M/G/T = KiB/MiB/GiB/TiB "
                        "(default 1K..1G)")
    p.add_argument("--latency-us", type=number_type(float, low=0), default=None,
                   help="per-send latency of the simulator in microseconds (default: simulate.DEFAULT_LATENCY_US)")
    p.add_argument("--measure", action="store_true",
                   help="also run the collective on the local JAX devices: jax_blink and lax interleaved in one "
                        "process, nccl-tests' columns plus the simulated time and bound of the lowered plan; "
                        "without GPUs, host CPU devices standing in for the GPU ids; with --json, the measured "
                        "rows as JSON")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed calls per size with --measure (default 5)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type with --measure (default float32)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list, one object per size: size (bytes per GPU), blink_plan, and "
                        "<name>_time_s, <name>_algbw_gbps, <name>_busbw_gbps for blink, ring, tree "
                        "(allgather / reducescatter: also lpring, the LP ring packing) (null where a "
                        "baseline does not exist); no tables")


def simulate_sweep(topo, blink_plan, sizes, *, latency_us=None, progress=True, fixed=False) -> list[dict]:
    """Simulate blink, NCCL's rings and (all-reduce) NCCL's double binary tree for every size.

    blink: ``algorithm="auto"`` for the size on ``blink_plan``'s devices and root
    (:func:`jax_blink.costmodel.choose_plan` at this latency), or ``blink_plan`` itself with
    ``fixed=True`` (a --plan file). ring / tree: :func:`jax_blink.planner.rings.nccl_ring_plan` /
    :func:`~jax_blink.planner.dbtree.nccl_tree_plan` (NVLink, else PCIe links); lpring (all-gather,
    reduce-scatter): :func:`~jax_blink.planner.rings.ring_plan`, the LP ring packing over every link.
    Returns rows {"size", "blink_plan", "blink", "ring", "tree", "lpring"} with SimResult values (None
    where the baseline does not exist: no ring through the GPUs, tree for other collectives than
    all-reduce, lpring for other collectives than all-gather / reduce-scatter, every baseline above
    BASELINE_MAX_GPUS GPUs). The simulator is ``simulate(method="auto")``: link-level, flow-level
    where that would take more than LINK_LEVEL_MAX_MESSAGES messages (about 1,000 GPUs).
    """
    from ..collectives import get as collective_row
    from ..costmodel import choose_plan
    from ..planner.dbtree import nccl_tree_plan
    from ..planner.rings import nccl_ring_plan, ring_plan
    from ..simulate import DEFAULT_LATENCY_US, simulate

    lat = DEFAULT_LATENCY_US if latency_us is None else latency_us
    devs = list(blink_plan.devices)
    coll = blink_plan.collective

    def baseline(make):
        if len(devs) > BASELINE_MAX_GPUS:
            return None
        try:
            return make()
        except PlanError:
            return None

    ring = baseline(lambda: nccl_ring_plan(topo, coll, devices=devs, root=blink_plan.root))
    tree = baseline(lambda: nccl_tree_plan(topo, devices=devs)) if coll == "allreduce" else None
    lpring = baseline(lambda: ring_plan(topo, coll, devices=devs)) if collective_row(coll).sharded else None
    rows = []
    for s in _progress(sizes, "simulating", progress):
        bp = blink_plan if fixed else choose_plan(topo, coll, s, devices=devs, root=blink_plan.root, latency_us=lat)
        plans = {"blink": bp, "ring": ring, "tree": tree, "lpring": lpring}
        sims = {name: None if p is None else simulate(p, s, topology=topo, latency_us=lat) for name, p in plans.items()}
        rows.append({"size": s, "blink_plan": bp, **sims})
    return rows


def _columns(collective: str) -> tuple:
    """The plans a bench row compares: blink, NCCL's ring, then NCCL's double binary tree ("tree")
    or, for all-gather / reduce-scatter, the LP ring packing ("lpring")."""
    from ..collectives import get as collective_row
    return ("blink", "ring", "lpring") if collective_row(collective).sharded else ("blink", "ring", "tree")


def json_rows(rows) -> list[dict]:
    """``bench --json`` objects: size (bytes per GPU), blink_plan (e.g. "ring, 1 ring") and, for blink,
    ring and tree, time in seconds and algbw / busbw in GB/s (None where the baseline is missing)."""
    out = []
    for r in rows:
        d = {"size": r["size"], "blink_plan": r["blink_plan"].shape()}
        names = ("blink", "ring", "tree") + (("lpring",) if "lpring" in _columns(r["blink_plan"].collective) else ())
        for name in names:
            res = r[name]
            d[f"{name}_time_s"] = None if res is None else res.time_s
            d[f"{name}_algbw_gbps"] = None if res is None else res.algbw_gbps
            d[f"{name}_busbw_gbps"] = None if res is None else res.busbw_gbps
        out.append(d)
    return out


def _progress(items, desc, enabled):
    if not enabled or len(items) < 4:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="size", file=sys.stderr, leave=False, disable=None)


def measure_devices(devices=None) -> list:
    """The local JAX devices ``--measure`` runs on: those with ids ``devices`` (default: all).

    Raises BlinkError, before anything is timed, when an id is not a local JAX device or fewer than
    2 devices would be used, saying how to get more host devices.
    """
    import jax

    local = {d.id: d for d in jax.local_devices()}
    ids = sorted(local) if devices is None else list(devices)
    hint = (f"JAX started with {len(local)} local device(s) before bench could ask for more; on CPU run "
            f"it in a fresh process or set XLA_FLAGS={HOST_FLAG}=<n>")
    missing = [i for i in ids if i not in local]
    if missing:
        raise BlinkError(f"--measure runs on local JAX devices; ids {missing} are not among "
                         f"{sorted(local)} ({hint})")
    if len(ids) < 2:
        raise BlinkError(f"--measure needs at least 2 local JAX devices ({hint})")
    return [local[i] for i in ids]


def measure_sweep(sizes, repeats: int, progress=True, topology=None, devices=None, collective: str = "allreduce",
                  dtype: str = "float32", root=None) -> list[dict]:
    """Time jax_blink's and lax's ``collective`` on local JAX devices, interleaved in one process
    (:func:`jax_blink.cli._measure.measure`: nccl-tests' columns plus the simulated time and bound of
    the plan jax_blink lowered).

    ``devices``: topology GPU ids to run on, taken as local JAX device ids (the default device map);
    default all local devices. ``topology``: what jax_blink plans on (default: its own choice);
    ``root``: broadcast / reduce root GPU id (default the first device). Raises BlinkError when
    fewer than 2 devices are used or a device id is not a local JAX device.
    """
    from ._measure import measure

    devs = measure_devices(devices)
    ids = [d.id for d in devs]
    root_rank = ids.index(root) if root is not None and root in ids else 0
    return measure(collective, sizes, devs, repeats=repeats, topology=topology, dtype=dtype, root_rank=root_rank,
                   progress=(lambda it: _progress(it, "measuring", True)) if progress else None)


def measured_table(rows, title: str):
    """The rich table of :func:`measure_sweep` rows (nccl-tests' columns for jax_blink and lax)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("size", "count", "type", "blink time", "algbw", "busbw", "lax time", "algbw", "busbw",
                "blink/lax", "plan (lowering)", "simulated", "bound", "equal"):
        t.add_column(col, justify="left" if col.startswith("plan") else "right")
    for r in rows:
        t.add_row(human_bytes(r["size"]), str(r["count"]), r["dtype"], human_time(r["blink_time_s"]),
                  f"{r['blink_algbw_gbps']:.3f}", f"{r['blink_busbw_gbps']:.3f}", human_time(r["lax_time_s"]),
                  f"{r['lax_algbw_gbps']:.3f}", f"{r['lax_busbw_gbps']:.3f}", f"{r['blink_over_lax']:.2f}x",
                  f"{r['plan']} ({r['lowering']})", "-" if r["sim_s"] is None else human_time(r["sim_s"]),
                  "-" if r["bound_s"] is None else human_time(r["bound_s"]), "yes" if r["equal"] else "NO")
    return t


def run(args: argparse.Namespace) -> int:
    """Print the simulated table (or --json) and, with --measure, a measured table."""
    from rich.console import Console
    from rich.table import Table

    sizes = parse_sizes(args.sizes)
    if args.repeats < 1:
        raise BlinkError(f"--repeats must be >= 1, got {args.repeats}")
    if args.latency_us is not None and not (args.latency_us >= 0 and math.isfinite(args.latency_us)):
        raise BlinkError(f"--latency-us must be >= 0, got {args.latency_us}")
    if args.measure and max(sizes) > MEASURE_MAX_BYTES:  # each device holds a few operands of this size
        raise BlinkError(f"--measure allocates the operand on every device: sizes up to "
                         f"{human_bytes(MEASURE_MAX_BYTES)} per GPU, got {human_bytes(max(sizes))} (--sizes "
                         f"{args.sizes}); the simulated sweep alone (no --measure) takes any size")
    if args.measure and args.plan is not None:
        raise BlinkError("--measure runs what jax_blink lowers (the plan its cost model chooses per size); "
                         "drop --plan")
    topo, devices, bp = load_inputs(args)
    if args.measure and len(devices) >= 2:
        # as `demo` does: on a machine without GPUs, one host CPU device per topology GPU id; then
        # check the devices before the simulated table, so a run that cannot measure fails first
        force_host_devices(max(devices) + 1)
        measure_devices(devices)
    if args.json:
        if args.measure:
            rows = measure_sweep(sizes, args.repeats, progress=False, topology=topo, devices=devices,
                                 collective=args.collective, dtype=args.dtype, root=bp.root) if len(devices) > 1 else []
            print(json.dumps(rows, indent=1))
            return 0
        rows = simulate_sweep(topo, bp, sizes, latency_us=args.latency_us, progress=False,
                              fixed=args.plan is not None) if len(devices) > 1 else []
        print(json.dumps(json_rows(rows), indent=1))
        return 0
    console = Console(file=sys.stdout, width=180)
    root = "" if bp.root is None else f" root {bp.root}"
    which = f"--plan {bp.shape()}" if args.plan else "auto (the fastest simulated candidate per size)"
    console.print(f"[bold]{bp.collective}{root}[/bold] on {topo.name} GPUs {devices}: blink = {which}")
    if len(devices) < 2:
        console.print("one device: nothing to communicate")
        return 0
    rows = simulate_sweep(topo, bp, sizes, latency_us=args.latency_us, fixed=args.plan is not None)
    model = "link-level event model" if all(v.messages for r in rows for v in r.values()
                                            if hasattr(v, "messages")) else "flow-level model at this scale"
    table = Table(title=f"simulated ({model}; busbw as nccl-tests)", title_justify="left")
    table.add_column("size", justify="right")
    table.add_column("blink plan", justify="left")
    names = _columns(bp.collective)
    label = {"lpring": "lp ring"}
    for name in names:
        for col in ("time", "algbw", "busbw"):
            table.add_column(f"{label.get(name, name)} {col}", justify="right")
    for name in names[1:]:
        table.add_column(f"{label.get(name, name)}/blink", justify="right")
    for r in rows:
        cells = [human_bytes(r["size"]), r["blink_plan"].shape()]
        for name in names:
            res = r[name]
            if res is None:
                cells += ["-", "-", "-"]
            else:
                cells += [human_time(res.time_s), f"{res.algbw_gbps:.2f}", f"{res.busbw_gbps:.2f}"]
        for name in names[1:]:
            cells.append("-" if r[name] is None else f"{r[name].time_s / r['blink'].time_s:.2f}x")
        table.add_row(*cells)
    console.print(table)
    if len(devices) > BASELINE_MAX_GPUS:
        console.print(f"NCCL baselines left out above {BASELINE_MAX_GPUS} GPUs (their planners search all GPUs "
                      f"at once)")
    from ..costmodel import process_phases
    for s in (sizes[0], sizes[-1]) if len(sizes) > 1 else sizes:
        phases = process_phases(topo, bp.collective, s, devices=devices)
        if phases is not None:  # several nodes: what a job with one process per node runs instead
            console.print(f"{human_bytes(s)}: {phases.describe()}")
    if "tree" in names:
        console.print("GB/s = 1e9 B/s; ring/blink, tree/blink: time ratios (> 1: blink faster); ring = NCCL's "
                      "rings, tree = NCCL's double binary tree (all-reduce), on NVLink, else PCIe links")
    else:
        console.print("GB/s = 1e9 B/s; size = the full buffer (n shards); ring/blink, lp ring/blink: time ratios "
                      "(> 1: blink faster); ring = NCCL's rings (NVLink, else PCIe links), lp ring = the best "
                      "ring packing over every link; busbw = algbw (n-1)/n")
    if args.measure:
        # The same topology and GPUs, run on the local JAX devices with those ids.
        mrows = measure_sweep(sizes, args.repeats, topology=topo, devices=devices, collective=args.collective,
                              dtype=args.dtype, root=bp.root)
        console.print(measured_table(mrows, f"measured on local JAX devices {list(devices)} planned on {topo.name} "
                                            f"({bp.collective}, {args.dtype}, jit(shard_map), median of "
                                            f"{args.repeats} interleaved calls each)"))
        console.print("nccl-tests columns: size (bytes per device; allgather / reducescatter: the full buffer), "
                      "count (elements), time, algbw = size / time, busbw = algbw x bus factor (GB/s); simulated "
                      "and bound: the link-level model of the plan jax_blink lowered (as `jax_blink.explain`)")
    return 0
