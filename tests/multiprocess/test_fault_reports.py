"""What the launcher's summary and jax_blink.faults say, without starting processes: each process's
first real error (its own exception before jax's abort line and before a peer's failure) and the
JAX_BLINK_FAULTS switch."""

import pytest

from jax_blink import faults, launch


def _proc(pid, rc, stderr, wall):
    return launch.ProcessResult(pid, rc, "", stderr, wall)


ABORT = ("F1204 23:01:24.195883   14994 client.h:80] Terminating process because the JAX distributed service "
         "detected fatal errors. This most likely indicates that another task died")


def test_error_line_is_the_first_real_exception():
    stderr = "\n".join(["Traceback (most recent call last):", '  File "w.py", line 3, in <module>',
                        "RuntimeError: the cause", "", "During handling of the above exception, another occurred:",
                        "ValueError: while handling it", "E1204 12:00:00.000 x.cc:1] an error log line", ABORT])
    assert _proc(0, 1, stderr, 1.0).error_line() == "RuntimeError: the cause"
    assert _proc(0, -6, f"E1204 12:00:00.000 x.cc:1] first\n{ABORT}", 1.0).error_line().startswith("F1204")
    assert _proc(0, 3, "SystemExit: process 1 of 2 exits with sys.exit(3) at w.py:9 in main",
                 1.0).error_line().startswith("SystemExit: process 1")
    assert _proc(0, 1, "", 1.0).error_line() == "(no output on stderr)"


def test_summary_names_the_process_that_failed_by_itself_first():
    peer = (f"{launch.PEER_FAILED} process 1 of 2 (host h, pid 7) failed: RuntimeError: boom (at w.py:5 in f); "
            "process 0 stops too")
    own = "Traceback (most recent call last):\nRuntimeError: boom\n" + ABORT
    # process 0 (stopped by its peer) ended before process 1: process 1 is still named first
    res = launch.LaunchResult([_proc(0, 1, peer, 6.0), _proc(1, 1, own, 6.2)], "127.0.0.1:1", 7.0)
    msg = launch._failure_message(res, 60, 20)
    assert msg.splitlines()[1] == "process 1 of 2 failed first (exit code 1 after 6.2 s): RuntimeError: boom", msg
    assert msg.splitlines()[2].startswith(f"  then process 0 failed (exit code 1 after 6.0 s): {launch.PEER_FAILED}")


def test_faults_switch(monkeypatch):
    for v, on in (("", True), ("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv(faults.ENV_FAULTS, v)
        assert faults.enabled() is on
    monkeypatch.setenv(faults.ENV_FAULTS, "maybe")
    with pytest.raises(ValueError, match=r"JAX_BLINK_FAULTS='maybe': .*takes 0 or 1"):
        faults.enabled()
    monkeypatch.setenv(faults.ENV_FAULTS, "1")
    assert faults.install() is False  # no jax.distributed job in this process: nothing to watch
