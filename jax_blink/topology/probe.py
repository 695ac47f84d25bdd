"""Measure the links the job's devices really have (Blink, Wang et al., MLSys 2020, section 3).

A link can be slower than its label (PCIe negotiated down to a lower gen or width, a degraded
NVLink, a VM's virtual topology), so Blink times transfers between the devices a job got instead of
trusting a table. :func:`probe` copies buffers between every ordered pair of devices with
``jax.device_put`` (device-to-device copies on GPUs, memory copies between host CPU devices):

1. one way (``i -> j`` alone) and both ways at once (``i -> j`` and ``j -> i`` together);
2. two transfers between four distinct devices at once: when each slows the other down by more than
   :data:`SLOWDOWN`, they share a link (two GPUs behind one PCIe switch halve each other);
3. every device sending to the next at once (a ring shift), the load a collective puts on the links.

The result is a :class:`~jax_blink.topology.Topology` whose GPU ids are the devices' topology ids
(:func:`default_gpu_id`: ``local_hardware_id`` on GPUs, ``device.id`` elsewhere) and whose
capacities are measured GB/s per direction: a direct link per ordered pair when no transfers share
a link; otherwise one shared node per group of devices whose transfers slow each other down, each
member joined to it at the rate it gets under the ring-shift load, and the groups joined through a
root node at the rate their shared uplink carried. Its notes say where the measurement and the
labelled topology (``label=``, else the detected one on GPUs) differ by more than 20%.

``JAX_BLINK_TOPOLOGY=probe`` (and ``topology="probe"`` anywhere a topology source is taken) plans on
:func:`cached_probe`'s result, measured once per machine and device set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import socket
import time

import networkx as nx
import numpy as np

from .. import envvars
from ..errors import TopologyError
from .model import Topology
from .nvml import detect

DEFAULT_SIZES = (1 << 20, 1 << 24)  # bytes per transfer: a small and a bandwidth-bound copy
SLOWDOWN = 1.2  # two transfers that take > 20% longer together than alone share a link
DISAGREE = 0.2  # measurement vs label: a note beyond this relative difference
MAX_PAIR_TESTS = 48  # concurrent-pair tests (a deterministic sample beyond this)
ENV_CACHE_DIR = "JAX_BLINK_CACHE_DIR"


@dataclasses.dataclass
class Measurement:
    """Raw probe results, GB/s per direction at the largest size (ids are topology GPU ids).

    Attributes:
      gpus: topology GPU ids of the probed devices, in device order.
      one_way: ``{(i, j): GB/s}`` of ``i -> j`` alone.
      both_ways: ``{(i, j): GB/s}`` of ``i -> j`` while ``j -> i`` runs.
      shared: ``[((i, j), (k, l), slowdown)]`` for pairs of transfers that slow each other down by
        more than :data:`SLOWDOWN` (slowdown: time together / time alone of the more slowed one).
      ring: ``{i: GB/s}`` of device ``i``'s send while every device sends to the next at once.
      concurrent: ``{((i, j), (k, l)): GB/s}`` sum of both transfers' rates when run together.
      by_size: ``{bytes: GB/s}`` median one-way rate over all ordered pairs at each probe size.
    """

    gpus: list
    one_way: dict
    both_ways: dict
    shared: list
    ring: dict
    concurrent: dict
    by_size: dict = dataclasses.field(default_factory=dict)


#: JAX platform names of GPUs (a probe of any other platform measures host memory copies).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def default_gpu_id(device) -> int:
    """Topology GPU id of a JAX device under the default mapping: ``local_hardware_id`` on GPUs
    (the CUDA / ROCm index), ``device.id`` elsewhere."""
    if device.platform in GPU_PLATFORMS:
        hw = getattr(device, "local_hardware_id", None)
        if hw is not None:
            return int(hw)
    return int(device.id)


def probe(devices=None, sizes=DEFAULT_SIZES, *, repeats: int = 3, label=None,
          max_pair_tests: int = MAX_PAIR_TESTS) -> Topology:
    """The measured topology of ``devices`` (Blink section 3).

    Args:
      devices: JAX devices of the job (default ``jax.local_devices()``: a process can copy only
        between its own devices), at least 2, all distinct and of one platform.
      sizes: transfer sizes in bytes (ints, 4 B .. 4 GiB); capacities come from the largest; the
        median one-way rate at every size is in the notes (small copies are latency-bound).
      repeats: timings per transfer (the fastest counts), >= 1.
      label: the topology the devices are said to have (a Topology or any ``load_topology``
        source), compared with the measurement; default: on GPUs the detected one, else none.
      max_pair_tests: how many concurrent pairs of transfers to time (a deterministic sample when
        there are more; every pair for up to 4 devices).

    Returns: a Topology named ``probe-<platform><n>`` with capacities in GB/s per direction (see the
    module docstring for its shape) and notes on what was measured and where it disagrees with
    the label. Raises TopologyError (bad arguments, fewer than 2 devices, devices mapping to the
    same topology GPU), TypeError for non-integer sizes.
    """
    devices, sizes = _check_args(devices, sizes, repeats, max_pair_tests)
    m = measure(devices, sizes, repeats=repeats, max_pair_tests=max_pair_tests)
    platform = devices[0].platform
    t = build_topology(m, platform)
    t.notes.append(f"probed {len(devices)} {platform} devices with jax.device_put copies of "
                   f"{', '.join(_fmt_bytes(s) for s in sizes)} (capacities at {_fmt_bytes(sizes[-1])}, "
                   f"fastest of {repeats}); median one-way GB/s by size: "
                   + ", ".join(f"{_fmt_bytes(k)} {v:.3g}" for k, v in sorted(m.by_size.items())))
    if platform not in GPU_PLATFORMS:
        t.notes.append(f"{platform} devices are not GPUs: every figure is the copy bandwidth of jax.device_put "
                       "between two devices of this process (memory copies by the host), not a link; a link's "
                       "GB/s is what each device moved while the other transfers in the measurement ran, the "
                       "median one-way GB/s is one pair copying alone")
    if label is None and platform in GPU_PLATFORMS:
        try:
            label = detect()
        except TopologyError as err:
            t.notes.append(f"no labelled topology to compare with ({err})")
    if label is not None:
        t.notes.extend(compare(m, label))
    return t


def _check_args(devices, sizes, repeats, max_pair_tests):
    import jax
    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) < 2:
        raise TopologyError(f"probe needs at least 2 devices to time transfers between, got {len(devices)}; "
                            "on CPU start JAX with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    if not all(isinstance(d, jax.Device) for d in devices):
        raise TopologyError(f"probe takes jax.Device objects (jax.devices()), got {devices!r}")
    if len({d.platform for d in devices}) != 1 or len(set(devices)) != len(devices):
        raise TopologyError(f"probe needs distinct devices of one platform, got {devices}")
    sizes = tuple(sizes) if not isinstance(sizes, (int, np.integer)) else (sizes,)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in sizes):
        raise TypeError(f"probe sizes are ints (bytes per transfer), got {sizes!r}")
    if any(s < 4 or s > 1 << 32 for s in sizes):
        raise TopologyError(f"probe sizes must be 4 B .. 4 GiB per transfer, got {sizes!r}")
    for name, v in (("repeats", repeats), ("max_pair_tests", max_pair_tests)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "repeats" else 0):
            raise TopologyError(f"probe {name} must be an int >= {1 if name == 'repeats' else 0}, got {v!r}")
    return devices, tuple(sorted(int(s) for s in sizes))


def measure(devices, sizes, *, repeats: int = 3, max_pair_tests: int = MAX_PAIR_TESTS) -> Measurement:
    """Time the transfers (see the module docstring): one way at every size, the rest at
    ``max(sizes)``; GB/s, the fastest of ``repeats``."""
    import jax
    gpus = [default_gpu_id(d) for d in devices]
    if len(set(gpus)) != len(gpus):
        raise TopologyError(f"devices {devices} map to topology GPUs {gpus}, some twice")
    n = len(devices)
    with jax.ensure_compile_time_eval():  # JAX_BLINK_TOPOLOGY=probe runs this while a psum traces
        def rate(transfers) -> list[float]:
            """GB/s of each (src index, dst index) transfer when all start at once: bytes over the
            time until it is seen done (waited on in order, so a later one's time is an upper bound);
            the fastest of ``repeats`` runs after a warm-up run."""
            best = [math.inf] * len(transfers)
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                outs = [jax.device_put(bufs[i], devices[j]) for i, j in transfers]
                for k, o in enumerate(outs):
                    o.block_until_ready()
                    if rep:  # run 0 warms the copy path up
                        best[k] = min(best[k], time.perf_counter() - t0)
                del outs
            return [nbytes / max(b, 1e-9) / 1e9 for b in best]

        by_size = {}
        for nbytes in sizes:  # ascending: the largest stays in nbytes / bufs for the tests below
            bufs = [jax.device_put(np.ones(nbytes, np.uint8), d) for d in devices]
            for b in bufs:
                b.block_until_ready()
            one = {(i, j): rate([(i, j)])[0] for i, j in itertools.permutations(range(n), 2)}
            by_size[nbytes] = float(np.median(list(one.values())))
        both = {}
        for i, j in itertools.combinations(range(n), 2):
            both[i, j], both[j, i] = rate([(i, j), (j, i)])
        tests = [(a, b) for a, b in itertools.combinations(itertools.combinations(range(n), 2), 2)
                 if not set(a) & set(b)]
        if len(tests) > max_pair_tests:
            pick = np.random.default_rng(0).choice(len(tests), max_pair_tests, replace=False)
            tests = [tests[k] for k in sorted(pick)]
        shared, concurrent = [], {}
        for a, b in tests:
            ra, rb = rate([a, b])
            concurrent[a, b] = ra + rb
            slow = max(one[a] / ra, one[b] / rb)  # the more slowed transfer: time together / alone
            if slow > SLOWDOWN:
                shared.append((a, b, slow))
        ring = dict(zip(range(n), rate([(i, (i + 1) % n) for i in range(n)])))
    g = lambda p: (gpus[p[0]], gpus[p[1]])  # noqa: E731
    return Measurement(
        gpus=gpus, one_way={g(p): v for p, v in one.items()}, both_ways={g(p): v for p, v in both.items()},
        shared=[(g(a), g(b), s) for a, b, s in shared], ring={gpus[i]: v for i, v in ring.items()},
        concurrent={(g(a), g(b)): v for (a, b), v in concurrent.items()}, by_size=by_size)


def build_topology(m: Measurement, platform: str = "cpu") -> Topology:
    """The Topology a :class:`Measurement` describes (see the module docstring)."""
    on_gpu = platform in GPU_PLATFORMS
    link_kind, hub_kind = ("pcie", "pcie-switch") if on_gpu else ("host", "host")
    t = Topology(f"probe-{platform}{len(m.gpus)}")
    for g in m.gpus:
        t.add_gpu(g)
    per_dir = {p: min(m.one_way[p], m.both_ways[p]) for p in m.one_way}
    groups = nx.utils.UnionFind(m.gpus)
    for (src1, dst1), (src2, dst2), _ in m.shared:
        groups.union(src1, src2)  # the two senders share a link ...
        groups.union(dst1, dst2)  # ... and so do the two receivers
    clusters = sorted((sorted(c) for c in groups.to_sets()), key=lambda c: c[0])
    if all(len(c) == 1 for c in clusters):
        for (i, j), bw in sorted(per_dir.items()):
            t.add_link(i, j, bw, link_kind, bidirectional=False)
        t.notes.append("no two transfers slowed each other down: one direct link per ordered pair")
        return t
    if len(clusters) == 1:
        t.add_switch("probe-hub", hub_kind)
        for g in m.gpus:
            t.add_link(g, "probe-hub", m.ring[g], link_kind)
        t.notes.append(f"{len(m.shared)} pairs of transfers slowed each other down (e.g. "
                       f"{_pair(m.shared[0])}): all devices share one link structure, joined through "
                       "'probe-hub' at the rate each gets when all send at once")
        return t
    t.add_switch("probe-root", hub_kind)
    for c, members in enumerate(clusters):
        if len(members) == 1:
            g = members[0]
            t.add_link(g, "probe-root", float(np.median([per_dir[g, h] for h in m.gpus if h != g])), link_kind)
            continue
        hub = f"probe-switch{c}"
        t.add_switch(hub, hub_kind)
        for g in members:
            intra = [per_dir[g, h] for h in members if h != g]
            t.add_link(g, hub, float(np.median(intra)), link_kind)
        carried = [v for (a, b), v in m.concurrent.items() if a[0] in members and b[0] in members
                   and a[1] not in members and b[1] not in members]
        cross = [per_dir[g, h] for g in members for h in m.gpus if h not in members]
        t.add_link(hub, "probe-root", float(np.median(carried or cross)), link_kind)
    t.notes.append(f"transfers that slowed each other down group the devices into {clusters}; each group "
                   "shares one uplink to 'probe-root'")
    return t


def _pair(s) -> str:
    (src1, dst1), (src2, dst2), slow = s
    return f"{src1}->{dst1} with {src2}->{dst2}: {slow:.2f}x"


def compare(m: Measurement, label) -> list[str]:
    """Notes where a measured one-way rate and the labelled capacity between the same GPUs differ
    by more than :data:`DISAGREE` (at most 8 pairs listed, the rest counted). The labelled capacity
    is the max-flow from i to j over links and switches with no other GPU forwarding, since a
    device-to-device copy goes over the links joining the two (NVLink, else PCIe) only."""
    label = Topology.load(label)  # the registered loader (topology.load imports this module)
    missing = [g for g in m.gpus if g not in set(label.gpus)]
    if missing:
        return [f"the labelled topology {label.name!r} lacks GPUs {missing}: nothing compared"]
    switches = [n for n, kind in label.graph.nodes(data="kind") if kind != "gpu"]
    out = []
    for (i, j), bw in sorted(m.one_way.items()):
        graph = label.graph.subgraph(switches + [i, j])
        want = nx.maximum_flow_value(graph, i, j, capacity="bandwidth_gbps")
        if want > 0 and abs(bw - want) / want > DISAGREE:
            out.append(f"{i}->{j}: measured {bw:.3g} GB/s, labelled {want:.3g} GB/s ({(bw - want) / want:+.0%})")
    if not out:
        return [f"measurement agrees with the labelled topology {label.name!r} within {DISAGREE:.0%}"]
    head = f"measurement differs from the labelled topology {label.name!r} by more than {DISAGREE:.0%} on " \
           f"{len(out)} of {len(m.one_way)} directed pairs: "
    return [head + "; ".join(out[:8]) + (f"; (+{len(out) - 8} more)" if len(out) > 8 else "")]


def _fmt_bytes(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------ cache
def cache_dir() -> pathlib.Path:
    """Where probed topologies are kept: ``$JAX_BLINK_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax_blink``,
    else ``~/.cache/jax_blink``."""
    if envvars.text(ENV_CACHE_DIR):
        return pathlib.Path(envvars.text(ENV_CACHE_DIR))
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jax_blink"


def cache_key(devices) -> str:
    """Hex key of this machine and device set: host name, platform, device count, kinds and
    topology ids, and the jax version (another device set or a new jax never reads an old probe;
    the probe sizes are not part of it, so `jax-blink topology probe --probe-sizes` feeds
    ``JAX_BLINK_TOPOLOGY=probe``)."""
    import jax
    desc = {"host": socket.gethostname(), "platform": devices[0].platform, "count": len(devices),
            "kinds": [getattr(d, "device_kind", "") for d in devices],
            "ids": [default_gpu_id(d) for d in devices], "jax": jax.__version__}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def cached_probe(devices=None, sizes=DEFAULT_SIZES, *, refresh: bool = False, **kw) -> Topology:
    """:func:`probe`'s result for this machine's devices, from the cache when present (see
    :func:`cache_dir`, :func:`cache_key`), else measured and stored. ``refresh=True`` re-measures.
    The topology's notes name the cache file and when it was measured."""
    import jax
    devices, sizes = _check_args(devices, sizes, kw.get("repeats", 3), kw.get("max_pair_tests", MAX_PAIR_TESTS))
    path = cache_dir() / f"probe-{cache_key(devices)}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            t = Topology.from_dict(data["topology"])
            t.notes.append(f"cached probe from {data['measured_at']} in {path} (delete it to re-probe)")
            return t
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or from another version: measure again and overwrite
    t = probe(devices, sizes, **kw)
    record = {"measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
              "topology": t.to_dict()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
        t.notes.append(f"probe stored in {path}")
    except OSError as err:
        t.notes.append(f"probe not cached ({path}: {err.strerror or err})")
    return t
