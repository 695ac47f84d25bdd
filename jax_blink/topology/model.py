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
# Limits on what a topology file may hold (docs/limits.md, "Topology files"); each keeps a hostile
# or garbled file from costing unbounded time or memory before it is refused.
#: GPUs in a JSON topology: the ``host<N>`` cap. Planning is polynomial in the GPU count (LPs over
#: every GPU pair's paths); 4,096 plans in minutes, 10,000 exhausted memory.
MAX_TOPOLOGY_GPUS = MAX_HOST_DEVICES
#: GPUs in one `nvidia-smi topo -m` matrix or NCCL XML file: each describes one machine, and the
#: largest machines have 16 (DGX-2); a matrix holds n^2 cells and the PCIe tree inference is cubic in
#: n, so 64 keeps a load in milliseconds (1,000 took 41 s).
MAX_MACHINE_GPUS = 64
#: Nodes (GPUs, switches, CPUs, NICs) and directed links in a JSON topology (a 4,096-GPU cluster of
#: DGX-1V nodes has about 6,000 nodes and 36,000 links).
MAX_TOPOLOGY_NODES = 4 * MAX_TOPOLOGY_GPUS
MAX_TOPOLOGY_LINKS = 64 * MAX_TOPOLOGY_GPUS
#: Bytes read from a topology file (a 4,096-GPU JSON topology is about 4 MB); larger files are refused
#: unread.
MAX_FILE_BYTES = 32 << 20
#: Largest GPU id (jax and XLA number devices with 32-bit ints).
MAX_GPU_ID = 2 ** 31 - 1
#: Physical links on one edge (GPUs have at most 18 NVLinks; NVSwitch ports aggregate as many).
MAX_LINKS = 1024
#: NVLinks between two GPUs in a `topo -m` cell (``NV<n>``) or an NCCL XML ``<nvlink count>``: real
#: GPUs have at most 18 in all.
MAX_NVLINKS = 64
#: Achieved GB/s of one link, per direction: 1 MB/s to 1 PB/s. Outside that a number is a typo or
#: garbage, and the planner's LPs lose precision (a 1e-320 GB/s link planned a rate of 0.0).
MIN_GBPS, MAX_GBPS = 1e-3, 1e6
#: Characters of a switch id, kind or name (the value shown in an error is cut to 80).
MAX_NAME_CHARS = 256
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


def show(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about hostile input (a 10 MB
    string or a huge int must not become a 10 MB message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"  # (str() refuses > 4300)
    try:
        r = repr(value) if not isinstance(value, (list, dict, tuple)) or len(value) < 64 else \
            f"a {type(value).__name__} of {len(value)} items"
    except (RecursionError, ValueError):  # a deeply nested value; an int too long for str()
        r = f"a {type(value).__name__}"
    return r if len(r) <= limit else r[:limit - 5] + " ...'"


def check_number(value, what: str, kind: str, lo=None, hi=None):
    """``value`` checked as a count (``kind="count"``: an int, returned as int) or a rate
    (``kind="rate"``: a finite real number, returned as float) in ``[lo, hi]``.

    The one number check of every topology loader (JSON fields, `topo -m` cells, NCCL XML attributes,
    rate keywords). Defaults: counts 1..:data:`MAX_LINKS`, rates :data:`MIN_GBPS`..:data:`MAX_GBPS`.
    ``what`` names the field (e.g. ``"links[3].bandwidth_gbps"``); the TopologyError raised names it
    and the value. Refused: booleans (``true`` is no count or rate), non-numbers (strings included:
    parse them first), NaN and infinities, fractions where a count is meant (2.0 is 2, 2.5 is refused),
    values out of range.
    """
    if kind not in ("count", "rate"):
        raise ValueError(f"check_number: kind must be 'count' or 'rate', got {kind!r}")
    count = kind == "count"
    lo = (1 if count else MIN_GBPS) if lo is None else lo
    hi = (MAX_LINKS if count else MAX_GBPS) if hi is None else hi
    want = f"an integer from {lo} to {hi}" if count else f"a finite number > 0 of GB/s, from {lo:g} to {hi:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TopologyError(f"{what} must be {want}, got {show(value)} ({type(value).__name__})")
    if isinstance(value, numbers.Integral):
        v = int(value)
    else:
        v = float(value)
        if not math.isfinite(v):
            raise TopologyError(f"{what} must be {want}, got {show(value)}")
        if count:
            if v != int(v):
                raise TopologyError(f"{what} must be {want}, got {show(value)} (a fraction)")
            v = int(v)
    if not lo <= v <= hi:
        raise TopologyError(f"{what} must be {want}, got {show(value)}")
    return v if count else float(v)


def check_rates(**rates) -> None:
    """Check rate keywords (``nvlink_gbps=``, ``pcie_gbps=``, ...: achieved GB/s per direction) with
    :func:`check_number`; None (from the source) passes. Raises TopologyError naming the keyword."""
    for label, v in rates.items():
        if v is not None:
            check_number(v, label, "rate")


def source_text(text, what: str) -> str:
    """The text of a topology source (str, or UTF-8 bytes) checked before parsing: a string, no NUL
    bytes, at most :data:`MAX_FILE_BYTES` characters. ``what`` names the format for the message.
    Raises TopologyError."""
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_FILE_BYTES:
            raise TopologyError(f"{what} input is {len(text):,} bytes; at most {MAX_FILE_BYTES:,} "
                                f"(jax_blink.topology.model.MAX_FILE_BYTES) are read")
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise TopologyError(f"{what} input must be text, got {type(text).__name__}")
    if len(text) > MAX_FILE_BYTES:
        raise TopologyError(f"{what} input is {len(text):,} characters; at most {MAX_FILE_BYTES:,} "
                            f"(jax_blink.topology.model.MAX_FILE_BYTES) are read")
    if "\x00" in text:
        raise TopologyError(f"input is binary data (it holds NUL bytes), not {what}")
    return text


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
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_GPU_ID:
            raise TopologyError(f"GPU ids are ints from 0 to {MAX_GPU_ID}, got {show(index)}")
        self.graph.add_node(index, kind="gpu", **attrs)

    def add_switch(self, node_id: str, kind: str, **attrs) -> None:
        """Add a shared resource node (string id, kind in NODE_KINDS minus 'gpu')."""
        if not isinstance(kind, str) or kind not in NODE_KINDS or kind == "gpu":
            raise TopologyError(f"unknown node kind {show(kind)} of node {show(node_id)}; expected one of "
                                f"{NODE_KINDS[1:]} (or 'gpu' for an int id)")
        if not isinstance(node_id, str) or not 0 < len(node_id) <= MAX_NAME_CHARS:
            raise TopologyError(f"a {kind} node's id must be a string of 1 to {MAX_NAME_CHARS} characters "
                                f"(GPUs have int ids), got {show(node_id)}")
        self.graph.add_node(node_id, kind=kind, **attrs)

    def add_link(self, u, v, per_link_gbps: float, kind: str, links: int = 1,
                 bidirectional: bool = True) -> None:
        """Add ``links`` links of ``per_link_gbps`` GB/s (per direction) between u and v.

        Adding to an existing edge adds links and bandwidth (parallel links aggregate).
        Both endpoints must already exist. Raises TopologyError on unknown nodes, a self loop, an
        unknown kind, a bandwidth outside :data:`MIN_GBPS`..:data:`MAX_GBPS` or not a finite number,
        or a count of links that is not an int from 1 to :data:`MAX_LINKS` (:func:`check_number`).
        """
        try:
            for n in (u, v):
                if n not in self.graph:
                    raise TopologyError(f"link {show(u)}-{show(v)}: node {show(n)} is not in the topology; "
                                        "add it first")
        except TypeError:  # an unhashable id (a list from a JSON file)
            raise TopologyError(f"link {show(u)}-{show(v)}: node ids are ints (GPUs) or strings") from None
        if u == v:
            raise TopologyError(f"link {u!r}-{v!r}: self loops are not links")
        if not isinstance(kind, str) or kind not in LINK_KINDS:
            raise TopologyError(f"link {u!r}-{v!r}: unknown kind {show(kind)}; expected one of {LINK_KINDS}")
        per_link_gbps = check_number(per_link_gbps, f"link {u!r}-{v!r}: bandwidth", "rate")
        links = check_number(links, f"link {u!r}-{v!r}: links", "count")
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
        """Inverse of :meth:`to_dict`. Raises TopologyError naming the bad entry and its value.

        Checked: ``name`` a string of at most :data:`MAX_NAME_CHARS`; ``notes`` strings; at most
        :data:`MAX_TOPOLOGY_NODES` nodes, :data:`MAX_TOPOLOGY_GPUS` of them GPUs, and
        :data:`MAX_TOPOLOGY_LINKS` links; each node's ``kind`` (named when unknown) and ``id`` (an int
        for a GPU, a string otherwise); each link's ``bandwidth_gbps`` (a rate) and ``links`` (a count,
        :func:`check_number`). Fields the format does not have are ignored and named in ``notes``.
        """
        if not isinstance(data, dict) or "nodes" not in data or "links" not in data:
            got = f"an object with keys {show(sorted(map(str, data)))}" if isinstance(data, dict) else \
                f"a JSON {type(data).__name__}"
            raise TopologyError(f"topology JSON must be an object with 'nodes' and 'links', got {got}")
        name = data.get("name", "custom")
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise TopologyError(f"'name' must be a string of at most {MAX_NAME_CHARS} characters, got {show(name)}")
        t = cls(name)
        notes = data.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(x, str) for x in notes):
            raise TopologyError(f"'notes' must be a list of strings, got {show(notes)}")
        t.notes = list(notes)
        ignored = [f"{k!r}" for k in data if k not in ("name", "nodes", "links", "notes")]
        nodes, links = data["nodes"], data["links"]
        for key, items, most in (("nodes", nodes, MAX_TOPOLOGY_NODES), ("links", links, MAX_TOPOLOGY_LINKS)):
            if not isinstance(items, list):
                raise TopologyError(f"'{key}' must be a list, got {show(items)}")
            if len(items) > most:
                raise TopologyError(f"'{key}' has {len(items):,} entries; at most {most:,} are read "
                                    f"(jax_blink.topology.model.MAX_TOPOLOGY_{key.upper()}, docs/limits.md)")
        n_gpus = sum(1 for n in nodes if isinstance(n, dict) and n.get("kind") == "gpu")
        if n_gpus > MAX_TOPOLOGY_GPUS:
            raise TopologyError(f"'nodes' holds {n_gpus:,} GPUs; at most {MAX_TOPOLOGY_GPUS:,} "
                                f"(MAX_TOPOLOGY_GPUS, the host<N> cap: planning time and memory grow "
                                f"polynomially with the GPU count; docs/limits.md)")
        for i, n in enumerate(nodes):
            if not isinstance(n, dict) or "id" not in n or "kind" not in n:
                raise TopologyError(f"nodes[{i}]: expected {{'id': ..., 'kind': ...}}, got {show(n)}")
            nid, kind = n["id"], n["kind"]
            ignored += [f"nodes[{i}].{k}" for k in n if k not in ("id", "kind", "no_p2p")]
            try:
                if kind == "gpu":
                    t.add_gpu(nid)  # checks the id before the lookup below (a list id is unhashable)
                    if n.get("no_p2p"):
                        t.graph.nodes[nid]["no_p2p"] = _gpu_list(n["no_p2p"], "no_p2p")
                else:
                    if isinstance(nid, str) and nid in t.graph:
                        raise TopologyError(f"duplicate node id {nid!r}")
                    t.add_switch(nid, kind)
            except TopologyError as err:
                raise TopologyError(f"nodes[{i}]: {err}") from None
            if t.graph.number_of_nodes() != i + 1:
                raise TopologyError(f"nodes[{i}]: duplicate node id {nid!r}")
        for i, e in enumerate(links):
            if not isinstance(e, dict) or not {"src", "dst", "bandwidth_gbps", "kind"} <= e.keys():
                raise TopologyError(f"links[{i}]: expected src, dst, bandwidth_gbps, kind (and links); "
                                    f"got {show(e)}")
            ignored += [f"links[{i}].{k}" for k in e if k not in ("src", "dst", "bandwidth_gbps", "kind", "links")]
            u, v = e["src"], e["dst"]
            try:
                bw = check_number(e["bandwidth_gbps"], "bandwidth_gbps", "rate", hi=MAX_GBPS * MAX_LINKS)
                c = check_number(e.get("links", 1), "links", "count")
                for x in (u, v):
                    if isinstance(x, bool) or not isinstance(x, (int, str)):
                        raise TopologyError(f"src and dst are node ids (ints or strings), got {show(x)}")
                if t.graph.has_edge(u, v):
                    raise TopologyError(f"duplicate link {u!r}->{v!r}")
                t.add_link(u, v, bw / c, e["kind"], links=c, bidirectional=False)
            except TopologyError as err:
                raise TopologyError(f"links[{i}]: {err}") from None
        if ignored:
            t.notes.append(f"ignored {len(ignored)} field(s) the topology JSON format does not have: "
                           f"{', '.join(ignored[:6])}{' ...' if len(ignored) > 6 else ''}")
        return t

    @classmethod
    def from_json(cls, text: str) -> Topology:
        """Parse :meth:`to_json` output (str or UTF-8 bytes, at most :data:`MAX_FILE_BYTES`). Raises
        TopologyError on malformed JSON (with its line and column), JSON nested deeper than the
        interpreter's recursion limit (the format needs 3 levels), or a bad entry (:meth:`from_dict`)."""
        text = source_text(text, "a topology JSON")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TopologyError(f"not valid JSON: {err}") from None
        except RecursionError:
            raise TopologyError("the JSON is nested too deeply to read (thousands of levels; the topology "
                                "format has 3)") from None
        except ValueError as err:  # e.g. an integer literal of more digits than Python converts
            raise TopologyError(f"not a usable JSON value: {show(str(err), 200)}") from None
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


def _gpu_list(value, what: str) -> tuple:
    """A JSON list of GPU ids (``no_p2p``) as a sorted tuple; TopologyError naming ``what`` otherwise."""
    if not isinstance(value, list) or len(value) > MAX_TOPOLOGY_GPUS:
        raise TopologyError(f"{what} must be a list of at most {MAX_TOPOLOGY_GPUS} GPU ids, got {show(value)}")
    bad = [x for x in value if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_GPU_ID]
    if bad:
        raise TopologyError(f"{what} must hold GPU ids (ints from 0 to {MAX_GPU_ID}), got {show(bad[0])}")
    return tuple(sorted(set(value)))


def _key(n):
    """Sort key putting GPUs (ints) before switch ids (strings)."""
    return (0, n, "") if isinstance(n, int) else (1, 0, str(n))
