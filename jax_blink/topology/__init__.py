"""The interconnect: the model (:mod:`.model`) and one module per place a topology comes from.

- :mod:`.model`: :class:`Topology` (a directed graph of GPUs, switches and links), GPU id lists;
- :mod:`.presets`: machines by name (DGX-1, DGX-2, DGX A100/H100, PCIe boxes, ``host<N>``), the
  achieved link rates, multi-node machines;
- :mod:`.nvsmi`: ``nvidia-smi topo -m`` text; :mod:`.ncclxml`: NCCL's topology XML;
- :mod:`.nvml`: this machine's topology (NVML, else ``nvidia-smi``);
- :mod:`.probe`: the links the job's devices really have, measured with JAX copies;
- :mod:`.load`: :func:`load_topology`, which picks the source from what a user names;
- :mod:`.symmetry`: the identical nodes of a cluster (node isomorphism), which the planner's
  symmetric algorithms plan one node of.

Importing this package imports every source module, which registers itself behind the
``Topology.preset / from_nvidia_smi / detect / load`` classmethods (``model`` imports none of them).
"""

from .load import load_topology
from .model import LINK_KINDS, MAX_HOST_DEVICES, NODE_KINDS, Topology, parse_gpu_ids
from .ncclxml import parse_nccl_xml
from .nvml import detect
from .nvsmi import parse_topo
from .presets import PRESETS, is_preset, multi_node, preset
from .probe import default_gpu_id

__all__ = ["LINK_KINDS", "MAX_HOST_DEVICES", "NODE_KINDS", "PRESETS", "Topology", "default_gpu_id", "detect",
           "is_preset", "load_topology", "multi_node", "parse_gpu_ids", "parse_nccl_xml", "parse_topo", "preset"]
