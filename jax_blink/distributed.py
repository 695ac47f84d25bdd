"""jax_blink across processes: joining a ``jax.distributed`` job and the multi-node topology.

One process per node (host). Each process knows its own node's topology (detected on GPU, host
devices on CPU, or given); the processes exchange those as JSON through jax.distributed's
key-value store, check they agree, and combine them with the network between nodes (NICs of
``nic_gbps`` GB/s into one fabric, :func:`jax_blink.topology.presets.multi_node`) into one Topology. Every
process then holds the same Topology and the same device map, so the deterministic planner gives
every process the same plan: on a multi-node topology the planner's "hierarchical" plan, Blink's
three phases (MLSys 2020, section 5: reduce inside each node on intra-node trees, exchange between
the node GPUs that own each partition across the network, broadcast inside each node). The
collectives run it as ``impl="hierarchical"`` (``jax_blink.lowering.hierarchical``: the native executor
inside each process, XLA's own all-reduce between processes, gloo on CPU and NCCL on GPU) where every
process holds two or more of a group's devices, else as the ``ppermute`` lowering's rounds of
``collective_permute``.

Device numbering: node k is process k (``jax.process_index()``); its i-th local device (local
devices sorted by ``local_hardware_id`` on GPU, by ``id`` elsewhere) is topology GPU ``k*G + i``,
G = GPUs per node, exactly :func:`~jax_blink.topology.presets.multi_node`'s numbering.

Typical use (see ``examples/multiprocess/``)::

    from jax_blink import distributed
    distributed.initialize()                       # reads the launcher's environment
    cluster = distributed.cluster_topology(nic_gbps=12.5)
    y = jax_blink.psum(x, "i", topology=cluster.topology, device_map=cluster.device_map)
"""

from __future__ import annotations

import dataclasses
import os

from .errors import BlinkError, TopologyError
from .launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .topology import Topology

ENV_NODE_TOPOLOGY = "JAX_BLINK_NODE_TOPOLOGY"
ENV_NIC_GBPS = "JAX_BLINK_NIC_GBPS"
ENV_NICS_PER_NODE = "JAX_BLINK_NICS_PER_NODE"

ENV_COLLECTIVE_TIMEOUT = "JAX_BLINK_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300

DEFAULT_NIC_GBPS = 12.5  # 100 Gb/s InfiniBand / Ethernet, per direction

_KV_PREFIX = "jax_blink/node_topology"
_exchange_generation = 0  # every process calls exchange the same number of times: keys pair up


class DistributedError(BlinkError, RuntimeError):
    """Joining the jax.distributed job or exchanging data between its processes failed."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = 10,
               initialization_timeout_s: int = 120, shutdown_timeout_s: int = 60,
               collective_timeout_s: int | None = None) -> tuple[int, int]:
    """Join (or start) the jax.distributed job; returns ``(process_id, num_processes)``.

    Arguments left None come from the environment set by :mod:`jax_blink.launch`
    (``JAX_BLINK_COORDINATOR``, ``JAX_BLINK_NUM_PROCESSES``, ``JAX_BLINK_PROCESS_ID``). Selects
    gloo for CPU cross-process collectives (needed for ``collective_permute`` across processes on
    CPU; unused on GPU, where XLA uses NCCL). Must run before any JAX computation.

    ``heartbeat_timeout_s`` bounds how long the survivors wait when a process dies: the
    coordination service then aborts every process with "another task died" instead of a hang.
    ``collective_timeout_s`` (default ``JAX_BLINK_COLLECTIVE_TIMEOUT_S``, else 300) bounds how long
    an XLA collective between processes on CPU (gloo: the network phase of ``impl="hierarchical"``,
    the ``collective_permute`` of ``"ppermute"``) waits for a process that is alive but never calls
    it: the waiting processes' call then raises (gloo: "Timed out waiting ... for recv operation")
    instead of hanging (XLA flag ``--xla_cpu_collective_timeout_seconds``, set in ``XLA_FLAGS``
    before the CPU client starts; an ``XLA_FLAGS`` that already sets it wins).

    Raises ValueError when neither arguments nor environment say where the coordinator is, and
    DistributedError when the job cannot be joined within ``initialization_timeout_s``.
    """
    import jax

    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    try:
        num_processes = int(num_processes if num_processes is not None else env[ENV_NUM_PROCESSES])
        process_id = int(process_id if process_id is not None else env[ENV_PROCESS_ID])
    except KeyError as e:
        raise ValueError(f"jax_blink.distributed.initialize: {e.args[0]} is not set; pass "
                         "coordinator_address, num_processes and process_id, or start the processes "
                         "with `python -m jax_blink.launch`") from None
    except (TypeError, ValueError):
        raise ValueError(f"num_processes and process_id must be ints, got {num_processes!r}, "
                         f"{process_id!r}") from None
    if not coordinator_address:
        raise ValueError(f"jax_blink.distributed.initialize: no coordinator address; pass one or set "
                         f"{ENV_COORDINATOR} (the launcher does)")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    if collective_timeout_s is None:
        text = env.get(ENV_COLLECTIVE_TIMEOUT, "").strip()
        try:
            collective_timeout_s = int(text) if text else DEFAULT_COLLECTIVE_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{ENV_COLLECTIVE_TIMEOUT} must be a whole number of seconds, got {text!r}") from None
    if isinstance(collective_timeout_s, bool) or not isinstance(collective_timeout_s, int) or collective_timeout_s < 1:
        raise ValueError(f"collective_timeout_s must be a positive int (seconds), got {collective_timeout_s!r}")
    flags = env.get("XLA_FLAGS", "")
    if "--xla_cpu_collective_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={collective_timeout_s}".strip()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                                   process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=initialization_timeout_s,
                                   shutdown_timeout_seconds=shutdown_timeout_s)
    except RuntimeError as e:  # XlaRuntimeError: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        raise DistributedError(
            f"process {process_id} of {num_processes} could not join the jax.distributed job at "
            f"{coordinator_address} within {initialization_timeout_s} s: {str(e).splitlines()[0]}. "
            "Check that every process was started and that process 0 can bind that address") from None
    return process_id, num_processes


# ----------------------------------------------------------------------------- node topology
def local_devices_sorted(devices=None) -> list:
    """This process's devices in node order (GPU ``local_hardware_id``, else ``id``)."""
    import jax

    devs = list(jax.local_devices() if devices is None else devices)
    return sorted(devs, key=lambda d: (d.local_hardware_id if d.local_hardware_id is not None else d.id,
                                       d.id))


def node_topology(spec=None) -> Topology:
    """This process's node: its local devices and the links between them.

    ``spec``: a Topology, a preset name or a topology file; else ``JAX_BLINK_NODE_TOPOLOGY``; else
    detection on GPU (restricted to this process's GPUs), else ``Topology.host(#local devices)``.
    The result's GPUs are renumbered 0..G-1 in node order. Raises TopologyError when the given or
    detected topology does not have exactly the local devices.
    """
    devs = local_devices_sorted()
    spec = spec if spec is not None else (os.environ.get(ENV_NODE_TOPOLOGY) or None)
    if spec is None:
        if devs and devs[0].platform in ("gpu", "cuda", "rocm"):
            from .topology.nvml import detect
            full = detect()
            topo = full.subset([d.local_hardware_id for d in devs])
        else:
            return Topology.host(len(devs))
    elif isinstance(spec, Topology):
        topo = spec
    else:
        from .mapping import _load
        topo = _load(os.fspath(spec))
    if len(topo.gpus) != len(devs):
        raise TopologyError(
            f"node topology {topo.name!r} has {len(topo.gpus)} GPUs {topo.gpus} but this process has "
            f"{len(devs)} local devices; give a node topology with exactly the process's devices "
            f"(argument or {ENV_NODE_TOPOLOGY})")
    return _renumber(topo)


def _renumber(topo: Topology) -> Topology:
    ren = {g: i for i, g in enumerate(topo.gpus)}
    if all(k == v for k, v in ren.items()):
        return topo
    d = topo.to_dict()
    for n in d["nodes"]:
        n["id"] = ren.get(n["id"], n["id"]) if isinstance(n["id"], int) else n["id"]
    for e in d["links"]:
        for k in ("src", "dst"):
            if isinstance(e[k], int):
                e[k] = ren[e[k]]
    return Topology.from_dict(d)


def exchange(value: str, *, timeout_s: float = 60.0) -> list[str]:
    """All-gather one string per process through jax.distributed's key-value store.

    Every process must call this the same number of times (keys are numbered by call). Returns the
    values in process order. Raises DistributedError when jax.distributed is not initialised or a
    process does not publish within ``timeout_s``.
    """
    global _exchange_generation
    import jax

    from ._jax_compat import distributed_client

    client = distributed_client()
    if client is None:
        raise DistributedError("jax.distributed is not initialised: call jax_blink.distributed.initialize() "
                               "first (one process per node)")
    gen = _exchange_generation
    _exchange_generation += 1
    me, n = jax.process_index(), jax.process_count()
    client.key_value_set(f"{_KV_PREFIX}/{gen}/{me}", value)
    out = []
    for p in range(n):
        try:
            out.append(client.blocking_key_value_get(f"{_KV_PREFIX}/{gen}/{p}", int(timeout_s * 1000)))
        except Exception as e:  # XlaRuntimeError DEADLINE_EXCEEDED
            raise DistributedError(f"process {me}: process {p} did not publish its node topology within "
                                   f"{timeout_s:.0f} s ({str(e).splitlines()[0]})") from None
    return out


def combine(nodes: list[Topology], nic_gbps: float = DEFAULT_NIC_GBPS, nics_per_node: int = 1) -> Topology:
    """The multi-node topology of ``nodes`` (one per process, in process order).

    Nodes must be identical (same GPUs, switches and links: Blink's hierarchical plan assumes
    homogeneous servers); the result is ``presets.multi_node(nodes[0], len(nodes), nic_gbps,
    nics_per_node)``. Raises TopologyError naming the processes whose nodes differ.
    """
    from .topology.presets import multi_node

    if not nodes:
        raise TopologyError("combine: no node topologies given")
    fps = [t.fingerprint() for t in nodes]
    if len(set(fps)) > 1:
        desc = ", ".join(f"process {i}: {t.name} ({len(t.gpus)} GPUs, fingerprint {f})"
                         for i, (t, f) in enumerate(zip(nodes, fps)))
        raise TopologyError("the processes' node topologies differ; jax_blink's multi-node plans need "
                            f"identical nodes ({desc}). Give every process the same node topology "
                            f"({ENV_NODE_TOPOLOGY}) and the same number of local devices")
    return multi_node(nodes[0], len(nodes), float(nic_gbps), int(nics_per_node))


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The job's topology as every process sees it.

    Attributes:
      topology: multi-node Topology (GPU ``k*G+i`` = process k's i-th device in node order).
      device_map: ``{jax device id: topology GPU id}`` for every device of every process.
      node: the per-node Topology (GPUs 0..G-1).
      num_processes: number of processes (= nodes).
    """

    topology: Topology
    device_map: dict
    node: Topology
    num_processes: int


def device_map(devices=None, gpus_per_node: int | None = None) -> dict[int, int]:
    """``{device.id: process_index*G + position in node order}`` over all (global) devices."""
    import jax

    devs = list(jax.devices() if devices is None else devices)
    by_proc: dict[int, list] = {}
    for d in devs:
        by_proc.setdefault(d.process_index, []).append(d)
    sizes = {p: len(v) for p, v in by_proc.items()}
    G = gpus_per_node if gpus_per_node is not None else max(sizes.values())
    if any(s != G for s in sizes.values()):
        raise TopologyError(f"every process needs the same number of devices for a multi-node "
                            f"topology; devices per process: {sizes}")
    return {d.id: p * G + i for p, v in by_proc.items() for i, d in enumerate(local_devices_sorted(v))}


def cluster_topology(node=None, *, nic_gbps: float | None = None, nics_per_node: int | None = None,
                     timeout_s: float = 60.0) -> Cluster:
    """Exchange node topologies between the processes and combine them (call on every process).

    Args:
      node: this process's node topology spec (see :func:`node_topology`).
      nic_gbps: GB/s per direction per NIC (default ``JAX_BLINK_NIC_GBPS`` or 12.5).
      nics_per_node: NICs per node (default ``JAX_BLINK_NICS_PER_NODE`` or 1).
    Returns a :class:`Cluster`, identical on every process. Raises TopologyError when the nodes
    differ, DistributedError when jax.distributed is not initialised or a process is missing.
    """
    nic_gbps = float(nic_gbps if nic_gbps is not None else os.environ.get(ENV_NIC_GBPS, DEFAULT_NIC_GBPS))
    nics_per_node = int(nics_per_node if nics_per_node is not None else os.environ.get(ENV_NICS_PER_NODE, 1))
    mine = node_topology(node)
    nodes = [Topology.from_json(s) for s in exchange(mine.to_json(), timeout_s=timeout_s)]
    topo = combine(nodes, nic_gbps, nics_per_node)
    return Cluster(topology=topo, device_map=device_map(gpus_per_node=len(mine.gpus)), node=mine,
                   num_processes=len(nodes))


def three_phase_plan(topology: Topology, collective: str = "allreduce", devices=None, root=None):
    """Blink's three-phase plan (MLSys 2020, section 5) over a multi-node topology, whatever
    :func:`jax_blink.plan` would choose by itself: ``plan(..., algorithm=
    "hierarchical")``. The data is partitioned over the GPU positions of a node; partition i is
    reduced inside each node onto GPU i on intra-node trees, exchanged among the GPU i's of all
    nodes over their NIC routes, and broadcast inside each node from GPU i.

    Args: ``devices`` topology GPU ids (default all), ``root`` for broadcast/reduce.
    Returns a ``Plan`` with ``algorithm="hierarchical"`` and the topology's max-flow bound
    for the collective. Raises PlanError as ``jax_blink.plan`` does, including when the devices lie
    in a single node (no network phase).
    """
    from .planning import plan

    return plan(topology, collective, devices=devices, root=root, algorithm="hierarchical")
