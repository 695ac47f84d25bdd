"""Schedules built from real plans: exact results by the NumPy reference executor, format invariants."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_blink import ScheduleError
from jax_blink.planning import plan
from jax_blink.schedule import COPY, REDUCE, Schedule, build_schedule, choose_chunks, execute
from jax_blink.topology.presets import PRESETS

DGX1V = PRESETS["dgx1v"]()


def expected(coll, x, root_rank):
    if coll == "allreduce":
        return np.broadcast_to(x.sum(0), x.shape)
    if coll == "broadcast":
        return np.broadcast_to(x[root_rank], x.shape)
    out = np.zeros_like(x)
    out[root_rank] = x.sum(0)
    return out


@pytest.mark.parametrize("coll", ["allreduce", "broadcast", "reduce"])
@pytest.mark.parametrize("devices", [(0, 1), (0, 1, 2), (1, 2, 5, 6, 7), tuple(range(8)), (6, 3, 0, 5)])
@pytest.mark.parametrize("nelems", [0, 1, 5, 1000, 33333])
def test_reference_execution_is_exact(coll, devices, nelems):
    root = devices[-1] if coll != "allreduce" else None
    p = plan(DGX1V, coll, devices=list(devices), root=root)
    s = build_schedule(p, nelems, chunk_elems=777 if nelems > 10000 else None)
    x = np.random.default_rng(nelems).integers(-1000, 1000, (len(devices), nelems))
    root_rank = devices.index(root) if root is not None else 0
    np.testing.assert_array_equal(execute(s, x), expected(coll, x, root_rank))


def test_segments_proportional_to_tree_weights():
    p = plan(DGX1V, "broadcast", devices=list(range(8)), root=0)
    s = build_schedule(p, 10**6)
    weights = np.array([t.weight_gbps for t in p.trees])
    np.testing.assert_allclose(s.seg_length / 10**6, weights / weights.sum(), atol=1e-5)
    assert s.seg_length.sum() == 10**6
    assert np.all(s.seg_root == 0)


def test_rounds_are_partial_permutations_and_read_only_finished_values():
    p = plan(DGX1V, "allreduce", devices=list(range(8)))
    s = build_schedule(p, 50000, chunk_elems=1000)
    for r in s.rounds():
        assert len(set(r[:, 2])) == len(r) and len(set(r[:, 3])) == len(r)
        # no rank both writes chunk c and has c read from it in one round
        writes = {(d, c) for d, c in zip(r[:, 3], r[:, 4])}
        reads = {(src, c) for src, c in zip(r[:, 2], r[:, 4])}
        assert not writes & reads
    # each chunk crosses every reduce edge and every broadcast edge exactly once
    n = s.nranks
    for c in range(len(s.chunk_seg)):
        rows = s.transfers[s.transfers[:, 4] == c]
        assert (rows[:, 1] == REDUCE).sum() == n - 1
        assert (rows[:, 1] == COPY).sum() == n - 1


def test_pipelining_overlaps_chunks():
    # A chain broadcast 0->1->...: with k chunks the pipeline takes k + depth - 1 rounds, not k * depth.
    p = plan(DGX1V, "broadcast", devices=[0, 1, 2, 3], root=0, max_trees=1)
    s = build_schedule(p, 8000, chunk_elems=1000)
    parents = s.bcast_parent[0]
    depth = 0
    for v in range(4):
        d, u = 0, v
        while parents[u] >= 0:
            u, d = parents[u], d + 1
        depth = max(depth, d)
    fanout = max(np.bincount(parents[parents >= 0], minlength=4))
    assert s.num_rounds <= fanout * (8 + depth - 1)


def test_array_round_trip_and_corruption_detected():
    p = plan(DGX1V, "allreduce", devices=[0, 2, 4, 6])
    s = build_schedule(p, 4097)
    a = s.to_array()
    s2 = Schedule.from_array(a)
    for f in ("seg_root", "seg_offset", "seg_length", "reduce_parent", "bcast_parent",
              "chunk_seg", "chunk_offset", "chunk_length", "transfers"):
        np.testing.assert_array_equal(getattr(s, f), getattr(s2, f))
    with pytest.raises(ScheduleError, match="magic"):
        Schedule.from_array(np.r_[0, a[1:]])
    with pytest.raises(ScheduleError, match="entries"):
        Schedule.from_array(a[:-1])
    bad = a.copy()
    bad[-2] = 99  # a transfer to a rank that does not exist
    with pytest.raises(ScheduleError):
        Schedule.from_array(bad)


def test_bad_arguments():
    p = plan(DGX1V, "allreduce", devices=[0, 1])
    with pytest.raises(ScheduleError, match="nelems"):
        build_schedule(p, -1)
    with pytest.raises(ScheduleError, match="chunk_elems"):
        build_schedule(p, 10, chunk_elems=0)


def test_single_device_is_a_no_op():
    p = plan(DGX1V, "allreduce", devices=[3])
    s = build_schedule(p, 100)
    assert len(s.transfers) == 0
    x = np.arange(100)[None]
    np.testing.assert_array_equal(execute(s, x), x)


def test_chunk_cost_model():
    # k* = sqrt((d-1) s / (a B)): 64 MiB over depth 3 at 25 GB/s with 20 us steps -> ~23, clamped to 16.
    assert choose_chunks(64 * 2**20, 3, 25.0) == 16
    assert choose_chunks(4 * 2**20, 3, 25.0, max_chunks=64) == round((2 * 4 * 2**20 / (20e-6 * 25e9)) ** 0.5)
    assert choose_chunks(4096, 3, 25.0) == 1  # below one 64 KiB chunk
    assert choose_chunks(2**30, 1, 25.0) == 1  # a single hop gains nothing from pipelining


@settings(max_examples=25, deadline=None)
@given(devs=st.lists(st.integers(0, 7), min_size=2, max_size=8, unique=True),
       nelems=st.integers(0, 3000), chunk=st.integers(1, 500),
       coll=st.sampled_from(["allreduce", "broadcast", "reduce"]),
       dtype=st.sampled_from([np.int8, np.uint16, np.int64]))
def test_random_allocations_wrap_like_numpy(devs, nelems, chunk, coll, dtype):
    root = devs[0] if coll != "allreduce" else None
    s = build_schedule(plan(DGX1V, coll, devices=devs, root=root), nelems, chunk_elems=chunk)
    x = np.random.default_rng(0).integers(0, 200, (len(devs), nelems)).astype(dtype)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(execute(s, x), expected(coll, x, 0).astype(dtype))


# ------------------------------------------------------------------------ sharded collectives (v2)
from jax_blink import collectives  # noqa: E402
from jax_blink.planner.model import Plan, Tree  # noqa: E402
from jax_blink.schedule import PHASE_BROADCAST, PHASE_REDUCE, phases_of  # noqa: E402


def sharded_expected(coll, x):
    """All-gather: every rank holds rank r's shard r at position r. Reduce-scatter: rank r's shard r
    is the sum over ranks of shard r (other positions are scratch: returned as NaN-free None)."""
    n, ne = x.shape
    m = ne // n
    if coll == "allgather":
        full = np.concatenate([x[r, r * m:(r + 1) * m] for r in range(n)])
        return np.broadcast_to(full, x.shape)
    return x.reshape(n, n, m).sum(0, dtype=x.dtype)  # [shard r] = sum over ranks (wrapping)


def check_sharded(s, coll, x):
    got = execute(s, x)
    n, ne = x.shape
    m = ne // n
    want = sharded_expected(coll, x)
    if coll == "allgather":
        np.testing.assert_array_equal(got, want)
    else:
        for r in range(n):
            np.testing.assert_array_equal(got[r, r * m:(r + 1) * m], want[r])


def ring_plan(coll, devices):
    """A contract-conforming plan built by hand: per root one chain along the ring, weight 1."""
    n = len(devices)
    trees = tuple(Tree(devices[r], 1.0, tuple((devices[(r + i) % n], devices[(r + i + 1) % n]) for i in range(n - 1)))
                  for r in range(n))
    return Plan(coll, None, tuple(devices), trees, float(n), float(n), "trees")


@pytest.mark.parametrize("coll", ["allgather", "reducescatter"])
@pytest.mark.parametrize("devices", [(0, 1), (0, 1, 2), (1, 2, 5, 6, 7), tuple(range(8)), (6, 3, 0, 5)])
@pytest.mark.parametrize("per_rank", [0, 1, 7, 1000])
def test_sharded_reference_execution_is_exact(coll, devices, per_rank):
    n = len(devices)
    for p in (plan(DGX1V, coll, devices=list(devices)), ring_plan(coll, list(devices))):
        s = build_schedule(p, n * per_rank, chunk_elems=97 if per_rank > 100 else None)
        x = np.random.default_rng(per_rank).integers(-1000, 1000, (n, n * per_rank))
        check_sharded(s, coll, x)
        assert np.all(s.seg_phases == phases_of(coll))
        row = collectives.get(coll)
        assert np.all((s.reduce_parent >= 0).any(1) == row.reduces) if len(s.seg_root) else True
        assert np.all((s.bcast_parent >= 0).any(1) == row.broadcasts) if len(s.seg_root) else True


@pytest.mark.parametrize("coll", ["allgather", "reducescatter"])
def test_segments_stay_in_their_owners_shard_in_proportion(coll):
    p = plan(DGX1V, coll, devices=list(range(8)))
    m = 100_000
    s = build_schedule(p, 8 * m)
    for r in range(8):
        mine = s.seg_root == r
        assert np.all(s.seg_offset[mine] >= r * m) and np.all(s.seg_offset[mine] + s.seg_length[mine] <= (r + 1) * m)
        assert s.seg_length[mine].sum() == m
        w = np.array([t.weight_gbps for t in p.trees if t.root == p.devices[r] and t.weight_gbps > 0])
        np.testing.assert_allclose(np.sort(s.seg_length[mine] / m), np.sort(w / w.sum()), atol=1e-4)


def test_sharded_needs_divisible_size_and_every_owner():
    p = plan(DGX1V, "allgather", devices=[0, 1, 2])
    with pytest.raises(ScheduleError, match="multiple of 3"):
        build_schedule(p, 10)
    lame = Plan("allgather", None, (0, 1, 2), tuple(t for t in ring_plan("allgather", [0, 1, 2]).trees if t.root != 1),
                2.0, 3.0, "trees")
    with pytest.raises(ScheduleError, match="no tree rooted at GPU"):
        build_schedule(lame, 9)


def test_v2_round_trip_and_v1_still_read():
    s = build_schedule(plan(DGX1V, "reducescatter", devices=[0, 2, 4, 6]), 4 * 1001, chunk_elems=100)
    a = s.to_array()
    assert a[1] == 2 and a[2] == collectives.get("reducescatter").wire_id
    s2 = Schedule.from_array(a)
    assert s2.collective == "reducescatter"
    for f in ("seg_root", "seg_offset", "seg_length", "seg_phases", "reduce_parent", "bcast_parent",
              "chunk_seg", "chunk_offset", "chunk_length", "transfers"):
        np.testing.assert_array_equal(getattr(s, f), getattr(s2, f))
    bad = a.copy()
    bad[8 + 3 * len(s.seg_root)] = PHASE_BROADCAST  # seg_phases[0] contradicts the row
    with pytest.raises(ScheduleError, match="seg_phases"):
        Schedule.from_array(bad)
    # a version-1 array (no seg_phases) of an all-reduce: phases derived from the collective
    ar = build_schedule(plan(DGX1V, "allreduce", devices=[0, 2, 4, 6]), 999)
    v2 = ar.to_array()
    S = len(ar.seg_root)
    v1 = np.r_[v2[:1], 1, v2[2:8 + 3 * S], v2[8 + 4 * S:]]
    old = Schedule.from_array(v1)
    assert np.all(old.seg_phases == PHASE_REDUCE | PHASE_BROADCAST)
    np.testing.assert_array_equal(old.transfers, ar.transfers)
    # version 1 has no sharded collectives
    v1_ag = v1.copy()
    v1_ag[2] = collectives.get("allgather").wire_id
    with pytest.raises(ScheduleError, match="header"):
        Schedule.from_array(v1_ag)


@settings(max_examples=25, deadline=None)
@given(devs=st.lists(st.integers(0, 7), min_size=2, max_size=8, unique=True),
       per_rank=st.integers(0, 400), chunk=st.integers(1, 300),
       coll=st.sampled_from(["allgather", "reducescatter"]), dtype=st.sampled_from([np.int8, np.uint16, np.int64]))
def test_random_sharded_wrap_like_numpy(devs, per_rank, chunk, coll, dtype):
    n = len(devs)
    s = build_schedule(plan(DGX1V, coll, devices=devs), n * per_rank, chunk_elems=chunk)
    x = np.random.default_rng(1).integers(0, 200, (n, n * per_rank)).astype(dtype)
    with np.errstate(over="ignore"):
        check_sharded(s, coll, x)


def test_tree_chunks_given_per_tree():
    """tree_chunks fixes a tree's chunk count (the link simulator's, simulate.plan_chunks), past the
    round model's total budget, at most one chunk per element; other trees keep the cost model."""
    p = plan(PRESETS["dgx1v"](), "allreduce")
    trees = [t for t in p.trees if t.weight_gbps > 0]
    ne = 1 << 16
    want = {trees[0]: 40, trees[1]: 1}
    s = build_schedule(p, ne, tree_chunks=want, max_total_chunks=8)
    per_seg = np.bincount(s.chunk_seg, minlength=len(s.seg_root))
    assert per_seg[0] == 40 and per_seg[1] == 1
    x = np.random.default_rng(0).normal(size=(8, ne)).astype(np.float32)
    np.testing.assert_allclose(execute(s, x), np.broadcast_to(x.sum(0), x.shape), rtol=1e-5, atol=1e-4)
    tiny = build_schedule(p, len(trees) * 2, tree_chunks={t: 64 for t in trees})
    assert all(int(c) <= int(n) for c, n in zip(np.bincount(tiny.chunk_seg, minlength=len(tiny.seg_root)),
                                                tiny.seg_length))
