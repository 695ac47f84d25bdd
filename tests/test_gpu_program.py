"""The CUDA executor's GPU program, checked on the CPU (ffi/src/gpu_program.cc, gpu_emulator.cc).

Every preset and shared topology file, every collective (all-gather and reduce-scatter included), odd
sizes, every dtype across the set, three layouts (GPU per rank with peer access; all ranks on one GPU
with 8 streams; no peer access, staged reduces): zero races, outputs bitwise equal to ``schedule.execute`` under random
stream timings, and the critical path within 1.1 x (chunks + depth - 1). Mutations: dropping any one
wait or record makes the checker report a race. Buckets: the same over several leaves (odd sizes,
chunks spanning leaves, aliased leaves), every leaf a separate buffer. The CUDA executor's program
cache: bounded by call site, never freeing a program whose work may still run.
"""

import numpy as np
import pytest

from jax_blink import _native, collectives
from jax_blink.lowering import gpu_program_check as g
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule
from jax_blink.topology.presets import PRESETS

pytestmark = pytest.mark.skipif(_native.cpu is None, reason="native CPU module not built")


def test_every_program_race_free_bitwise_and_pipelined():
    t = g.run(seeds=4, verbose=False)
    assert t["failures"] == []
    # 10 presets + 5 topology files, 5 collectives, 3 layouts + one bucket of leaves each
    cases = (len(PRESETS) + len(list(g.TOPOLOGY_DIR.glob("*.txt")))) * len(g.COLLECTIVES)
    assert t["programs"] == cases * 4 and t["bucketed"] == cases
    assert g.COLLECTIVES == tuple(collectives.COLLECTIVES)
    assert t["races"] == 0 and t["mismatches"] == 0
    assert 0.5 < t["worst_ratio"] <= 1.1


def _schedule(preset, collective, root=None, nelems=1031, chunk_elems=29):
    p = plan(PRESETS[preset](), collective, root=root)
    if collectives.get(collective).sharded:
        nelems -= nelems % len(p.devices)
    return build_schedule(p, nelems, chunk_elems=chunk_elems)


@pytest.mark.parametrize("preset,collective,root,layout", [
    ("pcie-2socket", "reduce", 7, "no-peer"),    # staged reduces through scratch
    ("dgx-h100", "broadcast", 3, "one-gpu"),      # 8 ranks on one device, 8 streams
    ("dgx-a100", "allreduce", None, "peer"),
    ("dgx1v", "allgather", None, "peer"),
    ("pcie-2socket", "reducescatter", None, "no-peer"),
])
def test_dropping_any_wait_or_record_is_a_race(preset, collective, root, layout):
    s = _schedule(preset, collective, root)
    base = g.check_schedule(s, "float32", layout=layout, seeds=1)
    assert base["races"] == 0 and base["mismatched_seeds"] == 0
    data_caught = 0
    for kind, count in (("wait", base["waits"]), ("record", base["records"])):
        assert count > 0
        for i in range(count):
            r = g.check_schedule(s, "float32", layout=layout, seeds=2, mutate=(kind, i))
            assert r["races"] > 0, f"dropping {kind} {i} went unnoticed"
            assert "race on" in r["race_info"]
            data_caught += r["mismatched_seeds"] > 0
    # the emulator is a real executor: many of these races also show up as wrong bits
    assert data_caught > 0


def test_interior_node_reduces_while_it_receives():
    """A chain (every node interior): R and B streams per node let chunk c+1 reduce while chunk c
    broadcasts, so the critical path is chunks + depth - 1 exactly."""
    s = build_schedule(plan(PRESETS["dgx1v"]().subset([0, 1, 2, 3]), "allreduce", algorithm="ring"), 4000,
                       chunk_elems=100)
    r = g.check_schedule(s, "int32", layout="peer", seeds=3)
    assert r["races"] == 0 and r["mismatched_seeds"] == 0
    assert r["critical_path"] == r["segment_chunks"] + r["chunk_depth"] - 1


@pytest.mark.parametrize("dtype", g.DTYPES)
def test_every_dtype_odd_size_one_gpu_staged(dtype):
    s = _schedule("dgx1v", "allreduce", nelems=997, chunk_elems=61)
    r = g.check_schedule(s, dtype, layout="no-peer", seeds=3, max_streams=2)
    assert r["races"] == 0 and r["mismatched_seeds"] == 0 and r["emulator_error"] == ""
    assert r["scratch_buffers"] > 0


def test_bad_options_are_errors():
    from jax_blink._native import _gpusim

    s = _schedule("dgx1v", "allreduce")
    with pytest.raises(ValueError, match="rank_device"):
        _gpusim.gpu_program_check(np.asarray(s.to_array(), np.int64), "float32", [], [], [0, 1], [], 0, 1, ("", 0))
    for leaves, match in (([1000, 30], "leaves hold 1030"), ([1031, 0], "no elements"), ([1032, -1], "no elements")):
        with pytest.raises(ValueError, match=match):
            g.check_schedule(s, "float32", leaves=leaves, seeds=1)
    with pytest.raises(ValueError, match="leaf_aliased"):
        g.check_schedule(s, "float32", leaves=[1000, 31], aliased=[1], seeds=1)


ALIASING = {"none": lambda k: [0] * k, "every other": lambda k: [i % 2 for i in range(k)], "all": lambda k: [1] * k}


@pytest.mark.parametrize("collective", g.COLLECTIVES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "complex128"])
def test_bucket_of_odd_leaves_race_free_bitwise(collective, dtype):
    """Leaves of odd sizes (1 and 3 elements among them; 29-element chunks span them), every leaf a
    separate buffer, with none, every other and all leaves aliased, in the three layouts."""
    s = _schedule("dgx1v", collective, root=5 if collectives.get(collective).rooted else None)
    leaves = g.bucket_leaves(s.nelems)
    assert min(leaves) == 1 and len(leaves) > 10
    for name, alias in ALIASING.items():
        for layout in g.LAYOUTS:
            r = g.check_schedule(s, dtype, layout=layout, seeds=3, leaves=leaves, aliased=alias(len(leaves)))
            label = f"{collective} {dtype} {layout} aliased {name}"
            assert r["emulator_error"] == "" and r["races"] == 0 and r["mismatched_seeds"] == 0, (label, r["race_info"])
            assert r["leaves"] == len(leaves) and r["continued_pieces"] > 0, label  # chunks do span leaves


def test_bucket_pipelines_as_one_buffer():
    """A chunk cut by a leaf boundary costs one step (its pieces are issued back to back): the
    critical path of a bucket equals the one-buffer program's."""
    s = _schedule("dgx-a100", "allreduce")
    one = g.check_schedule(s, "float32", seeds=1)
    bucket = g.check_schedule(s, "float32", seeds=1, leaves=g.bucket_leaves(s.nelems))
    assert bucket["critical_path"] == one["critical_path"]
    assert (bucket["waits"], bucket["records"]) == (one["waits"], one["records"])
    assert bucket["memory_ops"] == one["memory_ops"] + bucket["continued_pieces"]


@pytest.mark.parametrize("collective,layout,aliasing", [
    ("allreduce", "peer", "every other"),
    ("reduce", "no-peer", "all"),          # staged pieces through scratch, in place
    ("allgather", "one-gpu", "none"),
])
def test_dropping_any_wait_or_record_of_a_bucket_is_a_race(collective, layout, aliasing):
    p = plan(PRESETS["pcie-2socket"]().subset([0, 1, 2, 3]), collective, root=3 if collective == "reduce" else None)
    s = build_schedule(p, 404, chunk_elems=29)
    leaves = g.bucket_leaves(s.nelems, sizes=(7, 30, 1, 58))
    alias = ALIASING[aliasing](len(leaves))
    base = g.check_schedule(s, "float32", layout=layout, seeds=1, leaves=leaves, aliased=alias)
    assert base["races"] == 0 and base["mismatched_seeds"] == 0 and base["continued_pieces"] > 0
    for kind, count in (("wait", base["waits"]), ("record", base["records"])):
        assert count > 0
        for i in range(count):
            r = g.check_schedule(s, "float32", layout=layout, seeds=1, mutate=(kind, i), leaves=leaves, aliased=alias)
            assert r["races"] > 0, f"dropping {kind} {i} went unnoticed"


# ------------------------------------------------------------------------------ program cache
def _trace(max_sites, events):
    from jax_blink._native import _gpusim
    return _gpusim.program_cache_trace(max_sites, [(e[0], e[1], e[2] if len(e) > 2 else "k") for e in events])


def test_program_cache_capacity_from_env():
    from jax_blink._native import _gpusim
    assert _gpusim.program_cache_capacity("") == 64       # documented default
    assert _gpusim.program_cache_capacity("3") == 3
    for bad in ("0", "-2", "x", "3x", "2000000"):
        assert _gpusim.program_cache_capacity(bad) == 64


def test_program_cache_evicts_least_recently_used_call_site():
    log = _trace(2, [("call", 1), ("call", 2), ("call", 1), ("call", 3),   # 2 is the LRU: evicted
                     ("finish", 1), ("finish", 2), ("finish", 3), ("call", 1), ("call", 2)])
    assert log == ["build 1/k", "build 2/k", "build 3/k", "release 2/k",   # freed at the next call
                   "build 2/k", "sites 2", "retired 1"]                    # 3 evicted by 2, not released


def test_program_cache_never_frees_work_in_flight():
    # site 1 is evicted while its call still runs: it stays until its work completed
    log = _trace(1, [("call", 1), ("call", 2), ("call", 3), ("call", 3), ("finish", 2), ("call", 3),
                     ("finish", 1), ("call", 3)])
    assert log == ["build 1/k", "build 2/k", "build 3/k", "release 2/k", "release 1/k", "sites 1", "retired 0"]


def test_program_cache_keeps_every_program_of_a_site_together():
    # programs of one site (groups, dtypes, leaf layouts) go together, counted as one site
    log = _trace(2, [("call", 1, "g0"), ("call", 1, "g1"), ("call", 2, "g0"), ("call", 1, "g0"), ("call", 3, "g0"),
                     ("finish", 2, "g0"), ("call", 3, "g0")])
    assert log == ["build 1/g0", "build 1/g1", "build 2/g0", "build 3/g0", "release 2/g0", "sites 2", "retired 0"]
    log = _trace(1, [("call", 1, "g0"), ("call", 1, "g1"), ("call", 2, "g0"), ("finish", 1, "g1"), ("call", 2, "g0"),
                     ("finish", 1, "g0"), ("call", 2, "g0")])
    assert log == ["build 1/g0", "build 1/g1", "build 2/g0", "release 1/g1", "release 1/g0", "sites 1", "retired 0"]
