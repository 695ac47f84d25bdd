"""Machine presets: real interconnects with their sources (filled out by the topology work)."""

from __future__ import annotations

from .topology import Topology

# DGX-1V hybrid cube-mesh, from NVIDIA's DGX-1 V100 system architecture whitepaper (WP-08437-002)
# and the nvidia-smi topo -m of a real box (shared/topologies/dgx1v_v100.txt).
DGX1_DOUBLE = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)]
DGX1_SINGLE = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)]


def dgx1v() -> Topology:
    """DGX-1V (8x V100-SXM2): NVLink2 25 GB/s per link per direction, 6 links per GPU."""
    t = Topology("dgx1v")
    for g in range(8):
        t.add_gpu(g)
    for u, v in DGX1_DOUBLE:
        t.add_link(u, v, 25.0, "nvlink", links=2)
    for u, v in DGX1_SINGLE:
        t.add_link(u, v, 25.0, "nvlink", links=1)
    return t


PRESETS = {"dgx1v": dgx1v}
