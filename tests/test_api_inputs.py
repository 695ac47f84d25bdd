"""Public functions outside the collectives: bad input fails early with one clear error, and
environment preferences that do not apply fall back instead of failing."""

import warnings

import numpy as np
import pytest

import jax
from jax.sharding import Mesh, PartitionSpec as P

import jax_blink
from jax_blink import mapping
from jax_blink.discovery import load_topology
from jax_blink.topology import Topology


@pytest.mark.parametrize("env,collective,gpus,expect", [
    ("rsag", "broadcast", range(8), "auto"), ("rsag", "reduce", range(8), "auto"),
    ("rsag", "allgather", range(8), "auto"), ("rsag", "allreduce", range(8), "rsag"),
    ("ring", "broadcast", range(8), "auto"), ("ring", "reduce", range(8), "auto"),
    ("ring", "allreduce", range(8), "ring"), ("ring", "reducescatter", range(8), "ring"),
    ("hierarchical", "allreduce", range(8), "auto"),           # one node
    ("hierarchical", "allgather", range(8), "auto"), ("trees", "broadcast", range(8), "trees")])
def test_env_algorithm_falls_back_where_it_does_not_apply(monkeypatch, env, collective, gpus, expect):
    monkeypatch.setenv(mapping.ENV_ALGORITHM, env)
    monkeypatch.setattr(mapping, "_WARNED", set())
    key = mapping.make_plan_key()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert mapping.effective_algorithm(key, load_topology("dgx1v"), collective, list(gpus)) == expect
        mapping.effective_algorithm(key, load_topology("dgx1v"), collective, list(gpus))
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == (expect != env)  # warned once, not per call
    if msgs:
        assert msgs[0].startswith(f"JAX_BLINK_ALGORITHM={env}: ") and f"planning {collective} with 'auto'" in msgs[0]


def test_env_algorithm_hierarchical_applies_across_nodes(monkeypatch):
    monkeypatch.setenv(mapping.ENV_ALGORITHM, "hierarchical")
    key = mapping.make_plan_key()
    assert mapping.effective_algorithm(key, load_topology("dgx1v-4node"), "allreduce", [0, 8]) == "hierarchical"


def test_env_rsag_runs_broadcast_and_reduce(monkeypatch):
    # found by a user: JAX_BLINK_ALGORITHM=rsag set for a job broke every broadcast
    monkeypatch.setenv(mapping.ENV_ALGORITHM, "rsag")
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    x = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bc = lambda v: jax_blink.broadcast(v, "i", root=3, topology="dgx1v")
        got = jax.jit(jax.shard_map(bc, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(x[3:4], x.shape))
        rd = lambda v: jax_blink.reduce(v, "i", root=0, topology="dgx1v")
        got = jax.jit(jax.shard_map(rd, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))(x)
        np.testing.assert_allclose(np.asarray(got)[0], x.sum(0))


def test_topology_help_gives_achieved_default_rates(capsys):
    from jax_blink.cli import main
    from jax_blink.presets import nvlink_gbps, pcie_gen_gbps
    with pytest.raises(SystemExit) as e:
        main(["topology", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "default 25" not in out and "default 12)" not in out
    assert f"NVLink2 {nvlink_gbps(2):.1f} = 25 line rate" in out and f"gen3 x16 {pcie_gen_gbps(3):.1f}" in out
