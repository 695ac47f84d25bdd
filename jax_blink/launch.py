"""Launch N JAX processes on this machine (127.0.0.1) for multi-controller runs.

``launch(["script.py", ...], num_processes=2, local_devices=4)`` picks a free coordinator port,
starts one Python process per rank with the environment :func:`jax_blink.distributed.initialize`
reads (``JAX_BLINK_COORDINATOR``, ``JAX_BLINK_NUM_PROCESSES``, ``JAX_BLINK_PROCESS_ID``) and
``XLA_FLAGS=--xla_force_host_platform_device_count=<local_devices>``, and watches them:

- when one process fails, the others get ``grace_s`` seconds to fail on their own (jax.distributed's
  heartbeat makes them abort with "another task died"), then are killed;
- after ``timeout_s`` every process still running is killed (no hang, ever);
- every child is killed in ``finally`` (also on KeyboardInterrupt or a failing caller).

Failures raise :class:`LaunchError` naming the process that failed first, how (exit code or
signal), and the last error line of each failed process.

Command line: ``python -m jax_blink.launch --processes 2 --local-devices 4 -- script.py ARGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .errors import BlinkError

ENV_COORDINATOR = "JAX_BLINK_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_BLINK_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_BLINK_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAX_BLINK_LOCAL_DEVICES"


class LaunchError(BlinkError, RuntimeError):
    """A launched process failed, or the run timed out. ``result`` holds every process's output."""

    def __init__(self, message: str, result: LaunchResult):
        super().__init__(message)
        self.result = result


@dataclasses.dataclass
class ProcessResult:
    """One launched process: ``returncode`` (negative: killed by that signal), captured output,
    ``wall_s`` seconds from start to exit, ``killed_by_watchdog`` when the launcher ended it."""

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    killed_by_watchdog: bool = False

    @property
    def how(self) -> str:
        """Exit status in words: "exit code 1", "signal SIGABRT", ..."""
        rc = self.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                return f"signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"signal {-rc}"
        return f"exit code {rc}"

    def error_line(self) -> str:
        """The process's first real error on stderr: the first Python exception line (``Type: msg``,
        the cause of a chain; also ``SystemExit`` / ``KeyboardInterrupt``), else jax.distributed's
        fatal message ("Terminating process because ..."), else the first F / E log line, else the
        last non-empty line. A peer's failure reported by :mod:`jax_blink.faults` ranks below the
        process's own exception."""
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip() and not ln.startswith("    @")]
        for pat in (r"^(?!jax_blink\.faults\.PeerFailedError)[\w.]*(Error|Exception|Exit|Interrupt)\b[^\s]*:",
                    r"^[\w.]*(Error|Exception|Exit|Interrupt)\b[^\s]*:", r"^KeyboardInterrupt$",
                    r"Terminating process because", r"\bF\d{4} ", r"\bE\d{4} "):
            hits = [ln for ln in lines if re.search(pat, ln)]
            if hits:
                return hits[0][:400]
        return lines[-1][:400] if lines else "(no output on stderr)"

    @property
    def stopped_by_peer(self) -> bool:
        """True when the process stopped because a peer failed (jax_blink.faults said so)."""
        return PEER_FAILED in self.stderr


#: The marker :mod:`jax_blink.faults` prints when a process stops because a peer failed.
PEER_FAILED = "jax_blink.faults.PeerFailedError:"


@dataclasses.dataclass
class LaunchResult:
    """All processes of one launch, in process-id order, plus the coordinator address used."""

    processes: list[ProcessResult]
    coordinator: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(p.returncode == 0 for p in self.processes)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bound with port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_env(base: dict, coordinator: str, n: int, pid: int, local_devices: int | None) -> dict:
    env = dict(base)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(n)
    env[ENV_PROCESS_ID] = str(pid)
    env["PYTHONUNBUFFERED"] = "1"  # so a killed peer's last lines are not lost in a buffer
    if local_devices is not None:
        env[ENV_LOCAL_DEVICES] = str(local_devices)
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


#: The line gloo (XLA:CPU's cross-process collectives) prints per rank as it connects; kept in the
#: captured output, echoed only with ``verbose`` (one line per rank tells the user nothing).
GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks?\b")


def _pump(stream, sink: list, prefix: str | None, lock: threading.Lock, verbose: bool = False) -> None:
    # One thread per pipe: a child never blocks on a full pipe, and output can be echoed live.
    for line in iter(stream.readline, ""):
        sink.append(line)
        if prefix is not None and (verbose or not GLOO_CONNECTED.match(line)):
            with lock:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
    stream.close()


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session: this reaches only its group
    except (ProcessLookupError, PermissionError):
        pass


def launch(argv: Sequence[str], num_processes: int, local_devices: int | None = None, *,
           timeout_s: float = 300.0, grace_s: float = 20.0, env: dict | None = None,
           cwd: str | None = None, echo: bool = False, check: bool = True,
           python: str | None = None, verbose: bool = False) -> LaunchResult:
    """Run ``python argv...`` as ``num_processes`` cooperating JAX processes on 127.0.0.1.

    Args:
      argv: script path (or ``["-m", "module"]``) and its arguments, passed to every process.
      num_processes: N >= 1 processes; process i gets ``JAX_BLINK_PROCESS_ID=i``.
      local_devices: CPU devices per process (sets ``--xla_force_host_platform_device_count`` and
        ``JAX_PLATFORMS=cpu`` unless ``env`` sets it); None leaves the platform alone (GPU runs).
      timeout_s: wall-clock limit for the whole run; processes still running are killed.
      grace_s: after the first failure, how long the others may take to fail by themselves.
      env: base environment (default ``os.environ``).
      echo: print the children's lines live, prefixed ``[pN] ``; gloo's per-rank "[Gloo] Rank ...
        is connected to ..." lines only with ``verbose`` (they stay in the captured output).
      verbose: echo gloo's connection lines too.
      check: raise :class:`LaunchError` unless every process exits 0.
      python: interpreter (default ``sys.executable``).

    Returns: :class:`LaunchResult` (stdout/stderr of each process, exit codes, wall time).
    Raises: ValueError on bad arguments; LaunchError (``check=True``) when a process fails or the
    run times out. Children are always killed before this returns or raises.
    """
    if int(num_processes) != num_processes or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if local_devices is not None and (int(local_devices) != local_devices or local_devices < 1):
        raise ValueError(f"local_devices must be an int >= 1 or None, got {local_devices!r}")
    if not argv:
        raise ValueError("argv is empty: give the script (or -m module) every process should run")
    coordinator = f"127.0.0.1:{free_port()}"
    base = dict(os.environ if env is None else env)
    lock = threading.Lock()
    procs, outs, errs, threads, started, ended = [], [], [], [], [], {}
    killed: set[int] = set()
    t0 = time.monotonic()
    try:
        for i in range(num_processes):
            p = subprocess.Popen([python or sys.executable, *argv], cwd=cwd, text=True,
                                 env=_child_env(base, coordinator, num_processes, i, local_devices),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            started.append(time.monotonic())
            outs.append([])
            errs.append([])
            for stream, sink in ((p.stdout, outs[i]), (p.stderr, errs[i])):
                th = threading.Thread(target=_pump, args=(stream, sink, f"[p{i}] " if echo else None, lock,
                                                          verbose), daemon=True)
                th.start()
                threads.append(th)
        deadline = t0 + timeout_s
        first_fail_at = None
        while len(ended) < num_processes:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = now
                    if p.returncode != 0 and first_fail_at is None:
                        first_fail_at = now
            if len(ended) == num_processes:
                break
            limit = deadline if first_fail_at is None else min(deadline, first_fail_at + grace_s)
            if now >= limit:
                for i, p in enumerate(procs):
                    if i not in ended:
                        killed.add(i)
                        _kill(p, signal.SIGTERM)
                _wait_or_kill(procs, killed)
                for i in killed:
                    ended.setdefault(i, time.monotonic())
                break
            time.sleep(0.05)
    finally:
        alive = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in alive:
            killed.add(i)
            _kill(procs[i], signal.SIGKILL)
        for i in alive:
            procs[i].wait()
        for th in threads:
            th.join(timeout=5)
    result = LaunchResult(
        processes=[ProcessResult(i, p.returncode, "".join(outs[i]), "".join(errs[i]),
                                 ended.get(i, time.monotonic()) - started[i], i in killed)
                   for i, p in enumerate(procs)],
        coordinator=coordinator, wall_s=time.monotonic() - t0)
    if check and not result.ok:
        raise LaunchError(_failure_message(result, timeout_s, grace_s), result)
    return result


def _wait_or_kill(procs, killed, term_wait_s: float = 3.0) -> None:
    end = time.monotonic() + term_wait_s
    for i in killed:
        try:
            procs[i].wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(procs[i], signal.SIGKILL)
            procs[i].wait()


def _failure_message(result: LaunchResult, timeout_s: float, grace_s: float) -> str:
    failed = [p for p in result.processes if p.returncode != 0 and not p.killed_by_watchdog]
    lines = []
    if failed:
        # the process that failed by itself first; one stopped by a peer's failure only if all were
        first = min(failed, key=lambda p: (p.stopped_by_peer, p.wall_s))
        lines.append(f"process {first.process_id} of {len(result.processes)} failed first "
                     f"({first.how} after {first.wall_s:.1f} s): {first.error_line()}")
        for p in failed:
            if p is not first:
                lines.append(f"  then process {p.process_id} failed ({p.how} after {p.wall_s:.1f} s): "
                             f"{p.error_line()}")
    wd = [p.process_id for p in result.processes if p.killed_by_watchdog]
    if wd:
        why = (f"did not exit within {grace_s:.0f} s of that failure" if failed
               else f"were still running after the {timeout_s:.0f} s timeout")
        lines.append(f"  processes {wd} {why} and were killed by the launcher")
    return "multi-process run failed:\n" + "\n".join(lines)


def launch_cli(cmd, processes: int, local_devices, **kw) -> int:
    """:func:`launch` for a command line: exit status 0, or 1 with the failure printed to stderr."""
    try:
        launch(cmd, processes, local_devices, echo=True, **kw)
    except (LaunchError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jax_blink.launch --processes N [--local-devices L] -- script.py ARGS``."""
    ap = argparse.ArgumentParser(prog="python -m jax_blink.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, help="number of processes (default 2)")
    ap.add_argument("--local-devices", type=int, default=None,
                    help="CPU devices per process (omit on GPU machines)")
    ap.add_argument("--timeout", type=float, default=600.0, help="kill everything after this many seconds")
    ap.add_argument("--grace", type=float, default=20.0,
                    help="seconds the other processes get to fail after the first failure")
    ap.add_argument("--verbose", action="store_true",
                    help="also echo gloo's per-rank '[Gloo] Rank ... is connected' lines")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="script.py ARGS (after --)")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the script to run after --, e.g. -- examples/multiprocess/worker.py")
    return launch_cli(cmd, a.processes, a.local_devices, timeout_s=a.timeout, grace_s=a.grace, verbose=a.verbose)


if __name__ == "__main__":
    sys.exit(main())
