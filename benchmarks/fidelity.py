"""Simulator fidelity: simulated busbw against published measurements of real machines.

Every row of :data:`PUBLISHED` is one public nccl-tests / NCCL measurement: the machine, its topology
(a preset or a file in ``tests/data/topologies``), the GPUs, the collective and size, the measured
bus bandwidth and where it was posted. The simulated figure is ``jax_blink.simulate`` of the plan
NCCL runs there (its rings on the links NCCL uses, :func:`jax_blink.planner.rings.nccl_ring_plan`; one
row is Blink's three-path broadcast), busbw as nccl-tests computes it (all-reduce: algbw x 2(n-1)/n;
broadcast: algbw). Each row must be within :data:`TOLERANCE` (tests/test_fidelity.py).

Rows marked "calibrates" are the measurements a constant of the model was taken from (the NVLink
fractions in ``jax_blink.topology.presets.NVLINK_EFFICIENCY``, ``jax_blink.simulate.HOST_STAGING_GBPS``); the
others are independent checks of those constants on other machines, GPU counts or link kinds.

Run: python benchmarks/fidelity.py [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from jax_blink.planner.model import Plan, Tree
from jax_blink.planner.rings import nccl_ring_plan
from jax_blink.simulate import simulate
from jax_blink.topology.load import load_topology
from jax_blink.topology.presets import is_preset, preset

TOPOLOGY_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "topologies"
TOLERANCE = 0.25  # |simulated / published - 1| allowed
GIB = 2**30
BLINKPLUS = ("UCBerkeley-Spring2022-CS267-project/blinkplus, test_bandwidth/logs "
             "(NCCL 2.7.8, 1 GiB)")


@dataclasses.dataclass(frozen=True)
class Published:
    """One published measurement.

    Attributes: machine (words); topology (a preset name or a file in ``tests/data/topologies``);
    gpu (GPU model for a ``topo -m`` file, None otherwise); devices (GPUs, None: all); collective;
    nbytes (bytes per GPU simulated: the largest size of the run, capped at 1 GiB where the curve is
    flat); busbw_gbps (measured, GB/s); source (where it was posted); plan ("nccl-ring", or
    "three-paths": broadcast 0 -> 1 over the direct NVLink and via GPUs 2 and 3); use ("calibrates
    <constant>" or "check").
    """

    machine: str
    topology: str
    gpu: str | None
    devices: tuple | None
    collective: str
    nbytes: int
    busbw_gbps: float
    source: str
    plan: str = "nccl-ring"
    use: str = "check"


PUBLISHED = (
    Published("8x A100 PCIe, NVLink bridge pairs", "a100_pcie_nvlink_pairs.txt", "A100 PCIe", (0, 1),
              "allreduce", GIB, 208.0, "NVIDIA/nccl-tests#178 (all_reduce_perf -t 2: busbw 208 GB/s)",
              use="calibrates NVLINK_EFFICIENCY[3]"),
    Published("8x A100 PCIe, NVLink bridge pairs", "a100_pcie_nvlink_pairs.txt", "A100 PCIe", (0, 1, 2),
              "allreduce", GIB, 20.0, "NVIDIA/nccl-tests#178 (all_reduce_perf -t 3: busbw ~20 GB/s)"),
    Published("2x RTX 2080 Ti, one PCIe switch, no peer access", "two_gpus_pix_no_p2p.txt", "RTX 2080 Ti",
              (0, 1), "allreduce", GIB, 4.0,
              "Anthony-Hoo.github.io, posts/AutoDL_Multi-GPU_Interconnection_Test.md (busbw 4.0 GB/s)",
              use="calibrates HOST_STAGING_GBPS"),
    Published("8x A100 SXM4 80GB, NVSwitch (HPE Apollo 6500)", "dgx-a100", None, None, "allreduce", GIB,
              200.0, "NVIDIA/nccl-tests#149 (all_reduce_perf -g 1 -t 8: busbw ~200 GB/s)"),
    Published("8x H100 SXM, NVSwitch, NCCL_ALGO=RING", "dgx-h100", None, None, "allreduce", GIB, 370.0,
              "NVIDIA/nccl-tests#212 (NCCL maintainer: 450 GB/s line rate, ~370 GB/s busbw "
              "with NCCL_ALGO=RING)", use="calibrates NVLINK_EFFICIENCY[4]"),
    Published("DGX-1V, one NVLink (GPU 0 -> 1)", "dgx1v", None, (0, 1), "broadcast", GIB, 22.90, BLINKPLUS,
              use="calibrates NVLINK_EFFICIENCY[2]"),
    Published("DGX-1V, two NVLinks (GPU 0 -> 3)", "dgx1v", None, (0, 3), "broadcast", GIB, 45.77, BLINKPLUS),
    Published("DGX-1V, NCCL topology XML, one NVLink (0 -> 1)", "dgx1v_nccl_topo.xml", None, (0, 1),
              "broadcast", GIB, 22.90, BLINKPLUS),
    Published("DGX-1V, 0 -> 1 direct + via 2 + via 3", "dgx1v", None, (0, 1), "broadcast", GIB, 66.63,
              BLINKPLUS, plan="three-paths"),
)


def topology_of(row: Published):
    """The row's Topology: the preset, or the file parsed with the row's GPU model."""
    if is_preset(row.topology):
        return preset(row.topology)
    kw = {"gpu": row.gpu} if row.gpu else {}
    return load_topology(str(TOPOLOGY_DIR / row.topology), **kw)


def plan_of(row: Published, topo):
    """The plan the measured run used (NCCL's rings, or the three-path broadcast)."""
    if row.plan == "three-paths":
        w = topo.bandwidth(0, 1)
        trees = (Tree(0, w, ((0, 1),)), Tree(0, w, ((0, 2), (2, 1))), Tree(0, w, ((0, 3), (3, 1))))
        return Plan("broadcast", 0, (0, 1), trees, 3 * w, 3 * w, "trees")
    root = None if row.collective == "allreduce" else row.devices[0]
    return nccl_ring_plan(topo, row.collective, devices=row.devices, root=root)


def table(rows=PUBLISHED) -> list[dict]:
    """One dict per row: the row's fields plus gpus, simulated_gbps and ratio (simulated / published)."""
    out = []
    for row in rows:
        topo = topology_of(row)
        sim = simulate(plan_of(row, topo), row.nbytes, topology=topo)
        out.append(dataclasses.asdict(row) | {"gpus": sim.nranks, "simulated_gbps": sim.busbw_gbps,
                                              "ratio": sim.busbw_gbps / row.busbw_gbps})
    return out


def main(argv=None) -> int:
    """Print the table (rich) or, with --json, the rows as JSON. Returns 1 when a row is off by more
    than TOLERANCE."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = table()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        from rich.console import Console
        from rich.table import Table
        t = Table(title=f"simulated vs published busbw (GB/s), tolerance +-{TOLERANCE:.0%}", title_justify="left")
        for col in ("machine", "topology", "GPUs", "collective", "size", "simulated", "published", "ratio",
                    "use", "source"):
            t.add_column(col, justify="right" if col in ("GPUs", "simulated", "published", "ratio") else "left")
        for r in rows:
            t.add_row(r["machine"], r["topology"], str(r["gpus"]), r["collective"], f"{r['nbytes'] / GIB:g} GiB",
                      f"{r['simulated_gbps']:.1f}", f"{r['busbw_gbps']:.1f}", f"{r['ratio']:.2f}", r["use"],
                      r["source"])
        Console(width=250).print(t)
    bad = [r for r in rows if abs(r["ratio"] - 1) > TOLERANCE]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
