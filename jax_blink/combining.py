"""Combining independent collectives of one jaxpr into buckets (what XLA's all-reduce combiner does
to a compiled program, done here on the traced program that ``jax_blink.transform`` re-evaluates).

A program's collectives are often many and small: ``lax.pmean`` of a gradient pytree binds one psum
per leaf, every BatchNorm averages its statistics with one of its own. XLA merges those that do not
depend on each other into a few all-reduces before it runs them (``AllReduceCombiner``, byte
threshold ``xla_gpu_all_reduce_combine_threshold_bytes``, 30 MiB by default, and at most 256
operands per combined op); a rewrite that hands them to jax_blink one by one loses that, so
:func:`plan` does it on the jaxpr.

Method. Every equation is a node, every variable an edge from its producer to its consumers; the
equations with effects other than a collective's named-axis effect keep their order (an edge from
each to the next). A combinable equation (``key_of(eqn)`` is not None: same collective kind, axes,
groups, dtypes and lowering make the same key) gets a *height*: the largest number of combinable
equations on a path from it to the program's end. An equation that depends on another's result
sits strictly higher, so two equations of one key and one height never depend on each other, and
merging every such group keeps the graph acyclic (a path from one bucket to another always goes
down in height). Each group is cut, in program order, into buckets of at most ``threshold_bytes``
and ``max_operands``. Heights measured towards the end put a step's gradient averages (all at
height 0, whatever the depth of the backward pass that produced them) into one bucket, where depths
from the start would split them by layer. The equations are then emitted in a topological order of
the merged graph, each bucket at the first point where all its members' inputs exist (Kahn's
algorithm, ties broken by program order), so every output is produced before its first consumer.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from ._jax_compat import core

#: XLA:GPU's default all-reduce combine threshold (``xla_gpu_all_reduce_combine_threshold_bytes``).
DEFAULT_THRESHOLD_BYTES = 30 * 1024 * 1024
#: XLA's combiners' operand cap (``combine_threshold_count``, 256 on CPU and GPU).
MAX_OPERANDS = 256


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Equations of one jaxpr run as one collective: ``eqns`` their indices in ``jaxpr.eqns`` (program
    order), ``key`` their common key, ``nbytes`` the operands' bytes per device, ``height`` as in the
    module docstring."""

    eqns: tuple
    key: object
    nbytes: int
    height: int


def operand_bytes(eqn) -> int:
    """Bytes per device of ``eqn``'s operands (their avals)."""
    return int(sum(math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize for v in eqn.invars
                   if hasattr(v.aval, "shape")))


def _ordered(eqn) -> bool:
    return any(not isinstance(e, core.NamedAxisEffect) for e in eqn.effects)


def plan(jaxpr, key_of, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, max_operands: int = MAX_OPERANDS):
    """The order to evaluate ``jaxpr`` (an open ``core.Jaxpr``) in, with its combinable equations in buckets.

    Args:
      jaxpr: the jaxpr; its equations are in a valid (topological) order.
      key_of: ``eqn -> hashable or None``: equations with equal keys may be combined; None: never.
      threshold_bytes: most operand bytes per device in one bucket (an equation larger than it is a
        bucket of its own); 0 turns combining off.
      max_operands: most operands in one bucket.

    Returns ``(steps, buckets)``: ``steps`` lists every equation index once, in evaluation order, with
    a :class:`Bucket` in place of its members (each at its first member's place in that order);
    ``buckets`` the buckets of two or more equations, in ``steps`` order.
    """
    eqns = jaxpr.eqns
    n = len(eqns)
    keys = [key_of(e) if threshold_bytes > 0 else None for e in eqns]
    if sum(k is not None for k in keys) < 2:
        return list(range(n)), []
    producer = {}
    preds = [set() for _ in range(n)]
    last_ordered = None
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, core.Literal) and v in producer:
                preds[i].add(producer[v])
        if _ordered(e):
            if last_ordered is not None:
                preds[i].add(last_ordered)
            last_ordered = i
        for v in e.outvars:
            producer[v] = i
    succs = [[] for _ in range(n)]
    for i in range(n):
        for p in preds[i]:
            succs[p].append(i)
    height = [0] * n
    for i in range(n - 1, -1, -1):
        height[i] = max((height[j] + (keys[j] is not None) for j in succs[i]), default=0)

    groups: dict = {}
    for i, k in enumerate(keys):
        if k is not None:
            groups.setdefault((k, height[i]), []).append(i)
    owner = {}  # eqn index -> Bucket (buckets of two or more)
    for (k, h), members in groups.items():
        cur, size, ops = [], 0, 0
        cuts = []
        for i in members:
            b, m = operand_bytes(eqns[i]), len(eqns[i].invars)
            if cur and (size + b > threshold_bytes or ops + m > max_operands):
                cuts.append((cur, size))
                cur, size, ops = [], 0, 0
            cur.append(i)
            size, ops = size + b, ops + m
        cuts.append((cur, size))
        for members_, size in cuts:
            if len(members_) > 1:
                bucket = Bucket(tuple(members_), k, size, h)
                for i in members_:
                    owner[i] = bucket

    # Kahn's algorithm on the merged graph; a bucket is the node of its first member.
    node = [owner[i].eqns[0] if i in owner else i for i in range(n)]
    missing = {}
    for i in range(n):
        for p in preds[i]:
            if node[p] != node[i]:
                missing.setdefault(node[i], set()).add(node[p])
    waiting = {v: len(s) for v, s in missing.items()}
    out_edges: dict = {}
    for v, s in missing.items():
        for p in s:
            out_edges.setdefault(p, []).append(v)
    ready = [v for v in set(node) if not waiting.get(v)]
    heapq.heapify(ready)
    steps, buckets = [], []
    while ready:
        v = heapq.heappop(ready)
        if v in owner:
            steps.append(owner[v])
            buckets.append(owner[v])
        else:
            steps.append(v)
        for w in out_edges.get(v, ()):
            waiting[w] -= 1
            if not waiting[w]:
                heapq.heappush(ready, w)
    if sum(len(s.eqns) if isinstance(s, Bucket) else 1 for s in steps) != n:  # the heights forbid a cycle
        raise RuntimeError("jax_blink combining: the merged equation graph has a cycle (a bug in jax_blink; "
                           "pass combine_threshold_bytes=0 to jax_blink.transform to run without combining)")
    return steps, buckets
