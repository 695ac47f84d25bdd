"""The lowering registry: one record per lowering and platform, read by ``choose_lowering`` (impl names,
``auto``), ``api`` (accepted impls) and ``build_request`` (the cost model's step latency and
round-synchronous flag); the cost model itself knows no lowering by name."""

import ast
import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_blink.api as api
from jax_blink import costmodel, lowering, mapping, primitives
from jax_blink.dispatch import build_request, choose_lowering
from jax_blink.errors import BlinkError

FFI_CPU = lowering.find_lowering("ffi", "cpu")
needs_ffi = pytest.mark.skipif(FFI_CPU is None, reason="native CPU module not built")


def test_builtin_records():
    pp = lowering.record("ppermute", "cpu")
    assert pp is lowering.record("ppermute", "tpu") and pp.platform is None
    assert (pp.step_latency_s, pp.round_synchronous, pp.multi_process) == (100e-6, True, True)
    # the CPU executor's thread hand-off; the CUDA interpreter's flag hop (NCCL's Simple step, ffi.py)
    for platform, step in (("cpu", 5e-6), ("cuda", 2.8e-6)):
        ffi = lowering.record("ffi", platform)
        assert (ffi.platform, ffi.step_latency_s, ffi.round_synchronous, ffi.multi_process) == (platform, step, False,
                                                                                                 False)
        assert ffi.auto_priority < pp.auto_priority and ffi.auto_allowed is not None
    assert lowering.record("ffi", "cpu").candidates is lowering.host_memory_candidates
    assert lowering.record("ffi", "cuda").candidates is None
    assert lowering.names() == ["ffi", "hierarchical", "ppermute"]
    assert api.impls() == ["auto", "ffi", "hierarchical", "ppermute"]
    for platform in ("cpu", "cuda"):  # across processes: native inside, XLA's collective between
        h = lowering.record("hierarchical", platform)
        assert (h.platform, h.multi_process, h.auto_priority, h.auto_fits is not None) == (platform, True, 0, True)
        assert (h.unavailable is None) == (lowering.record("ffi", platform).unavailable is None)
    with pytest.raises(ValueError, match="step_latency_s must be > 0"):
        dataclasses.replace(pp, step_latency_s=0.0)


def test_unavailable_record_is_skipped_and_says_why(monkeypatch):
    broken = dataclasses.replace(lowering.record("ffi", "cpu"), unavailable="native module not built (test)")
    monkeypatch.setitem(lowering.LOWERINGS["ffi"], "cpu", broken)
    monkeypatch.setitem(lowering.LOWERINGS["hierarchical"], "cpu", dataclasses.replace(
        lowering.record("hierarchical", "cpu"), unavailable="its intra-process phases need the native executor"))
    assert lowering.find_lowering("ffi", "cpu") is None and lowering.record("ffi", "cpu") is broken
    assert choose_lowering("auto", ["cpu"]).name == "ppermute"
    with pytest.raises(BlinkError, match=r"no lowering registered for platform\(s\) \['cpu'\] \(registered impls: "
                                         r"\['ppermute'\]; 'ffi' on cpu: native module not built \(test\)\)"):
        choose_lowering("ffi", ["cpu"])
    assert "ffi" in api.impls()  # still a valid impl name: it fails at lowering, saying why


@needs_ffi
def test_auto_takes_the_lowest_priority_that_can_run():
    assert choose_lowering("auto", ["cpu"]) is FFI_CPU
    assert choose_lowering("auto", ["cpu"], processes=2).name == "ppermute"  # ffi: one process only
    assert choose_lowering("auto", ["cpu", "tpu"]).name == "ppermute"       # ffi not on every platform
    with pytest.raises(BlinkError, match="impl='ffi' runs inside one process, but this mesh spans 2 processes .*"
                                         r"use impl='auto' or impl='hierarchical' \(native trees inside each "
                                         r"process, .*\) or impl='ppermute' \(rounds of collective_permute\)"):
        choose_lowering("ffi", ["cpu"], processes=2)


def test_a_registered_lowering_is_an_impl_and_auto_follows_priority(monkeypatch):
    pp = lowering.record("ppermute", "cpu")
    mine = dataclasses.replace(pp, name="mine", platform="cpu", auto_priority=-1, description="test")
    monkeypatch.setitem(lowering.LOWERINGS, "mine", {})
    lowering.register(mine)
    assert "mine" in api.impls() and api._impl("mine") == "mine"
    assert choose_lowering("mine", ["cpu"]) is mine and choose_lowering("auto", ["cpu"]) is mine
    assert choose_lowering("auto", ["cuda"]).name != "mine"
    monkeypatch.setitem(lowering.LOWERINGS, "mine", {"cpu": dataclasses.replace(mine, auto_allowed=lambda p: False)})
    assert choose_lowering("auto", ["cpu"]).name != "mine"


@pytest.mark.parametrize("step,sync", [(100e-6, True), (5e-6, False), (1e-3, False)])
def test_build_request_passes_the_record_costs_to_the_cost_model(monkeypatch, step, sync):
    seen = []
    real = costmodel.lowering_schedule

    def spy(plans, nelems, **kw):
        seen.append((kw["step_latency_s"], kw["round_synchronous"]))
        return real(plans, nelems, **kw)

    mine = dataclasses.replace(lowering.record("ppermute", "cpu"), name="costs", step_latency_s=step,
                               round_synchronous=sync)
    monkeypatch.setitem(lowering.LOWERINGS, "costs", {None: mine})
    monkeypatch.setattr(costmodel, "lowering_schedule", spy)
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    key = mapping.make_plan_key("dgx1v")
    build_request.cache_clear()
    req = build_request("allreduce", mesh, ("i",), None, None, key, 4096, 4, "cpu", "costs")
    assert seen == [(step, sync)] and len(req.schedules) == 1
    with pytest.raises(BlinkError, match="no lowering 'nope' is registered"):
        build_request("allreduce", mesh, ("i",), None, None, key, 4096, 4, "cpu", "nope")


def test_costmodel_knows_no_lowering_by_name():
    tree = ast.parse(pathlib.Path(costmodel.__file__).read_text())
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    # "hierarchical" is also a planner algorithm (the three-phase plan), which the cost model does name
    from jax_blink.planner.facade import ALGORITHMS
    lowerings = set(lowering.names()) - set(ALGORITHMS)
    assert lowerings >= {"ffi", "ppermute"} and not names & lowerings, names & lowerings
    for gone in ("STEP_LATENCY_S", "ROUND_SYNCHRONOUS", "step_latency"):
        assert not hasattr(costmodel, gone)


def test_each_primitive_has_every_rule():
    from jax._src.interpreters import ad, batching, mlir  # the test checks JAX's own tables

    prims = [primitives.blink_psum_p, primitives.blink_psum_invariant_p, primitives.blink_broadcast_p,
             primitives.blink_reduce_p, primitives.blink_all_gather_p, primitives.blink_reduce_scatter_p]
    for p in prims:
        assert p in ad.primitive_transposes and p in batching.fancy_primitive_batchers, p
        assert p in mlir._lowerings, p
