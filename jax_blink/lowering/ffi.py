"""FFI lowering: a schedule as one XLA FFI custom call executed by the native handlers in ``ffi/``.

Registers impl ``"ffi"`` for platform ``"cpu"`` (target ``jax_blink_cpu``) and ``"cuda"`` (target
``jax_blink_cuda``) when the native modules imported and ``jax.ffi.register_ffi_target`` accepted
them. Each device's call registers its buffers at a meeting keyed by (run id, call site, group,
per-device generation); the native executor then walks the schedule (Blink, MLSys 2020, Sec. 4:
reduce up and broadcast down spanning trees with pipelined chunks).

Attributes of the custom call (docs/architecture.md): ``schedule`` (int64: the group schedules'
``Schedule.to_array()`` back to back, one per group in group order), ``device_table`` (int64 rows
(device_id, group, rank)), ``call_site`` (int64, deterministic: a hash of the schedules, table,
operand type and the call's position in the module), ``timeout_ms`` (the runtime environment variable
``JAX_BLINK_TIMEOUT_S`` overrides it).

Test hook: ``JAX_BLINK_TEST_ABSENT_DEVICE=<device id>`` (read by the native handler at run time)
makes that device skip every meeting, so the others hit the timeout error. Never set it otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict

import numpy as np

import jax
from jax._src.lib.mlir import ir

from .. import _native
from ..errors import BlinkError
from . import LoweringRequest, register_lowering

CPU_TARGET = "jax_blink_cpu"
CUDA_TARGET = "jax_blink_cuda"

#: Platforms ("cpu", "cuda") whose FFI target registered; why others did not.
REGISTERED: dict[str, str] = {}
UNAVAILABLE: dict[str, str] = {}

# Per-module call counters (module -> next ordinal), so two call sites with identical operands get
# different ids while re-lowering the same program gives the same ids. Holds the module so its id is
# not reused while counted; only the most recent modules are kept.
_ordinals: "OrderedDict[int, tuple[object, int]]" = OrderedDict()


def _ordinal(ctx) -> int:
    module = ctx.module_context.keepalives  # one list per module being lowered (shared by its sub-contexts)
    key = id(module)
    _, n = _ordinals.get(key, (module, 0))
    _ordinals[key] = (module, n + 1)
    _ordinals.move_to_end(key)
    while len(_ordinals) > 32:
        _ordinals.popitem(last=False)
    return n


def schedule_attribute(request: LoweringRequest) -> np.ndarray:
    """The ``schedule`` attribute: each group's ``Schedule.to_array()`` back to back (int64)."""
    return np.concatenate([np.asarray(s.to_array(), np.int64) for s in request.schedules])


def call_site_id(request: LoweringRequest, avals, ordinal: int) -> int:
    """Deterministic 63-bit id of a call site (same program, same ids, on every compile)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(schedule_attribute(request).tobytes())
    h.update(np.asarray(request.device_table, np.int64).tobytes())
    shapes = ",".join(f"{a.shape}:{a.dtype}" for a in avals)
    h.update(f"{request.collective}|{shapes}|{ordinal}".encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


MAX_TIMEOUT_S = 1e6

# Results aliased to operands (JAX_BLINK_ALIAS=0 turns it off, to measure both).
_ALIAS = os.environ.get("JAX_BLINK_ALIAS", "1") != "0"


def timeout_ms(default_ms: int) -> int:
    """The peer-wait timeout in ms: ``JAX_BLINK_TIMEOUT_S`` (seconds) when set, else ``default_ms``.

    Raises BlinkError when the variable is not a finite number of seconds in (0, 1e6]: a bad value
    must not silently become the default or overflow into an instant timeout.
    """
    text = os.environ.get("JAX_BLINK_TIMEOUT_S", "").strip()
    if not text:
        return int(default_ms)
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not (0 < s <= MAX_TIMEOUT_S):
        raise BlinkError(f"JAX_BLINK_TIMEOUT_S must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                         f"got {text!r}; unset it for the default {default_ms / 1000:g} s")
    return max(1, int(s * 1000))


def _produced(x) -> bool:
    """True when ``x`` is an op's result, not an argument of the function being lowered."""
    return not isinstance(x.owner, ir.Block)


def _call(target: str, ctx, xs, request: LoweringRequest, alias: bool):
    avals = ctx.avals_in
    # Alias only operands computed in this function (gradients, activations): they usually die at
    # the call, so the collective works in place on pages already touched. An argument (a jit
    # parameter, not donated) would make XLA copy it first: one more pass over fresh pages.
    aliases = {i: i for i, x in enumerate(xs) if _produced(x)} if alias else {}
    lower = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases or None)
    return list(lower(ctx, *xs,
                      schedule=schedule_attribute(request),
                      device_table=np.asarray(request.device_table, np.int64).reshape(-1),
                      call_site=np.int64(call_site_id(request, avals, _ordinal(ctx))),
                      timeout_ms=np.int64(timeout_ms(request.timeout_ms))))


def _cpu_rule(ctx, xs, request_for):
    """One custom call for the whole bucket: operand i -> result i, one schedule over the leaves'
    virtual concatenation. Results are aliased to operands so that the collective works in place
    (no fresh output pages) where an operand dies at the call; where it is still used, XLA copies it
    first. The executor reads a rank's input only before it first writes its output, so in == out is
    safe (ffi/src/blink_core.h, Leaf)."""
    request = request_for(sum(math.prod(a.shape) for a in ctx.avals_in))
    return _call(CPU_TARGET, ctx, xs, request, _ALIAS)


def _cuda_rule(ctx, xs, request_for):
    """One custom call per leaf: the CUDA handler takes one operand (not yet variadic; it has never
    run on a GPU, see README), no aliasing."""
    outs = []
    for x, a_in, a_out in zip(xs, ctx.avals_in, ctx.avals_out):
        sub = ctx.replace(avals_in=[a_in], avals_out=[a_out])
        outs += _call(CUDA_TARGET, sub, [x], request_for(math.prod(a_in.shape)), False)
    return outs


def _register(platform: str, xla_platform: str, module, target: str, missing: str | None, rule) -> None:
    if module is None:
        UNAVAILABLE[platform] = missing or "native module not built"
        return
    try:
        jax.ffi.register_ffi_target(target, module.handler(), platform=xla_platform)
    except Exception as e:  # e.g. jaxlib without this platform's plugin
        UNAVAILABLE[platform] = f"register_ffi_target({target!r}, platform={xla_platform!r}) failed: {e}"
        return
    register_lowering("ffi", platform, rule)
    REGISTERED[platform] = target


_register("cpu", "cpu", _native.cpu, CPU_TARGET, _native.cpu_error, _cpu_rule)
_register("cuda", "CUDA", _native.cuda, CUDA_TARGET, _native.cuda_error, _cuda_rule)
