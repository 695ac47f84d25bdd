"""Detect the machine's topology: NVML, then ``nvidia-smi topo -m``.

:func:`detect` reads NVML through nvidia-ml-py (``pip install jax-blink[nvml]``): every active
NVLink's remote PCI bus id (a GPU, or an NVSwitch), the NVLink version (-> per-link GB/s), the PCIe
common ancestor of each GPU pair (the same PIX/PXB/PHB/NODE/SYS levels nvidia-smi prints), the
peer-to-peer read status and the NUMA node. The pairwise relations go through the same model builder
as the ``nvidia-smi topo -m`` parser (:func:`jax_blink.topology.nvsmi.build_topology`), so both readings of a
machine agree. GPU ids are NVML indices (PCI bus order); an integer ``CUDA_VISIBLE_DEVICES`` list is
applied (those GPUs, renumbered 0..k-1 in the listed order), as CUDA numbers them with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import networkx as nx

from ..errors import TopologyError
from . import model
from .model import HOW_TO_PASS, Topology
from .ncclxml import normalise_busid
from .nvsmi import build_topology, parse_topo
from .presets import nvlink_gbps as _nvlink_rate

# NVLink version -> achieved GB/s per link per direction (presets.nvlink_gbps: line rate x efficiency).
NVLINK_VERSION_GBPS = {v: _nvlink_rate(v) for v in range(1, 6)}
# GPU model substring -> achieved GB/s per link per direction, when NVML does not report the version.
NVLINK_MODEL_GBPS = tuple((m, _nvlink_rate(v)) for m, v in (
    ("P100", 1), ("V100", 2), ("A100", 3), ("A800", 3), ("H100", 4), ("H200", 4), ("H800", 4), ("GH200", 4),
    ("B100", 5), ("B200", 5), ("GB200", 5), ("B300", 5)))
_NVML_LEVEL = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def detect(*, nvlink_gbps: float | None = None, pcie_gbps: float | None = None, inter_socket_gbps: float = 20.0,
           use_nvml: bool = True, use_nvidia_smi: bool = True, all_gpus: bool = False) -> Topology:
    """This machine's GPU topology.

    Tries NVML (nvidia-ml-py), then ``nvidia-smi topo -m`` (+ ``topo -p2p r``). ``nvlink_gbps``
    overrides the achieved per-link rate (default: from the NVLink version / GPU model).
    ``all_gpus``: every GPU of the machine in NVML numbering, ignoring ``CUDA_VISIBLE_DEVICES``
    (the host's topology that several processes, each with its own GPUs, share).
    Raises TopologyError when neither works, saying why each failed and how to pass a topology.
    """
    reasons = []
    visible = (lambda t: t) if all_gpus else _apply_visible_devices
    if use_nvml:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            reasons.append("NVML: nvidia-ml-py is not installed (pip install 'jax-blink[nvml]')")
        else:
            try:
                pynvml.nvmlInit()
            except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                reasons.append(f"NVML: cannot initialise ({err})")
            else:
                try:
                    return visible(
                        from_nvml(pynvml, nvlink_gbps=nvlink_gbps, pcie_gbps=pcie_gbps,
                                  inter_socket_gbps=inter_socket_gbps))
                except TopologyError as err:
                    reasons.append(f"NVML: {err}")
                finally:
                    try:
                        pynvml.nvmlShutdown()
                    except Exception:
                        pass
    if use_nvidia_smi:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            reasons.append("nvidia-smi: not on PATH")
        else:
            try:
                text = _run([exe, "topo", "-m"])
                try:
                    text += "\n$ nvidia-smi topo -p2p r\n" + _run([exe, "topo", "-p2p", "r"])
                except TopologyError:
                    pass  # older drivers lack -p2p: assume peer-to-peer works
                kw = {} if nvlink_gbps is None else {"nvlink_gbps": nvlink_gbps}
                return visible(parse_topo(text, pcie_gbps=pcie_gbps,
                                                         inter_socket_gbps=inter_socket_gbps,
                                                         name="detected", **kw))
            except TopologyError as err:
                reasons.append(f"nvidia-smi: {err}")
    raise TopologyError("could not detect the GPU topology (" + "; ".join(reasons or ["detection disabled"])
                        + "); " + HOW_TO_PASS)


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TopologyError(f"`{' '.join(cmd)}` failed: {err}") from None
    if out.returncode != 0:
        raise TopologyError(f"`{' '.join(cmd)}` exited {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


def _bus_key(bus) -> str:
    """Normalise a PCI bus id ('00000000:07:00.0' or b'0000:07:00.0') to '0000:07:00.0'."""
    if isinstance(bus, bytes):
        bus = bus.decode(errors="replace")
    return normalise_busid(bus, "PCI bus id")


def from_nvml(nvml, *, nvlink_gbps: float | None = None, pcie_gbps: float | None = None,
              inter_socket_gbps: float = 20.0) -> Topology:
    """Build the topology from an initialised NVML module (``pynvml``; any object with its API).

    Raises TopologyError when NVML reports no GPUs or a query fails.
    """
    Err = getattr(nvml, "NVMLError", Exception)
    try:
        n = int(nvml.nvmlDeviceGetCount())
        if n < 1:
            raise TopologyError("NVML reports no GPUs")
        hs = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        names = [nvml.nvmlDeviceGetName(h) for h in hs]
        names = [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in names]
        bus = {_bus_key(nvml.nvmlDeviceGetPciInfo(h).busId): i for i, h in enumerate(hs)}
        pcie, no_p2p, affinity = {}, set(), {}
        read = nvml.NVML_P2P_CAPS_INDEX_READ
        read = read[0] if isinstance(read, tuple) else read  # pynvml defines it as (0,)
        for i in range(n):
            for j in range(i + 1, n):
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(hs[i], hs[j]))
                pcie[frozenset((i, j))] = _NVML_LEVEL.get(level, "SYS")
                try:
                    if nvml.nvmlDeviceGetP2PStatus(hs[i], hs[j], read) != nvml.NVML_P2P_STATUS_OK:
                        no_p2p.add(frozenset((i, j)))
                except Err:
                    pass  # unknown: assume peer-to-peer works, as nvidia-smi without -p2p does
        for i, h in enumerate(hs):
            try:
                affinity[i] = ("NUMA", int(nvml.nvmlDeviceGetNumaNodeId(h)))
            except (Err, AttributeError):
                pass
        nvlinks, to_switch, versions = {}, {}, set()
        for i, h in enumerate(hs):
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _bus_key(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                except Err:
                    continue  # link absent on this GPU
                try:
                    versions.add(int(nvml.nvmlDeviceGetNvLinkVersion(h, link)))
                except Err:
                    pass
                j = bus.get(remote)
                if j is not None and j != i:
                    if i < j:  # count each pair from its lower end; the other end sees the same links
                        key = frozenset((i, j))
                        nvlinks[key] = nvlinks.get(key, 0) + 1
                else:
                    to_switch[i] = to_switch.get(i, 0) + 1
    except Err as err:
        raise TopologyError(f"NVML query failed: {err}") from None
    if nvlink_gbps is None:
        nvlink_gbps = _link_gbps(versions, names)
    return build_topology(n, [], pcie, nvlinks, no_p2p=no_p2p, affinity=affinity, nvlink_gbps=nvlink_gbps,
                          pcie_gbps=pcie_gbps, inter_socket_gbps=inter_socket_gbps,
                          nvswitch_links=to_switch, nvswitch=False, gpu=names[0], name="detected")


def _link_gbps(versions: set[int], names: list[str]) -> float:
    """Achieved per-link GB/s per direction from NVLink versions, else the GPU model name, else V100's."""
    if versions:
        return min(NVLINK_VERSION_GBPS.get(v, _nvlink_rate(2)) for v in versions)
    for sub, gbps in NVLINK_MODEL_GBPS:
        if any(sub in nm for nm in names):
            return gbps
    return _nvlink_rate(2)


def _apply_visible_devices(t: Topology) -> Topology:
    """Restrict to an integer ``CUDA_VISIBLE_DEVICES`` list, renumbered in the listed order."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or not env.strip():
        return t
    try:
        ids = [int(x) for x in env.split(",") if x.strip()]
    except ValueError:
        return t  # UUID / MIG forms: keep NVML numbering
    if ids and all(0 <= i < len(t.gpus) for i in ids) and len(set(ids)) == len(ids):
        sub = t.subset(ids)
        sub.graph = nx.relabel_nodes(sub.graph, {g: r for r, g in enumerate(ids)})
        sub.name = t.name
        return sub
    return t


model.register_source("detect", detect)
