"""All-reduce over identical nodes planned by symmetry (jax_blink/planner/symmetric.py): the structure
(jax_blink/topology/symmetry.py), the exact bound against the flat LP certificate, valid executable
plans, the rsag cut bounds."""

import pickle

import numpy as np
import pytest

import jax_blink
from jax_blink.planner import bounds, symmetric
from jax_blink.planner.trees import flat_plan
from jax_blink.schedule import build_schedule, execute
from jax_blink.topology import symmetry
from jax_blink.topology.presets import multi_node


def _loads_within_capacity(plan, topo):
    for e, load in plan.link_loads().items():
        assert load <= topo.graph.edges[e]["bandwidth_gbps"] * (1 + 1e-6), (e, load)


def test_structure_of_identical_nodes_and_none_otherwise():
    topo = multi_node("dgx1v", 3, 12.5, 2)
    st = symmetry.node_structure(topo, tuple(topo.gpus))
    assert st is not None and st.n_nodes == 3
    assert st.groups == (tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 24)))
    assert st.maps[2][0] == 16 and st.maps[2]["n0-nic1"] == "n2-nic1"
    assert symmetry.node_structure(topo, tuple(range(8))) is None  # one node
    # the same two GPU positions of every node: still identical nodes
    part = (0, 1, 8, 9, 16, 17)
    assert symmetry.node_structure(topo, part).groups == ((0, 1), (8, 9), (16, 17))
    assert symmetry.node_structure(topo, (0, 1, 8, 9, 10)) is None  # 2 GPUs vs 3
    slower = multi_node("dgx1v", 3, 12.5, 2)
    slower.graph.edges[8, 9]["bandwidth_gbps"] /= 2  # node 1 differs from node 0
    assert symmetry.node_structure(slower, tuple(slower.gpus)) is None
    assert symmetry.node_structure(jax_blink.Topology.preset("dgx1v"), tuple(range(8))) is None


@pytest.mark.parametrize("node, n, nics", [("dgx1v", 3, 1), ("dgx1v", 2, 4), ("pcie-2socket", 2, 2)])
def test_symmetric_bound_is_the_flat_lp_certificate(node, n, nics):
    """The symmetric LP's dual (one node's links) equals the flat LP's optimum over all GPUs, and the
    composed plan reaches it."""
    topo = multi_node(node, n, 12.5, nics)
    devs = tuple(topo.gpus)
    flat = flat_plan(topo, "allreduce", devs, None, None, "trees")
    st = symmetry.node_structure(topo, devs)
    p = symmetric.symmetric_plan(topo, devs, st)
    assert p.bound_gbps == pytest.approx(flat.bound_gbps, rel=1e-6)
    assert p.rate_gbps == pytest.approx(flat.rate_gbps, rel=1e-6)
    assert p.rate_gbps == pytest.approx(p.bound_gbps, rel=1e-6)
    assert symmetric.exact_allreduce_bound(st) == pytest.approx(flat.bound_gbps, rel=1e-6)
    _loads_within_capacity(p, topo)


def test_nic_bound_formula_at_many_nodes():
    """N nodes with one NIC of C GB/s: any tree crosses the node cuts 2(N-1) times, so the optimum is
    N C / (2 (N-1)) (the NIC binds on dgx1v); the symmetric plan at 32 nodes meets it."""
    topo = multi_node("dgx1v", 32, 12.5, 1)
    p = jax_blink.plan(topo, "allreduce", algorithm="trees")
    assert p.bound_gbps == pytest.approx(32 * 12.5 / 62, rel=1e-6)
    assert p.rate_gbps == pytest.approx(p.bound_gbps, rel=1e-6)
    _loads_within_capacity(p, topo)


@pytest.mark.parametrize("node, n, nics", [("dgx1v", 3, 2), ("dgx-h100", 2, 8), ("pcie-2socket", 3, 2)])
def test_composed_plans_execute_and_meet_their_bounds(node, n, nics):
    topo = multi_node(node, n, 12.5, nics)
    x = np.random.default_rng(0).standard_normal((len(topo.gpus), 257))
    for alg in ("trees", "hierarchical", "rsag"):
        p = jax_blink.plan(topo, "allreduce", algorithm=alg)
        assert p.algorithm == alg
        _loads_within_capacity(p, topo)
        assert p.rate_gbps <= p.bound_gbps * (1 + 1e-9)
        assert p.rate_gbps == pytest.approx(p.bound_gbps, rel=1e-6), p.notes
        out = execute(build_schedule(p, 257), x)
        np.testing.assert_allclose(out, np.broadcast_to(x.sum(0), out.shape), rtol=1e-12, atol=1e-12)
    hier = jax_blink.plan(topo, "allreduce", algorithm="hierarchical")
    assert "below the exact flat bound" in hier.notes[0]


def test_sharded_bounds_match_the_flat_cut_bounds():
    topo = multi_node("dgx1v", 2, 12.5, 2)
    st = symmetry.node_structure(topo, tuple(topo.gpus))
    rs, ag = symmetric.sharded_bounds(st)
    assert ag == pytest.approx(bounds.allgather_bound(topo, topo.gpus), rel=1e-9)
    assert rs == pytest.approx(bounds.reducescatter_bound(topo, topo.gpus), rel=1e-9)


def test_composed_trees_are_built_on_use():
    """A composed plan's trees are built when iterated (not to plan or rank it); its flow-level time from
    one tree per shape equals the time over the built trees; the built trees are the plan's."""
    from jax_blink.planner.model import ComposedTrees
    from jax_blink.simulate import flow_time

    topo = multi_node("dgx1v", 3, 12.5, 2)
    for alg in ("trees", "hierarchical", "rsag"):
        jax_blink.clear_caches()
        p = jax_blink.plan(topo, "allreduce", algorithm=alg)
        assert isinstance(p.trees, ComposedTrees) and p.trees._trees is None
        t = flow_time(p, 1 << 20, topo)
        assert p.trees._trees is None and len(p.trees) == len(p.trees.pieces) > 3
        built = tuple(p.trees)
        assert [(x.weight_gbps, x.root) for x in built] == [q[:2] for q in p.trees.pieces]
        jax_blink.clear_caches()  # flow metrics from the built trees, each walked
        flat = p.__class__(**{**p.__dict__, "trees": built})
        assert flow_time(flat, 1 << 20, topo) == pytest.approx(t, rel=1e-12)
        assert flat == p and hash(p) == hash(p) and p.trees == built
        assert pickle.loads(pickle.dumps(p)) == p  # pickles with its trees built (a plain tuple)


def test_one_gpu_per_node():
    """A cross-node mesh axis (one GPU of each node, as distributed meshes have): no intra-node phase."""
    topo = multi_node(jax_blink.Topology.host(4), 3, 12.5, 1)
    x = np.arange(3 * 50.0).reshape(3, 50)
    for alg in ("trees", "hierarchical", "rsag"):
        p = jax_blink.plan(topo, "allreduce", devices=[1, 5, 9], algorithm=alg)
        assert p.rate_gbps == pytest.approx(3 * 12.5 / 4, rel=1e-6) == pytest.approx(p.bound_gbps, rel=1e-6)
        np.testing.assert_allclose(execute(build_schedule(p, 50), x), np.broadcast_to(x.sum(0), x.shape))


def _pieces_by_loops(n, cols, weights):
    """The cut of symmetric._pieces written as its definition: every (cut k, column i) pair."""
    groups = {}
    for j, col in enumerate(cols):
        if weights[j] > 1e-12:
            groups.setdefault((col.attach[0], len(col.attach)), []).append(j)
    out = []
    for js in groups.values():
        total = float(sum(weights[j] for j in js))
        edges = np.cumsum([0.0] + [float(weights[j]) for j in js])
        for k in range(n):
            lo, hi = total * k / n, total * (k + 1) / n
            for i, j in enumerate(js):
                a, b = max(lo, edges[i]), min(hi, edges[i + 1])
                if b - a > 1e-12:
                    out.append((j, k, float(np.floor((b - a) * 1e9 + 1e-6) / 1e9)))
    return out


def test_pieces_cut_equals_every_pair_definition():
    """The vectorised cut (only the columns each cut overlaps) gives exactly the pieces of the
    all-pairs definition, tiny and zero weights, one node and 128 included; and the pieces of each
    group sum to its columns' weight."""
    import random

    class Col:
        def __init__(self, attach):
            self.attach = attach

    rng = random.Random(7)
    for _ in range(500):
        m, n = rng.randint(1, 12), rng.choice([1, 2, 3, 8, 128])
        cols = [Col(((rng.randint(0, 2), ()),) * rng.randint(1, 2)) for _ in range(m)]
        weights = [rng.choice([0.0, 1e-13, 1 / 3, 12.5, rng.random() * 50]) for _ in range(m)]
        got = symmetric._pieces(n, cols, weights)
        assert got == _pieces_by_loops(n, cols, weights), (n, weights)
        for j in range(m):
            if weights[j] > 1e-12:
                assert sum(w for jj, _, w in got if jj == j) == pytest.approx(weights[j], abs=1e-8 * n)


def test_stored_structure_hop_check_covers_every_node():
    """check(hops) of a stored structure passes on the topology it was made of and names the link of
    the node where a hop is missing or slower (node 2 of 3 here), both directions of a hop checked."""
    topo = multi_node("dgx1v", 3, 12.5, 1)
    devs = tuple(topo.gpus)
    st = symmetry.node_structure(topo, devs)
    enc = symmetric.encode_structure(st)
    nic = next(v for v in st.template.graph.successors(st.x_id))
    _, check = symmetric.stored_structure(topo, devs, topo.fingerprint(), enc)
    check({(0, 1), (st.x_id, nic)})
    slow = multi_node("dgx1v", 3, 12.5, 1)
    slow.graph.edges[17, 16]["bandwidth_gbps"] /= 2  # node 2's 0 <- 1 link, one direction
    _, check = symmetric.stored_structure(slow, devs, slow.fingerprint(), enc)
    check({(0, 2)})
    with pytest.raises(jax_blink.PlanError, match="17->16"):
        check({(0, 1)})
    gone = multi_node("dgx1v", 3, 12.5, 1)
    gone.graph.remove_edge(8, 9)  # node 1's 0 -> 1
    _, check = symmetric.stored_structure(gone, devs, gone.fingerprint(), enc)
    with pytest.raises(jax_blink.PlanError, match="8->9"):
        check({(1, 0)})
