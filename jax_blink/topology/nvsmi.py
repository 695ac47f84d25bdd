"""Parse ``nvidia-smi topo -m`` (and an appended ``nvidia-smi topo -p2p``) into a Topology.

The input is what people paste: space- or tab-aligned columns, ``X`` on the diagonal, ``NV<n>``
(n bonded NVLinks), the PCIe relations ``PIX`` (at most one PCIe switch), ``PXB`` (several switches,
no host bridge), ``PHB`` (through a CPU host bridge), ``NODE`` (across host bridges of one NUMA
node), ``SYS`` (across the SMP interconnect between NUMA nodes; old drivers print ``SOC``), NIC rows
and columns (``mlx5_0``, ``NIC0``), ``CPU Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID`` columns,
legend lines (``NIC0: mlx5_0`` names are kept as the NIC's ``device`` attribute), and optionally a
``topo -p2p`` matrix (``OK``; anything else, ``NS``/``GNS``/``CNS``/``TNS``/``U``, means no
peer-to-peer).

The model built (:func:`build_topology`, shared with NVML discovery):

- Rates are achieved GB/s per direction (:mod:`jax_blink.topology.presets`): by default from the GPU model
  (``gpu=``, :func:`jax_blink.topology.presets.gpu_model`: NVLink generation, PCIe generation and width);
  without it the NVLink generation is read from the links per GPU (at most 6: NVLink2 as on V100, 12:
  NVLink3 as on A100, more: NVLink4 as on H100; ``topo -m`` names no GPU model), and PCIe is that
  GPU generation's (gen3 x16 with NVLink2, gen4 x16 with NVLink3, gen5 x16 with NVLink4; gen3 x16
  without NVLink). ``Topology.notes`` says what was inferred.
- NVLink: ``NV<n>`` gives a ``nvlink`` edge of n links x ``nvlink_gbps``. When a GPU's NVLink counts
  summed over its peers exceed ``max_nvlinks_per_gpu`` (18: no GPU has more links), the links cannot
  be direct: the GPUs sit behind an NVSwitch (nvidia-smi prints ``NV<links per GPU>`` for every pair
  there, e.g. NV18 on an H100 box). Then one ``"nvswitch"`` node joins every GPU with its link count.
- PCIe: the tree is inferred by closure. Devices joined by PIX share a ``pcie-switch``; PIX/PXB
  groups with several switches get an upstream ``pcie-switch``; PHB groups with several members get
  a host bridge node (``cpu<s>-bridge<i>``, kind ``cpu``); each NUMA node (devices joined by
  PIX/PXB/PHB/NODE or sharing NUMA/CPU affinity) is a ``cpu<s>`` node; sockets are joined pairwise
  by a ``host`` link of ``inter_socket_gbps``. A level with one child is skipped. Every PCIe hop is
  ``pcie_gbps``. ``NV<n>`` hides a pair's PCIe relation, so such pairs only share a switch when
  other cells (e.g. a NIC's PIX) say so. NICs not on any GPU's NUMA node are left out.
- No peer-to-peer (``topo -p2p r|w|p`` not OK, or no mode given): the pair's NVLink edge is dropped
  and any PCIe switch/bridge holding both GPUs is dissolved into its parent, so their traffic must
  pass through the ``cpu`` node (host memory), as the CUDA driver stages it; each such GPU node gets
  the attribute ``no_p2p`` (the sorted peers it cannot reach directly), so the simulator charges
  those transfers two copies through host memory. Matrices for modes
  ``n`` (NVLink) and ``a`` (atomics) are checked but do not change the model.

Errors are :class:`TopologyError` naming the line and cell, the value and what was expected.

Limits (docs/limits.md, "Topology files"): at most :data:`jax_blink.topology.model.MAX_MACHINE_GPUS`
(64) GPUs, as many NIC columns, and :data:`jax_blink.topology.model.MAX_FILE_BYTES` of text: a matrix
is one machine (the largest have 16 GPUs) and holds n^2 cells. ``NV<n>`` has n from 1 to
:data:`jax_blink.topology.model.MAX_NVLINKS`. ``CPU Affinity`` / ``NUMA Affinity`` values are CPU lists
(``0-11,24-35``) and ``GPU NUMA ID`` a number, or ``N/A``; anything else is refused (a garbled value
would silently add a CPU socket). Columns after the affinity ones that the parser does not know are
ignored and named in ``Topology.notes``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

import networkx as nx

from ..errors import TopologyError
from . import model
from .model import MAX_MACHINE_GPUS, MAX_NVLINKS, Topology, check_number, check_rates, show, source_text
from .presets import gpu_model, pcie_gen_gbps
from .presets import nvlink_gbps as _nvlink_rate

PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ALIASES = {"SOC": "SYS"}
P2P_CODES = ("OK", "NS", "GNS", "CNS", "TNS", "U")
_NV_RE = re.compile(r"NV(\d+)")
_GPU_RE = re.compile(r"GPU(\d+)")
_NIC_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}")
# affinity values: a CPU (or NUMA node) list "0-11,24-35" (numbers of at most 7 digits), or one number
_CPU_LIST_RE = re.compile(r"\d{1,7}(?:-\d{1,7})?(?:,\d{1,7}(?:-\d{1,7})?)*")
_AFFINITY_FORMS = {"CPU Affinity": (_CPU_LIST_RE, "a CPU list like 0-11,24-35"),
                   "NUMA Affinity": (_CPU_LIST_RE, "a NUMA node number like 0 (or a list like 0-1)"),
                   "GPU NUMA ID": (re.compile(r"\d{1,7}"), "a NUMA node number like 0")}
_AFFINITY_WORDS = {"CPU", "NUMA", "Affinity", "ID", "GPU"}
_AFFINITY_PHRASES = (("GPU", "NUMA", "ID"), ("CPU", "Affinity"), ("NUMA", "Affinity"))
_RESERVED_PREFIXES = ("cpu", "pcie-", "nvswitch", "gpu", "host", "network")
_LEGEND_RE = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*$")
# ANSI escape sequences: nvidia-smi underlines the header (ESC[4m ... ESC[0m) on a terminal.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

_EXPECTED_TOPO = "X, NV<n>, PIX, PXB, PHB, NODE or SYS"


@dataclass
class _Matrix:
    header_line: int
    columns: list[str]
    extra_columns: list[str]
    mode: str | None
    rows: dict[str, tuple[int, list[str], list[str]]] = field(default_factory=dict)
    kind: str = ""  # "topo" | "p2p"


def parse_topo(text: str, *, nvlink_gbps: float | None = None, pcie_gbps: float | None = None,
               inter_socket_gbps: float = 20.0, max_nvlinks_per_gpu: int = 18,
               nvswitch: bool | None = None, gpu: str | None = None, name: str = "nvidia-smi") -> Topology:
    """Parse ``nvidia-smi topo -m`` text (optionally followed by ``topo -p2p`` output).

    Args:
      text: the pasted output (str or UTF-8 bytes); ANSI escape codes (the underlined header
        nvidia-smi prints on a terminal) are ignored.
      nvlink_gbps: achieved GB/s per direction of one NVLink (None: from ``gpu`` or the link counts,
        module docstring; 22.9 for V100, 17.3 for A100, 20.6 for H100).
      pcie_gbps: achieved GB/s per direction of every PCIe hop (None: from ``gpu`` or the NVLink
        generation; 12 for gen3 x16, 24 for gen4).
      gpu: the GPU model name (e.g. "A100 80GB PCIe", "RTX 2080 Ti"; :data:`jax_blink.topology.presets.GPU_MODELS`).
      inter_socket_gbps: GB/s per direction between two CPU sockets (QPI/UPI/xGMI).
      max_nvlinks_per_gpu: links per GPU above which ``NV<n>`` rows mean an NVSwitch fabric.
      nvswitch: force (True) or forbid (False) the NVSwitch reading; None infers it.
      name: the Topology's name.

    Returns a Topology with GPU nodes 0..n-1 (from ``GPU<i>``) and the nodes described in the
    module docstring. Raises TopologyError on empty input, no matrix, a malformed or non-square
    matrix, an unknown code, asymmetric cells, duplicate or missing GPUs, naming line and cell.
    """
    text = _ANSI_RE.sub("", source_text(text, "the text output of `nvidia-smi topo -m`"))
    if not text.strip():
        raise TopologyError("empty input: expected the output of `nvidia-smi topo -m` "
                            "(a header line starting with GPU0, then one row per GPU)")
    lines = text.splitlines()
    matrices, nic_legend = _scan(lines)
    topo = [m for m in matrices if m.kind == "topo"]
    if not topo:
        raise TopologyError("no `nvidia-smi topo -m` matrix found: expected a header line "
                            "'GPU0 GPU1 ... [CPU Affinity ...]' followed by rows 'GPU0 X NV1 ...'")
    if len(topo) > 1:
        raise TopologyError(f"two `nvidia-smi topo -m` matrices (header lines {topo[0].header_line} and "
                            f"{topo[1].header_line}); pass one machine at a time")
    m = topo[0]
    gpus = _gpu_columns(m)
    n = len(gpus)
    for g in range(n):
        if f"GPU{g}" not in m.rows:
            raise TopologyError(f"line {m.header_line}: the header has column GPU{g} but there is no "
                                f"row GPU{g}; expected one row per GPU (a square matrix)")
    nic_cols = [c for c in m.columns if not _GPU_RE.fullmatch(c)]
    nic_id = {}
    for c in nic_cols:
        nid = c.lower()
        if not _NIC_RE.fullmatch(c) or nid.startswith(_RESERVED_PREFIXES):
            raise TopologyError(f"line {m.header_line}: column {c!r} is neither GPU<i> nor a NIC name "
                                f"(like mlx5_0 or NIC0)")
        nic_id[c] = nid
    dev = {f"GPU{g}": g for g in range(n)} | nic_id

    cell = {}  # (row name, column name) -> (code, line)
    for r, (ln, cells, _extra) in m.rows.items():
        for c, code in zip(m.columns, cells):
            cell[r, c] = (code, ln)
            if (r == c) != (code == "X"):
                want = "X (the device itself)" if r == c else f"a link code ({_EXPECTED_TOPO}), not X"
                raise TopologyError(f"line {ln}, row {r}, column {c}: got {code!r}; expected {want}")
    nvlinks, pcie = {}, {}
    for (r, c), (code, ln) in cell.items():
        if r == c:
            continue
        back = cell.get((c, r))
        if back is not None and back[0] != code:
            what = "NVLink counts" if code.startswith("NV") or back[0].startswith("NV") else "cells"
            raise TopologyError(f"asymmetric {what}: line {ln} row {r} column {c} is {code!r} but line "
                                f"{back[1]} row {c} column {r} is {back[0]!r}; expected the same value")
        a, b = dev[r], dev[c]
        key = frozenset((a, b))
        nv = _NV_RE.fullmatch(code)
        if nv:
            if isinstance(a, int) and isinstance(b, int):
                nvlinks[key] = int(nv.group(1))
        else:
            pcie[key] = _ALIASES.get(code, code)

    affinity, notes = {}, []
    unknown_cols = [c for c in m.extra_columns if c not in _AFFINITY_FORMS]
    if unknown_cols:
        notes.append(f"ignored column(s) {', '.join(map(show, unknown_cols[:6]))} of the header on line "
                     f"{m.header_line} (known after the link columns: {', '.join(_AFFINITY_FORMS)})")
    for r, (ln, _cells, extra) in m.rows.items():
        vals = dict(zip(m.extra_columns, extra))
        for col, v in vals.items():
            if col in _AFFINITY_FORMS:
                _check_affinity(v, col, r, ln)
        for col in ("NUMA Affinity", "CPU Affinity"):
            v = vals.get(col)
            if v and v.upper() != "N/A":
                affinity[dev[r]] = (col, v)
                break

    no_p2p = set()
    for p in matrices:
        if p.kind != "p2p":
            continue
        for c in p.columns:
            if not _GPU_RE.fullmatch(c) or c not in m.columns:
                raise TopologyError(f"line {p.header_line}: p2p matrix column {c!r} is not a GPU of the "
                                    f"topo -m matrix (GPUs: GPU0..GPU{n - 1})")
        if p.mode in ("n", "a"):
            continue  # NVLink / atomics capability: informative only
        for r, (ln, cells, _e) in p.rows.items():
            for c, code in zip(p.columns, cells):
                if (r == c) != (code == "X"):
                    raise TopologyError(f"line {ln}, row {r}, column {c}: got {code!r} in the p2p matrix; "
                                        f"expected {'X' if r == c else 'OK or a not-supported code'}")
                if r != c and code != "OK":
                    no_p2p.add(frozenset((dev[r], dev[c])))

    nic_attrs = {nic_id[c]: {"device": nic_legend[c]} for c in nic_cols if c in nic_legend}
    t = build_topology(n, list(nic_id.values()), pcie, nvlinks, no_p2p=no_p2p, affinity=affinity,
                       nic_attrs=nic_attrs, nvlink_gbps=nvlink_gbps, pcie_gbps=pcie_gbps,
                       inter_socket_gbps=inter_socket_gbps, max_nvlinks_per_gpu=max_nvlinks_per_gpu,
                       nvswitch=nvswitch, gpu=gpu, name=name)
    t.notes.extend(notes)
    return t


def _check_affinity(value: str, col: str, row: str, ln: int) -> None:
    """Refuse an affinity cell that is neither ``N/A`` nor the column's form (a CPU list, a number)."""
    pattern, want = _AFFINITY_FORMS[col]
    if value.upper() == "N/A":
        return
    if pattern.fullmatch(value):
        ranges = [tuple(map(int, item.split("-"))) for item in value.split(",") if "-" in item]
        if all(a <= b for a, b in ranges):
            return
    raise TopologyError(f"line {ln}, row {row}, column {col!r}: got {show(value)}; expected {want}, or N/A")


# ----------------------------------------------------------------------------- scanning
def _is_code(tok: str) -> bool:
    return (tok == "X" or tok in PCIE_LEVELS or tok in _ALIASES or tok in P2P_CODES
            or _NV_RE.fullmatch(tok) is not None)


def _scan(lines: list[str]) -> tuple[list[_Matrix], dict[str, str]]:
    """Find every matrix (header + rows) and the NIC legend in ``lines``."""
    matrices, legend, mode = [], {}, None
    i = 0
    while i < len(lines):
        toks = lines[i].split()
        lm = _LEGEND_RE.match(lines[i])
        if lm:
            legend[lm.group(1)] = lm.group(2)
        if "-p2p" in toks:
            k = toks.index("-p2p")
            mode = toks[k + 1].lower() if k + 1 < len(toks) else None
        if toks and _GPU_RE.fullmatch(toks[0]) and not any(_is_code(t) for t in toks[1:]):
            mat = _header(toks, i + 1, mode)
            j = i + 1
            while j < len(lines):
                rt = lines[j].split()
                if not rt or (rt[0] not in mat.columns and not _GPU_RE.fullmatch(rt[0])):
                    break
                if _GPU_RE.fullmatch(rt[0]) and not any(_is_code(t) for t in rt[1:]):
                    break  # another header line starts the next matrix
                if rt[0] not in mat.columns:
                    raise TopologyError(f"line {j + 1}: row {rt[0]} is not a column of the header on line "
                                        f"{i + 1} (columns: {' '.join(mat.columns)})")
                if rt[0] in mat.rows:
                    raise TopologyError(f"line {j + 1}: duplicate row {rt[0]} (first on line "
                                        f"{mat.rows[rt[0]][0]})")
                _row(mat, rt, j + 1)
                j += 1
            _classify(mat)
            matrices.append(mat)
            mode = None
            i = j
            continue
        i += 1
    return matrices, legend


def _header(toks: list[str], ln: int, mode: str | None) -> _Matrix:
    k = 0
    while k < len(toks) and toks[k] not in _AFFINITY_WORDS:
        k += 1
    cols, rest = toks[:k], toks[k:]
    if len(cols) > 2 * MAX_MACHINE_GPUS:
        raise TopologyError(f"line {ln}: the header has {len(cols):,} columns; at most {MAX_MACHINE_GPUS} "
                            f"GPUs and {MAX_MACHINE_GPUS} NICs (a `topo -m` matrix is one machine: "
                            f"MAX_MACHINE_GPUS, docs/limits.md)")
    seen = set()
    for c in cols:
        if c in seen:
            raise TopologyError(f"line {ln}: duplicate column {c} in the header; expected each GPU/NIC once")
        seen.add(c)
    extra = []
    while rest:
        for ph in _AFFINITY_PHRASES:
            if tuple(rest[:len(ph)]) == ph:
                extra.append(" ".join(ph))
                rest = rest[len(ph):]
                break
        else:
            extra.append(rest.pop(0))
    return _Matrix(ln, cols, extra, mode)


def _row(mat: _Matrix, toks: list[str], ln: int) -> None:
    name, vals = toks[0], toks[1:]
    n = len(mat.columns)
    if len(vals) < n:
        raise TopologyError(f"line {ln}: row {name} has {len(vals)} cells; expected {n} "
                            f"(one per column {' '.join(mat.columns)})")
    cells, extra = vals[:n], vals[n:]
    if len(extra) > len(mat.extra_columns):
        raise TopologyError(f"line {ln}: row {name} has {len(vals)} cells; expected {n} link cells plus at "
                            f"most {len(mat.extra_columns)} affinity values "
                            f"({', '.join(mat.extra_columns) or 'none in the header'})")
    mat.rows[name] = (ln, cells, extra)


def _classify(mat: _Matrix) -> None:
    """Decide whether ``mat`` is a topo -m or a topo -p2p matrix and check every cell's code."""
    cells = [(ln, r, c, code) for r, (ln, cs, _e) in mat.rows.items() for c, code in zip(mat.columns, cs)]
    topo = any(code in PCIE_LEVELS or code in _ALIASES or _NV_RE.fullmatch(code) for *_, code in cells)
    if not topo and cells and all(code == "X" or code in P2P_CODES for *_, code in cells) \
            and any(code in P2P_CODES for *_, code in cells):
        mat.kind = "p2p"
        return
    mat.kind = "topo"
    for ln, r, c, code in cells:
        nv = _NV_RE.fullmatch(code)
        if nv:
            digits = nv.group(1)
            check_number(int(digits) if len(digits) <= 9 else math.inf, f"line {ln}, row {r}, column {c}: "
                         f"{show(code)}: the NVLink count of NV<n>", "count", hi=MAX_NVLINKS)
        if not (code == "X" or code in PCIE_LEVELS or code in _ALIASES or nv):
            raise TopologyError(f"line {ln}, row {r}, column {c}: unknown link code {code!r}; "
                                f"expected {_EXPECTED_TOPO}")


def _gpu_columns(m: _Matrix) -> list[int]:
    ids = []
    for c in m.columns:
        g = _GPU_RE.fullmatch(c)
        if g is None:
            continue
        if len(g.group(1)) > 6 or int(g.group(1)) >= MAX_MACHINE_GPUS:  # (no int() of 10^4 digits)
            raise TopologyError(f"line {m.header_line}: column {show(c)}: GPU ids of one `topo -m` matrix "
                                f"are 0 to {MAX_MACHINE_GPUS - 1} (at most {MAX_MACHINE_GPUS} GPUs per "
                                f"machine: MAX_MACHINE_GPUS, docs/limits.md)")
        ids.append(int(g.group(1)))
    if not ids:
        raise TopologyError(f"line {m.header_line}: the header names no GPU columns; expected GPU0, GPU1, ...")
    if len(set(ids)) != len(ids):
        raise TopologyError(f"line {m.header_line}: duplicate GPU column (GPU0 and GPU00 are the same GPU)")
    missing = sorted(set(range(max(ids) + 1)) - set(ids))
    if missing:
        raise TopologyError(f"line {m.header_line}: GPU{missing[0]} is missing; expected GPU0..GPU{max(ids)} "
                            f"with none left out (got {', '.join(f'GPU{i}' for i in sorted(ids))})")
    return sorted(ids)


# ----------------------------------------------------------------------------- rates
# NVLinks per GPU -> NVLink generation, when no GPU model is given: V100 has 6 links, A100 12, H100 18.
NVLINK_GENERATION_BY_LINKS = ((6, 2), (12, 3), (18, 4))
# NVLink generation -> PCIe generation of the GPUs that have it (V100 gen3, A100 gen4, H100/B200 gen5).
PCIE_GEN_BY_NVLINK = {1: 3, 2: 3, 3: 4, 4: 5, 5: 5}


def _default_rates(gpu, nvlink_gbps, pcie_gbps, nv, nvswitch_links, notes):
    """Achieved (NVLink, PCIe) GB/s per link: the given ones, else from ``gpu``'s model, else inferred
    from the NVLinks per GPU (module docstring). Appends what it inferred to ``notes``."""
    spec = gpu_model(gpu)
    if gpu and spec is None:
        notes.append(f"GPU model {gpu!r} is not in presets.GPU_MODELS: rates inferred from the links")
    gen = spec[0] if spec else None
    links = max([sum(c for k, c in nv.items() if g in k) for g in {x for k in nv for x in k}]
                + list((nvswitch_links or {}).values()) + [0])
    if links > NVLINK_GENERATION_BY_LINKS[-1][0]:  # NV<n> on every pair: an NVSwitch, n links per GPU
        links = max(nv.values())
    if gen is None and links and not spec:
        gen = next((g for most, g in NVLINK_GENERATION_BY_LINKS if links <= most), 4)
        if nvlink_gbps is None:
            notes.append(f"NVLink generation {gen} inferred from {links} NVLinks per GPU (no GPU model "
                         f"given): {_nvlink_rate(gen):.3g} GB/s achieved per link; pass gpu= to set it")
    if nvlink_gbps is None:
        nvlink_gbps = _nvlink_rate(gen if gen else 2)
    if pcie_gbps is None:
        if spec:
            pcie_gbps = pcie_gen_gbps(spec[1], spec[2])
        else:
            pcie_gbps = pcie_gen_gbps(PCIE_GEN_BY_NVLINK[gen] if gen else 3)
            notes.append(f"PCIe taken as gen{PCIE_GEN_BY_NVLINK[gen] if gen else 3} x16 "
                         f"({pcie_gbps:.3g} GB/s achieved){' for NVLink' + str(gen) + ' GPUs' if gen else ''}; "
                         f"set it with --pcie-gbps (jax-blink topology) or gpu= / pcie_gbps= (Python)")
    return float(nvlink_gbps), float(pcie_gbps)


# ----------------------------------------------------------------------------- model building
@dataclass
class _Group:
    level: int  # index into PCIE_LEVELS: 0 switch, 1 upstream switch, 2 host bridge, 3 NUMA node
    children: list


def build_topology(n_gpus: int, nics: list[str], pcie: dict, nvlinks: dict, *, no_p2p=(),
                   affinity: dict | None = None, nic_attrs: dict | None = None,
                   nvlink_gbps: float | None = None, pcie_gbps: float | None = None,
                   inter_socket_gbps: float = 20.0, max_nvlinks_per_gpu: int = 18,
                   nvswitch: bool | None = None, nvswitch_links: dict | None = None, gpu: str | None = None,
                   name: str = "nvidia-smi") -> Topology:
    """Build the model described in the module docstring from pairwise relations.

    Args:
      n_gpus: GPUs 0..n_gpus-1.
      nics: NIC node ids (strings).
      pcie: ``frozenset({a, b}) -> code`` in :data:`PCIE_LEVELS` (absent = unknown, e.g. hidden by NV).
      nvlinks: ``frozenset({i, j}) -> n`` bonded NVLinks between GPUs i and j.
      no_p2p: GPU pairs (frozensets) without peer-to-peer support.
      affinity: device -> hashable NUMA/CPU affinity (devices with equal values share a socket).
      nic_attrs: NIC id -> extra node attributes.
      nvswitch_links: GPU -> NVLinks it has into an NVSwitch, when known (NVML reports links to the
        switch itself); these GPUs join one ``"nvswitch"`` node and ``nvlinks`` keeps direct links.
      nvlink_gbps, pcie_gbps, inter_socket_gbps, max_nvlinks_per_gpu, nvswitch, gpu, name: as in
        :func:`parse_topo`.

    Raises TopologyError on bandwidths that are not finite numbers in range
    (:func:`jax_blink.topology.model.check_number`) or more than
    :data:`jax_blink.topology.model.MAX_MACHINE_GPUS` GPUs.
    """
    check_rates(nvlink_gbps=nvlink_gbps, pcie_gbps=pcie_gbps, inter_socket_gbps=inter_socket_gbps)
    check_number(n_gpus, "n_gpus", "count", hi=MAX_MACHINE_GPUS)
    check_number(max_nvlinks_per_gpu, "max_nvlinks_per_gpu", "count", hi=MAX_NVLINKS * MAX_MACHINE_GPUS)
    affinity = affinity or {}
    no_p2p = set(no_p2p)
    t = Topology(name)
    for g in range(n_gpus):
        peers = sorted(x for k in no_p2p if g in k for x in k if x != g)
        t.add_gpu(g, **({"no_p2p": tuple(peers)} if peers else {}))
    for nic in nics:
        t.add_switch(nic, "nic", **(nic_attrs or {}).get(nic, {}))

    # NVLink: direct links, or one NVSwitch when the counts exceed what a GPU has.
    nv = {k: c for k, c in nvlinks.items() if k not in no_p2p}
    per_gpu = {g: sum(c for k, c in nv.items() if g in k) for g in range(n_gpus)}
    nvlink_gbps, pcie_gbps = _default_rates(gpu, nvlink_gbps, pcie_gbps, nv, nvswitch_links, t.notes)
    if nvswitch is None:
        nvswitch = any(v > max_nvlinks_per_gpu for v in per_gpu.values())
    if nvswitch_links:
        t.add_switch("nvswitch", "nvswitch")
        for g, links in sorted(nvswitch_links.items()):
            if links:
                t.add_link(g, "nvswitch", nvlink_gbps, "nvswitch", links=int(links))
        nvswitch = False  # the remaining pairwise counts are direct links
    if nvswitch and nv:
        t.add_switch("nvswitch", "nvswitch")
        for g in range(n_gpus):
            links = max((c for k, c in nv.items() if g in k), default=0)
            if links:
                t.add_link(g, "nvswitch", nvlink_gbps, "nvswitch", links=links)
    else:
        for k, c in sorted(nv.items(), key=lambda kv: sorted(kv[0])):
            a, b = sorted(k)
            t.add_link(a, b, nvlink_gbps, "nvlink", links=c)

    # Sockets: closure of PIX/PXB/PHB/NODE and equal affinity, then merge groups nothing separates.
    devs = list(range(n_gpus)) + list(nics)
    order = {d: i for i, d in enumerate(devs)}
    same = nx.Graph()
    same.add_nodes_from(devs)
    same.add_edges_from(tuple(k) for k, code in pcie.items() if code != "SYS" and len(k) == 2)
    by_aff = {}
    for d in devs:
        if d in affinity:
            by_aff.setdefault(affinity[d], []).append(d)
    for members in by_aff.values():
        same.add_edges_from(zip(members, members[1:]))
    groups = sorted((sorted(c, key=order.get) for c in nx.connected_components(same)),
                    key=lambda c: order[c[0]])
    merged: list[list] = []
    for grp in groups:
        for tgt in merged:
            sys_pair = any(pcie.get(frozenset((a, b))) == "SYS" for a in grp for b in tgt)
            affs = {affinity[d] for d in grp + tgt if d in affinity}
            if not sys_pair and len(affs) <= 1:
                tgt.extend(grp)
                break
        else:
            merged.append(list(grp))
    sockets = [sorted(s, key=order.get) for s in merged if any(isinstance(d, int) for d in s)]
    placed = {d for s in sockets for d in s}
    for nic in nics:
        if nic not in placed:
            t.graph.remove_node(nic)  # not on any GPU's NUMA node: nothing to place it under

    counters = {"switch": 0, "bridge": 0}

    def split(members: list, level: int):
        if len(members) == 1:
            return members[0]
        if level == 0:
            children = list(members)
        else:
            codes = set(PCIE_LEVELS[:level])
            sub = nx.Graph()
            sub.add_nodes_from(members)
            sub.add_edges_from((a, b) for a, b in itertools.combinations(members, 2)
                               if pcie.get(frozenset((a, b))) in codes)
            parts = sorted((sorted(c, key=order.get) for c in nx.connected_components(sub)),
                           key=lambda c: order[c[0]])
            children = [split(p, level - 1) for p in parts]
        return children[0] if len(children) == 1 else _Group(level, children)

    def leaves(x):
        return [x] if not isinstance(x, _Group) else [y for c in x.children for y in leaves(c)]

    def emit(x, parent: str, s: int) -> None:
        if not isinstance(x, _Group):
            t.add_link(x, parent, pcie_gbps, "pcie")
            return
        gl = [d for d in leaves(x) if isinstance(d, int)]
        if any(frozenset(p) in no_p2p for p in itertools.combinations(gl, 2)):
            for c in x.children:  # no peer-to-peer inside: their traffic must reach the CPU
                emit(c, parent, s)
            return
        if x.level <= 1:
            node = f"pcie-switch-{counters['switch']}"
            counters["switch"] += 1
            t.add_switch(node, "pcie-switch")
        else:
            node = f"cpu{s}-bridge{counters['bridge']}"
            counters["bridge"] += 1
            t.add_switch(node, "cpu")
        t.add_link(node, parent, pcie_gbps, "pcie")
        for c in x.children:
            emit(c, node, s)

    for s, members in enumerate(sockets):
        cpu = f"cpu{s}"
        t.add_switch(cpu, "cpu")
        root = split(members, 3)
        if isinstance(root, _Group) and root.level >= 2:
            # the socket's one host bridge is the CPU itself
            for c in root.children:
                emit(c, cpu, s)
        else:
            emit(root, cpu, s)
    for a, b in itertools.combinations(range(len(sockets)), 2):
        t.add_link(f"cpu{a}", f"cpu{b}", inter_socket_gbps, "host")
    return t


model.register_source("nvidia_smi", parse_topo)
