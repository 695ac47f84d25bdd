"""Simulator and cost model for all-gather / reduce-scatter plans, and the "rsag" all-reduce (reduce-
scatter forest then all-gather forest): closed forms, busbw factor, auto choice, exact execution."""

import numpy as np
import pytest

from jax_blink import costmodel
from jax_blink.errors import PlanError
from jax_blink.planner.model import Plan, Tree
from jax_blink.planner.rings import nccl_ring_plan, ring_plan
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule, execute
from jax_blink.simulate import simulate
from jax_blink.topology import Topology
from jax_blink.topology.presets import PRESETS

ALPHA_US = 2.0  # the whole per-send latency: closed forms below pass protocol_latency_us=0


def one_way_ring(n: int, gbps: float) -> Topology:
    t = Topology(f"ring{n}")
    for i in range(n):
        t.add_gpu(i)
    for i in range(n):
        t.add_link(i, (i + 1) % n, gbps, "nvlink", bidirectional=False)
    return t


@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
def test_unpipelined_ring_matches_closed_form(collective):
    # n - 1 steps of one shard S/n over each link, each paying alpha (Patarasuk & Yuan 2009; NCCL)
    n, b, s = 5, 10.0, 5e6
    t = one_way_ring(n, b)
    if collective == "reducescatter":  # the reduce-scatter ring runs on the reversed links
        t = Topology("rev")
        for i in range(n):
            t.add_gpu(i)
        for i in range(n):
            t.add_link((i + 1) % n, i, b, "nvlink", bidirectional=False)
    p = plan(t, collective, algorithm="ring")
    assert p.rate_gbps == pytest.approx(n * b / (n - 1)) == pytest.approx(p.bound_gbps)
    r = simulate(p, s, topology=t, latency_us=ALPHA_US, chunk_bytes=s / n,
                 protocol_latency_us=0.0)
    assert r.time_s == pytest.approx((n - 1) * (s / n / (b * 1e9) + ALPHA_US * 1e-6), rel=1e-9)
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * (n - 1) / n)
    assert r.algbw_gbps == pytest.approx(s / r.time_s / 1e9)
    # every link carries n - 1 shards
    assert all(v == pytest.approx((n - 1) * s / n) for v in r.link_bytes.values())


def test_two_gpus_exchange_their_shards():
    t = Topology("pair")
    t.add_gpu(0)
    t.add_gpu(1)
    t.add_link(0, 1, 20.0, "nvlink")
    s = 4e6
    for coll in ("allgather", "reducescatter"):
        p = plan(t, coll)
        assert p.rate_gbps == pytest.approx(40.0)  # each shard S/2 over its own direction at 20 GB/s
        r = simulate(p, s, topology=t, latency_us=ALPHA_US, chunk_bytes=s / 2,
                     protocol_latency_us=0.0)
        assert r.time_s == pytest.approx(s / 2 / 20e9 + ALPHA_US * 1e-6, rel=1e-9)
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps / 2)
        assert r.link_bytes == {(0, 1): pytest.approx(s / 2), (1, 0): pytest.approx(s / 2)}


def test_segments_stay_inside_shards_and_large_sizes_approach_the_rate():
    t = PRESETS["dgx1v"]()
    for coll in ("allgather", "reducescatter"):
        p = plan(t, coll, devices=[0, 1, 2, 5])
        s = 1 << 30
        r = simulate(p, s, topology=t)
        # large operands: within 15% of the planned rate (pipeline fill and latency only)
        assert p.rate_gbps * 0.85 < r.algbw_gbps <= p.rate_gbps * (1 + 1e-9)
        # each rank's shard S/n leaves (all-gather) or enters (reduce-scatter) its owner n-1 times in total
        into = sum(v for (a, b), v in r.link_bytes.items() if (b if coll == "allgather" else a) in p.devices)
        assert into >= 4 * 3 * s / 4 * (1 - 1e-9)


def test_plan_without_trees_for_a_rank_is_refused():
    t = Topology("pair")
    t.add_gpu(0)
    t.add_gpu(1)
    t.add_link(0, 1, 20.0, "nvlink")
    bad = Plan("allgather", None, (0, 1), (Tree(0, 10.0, ((0, 1),)),), 10.0, 40.0, "trees")
    with pytest.raises(PlanError, match="no tree rooted at GPUs \\[1\\]"):
        simulate(bad, 1e6, topology=t)


@pytest.mark.parametrize("name,devices", [("dgx1v", None), ("dgx1v", [0, 1, 2, 5]), ("pcie-2socket", [0, 2, 5])])
@pytest.mark.slow
def test_auto_allgather_is_the_fastest_candidate(name, devices):
    t = PRESETS[name]()
    rivals = [ring_plan(t, "allgather", devices=devices), nccl_ring_plan(t, "allgather", devices=devices),
              plan(t, "allgather", devices=devices, algorithm="trees")]
    n = len(rivals[-1].devices)
    rivals.append(plan(t, "allgather", devices=devices, algorithm="trees", max_trees=n))
    for size in (64 << 10, 1 << 20, 64 << 20, 1 << 30):
        chosen = plan(t, "allgather", devices=devices, nbytes=size)
        tc = costmodel.simulated_time(chosen, size, t)
        for r in rivals:
            assert tc <= costmodel.simulated_time(r, size, t) * (1 + 1e-12), (size, r.shape())
        assert chosen.collective == "allgather" and "chosen for" in chosen.notes[-1]


def test_rsag_allreduce_is_executable_and_its_rate_is_rs_plus_ag_time():
    t = PRESETS["dgx1v"]()
    for devices in (None, [0, 1, 2, 5], [0, 1, 4, 5, 6]):
        p = plan(t, "allreduce", devices=devices, algorithm="rsag")
        rs = plan(t, "reducescatter", devices=devices)
        ag = plan(t, "allgather", devices=devices)
        n = len(p.devices)
        assert p.algorithm == "rsag" and p.collective == "allreduce"
        # S / rate = S / rate_rs + S / rate_ag
        assert 1 / p.rate_gbps == pytest.approx(1 / rs.rate_gbps + 1 / ag.rate_gbps, rel=1e-6)
        assert p.bound_gbps == pytest.approx(1 / (1 / rs.bound_gbps + 1 / ag.bound_gbps), rel=1e-6)
        for (u, v), load in p.link_loads().items():
            assert load <= t.graph.edges[u, v]["bandwidth_gbps"] + 1e-6
        per_root = {}
        for tr in p.trees:
            assert tr.reduce_edges is not None
            assert set(tr.gpu_parents()) == set(tr.gpu_parents(reduce=True)) == set(p.devices) - {tr.root}
            per_root[tr.root] = per_root.get(tr.root, 0.0) + tr.weight_gbps
        assert all(w == pytest.approx(p.rate_gbps / n, rel=1e-6) for w in per_root.values())
        s = build_schedule(p, 1003)
        x = np.random.default_rng(1).integers(-50, 50, (n, 1003))
        np.testing.assert_array_equal(execute(s, x), np.broadcast_to(x.sum(0), x.shape))
    cands = costmodel.candidate_plans(t, "allreduce")
    assert cands[-1].algorithm == "rsag"
    with pytest.raises(PlanError, match="rsag"):
        plan(t, "allgather", algorithm="rsag")
    with pytest.raises(PlanError, match="max_trees"):
        plan(t, "allreduce", algorithm="rsag", max_trees=3)
