"""The interconnect model: a directed graph of GPUs, switches and links.

GPU nodes are integer device indices; shared resources (an NVSwitch, a PCIe switch, a CPU root
complex, a NIC, host memory) are string nodes, so flows through one switch share its capacity
(Blink, MLSys 2020, section 3: "hybrid" PCIe + NVLink transfers and shared PCIe switches).
Every directed edge carries ``bandwidth_gbps`` (GB/s = 1e9 B/s, per direction, all links of the
edge together), ``kind`` (one of :data:`LINK_KINDS`) and ``links`` (how many physical links).
``bandwidth_gbps`` is the link's *achieved* rate (line rate x the achieved fraction of its kind,
:mod:`jax_blink.topology.presets`), used alike as the planner's capacity and the simulator's service rate.
A GPU node may carry ``no_p2p``: the GPUs it has no peer access to (their transfers are staged
through host memory, :mod:`jax_blink.simulate`).

The classmethods that read a topology from somewhere (:meth:`Topology.preset`,
:meth:`Topology.from_nvidia_smi`, :meth:`Topology.detect`, :meth:`Topology.load`) call the source
modules of this package through :data:`_SOURCES`, which each source module fills when imported
(``jax_blink.topology`` imports them all), so this module imports none of them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import numbers
import re
from collections.abc import Callable, Iterable

import networkx as nx

from ..errors import TopologyError

LINK_KINDS = ("nvlink", "nvswitch", "pcie", "host", "net")
MAX_HOST_DEVICES = 4096
NODE_KINDS = ("gpu", "nvswitch", "pcie-switch", "cpu", "nic", "host", "network")
_GPU_ITEM = re.compile(r"(\d+)(?:-(\d+))?")
SUPPORTED_FORMATS = ("a preset name (e.g. 'dgx1v', 'dgx-a100', 'host8')",
                     "the path of a saved `nvidia-smi topo -m` output (.txt)",
                     "NCCL's topology XML (.xml, as NCCL_TOPO_DUMP_FILE writes it)",
                     "a JSON file written by Topology.to_json() (.json)")
CACHE_SIZE = 1024  # entries kept per derived cache (least recently used dropped)
_CACHES: list = []  # every derived_cache(), emptied together by jax_blink.clear_caches


def derived_cache() -> collections.OrderedDict:
    """A new LRU cache (an OrderedDict) of facts derived from topologies or plans, emptied by
    ``jax_blink.clear_caches`` (``planner.model.clear_caches``) with every other."""
    cache = collections.OrderedDict()
    _CACHES.append(cache)
    return cache


def cached(cache: collections.OrderedDict, key, make, size: int = CACHE_SIZE):
    """``cache[key]``, computed by ``make()`` on a miss; at most ``size`` entries (least recently
    used dropped)."""
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
        if len(cache) > size:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


HOW_TO_PASS = ("pass a topology explicitly instead: " + ", ".join(SUPPORTED_FORMATS[:-1]) + ", or "
               + SUPPORTED_FORMATS[-1] + "; e.g. jax_blink.Topology.load('topo.txt') or "
               "`jax-blink topology topo.txt`")
#: Topology sources by name ("preset", "nvidia_smi", "detect", "load") -> function; filled by the
#: source modules of this package when they are imported.
_SOURCES: dict[str, Callable[..., Topology]] = {}


def register_source(name: str, fn: Callable[..., Topology]) -> None:
    """Make ``fn`` the topology source ``name`` behind the Topology classmethods (called by each
    source module of :mod:`jax_blink.topology` when it is imported)."""
    _SOURCES[name] = fn


def _source(name: str) -> Callable[..., Topology]:
    """The registered source ``name``; TopologyError when its module was never imported (it always
    is once :mod:`jax_blink.topology` is)."""
    try:
        return _SOURCES[name]
    except KeyError:
        raise TopologyError(f"topology source {name!r} is not registered: import jax_blink.topology") from None


def parse_gpu_ids(text: str, option: str = "devices") -> list[int]:
    """GPU ids from ``"0,1,4"``, ``"0-3"`` or mixes like ``"0-2,5"`` (ranges include both ends).

    Raises TopologyError naming the bad item: an empty list or item (``"0,,1"``),
    a negative id, a non-integer, a range whose end is below its start, or a repeated id.
    """
    if not str(text).strip():
        raise TopologyError(f"{option} is empty: give GPU ids like 0,1,4 or 0-3")
    out: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            raise TopologyError(f"{option} {text!r} has an empty item: give GPU ids like 0,1,4 or 0-3")
        if item.startswith("-"):
            raise TopologyError(f"{option} {text!r}: {item!r} is negative; GPU ids are 0, 1, 2, ...")
        m = _GPU_ITEM.fullmatch(item)
        if not m:
            raise TopologyError(f"{option} {text!r}: {item!r} is not a GPU id or a range; "
                                f"expected ids like 0,1,4 or ranges like 0-3")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise TopologyError(f"{option} {text!r}: range {item!r} ends below its start; write {b}-{a}")
        out.extend(range(a, b + 1))
    dup = sorted({d for d in out if out.count(d) > 1})
    if dup:
        raise TopologyError(f"{option} {text!r} names GPU {', '.join(map(str, dup))} more than once")
    return out


def _bumping(name: str):
    """dict method ``name`` that first bumps the owning graph's version (:class:`_Attrs`)."""
    def method(self, *a, **k):
        g = getattr(self, "_graph", None)
        if g is not None:  # (a graph being unpickled or copied may not have its count yet)
            g.__dict__["_version"] = g.__dict__.get("_version", 0) + 1
        return getattr(dict, name)(self, *a, **k)
    method.__name__ = name
    return method


class _Attrs(dict):
    """A node's or link's attribute dict in a :class:`_TrackedDiGraph`: every change bumps the graph's
    version (``g.edges[u, v]["bandwidth_gbps"] = x`` included), so :meth:`Topology.fingerprint` knows
    the graph is unchanged without a pass over it."""

    __slots__ = ("_graph",)
    __setitem__, __delitem__, __ior__ = _bumping("__setitem__"), _bumping("__delitem__"), _bumping("__ior__")
    update, pop, popitem = _bumping("update"), _bumping("pop"), _bumping("popitem")
    clear, setdefault = _bumping("clear"), _bumping("setdefault")


def _changing(name: str):
    """``networkx.DiGraph`` method ``name`` that bumps the graph's version (:class:`_TrackedDiGraph`)."""
    base = getattr(nx.DiGraph, name)

    def method(self, *a, **k):
        self._version += 1
        try:
            return base(self, *a, **k)
        finally:
            self._version += 1
    method.__name__, method.__doc__ = name, base.__doc__
    return method


class _TrackedDiGraph(nx.DiGraph):
    """``networkx.DiGraph`` that counts its changes (``_version``): nodes and links added or removed
    through its methods, attributes set on its node and link dicts (:class:`_Attrs`). What a
    :class:`Topology` builds; a graph assigned from elsewhere is an ordinary DiGraph, fingerprinted by
    a pass over it."""

    def __init__(self, *args, **kwargs):
        self._version = 0
        self.node_attr_dict_factory = self.edge_attr_dict_factory = self._new_attrs
        super().__init__(*args, **kwargs)

    def _new_attrs(self):
        d = _Attrs()
        d._graph = self
        return d

    add_node, add_nodes_from = _changing("add_node"), _changing("add_nodes_from")
    remove_node, remove_nodes_from = _changing("remove_node"), _changing("remove_nodes_from")
    add_edge, add_edges_from = _changing("add_edge"), _changing("add_edges_from")
    add_weighted_edges_from = _changing("add_weighted_edges_from")
    remove_edge, remove_edges_from = _changing("remove_edge"), _changing("remove_edges_from")
    update, clear, clear_edges = _changing("update"), _changing("clear"), _changing("clear_edges")


class Topology:
    """A machine's (or a job's) interconnect as a ``networkx.DiGraph``.

    Attributes:
      graph: the directed graph. Node attribute ``kind`` in :data:`NODE_KINDS`; edge attributes
        ``bandwidth_gbps`` (float, GB/s per direction), ``kind`` (str), ``links`` (int).
      name: a short human name ("dgx1v", "custom", ...).
      notes: what a parser assumed or ignored while reading the source (e.g. NCCL XML without
        NVLink information); printed by ``jax-blink topology``; not part of :meth:`fingerprint`.

    Build one with :meth:`add_gpu` / :meth:`add_switch` / :meth:`add_link`, a preset
    (:meth:`preset`), a parser (:meth:`from_nvidia_smi`, :meth:`from_json`), or :meth:`detect`.
    """

    def __init__(self, name: str = "custom"):
        self.graph = _TrackedDiGraph()
        self.name = name
        self.notes: list[str] = []

    # ----------------------------------------------------------------- building
    def add_gpu(self, index: int, **attrs) -> None:
        """Add GPU ``index`` (a non-negative int). Raises TopologyError on a bad index."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TopologyError(f"GPU ids are non-negative ints, got {index!r}")
        self.graph.add_node(index, kind="gpu", **attrs)

    def add_switch(self, node_id: str, kind: str, **attrs) -> None:
        """Add a shared resource node (string id, kind in NODE_KINDS minus 'gpu')."""
        if not isinstance(node_id, str) or not node_id:
            raise TopologyError(f"switch/host node ids are non-empty strings, got {node_id!r}")
        if kind not in NODE_KINDS or kind == "gpu":
            raise TopologyError(f"unknown node kind {kind!r}; expected one of {NODE_KINDS[1:]}")
        self.graph.add_node(node_id, kind=kind, **attrs)

    def add_link(self, u, v, per_link_gbps: float, kind: str, links: int = 1,
                 bidirectional: bool = True) -> None:
        """Add ``links`` links of ``per_link_gbps`` GB/s (per direction) between u and v.

        Adding to an existing edge adds links and bandwidth (parallel links aggregate).
        Both endpoints must already exist. Raises TopologyError on unknown nodes, a self loop,
        a non-positive bandwidth or count, or an unknown kind.
        """
        for n in (u, v):
            if n not in self.graph:
                raise TopologyError(f"link {u!r}-{v!r}: node {n!r} is not in the topology; add it first")
        if u == v:
            raise TopologyError(f"link {u!r}-{v!r}: self loops are not links")
        if kind not in LINK_KINDS:
            raise TopologyError(f"link {u!r}-{v!r}: unknown kind {kind!r}; expected one of {LINK_KINDS}")
        if not (0 < per_link_gbps < math.inf) or int(links) != links or links < 1:
            raise TopologyError(f"link {u!r}-{v!r}: bandwidth must be a finite number > 0 and links >= 1, "
                                f"got {per_link_gbps!r} GB/s x {links!r}")
        pairs = [(u, v), (v, u)] if bidirectional else [(u, v)]
        for a, b in pairs:
            if self.graph.has_edge(a, b):
                d = self.graph.edges[a, b]
                d["bandwidth_gbps"] += float(per_link_gbps) * links
                d["links"] += int(links)
            else:
                self.graph.add_edge(a, b, bandwidth_gbps=float(per_link_gbps) * links,
                                    kind=kind, links=int(links))

    # ----------------------------------------------------------------- queries
    @property
    def gpus(self) -> list[int]:
        """Sorted GPU ids (a new list each call)."""
        g = self.graph
        version = getattr(g, "_version", None) if type(g) is _TrackedDiGraph else None
        kept = self.__dict__.get("_gpus")
        if kept is not None and version is not None and kept[0] is g and kept[1] == version:
            return list(kept[2])  # unchanged graph (it counts its edits): a 1,024-GPU pass costs ~0.5 ms
        # networkx's node dict directly: the data view costs several times more on 10^3 GPUs
        out = sorted([n for n, d in g._node.items() if d.get("kind") == "gpu"])
        self._gpus = (g, version, tuple(out))
        return out

    @property
    def switches(self) -> list[str]:
        """Sorted ids of the non-GPU (shared resource) nodes."""
        return sorted(n for n, k in self.graph.nodes(data="kind") if k != "gpu")

    def kind(self, node) -> str:
        """Node kind of ``node``; TopologyError if absent."""
        if node not in self.graph:
            raise TopologyError(f"node {node!r} is not in topology {self.name!r}")
        return self.graph.nodes[node]["kind"]

    def bandwidth(self, u, v) -> float:
        """GB/s per direction from u to v over the direct edge (0.0 when there is none)."""
        d = self.graph.get_edge_data(u, v)
        return 0.0 if d is None else d["bandwidth_gbps"]

    def links(self) -> list[tuple]:
        """All directed edges as (u, v, bandwidth_gbps, kind, links), in a stable order."""
        out = [(u, v, d["bandwidth_gbps"], d["kind"], d["links"]) for u, v, d in self.graph.edges(data=True)]
        return sorted(out, key=lambda e: (_key(e[0]), _key(e[1])))

    def check_devices(self, devices: Iterable[int] | str) -> list[int]:
        """Validate a device list: ints, unique, all GPUs of this topology. Returns it as a list.

        ``devices``: an iterable of GPU ids, or a string like the CLI's ``--devices`` ("0,1,4",
        "0-3", :func:`parse_gpu_ids`). Raises TopologyError for anything else, non-integer ids
        (bools included), ids that are not GPUs of this topology, or duplicates.
        """
        if isinstance(devices, str):
            devices = parse_gpu_ids(devices)
        try:
            devices = list(devices)
        except TypeError:
            raise TopologyError(f"devices must be a list of GPU ids or a string like '0,1' or '0-3', got "
                                f"{type(devices).__name__} {devices!r}") from None
        # plain ints first: the abstract-class check costs a microsecond per GPU of a 1,024-GPU job
        odd = [d for d in devices
               if type(d) is not int and (isinstance(d, bool) or not isinstance(d, numbers.Integral))]
        if odd:
            raise TopologyError(f"devices must be integer GPU ids, got {odd!r} in {devices!r}")
        gpus = set(self.gpus)
        bad = [d for d in devices if d not in gpus]
        if bad:
            raise TopologyError(f"devices {bad} are not GPUs of topology {self.name!r} (GPUs: {sorted(gpus)})")
        if len(set(devices)) != len(devices):
            raise TopologyError(f"duplicate devices in {devices}")
        return devices

    def subset(self, devices: Iterable[int]) -> Topology:
        """The part of the machine a job got: the given GPUs, the links among them, and the shared
        nodes (switches, CPUs, NICs) that can carry traffic between them.

        Shared nodes are kept unless they are dead ends: repeatedly drop every switch node joined to
        at most one remaining node, so a PCIe switch, CPU or network that joins two chosen GPUs stays
        (and stays shared) while branches leading only to other GPUs go. Raises TopologyError for
        devices that are not GPUs of this topology or duplicates.

        Example: GPUs 0-3 of a DGX-1V keep their NVLinks (GB/s per direction; GPUs 0 and 3 share two
        links) and the PCIe switches and CPU between them::

            >>> from jax_blink import Topology
            >>> sub = Topology.preset("dgx1v").subset([0, 1, 2, 3])
            >>> sub
            Topology('dgx1v[0,1,2,3]', gpus=4, switches=3, edges=24)
            >>> sub.switches
            ['cpu0', 'pcie-switch-0', 'pcie-switch-1']
            >>> sub.bandwidth(0, 3), sub.bandwidth(0, 1)
            (45.8, 22.9)
        """
        devices = self.check_devices(devices)
        g = self.graph
        keep = set(devices) | {n for n, k in g.nodes(data="kind") if k != "gpu"}
        # undirected neighbour sets of the kept nodes (plain sets: no networkx graph copy)
        und = {n: {m for m in g.succ[n] if m in keep} | {m for m in g.pred[n] if m in keep} for n in keep}
        leaves = [n for n in und if not isinstance(n, int) and len(und[n]) <= 1]
        while leaves:
            nbrs = set()
            for n in leaves:
                for m in und.pop(n):
                    und[m].discard(n)
                    nbrs.add(m)
            leaves = [n for n in nbrs if n in und and not isinstance(n, int) and len(und[n]) <= 1]
        t = Topology(f"{self.name}[{','.join(map(str, devices))}]")
        # the induced subgraph in the original node and edge order, built directly (a subgraph view's
        # filtered iteration cost more than the copy)
        t.graph.graph.update(g.graph)
        t.graph.add_nodes_from((n, d) for n, d in g.nodes(data=True) if n in und)
        t.graph.add_edges_from((u, v, d) for u, v, d in g.edges(data=True) if u in und and v in und)
        t.notes = list(self.notes)
        return t

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """JSON-ready dict: {"name", "nodes": [{"id", "kind"}], "links": [{"src", "dst",
        "bandwidth_gbps", "kind", "links"}]} in a stable order, plus "notes" when there are any and
        a GPU node's "no_p2p" (peers without peer access) when it has one."""
        nodes = [{"id": n, "kind": self.graph.nodes[n]["kind"]} for n in sorted(self.graph, key=_key)]
        for d in nodes:
            if self.graph.nodes[d["id"]].get("no_p2p"):
                d["no_p2p"] = sorted(self.graph.nodes[d["id"]]["no_p2p"])
        links = [{"src": u, "dst": v, "bandwidth_gbps": bw, "kind": k, "links": c}
                 for u, v, bw, k, c in self.links()]
        d = {"name": self.name, "nodes": nodes, "links": links}
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def to_json(self, **kw) -> str:
        """Serialise with :meth:`to_dict`; round-trips through :meth:`from_json`."""
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        """Inverse of :meth:`to_dict`. Raises TopologyError naming the bad entry."""
        if not isinstance(data, dict) or "nodes" not in data or "links" not in data:
            raise TopologyError("topology JSON must be an object with 'nodes' and 'links'")
        t = cls(str(data.get("name", "custom")))
        notes = data.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(x, str) for x in notes):
            raise TopologyError(f"'notes' must be a list of strings, got {notes!r}")
        t.notes = list(notes)
        for i, n in enumerate(data["nodes"]):
            try:
                nid, kind = n["id"], n["kind"]
            except (TypeError, KeyError):
                raise TopologyError(f"nodes[{i}]: expected {{'id': ..., 'kind': ...}}, got {n!r}") from None
            if nid in t.graph:
                raise TopologyError(f"nodes[{i}]: duplicate node id {nid!r}")
            if kind == "gpu":
                t.add_gpu(nid, **({"no_p2p": tuple(n["no_p2p"])} if n.get("no_p2p") else {}))
            else:
                t.add_switch(nid, kind)
        for i, e in enumerate(data["links"]):
            try:
                u, v, bw, k, c = e["src"], e["dst"], e["bandwidth_gbps"], e["kind"], e.get("links", 1)
            except (TypeError, KeyError):
                raise TopologyError(f"links[{i}]: expected src, dst, bandwidth_gbps, kind; got {e!r}") from None
            if t.graph.has_edge(u, v):
                raise TopologyError(f"links[{i}]: duplicate link {u!r}->{v!r}")
            try:
                t.add_link(u, v, float(bw) / int(c), k, links=int(c), bidirectional=False)
            except (TypeError, ValueError) as err:
                if isinstance(err, TopologyError):
                    raise TopologyError(f"links[{i}]: {err}") from None
                raise TopologyError(f"links[{i}]: bad numbers in {e!r}") from None
        return t

    @classmethod
    def from_json(cls, text: str) -> Topology:
        """Parse :meth:`to_json` output. Raises TopologyError on malformed JSON."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TopologyError(f"not valid JSON: {err}") from None
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """Stable hex digest of nodes, kinds and links (not the name): a cache key for plans.

        Kept on the object with a snapshot of the fields it hashes (node kinds and ``no_p2p``, link
        bandwidths, kinds and counts, in graph order), recomputed when the snapshot differs: building
        the snapshot costs a fraction of the digest, and any change to the graph, through
        :meth:`add_link` or ``graph`` directly, changes it. The graph a Topology builds counts its
        changes (nodes and links added or removed, attributes set), so while that count, the graph
        object and the ``no_p2p`` lists are the same the kept digest is returned without the snapshot
        (O(1) instead of a pass over every link: a cached plan of 1,024 GPUs loads in milliseconds)."""
        g = self.graph
        kept = self.__dict__.get("_fingerprint")
        version = getattr(g, "_version", None) if type(g) is _TrackedDiGraph else None
        if kept is not None and version is not None and kept[2] is g and kept[3] == version \
                and all(tuple(g._node[n]["no_p2p"]) == v for n, v in kept[4]):  # (lists: changed in place)
            return kept[1]  # the graph this digest was made of, unchanged since (a 1,024-GPU pass costs ms)
        # networkx's node and adjacency dicts directly (graph order): the views cost twice as much
        snap = (tuple((n, d.get("kind"), tuple(d["no_p2p"]) if d.get("no_p2p") else None)
                      for n, d in g._node.items()),
                tuple((u, v, d.get("bandwidth_gbps"), d.get("kind"), d.get("links"))
                      for u, nbrs in g._adj.items() for v, d in nbrs.items()))
        p2p = tuple((n, v) for n, _, v in snap[0] if v is not None)
        if kept is not None and kept[0] == snap:
            self._fingerprint = (snap, kept[1], g, version, p2p)
            return kept[1]
        d = self.to_dict()
        d.pop("name")
        d.pop("notes", None)
        fp = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
        self._fingerprint = (snap, fp, g, version, p2p)
        return fp

    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return (f"Topology({self.name!r}, gpus={len(self.gpus)}, switches={len(self.switches)}, "
                f"edges={self.graph.number_of_edges()})")

    # ----------------------------------------------------------------- constructors
    @classmethod
    def host(cls, n: int, gbps: float = 10.0) -> Topology:
        """n CPU devices sharing host memory: each joined to one "host" node at ``gbps`` GB/s.

        The embedded default on machines without GPUs (``--xla_force_host_platform_device_count``).
        """
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or int(n) != n or n < 1:
            raise TopologyError(f"Topology.host needs n >= 1 devices, got {n!r}")
        if n > MAX_HOST_DEVICES:  # planning is polynomial in n: refuse before minutes of work
            raise TopologyError(f"host{n}: at most {MAX_HOST_DEVICES} devices (a job's host CPU devices); "
                                f"got {n}")
        t = cls(f"host{n}")
        t.add_switch("host", "host")
        for i in range(n):
            t.add_gpu(i)
            t.add_link(i, "host", gbps, "host")
        return t


    @classmethod
    def preset(cls, name: str) -> Topology:
        """A machine preset by name (see :data:`jax_blink.topology.presets.PRESETS`; ``host<N>`` too).
        Raises TopologyError for an unknown name, listing the known ones."""
        return _source("preset")(name)

    @classmethod
    def from_nvidia_smi(cls, text: str, **kw) -> Topology:
        """Parse ``nvidia-smi topo -m`` output (optionally followed by ``topo -p2p``); see
        :func:`jax_blink.topology.nvsmi.parse_topo` for keywords (``nvlink_gbps``, ``pcie_gbps``, ...)."""
        return _source("nvidia_smi")(text, **kw)

    @classmethod
    def detect(cls, **kw) -> Topology:
        """This machine's topology: NVML, else ``nvidia-smi topo -m``; see
        :func:`jax_blink.topology.nvml.detect`. Raises TopologyError saying how to pass one instead."""
        return _source("detect")(**kw)

    @classmethod
    def load(cls, source, **kw) -> Topology:
        """A Topology from a preset name, a ``topo -m`` text file, a JSON file, or a Topology;
        see :func:`jax_blink.topology.load.load_topology`."""
        return _source("load")(source, **kw)


def _key(n):
    """Sort key putting GPUs (ints) before switch ids (strings)."""
    return (0, n, "") if isinstance(n, int) else (1, 0, str(n))
