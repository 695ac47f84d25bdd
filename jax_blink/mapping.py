"""Which topology a collective plans on, and which topology GPU each JAX device is.

Resolution order for the topology: the ``topology=`` argument (a :class:`Topology`, a
preset name from ``jax_blink.topology.presets.PRESETS`` or a path to a JSON / ``nvidia-smi topo -m`` file),
else the ``JAX_BLINK_TOPOLOGY`` environment variable (preset name or file), else
``Topology.detect()`` on GPU, else ``Topology.host(n)`` for host CPU devices.

Device mapping: by default a JAX device is topology GPU ``device.local_hardware_id`` on GPUs and
``device.id`` elsewhere; :func:`set_device_map` or the ``device_map=`` argument of the public API
overrides it (a dict ``{device.id: gpu}`` or a callable ``device -> gpu``).

Groups: a collective over mesh axes ``axes`` runs once per combination of the other mesh axes (a
*group*); rank ``r`` of a group is the row-major index over ``axes`` in the order given (the same
order as ``lax.axis_index(axes)``). Mesh position is not device id: a permuted mesh puts any device
at position 0, so the device table is built from ``mesh.devices``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import envvars
from .errors import TopologyError
from .planner.model import clear_on_reset
from .topology import Topology, default_gpu_id

ENV_TOPOLOGY = "JAX_BLINK_TOPOLOGY"
ENV_ALGORITHM = "JAX_BLINK_ALGORITHM"

_GLOBAL_DEVICE_MAP: Any = None


class _Frozen:
    """Hashable wrapper of a user device map (dict or callable), compared by identity/content."""

    def __init__(self, m):
        self.m = m
        self._key = tuple(sorted(m.items())) if isinstance(m, dict) else id(m)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Frozen) and self._key == other._key

    def __call__(self, device) -> int:
        if isinstance(self.m, dict):
            if device.id not in self.m:
                raise TopologyError(f"device_map has no entry for JAX device id {device.id} ({device}); "
                                    f"it maps {sorted(self.m)}")
            return int(self.m[device.id])
        return int(self.m(device))

    def __repr__(self):
        return f"device_map({self.m!r})"


def set_device_map(device_map: dict[int, int] | Callable | None) -> None:
    """Set the process-wide mapping of JAX devices onto topology GPU ids.

    Args:
      device_map: ``{device.id: topology_gpu_id}``, a callable ``jax.Device -> int``, or None to
        restore the default (``local_hardware_id`` on GPU, ``device.id`` otherwise).
    Raises TypeError for anything else.
    """
    global _GLOBAL_DEVICE_MAP
    if device_map is not None and not (isinstance(device_map, dict) or callable(device_map)):
        raise TypeError(f"device_map must be a dict, a callable or None, got {type(device_map).__name__}")
    _GLOBAL_DEVICE_MAP = device_map


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Hashable primitive parameter: what to plan on (resolved at lowering, when devices are known).

    Attributes:
      topology: a Topology, a preset name / file path (str), or None (environment / detection).
      device_map: a frozen user mapping, or None for the default mapping.
      chunk_elems: fixed chunk size in elements for the schedule, or None for the cost model.
      algorithm: ``jax_blink.plan``'s algorithm: "auto" (default), "trees", "ring" (all-reduce only)
        or "hierarchical" (Blink's three phases, section 5; groups spanning two or more nodes).
      algorithm_strict: False when ``algorithm`` came from ``JAX_BLINK_ALGORITHM``: a global
        preference applied where it fits (see :func:`effective_algorithm`), not an error elsewhere.
      max_trees: plan with at most this many trees, or None: the lowering picks the tree count per
        operand size by the cost model (:mod:`jax_blink.costmodel`).
    """

    topology: Any = None
    device_map: Any = None
    chunk_elems: int | None = None
    algorithm: str = "auto"
    max_trees: int | None = None
    algorithm_strict: bool = True


def make_plan_key(topology=None, device_map=None, chunk_elems=None, algorithm=None,
                  max_trees=None) -> PlanKey:
    """Build a :class:`PlanKey` from the public-API arguments (reads ``JAX_BLINK_TOPOLOGY`` and, when
    ``algorithm`` is None, ``JAX_BLINK_ALGORITHM``; default "auto"). Raises ValueError for an
    unknown algorithm, naming where it came from, or a ``max_trees`` that is not a positive int."""
    from .planner.facade import ALGORITHMS
    where, strict = "algorithm=", True
    if algorithm is None:
        algorithm = envvars.choice(ENV_ALGORITHM) or "auto"
        where, strict = ENV_ALGORITHM, False
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where} must be one of {ALGORITHMS}, got {algorithm!r}")
    if topology is None and envvars.text(ENV_TOPOLOGY):
        topology = envvars.text(ENV_TOPOLOGY)
        try:
            named_topology(topology)
        except TopologyError as err:
            raise TopologyError(f"{ENV_TOPOLOGY}={topology!r}: {err}") from None
    if topology is not None and not isinstance(topology, (Topology, str, os.PathLike)):
        raise TypeError(f"topology must be a Topology, a preset name or a file path, got "
                        f"{type(topology).__name__}")
    if isinstance(topology, os.PathLike):
        topology = os.fspath(topology)
    dm = device_map if device_map is not None else _GLOBAL_DEVICE_MAP
    if dm is not None and not (isinstance(dm, dict) or callable(dm)):
        raise TypeError(f"device_map must be a dict or a callable, got {type(dm).__name__}")
    if chunk_elems is not None and (isinstance(chunk_elems, (bool, np.bool_)) or not isinstance(
            chunk_elems, (int, np.integer)) or chunk_elems < 1):
        raise ValueError(f"chunk_elems must be a positive int, got {chunk_elems!r}")
    if max_trees is not None and (isinstance(max_trees, bool) or not isinstance(max_trees, int) or max_trees < 1):
        raise ValueError(f"max_trees must be a positive int or None (cost model), got {max_trees!r}")
    return PlanKey(topology, _Frozen(dm) if dm is not None else None, chunk_elems, algorithm, max_trees,
                   strict)


@clear_on_reset
@functools.lru_cache(maxsize=64)
def _load(spec: str) -> Topology:
    from .topology.load import load_topology
    return load_topology(spec)


def named_topology(spec) -> Topology | None:
    """The Topology a :class:`PlanKey`'s ``topology`` names: itself for a Topology, the loaded preset
    or file for a str, None for None (environment unset: detection or host, :func:`resolve_topology`).

    The one resolution of a named topology a call site shares (``make_plan_key`` for
    ``JAX_BLINK_TOPOLOGY``, the API's trace-time check, the dispatcher at lowering): a memo keyed by
    the spec, emptied by ``jax_blink.clear_caches`` (after editing a topology file).
    Raises TopologyError when a named topology cannot be loaded.
    """
    if spec is None or isinstance(spec, Topology):
        return spec
    return _load(spec)


def resolve_topology(spec, platform: str, gpu_ids: list[int]) -> Topology:
    """The Topology to plan on for devices that map to ``gpu_ids`` on ``platform``.

    Raises TopologyError when a named topology cannot be loaded or detection fails on GPU.
    """
    if spec is not None:
        return named_topology(spec)
    if platform in ("cuda", "rocm", "gpu"):
        from .topology.nvml import detect
        return detect()
    return _host(max(gpu_ids) + 1)


@functools.lru_cache(maxsize=16)
def _host(n: int) -> Topology:
    return Topology.host(n)


def map_devices(devices, key: PlanKey) -> list[int]:
    """Topology GPU ids of ``devices`` (JAX devices) under ``key.device_map`` or the default."""
    fn = key.device_map if key.device_map is not None else default_gpu_id
    ids = [fn(d) for d in devices]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise TopologyError(f"JAX devices {[d.id for d in devices]} map to topology GPUs {ids}: GPUs "
                            f"{dup} are used twice. Pass device_map= (or jax_blink.set_device_map) "
                            "so every device is a distinct topology GPU")
    return ids


def mesh_groups(mesh_shape: tuple[int, ...], mesh_axis_names: tuple, axes: tuple,
                axis_index_groups=None) -> list[list[int]]:
    """Mesh-linear positions of each group, members in rank order.

    Rank is the row-major index over ``axes`` in the given order (``lax.axis_index(axes)``); with
    ``axis_index_groups`` each group is further split into the listed rank subsets.
    """
    missing = [a for a in axes if a not in mesh_axis_names]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}: the mesh has axes {tuple(mesh_axis_names)}")
    pos = [list(mesh_axis_names).index(a) for a in axes]
    iota = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
    other = [i for i in range(len(mesh_shape)) if i not in pos]
    g = np.transpose(iota, other + pos).reshape(-1, int(np.prod([mesh_shape[i] for i in pos])))
    groups = [list(map(int, row)) for row in g]
    if axis_index_groups is not None:
        groups = [[row[i] for i in sub] for row in groups for sub in axis_index_groups]
    return groups


def device_table(devices_flat, groups) -> np.ndarray:
    """int64 [ndevices, 3] rows (device_id, group, rank) for every member of every group."""
    rows = [(devices_flat[p].id, g, r) for g, members in enumerate(groups) for r, p in enumerate(members)]
    return np.asarray(rows, np.int64).reshape(-1, 3)


def split_by_process(devices_flat, groups) -> list[dict[int, list[int]]]:
    """For each group: ``{process index: its members in that process}`` (mesh positions, rank
    order kept), processes in increasing order. The intra-node groups of Blink's three phases
    (MLSys 2020, section 5) when each process is a node."""
    out = []
    for members in groups:
        split: dict[int, list[int]] = {}
        for p in members:
            split.setdefault(int(devices_flat[p].process_index), []).append(int(p))
        out.append(dict(sorted(split.items())))
    return out


