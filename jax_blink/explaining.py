"""``jax_blink.explain(fn, *args, **kwargs)`` (module ``jax_blink.explaining``): what a program's
collectives run, before anything runs.

Traces and lowers ``fn`` (and, by default, compiles it: XLA inserts collectives of its own there;
nothing executes) and reports

- one row per jax_blink call site (one bucket of one collective): collective, axes and group size,
  dtype, bytes per device, the lowering chosen and why, the plan (algorithm, trees / rings, chunks),
  the cost model's predicted time, the link simulator's time of the plan, the bound's time (bytes /
  certified rate), NCCL's ring and double binary tree on the same links, the predicted speedup and
  the source line of the call. The rows are the :class:`jax_blink.callsites.CallSite` records made
  by the lowering itself from the ``LoweringRequest`` it runs, so their numbers are those of
  ``jax_blink.plan(nbytes=)`` and ``jax-blink bench`` for the same topology, devices and size;
- the XLA collectives of the compiled program that jax_blink does not handle (``lax.psum``,
  all-gathers the SPMD partitioner inserted, ...), parsed from the compiled HLO text, with their
  result sizes and replica groups: what stays on XLA's own collectives (NCCL on GPUs).

JAX caches lowerings; ``explain`` clears JAX's caches first (``jax.clear_caches()``) so the call
sites lower again and report. The report prints as a table (``rich``) and as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from . import callsites

#: HLO opcodes of collectives (the ``-start`` halves of async pairs count, ``-done`` do not).
XLA_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                   "collective-broadcast", "ragged-all-to-all")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>"
                 + "|".join(re.escape(o) for o in XLA_COLLECTIVES) + r")(?:-start)?\((?P<rest>.*)$")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass
class XlaCollective:
    """One collective of the compiled HLO that jax_blink does not run.

    Attributes: op (HLO opcode, "all-reduce", ...); name (HLO instruction); dtype; nbytes (bytes per
    device of its result; all-gather: the gathered buffer); group_size (devices per replica group,
    None when the HLO lists none); op_name (the JAX name stack, e.g. ``jit(step)/shard_map/psum``);
    source ("file:line" from the HLO metadata, or ""); spmd_generated (XLA's SPMD partitioner
    inserted it: the frontend attribute ``is_spmd_generated``, newer XLA only).
    """

    op: str
    name: str
    dtype: str
    nbytes: int
    group_size: int | None
    op_name: str
    source: str
    spmd_generated: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bytes(type_text: str) -> tuple[str, int]:
    shapes = _SHAPE.findall(type_text)
    total = sum(_ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in shapes)
    return (shapes[0][0] if shapes else "?"), int(total)


def _group_size(rest: str) -> int | None:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len([v for v in m.group(1).split(",") if v])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)  # mesh['i'=8] {'i'} (newer XLA)
    if m:
        sizes = dict(re.findall(r"'([^']*)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']*)'", m.group(2)))
    return None


def xla_collectives(hlo_text: str, *, exclude: str = "jax_blink.") -> list[XlaCollective]:
    """The collectives of HLO text ``hlo_text`` (``compiled.as_text()``), leaving out those whose
    ``op_name`` contains ``exclude`` (the jax_blink call sites' labels: the ``ppermute`` lowering's
    own collective-permutes)."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        rest = m.group("rest")
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        if exclude and exclude in op_name:
            continue
        typ = m.group("type")
        if typ.startswith("(") and m.group("op") in ("all-gather", "collective-permute", "all-to-all"):
            # async start: (operand, result, ...) tuple; the result is the second element
            parts = _SHAPE.findall(typ)
            typ = "{}[{}]".format(*parts[1]) if len(parts) > 1 else typ
        dtype, nbytes = _bytes(typ)
        file = re.search(r'source_file="([^"]*)"', rest)
        line_no = re.search(r"source_line=(\d+)", rest)
        source = f"{file.group(1)}:{line_no.group(1)}" if file and line_no else ""
        out.append(XlaCollective(m.group("op"), m.group("name"), dtype, nbytes, _group_size(rest), op_name, source,
                                 'is_spmd_generated="true"' in rest))
    return out


@dataclasses.dataclass
class Report:
    """What :func:`explain` found: ``sites`` (one :class:`~jax_blink.callsites.CallSite` per jax_blink
    call site, in lowering order) and ``xla`` (the :class:`XlaCollective` ops jax_blink does not
    handle; None when not compiled). Print it (a rich table), or :meth:`to_json`."""

    sites: list
    xla: list | None
    function: str = ""

    def to_dict(self) -> dict:
        return {"function": self.function, "call_sites": [s.to_dict() for s in self.sites],
                "xla_collectives": None if self.xla is None else [x.to_dict() for x in self.xla]}

    def to_json(self, indent: int | None = 1) -> str:
        """The report as JSON (times in seconds, sizes in bytes per device, rates in GB/s)."""
        return json.dumps(self.to_dict(), indent=indent)

    def tables(self) -> list:
        """The rich renderables: the call-site table, the lowering reasons, the XLA collectives."""
        from rich.table import Table
        from rich.text import Text

        def t(s):
            if s is None:
                return "-"
            return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms"

        out = []
        tab = Table(title=f"jax_blink call sites of {self.function or 'the program'} (times: cost model of the "
                          "lowering; simulated / bound / NCCL: link-level simulator, as `jax-blink bench`)",
                    title_justify="left")
        for col, just in (("#", "right"), ("call", "left"), ("axes (n)", "left"), ("dtype", "left"),
                          ("bytes/dev", "right"), ("lowering", "left"), ("plan", "left"), ("chunks", "right"),
                          ("predicted", "right"), ("simulated", "right"), ("bound", "right"),
                          ("NCCL ring", "right"), ("NCCL tree", "right"), ("speedup", "right"),
                          ("source", "left")):
            tab.add_column(col, justify=just, overflow="fold")
        for s in self.sites:
            axes = ",".join(map(str, s.axes)) + f" ({s.group_size}{'' if s.groups == 1 else f' x{s.groups}'})"
            tab.add_row(str(s.index), s.api.removeprefix("jax_blink."), axes, s.dtype,
                        callsites.human_bytes(s.nbytes), s.lowering, s.shape, str(s.chunks), t(s.predicted_s),
                        t(s.sim_s), t(s.bound_s), t(s.ring_s), t(s.tree_s),
                        "-" if s.speedup is None else f"{s.speedup:.2f}x", callsites.short_source(s.source))
        out.append(tab)
        if self.sites:
            why = Text()
            for s in self.sites:
                why.append(f"#{s.index} {s.lowering}: {s.why}\n")
            out.append(why)
        else:
            out.append(Text("no jax_blink call site in this program\n"))
        if self.xla is not None:
            x = Table(title="XLA collectives jax_blink does not handle (compiled HLO)", title_justify="left")
            for col in ("op", "dtype", "bytes/dev", "group", "op_name", "source"):
                x.add_column(col, overflow="fold")
            for c in self.xla:
                op = c.op + (" (SPMD partitioner)" if c.spmd_generated else "")
                group = "-" if c.group_size is None else str(c.group_size)
                x.add_row(op, c.dtype, callsites.human_bytes(c.nbytes), group, c.op_name, callsites.short_source(c.source))
            out.append(x if self.xla else Text("no other XLA collectives"))
        return out

    def print(self, console=None) -> None:
        """Print the tables to ``console`` (default: a rich Console on stdout, at the terminal's width, or
        200 columns when stdout is not a terminal, e.g. a log file, where rich would assume 80)."""
        import os
        import sys

        from rich.console import Console
        if console is None:
            console = Console() if sys.stdout.isatty() or os.environ.get("COLUMNS") else Console(width=200)
        for r in self.tables():
            console.print(r)

    def __str__(self) -> str:
        from rich.console import Console
        console = Console(width=200, record=True, file=_Null())
        self.print(console)
        return console.export_text()


class _Null:
    def write(self, _s):
        return 0

    def flush(self):
        pass


def explain(fn, *args, compile: bool = True, **kwargs) -> Report:
    """Report what each jax_blink call site of ``fn(*args, **kwargs)`` runs (module docstring).

    Args:
      fn: a function, a ``jax.jit`` / ``jax.pmap`` wrapped function (its own ``lower``), or any
        callable JAX can trace; ``args`` / ``kwargs``: arrays, ``jax.ShapeDtypeStruct`` (with
        ``sharding=`` where the program needs it) or Python values, as for ``fn.lower``.
      compile: also compile (nothing runs) to list XLA's remaining collectives (``Report.xla``);
        False: lower only (``Report.xla`` is None).

    Returns a :class:`Report` (times in seconds, sizes in bytes per device, rates in GB/s). Raises what
    tracing / lowering ``fn`` raises (jax_blink's errors for a topology that does not fit the mesh, ...).
    Clears JAX's compilation caches first.

    Method: the plans, bound and times are the lowering's own (Blink, MLSys 2020, sections 3-4: the
    packing and its max-flow / Nash-Williams certificate; :mod:`jax_blink.costmodel`); NCCL's baselines
    are the rings and double binary tree (Sanders, Speck, Traeff 2009) ``jax-blink bench`` simulates.

    Example (8 host CPU devices)::

        >>> import jax, jax.numpy as jnp, jax_blink
        >>> r = jax_blink.explain(jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i"), jnp.ones((8, 256)))
        >>> [(s.api, s.collective, s.group_size, s.nbytes, s.lowering) for s in r.sites]
        [('jax_blink.psum', 'allreduce', 8, 1024, 'ffi')]
        >>> r.xla
        []
    """
    import jax

    target = fn if hasattr(fn, "lower") else jax.jit(fn)
    jax.clear_caches()  # a cached lowering would not run the call sites' lowering rules again
    with callsites.collect() as sites:
        lowered = target.lower(*args, **kwargs)
    xla = None
    if compile:
        xla = xla_collectives(lowered.compile().as_text())
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return Report(list(sites), xla, str(name))




#: Platforms :func:`lowered_text` lowers for, and the dialects it prints.
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
DIALECTS = ("hlo", "stablehlo")


def lowered_text(fn, *args, platform: str = "cuda", dialect: str = "hlo", native_auto: bool | None = None,
                 **kwargs) -> str:
    """The program a ``platform`` machine would compile for ``fn(*args, **kwargs)``, as text, lowered here.

    Lowering only (JAX's cross-platform lowering, ``Traced.lower(lowering_platforms=(platform,))``):
    nothing compiles or runs, so no GPU, driver or CUDA module is needed. jax_blink's records for
    ``platform`` lower as they would there even where their native target cannot run here
    (``impl="ffi"`` on CUDA with the CUDA module absent or reporting no driver:
    :func:`jax_blink.lowering.lowering_only`), so the text shows the ``jax_blink_cuda`` custom calls,
    their schedule / device-table attributes, operand aliasing and the stream annotation that puts
    them on their own XLA stream (``_xla_stream_annotation``, docs/cuda.md "Overlap"). This is the
    module XLA receives, before XLA's own passes (fusion, the async wrapping of annotated calls,
    scheduling): ``lowered.compile().as_text()`` on a ``platform`` machine shows what those make of it.

    Args:
      fn: a ``jax.jit`` wrapped function (its ``trace``) or any callable JAX can trace (jitted here).
      args / kwargs: arrays, ``jax.ShapeDtypeStruct`` or Python values, as for ``jax.jit(fn).trace``;
        the mesh is that of ``fn`` (e.g. host CPU devices standing in for the GPUs: a device's id is
        its CUDA ordinal in the device table, as on a one-process machine that sees every GPU).
      platform: "cuda" (default), "rocm", "tpu" or "cpu".
      dialect: "hlo" (default; XLA's HLO text, ``frontend_attributes={...}``) or "stablehlo" (the MLIR
        module, ``mhlo.frontend_attributes = {...}``).
      native_auto: whether ``impl="auto"`` may take the native CUDA executor, as on a machine where
        ``jax-blink selftest`` passed (True) or not (False); None: as this machine decides
        (``JAX_BLINK_CUDA_NATIVE``, the self-test record).

    Returns the text (str). Raises BlinkError for an unknown ``platform`` or ``dialect`` or a ``fn``
    that is not callable, and what tracing / lowering raises (jax_blink's errors for a topology that
    does not fit the mesh, ...). Clears JAX's compilation caches before and after, so neither this
    lowering nor a later real one reuses the other's.

    Example (8 host CPU devices standing in for the 8 GPUs of a DGX H100; on a machine without GPUs
    the topology is given, as detection has nothing to detect)::

        >>> import jax, jax.numpy as jnp, numpy as np, jax_blink
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
        >>> f = jax.shard_map(lambda v: jax_blink.psum(v * 2, "d", topology="dgx-h100", impl="ffi"),
        ...                   mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        >>> text = jax_blink.lowered_text(f, jnp.ones(8 * 256))
        >>> 'custom_call_target="jax_blink_cuda"' in text, '_xla_stream_annotation="1"' in text
        (True, True)
    """
    import jax

    from . import lowering
    from .errors import BlinkError
    from .lowering import ffi as ffi_lowering
    if platform not in LOWERING_PLATFORMS:
        raise BlinkError(f"lowered_text: platform must be one of {', '.join(LOWERING_PLATFORMS)}, got {platform!r}")
    if dialect not in DIALECTS:
        raise BlinkError(f"lowered_text: dialect must be 'hlo' or 'stablehlo', got {dialect!r}")
    if not callable(fn):
        raise BlinkError(f"lowered_text: fn must be a function or a jax.jit wrapped function, got {type(fn).__name__}")
    target = fn if hasattr(fn, "trace") else jax.jit(fn)
    jax.clear_caches()  # a cached lowering (for this platform, other records) would be returned as it was
    try:
        with lowering.lowering_only(platform), ffi_lowering.assume_native_auto(platform, native_auto):
            lowered = target.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
            return lowered.as_text() if dialect == "stablehlo" else lowered.as_text(dialect="hlo")
    finally:
        jax.clear_caches()
