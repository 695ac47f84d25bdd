"""nvidia-smi topo -m / -p2p parser: the real matrices' link tables (hand-counted), errors, properties."""

import re

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_blink import Topology, TopologyError
from jax_blink.topology.nvsmi import parse_topo
from jax_blink.topology.presets import DGX1_DOUBLE, DGX1_SINGLE, nvlink_gbps, preset

V2, V3, V4 = nvlink_gbps(2), nvlink_gbps(3), nvlink_gbps(4)  # achieved GB/s per NVLink (V100/A100/H100)


def nvlink_table(t):
    """{(a, b): links} for GPU-GPU nvlink edges, a < b."""
    return {(u, v): c for u, v, _, k, c in t.links() if k == "nvlink" and u < v}


def pcie_pairs(t):
    """{(a, b)} undirected pcie/host edges, as sorted string pairs."""
    return {tuple(sorted((str(u), str(v)))) for u, v, _, k, _ in t.links() if k in ("pcie", "host")}


def read(topology_dir, name):
    return (topology_dir / name).read_text()


def test_all_shared_files_parse(topology_dir):
    files = sorted(topology_dir.glob("*.txt"))
    assert len(files) == 5
    for f in files:
        t = parse_topo(f.read_text())
        assert t.gpus == list(range(8 if "two_gpus" not in f.name else 2))
        assert Topology.from_json(t.to_json()) == t


def test_dgx1v_file(topology_dir):
    t = Topology.from_nvidia_smi(read(topology_dir, "dgx1v_v100.txt"))
    want = {tuple(sorted(p)): 2 for p in DGX1_DOUBLE} | {tuple(sorted(p)): 1 for p in DGX1_SINGLE}
    assert nvlink_table(t) == want
    assert t.bandwidth(0, 3) == 2 * V2 and t.bandwidth(0, 1) == V2  # 6 links per GPU: NVLink2 (V100)
    # mlx5_0 is PIX with GPU2 and GPU3: they share one switch; NV hides 0-1's and 4..7's PCIe relation,
    # so those attach to their socket's CPU (CPU affinity 0-11,24-35 vs 12-23,36-47).
    assert set(t.switches) == {"cpu0", "cpu1", "pcie-switch-0", "mlx5_0"}
    assert t.kind("mlx5_0") == "nic"
    assert pcie_pairs(t) == {("2", "pcie-switch-0"), ("3", "pcie-switch-0"), ("mlx5_0", "pcie-switch-0"),
                             ("cpu0", "pcie-switch-0"), ("0", "cpu0"), ("1", "cpu0"), ("4", "cpu1"),
                             ("5", "cpu1"), ("6", "cpu1"), ("7", "cpu1"), ("cpu0", "cpu1")}
    assert t.bandwidth("cpu0", "cpu1") == 20.0 and t.bandwidth(2, "pcie-switch-0") == 12.0


def test_dgx1v_file_bandwidth_options(topology_dir):
    t = parse_topo(read(topology_dir, "dgx1v_v100.txt"), nvlink_gbps=20.0, pcie_gbps=24.0, inter_socket_gbps=30.0)
    assert t.bandwidth(0, 3) == 40.0 and t.bandwidth(0, "cpu0") == 24.0 and t.bandwidth("cpu1", "cpu0") == 30.0


def test_h100_file_is_nvswitch(topology_dir):
    t = parse_topo(read(topology_dir, "h100_sxm_nvswitch.txt"))
    # NV18 on all 28 pairs would be 126 links per GPU: only an NVSwitch explains it (18 links per GPU).
    assert nvlink_table(t) == {}
    assert t.kind("nvswitch") == "nvswitch"
    for g in range(8):
        d = t.graph.edges[g, "nvswitch"]
        assert (d["links"], d["bandwidth_gbps"], d["kind"]) == (18, pytest.approx(18 * V4), "nvswitch")
    # each GPU shares a PCIe switch with the NIC marked PIX; NIC0 is SYS to every GPU: left out
    pix = {0: "nic8", 1: "nic7", 2: "nic6", 3: "nic5", 4: "nic4", 5: "nic3", 6: "nic2", 7: "nic1"}
    assert "nic0" not in t.graph
    for g, nic in pix.items():
        (sw,) = [v for v in t.graph.successors(g) if v != "nvswitch"]
        assert t.kind(sw) == "pcie-switch" and t.graph.has_edge(nic, sw)
        assert t.graph.has_edge(sw, "cpu0" if g < 4 else "cpu1")
    assert len([s for s in t.switches if t.kind(s) == "pcie-switch"]) == 8


def test_a100_pairs_file(topology_dir):
    t = parse_topo(read(topology_dir, "a100_pcie_nvlink_pairs.txt"))
    assert nvlink_table(t) == {(0, 1): 12, (2, 3): 12, (4, 5): 12, (6, 7): 12}
    assert t.bandwidth(0, 1) == 12 * V3 and t.bandwidth(0, "cpu0") == 24.0  # NV12: A100, PCIe gen4 x16
    assert set(t.switches) == {"cpu0", "cpu1"}  # NODE/SYS only: every GPU on its socket's root complex
    assert pcie_pairs(t) == {(str(g), f"cpu{g // 4}") for g in range(8)} | {("cpu0", "cpu1")}


def test_pcie_2socket_file_equals_preset(topology_dir):
    t = parse_topo(read(topology_dir, "pcie_2socket_4switch.txt"))
    assert nvlink_table(t) == {}
    assert t.fingerprint() == preset("pcie-2socket").fingerprint()
    assert t.graph.has_edge(0, "pcie-switch-0") and t.graph.has_edge(1, "pcie-switch-0")
    assert t.graph.has_edge("pcie-switch-3", "cpu1") and t.graph.has_edge(7, "pcie-switch-3")


def test_two_gpus_no_p2p_goes_through_host(topology_dir):
    text = read(topology_dir, "two_gpus_pix_no_p2p.txt")
    t = parse_topo(text)
    # NS: no peer-to-peer, so the shared switch is no shortcut; traffic is staged through the CPU
    assert set(t.switches) == {"cpu0"}
    assert pcie_pairs(t) == {("0", "cpu0"), ("1", "cpu0")}
    without_p2p = parse_topo(text.split("$ nvidia-smi")[0])
    assert set(without_p2p.switches) == {"cpu0", "pcie-switch-0"}
    assert pcie_pairs(without_p2p) == {("0", "pcie-switch-0"), ("1", "pcie-switch-0"), ("cpu0", "pcie-switch-0")}


P2P_NS_NVLINK = """\
        GPU0    GPU1    GPU2    CPU Affinity
GPU0     X      NV2     PIX     0-7
GPU1    NV2      X      PIX     0-7
GPU2    PIX     PIX      X      0-7

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks

nvidia-smi topo -p2p {mode}
        GPU0    GPU1    GPU2
 GPU0   X       GNS     OK
 GPU1   GNS     X       OK
 GPU2   OK      OK      X
"""


def test_p2p_not_ok_drops_nvlink_and_switch():
    t = parse_topo(P2P_NS_NVLINK.format(mode="r"))
    assert nvlink_table(t) == {}
    assert set(t.switches) == {"cpu0"} and all(t.graph.has_edge(g, "cpu0") for g in range(3))
    # an NVLink-capability matrix (-p2p n) is informative only
    t = parse_topo(P2P_NS_NVLINK.format(mode="n"))
    assert nvlink_table(t) == {(0, 1): 2} and "pcie-switch-0" in t.switches


def test_pxb_phb_tree():
    text = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNUMA Affinity
GPU0\t X \tPIX\tPXB\tPXB\tPHB\tPHB\tNODE\tNODE\t0
GPU1\tPIX\t X \tPXB\tPXB\tPHB\tPHB\tNODE\tNODE\t0
GPU2\tPXB\tPXB\t X \tPIX\tPHB\tPHB\tNODE\tNODE\t0
GPU3\tPXB\tPXB\tPIX\t X \tPHB\tPHB\tNODE\tNODE\t0
GPU4\tPHB\tPHB\tPHB\tPHB\t X \tPIX\tNODE\tNODE\t0
GPU5\tPHB\tPHB\tPHB\tPHB\tPIX\t X \tNODE\tNODE\t0
GPU6\tNODE\tNODE\tNODE\tNODE\tNODE\tNODE\t X \tSOC\t0
GPU7\tNODE\tNODE\tNODE\tNODE\tNODE\tNODE\tSOC\t X \t0
"""
    t = parse_topo(text)
    # {0,1},{2,3} switches under an upstream switch; with {4,5} under host bridge 0 of cpu0;
    # 6 and 7 (SOC = SYS between them, yet the same NUMA affinity) hang off cpu0 directly
    assert pcie_pairs(t) == {
        ("0", "pcie-switch-1"), ("1", "pcie-switch-1"), ("2", "pcie-switch-2"), ("3", "pcie-switch-2"),
        ("pcie-switch-0", "pcie-switch-1"), ("pcie-switch-0", "pcie-switch-2"),
        ("cpu0-bridge0", "pcie-switch-0"), ("4", "pcie-switch-3"), ("5", "pcie-switch-3"),
        ("cpu0-bridge0", "pcie-switch-3"), ("cpu0", "cpu0-bridge0"), ("6", "cpu0"), ("7", "cpu0")}


def test_direct_full_mesh_is_not_nvswitch():
    # HGX A100 4-GPU: NV4 between every pair = 12 links per GPU, direct
    rows = ["\tGPU0\tGPU1\tGPU2\tGPU3"] + [
        f"GPU{i}\t" + "\t".join("X" if i == j else "NV4" for j in range(4)) for i in range(4)]
    t = parse_topo("\n".join(rows))
    assert nvlink_table(t) == {(a, b): 4 for a in range(4) for b in range(a + 1, 4)}
    forced = parse_topo("\n".join(rows), nvswitch=True)
    assert nvlink_table(forced) == {} and forced.bandwidth(0, "nvswitch") == 4 * V3  # 12 links per GPU: A100


def test_nic_legend_names_kept():
    text = """\
        GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity
GPU0     X      PIX     PIX     0-15    0
GPU1    PIX      X      PIX     0-15    0
NIC0    PIX     PIX      X

Legend:

  X    = Self
  PIX  = Connection traversing at most a single PCIe bridge

NIC Legend:

  NIC0: mlx5_0
"""
    t = parse_topo(text)
    assert t.graph.nodes["nic0"]["device"] == "mlx5_0"
    assert pcie_pairs(t) == {("0", "pcie-switch-0"), ("1", "pcie-switch-0"), ("nic0", "pcie-switch-0"),
                             ("cpu0", "pcie-switch-0")}


GOOD = """\
        GPU0    GPU1    GPU2    CPU Affinity
GPU0     X      NV1     SYS     0-7
GPU1    NV1      X      SYS     0-7
GPU2    SYS     SYS      X      8-15
"""


@pytest.mark.parametrize("text, pattern", [
    ("", r"empty input"),
    ("   \n\t\n", r"empty input"),
    ("hello world\nthis is not a matrix", r"no `nvidia-smi topo -m` matrix"),
    (GOOD.replace("GPU1    NV1      X      SYS     0-7", "GPU1    NV1      X"),
     r"line 3: row GPU1 has 2 cells; expected 3"),
    (GOOD.replace("GPU2    SYS     SYS      X      8-15\n", ""), r"no row GPU2.*square"),
    (GOOD.replace("GPU2    SYS     SYS", "GPU2    SYS     FOO"),
     r"line 4, row GPU2, column GPU1: unknown link code 'FOO'"),
    (GOOD.replace("GPU1    NV1 ", "GPU1    NV2 "), r"asymmetric NVLink counts.*line 2.*'NV1'.*line 3.*'NV2'"),
    (GOOD.replace("GPU2    SYS     SYS", "GPU2    SYS     PIX"), r"asymmetric cells"),
    (GOOD.replace("GPU1    GPU2", "GPU0    GPU2"), r"line 1: duplicate column GPU0"),
    (GOOD.replace("GPU1", "GPU3"), r"GPU1 is missing"),
    (GOOD + "GPU1    NV1      X      SYS     0-7\n", r"line 5: duplicate row GPU1"),
    (GOOD.replace("GPU0     X ", "GPU0    SYS"), r"line 2, row GPU0, column GPU0: got 'SYS'; expected X"),
    (GOOD.replace("GPU1    NV1      X", "GPU1    X        X"), r"row GPU1, column GPU0: got .X.; expected a link code"),
    (GOOD.replace("NV1", "NV0"), r"'NV0': the NVLink count of NV<n> must be an integer from 1 to 64, got 0"),
    (GOOD.replace("0-7\n", "0-7  1  2\n", 1), r"row GPU0 has 6 cells; expected 3 link cells plus at most 1"),
    (GOOD + "GPU7    SYS     SYS      X      8-15\n", r"row GPU7 is not a column"),
    (GOOD + GOOD, r"two `nvidia-smi topo -m` matrices"),
    (GOOD + "\n        GPU0    GPU5\n GPU0   X       OK\n GPU5   OK      X\n", r"p2p matrix column 'GPU5'"),
    (GOOD.replace("CPU Affinity", "cpu0 CPU Affinity").replace("0-7", "SYS 0-7").replace("8-15", "SYS 8-15"),
     r"column 'cpu0' is neither GPU<i> nor a NIC name"),
    ("CPU Affinity\nGPU0 X", r"no `nvidia-smi topo -m` matrix"),
])
def test_bad_input_names_the_problem(text, pattern):
    with pytest.raises(TopologyError, match=pattern):
        parse_topo(text)


def test_non_text_input():
    with pytest.raises(TopologyError, match="must be text"):
        parse_topo(None)
    assert parse_topo(GOOD.encode()).gpus == [0, 1, 2]
    with pytest.raises(TopologyError, match="pcie_gbps must be a finite number > 0 of GB/s, from 0.001 to 1e.06"):
        parse_topo(GOOD, pcie_gbps=0)


# ----------------------------------------------------------------------------- properties
PCIE = ["PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def matrices(draw):
    n = draw(st.integers(1, 8))
    cells = {}
    for i in range(n):
        for j in range(i + 1, n):
            cells[i, j] = cells[j, i] = draw(st.sampled_from(PCIE + ["NV1", "NV2"]))
    sep = draw(st.sampled_from(["\t", "    ", " \t "]))
    aff = draw(st.booleans())
    numa = [draw(st.integers(0, 1)) for _ in range(n)]
    head = sep + sep.join(f"GPU{i}" for i in range(n)) + (sep + "CPU Affinity" + sep + "NUMA Affinity" if aff else "")
    rows = [head]
    for i in range(n):
        row = [f"GPU{i}"] + [" X " if i == j else cells[i, j] for j in range(n)]
        if aff:
            row += [f"{numa[i] * 8}-{numa[i] * 8 + 7}", str(numa[i])]
        rows.append(sep.join(row))
    legend = draw(st.sampled_from(["", "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe\n"]))
    return n, cells, "\n".join(rows) + "\n" + legend


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(matrices())
def test_random_valid_matrices_parse_and_round_trip(m):
    n, cells, text = m
    t = parse_topo(text)
    assert t.gpus == list(range(n))
    want = {(i, j): int(c[2:]) for (i, j), c in cells.items() if i < j and c.startswith("NV")}
    assert nvlink_table(t) == want  # at most 2 x 7 = 14 links per GPU: always direct links
    back = Topology.from_json(t.to_json())
    assert back == t and back.fingerprint() == t.fingerprint()
    pcie = t.graph.edge_subgraph([(u, v) for u, v, kind in t.graph.edges(data="kind") if kind == "pcie"])
    cpus = [v for v in t.graph.nodes if isinstance(v, str) and t.kind(v) == "cpu"]
    for g in t.gpus:  # every GPU reaches a CPU over PCIe
        assert g in pcie and any(nx.has_path(pcie, g, c) for c in cpus if c in pcie), g


def _only_topology_errors(text):
    try:
        t = parse_topo(text)
    except TopologyError as err:
        assert str(err)
    else:
        assert isinstance(t, Topology)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("GPU0123 \tXNVSYPIXBHODE\n-,:mlx5_OKCS")), max_size=300))
def test_garbage_raises_only_topology_error(text):
    _only_topology_errors(text)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_real_files_raise_only_topology_error(topology_dir, data):
    files = sorted(topology_dir.glob("*.txt"))
    text = files[data.draw(st.integers(0, len(files) - 1))].read_text()
    toks = re.split(r"(\s+)", text)
    for _ in range(data.draw(st.integers(1, 3))):
        k = data.draw(st.integers(0, len(toks) - 1))
        toks[k] = data.draw(st.sampled_from(["", "X", "NV3", "GPU9", "PIX", "OK", "\n", "GPU0", "junk", "NIC0"]))
    _only_topology_errors("".join(toks))


# ----------------------------------------------------------------------------- terminal output
@pytest.mark.parametrize("name", ["dgx1v_v100.txt", "h100_sxm_nvswitch.txt", "two_gpus_pix_no_p2p.txt"])
def test_ansi_underlined_header_parses_like_the_plain_file(topology_dir, name):
    """On a terminal nvidia-smi underlines the header: ESC[4m GPU0\\tGPU1 ... ESC[0m."""
    text = read(topology_dir, name)
    plain = parse_topo(text)
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.split() and ln.split()[0] == "GPU0")
    lines[k] = "\x1b[4m" + "\t".join(lines[k].split()) + "\x1b[0m"
    lines.insert(0, "\x1b[1;32muser@host\x1b[0m$ nvidia-smi topo -m")
    escaped = "\n".join(lines) + "\n"
    assert "\x1b[4mGPU0\t" in escaped
    t = parse_topo(escaped)
    assert t == plain and t.fingerprint() == plain.fingerprint()
    assert nvlink_table(t) == nvlink_table(plain) and t.gpus == plain.gpus


def test_binary_input_says_it_is_not_text():
    with pytest.raises(TopologyError, match="binary data .* not the text output of `nvidia-smi topo -m`"):
        parse_topo(b"\x7fELF\x02\x01\x01\x00\x00\x00GPU0 GPU1")
