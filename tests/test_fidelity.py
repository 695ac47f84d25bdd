"""Simulator fidelity: published measurements (benchmarks/fidelity.py), host staging without peer
access (hand-computed), achieved link rates from GPU models and from NCCL XML link_speed/link_width."""

import importlib.util
import pathlib
import sys

import pytest

from jax_blink import Topology
from jax_blink.errors import PlanError
from jax_blink.planner.model import Plan, Tree
from jax_blink.simulate import HOST_STAGING_GBPS, PROTOCOL_LATENCY_US, simulate
from jax_blink.topology.ncclxml import parse_nccl_xml
from jax_blink.topology.nvsmi import parse_topo
from jax_blink.topology.presets import NVLINK_EFFICIENCY, gpu_model, nvlink_gbps, pcie_gen_gbps, pcie_link_gbps

_spec = importlib.util.spec_from_file_location(
    "fidelity", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity.py")
fidelity = sys.modules.setdefault("fidelity", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fidelity)


@pytest.fixture(scope="module")
def rows():
    return fidelity.table()


@pytest.mark.parametrize("i", range(len(fidelity.PUBLISHED)))
def test_published_row_within_tolerance(rows, i):
    r = rows[i]
    assert r["busbw_gbps"] == fidelity.PUBLISHED[i].busbw_gbps and r["source"]
    assert abs(r["ratio"] - 1) <= fidelity.TOLERANCE, (r["machine"], r["simulated_gbps"], r["busbw_gbps"])


def test_table_covers_link_kinds(rows):
    """At least 6 rows, over direct NVLink, NVSwitch, PCIe and host-staged PCIe, from presets, topo -m
    files and NCCL XML."""
    assert len(rows) >= 6
    assert {r["topology"].rsplit(".", 1)[-1] for r in rows} >= {"txt", "xml", "dgx1v", "dgx-a100", "dgx-h100"}
    assert fidelity.main(["--json"]) == 0


# ----------------------------------------------------------------------------- host staging
S = 96 * 2**20
B = 12.0  # GB/s, each GPU's PCIe link to the CPU


def _pair(no_p2p: bool) -> Topology:
    t = Topology("pair")
    t.add_switch("cpu0", "cpu")
    for g in (0, 1):
        t.add_gpu(g, **({"no_p2p": (1 - g,)} if no_p2p else {}))
        t.add_link(g, "cpu0", B, "pcie")
    return t


def _bcast():
    return Plan("broadcast", 0, (0, 1), (Tree(0, B, ((0, "cpu0"), ("cpu0", 1))),), B, B, "trees")


def test_no_p2p_send_is_two_host_copies():
    a = 2e-6  # per-send latency
    p = PROTOCOL_LATENCY_US["pcie"] * 1e-6
    direct = simulate(_bcast(), S, topology=_pair(False), latency_us=2.0, chunk_bytes=S)
    staged = simulate(_bcast(), S, topology=_pair(True), latency_us=2.0, chunk_bytes=S)
    # peer access: one send, store-and-forward through the root complex
    assert direct.time_s == pytest.approx(2 * S / (B * 1e9) + a + p, rel=1e-12)
    # no peer access: GPU 0 -> host memory (its link, then the staging queue), then host memory -> GPU 1
    # (the staging queue, then GPU 1's link); each copy is a send of its own
    want = 2 * S / (B * 1e9) + 2 * S / (HOST_STAGING_GBPS * 1e9) + 2 * (a + p)
    assert staged.time_s == pytest.approx(want, rel=1e-12)
    assert staged.messages == 2 and direct.messages == 1
    assert staged.link_bytes == {(0, "cpu0"): S, ("cpu0", 1): S}  # the staging queue is not a link


def test_no_p2p_allreduce_is_bound_by_the_staging_path():
    # 2 GPUs: 2S bytes of sends, each written to and read from host memory: 4S through the staging path
    r = simulate(_ring2(), 2**30, topology=_pair(True))
    assert r.busbw_gbps == pytest.approx(HOST_STAGING_GBPS / 4, rel=0.02)
    fast = simulate(_ring2(), 2**30, topology=_pair(False))
    assert fast.busbw_gbps == pytest.approx(B, rel=0.02)  # with peer access the PCIe links bound it


def _ring2():
    from jax_blink.planner.rings import ring_plan
    return ring_plan(_pair(False), "allreduce")


def test_no_p2p_from_topo_p2p_survives_json(topology_dir):
    t = parse_topo((topology_dir / "two_gpus_pix_no_p2p.txt").read_text(), gpu="RTX 2080 Ti")
    assert {g: t.graph.nodes[g].get("no_p2p") for g in t.gpus} == {0: (1,), 1: (0,)}
    back = Topology.from_json(t.to_json())
    assert back == t and back.graph.nodes[0]["no_p2p"] == (1,)
    assert t.bandwidth(0, "cpu0") == 12.0  # RTX 2080 Ti: PCIe gen3 x16


def test_staged_route_without_a_cpu_is_an_error():
    t = Topology("nvl")
    t.add_gpu(0, no_p2p=(1,))
    t.add_gpu(1, no_p2p=(0,))
    t.add_link(0, 1, 25.0, "nvlink")
    p = Plan("broadcast", 0, (0, 1), (Tree(0, 25.0, ((0, 1),)),), 25.0, 25.0, "trees")
    with pytest.raises(PlanError, match="no peer access.*passes no CPU node"):
        simulate(p, 1024, topology=t)


# ----------------------------------------------------------------------------- achieved rates
def _xml(speed: str, width: int) -> str:
    gpu = (f'<pci busid="0000:11:00.0" class="0x030200" link_speed="{speed}" link_width="{width}">'
           '<gpu dev="0" sm="80" rank="0" gdr="1"/></pci>')
    return ('<system version="1"><cpu numaid="0"><pci busid="0000:10:00.0" class="0x060400" '
            f'link_speed="{speed}" link_width="{width}">' + gpu + '</pci></cpu></system>')


@pytest.mark.parametrize("speed,width,gbps", [
    ("8 GT/s", 16, 12.0),            # gen3 x16: 15.75 line rate x 0.762
    ("16.0 GT/s PCIe", 16, 24.0),    # gen4 x16 (A100)
    ("16.0 GT/s PCIe", 8, 12.0),     # gen4 x8
    ("32.0 GT/s PCIe", 16, 48.0),    # gen5 x16 (H100)
    ("5 GT/s", 8, 4.0 * 12.0 / (8 * 16 * 128 / 130 / 8)),  # gen2 x8: 8b/10b, 4.0 GB/s line rate
])
def test_pcie_rate_from_nccl_xml(speed, width, gbps):
    t = parse_nccl_xml(_xml(speed, width))
    assert t.bandwidth(0, "pcie-switch-0") == pytest.approx(gbps, rel=1e-9)
    assert t.bandwidth("pcie-switch-0", "cpu0") == pytest.approx(gbps, rel=1e-9)


def test_rates_are_line_rate_times_achieved_fraction():
    assert nvlink_gbps(2) == pytest.approx(22.90)   # V100: blinkplus broadcast over one NVLink
    assert 12 * nvlink_gbps(3) == pytest.approx(208.0)  # A100: NVIDIA/nccl-tests#178
    assert 18 * nvlink_gbps(4) == pytest.approx(370.0)  # H100: NVIDIA/nccl-tests#212
    assert all(0.5 < f < 1 for f in NVLINK_EFFICIENCY.values())
    assert pcie_link_gbps(16, 16, efficiency=1.0) == pytest.approx(31.508, abs=1e-3)  # gen4 x16 line rate
    assert pcie_gen_gbps(4) == pytest.approx(24.0) and pcie_gen_gbps(3, 8) == pytest.approx(6.0)


def test_gpu_model_sets_pcie_and_nvlink(topology_dir):
    assert gpu_model("NVIDIA A100 80GB PCIe") == (3, 4, 16) and gpu_model("NVIDIA A10") == (None, 4, 16)
    assert gpu_model("Tesla V100-SXM2-32GB") == (2, 3, 16) and gpu_model("nope") is None
    text = (topology_dir / "a100_pcie_nvlink_pairs.txt").read_text()
    inferred = parse_topo(text)  # NV12 pairs: NVLink3, so an A100 on PCIe gen4
    assert inferred.bandwidth(0, 1) == pytest.approx(208.0) and inferred.bandwidth(0, "cpu0") == 24.0
    assert any("NVLink generation 3 inferred" in n for n in inferred.notes)
    named = parse_topo(text, gpu="A100 PCIe")
    assert named.fingerprint() == inferred.fingerprint() and named.notes == []
    assert parse_topo(text, gpu="A100 PCIe", pcie_gbps=20.0).bandwidth(0, "cpu0") == 20.0  # given: as is
    h100 = parse_topo((topology_dir / "h100_sxm_nvswitch.txt").read_text())
    assert h100.bandwidth(0, "nvswitch") == pytest.approx(370.0)
    assert h100.bandwidth(0, next(v for v in h100.graph.successors(0) if v != "nvswitch")) == 48.0
