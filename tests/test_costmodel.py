"""Latency-aware (plan, chunks) choice: small operands get fewer rounds, large keep the optimal rate."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import ScheduleError, costmodel, dispatch, lowering, mapping
from jax_blink.errors import PlanError
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule, execute
from jax_blink.simulate import simulate
from jax_blink.topology import Topology
from jax_blink.topology.presets import PRESETS

DGX1V = PRESETS["dgx1v"]()
ALL8 = list(range(8))


def test_predicted_time_by_hand():
    """One tree on two GPUs, one chunk: 2 rounds (reduce + broadcast), depth 2 -> stretch 2."""
    p = plan(DGX1V, "allreduce", devices=[0, 1])
    s = build_schedule(p, 1000, chunk_elems=1000)
    assert s.num_rounds == 2 and len(s.chunk_seg) == len(s.seg_root)
    rate = costmodel.plan_rate_gbps(p)
    want = 2 * 1e-4 + 4000 / (rate * 1e9) * 2
    assert costmodel.predicted_time(s, p, 4, 1e-4) == pytest.approx(want, rel=1e-12)


def test_small_operand_gets_fewer_rounds_than_optimal_plan():
    plans = dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None)
    opt = plans[0]
    assert len(opt.trees) == 24 and [len(p.trees) for p in plans[1:4]] == [4, 2, 1]
    # then the LP ring packing (NVLink + PCIe), NCCL's double binary tree, NCCL's NVLink rings and
    # reduce-scatter + all-gather forests
    assert [p.algorithm for p in plans[4:]] == ["ring", "double-binary-tree", "ring", "rsag"]
    lat = lowering.record("ppermute", "cpu").step_latency_s
    chosen, sched, t = costmodel.choose_schedule(plans, 1024, step_latency_s=lat)
    base = build_schedule(opt, 1024, step_latency_s=lat)
    # 24 one-chunk trees need 54 rounds on 8 ranks (one send / receive per rank and round); NCCL's
    # double binary tree needs 10 (the one-tree packing, a Hamiltonian path of double links, 11)
    assert base.num_rounds == 54 and sched.num_rounds == 10 and chosen.algorithm == "double-binary-tree"
    assert t < costmodel.predicted_time(base, opt, 4, lat)
    x = np.random.default_rng(0).integers(-99, 99, (8, 1024))
    np.testing.assert_array_equal(execute(sched, x), np.broadcast_to(x.sum(0), x.shape))


def test_large_operand_keeps_optimal_rate():
    topo = Topology.host(8)
    plans = dispatch.candidate_plans(topo, "allreduce", ALL8, None)[:4]  # the packings
    assert [len(p.trees) for p in plans] == [8, 4, 2, 1]
    for impl in ("ppermute", "ffi"):
        lat = lowering.record(impl, "cpu").step_latency_s
        chosen, sched, _ = costmodel.choose_schedule(plans, 16 * 2**20, step_latency_s=lat)
        assert chosen is plans[0] and chosen.rate_gbps == max(p.rate_gbps for p in plans)
        assert len(sched.chunk_seg) > len(chosen.trees)  # pipelined
    # dgx1v: ppermute's latency keeps one tree; a negligible latency buys rate with more trees (not
    # all 17: the lightest trees' segments are too short to pipeline, the (k + d - 1) / k term)
    dplans = dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None)[:4]
    slow, _, _ = costmodel.choose_schedule(dplans, 2**22, step_latency_s=1e-4)
    fast, _, _ = costmodel.choose_schedule(dplans, 2**22, step_latency_s=1e-9)
    assert len(slow.trees) == 1 and len(fast.trees) > 1 and fast.rate_gbps > slow.rate_gbps


def test_chunks_shrink_with_latency():
    p = plan(Topology.host(8), "allreduce")
    _, fast, _ = costmodel.choose_schedule([p], 2**22, step_latency_s=1e-6)
    _, slow, _ = costmodel.choose_schedule([p], 2**22, step_latency_s=1e-3)
    assert fast.num_rounds > slow.num_rounds and len(fast.chunk_seg) > len(slow.chunk_seg)


def test_overrides_and_errors():
    plans = dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None, max_trees=2)
    assert len(plans) == 1 and len(plans[0].trees) == 2
    _, s, _ = costmodel.choose_schedule(plans, 1000, chunk_elems=100)
    assert len(s.chunk_seg) == 7 + 4  # segments 667 and 333 (weights 50:25) in chunks of <= 100
    assert dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None, algorithm="ring")[0].algorithm == "ring"
    assert len(dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None, algorithm="ring")) == 1
    with pytest.raises(ScheduleError, match="at least one plan"):
        costmodel.choose_schedule([], 10)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_trees must be a positive int"):
            mapping.make_plan_key(max_trees=bad)


@pytest.mark.parametrize("max_trees", [None, 1, 3])
def test_psum_max_trees_matches_lax(max_trees):
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    x = jnp.arange(8 * 300, dtype=jnp.int32).reshape(8, 300)
    def f(m):
        return jax.jit(jax.shard_map(m, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    got = f(lambda v: jax_blink.psum(v, "i", impl="ppermute", topology="dgx1v", max_trees=max_trees))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(lambda v: lax.psum(v, "i"))(x)))
    from jax_blink.dispatch import build_request
    key = mapping.make_plan_key("dgx1v", None, None, None, max_trees)
    req = build_request("allreduce", mesh, ("i",), None, None, key, 300, 4, "cpu", "ppermute")
    want = {None: 2, 1: 1, 3: 3}[max_trees]  # cost model: NCCL's double binary tree for 1.2 KB on ppermute
    assert len(req.schedules[0].seg_root) == want
    with pytest.raises(ValueError, match="max_trees"):
        f(lambda v: jax_blink.psum(v, "i", max_trees=0))(x)


def test_native_lowering_runs_the_simulators_fastest_candidate():
    """Native GPU lowerings (no round barrier) take the plan the simulator predicts fastest at the
    operand's size with their step latency, every tree edge on its pair's peer-to-peer path (the CUDA
    interpreter loads its peers' memory); ppermute ranks the same candidates by rounds; the CPU
    executor keeps the packing (its cost is memory passes, not links: a ring measured 1.6x slower)."""

    mesh = Mesh(np.array(jax.devices()), ("i",))
    key = mapping.make_plan_key("dgx1v")
    cands = dispatch.candidate_plans(DGX1V, "allreduce", ALL8, None)
    rec = lowering.record("ffi", "cuda")
    assert rec.peer_routes and not lowering.record("ffi", "cpu").peer_routes
    lat_us = rec.step_latency_s * 1e6
    for nel in (2**14, 2**22):
        times = [simulate(p, nel * 4, topology=DGX1V, latency_us=lat_us, peer_routes=True).time_s for p in cands]
        best = cands[int(np.argmin(times))]
        native = dispatch.build_request("allreduce", mesh, ("i",), None, None, key, nel, 4, "cuda", "ffi")
        assert len(native.schedules[0].seg_root) == len(best.trees)
        assert sorted(native.schedules[0].seg_root.tolist()) == sorted(
            best.devices.index(t.root) for t in best.trees)
        cpu = dispatch.build_request("allreduce", mesh, ("i",), None, None, key, nel, 4, "cpu", "ffi")
        assert len(cpu.schedules[0].seg_root) == len(cands[0].trees)
    portable = dispatch.build_request("allreduce", mesh, ("i",), None, None, key, 2**22, 4, "cpu", "ppermute")
    assert len(portable.schedules[0].seg_root) < len(plan(DGX1V, "allreduce").trees)


def test_cuda_schedule_is_chunked_as_simulated():
    """The CUDA record (one kernel per call: a chunk costs a flag hop) takes the chosen plan's chunk counts
    from the link simulator's rule (choose_chunks per tree, at most 64 per tree), past the round model's
    48-chunk cap, and predicts the schedule's simulated time as the interpreter runs it (free-running, on
    peer-to-peer paths), within 4% of its plan's; the CPU executor keeps the round model's cap."""
    from jax_blink.simulate import CHUNK_BUDGET, DEFAULT_MAX_CHUNKS

    rec = lowering.record("ffi", "cuda")
    assert rec.chunks_as_simulated and not lowering.record("ffi", "cpu").chunks_as_simulated
    mesh = Mesh(np.array(jax.devices()), ("i",))
    key = mapping.make_plan_key("dgx1v")
    nel = 2**24  # 64 MiB of float32 per GPU
    req = dispatch.build_request("allreduce", mesh, ("i",), None, None, key, nel, 4, "cuda", "ffi")
    chosen, sched, predicted = req.plans[0], req.schedules[0], req.predicted_s[0]
    ntrees = sum(1 for t in chosen.trees if t.weight_gbps > 0)
    want = build_schedule(chosen, nel, itemsize=4, step_latency_s=rec.step_latency_s,
                          max_chunks=min(DEFAULT_MAX_CHUNKS, CHUNK_BUDGET // ntrees), max_total_chunks=CHUNK_BUDGET)
    assert np.array_equal(sched.chunk_length, want.chunk_length) and len(sched.chunk_seg) > 48
    assert predicted == simulate(sched, nel * 4, topology=DGX1V, latency_us=rec.step_latency_s * 1e6,
                                 devices=list(chosen.devices), free_running=True).time_s
    assert predicted == pytest.approx(simulate(chosen, nel * 4, topology=DGX1V, latency_us=rec.step_latency_s * 1e6,
                                               peer_routes=True).time_s, rel=0.04)
    cpu = dispatch.build_request("allreduce", mesh, ("i",), None, None, key, nel, 4, "cpu", "ffi")
    assert len(cpu.schedules[0].chunk_seg) <= 48


def test_link_rerank_ranks_a_candidate_that_cannot_run_last():
    """Across nodes the close candidates are timed again link-level; one that the link-level model
    refuses (an all-gather plan missing a tree from some shard's owner) is ranked last with an infinite
    time instead of failing the whole choice."""
    from jax_blink.topology.presets import multi_node
    topo = multi_node("dgx1v", 2, 12.5, 1)
    good = costmodel.candidate_plans(topo, "allgather")
    p = good[0]
    bad = dataclasses.replace(p, trees=tuple(t for t in p.trees if t.root != p.trees[0].root))
    with pytest.raises(PlanError, match="no tree rooted"):
        simulate(bad, 1 << 20, topology=topo, method="link")
    order, model = costmodel.ranked([bad, *good], 1 << 20, topo)
    assert model == "link" and order[-1] == (bad, math.inf) and all(t < math.inf for _, t in order[:-1])
