"""jax_blink.probe: measured topologies (Blink section 3) on the 8 host CPU devices.

CPU devices measure memory copies, so the numbers say nothing about a GPU machine: the tests check
the mechanics (the shape of the result, positive finite GB/s, the model built from hand-made
measurements), that the planner and psum accept the result, and the JAX_BLINK_TOPOLOGY=probe path.
Probe sizes are a few KiB so each probe takes about a second.
"""

import importlib
import json
import math
import re

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import mapping
from jax_blink.cli import main
from jax_blink.topology import LINK_KINDS

probe = importlib.import_module("jax_blink.topology.probe")  # the module; jax_blink.probe is its function
SMALL = dict(sizes=(4096, 65536), repeats=1, max_pair_tests=6)


@pytest.fixture(scope="module")
def probed():
    return probe.probe(**SMALL, label="host8")


def test_probe_shape_positive_finite_and_every_pair_reachable(probed):
    assert probed.gpus == list(range(8))
    assert probed.name == "probe-cpu8"
    links = probed.links()
    assert links and all(0 < bw < math.inf and kind in LINK_KINDS for _, _, bw, kind, _ in links)
    if not probed.switches:  # no shared link seen: one direct link per ordered pair
        assert {(u, v) for u, v, *_ in links} == {(i, j) for i in range(8) for j in range(8) if i != j}
    else:
        assert all(s.startswith("probe-") for s in probed.switches)
    for i in range(8):
        for j in range(8):
            if i != j:
                assert nx.maximum_flow_value(probed.graph, i, j, capacity="bandwidth_gbps") > 0
    (note,) = [n for n in probed.notes if n.startswith("probed 8 cpu devices")]
    assert "copies of 4 KiB, 64 KiB (capacities at 64 KiB, fastest of 1)" in note
    assert re.search(r"median one-way GB/s by size: 4 KiB [\d.e+-]+, 64 KiB [\d.e+-]+$", note), note
    assert any("labelled topology 'host8'" in n for n in probed.notes)


def test_planner_and_psum_accept_the_probed_topology(probed):
    p = jax_blink.plan(probed, "allreduce")
    assert p.devices == tuple(range(8)) and p.rate_gbps > 0 and math.isfinite(p.rate_gbps)
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    x = jnp.arange(8 * 5, dtype=jnp.float32)
    f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "d", topology=probed), mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    g = jax.jit(jax.shard_map(lambda v: lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(g(x)))


def _measurement(one, both=None, shared=(), ring=None, concurrent=None, n=4):
    gpus = list(range(n))
    pairs = [(i, j) for i in gpus for j in gpus if i != j]
    one_way = {p: one(*p) for p in pairs}
    return probe.Measurement(gpus=gpus, one_way=one_way, both_ways=dict(both or one_way), shared=list(shared),
                             ring=ring or {g: 1.0 for g in gpus}, concurrent=concurrent or {})


def test_no_shared_links_gives_a_direct_link_per_ordered_pair_at_the_slower_rate():
    m = _measurement(lambda i, j: 10.0 + i, both={(i, j): 8.0 + j for i in range(4) for j in range(4) if i != j})
    t = probe.build_topology(m, "cpu")
    assert t.switches == [] and len(t.links()) == 12
    assert t.bandwidth(0, 1) == 9.0   # min(one way 10, both ways 9)
    assert t.bandwidth(3, 0) == 8.0   # min(13, 8)
    assert t.kind(0) == "gpu" and t.graph.edges[0, 1]["kind"] == "host"


def test_pcie_switch_pairs_become_two_groups_sharing_an_uplink():
    """GPUs 0,1 behind one switch, 2,3 behind another: 0->2 and 1->3 halve each other."""
    local = {frozenset((0, 1)), frozenset((2, 3))}
    m = _measurement(lambda i, j: 12.0 if frozenset((i, j)) in local else 6.0,
                     shared=[((0, 2), (1, 3), 2.0), ((2, 0), (3, 1), 2.0)],
                     concurrent={((0, 2), (1, 3)): 6.0, ((2, 0), (3, 1)): 6.0, ((0, 1), (2, 3)): 24.0})
    t = probe.build_topology(m, "gpu")
    assert t.switches == ["probe-root", "probe-switch0", "probe-switch1"]
    assert t.bandwidth(0, "probe-switch0") == 12.0 and t.bandwidth(3, "probe-switch1") == 12.0
    assert t.bandwidth("probe-switch0", "probe-root") == 6.0  # what the shared uplink carried
    assert t.graph.edges[0, "probe-switch0"]["kind"] == "pcie" and t.kind("probe-switch0") == "pcie-switch"
    p = jax_blink.plan(t, "allreduce")
    assert p.rate_gbps > 0


def test_everything_shared_gives_one_hub_at_the_all_at_once_rates():
    m = _measurement(lambda i, j: 5.0, shared=[((0, 1), (2, 3), 1.8), ((0, 2), (1, 3), 1.9)],
                     ring={0: 2.0, 1: 2.5, 2: 3.0, 3: 3.5})
    t = probe.build_topology(m, "cpu")
    assert t.switches == ["probe-hub"]
    assert [t.bandwidth(g, "probe-hub") for g in range(4)] == [2.0, 2.5, 3.0, 3.5]
    assert any("0->1 with 2->3: 1.80x" in n for n in t.notes)


def test_compare_names_pairs_off_by_more_than_20_percent():
    m = _measurement(lambda i, j: 5.0 if (i, j) == (0, 1) else 10.5)
    (note,) = probe.compare(m, jax_blink.Topology.host(4, gbps=10.0))
    assert "on 1 of 12 directed pairs: 0->1: measured 5 GB/s, labelled 10 GB/s (-50%)" in note
    (ok,) = probe.compare(_measurement(lambda i, j: 11.0), "host4")
    assert "agrees with the labelled topology 'host4' within 20%" in ok
    (lack,) = probe.compare(m, "host2")
    assert "lacks GPUs [2, 3]" in lack


def test_public_probe_is_the_function():
    assert jax_blink.probe is probe.probe and "probe" in dir(jax_blink)
    t = jax_blink.probe(jax.devices()[:2], sizes=4096, repeats=1)
    assert t.gpus == [0, 1] and all(0 < bw < math.inf for _, _, bw, _, _ in t.links())


def test_probe_argument_errors():
    with pytest.raises(jax_blink.TopologyError, match="at least 2 devices"):
        probe.probe(jax.devices()[:1])
    with pytest.raises(jax_blink.TopologyError, match="4 B .. 4 GiB"):
        probe.probe(sizes=(0,))
    with pytest.raises(TypeError, match="probe sizes are ints"):
        probe.probe(sizes=("1M",))
    with pytest.raises(jax_blink.TopologyError, match="distinct devices"):
        probe.probe([jax.devices()[0]] * 2)
    with pytest.raises(jax_blink.TopologyError, match="repeats must be an int >= 1"):
        probe.probe(repeats=0)


def test_cache_per_device_set_and_env_var_plans_on_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    devs = jax.devices()[:8]
    first = probe.cached_probe(devs, **SMALL)
    files = list(tmp_path.glob("probe-*.json"))
    assert len(files) == 1 and any("probe stored in" in n for n in first.notes)
    again = probe.cached_probe(devs, **SMALL)
    assert again.fingerprint() == first.fingerprint()
    assert any(n.startswith("cached probe from") for n in again.notes)
    probe.cached_probe(devs[:4], **SMALL)  # another device set: another key, another file
    assert len(list(tmp_path.glob("probe-*.json"))) == 2
    assert probe.cache_key(devs) != probe.cache_key(devs[:4])

    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", "probe")
    mapping._load.cache_clear()
    try:
        assert mapping.make_plan_key().topology == "probe"
        assert mapping._load("probe").fingerprint() == first.fingerprint()  # the cached 8-device probe
        mesh = Mesh(np.array(devs), ("d",))
        x = jnp.arange(8 * 3, dtype=jnp.float32) * 1.5
        f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        g = jax.jit(jax.shard_map(lambda v: lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(g(x)))
    finally:
        mapping._load.cache_clear()


def test_stale_or_broken_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    devs = jax.devices()[:2]
    path = tmp_path / f"probe-{probe.cache_key(devs)}.json"
    path.write_text("{not json")
    t = probe.cached_probe(devs, **SMALL)
    assert t.gpus == [0, 1] and json.loads(path.read_text())["topology"]["name"] == "probe-cpu2"


def test_cli_topology_probe_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    assert main(["topology", "probe", "--probe-sizes", "4K,64K", "--repeats", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [n["id"] for n in d["nodes"] if n["kind"] == "gpu"] == list(range(8))
    assert all(0 < e["bandwidth_gbps"] < math.inf for e in d["links"])
    assert len(list(tmp_path.glob("probe-*.json"))) == 1  # refreshed the cache JAX_BLINK_TOPOLOGY=probe reads
    assert main(["topology", "probe", "--probe-sizes", "4K", "--repeats", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    # CPU devices are named as devices, and the figures as copy bandwidths, not links
    assert "probe-cpu8: 8 cpu devices," in out and "GPU" not in out.replace("not GPUs", "")
    assert "measured copy bandwidths between cpu devices (jax.device_put, host memory), not interconnect" in out
    assert "median one-way GB/s is one pair copying alone" in out
    mapping._load.cache_clear()
    assert main(["plan", "--topology", "probe", "--json"]) == 0  # plans on the probe just cached
    p = json.loads(capsys.readouterr().out)
    assert p["devices"] == list(range(8)) and p["rate_gbps"] > 0
    assert len(list(tmp_path.glob("probe-*.json"))) == 1


def test_label_capacity_counts_no_forwarding_gpu():
    """dgx1v-nvlink: 0->1 has one direct NVLink (22.9 GB/s achieved); the max-flow through other GPUs
    is larger, but a copy does not pass through them, so a measured 25 GB/s agrees with the label."""
    m = _measurement(lambda i, j: 25.0, n=2)
    (ok,) = probe.compare(m, "dgx1v-nvlink")
    assert "agrees" in ok
    (off,) = probe.compare(_measurement(lambda i, j: 12.0, n=2), "dgx1v-nvlink")
    assert "0->1: measured 12 GB/s, labelled 22.9 GB/s (-48%)" in off
