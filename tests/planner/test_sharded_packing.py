"""All-gather / reduce-scatter packings (ForestColl, Zhao et al. 2024): the rate reaches the exact cut
bound, the bound matches brute force over node subsets, the trees are valid arborescences with equal
per-root weight, reduce-scatter is the reversal, ring variants and bad input."""

import collections
import itertools
import pathlib

import networkx as nx
import numpy as np
import pytest

from jax_blink.errors import PlanError
from jax_blink.planner import bounds, rings
from jax_blink.planner.model import Plan
from jax_blink.planner.rings import nccl_ring_plan, ring_plan
from jax_blink.planning import plan
from jax_blink.topology import Topology
from jax_blink.topology.load import load_topology
from jax_blink.topology.presets import EDR_IB_GBPS, NVLINK_EFFICIENCY, NVLINK_GBPS, PRESETS

NVLINK2 = NVLINK_GBPS * NVLINK_EFFICIENCY[2]  # one V100 NVLink, achieved GB/s per direction

TOL = 1e-6
FILES = sorted(str(p) for p in (pathlib.Path(__file__).parents[1] / "data" / "topologies").glob("*")
               if p.suffix in (".txt", ".xml"))
SHARDED = ("allgather", "reducescatter")


def reversed_topology(t: Topology) -> Topology:
    """``t`` with every link turned around (reduce-scatter on t = all-gather on this)."""
    r = Topology(f"{t.name}:reversed")
    r.graph = t.graph.reverse(copy=True)
    return r


def brute_force_cut(topology, devices, reverse=False):
    """min over node sets T of the job graph holding some but not all ranks of n B_out(T) / |T & ranks|."""
    g = topology.subset(devices).graph
    if reverse:
        g = g.reverse(copy=True)
    nodes, ranks, n = list(g), set(devices), len(devices)
    best = np.inf
    for k in range(1, len(nodes)):
        for t_set in itertools.combinations(nodes, k):
            s = set(t_set)
            inside = len(s & ranks)
            if 0 < inside < n:
                out = sum(d["bandwidth_gbps"] for a, b, d in g.edges(data=True) if a in s and b not in s)
                best = min(best, n * out / inside)
    return best


def check_sharded_plan(topology, p):
    """Trees are arborescences spanning the ranks from their root over switch-only routes, every rank
    roots trees of total weight rate / n, and no link is overloaded (reduce-scatter: reversed links)."""
    g = topology.graph
    devs = set(p.devices)
    n = len(devs)
    assert p.root is None and p.collective in SHARDED
    assert p.rate_gbps == pytest.approx(sum(t.weight_gbps for t in p.trees), abs=1e-6)
    per_root = collections.Counter()
    for t in p.trees:
        assert t.weight_gbps > 0 and t.reduce_edges is None
        per_root[t.root] += t.weight_gbps
        for r in t.routes():
            assert r[0] in devs and r[-1] in devs
            assert all(g.nodes[x]["kind"] != "gpu" for x in r[1:-1]), r
            for a, b in zip(r, r[1:]):  # all-gather sends a->b, reduce-scatter b->a
                assert g.has_edge(a, b) if p.collective == "allgather" else g.has_edge(b, a), (a, b)
        par = t.gpu_parents()
        assert set(par) == devs - {t.root}
        h = nx.DiGraph([(pp, c) for c, pp in par.items()])
        h.add_nodes_from(devs)
        assert nx.is_arborescence(h) and all(nx.has_path(h, t.root, v) for v in devs)
    assert set(per_root) == devs
    for d, w in per_root.items():
        assert w == pytest.approx(p.rate_gbps / n, rel=1e-6), (d, dict(per_root))
    for (u, v), load in p.link_loads().items():
        assert load <= g.edges[u, v]["bandwidth_gbps"] + TOL, ((u, v), load)


def check_optimal(topology, devices=None):
    for coll in SHARDED:
        p = plan(topology, coll, devices=devices)
        check_sharded_plan(topology, p)
        assert p.rate_gbps == pytest.approx(p.bound_gbps, rel=TOL), (coll, p.rate_gbps, p.bound_gbps)
        exact = (bounds.allgather_bound if coll == "allgather" else bounds.reducescatter_bound)(
            topology, p.devices)
        assert p.bound_gbps == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "dgx1v-4node"])
def test_presets_reach_cut_bound(name):
    check_optimal(PRESETS[name]())


def test_multi_node_preset_reaches_cut_bound():
    t = PRESETS["dgx1v-4node"]()
    p = plan(t, "allgather")
    check_sharded_plan(t, p)
    # four nodes behind one EDR NIC each (12.5 GB/s line rate x 0.96 achieved): the binding cut is
    # three nodes plus the network switch, whose 24 shards leave only through the fourth node's NIC
    assert p.rate_gbps == pytest.approx(32 * EDR_IB_GBPS / 24, rel=TOL)
    assert p.bound_gbps == pytest.approx(p.rate_gbps, rel=TOL)


@pytest.mark.parametrize("source", FILES, ids=lambda s: pathlib.Path(s).name)
def test_topology_files_reach_cut_bound(source):
    check_optimal(load_topology(source))


FRAGMENTS = [("dgx1v", [0, 1, 2, 3]), ("dgx1v", [0, 1, 4, 5]), ("dgx1v", [0, 2, 5, 7]),
             ("dgx1v", [1, 2, 3, 6, 7]), ("dgx1v", [0, 1, 2, 3, 4, 5]), ("dgx1v-nvlink", [0, 4, 6]),
             ("dgx1p", [0, 1, 5]), ("pcie-2socket", [0, 2, 5]), ("pcie-2socket", [0, 1, 2, 3, 4, 6]),
             ("dgx2", [0, 3, 7, 9, 12])]


@pytest.mark.parametrize("name,devices", FRAGMENTS, ids=lambda x: str(x))
def test_fragments_reach_cut_bound(name, devices):
    check_optimal(PRESETS[name](), devices)


def test_file_fragments_reach_cut_bound():
    for source, devices in [(FILES[0], [0, 1, 2]), (FILES[0], [1, 2, 5, 6])]:
        check_optimal(load_topology(source), devices)


def _random_topology(seed: int) -> Topology:
    """4-6 GPUs with random asymmetric direct links, sometimes a PCIe switch joining some of them."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 7))
    t = Topology(f"random{seed}")
    for i in range(n):
        t.add_gpu(i)
    for u, v in itertools.permutations(range(n), 2):
        if rng.random() < 0.45:
            t.add_link(u, v, float(rng.choice([5.0, 10.0, 25.0])), "nvlink", bidirectional=False)
    if rng.random() < 0.6:
        t.add_switch("sw", "pcie-switch")
        for i in range(n):
            if rng.random() < 0.7:
                t.add_link(i, "sw", float(rng.choice([8.0, 12.0])), "pcie")
    return t


def _connected(t: Topology) -> bool:
    g = t.graph
    return all(nx.has_path(g, u, v) for u in t.gpus for v in t.gpus if u != v)


def test_cut_bound_matches_brute_force_on_small_topologies():
    cases = [(PRESETS["dgx1v-nvlink"](), None), (PRESETS["dgx1p-nvlink"](), None), (PRESETS["dgx-a100"](), None),
             (PRESETS["dgx1v"](), [0, 1, 2, 3]), (PRESETS["dgx1v"](), [0, 3, 5]),
             (PRESETS["pcie-2socket"](), [0, 1, 2, 4]), (load_topology(FILES[0]), [0, 1, 2])]
    cases += [(t, None) for t in map(_random_topology, range(40)) if _connected(t)]
    assert len(cases) > 20
    checked = 0
    for t, devices in cases:
        devices = list(t.gpus if devices is None else devices)
        if t.subset(devices).graph.number_of_nodes() > 12:
            continue
        checked += 1
        for reverse in (False, True):
            want = brute_force_cut(t, devices, reverse)
            got = (bounds.reducescatter_bound if reverse else bounds.allgather_bound)(t, devices)
            assert got == pytest.approx(want, rel=1e-12), (t.name, devices, reverse)
        x, t_set = bounds.sharded_cut(t, devices)
        assert 0 < len(t_set & set(devices)) < len(devices)
    assert checked >= 20


def test_random_asymmetric_topologies_plan_optimally_and_reducescatter_is_the_reversal():
    done = 0
    for seed in range(40):
        t = _random_topology(seed)
        if not _connected(t):
            continue
        done += 1
        check_optimal(t)
        rs = plan(t, "reducescatter")
        ag_rev = plan(reversed_topology(t), "allgather")
        assert rs.bound_gbps == pytest.approx(ag_rev.bound_gbps, rel=1e-9)
        # reduce-scatter's link loads are all-gather's on the same trees, links turned around
        for tree in rs.trees:
            rev = collections.Counter({(b, a): k for (a, b), k in tree.link_usage("allgather").items()})
            assert tree.link_usage("reducescatter") == rev
    assert done >= 15


def test_asymmetric_links_differ_between_allgather_and_reducescatter():
    # GPU 0 sends 20 GB/s to each of 1, 2 but receives only 5 from each; 1 <-> 2 at 20 both ways
    t = Topology("asym")
    for i in range(3):
        t.add_gpu(i)
    for u, v, c in [(0, 1, 20.0), (0, 2, 20.0), (1, 0, 5.0), (2, 0, 5.0), (1, 2, 20.0), (2, 1, 20.0)]:
        t.add_link(u, v, c, "nvlink", bidirectional=False)
    ag, rs = plan(t, "allgather"), plan(t, "reducescatter")
    # all-gather: GPU 0 must receive two shards over 10 GB/s in total: x = 5, rate 3 * 5
    assert ag.rate_gbps == pytest.approx(15.0, rel=TOL)
    # reduce-scatter: shard 0 enters GPU 0 over 10 GB/s (x <= 10); T = {0, 2} takes in 25 for two
    # shards (12.5 each): x = 10, rate 30
    assert rs.rate_gbps == pytest.approx(30.0, rel=TOL)
    assert brute_force_cut(t, [0, 1, 2]) == pytest.approx(15.0)
    assert brute_force_cut(t, [0, 1, 2], reverse=True) == pytest.approx(30.0)
    check_sharded_plan(t, ag)
    check_sharded_plan(t, rs)


def test_unbalanced_switch_bound_is_an_upper_bound():
    # a switch that cannot replicate, 10 GB/s up, 30 down: every GPU sends its shard up twice (x = 5),
    # while the cut bound (switch as an ordinary node) allows x = 10: the plan stays below it
    t = Topology("unbalanced")
    t.add_switch("sw", "pcie-switch")
    for i in range(3):
        t.add_gpu(i)
        t.add_link(i, "sw", 10.0, "pcie", bidirectional=False)
        t.add_link("sw", i, 30.0, "pcie", bidirectional=False)
    p = plan(t, "allgather")
    check_sharded_plan(t, p)
    assert p.rate_gbps == pytest.approx(15.0, rel=TOL)
    assert p.bound_gbps == pytest.approx(30.0, rel=TOL) == brute_force_cut(t, [0, 1, 2])


def test_ring_plans_for_allgather_and_reducescatter():
    t = PRESETS["dgx1v"]()
    for devices in (None, [0, 1, 2, 3, 5], [0, 1, 4, 5]):
        b_ring = rings.ring_rate(t, t.gpus if devices is None else devices)
        for coll in SHARDED:
            p = plan(t, coll, devices=devices, algorithm="ring")
            n = len(p.devices)
            assert p.algorithm == "ring" and p.shape().startswith("ring")
            check_sharded_plan(t, p)
            # each shard travels n-1 hops: rate n B / (n - 1), and never above the cut bound
            assert p.rate_gbps == pytest.approx(n * b_ring / (n - 1), rel=1e-6)
            assert p.rate_gbps <= p.bound_gbps * (1 + TOL)
            assert sum(b for _, b in p.rings()) == pytest.approx(b_ring, rel=1e-6)
            for tr in p.trees:  # chains: n-1 GPU-level edges, one child each
                assert len(tr.gpu_parents()) == n - 1
                assert len(set(tr.gpu_parents().values())) == n - 1
            assert ring_plan(t, coll, devices=devices).trees == p.trees
            nccl = nccl_ring_plan(t, coll, devices=devices)
            check_sharded_plan(t, nccl)
            assert nccl.rate_gbps <= p.rate_gbps * (1 + TOL)
    # fragment with no NVLink ring: NCCL's rings run over PCIe, far below the tree packing
    frag = [0, 1, 2, 5]
    nccl = nccl_ring_plan(t, "allgather", devices=frag)
    assert "pcie links" in nccl.notes[0]
    assert plan(t, "allgather", devices=frag).rate_gbps > 2 * nccl.rate_gbps


@pytest.mark.slow
def test_max_trees_and_tree_count():
    t = PRESETS["dgx1v"]()
    full = plan(t, "allgather")
    for k in (8, 12):
        p = plan(t, "allgather", max_trees=k)
        check_sharded_plan(t, p)
        assert len(p.trees) <= k
        assert p.rate_gbps <= full.rate_gbps * (1 + TOL)
    assert plan(t, "allgather", max_trees=12).rate_gbps >= plan(t, "allgather", max_trees=8).rate_gbps - TOL
    with pytest.raises(PlanError, match="at least one tree per rank"):
        plan(t, "allgather", max_trees=7)
    tol = plan(t, "allgather", rate_tolerance=0.2)
    check_sharded_plan(t, tol)
    assert tol.rate_gbps >= 0.8 * full.rate_gbps - TOL and len(tol.trees) <= len(full.trees)


def test_bad_input_and_trivial_and_json():
    t = PRESETS["dgx1v"]()
    with pytest.raises(PlanError, match="has no root"):
        plan(t, "allgather", root=0)
    with pytest.raises(PlanError, match="hierarchical"):
        plan(t, "reducescatter", algorithm="hierarchical")
    one = plan(t, "allgather", devices=[3])
    assert one.algorithm == "trivial" and one.trees == ()
    p = plan(t, "reducescatter", devices=[0, 1, 2])
    assert Plan.from_json(p.to_json()) == p
    assert p.predicted_time_s(1e9) == pytest.approx(1.0 / p.rate_gbps)


def test_relay_gpus_forward_allgather_and_reducescatter_up_to_the_relay_cut_bound():
    t = PRESETS["dgx1v-nvlink"]()
    for coll in SHARDED:
        direct = plan(t, coll, devices=[0, 1, 2])
        relayed = plan(t, coll, devices=[0, 1, 2], relays="gpus")
        # every GPU takes in 6 NVLinks x 22.9 GB/s (achieved); two shards enter each: x = 3 links'
        # worth, rate 9 links' worth
        assert relayed.rate_gbps == pytest.approx(9 * NVLINK2, rel=TOL) == relayed.bound_gbps
        assert relayed.bound_gbps == pytest.approx(
            (bounds.allgather_bound if coll == "allgather" else bounds.reducescatter_bound)(
                t, [0, 1, 2], relays=[3, 4, 5, 6, 7]), rel=1e-9)
        assert direct.rate_gbps == pytest.approx(3 * NVLINK2, rel=TOL) and relayed.relays
