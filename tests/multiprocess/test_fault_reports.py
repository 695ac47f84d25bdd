"""What the launcher's summary and jax_blink.faults say, without starting processes: each process's
first real error (its own exception before jax's abort line and before a peer's failure) and the
JAX_BLINK_FAULTS switch."""

import json
import threading
import time

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


class _Store:
    """In-process stand-in for jax.distributed's key-value client: blocking gets wait on a condition."""

    def __init__(self):
        self.data, self.cv = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cv:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = value
            self.cv.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.data[key]


def test_exit_hook_ends_both_threads_before_python_finalizes():
    """The exit hook waits for the listener and the sampler: a daemon thread that comes back from a
    blocking key-value get while Python finalizes is ended by pthread_exit, and jaxlib's binding catching
    that forced unwind aborted the process ("FATAL: exception not rethrown", SIGABRT: 2 of 15 four-process
    runs under load before the join)."""
    store = _Store()
    store.key_value_set(f"{faults._PREFIX}/event/0", json.dumps({"kind": "exit", "process": 1, "host": "h",
                                                                 "what": "ended", "where": "exit"}))
    w = faults._Watch(store, 0, 2, timeout_s=60.0)  # the sampler ticks every second
    listener, sampler = w.threads
    t0 = time.monotonic()
    while 1 not in w.exited and time.monotonic() - t0 < 10:  # the listener read the peer's exit
        time.sleep(0.01)
    assert 1 in w.exited and listener.is_alive() and sampler.is_alive()
    t1 = time.monotonic()
    w.on_exit()
    took = time.monotonic() - t1
    assert not listener.is_alive() and not sampler.is_alive()
    assert json.loads(store.data[f"{faults._PREFIX}/event/1"])["kind"] == "exit"  # its own exit, published
    assert took < 0.9, took  # the sampler was woken, not waited for until its next tick
