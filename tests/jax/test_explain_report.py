"""explain and transform_report for people: one row per bucket with its leaves and source lines,
tables no wider than the console, one shared why, a summary, the GPU machine's columns when the
topology describes GPUs; transform_report grouped by collective and source line with counts, what
it left on lax and why, no object reprs."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from rich.console import Console

import jax_blink
from jax_blink import api, lowering  # noqa: F401  (api registers the lowerings)

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("i",))
IMPL = "ffi" if lowering.find_lowering("ffi", "cpu") is not None else "ppermute"


def _prog(a, b):
    s1 = lax.psum(a, "i")  # line +1: alone (s3 depends on it)
    s2 = lax.psum(b, "i")  # line +2: bucket with s3 and s4
    s3 = lax.psum(s1 * 2.0, "i")  # line +3
    s4 = lax.psum(b * 3.0, "i")  # line +4
    return s2 + s3 + s4 + lax.pmax(a, "i")


LINE = inspect.getsourcelines(_prog)[1]


def _explain(topology):
    f = jax.jit(jax.shard_map(jax_blink.transform(_prog, impl=IMPL, topology=topology), mesh=MESH,
                              in_specs=P("i"), out_specs=P("i"), check_vma=False))
    x = jnp.arange(N * 64, dtype=jnp.float32)
    return jax_blink.explain(f, x, x)


def _render(report, width):
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    report.print(console)
    return console.export_text()


def test_explain_rows_are_buckets_with_sources_and_gpu_columns():
    r = _explain("dgx1v")
    assert [len(s.sources) for s in r.sites] == [1, 3] and [s.leaves for s in r.sites] == [1, 3]
    lines = [int(src.split(":")[1].split()[0]) for src in r.sites[1].sources]
    assert lines == [LINE + 2, LINE + 3, LINE + 4]
    assert all("test_explain_report.py" in src for s in r.sites for src in s.sources)
    # a GPU topology on a CPU machine: the same sites lowered for CUDA, with their own plans and columns
    assert r.gpu_sites is not None and len(r.gpu_sites) == 2
    assert {s.platform for s in r.gpu_sites} == {"cuda"} and all(s.sim_s and s.bound_s for s in r.gpu_sites)
    if IMPL == "ffi":  # the CPU executor's one-plan policy is stated where its plan differs from plan(nbytes=)
        assert any("host memory" in s.plan_why for s in r.sites if s.auto_shape != s.shape)
    d = r.summary()
    assert (d["call_sites"], d["buckets"], d["collectives"], d["leaves"]) == (2, 1, 4, 4)
    assert d["here"]["predicted_s"] == pytest.approx(sum(s.predicted_s for s in r.sites))
    assert d["gpu"]["simulated_s"] == pytest.approx(sum(s.sim_s for s in r.gpu_sites))
    assert d["here"]["slower_than_nccl"] == [s.index for s in r.sites if s.sim_s > min(
        t for t in (s.ring_s, s.tree_s) if t is not None)]
    assert [x.op for x in r.xla] == ["all-reduce"]  # the pmax stays XLA's
    for width in (80, 120, 200):
        text = _render(r, width)
        assert max(map(len, text.splitlines())) <= width
        assert text.count("why (every site)") == 1 and "summary: 2 jax_blink call site(s), 1 of them bucket" in text
        assert "the same call sites on a GPU machine with this topology" in text
        if width >= 150:  # narrower tables name the file only, wrapped
            assert f"jax/test_explain_report.py:{LINE + 2}" in text
        assert "<function" not in text and "functools.partial" not in text


def test_explain_without_gpu_topology_says_so():
    r = _explain(None)
    assert r.gpu_sites is None and "describes no GPUs" in r.gpu_note
    text = _render(r, 100)
    assert "describes no GPUs" in text and max(map(len, text.splitlines())) <= 100


def test_transform_report_groups_by_collective_and_line():
    flax_nn = pytest.importorskip("flax.linen")

    class Net(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = flax_nn.BatchNorm(use_running_average=False, axis_name="i")(flax_nn.Dense(4)(x))
            return x

    model = Net()
    x = jnp.ones((N, 2, 3))
    variables = model.init(jax.random.PRNGKey(0), x[0])

    def step(variables, x, scale):
        def loss(p):
            y, upd = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
            return jnp.sum(y ** 2) * scale, upd
        (value, _), g = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        return lax.pmean(g, "i"), lax.pmax(value, "i")

    t = jax_blink.transform(functools.partial(step, scale=2.0), impl=IMPL)
    rep = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), variables)
    jax.pmap(t, axis_name="i")(rep, x)
    text = jax_blink.transform_report(t)
    assert "functools.partial" not in text and "<function" not in text and " at 0x" not in text
    lines = text.splitlines()
    assert lines[0].startswith("transform(step): ")
    leaves = len(jax.tree.leaves(variables["params"]))
    # three BatchNorms: their statistics' pmean forward and its transpose backward, one line of Flax
    bn = [ln for ln in lines if "normalization.py" in ln]
    assert len(bn) == 1 and bn[0].split()[0] == "6"
    here = f"test_explain_report.py:{inspect.getsourcelines(step)[1] + 5}"
    grads = [ln for ln in lines if here in ln and "lax.psum" in ln]
    assert len(grads) == 1 and grads[0].split()[0] == str(leaves) and grads[0].endswith("in 1 call(s)")
    assert "left on lax (count, collective, source: why):" in lines
    pmax = [ln for ln in lines if "lax.pmax" in ln]
    assert len(pmax) == 1 and here in pmax[0] and "not a jax_blink collective" in pmax[0]
    assert len(lines) <= 8
