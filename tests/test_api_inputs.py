"""Public functions outside the collectives: bad input fails early with one clear error, and
environment preferences that do not apply fall back instead of failing."""

import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import dispatch, mapping
from jax_blink.topology import Topology
from jax_blink.topology.load import load_topology


@pytest.mark.parametrize("env,collective,gpus,expect", [
    ("rsag", "broadcast", range(8), "auto"), ("rsag", "reduce", range(8), "auto"),
    ("rsag", "allgather", range(8), "auto"), ("rsag", "allreduce", range(8), "rsag"),
    ("ring", "broadcast", range(8), "auto"), ("ring", "reduce", range(8), "auto"),
    ("ring", "allreduce", range(8), "ring"), ("ring", "reducescatter", range(8), "ring"),
    ("hierarchical", "allreduce", range(8), "auto"),           # one node
    ("hierarchical", "allgather", range(8), "auto"), ("trees", "broadcast", range(8), "trees")])
def test_env_algorithm_falls_back_where_it_does_not_apply(monkeypatch, env, collective, gpus, expect):
    monkeypatch.setenv(mapping.ENV_ALGORITHM, env)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    key = mapping.make_plan_key()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert dispatch.effective_algorithm(key, load_topology("dgx1v"), collective, list(gpus)) == expect
        dispatch.effective_algorithm(key, load_topology("dgx1v"), collective, list(gpus))
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == (expect != env)  # warned once, not per call
    if msgs:
        assert msgs[0].startswith(f"JAX_BLINK_ALGORITHM={env}: ") and f"planning {collective} with 'auto'" in msgs[0]


def test_env_algorithm_hierarchical_applies_across_nodes(monkeypatch):
    monkeypatch.setenv(mapping.ENV_ALGORITHM, "hierarchical")
    key = mapping.make_plan_key()
    assert dispatch.effective_algorithm(key, load_topology("dgx1v-4node"), "allreduce", [0, 8]) == "hierarchical"


def test_env_rsag_runs_broadcast_and_reduce(monkeypatch):
    # found by a user: JAX_BLINK_ALGORITHM=rsag set for a job broke every broadcast
    monkeypatch.setenv(mapping.ENV_ALGORITHM, "rsag")
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    x = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        def bc(v):
            return jax_blink.broadcast(v, "i", root=3, topology="dgx1v")
        got = jax.jit(jax.shard_map(bc, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(x[3:4], x.shape))
        def rd(v):
            return jax_blink.reduce(v, "i", root=0, topology="dgx1v")
        got = jax.jit(jax.shard_map(rd, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        np.testing.assert_allclose(np.asarray(got)[0], x.sum(0))


def test_topology_help_gives_achieved_default_rates(capsys):
    from jax_blink.cli import main
    from jax_blink.topology.presets import nvlink_gbps, pcie_gen_gbps
    with pytest.raises(SystemExit) as e:
        main(["topology", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "default 25" not in out and "default 12)" not in out
    assert f"NVLink2 {nvlink_gbps(2):.1f} = 25 line rate" in out and f"gen3 x16 {pcie_gen_gbps(3):.1f}" in out


# ------------------------------------------------------------------ public-function sweep
from jax_blink import costmodel, schedule, simulate  # noqa: E402
from jax_blink.errors import BlinkError, PlanError, ScheduleError, TopologyError  # noqa: E402
from jax_blink.planner import bounds  # noqa: E402

DGX = load_topology("dgx1v")


def test_devices_string_is_parsed_like_the_cli():
    assert jax_blink.plan(DGX, devices="0,1").devices == (0, 1)
    assert jax_blink.plan(DGX, devices="0-3").devices == (0, 1, 2, 3)
    assert jax_blink.plan(DGX, devices=np.arange(3)).devices == (0, 1, 2)  # numpy ids become ints
    assert bounds.allreduce_bound(DGX, "0-3") == bounds.allreduce_bound(DGX, [0, 1, 2, 3])
    assert DGX.check_devices("0-2,5") == [0, 1, 2, 5]


@pytest.mark.parametrize("devices,match", [
    ("0,,1", "has an empty item"), ("0-x", "is not a GPU id or a range"), ("3-1", "ends below its start"),
    (3, "devices must be a list of GPU ids or a string like '0,1'"),
    ([0, True], "integer GPU ids, got \\[True\\]"),
    ([0, 1.0], "integer GPU ids"), ([0, 0], "duplicate devices"),
    ([0, 99], "\\[99\\] are not GPUs of topology 'dgx1v'"),
    ([], "at least one device")])
def test_bad_devices_fail_early(devices, match):
    with pytest.raises(PlanError, match=match):
        jax_blink.plan(DGX, devices=devices)


@pytest.mark.parametrize("root", [True, 1.5, "1", 9])
def test_bad_root(root):
    with pytest.raises(PlanError, match="root"):
        jax_blink.plan(DGX, "broadcast", root=root)
    with pytest.raises(PlanError, match="root"):
        bounds.broadcast_bound(DGX, [0, 1], root if root != 9 else 5)


def test_plan_json_names_the_missing_field():
    with pytest.raises(PlanError, match="plan JSON lacks 'collective', .*'trees': a plan holds"):
        jax_blink.Plan.from_json("{}")
    good = jax_blink.plan(DGX, devices=[0, 1]).to_dict()
    with pytest.raises(PlanError, match="plan JSON lacks 'trees'"):
        jax_blink.Plan.from_dict({k: v for k, v in good.items() if k != "trees"})
    with pytest.raises(PlanError, match="a plan JSON is an object"):
        jax_blink.Plan.from_json("[]")
    with pytest.raises(PlanError, match="unknown collective 'allredux'"):
        jax_blink.Plan.from_dict({**good, "collective": "allredux"})
    good["trees"][0].pop("edges")
    with pytest.raises(PlanError, match="a tree lacks 'edges'"):
        jax_blink.Plan.from_dict(good)


def test_wrong_argument_types_name_what_is_expected():
    p = jax_blink.plan(DGX, devices=[0, 1, 2])
    with pytest.raises(PlanError, match=r"Topology \(e.g. jax_blink.load_topology\('dgx1v'\)\), got int"):
        jax_blink.plan(42)
    # a name or file is loaded, as the collectives' topology= is
    assert jax_blink.plan("dgx1v", devices=[0, 1, 2]) is p
    with pytest.raises(TopologyError, match="dgx1v"):  # the loader's error: did-you-mean and the formats
        jax_blink.plan("dgx1vv")
    with pytest.raises(PlanError, match="expected a jax_blink.Topology"):
        bounds.allreduce_bound("dgx1v", [0, 1])
    with pytest.raises(BlinkError, match="simulate needs a jax_blink.Plan or a Schedule, got str"):
        simulate.simulate("x", 100, topology=DGX)
    with pytest.raises(BlinkError, match="topology must be a jax_blink.Topology"):
        simulate.simulate(p, 100, topology="dgx1v")
    with pytest.raises(BlinkError, match="nbytes must be a positive number of bytes, got True"):
        simulate.simulate(p, True, topology=DGX)
    with pytest.raises(ScheduleError, match="build_schedule needs a jax_blink.Plan"):
        schedule.build_schedule("x", 10)
    with pytest.raises(ScheduleError, match="nelems must be a non-negative int, got True"):
        schedule.build_schedule(p, True)
    with pytest.raises(ScheduleError, match="execute needs a Schedule"):
        schedule.execute("x", np.zeros((3, 4)))
    with pytest.raises(PlanError, match="fastest needs at least one plan"):
        costmodel.fastest([], 100, DGX)
    with pytest.raises(PlanError, match=r"devices \[9\] are not GPUs"):
        bounds.nash_williams_value(DGX, [0, 9])
    for n in (True, float("nan"), "4"):
        with pytest.raises(TopologyError, match="Topology.host needs n >= 1 devices"):
            Topology.host(n)


@pytest.mark.parametrize("args,match", [
    ((0, -1.0, ((0, 1),)), "weight_gbps must be a finite number >= 0"), ((0, float("nan"), ((0, 1),)), "weight_gbps"),
    ((True, 1.0, ((1, 0),)), "root must be a GPU id"), ((0, 1.0, "ab"), "edges must be \\(parent, child\\) hops"),
    ((0, 1.0, ((0, 1),), ((0, 1, 2),)), "reduce_edges must be")])
def test_bad_tree(args, match):
    with pytest.raises(PlanError, match=match):
        jax_blink.Tree(*args)
