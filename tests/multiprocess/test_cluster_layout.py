"""Where a job comes from and how its processes lie on hosts: ``distributed.initialize``'s sources
(arguments, jax_blink.launch's variables, jax's cluster detection), ``group_hosts`` (processes grouped
by host: one per GPU, one per host, between) and a real 4-process job on the fake DGX-1V discovery
(``nvidia-smi topo -m`` from tests/data), one process per GPU, against lax."""

import json
import os
import pathlib

import pytest

from jax_blink import distributed, launch
from jax_blink.distributed import HostView, group_hosts
from jax_blink.errors import TopologyError
from jax_blink.topology import Topology, load_topology
from jax_blink.topology.presets import dgx1v

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(pathlib.Path(__file__).resolve().parent / "cluster_worker.py")
DGX1V_TOPO = ROOT / "tests" / "data" / "topologies" / "dgx1v_v100.txt"


def _clear_job_env(monkeypatch):
    for k in (launch.ENV_COORDINATOR, launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID, "JAX_COORDINATOR_ADDRESS",
              "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST",
              "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(k, raising=False)


def test_initialize_without_a_job_names_every_source(monkeypatch):
    _clear_job_env(monkeypatch)
    with pytest.raises(ValueError) as ei:
        distributed.initialize()
    msg = str(ei.value)
    for what in ("JAX_BLINK_COORDINATOR", "python -m jax_blink.launch", "SLURM", "Open MPI", "JAX_COORDINATOR_ADDRESS"):
        assert what in msg, msg


def test_launcher_variables_partly_set_name_the_missing_one(monkeypatch):
    _clear_job_env(monkeypatch)
    monkeypatch.setenv(launch.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(launch.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match=r"JAX_BLINK_PROCESS_ID is not set but JAX_BLINK_COORDINATOR, "
                                         r"JAX_BLINK_NUM_PROCESSES is"):
        distributed.initialize()
    monkeypatch.setenv(launch.ENV_PROCESS_ID, "2")
    with pytest.raises(ValueError, match=r"process_id \(JAX_BLINK_PROCESS_ID\) 2 is not in \[0, 2\)"):
        distributed.initialize()
    _clear_job_env(monkeypatch)
    with pytest.raises(ValueError, match="process_id not given"):
        distributed.initialize("127.0.0.1:1", 2)


def test_jax_cluster_detection_is_named(monkeypatch):
    """The name initialize reports for each launcher's variables (jax's own detectors decide)."""
    from jax_blink._jax_compat import detected_cluster

    _clear_job_env(monkeypatch)
    assert detected_cluster() is None
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "123.0;tcp://127.0.0.1:5555")
    assert detected_cluster() == "Open MPI"
    monkeypatch.delenv("OMPI_MCA_orte_hnp_uri")
    for k, v in (("SLURM_JOB_ID", "7"), ("SLURM_NTASKS", "2"), ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0"),
                 ("SLURM_STEP_NODELIST", "vm")):
        monkeypatch.setenv(k, v)
    assert detected_cluster() == "SLURM"


def test_collective_timeout_bounded_by_what_xla_parses(monkeypatch):
    monkeypatch.setenv(distributed.ENV_COLLECTIVE_TIMEOUT, str(2**31))
    with pytest.raises(ValueError, match=r"COLLECTIVE_TIMEOUT_S='2147483648': out of range; .*1\.\.2147483647"):
        distributed._collective_timeout(None)
    monkeypatch.setenv(distributed.ENV_COLLECTIVE_TIMEOUT, "30")
    assert distributed._collective_timeout(None) == 30


# ----------------------------------------------------------------------------- grouping by host
def _views(host_of, gpus_of, topo):
    return [HostView(h, topo, tuple(g), False) for h, g in zip(host_of, gpus_of)]


def test_one_process_per_gpu_on_two_hosts_is_two_nodes_of_eight():
    """16 processes, one per GPU of two DGX-1Vs (listed interleaved): two nodes, each the whole DGX-1V
    with its NVLinks, joined by the network; process p holds its GPU's place in its host."""
    host_of = [f"h{p % 2}" for p in range(16)]
    gpus_of = [[p // 2] for p in range(16)]
    nodes, hosts, node_of, pos = group_hosts(_views(host_of, gpus_of, dgx1v()))
    assert hosts == ["h0", "h1"] and node_of == [p % 2 for p in range(16)]
    assert pos == [[p // 2] for p in range(16)]
    assert all(n.fingerprint() == dgx1v().fingerprint() for n in nodes)
    topo = distributed.combine(nodes, 12.5, 1)
    assert topo.gpus == list(range(16)) and topo.bandwidth(0, 3) == dgx1v().bandwidth(0, 3)


def test_processes_sharing_a_host_keep_its_nvlinks():
    """Two processes holding GPUs 4,5 and 6,7 of one DGX-1V: one node = DGX-1V's GPUs 4-7 (not two
    nodes of two GPUs joined by a NIC)."""
    nodes, hosts, node_of, pos = group_hosts(_views(["a", "a"], [[6, 7], [4, 5]], dgx1v()))
    assert len(nodes) == 1 and node_of == [0, 0] and pos == [[2, 3], [0, 1]]
    ref = distributed._renumber(dgx1v().subset([4, 5, 6, 7]))
    assert nodes[0].fingerprint() == ref.fingerprint() and nodes[0].bandwidth(0, 3) > 0


def test_one_process_per_host_and_own_nodes():
    cpu = [HostView("vm", Topology.host(4), (0, 1, 2, 3), True) for _ in range(3)]
    nodes, hosts, node_of, pos = group_hosts(cpu)
    assert node_of == [0, 1, 2] and hosts == ["vm"] * 3 and pos == [[0, 1, 2, 3]] * 3


def test_two_processes_claiming_one_gpu_are_refused():
    with pytest.raises(TopologyError, match=r"processes 0 and 1 on host 'a' both hold GPU 3 .*JAX_BLINK_HOST"):
        group_hosts(_views(["a", "a"], [[2, 3], [3, 4]], dgx1v()))


def test_different_host_topologies_on_one_host_are_refused():
    views = [HostView("a", dgx1v(), (0,), False), HostView("a", Topology.host(8), (1,), False)]
    with pytest.raises(TopologyError, match=r"processes 0 and 1 on host 'a' see different host topologies"):
        group_hosts(views)


def test_host_view_places_visible_gpus_in_the_detected_machine(tmp_path, monkeypatch):
    """JAX_BLINK_NODE_TOPOLOGY=detect on the fake nvidia-smi (a DGX-1V): CUDA_VISIBLE_DEVICES=5,4 on two
    host devices -> GPUs 5 and 4 of the whole machine, not a renumbered two-GPU machine."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nif [ "$2" = "-m" ]; then cat "{DGX1V_TOPO}"; else exit 3; fi\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,4")
    monkeypatch.setenv(distributed.ENV_HOST, "fake-dgx")
    import jax

    v = distributed.host_view("detect", devices=jax.local_devices()[:2])
    assert (v.host, v.gpus, v.own_node, len(v.topology.gpus)) == ("fake-dgx", (5, 4), False, 8)
    assert v.topology.fingerprint() == load_topology(str(DGX1V_TOPO)).fingerprint()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(TopologyError, match="no CUDA_VISIBLE_DEVICES list of 2 GPUs"):
        distributed.host_view("detect", devices=jax.local_devices()[:2])


@pytest.mark.slow
def test_one_process_per_gpu_of_a_fake_dgx_matches_lax(tmp_path):
    """4 processes x 1 device on one host, each claiming one GPU (CUDA_VISIBLE_DEVICES=k, as SLURM's
    --gpus-per-task gives) of the fake nvidia-smi's DGX-1V: one node, DGX-1V's GPUs 0-3 with their
    NVLinks (not four one-GPU nodes joined by NICs), device of process k -> GPU k; psum / all_gather /
    psum_scatter on it equal lax bit for bit."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nif [ "$2" = "-m" ]; then cat "{DGX1V_TOPO}"; else exit 3; fi\n')
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "JAX_BLINK_NODE_TOPOLOGY": "detect"}
    res = launch.launch([WORKER, "collectives", "--claim-gpus"], 4, 1, timeout_s=240, env=env)
    ref = distributed._renumber(load_topology(str(DGX1V_TOPO)).subset([0, 1, 2, 3]))
    for p in res.processes:
        recs = {r["case"]: r for r in (json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT "))}
        j = recs["joined"]
        assert j["node_of_process"] == [0, 0, 0, 0] and j["hosts"] == [j["hosts"][0]], j
        assert j["node_fingerprint"] == ref.fingerprint() and j["topology_gpus"] == [0, 1, 2, 3], j
        assert j["gpus_of_process"] == {str(k): [k] for k in range(4)}, j
        for case in ("psum_i32", "psum_f32_integers", "all_gather_f32", "psum_scatter_i32"):
            assert recs[case]["bitwise_equal"], (p.process_id, recs[case])
        assert recs["psum_f32_random"]["max_abs_vs_lax"] <= 1e-5, recs["psum_f32_random"]
