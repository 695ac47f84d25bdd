"""Fully sharded data-parallel (FSDP) Flax MLP on scikit-learn's digits, with jax_blink all-gather
and reduce-scatter.

Every parameter is flattened, zero-padded to a multiple of the device count and split over the data
axis of a 1-D mesh: device r stores block r of every parameter (and of Adam's moments). A train step
(``jax.jit(jax.shard_map(...))``, check_vma on) all-gathers the parameters with
``jax_blink.all_gather`` for the forward pass; the gradient with respect to a device's blocks is then,
by JAX's transpose rule, ``jax_blink.psum_scatter`` of the per-device gradients (all-gather's
transpose is reduce-scatter, as for ``lax.all_gather``), so every device receives the sum of
everyone's gradients for its own blocks only and updates them. Data: the 1797 8x8 digit images that
ship with scikit-learn (nothing downloaded), split 80/20 as in ``examples/flax_digits``.

Lockstep check: at every step the same step with ``lax.all_gather`` starts from this run's state and
batch; its loss and updated parameter blocks must match (relative loss difference <= 1e-5, largest
parameter difference reported). Run from the repository root::

    python examples/flax_fsdp/train.py --epochs 10

``jax-blink demo --fsdp`` runs the same code; ``tests/examples/test_example_fsdp.py`` a short run.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # must precede the jax import; it only shapes the host (CPU) platform
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import importlib.util
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blink


def _digits_example():
    """``examples/flax_digits/train.py`` (its data loading and accuracy check), loaded by path."""
    name = "jax_blink_example_flax_digits"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "flax_digits" / "train.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


digits = _digits_example()  # raises the examples extra's install hint when flax / optax / sklearn are missing
load_data = digits.load_data
nn, optax = digits.nn, digits.optax
AXIS = "data"
MIN_ACCURACY = 0.95
MAX_REL_DIFF = 1e-5   # lockstep: largest relative per-step loss difference vs lax


# ----------------------------------------------------------------------------- sharding
@dataclasses.dataclass(frozen=True)
class Layout:
    """How one parameter pytree is sharded: per leaf its shape and the block length per device."""

    treedef: object
    shapes: tuple
    block: tuple   # elements per device (the flattened leaf zero-padded to n * block)
    n: int

    @classmethod
    def of(cls, params, n: int) -> Layout:
        leaves, treedef = jax.tree.flatten(params)
        return cls(treedef, tuple(v.shape for v in leaves), tuple(-(-math.prod(v.shape) // n) for v in leaves), n)

    def shard(self, params) -> list:
        """Host params -> per leaf a [n * block] array (block r belongs to device r)."""
        out = []
        for v, b in zip(jax.tree.leaves(params), self.block):
            flat = np.asarray(v, np.float32).reshape(-1)
            out.append(np.pad(flat, (0, self.n * b - flat.size)))
        return out

    def unshard(self, full_leaves) -> object:
        """Gathered [n * block] leaves -> the parameter pytree (padding dropped)."""
        leaves = [f[:math.prod(s)].reshape(s) for f, s in zip(full_leaves, self.shapes)]
        return jax.tree.unflatten(self.treedef, leaves)


class MLP(nn.Module):
    """[B, 8, 8, 1] images -> logits [B, 10]: 64 -> 256 -> 128 -> 10, ReLU."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The collectives one FSDP step uses, so one step body serves jax_blink and lax."""

    name: str
    all_gather: Callable   # all_gather(block [k], axis) -> [n * k] (tiled)
    psum: Callable


def blink_collectives(topology=None, impl=None) -> Collectives:
    """``jax_blink.all_gather`` (its transpose ``jax_blink.psum_scatter`` under grad) and ``psum``."""
    kw = {"topology": topology, "impl": impl}
    return Collectives("jax_blink", lambda x, a: jax_blink.all_gather(x, a, tiled=True, **kw),
                       lambda x, a: jax_blink.psum(x, a, **kw))


def lax_collectives() -> Collectives:
    """``lax.all_gather`` (transpose ``lax.psum_scatter``) and ``lax.psum``: the reference."""
    return Collectives("lax", lambda x, a: lax.all_gather(x, a, tiled=True), lax.psum)


def _step_body(blocks, opt_state, x, y, *, model, tx, layout, coll):
    """One FSDP step on this device: gather, local loss, gradient (reduce-scattered by the
    transpose of the gather) averaged over devices, Adam on the own blocks.

    ``blocks``: per leaf this device's [block] slice. Returns (blocks, opt_state, metrics float32 [3]
    = summed over devices: loss * count, correct predictions, count)."""
    def loss_fn(bs):
        params = layout.unshard([coll.all_gather(b, AXIS) for b in bs])
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(blocks)
    grads = [g / layout.n for g in grads]  # psum_scatter summed the per-device mean losses' grads
    updates, opt_state = tx.update(grads, opt_state, blocks)
    blocks = optax.apply_updates(blocks, updates)
    n = jnp.float32(y.shape[0])
    correct = (logits.argmax(-1) == y).sum().astype(jnp.float32)
    return blocks, opt_state, coll.psum(jnp.stack([loss * n, correct, n]), AXIS)


def make_step(coll: Collectives, model, tx, layout: Layout, mesh: Mesh, opt_state):
    """The jitted shard_map step: blocks and the optimizer's per-element state sharded on their
    leading axis, its scalars (Adam's step count) replicated."""
    body = lambda b, o, x, y: _step_body(b, o, x, y, model=model, tx=tx, layout=layout, coll=coll)  # noqa: E731
    opt_specs = jax.tree.map(lambda v: P(AXIS) if jnp.ndim(v) else P(), opt_state)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), opt_specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(AXIS), opt_specs, P())))


def explain_train_step(batch_size: int = 64, ndevices: int = 8, topology=None):
    """One FSDP train step with jax_blink on the first ``ndevices`` JAX devices, for
    ``jax-blink explain examples/flax_fsdp/train.py:explain_train_step`` (no arguments: parameter
    blocks, Adam's state and a zero batch are built inside); ``topology``: what jax_blink plans on (None:
    its default). Returns the step's outputs."""
    devices = digits.job_devices(None, ndevices, batch_size)
    n = len(devices)
    mesh = Mesh(np.asarray(devices), (AXIS,))
    model, tx = MLP(), optax.adam(Config.lr)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1), jnp.float32)))
    layout = Layout.of(params["params"], n)
    blocks = [jnp.zeros((n * b,), jnp.float32) for b in layout.block]
    opt_state = tx.init(blocks)
    step = make_step(blink_collectives(topology), model, tx, layout, mesh, opt_state)
    return step(blocks, opt_state, jnp.zeros((batch_size, 8, 8, 1), jnp.float32), jnp.zeros((batch_size,), jnp.int32))


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class Config:
    """One run: ``batch_size`` global (split over the devices), ``lr`` for Adam."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    ndevices: int = 8


@dataclasses.dataclass
class Result:
    """Per-step losses of the run and of the lax step from the same state (lockstep), accuracies."""

    collectives: str
    step_losses: list
    lockstep_losses: list
    max_param_diff: float      # largest |block_blink - block_lax| after any one lockstep step
    epochs: list               # dicts: epoch, loss, accuracy (train), test_accuracy
    test_accuracy: float
    step_times: list           # seconds, first (compiling) step excluded
    lax_step_times: list       # the lockstep lax steps, same state and batch
    nparams: int
    nbytes_per_device: int     # the float32 parameter blocks one device stores

    @property
    def max_rel_diff(self) -> float:
        a, b = np.asarray(self.step_losses), np.asarray(self.lockstep_losses)
        return float((np.abs(a - b) / np.abs(b)).max()) if len(a) else 0.0


def train(config: Config, coll: Collectives, data=None, devices=None, progress: bool = False) -> Result:
    """Train the MLP fully sharded with ``coll``; every step also runs the lax step from the same
    state (untimed towards ``step_times``) for the lockstep check. Raises ValueError when the batch
    does not split over the devices or JAX has too few devices."""
    devices = digits.job_devices(devices, config.ndevices, config.batch_size)
    n = len(devices)
    x_tr, y_tr, x_te, y_te = data if data is not None else load_data(config.seed)
    mesh = Mesh(np.asarray(devices), (AXIS,))
    dat = NamedSharding(mesh, P(AXIS))
    model, tx = MLP(), optax.adam(config.lr)
    params = model.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, 8, 8, 1), jnp.float32))["params"]
    layout = Layout.of(params, n)
    blocks = [jax.device_put(v, dat) for v in layout.shard(params)]
    opt_state = jax.jit(tx.init)(blocks)
    step = make_step(coll, model, tx, layout, mesh, opt_state)
    ref = make_step(lax_collectives(), model, tx, layout, mesh, opt_state)
    predict = jax.jit(lambda p, x: model.apply({"params": p}, x).argmax(-1))

    losses, lock, times, lax_times, epochs, worst = [], [], [], [], [], 0.0
    for epoch in range(config.epochs):
        sums = np.zeros(3)
        for b in digits._epoch_batches(len(y_tr), config.batch_size, config.seed, epoch):
            xb, yb = jax.device_put(x_tr[b], dat), jax.device_put(y_tr[b], dat)
            t0 = time.perf_counter()
            new_blocks, new_opt, m = jax.block_until_ready(step(blocks, opt_state, xb, yb))
            t1 = time.perf_counter()
            ref_blocks, _, mr = jax.block_until_ready(ref(blocks, opt_state, xb, yb))
            t2 = time.perf_counter()
            if len(losses) or epoch:  # the first call compiles
                times.append(t1 - t0)
                lax_times.append(t2 - t1)
            m, mr = np.asarray(m, np.float64), np.asarray(mr, np.float64)
            losses.append(float(m[0] / m[2]))
            lock.append(float(mr[0] / mr[2]))
            worst = max(worst, max(float(np.abs(np.asarray(u) - np.asarray(v)).max())
                                   for u, v in zip(new_blocks, ref_blocks)))
            sums += m
            blocks, opt_state = new_blocks, new_opt
        host = layout.unshard([np.asarray(v) for v in blocks])
        test_acc = float((np.asarray(predict(host, x_te)) == y_te).mean())
        epochs.append({"epoch": epoch + 1, "loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2],
                       "test_accuracy": test_acc})
        if progress:
            print(f"[{coll.name} fsdp] epoch {epoch + 1:3d}  loss {sums[0] / sums[2]:.4f}  "
                  f"train acc {sums[1] / sums[2]:.4f}  test acc {test_acc:.4f}", flush=True)
    return Result(coll.name, losses, lock, worst, epochs, epochs[-1]["test_accuracy"] if epochs else float("nan"),
                  times, lax_times, int(sum(math.prod(s) for s in layout.shapes)), 4 * sum(layout.block))


def report(res: Result) -> str:
    """Lines: accuracy, lockstep differences, step times against the lax steps."""
    med = lambda t: float(np.median(t)) * 1e3 if t else float("nan")  # noqa: E731
    return "\n".join([
        f"[{res.collectives} fsdp] held-out accuracy {res.test_accuracy:.4f} after {len(res.epochs)} epochs "
        f"({len(res.step_losses)} steps; {res.nparams} parameters, {res.nbytes_per_device} bytes stored per device)",
        f"lockstep vs lax.all_gather / lax.psum_scatter (same state and batch every step): largest loss "
        f"difference {res.max_rel_diff:.3e} rel ({'within' if res.max_rel_diff <= MAX_REL_DIFF else 'OUTSIDE'} "
        f"{MAX_REL_DIFF:g}), largest parameter difference {res.max_param_diff:.3e}",
        f"train step: jax_blink {med(res.step_times):.2f} ms, lax {med(res.lax_step_times):.2f} ms (medians)",
    ])


def problems(res: Result, min_accuracy: float) -> list:
    """Sentences for stderr: why the run fails (accuracy below target, lockstep mismatch); [] if fine."""
    out = []
    if res.test_accuracy < min_accuracy:
        out.append(f"held-out accuracy {res.test_accuracy:.4f} is below --min-accuracy {min_accuracy} after "
                   f"{len(res.epochs)} epoch(s) (per epoch: "
                   + ", ".join(f"{e['test_accuracy']:.3f}" for e in res.epochs)
                   + "): train longer (--epochs), adjust --lr, or lower --min-accuracy")
    if res.max_rel_diff > MAX_REL_DIFF:
        out.append(f"jax_blink all-gather / reduce-scatter changed a step's loss by {res.max_rel_diff:.2e} relative "
                   f"to lax (bound {MAX_REL_DIFF:g}): a wrong collective; please report it")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=Config.epochs)
    p.add_argument("--batch-size", type=int, default=Config.batch_size, help="global batch (default 64)")
    p.add_argument("--lr", type=float, default=Config.lr, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--topology", default=None, help="preset name or file for jax_blink (default: its own choice)")
    p.add_argument("--impl", choices=("auto", "ppermute", "ffi"), default="auto")
    p.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY,
                   help=f"exit status 1 when the held-out accuracy ends below this (default {MIN_ACCURACY})")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error("--epochs, --batch-size and --lr must be positive")
    config = Config(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                    ndevices=min(8, len(jax.devices())))
    if config.batch_size % config.ndevices:
        p.error(f"--batch-size {config.batch_size} does not split over {config.ndevices} devices")
    topo = jax_blink.Topology.load(args.topology) if args.topology else None
    res = train(config, blink_collectives(topo, args.impl), progress=True)
    print(report(res))
    bad = problems(res, args.min_accuracy)
    for x in bad:
        print(f"{p.prog}: {x}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
