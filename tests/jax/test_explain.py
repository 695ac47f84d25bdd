"""jax_blink.explain, JAX_BLINK_LOG and the names profiles show (jax_blink/callsites.py, explaining.py).

The rows of ``explain`` are made by the lowering from the LoweringRequest it runs; these tests check
them against independent calls of the public planner and of ``jax-blink bench``'s sweep for the
same topology, devices and size (exact equality: the same deterministic functions), on the digits
and FSDP examples' train steps, and the XLA collectives it lists against a program with known ones.
"""

import functools
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import Topology, callsites, costmodel, nccl_model
from jax_blink import lowering as registry
from jax_blink.cli import main
from jax_blink.cli.bench_cmd import simulate_sweep
from jax_blink.cli.demo_cmd import load_example
from jax_blink.explaining import explain, xla_collectives

DGX1V = Topology.preset("dgx1v")


def _check_site(site, topo):
    """A row equals what jax_blink.plan / plan(nbytes=) / jax-blink bench (and bench --plan) give."""
    p = site.plan
    devs, coll = list(p.devices), site.collective
    ref = jax_blink.plan(topo, coll, devices=devs, root=p.root)  # the certificate `jax-blink plan` prints
    assert site.bound_gbps == ref.bound_gbps
    assert site.bound_s == site.nbytes / (ref.bound_gbps * 1e9)
    swept, = simulate_sweep(topo, ref, [site.nbytes], progress=False)  # `jax-blink bench --sizes <nbytes>`
    assert site.auto_shape == swept["blink_plan"].shape()
    assert site.auto_shape == jax_blink.plan(topo, coll, devices=devs, root=p.root, nbytes=site.nbytes).shape()
    assert site.auto_s == swept["blink"].time_s
    assert site.ring_s == swept["ring"].time_s
    assert site.tree_s == (None if swept["tree"] is None else swept["tree"].time_s)
    fixed, = simulate_sweep(topo, p, [site.nbytes], progress=False, fixed=True)  # `bench --plan <its plan>`
    assert site.sim_s == fixed["blink"].time_s
    # NCCL's own choice by its tuner (jax_blink.nccl_model), back to back, is the speedup's reference
    ch = nccl_model.predict(topo, coll, site.nbytes, devices=devs)
    assert (site.nccl_s, site.nccl_choice) == (ch.steady_us * 1e-6, f"{ch.algorithm}/{ch.protocol}")
    assert site.speedup == pytest.approx(site.nccl_s / site.sim_s, rel=1e-12)
    # the lowering's own choice: the CPU executor keeps the packing (sharded: one star per owner) and
    # picks its chunks by the cost model with the ffi record's step latency
    rec = registry.record("ffi", "cpu")
    cands = [registry.shared_memory_stars(ref)] if site.collective in ("allgather", "reducescatter") else [ref]
    chosen, sched, t = costmodel.lowering_schedule(cands, site.nbytes // 4, itemsize=4,
                                                   step_latency_s=rec.step_latency_s, round_synchronous=False,
                                                   topology=topo)
    assert site.predicted_s == t and site.chunks == len(sched.chunk_seg) and site.shape == chosen.shape()


@pytest.mark.slow
def test_explain_digits_train_step_rows_equal_plan_and_bench():
    ex = load_example("digits")
    report = explain(functools.partial(ex.explain_train_step, topology=DGX1V))
    shapes = jax.eval_shape(lambda: ex.CNN().init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1))))
    nparams = sum(math.prod(v.shape) for v in jax.tree.leaves(shapes))
    grads, metrics = report.sites
    assert (grads.nbytes, grads.leaves, metrics.nbytes, metrics.leaves) == (4 * nparams, 8, 12, 1)
    for s in report.sites:
        assert (s.api, s.collective, s.axes, s.group_size, s.dtype, s.lowering) == \
               ("jax_blink.psum", "allreduce", ("data",), 8, "float32", "ffi")
        assert s.why.startswith("auto: ffi") and "flax_digits/train.py" in s.source
        _check_site(s, DGX1V)
    assert report.xla == []  # every collective of the step is jax_blink's
    d = json.loads(report.to_json())
    assert [r["nbytes"] for r in d["call_sites"]] == [4 * nparams, 12] and d["xla_collectives"] == []
    text = str(report)
    assert "psum" in text and "no other XLA collectives" in text and "flax_digits/train.py" in text


@pytest.mark.slow
def test_explain_fsdp_train_step_rows_equal_plan_and_bench():
    ex = load_example("fsdp")
    report = explain(functools.partial(ex.explain_train_step, topology=DGX1V))
    shapes = jax.eval_shape(lambda: ex.MLP().init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1))))
    layout = ex.Layout.of(shapes["params"], 8)
    by = {}
    for s in report.sites:
        by.setdefault(s.collective, []).append(s.nbytes)
    full = sorted(4 * 8 * b for b in layout.block)  # the full (gathered) buffer of each parameter
    assert sorted(by["allgather"]) == full and sorted(by["reducescatter"]) == full and by["allreduce"] == [12]
    for s in report.sites:
        _check_site(s, DGX1V)
    assert report.xla == []


def test_xla_collectives_are_listed_and_jax_blinks_own_are_not(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("i",))

    def body(v):
        return jax_blink.psum(v, "i", impl="ppermute") + lax.psum(2 * v, "i")

    inner = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
    f = jax.jit(lambda x: jnp.sum(inner(x)))  # the sum over a sharded array: XLA inserts an all-reduce
    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("i")))
    report = explain(f, x)
    (site,) = report.sites
    assert site.lowering == "ppermute" and site.why == "impl='ppermute' given (cpu, mesh in 1 process)"
    assert sorted(c.op for c in report.xla) == ["all-reduce", "all-reduce"], report.xla
    psum = [c for c in report.xla if c.op_name.endswith("/psum")]
    assert len(psum) == 1 and (psum[0].dtype, psum[0].nbytes, psum[0].group_size) == ("f32", 32, 8)
    compiled = f.lower(x).compile().as_text()
    ours = [ln for ln in compiled.splitlines() if "collective-permute" in ln and site.label in ln]
    assert ours and not any(c.op == "collective-permute" for c in report.xla)
    # the parser alone, on a hand-written line: bytes of the result, group from replica_groups
    line = ('  %ar = bf16[4,256]{1,0} all-reduce(bf16[4,256]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[8], '
            'to_apply=%add, metadata={op_name="jit(f)/psum" source_file="/x/y.py" source_line=7}')
    (c,) = xla_collectives(line)
    assert (c.op, c.dtype, c.nbytes, c.group_size, c.op_name, c.source) == \
           ("all-reduce", "bf16", 2048, 4, "jit(f)/psum", "/x/y.py:7")
    line = ("  ROOT %all-reduce = f32[] all-reduce(%w), channel_id=2, replica_groups=mesh['a'=2,'b'=4] {'b'}, "
            'use_global_device_ids=true, frontend_attributes={is_spmd_generated="true"}, metadata={op_name="x"}')
    (c,) = xla_collectives(line)  # jax 0.12's mesh notation
    assert (c.nbytes, c.group_size, c.spmd_generated) == (4, 4, True)


def test_cli_explain_prints_a_row_per_call_site(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "import jax_blink\n"
        "def step():\n"
        "    mesh = Mesh(np.asarray(jax.devices()[:4]), ('d',))\n"
        "    f = jax.shard_map(lambda v: jax_blink.psum(v, 'd', topology='dgx1v'), mesh=mesh,\n"
        "                      in_specs=P('d'), out_specs=P(), check_vma=False)\n"
        "    return f(jnp.ones((4, 256)))\n")
    assert main(["explain", f"{script}:step", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (row,) = d["call_sites"]
    assert (row["collective"], row["group_size"], row["nbytes"], row["lowering"]) == ("allreduce", 4, 1024, "ffi")
    assert row["source"].startswith(f"{script}:6")
    assert main(["explain", f"{script}:nothing"]) == 2
    assert "has no function 'nothing' (its functions: step)" in capsys.readouterr().err
    assert main(["explain", f"{script}"]) == 2
    assert "SCRIPT:FUNCTION" in capsys.readouterr().err


# ------------------------------------------------------------------------------ JAX_BLINK_LOG
def _lower_two_sites():
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("i",))
    f = jax.jit(jax.shard_map(lambda v: (jax_blink.psum(v, "i"), jax_blink.psum(v.astype(jnp.int32), "i")),
                              mesh=mesh, in_specs=P("i"), out_specs=(P(), P()), check_vma=False))
    jax.clear_caches()
    with callsites.collect() as sites:
        f.lower(jnp.ones(64))
    return sites


@pytest.mark.parametrize("level", ["", "info", "debug"])
def test_log_one_line_per_call_site(monkeypatch, caplog, level):
    monkeypatch.setenv("JAX_BLINK_LOG", level)
    caplog.set_level(logging.DEBUG, logger="jax_blink.unrelated")  # capture, without enabling jax_blink
    sites = _lower_two_sites()
    recs = [r for r in caplog.records if r.name == "jax_blink"]
    if not level:  # nothing by default
        assert recs == []
        return
    infos = [r.getMessage() for r in recs if r.levelno == logging.INFO]
    assert infos == [s.log_line() for s in sites] and len(infos) == 2
    assert "jax_blink.psum allreduce over i (n=8) float32 32 B/device" in infos[0]
    assert "int32" in infos[1] and "lowering ffi" in infos[1] and "test_explain.py" in infos[1]
    debugs = [r.getMessage() for r in recs if r.levelno == logging.DEBUG]
    if level == "info":
        assert debugs == []
    else:
        assert len(debugs) == 2 and all("trees:" in m and m.count("tree") > 2 for m in debugs)
        assert sites[0].plan.describe() in debugs[0]


def test_bad_log_level_says_what_it_takes(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_LOG", "verbose")
    with pytest.raises(ValueError, match="JAX_BLINK_LOG='verbose': .*takes one of info, debug"):
        _lower_two_sites()


# ------------------------------------------------------------------------------ names in profiles
def test_ops_carry_the_call_site_name_in_hlo_and_in_a_profiler_trace(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("i",))
    out = {}
    for impl in ("ffi", "ppermute"):
        f = jax.jit(jax.shard_map(lambda v, impl=impl: jax_blink.psum(v, "i", impl=impl), mesh=mesh,
                                  in_specs=P("i"), out_specs=P(), check_vma=False))
        jax.clear_caches()
        with callsites.collect() as sites:
            compiled = f.lower(jnp.ones(8 * 1024)).compile()
        (site,) = sites
        assert site.label.startswith(f"jax_blink.psum[allreduce float32 4KiB {site.algorithm} x{site.trees} ")
        assert site.label.endswith(f"{site.chunks}ch {impl}]")
        lines = [ln for ln in compiled.as_text().splitlines() if f'/{site.label}' in ln]
        kind = "custom-call(" if impl == "ffi" else "collective-permute"
        assert any(kind in ln and 'op_name="jit(<lambda>)/shard_map/jax_blink.psum[' in ln for ln in lines), \
            compiled.as_text()[:3000]
        out[impl] = (f, site.label)
    trace = tmp_path / "trace"
    jax.profiler.start_trace(str(trace))
    try:
        for f, _ in out.values():
            jax.block_until_ready(f(jnp.ones(8 * 1024)))
    finally:
        jax.profiler.stop_trace()
    data = b"".join(p.read_bytes() for p in trace.rglob("*.xplane.pb"))
    assert data, list(trace.rglob("*"))
    # the trace's events carry the op names (XLA:CPU names thunks after HLO instructions, whose names
    # and op_name metadata come from the label)
    assert out["ffi"][1].encode() in data or b"jax_blink_psum_allreduce_float32_4KiB" in data
