"""Every ``JAX_BLINK_*`` environment variable: its type, range, default and meaning, in one registry,
and the one parser that reads them.

Each variable is a :class:`Var` in :data:`REGISTRY`. Readers call :func:`flag`, :func:`integer`,
:func:`number`, :func:`choice`, :func:`text` or :func:`address`; each returns None when the variable
is unset, empty or only blanks (empty means unset for every variable: the default stands), else the
parsed value, and raises :class:`EnvVarError` naming the variable, the value and what it takes for
anything else. Integers follow the C++ side's grammar (``strtol`` on ASCII digits with ASCII blanks
around: ``ffi/src/cpu_executor.cc``), so a value Python accepts is one the native executor reads
the same way. Bounds are those of the consumer: a value passed on to jax or XLA is checked against
what they accept (XLA parses ``--xla_cpu_collective_timeout_seconds`` as a 32-bit int).

:func:`render_markdown` renders the table of docs/environment.md (between its BEGIN / END markers;
``tests/docs/test_environment_table.py`` keeps them equal).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from .errors import BlinkError

_ASCII_SPACE = " \t\n\v\f\r"  # what the C++ side trims (isspace in the C locale)
_INT = re.compile(r"[+-]?[0-9]+")
_TRUE, _FALSE = ("1", "true", "on"), ("0", "false", "off")


class EnvVarError(BlinkError, ValueError):
    """A ``JAX_BLINK_*`` variable holds a value its reader cannot use; the message names the variable,
    the value and what it takes."""


@dataclasses.dataclass(frozen=True)
class Var:
    """One variable: ``kind`` "flag" (0 / 1), "int" / "float" (within ``lo`` .. ``hi``; a float must be
    finite and > ``lo`` when ``lo_open``), "choice" (one of ``choices``), "text", "path", "address"
    (``host:port``); ``section`` "Run time", "Several processes" or "Build time"; ``reader``: who reads
    it when not jax_blink's Python (the native executor, CMake, a script, the tests)."""

    name: str
    kind: str
    meaning: str
    section: str = "Run time"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()
    reader: str = ""

    def takes(self) -> str:
        """What the variable takes, in words (for errors and the table)."""
        if self.kind == "flag":
            return "0 or 1 (also false / true, off / on)"
        if self.kind == "int":
            return f"an integer in {_fmt(self.lo)}..{_fmt(self.hi)}"
        if self.kind == "float":
            left = "(" if self.lo_open else "["
            return f"a finite number in {left}{_fmt(self.lo)}, {_fmt(self.hi)}]"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "address":
            return "host:port with a port in 1..65535"
        return "a path" if self.kind == "path" else "text"


def _fmt(v) -> str:
    return f"{int(v)}" if float(v).is_integer() else f"{v:g}"


_RUN, _PROC, _BUILD = "Run time", "Several processes", "Build time"
_VARS = (
    Var("JAX_BLINK_TOPOLOGY", "text",
        "topology when `topology=` is not given: preset name or file (`topo -m` text, NCCL XML or JSON), or "
        "`probe`: the job's devices as measured by `jax_blink.probe` (Blink section 3), cached per machine and "
        "device set in `$JAX_BLINK_CACHE_DIR` (`jax-blink topology probe` re-measures)"),
    Var("JAX_BLINK_ALGORITHM", "choice",
        "`auto` (default), `trees`, `ring` (all-reduce, all-gather, reduce-scatter), `rsag` (all-reduce) or "
        "`hierarchical` (several nodes); a preference: collectives it does not apply to plan with `auto` "
        "(one RuntimeWarning)", choices=("auto", "trees", "ring", "rsag", "hierarchical")),
    Var("JAX_BLINK_TIMEOUT_S", "float",
        "seconds a native collective waits for its peers before failing with the missing devices named "
        "(default 60); also the `JAX_BLINK_WATCH` arrival check's timeout", lo=0, hi=1e6, lo_open=True),
    Var("JAX_BLINK_LOG", "choice",
        "`info`: one line per jax_blink call site at lowering (logger `jax_blink`: lowering and why, plan, "
        "chunks, predicted / simulated / bound / NCCL times, source line); `debug`: also the plan's trees; "
        "unset: nothing", choices=("info", "debug")),
    Var("JAX_BLINK_WATCH", "flag",
        "`1`: call sites whose groups span processes check through the `jax.distributed` key-value store that "
        "every process arrives; a timeout names the missing processes, their hosts, devices, last completed call "
        "site and the phase (default off: a key-value round trip and a host synchronisation per call site and "
        "step, see [limits.md](limits.md))"),
    Var("JAX_BLINK_CPU_THREADS", "int", "threads of the CPU executor, the calling one included (default: one "
        "per core, at most 16)", lo=1, hi=256, reader="the CPU executor (checked at lowering)"),
    Var("JAX_BLINK_CPU_HUGEPAGES", "flag", "`0` turns off the transparent-huge-page hint on outputs of 8 MiB "
        "or more that are not aliased to their operand", reader="the CPU executor (checked at lowering)"),
    Var("JAX_BLINK_CPU_STREAM", "flag", "`0` turns off non-temporal stores for the final broadcast copies of "
        "calls moving more than 32 MiB", reader="the CPU executor (checked at lowering)"),
    Var("JAX_BLINK_CPU_ISA", "choice",
        "caps the instruction set of the CPU executor's sums (default: the widest this CPU runs; "
        "`jax_blink.cpu_isa()` says which); a set this CPU does not run is refused at the call, naming the "
        "widest it runs", choices=("baseline", "avx2", "avx512")),
    Var("JAX_BLINK_ALIAS", "flag", "`0` stops aliasing the custom call's results to its operands (for "
        "measurements)"),
    Var("JAX_BLINK_CUDA_NATIVE", "flag", "`1`: `impl=\"auto\"` uses the native CUDA executor without a "
        "recorded self-test; `0`: never"),
    Var("JAX_BLINK_CUDA_STREAM", "int",
        "the XLA stream the CUDA custom call runs on (its `_xla_stream_annotation`, default 1: async next to "
        "the compute stream); `0`: no annotation, the call runs on the compute stream in program order",
        lo=0, hi=63),
    Var("JAX_BLINK_CUDA_FORCE_STAGING", "flag", "`1`: the CUDA executor stages every cross-rank source "
        "through host-pinned memory (tests the no-peer path)", reader="the CUDA executor (checked at lowering)"),
    Var("JAX_BLINK_CUDA_SYNC_ERRORS", "flag",
        "`1`: each CUDA call waits for its kernels and fails itself when a rank never arrived (default: a "
        "failed call's error records make the next jax_blink CUDA call of the process fail naming the rank; "
        "docs/cuda.md, \"Errors\")", reader="the CUDA executor (checked at lowering)"),
    Var("JAX_BLINK_CUDA_CACHE_PROGRAMS", "int", "call sites whose interpreter programs the CUDA executor keeps "
        "(default 64; least recently used evicted, freed once its work completed)", lo=1, hi=1 << 20,
        reader="the CUDA executor (checked at lowering)"),
    Var("JAX_BLINK_CACHE_DIR", "path",
        "where `jax-blink selftest` records passes, probed topologies, plans (`plans/`) and the calibration are "
        "kept (default `$XDG_CACHE_HOME/jax_blink`, else `~/.cache/jax_blink`)"),
    Var("JAX_BLINK_PLAN_CACHE", "flag",
        "`0`: do not cache plans on disk (default on: one file per request; an entry that does not re-certify "
        "is planned again and rewritten)"),
    Var("JAX_BLINK_CALIBRATION", "flag", "`0`: ignore `jax-blink calibrate`'s measurements (the cost model's "
        "defaults decide between jax_blink and XLA); default: use them when present"),
    Var("JAX_BLINK_COMBINE_THRESHOLD_BYTES", "int",
        "bytes per bucket under which `transform` combines independent collectives into one call (default 30 "
        "MiB, XLA's all-reduce combiner's; `0`: one call per collective)", lo=0, hi=1 << 50),
    Var("JAX_BLINK_TEST_ABSENT_DEVICE", "int", "test hook: that device's native calls never arrive (the peer "
        "timeout's tests)", lo=0, hi=1 << 20, reader="the native executors (tests only)"),
    Var("JAX_BLINK_COORDINATOR", "address", "what `jax_blink.distributed.initialize()` joins when its "
        "arguments are not given: the coordinator's `host:port` (`jax_blink.launch` sets it)", section=_PROC),
    Var("JAX_BLINK_NUM_PROCESSES", "int", "the number of processes of the job (`jax_blink.launch` sets it)",
        section=_PROC, lo=1, hi=65536),
    Var("JAX_BLINK_PROCESS_ID", "int", "this process's index, 0..N-1 (`jax_blink.launch` sets it)",
        section=_PROC, lo=0, hi=65535),
    Var("JAX_BLINK_LOCAL_DEVICES", "int", "set by `jax_blink.launch` for each process: its number of local "
        "(CPU) devices", section=_PROC, lo=1, hi=4096, reader="jax_blink.launch's workers"),
    Var("JAX_BLINK_COLLECTIVE_TIMEOUT_S", "int",
        "read by `jax_blink.distributed.initialize`: seconds an XLA collective between processes on CPU (gloo) "
        "waits for a process that never calls it (default 300; sets `--xla_cpu_collective_timeout_seconds` "
        "unless `XLA_FLAGS` has it; XLA reads a 32-bit int)", section=_PROC, lo=1, hi=2**31 - 1),
    Var("JAX_BLINK_FAULTS", "flag", "`0` turns off the default fault handling across processes: a process that "
        "raises or calls `sys.exit(code)` is named by its peers, which stop at once ([cluster.md](cluster.md))",
        section=_PROC),
    Var("JAX_BLINK_HOST", "text", "the host a process counts as in `distributed.cluster_topology()` (default "
        "`socket.gethostname()`): processes of one host share one node", section=_PROC),
    Var("JAX_BLINK_NODE_TOPOLOGY", "text", "each process's own topology (a preset name, a file, or `detect`) "
        "when `distributed.cluster_topology` is given none", section=_PROC),
    Var("JAX_BLINK_NIC_GBPS", "float", "`distributed.cluster_topology`: GB/s per direction per NIC (default "
        "12.5)", section=_PROC, lo=0, hi=1e4, lo_open=True),
    Var("JAX_BLINK_NICS_PER_NODE", "int", "`distributed.cluster_topology`: NICs per node (default 1)",
        section=_PROC, lo=1, hi=64),
    Var("JAX_BLINK_CUDA", "choice", "`AUTO` (default: build the CUDA module where an NVIDIA driver and a CUDA "
        "compiler are found), `ON`, `OFF` ([installation.md](installation.md#cuda-builds))", section=_BUILD,
        choices=("AUTO", "ON", "OFF"), reader="CMake"),
    Var("JAX_BLINK_CUDA_ARCH", "text", "CMake define (`-Ccmake.define.JAX_BLINK_CUDA_ARCH=90-real`): the CUDA "
        "architectures to compile (default: sm_75..sm_90 + PTX, and sm_70 with nvcc 12)", section=_BUILD,
        reader="CMake"),
    Var("JAX_BLINK_CUDA118_DIR", "path", "`scripts/build_cuda118.sh`: where the CUDA 11.8 toolkit is fetched "
        "and laid out (default `~/.cache/jax_blink/cuda118`)", section=_BUILD, reader="scripts/build_cuda118.sh"),
)
#: name -> :class:`Var`, every ``JAX_BLINK_*`` variable the project reads.
REGISTRY: dict[str, Var] = {v.name: v for v in _VARS}


def var(name: str) -> Var:
    """The registered variable ``name``; KeyError for a name not in :data:`REGISTRY` (a reader of an
    unregistered variable is a bug the registry test catches)."""
    return REGISTRY[name]


def raw(name: str) -> str | None:
    """The variable's text with ASCII blanks around it removed, or None when unset or empty."""
    var(name)
    text = os.environ.get(name)
    if text is None:
        return None
    text = text.strip(_ASCII_SPACE)
    return text or None


def error(name: str, value, problem: str = "") -> EnvVarError:
    """The :class:`EnvVarError` for ``name=value``: what is wrong, what it takes, what to do."""
    v = var(name)
    why = f"{problem}; " if problem else ""
    return EnvVarError(f"{name}={value!r}: {why}{name} takes {v.takes()}; unset it (or set it empty) for the "
                       f"default")


def flag(name: str) -> bool | None:
    """``0`` / false / off -> False, ``1`` / true / on -> True (any case), unset / empty -> None;
    anything else: EnvVarError. (The native executors read only 0 and 1: :func:`check` holds those
    variables to them.)"""
    text = raw(name)
    if text is None:
        return None
    key = text.lower()
    if key not in _TRUE + _FALSE:
        raise error(name, os.environ[name])
    return key in _TRUE


def integer(name: str) -> int | None:
    """An integer within the variable's range (C++ ``strtol`` grammar: ASCII digits, optional sign), or
    None when unset / empty; EnvVarError otherwise (10^20, ``1.5``, ``nan``, ``1_0`` alike)."""
    v, text = var(name), raw(name)
    if text is None:
        return None
    if not _INT.fullmatch(text):
        raise error(name, os.environ[name], "not an integer")
    n = int(text)
    if (v.lo is not None and n < v.lo) or (v.hi is not None and n > v.hi):
        raise error(name, os.environ[name], "out of range")
    return n


def number(name: str) -> float | None:
    """A finite float within the variable's range, or None when unset / empty; EnvVarError otherwise
    (nan, inf, 1e999, text)."""
    v, text = var(name), raw(name)
    if text is None:
        return None
    try:
        x = float(text)
    except ValueError:
        raise error(name, os.environ[name], "not a number") from None
    low_ok = v.lo is None or (x > v.lo if v.lo_open else x >= v.lo)
    if not (math.isfinite(x) and low_ok and (v.hi is None or x <= v.hi)):
        raise error(name, os.environ[name], "not finite or out of range")
    return x


def choice(name: str, *, casefold: bool = False) -> str | None:
    """One of the variable's choices (compared in lower case with ``casefold``), or None when unset /
    empty; EnvVarError otherwise."""
    v, text = var(name), raw(name)
    if text is None:
        return None
    key = text.lower() if casefold else text
    if key not in v.choices:
        raise error(name, os.environ[name], "not one of its values")
    return key


def text(name: str) -> str | None:
    """The variable's text (blanks around removed), or None when unset / empty."""
    return raw(name)


def address(name: str) -> str | None:
    """``host:port`` (a bracketed IPv6 host allowed) with a port in 1..65535, or None when unset /
    empty; EnvVarError otherwise (jax's own parser fails with an IndexError on a missing port)."""
    text = raw(name)
    if text is None:
        return None
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})", text)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise error(name, os.environ[name], "not host:port")
    return text


def check(names=None) -> None:
    """Parse every registered variable of ``names`` (default: all read by Python, not build-time ones)
    by its kind: raises the first EnvVarError. Used at lowering for those the native executors read
    (a value they cannot use would otherwise fall back to their default without a word)."""
    readers = {"flag": flag, "int": integer, "float": number, "choice": choice, "address": address,
               "text": text, "path": text}
    for name in names if names is not None else [v.name for v in _VARS if v.section != _BUILD]:
        v = var(name)
        if v.kind == "choice":
            choice(name, casefold=name == "JAX_BLINK_LOG")
        else:
            readers[v.kind](name)


def render_markdown() -> str:
    """The tables of docs/environment.md: one per section, ``| variable | takes | meaning |``."""
    out = []
    for section in (_RUN, _PROC, _BUILD):
        out += [f"## {section}", "", "| variable | takes (empty = unset) | meaning |", "|---|---|---|"]
        for v in _VARS:
            if v.section == section:
                who = f" Read by {v.reader}." if v.reader else ""
                out.append(f"| `{v.name}` | {v.takes()} | {v.meaning}.{who} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


BEGIN_MARK = "<!-- BEGIN environment table"
END_MARK = "<!-- END environment table -->"


def rewrite_doc(text: str) -> str:
    """``text`` (docs/environment.md) with the part between its BEGIN / END markers replaced by
    :func:`render_markdown` (``python -m jax_blink.envvars docs/environment.md`` writes it)."""
    head, _, rest = text.partition(BEGIN_MARK)
    _, _, tail = rest.partition(END_MARK)
    note = (" (generated from jax_blink/envvars.py: edit the registry there, then run\n"
            "`python -m jax_blink.envvars docs/environment.md`) -->\n")
    return f"{head}{BEGIN_MARK}{note}{render_markdown()}{END_MARK}{tail}"


if __name__ == "__main__":
    import pathlib
    import sys

    doc = pathlib.Path(sys.argv[1])
    doc.write_text(rewrite_doc(doc.read_text()))
