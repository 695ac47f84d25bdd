"""Parse NCCL's topology XML (``NCCL_TOPO_DUMP_FILE`` writes it, ``NCCL_TOPO_FILE`` reads it) into a Topology.

The format (NCCL ``src/graph/xml.cc`` writes it, ``src/graph/topo.cc`` reads it)::

    <system version="1">
      <cpu numaid="0" affinity="..." arch="x86_64" ...>          one per CPU socket / NUMA node
        <pci busid="0000:03:00.0" class="0x060400" link_speed="8 GT/s" link_width="16">   a PCIe switch
          <pci busid="0000:06:00.0" class="0x030200" link_speed="8 GT/s" link_width="16">   a GPU
            <gpu dev="0" sm="70" rank="0" gdr="1">
              <nvlink target="0000:07:00.0" count="1" tclass="0x030200"/>
            </gpu>
          </pci>
        </pci>
        <pci busid="0000:01:00.0" class="0x020000" link_speed="5 GT/s" link_width="8">
          <nic><net name="enp1s0f0" dev="0" speed="1000" .../></nic>                       a NIC
        </pci>
        <nic><net name="lxcbr0" speed="10000" .../></nic>                                   a NIC without PCIe
      </cpu>
    </system>

The model built (node and link kinds as in :mod:`jax_blink.topology.model`):

- ``<cpu>`` -> node ``cpu<s>`` (kind ``cpu``), numbered in file order; every two sockets are
  joined by a ``host`` link of ``inter_socket_gbps`` (the XML does not give the QPI/UPI rate; 20
  GB/s by default, see :mod:`jax_blink.topology.presets`). A file whose root is ``<cpu>`` (an excerpt) is
  read as a machine with that one socket, and says so in the notes.
- ``<pci>`` bridges (class ``0x0604xx``) -> ``pcie-switch-<k>`` nodes, numbered in file order;
  bridges with no GPU or NIC below them are left out. Every ``<pci>`` element's ``link_speed`` and
  ``link_width`` give the ``pcie`` link to its parent (NCCL reads them the same way), at
  :func:`pcie_link_gbps` of them.
- GPUs: a ``<pci>`` holding a ``<gpu>``, or a bare ``<pci class="0x03xxxx">`` (a VM or a hand-made
  file that hides the GPUs' NVLinks: those GPUs get no NVLink, and the notes say so). GPU ids are the
  ``<gpu dev=...>`` CUDA device numbers when every GPU has one and they are 0..n-1; otherwise the
  GPUs are numbered in PCI bus id order (as ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and NVML do), with a note.
- ``<nvlink target=... count=... tclass=...>``: a target that is a GPU of the file gives an
  ``nvlink`` edge of ``count`` links (both GPUs list the link; the counts must agree); an NVSwitch
  target (``tclass`` ``0x068000``) joins the GPU to the one ``"nvswitch"`` node (kind ``nvswitch``,
  all NVSwitch chips together, as NCCL models them); a CPU target (``tclass`` ``0x068001``, IBM
  POWER9) an ``nvlink`` edge to the GPU's socket (a GPU right under its socket then has one edge
  there carrying both the PCIe and the NVLink rate, labelled ``nvlink``). A link whose target is the GPU's own bus id is
  ignored with a note (seen in dumps from some drivers), as is one whose target is not in the file
  (an excerpt). Per-link rate: :func:`nvlink_gbps_for_sm` of the GPU's ``sm``.
- NICs: a ``<nic>`` (in a ``<pci class="0x02xxxx">`` or right under ``<cpu>``) -> node ``nic<k>``
  (kind ``nic``, attribute ``device`` = its ``<net name>`` list). ``<net speed>`` is Mb/s (NCCL);
  the NIC's link to its parent carries min(PCIe link, sum of its ports' speeds / 8000 x
  ``presets.NET_EFFICIENCY``) GB/s (every rate achieved, see :mod:`jax_blink.topology.presets`).
- Other PCI devices (NVMe drives, NVSwitch management functions, ...) are skipped.

Every problem raises :class:`TopologyError` naming the element (by bus id where it has one), the
attribute and its value, and what was expected; everything the parser had to assume is in
``Topology.notes``, and so is everything it ignored: elements and attributes NCCL's format does not
have (a misspelt ``<nvlnk>`` is named, not silently read as a machine without NVLink), and known
elements in places the format does not put them.

Limits (docs/limits.md, "Topology files"): at most :data:`jax_blink.topology.model.MAX_MACHINE_GPUS`
(64) GPUs (the file describes one machine), ``<pci>`` nested at most 64 deep, ``<nvlink count>`` at most
:data:`jax_blink.topology.model.MAX_NVLINKS`, :data:`jax_blink.topology.model.MAX_FILE_BYTES` of text,
no ``<!DOCTYPE>`` (no entity expansion).
"""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET

from ..errors import TopologyError
from .model import MAX_MACHINE_GPUS, MAX_NVLINKS, Topology, check_number, check_rates, show, source_text
from .presets import INTER_SOCKET_GBPS, NET_EFFICIENCY, NVLINK_EFFICIENCY, PCIE_GEN3_GBPS, pcie_link_gbps
from .presets import nvlink_gbps as _nvlink_rate

# ----------------------------------------------------------------------------- rates
NVSWITCH_CLASS = "0x068000"   # NCCL kvDictPciClass: NVS
CPU_CLASS = "0x068001"        # NCCL kvDictPciClass: CPU (NVLink to an IBM POWER9 socket)
_BRIDGE_PREFIX = "0x0604"     # PCI-to-PCI bridge (a PCIe switch port / root port)
_GPU_PREFIX = "0x03"          # display controller: VGA 0x0300xx, 3D 0x0302xx
_NIC_PREFIX = "0x02"          # network controller: Ethernet 0x0200xx, InfiniBand 0x0207xx

# GPU architecture (first ``sm`` of the family, sm = 10 x CUDA compute capability) -> achieved GB/s per
# NVLink per direction (line rate x presets.NVLINK_EFFICIENCY of its generation). Line rates: NVIDIA
# Tesla P100 whitepaper (NVLink1, 4 links, 160 GB/s bidirectional -> 20); V100 whitepaper (NVLink2, 6
# links, 300 GB/s -> 25; Turing's NVLink2 bridge, sm 75, has the same per-link rate); A100 architecture
# whitepaper (NVLink3, 12 links, 600 GB/s -> 25); A40 / RTX 3090 datasheets (GA102, sm 86: 4 NVLink3 x4
# links, 112.5 GB/s bidirectional -> 14.0625); H100 architecture whitepaper (NVLink4, 18 links, 900
# GB/s -> 25); Blackwell B200 (NVLink5, 18 links, 1.8 TB/s -> 50). The same rates as the presets and
# NVML discovery use.
NVLINK_GBPS_BY_SM = ((60, _nvlink_rate(1)), (70, _nvlink_rate(2)), (80, _nvlink_rate(3)),
                     (86, 112.5 / 8 * NVLINK_EFFICIENCY[3]), (90, _nvlink_rate(4)), (100, _nvlink_rate(5)))

_SPEED_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*GT/s(?:\s+PCIe)?\s*", re.IGNORECASE)
_INT_RE = re.compile(r"0[xX]([0-9a-fA-F]{1,16})|([0-9]{1,18})")  # (no int() of a 10^4-digit string)
_MAX_DEPTH = 64           # nested <pci> levels; real machines have fewer than 8
# Where each element of NCCL's format may appear (parent tag -> child tags), and its attributes (xml.cc
# writes them; those the model does not use are known and ignored silently).
_CHILDREN = {None: {"system", "cpu"}, "system": {"cpu"}, "cpu": {"pci", "nic"}, "pci": {"pci", "gpu", "nic"},
             "gpu": {"nvlink"}, "nic": {"net"}, "nvlink": set(), "net": set()}
_ATTRS = {"system": {"version"},
          "cpu": {"numaid", "affinity", "arch", "vendor", "familyid", "modelid", "host_hash"},
          "pci": {"busid", "class", "vendor", "device", "subsystem_vendor", "subsystem_device", "link_speed",
                  "link_width"},
          "gpu": {"dev", "sm", "rank", "gdr"}, "nvlink": {"target", "count", "tclass"}, "nic": set(),
          "net": {"name", "dev", "speed", "port", "latency", "guid", "maxconn", "gdr", "coll", "keep"}}


def nvlink_gbps_for_sm(sm: int) -> float | None:
    """Achieved GB/s per NVLink per direction for a GPU of compute capability ``sm`` (70 = 7.0), or None when
    ``sm`` is below the first NVLink GPU (P100, sm 60). See :data:`NVLINK_GBPS_BY_SM` for sources."""
    rate = None
    for first_sm, gbps in NVLINK_GBPS_BY_SM:
        if sm >= first_sm:
            rate = gbps
    return rate


# ----------------------------------------------------------------------------- parsing
class _Dev:
    """One kept node of the PCI tree while parsing (a socket, a bridge, a GPU or a NIC)."""

    def __init__(self, kind: str, busid: str | None, parent: _Dev | None, up_gbps: float | None):
        self.kind, self.busid, self.parent, self.up_gbps = kind, busid, parent, up_gbps
        self.children: list[_Dev] = []
        self.node = None          # Topology node id, assigned once the tree is pruned
        self.socket = None        # index of the <cpu> it hangs under
        self.gpu: dict = {}       # GPUs: dev, sm, nvlinks [(target busid, count, tclass)]
        self.nets: list = []      # NICs: [(name, speed Mb/s or None)]


def parse_nccl_xml(text, *, nvlink_gbps: float | None = None, pcie_gbps: float | None = None,
                   inter_socket_gbps: float = INTER_SOCKET_GBPS, name: str = "nccl-xml") -> Topology:
    """Parse NCCL's topology XML (see the module docstring for the model).

    Args:
      text: the file's text (str or UTF-8 bytes).
      nvlink_gbps: achieved GB/s per NVLink per direction for every GPU; None: from each GPU's ``sm``.
      pcie_gbps: achieved GB/s per direction for every PCIe link; None: from ``link_speed`` and
        ``link_width`` (:func:`pcie_link_gbps`).
      inter_socket_gbps: GB/s per direction between two CPU sockets.
      name: the Topology's name.

    Returns a Topology with ``notes`` listing what the parser assumed or ignored. Raises
    TopologyError for text that is not XML, is not NCCL's topology format, or has bad attributes.
    """
    check_rates(nvlink_gbps=nvlink_gbps, pcie_gbps=pcie_gbps, inter_socket_gbps=inter_socket_gbps)
    root = _parse_xml(text)
    notes: list[str] = _unknown_parts(root)
    if root.tag == "system":
        cpus = [c for c in root if c.tag == "cpu"]
        if not cpus:
            raise TopologyError("<system> has no <cpu> element; expected NCCL's topology XML: "
                                "<system><cpu numaid=...><pci ...><gpu .../></pci></cpu></system>")
    elif root.tag == "cpu":
        cpus = [root]
        notes.append("the file's root is <cpu> (an excerpt of NCCL's <system>): read as one CPU socket")
    else:
        raise TopologyError(f"the root element is <{root.tag}>; expected <system> (or a <cpu> excerpt) "
                            f"as NCCL_TOPO_DUMP_FILE writes it")

    sockets = [_Dev("cpu", None, None, None) for _ in cpus]
    gpus: list[_Dev] = []
    nics: list[_Dev] = []
    unknown_speed: list[str] = []
    for s, (cpu_el, sock) in enumerate(zip(cpus, sockets)):
        sock.socket = s
        for child in cpu_el:
            if child.tag == "pci":
                _walk_pci(child, sock, s, gpus, nics, unknown_speed, pcie_gbps)
            elif child.tag == "nic":
                nic = _Dev("nic", None, sock, None)
                nic.socket = s
                nic.nets = _nets(child, "a <nic> under <cpu>")
                sock.children.append(nic)
                nics.append(nic)
    if not gpus:
        raise TopologyError("the file has no GPUs: expected <pci class=\"0x03...\"> elements (with a "
                            "<gpu dev=... sm=...> inside) under <cpu>")
    if len(gpus) > MAX_MACHINE_GPUS:
        raise TopologyError(f"the file has {len(gpus)} GPUs; at most {MAX_MACHINE_GPUS} (NCCL's topology XML "
                            f"describes one machine: MAX_MACHINE_GPUS, docs/limits.md)")
    if unknown_speed:
        notes.append(f"{len(unknown_speed)} PCIe link(s) without a usable link_speed/link_width (bus "
                     f"{', '.join(unknown_speed[:4])}{' ...' if len(unknown_speed) > 4 else ''}): assumed "
                     f"gen3 x16 ({PCIE_GEN3_GBPS:g} GB/s), as NCCL does")

    busids = [g.busid for g in gpus]
    dup = sorted({b for b in busids if busids.count(b) > 1})
    if dup:
        raise TopologyError(f"GPU bus id {dup[0]} appears more than once; expected one <pci> per GPU")
    bare = [g.busid for g in gpus if g.gpu["bare"]]
    if bare:
        notes.append(f"{len(bare)} GPU(s) are bare <pci class=\"0x03...\"> devices without <gpu> (bus "
                     f"{', '.join(bare[:4])}{' ...' if len(bare) > 4 else ''}): the file has no NVLink "
                     f"information for them, so they are modelled without NVLink")
    _number_gpus(gpus, notes)
    t = Topology(name)
    for g in sorted(gpus, key=lambda g: g.node):
        t.add_gpu(g.node)
    for sock in sockets:
        _prune(sock)
    for s, sock in enumerate(sockets):
        sock.node = f"cpu{s}"
        t.add_switch(sock.node, "cpu")
    counters = {"pcie-switch": 0, "nic": 0}
    for sock in sockets:
        _emit(t, sock, counters, pcie_gbps)
    for a, b in itertools.combinations(range(len(sockets)), 2):
        t.add_link(f"cpu{a}", f"cpu{b}", inter_socket_gbps, "host")
    _add_nvlinks(t, gpus, sockets, nvlink_gbps, notes)
    t.notes = notes
    return t


def _parse_xml(text) -> ET.Element:
    text = source_text(text, "NCCL's topology XML")
    if not text.strip():
        raise TopologyError("empty input: expected NCCL's topology XML (<system><cpu>...</cpu></system>)")
    if "<!DOCTYPE" in text or "<!ENTITY" in text:
        # NCCL never writes a DTD; refusing one also rules out entity-expansion attacks
        raise TopologyError("the file has a <!DOCTYPE>/<!ENTITY> declaration; NCCL's topology XML never "
                            "does: expected plain <system><cpu>... elements")
    try:
        return ET.fromstring(text.lstrip("\ufeff"))
    except ET.ParseError as err:
        line, col = getattr(err, "position", (0, 0))
        msg = str(err).split(":")[0]
        raise TopologyError(f"not well-formed XML at line {line}, column {col + 1} ({msg}); expected "
                            f"NCCL's topology XML as NCCL_TOPO_DUMP_FILE writes it") from None
    except (ValueError, RecursionError) as err:  # e.g. an encoding declaration expat refuses
        raise TopologyError(f"cannot parse the XML: {err}") from None


def _unknown_parts(root: ET.Element) -> list[str]:
    """Notes naming the elements and attributes of ``root`` that NCCL's format does not have or does not
    put there (:data:`_CHILDREN`, :data:`_ATTRS`), each with a count and its first place."""
    bad_tags: dict[tuple, list] = {}
    bad_attrs: dict[tuple, list] = {}
    stack = [(root, None, "the root")]
    while stack:  # (iterative: deep garbage cannot exhaust the stack)
        el, parent, where = stack.pop()
        if el.tag not in _CHILDREN.get(parent, ()):
            bad_tags.setdefault((el.tag, parent), [0, where])[0] += 1
            continue  # its subtree is ignored with it
        for a in el.attrib:
            if a not in _ATTRS[el.tag]:
                bad_attrs.setdefault((el.tag, a), [0, _where(el)])[0] += 1
        here = _where(el)
        stack.extend((c, el.tag, here) for c in reversed(el))
    notes = []
    for (tag, parent), (n, where) in bad_tags.items():
        what = "not in NCCL's topology format" if tag not in _CHILDREN else f"not a child NCCL puts in <{parent}>"
        notes.append(f"ignored {n} <{show(tag, 40)[1:-1]}> element(s) ({what}; first in {where}) and what they hold")
    for (tag, a), (n, where) in bad_attrs.items():
        notes.append(f"ignored attribute {show(a, 40)} of {n} <{tag}> element(s) (not in NCCL's topology "
                     f"format; first {where})")
    return notes[:20] + ([f"... and {len(notes) - 20} more ignored kinds of element or attribute"]
                         if len(notes) > 20 else [])


def _where(el: ET.Element) -> str:
    b = el.get("busid")
    return f"<{el.tag} busid={show(b, 40)}>" if b else f"<{el.tag}>"


def _busid(el: ET.Element) -> str:
    """The element's PCI bus id, normalised to 'dddd:bb:dd.f' (lower case)."""
    raw = el.get("busid")
    if raw is None:
        raise TopologyError(f"a <{el.tag}> element has no busid attribute; expected busid=\"0000:07:00.0\"")
    return normalise_busid(raw, f"{_where(el)}: busid")


_BUS_RE = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")


def normalise_busid(raw: str, what: str = "bus id") -> str:
    """'00000000:07:00.0', '0000:07:00.0' or '07:00.0' -> '0000:07:00.0'. Raises TopologyError."""
    m = _BUS_RE.fullmatch(str(raw).strip().lower())
    if not m:
        raise TopologyError(f"{what} {raw!r} is not a PCI bus id; expected [domain:]bus:device.function "
                            f"like 0000:07:00.0")
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def _int_attr(el: ET.Element, attr: str, lo: int, hi: int, where: str | None = None) -> int | None:
    """An integer attribute in [lo, hi] (decimal or 0x hex), None when absent."""
    raw = el.get(attr)
    if raw is None:
        return None
    m = _INT_RE.fullmatch(raw.strip())
    v = raw if m is None else int(m.group(1), 16) if m.group(1) else int(m.group(2))
    return check_number(v, f"{where or _where(el)}: {attr}={show(raw)}", "count", lo, hi)


def _link_gbps(el: ET.Element, override: float | None, unknown: list) -> float:
    """GB/s of the PCIe link from ``el`` up to its parent, from link_speed and link_width."""
    if override is not None:
        return float(override)
    speed, width = el.get("link_speed"), el.get("link_width")
    m = _SPEED_RE.fullmatch(speed) if speed is not None else None
    w = _int_attr(el, "link_width", 0, 32) if width is not None else None
    if m is None or w is None:
        # NCCL writes "" or "Unknown speed" when sysfs has none; it then assumes gen3 (and x16 for 0)
        unknown.append(el.get("busid", "?"))
        return PCIE_GEN3_GBPS
    gts = float(m.group(1))
    if not 0 < gts <= 1000:
        raise TopologyError(f"{_where(el)}: link_speed={speed!r}; expected a PCIe rate like '8 GT/s' or "
                            f"'16.0 GT/s PCIe'")
    return pcie_link_gbps(gts, w or 16)


def _walk_pci(top: ET.Element, sock: _Dev, s: int, gpus: list, nics: list, unknown: list,
              override: float | None) -> None:
    """Add the PCI subtree ``top`` under ``sock`` (iterative: deep garbage cannot exhaust the stack)."""
    stack = [(top, sock, 1)]
    while stack:
        el, parent, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise TopologyError(f"{_where(el)}: <pci> elements nested more than {_MAX_DEPTH} deep; "
                                f"expected a PCI tree a few levels deep")
        busid = _busid(el)
        cls = (el.get("class") or "").strip().lower()
        gpu_el = el.find("gpu")
        nic_el = el.find("nic")
        if gpu_el is not None or cls.startswith(_GPU_PREFIX):
            d = _Dev("gpu", busid, parent, _link_gbps(el, override, unknown))
            d.gpu = _gpu_info(gpu_el, busid)
            gpus.append(d)
        elif nic_el is not None or cls.startswith(_NIC_PREFIX):
            d = _Dev("nic", busid, parent, _link_gbps(el, override, unknown))
            d.nets = _nets(nic_el, _where(el)) if nic_el is not None else []
            nics.append(d)
        elif cls.startswith(_BRIDGE_PREFIX) or not cls:
            d = _Dev("bridge", busid, parent, _link_gbps(el, override, unknown))
            # reversed: the stack pops the first child first, so numbering follows the file
            stack.extend((c, d, depth + 1) for c in reversed([c for c in el if c.tag == "pci"]))
        else:
            continue  # NVMe, NVSwitch management functions, ...: not on any GPU's path
        d.socket = s
        parent.children.append(d)


def _gpu_info(gpu_el: ET.Element | None, busid: str) -> dict:
    if gpu_el is None:
        return {"dev": None, "sm": None, "nvlinks": [], "bare": True}
    where = f"<gpu> of bus {busid}"
    info = {"dev": _int_attr(gpu_el, "dev", 0, 1 << 16, where), "sm": _int_attr(gpu_el, "sm", 0, 10000, where),
            "nvlinks": [], "bare": False}
    for nv in gpu_el.findall("nvlink"):
        target = nv.get("target")
        if target is None:
            raise TopologyError(f"an <nvlink> of the GPU at bus {busid} has no target; expected "
                                f"target=\"<bus id>\" count=\"<links>\" tclass=\"0x...\"")
        count = _int_attr(nv, "count", 1, MAX_NVLINKS, f"<nvlink target={target!r}> of the GPU at bus {busid}")
        tclass = (nv.get("tclass") or "").strip().lower()
        info["nvlinks"].append((normalise_busid(target, f"<nvlink> of the GPU at bus {busid}: target"),
                                1 if count is None else count, tclass))
    return info


def _nets(nic_el: ET.Element, where: str) -> list[tuple[str, int | None]]:
    out = []
    for net in nic_el.findall("net"):
        speed = _int_attr(net, "speed", 0, 10 ** 9, f"<net name={net.get('name')!r}> in {where}")
        out.append((net.get("name") or f"net{len(out)}", speed or None))
    return out


def _number_gpus(gpus: list[_Dev], notes: list[str]) -> None:
    """Set each GPU's Topology id: its ``dev`` when those are 0..n-1, else its rank in bus id order."""
    devs = [g.gpu["dev"] for g in gpus]
    if None not in devs and sorted(devs) == list(range(len(gpus))):
        for g in gpus:
            g.node = g.gpu["dev"]
        return
    for i, g in enumerate(sorted(gpus, key=lambda g: g.busid)):
        g.node = i
    why = ("some GPUs have no <gpu dev=...>" if None in devs else
           f"their <gpu dev=...> values {sorted(devs)} are not 0..{len(gpus) - 1}")
    notes.append(f"GPU ids follow PCI bus id order ({why})")


def _prune(d: _Dev) -> bool:
    """Drop bridges with no GPU or NIC below; True when ``d`` keeps something."""
    d.children = [c for c in d.children if _prune(c)]
    return d.kind != "bridge" or bool(d.children)


def _emit(t: Topology, d: _Dev, counters: dict, override: float | None) -> None:
    """Add ``d``'s children (nodes and their PCIe links up to ``d``) to ``t``, depth first."""
    stack = list(reversed(d.children))
    while stack:
        c = stack.pop()
        if c.kind == "bridge":
            c.node = f"pcie-switch-{counters['pcie-switch']}"
            counters["pcie-switch"] += 1
            t.add_switch(c.node, "pcie-switch", bus=c.busid)
            stack.extend(reversed(c.children))
        elif c.kind == "nic":
            c.node = f"nic{counters['nic']}"
            counters["nic"] += 1
            t.add_switch(c.node, "nic", device=",".join(n for n, _ in c.nets) or c.busid or c.node)
        gbps = c.up_gbps
        net_mbps = sum(sp for _, sp in c.nets if sp) if c.kind == "nic" else 0
        if net_mbps:
            net_gbps = net_mbps / 8000.0 * NET_EFFICIENCY  # Mb/s -> GB/s line rate -> achieved
            gbps = net_gbps if gbps is None else min(gbps, net_gbps)
        if gbps is None:  # a NIC without PCIe link and without port speeds
            gbps = override if override is not None else PCIE_GEN3_GBPS
        t.add_link(c.node, c.parent.node, gbps, "pcie")


def _add_nvlinks(t: Topology, gpus: list[_Dev], sockets: list[_Dev], nvlink_gbps: float | None,
                 notes: list[str]) -> None:
    by_bus = {g.busid: g for g in gpus}
    pair: dict[frozenset, dict] = {}     # {a, b} -> {a: count a lists, b: count b lists}
    to_switch: dict[int, int] = {}
    to_cpu: dict[int, int] = {}
    self_links, missing, unknown_sm = [], [], []

    def rate(g: _Dev) -> float:
        if nvlink_gbps is not None:
            return float(nvlink_gbps)
        r = nvlink_gbps_for_sm(g.gpu["sm"]) if g.gpu["sm"] is not None else None
        if r is None:
            unknown_sm.append(g.node)
            return _nvlink_rate(2)
        return r

    for g in gpus:
        for target, count, tclass in g.gpu["nvlinks"]:
            if tclass == NVSWITCH_CLASS:
                to_switch[g.node] = to_switch.get(g.node, 0) + count
            elif tclass == CPU_CLASS:
                to_cpu[g.node] = to_cpu.get(g.node, 0) + count
            elif target == g.busid:
                self_links.append(g.node)
            elif target in by_bus:
                key = frozenset((g.node, by_bus[target].node))
                seen = pair.setdefault(key, {})
                seen[g.node] = seen.get(g.node, 0) + count
            else:
                missing.append(f"GPU {g.node} -> {target}")
    if self_links:
        notes.append(f"ignored NVLink(s) whose target is the GPU's own bus id (GPU "
                     f"{', '.join(map(str, sorted(set(self_links))))})")
    if missing:
        notes.append(f"ignored NVLink(s) to bus ids that are no GPU of the file ({', '.join(missing[:4])}"
                     f"{' ...' if len(missing) > 4 else ''})")
    g_of = {g.node: g for g in gpus}
    for key, counts in sorted(pair.items(), key=lambda kv: sorted(kv[0])):
        a, b = sorted(key)
        if len(counts) == 2 and counts[a] != counts[b]:
            raise TopologyError(f"asymmetric NVLink counts: GPU {a} (bus {g_of[a].busid}) lists {counts[a]} "
                                f"link(s) to GPU {b} but GPU {b} (bus {g_of[b].busid}) lists {counts[b]}; "
                                f"expected the same count on both ends")
        n = max(counts.values())
        t.add_link(a, b, min(rate(g_of[a]), rate(g_of[b])), "nvlink", links=n)
    if to_switch:
        t.add_switch("nvswitch", "nvswitch")
        for g, n in sorted(to_switch.items()):
            t.add_link(g, "nvswitch", rate(g_of[g]), "nvswitch", links=n)
    for g, n in sorted(to_cpu.items()):
        cpu = f"cpu{g_of[g].socket}"
        t.add_link(g, cpu, rate(g_of[g]), "nvlink", links=n)  # adds to a direct PCIe edge, if any
        for e in ((g, cpu), (cpu, g)):
            t.graph.edges[e]["kind"] = "nvlink"
    if unknown_sm:
        notes.append(f"GPU {', '.join(map(str, sorted(set(unknown_sm))))}: no NVLink GPU architecture "
                     f"known for its sm attribute; assumed {_nvlink_rate(2):g} GB/s per NVLink (V100's) "
                     f"(pass nvlink_gbps= / --nvlink-gbps to set it)")
