"""Tree packing (TreeGen): validity, capacity, optimality against independent max-flow / Nash-Williams
values, determinism, bad input."""

import collections
import itertools
import json
import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_blink
from jax_blink.errors import PlanError
from jax_blink.planner import bounds, rings
from jax_blink.planner.model import Plan
from jax_blink.planning import plan
from jax_blink.topology import Topology
from jax_blink.topology.presets import EDR_IB_GBPS, PRESETS, nvlink_gbps

TOL = 1e-6
V2, V4 = nvlink_gbps(2), nvlink_gbps(4)  # achieved GB/s per NVLink (V100, H100)


def maxflow_bound(topology, devices, root, reverse=False):
    """Independent Edmonds bound: min over v of maxflow(root -> v) on the job's physical graph."""
    g = topology.subset(devices).graph
    if reverse:
        g = g.reverse(copy=True)
    return min(nx.maximum_flow_value(g, root, v, capacity="bandwidth_gbps") for v in devices if v != root)


def check_plan(topology, p):
    """Every tree spans the devices from its root through switch-only routes; no link overloaded."""
    g = topology.graph
    devs = set(p.devices)
    assert p.rate_gbps == pytest.approx(sum(t.weight_gbps for t in p.trees), abs=1e-6)
    for t in p.trees:
        assert t.weight_gbps > 0
        for reduce in (False, True):
            for r in t.routes(reduce):
                assert r[0] in devs and r[-1] in devs
                assert all(g.nodes[x]["kind"] != "gpu" for x in r[1:-1]), r
                for a, b in zip(r, r[1:]):
                    assert g.has_edge(a, b) or reduce and t.reduce_edges is None and g.has_edge(b, a), (a, b)
            par = t.gpu_parents(reduce)
            assert set(par) == devs - {t.root}
            h = nx.DiGraph([(pp, c) for c, pp in par.items()])
            h.add_nodes_from(devs)
            assert nx.is_arborescence(h) and t.root in devs
            assert all(nx.has_path(h, t.root, v) for v in devs)
        if p.collective != "allreduce":
            assert t.root == p.root
    for (u, v), load in p.link_loads().items():
        assert load <= g.edges[u, v]["bandwidth_gbps"] + TOL, ((u, v), load)


def test_dgx1v_every_allocation_and_root_broadcast_reduce_reach_maxflow():
    t = PRESETS["dgx1v"]()
    count = 0
    for k in range(2, 9):
        for devs in itertools.combinations(range(8), k):
            for root in devs:
                for coll, rev in (("broadcast", False), ("reduce", True)):
                    p = plan(t, coll, devices=devs, root=root)
                    ref = maxflow_bound(t, devs, root, reverse=rev)
                    assert p.bound_gbps == pytest.approx(ref, rel=1e-9)
                    assert p.rate_gbps == pytest.approx(ref, rel=1e-6), (coll, devs, root)
                    if k in (2, 5, 8):
                        check_plan(t, p)
                    count += 1
    assert count == 2 * sum(math.comb(8, k) * k for k in range(2, 9))


def test_dgx1v_nvlink_allreduce_equals_nash_williams():
    t = PRESETS["dgx1v-nvlink"]()
    full = plan(t, "allreduce")
    assert full.rate_gbps == pytest.approx(24 * V2 / 7, rel=1e-6)  # 600/7 at the 25 GB/s line rate
    assert bounds.nash_williams_value(t, range(8)) == pytest.approx(24 * V2 / 7)
    for k in (2, 3, 4, 5, 6):
        for devs in itertools.combinations(range(8), k):
            if not nx.is_connected(t.subset(devs).graph.to_undirected()):
                with pytest.raises(PlanError):
                    plan(t, "allreduce", devices=devs)
                continue
            p = plan(t, "allreduce", devices=devs)
            nw = bounds.nash_williams_value(t, devs)
            if p.algorithm == "trees":
                assert p.rate_gbps == pytest.approx(nw, rel=1e-6), devs
            else:  # a ring only wins when it beats the tree optimum
                assert p.rate_gbps > nw
            check_plan(t, p)


@pytest.mark.parametrize("name", ["dgx1p", "dgx1v", "dgx2", "dgx-a100", "dgx-h100", "pcie-2socket"])
def test_presets_full_box_optimal_and_valid(name):
    t = PRESETS[name]()
    root = t.gpus[-1]
    for coll, rev in (("broadcast", False), ("reduce", True)):
        p = plan(t, coll, root=root)
        assert p.rate_gbps == pytest.approx(maxflow_bound(t, t.gpus, root, rev), rel=1e-6)
        check_plan(t, p)
    a = plan(t, "allreduce")
    assert a.rate_gbps == pytest.approx(a.bound_gbps, rel=1e-6) or a.algorithm == "ring"
    check_plan(t, a)


def test_known_values():
    assert plan(PRESETS["dgx1v-nvlink"](), "broadcast").rate_gbps == pytest.approx(6 * V2)
    # H100: 450 GB/s per GPU into the NVSwitch; all-reduce trees: n*c/(2(n-1)) = 8*450/14
    assert plan(PRESETS["dgx-h100"](), "allreduce").rate_gbps == pytest.approx(8 * 18 * V4 / 14, rel=1e-6)
    # ring all-reduce rate equals the tree rate on a uniform switch: n*B/(2(n-1)), B = 450
    assert rings.ring_rate(PRESETS["dgx-h100"](), range(8)) == pytest.approx(18 * V4, rel=1e-6)


def test_allreduce_roots_spread_and_ring_plan_valid():
    t = PRESETS["dgx1v-nvlink"]()
    p = plan(t, "allreduce")
    assert len({tr.root for tr in p.trees}) == min(len(p.trees), 8)
    # a 4-GPU ring machine: 0-1-2-3-0 single links plus nothing else: ring == trees; force the ring
    # path through the private helper to check ring trees execute as a valid packing.
    from jax_blink.planner.rings import _ring_trees, ring_packing
    b, rings = ring_packing(t, range(8))
    assert b == pytest.approx(6 * V2, rel=1e-6)
    rt = tuple(_ring_trees(rings, 8))
    rp = Plan("allreduce", None, tuple(range(8)), rt, sum(x.weight_gbps for x in rt), 0.0, "ring")
    check_plan(t, rp)
    assert sum(tr.weight_gbps for tr in rp.trees) == pytest.approx(8 * 6 * V2 / 14, rel=1e-6)


def _pcie_switch_pair():
    t = Topology("sw")
    t.add_switch("sw", "pcie-switch")
    for g in range(3):
        t.add_gpu(g)
        t.add_link(g, "sw", 12.0, "pcie")
    return t


def test_switch_routes_share_capacity():
    t = _pcie_switch_pair()
    p = plan(t, "broadcast", root=0)
    assert p.rate_gbps == pytest.approx(12.0)  # a chain through the switch, not a star
    check_plan(t, p)
    for tr in p.trees:
        assert any(isinstance(a, str) or isinstance(b, str) for a, b in tr.edges)


def test_max_trees_reports_loss():
    t = PRESETS["dgx1v-nvlink"]()
    p = plan(t, "broadcast", max_trees=1)
    assert len(p.trees) == 1 and p.rate_gbps == pytest.approx(2 * V2)  # the double-link Hamiltonian path
    assert any("max_trees=1" in n for n in p.notes)
    check_plan(t, p)


def test_multi_node_flat_optimum_and_three_phase_plan_valid():
    from jax_blink.planner.threephase import node_groups as _node_groups
    t = PRESETS["dgx1v-4node"]()
    devs = t.gpus
    p = plan(t, "broadcast")
    assert len(p.devices) == 32 and p.rate_gbps == pytest.approx(maxflow_bound(t, devs, 0), rel=1e-6)
    check_plan(t, p)
    groups = _node_groups(t, devs)
    assert groups == [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    for coll, root in (("broadcast", 0), ("reduce", 0), ("allreduce", None)):
        hp = plan(t, coll, root=root, algorithm="hierarchical")
        assert hp.algorithm == "hierarchical"
        check_plan(t, hp)
        check_three_phase(hp, 8)
        if coll != "allreduce":
            assert hp.bound_gbps == pytest.approx(EDR_IB_GBPS)  # one NIC (12.0 GB/s achieved) per node is the cut
            assert hp.rate_gbps == pytest.approx(EDR_IB_GBPS, rel=1e-6)
        else:
            # a spanning tree over 4 nodes crosses the network on >= 3 GPU edges, each using two NIC
            # egress directions (reduce + broadcast): rate <= 4 * 12.0 / (2 * 3) for any tree packing;
            # identical nodes: the certificate is that exact tree-packing bound (planner/symmetric.py)
            assert hp.rate_gbps == pytest.approx(4 * EDR_IB_GBPS / 6, rel=1e-6)
            assert hp.bound_gbps == pytest.approx(4 * EDR_IB_GBPS / 6, rel=1e-6)
            assert "0.00% below the exact flat bound 8.000" in hp.notes[0]


def check_three_phase(p, G):
    """Blink s. 5 structure: every cross-node GPU edge joins the same position i of two nodes, and one
    position per tree (partition i's leaders), so each node's part of a tree is an intra-node tree."""
    for tr in p.trees:
        pos = set()
        for reduce in (False, True):
            for c, par in tr.gpu_parents(reduce).items():
                if c // G != par // G:
                    assert c % G == par % G, (c, par)
                    pos.add(c % G)
        assert len(pos) == 1, pos
        by_node = collections.defaultdict(set)
        for c, par in tr.gpu_parents().items():
            if c // G == par // G:
                by_node[c // G] |= {c, par}
        nodes = {d // G for d in p.devices}
        for k in nodes:  # the node's GPUs form one intra-node tree (connected without the network)
            mine = [d for d in p.devices if d // G == k]
            h = nx.Graph([(c, par) for c, par in tr.gpu_parents().items() if c // G == k and par // G == k])
            h.add_nodes_from(mine)
            assert nx.is_connected(h), (k, list(h.edges))


@pytest.mark.parametrize("nics", [1, 2, 4])
def test_three_phase_allreduce_reaches_nic_bound_and_runs_exactly(nics):
    """2 dgx1v nodes, NICs of 12.5 GB/s: the NICs are the cut (max-flow bound nics * 12.5 GB/s); Blink's
    three phases with partitions spread over the GPUs that reach each NIC reach it, and the schedule
    sums integers exactly."""
    from jax_blink.schedule import build_schedule, execute
    from jax_blink.simulate import simulate
    from jax_blink.topology.presets import multi_node

    t = multi_node("dgx1v", 2, 12.5, nics)
    hp = plan(t, "allreduce", algorithm="hierarchical")
    assert bounds.allreduce_bound(t, t.gpus) == pytest.approx(12.5 * nics)
    assert hp.bound_gbps == pytest.approx(12.5 * nics)
    assert hp.rate_gbps == pytest.approx(12.5 * nics, rel=1e-6)
    check_plan(t, hp)
    check_three_phase(hp, 8)
    # NIC links carry exactly the rate in each direction (reduce one way, broadcast the other)
    loads = hp.link_loads()
    nic_up = sum(v for (a, b), v in loads.items() if b == "network")
    assert nic_up == pytest.approx(2 * 12.5 * nics, rel=1e-6)
    s = build_schedule(hp, 4099)
    x = np.random.default_rng(0).integers(-2**20, 2**20, size=(16, 4099)).astype(np.int64)
    np.testing.assert_array_equal(execute(s, x), np.broadcast_to(x.sum(0), x.shape))
    sim = simulate(hp, 256 * 2**20, topology=t)
    # the event model loses 17-29% to pipeline fill on these deep trees (flat packings lose 17-23%), but
    # the simulated three-phase plan still beats a flat ring's ideal rate n * B / (2(n-1)), B = NIC rate
    assert 0.65 * hp.rate_gbps <= sim.algbw_gbps <= hp.rate_gbps * (1 + 1e-6), sim.algbw_gbps
    assert sim.algbw_gbps > 16 * 12.5 * nics / 30, sim.algbw_gbps


def test_three_phase_rooted_and_uneven_nodes_run_exactly():
    """Broadcast/reduce three-phase plans and nodes with different GPU counts (3 + 2 GPUs)."""
    from jax_blink.schedule import build_schedule, execute
    from jax_blink.topology.presets import multi_node

    t = multi_node("dgx1v", 2, 12.5, 2)
    devs = [1, 2, 4, 9, 14]
    for coll, root in (("broadcast", 9), ("reduce", 4), ("allreduce", None)):
        hp = plan(t, coll, devices=devs, root=root, algorithm="hierarchical")
        check_plan(t, hp)
        assert 0 < hp.rate_gbps <= hp.bound_gbps * (1 + 1e-6)
        s = build_schedule(hp, 517)
        x = np.arange(5 * 517, dtype=np.int64).reshape(5, 517) * 3 - 700
        got = execute(s, x)
        if coll == "broadcast":
            want = np.broadcast_to(x[devs.index(root)], x.shape)
        elif coll == "reduce":
            want = np.zeros_like(x)
            want[devs.index(root)] = x.sum(0)
        else:
            want = np.broadcast_to(x.sum(0), x.shape)
        np.testing.assert_array_equal(got, want)


def test_deterministic_json_roundtrip():
    t = PRESETS["dgx1v"]()
    a = plan(t, "allreduce", devices=(0, 1, 2, 5, 6))
    jax_blink.clear_caches()
    b = plan(t, "allreduce", devices=(0, 1, 2, 5, 6))
    assert a is not b and a.to_json() == b.to_json()
    assert Plan.from_json(a.to_json()).to_json() == a.to_json()
    d = json.loads(a.to_json())
    assert set(d) == {"collective", "root", "devices", "rate_gbps", "bound_gbps", "algorithm", "notes", "trees"}
    assert "tree 0" in a.describe()


def test_clear_caches_reaches_every_stage():
    """clear_caches() empties the plan caches and what later stages derived from plans: the cost
    model's choice (plan(nbytes=)), NCCL's ring level, loaded topology files, call-site requests."""
    from jax_blink import dispatch, mapping
    from jax_blink.planner import rings
    t = PRESETS["dgx1v"]()
    a = plan(t, "allreduce", devices=(0, 1, 2, 5), nbytes=1 << 20)
    assert plan(t, "allreduce", devices=(0, 1, 2, 5), nbytes=1 << 20) is a  # cached
    mapping._load("dgx1v")
    assert rings._nccl_level.cache_info().currsize > 0 and mapping._load.cache_info().currsize > 0
    jax_blink.clear_caches()
    for fn in (rings._nccl_level, mapping._load, dispatch.build_request):
        assert fn.cache_info().currsize == 0, fn
    b = plan(t, "allreduce", devices=(0, 1, 2, 5), nbytes=1 << 20)
    assert b is not a and b.to_json() == a.to_json()


def test_trivial_and_errors():
    t = PRESETS["dgx1v"]()
    one = plan(t, "broadcast", devices=[3])
    assert one.trees == () and math.isinf(one.rate_gbps) and json.loads(one.to_json())["rate_gbps"] is None
    with pytest.raises(PlanError, match="9"):
        plan(t, "broadcast", devices=[0, 9])
    with pytest.raises(PlanError, match="root 5"):
        plan(t, "broadcast", devices=[0, 1], root=5)
    with pytest.raises(PlanError, match="collective"):
        plan(t, "gather")
    with pytest.raises(PlanError, match="max_trees"):
        plan(t, "broadcast", max_trees=0)
    two = Topology("split")
    for g in range(4):
        two.add_gpu(g)
    two.add_link(0, 1, 10.0, "nvlink")
    two.add_link(2, 3, 10.0, "nvlink")
    with pytest.raises(PlanError, match=r"\[0, 1\], \[2, 3\]"):
        plan(two, "allreduce")


@st.composite
def random_topology(draw):
    n = draw(st.integers(2, 6))
    t = Topology("random")
    for g in range(n):
        t.add_gpu(g)
    nsw = draw(st.integers(0, 2))
    for s in range(nsw):
        t.add_switch(f"sw{s}", "pcie-switch")
    nodes = list(range(n)) + [f"sw{s}" for s in range(nsw)]
    # a random spanning tree (connected), then extra links; symmetric so switches are Eulerian
    for i in range(1, len(nodes)):
        j = draw(st.integers(0, i - 1))
        t.add_link(nodes[i], nodes[j], draw(st.sampled_from([5.0, 10.0, 25.0])), "pcie")
    for _ in range(draw(st.integers(0, 6))):
        u, v = draw(st.sampled_from(nodes)), draw(st.sampled_from(nodes))
        if u != v and not (isinstance(u, str) and isinstance(v, str)):
            t.add_link(u, v, draw(st.sampled_from([5.0, 10.0, 25.0])), "nvlink")
    return t


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_topology(), st.data())
def test_random_graphs_reach_maxflow(t, data):
    devs = t.gpus
    try:
        t.subset(devs)
        ok = nx.is_strongly_connected(t.subset(devs).graph)
    except Exception:
        ok = False
    if not ok:
        with pytest.raises(PlanError):
            plan(t, "broadcast")
        return
    root = data.draw(st.sampled_from(devs))
    for coll, rev in (("broadcast", False), ("reduce", True)):
        p = plan(t, coll, root=root)
        assert p.rate_gbps == pytest.approx(maxflow_bound(t, devs, root, rev), rel=1e-6)
        check_plan(t, p)
    a = plan(t, "allreduce")
    check_plan(t, a)
    assert a.rate_gbps <= bounds.allreduce_bound(t, devs) + TOL
    if not t.switches and a.algorithm == "trees":
        assert a.rate_gbps == pytest.approx(bounds.nash_williams_value(t, devs), rel=1e-6)


def test_cli_plan_json_table_and_error(capsys):
    from jax_blink.cli import main
    assert main(["plan", "--topology", "dgx1v-nvlink", "--devices", "0,1,2,3", "--collective", "broadcast",
                 "--root", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["root"] == 3 and d["rate_gbps"] == pytest.approx(4 * V2) and d["bound_gbps"] == pytest.approx(4 * V2)
    assert main(["plan", "--topology", "dgx1v-nvlink"]) == 0
    out = capsys.readouterr().out
    assert "78.514" in out and "ring" in out  # 24 x 22.9 / 7
    assert main(["plan", "--topology", "dgx1v", "--devices", "0,9"]) == 2
    assert "[9]" in capsys.readouterr().err


def test_forced_algorithms():
    from jax_blink.schedule import build_schedule, execute
    from jax_blink.topology.presets import PRESETS

    t = PRESETS["dgx1v-nvlink"]()
    ring = plan(t, "allreduce", algorithm="ring")
    assert ring.algorithm == "ring" and len(ring.trees) % 8 == 0
    # n rings' worth of reduce/broadcast paths: the all-reduce rate n*B/(2(n-1)) with B = 150 GB/s of rings
    assert ring.rate_gbps == pytest.approx(8 * 6 * V2 / 14, rel=1e-6)
    s = build_schedule(ring, 1001)
    x = np.arange(8 * 1001).reshape(8, 1001)
    np.testing.assert_array_equal(execute(s, x), np.broadcast_to(x.sum(0), x.shape))
    with pytest.raises(PlanError, match="all-reduce algorithm"):
        plan(t, "broadcast", algorithm="ring")
    with pytest.raises(PlanError, match="two or more nodes"):
        plan(t, "allreduce", algorithm="hierarchical")
    with pytest.raises(PlanError, match="unknown algorithm"):
        plan(t, "allreduce", algorithm="magic")
    multi = PRESETS["dgx1v-4node"]()
    devs = [g for g in multi.gpus if g % 8 < 2]  # two GPUs per node
    hier = plan(multi, "allreduce", devices=devs, algorithm="hierarchical")
    assert hier.algorithm == "hierarchical"
    s = build_schedule(hier, 999)
    x = np.arange(len(devs) * 999).reshape(len(devs), 999)
    np.testing.assert_array_equal(execute(s, x), np.broadcast_to(x.sum(0), x.shape))


def test_relays_reach_maxflow_over_relay_graph_and_schedule_refuses():
    from jax_blink.errors import ScheduleError
    from jax_blink.schedule import build_schedule
    from jax_blink.simulate import simulate

    t = PRESETS["dgx1v-nvlink"]()
    direct = plan(t, "broadcast", devices=[0, 1], root=0)
    p = plan(t, "broadcast", devices=[0, 1], root=0, relays=[2, 3])
    g = t.subset([0, 1, 2, 3]).graph
    ref = nx.maximum_flow_value(g, 0, 1, capacity="bandwidth_gbps")
    assert direct.rate_gbps == pytest.approx(V2)
    assert ref == pytest.approx(4 * V2)  # 0->1, 0->2->1, 0=3 (double link) ->1 and ->2->1
    assert p.rate_gbps == pytest.approx(ref, rel=1e-6) and p.bound_gbps == pytest.approx(ref, rel=1e-6)
    assert p.relays == (2, 3) and any(x in (2, 3) for tr in p.trees for r in tr.routes() for x in r[1:-1])
    for tr in p.trees:  # relay GPUs are route hops, never tree nodes
        assert tr.gpu_parents() == {1: 0}
    for (u, v), load in p.link_loads().items():
        assert load <= t.graph.edges[u, v]["bandwidth_gbps"] + TOL
    assert Plan.from_json(p.to_json()).to_json() == p.to_json()
    with pytest.raises(ScheduleError, match="relay GPUs"):
        build_schedule(p, 1000)
    sim = simulate(p, 1e9, topology=t)
    assert 0.8 * ref < sim.algbw_gbps <= ref + TOL
    assert plan(t, "broadcast", devices=[0, 1], root=0, relays="gpus").rate_gbps == pytest.approx(
        nx.maximum_flow_value(t.graph, 0, 1, capacity="bandwidth_gbps"), rel=1e-6)
    with pytest.raises(PlanError, match="job devices"):
        plan(t, "broadcast", devices=[0, 1], relays=[1])
    with pytest.raises(PlanError, match="not GPUs"):
        plan(t, "broadcast", devices=[0, 1], relays=[42])
    with pytest.raises(PlanError, match="tree packings only"):
        plan(t, "allreduce", devices=[0, 1], relays=[2], algorithm="ring")


def test_rate_tolerance_drops_light_trees_within_tolerance():
    t = PRESETS["dgx1v"]()
    exact = plan(t, "broadcast", root=0)
    loose = plan(t, "broadcast", root=0, rate_tolerance=0.05)
    assert exact.rate_gbps == pytest.approx(exact.bound_gbps, rel=1e-9)
    assert len(loose.trees) < len(exact.trees)
    assert exact.rate_gbps * 0.95 - TOL <= loose.rate_gbps <= exact.rate_gbps + TOL
    assert any("rate_tolerance" in n for n in loose.notes)
    check_plan(t, loose)
    with pytest.raises(PlanError, match="rate_tolerance"):
        plan(t, "broadcast", rate_tolerance=1.0)


def test_bounds_with_fractional_rates_use_the_exact_networkx_max_flow():
    """Rates that are not whole MB/s (a probed topology) take networkx's max-flow path, not scipy's
    integral one; the values equal a direct networkx max-flow."""
    import networkx as nx

    from jax_blink.planner import bounds
    t = Topology("fractional")
    for g in range(3):
        t.add_gpu(g)
    t.add_link(0, 1, 1.23456789, "nvlink")
    t.add_link(1, 2, 2.3456789, "nvlink")
    t.add_link(0, 2, 0.3456789, "pcie")
    g = t.subset([0, 1, 2]).graph
    flow = lambda s, d: nx.maximum_flow_value(g, s, d, capacity="bandwidth_gbps")  # noqa: E731
    assert bounds.broadcast_bound(t, [0, 1, 2], 0) == pytest.approx(min(flow(0, 1), flow(0, 2)), rel=1e-12)
    assert bounds.allreduce_bound(t, [0, 1, 2]) == pytest.approx(
        min(flow(u, v) for u in range(3) for v in range(3) if u != v), rel=1e-12)


def test_ring_plans_honour_max_trees():
    """algorithm="ring" with max_trees=k: at most k // n rings (each runs as n trees), the best total
    found, never less than with a smaller k; fewer than n trees allow no ring (a clear error)."""
    t = PRESETS["dgx1v"]()
    full = plan(t, "allreduce", algorithm="ring")
    assert len(full.rings()) == 36
    last = 0.0
    for k in (8, 16, 24, 64, 128, 287, 288):
        p = plan(t, "allreduce", algorithm="ring", max_trees=k)
        assert p.algorithm == "ring" and len(p.rings()) <= k // 8 and len(p.trees) <= k
        assert last - 1e-6 <= p.rate_gbps <= full.rate_gbps + 1e-6
        last = p.rate_gbps
    assert plan(t, "allreduce", algorithm="ring", max_trees=8).rate_gbps == pytest.approx(8 * 45.8 / 14)  # 0-3 x2
    assert plan(t, "allreduce", algorithm="ring", max_trees=288).rate_gbps == pytest.approx(full.rate_gbps)
    ag = plan(t, "allgather", devices=[0, 1, 2, 3], algorithm="ring", max_trees=4)
    assert len(ag.rings()) == 1 and len(ag.trees) == 4
    with pytest.raises(PlanError, match=r"max_trees=5 allows no ring; use max_trees >= 8"):
        plan(t, "allreduce", algorithm="ring", max_trees=5)
