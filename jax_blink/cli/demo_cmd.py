"""``jax-blink demo``: plan the all-reduce for this machine, then train the digits CNN with it;
``jax-blink demo --fsdp``: plan the all-gather, then train a fully sharded MLP (all-gather forward,
reduce-scatter gradients; ``examples/flax_fsdp/train.py``).

The training code is the example ``examples/flax_digits/train.py`` itself, loaded from the source
checkout (the README's main command is ``pip install -e ".[examples]" && jax-blink demo`` in the
repository). Keeping one copy there means the demo runs exactly what a user reads and copies, and the
package itself never imports flax, optax or scikit-learn.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from ..errors import BlinkError
from ._args import HOST_FLAG, force_host_devices, number_type, positive_int

HOST_DEVICES = 8
EXAMPLES = {"digits": pathlib.Path("examples") / "flax_digits" / "train.py",
            "fsdp": pathlib.Path("examples") / "flax_fsdp" / "train.py"}


def add_arguments(p) -> None:
    """Options: the example's training options plus topology and the accuracy target."""
    p.add_argument("--epochs", type=positive_int, default=8, help="passes over the training split (default 8)")
    p.add_argument("--mode", choices=("pmap", "shard_map"), default="shard_map",
                   help="train step: jax.pmap or jax.jit(jax.shard_map) on a mesh (default shard_map)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="global batch over all devices (default 64)")
    p.add_argument("--lr", type=number_type(float, low=0, low_open=True), default=5e-3,
                   help="Adam learning rate (default 5e-3)")
    p.add_argument("--seed", type=number_type(int, low=0, what="an integer"), default=0)
    p.add_argument("--topology", default=None,
                   help="preset name, nvidia-smi topo -m file, NCCL topology XML or JSON (default: "
                        "detected GPUs, else the dgx1v preset mapped onto 8 host CPU devices)")
    p.add_argument("--impl", choices=("auto", "ppermute", "ffi"), default="auto",
                   help="jax_blink lowering: auto (ffi where built, else ppermute), ppermute, ffi")
    p.add_argument("--min-accuracy", type=number_type(float, low=0, high=1), default=0.95,
                   help="exit status 1 when the held-out accuracy ends below this (default 0.95)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fsdp", action="store_true",
                   help="train the fully sharded MLP instead (parameters all-gathered with jax_blink.all_gather, "
                        "gradients reduce-scattered; --mode is ignored)")


def load_example(name: str = "digits"):
    """Import ``examples/flax_digits/train.py`` ("digits") or ``examples/flax_fsdp/train.py``
    ("fsdp") from the source tree next to this package.

    Raises BlinkError when the file is absent (a non-editable install) or the examples extra
    (flax, optax, scikit-learn) is missing, saying what to install.
    """
    module_name, example = f"jax_blink_example_flax_{name}", EXAMPLES[name]
    if module_name in sys.modules:
        return sys.modules[module_name]
    root = pathlib.Path(__file__).resolve().parents[2]
    path = root / example
    if not path.is_file():
        raise BlinkError(f"the demo runs {example} from a source checkout, and {path} does not exist: "
                         "clone the jax_blink repository and run `pip install -e \".[examples]\"` in it")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        del sys.modules[module_name]
        raise BlinkError(f"{err} (install the examples extra: pip install -e \".[examples]\")") from None
    return module


def choose_devices(topology_source: str | None):
    """Pick (devices, topology, sentence saying why).

    Two or more GPUs: all of them (up to 8) with the detected topology (or ``topology_source``).
    Otherwise host CPU devices with ``topology_source`` or the dgx1v preset, device i playing GPU i
    (a topology with more than 8 GPUs: its first 8). Raises BlinkError when JAX started with fewer
    host devices than needed or the topology's GPUs are not numbered 0..n-1.
    """
    import jax

    from ..topology import Topology

    try:
        gpus_found = jax.devices("gpu")
    except RuntimeError:
        gpus_found = []
    if len(gpus_found) >= 2:
        devices = gpus_found[:8]
        if topology_source:
            topo, how = Topology.load(topology_source), f"topology {topology_source!r}"
        else:
            topo, how = Topology.detect(), "topology detected from NVML / nvidia-smi"
        if len(topo.gpus) > len(devices):  # the job uses the first 8 GPUs
            topo = topo.subset(topo.gpus[:len(devices)])
        return devices, topo, f"{len(devices)} GPUs detected; {how}"
    cpus = jax.devices("cpu")
    if len(cpus) < HOST_DEVICES:
        raise BlinkError(f"JAX has {len(cpus)} host CPU devices, the demo needs {HOST_DEVICES}: JAX was "
                         f"started before the demo could set XLA_FLAGS={HOST_FLAG}={HOST_DEVICES}; "
                         "run `jax-blink demo` in a fresh process")
    name = topology_source or "dgx1v"
    topo = Topology.load(name)
    gpus = topo.gpus
    if gpus != list(range(len(gpus))) or len(gpus) < 2:
        raise BlinkError(f"topology {name!r} has GPUs {gpus}: on CPU the demo lets host device i play "
                         "GPU i, so it needs GPUs numbered 0, 1, ... (at least 2)")
    if len(gpus) > HOST_DEVICES:  # the job gets the first 8 GPUs of a bigger machine
        topo = topo.subset(gpus[:HOST_DEVICES])
    n = len(topo.gpus)
    why = "no GPU detected" if not gpus_found else "only 1 GPU detected (nothing to all-reduce across)"
    part = "" if n == len(gpus) else f", its GPUs 0-{n - 1} of {len(gpus)}"
    return cpus[:n], topo, (
        f"{why}: topology {name!r} ({n} GPUs{part}) mapped onto {n} host CPU devices "
        f"(CPU device i plays GPU i); the plan is {name}'s, the timings are this CPU's")


def _plan_lines(topo, ndevices: int, collective: str = "allreduce") -> list[str]:
    from ..planner.rings import ring_rate
    from ..planning import plan

    gpus = tuple(topo.gpus[:ndevices])
    pl = plan(topo, collective, devices=gpus)
    if collective != "allreduce":
        return [pl.describe().rstrip(), f"plan ({collective}): {len(pl.trees)} trees, rate {pl.rate_gbps:.2f} GB/s, "
                f"bound {pl.bound_gbps:.2f} GB/s ({pl.algorithm})"]
    lines = [pl.describe().rstrip()]
    ring = ring_rate(topo, gpus)
    n = len(gpus)
    summary = (f"plan: {len(pl.trees)} trees, rate {pl.rate_gbps:.2f} GB/s, bound {pl.bound_gbps:.2f} GB/s "
               f"({pl.algorithm}); best ring packing: rings of {ring:.2f} GB/s in total, so an all-reduce ring rate "
               f"of at most {ring * n / (2 * (n - 1)):.2f} GB/s (ring time 2(n-1)/n * S / B; NCCL's rings "
               "reach at most this)")
    lines.append(summary)
    return lines


def _lowering_name(impl: str, platform: str) -> str:
    from .. import api  # noqa: F401  (importing it registers the lowerings that exist)
    from ..dispatch import choose_lowering

    rec = choose_lowering(impl, [platform])
    return f"{rec.name} ({rec.description or rec.name}) on {platform}"


def run_fsdp(args) -> int:
    """``--fsdp``: plan the all-gather, train the sharded MLP with jax_blink (lax in lockstep)."""
    force_host_devices(HOST_DEVICES)
    ex = load_example("fsdp")
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        raise BlinkError("--epochs, --batch-size and --lr must be positive")
    devices, topo, why = choose_devices(args.topology)
    if args.batch_size % len(devices):
        raise BlinkError(f"--batch-size {args.batch_size} does not split over {len(devices)} devices: "
                         f"use a multiple of {len(devices)}")
    print(f"devices: {why}")
    for line in _plan_lines(topo, len(devices), "allgather"):
        print(line)
    print(f"lowering: {_lowering_name(args.impl, devices[0].platform)}")
    print(f"training: Flax MLP on scikit-learn digits, parameters sharded over {len(devices)} devices (FSDP), "
          f"{args.epochs} epochs, global batch {args.batch_size}", flush=True)
    config = ex.Config(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                       ndevices=len(devices))
    res = ex.train(config, ex.blink_collectives(topo, args.impl), devices=devices, progress=not args.no_progress)
    print(ex.report(res))
    bad = ex.problems(res, args.min_accuracy)
    for x in bad:
        print(f"jax-blink demo --fsdp: {x}", file=sys.stderr)
    return 1 if bad else 0


def run(args) -> int:
    """Choose the topology, print the plan, train with jax_blink and lax, print the summary."""
    if getattr(args, "fsdp", False):
        return run_fsdp(args)
    force_host_devices(HOST_DEVICES)
    ex = load_example()
    try:
        config = ex.config_from_args(args, ndevices=HOST_DEVICES)
    except ValueError as err:
        raise BlinkError(str(err)) from None
    devices, topo, why = choose_devices(args.topology)
    config.ndevices = len(devices)
    if config.batch_size % len(devices):
        raise BlinkError(f"--batch-size {config.batch_size} does not split over {len(devices)} devices: "
                         f"use a multiple of {len(devices)}")
    print(f"devices: {why}")
    for line in _plan_lines(topo, len(devices)):
        print(line)
    print(f"lowering: {_lowering_name(args.impl, devices[0].platform)}")
    print(f"training: Flax CNN on scikit-learn digits, {config.mode}, {config.epochs} epochs, "
          f"global batch {config.batch_size} over {len(devices)} devices", flush=True)
    c = ex.compare(config, ex.blink_collectives(topo, args.impl), devices=devices)
    print(ex.report(c.blink))
    print(ex.report(c.lax))
    print(ex.report_comparison(c))
    acc_ok = c.blink.test_accuracy >= args.min_accuracy
    diff_ok = c.max_rel_diff <= 1e-5
    print(f"summary: held-out accuracy {c.blink.test_accuracy:.4f} "
          f"(lax.psum run {c.lax.test_accuracy:.4f}; target {args.min_accuracy:.2f} "
          f"{'reached' if acc_ok else 'NOT reached'}); "
          f"train step {c.step_s['jax_blink'] * 1e3:.2f} ms with jax_blink vs {c.step_s['lax'] * 1e3:.2f} ms "
          f"with lax (ratio {c.step_s['jax_blink'] / c.step_s['lax']:.2f}); "
          f"loss difference {c.max_rel_diff:.1e} rel ({'ok' if diff_ok else 'TOO LARGE'})")
    if not acc_ok:
        print(f"jax-blink demo: held-out accuracy {c.blink.test_accuracy:.4f} is below --min-accuracy "
              f"{args.min_accuracy}: train longer (--epochs)", file=sys.stderr)
    if not diff_ok:
        print(f"jax-blink demo: jax_blink.psum changed a step's loss by {c.max_rel_diff:.2e} relative to "
              "lax.psum (bound 1e-5): a wrong all-reduce; please report it", file=sys.stderr)
    return 0 if acc_ok and diff_ok else 1
