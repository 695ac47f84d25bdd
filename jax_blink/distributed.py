"""jax_blink across processes: joining a ``jax.distributed`` job and the multi-node topology.

Any layout of processes: one per host, one per GPU, or between. Each process knows its host
(detected on GPU, host devices on CPU, or given) and which of the host's GPUs it holds; the
processes exchange those as JSON through jax.distributed's key-value store, group themselves by host
(the processes of one host share one node holding all their GPUs, so NVLink inside a host stays in
the topology), check the nodes agree, and combine them with the network between nodes (NICs of
``nic_gbps`` GB/s into one fabric, :func:`jax_blink.topology.presets.multi_node`) into one Topology. Every
process then holds the same Topology and the same device map, so the deterministic planner gives
every process the same plan: on a multi-node topology the planner's "hierarchical" plan, Blink's
three phases (MLSys 2020, section 5: reduce inside each node on intra-node trees, exchange between
the node GPUs that own each partition across the network, broadcast inside each node). The
collectives run it as ``impl="hierarchical"`` (``jax_blink.lowering.hierarchical``: the native executor
inside each process, XLA's own all-reduce between processes, gloo on CPU and NCCL on GPU) where every
process holds two or more of a group's devices, else as the ``ppermute`` lowering's rounds of
``collective_permute``.

Device numbering: nodes in the order of their lowest process index; GPU ``i`` of node ``k`` (the
host's GPUs held by the job, in the machine's order) is topology GPU ``k*G + i``, G = GPUs per
node, exactly :func:`~jax_blink.topology.presets.multi_node`'s numbering. With one process per node
(CPU host devices, or one process per host) node k is process k and its i-th local device (local
devices sorted by ``local_hardware_id`` on GPU, by ``id`` elsewhere) is GPU ``k*G + i``.

Typical use (see ``examples/multiprocess/``)::

    from jax_blink import distributed
    distributed.initialize()      # jax_blink.launch, srun, mpirun, ...: says which on process 0
    cluster = distributed.cluster_topology(nic_gbps=12.5)
    y = jax_blink.psum(x, "i", topology=cluster.topology, device_map=cluster.device_map)
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import envvars
from .errors import BlinkError, TopologyError
from .launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .topology import Topology

ENV_NODE_TOPOLOGY = "JAX_BLINK_NODE_TOPOLOGY"
ENV_HOST = "JAX_BLINK_HOST"
ENV_NIC_GBPS = "JAX_BLINK_NIC_GBPS"
ENV_NICS_PER_NODE = "JAX_BLINK_NICS_PER_NODE"

ENV_COLLECTIVE_TIMEOUT = "JAX_BLINK_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300

DEFAULT_NIC_GBPS = 12.5  # 100 Gb/s InfiniBand / Ethernet, per direction

_KV_PREFIX = "jax_blink/node_topology"
_exchange_generation = 0  # every process calls exchange the same number of times: keys pair up


class DistributedError(BlinkError, RuntimeError):
    """Joining the jax.distributed job or exchanging data between its processes failed."""


class Joined(tuple):
    """``(process_id, num_processes)`` of :func:`initialize`, with ``source``: how the job was found
    (``"arguments"``, ``"jax_blink.launch"``, ``"SLURM (jax's cluster detection)"``, ...,
    ``"jax.distributed.initialize() called before"``)."""

    source: str

    def __new__(cls, process_id: int, num_processes: int, source: str):
        self = super().__new__(cls, (process_id, num_processes))
        self.source = source
        return self

    @property
    def process_id(self) -> int:
        return self[0]

    @property
    def num_processes(self) -> int:
        return self[1]


#: How the running job was joined (a :class:`Joined`), or None before :func:`initialize`.
joined: Joined | None = None


def _collective_timeout(collective_timeout_s):
    if collective_timeout_s is None:
        collective_timeout_s = envvars.integer(ENV_COLLECTIVE_TIMEOUT) or DEFAULT_COLLECTIVE_TIMEOUT_S
    if (isinstance(collective_timeout_s, bool) or not isinstance(collective_timeout_s, int)
            or not 1 <= collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S):
        raise ValueError(f"collective_timeout_s ({ENV_COLLECTIVE_TIMEOUT}) must be a whole number of seconds in "
                         f"[1, {MAX_COLLECTIVE_TIMEOUT_S}], got {collective_timeout_s!r}")
    return collective_timeout_s


#: XLA parses --xla_cpu_collective_timeout_seconds as a 32-bit int: a larger value aborts the process.
MAX_COLLECTIVE_TIMEOUT_S = 2**31 - 1


def _launcher_args(coordinator_address, num_processes, process_id):
    """The arguments, completed from jax_blink.launch's variables; (address, n, id, source) or None
    when neither gives any of them."""
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    from_env = [envvars.raw(k) is not None for k in names]
    if all(given):
        source = "arguments"
    elif any(from_env):
        source = "jax_blink.launch" if not any(given) else "arguments and jax_blink.launch's variables"
    elif any(given):
        missing = [a for a, g in zip(("coordinator_address", "num_processes", "process_id"), given) if not g]
        raise ValueError(f"jax_blink.distributed.initialize: {', '.join(missing)} not given; pass all three "
                         "of coordinator_address, num_processes, process_id, or none (then the launcher's "
                         "environment is read)")
    else:
        return None
    vals = []
    readers = (envvars.address, envvars.integer, envvars.integer)
    for v, k, read in zip((coordinator_address, num_processes, process_id), names, readers):
        if v is None:
            v = read(k)  # EnvVarError names the variable and its value
            if v is None:
                raise ValueError(f"jax_blink.distributed.initialize: {k} is not set but "
                                 f"{', '.join(n for n, f in zip(names, from_env) if f)} is; start the "
                                 "processes with `python -m jax_blink.launch` (which sets all three)")
        vals.append(v)
    address, n, pid = vals
    try:
        n, pid = int(n), int(pid)
    except (TypeError, ValueError):
        raise ValueError(f"num_processes and process_id ({ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) must be whole "
                         f"numbers, got {n!r}, {pid!r}") from None
    if not 1 <= n <= 65536:
        raise ValueError(f"num_processes ({ENV_NUM_PROCESSES}) must be in [1, 65536], got {n}")
    if not 0 <= pid < n:
        raise ValueError(f"process_id ({ENV_PROCESS_ID}) {pid} is not in [0, {n}) (num_processes, "
                         f"{ENV_NUM_PROCESSES}, is {n})")
    if coordinator_address is not None and not isinstance(coordinator_address, str):
        raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    return str(address), n, pid, source


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None, heartbeat_timeout_s: int = 10,
               initialization_timeout_s: int = 120, shutdown_timeout_s: int = 60,
               collective_timeout_s: int | None = None, quiet: bool = False) -> Joined:
    """Join (or start) the jax.distributed job; returns ``(process_id, num_processes)`` (a
    :class:`Joined`, whose ``source`` says how the job was found; also in :data:`joined`).

    Where the job is, in this order: the arguments; the variables :mod:`jax_blink.launch` sets
    (``JAX_BLINK_COORDINATOR``, ``JAX_BLINK_NUM_PROCESSES``, ``JAX_BLINK_PROCESS_ID``); jax's own
    cluster detection (``jax.distributed.initialize()`` without arguments: SLURM's ``srun``, Open
    MPI's ``mpirun``, Kubernetes, Cloud TPU, ... whatever the installed jax detects; also
    ``JAX_COORDINATOR_ADDRESS``). When ``jax.distributed.initialize()`` was already called, nothing is
    joined again: the job is checked as below and returned. Process 0 prints one line saying which
    was used (``quiet`` leaves it out).

    Selects gloo for CPU cross-process collectives (``jax_cpu_collectives_implementation``; XLA uses
    NCCL on GPU) and bounds how long an XLA collective between processes on CPU waits for a process
    that is alive but never calls it (``collective_timeout_s``, default
    ``JAX_BLINK_COLLECTIVE_TIMEOUT_S``, else 300 s: XLA flag
    ``--xla_cpu_collective_timeout_seconds`` in ``XLA_FLAGS``, read when the CPU client starts; an
    ``XLA_FLAGS`` that already sets it wins). Both must happen before any JAX computation. Then starts
    :mod:`jax_blink.faults` (a failing process is named by its peers, which stop).

    ``heartbeat_timeout_s`` bounds how long the survivors wait when a process dies: the coordination
    service then aborts every process with "another task died" instead of a hang.
    ``local_device_ids`` is passed to jax (GPU: the GPUs this process uses; jax's cluster detection
    otherwise gives each process the one GPU of its local rank).

    Raises ValueError when nothing says where the coordinator is (naming what was looked for) or a
    value is malformed, DistributedError when the job cannot be joined within
    ``initialization_timeout_s`` or when jax was initialised without what jax_blink needs.
    """
    global joined
    import jax

    from . import faults
    from ._jax_compat import detected_cluster, distributed_client

    if distributed_client() is not None:  # the user called jax.distributed.initialize() already
        if jax.default_backend() == "cpu":
            faults.check_cpu_collectives()
        joined = Joined(jax.process_index(), jax.process_count(), "jax.distributed.initialize() called before")
        faults.install()
        return joined
    args = _launcher_args(coordinator_address, num_processes, process_id)
    cluster = None
    if args is None:
        cluster = detected_cluster()
        if cluster is None and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            raise ValueError(
                "jax_blink.distributed.initialize: no job found: no arguments, no "
                f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} (start the processes with `python -m "
                "jax_blink.launch`), and jax's cluster detection found none of its environments (SLURM srun, "
                "Open MPI mpirun, Kubernetes, ...; or JAX_COORDINATOR_ADDRESS with num_processes and process_id)")
    timeout = _collective_timeout(collective_timeout_s)
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_collective_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={timeout}".strip()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = dict(local_device_ids=local_device_ids, heartbeat_timeout_seconds=heartbeat_timeout_s,
              initialization_timeout=initialization_timeout_s, shutdown_timeout_seconds=shutdown_timeout_s)
    if args is not None:
        address, n, pid, source = args
        kw.update(coordinator_address=address, num_processes=n, process_id=pid)
    else:
        source = f"{cluster} (jax's cluster detection)" if cluster else "JAX_COORDINATOR_ADDRESS (jax)"
        address, pid, n = "the detected coordinator", "?", "?"
    try:
        jax.distributed.initialize(**kw)
    except RuntimeError as e:  # XlaRuntimeError: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        raise DistributedError(
            f"process {pid} of {n} could not join the jax.distributed job at {address} (found through "
            f"{source}) within {initialization_timeout_s} s: {str(e).splitlines()[0]}. Check that every "
            "process was started and that process 0 can bind that address") from None
    except (ValueError, TypeError) as e:  # jax's detection left something unset
        raise ValueError(f"jax_blink.distributed.initialize: jax.distributed.initialize() through {source} "
                         f"failed: {e}") from None
    joined = Joined(jax.process_index(), jax.process_count(), source)
    if joined.process_id == 0 and not quiet:
        print(f"jax_blink.distributed: {joined.num_processes} process(es) joined through {source}",
              file=sys.stderr, flush=True)
    faults.install()
    return joined


# ----------------------------------------------------------------------------- node topology
def local_devices_sorted(devices=None) -> list:
    """This process's devices in node order (GPU ``local_hardware_id``, else ``id``)."""
    import jax

    devs = list(jax.local_devices() if devices is None else devices)
    return sorted(devs, key=lambda d: (d.local_hardware_id if d.local_hardware_id is not None else d.id,
                                       d.id))


def _visible_gpus() -> list[int] | None:
    """An integer ``CUDA_VISIBLE_DEVICES`` list (the machine's GPU numbers a process sees), else None."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return None  # UUID / MIG forms


def host_name() -> str:
    """This process's host for :func:`cluster_topology`: ``JAX_BLINK_HOST``, else the host name
    (``socket.gethostname()``). Processes with the same host share one node of the topology."""
    import socket

    return envvars.text(ENV_HOST) or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class HostView:
    """What one process knows of its host (exchanged between processes as JSON).

    Attributes:
      host: :func:`host_name`; ``own_node`` processes are nodes by themselves whatever it is.
      topology: the host's topology (every GPU of the machine, NVML numbering) or, for ``own_node``,
        the process's node (GPUs 0..G-1).
      gpus: this process's devices as GPUs of ``topology``, in node order (local devices sorted by
        :func:`local_devices_sorted`).
      own_node: True when the process is a node by itself (host CPU devices, or a given node topology
        with exactly the process's devices).
    """

    host: str
    topology: Topology
    gpus: tuple
    own_node: bool

    def to_json(self) -> str:
        import json
        return json.dumps({"host": self.host, "topology": self.topology.to_dict(), "gpus": list(self.gpus),
                           "own_node": self.own_node})

    @classmethod
    def from_json(cls, text: str) -> HostView:
        import json
        d = json.loads(text)
        return cls(d["host"], Topology.from_dict(d["topology"]), tuple(d["gpus"]), bool(d["own_node"]))


def host_view(spec=None, devices=None) -> HostView:
    """This process's :class:`HostView`.

    ``spec``: a Topology, a preset name or a topology file; else ``JAX_BLINK_NODE_TOPOLOGY``; else
    detection on GPU. ``"detect"`` (or detection on GPU) reads the whole machine
    (``detect(all_gpus=True)``) and places this process's GPUs in it: GPU ``CUDA_VISIBLE_DEVICES[h]``
    for a device of local hardware id ``h`` where that variable is an integer list (SLURM's
    ``--gpus-per-task``, ``--gpu-bind``), else ``h`` (jax's ``local_device_ids``). A given topology
    with more GPUs than the process has devices is the host's; the process's GPUs are then its
    ``CUDA_VISIBLE_DEVICES`` list (on GPU mapped as above). A given topology with exactly the
    process's devices, or host CPU devices without a spec (``Topology.host``: devices of different
    processes share no memory, they talk through gloo even on one machine), make the process a node by
    itself. Raises TopologyError when the devices cannot be placed in the topology.
    """
    devs = local_devices_sorted(devices)
    spec = spec if spec is not None else envvars.text(ENV_NODE_TOPOLOGY)
    on_gpu = bool(devs) and devs[0].platform in ("gpu", "cuda", "rocm")
    visible = _visible_gpus()
    if spec is None and not on_gpu:
        return HostView(host_name(), Topology.host(len(devs)), tuple(range(len(devs))), True)
    if (spec is None and on_gpu) or spec == "detect":
        from .topology.nvml import detect
        topo = detect(all_gpus=True)
    elif isinstance(spec, Topology):
        topo = spec
    else:
        from .mapping import _load
        topo = _load(os.fspath(spec))
    if spec is not None and spec != "detect" and len(topo.gpus) == len(devs):
        return HostView(host_name(), _renumber(topo), tuple(range(len(devs))), True)
    if on_gpu:
        hw = [d.local_hardware_id for d in devs]
        gpus = [visible[h] if visible is not None and 0 <= h < len(visible) else h for h in hw]
    elif visible is not None and len(visible) == len(devs):
        gpus = list(visible)
    else:
        raise TopologyError(
            f"node topology {topo.name!r} has {len(topo.gpus)} GPUs but this process has {len(devs)} local "
            f"devices and no CUDA_VISIBLE_DEVICES list of {len(devs)} GPUs saying which of them it holds; give "
            f"each process CUDA_VISIBLE_DEVICES, or a node topology with exactly its devices ({ENV_NODE_TOPOLOGY})")
    bad = [g for g in gpus if g not in topo.gpus]
    if bad or len(set(gpus)) != len(gpus):
        raise TopologyError(f"this process's GPUs {gpus} (CUDA_VISIBLE_DEVICES / local hardware ids) are not "
                            f"distinct GPUs of node topology {topo.name!r} (GPUs {topo.gpus})")
    return HostView(host_name(), topo, tuple(gpus), False)


def node_topology(spec=None) -> Topology:
    """This process's own GPUs and the links between them, renumbered 0..G-1 in node order.

    ``spec`` as for :func:`host_view`; without one, on host CPU devices ``Topology.host(#local
    devices)``. Raises TopologyError when the given or detected topology cannot hold the devices.
    """
    v = host_view(spec)
    return v.topology if v.own_node else _renumber(v.topology.subset(sorted(v.gpus)))


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
    from . import faults

    faults.install()  # where the program joined through jax.distributed.initialize() itself
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
      topology: multi-node Topology of the hosts (GPU ``k*G+i`` = GPU ``i`` of node ``k``, node
        order = order of each node's lowest process index); the node's own topology when there is
        one node.
      device_map: ``{jax device id: topology GPU id}`` for every device of every process.
      node: the per-node Topology (GPUs 0..G-1).
      num_processes: number of processes.
      hosts: each node's host name, in node order.
      node_of_process: node index of each process, in process order.
    """

    topology: Topology
    device_map: dict
    node: Topology
    num_processes: int
    hosts: tuple = ()
    node_of_process: tuple = ()

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)


def device_map(devices=None, gpus_per_node: int | None = None) -> dict[int, int]:
    """``{device.id: process_index*G + position in node order}`` over all (global) devices: the map
    of one node per process (:func:`cluster_topology` gives the map of any layout)."""
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


def group_hosts(views: list[HostView]) -> tuple[list[Topology], list[str], list[int], list[list[int]]]:
    """Nodes of the job from every process's :class:`HostView` (in process order).

    Processes with the same host (and not ``own_node``) form one node: their host topologies must
    be the same, their GPUs distinct; the node is the host topology restricted to the union of their
    GPUs, renumbered 0..G-1 in the machine's order. Returns ``(node topologies, node hosts,
    node of each process, each process's positions in its node)``. Raises TopologyError naming the
    processes whose host topologies differ or whose GPUs overlap.
    """
    members = {}
    for p, v in enumerate(views):
        key = ("process", p) if v.own_node else ("host", v.host)
        members.setdefault(key, []).append(p)
    nodes, hosts, node_of, positions = [], [], [None] * len(views), [None] * len(views)
    for k, procs in enumerate(members.values()):
        first = views[procs[0]]
        fp = first.topology.fingerprint()
        claimed: dict[int, int] = {}
        for p in procs:
            v = views[p]
            if v.topology.fingerprint() != fp:
                raise TopologyError(
                    f"processes {procs[0]} and {p} on host {v.host!r} see different host topologies "
                    f"({first.topology.name}, {v.topology.name}); every process of a host must detect or be "
                    f"given the same one ({ENV_NODE_TOPOLOGY})")
            for g in v.gpus:
                if g in claimed:
                    raise TopologyError(
                        f"processes {claimed[g]} and {p} on host {v.host!r} both hold GPU {g} of "
                        f"{v.topology.name}; give each process its own GPUs (CUDA_VISIBLE_DEVICES, srun "
                        f"--gpus-per-task, jax's local_device_ids), or set {ENV_HOST} to tell nodes apart")
                claimed[g] = p
        union = sorted(claimed)
        node = first.topology if first.own_node else _renumber(first.topology.subset(union))
        nodes.append(node)
        hosts.append(first.host)
        for p in procs:
            node_of[p] = k
            positions[p] = [union.index(g) for g in views[p].gpus]
    return nodes, hosts, node_of, positions


def cluster_topology(node=None, *, nic_gbps: float | None = None, nics_per_node: int | None = None,
                     timeout_s: float = 60.0) -> Cluster:
    """Exchange what each process knows of its host and build the job's topology (call on every
    process).

    Processes are grouped by host (:func:`group_hosts`): one process per GPU, one per host, or
    anything between gives one node per host holding that host's GPUs, and the multi-node topology
    joins hosts (``presets.multi_node``: ``nics_per_node`` NICs of ``nic_gbps`` GB/s each into one
    network). Host CPU devices make each process a node (see :func:`host_view`).

    Args:
      node: this process's node or host topology spec (see :func:`host_view`).
      nic_gbps: GB/s per direction per NIC (default ``JAX_BLINK_NIC_GBPS`` or 12.5).
      nics_per_node: NICs per node (default ``JAX_BLINK_NICS_PER_NODE`` or 1).
    Returns a :class:`Cluster`, identical on every process. Raises TopologyError when the nodes
    differ or GPUs are claimed twice, DistributedError when jax.distributed is not initialised or a
    process is missing.
    """
    import jax

    nic_gbps = float(nic_gbps if nic_gbps is not None else envvars.number(ENV_NIC_GBPS) or DEFAULT_NIC_GBPS)
    nics_per_node = int(nics_per_node if nics_per_node is not None else envvars.integer(ENV_NICS_PER_NODE) or 1)
    mine = host_view(node)
    views = [HostView.from_json(s) for s in exchange(mine.to_json(), timeout_s=timeout_s)]
    nodes, hosts, node_of, positions = group_hosts(views)
    topo = nodes[0] if len(nodes) == 1 else combine(nodes, nic_gbps, nics_per_node)
    G = len(nodes[0].gpus)
    by_proc: dict[int, list] = {}
    for d in jax.devices():
        by_proc.setdefault(d.process_index, []).append(d)
    dmap = {}
    for p, devs in by_proc.items():
        devs = local_devices_sorted(devs)
        if len(devs) != len(positions[p]):
            raise TopologyError(f"process {p} has {len(devs)} devices but published {len(positions[p])} GPUs")
        dmap.update({d.id: node_of[p] * G + i for d, i in zip(devs, positions[p])})
    return Cluster(topology=topo, device_map=dmap, node=nodes[0], num_processes=len(views), hosts=tuple(hosts),
                   node_of_process=tuple(node_of))


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
