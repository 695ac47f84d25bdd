"""The link-level event engine: per-link FIFO queues served in order of readiness. The event loop runs in
native code (``jax_blink._native._linksim``, ffi/src/linksim.cc) over messages as arrays
(:class:`_Arrays`; a plan's tiled from one chunk template per tree, :func:`_tiled_arrays`); the Python
loop :func:`_run` is its bitwise reference and runs where the module is not built."""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from .._native import linksim as _native_linksim
from ..errors import PlanError, ScheduleError
from .messages import _chunk_template, _Msg, _set_protocol_latency, _stage_through_host
from .results import (
    _HOST_MEMORY,
    HOST_STAGING_GBPS,
)


@dataclasses.dataclass
class _Arrays:
    """Messages as arrays, the native event model's input (ffi/src/linksim.h): per message its bytes,
    protocol latency (s) and priority ``rank`` (served first when smaller); its links
    ``hop_edge[hop_ptr[i]:hop_ptr[i + 1]]`` (indices into ``edges``) and the messages it waits for
    ``dep[dep_ptr[i]:dep_ptr[i + 1]]``."""

    nbytes: np.ndarray
    extra_s: np.ndarray
    hop_ptr: np.ndarray
    hop_edge: np.ndarray
    dep_ptr: np.ndarray
    dep: np.ndarray
    rank: np.ndarray
    edges: list

    def __len__(self) -> int:
        return len(self.nbytes)


def _msg_arrays(msgs: list[_Msg]) -> _Arrays:
    """:class:`_Arrays` of message objects; ranks in the order of (prio, index), the reference's."""
    eid: dict = {}
    hop_edge = np.fromiter((eid.setdefault(e, len(eid)) for m in msgs for e in m.hops), dtype=np.int32)
    hop_ptr = np.zeros(len(msgs) + 1, dtype=np.int64)
    np.cumsum([len(m.hops) for m in msgs], out=hop_ptr[1:])
    dep = np.fromiter((d for m in msgs for d in m.deps), dtype=np.int64)
    dep_ptr = np.zeros(len(msgs) + 1, dtype=np.int64)
    np.cumsum([len(m.deps) for m in msgs], out=dep_ptr[1:])
    rank = np.zeros(len(msgs), dtype=np.int64)
    if msgs:  # prio tuples compare as their float columns (ints below 2^53 are exact), index last
        prio = np.array([m.prio for m in msgs], dtype=np.float64).reshape(len(msgs), -1)
        order = np.lexsort((np.arange(len(msgs)),) + tuple(prio[:, c] for c in reversed(range(prio.shape[1]))))
        rank[order] = np.arange(len(msgs))
    return _Arrays(np.array([m.nbytes for m in msgs], dtype=np.float64),
                   np.array([m.extra_s for m in msgs], dtype=np.float64), hop_ptr, hop_edge, dep_ptr, dep, rank,
                   list(eid))


def _gather(ptr: np.ndarray, values: np.ndarray, rows: np.ndarray):
    """(new ptr, values) of the CSR rows ``rows`` (``values[ptr[r]:ptr[r + 1]]`` each), in that order."""
    counts = (ptr[1:] - ptr[:-1])[rows]
    out_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=out_ptr[1:])
    at = np.repeat(ptr[:-1][rows] - out_ptr[:-1], counts) + np.arange(out_ptr[-1], dtype=np.int64)
    return out_ptr, values[at], counts


def _tiled_arrays(segs, topology, protocol_latency_us) -> _Arrays:
    """:class:`_Arrays` of a plan's segments (:func:`_plan_segments`), equal to
    ``_msg_arrays`` of :func:`_plan_messages` staged and timed as :func:`simulate` does
    (tests/test_linksim.py checks every float): each tree's :func:`_chunk_template` is staged and
    given its protocol latencies once, then tiled over its chunks by numpy, chunk j of every tree in
    turn. A staged send's two copies share its priority, so the reference orders them by index, as
    (fraction, index) of the tiled list does."""
    if not segs:
        return _msg_arrays([])
    tmpls, by_route = [], {}
    for root, red, bc, cbytes, _ in segs:
        t = _stage_through_host(_chunk_template(root, red, bc, cbytes), topology)
        _set_protocol_latency(t, topology, protocol_latency_us, by_route)
        tmpls.append(t)
    flat = _msg_arrays([m for t in tmpls for m in t])  # deps local to each template
    size = np.array([len(t) for t in tmpls], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(size)[:-1]))
    ks = np.array([s[4] for s in segs], dtype=np.int64)
    active = [np.flatnonzero(ks > j) for j in range(int(ks.max()))]  # trees with a chunk j, in order
    blk_seg = np.concatenate(active)
    blk_j = np.repeat(np.arange(len(active), dtype=np.int64), [len(a) for a in active])
    blk_size = size[blk_seg]
    blk_base = np.concatenate(([0], np.cumsum(blk_size)[:-1]))
    total = int(blk_size.sum())
    msg_blk = np.repeat(np.arange(len(blk_seg)), blk_size)
    rows = np.arange(total, dtype=np.int64) - blk_base[msg_blk] + start[blk_seg][msg_blk]
    hop_ptr, hop_edge, _ = _gather(flat.hop_ptr, flat.hop_edge, rows)
    dep_ptr, dep, dcount = _gather(flat.dep_ptr, flat.dep, rows)
    dep = dep + np.repeat(blk_base[msg_blk], dcount)
    frac = ((blk_j + 1) / ks[blk_seg])[msg_blk]  # (j + 1) / k, correctly rounded as Python's
    rank = np.empty(total, dtype=np.int64)
    rank[np.lexsort((np.arange(total), frac))] = np.arange(total)
    return _Arrays(flat.nbytes[rows], flat.extra_s[rows], hop_ptr, np.ascontiguousarray(hop_edge, dtype=np.int32),
                   dep_ptr, np.ascontiguousarray(dep, dtype=np.int64), rank, flat.edges)


# --------------------------------------------------------------------------- engine
_ARRIVE, _SERVE = 0, 1


def _bytes_per_s(e, topology) -> float:
    if e[0] == _HOST_MEMORY:
        return HOST_STAGING_GBPS * 1e9
    d = topology.graph.get_edge_data(*e)
    if d is None:
        raise PlanError(f"message routed over {e}, which is not a link of {topology.name!r}")
    return d["bandwidth_gbps"] * 1e9


def _run_any(msgs, topology, latency_s: float):
    """:func:`_run` of message objects or :class:`_Arrays`, in native code (ffi/src/linksim.cc, the
    same event order and floats) where the module is built."""
    if _native_linksim is None:
        return _run(msgs, topology, latency_s)
    a = msgs if isinstance(msgs, _Arrays) else _msg_arrays(msgs)
    bw = np.array([_bytes_per_s(e, topology) for e in a.edges], dtype=np.float64)
    end, busy, carried, first, done = _native_linksim.run(a.nbytes, a.extra_s, a.hop_ptr, a.hop_edge, a.dep_ptr,
                                                          a.dep, a.rank, bw, float(latency_s))
    if done != len(a):
        raise ScheduleError(f"{len(a) - done} transfers never became ready (cyclic dependencies)")
    return end, {a.edges[e]: busy[e] for e in first}, {a.edges[e]: carried[e] for e in first}


def _run(msgs: list[_Msg], topology, latency_s: float):
    """Event loop over per-link queues. Returns (finish time, {edge: busy s}, {edge: bytes}).
    The reference of the native model (ffi/src/linksim.cc), run where that is not built.

    A link that falls free serves the waiting message with the smallest ``prio`` (all arrivals at
    the same instant are queued first), so trees of different weights progress in proportion and
    finish together, as Blink's weight-proportional split intends.
    """
    bw = {}
    for m in msgs:
        for e in m.hops:
            if e not in bw:
                bw[e] = _bytes_per_s(e, topology)
    waiting = [len(m.deps) for m in msgs]
    ready_at = [0.0] * len(msgs)
    dependents: list[list[int]] = [[] for _ in msgs]
    for i, m in enumerate(msgs):
        for d in m.deps:
            dependents[d].append(i)
    events = []  # (time, kind, tiebreak, payload)
    seq = 0
    for i, m in enumerate(msgs):
        if not m.deps:
            events.append((0.0, _ARRIVE, seq, (i, 0)))
            seq += 1
    heapq.heapify(events)
    queue: dict = {e: [] for e in bw}  # edge -> heap of (prio, msg, hop)
    idle = {e: True for e in bw}
    busy: dict = {}
    carried: dict = {}
    end, done = 0.0, 0
    while events:
        t, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            i, h = payload
            m = msgs[i]
            if h < len(m.hops):
                e = m.hops[h]
                heapq.heappush(queue[e], (m.prio, i, h))
                if idle[e]:
                    idle[e] = False  # claim now, choose at _SERVE once all arrivals at t are in
                    heapq.heappush(events, (t, _SERVE, seq, e))
                    seq += 1
                continue
            finish = t + latency_s + m.extra_s  # alpha + protocol: once per send, not holding links
            done += 1
            end = max(end, finish)
            for d in dependents[i]:
                waiting[d] -= 1
                ready_at[d] = max(ready_at[d], finish)
                if waiting[d] == 0:
                    heapq.heappush(events, (ready_at[d], _ARRIVE, seq, (d, 0)))
                    seq += 1
            continue
        e = payload
        if not queue[e]:
            idle[e] = True
            continue
        _, i, h = heapq.heappop(queue[e])
        dt = msgs[i].nbytes / bw[e]
        busy[e] = busy.get(e, 0.0) + dt
        carried[e] = carried.get(e, 0.0) + msgs[i].nbytes
        heapq.heappush(events, (t + dt, _ARRIVE, seq, (i, h + 1)))
        heapq.heappush(events, (t + dt, _SERVE, seq + 1, e))
        seq += 2
    if done != len(msgs):
        raise ScheduleError(f"{len(msgs) - done} transfers never became ready (cyclic dependencies)")
    return end, busy, carried
