"""One process of the multi-process digits training (started by ``launch.py``; see its docstring).

Also runs as it is under cluster launchers (docs/cluster.md), e.g. with 4 CPU devices per process
(``JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4``)::

    srun -n 2 --overcommit python examples/multiprocess/worker.py --epochs 1 --min-accuracy 0.5
    mpirun -n 2 -x JAX_PLATFORMS -x XLA_FLAGS python examples/multiprocess/worker.py --epochs 1 --min-accuracy 0.5

Joins the jax.distributed job (``jax_blink.distributed.initialize``: jax_blink.launch's variables, else
jax's cluster detection: SLURM, Open MPI, ...), exchanges what each process knows of its host and
builds the multi-node topology every process plans on (``cluster_topology``: nodes joined by NICs of
``--nic-gbps`` GB/s), maps every JAX device of every process onto it (``jax_blink.set_device_map``),
then runs the single-process training code of ``examples/flax_digits/train.py`` unchanged over all
devices of all processes: gradients are all-reduced with ``jax_blink.pmean`` on the hierarchical plan
(Blink, MLSys 2020, section 5), lowered to ``collective_permute`` (gloo between CPU processes).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jax_blink import distributed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "flax_digits"))


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's own options (the training options come from train.add_arguments); also listed
    by ``launch.py --help``."""
    p.add_argument("--nic-gbps", type=float, default=12.5, help="GB/s per NIC between nodes")
    p.add_argument("--nics-per-node", type=int, default=1)
    p.add_argument("--compare-lax", action="store_true",
                   help="repeat the run with lax.psum; report loss difference and per-step times")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one process of the multi-process digits training")
    add_worker_arguments(p)
    distributed.initialize()

    import jax
    import numpy as np
    import train as digits  # examples/flax_digits/train.py

    import jax_blink

    digits.add_arguments(p)
    args = p.parse_args(argv)
    me = jax.process_index()
    cluster = distributed.cluster_topology(nic_gbps=args.nic_gbps, nics_per_node=args.nics_per_node)
    jax_blink.set_device_map(cluster.device_map)
    devices = jax.devices()
    config = digits.config_from_args(args, ndevices=len(devices))
    config.progress = config.progress and me == 0
    if me == 0:
        plan = jax_blink.plan(cluster.topology, "allreduce", devices=sorted(cluster.device_map.values()))
        print(f"{cluster.num_processes} processes x {len(cluster.node.gpus)} devices, topology "
              f"{cluster.topology.name}: {plan.algorithm} plan, {len(plan.trees)} trees, "
              f"rate {plan.rate_gbps:.2f} GB/s (bound {plan.bound_gbps:.2f})", flush=True)
    blink = digits.blink_collectives(cluster.topology)
    if args.compare_lax:
        c = digits.compare(config, blink, devices=devices)
        # Different summation orders differ in the last bit; over many Adam steps such differences
        # grow (the trajectories diverge chaotically), so the first epoch is the exactness check.
        k = max(1, len(c.lax.step_losses) // config.epochs)
        a, b = np.asarray(c.blink.step_losses[:k]), np.asarray(c.lax.step_losses[:k])
        first = float(np.max(np.abs(a - b) / np.abs(b)))
        lines = [digits.report(c.blink), digits.report(c.lax), digits.report_comparison(c),
                 f"first epoch ({k} steps): largest relative loss difference vs lax.psum {first:.3e}"]
        res, ok = c.blink, first <= digits.MAX_REL_DIFF
    else:
        res = digits.train(config, blink, devices=devices)
        lines, ok = [digits.report(res)], True
    if me == 0:
        print("\n".join(lines), flush=True)
    if not ok:
        print(f"process {me}: first-epoch losses of jax_blink and lax.psum differ by more than "
              f"{digits.MAX_REL_DIFF:g} relative", file=sys.stderr)
    short = digits.accuracy_shortfall(res, args.min_accuracy)
    if short:
        print(f"process {me}: {short}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
