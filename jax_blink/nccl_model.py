"""NCCL's tuner as a model: which algorithm x protocol NCCL runs for a collective, and its time.

The facts are NCCL's own, from ``src/graph/tuning.cc`` of NVIDIA/nccl (master, version 2.30.7,
``makefiles/version.mk``): ``ncclTopoTuneModel`` fills a bandwidth and a latency per collective x
algorithm x protocol, ``ncclTopoGetAlgoTime`` times a call as ``latency + bytes / bandwidth`` and the
least time wins. The tables copied here keep NCCL's names:

- ``baseLatencies`` (us, per algorithm x protocol) and ``hwLatencies`` (us, per hardware kind NVLink /
  PCI / NET x algorithm x protocol): :data:`BASE_LATENCIES`, :data:`HW_LATENCIES`;
- per-channel bandwidth caps (GB/s) per compute-capability index (Volta, Ampere, Hopper, Blackwell) x
  node-count index (1, 2, more nodes): ``llMaxBws`` (:data:`LL_MAX_BWS`), ``perChMaxRingLL128Bws``,
  ``perChMaxTreeLL128Bws``, ``perChMaxTreeBws``, ``perChMaxNVLSTreeBws``;
- ``nvlsEfficiency`` per compute capability (:data:`NVLS_EFFICIENCY`) and ``treeCorrectionFactor``
  (per protocol x log2(bytes / 64)).

Algorithms: ring and tree on every machine; NVLS (in-switch reduction over NVSwitch multicast) inside
one node and NVLSTree across nodes, only where an NVSwitch exists and the GPUs are Hopper or newer
(NCCL's search skips the NVLS pattern otherwise: ``src/graph/search.cc``, ``ncclTopoCompute``); PAT for
all-gather / reduce-scatter with one GPU per node (``ncclPatEnable``). CollNet is not modelled (NCCL
disables it unless the network plugin offers it). Protocols LL, LL128 and Simple; NVLS and PAT run
Simple only; LL128 only where NCCL enables it by default (NVLink inside a node: ``typeIntra <= PATH_NVB``).

What NCCL's topology search gives the tuner (channel count and per-channel GB/s of each graph) is
modelled from a :class:`~jax_blink.topology.Topology`: the ring / tree graph's total is the busbw of
NCCL's rings on the topology's links (:func:`jax_blink.planner.rings.nccl_ring_plan`, achieved rates),
quantised the way ``ncclTopoCompute`` does (a per-channel speed from ``speedArrayIntra`` /
``sm90SpeedArrayIntra`` / ``sm100SpeedArrayIntra``, as many channels as fit, lower speeds tried while
above 0.49 of the best found, then ``ncclTopoDupChannels``); the NVLS graph has one channel per GPU
(``NCCL_MAX_NVLS_ARITY`` >= 8) at the fastest speed whose channels fit a GPU's NVSwitch bandwidth
(the head of each channel pulls twice).
The GPU generation is read from the NVLink rate per link (:func:`gpu_generation`).

Units: bytes, microseconds, GB/s (1e9 B/s; ``bytes / (1000 * GB/s)`` is microseconds). Sizes follow
NCCL's (and jax_blink's) convention: all-reduce, broadcast, reduce: the operand; all-gather: the
gathered output; reduce-scatter: the input.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from .planner import rings, threephase

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce")
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("LL", "LL128", "Simple")
#: Compute-capability index of NCCL's tables (``NCCL_VOLTA_COMPCAP_IDX`` ...).
GENERATIONS = ("volta", "ampere", "hopper", "blackwell")
_HW = ("nvlink", "pci", "net")

# tuning.cc, ncclTunerConstantsDefaults.baseLatencies [algorithm][protocol] (us)
BASE_LATENCIES = {
    "tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet_direct": (0, 0, 0), "collnet_chain": (0, 0, 0),
    "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (8.0, 8.0, 8.0),
}
# tuning.cc, ncclTunerConstantsDefaults.hwLatencies [hw][algorithm][protocol] (us)
HW_LATENCIES = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25), "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31),
            "collnet_chain": (0, 0, 30), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9), "pat": (0, 0, 14)},
}
# tuning.cc, llMaxBws [index1][nodes index]: index1 is the GPU generation inside one node, the CPU
# kind across nodes (0 Intel, 1 AMD).
LL_MAX_BWS = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (2 * 141.0, 2 * 45.0, 2 * 35.0))
PER_CH_MAX_RING_LL128_BWS = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
PER_CH_MAX_TREE_LL128_BWS = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE_BWS = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE_BWS = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
#: tuning.cc, nvlsEfficiency (Volta, Ampere, Hopper, Blackwell).
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
#: tuning.cc, treeCorrectionFactor [protocol][log2(bytes / 64)], 64 B .. 256 MiB.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
# src/graph/search.cc: per-channel speeds the search tries, by generation (pre-Hopper, sm90, sm100).
SPEED_ARRAY_INTRA = {"volta": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
                     "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
                     "blackwell": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)}
SPEED_ARRAY_INTRA["ampere"] = SPEED_ARRAY_INTRA["volta"]
#: MAXCHANNELS / 2 channels for rings and trees (src/include/device.h MAXCHANNELS = 64).
MAX_CHANNELS = 32
#: NVLS algorithms need at least this many channels (tuning.cc: "NVLS/NVLStree needs at least 2 channels").
NVLS_MIN_CHANNELS = 2
#: tuning.cc getNetOverhead: 1 us per network post on Intel x86 (2 on AMD), x3 for Simple.
NET_OVERHEAD_US = 1.0

# Achieved GB/s per NVLink by generation (jax_blink.topology.presets.nvlink_gbps): V100 22.9, A100 17.3,
# H100 20.6, B200 41.1, P100 18.3; the nearest one names the GPU generation.
_NVLINK_GEN = {1: "volta", 2: "volta", 3: "ampere", 4: "hopper", 5: "blackwell"}
# PCIe generation of a GPU's link (12 GB/s gen3, 24 gen4, 48 gen5) -> GPU generation, without NVLink.
_PCIE_GEN = ((36.0, "hopper"), (18.0, "ampere"), (0.0, "volta"))


@dataclasses.dataclass(frozen=True)
class Graph:
    """What NCCL's topology search gives the tuner for one algorithm: ``channels`` x ``bw_intra`` GB/s
    per channel inside a node, ``bw_inter`` GB/s per channel across nodes, and whether the intra-node
    hops are NVLink (``nvlink``; else PCI)."""

    channels: int
    bw_intra: float
    bw_inter: float
    nvlink: bool


@dataclasses.dataclass(frozen=True)
class System:
    """A communicator as NCCL's tuner sees it.

    Attributes:
      nranks: GPUs in the communicator; nnodes: nodes they span (ranks split evenly).
      generation: one of :data:`GENERATIONS` (the compute-capability index of NCCL's tables).
      ring: the ring (and tree) :class:`Graph`; nvls: the NVLS graph, or None (no NVSwitch multicast).
      amd_cpu: the hosts' CPUs are AMD (NCCL's ``llMaxBws`` row across nodes and net overhead).
    """

    nranks: int
    nnodes: int
    generation: str
    ring: Graph
    nvls: Graph | None = None
    amd_cpu: bool = False

    def __post_init__(self):
        if self.nranks < 1 or self.nnodes < 1 or self.nranks % self.nnodes:
            raise ValueError(f"nccl_model.System: {self.nranks} ranks over {self.nnodes} nodes must split evenly")
        if self.generation not in GENERATIONS:
            raise ValueError(f"nccl_model.System: generation must be one of {GENERATIONS}, got {self.generation!r}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """NCCL's choice for one call: ``algorithm`` x ``protocol`` (the least tuner time), the tuner's
    ``time_us`` for it (us; :func:`algo_time_us`), its ``latency_us`` and ``bandwidth_gbps`` (the
    tuner's algorithm bandwidth after the size corrections), ``steady_us`` (the same call without
    ``baseLatencies``: what one of a stream of back-to-back calls costs, as nccl-tests times it; see
    :func:`algo_time_us`), ``busbw_gbps`` (nccl-tests' bus bandwidth at ``steady_us``) and the runner-up
    (``next``: (algorithm, protocol, time_us), or None)."""

    collective: str
    nbytes: int
    algorithm: str
    protocol: str
    time_us: float
    latency_us: float
    bandwidth_gbps: float
    steady_us: float
    busbw_gbps: float
    next: tuple | None = None

    def describe(self) -> str:
        nxt = f"; next {self.next[0]}/{self.next[1]} {self.next[2]:.1f} us" if self.next else ""
        return (f"NCCL's tuner: {self.algorithm}/{self.protocol} {self.time_us:.1f} us "
                f"({self.steady_us:.1f} us back to back, busbw {self.busbw_gbps:.0f} GB/s{nxt})")


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def nsteps(collective: str, nranks: int) -> int:
    """NCCL's ring steps: all-reduce 2 (n - 1), all-gather / reduce-scatter n - 1, else n."""
    if collective == "allreduce":
        return 2 * (nranks - 1)
    if collective in ("allgather", "reducescatter"):
        return nranks - 1
    return nranks


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw: all-reduce 2 (n - 1) / n, all-gather / reduce-scatter (n - 1) / n,
    broadcast / reduce 1 (nccl-tests ``doc/PERFORMANCE.md``)."""
    if collective == "allreduce":
        return 2 * (nranks - 1) / nranks
    if collective in ("allgather", "reducescatter"):
        return (nranks - 1) / nranks
    return 1.0


def _tables(system: System) -> dict:
    """(latency us, busBw GB/s as the tuner's algorithm bandwidth) per (collective, algorithm,
    protocol) NCCL enables: ``ncclTopoTuneModel``'s loops, for this system."""
    n, nodes = system.nranks, system.nnodes
    cc = GENERATIONS.index(system.generation)
    idx2 = nodes - 1 if nodes <= 2 else 2
    idx1 = cc if nodes == 1 else (1 if system.amd_cpu else 0)
    ll_max = LL_MAX_BWS[idx1][idx2]
    tree_max = PER_CH_MAX_TREE_BWS[cc][idx2]
    ring_ll128_max = PER_CH_MAX_RING_LL128_BWS[cc][idx2]
    tree_ll128_max = PER_CH_MAX_TREE_LL128_BWS[cc][idx2]
    nvls_tree_max = PER_CH_MAX_NVLS_TREE_BWS[cc][idx2]
    ppn = n / nodes
    out = {}
    for coll in COLLECTIVES:
        steps = nsteps(coll, n)
        for a in ("tree", "ring", "nvls", "nvls_tree", "pat"):
            if coll in ("broadcast", "reduce") and a != "ring":
                continue
            if coll in ("allgather", "reducescatter") and a not in ("pat", "ring", "nvls"):
                continue
            if coll == "allreduce" and a == "pat":
                continue
            if a == "pat" and (nodes != n or n < 2):  # PAT: one GPU per node only (ncclPatEnable)
                continue
            if a == "nvls" and nodes > 1:  # NVLS across nodes needs CollNet (disabled)
                continue
            if a == "nvls_tree" and nodes == 1:  # "Disable NVLS Tree on a single node"
                continue
            graph = system.nvls if a in ("nvls", "nvls_tree") else system.ring
            if graph is None or graph.channels == 0:
                continue
            intra_hw = "nvlink" if graph.nvlink else "pci"
            for p, proto in enumerate(PROTOCOLS):
                if a in ("nvls", "nvls_tree", "pat") and proto != "Simple":
                    continue
                if proto == "LL128" and not graph.nvlink:  # LL128 on by default only up to PATH_NVB
                    continue
                bw = graph.bw_intra if nodes <= 2 else graph.bw_inter
                if a in ("nvls", "nvls_tree"):
                    if graph.channels < NVLS_MIN_CHANNELS:
                        continue
                    intra = graph.bw_intra * NVLS_EFFICIENCY[cc] * (graph.channels - 1) / graph.channels
                    intra *= 2.0 if coll == "allreduce" else (ppn - 1) / ppn
                    inter = graph.bw_inter * (2 if nodes <= 2 and a == "nvls_tree" else 1)
                    bw = min(intra, inter if nodes > 1 else math.inf, nvls_tree_max if a == "nvls_tree" else math.inf)
                bus = graph.channels * bw
                if a == "ring" and proto == "LL":
                    bus = min(ll_max, bus * .5)
                if a == "ring" and proto == "LL128":
                    bus = min(bus * 0.92, graph.channels * ring_ll128_max)
                if a == "tree" and coll == "allreduce":
                    bus = min(bus * .92, graph.channels * tree_max)
                if a == "tree" and proto == "LL":
                    bus = min(bus / 3.8, ll_max)
                if a == "tree" and proto == "LL128":
                    bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), graph.channels * tree_ll128_max)
                if a == "pat":
                    bus *= .75
                if bus <= 0:
                    continue
                if not (a != "ring" and coll in ("allgather", "reducescatter")):  # bus BW -> algorithm BW
                    bus *= n / steps if a in ("ring", "nvls", "nvls_tree") else .5
                lat = BASE_LATENCIES[a][p]
                intra_lat = HW_LATENCIES[intra_hw][a][p]
                inter_lat = HW_LATENCIES["net"]["tree" if ppn == 1 else a][p]
                if a == "ring":
                    hw = intra_hw if nodes == 1 else "net"
                    if coll in ("broadcast", "reduce"):
                        lat += HW_LATENCIES[hw][a][p]  # one channel set (graph->sameChannels)
                    else:
                        over = 0.0
                        if nodes > 1:
                            over = NET_OVERHEAD_US * (2 if system.amd_cpu else 1) * (3 if proto == "Simple" else 1)
                        intra_lat = max(intra_lat, over)
                        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if coll == "allreduce" else nodes - 1)
                        lat += (steps - inter_steps) * intra_lat + inter_steps * inter_lat
                elif a == "tree":
                    if coll == "allreduce":
                        lat += 2 * ((n // nodes - 1) * intra_lat + _log2i(nodes) * inter_lat)
                elif a == "nvls":
                    lat = intra_lat + (inter_lat if nodes > 1 else 0.0)
                elif a == "nvls_tree":
                    lat += intra_lat + 2 * _log2i(nodes) * inter_lat
                elif a == "pat":
                    lat += _log2i(nodes) * (inter_lat / 3.5) + n * 2.8
                out[(coll, a, proto)] = (lat, bus)
    return out


@functools.lru_cache(maxsize=256)
def _cached_tables(system: System) -> dict:
    return _tables(system)


def _corrected(system: System, collective: str, algorithm: str, protocol: str, nbytes: float):
    """(latency us, GB/s) of one enabled pair after ``ncclTopoGetAlgoTime``'s corrections, or None."""
    entry = _cached_tables(system).get((collective, algorithm, protocol))
    if entry is None:
        return None
    lat, bw = entry
    log_size = _log2i(int(nbytes) >> 6) if int(nbytes) >> 6 else -1
    if algorithm == "tree" and collective == "allreduce" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[PROTOCOLS.index(protocol)][log_size]
    if (algorithm == "ring" and protocol == "Simple" and system.nnodes > 1 and collective == "allreduce"
            and nbytes / (system.ring.channels * system.nranks) >= 64):
        lat *= 1.4 if GENERATIONS.index(system.generation) >= 1 else 1.9
    return lat, bw


def algo_time_us(system: System, collective: str, algorithm: str, protocol: str, nbytes: float, *,
                 steady: bool = False) -> float | None:
    """``ncclTopoGetAlgoTime``: microseconds of ``algorithm`` x ``protocol`` for ``nbytes``
    (``latency + nbytes / (1000 * GB/s)``), or None when NCCL does not enable that pair here. Tree
    all-reduce takes ``treeCorrectionFactor``; a multi-node Simple ring all-reduce pays the plateau
    factor (1.4 from Ampere, 1.9 before).

    ``steady``: leave out ``baseLatencies`` (the per-call part of NCCL's latency). nccl-tests issues
    its calls back to back, and published small-message times match the hardware part alone: 4 H800 on
    NVLink, 1 KiB ring all-reduce 3.5 us (NVIDIA/nccl#1984) against 6 x 0.6 = 3.6 us here, where
    the full estimate says 10.2 us (``benchmarks/nccl_model.py``)."""
    got = _corrected(system, collective, algorithm, protocol, nbytes)
    if got is None:
        return None
    lat, bw = got
    if steady:
        lat = max(0.0, lat - BASE_LATENCIES[algorithm][PROTOCOLS.index(protocol)])
    return lat + nbytes / (1000.0 * bw)


def choose(system: System, collective: str, nbytes: float, *, algorithms=None) -> Choice:
    """NCCL's choice for ``collective`` of ``nbytes`` bytes (module docstring's convention): the least
    :func:`algo_time_us` over the enabled algorithm x protocol pairs (NCCL's order wins ties).
    ``algorithms``: only these (as ``NCCL_ALGO=ring`` restricts NCCL). Raises ValueError for an
    unknown collective or algorithm, a negative size, a one-rank system or no enabled pair."""
    if collective not in COLLECTIVES:
        raise ValueError(f"nccl_model.choose: collective must be one of {COLLECTIVES}, got {collective!r}")
    if not nbytes >= 0:
        raise ValueError(f"nccl_model.choose: nbytes must be >= 0, got {nbytes!r}")
    if system.nranks < 2:
        raise ValueError("nccl_model.choose: a one-rank communicator runs no collective")
    allowed = ALGORITHMS if algorithms is None else tuple(algorithms)
    bad = [a for a in allowed if a not in ALGORITHMS]
    if bad:
        raise ValueError(f"nccl_model.choose: unknown algorithm(s) {bad}; expected some of {ALGORITHMS}")
    timed = []
    for a in allowed:
        for p in PROTOCOLS:
            t = algo_time_us(system, collective, a, p, nbytes)
            if t is not None:
                timed.append((t, ALGORITHMS.index(a), PROTOCOLS.index(p), a, p))
    if not timed:
        raise ValueError(f"nccl_model.choose: NCCL enables none of {allowed} for {collective} here")
    timed.sort()
    t, _, _, a, p = timed[0]
    lat, bw = _corrected(system, collective, a, p, nbytes)
    steady = algo_time_us(system, collective, a, p, nbytes, steady=True)
    algbw = nbytes / (1000.0 * steady) if steady > 0 else math.inf
    nxt = (timed[1][3], timed[1][4], timed[1][0]) if len(timed) > 1 else None
    return Choice(collective, int(nbytes), a, p, t, lat, bw, steady, algbw * bus_factor(collective, system.nranks),
                  nxt)


# ------------------------------------------------------------------------------ from a Topology
def gpu_generation(topology, devices=None) -> str | None:
    """The GPU generation (:data:`GENERATIONS`) of ``devices`` of ``topology``: from the achieved GB/s
    per NVLink (the nearest of :func:`jax_blink.topology.presets.nvlink_gbps`'s generations), else from
    the PCIe rate of a GPU's link (gen5 Hopper, gen4 Ampere, gen3 Volta); None for a topology of host
    CPU devices (no NVLink, NVSwitch or PCIe links: no NCCL)."""
    from .topology import presets
    devices = list(topology.gpus if devices is None else devices)
    g = topology.graph
    per_link, pcie = [], []
    for d in devices:
        for _, _, e in g.out_edges(d, data=True):
            if e.get("kind") in ("nvlink", "nvswitch"):
                per_link.append(e["bandwidth_gbps"] / max(1, e.get("links", 1)))
            elif e.get("kind") == "pcie":
                pcie.append(e["bandwidth_gbps"])
    if per_link:
        rate = sorted(per_link)[len(per_link) // 2]
        gen = min(presets.NVLINK_LINE_GBPS, key=lambda k: abs(presets.nvlink_gbps(k) - rate))
        return _NVLINK_GEN[gen]
    if pcie:
        rate = max(pcie)
        return next(name for floor, name in _PCIE_GEN if rate >= floor)
    return None


def _quantise(total: float, generation: str, nvlink: bool) -> tuple[int, float]:
    """(channels, GB/s per channel) of NCCL's search for rings of ``total`` GB/s per GPU: the speed of
    ``speedArrayIntra`` (by generation) with the most channels x speed that fit (the first such),
    then ``ncclTopoDupChannels`` (double the channels at half the speed when a channel runs >= 25 GB/s;
    from Hopper not below 50 GB/s with more than 4 channels)."""
    speeds = [s for s in SPEED_ARRAY_INTRA[generation] if s <= total + 1e-9]
    if not speeds:  # slower than the slowest speed: one channel at the rate there is
        return 1, total
    best = (0, 0.0)
    for s in speeds:  # lower speeds while the next is above 0.49 of the best found (ncclTopoCompute)
        if best[0] and s / best[1] <= .49:
            break
        k = min(MAX_CHANNELS, int(total / s + 1e-9))
        if k * s > best[0] * best[1] + 1e-9:
            best = (k, s)
    k, s = best
    cc = GENERATIONS.index(generation)
    if s >= 25.0 and not (cc >= 2 and s < 50.0 and k > 4):
        k2 = min(2 * k, MAX_CHANNELS)
        s = s / math.ceil(k2 / k)
        k = k2
    return k, s


def _all_nvlink(topology, plan) -> bool:
    """Whether every hop of ``plan``'s trees is an NVLink or NVSwitch link (NCCL's ``typeIntra == LINK_NVL``)."""
    g = topology.graph
    return all(g.edges[u, v].get("kind") in ("nvlink", "nvswitch")
               for t in plan.trees for u, v in t.edges + (t.reduce_edges or ()))


def _nvswitch_gbps(topology, d) -> float:
    return sum(e["bandwidth_gbps"] for _, _, e in topology.graph.out_edges(d, data=True) if e.get("kind") == "nvswitch")


@functools.lru_cache(maxsize=64)
def _system(topology, devices: tuple, generation: str | None) -> System | None:
    gen = generation or gpu_generation(topology, devices)
    if gen is None:
        return None
    nodes = threephase.node_groups(topology, list(devices))
    if len({len(x) for x in nodes}) != 1:
        raise ValueError(f"nccl_model: the devices lie unevenly over {len(nodes)} nodes "
                         f"({[len(x) for x in nodes]} GPUs); NCCL's tuner assumes equal nodes")
    node = list(nodes[0])
    ppn = len(node)
    net = {n for n, k in topology.graph.nodes(data="kind") if k == "network"}
    if ppn > 1:
        local = topology.subset(node) if len(nodes) > 1 else topology
        ring = rings.nccl_ring_plan(local, "allreduce", devices=node)
        intra = ring.rate_gbps * bus_factor("allreduce", ppn)
        nvlink = _all_nvlink(local, ring)
    else:
        intra, nvlink = math.inf, True
    inter = math.inf
    if len(nodes) > 1:  # a node's NICs into the network, per node
        inter = sum(e["bandwidth_gbps"] for u, v, e in topology.graph.edges(data=True)
                    if v in net and u not in net) / len(nodes)
    total = min(intra, inter)
    k, s = _quantise(total, gen, nvlink)
    ring_graph = Graph(k, s, s, nvlink)
    nvls = None
    has_switch = ppn > 1 and all(_nvswitch_gbps(topology, d) > 0 for d in node)
    if has_switch and GENERATIONS.index(gen) >= 2:
        gpu_bw = min(_nvswitch_gbps(topology, d) for d in node)
        speeds = SPEED_ARRAY_INTRA[gen]
        s_nvls = next((x for x in speeds if (ppn + 1) * x <= gpu_bw + 1e-9), speeds[-1])
        per_ch_inter = inter / ppn if len(nodes) > 1 else s_nvls
        nvls = Graph(ppn, s_nvls, per_ch_inter, True)
    return System(len(devices), len(nodes), gen, ring_graph, nvls)


def system(topology, devices=None, *, generation: str | None = None) -> System | None:
    """The :class:`System` NCCL's tuner sees for ``devices`` (default every GPU) of ``topology``, or None
    for host CPU devices (no NCCL there). ``generation`` overrides :func:`gpu_generation`. Raises
    ValueError when the devices lie unevenly over nodes."""
    devices = tuple(topology.gpus if devices is None else devices)
    return _system(topology, devices, generation)


def predict(topology, collective: str, nbytes: float, *, devices=None, generation: str | None = None,
            algorithms=None) -> Choice | None:
    """NCCL's :class:`Choice` for ``collective`` of ``nbytes`` bytes over ``devices`` of ``topology``
    (:func:`system` then :func:`choose`, ``algorithms`` as there), or None where NCCL does not run
    (host CPU devices) or on one device. Raises ValueError as :func:`choose`."""
    s = system(topology, devices, generation=generation)
    if s is None or s.nranks < 2:
        return None
    return choose(s, collective, nbytes, algorithms=algorithms)
