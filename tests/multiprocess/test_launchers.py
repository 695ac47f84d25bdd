"""jax_blink under real cluster launchers on this machine: Open MPI's ``mpirun`` (Debian's openmpi-bin)
and a single-node SLURM's ``srun`` (Debian's slurmctld + slurmd + munge, started for the session by
``.ci/slurm/local-slurm`` from the repository's template and stopped by its pid files). One job per
launcher, 2 processes x 4 host devices, the program calling ``jax_blink.distributed.initialize()``
without arguments: jax's cluster detection finds the job (and initialize says so), jax_blink's psum /
all_gather / psum_scatter equal lax's bit for bit, then process 1 SIGKILLs itself in a loop of psums
and the launcher must end the job naming it.

``.ci/run`` installs the tools and sets ``JAX_BLINK_REQUIRE_TOOLS=1``: a missing tool (or SLURM that
does not come up) then fails these tests; elsewhere they skip saying what to install.
"""

import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(pathlib.Path(__file__).resolve().parent / "cluster_worker.py")
LOCAL_SLURM = ROOT / ".ci" / "slurm" / "local-slurm"
CASES = ("psum_i32", "psum_f32_integers", "all_gather_f32", "psum_scatter_i32")


def _unavailable(why: str):
    if os.environ.get("JAX_BLINK_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{why}; .ci/run installs openmpi-bin, slurmctld, slurmd, slurm-client and munge (Debian)")
    pytest.skip(f"{why} (Debian: apt-get install openmpi-bin slurmctld slurmd slurm-client munge; run as root); "
                "CI runs this test")


def _need(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        _unavailable(f"{', '.join(missing)} not installed")


def _job_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_BLINK_", "SLURM_", "OMPI_", "PMIX_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a single-node SLURM started for this module (stopped, by pid files, at its end)."""
    _need("munged", "slurmctld", "slurmd", "srun", "sinfo")
    if os.geteuid() != 0:
        _unavailable("the single-node SLURM's slurmd must run as root")
    state = tmp_path_factory.mktemp("slurm")
    # one single-node SLURM on the machine at a time (.ci/run runs the two jax ends side by side: both
    # slurmd would register the same node name)
    lock = open(pathlib.Path(tempfile.gettempdir()) / f"jax_blink_slurm_{os.getuid()}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        out = subprocess.run([str(LOCAL_SLURM), "start", str(state)], capture_output=True, text=True, timeout=90)
        if out.returncode != 0:
            _unavailable(f"SLURM did not start: {out.stderr.strip()[-1500:]}")
        conf = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
        yield conf
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop", str(state)], capture_output=True, timeout=60)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge-dir"):
            assert not (state / pid_file).exists(), f"{pid_file} left behind"


def _check(out: subprocess.CompletedProcess, source: str, killed_named: str):
    text = out.stdout + out.stderr
    per = {}
    decoder = json.JSONDecoder()
    for ln in out.stdout.splitlines():
        for part in ln.split("RESULT ")[1:]:  # a launcher may still join two ranks' lines
            r, _ = decoder.raw_decode(part)
            per.setdefault(r["case"], []).append(r)
    assert len(per.get("done", [])) == 2, text[-4000:]
    assert {r["source"] for r in per["joined"]} == {source}, per["joined"]
    assert f"jax_blink.distributed: 2 process(es) joined through {source}" in out.stderr, out.stderr[-3000:]
    assert all(r["topology"] == "2xhost4" and r["processes"] == 2 for r in per["joined"]), per["joined"]
    for case in CASES:
        assert [r["bitwise_equal"] for r in per[case]] == [True, True], (case, per[case])
    assert all(r["max_abs_vs_lax"] <= 1e-5 for r in per["psum_f32_random"]), per["psum_f32_random"]
    # the fault case: process 1 SIGKILLed itself; the job ended (not the test's timeout) naming it
    assert out.returncode != 0 and "survived" not in out.stdout, text[-3000:]
    assert "injecting fault 'kill' during" in out.stdout, text[-3000:]
    assert killed_named in text, text[-3000:]


def test_srun_runs_jax_blink_equal_to_lax_and_names_a_killed_task(slurm):
    env = {**_job_env(), "SLURM_CONF": slurm}
    out = subprocess.run(["srun", "-n", "2", "--overcommit", "--kill-on-bad-exit=1", "--label", sys.executable,
                          WORKER, "collectives", "--kill", "--heartbeat", "3"], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    _check(out, "SLURM (jax's cluster detection)", "task 1: Killed")


def test_mpirun_runs_jax_blink_equal_to_lax_and_names_a_killed_rank():
    _need("mpirun")
    cmd = ["mpirun", "--oversubscribe", "-n", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    for k in ("JAX_PLATFORMS", "XLA_FLAGS", "PYTHONPATH", "PYTHONUNBUFFERED"):
        cmd += ["-x", k]
    out = subprocess.run([*cmd, sys.executable, WORKER, "collectives", "--kill", "--heartbeat", "3"],
                         capture_output=True, text=True, timeout=240, env=_job_env(), cwd=ROOT)
    _check(out, "Open MPI (jax's cluster detection)", "process rank 1")
    assert "exited on signal 9" in out.stdout + out.stderr, out.stderr[-3000:]
