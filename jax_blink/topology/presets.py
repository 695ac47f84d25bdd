"""Machine presets: real interconnects, each with its source, and a multi-node constructor.

Bandwidths are GB/s (1e9 B/s) per direction. **Every link's ``bandwidth_gbps`` is its achieved rate**:
the line rate times the fraction of it that NCCL's long transfers reach on that kind of link (the
"achieved fraction" or link efficiency; tables below, each with its measurement). The planner's LPs
use these rates as capacities and the simulator as service rates, so plan rates, bounds and
simulated busbw are all in achieved GB/s. Keywords that take a rate from the user
(``nvlink_gbps=``, ``pcie_gbps=``, ``nic_gbps=``, ...) mean an achieved rate too.

Sources used throughout:

- NVIDIA DGX-1 system architecture whitepapers (WP-08437-001 P100, WP-08437-002 V100): hybrid
  cube-mesh NVLink, 4 PCIe switches with two GPUs each, two per CPU socket, QPI between sockets.
- NVIDIA DGX-2 / DGX A100 / DGX H100 user guides and architecture whitepapers (NVSwitch fabrics).
- The real ``nvidia-smi topo -m`` matrices in ``tests/data/topologies`` (copied from
  ``shared/topologies``; see its README for where each was posted).
- Line rates per link per direction: NVLink1 (P100) 20 GB/s, NVLink2/3/4 (V100/A100/H100) 25 GB/s,
  NVLink5 (B200) 50 GB/s; PCIe 8/16/32 GT/s per lane for gen3/4/5 with 128b/130b encoding (gen3 x16
  15.75 GB/s).
- Achieved fractions: :data:`NVLINK_EFFICIENCY`, :data:`PCIE_EFFICIENCY`, :data:`NET_EFFICIENCY`
  (measurements named there); ``benchmarks/fidelity.py`` compares the simulator with them.

Modelling choices (documented once here):

- An NVSwitch fabric is one node ``"nvswitch"`` (kind ``nvswitch``); each GPU joins it with its
  NVLink count, so every GPU's injection bandwidth is its link budget (the switch is non-blocking).
  Its links reach the same fraction as direct NVLinks of their generation.
- The PCIe tree is GPU -- ``pcie-switch-i`` -- ``cpu<s>``, both hops ``PCIE_GEN3_GBPS``; sockets are
  joined by one ``host``-kind link of ``INTER_SOCKET_GBPS``.
- ``INTER_SOCKET_GBPS = 20``: a QPI link at 9.6 GT/s moves 19.2 GB/s per direction (Intel Xeon E5 v4
  datasheet); peer-to-peer PCIe traffic across sockets rarely gets more than that, so we use one
  link's worth, about 20 GB/s, as the usable cross-socket rate (an assumption, not a measurement).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import TopologyError
from . import model
from .model import Topology

NVLINK1_GBPS = 20.0   # P100, per link per direction, line rate
NVLINK_GBPS = 25.0    # V100 (NVLink2), A100 (NVLink3), H100 (NVLink4), per link per direction, line rate
NVLINK5_GBPS = 50.0   # B200 / GB200 (NVLink5: 18 links, 1.8 TB/s bidirectional), per link per direction
NVLINK_LINE_GBPS = {1: NVLINK1_GBPS, 2: NVLINK_GBPS, 3: NVLINK_GBPS, 4: NVLINK_GBPS, 5: NVLINK5_GBPS}

# Achieved fraction of the NVLink line rate per generation (NCCL, large messages; direct links and
# NVSwitch ports alike). The published runs are cited in docs/benchmarks.md, "Simulator fidelity":
# - 2 (V100): 22.90 of 25 GB/s: NCCL 2.7.8 broadcast of 1 GiB from GPU 0 to GPU 1 over one NVLink of a
#   DGX-1V (UCBerkeley-Spring2022-CS267-project/blinkplus, test_bandwidth/logs; 45.77 over a double link).
# - 3 (A100): 208 of 300 GB/s: all_reduce_perf busbw of 2 A100 PCIe joined by 12 NVLinks (a run
#   posted to NVIDIA/nccl-tests); an 8x A100 SXM4 NVSwitch box reaches about 200 (another such run).
# - 4 (H100): 370 of 450 GB/s: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get
#   an effective NVLink bandwidth of 370GB/s" (an NCCL maintainer, on NVIDIA/nccl-tests).
# - 1 (P100) and 5 (B200): no measurement at hand; assumed equal to the next known generation.
NVLINK_EFFICIENCY = {1: 22.90 / 25.0, 2: 22.90 / 25.0, 3: 208.0 / 300.0, 4: 370.0 / 450.0, 5: 370.0 / 450.0}

# PCIe: payload bits per transferred bit by GT/s per lane (PCI Express Base Specification: 8b/10b up to
# 5 GT/s (gen1/gen2), 128b/130b from 8 GT/s (gen3+)), and the achieved fraction of the encoded line
# rate (TLP/DLLP headers, flow control): gen3 x16 moves about 12 GB/s per direction of its 15.75
# (nccl-tests PCIe boxes; Blink, MLSys 2020, section 2). NCCL's own table gives the same numbers
# within 2% (src/graph/topo.cc: kvDictPciGen, width * speed / 80 GB/s).
PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_GEN12_MAX_GTS = 5.0
PCIE_EFFICIENCY = 12.0 / (8.0 * 16 * 128 / 130 / 8)

# Network: achieved fraction of a NIC's line rate: 3 nodes of 8 A100 with 4 HDR (200 Gb/s) NICs each,
# all_reduce_perf peak busbw about 96 GB/s of the 100 GB/s per node (a run posted to NVIDIA/nccl-tests;
# cited in docs/benchmarks.md, "Simulator fidelity").
NET_EFFICIENCY = 96.0 / 100.0


def nvlink_gbps(generation: int) -> float:
    """Achieved GB/s per NVLink per direction of NVLink ``generation`` (1..5): line rate x
    :data:`NVLINK_EFFICIENCY`. Raises TopologyError for an unknown generation."""
    if generation not in NVLINK_LINE_GBPS:
        raise TopologyError(f"unknown NVLink generation {generation!r}; expected one of "
                            f"{sorted(NVLINK_LINE_GBPS)}")
    return NVLINK_LINE_GBPS[generation] * NVLINK_EFFICIENCY[generation]


def pcie_link_gbps(gts: float, width: int, efficiency: float | None = None) -> float:
    """Achieved GB/s per direction of a PCIe link: ``gts`` GT/s per lane x ``width`` lanes.

    ``GT/s x lanes x encoding / 8 x efficiency``, encoding 8/10 up to 5 GT/s (gen1/gen2) and 128/130
    from 8 GT/s (gen3+), efficiency :data:`PCIE_EFFICIENCY` (0.762) unless given: gen3 x16 -> 12.0,
    gen4 x16 -> 24.0, gen5 x16 -> 48.0, gen2 x8 -> 3.05 GB/s. ``efficiency=1`` gives the line rate
    (gen3 x16 15.75).
    """
    encoding = 8 / 10 if gts <= _GEN12_MAX_GTS else 128 / 130
    return gts * width * encoding / 8 * (PCIE_EFFICIENCY if efficiency is None else efficiency)


def pcie_gen_gbps(generation: int, width: int = 16) -> float:
    """Achieved GB/s per direction of a PCIe gen ``generation`` x ``width`` link (:func:`pcie_link_gbps`).
    Raises TopologyError for an unknown generation."""
    if generation not in PCIE_GTS:
        raise TopologyError(f"unknown PCIe generation {generation!r}; expected one of {sorted(PCIE_GTS)}")
    return pcie_link_gbps(PCIE_GTS[generation], width)


PCIE_GEN3_GBPS = pcie_gen_gbps(3)  # 12.0: achieved per direction on a gen3 x16 link
INTER_SOCKET_GBPS = 20.0  # see the module docstring
EDR_IB_GBPS = 12.5 * NET_EFFICIENCY  # 100 Gb/s EDR InfiniBand (the DGX-1's NICs), achieved: 12.0

# GPU model (a substring of the name NVML / nvidia-smi print) -> (NVLink generation or None, PCIe
# generation, PCIe lanes). Sources: the vendor datasheets (P100/V100 PCIe gen3 x16; A100, A40,
# RTX 30xx/40xx gen4 x16; H100/H200/B200 gen5 x16; Turing's NVLink bridge is NVLink2, GA102's NVLink3).
# Longer names first: "A100" must not match "A10".
GPU_MODELS = (
    ("GH200", (4, 5, 16)), ("GB200", (5, 5, 16)), ("B200", (5, 5, 16)), ("B100", (5, 5, 16)),
    ("H100", (4, 5, 16)), ("H200", (4, 5, 16)), ("H800", (4, 5, 16)), ("H20", (4, 5, 16)),
    ("A100", (3, 4, 16)), ("A800", (3, 4, 16)), ("A40", (3, 4, 16)), ("RTX 3090", (3, 4, 16)),
    ("RTX 4090", (None, 4, 16)), ("L40", (None, 4, 16)), ("A10", (None, 4, 16)),
    ("V100", (2, 3, 16)), ("RTX 2080", (2, 3, 16)), ("T4", (None, 3, 16)), ("P100", (1, 3, 16)),
)


def gpu_model(name: str | None):
    """(NVLink generation or None, PCIe generation, PCIe lanes) of the GPU model ``name`` (e.g.
    "NVIDIA A100 80GB PCIe", "RTX 2080 Ti"), or None when ``name`` is None or not in :data:`GPU_MODELS`."""
    if not name:
        return None
    up = str(name).upper()
    for sub, spec in GPU_MODELS:
        if sub.upper() in up:
            return spec
    return None


# DGX-1 hybrid cube-mesh (DGX-1 V100 whitepaper WP-08437-002, fig. 2; matches
# tests/data/topologies/dgx1v_v100.txt). P100 uses the same 16 GPU pairs with one link each.
DGX1_DOUBLE = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)]
DGX1_SINGLE = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)]


def add_pcie_tree(t: Topology, sockets: list[list[list[int]]], *, pcie_gbps: float = PCIE_GEN3_GBPS,
                  inter_socket_gbps: float = INTER_SOCKET_GBPS) -> None:
    """Add a PCIe tree to ``t`` in place.

    Args:
      sockets: ``sockets[s][w]`` is the list of GPU ids under PCIe switch ``w`` of CPU socket ``s``.
        Switches are numbered globally in that order (``pcie-switch-0``, ...); sockets are ``cpu<s>``.
      pcie_gbps: GB/s per direction of every GPU--switch and switch--CPU link.
      inter_socket_gbps: GB/s per direction of the link joining each pair of sockets (kind ``host``).

    Raises TopologyError if a GPU is not in ``t`` or the bandwidths are not positive.
    """
    sw = 0
    for s, switches in enumerate(sockets):
        t.add_switch(f"cpu{s}", "cpu")
        for gpus in switches:
            name = f"pcie-switch-{sw}"
            sw += 1
            t.add_switch(name, "pcie-switch")
            t.add_link(name, f"cpu{s}", pcie_gbps, "pcie")
            for g in gpus:
                t.add_link(g, name, pcie_gbps, "pcie")
    for a in range(len(sockets)):
        for b in range(a + 1, len(sockets)):
            t.add_link(f"cpu{a}", f"cpu{b}", inter_socket_gbps, "host")


_DGX1_PCIE = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def _dgx1(name: str, per_link: float, double: bool, pcie: bool, nics: bool) -> Topology:
    t = Topology(name + ("-nics" if nics else "" if pcie else "-nvlink"))
    for g in range(8):
        t.add_gpu(g)
    for u, v in DGX1_DOUBLE:
        t.add_link(u, v, per_link, "nvlink", links=2 if double else 1)
    for u, v in DGX1_SINGLE:
        t.add_link(u, v, per_link, "nvlink", links=1)
    if pcie or nics:
        add_pcie_tree(t, _DGX1_PCIE)
    if nics:
        for i in range(4):  # one 100 Gb/s EDR InfiniBand NIC per PCIe switch (whitepaper fig. 4)
            t.add_switch(f"nic{i}", "nic")
            t.add_link(f"nic{i}", f"pcie-switch-{i}", EDR_IB_GBPS, "pcie")
    return t


def dgx1p(*, pcie: bool = True, nics: bool = False) -> Topology:
    """DGX-1P (8x P100-SXM2): cube-mesh of 16 single NVLink1 links, 20 GB/s line rate each, 4 per GPU
    (``nvlink_gbps(1)`` achieved).

    Source: NVIDIA DGX-1 system architecture whitepaper (WP-08437-001), fig. 2; Blink (MLSys 2020),
    fig. 1. ``pcie=True`` adds the DGX-1 PCIe tree (see :func:`dgx1v`); ``nics=True`` adds its 4 NICs.
    """
    return _dgx1("dgx1p", nvlink_gbps(1), False, pcie, nics)


def dgx1v(*, pcie: bool = True, nics: bool = False) -> Topology:
    """DGX-1V (8x V100-SXM2): hybrid cube-mesh, 6 links per GPU of 25 GB/s line rate per direction
    (``nvlink_gbps(2)`` = 22.9 GB/s achieved).

    NVLink: double links 0-3, 0-4, 1-2, 1-5, 2-3, 4-7, 5-6, 6-7; single links 0-1, 0-2, 1-3, 2-6,
    3-7, 4-5, 4-6, 5-7. PCIe (``pcie=True``): GPUs {0,1}, {2,3} under ``pcie-switch-0/1`` on ``cpu0``,
    {4,5}, {6,7} under ``pcie-switch-2/3`` on ``cpu1``, gen3 x16 (12 GB/s), QPI between sockets
    (20 GB/s, see module docstring). ``nics=True`` adds one 100 Gb/s EDR NIC (12.5 GB/s line rate,
    ``EDR_IB_GBPS`` = 12.0 achieved) per switch.

    Source: NVIDIA DGX-1 V100 whitepaper (WP-08437-002), figs. 2 and 4; the real matrix
    ``tests/data/topologies/dgx1v_v100.txt``; Blink (MLSys 2020), fig. 1.
    """
    return _dgx1("dgx1v", nvlink_gbps(2), True, pcie, nics)


def _nvswitch_box(name: str, n: int, links: int, per_link: float) -> Topology:
    t = Topology(name)
    t.add_switch("nvswitch", "nvswitch")
    for g in range(n):
        t.add_gpu(g)
        t.add_link(g, "nvswitch", per_link, "nvswitch", links=links)
    return t


def dgx2() -> Topology:
    """DGX-2 (16x V100-SXM3) through NVSwitch: 6 links x 25 GB/s = 150 GB/s line rate per GPU per
    direction (6 x ``nvlink_gbps(2)`` = 137.4 achieved).

    The two baseboards' 12 NVSwitch chips form one non-blocking fabric, modelled as one node
    ``"nvswitch"``. Source: NVIDIA DGX-2 system architecture whitepaper (WP-09060-001).
    """
    return _nvswitch_box("dgx2", 16, 6, nvlink_gbps(2))


def dgx_a100() -> Topology:
    """DGX A100 (8x A100-SXM4) through NVSwitch: 12 links x 25 GB/s = 300 GB/s line rate per GPU per
    direction (12 x ``nvlink_gbps(3)`` = 208 achieved).

    Source: NVIDIA DGX A100 system architecture whitepaper (WP-10083-001); A100 NVLink3 is
    12 links at 25 GB/s per direction each.
    """
    return _nvswitch_box("dgx-a100", 8, 12, nvlink_gbps(3))


def dgx_h100() -> Topology:
    """DGX H100 (8x H100-SXM5) through NVSwitch: 18 links x 25 GB/s = 450 GB/s line rate per GPU per
    direction (18 x ``nvlink_gbps(4)`` = 370 achieved).

    Source: NVIDIA DGX H100 user guide / H100 Tensor Core GPU architecture whitepaper (NVLink4,
    18 links, 900 GB/s bidirectional); the real matrix ``tests/data/topologies/h100_sxm_nvswitch.txt``
    shows NV18 on every pair.
    """
    return _nvswitch_box("dgx-h100", 8, 18, nvlink_gbps(4))


def pcie_2socket(*, pcie_gbps: float = PCIE_GEN3_GBPS,
                 inter_socket_gbps: float = INTER_SOCKET_GBPS) -> Topology:
    """8 GPUs on PCIe only: two per PCIe switch, two switches per CPU socket, sockets joined.

    GPUs {0,1}, {2,3} on ``cpu0``; {4,5}, {6,7} on ``cpu1``. Gen3 x16 (12 GB/s) everywhere, the
    inter-socket link 20 GB/s (module docstring). Source: the real matrix
    ``tests/data/topologies/pcie_2socket_4switch.txt`` (PIX pairs, PHB, SYS; its origin is in that
    folder's README).
    """
    t = Topology("pcie-2socket")
    for g in range(8):
        t.add_gpu(g)
    add_pcie_tree(t, _DGX1_PCIE, pcie_gbps=pcie_gbps, inter_socket_gbps=inter_socket_gbps)
    return t


def multi_node(node: str | Topology, n_nodes: int, nic_gbps: float, nics_per_node: int = 1) -> Topology:
    """N copies of a node joined by NICs through one network fabric (Blink, MLSys 2020, section 5).

    Args:
      node: a preset name or a Topology whose GPUs are the node's devices.
      n_nodes: number of nodes (>= 1).
      nic_gbps: achieved GB/s per direction of each NIC (e.g. ``EDR_IB_GBPS`` = 12.0 for 100 Gb/s
        InfiniBand: 12.5 line rate x ``NET_EFFICIENCY``).
      nics_per_node: NICs per node (>= 1).

    Returns a Topology where node k's i-th GPU (in sorted order) is GPU ``k*G + i`` (G = GPUs per
    node), node k's switch ids are prefixed ``"n{k}-"``, and NIC ``"n{k}-nic{j}"`` (kind ``nic``)
    joins one ``"network"`` node (kind ``network``) by a ``net`` link of ``nic_gbps``. Each NIC hangs
    off the node's PCIe switches (round robin; else its CPUs; kind ``pcie``, ``nic_gbps``); a node
    without PCIe nodes attaches NIC j to GPUs ``i`` with ``i % nics_per_node == j`` (GPUDirect RDMA).

    Raises TopologyError on an unknown preset, a node without GPUs, or bad counts/bandwidths.
    """
    base = preset(node) if isinstance(node, str) else node
    if not isinstance(base, Topology):
        raise TopologyError(f"multi_node: node must be a preset name or a Topology, got {node!r}")
    if isinstance(n_nodes, bool) or not isinstance(n_nodes, int) or n_nodes < 1:
        raise TopologyError(f"multi_node: n_nodes must be an int >= 1, got {n_nodes!r}")
    if isinstance(nics_per_node, bool) or not isinstance(nics_per_node, int) or nics_per_node < 1:
        raise TopologyError(f"multi_node: nics_per_node must be an int >= 1, got {nics_per_node!r}")
    try:
        ok = float(nic_gbps) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TopologyError(f"multi_node: nic_gbps must be > 0 GB/s, got {nic_gbps!r}")
    gpus = base.gpus
    if not gpus:
        raise TopologyError(f"multi_node: node topology {base.name!r} has no GPUs")
    G = len(gpus)
    pcie_nodes = [s for s in base.switches if base.kind(s) == "pcie-switch"]
    attach_to = pcie_nodes or [s for s in base.switches if base.kind(s) == "cpu"]
    t = Topology(f"{n_nodes}x{base.name}")
    t.add_switch("network", "network")
    for k in range(n_nodes):
        rename = {g: k * G + i for i, g in enumerate(gpus)}
        rename.update({s: f"n{k}-{s}" for s in base.switches})
        for n, data in base.graph.nodes(data=True):
            attrs = {a: v for a, v in data.items() if a != "kind"}
            if data["kind"] == "gpu":
                t.add_gpu(rename[n], **attrs)
            else:
                t.add_switch(rename[n], data["kind"], **attrs)
        for u, v, d in base.graph.edges(data=True):
            t.graph.add_edge(rename[u], rename[v], **d)
        for j in range(nics_per_node):
            nic = f"n{k}-nic{j}"
            if nic in t.graph:
                raise TopologyError(f"multi_node: node {base.name!r} already has a switch named 'nic{j}'")
            t.add_switch(nic, "nic")
            t.add_link(nic, "network", nic_gbps, "net")
            if attach_to:
                t.add_link(nic, rename[attach_to[j * len(attach_to) // nics_per_node]], nic_gbps, "pcie")
            else:
                for i in range(G):
                    if i % nics_per_node == j:
                        t.add_link(nic, k * G + i, nic_gbps, "pcie")
    return t


def dgx1v_4node() -> Topology:
    """4 DGX-1V nodes, one 100 Gb/s EDR InfiniBand NIC (``EDR_IB_GBPS``, 12.0 GB/s achieved) each,
    through one network.

    Source: Blink (MLSys 2020), section 5/6 multi-server setting (DGX-1 class servers over
    InfiniBand); NIC rate from the DGX-1 whitepaper (EDR IB).
    """
    t = multi_node("dgx1v", 4, EDR_IB_GBPS, 1)
    t.name = "dgx1v-4node"
    return t


PRESETS: dict[str, Callable[[], Topology]] = {
    "dgx1p": dgx1p,
    "dgx1p-nvlink": lambda: dgx1p(pcie=False),
    "dgx1v": dgx1v,
    "dgx1v-nvlink": lambda: dgx1v(pcie=False),
    "dgx1v-nics": lambda: dgx1v(nics=True),
    "dgx2": dgx2,
    "dgx-a100": dgx_a100,
    "dgx-h100": dgx_h100,
    "pcie-2socket": pcie_2socket,
    "dgx1v-4node": dgx1v_4node,
}
"""Preset name -> zero-argument constructor. Underscore spellings and ``host<N>`` are accepted by
:func:`preset`."""

_HOST_RE = re.compile(r"host(\d+)")
#: "<N>x<preset>" or "<N>x<preset>-<k>nic": N nodes of a preset, k EDR NICs each (:func:`multi_node`)
_CLUSTER_RE = re.compile(r"(\d+)x(.+?)(?:-(\d+)nics?)?")


def preset(name: str) -> Topology:
    """Build the preset ``name`` (``PRESETS`` key; ``_`` may replace ``-``; ``host<N>`` gives
    ``Topology.host(N)``; ``<N>x<preset>[-<k>nic]`` gives ``multi_node(preset, N, EDR_IB_GBPS, k)``,
    e.g. ``128xdgx1v``: 1,024 GPUs). Raises TopologyError naming the known presets when unknown."""
    if not isinstance(name, str):
        raise TopologyError(f"preset names are strings, got {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key in PRESETS:
        return PRESETS[key]()
    m = _HOST_RE.fullmatch(key)
    if m:
        n = int(m.group(1))
        if not 1 <= n <= model.MAX_HOST_DEVICES:
            raise TopologyError(f"preset {name!r}: host<N> takes N host CPU devices in 1..{model.MAX_HOST_DEVICES} "
                                f"(e.g. host8), got N={n}")
        return Topology.host(n)
    c = _CLUSTER_RE.fullmatch(key)
    if c and c.group(2) in PRESETS and int(c.group(1)) >= 1:
        t = multi_node(c.group(2), int(c.group(1)), EDR_IB_GBPS, int(c.group(3) or 1))
        t.name = key
        return t
    raise TopologyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}, host<N>, and clusters "
                        f"<N>x<preset>[-<k>nic] (e.g. 16xdgx1v, 128xdgx-h100-8nic: N nodes, k EDR NICs each)")


def is_preset(name: str) -> bool:
    """True when ``name`` is shaped as a preset name (:func:`preset` accepts it or, for ``host<N>`` with
    N out of range, refuses it saying the range)."""
    if not isinstance(name, str):
        return False
    key = name.strip().lower().replace("_", "-")
    m = _HOST_RE.fullmatch(key)
    c = _CLUSTER_RE.fullmatch(key)
    return key in PRESETS or bool(m) or bool(
        c and c.group(2) in PRESETS and int(c.group(1)) >= 1 and int(c.group(3) or 1) >= 1)


model.register_source("preset", preset)
