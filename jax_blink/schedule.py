"""Plan -> schedule: the one executable format every lowering, the simulator and ``ffi/`` consume.

A :class:`Schedule` splits the flattened operand into one contiguous *segment* per tree (sizes in
proportion to the tree weights, Blink section 4.1: "data is split across trees in proportion to
their rates"), cuts each segment into *chunks* that pipeline up (reduce) and down (broadcast) the
tree, and lists the chunk *transfers* in *rounds*. Within a round every rank sends at most once and
receives at most once (a partial permutation, so a round is one ``collective_permute``) and reads only
values completed in earlier rounds. Plain int64 NumPy arrays, no JAX.

Format (see docs/architecture.md): ``transfers`` rows are ``(round, op, src, dst, chunk)`` with
``op`` :data:`REDUCE` (dst += src) or :data:`COPY` (dst = src) over the chunk's element range.
Executing the rows in order on per-rank buffers initialised with each rank's input gives the
collective's result; where the collective's row says non-root ranks hold zeros (``reduce``) the
executor then zeroes every non-root buffer.

Sharded collectives (all-gather, reduce-scatter; ForestColl, Zhao et al. 2024, section 3): the buffer
is ``n`` equal shards, shard ``r`` owned by rank ``r``; each owner's trees split its shard in
proportion to their weights, so every segment lies inside its root's shard. The collective's phases
come from its row in :mod:`jax_blink.collectives`, never from its name.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from . import collectives as _coll
from .errors import ScheduleError

REDUCE = 0
COPY = 1
COLLECTIVES = tuple(_coll.COLLECTIVES)
MAGIC = 0x424C4E4B  # "BLNK"
VERSION = 2
PHASE_REDUCE = 1     # seg_phases bit 0: the segment's tree runs a reduce phase
PHASE_BROADCAST = 2  # seg_phases bit 1: ... a broadcast phase


def phases_of(collective: str) -> int:
    """The ``seg_phases`` bits of ``collective`` (from its row): reduce bit 0, broadcast bit 1."""
    row = _coll.get(collective)
    return PHASE_REDUCE * row.reduces + PHASE_BROADCAST * row.broadcasts

# Cost model defaults for choosing the chunk count (see choose_chunks).
DEFAULT_STEP_LATENCY_S = 20e-6
DEFAULT_MAX_CHUNKS = 16
DEFAULT_MAX_TOTAL_CHUNKS = 48  # every round is one collective step: bound the rounds per call
MIN_CHUNK_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """An executable tree schedule over ``nranks`` ranks and a flat operand of ``nelems`` elements.

    Attributes (all int64 NumPy arrays; S segments, C chunks, T transfers, n = nranks):
      collective: a name of :mod:`jax_blink.collectives` ("allreduce", "broadcast", "reduce",
        "allgather", "reducescatter").
      nelems: elements per rank of the full buffer (all-gather: the gathered output; reduce-scatter:
        the input); for sharded collectives a multiple of n, shard r = [r*m, (r+1)*m), m = nelems/n.
      seg_root [S]: root rank of each segment. seg_offset [S], seg_length [S]: element range.
      seg_phases [S]: bit 0 reduce phase, bit 1 broadcast phase (the collective's row).
      reduce_parent [S, n], bcast_parent [S, n]: parent rank in the segment's reduce / broadcast
        tree, -1 at the root (all -1 where that phase is unused).
      chunk_seg [C], chunk_offset [C] (absolute), chunk_length [C] (> 0).
      transfers [T, 5]: rows (round, op, src, dst, chunk), sorted by round then src.
    """

    collective: str
    nranks: int
    nelems: int
    seg_root: np.ndarray
    seg_offset: np.ndarray
    seg_length: np.ndarray
    seg_phases: np.ndarray
    reduce_parent: np.ndarray
    bcast_parent: np.ndarray
    chunk_seg: np.ndarray
    chunk_offset: np.ndarray
    chunk_length: np.ndarray
    transfers: np.ndarray

    @property
    def num_rounds(self) -> int:
        """Number of rounds (0 when nothing moves)."""
        return int(self.transfers[-1, 0]) + 1 if len(self.transfers) else 0

    def rounds(self) -> list[np.ndarray]:
        """The transfer rows split by round: a list of [t_r, 5] arrays."""
        if not len(self.transfers):
            return []
        cuts = np.flatnonzero(np.diff(self.transfers[:, 0])) + 1
        return np.split(self.transfers, cuts)

    # ------------------------------------------------------------- serialisation
    def to_array(self) -> np.ndarray:
        """Serialise to one int64 array (the FFI attribute; layout in docs/architecture.md): header
        [MAGIC, 2, wire_id, n, nelems, S, C, T], then seg_root, seg_offset, seg_length, seg_phases,
        reduce_parent, bcast_parent, chunk_seg, chunk_offset, chunk_length, transfers."""
        S, C, T = len(self.seg_root), len(self.chunk_seg), len(self.transfers)
        head = [MAGIC, VERSION, _coll.get(self.collective).wire_id, self.nranks, self.nelems, S, C, T]
        parts = [np.asarray(head, np.int64), self.seg_root, self.seg_offset, self.seg_length, self.seg_phases,
                 self.reduce_parent.reshape(-1), self.bcast_parent.reshape(-1), self.chunk_seg,
                 self.chunk_offset, self.chunk_length, self.transfers.reshape(-1)]
        return np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts])

    @classmethod
    def from_array(cls, arr) -> Schedule:
        """Inverse of :meth:`to_array`; also reads version-1 arrays (no seg_phases: derived from the
        collective, wire ids 0-2). Validates. Raises ScheduleError on a malformed array."""
        a = np.asarray(arr, np.int64).reshape(-1)
        if len(a) < 8 or a[0] != MAGIC or a[1] not in (1, VERSION):
            raise ScheduleError("not a jax_blink schedule array (bad magic/version)")
        version = int(a[1])
        wire, n, nelems, S, C, T = (int(x) for x in a[2:8])
        row = _coll.BY_WIRE_ID.get(wire)
        if row is None or (version == 1 and wire > 2) or min(n, nelems, S, C, T) < 0:
            raise ScheduleError(f"bad schedule header {a[:8].tolist()}")
        sizes = [S, S, S, S if version >= 2 else 0, S * n, S * n, C, C, C, T * 5]
        if len(a) != 8 + sum(sizes):
            raise ScheduleError(f"schedule array has {len(a)} entries, header implies {8 + sum(sizes)}")
        out, pos = [], 8
        for k in sizes:
            out.append(a[pos:pos + k].copy())
            pos += k
        if version == 1:
            out[3] = np.full(S, phases_of(row.name), np.int64)
        s = cls(row.name, n, nelems, out[0], out[1], out[2], out[3], out[4].reshape(S, n),
                out[5].reshape(S, n), out[6], out[7], out[8], out[9].reshape(T, 5))
        s.validate()
        return s

    def validate(self) -> None:
        """Check the invariants of the format. Raises ScheduleError naming the first violation."""
        n = self.nranks
        if self.collective not in COLLECTIVES:
            raise ScheduleError(f"unknown collective {self.collective!r}")
        row = _coll.get(self.collective)
        ends = self.seg_offset + self.seg_length
        if len(self.seg_root) and (self.seg_offset[0] != 0 or ends[-1] != self.nelems
                                   or np.any(self.seg_offset[1:] != ends[:-1])):
            raise ScheduleError("segments must be contiguous and cover [0, nelems)")
        if np.any((self.seg_root < 0) | (self.seg_root >= n)):
            raise ScheduleError("segment root out of range")
        if self.seg_phases.shape != self.seg_root.shape or np.any(self.seg_phases != phases_of(row.name)):
            raise ScheduleError(f"seg_phases must be {phases_of(row.name)} (the {row.name} row) for every segment")
        if row.sharded and len(self.seg_root):
            if self.nelems % n:
                raise ScheduleError(f"{row.name} needs nelems divisible by nranks, got {self.nelems} over {n}")
            m = self.nelems // n
            if np.any(self.seg_offset < self.seg_root * m) or np.any(ends > (self.seg_root + 1) * m):
                raise ScheduleError(f"{row.name}: a segment leaves its root's shard")
        for name in ("reduce_parent", "bcast_parent"):
            p = getattr(self, name)
            if p.shape != (len(self.seg_root), n) or np.any((p < -1) | (p >= n)):
                raise ScheduleError(f"{name} has shape {p.shape} or out-of-range ranks")
        if len(self.chunk_seg):
            if np.any(self.chunk_length <= 0) or np.any((self.chunk_seg < 0) | (self.chunk_seg >= len(self.seg_root))):
                raise ScheduleError("chunks must have positive length and a valid segment")
            lo = self.seg_offset[self.chunk_seg]
            hi = lo + self.seg_length[self.chunk_seg]
            if np.any(self.chunk_offset < lo) or np.any(self.chunk_offset + self.chunk_length > hi):
                raise ScheduleError("chunk outside its segment")
        t = self.transfers
        if t.ndim != 2 or t.shape[1] != 5:
            raise ScheduleError(f"transfers must be [T, 5], got {t.shape}")
        if len(t):
            if np.any(np.diff(t[:, 0]) < 0) or np.any((t[:, 1] != REDUCE) & (t[:, 1] != COPY)):
                raise ScheduleError("transfers must be sorted by round with op REDUCE or COPY")
            if np.any((t[:, 2:4] < 0) | (t[:, 2:4] >= n)) or np.any(t[:, 2] == t[:, 3]):
                raise ScheduleError("transfer ranks out of range or src == dst")
            if np.any((t[:, 4] < 0) | (t[:, 4] >= len(self.chunk_seg))):
                raise ScheduleError("transfer chunk out of range")
            for r in self.rounds():
                if len(set(r[:, 2])) != len(r) or len(set(r[:, 3])) != len(r):
                    raise ScheduleError(f"round {int(r[0, 0])} is not a partial permutation")


def choose_chunks(segment_bytes: float, depth: int, rate_gbps: float, *,
                  step_latency_s: float = DEFAULT_STEP_LATENCY_S, max_chunks: int = DEFAULT_MAX_CHUNKS) -> int:
    """Chunk count minimising the pipelined time ``(k + depth - 1) * (a + s / (k B))``.

    d/dk = 0 gives k* = sqrt((depth - 1) s / (a B)) (the classic pipelined-broadcast optimum, e.g.
    Blink section 4.2 and Johnsson & Ho 1989). Clamped to [1, max_chunks] and chunks >= 64 KiB.
    """
    if depth <= 1 or segment_bytes <= 0 or not math.isfinite(rate_gbps):
        return 1
    k = math.sqrt((depth - 1) * segment_bytes / (step_latency_s * rate_gbps * 1e9))
    k = min(k, segment_bytes / MIN_CHUNK_BYTES, max_chunks)
    return max(1, int(round(k)))


def _split_proportional(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` into integer parts proportional to ``weights`` (largest remainder, stable)."""
    wsum = float(sum(weights))
    raw = [total * w / wsum for w in weights]
    parts = [int(math.floor(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _depth(parent: np.ndarray, root: int) -> int:
    """Number of levels (edges on the longest root path) of a parent array; 0 if unused."""
    best = 0
    for v in range(len(parent)):
        d, u = 0, v
        while parent[u] >= 0:
            u, d = parent[u], d + 1
            if d > len(parent):
                raise ScheduleError(f"parent array {parent.tolist()} has a cycle")
        if d and u != root:
            raise ScheduleError(f"rank {v} does not reach root {root} in {parent.tolist()}")
        best = max(best, d)
    return best


def build_schedule(plan, nelems: int, *, itemsize: int = 4, chunk_elems: int | None = None,
                   step_latency_s: float = DEFAULT_STEP_LATENCY_S,
                   max_chunks: int = DEFAULT_MAX_CHUNKS,
                   max_total_chunks: int = DEFAULT_MAX_TOTAL_CHUNKS, tree_chunks: dict | None = None) -> Schedule:
    """Schedule ``plan`` (a ``jax_blink.planner.model.Plan``) for a flat operand of ``nelems`` elements.

    Args:
      plan: the tree packing; rank r is ``plan.devices[r]``. For sharded collectives (all-gather,
        reduce-scatter) every rank's GPU roots one or more trees (the owner of shard r).
      nelems: elements per rank (>= 0); for sharded collectives the FULL buffer (gathered output /
        reduce-scatter input), divisible by the rank count. Shard r = [r*m, (r+1)*m), m = nelems / n,
        is split over rank r's trees in proportion to their weights (segments never cross shards).
      itemsize: bytes per element (for the chunk cost model only).
      chunk_elems: fixed chunk size in elements (overrides the cost model).
      step_latency_s, max_chunks: the cost model of :func:`choose_chunks`.
      max_total_chunks: cost-model chunk counts are scaled down so all trees together use at most
        this many chunks (each chunk adds rounds, and a round has a fixed cost); not applied to an
        explicit ``chunk_elems``.
      tree_chunks: {tree: chunks} for the plan's trees (``jax_blink.simulate.plan_chunks``: the link
        simulator's chunking, so the schedule is the one it timed); overrides the cost model and
        ``max_total_chunks`` for the trees it names (at most one chunk per element).

    Returns: a validated :class:`Schedule`. Raises ScheduleError on bad arguments, ``nelems`` not
    divisible by the rank count for a sharded collective, or a plan whose trees do not span its
    devices (or, sharded, a rank that roots no tree).

    Example: an all-reduce over four GPUs of a DGX-1V, 8 elements in chunks of at most 2::

        >>> from jax_blink import Topology, plan
        >>> from jax_blink.schedule import build_schedule
        >>> s = build_schedule(plan(Topology.preset("dgx1v"), "allreduce", devices=[0, 1, 2, 3]), 8, chunk_elems=2)
        >>> s.collective, s.nranks, s.nelems, int(s.seg_length.sum()), int(s.chunk_length.max())
        ('allreduce', 4, 8, 8, 2)
        >>> s.transfers.shape[1]  # rows (round, op, src, dst, chunk)
        5
    """
    if not all(hasattr(plan, a) for a in ("collective", "devices", "trees")):
        raise ScheduleError(f"build_schedule needs a jax_blink.Plan (from jax_blink.plan), got {type(plan).__name__}")
    collective = plan.collective
    if collective not in COLLECTIVES:
        raise ScheduleError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    row = _coll.get(collective)
    if isinstance(nelems, bool) or not isinstance(nelems, (int, np.integer)) or nelems < 0:
        raise ScheduleError(f"nelems must be a non-negative int, got {nelems!r}")
    if chunk_elems is not None and (int(chunk_elems) != chunk_elems or chunk_elems < 1):
        raise ScheduleError(f"chunk_elems must be a positive int, got {chunk_elems!r}")
    if getattr(plan, "relays", ()):
        raise ScheduleError(f"plan forwards through relay GPUs {list(plan.relays)} outside its devices "
                            f"{list(plan.devices)}; the JAX lowerings run only on job devices. Plan "
                            f"without relays (jax_blink.plan(..., relays=None)) to execute it.")
    devices = list(plan.devices)
    n = len(devices)
    if row.sharded and nelems % max(n, 1):
        raise ScheduleError(f"{collective} over {n} ranks needs a full buffer of a multiple of {n} elements "
                            f"(n shards of equal size), got nelems={nelems}")
    rank = {d: r for r, d in enumerate(devices)}
    trees = [t for t in plan.trees if t.weight_gbps > 0]
    if n > 1 and not trees:
        raise ScheduleError(f"plan for {n} devices has no trees")
    if n <= 1 or nelems == 0:
        trees = []
    if row.sharded and trees:
        m = int(nelems) // n
        per_root = [[t for t in trees if t.root == d] for d in devices]
        missing = [d for d, ts in zip(devices, per_root) if not ts]
        if missing:
            raise ScheduleError(f"{collective} plan has no tree rooted at GPU(s) {missing}: every rank's GPU "
                                "must root the trees of its shard")
        trees = [t for ts in per_root for t in ts]
        lengths = [x for ts in per_root for x in _split_proportional(m, [t.weight_gbps for t in ts])]
    else:
        lengths = _split_proportional(int(nelems), [t.weight_gbps for t in trees]) if trees else []

    phases = phases_of(collective)
    lengths_kept = [(t, length) for t, length in zip(trees, lengths) if length]
    seg_root, seg_offset, seg_length, red_par, bc_par = [], [], [], [], []
    chunk_seg, chunk_offset, chunk_length = [], [], []
    ks = []
    offset = 0
    for t, length in lengths_kept:
        root = rank[t.root]
        rp = np.full(n, -1, np.int64)
        bp = np.full(n, -1, np.int64)
        if row.reduces:
            for child, parent in t.gpu_parents(reduce=True).items():
                rp[rank[child]] = rank[parent]
        if row.broadcasts:
            for child, parent in t.gpu_parents(reduce=False).items():
                bp[rank[child]] = rank[parent]
        d = _depth(rp, root) + _depth(bp, root)
        for p, used in ((rp, row.reduces), (bp, row.broadcasts)):
            if used and np.count_nonzero(p >= 0) != n - 1:
                raise ScheduleError(f"tree rooted at GPU {t.root} does not span devices {devices}")
        seg_root.append(root), seg_offset.append(offset), seg_length.append(length)
        red_par.append(rp), bc_par.append(bp)
        if chunk_elems is not None:
            ks.append(-(-length // int(chunk_elems)))
        elif tree_chunks is not None and t in tree_chunks:
            ks.append(-max(1, min(int(tree_chunks[t]), length)))  # negative: exempt from the budget below
        else:
            ks.append(choose_chunks(length * itemsize, d, t.weight_gbps,
                                    step_latency_s=step_latency_s, max_chunks=max_chunks))
        offset += length
    given = [k < 0 for k in ks]
    ks = [abs(k) for k in ks]
    free = sum(k for k, g in zip(ks, given) if not g)
    if chunk_elems is None and free and sum(ks) > max_total_chunks:
        ks = [k if g else max(1, k * max_total_chunks // sum(ks)) for k, g in zip(ks, given)]
    offset = 0
    for s, ((_, length), k) in enumerate(zip(lengths_kept, ks)):
        for cl in _split_proportional(length, [1.0] * k):
            if cl:
                chunk_seg.append(s), chunk_offset.append(offset), chunk_length.append(cl)
                offset += cl

    transfers = _list_schedule(row, n, seg_root, red_par, bc_par, chunk_seg, chunk_length)

    def i64(x):
        return np.asarray(x, np.int64)

    sched = Schedule(collective, n, int(nelems), i64(seg_root), i64(seg_offset), i64(seg_length),
                     np.full(len(seg_root), phases, np.int64),
                     i64(red_par).reshape(len(seg_root), n), i64(bc_par).reshape(len(seg_root), n),
                     i64(chunk_seg), i64(chunk_offset), i64(chunk_length),
                     i64(transfers).reshape(-1, 5))
    sched.validate()
    return sched


def _list_schedule(row, n, seg_root, red_par, bc_par, chunk_seg, chunk_length):
    """Greedy list scheduling of chunk transfers into partial-permutation rounds.

    Each task is one chunk crossing one tree edge. A reduce task (v -> parent) is ready once all of
    v's reduce-children delivered that chunk; a broadcast task (parent -> v) once the parent holds
    the final value. Each round takes ready tasks in priority order (earlier chunk first, then larger
    chunk, so trees interleave and the pipeline stays full) while the sender and receiver are free.
    """
    do_reduce, do_bcast = row.reduces, row.broadcasts
    children_r = []  # per segment: rank -> number of reduce children
    kids_b = []      # per segment: rank -> broadcast children
    for s in range(len(seg_root)):
        cnt = np.zeros(n, np.int64)
        kb = [[] for _ in range(n)]
        for v in range(n):
            if red_par[s][v] >= 0:
                cnt[red_par[s][v]] += 1
            if bc_par[s][v] >= 0:
                kb[bc_par[s][v]].append(v)
        children_r.append(cnt)
        kids_b.append(kb)

    ready = []  # heap of (priority, op, src, dst, chunk)
    pending = {}  # (chunk, rank) -> reduce children still to arrive
    seq = {}  # chunk -> position, for priorities

    def push(op, src, dst, c, level):
        heapq.heappush(ready, ((seq[c], level, op, src, dst), op, src, dst, c))

    def final(c, v, level):
        """Rank v holds chunk c's final value: release its broadcast children."""
        s = chunk_seg[c]
        for w in kids_b[s][v]:
            push(COPY, v, w, c, level + 1)

    local = {}
    for c in range(len(chunk_seg)):
        s = chunk_seg[c]
        local[s] = local.get(s, -1) + 1
        seq[c] = (local[s], s)  # interleave trees: chunk j of every tree before chunk j+1
        root = seg_root[s]
        if do_reduce:
            for v in range(n):
                pending[c, v] = int(children_r[s][v])
                if v != root and children_r[s][v] == 0:
                    push(REDUCE, v, int(red_par[s][v]), c, 0)
        if not do_reduce:  # broadcast only: the root holds the final value from the start
            final(c, root, 0)

    rows = []
    rnd = 0
    while ready:
        busy_send, busy_recv, done, skipped = set(), set(), [], []
        while ready:
            item = heapq.heappop(ready)
            _, op, src, dst, c = item
            if src in busy_send or dst in busy_recv:
                skipped.append(item)
                continue
            busy_send.add(src), busy_recv.add(dst)
            done.append(item)
            if len(busy_send) == n or len(busy_recv) == n:
                break
        for item in skipped:
            heapq.heappush(ready, item)
        done.sort(key=lambda it: it[2])
        for (prio, op, src, dst, c) in done:
            rows.append((rnd, op, src, dst, c))
            s = chunk_seg[c]
            if op == REDUCE:
                pending[c, dst] -= 1
                if pending[c, dst] == 0:
                    if dst == seg_root[s]:
                        if do_bcast:
                            final(c, dst, prio[1])
                    else:
                        push(REDUCE, dst, int(red_par[s][dst]), c, prio[1] + 1)
            else:
                final(c, dst, prio[1])
        rnd += 1
    return rows


def execute(schedule: Schedule, inputs: np.ndarray) -> np.ndarray:
    """Reference executor (NumPy): run ``schedule`` on ``inputs`` of shape [nranks, nelems].

    Returns a new [nranks, nelems] array with the collective's result, applying the rows in order
    with the input dtype's arithmetic (integers wrap). The specification the native executors and
    the ppermute lowering must match. Sharded collectives take full buffers: for all-gather the
    caller places each rank's shard at its position (other positions may hold anything) and every
    rank ends with the gathered buffer; for reduce-scatter rank r's shard r ends with the sum over
    ranks of shard r, and its other positions are scratch (partial sums or its input).

    Example: all-reduce and broadcast (root GPU 2, rank 2) of rank r's input ``8r .. 8r+7``::

        >>> import numpy as np
        >>> from jax_blink import Topology, plan
        >>> from jax_blink.schedule import build_schedule, execute
        >>> topo = Topology.preset("dgx1v")
        >>> x = np.arange(32).reshape(4, 8)
        >>> execute(build_schedule(plan(topo, "allreduce", devices=[0, 1, 2, 3]), 8, chunk_elems=2), x)
        array([[48, 52, 56, 60, 64, 68, 72, 76],
               [48, 52, 56, 60, 64, 68, 72, 76],
               [48, 52, 56, 60, 64, 68, 72, 76],
               [48, 52, 56, 60, 64, 68, 72, 76]])
        >>> execute(build_schedule(plan(topo, "broadcast", devices=[0, 1, 2, 3], root=2), 8), x)[:, :3]
        array([[16, 17, 18],
               [16, 17, 18],
               [16, 17, 18],
               [16, 17, 18]])
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"execute needs a Schedule (from build_schedule), got {type(schedule).__name__}")
    x = np.array(inputs, copy=True)
    if x.shape[:1] != (schedule.nranks,) or x.reshape(schedule.nranks, -1).shape[1] != schedule.nelems:
        raise ScheduleError(f"inputs must be [{schedule.nranks}, {schedule.nelems}], got {x.shape}")
    x = x.reshape(schedule.nranks, -1)
    with np.errstate(over="ignore"):
        for _, op, src, dst, c in schedule.transfers:
            lo = schedule.chunk_offset[c]
            hi = lo + schedule.chunk_length[c]
            if op == REDUCE:
                x[dst, lo:hi] = x[dst, lo:hi] + x[src, lo:hi]
            else:
                x[dst, lo:hi] = x[src, lo:hi]
    if _coll.get(schedule.collective).non_root == "zeros" and len(schedule.seg_root):
        root = int(schedule.seg_root[0])
        keep = x[root].copy()
        x[:] = 0
        x[root] = keep
    return x
