"""Bad input to the public functions fails when the function is called, with one clear exception.

A collective is checked while it traces (``jax.make_jaxpr`` never lowers, so an error raised under
it is a trace-time error, not one wrapped in JAX's lowering traceback).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import TopologyError
from jax_blink.errors import BlinkError


def mesh8(name="d"):
    return Mesh(np.array(jax.devices()[:8]), (name,))


def traced(fn, n=8):
    """make_jaxpr of ``fn`` under shard_map over 8 devices (no lowering)."""
    f = jax.shard_map(fn, mesh=mesh8(), in_specs=P("d"), out_specs=P("d"), check_vma=False)
    return jax.make_jaxpr(f)(jnp.ones(n, jnp.float32))


@pytest.mark.parametrize("api", ["psum", "pmean", "broadcast", "reduce"])
def test_unknown_preset_at_trace_time(api):
    fn = getattr(jax_blink, api)
    with pytest.raises(TopologyError) as e:
        traced(lambda x: fn(x, "d", topology="dgx1vv"))
    msg = str(e.value)
    assert f"jax_blink.{api.replace('pmean', 'psum')}: topology='dgx1vv'" in msg  # pmean is psum / n
    assert "did you mean 'dgx1v'?" in msg and "known presets: " in msg and "host<N>" in msg
    assert "NCCL's topology XML" in msg  # the file formats it takes


def test_too_small_topology_at_trace_time_shard_map_jit_and_pmap():
    want = "topology 'host4' has 4 GPUs but axes 'd' span 8 devices"
    with pytest.raises(TopologyError, match=want) as e:
        traced(lambda x: jax_blink.psum(x, "d", topology="host4"))
    assert "topology='host8'" in str(e.value)
    f = jax.jit(jax.shard_map(lambda x: jax_blink.psum(x, "d", topology="host4"), mesh=mesh8(),
                              in_specs=P("d"), out_specs=P("d")))
    with pytest.raises(TopologyError, match=want):
        f.trace(jnp.ones(8))
    with pytest.raises(TopologyError, match="has 4 GPUs but axes 'p' span 8 devices"):
        jax.pmap(lambda x: jax_blink.psum(x, "p", topology="host4"), axis_name="p")(jnp.ones(8))


def test_whole_mesh_needs_a_gpu_per_device():
    """Axis 'b' has 4 devices but the 2x4 mesh has 8 distinct devices: host4 cannot map them."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    f = jax.shard_map(lambda x: jax_blink.psum(x, "b", topology="host4"), mesh=mesh,
                      in_specs=P(("a", "b")), out_specs=P(("a", "b")), check_vma=False)
    with pytest.raises(TopologyError, match="has 4 GPUs but the mesh span 8 devices"):
        jax.make_jaxpr(f)(jnp.ones(8))


def test_topology_big_enough_still_runs_and_equals_lax():
    mesh = mesh8()
    x = jnp.arange(16.0)
    f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "d", topology="host8"), mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    g = jax.jit(jax.shard_map(lambda v: lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(g(x)))


def test_env_topology_checked_at_call(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_TOPOLOGY", "dgx1vv")
    with pytest.raises(TopologyError, match="JAX_BLINK_TOPOLOGY='dgx1vv'.*did you mean 'dgx1v'"):
        traced(lambda x: jax_blink.psum(x, "d"))


def test_missing_file_topology():
    with pytest.raises(TopologyError, match="'no/such/topo.txt' is not a preset name.*existing file"):
        traced(lambda x: jax_blink.psum(x, "d", topology="no/such/topo.txt"))


@pytest.mark.parametrize("bad", ["hello", "float32", b"bytes", object(), [1.0, "x"]])
def test_operand_not_a_jax_type_is_lax_kind_of_type_error(bad):
    with pytest.raises(TypeError) as lax_err:
        traced(lambda x: (lax.psum(bad, "d"), x)[1])
    assert "not a valid JAX type" in str(lax_err.value)
    for api in ("psum", "pmean", "broadcast", "reduce"):
        with pytest.raises(TypeError, match=f"jax_blink.{api.replace('pmean', 'psum')}: argument .* is "
                                            "not a valid JAX type"):
            traced(lambda x, api=api: (getattr(jax_blink, api)(bad, "d"), x)[1])


@pytest.mark.parametrize("root,exc,match", [
    ("a", TypeError, "root must be an int rank in \\[0, 8\\) over axes \\('d',\\), got 'a' of type str"),
    (1.5, TypeError, "got 1.5 of type float"),
    (True, TypeError, "got True of type bool"),
    (8, ValueError, "root must be a rank in \\[0, 8\\)"),
    (-1, ValueError, "got -1"),
])
@pytest.mark.parametrize("api", ["broadcast", "reduce"])
def test_bad_root(api, root, exc, match):
    with pytest.raises(exc, match=match):
        traced(lambda x: getattr(jax_blink, api)(x, "d", root=root))


def test_root_numpy_int_accepted_and_traced_root_refused():
    out = traced(lambda x: jax_blink.broadcast(x, "d", root=np.int64(3)))
    assert out is not None

    def f(x):
        return jax_blink.broadcast(x, "d", root=lax.axis_index("d"))
    with pytest.raises(TypeError, match="root must be a static Python int"):
        traced(f)


@pytest.mark.parametrize("kw,exc,match", [
    ({"impl": "nccl"}, ValueError, "impl must be one of"),
    ({"algorithm": "rings"}, ValueError, "algorithm= must be one of"),
    ({"chunk_elems": 0}, ValueError, "chunk_elems must be a positive int"),
    ({"chunk_elems": "x"}, ValueError, "chunk_elems must be a positive int, got 'x'"),
    ({"chunk_elems": True}, ValueError, "chunk_elems must be a positive int, got True"),
    ({"max_trees": 0}, ValueError, "max_trees must be a positive int"),
    ({"device_map": 5}, TypeError, "device_map must be a dict or a callable"),
    ({"topology": 8}, TypeError, "topology must be a Topology, a preset name or a file path"),
])
def test_bad_keyword(kw, exc, match):
    with pytest.raises(exc, match=match):
        traced(lambda x: jax_blink.psum(x, "d", **kw))


def test_positional_axis_and_unbound_axis():
    with pytest.raises(TypeError, match="named axes only"):
        traced(lambda x: jax_blink.psum(x, 0))
    with pytest.raises(NameError, match="unbound axis name: e"):
        traced(lambda x: jax_blink.psum(x, "e"))
    for f in (jax_blink.psum, jax_blink.all_gather):
        with pytest.raises(ValueError, match=r"each axis once.*repeated: d"):
            traced(lambda x, f=f: f(x, ("d", "d")))


# ------------------------------------------------------------------ the other public functions
def test_set_device_map_type():
    with pytest.raises(TypeError, match="device_map must be a dict, a callable or None"):
        jax_blink.set_device_map([0, 1])


def test_load_topology_and_preset_errors(tmp_path):
    with pytest.raises(TopologyError, match="did you mean 'dgx-a100'"):
        jax_blink.load_topology("dgx_a10")
    with pytest.raises(TopologyError, match="cannot load a topology from int"):
        jax_blink.load_topology(3)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TopologyError, match="no supported format"):
        jax_blink.load_topology(empty)


def test_host_preset_size_limit_is_fast():
    import time
    t0 = time.perf_counter()
    msg = r"preset .host100000.: host<N> takes N host CPU devices in 1..4096 \(e.g. host8\), got N=100000"
    with pytest.raises(TopologyError, match=msg):
        jax_blink.load_topology("host100000")
    with pytest.raises(TopologyError, match="at most 4096"):
        jax_blink.Topology.host(100000)
    assert time.perf_counter() - t0 < 1.0
    assert len(jax_blink.load_topology("host4096").gpus) == 4096


@pytest.mark.parametrize("args,match", [
    (("dgx1vv", 2, 12.5), "unknown preset 'dgx1vv'"),
    (("dgx1v", 0, 12.5), "n_nodes must be an int >= 1"),
    (("dgx1v", 2, float("nan")), "nic_gbps must be > 0"),
    (("dgx1v", 2, -1.0), "nic_gbps must be > 0"),
])
def test_multi_node_errors(args, match):
    with pytest.raises(TopologyError, match=match):
        jax_blink.multi_node(*args)


def test_host_bandwidth_must_be_finite_positive():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TopologyError, match="bandwidth must be a finite number > 0"):
            jax_blink.Topology.host(4, gbps=bad)


def test_plan_and_ring_rate_errors():
    t = jax_blink.Topology.preset("dgx1v")
    with pytest.raises(BlinkError, match="unknown collective"):
        jax_blink.plan(t, "allgatherv")
    with pytest.raises(BlinkError):
        jax_blink.plan("dgx1vv")  # no such preset: the loader's TopologyError
    with pytest.raises(BlinkError):
        jax_blink.plan(t, devices=[0, 99])
    assert math.isfinite(jax_blink.ring_rate(t, [0, 1, 2, 3]))


def test_ring_rate_takes_what_plan_takes_and_selftest_a_rank_count():
    """ring_rate("dgx1v", ...) loads the preset as plan() does; other types and bad names fail clearly."""
    t = jax_blink.Topology.preset("dgx1v")
    assert jax_blink.ring_rate("dgx1v", [0, 1, 2, 3]) == jax_blink.ring_rate(t, [0, 1, 2, 3])
    with pytest.raises(BlinkError, match="ring_rate needs a jax_blink.Topology or a preset name / topology file, "
                                         "got int"):
        jax_blink.ring_rate(8, [0, 1])
    with pytest.raises(BlinkError, match="dgx1vv"):
        jax_blink.ring_rate("dgx1vv", [0, 1])
    for bad in (0, -2, "2", True, 1.5):
        with pytest.raises(ValueError, match="nranks must be None .* or an int >= 1"):
            jax_blink.selftest(nranks=bad, record=False)


def test_vmap_axis_is_not_counted_as_devices():
    """A vmap axis of 16 with topology host4: no devices to count, the sum is lax's."""
    out = jax.vmap(lambda v: jax_blink.psum(v, "v", topology="host4"), axis_name="v")(jnp.arange(16.0))
    np.testing.assert_array_equal(np.asarray(out), np.full(16, 120.0))


def test_sharded_collectives_static_arguments_and_scalars():
    """all_gather's axis and psum_scatter's scatter_dimension are static ints (as lax), named in the
    error; a scalar has no dimension to scatter."""
    with pytest.raises(TypeError, match=r"jax_blink.all_gather: axis must be a static int, got 1.0"):
        traced(lambda v: jax_blink.all_gather(v, "d", axis=1.0))
    with pytest.raises(TypeError, match=r"scatter_dimension must be a static int, got True"):
        traced(lambda v: jax_blink.psum_scatter(v, "d", scatter_dimension=True))
    with pytest.raises(ValueError, match="a scalar operand has no dimension to scatter"):
        traced(lambda v: jax_blink.psum_scatter(v[0], "d"))
