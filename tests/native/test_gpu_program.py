"""The CUDA executor's device interpreter, checked on the CPU (ffi/src/device_interp.h, interp_plan.cc,
interp_host.cc): the same interpreter the kernel runs, with a thread per (rank, block) over host memory
and acquire/release flags.

Every preset and shared topology file, every collective, odd sizes, dtypes rotating, three peer layouts
(all peers; none: every cross-rank source staged; two halves), a bucket of odd leaves per plan and a
never-arriving rank per plan: outputs bitwise equal to ``schedule.execute`` under random delays over
two successive calls (epochs, no reset), the pipeline ratio within 1.1, and every peer of the absent
rank failing within the bound and naming it. The ThreadSanitizer run is in tests/native/test_sanitizers.py.
"""

import pytest

from jax_blink import _native, collectives
from jax_blink.lowering import gpu_program_check as g
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule
from jax_blink.topology.presets import PRESETS

pytestmark = pytest.mark.skipif(_native.cpu is None, reason="native CPU module not built")


@pytest.mark.slow
def test_every_program_bitwise_pipelined_and_times_out_naming_the_rank():
    t = g.run(seeds=1, layouts=("peer", "no-peer"), verbose=False, timeouts_every=7)
    assert t["failures"] == []
    cases = (len(PRESETS) + len(list(g.TOPOLOGY_DIR.glob("*.txt")))) * len(g.COLLECTIVES)
    # 2 layouts + one bucket per case, a never-arriving rank in every 7th
    absent = len(range(0, cases, 7))
    assert t["programs"] == cases * 3 + absent and t["bucketed"] == cases and t["timeouts_checked"] == absent
    assert g.COLLECTIVES == tuple(collectives.COLLECTIVES)
    assert t["mismatches"] == 0
    assert 0.5 < t["worst_ratio"] <= 1.1
    # fewer blocks than trees x phases: still correct, and the figure is a real (larger) number
    assert t["worst_capped"][0] == pytest.approx(t["worst_ratio"])
    assert t["worst_capped"][1] > t["worst_capped"][8] >= t["worst_capped"][0]


def _schedule(preset, collective, root=None, nelems=1031, chunk_elems=29):
    p = plan(PRESETS[preset](), collective, root=root)
    if collectives.get(collective).sharded:
        nelems -= nelems % len(p.devices)
    return build_schedule(p, nelems, chunk_elems=chunk_elems)


def test_interior_node_reduces_while_it_receives():
    """A chain (every node interior): a block per (tree, phase) lets chunk c+1 reduce while chunk c
    is forwarded, so the critical path is chunks + depth - 1 exactly."""
    s = build_schedule(plan(PRESETS["dgx1v"]().subset([0, 1, 2, 3]), "allreduce", algorithm="ring"), 4000,
                       chunk_elems=100)
    r = g.check_schedule(s, "int32", seeds=2)
    assert r["mismatched_seeds"] == 0 and r["error"] == ""
    assert r["critical_path"] == r["pipeline_ideal"]


@pytest.mark.parametrize("dtype", g.DTYPES)
def test_every_dtype_odd_size_staged_capped(dtype):
    s = _schedule("dgx1v", "allreduce", nelems=997, chunk_elems=61)
    r = g.check_schedule(s, dtype, layout="mixed", seeds=2, max_blocks=2, calls=2)
    assert r["mismatched_seeds"] == 0 and r["error"] == ""
    assert r["staging_elems"] > 0 and r["blocks"] == 2


ALIASING = {"none": lambda k: [0] * k, "every other": lambda k: [i % 2 for i in range(k)], "all": lambda k: [1] * k}


@pytest.mark.parametrize("collective", g.COLLECTIVES)
def test_bucket_of_odd_leaves_bitwise(collective):
    """Leaves of odd sizes (1 and 3 elements among them; 29-element chunks span them), every leaf a
    separate buffer, with none, every other and all leaves aliased, in the three layouts."""
    s = _schedule("dgx1v", collective, root=5 if collectives.get(collective).rooted else None)
    leaves = g.bucket_leaves(s.nelems)
    assert min(leaves) == 1 and len(leaves) > 10
    for k, (name, alias) in enumerate(ALIASING.items()):
        for layout in g.LAYOUTS:
            dtype = ("float32", "bfloat16", "int8", "complex128")[(k + len(layout)) % 4]
            r = g.check_schedule(s, dtype, layout=layout, seeds=2, leaves=leaves, aliased=alias(len(leaves)))
            assert r["error"] == "" and r["mismatched_seeds"] == 0, (collective, dtype, layout, name)
            assert r["leaves"] == len(leaves)


def test_bucket_pipelines_as_one_buffer():
    """A task cuts its chunk at leaf boundaries itself: a bucket's program is the one-buffer program."""
    s = _schedule("dgx-a100", "allreduce")
    one = g.check_schedule(s, "float32", seeds=1)
    bucket = g.check_schedule(s, "float32", seeds=1, leaves=g.bucket_leaves(s.nelems))
    for k in ("critical_path", "tasks", "flags", "dep_waits", "blocks"):
        assert bucket[k] == one[k], k


@pytest.mark.parametrize("absent", [0, 3, 7])
@pytest.mark.slow
def test_never_arriving_rank_fails_every_peer_naming_it(absent):
    import time
    s = _schedule("dgx1v", "allreduce")
    t0 = time.perf_counter()
    r = g.check_schedule(s, "float32", seeds=1, absent_rank=absent, timeout_ms=1000)
    took = time.perf_counter() - t0
    assert f"rank {absent} never arrived" in r["error"] and "timed out" in r["error"]
    for rank, (epoch, missing, waiting, _task) in enumerate(r["records"]):
        if rank != absent:
            assert (epoch, missing, waiting) == (1, absent, rank)
    assert took < 10  # bounded: 1.5 x the timeout, far from a hang


def test_non_blocking_watch_reports_the_missing_rank_while_kernels_run():
    """The CUDA executor's default error path (ErrorWatch): a host thread polls the pinned error records
    while the blocks run, never waiting for them; with a rank that never arrives it finds the
    blocking path's message (naming the rank; the ranks that gave up so far) before the last block
    thread ends (blocks waiting on ranks that did arrive give up only after their grace); a healthy run over two calls
    (epochs) finds nothing, and the outputs stay bitwise those of schedule.execute."""
    s = _schedule("dgx1v", "allreduce")
    r = g.check_schedule(s, "float32", seeds=1, absent_rank=5, timeout_ms=1000, watch=True)
    head = "jax_blink: collective timed out: rank 5 never arrived on the device within 1000 ms (ranks "
    assert r["watch_error"].startswith(head) and r["error"].startswith(head)
    gave_up = r["watch_error"][len(head):].split(" gave up")[0].split(", ")
    assert gave_up and set(gave_up) <= {"0", "1", "2", "3", "4", "6", "7"}
    assert r["watch_early"]
    ok = g.check_schedule(s, "float32", seeds=2, calls=2, watch=True)
    assert ok["watch_error"] == "" and ok["error"] == "" and ok["mismatched_seeds"] == 0


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex64", "complex128"])
def test_data_loop_moves_aligned_pieces_in_16_byte_words(dtype):
    """Where a piece's destination and sources are 16-byte aligned (chunks of 64 elements here: every
    buffer its own allocation, 16-byte aligned), the interpreter loads, adds and stores 16-byte words;
    the odd tail (4099 elements) and a bucket's unaligned leaves go one scalar at a time. Bitwise equal
    to schedule.execute either way (the same adds per element); staged sources too."""
    s = _schedule("dgx1v", "allreduce", nelems=4099, chunk_elems=64)
    for layout in ("peer", "no-peer"):
        r = g.check_schedule(s, dtype, seeds=2, layout=layout)
        assert r["error"] == "" and r["mismatched_seeds"] == 0
        assert r["wide_scalars"] > 0
    leaves = g.bucket_leaves(s.nelems, sizes=(7, 30, 1, 58))
    b = g.check_schedule(s, dtype, seeds=1, leaves=leaves)
    assert b["error"] == "" and b["mismatched_seeds"] == 0


def test_late_rank_is_waited_for():
    s = _schedule("dgx-h100", "allreduce")
    r = g.check_schedule(s, "float16", seeds=1, late_rank=2, late_ms=150, timeout_ms=5000, calls=2)
    assert r["error"] == "" and r["mismatched_seeds"] == 0


def test_bad_options_are_errors():
    s = _schedule("dgx1v", "allreduce")
    for leaves, match in (([1000, 30], "leaves hold 1030"), ([1031, 0], "no elements"), ([1032, -1], "no elements")):
        with pytest.raises(ValueError, match=match):
            g.check_schedule(s, "float32", leaves=leaves, seeds=1)
    with pytest.raises(ValueError, match="aliased"):
        g.check_schedule(s, "float32", leaves=[1000, 31], aliased=[1], seeds=1)
    with pytest.raises(ValueError, match="layout"):
        g.check_schedule(s, "float32", layout="one-gpu", seeds=1)


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
