"""``jax_blink.explain(fn, *args, **kwargs)`` (module ``jax_blink.explaining``): what a program's
collectives run, before anything runs.

Traces and lowers ``fn`` (and, by default, compiles it: XLA inserts collectives of its own there;
nothing executes) and reports

- one row per jax_blink call site (one bucket of one collective): collective, axes and group size,
  dtype, bytes per device, the lowering chosen and why, the plan (algorithm, trees / rings, chunks),
  the cost model's predicted time, the link simulator's time of the plan, the bound's time (bytes /
  certified rate), NCCL's ring and double binary tree on the same links, what NCCL's own tuner runs
  there (:mod:`jax_blink.nccl_model`: algorithm / protocol, time), the predicted speedup and
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


def _t(s) -> str:
    """Seconds as "12.3 us" / "4.56 ms", "-" for None."""
    if s is None:
        return "-"
    if s < 1e-6:
        return f"{s * 1e9:.3g} ns"
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms"


#: Short names of plan shapes for narrow tables.
_ABBREV = {"double-binary-tree": "dbtree", "hierarchical": "3-phase"}


def compact_shape(shape: str) -> str:
    """``Plan.shape()`` in a few characters: "trees, 24 trees" -> "trees x24", "double-binary-tree,
    2 trees" -> "dbtree x2", "ring, 1 ring" -> "ring x1"."""
    alg, _, rest = shape.partition(", ")
    count = rest.split(" ", 1)[0]
    return f"{_ABBREV.get(alg, alg)} x{count}" if count.isdigit() else shape


def sources_text(sources, limit: int = 3, dirs: bool = True) -> str:
    """Distinct "file:line" of ``sources`` (the file's last two path parts, or with ``dirs=False`` its
    name; functions left out) with their counts, in first-seen order: "linen/normalization.py:129 x2;
    examples/train.py:55" (at most ``limit``, then "+k more")."""
    counts: dict = {}
    for src in sources:
        one = callsites.short_source(src.split(" < ")[0]).split(" (")[0]
        one = one if dirs else one.rsplit("/", 1)[-1]
        counts[one] = counts.get(one, 0) + 1
    items = [f"{k} x{n}" if n > 1 else k for k, n in counts.items()]
    return "; ".join(items[:limit]) + (f"; +{len(items) - limit} more" if len(items) > limit else "")


def _nccl(s) -> float | None:
    """NCCL's time at a site: its tuner's choice (nccl_model) where modelled, else the faster simulated baseline."""
    if s.nccl_s is not None:
        return s.nccl_s
    nccl = [t for t in (s.ring_s, s.tree_s) if t is not None]
    return min(nccl) if nccl else None


@dataclasses.dataclass
class Report:
    """What :func:`explain` found: ``sites`` (one :class:`~jax_blink.callsites.CallSite` per jax_blink
    call site, i.e. per bucket, in lowering order), ``xla`` (the :class:`XlaCollective` ops jax_blink
    does not handle; None when not compiled), ``gpu_sites`` (the call sites of the same program lowered
    for CUDA, ``platform="cuda"``, when the topology describes GPUs and this machine is not one; None
    otherwise) and ``gpu_note`` (how they were made, or why there are none). Print it (rich tables that
    fit the console's width, a summary at the end), or :meth:`to_json`."""

    sites: list
    xla: list | None
    function: str = ""
    gpu_sites: list | None = None
    gpu_note: str = ""

    def to_dict(self) -> dict:
        return {"function": self.function, "call_sites": [s.to_dict() for s in self.sites],
                "xla_collectives": None if self.xla is None else [x.to_dict() for x in self.xla],
                "gpu_call_sites": None if self.gpu_sites is None else [s.to_dict() for s in self.gpu_sites],
                "gpu_note": self.gpu_note, "summary": self.summary()}

    def to_json(self, indent: int | None = 1) -> str:
        """The report as JSON (times in seconds, sizes in bytes per device, rates in GB/s)."""
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> dict:
        """Totals: ``call_sites``, ``buckets`` (call sites running several collectives), ``collectives``
        (collectives the call sites run; a site not from ``jax_blink.transform``'s combining counts as
        one), ``leaves``; per machine ("here", and "gpu" when lowered for CUDA): ``predicted_s``,
        ``simulated_s`` and ``nccl_s`` (sums over the sites; NCCL: its faster of ring and double binary
        tree per site, simulated on the same links, what lax's collectives run on GPUs), and
        ``slower_than_nccl`` (indices of the sites whose simulated time exceeds NCCL's)."""
        def machine(sites):
            sims = [s.sim_s for s in sites if s.sim_s is not None]
            ncc = [(s, _nccl(s)) for s in sites]
            return {"predicted_s": float(sum(s.predicted_s for s in sites)),
                    "simulated_s": float(sum(sims)) if sims else None,
                    "nccl_s": float(sum(n for _, n in ncc if n is not None)) if any(n for _, n in ncc) else None,
                    "slower_than_nccl": [s.index for s, n in ncc if n is not None and s.sim_s is not None
                                         and s.sim_s > n]}
        out = {"call_sites": len(self.sites), "buckets": sum(len(s.sources) > 1 for s in self.sites),
               "collectives": sum(max(1, len(s.sources)) for s in self.sites),
               "leaves": sum(s.leaves for s in self.sites), "here": machine(self.sites)}
        if self.gpu_sites is not None:
            out["gpu"] = machine(self.gpu_sites)
        return out

    def tables(self, width: int = 200) -> list:
        """The rich renderables for a console ``width`` columns wide: the call sites as this machine
        runs them, the reasons (each distinct one once), the same sites on a GPU machine of the
        topology (when lowered for CUDA), XLA's other collectives, the summary. Below 150 columns the
        bound and NCCL's ring / tree split are left out (NCCL: the faster of the two), plans are
        abbreviated and a call column that says the same on every row goes into the title; below 110
        this machine's table keeps predicted and the speedup over NCCL only (the JSON has every
        field); rich then fits the rest to ``width``, wrapping the source column."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        wide, narrow = width >= 150, width < 110

        def table(title, cols):
            tab = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
            for col in cols:
                left = col in ("call", "runs", "source", "op", "op_name", "dtype")
                tab.add_column(col, justify="left" if left else "right", overflow="fold",
                               no_wrap=col not in ("source", "op_name"))
            return tab

        def times(s, here=True):
            tuner = "-" if s.nccl_s is None else f"{_t(s.nccl_s)} {s.nccl_choice}"
            nccl = [_t(s.bound_s), _t(s.ring_s), _t(s.tree_s), tuner] if wide else [] if narrow and here else [
                _t(_nccl(s))]
            sim = [] if narrow and here else [_t(s.sim_s)]
            return [_t(s.predicted_s), *sim, *nccl, "-" if s.speedup is None else f"{s.speedup:.2f}x"]

        def runs(s):
            return f"{s.lowering} {s.shape}, {s.chunks} ch" if wide else f"{s.lowering} {compact_shape(s.shape)}"

        def time_cols(here=True):
            nccl = ["bound", "NCCL ring", "NCCL tree", "NCCL tuner"] if wide else [] if narrow and here else ["NCCL"]
            return ["predicted", *([] if narrow and here else ["simulated"]), *nccl, "vs NCCL"]

        out = []
        platform = self.sites[0].platform if self.sites else "-"
        apis = {s.api for s in self.sites}
        one_api = len(apis) == 1 and not wide
        title = f"jax_blink call sites of {self.function or 'the program'} as this machine ({platform}) runs them"
        if one_api:
            title += f" (every one a {next(iter(apis))})"
        tab = table(title, ["#", *([] if one_api else ["call"]), "leaves", "bytes/dev", "runs", *time_cols(),
                            "source"])
        whys: dict = {}
        for s in self.sites:
            whys.setdefault(s.why, []).append(s.index)
            call = [] if one_api else [s.api.removeprefix("jax_blink.")]
            tab.add_row(str(s.index), *call, str(s.leaves), callsites.human_bytes(s.nbytes), runs(s), *times(s),
                        sources_text(s.sources or (s.source,), 3 if wide else 2, dirs=wide))
        out.append(tab)
        if self.sites:
            why = Text()
            for text, idx in whys.items():
                which = "every site" if len(idx) == len(self.sites) else "sites " + _ranges(idx)
                why.append(f"why ({which}): {text}\n")
            for text in dict.fromkeys(s.plan_why for s in self.sites if s.plan_why):
                why.append(f"plan: {text}\n")
            out.append(why)
        else:
            out.append(Text("no jax_blink call site in this program\n"))
        if self.gpu_sites:
            g = table("the same call sites on a GPU machine with this topology", ["#", "runs", *time_cols(False)])
            for s in self.gpu_sites:
                g.add_row(str(s.index), runs(s), *times(s, False))
            out.append(g)
            out.append(Text(f"GPU machine: {self.gpu_note}\n"))
        elif self.gpu_note:
            out.append(Text(f"GPU machine: {self.gpu_note}\n"))
        if self.xla is not None:
            x = table("XLA collectives jax_blink does not handle (compiled HLO)",
                      ["op", "dtype", "bytes/dev", "group", "op_name", "source"])
            for c in self.xla:
                op = c.op + (" (SPMD partitioner)" if c.spmd_generated else "")
                group = "-" if c.group_size is None else str(c.group_size)
                x.add_row(op, c.dtype, callsites.human_bytes(c.nbytes), group, c.op_name,
                          callsites.short_source(c.source))
            out.append(x if self.xla else Text("no other XLA collectives"))
        out.append(Text(self.summary_text()))
        return out

    def summary_text(self) -> str:
        """The summary as lines of text (see :meth:`summary`)."""
        d = self.summary()
        lines = [f"summary: {d['call_sites']} jax_blink call site(s), {d['buckets']} of them bucket(s) of several "
                 f"collectives; {d['collectives']} collective(s), {d['leaves']} leaves"]
        for name, m in (("this machine", d["here"]), ("a GPU machine of the topology", d.get("gpu"))):
            if m is None:
                continue
            slow = m["slower_than_nccl"]
            lines.append(f"  {name}: predicted {_t(m['predicted_s'])} in all, simulated {_t(m['simulated_s'])} vs "
                         f"NCCL {_t(m['nccl_s'])}; {len(slow)} site(s) slower than NCCL"
                         + (f" (#{_ranges(slow)})" if slow else ""))
        if self.xla:
            lines.append(f"  {len(self.xla)} XLA collective(s) jax_blink does not handle")
        return "\n".join(lines) + "\n"

    def print(self, console=None) -> None:
        """Print the tables to ``console`` (default: a rich Console on stdout, whose width is the
        terminal's, ``$COLUMNS``, or rich's default of 80 when neither is known)."""
        from rich.console import Console
        console = Console() if console is None else console
        for r in self.tables(console.width):
            console.print(r)

    def __str__(self) -> str:
        from rich.console import Console
        console = Console(width=200, record=True, file=_Null())
        self.print(console)
        return console.export_text()


def _ranges(idx) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, idx = [], sorted(idx)
    k = 0
    while k < len(idx):
        j = k
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[k]) if j == k else f"{idx[k]}-{idx[j]}")
        k = j + 1
    return ", ".join(out)


class _Null:
    def write(self, _s):
        return 0

    def flush(self):
        pass


def explain(fn, *args, compile: bool = True, gpu: bool | None = None, **kwargs) -> Report:
    """Report what each jax_blink call site of ``fn(*args, **kwargs)`` runs (module docstring).

    Args:
      fn: a function, a ``jax.jit`` / ``jax.pmap`` wrapped function (its own ``lower``), or any
        callable JAX can trace; ``args`` / ``kwargs``: arrays, ``jax.ShapeDtypeStruct`` (with
        ``sharding=`` where the program needs it) or Python values, as for ``fn.lower``.
      compile: also compile (nothing runs) to list XLA's remaining collectives (``Report.xla``);
        False: lower only (``Report.xla`` is None).
      gpu: also lower ``fn`` for CUDA (``platform="cuda"``, nothing compiles) and report what a GPU
        machine with the call sites' topology would run (``Report.gpu_sites``: its plans, predicted,
        simulated, bound and NCCL columns). None (default): when the topology describes GPUs
        (links other than host memory), this machine is not a GPU one and the mesh lies in one
        process.

    Returns a :class:`Report` (times in seconds, sizes in bytes per device, rates in GB/s). Raises what
    tracing / lowering ``fn`` raises (jax_blink's errors for a topology that does not fit the mesh, ...);
    a failed CUDA lowering is reported in ``Report.gpu_note`` instead. Clears JAX's compilation caches
    first.

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
    name = str(name).rsplit(".", 1)[-1] if "<locals>" in str(name) else name
    sites = list(sites)
    if gpu is None:
        gpu = (any(s.gpu_topology and s.platform != "cuda" for s in sites)
               and all(s.processes == 1 for s in sites))
    gpu_sites, note = (_gpu_sites(fn, sites, args, kwargs) if gpu else
                       (None, "" if not sites or sites[0].platform == "cuda" else
                        "not shown: the topology describes no GPUs (host memory only)"))
    return Report(sites, xla, str(name), gpu_sites, note)


def _gpu_sites(fn, sites, args, kwargs):
    """The call sites of ``fn`` lowered for CUDA here (as :func:`lowered_text` does, the native CUDA
    executor allowed as on a machine where its self-test passed) and a note; (None, why) when that
    lowering fails or finds other call sites than this machine's."""
    import jax

    from . import lowering
    from .lowering import ffi as ffi_lowering
    target = fn if hasattr(fn, "trace") else jax.jit(fn)
    jax.clear_caches()
    try:
        with lowering.lowering_only("cuda"), ffi_lowering.assume_native_auto("cuda", True), \
                callsites.collect() as gsites:
            target.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    except Exception as err:  # noqa: BLE001 - a report of what could not be shown, not a failure of explain
        return None, f"not shown: lowering for CUDA failed here ({type(err).__name__}: {str(err)[:200]})"
    finally:
        jax.clear_caches()
    gsites = list(gsites)
    if len(gsites) != len(sites):
        return None, f"not shown: lowering for CUDA found {len(gsites)} call sites, this machine {len(sites)}"
    return gsites, ("platform='cuda', lowered here as lowered_text does; the native executor assumed "
                    "self-tested there")




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
