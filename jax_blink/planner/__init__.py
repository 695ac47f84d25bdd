"""TreeGen: plans for broadcast, reduce, all-reduce (Blink, MLSys 2020, s. 4), all-gather and
reduce-scatter (ForestColl, Zhao et al. 2024): weighted trees over the job's GPUs whose edges may
relay through switch nodes, the rate they reach, and a certificate. One algorithm per module, in
import order (each imports only those before it):

- :mod:`.model`: :class:`Tree`, :class:`Plan` and their JSON, hop helpers, job devices, plan caches;
- :mod:`.store`: plans on disk (``$JAX_BLINK_CACHE_DIR/plans``), checked before use;
- :mod:`.routes`: GPU-level routes (:class:`~.routes.RouteTable`), tree pricing, :func:`~.routes.route`;
- :mod:`.colgen`: the one column-generation loop and the rate LP; the tree and rooted packings;
- :mod:`.bounds`: certificates (max-flow, cut, Nash-Williams);
- :mod:`.minimize`: fewest trees (L1 / MILP), ``max_trees``, dropping light trees;
- :mod:`.rings`: the ring packing, ring plans, NCCL's NVLink-else-PCIe rings;
- :mod:`.dbtree`: NCCL's double binary tree;
- :mod:`.trees`: flat tree packings (and the all-reduce ring alternative), relayed packings;
- :mod:`.sharded`: all-reduce as reduce-scatter + all-gather forests ("rsag");
- :mod:`.symmetric`: all-reduce over identical nodes planned on one node by symmetry (trees, three
  phases, rsag; the exact bound);
- :mod:`.threephase`: Blink's three phases over several nodes ("hierarchical");
- :mod:`.facade`: validation, dispatch by algorithm, the plan cache (``clear_caches``).

The public :func:`jax_blink.plan` (:mod:`jax_blink.planning`) adds the cost model's choice by size.
"""

from .model import PLAN_FIELDS, Plan, Tree

__all__ = ["PLAN_FIELDS", "Plan", "Tree"]
