"""A failing process is named by its peers by default (jax_blink.faults), 2 processes x 2 host
devices under jax_blink.launch: the last process raises, calls sys.exit(3), SIGKILLs itself or stalls,
before its first psum or at step 3 of a loop of psums, while process 0 runs the loop. Every job must
end by itself (never by the launcher's watchdog), within a bound from the fault, and the launcher's
summary must name process 1 first with its own error."""

import json
import os
import pathlib
import re
import socket

import pytest

from jax_blink import launch

WORKER = str(pathlib.Path(__file__).resolve().parent / "cluster_worker.py")


def _fault_job(how: str, when: str, *extra: str, env: dict | None = None):
    """(LaunchError, seconds from the injected fault to the survivor's end)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_BLINK_")}
    base.update(env or {})
    with pytest.raises(launch.LaunchError) as ei:
        launch.launch([WORKER, "fault", "--how", how, "--when", when, "--heartbeat", "3", *extra], 2, 2,
                      timeout_s=150, grace_s=60, env=base)
    res = ei.value.result
    victim, survivor = res.processes[1], res.processes[0]
    m = re.search(r"injecting fault '\w+' \w+ the collectives at ([\d.]+) s", victim.stdout)
    assert m, victim.stdout[-2000:] + victim.stderr[-2000:]
    # the worker's clock starts a moment after the launcher started it: a bound, not an exact time
    after = survivor.wall_s - float(m.group(1))
    assert not survivor.killed_by_watchdog and not victim.killed_by_watchdog, str(ei.value)
    assert survivor.returncode != 0, survivor.stderr[-2000:]
    return ei.value, after


def _peer_failed_line(p, victim: int, what: str) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(launch.PEER_FAILED)]
    assert lines, p.stderr[-3000:]
    host = re.escape(socket.gethostname())
    assert re.match(rf"{re.escape(launch.PEER_FAILED)} process {victim} of 2 \(host {host}, pid \d+\) failed: "
                    rf"{what}", lines[0]), lines[0]
    return lines[0]


def test_raise_before_the_collective_fails_the_peer_fast_naming_it():
    """Default settings: process 1 raises before its first psum while process 0 waits in it; process
    0 stops within 15 s naming process 1, its host and its exception (without the fault watch: 66 s,
    the shutdown barrier's timeout, naming no one)."""
    err, after = _fault_job("raise", "before")
    assert after <= 15, (after, str(err))
    survivor, victim = err.result.processes
    line = _peer_failed_line(survivor, 1,
                             r"RuntimeError: injected fault in process 1 \(at cluster_worker\.py:\d+ in fail\)")
    assert "process 0 stops too" in line, line
    assert victim.returncode == 1 and "RuntimeError: injected fault in process 1" in victim.stderr
    msg = str(err)
    assert re.search(r"process 1 of 2 failed first \(exit code 1 after [\d.]+ s\): RuntimeError: injected fault "
                     r"in process 1\n  then process 0 failed \(exit code 1 ", msg), msg


@pytest.mark.slow
def test_raise_during_collectives_when_the_program_joined_with_jax_itself():
    """The program calls jax.distributed.initialize() itself (not jax_blink's): the watch starts at
    cluster_topology(), and a raise at step 3 stops process 0 in its psum the same way."""
    err, after = _fault_job("raise", "during", "--jax-init")
    assert after <= 15, (after, str(err))
    survivor, victim = err.result.processes
    recs = [json.loads(ln[7:]) for ln in survivor.stdout.splitlines() if ln.startswith("RESULT ")]
    assert {"case": "step0", "value": 4.0} == {k: recs[1][k] for k in ("case", "value")}, recs
    assert recs[0]["source"] == "the program's jax.distributed.initialize()", recs[0]
    _peer_failed_line(survivor, 1, r"RuntimeError: injected fault in process 1")
    assert "process 1 of 2 failed first (exit code 1" in str(err), str(err)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "during"])
def test_sys_exit_3_is_named_with_its_code(when):
    err, after = _fault_job("exit", when)
    assert after <= 15, (after, str(err))
    survivor, victim = err.result.processes
    _peer_failed_line(survivor, 1, r"SystemExit: sys\.exit\(3\) \(at cluster_worker\.py:\d+ in fail\)")
    assert victim.returncode == 3
    assert re.search(r"process 1 of 2 failed first \(exit code 3 after [\d.]+ s\): SystemExit: process 1 of 2 "
                     r"exits with sys\.exit\(3\) at cluster_worker\.py:\d+ in fail", str(err)), str(err)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "during"])
def test_sigkill_ends_the_job_through_the_heartbeat(when):
    """A SIGKILLed process publishes nothing: jax.distributed's heartbeat (3 s here) or gloo's broken
    connection ends process 0 by itself; the launcher names process 1 and its signal first."""
    err, after = _fault_job("kill", when)
    assert after <= 25, (after, str(err))
    survivor, victim = err.result.processes
    assert victim.returncode == -9
    # jax's service, or gloo seeing the socket go: "reset" or (jax 0.12 under load) "closed" by peer
    assert any(m in survivor.stderr for m in ("another task died", "Connection reset by peer",
                                              "Connection closed by peer", "unhealthy")), survivor.stderr[-3000:]
    assert re.search(r"process 1 of 2 failed first \(signal SIGKILL after [\d.]+ s\)", str(err)), str(err)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "during"])
def test_stalled_process_is_named_where_it_stalls(when):
    """Process 1 sleeps instead of calling psum (JAX_BLINK_TIMEOUT_S=3, collective timeout 6 s): after
    3 s at one instruction process 0 prints where each process's main thread is (process 1: in the
    worker's fail(), its sleep); the collective's timeout then raises in process 0 (before the first
    call: gloo's own 30 s context set-up), and the stalled process 1 stops naming process 0's error."""
    err, after = _fault_job("stall", when, env={"JAX_BLINK_TIMEOUT_S": "3", "JAX_BLINK_COLLECTIVE_TIMEOUT_S": "6",
                                                "STALL_S": "120"})
    assert after <= (45 if when == "before" else 20), (after, str(err))
    survivor, victim = err.result.processes
    where = [ln for ln in survivor.stderr.splitlines() if ln.startswith("jax_blink: process 0 of 2 has been at")]
    assert where, survivor.stderr[-3000:]
    assert re.search(r"has been at cluster_worker\.py:\d+ in <module> for \d+ s \(JAX_BLINK_TIMEOUT_S=3\); where the "
                     r"others are: process 1 at cluster_worker\.py:\d+ in fail for [\d.]+ s", where[0]), where[0]
    assert "Timed out" in survivor.stderr or "timed out" in survivor.stderr, survivor.stderr[-3000:]
    _peer_failed_line(victim, 0, r"JaxRuntimeError: ")
    msg = str(err)
    assert re.search(r"process 0 of 2 failed first \(exit code 1 after [\d.]+ s\): jax\.errors\.JaxRuntimeError",
                     msg), msg
