"""The native link-level event model (ffi/src/linksim.cc, with the array form of a plan's messages:
simulate.events._tiled_arrays) against the Python reference (simulate.messages._plan_messages /
_schedule_messages and simulate.events._run): every float of every result bitwise equal, on presets,
topology files (host staging without peer access included), clusters, every collective, schedules in
round and free-running order, and rsag / hierarchical plans; and the native model's own input checks."""

import pathlib

import numpy as np
import pytest

from jax_blink import costmodel
from jax_blink import simulate as sim
from jax_blink._native import linksim
from jax_blink.errors import ScheduleError
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule
from jax_blink.simulate import events
from jax_blink.topology.load import load_topology
from jax_blink.topology.presets import multi_node

DATA = pathlib.Path(__file__).parent / "data" / "topologies"
pytestmark = pytest.mark.skipif(linksim is None, reason="the native _linksim module is not built")


def _both(monkeypatch, *args, **kw):
    native = sim.simulate(*args, **kw)
    with monkeypatch.context() as m:
        m.setattr(events, "_native_linksim", None)
        ref = sim.simulate(*args, **kw)
    return native, ref


def _same(native, ref):
    assert native.time_s == ref.time_s  # bitwise: the same events in the same order
    assert native.messages == ref.messages
    assert list(native.link_bytes.items()) == list(ref.link_bytes.items())
    assert native.link_util == ref.link_util


CASES = [("dgx1v", "allreduce"), ("dgx1v", "broadcast"), ("dgx1v", "reduce"), ("dgx1v", "allgather"),
         ("dgx1v", "reducescatter"), ("dgx1p", "allreduce"), ("dgx-a100", "allreduce"),
         (str(DATA / "two_gpus_pix_no_p2p.txt"), "allreduce"), (str(DATA / "pcie_2socket_4switch.txt"), "allreduce"),
         (str(DATA / "a100_pcie_nvlink_pairs.txt"), "allgather")]


@pytest.mark.parametrize("source,collective", CASES, ids=lambda s: pathlib.Path(str(s)).stem)
def test_plans_simulate_bitwise_as_the_reference(monkeypatch, source, collective):
    topo = load_topology(source)
    root = topo.gpus[0] if collective in ("broadcast", "reduce") else None
    p = plan(topo, collective, root=root)
    for nbytes in (64 << 10, 4 << 20, 256 << 20):
        for kw in ({}, {"peer_routes": True}, {"protocol_latency_us": 0.3, "latency_us": 0.0}):
            _same(*_both(monkeypatch, p, nbytes, topology=topo, method="link", **kw))


@pytest.mark.parametrize("node,nodes,nics,nbytes", [("dgx-h100", 2, 8, 256 << 20), ("pcie-2socket", 4, 2, 64 << 10),
                                                     ("dgx1v", 2, 4, 1 << 20)])
def test_cluster_candidates_simulate_bitwise_as_the_reference(monkeypatch, node, nodes, nics, nbytes):
    topo = multi_node(node, nodes, 12.5, nics)
    cands = costmodel.candidate_plans(topo, "allreduce")
    assert len(cands) >= 2
    for p in cands:
        _same(*_both(monkeypatch, p, nbytes, topology=topo, method="link"))


@pytest.mark.parametrize("free_running", [False, True])
def test_schedules_simulate_bitwise_as_the_reference(monkeypatch, free_running):
    topo = load_topology("dgx1v")
    p = plan(topo, "allreduce")
    s = build_schedule(p, 1 << 18, step_latency_s=2e-6)
    _same(*_both(monkeypatch, s, 1 << 20, topology=topo, free_running=free_running))


def test_native_model_checks_its_input():
    one = np.ones(1)
    ptr = np.array([0, 1], dtype=np.int64)
    edge = np.zeros(1, dtype=np.int32)
    none = np.zeros(0, dtype=np.int64)
    rank = np.zeros(1, dtype=np.int64)
    end, busy, carried, first, done = linksim.run(one * 8, one * 0, ptr, edge, np.array([0, 0]), none, rank,
                                                  one * 4, 1.0)
    assert (end, busy, carried, first, done) == (3.0, [2.0], [8.0], [0], 1)  # 8 B at 4 B/s, then 1 s latency
    with pytest.raises(ValueError, match="crosses no link"):
        linksim.run(one, one, ptr, np.array([3], dtype=np.int32), np.array([0, 0]), none, rank, one, 0.0)
    with pytest.raises(ValueError, match="no positive bandwidth"):
        linksim.run(one, one, ptr, edge, np.array([0, 0]), none, rank, one * 0, 0.0)
    with pytest.raises(ValueError, match="permutation"):
        linksim.run(one, one, ptr, edge, np.array([0, 0]), none, rank + 5, one, 0.0)
    with pytest.raises(ValueError, match="n \\+ 1"):
        linksim.run(one, one, ptr[:1], edge, np.array([0, 0]), none, rank, one, 0.0)


def test_a_dependency_cycle_is_an_error_not_a_hang():
    from jax_blink.simulate.events import _run_any
    from jax_blink.simulate.messages import _Msg
    topo = load_topology("dgx1v")
    msgs = [_Msg(8.0, ((0, 1),), [1], (0.0, 0)), _Msg(8.0, ((1, 0),), [0], (0.0, 1))]
    for native in (linksim, None):
        events._native_linksim = native
        try:
            with pytest.raises(ScheduleError, match="2 transfers never became ready"):
                _run_any(msgs, topo, 1e-6)
        finally:
            events._native_linksim = linksim


def test_random_message_graphs_run_bitwise_as_the_reference():
    """Random messages on a 4-GPU ring (zero-byte sends, equal sizes that tie, zero latency, several
    dependencies, priorities with ties): the native loop's finish time and per-link busy time and
    bytes, in first-service order, equal the Python event loop's."""
    from jax_blink.simulate.events import _run, _run_any
    from jax_blink.simulate.messages import _Msg
    from jax_blink.topology import Topology
    topo = Topology("ring4")
    for g in range(4):
        topo.add_gpu(g)
    for g in range(4):
        topo.add_link(g, (g + 1) % 4, 10.0 + g, "nvlink")
        topo.add_link((g + 1) % 4, g, 10.0 + g, "nvlink")
    links = sorted(topo.graph.edges)
    rng = np.random.default_rng(7)
    for case in range(200):
        n = int(rng.integers(1, 120))
        msgs = []
        for i in range(n):
            hops = tuple(links[j] for j in rng.integers(0, len(links), int(rng.integers(1, 4))))
            deps = sorted(set(rng.integers(0, i, int(rng.integers(0, 3))).tolist())) if i else []
            size = float(rng.choice([0.0, 1e3, 1e3, 4e3]))  # ties on purpose
            msgs.append(_Msg(size, hops, deps, (float(rng.integers(0, 4)) / 4, i), float(rng.choice([0.0, 1e-7]))))
        latency = float(rng.choice([0.0, 1e-6]))
        ref = _run(msgs, topo, latency)
        nat = _run_any(msgs, topo, latency)
        assert nat[0] == ref[0], case
        assert list(nat[1].items()) == list(ref[1].items()), case
        assert list(nat[2].items()) == list(ref[2].items()), case
