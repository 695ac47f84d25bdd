"""Topology model: presets (hand-counted tables), multi_node, subset, fingerprint, JSON, discovery, CLI."""

import json

import pytest

import jax_blink
from jax_blink import PRESETS, Topology, TopologyError, multi_node
from jax_blink.cli import main
from jax_blink.topology.load import load_topology
from jax_blink.topology.nvml import detect, from_nvml
from jax_blink.topology.presets import DGX1_DOUBLE, DGX1_SINGLE, EDR_IB_GBPS, nvlink_gbps, preset

V2, V3, V4 = nvlink_gbps(2), nvlink_gbps(3), nvlink_gbps(4)  # achieved GB/s per NVLink (V100/A100/H100)


def nvlink_counts(t, kind="nvlink"):
    """GPU -> total links of ``kind`` leaving it."""
    return {g: sum(d["links"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == kind) for g in t.gpus}


def out_gbps(t, g, kind):
    return sum(d["bandwidth_gbps"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == kind)


# ----------------------------------------------------------------------------- presets
def test_every_preset_builds_round_trips_and_is_named():
    for name, make in PRESETS.items():
        t = make()
        assert t.name == name
        assert Topology.from_json(t.to_json()) == t
        assert Topology.preset(name).fingerprint() == t.fingerprint()
        for u, v, bw, _kind, links in t.links():  # links are symmetric in every preset
            assert t.bandwidth(v, u) == bw and t.graph.edges[v, u]["links"] == links


def test_dgx1v_tables():
    t = preset("dgx1v")
    assert t.gpus == list(range(8))
    for u, v in DGX1_DOUBLE:
        assert t.graph.edges[u, v]["links"] == 2 and t.bandwidth(u, v) == 2 * V2
    for u, v in DGX1_SINGLE:
        assert t.graph.edges[u, v]["links"] == 1 and t.bandwidth(v, u) == V2
    assert len([1 for *_, k, _ in t.links() if k == "nvlink"]) == 32  # 16 pairs, both directions
    assert nvlink_counts(t) == {g: 6 for g in range(8)}
    assert {g: out_gbps(t, g, "nvlink") for g in t.gpus} == {g: pytest.approx(6 * V2) for g in range(8)}
    sw = {g: next(v for v in t.graph.successors(g) if isinstance(v, str)) for g in t.gpus}
    assert sw == {0: "pcie-switch-0", 1: "pcie-switch-0", 2: "pcie-switch-1", 3: "pcie-switch-1",
                  4: "pcie-switch-2", 5: "pcie-switch-2", 6: "pcie-switch-3", 7: "pcie-switch-3"}
    for s, cpu in (("pcie-switch-0", "cpu0"), ("pcie-switch-1", "cpu0"), ("pcie-switch-2", "cpu1"),
                   ("pcie-switch-3", "cpu1")):
        assert t.bandwidth(s, cpu) == 12.0 and t.kind(s) == "pcie-switch"
    assert t.bandwidth("cpu0", "cpu1") == 20.0 and t.graph.edges["cpu0", "cpu1"]["kind"] == "host"
    nvonly = preset("dgx1v-nvlink")
    assert nvonly.switches == [] and nvlink_counts(nvonly) == nvlink_counts(t)
    nics = preset("dgx1v-nics")
    assert [s for s in nics.switches if nics.kind(s) == "nic"] == ["nic0", "nic1", "nic2", "nic3"]
    assert nics.bandwidth("nic2", "pcie-switch-2") == EDR_IB_GBPS == 12.5 * 0.96


def test_dgx1p_and_nvswitch_boxes():
    p = preset("dgx1p")
    assert nvlink_counts(p) == {g: 4 for g in range(8)}
    assert {g: out_gbps(p, g, "nvlink") for g in p.gpus} == {g: pytest.approx(4 * nvlink_gbps(1)) for g in range(8)}
    for name, n, links, gbps in (("dgx2", 16, 6, 6 * V2), ("dgx-a100", 8, 12, 12 * V3), ("dgx-h100", 8, 18, 18 * V4)):
        t = preset(name)
        assert t.gpus == list(range(n)) and t.switches == ["nvswitch"]
        for g in t.gpus:
            d = t.graph.edges[g, "nvswitch"]
            assert (d["links"], d["bandwidth_gbps"], d["kind"]) == (links, gbps, "nvswitch")
            assert t.bandwidth("nvswitch", g) == gbps


def test_pcie_2socket_and_host():
    t = preset("pcie-2socket")
    assert nvlink_counts(t) == {g: 0 for g in range(8)}
    assert sorted(t.switches) == ["cpu0", "cpu1"] + [f"pcie-switch-{i}" for i in range(4)]
    assert t.graph.has_edge(5, "pcie-switch-2") and t.graph.has_edge("pcie-switch-1", "cpu0")
    h = preset("host8")
    assert h == Topology.host(8) and h.switches == ["host"] and h.bandwidth(3, "host") == 10.0


def test_preset_aliases_and_unknown():
    assert preset("dgx_a100") == preset("dgx-a100") and preset("DGX_H100").name == "dgx-h100"
    with pytest.raises(TopologyError, match=r"unknown preset 'dgx9'.*dgx1v.*host<N>"):
        Topology.preset("dgx9")
    with pytest.raises(TopologyError, match=r"host<N> takes N host CPU devices in 1\.\.4096"):
        preset("host0")


# ----------------------------------------------------------------------------- multi_node
def test_multi_node_dgx1v():
    t = multi_node("dgx1v", 3, 12.5, nics_per_node=2)
    assert t.gpus == list(range(24)) and t.kind("network") == "network"
    base = preset("dgx1v")
    for k in range(3):
        for u, v in DGX1_DOUBLE:
            assert t.graph.edges[8 * k + u, 8 * k + v]["links"] == 2
        assert t.graph.has_edge(8 * k + 3, f"n{k}-pcie-switch-1")
        assert t.bandwidth(f"n{k}-cpu0", f"n{k}-cpu1") == 20.0
        # NIC j on switch j * 4 // 2: nic0 -> switch 0, nic1 -> switch 2
        assert t.bandwidth(f"n{k}-nic0", f"n{k}-pcie-switch-0") == 12.5
        assert t.bandwidth(f"n{k}-nic1", f"n{k}-pcie-switch-2") == 12.5
        for j in range(2):
            assert t.kind(f"n{k}-nic{j}") == "nic"
            d = t.graph.edges[f"n{k}-nic{j}", "network"]
            assert (d["kind"], d["bandwidth_gbps"]) == ("net", 12.5)
    assert t.graph.number_of_edges() == 3 * (base.graph.number_of_edges() + 2 * 4)
    assert t.graph.degree("network") == 2 * 6
    assert not any(t.graph.has_edge(u, v) for u in range(8) for v in range(8, 24))


def test_multi_node_nvswitch_node_attaches_nics_to_gpus():
    t = multi_node(preset("dgx-h100"), 2, 50.0, nics_per_node=8)
    for k in range(2):
        for j in range(8):
            assert [v for v in t.graph.successors(f"n{k}-nic{j}") if isinstance(v, int)] == [8 * k + j]
    one = multi_node("dgx-a100", 2, 25.0)
    assert sorted(v for v in one.graph.successors("n1-nic0") if isinstance(v, int)) == list(range(8, 16))


def test_dgx1v_4node_and_multi_node_errors():
    t = preset("dgx1v-4node")
    assert len(t.gpus) == 32 and t.graph.degree("network") == 8
    assert all(t.bandwidth(f"n{k}-nic0", "network") == EDR_IB_GBPS for k in range(4))
    for args, pat in ((("dgx9", 2, 10.0), "unknown preset"), (("dgx1v", 0, 10.0), "n_nodes"),
                      (("dgx1v", 2, 0.0), "nic_gbps"), (("dgx1v", 2, "x"), "nic_gbps"),
                      (("dgx1v", 2, 10.0, 0), "nics_per_node"), ((42, 2, 10.0), "preset name or a Topology")):
        with pytest.raises(TopologyError, match=pat):
            multi_node(*args)


# ----------------------------------------------------------------------------- subset / fingerprint
def test_subset_keeps_joining_switches():
    t = preset("pcie-2socket")
    assert t.subset([0, 1]).switches == ["pcie-switch-0"]
    assert t.subset([0, 2]).switches == ["cpu0", "pcie-switch-0", "pcie-switch-1"]
    s = t.subset([1, 5])
    assert s.switches == ["cpu0", "cpu1", "pcie-switch-0", "pcie-switch-2"]
    assert s.bandwidth("cpu0", "cpu1") == 20.0 and s.gpus == [1, 5]
    d = preset("dgx1v").subset([0, 3, 4])
    assert d.graph.edges[0, 3]["links"] == 2 and d.graph.edges[0, 4]["links"] == 2 and not d.graph.has_edge(3, 4)
    assert d.switches == ["cpu0", "cpu1", "pcie-switch-0", "pcie-switch-1", "pcie-switch-2"]
    m = preset("dgx1v-4node").subset([0, 8])
    assert m.switches == ["n0-nic0", "n0-pcie-switch-0", "n1-nic0", "n1-pcie-switch-0", "network"]
    assert preset("dgx-h100").subset([2, 6]).switches == ["nvswitch"]
    assert preset("dgx1v").subset([5]).switches == []
    with pytest.raises(TopologyError, match=r"devices \[9\] are not GPUs"):
        t.subset([0, 9])
    with pytest.raises(TopologyError, match="duplicate"):
        t.subset([0, 0])


def test_fingerprint_stable_and_sensitive():
    assert Topology.host(8).fingerprint() == "1ec72d53792a50a6"  # pinned: plan caches key on it
    a, b = preset("dgx1v"), preset("dgx1v")
    b.name = "renamed"
    assert a.fingerprint() == b.fingerprint()
    # insertion order does not matter
    x, y = Topology(), Topology()
    for t, order in ((x, [(0, 1), (1, 2)]), (y, [(1, 2), (0, 1)])):
        for g in (2, 0, 1) if t is y else (0, 1, 2):
            t.add_gpu(g)
        for u, v in order:
            t.add_link(u, v, 25.0, "nvlink")
    assert x.fingerprint() == y.fingerprint()
    y.add_link(0, 1, 25.0, "nvlink")
    assert x.fingerprint() != y.fingerprint()
    assert len({preset(n).fingerprint() for n in PRESETS}) == len(PRESETS)


def test_fingerprint_follows_every_change_to_the_graph():
    """The kept digest is reused only while the graph is unchanged (its change count): any edit through
    networkx, in place on a link's or node's attributes included, gives a new digest; undoing it the old."""
    import pickle

    import networkx as nx

    t = preset("dgx1v")
    f0 = t.fingerprint()
    edits = [lambda g: g.edges[0, 1].__setitem__("bandwidth_gbps", 1.0), lambda g: g.edges[0, 1].update(links=7),
             lambda g: nx.set_edge_attributes(g, {(0, 1): 2.0}, "bandwidth_gbps"), lambda g: g.remove_edge(0, 1),
             lambda g: g.add_edge(0, 5, bandwidth_gbps=1.0, kind="pcie", links=1),
             lambda g: g.nodes[0].__setitem__("no_p2p", [1]), lambda g: g.nodes[0]["no_p2p"].append(2)]
    for edit in edits:
        before = t.fingerprint()
        edit(t.graph)
        assert t.fingerprint() != before
    fresh = preset("dgx1v")
    t.graph = fresh.graph  # a graph assigned: the digest of what is there now
    assert t.fingerprint() == f0
    copy = pickle.loads(pickle.dumps(t))
    assert copy.fingerprint() == f0
    copy.graph.edges[0, 1]["bandwidth_gbps"] = 3.0
    assert copy.fingerprint() != f0 and t.fingerprint() == f0
    t.graph = nx.DiGraph(fresh.graph)  # an ordinary DiGraph: snapshot compared each time
    assert t.fingerprint() == f0
    t.graph.edges[0, 1]["bandwidth_gbps"] = 3.0
    assert t.fingerprint() != f0



def test_gpus_follow_every_change_to_the_graph():
    """gpus is kept while the graph is unchanged (its change count) and recomputed after any edit."""
    import networkx as nx

    t = preset("dgx1v")
    assert t.gpus == list(range(8))
    t.gpus.append(99)  # a new list each call: the kept one is not the caller's
    assert t.gpus == list(range(8))
    t.add_gpu(9)
    assert t.gpus == [*range(8), 9]
    t.graph.nodes[9]["kind"] = "cpu"  # in place on a node's attributes
    assert t.gpus == list(range(8))
    t.graph.remove_node(0)
    assert t.gpus == list(range(1, 8))
    t.graph = nx.DiGraph(preset("dgx1v").graph)  # an ordinary DiGraph: computed each time
    assert t.gpus == list(range(8))
    t.graph.add_node(12, kind="gpu")
    assert t.gpus == [*range(8), 12]


# ----------------------------------------------------------------------------- discovery
class FakeNVML:
    """The slice of the pynvml API that discovery uses, describing a made-up machine."""

    class NVMLError(Exception):
        pass

    NVML_FEATURE_ENABLED = 1
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_CAPS_INDEX_READ = (0,)  # as pynvml really defines it
    NVML_NVLINK_MAX_LINKS = 18

    class _Pci:
        def __init__(self, bus):
            self.busId = bus

    def __init__(self, n, links, level, numa, name=b"Tesla V100-SXM2-32GB", version=2, no_p2p=()):
        self.n, self.links, self.level, self.numa = n, links, level, numa
        self.name, self.version, self.no_p2p = name, version, set(no_p2p)

    @staticmethod
    def bus(i):
        return f"00000000:{0x10 + i:02X}:00.0"

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.name

    def nvmlDeviceGetPciInfo(self, h):
        return self._Pci(self.bus(h).encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.level(a, b)

    def nvmlDeviceGetP2PStatus(self, a, b, idx):
        assert idx == 0
        return 3 if frozenset((a, b)) in self.no_p2p else 0

    def nvmlDeviceGetNumaNodeId(self, h):
        return self.numa(h)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h]):
            raise self.NVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        r = self.links[h][link]
        return self._Pci("0000:c0:00.0" if r == "switch" else self.bus(r)[4:])

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self.version


def fake_dgx1v():
    links = {g: [] for g in range(8)}
    for pairs, count in ((DGX1_DOUBLE, 2), (DGX1_SINGLE, 1)):
        for u, v in pairs:
            links[u] += [v] * count
            links[v] += [u] * count

    def level(a, b):
        return 10 if a // 2 == b // 2 else 30 if a // 4 == b // 4 else 50

    return FakeNVML(8, links, level, lambda g: g // 4)


def test_from_nvml_dgx1v_equals_preset():
    t = from_nvml(fake_dgx1v())
    assert t.fingerprint() == preset("dgx1v").fingerprint()


def test_from_nvml_nvswitch_and_no_p2p():
    h100 = FakeNVML(8, {g: ["switch"] * 18 for g in range(8)}, lambda a, b: 30 if a // 4 == b // 4 else 50,
                    lambda g: g // 4, name="NVIDIA H100 80GB HBM3", version=4)
    t = from_nvml(h100)
    assert all(t.graph.edges[g, "nvswitch"]["bandwidth_gbps"] == pytest.approx(18 * V4) for g in range(8))
    assert {s for s in t.switches} == {"nvswitch", "cpu0", "cpu1"}
    fake = fake_dgx1v()
    fake.no_p2p = {frozenset((0, 1))}
    t = from_nvml(fake)
    assert not t.graph.has_edge(0, 1) and t.graph.has_edge(0, "cpu0") and t.graph.has_edge(1, "cpu0")
    assert t.graph.edges[0, 3]["links"] == 2
    p100 = fake_dgx1v()
    p100.version = 1
    assert from_nvml(p100).bandwidth(0, 3) == 2 * nvlink_gbps(1)


def test_detect_applies_cuda_visible_devices(monkeypatch):
    import jax_blink.topology.nvml as disc
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2,7")
    t = disc._apply_visible_devices(from_nvml(fake_dgx1v()))
    assert t.gpus == [0, 1, 2]
    assert t.graph.edges[0, 1]["links"] == 2 and t.graph.edges[0, 2]["links"] == 1  # 3-2 NV2, 3-7 NV1
    assert not t.graph.has_edge(1, 2)


def test_detect_via_nvidia_smi(tmp_path, monkeypatch, topology_dir):
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nif [ "$2" = "-m" ]; then cat "{topology_dir / "dgx1v_v100.txt"}"; '
                      'else echo "unsupported" >&2; exit 3; fi\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    t = detect(use_nvml=False)
    assert t.name == "detected"
    assert t.fingerprint() == load_topology(topology_dir / "dgx1v_v100.txt").fingerprint()


def test_detect_without_gpus_says_how_to_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TopologyError, match=r"nvidia-smi: not on PATH.*preset name.*topo -m.*JSON"):
        Topology.detect(use_nvml=False)
    with pytest.raises(TopologyError, match="detection disabled"):
        detect(use_nvml=False, use_nvidia_smi=False)


def test_load_topology_sources(tmp_path, topology_dir):
    t = preset("dgx1v")
    assert load_topology(t) is t
    assert load_topology("dgx1v") == t and Topology.load("host4") == Topology.host(4)
    assert load_topology(t.to_dict()) == t
    p = tmp_path / "m.json"
    p.write_text(t.to_json())
    assert load_topology(str(p)) == t
    txt = load_topology(topology_dir / "a100_pcie_nvlink_pairs.txt", pcie_gbps=24.0)
    assert txt.name == "a100_pcie_nvlink_pairs" and txt.bandwidth(0, "cpu0") == 24.0
    with pytest.raises(TopologyError, match="'nope' is not a preset name or an existing file"):
        load_topology("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(TopologyError, match="bad.json: not valid JSON"):
        load_topology(bad)
    with pytest.raises(TopologyError, match="cannot load a topology from int"):
        load_topology(3)


# ----------------------------------------------------------------------------- CLI
def test_cli_json_preset_and_files(capsys, topology_dir):
    assert main(["topology", "dgx1v", "--json"]) == 0
    assert Topology.from_json(capsys.readouterr().out) == preset("dgx1v")
    for f in sorted(topology_dir.glob("*.txt")):
        assert main(["topology", str(f), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert Topology.from_dict(data) == jax_blink.load_topology(f)


def test_cli_table_and_errors(capsys, topology_dir):
    assert main(["topology", str(topology_dir / "dgx1v_v100.txt")]) == 0
    out = capsys.readouterr().out
    assert "dgx1v_v100: 8 GPUs" in out and "mlx5_0" in out and "pcie-switch-0" in out
    assert "149.4" in out  # GPU out bandwidth: 6 x 22.9 NVLink + 12 PCIe (achieved rates)
    assert main(["topology", "dgx-h100"]) == 0
    assert "370" in capsys.readouterr().out  # 18 x 20.56 achieved
    assert main(["topology", "nope"]) == 2
    assert "not a preset name or an existing file" in capsys.readouterr().err


def test_cli_bandwidth_options_must_be_positive_and_apply(capsys, topology_dir, tmp_path):
    f = str(topology_dir / "dgx1v_v100.txt")
    for bad in ("-5", "0", "nan", "inf", "x"):
        for opt in ("--nvlink-gbps", "--pcie-gbps"):
            with pytest.raises(SystemExit) as exc:
                main(["topology", f, opt, bad])
            assert exc.value.code == 2
            assert f"argument {opt}: must be a finite number of GB/s > 0, got '{bad}'" in capsys.readouterr().err
    assert main(["topology", f, "--nvlink-gbps", "20", "--json"]) == 0
    t = Topology.from_json(capsys.readouterr().out)
    assert t.bandwidth(0, 3) == 40.0 and t.bandwidth(0, 1) == 20.0  # NV2 and NV1 at 20 GB/s per link
    # presets and JSON models have fixed bandwidths: the option would be silently ignored
    assert main(["topology", "dgx1v", "--nvlink-gbps", "20"]) == 2
    assert "the preset 'dgx1v' has fixed bandwidths" in capsys.readouterr().err
    j = tmp_path / "m.json"
    j.write_text(preset("dgx1v").to_json())
    assert main(["topology", str(j), "--pcie-gbps", "24"]) == 2
    assert "JSON model" in capsys.readouterr().err


def test_cli_binary_file_is_a_clean_error(capsys, tmp_path):
    b = tmp_path / "prog"
    b.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    assert main(["topology", str(b)]) == 2
    assert "binary data" in capsys.readouterr().err
    assert main(["topology", str(tmp_path)]) == 2
    assert "is not a preset name or an existing file" in capsys.readouterr().err


def test_fingerprint_follows_changes_to_a_kept_topology():
    """The fingerprint kept on a Topology is recomputed after add_link, add_gpu, a direct graph
    change and a no_p2p change, and equals a fresh copy's digest each time."""
    t = Topology.preset("dgx1v")

    def fresh():
        return Topology.from_dict(t.to_dict()).fingerprint()

    seen = {t.fingerprint()}
    assert t.fingerprint() == fresh()
    t.add_link(0, 5, 25.0, "nvlink")
    assert t.fingerprint() == fresh() and t.fingerprint() not in seen
    seen.add(t.fingerprint())
    t.graph.edges[0, 5]["bandwidth_gbps"] = 10.0
    assert t.fingerprint() == fresh() and t.fingerprint() not in seen
    seen.add(t.fingerprint())
    t.graph.nodes[0]["no_p2p"] = {7}
    assert t.fingerprint() == fresh() and t.fingerprint() not in seen
    seen.add(t.fingerprint())
    t.add_gpu(8)
    assert t.fingerprint() == fresh() and t.fingerprint() not in seen
