"""What a collective is: one row per collective, read by the planner, schedule, simulator, cost model,
lowerings and executors instead of comparing collective names.

A collective over ``n`` ranks moves a flat buffer of ``nelems`` elements per rank (the *full* buffer:
for all-gather the gathered output, for reduce-scatter the input). Its trees run one or both *phases*:
a reduce phase (data flows child -> parent along an in-arborescence to the segment's root, summing)
and a broadcast phase (parent -> child along an out-arborescence from the root, copying).

* Whole-buffer collectives (all-reduce, broadcast, reduce; Blink, MLSys 2020, sections 3-4): every
  segment of the buffer has the same root (broadcast / reduce) or any root (all-reduce).
* Sharded collectives (all-gather, reduce-scatter; ForestColl, Zhao et al. 2024, section 3): the
  buffer is ``n`` equal shards, shard ``r`` owned by rank ``r`` (the ``lax.all_gather`` order); every
  segment lies inside one shard and is rooted at that shard's owner. All-gather broadcasts each shard
  from its owner; reduce-scatter reduces each shard to its owner.

Bus bandwidth factors follow nccl-tests (doc/PERFORMANCE.md): ``busbw = algbw * factor(n)``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective.

    Attributes:
      name: "allreduce" | "broadcast" | "reduce" | "allgather" | "reducescatter".
      wire_id: the id in a serialised schedule's header (``schedule.Schedule.to_array``) and in the
        native executors (ffi/src); stable, never reused.
      reduces: its trees run a reduce phase (child -> parent, summing).
      broadcasts: its trees run a broadcast phase (parent -> child, copying).
      rooted: one root rank chosen by the caller (broadcast, reduce).
      sharded: segments are owned per shard: segment roots are the shard owners (all-gather,
        reduce-scatter); the buffer is ``n`` equal shards.
      input: "whole" (each rank passes the full buffer) or "shard" (each rank passes its own shard).
      output: "whole" or "shard" (each rank keeps its own shard of the full buffer).
      non_root: what a rank that is not a segment's root holds there after the call: "result" (the
        collective's value), "zeros" (reduce: only the root keeps the sum), "unspecified" (reduce-
        scatter: the partial sums left in other ranks' shards are scratch and are not returned).
      certificate: the upper bound ``Plan.bound_gbps`` certifies for this collective's rate.
    """

    name: str
    wire_id: int
    reduces: bool
    broadcasts: bool
    rooted: bool
    sharded: bool
    input: str
    output: str
    non_root: str
    certificate: str

    def busbw_factor(self, n: int) -> float:
        """nccl-tests' bus-bandwidth factor for ``n`` ranks: all-reduce 2(n-1)/n, all-gather and
        reduce-scatter (n-1)/n, broadcast and reduce 1."""
        if self.name == "allreduce":
            return 2.0 * (n - 1) / n if n > 1 else 0.0
        if self.sharded:
            return (n - 1) / n if n > 1 else 0.0
        return 1.0


_ROWS = (
    Collective("allreduce", 0, True, True, False, False, "whole", "whole", "result",
               "LP dual bound of the tree (or ring) packing; max-flow orientation bound for three phases"),
    Collective("broadcast", 1, False, True, True, False, "whole", "whole", "result",
               "Edmonds: min over GPUs v of maxflow(root -> v)"),
    Collective("reduce", 2, True, False, True, False, "whole", "whole", "zeros",
               "Edmonds on the reversed graph: min over GPUs v of maxflow(v -> root)"),
    Collective("allgather", 3, False, True, False, True, "shard", "whole", "result",
               "cut bound: min over node sets T holding some but not all ranks of n * B_out(T) / |T & ranks|"),
    Collective("reducescatter", 4, True, False, False, True, "whole", "shard", "unspecified",
               "cut bound of all-gather on the reversed graph: n * B_in(T) / |T & ranks|"),
)

COLLECTIVES: dict[str, Collective] = {c.name: c for c in _ROWS}
BY_WIRE_ID: dict[int, Collective] = {c.wire_id: c for c in _ROWS}


def get(name: str) -> Collective:
    """The row of ``name``. Raises ValueError listing the known collectives for an unknown name."""
    try:
        return COLLECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; expected one of {tuple(COLLECTIVES)}") from None
