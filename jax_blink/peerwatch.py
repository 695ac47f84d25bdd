"""Which process is stuck: an arrival check for call sites whose mesh spans processes.

With ``JAX_BLINK_WATCH=1`` every jax_blink call site whose groups span several ``jax.distributed``
processes is bracketed by two host callbacks (``jax.experimental.io_callback``) tied to the
collective's data (before: every operand depends on the check's result, :func:`_tie`; after: the
callback reads the collective's result). The hierarchical lowering is bracketed per phase between
processes (:func:`phase_guard`), so the message names the phase its peers wait in:

- before: the first local device of this process to reach generation ``g`` of the call site
  publishes ``jax_blink/watch/<site>/<g>/<process>`` in the job's key-value store and waits until
  every process that shares a group with it has published too. Past ``JAX_BLINK_TIMEOUT_S``
  (default 60 s) the callback raises :class:`PeerTimeoutError`, which XLA returns to the caller as
  the program's error (nothing aborts): it names each missing process, its host, its devices and the
  last call site it completed, and the processes that did arrive.
- after: the process publishes ``jax_blink/watch/done/<process>`` = the call site it completed.

Without it, :mod:`jax_blink.faults` (on by default) already stops the peers of a process that raises
or exits, naming it, and prints where every process is once one waits at one instruction past the
timeout; this module adds the call site and generation where each peer waits. So a process that
stalls or never calls is named by every peer that waits for it, at the call site where they wait,
instead of a hang inside the collective (gloo / NCCL wait for minutes or forever).
Cost: one key-value round trip to the coordinator per call site and step (and a host
synchronisation), hence opt-in. Keys two generations old are deleted as the job goes.
The key-value store is ``jax.distributed``'s (the coordination service); hosts are
``socket.gethostname()``. Both callbacks run per device (XLA calls them once per device of the
process); only the first arrival of each generation talks to the store.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import numpy as np

from . import envvars
from .errors import BlinkError

ENV_WATCH = "JAX_BLINK_WATCH"
_PREFIX = "jax_blink/watch"


class PeerTimeoutError(BlinkError, RuntimeError):
    """A process of the call site's groups did not arrive within the timeout (message names it)."""


def enabled() -> bool:
    """True when ``JAX_BLINK_WATCH`` is 1 / true / on. Raises EnvVarError (a ValueError) for a value
    that is no flag."""
    return envvars.flag(ENV_WATCH) is True


def _client():
    from ._jax_compat import distributed_client
    return distributed_client()


class _Site:
    """One watched call site of one compiled program, in this process."""

    def __init__(self, site: str, mesh, groups, me: int):
        self.label = site
        self.key = hashlib.blake2b(site.encode(), digest_size=8).hexdigest()
        flat = list(mesh.devices.flat)
        self.me = me
        mine = {p for p, d in enumerate(flat) if d.process_index == me}
        self.peers = sorted({flat[p].process_index for g in groups if mine & set(g) for p in g})
        self.devices = {}
        for d in flat:
            self.devices.setdefault(d.process_index, []).append(d.id)
        self.lock = threading.Lock()
        self.arrived = {}   # mesh position -> next generation
        self.done = {}
        self.pending = {}   # generation -> (Event, [error])
        self.published = set()

    @property
    def needed(self) -> bool:
        return any(p != self.me for p in self.peers)

    def _leader(self, counts, pos):
        with self.lock:
            g = counts.get(pos, 0)
            counts[pos] = g + 1
            if (counts is self.arrived) and g not in self.pending:
                self.pending[g] = (threading.Event(), [None])
                return g, True
            if counts is self.done:
                first = (g not in self.published)
                self.published.add(g)
                return g, first
            return g, False

    def arrive(self, pos):
        g, lead = self._leader(self.arrived, int(pos))
        event, err = self.pending[g]
        if lead:
            try:
                err[0] = self._rendezvous(g)
            except Exception as e:  # noqa: BLE001 - any store failure is reported to the caller
                err[0] = f"jax_blink: {self.label}: the peer check failed: {e}"
            event.set()
        else:
            event.wait()
        with self.lock:  # forget generations every local device has passed
            for old in [k for k in self.pending if k < min(self.arrived.values()) - 1]:
                del self.pending[old]
        if err[0]:
            raise PeerTimeoutError(err[0])
        return np.int32(0)

    def finish(self, pos, _dep):
        g, first = self._leader(self.done, int(pos))
        if first:
            client = _client()
            client.key_value_set(f"{_PREFIX}/done/{self.me}", f"{self.label} (generation {g})", allow_overwrite=True)
            with self.lock:
                self.published = {k for k in self.published if k >= g - 2}
        return np.int32(0)

    def _rendezvous(self, g: int) -> str | None:
        from .lowering.ffi import timeout_ms
        client = _client()
        if client is None:
            return None
        client.key_value_set(f"{_PREFIX}/host/{self.me}", socket.gethostname(), allow_overwrite=True)
        client.key_value_set(f"{_PREFIX}/{self.key}/{g}/{self.me}", "1", allow_overwrite=True)
        if g >= 2:  # every peer passed generation g-1, so nobody reads g-2 any more
            try:
                client.key_value_delete(f"{_PREFIX}/{self.key}/{g - 2}/{self.me}")
            except Exception:  # noqa: BLE001 - a missing key is no problem
                pass
        limit_ms = timeout_ms(60_000)
        deadline = time.monotonic() + limit_ms / 1000
        missing, arrived = [], []
        for p in self.peers:
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                client.blocking_key_value_get(f"{_PREFIX}/{self.key}/{g}/{p}", left)
                arrived.append(p)
            except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: not there in time
                missing.append(p)
        if not missing:
            return None
        return self._message(g, missing, arrived, limit_ms / 1000)

    def _message(self, g, missing, arrived, seconds) -> str:
        client = _client()

        def get(key):
            try:
                return client.key_value_try_get(key)
            except Exception:  # noqa: BLE001 - NOT_FOUND
                return None

        def who(p):
            host = get(f"{_PREFIX}/host/{p}") or "host unknown: it has reached no watched call site"
            return f"process {p} (host {host}, devices {self.devices.get(p, [])})"

        lines = []
        for p in missing:
            last = get(f"{_PREFIX}/done/{p}")
            lines.append(f"{who(p)}: last completed jax_blink call site: {last or 'none yet'}")
        return (f"jax_blink: collective timed out after {seconds:g} s at {self.label} (generation {g}): "
                f"{len(missing)} process(es) never arrived: " + "; ".join(lines)
                + f". Arrived: {', '.join(who(p) for p in arrived) or 'none'}. Every process must run the same "
                "collectives in the same order; raise JAX_BLINK_TIMEOUT_S if a process is only slow.")


_ordinals: dict = {}


def _ordinal(ctx) -> int:
    """The n-th watched call site of the module being lowered (the same on every process of an SPMD
    program), so two call sites with the same label in one program get different keys."""
    module = ctx.module_context.keepalives  # one list per module being lowered
    n = _ordinals.get(id(module), (module, 0))[1]
    _ordinals[id(module)] = (module, n + 1)
    while len(_ordinals) > 32:
        _ordinals.pop(next(iter(_ordinals)))
    return n


def _tie(t, v):
    """``v`` made to depend on the arrival check's result ``t`` (an int32 0 at run time): its first
    element passes through a select on ``t``. XLA:CPU drops ``optimization_barrier`` before
    scheduling, so a barrier alone let XLA's own all-reduce start before the check (seen with one
    device per process, where the check then never fired before gloo's timeout). Costs one in-place
    element update (a copy of ``v`` where ``v`` is a parameter that is not donated)."""
    import jax.numpy as jnp
    from jax import lax

    flat = v.reshape(-1)
    head = jnp.where(t == 0, flat[:1], jnp.zeros_like(flat[:1]))
    return lax.dynamic_update_slice(flat, head, (0,)).reshape(v.shape)


def _bracket(ctx, s: _Site, xs, avals_in, avals_out, fn):
    """``fn(xs)`` (a list of ir.Values in, a list out) between ``s``'s arrival check, which every
    operand depends on, and its completion record, which depends on the first result."""
    import jax
    from jax import lax
    from jax.experimental import io_callback

    from ._jax_compat import core, mlir
    from .lowering import ppermute

    token = jax.ShapeDtypeStruct((), np.int32)
    plain_in = [core.ShapedArray(a.shape, a.dtype) for a in avals_in]

    def before(*vs):
        t = io_callback(s.arrive, token, ppermute._position_p.bind(), ordered=False)
        return [_tie(t, v) for v in vs]

    xs = mlir.lower_fun(before, multiple_results=True)(
        ctx.replace(primitive=None, avals_in=plain_in, avals_out=plain_in), *xs)
    outs = fn(list(xs))
    plain_out = [core.ShapedArray(a.shape, a.dtype) for a in avals_out]

    def after(*vs):
        t = io_callback(s.finish, token, ppermute._position_p.bind(), vs[0].reshape(-1)[:1], ordered=False)
        return list(lax.optimization_barrier((t, *vs))[1:])

    return list(mlir.lower_fun(after, multiple_results=True)(
        ctx.replace(primitive=None, avals_in=plain_out, avals_out=plain_out), *outs))


def watched(rule, ctx, xs, request_for, *, mesh, groups, site: str):
    """``rule(ctx, xs, request_for)`` bracketed by the arrival check and the completion record
    (module docstring); the rule's results unchanged. Without processes to wait for (every group
    inside this process) the rule alone."""
    import jax

    s = _Site(f"{site} (watched call {_ordinal(ctx)} of its program)", mesh, groups, jax.process_index())
    if not s.needed:
        return rule(ctx, xs, request_for)
    return _bracket(ctx, s, xs, ctx.avals_in, ctx.avals_out, lambda vs: rule(ctx, vs, request_for))


def phase_guard(*, mesh, groups, site: str):
    """The guard for a rule that runs its phases between processes through
    ``lowering.network_phase`` (the hierarchical lowering): each such phase gets its own arrival
    check and completion record, labelled ``<site> phase <phase>``, so a peer that waits names the
    phase it waits in (the intra-process phases wait on no other process; the native executor names
    a missing local device itself)."""
    import jax

    me = jax.process_index()

    def guard(ctx, xs, avals_in, avals_out, phase, fn):
        s = _Site(f"{site} phase {phase} (watched call {_ordinal(ctx)} of its program)", mesh, groups, me)
        if not s.needed:
            return fn(xs)
        return _bracket(ctx, s, xs, avals_in, avals_out, fn)
    return guard
