"""Lowerings of the jax_blink primitives: a registry ``{impl: {platform: rule}}``.

A rule is ``rule(ctx, xs, request_for) -> list[ir.Value]``: ``ctx`` is the ``mlir.LoweringRuleContext``
(its ``avals_in`` / ``avals_out`` describe ``xs``), ``xs`` a bucket of non-empty operands of one dtype
(any shapes), one result per operand, and ``request_for(nelems)`` gives the :class:`LoweringRequest`
for a schedule over ``nelems`` elements: the bucket's total (one call over the leaves as a virtual
concatenation, as the ffi rule does) or one leaf's (the ppermute rule, one schedule per leaf).
``"ppermute"`` registers for every platform (``None``); ``"ffi"`` registers per platform once its
native target exists. ``impl="auto"`` picks ``"ffi"`` when registered for the platform, else
``"ppermute"``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

# impl -> platform (or None for "any platform") -> rule
LOWERINGS: dict[str, dict[str | None, Callable]] = {}


@dataclasses.dataclass(frozen=True)
class LoweringRequest:
    """What a lowering needs to run one collective.

    Attributes:
      collective: a name of ``jax_blink.collectives`` ("allreduce", "broadcast", "reduce",
        "allgather", "reducescatter"); sharded ones run on full buffers (``nelems`` = the full size).
      schedules: one ``jax_blink.schedule.Schedule`` per group, in group order.
      device_table: int64 array [ndevices, 3], rows (device_id, group, rank): which group and rank
        each participating JAX device (``device.id``) has. Built from the mesh, not from device ids.
      groups: for each group, the mesh-linear positions of its members in rank order (what a
        collective_permute over all mesh axes of the call needs).
      axis_names: the mesh axes the collective runs over (as given by the user, a tuple).
      timeout_ms: how long a native executor waits for peers before failing.
    """

    collective: str
    schedules: tuple
    device_table: np.ndarray
    groups: tuple
    axis_names: tuple
    timeout_ms: int = 60_000


def register_lowering(impl: str, platform: str | None, rule: Callable) -> None:
    """Register ``rule`` as lowering ``impl`` on ``platform`` (None: every platform)."""
    LOWERINGS.setdefault(impl, {})[platform] = rule


def find_lowering(impl: str, platform: str) -> Callable | None:
    """The rule for ``impl`` on ``platform``, or None when none is registered."""
    table = LOWERINGS.get(impl, {})
    return table.get(platform, table.get(None))
