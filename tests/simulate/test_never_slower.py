"""Never slower than XLA by the model (benchmarks/never_slower.py) on a subset: two machines (NVSwitch
with NVLS; PCIe), all five collectives, small / mid / large sizes: auto's time <= NCCL's modelled
choice and <= every candidate plan's schedule as the executor runs it; XLA takes the large all-reduces on
DGX H100 (NVLS) and jax_blink keeps some cells (it is not always XLA)."""

import importlib.util
import pathlib
import sys

import pytest

_spec = importlib.util.spec_from_file_location(
    "never_slower_bench", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "never_slower.py")
bench = sys.modules.setdefault("never_slower_bench", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench)

from jax_blink.topology import Topology  # noqa: E402


@pytest.mark.parametrize("machine", ["dgx-h100", "pcie-2socket"])
def test_auto_never_slower_subset(machine):
    topo = Topology.preset(machine)
    sizes = (4096, 1 << 20, 256 << 20) if machine == "dgx-h100" else (4096, 256 << 20)
    rows = [bench.row(topo, c, s) for c in bench.COLLECTIVES for s in sizes]
    bad = [(r["collective"], r["size"], r["auto_s"], r["nccl_s"], r["plans_s"]) for r in rows if not r["ok"]]
    assert not bad
    assert any(r["auto"] == "ffi" for r in rows)
    if machine == "dgx-h100":
        big = next(r for r in rows if r["collective"] == "allreduce" and r["size"] == 256 << 20)
        assert big["auto"] == "xla" and "nvls" in big["nccl"]
