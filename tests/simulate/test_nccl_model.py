"""NCCL's tuner model (jax_blink.nccl_model): published nccl-tests figures (benchmarks/nccl_model.py)
within +-25%, and the tuner's rules checked by hand on small systems (tables of src/graph/tuning.cc)."""

import importlib.util
import math
import pathlib
import sys

import pytest

from jax_blink import nccl_model as m
from jax_blink.topology import Topology

_spec = importlib.util.spec_from_file_location(
    "nccl_model_bench", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "nccl_model.py")
bench = sys.modules.setdefault("nccl_model_bench", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def rows():
    return bench.table()


@pytest.mark.parametrize("i", range(len(bench.PUBLISHED)))
def test_published_figure_within_tolerance(rows, i):
    r = rows[i]
    assert r["source"] and r["published"] == bench.PUBLISHED[i].value
    if not r["modelled"]:
        assert r["why"]
        return
    assert abs(r["ratio"] - 1) <= bench.TOLERANCE, (r["label"], r["model"], r["published"])


def test_only_the_symmetric_kernel_row_is_exempt(rows):
    assert [r["label"] for r in rows if not r["modelled"]] == ["DGX H100, 8 GPUs, small all-reduce, NVLS one-shot"]
    assert sum(r["modelled"] for r in rows) >= 6


def test_nvls_only_on_hopper_nvswitch():
    assert m.system(Topology.preset("dgx-h100")).nvls is not None
    assert m.system(Topology.preset("dgx-a100")).nvls is None  # Ampere: no NVLS
    assert m.system(Topology.preset("dgx1v")).nvls is None  # no NVSwitch
    big = m.predict(Topology.preset("dgx-h100"), "allreduce", 1 << 30)
    assert (big.algorithm, big.protocol) == ("nvls", "Simple")


def test_ring_ll_latency_by_hand():
    """8 GPUs on one NVSwitch node, ring LL all-reduce: baseLatencies 6.6 + 2 (n - 1) x hwLatencies[NVLINK]
    0.6 = 15.0 us; back to back 8.4 us. PCIe: 6.6 + 14 x 1.0."""
    s = m.system(Topology.preset("dgx-h100"))
    assert m.algo_time_us(s, "allreduce", "ring", "LL", 0) == pytest.approx(6.6 + 14 * 0.6)
    assert m.algo_time_us(s, "allreduce", "ring", "LL", 0, steady=True) == pytest.approx(14 * 0.6)
    p = m.system(Topology.preset("pcie-2socket"))
    assert m.algo_time_us(p, "allreduce", "ring", "LL", 0) == pytest.approx(6.6 + 14 * 1.0)
    assert m.algo_time_us(p, "allreduce", "ring", "LL128", 0) is None  # LL128 off over PCIe


def test_nvls_bandwidth_by_hand():
    """NVLS graph on DGX H100: 8 channels at 40 GB/s (9 x 40 <= 370 per GPU); busBw = 8 x 40 x
    nvlsEfficiency 0.85 x 7/8 x 2 = 476 GB/s, algbw = busBw x 8 / 14."""
    s = m.system(Topology.preset("dgx-h100"))
    assert (s.nvls.channels, s.nvls.bw_intra) == (8, 40.0)
    lat, bw = m._cached_tables(s)[("allreduce", "nvls", "Simple")]
    assert lat == 25
    assert bw == pytest.approx(8 * 40 * 0.85 * 7 / 8 * 2 * 8 / 14)


def test_pat_only_one_gpu_per_node():
    one = m.System(4, 4, "hopper", m.Graph(8, 12.0, 12.0, True))
    assert m.algo_time_us(one, "allgather", "pat", "Simple", 1 << 20) is not None
    assert m.algo_time_us(one, "allreduce", "pat", "Simple", 1 << 20) is None
    several = m.System(8, 2, "hopper", m.Graph(8, 12.0, 12.0, True))
    assert m.algo_time_us(several, "allgather", "pat", "Simple", 1 << 20) is None
    # PAT latency: 8 + log2(4) x 14 / 3.5 + 4 x 2.8
    assert m._cached_tables(one)[("allgather", "pat", "Simple")][0] == pytest.approx(8 + 2 * 14 / 3.5 + 4 * 2.8)


def test_choice_is_the_least_time():
    s = m.system(Topology.preset("dgx-a100"))
    for size in (8, 1 << 16, 1 << 24, 1 << 30):
        ch = m.choose(s, "allreduce", size)
        others = [m.algo_time_us(s, "allreduce", a, p, size) for a in m.ALGORITHMS for p in m.PROTOCOLS]
        assert ch.time_us == min(t for t in others if t is not None)


def test_host_topology_has_no_nccl_and_errors_are_clear():
    assert m.predict(Topology.host(8), "allreduce", 1024) is None
    s = m.system(Topology.preset("dgx-h100"))
    with pytest.raises(ValueError, match="collective must be"):
        m.choose(s, "alltoall", 8)
    with pytest.raises(ValueError, match="unknown algorithm"):
        m.choose(s, "allreduce", 8, algorithms=["mesh"])
    with pytest.raises(ValueError, match="nbytes"):
        m.choose(s, "allreduce", -1)
    assert math.isfinite(m.choose(s, "broadcast", 1 << 20).time_us)
