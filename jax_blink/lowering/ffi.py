"""FFI lowering: a schedule as one XLA FFI custom call executed by the native handlers in ``ffi/``.

Registers the ``"ffi"`` lowering records (``jax_blink.lowering.Lowering``) for platform ``"cpu"``
(target ``jax_blink_cpu``) and ``"cuda"`` (target ``jax_blink_cuda``): usable when the native module
imported and ``jax.ffi.register_ffi_target`` accepted it, else marked unavailable with the reason
(also in ``UNAVAILABLE``). Each device's call registers its buffers at a meeting keyed by (run id, call site, group,
per-device generation); the native executor then walks the schedule (Blink, MLSys 2020, Sec. 4:
reduce up and broadcast down spanning trees with pipelined chunks).

Attributes of the custom call (docs/architecture.md): ``schedule`` (int64: the group schedules'
``Schedule.to_array()`` back to back, one per group in group order), ``device_table`` (int64 rows
(device_id, group, rank)), ``call_site`` (int64, deterministic: a hash of the schedules, table,
operand type and the call's position in the module), ``timeout_ms`` (the runtime environment variable
``JAX_BLINK_TIMEOUT_S`` overrides it).

CUDA specifics. The CUDA handler identifies itself by the CUDA ordinal of its operand's buffer, so
the ``device_table`` of the CUDA target is keyed by each device's ``local_hardware_id`` (its CUDA
ordinal in this process), not ``Device.id`` (global in multi-process jobs) nor the FFI device ordinal
(which differs under a visible-device subset): :func:`cuda_device_table`. The CUDA target registers
only when ``_cuda.check_compatibility()`` passes (driver new enough for the build's CUDA runtime, a
cubin or PTX in the binary for every visible GPU); otherwise ``UNAVAILABLE["cuda"]`` says why and
``impl="auto"`` uses ppermute. Even when registered, ``impl="auto"`` on GPUs keeps using ppermute
until ``jax_blink.selftest()`` (``jax-blink selftest``) has passed on this machine and build
(:func:`native_auto_allowed`, the record's ``auto_allowed``); ``impl="ffi"`` always uses it.

Test hook: ``JAX_BLINK_TEST_ABSENT_DEVICE=<device id>`` (read by the native handler at run time)
makes that device skip every meeting, so the others hit the timeout error. Never set it otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections import OrderedDict

import jax
import numpy as np

from .. import _native, collectives, envvars
from .._jax_compat import call_in_function, ir
from ..errors import BlinkError, warn_user
from . import Lowering, LoweringRequest, host_memory_candidates, register, selftest_record, site_text

CPU_TARGET = "jax_blink_cpu"
CUDA_TARGET = "jax_blink_cuda"

#: Platforms ("cpu", "cuda") whose FFI target registered; why others did not.
REGISTERED: dict[str, str] = {}
UNAVAILABLE: dict[str, str] = {}

# Per-module call counters (module -> next ordinal), so two call sites with identical operands get
# different ids while re-lowering the same program gives the same ids. Holds the module so its id is
# not reused while counted; only the most recent modules are kept.
_ordinals: OrderedDict[int, tuple[object, int]] = OrderedDict()


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
_ALIAS = envvars.raw("JAX_BLINK_ALIAS") != "0"  # its value is checked by check_cpu_env


def timeout_ms(default_ms: int) -> int:
    """The peer-wait timeout in ms: ``JAX_BLINK_TIMEOUT_S`` (seconds) when set, else ``default_ms``.

    Raises BlinkError when the variable is not a finite number of seconds in (0, 1e6]: a bad value
    must not silently become the default or overflow into an instant timeout.
    """
    s = envvars.number("JAX_BLINK_TIMEOUT_S")
    return int(default_ms) if s is None else max(1, int(s * 1000))


#: The CPU executor's settings, read by the C++ side (ffi/src/cpu_executor.cc, EnvInt) at its first
#: call: name -> (least, largest) accepted integer. Checked here, at lowering, because the C++ side
#: can only fall back to its default for a value it cannot use.
CPU_ENV = {"JAX_BLINK_CPU_THREADS": (1, 256), "JAX_BLINK_CPU_STREAM": (0, 1), "JAX_BLINK_CPU_HUGEPAGES": (0, 1),
           "JAX_BLINK_ALIAS": (0, 1)}
#: The CUDA executor's settings and the test hook, read by the C++ side the same way (checked here too).
NATIVE_ENV = ("JAX_BLINK_CUDA_FORCE_STAGING", "JAX_BLINK_CUDA_SYNC_ERRORS", "JAX_BLINK_CUDA_CACHE_PROGRAMS",
              "JAX_BLINK_TEST_ABSENT_DEVICE")
#: JAX_BLINK_CPU_ISA caps the instruction set of the executor's sum kernels (ffi/src/cpu_sum.h):
#: the widest of these, up to the cap, that the build and the CPU have (default: no cap).
CPU_ISAS = _native.CPU_ISAS


def check_cpu_env() -> None:
    """Raises BlinkError when a variable of :data:`CPU_ENV` is set to anything but an integer in its
    range (e.g. ``JAX_BLINK_CPU_THREADS=abc`` or ``0``), or ``JAX_BLINK_CPU_ISA`` to a name not in
    :data:`CPU_ISAS` or to one this build and CPU do not run (the executor would cap at a lower set
    without a word), naming the variable, what it takes and the widest set this CPU runs."""
    for name in (*CPU_ENV, *NATIVE_ENV):
        if envvars.var(name).kind == "flag":  # the C++ side reads an integer: only 0 and 1
            text = envvars.raw(name)
            if text not in (None, "0", "1"):
                raise envvars.error(name, os.environ[name], "the native executor reads only 0 or 1")
        else:
            envvars.integer(name)  # the C++ side's grammar (EnvInt: strtol, ASCII blanks around)
    cap = envvars.choice("JAX_BLINK_CPU_ISA")
    if cap is None:
        return
    usable = _native.cpu_isas()
    if usable and cap not in usable:
        raise BlinkError(f"JAX_BLINK_CPU_ISA={cap} names an instruction set this CPU (or this build) does not run: "
                         f"it runs {', '.join(usable)}, the widest {usable[-1]!r}; set JAX_BLINK_CPU_ISA={usable[-1]} "
                         "or lower, or unset it")


def _produced(x, through_reshapes: bool = False) -> bool:
    """True when ``x`` is an op's result, not an argument of the function being lowered (with
    ``through_reshapes``: nor a reshape of one, which XLA would also copy before aliasing)."""
    while through_reshapes and not isinstance(x.owner, ir.Block) and \
            getattr(x.owner, "operation", x.owner).name == "stablehlo.reshape":
        x = x.owner.operands[0]
    return not isinstance(x.owner, ir.Block)


def cuda_device_table(table, devices, process_index: int) -> np.ndarray:
    """The CUDA target's device table: rows (device_id, group, rank) -> (local_hardware_id, group, rank).

    Args:
      table: int64 rows (device_id, group, rank) (``LoweringRequest.device_table``).
      devices: the mesh's devices (objects with ``id``, ``process_index``, ``local_hardware_id``).
      process_index: this process's index (``jax.process_index()``).
    Rows of groups with no device in this process are dropped (they meet in their own process).
    Raises BlinkError when a device of the table is missing from ``devices``, a group mixes this
    process's devices with another's (the custom call meets its peers in process memory), a device
    has no local hardware id, or two devices share one (the handler could not tell them apart).
    """
    by_id = {int(d.id): d for d in devices}
    rows = np.asarray(table, np.int64).reshape(-1, 3).copy()
    for row in rows:
        if int(row[0]) not in by_id:
            raise BlinkError(f"jax_blink ffi (CUDA): device id {int(row[0])} of the device table is not in the mesh")
    # Groups wholly in other processes (a hierarchical local phase lists every process's groups so
    # that all processes lower one program) meet there: their rows are dropped here.
    local = {int(r[1]) for r in rows if int(getattr(by_id[int(r[0])], "process_index", 0)) == int(process_index)}
    rows = rows[[int(r[1]) in local for r in rows]] if local else rows
    seen = {}
    for row in rows:
        dev = by_id[int(row[0])]
        if int(getattr(dev, "process_index", 0)) != int(process_index):
            raise BlinkError(f"jax_blink ffi (CUDA): device {dev.id} belongs to process {dev.process_index}, not "
                             f"this one ({process_index}); the native executor runs inside one process: use "
                             "impl='ppermute' or impl='auto'")
        hw = getattr(dev, "local_hardware_id", None)
        if hw is None or int(hw) < 0:
            raise BlinkError(f"jax_blink ffi (CUDA): device {dev.id} has no local hardware id")
        if int(hw) in seen:
            raise BlinkError(f"jax_blink ffi (CUDA): devices {seen[int(hw)]} and {dev.id} share local hardware id {hw}")
        seen[int(hw)] = dev.id
        row[0] = int(hw)
    return rows.reshape(-1)


#: JAX_BLINK_CUDA_STREAM: the XLA stream the CUDA custom call runs on (``_xla_stream_annotation``);
#: 0 keeps it on the compute stream, in program order (the behaviour before the annotation).
ENV_STREAM = "JAX_BLINK_CUDA_STREAM"
DEFAULT_STREAM = 1
MAX_STREAM = 63


def cuda_stream() -> int:
    """The stream the CUDA custom call is annotated with: ``JAX_BLINK_CUDA_STREAM`` (an integer in
    0..63) or :data:`DEFAULT_STREAM`; 0 means no annotation. Raises BlinkError for anything else
    (read at lowering, so a bad value fails the call that lowers, not a compile deep in XLA)."""
    n = envvars.integer(ENV_STREAM)
    return DEFAULT_STREAM if n is None else n


def stream_attributes(stream: int) -> dict[str, str]:
    """The frontend attributes that put a call on XLA:GPU stream ``stream`` (> 0), as
    ``jax.experimental.compute_on(f"gpu_stream:{stream}")`` writes them: ``_xla_stream_annotation``
    (honoured under ``--xla_gpu_experimental_stream_annotation``, on by default at jax 0.10.2 and
    0.12) and ``inlineable="false"`` (so XLA's call inliner keeps the call that carries it)."""
    return {"_xla_stream_annotation": str(int(stream)), "inlineable": "false"}


def _call(target: str, ctx, xs, request: LoweringRequest, alias: bool, table=None, stream: int = 0,
          block_order=None):
    avals = ctx.avals_in
    sharded = collectives.get(request.collective).sharded
    table = np.asarray(request.device_table, np.int64).reshape(-1) if table is None else table
    # Alias only operands computed in this function (gradients, activations): they usually die at
    # the call, so the collective works in place on pages already touched. An argument (a jit
    # parameter, not donated) would make XLA copy it first: one more pass over fresh pages.
    aliases = {i: i for i, x in enumerate(xs)
               if _produced(x, sharded) and ctx.avals_out[i].shape == avals[i].shape} if alias else {}
    lower = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases or None)
    attrs = dict(schedule=schedule_attribute(request), device_table=table,
                 call_site=np.int64(call_site_id(request, avals, _ordinal(ctx))),
                 timeout_ms=np.int64(timeout_ms(request.timeout_ms)))
    if target == CPU_TARGET:  # one block: the buffer as the schedule sees it (cpu_module.cc, BlockOrderLeaves)
        attrs["block_order"] = np.asarray([0] if block_order is None else block_order, np.int64)
        attrs["where"] = site_text() or "(outside jax_blink's call sites)"  # named by timeouts

    def emit(args):
        return list(lower(ctx, *args, **attrs))
    if not stream:
        return emit(xs)
    # The aliases were decided on the caller's values above; inside the function every operand is an
    # argument, and the custom call's result i still aliases its operand i there.
    return call_in_function(ctx, xs, emit, f"{target}_call", stream_attributes(stream))


def _cpu_rule(ctx, xs, request_for, block_order=None):
    """One custom call for the whole bucket: operand i -> result i, one schedule over the leaves'
    virtual concatenation. Results are aliased to operands so that the collective works in place
    (no fresh output pages) where an operand dies at the call; where it is still used, XLA copies it
    first. The executor reads a rank's input only before it first writes its output, so in == out is
    safe (ffi/src/blink_core.h, Leaf). An all-gather may pass its shard as the one operand with the
    full buffer as result (the record's ``shard_input``): the executor copies the shard straight into
    place; a reduce-scatter may return only the rank's shard (the record's ``shard_output``): the
    executor sums it straight into the result, with no full-size result buffer (fresh pages) and no
    slice copy after the call. ``block_order`` (one operand; the hierarchical lowering): virtual
    block k of the schedule is block ``block_order[k]`` of the full-size buffer (the all-gather's
    result, the reduce-scatter's operand), so the blocks land in rank order without a copy."""
    check_cpu_env()
    request = request_for(sum(max(math.prod(a.shape), math.prod(b.shape))
                              for a, b in zip(ctx.avals_in, ctx.avals_out)))
    return _call(CPU_TARGET, ctx, xs, request, _ALIAS, block_order=block_order)


def _cuda_rule(ctx, xs, request_for):
    """One custom call for the whole bucket, as on CPU (operand i -> result i, one schedule over the
    leaves' virtual concatenation, results aliased to operands that die at the call); the GPU program
    maps chunks onto the leaf buffers and treats an aliased leaf as one buffer, race-checked in CI
    (``ffi/src/gpu_program.h``). Its device table is keyed by local hardware id (``cuda_device_table``).

    The call sits in a private function whose ``call`` carries the stream annotation of
    :func:`stream_attributes` (stream :func:`cuda_stream`): XLA:GPU makes it an async ``call-start`` /
    ``call-done`` pair on that stream, which the latency-hiding scheduler overlaps with independent
    compute (docs/cuda.md, "Overlap"). ``JAX_BLINK_CUDA_STREAM=0`` keeps the plain custom call."""
    request = request_for(sum(math.prod(a.shape) for a in ctx.avals_out))
    devices = list(ctx.module_context.axis_context.mesh.devices.flat)
    table = cuda_device_table(request.device_table, devices, jax.process_index())
    return _call(CUDA_TARGET, ctx, xs, request, _ALIAS, table, stream=cuda_stream())


# ------------------------------------------------------------------------------ safe default on GPUs
ENV_NATIVE = "JAX_BLINK_CUDA_NATIVE"
_said = set()
_ASSUMED: dict[str, bool] = {}  # platform -> answer of native_auto_allowed inside assume_native_auto


@contextlib.contextmanager
def assume_native_auto(platform: str, allowed: bool | None):
    """Within the block :func:`native_auto_allowed` answers ``allowed`` for ``platform`` (as on a
    machine whose self-test passed, or not), without a warning; None leaves it as it is. For
    lowering for a machine other than this one (``jax_blink.lowered_text``)."""
    if allowed is None:
        yield
        return
    saved = _ASSUMED.get(platform)
    _ASSUMED[platform] = bool(allowed)
    try:
        yield
    finally:
        if saved is None:
            del _ASSUMED[platform]
        else:
            _ASSUMED[platform] = saved


def native_auto_allowed(platform: str) -> bool:
    """May ``impl="auto"`` use the native executor on ``platform``?

    CPU: yes. CUDA: only once ``jax_blink.selftest()`` recorded a pass for this machine and build
    (GPU names, driver version, module build id; see ``jax_blink.lowering.selftest_record``), or when
    ``JAX_BLINK_CUDA_NATIVE=1``; ``JAX_BLINK_CUDA_NATIVE=0`` always says no. The first refusal is
    reported once (a warning naming the command that enables it).

    Raises:
      BlinkError: ``JAX_BLINK_CUDA_NATIVE`` is set to anything but 0 or 1.
    """
    if platform != "cuda":
        return True
    if platform in _ASSUMED:
        return _ASSUMED[platform]
    env = envvars.flag(ENV_NATIVE)
    if env is not None:
        return env
    if selftest_record.has_passed():
        return True
    if platform not in _said:
        _said.add(platform)
        warn_user("jax_blink: impl='auto' uses the portable ppermute lowering on GPUs until the native CUDA "
                  "executor has passed its self-test on this machine: run `jax-blink selftest` once (or set "
                  f"{ENV_NATIVE}=1 to trust it, or pass impl='ffi')", UserWarning)
    return False


# ------------------------------------------------------------------------------ registration
def _register_target(platform: str, module, target: str, xla_platform: str, missing: str | None) -> str | None:
    """Register ``target`` with XLA for ``platform``: None when done, else why it cannot be."""
    if module is None:
        return missing or "native module not built"
    if platform == "cuda":
        try:
            why = module.check_compatibility()
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            why = f"compatibility check failed: {e}"
        if why:
            return (f"{why} (module built with CUDA {module.built_cuda_version()}, "
                    f"architectures {module.built_architectures()})")
    try:
        jax.ffi.register_ffi_target(target, module.handler(), platform=xla_platform)
    except Exception as e:  # e.g. jaxlib without this platform's plugin
        return f"register_ffi_target({target!r}, platform={xla_platform!r}) failed: {e}"
    return None


#: Seconds of one schedule step of the CPU executor: an in-process wait between the device threads
#: for a chunk a peer thread wrote (a few us, estimate).
CPU_STEP_LATENCY_S = 5e-6
#: Seconds of one schedule step of the CUDA executor's device-side interpreter (one kernel per device
#: per call): a chunk hop is the sender's stores, a release fence and a flag store in
#: peer-visible memory, seen by the receiver's acquire poll, the synchronisation of NCCL's Simple
#: protocol. NCCL prices a Simple-protocol ring step over NVLink at 3.4 us (src/graph/tuning.cc, hwLat
#: [NVLINK][RING][SIMPLE], NCCL 2.19-2.23; LL's flag-in-every-8-bytes steps 0.6 us); the simulator
#: adds the link kind's protocol latency (``simulate.PROTOCOL_LATENCY_US``: 0.6 us NVLink, 1.0 us
#: PCIe) to this per-send latency, so an NVLink hop costs 2.8 + 0.6 = 3.4 us. The launch (~5 us,
#: once per call, not per step) does not change which schedule wins and is not part of this figure.
CUDA_STEP_LATENCY_S = 2.8e-6


def cuda_errors() -> str:
    """The first failed jax_blink CUDA collective of this process not reported yet, or "".

    The CUDA executor does not wait for its kernels (docs/cuda.md, "Errors"): a rank that gives up
    waiting writes an error record into pinned host memory while its kernel runs, and the next
    jax_blink CUDA call (any call site) fails with that message, naming the rank that never arrived.
    A job with no next call (its last step, a benchmark loop's end) asks here; each failure is
    reported once, by whichever comes first. Never waits; "" without the CUDA module.
    """
    mod = _native.cuda
    poll = getattr(mod, "poll_errors", None) if mod is not None else None
    return poll() if poll is not None else ""


def _register(platform: str, xla_platform: str, module, target: str, missing: str | None, rule,
              step_latency_s: float, **fields) -> None:
    why = _register_target(platform, module, target, xla_platform, missing)
    if why is None:
        REGISTERED[platform] = target
    else:
        UNAVAILABLE[platform] = why
    # No barrier per round (per-tree pipelines); peers meet in process memory, so one process only.
    register(Lowering("ffi", platform, rule, step_latency_s=step_latency_s, round_synchronous=False,
                      multi_process=False, auto_priority=0, auto_allowed=native_auto_allowed,
                      description="native XLA FFI custom call", unavailable=why, **fields))


_register("cpu", "cpu", _native.cpu, CPU_TARGET, _native.cpu_error, _cpu_rule, CPU_STEP_LATENCY_S,
          candidates=host_memory_candidates, shard_input=True, shard_output=True)
_register("cuda", "CUDA", _native.cuda, CUDA_TARGET, _native.cuda_error, _cuda_rule, CUDA_STEP_LATENCY_S,
          chunks_as_simulated=True, peer_routes=True)
