"""The hierarchical lowering (native executor inside each process, XLA's collective between them;
Blink, MLSys 2020, section 5): which lowering impl="auto" picks across processes, the layout rules,
and real jax.distributed jobs on 127.0.0.1 with gloo (2x4, 4x2, 3x2, 2x3 processes x local devices;
one job per shape, every case inside it: tests/multiprocess/hierarchical_worker.py), a process that never calls."""

import json
import os
import pathlib
import time

import pytest

import jax_blink.api  # noqa: F401,I001  (registers the lowerings)
from jax_blink import launch
from jax_blink import lowering as _lowering
from jax_blink.dispatch import choose_lowering
from jax_blink.lowering import hierarchical

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "multiprocess" / "hierarchical_worker.py")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _site(nproc, local, groups=None):
    process_of = tuple(p // local for p in range(nproc * local))
    groups = groups if groups is not None else (tuple(range(nproc * local)),)
    return _lowering.Site(processes=nproc, groups=tuple(map(tuple, groups)), process_of=process_of)


# ----------------------------------------------------------------------------- choice of lowering
def test_auto_across_processes_picks_hierarchical_with_two_or_more_devices_per_process():
    assert choose_lowering("auto", ["cpu"], 2, site=_site(2, 4)).name == "hierarchical"
    assert choose_lowering("auto", ["cpu"], 3, site=_site(3, 2)).name == "hierarchical"
    # one device of the group per process: no intra-node phase, the tree schedule on ppermute
    cols = [tuple(range(j, 8, 4)) for j in range(4)]
    assert choose_lowering("auto", ["cpu"], 2, site=_site(2, 4, cols)).name == "ppermute"
    # inside one process the native executor runs it all
    assert choose_lowering("auto", ["cpu"], 1).name == "ffi"


def test_fits_says_why_not():
    assert hierarchical.fits(None).startswith("the mesh lies in one process")
    assert "one device of each group per process" in hierarchical.fits(_site(4, 1))
    uneven = _site(2, 4, [(0, 1, 2, 4), (3, 5, 6, 7)])
    assert "devices in its processes" in hierarchical.fits(uneven)
    assert choose_lowering("auto", ["cpu"], 2, site=uneven).name == "ppermute"
    assert hierarchical.fits(_site(2, 4)) is None


def test_one_device_per_process_the_cost_model_decides():
    import dataclasses
    times = {"hierarchical": 1e-3, "ppermute": 2e-3}
    site = dataclasses.replace(_site(4, 1), estimate=times.__getitem__)
    assert hierarchical.fits(site) is None  # XLA's collective alone is predicted faster
    assert choose_lowering("auto", ["cpu"], 4, site=site).name == "hierarchical"
    times["hierarchical"] = 3e-3
    why = hierarchical.fits(site)
    assert "2000.0 us predicted" in why and "3000.0 us" in why, why
    assert choose_lowering("auto", ["cpu"], 4, site=site).name == "ppermute"


def test_a_root_at_different_places_stays_on_ppermute():
    import dataclasses
    # group 0 = (0, 1, 4, 5), group 1 = (7, 6, 3, 2): rank 0 sits in process 0 resp. process 1
    site = dataclasses.replace(_site(2, 4, [(0, 1, 4, 5), (7, 6, 3, 2)]), root=0)
    assert "root lies at different" in hierarchical.fits(site)
    assert hierarchical.fits(dataclasses.replace(site, root=None)) is None


def test_layout_problem_shapes():
    po = tuple(p // 2 for p in range(8))
    assert hierarchical.layout_problem([(0, 1, 2, 3), (4, 5, 6, 7)], po) is None   # 2 x 2 each
    assert "different (processes, devices per process)" in hierarchical.layout_problem(
        [(0, 1, 2, 3), (4, 6)], po)


def test_explicit_hierarchical_is_multi_process_capable():
    rec = choose_lowering("hierarchical", ["cpu"], 4)
    assert rec.name == "hierarchical" and rec.multi_process and rec.shard_input and rec.shard_output


# ----------------------------------------------------------------------------- real jobs
def _records(res):
    out = []
    for p in res.processes:
        out.append({r["case"]: r for r in (json.loads(ln[7:]) for ln in p.stdout.splitlines()
                                           if ln.startswith("RESULT "))})
    return out


def _tolerance(case, dtype_name, magnitude, n):
    if case.endswith("bf16"):
        return 2.0 ** -7 * max(magnitude, 1.0) * n
    if "f16" in case:
        return 2.0 ** -10 * max(magnitude, 1.0) * n
    return 1e-6 * max(magnitude, 1.0) * n


@pytest.mark.slow
@pytest.mark.parametrize("nproc,local", [(2, 4), (4, 2), (3, 2), (2, 3)])
def test_every_collective_matches_lax_across_processes(nproc, local):
    # a correctness run: a heartbeat timeout a loaded 2-core CI (both jax ends at once) cannot reach
    res = launch.launch([WORKER, "check", "--heartbeat", "60"], nproc, local, timeout_s=300, env=_env())
    per = _records(res)
    n = nproc * local
    for p, recs in enumerate(per):
        assert "done" in recs, f"process {p} did not finish: {res.processes[p].stderr[-2000:]}"
        cases = [c for c in recs if "/" in c]
        assert len(cases) >= 25, cases
        for c in cases:
            r = recs[c]
            assert r["bitwise_in_group"], (p, r)  # the three phases give every rank the same bits
            if r["dtype"].startswith("int") or c.split("/")[1].startswith(("ag", "bcast")):
                assert r["exact_vs_lax"], (p, r)  # integers, copies and broadcasts are exact
            else:
                assert r["max_abs_vs_lax"] <= _tolerance(c, r["dtype"], r["magnitude"], n), (p, r)
        # impl="auto" ran the hierarchical lowering on the flat mesh: native calls + XLA collectives,
        # no collective_permute
        for c in cases:  # one program in every process (the local phases list every process's groups)
            assert recs[c]["program_sha"] == per[0][c]["program_sha"], (p, c)
        flat = recs["flat/psum_f32"]
        assert flat["custom_call"] > 0 and flat["all_reduce"] > 0 and flat["collective_permute"] == 0, flat
        assert flat["all_gather"] > 0, flat
        # psum_scatter between processes on CPU: an all-to-all and a sum, never gloo's reduce-scatter
        # (it stalls in ~45 ms steps and slows the collectives after it: lowering/hierarchical.py)
        assert flat["reduce_scatter"] == 0 and flat["all_to_all"] > 0, flat
        # the CPU executor puts the blocks in rank order itself: no XLA reorder (a gather) of them
        assert flat["gather"] == 0, flat
        # 2-D mesh: where the collective axis "a" has one device per process -> ppermute; 2x4 (two per
        # process) -> hierarchical everywhere
        grid = recs["grid/psum_a"]
        if local % 2 == 0 and local // 2 >= 2:
            assert grid["collective_permute"] == 0 and grid["all_reduce"] > 0, grid
        else:
            assert grid["collective_permute"] > 0, grid
    if (nproc, local) == (2, 4):
        # the GPU shape: native CUDA calls inside each process, one XLA all-reduce whose replica
        # groups are the partitions (the same local position in every process)
        for recs in per:
            cuda = recs["cuda_hlo"]
            assert cuda["native_calls"] == 2 and cuda["cpu_calls"] == 0, cuda  # reduce-scatter + all-gather
            assert cuda["all_reduce"] == 1 and cuda["collective_permute"] == 0, cuda
            assert cuda["replica_groups"] == [[[0, 4], [1, 5], [2, 6], [3, 7]]], cuda


@pytest.mark.slow
def test_a_process_that_never_calls_fails_its_peers():
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchError) as ei:
        launch.launch([WORKER, "absent"], 2, 2, timeout_s=120, grace_s=5,
                      env=_env(JAX_BLINK_COLLECTIVE_TIMEOUT_S="8"))
    res = ei.value.result
    survivor = _records(res)[0]
    assert "absent_failed" in survivor, res.processes[0].stderr[-3000:]
    failed = survivor["absent_failed"]
    assert failed["seconds"] < 8 + 20, failed  # the collective timeout, not the launcher's
    assert "Timed out" in failed["message"], failed
    assert not res.processes[0].killed_by_watchdog
    assert time.monotonic() - t0 < 110


# ----------------------------------------------------------------------------- cost model
def test_cost_model_knows_the_three_process_phases():
    from jax_blink import costmodel, plan
    from jax_blink.topology import Topology
    from jax_blink.topology.presets import multi_node

    topo = multi_node(Topology.host(4), 2, 12.5)
    S = 64 << 20
    ar = costmodel.process_phases(topo, "allreduce", S)
    # 2 nodes: a ring all-reduce moves 2 (P-1)/P S = S through each node's NIC, in 2 (P-1) = 2 steps
    assert ar.nodes == 2 and ar.per_node == 4 and ar.nic_gbps == 12.5
    assert ar.network_s == S / 12.5e9 + 2 * costmodel.NETWORK_STEP_S
    ag = costmodel.process_phases(topo, "allgather", S)
    assert ag.network_s == S / 2 / 12.5e9 + costmodel.NETWORK_STEP_S
    assert 0 < ar.local_s and 0 < ag.local_s < ar.local_s  # one local phase instead of two
    # one node: no network phase, the lowering does not apply
    assert costmodel.process_phases(Topology.host(4), "allreduce", S) is None
    # plan(nbytes=) on a multi-node topology says what a multi-process job runs
    p = plan(topo, "allreduce", nbytes=S)
    assert any("impl='hierarchical'" in n and "network" in n for n in p.notes), p.notes
