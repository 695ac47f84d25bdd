"""Load a topology from what a user names: a Topology, a preset name, "detect", "probe", a JSON /
NCCL XML / ``nvidia-smi topo -m`` file or a dict. The file format comes from the suffix, else from
the content.
"""

from __future__ import annotations

import os
import pathlib
import re

from ..errors import TopologyError
from . import model
from .model import HOW_TO_PASS, MAX_FILE_BYTES, SUPPORTED_FORMATS, Topology
from .ncclxml import parse_nccl_xml
from .nvml import detect
from .nvsmi import parse_topo
from .presets import PRESETS, is_preset, preset
from .probe import cached_probe

_TOPO_M_GPU = re.compile(r"GPU\d+\b")  # a topo -m header or row names GPU0, GPU1, ...


def _did_you_mean(name: str) -> str:
    """' (did you mean 'dgx1v'?)' for a near miss of a preset name, else ''."""
    import difflib
    close = difflib.get_close_matches(name.strip().lower().replace("_", "-"), list(PRESETS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_topology(source, **kw) -> Topology:
    """A Topology from what a user names.

    Args:
      source: a Topology (returned as is); a preset name (``dgx1v``, ``dgx-a100``, ``host8``...);
        ``"detect"`` (:func:`detect`); ``"probe"`` (the job's devices, measured once per machine:
        :func:`jax_blink.topology.probe.cached_probe`); a path to a ``.json`` file (``Topology.to_json``), to NCCL's
        topology XML (``.xml``, :func:`jax_blink.topology.ncclxml.parse_nccl_xml`) or to a text file with
        ``nvidia-smi topo -m`` output; or a dict (``Topology.to_dict``). A file's format comes from
        its suffix, else from its first character (``{`` JSON, ``<`` XML), else from ``GPU<i>``
        names (topo -m).
      **kw: forwarded to the ``topo -m`` or XML parser (``nvlink_gbps``, ``pcie_gbps``, ...) or to
        :func:`detect`.

    Raises TopologyError when the source is none of these (listing the supported formats) or does
    not parse.
    """
    if isinstance(source, Topology):
        return source
    if isinstance(source, dict):
        return Topology.from_dict(source)
    if isinstance(source, str) and source.strip().lower() == "detect":
        return detect(**kw)
    if isinstance(source, str) and source.strip().lower() == "probe":
        return cached_probe(**kw)  # imports jax: only when asked for
    if isinstance(source, str) and is_preset(source):
        return preset(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TopologyError(f"cannot load a topology from {type(source).__name__}; " + HOW_TO_PASS)
    path = pathlib.Path(source)
    if not path.is_file():
        raise TopologyError(f"{str(source)!r} is not a preset name or an existing file{_did_you_mean(str(source))}; "
                            f"known presets: {', '.join(PRESETS)}, host<N>; 'detect' reads this machine's GPUs, "
                            "'probe' measures the job's devices; " + HOW_TO_PASS)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:  # refused unread: a topology file of one machine is kilobytes
            raise TopologyError(f"{str(path)!r} is {size:,} bytes; at most {MAX_FILE_BYTES:,} are read "
                                "(jax_blink.topology.model.MAX_FILE_BYTES, docs/limits.md)")
        text = path.read_text(errors="replace")
    except OSError as err:
        raise TopologyError(f"cannot read {str(path)!r}: {err}") from None
    head, suffix = text.lstrip("\ufeff \t\r\n"), path.suffix.lower()
    try:
        if "\x00" in text:
            raise TopologyError("binary data (it holds NUL bytes), not a topology; supported: "
                                + "; ".join(SUPPORTED_FORMATS))
        if suffix == ".json" or (suffix != ".xml" and head.startswith("{")):
            return Topology.from_json(text)
        if suffix == ".xml" or head.startswith("<"):
            return parse_nccl_xml(text, name=path.stem, **kw)
        if _TOPO_M_GPU.search(text):
            return parse_topo(text, name=path.stem, **kw)
        raise TopologyError("the file is in no supported format (no JSON object, no XML element, no "
                            "`nvidia-smi topo -m` header line 'GPU0 GPU1 ...'); supported: "
                            + "; ".join(SUPPORTED_FORMATS))
    except TopologyError as err:
        raise TopologyError(f"{path}: {err}") from None


model.register_source("load", load_topology)
