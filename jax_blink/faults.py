"""A failing process is named by its peers, by default, at no cost per step.

In a ``jax.distributed`` job a process that raises or exits leaves its peers waiting in the next
collective (gloo or NCCL wait for minutes, NCCL forever). Once :func:`install` ran (at
:func:`jax_blink.distributed.initialize`, else at the first jax_blink call site whose mesh spans
processes), each process:

- publishes its own failure in the job's key-value store (``jax_blink/fault/event/<k>``, the
  ``k``-th event of the job, first writer wins): an uncaught exception from ``sys.excepthook`` (after
  Python's own traceback is printed as usual), ``sys.exit(code)`` with a code other than 0 / None
  at exit (a ``SystemExit`` that the program catches and survives is still reported at its exit);
  then it exits at once with its status (1 for an exception) instead of going through jax's
  shutdown barrier, which would wait for peers that are about to stop;
- publishes a normal exit (the program ended, or ``raise SystemExit``) at exit;
- runs one daemon thread blocked on the next event (a key-value get, no polling): on a peer's
  failure it prints ``jax_blink.faults.PeerFailedError: process <p> of <n> (host <h>) failed:
  <exception> ...`` and the place its own main thread was, and exits with status 1 at once,
  whatever it was doing (blocked in a collective, or not yet there);
- runs one daemon thread that looks at its main thread's Python frame every ``min(1, T / 8)``
  seconds (T = ``JAX_BLINK_TIMEOUT_S``, default 60 s): when the main thread has stayed at one
  instruction (a blocking call: a collective's wait, or a stall) for T seconds, it asks its peers
  where their main threads are and prints one line saying so (``jax_blink: process 0 has been at
  ... for 60 s; process 1 (host h) at ... for 61 s``), which names a stalled peer; when moreover a
  peer has exited, this process fails (a collective with an exited process never completes).

A process killed by a signal (SIGKILL) cannot publish anything: jax.distributed's heartbeat ends the
job (``heartbeat_timeout_s`` of :func:`jax_blink.distributed.initialize`, 10 s; jax's own default
100 s). A stalled peer is named but not failed by this module (it may be slow, not stuck): the
collective's own timeout (``JAX_BLINK_COLLECTIVE_TIMEOUT_S`` on CPU) raises in the waiting process,
whose exception is then published as above.

``JAX_BLINK_FAULTS=0`` turns all of this off. Nothing runs on the collectives' path: the cost is two
idle threads and one frame look-up per second.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback

from . import envvars
from .errors import BlinkError

ENV_FAULTS = "JAX_BLINK_FAULTS"
_PREFIX = "jax_blink/fault"
#: how long one blocking key-value get of the listener lasts before it asks again (ms)
_GET_CHUNK_MS = 60_000
_JOIN_AT_EXIT_S = 5.0  # at exit, how long to wait for the threads (they end within a tick)
#: how long a process stopped by a peer's failure waits before it exits (s)
_LET_GO_FIRST_S = 0.5
#: how long a probe waits for each peer's answer (s)
_ANSWER_S = 3.0


class PeerFailedError(BlinkError, RuntimeError):
    """A peer process of the job failed; the message names it, its host and its exception."""


def enabled() -> bool:
    """False when ``JAX_BLINK_FAULTS`` is 0 / false / off; raises EnvVarError (a ValueError) for a
    value that is no flag."""
    return envvars.flag(ENV_FAULTS) is not False


def _where(frame) -> str:
    """``file:line in function`` of ``frame`` (a Python frame), or "unknown"."""
    while frame is not None and frame.f_code.co_filename.startswith("<") and frame.f_back is not None:
        frame = frame.f_back  # <frozen importlib...>: say which import of the program's
    if frame is None:
        return "unknown"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _exception_text(exc: BaseException) -> tuple[str, str]:
    """(``Type: message`` first line, where it was raised) of ``exc``."""
    msg = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__
    tb = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else "unknown"
    return what[:500], where


class _Watch:
    """This process's part: publishing its failure or exit, the listener and the frame sampler."""

    def __init__(self, client, me: int, nproc: int, timeout_s: float):
        self.client, self.me, self.n, self.timeout_s = client, me, nproc, timeout_s
        self.host = socket.gethostname()
        self.lock = threading.Lock()
        self.next_event = 0       # the first event index not yet known to be taken
        self.exited: dict[int, dict] = {}   # peers that published a normal exit
        self.exit_code = None     # sys.exit's code when it is not 0 / None
        self.failed = False       # this process published a failure
        self.wake = threading.Event()  # set by the exit hook: no more verdicts; wakes the sampler
        self.main = threading.main_thread()
        self.stable_since = time.monotonic()
        self.stable_key = None
        self.reported_key = None
        self.threads = [threading.Thread(target=self._listen, name="jax_blink-faults-listener", daemon=True),
                        threading.Thread(target=self._sample, name="jax_blink-faults-sampler", daemon=True)]
        for t in self.threads:
            t.start()

    @property
    def stopping(self) -> bool:
        """The exit hook ran: no more verdicts."""
        return self.wake.is_set()

    # ------------------------------------------------------------------ events
    def post(self, event: dict) -> None:
        """Publish ``event`` as the next event of the job (first writer of an index wins)."""
        event = {**event, "process": self.me, "host": self.host, "pid": os.getpid()}
        text = json.dumps(event)
        with self.lock:
            k = self.next_event
            for _ in range(10_000):
                try:
                    self.client.key_value_set(f"{_PREFIX}/event/{k}", text)
                    self.next_event = k + 1
                    return
                except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: taken, try the next; else give up
                    if "ALREADY_EXISTS" not in str(e):
                        return
                    k += 1

    def _listen(self) -> None:
        k = 0
        while True:
            try:
                text = self.client.blocking_key_value_get(f"{_PREFIX}/event/{k}", _GET_CHUNK_MS)
            except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED: ask again; else the job is gone
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                return
            with self.lock:
                self.next_event = max(self.next_event, k + 1)
            k += 1
            try:
                ev = json.loads(text)
            except ValueError:
                continue
            if ev.get("process") == self.me:
                if ev.get("kind") == "exit":
                    return  # our own exit: nothing more to wait for
                continue
            kind = ev.get("kind")
            if kind == "fault" and not self.stopping:
                self._stop_for(ev)
            elif kind == "exit":
                self.exited[int(ev["process"])] = {**ev, "seen": time.monotonic()}
            elif kind == "probe":
                self._answer(ev)

    def _stop_for(self, ev: dict) -> None:
        frame = sys._current_frames().get(self.main.ident)
        p = ev.get("process")
        msg = (f"jax_blink.faults.PeerFailedError: process {p} of {self.n} (host {ev.get('host')}, pid "
               f"{ev.get('pid')}) failed: {ev.get('what')} (at {ev.get('where')}); process {self.me} stops "
               f"too (its main thread was at {_where(frame)}): a collective with process {p} can never "
               f"complete. Process {p}'s own output has its traceback.")
        print(msg, file=sys.stderr, flush=True)
        # The failed process exits right after publishing; let it go first: where this process hosts
        # the coordination service, leaving first would make jax abort that process (SIGABRT).
        time.sleep(_LET_GO_FIRST_S)
        _die(None, 1)

    # ------------------------------------------------------------------ probes
    def _state(self) -> dict:
        frame = sys._current_frames().get(self.main.ident)
        return {"where": _where(frame), "seconds": round(time.monotonic() - self.stable_since, 1)}

    def _answer(self, ev: dict) -> None:
        try:
            self.client.key_value_set(f"{_PREFIX}/answer/{ev['id']}/{self.me}", json.dumps(self._state()),
                                      allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the job is going away
            pass

    def probe(self) -> dict[int, dict | None]:
        """Every peer's main-thread place and how long it has been there (None: no answer)."""
        pid = f"{self.me}.{time.monotonic_ns()}"
        self.post({"kind": "probe", "id": pid})
        out = {}
        deadline = time.monotonic() + _ANSWER_S
        for p in range(self.n):
            if p == self.me:
                continue
            if p in self.exited:
                out[p] = {"exited": True}
                continue
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                out[p] = json.loads(self.client.blocking_key_value_get(f"{_PREFIX}/answer/{pid}/{p}", left))
            except Exception:  # noqa: BLE001 - no answer in time
                out[p] = None
        return out

    def _sample(self) -> None:
        period = min(1.0, max(0.05, self.timeout_s / 8))
        while not self.stopping:
            if self.wake.wait(period):  # set by the exit hook: end now, not a period later
                return
            frame = sys._current_frames().get(self.main.ident)
            if frame is None:
                return
            key = (id(frame), frame.f_lasti, frame.f_lineno)
            now = time.monotonic()
            if key != self.stable_key:
                self.stable_key, self.stable_since = key, now
                continue
            if now - self.stable_since < self.timeout_s or self.reported_key == key or self.stopping:
                continue
            self.reported_key = key
            self._report(frame, now - self.stable_since)

    def _report(self, frame, seconds: float) -> None:
        peers = self.probe()
        parts = []
        for p, st in sorted(peers.items()):
            if st is None:
                parts.append(f"process {p}: no answer within {_ANSWER_S:g} s (busy holding the GIL, or gone)")
            elif st.get("exited"):
                ev = self.exited.get(p, {})
                parts.append(f"process {p} (host {ev.get('host')}) exited: {ev.get('what')}")
            else:
                parts.append(f"process {p} at {st['where']} for {st['seconds']:g} s")
        line = (f"jax_blink: process {self.me} of {self.n} has been at {_where(frame)} for {seconds:.0f} s "
                f"(JAX_BLINK_TIMEOUT_S={self.timeout_s:g}); where the others are: " + "; ".join(parts))
        exited = [p for p, st in peers.items() if st and st.get("exited")]
        if exited and not self.stopping:
            p = exited[0]
            ev = self.exited.get(p, {})
            msg = (f"jax_blink.faults.PeerFailedError: process {p} of {self.n} (host {ev.get('host')}) exited "
                   f"({ev.get('what')}) while process {self.me} waits at {_where(frame)} for {seconds:.0f} s: "
                   f"a collective with an exited process never completes. {line}")
            self.post({"kind": "fault", "what": f"PeerFailedError: process {p} exited", "where": _where(frame)})
            _die(msg, 1)
        print(line, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ this process's end
    def on_exception(self, exc: BaseException) -> None:
        """An uncaught exception ends the program (its traceback already printed): publish, exit 1.

        Exiting at once (not through jax's shutdown) keeps the status: once the peers stop, jax's
        client in this process would abort it (SIGABRT) for the lost coordination service."""
        if self.failed or self.stopping:
            return
        self.failed = True
        what, where = _exception_text(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        self.post({"kind": "fault", "what": what, "where": where})
        _die(None, 1)

    def on_exit(self) -> None:
        """atexit: publish this process's end; after ``sys.exit(code)``, exit now with that code."""
        self.wake.set()
        if self.exit_code is not None:
            self.failed = True
            print(f"SystemExit: process {self.me} of {self.n} exits with sys.exit({self.exit_code!r}) at "
                  f"{self.exit_where}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            self.post({"kind": "fault", "what": f"SystemExit: sys.exit({self.exit_code!r})",
                       "where": self.exit_where or "unknown"})
            _die(None, self.exit_code if isinstance(self.exit_code, int) else 1)
        self.post({"kind": "exit", "what": "its program ended (or raised SystemExit)", "where": "exit"})
        # Both threads end before the interpreter finalizes: the listener at our own exit event (just
        # posted), the sampler at once (woken). A daemon thread that comes back from a blocking
        # key-value get while Python finalizes is ended by pthread_exit, whose forced unwind jaxlib's
        # binding catches: "FATAL: exception not rethrown", SIGABRT (2 of 15 four-process runs under
        # load before this join).
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=_JOIN_AT_EXIT_S)

    exit_where = None


def _die(message: str | None, status: int) -> None:
    """Print ``message`` (if any), flush, and end the process now with ``status``."""
    try:
        if message:
            print(message, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


_watch: _Watch | None = None
_install_lock = threading.Lock()


def install(timeout_s: float | None = None) -> bool:
    """Start this process's part (idempotent); True when it runs.

    Needs ``jax.distributed`` initialised with more than one process; does nothing when
    ``JAX_BLINK_FAULTS=0`` or in a single process. ``timeout_s``: how long the main thread may stay
    at one instruction before the peers are asked where they are (default ``JAX_BLINK_TIMEOUT_S``,
    else 60 s). Raises ValueError for a bad ``JAX_BLINK_FAULTS``, BlinkError for a bad
    ``JAX_BLINK_TIMEOUT_S``.
    """
    global _watch
    if not enabled():
        return False
    with _install_lock:
        if _watch is not None:
            return True
        import jax

        from ._jax_compat import distributed_client
        from .lowering.ffi import timeout_ms

        client = distributed_client()
        if client is None or jax.process_count() < 2:
            return False
        t = timeout_s if timeout_s is not None else timeout_ms(60_000) / 1000
        w = _Watch(client, jax.process_index(), jax.process_count(), float(t))
        _watch = w
        prev_hook = sys.excepthook

        def excepthook(etype, value, tb):
            prev_hook(etype, value, tb)  # Python's traceback first, as without the watch
            if value is not None and not isinstance(value, SystemExit) and not hasattr(sys, "ps1"):
                w.on_exception(value)  # (an interactive interpreter goes on after an error)

        sys.excepthook = excepthook
        prev_exit = sys.exit

        def exit(status=None):  # noqa: A001 - stands in for sys.exit
            if status not in (None, 0):
                w.exit_code = status if isinstance(status, int) else 1
                caller = sys._getframe(1)
                w.exit_where = _where(caller)
            prev_exit(status)

        exit.__doc__ = prev_exit.__doc__
        sys.exit = exit
        atexit.register(w.on_exit)  # runs before jax's own atexit shutdown (registered at jax's import)
        return True


def check_cpu_collectives() -> None:
    """Raise BlinkError unless collectives between processes can run on CPU: jax's setting
    ``jax_cpu_collectives_implementation`` must be "gloo" or "mpi" (gloo is jax's default from
    0.5; ``jax.config.update("jax_cpu_collectives_implementation", "gloo")`` before the first
    computation selects it; :func:`jax_blink.distributed.initialize` does)."""
    from ._jax_compat import cpu_collectives_implementation

    impl = cpu_collectives_implementation()
    if impl not in ("gloo", "mpi"):
        raise BlinkError(
            f"jax_cpu_collectives_implementation is {impl!r}: collectives between processes on CPU need "
            "'gloo' (or 'mpi'); call jax.config.update('jax_cpu_collectives_implementation', 'gloo') before "
            "jax.distributed.initialize(), or use jax_blink.distributed.initialize(), which does")


def installed() -> bool:
    """True when this process's part runs."""
    return _watch is not None
