"""The CUDA executor's GPU program, checked on the CPU (ffi/src/gpu_program.cc, gpu_emulator.cc).

Every preset and shared topology file, every collective (all-gather and reduce-scatter included), odd
sizes, every dtype across the set, three layouts (GPU per rank with peer access; all ranks on one GPU
with 8 streams; no peer access, staged reduces): zero races, outputs bitwise equal to ``schedule.execute`` under random
stream timings, and the critical path within 1.1 x (chunks + depth - 1). Mutations: dropping any one
wait or record makes the checker report a race.
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
    # 10 presets + 5 topology files, 5 collectives, 3 layouts
    assert t["programs"] == (len(PRESETS) + len(list(g.TOPOLOGY_DIR.glob("*.txt")))) * len(g.COLLECTIVES) * 3
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
    s = _schedule("dgx1v", "allreduce")
    with pytest.raises(ValueError, match="rank_device"):
        _native.cpu.gpu_program_check(np.asarray(s.to_array(), np.int64), "float32", [], [], [0, 1], [], 0, 1,
                                      ("", 0))
