"""Link-level event simulation of tree, ring and double-binary-tree collectives.

The model (an alpha-beta model per link, evaluated as a discrete event simulation):

* Every directed physical edge of the :class:`~jax_blink.topology.Topology` is a FIFO queue that
  serves one message at a time at its ``bandwidth_gbps`` (GB/s = 1e9 B/s; the link's achieved rate:
  line rate x the achieved fraction of its kind, set by the topology sources, see
  :mod:`jax_blink.topology.presets`). Switch, PCIe, CPU and host nodes are ordinary nodes, so transfers routed
  through them share their edges' capacity.
* The data of a plan is split across its trees in proportion to the tree weights (Blink, MLSys 2020,
  section 4.1) and each tree's segment is cut into chunks.
* A chunk crossing a GPU-level tree edge is one *message*. It crosses each physical edge of its
  route store-and-forward (a hop starts when the whole chunk has arrived and the edge is free) and,
  after its last hop, pays ``latency_us`` once (the alpha term of a GPU-to-GPU send) plus the
  per-chunk protocol latency of its route's slowest link kind (:data:`PROTOCOL_LATENCY_US`). That
  term delays the chunk but does not hold the links: the sender's next chunks are already queued
  (NCCL keeps NCCL_STEPS = 8 chunk slots in flight per connection for the same reason).
* Host staging: a send between GPUs without peer access (GPU node attribute ``no_p2p``, set by
  :mod:`jax_blink.topology.nvsmi` and NVML discovery from ``topo -p2p``) is two copies through host memory:
  GPU -> host memory over the sender's PCIe path to its CPU, then host memory -> GPU down the
  receiver's path. Each copy is its own send (it pays the latencies) and both pass the socket's
  host-memory staging queue (:data:`HOST_STAGING_GBPS`, shared by every staged copy of that socket,
  in both directions), as the CUDA driver's and NCCL's shared-memory transport stage them.
* Reduce: a GPU forwards chunk j to its parent when chunk j arrived from all its reduce children.
  Broadcast: a GPU forwards chunk j to its children when it holds chunk j. All-reduce: a tree's
  broadcast of chunk j starts at the root as soon as the root finished reducing chunk j, so chunks
  pipeline up and down every tree at once (Blink section 4.2).
* Messages are served in order of readiness; ties go to the earlier chunk, then creation order, so
  the simulation is deterministic.
* Engine: the event loop runs in native code (``jax_blink._native._linksim``, ffi/src/linksim.cc)
  over messages as arrays; a plan's are one chunk template per tree tiled by numpy, so neither cost
  grows with Python objects per chunk (about 0.65 us per message on one core: a 64-GPU cluster's
  258,000 messages in 0.17 s, 17x the Python loop; benchmarks/simulator.py). The Python event
  loop ``_run`` is its reference and runs where the module is not built; both give the same floats
  (tests/test_linksim.py).

Closed forms it reproduces exactly (tests/test_simulate.py; ``alpha`` = ``latency_us`` + the protocol
latency): one link ``S/B + alpha``; a pipelined chain broadcast of k chunks over n GPUs
``(k + n - 2) c/B + (n - 1) alpha``; an unpipelined ring all-reduce ``2(n-1) (S/(n B) + alpha)``
(Patarasuk & Yuan 2009; NCCL's ring); a send without peer access ``2 S/B + 2 S/H + 2 alpha`` over
PCIe links of B and the staging path H (tests/test_fidelity.py). Agreement with measured machines:
``benchmarks/fidelity.py``.

Bandwidth figures follow nccl-tests (doc/PERFORMANCE.md): ``algbw = S / t``; all-reduce
``busbw = algbw * 2(n-1)/n``; all-gather and reduce-scatter ``busbw = algbw * (n-1)/n`` (S the full
buffer); broadcast and reduce ``busbw = algbw``. All-gather broadcasts each shard down its owner's
trees; reduce-scatter reduces each shard up its owner's in-trees (phases from ``collectives.get``).

Modules, bottom to top: ``results`` (:class:`SimResult`, the model's constants), ``messages`` (a plan's
or schedule's sends as messages over physical hops, host staging, protocol latencies), ``events``
(the event engine: native ``_linksim`` bridge and the Python reference loop), ``flow`` (the
flow-level closed form), ``simulation`` (:func:`simulate`, which picks the model).
"""

from .flow import LINK_LEVEL_MAX_MESSAGES, flow_time, link_level_messages
from .messages import plan_chunks, tree_gpu_edges
from .results import (
    CHUNK_BUDGET,
    COLLECTIVES,
    DEFAULT_LATENCY_US,
    DEFAULT_MAX_CHUNKS,
    HOST_STAGING_GBPS,
    PROTOCOL_LATENCY_US,
    SimResult,
    busbw_factor,
)
from .simulation import simulate

__all__ = ["CHUNK_BUDGET", "COLLECTIVES", "DEFAULT_LATENCY_US", "DEFAULT_MAX_CHUNKS", "HOST_STAGING_GBPS",
           "LINK_LEVEL_MAX_MESSAGES", "PROTOCOL_LATENCY_US", "SimResult", "busbw_factor", "flow_time",
           "link_level_messages", "plan_chunks", "simulate", "tree_gpu_edges"]
