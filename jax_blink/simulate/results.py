"""What a simulation returns (:class:`SimResult`, nccl-tests' bus bandwidth) and the constants of the
model: the per-send latency, the protocol latency of each link kind, the host staging rate, chunk bounds."""

from __future__ import annotations

import dataclasses

from .. import collectives as _collectives

DEFAULT_LATENCY_US = 2.0

#: Per-chunk protocol latency in microseconds by link kind, paid once per GPU-to-GPU send for the
#: slowest kind on its route (net > pcie/host > nvlink/nvswitch). Source: NCCL src/graph/tuning.cc,
#: ``hwLat`` for the ring algorithm and the LL protocol (NVLink 0.6, PCI 1.0, network 2.7 us per step).
PROTOCOL_LATENCY_US = {"nvlink": 0.6, "nvswitch": 0.6, "pcie": 1.0, "host": 1.0, "net": 2.7}

#: GB/s of one CPU socket's host-memory staging path, shared by every copy staged through it (both
#: the GPU -> host and the host -> GPU copy of each send). Calibrated: 2x RTX 2080 Ti on one PCIe
#: switch without peer access reach an all-reduce busbw of 4.0 GB/s (Anthony-Hoo.github.io,
#: posts/AutoDL_Multi-GPU_Interconnection_Test.md); that all-reduce stages 2S bytes of sends, each
#: written to and read from host memory, so 4S bytes cross the path in S / 4.0 GB/s seconds.
HOST_STAGING_GBPS = 16.0
_HOST_MEMORY = "host-memory"  # first element of the virtual staging queue's key (_HOST_MEMORY, cpu)
_KIND_ORDER = ("nvswitch", "nvlink", "host", "pcie", "net")
DEFAULT_MAX_CHUNKS = 64
CHUNK_BUDGET = 2048  # default chunking keeps about this many chunks per plan (simulation cost)
COLLECTIVES = tuple(_collectives.COLLECTIVES)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated collective.

    Attributes:
      collective: "allreduce" | "broadcast" | "reduce" | "allgather" | "reducescatter".
      algorithm: the plan's algorithm ("trees", "ring", "double-binary-tree", "schedule", ...).
      nranks: number of GPUs taking part.
      nbytes: bytes per rank (the operand size S; all-gather / reduce-scatter: the full buffer, n shards).
      time_s: completion time of the last message, seconds (0.0 for one GPU).
      algbw_gbps: S / time_s in GB/s (inf for one GPU).
      busbw_gbps: nccl-tests bus bandwidth in GB/s (algbw * :func:`busbw_factor`).
      link_bytes: {(u, v): bytes carried} per directed physical edge that carried data.
      link_util: {(u, v): busy time / time_s} per directed physical edge of the topology (0..1).
      messages: number of chunk transfers simulated.
    """

    collective: str
    algorithm: str
    nranks: int
    nbytes: float
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    link_bytes: dict
    link_util: dict
    messages: int


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor (``collectives.Collective.busbw_factor``): 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and reduce."""
    return _collectives.get(collective).busbw_factor(n)
