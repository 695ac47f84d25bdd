"""NCCL topology XML parser: the real DGX-1V dump's link table (hand-counted), the variants seen in the
wild (NVSwitch targets, self targets, bare GPUs, a <cpu> excerpt), rates, errors, fuzzing, and that
every topology input (load_topology, JAX_BLINK_TOPOLOGY, the CLI) accepts it."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_blink
from jax_blink import Topology, TopologyError, load_topology
from jax_blink.cli import main
from jax_blink.topology.ncclxml import NVLINK_GBPS_BY_SM, nvlink_gbps_for_sm, parse_nccl_xml, pcie_link_gbps
from jax_blink.topology.nvsmi import parse_topo
from jax_blink.topology.presets import NVLINK_EFFICIENCY, nvlink_gbps, preset

V2 = nvlink_gbps(2)  # achieved GB/s per NVLink2 (V100, sm 70)

XML = "dgx1v_nccl_topo.xml"


def nvlink_table(t):
    """{(a, b): links} for GPU-GPU nvlink edges, a < b."""
    return {(u, v): c for u, v, _, k, c in t.links()
            if k == "nvlink" and isinstance(u, int) and isinstance(v, int) and u < v}


def undirected(t, kinds=("pcie", "host")):
    """{(a, b): GB/s} undirected edges of the given kinds, as sorted string pairs."""
    return {tuple(sorted((str(u), str(v)))): bw for u, v, bw, k, _ in t.links() if k in kinds}


@pytest.fixture()
def dgx1v_xml(topology_dir):
    return (topology_dir / XML).read_text()


# ----------------------------------------------------------------------------- the real file
def test_dgx1v_dump_link_table(dgx1v_xml):
    t = parse_nccl_xml(dgx1v_xml)
    # hand-counted from the file: each <gpu dev=i> lists its four <nvlink target=... count=...>;
    # bus ids 06 07 0a 0b 85 86 89 8a are GPUs 0..7
    want = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
            (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}
    assert nvlink_table(t) == want
    # the same cube-mesh as the preset and as the DGX-1V's nvidia-smi topo -m matrix
    assert want == nvlink_table(preset("dgx1v"))
    assert t.bandwidth(0, 3) == 2 * V2 and t.bandwidth(0, 1) == V2  # sm 70: 25 GB/s line rate per link
    # PCIe: 4 PLX switches (8 GT/s x16 = 12 GB/s), 2 per socket; on cpu0 one 1 GbE NIC (5 GT/s x8 PCIe,
    # 1000 Mb/s = 0.125 GB/s line rate, 0.12 achieved) and one virtual NIC (lxcbr0 + br-..., 2 x 10000
    # Mb/s = 2.5 GB/s line rate, 2.4 achieved)
    assert undirected(t) == {
        ("0", "pcie-switch-0"): 12.0, ("1", "pcie-switch-0"): 12.0, ("2", "pcie-switch-1"): 12.0,
        ("3", "pcie-switch-1"): 12.0, ("4", "pcie-switch-2"): 12.0, ("5", "pcie-switch-2"): 12.0,
        ("6", "pcie-switch-3"): 12.0, ("7", "pcie-switch-3"): 12.0,
        ("cpu0", "pcie-switch-0"): 12.0, ("cpu0", "pcie-switch-1"): 12.0,
        ("cpu1", "pcie-switch-2"): 12.0, ("cpu1", "pcie-switch-3"): 12.0,
        ("cpu0", "nic0"): 0.12, ("cpu0", "nic1"): 2.4, ("cpu0", "cpu1"): 20.0}
    assert t.graph.nodes["nic0"]["device"] == "enp1s0f0"
    assert t.graph.nodes["nic1"]["device"] == "lxcbr0,br-d774142ed332"
    assert t.graph.nodes["pcie-switch-1"]["bus"] == "0000:08:00.0"
    assert t.notes == []
    # without its dead-end NICs the dump is exactly the dgx1v preset
    assert t.subset(range(8)).fingerprint() == preset("dgx1v").fingerprint()


def test_dgx1v_dump_agrees_with_topo_m_matrix(dgx1v_xml, topology_dir):
    t = parse_nccl_xml(dgx1v_xml)
    m = parse_topo((topology_dir / "dgx1v_v100.txt").read_text())
    assert nvlink_table(t) == nvlink_table(m)


def test_dgx1v_dump_plans_like_the_preset(dgx1v_xml):
    t = parse_nccl_xml(dgx1v_xml)
    p = jax_blink.plan(t, "broadcast", root=0)
    # 6 NVLinks x 22.9 + the PCIe hop 12 leave GPU 0: the max-flow bound, reached
    assert p.rate_gbps == pytest.approx(6 * V2 + 12) and p.bound_gbps == pytest.approx(6 * V2 + 12)
    a = jax_blink.plan(t, "allreduce")
    assert a.rate_gbps == pytest.approx(jax_blink.plan(preset("dgx1v"), "allreduce").rate_gbps)


def test_option_overrides(dgx1v_xml):
    t = parse_nccl_xml(dgx1v_xml, nvlink_gbps=20.0, pcie_gbps=24.0, inter_socket_gbps=30.0)
    assert t.bandwidth(0, 3) == 40.0 and t.bandwidth(0, "pcie-switch-0") == 24.0
    assert t.bandwidth("cpu0", "cpu1") == 30.0
    assert t.bandwidth("nic0", "cpu0") == 0.12  # a NIC is still capped by its port speed (achieved)
    with pytest.raises(TopologyError, match=r"nvlink_gbps must be a finite number > 0.*got 0"):
        parse_nccl_xml(dgx1v_xml, nvlink_gbps=0)


# ----------------------------------------------------------------------------- rates
def test_pcie_rates():
    # GT/s x lanes x encoding / 8 x 0.762: 8b/10b up to 5 GT/s, 128b/130b from 8 GT/s
    assert pcie_link_gbps(8, 16) == pytest.approx(12.0)
    assert pcie_link_gbps(16, 16) == pytest.approx(24.0)
    assert pcie_link_gbps(32, 16) == pytest.approx(48.0)
    assert pcie_link_gbps(8, 16, efficiency=1.0) == pytest.approx(15.754, abs=1e-3)  # line rate
    assert pcie_link_gbps(2.5, 16, efficiency=1.0) == pytest.approx(4.0)
    assert pcie_link_gbps(5, 8, efficiency=1.0) == pytest.approx(4.0)
    # NCCL's own table (topo.cc kvDictPciGen, width * speed / 80 GB/s) agrees within 2%
    nccl = {2.5: 15, 5: 30, 8: 60, 16: 120, 32: 240, 64: 480}
    for gts, speed in nccl.items():
        for width in (1, 4, 8, 16):
            assert pcie_link_gbps(gts, width) == pytest.approx(width * speed / 80, rel=0.02)


def test_nvlink_rate_by_sm():
    assert [nvlink_gbps_for_sm(sm) for sm in (60, 61, 70, 75, 80, 86, 90, 100, 103)] == \
        [nvlink_gbps(g) for g in (1, 1, 2, 2, 3)] + [14.0625 * NVLINK_EFFICIENCY[3]] + \
        [nvlink_gbps(g) for g in (4, 5, 5)]  # line rates 20, 25, 25, 14.0625 (GA102), 25, 50
    assert nvlink_gbps_for_sm(52) is None
    assert [sm for sm, _ in NVLINK_GBPS_BY_SM] == sorted(sm for sm, _ in NVLINK_GBPS_BY_SM)


# ----------------------------------------------------------------------------- variants seen in the wild
def gpu_pci(bus, dev, sm, nvlinks="", speed="16.0 GT/s PCIe", width="16"):
    return (f'<pci busid="{bus}" class="0x030200" link_speed="{speed}" link_width="{width}">'
            f'<gpu dev="{dev}" sm="{sm}" rank="{dev}" gdr="1">{nvlinks}</gpu></pci>')


def nvl(target, count, tclass="0x030200"):
    return f'<nvlink target="{target}" count="{count}" tclass="{tclass}"/>'


def test_nvswitch_targets_make_one_nvswitch_node():
    # DGX A100 style: each GPU has 2 links to each of 6 NVSwitch chips (class 0x068000)
    switches = [f"0000:c{i}:00.0" for i in range(6)]
    links = "".join(nvl(s, 2, "0x068000") for s in switches)
    xml = ('<system version="1"><cpu numaid="0"><pci busid="0000:10:00.0" class="0x060400" '
           'link_speed="16.0 GT/s PCIe" link_width="16">'
           + gpu_pci("0000:11:00.0", 0, 80, links) + gpu_pci("0000:12:00.0", 1, 80, links)
           + '</pci></cpu></system>')
    t = parse_nccl_xml(xml)
    assert nvlink_table(t) == {}
    for g in (0, 1):
        d = t.graph.edges[g, "nvswitch"]
        assert (d["kind"], d["links"], d["bandwidth_gbps"]) == ("nvswitch", 12, pytest.approx(12 * nvlink_gbps(3)))
    assert t.bandwidth(0, "pcie-switch-0") == pytest.approx(24.0)  # gen4 x16
    assert t.kind("nvswitch") == "nvswitch"


def test_self_target_is_ignored_with_a_note():
    xml = ('<system><cpu numaid="0">'
           + gpu_pci("0000:06:00.0", 0, 70, nvl("0000:06:00.0", 1) + nvl("0000:07:00.0", 2))
           + gpu_pci("0000:07:00.0", 1, 70, nvl("0000:06:00.0", 2))
           + '</cpu></system>')
    t = parse_nccl_xml(xml)
    assert nvlink_table(t) == {(0, 1): 2}
    assert any("own bus id (GPU 0)" in n for n in t.notes)


def test_bare_pci_gpus_have_no_nvlink_and_a_note():
    # a VM's file: GPUs only as <pci class="0x030200">, no <gpu>, so no NVLink information
    xml = ('<system version="1"><cpu numaid="0">'
           '<pci busid="0000:21:00.0" class="0x030200" link_speed="16 GT/s" link_width="16"/>'
           '<pci busid="0000:01:00.0" class="0x030200" link_speed="16 GT/s" link_width="8"/>'
           '</cpu></system>')
    t = parse_nccl_xml(xml)
    assert t.gpus == [0, 1] and nvlink_table(t) == {}
    # numbered in bus id order: 0000:01 is GPU 0 (x8: 12 GB/s), 0000:21 is GPU 1 (x16: 24 GB/s)
    assert t.bandwidth(0, "cpu0") == pytest.approx(12.0) and t.bandwidth(1, "cpu0") == pytest.approx(24.0)
    assert any("2 GPU(s) are bare" in n and "no NVLink" in n for n in t.notes)
    assert any("PCI bus id order" in n for n in t.notes)


def test_cpu_root_excerpt():
    xml = ('<cpu numaid="1" arch="x86_64">'
           + gpu_pci("0000:85:00.0", 0, 90, nvl("0000:86:00.0", 4))
           + gpu_pci("0000:86:00.0", 1, 90, nvl("0000:85:00.0", 4))
           + '</cpu>')
    t = parse_nccl_xml(xml)
    assert set(t.switches) == {"cpu0"} and nvlink_table(t) == {(0, 1): 4}
    assert t.bandwidth(0, 1) == 4 * nvlink_gbps(4)  # sm 90: NVLink4
    assert any("root is <cpu>" in n for n in t.notes)


def test_gpu_ids_from_dev_else_bus_order():
    # dev numbers reversed relative to the bus order: ids follow dev (the CUDA device number)
    xml = ('<system><cpu numaid="0">' + gpu_pci("0000:06:00.0", 1, 70, nvl("0000:07:00.0", 1))
           + gpu_pci("0000:07:00.0", 0, 70, nvl("0000:06:00.0", 1)) + '</cpu>'
           '<cpu numaid="1">' + gpu_pci("0000:85:00.0", 2, 70) + '</cpu></system>')
    t = parse_nccl_xml(xml)
    assert t.notes == [] and t.graph.has_edge(2, "cpu1") and t.graph.has_edge(0, "cpu0")
    # every process saw its GPU as dev 0 (one GPU per process): fall back to the bus order, say so
    same = xml.replace('dev="1"', 'dev="0"').replace('dev="2"', 'dev="0"')
    t2 = parse_nccl_xml(same)
    assert t2.gpus == [0, 1, 2] and t2.graph.has_edge(2, "cpu1")
    assert any("values [0, 0, 0] are not 0..2" in n for n in t2.notes)


def test_nvlink_to_cpu_and_unknown_sm_and_missing_target():
    xml = ('<system><cpu numaid="0">'
           + gpu_pci("0000:04:00.0", 0, 70, nvl("0000:00:00.0", 3, "0x068001") + nvl("0000:99:00.0", 1))
           + '<pci busid="0000:05:00.0" class="0x030200" link_speed="8 GT/s" link_width="16">'
           '<gpu dev="1"><nvlink target="0000:04:00.0" count="1" tclass="0x030200"/></gpu></pci>'
           '<pci busid="0000:09:00.0" class="0x010802" link_speed="8 GT/s" link_width="4"/>'
           '</cpu></system>')
    t = parse_nccl_xml(xml)
    # POWER9 style: 3 NVLinks to the CPU, on top of the GPU's own gen3 x16 PCIe link to it
    assert t.graph.edges[0, "cpu0"]["kind"] == "nvlink" and t.bandwidth(0, "cpu0") == pytest.approx(3 * V2 + 24.0)
    assert t.graph.edges["cpu0", 0]["links"] == 4
    assert nvlink_table(t) == {(0, 1): 1} and t.bandwidth(0, 1) == V2
    assert any("no GPU of the file (GPU 0 -> 0000:99:00.0)" in n for n in t.notes)
    assert any(n.startswith("GPU 1: no NVLink GPU architecture") for n in t.notes)
    assert len(t.switches) == 1  # the NVMe drive (class 0x010802) is skipped


def test_missing_link_speed_assumes_gen3_x16_with_a_note():
    xml = ('<system><cpu numaid="0"><pci busid="0000:03:00.0" class="0x060400" link_speed="Unknown speed" '
           'link_width="0">' + gpu_pci("0000:06:00.0", 0, 70) + '</pci></cpu></system>')
    t = parse_nccl_xml(xml)
    assert t.bandwidth("pcie-switch-0", "cpu0") == 12.0 and t.bandwidth(0, "pcie-switch-0") == pytest.approx(24.0)
    assert any("1 PCIe link(s) without a usable link_speed" in n and "0000:03:00.0" in n for n in t.notes)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("text, pattern", [
    ("", r"empty input"),
    ("<system", r"not well-formed XML at line 1"),
    ("<foo/>", r"root element is <foo>; expected <system>"),
    ("<system/>", r"<system> has no <cpu>"),
    ('<system><cpu numaid="0"><pci busid="0000:03:00.0" class="0x060400"/></cpu></system>', r"has no GPUs"),
    ('<system><cpu><pci class="0x030200"/></cpu></system>', r"<pci> element has no busid"),
    ('<system><cpu><pci busid="zz:00.0" class="0x030200"/></cpu></system>', r"'zz:00.0' is not a PCI bus id"),
    ('<system><cpu><pci busid="0000:06:00.0" class="0x030200" link_width="x"/></cpu></system>',
     r"link_width='x' must be an integer from 0 to 32, got 'x'"),
    ('<system><cpu>' + gpu_pci("0000:06:00.0", 0, 70, nvl("0000:07:00.0", 0)) + '</cpu></system>',
     r"count='0' must be an integer from 1 to 64, got 0"),
    ('<system><cpu>' + gpu_pci("0000:06:00.0", 0, 70, nvl("0000:07:00.0", 1))
     + gpu_pci("0000:07:00.0", 1, 70, nvl("0000:06:00.0", 2)) + '</cpu></system>',
     r"asymmetric NVLink counts: GPU 0 \(bus 0000:06:00.0\) lists 1 link\(s\) to GPU 1"),
    ('<system><cpu>' + gpu_pci("0000:06:00.0", 0, 70) + gpu_pci("0000:06:00.0", 1, 70) + '</cpu></system>',
     r"GPU bus id 0000:06:00.0 appears more than once"),
    ('<!DOCTYPE x [<!ENTITY a "aaaa">]><system/>', r"<!DOCTYPE>/<!ENTITY> declaration"),
    ("<system>" + "<pci busid='0000:01:00.0'>" * 70, r"not well-formed"),
])
def test_bad_input_names_the_problem(text, pattern):
    with pytest.raises(TopologyError, match=pattern):
        parse_nccl_xml(text)


def test_deep_nesting_and_binary():
    deep = ('<system><cpu>' + '<pci busid="0000:01:00.0" class="0x060400">' * 70
            + '</pci>' * 70 + '</cpu></system>')
    with pytest.raises(TopologyError, match="nested more than 64 deep"):
        parse_nccl_xml(deep)
    with pytest.raises(TopologyError, match="binary data"):
        parse_nccl_xml("<system>\x00</system>")
    with pytest.raises(TopologyError, match="must be text"):
        parse_nccl_xml(None)


def _only_topology_errors(text):
    try:
        t = parse_nccl_xml(text)
    except TopologyError:
        return
    assert t.gpus == list(range(len(t.gpus)))
    assert Topology.from_json(t.to_json()) == t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_dump_raises_only_topology_error(topology_dir, data):
    text = (topology_dir / XML).read_text()
    toks = re.split(r'(["<>/= ])', text)
    for _ in range(data.draw(st.integers(1, 4))):
        k = data.draw(st.integers(0, len(toks) - 1))
        toks[k] = data.draw(st.sampled_from(
            ["", "<", ">", "/", '"', "pci", "gpu", "nvlink", "cpu", "nic", "net", "0x068000", "0x068001",
             "0x030200", "0x060400", "0000:06:00.0", "0000:0a:00.0", "-1", "0", "99999999999999999999",
             "1e9", "junk", "&amp;", "&bogus;", "count", "dev", "sm", "speed", "busid", "link_width"]))
    _only_topology_errors("".join(toks))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list('<>/="\' 0x3:.') + ["system", "cpu", "<pci ", "<gpu ", "<nvlink ",
                                                            "busid=", "class=", "count=", "target="]),
                max_size=80))
def test_garbage_raises_only_topology_error(parts):
    _only_topology_errors("".join(parts))


# ----------------------------------------------------------------------------- every input accepts it
def test_load_topology_and_json_round_trip(topology_dir, tmp_path):
    t = load_topology(topology_dir / XML)
    assert t.name == "dgx1v_nccl_topo" and nvlink_table(t) == nvlink_table(preset("dgx1v"))
    assert Topology.from_json(t.to_json()) == t
    assert load_topology(str(topology_dir / XML), pcie_gbps=24.0).bandwidth(0, "pcie-switch-0") == 24.0
    # the format comes from the content when the suffix says nothing
    other = tmp_path / "topo.dump"
    other.write_text((topology_dir / XML).read_text())
    assert load_topology(other).fingerprint() == t.fingerprint()
    # notes travel through JSON, not into the fingerprint
    bare = tmp_path / "vm.xml"
    bare.write_text('<system><cpu><pci busid="0000:01:00.0" class="0x030200"/></cpu></system>')
    v = load_topology(bare)
    assert v.notes and Topology.from_json(v.to_json()).notes == v.notes
    plain = Topology.from_json(v.to_json())
    plain.notes = []
    assert plain.fingerprint() == v.fingerprint()


def test_unsupported_format_lists_the_supported_ones(tmp_path):
    f = tmp_path / "cluster.cfg"
    f.write_text("hosts = a, b\nslots = 8\n")
    with pytest.raises(TopologyError) as exc:
        load_topology(f)
    msg = str(exc.value)
    assert "no supported format" in msg
    for fmt in ("preset name", "nvidia-smi topo -m", "NCCL's topology XML", "Topology.to_json"):
        assert fmt in msg
    bad = tmp_path / "bad.xml"
    bad.write_text("<system><cpu>")
    with pytest.raises(TopologyError, match=r"bad.xml: not well-formed XML"):
        load_topology(bad)


def test_env_variable_accepts_xml(topology_dir, monkeypatch, tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", str(topology_dir / XML))
    x = jnp.arange(8 * 5, dtype=jnp.float32).reshape(8, 5)
    y = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ppermute"), axis_name="i")(x)
    np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(np.asarray(x).sum(0), (8, 5)))
    other = tmp_path / "cluster.cfg"
    other.write_text("hosts = a, b\n")
    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", str(other))
    with pytest.raises(Exception, match="no supported format"):
        jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")(x + 1)


def test_cli_topology_plan_bench_show_accept_xml(capsys, topology_dir, tmp_path):
    f = str(topology_dir / XML)
    assert main(["topology", f]) == 0
    out = capsys.readouterr().out
    assert "dgx1v_nccl_topo: 8 GPUs" in out and "pcie-switch-3" in out and "nic1" in out
    assert main(["topology", f, "--json", "--nvlink-gbps", "20"]) == 0
    assert Topology.from_json(capsys.readouterr().out).bandwidth(0, 3) == 40.0
    assert main(["plan", "--topology", f, "--collective", "broadcast", "--root", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rate_gbps"] == pytest.approx(6 * V2 + 12)
    assert main(["bench", "--topology", f, "--sizes", "64M"]) == 0
    assert "blink" in capsys.readouterr().out
    png = tmp_path / "x.png"
    assert main(["show", "--topology", f, "--devices", "0-3", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    capsys.readouterr()
    vm = tmp_path / "vm.xml"
    vm.write_text('<system><cpu><pci busid="0000:01:00.0" class="0x030200"/>'
                  '<pci busid="0000:02:00.0" class="0x030200"/></cpu></system>')
    assert main(["topology", str(vm)]) == 0
    assert "note: 2 GPU(s) are bare" in capsys.readouterr().out
