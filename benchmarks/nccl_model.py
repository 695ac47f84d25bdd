"""NCCL's tuner model (jax_blink.nccl_model) against published nccl-tests figures.

Each row: a machine (a preset of jax_blink), a collective and size, a published figure (nccl-tests'
busbw in GB/s, or time per call in us) with its source, and the model's figure for the same call:
bus bandwidth at the largest size nccl-tests reports, or the back-to-back time (``steady_us``) for
small messages (nccl-tests issues its calls back to back). ``TOLERANCE`` is the agreement asked of
every modelled row. Rows the tuner does not model (the symmetric-memory kernels NCCL runs on
registered buffers, which XLA's NCCL calls do not use) are printed with ``modelled=False`` and
their reason; the test checks that only those are exempt.

Run: ``python benchmarks/nccl_model.py`` (a table; ``--json`` for JSON). Pure Python, under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jax_blink import nccl_model
from jax_blink.topology.presets import preset

TOLERANCE = 0.25
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Figure:
    """One published figure: ``machine`` (a jax_blink preset), ``devices`` (None: all its GPUs),
    ``collective``, ``nbytes``, ``unit`` ("busbw GB/s" or "us"), ``value``, ``source``, ``algorithms``
    (None: NCCL's own choice, else what ``NCCL_ALGO`` forced), ``modelled`` (False: the tuner does not
    describe what ran; ``why`` says what did)."""

    label: str
    machine: str
    devices: tuple | None
    collective: str
    nbytes: int
    unit: str
    value: float
    source: str
    algorithms: tuple | None = None
    modelled: bool = True
    why: str = ""


PUBLISHED = (
    Figure("DGX H100, 8 GPUs, all-reduce, NVLS", "dgx-h100", None, "allreduce", 8 * GIB, "busbw GB/s", 480.0,
           "NVIDIA/nccl-tests#212 (an NCCL maintainer: 'On 8 GPUs, you should reach a peak busBw of "
           "~480GB/s' with NVLink SHARP); NVIDIA/nccl#1374 (GTC S62129: 480 GB/s)"),
    Figure("DGX H100, 8 GPUs, all-reduce, NCCL_ALGO=Ring", "dgx-h100", None, "allreduce", 8 * GIB, "busbw GB/s",
           370.0, "NVIDIA/nccl-tests#212 ('an effective NVLink bandwidth of 370GB/s ... when running "
           "with NCCL_ALGO=RING')", algorithms=("ring",)),
    Figure("8x A100 SXM4 (NVSwitch), all-reduce", "dgx-a100", None, "allreduce", GIB, "busbw GB/s", 200.0,
           "NVIDIA/nccl-tests#149 (8x A100-SXM4-80GB, all_reduce_perf to 1 GiB: 'a busbw of ~200 GB/s')"),
    Figure("DGX A100, 8 GPUs, all-reduce", "dgx-a100", None, "allreduce", 8 * GIB, "busbw GB/s", 231.0,
           "public nccl-tests runs on DGX A100 (quoted as ~231 GB/s in the project's design notes)"),
    Figure("4 H800 on NVLink, 1 KiB all-reduce, NCCL_ALGO=Ring", "dgx-h100", (0, 1, 2, 3), "allreduce", 1024, "us",
           3.5, "NVIDIA/nccl#1984 (all_reduce_perf -b 1024 on 4 H800, without CUDA graphs: 3.5 us)",
           algorithms=("ring",)),
    Figure("8 PCIe gen3 GPUs, 4 KiB all-reduce", "pcie-2socket", None, "allreduce", 4096, "us", 19.0,
           "public reports of NCCL on 8 PCIe GPUs against one-shot custom all-reduce kernels (~19 us "
           "NCCL, ~4 us one-shot; the project's design notes)"),
    Figure("DGX H100, 8 GPUs, small all-reduce, NVLS one-shot", "dgx-h100", None, "allreduce", 1024, "us", 3.5,
           "public reports of NVLink SHARP multimem one-shot all-reduce (the project's design notes)",
           modelled=False,
           why="NCCL runs one-shot multimem kernels only on symmetric (registered) buffers (src/sym_kernels.cc, "
               "NCCL >= 2.27); tuning.cc's NVLS latency is 25 us and XLA's NCCL calls do not register windows"),
)


def model_value(f: Figure) -> tuple[float, nccl_model.Choice]:
    """The model's figure for ``f`` (busbw GB/s, or back-to-back us) and the Choice it comes from."""
    topo = preset(f.machine)
    ch = nccl_model.predict(topo, f.collective, f.nbytes, devices=f.devices, algorithms=f.algorithms)
    return (ch.busbw_gbps if f.unit.startswith("busbw") else ch.steady_us), ch


def table() -> list[dict]:
    """One dict per :data:`PUBLISHED` figure: label, unit, published, model, ratio (model / published),
    within (|ratio - 1| <= TOLERANCE), modelled, why, choice (algorithm/protocol), source."""
    rows = []
    for f in PUBLISHED:
        v, ch = model_value(f)
        rows.append({"label": f.label, "unit": f.unit, "published": f.value, "model": v, "ratio": v / f.value,
                     "within": abs(v / f.value - 1) <= TOLERANCE, "modelled": f.modelled, "why": f.why,
                     "choice": f"{ch.algorithm}/{ch.protocol}", "tuner_us": ch.time_us, "source": f.source})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    rows = table()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'figure':52} {'unit':>10} {'published':>9} {'model':>8} {'ratio':>6}  {'NCCL runs':14} check")
    for r in rows:
        check = ("ok" if r["within"] else "OUTSIDE") if r["modelled"] else "not modelled"
        print(f"{r['label']:52} {r['unit']:>10} {r['published']:9.1f} {r['model']:8.1f} {r['ratio']:6.2f}  "
              f"{r['choice']:14} {check}")
    print(f"\ntolerance +-{TOLERANCE:.0%}; small-message model figures are back-to-back times (without "
          "NCCL's baseLatencies)")
    for i, r in enumerate(rows, 1):
        print(f"[{i}] {r['source']}" + (f"\n    not modelled: {r['why']}" if not r["modelled"] else ""))
    return 0 if all(r["within"] for r in rows if r["modelled"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
