"""Data-parallel Flax CNN on scikit-learn's handwritten digits, gradients synchronised by jax_blink.

The 8x8 digit images ship inside scikit-learn (``sklearn.datasets.load_digits``: 1797 images, 10
classes), so nothing is downloaded. Each global batch is split over the devices of one mesh axis;
every device computes the gradient of its shard, and the gradients are averaged with
``jax_blink.pmean`` on the gradient pytree as it is (jax_blink runs one collective per dtype over the
leaves where they are, so no flattening by hand) and the metrics summed
with ``jax_blink.psum``. Initial parameters are created independently on every device and replaced by
device 0's copy with ``jax_blink.broadcast``. ``--compare-lax`` repeats the identical run with
``jax.lax.psum`` and reports the largest per-step loss difference and both per-step times.

Two train steps, the same body: ``--mode pmap`` (``jax.pmap``) and ``--mode shard_map``
(``jax.jit(jax.shard_map(...))`` on a 1-D ``Mesh``).

Run from the repository root (8 host CPU devices are forced when the script is the entry point)::

    python examples/flax_digits/train.py --mode shard_map --epochs 10 --compare-lax

The same functions back ``jax-blink demo`` and ``tests/examples/test_example_digits.py``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # must precede the jax import; it only shapes the host (CPU) platform
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

try:
    import flax.linen as nn
    import optax
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError as err:  # the examples extra is not installed
    raise ModuleNotFoundError(
        f"the digits example needs flax, optax and scikit-learn ({err.name} is missing): "
        "pip install -e \".[examples]\"", name=err.name) from None

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blink

AXIS = "data"
MODES = ("pmap", "shard_map")
MIN_ACCURACY = 0.95   # default --min-accuracy: the exit status says whether training reached it
MAX_REL_DIFF = 1e-5   # --compare-lax: largest relative per-step loss difference vs lax.psum


# ----------------------------------------------------------------------------- data and model
def load_data(seed: int = 0):
    """The digits data set split 80/20 (stratified, fixed by ``seed``).

    Returns ``(x_train, y_train, x_test, y_test)``: images float32 ``[N, 8, 8, 1]`` scaled to [0, 1]
    (pixel values are 0..16), labels int32 ``[N]``; 1437 training and 360 held-out images.
    """
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


class CNN(nn.Module):
    """Two 3x3 convolutions, 2x2 average pooling, two dense layers: [B, 8, 8, 1] -> logits [B, 10]."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


# ----------------------------------------------------------------------------- collectives
@dataclasses.dataclass(frozen=True)
class Collectives:
    """The three collectives a training step uses, so one step body serves jax_blink and lax."""

    name: str
    psum: Callable
    pmean: Callable
    broadcast: Callable  # broadcast(x, axis_name, root) -> root's x on every device


def blink_collectives(topology=None, impl=None) -> Collectives:
    """``jax_blink.psum / pmean / broadcast`` on ``topology`` (None: jax_blink's default choice)."""
    kw = {"topology": topology, "impl": impl}
    return Collectives(
        "jax_blink",
        lambda x, a: jax_blink.psum(x, a, **kw),
        lambda x, a: jax_blink.pmean(x, a, **kw),
        lambda x, a, root=0: jax_blink.broadcast(x, a, root=root, **kw))


def _lax_broadcast(x, axis_name, root=0):
    # Bitwise copy of the root's value: every other device contributes exact zeros.
    keep = lax.axis_index(axis_name) == root
    return jax.tree.map(lambda v: lax.psum(jnp.where(keep, v, jnp.zeros_like(v)), axis_name), x)


def lax_collectives() -> Collectives:
    """``jax.lax.psum / pmean`` (the reference the jax_blink run is compared with)."""
    return Collectives("lax", lax.psum, lax.pmean, _lax_broadcast)


# ----------------------------------------------------------------------------- steps
def _init_body(key, *, model, coll, sample):
    # Each device initialises from its own key; device 0's parameters then replace them all.
    params = model.init(key, sample)["params"]
    return coll.broadcast(params, AXIS, 0)


def _step_body(params, opt_state, x, y, *, model, tx, coll, vary):
    """One data-parallel step on this device's shard: local gradient, pmean, optax update.

    Returns ``(params, opt_state, metrics)``; metrics float32 ``[3]`` = summed over devices
    (loss * count, correct predictions, count).
    """
    local = lax.pcast(params, AXIS, to="varying") if vary else params  # keep grads per-device

    def loss_fn(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(local)
    grads = coll.pmean(grads, AXIS)  # the pytree as is: one all-reduce per dtype, no concatenate
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    n = jnp.float32(y.shape[0])
    correct = (logits.argmax(-1) == y).sum().astype(jnp.float32)
    metrics = coll.psum(jnp.stack([loss * n, correct, n]), AXIS)
    return params, opt_state, metrics


@dataclasses.dataclass
class Steps:
    """Mode-specific plumbing around the shared step body.

    ``init(keys)`` -> per-device parameters stacked on a leading device axis (for the broadcast
    check); ``start(stacked)`` -> (params, opt_state) in the layout ``step`` wants;
    ``shard(x, y)`` places one global batch; ``step(params, opt_state, x, y)`` ->
    (params, opt_state, metrics float32 [3]); ``host_params(params)`` -> one host copy.
    """

    init: Callable
    start: Callable
    shard: Callable
    step: Callable
    host_params: Callable


def make_steps(mode: str, coll: Collectives, model, tx, devices, sample) -> Steps:
    """Build the ``pmap`` or ``jit(shard_map)`` variant over ``devices`` (a list of jax devices)."""
    n = len(devices)
    init_body = lambda key: _init_body(key, model=model, coll=coll, sample=sample)  # noqa: E731
    if mode == "pmap":
        body = lambda p, o, x, y: _step_body(p, o, x, y, model=model, tx=tx, coll=coll,  # noqa: E731
                                             vary=False)
        step = jax.pmap(body, axis_name=AXIS, devices=devices)
        init = jax.pmap(init_body, axis_name=AXIS, devices=devices)
        # With several processes (examples/multiprocess) each passes pmap the rows of its own devices
        # only, and gets back arrays spanning every process: read the first local device's row.
        me = jax.process_index()
        local = np.asarray([i for i, d in enumerate(devices) if d.process_index == me])
        mine = (lambda v: v) if len(local) == n else (lambda v: v[local])  # noqa: E731
        first = lambda v: np.asarray(v.addressable_data(0)).reshape(v.shape[1:])  # noqa: E731
        return Steps(
            init=lambda keys: init(mine(keys)),
            start=jax.pmap(lambda p: (p, tx.init(p)), axis_name=AXIS, devices=devices),
            shard=lambda x, y: (mine(x.reshape(n, -1, *x.shape[1:])), mine(y.reshape(n, -1))),
            step=lambda p, o, x, y: (lambda r: (r[0], r[1], first(r[2])))(step(p, o, x, y)),
            host_params=lambda p: jax.tree.map(first, p))
    if mode == "shard_map":
        mesh = Mesh(np.asarray(devices), (AXIS,))
        rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
        # check_vma=False here: the stacked output must not depend on how broadcast types its result.
        init = jax.jit(jax.shard_map(lambda k: jax.tree.map(lambda v: v[None], init_body(k[0])),
                                     mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                     check_vma=False))
        body = lambda p, o, x, y: _step_body(p, o, x, y, model=model, tx=tx, coll=coll,  # noqa: E731
                                             vary=True)
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                     out_specs=(P(), P(), P())))

        def start(stacked):
            params = jax.device_put(jax.tree.map(lambda v: v[0], stacked), rep)
            return params, jax.jit(tx.init, out_shardings=rep)(params)

        return Steps(
            init=lambda keys: init(jax.device_put(keys, dat)),
            start=start,
            shard=lambda x, y: (jax.device_put(x, dat), jax.device_put(y, dat)),
            step=step,
            host_params=lambda p: jax.tree.map(np.asarray, p))
    raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class Config:
    """One training run. ``batch_size`` is global (split over the devices); ``lr`` for Adam."""

    mode: str = "shard_map"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 5e-3
    seed: int = 0
    ndevices: int = 8
    progress: bool = True


@dataclasses.dataclass
class Result:
    """What one run measured. Times in seconds; losses are mean cross-entropy per example."""

    collectives: str
    mode: str
    step_losses: list          # one float per step, in order
    epochs: list               # dicts: epoch, loss, accuracy (train, over the epoch), test_accuracy
    test_accuracy: float       # held-out accuracy after the last epoch
    step_times: list           # seconds per step, first (compiling) step excluded
    compile_s: float           # first step, including compilation
    broadcast_ok: bool         # every device held device 0's initial parameters
    nparams: int
    lockstep_losses: list | None = None  # with a shadow: its loss at each step, its previous step
                                         # taken from this run's state (see ``train``)

    @property
    def step_time(self) -> float:
        """Median seconds per train step (after compilation)."""
        return float(np.median(self.step_times)) if self.step_times else float("nan")


def _epoch_batches(ntrain: int, batch: int, seed: int, epoch: int):
    order = np.random.default_rng([seed, epoch]).permutation(ntrain)
    nb = ntrain // batch  # the remainder is dropped; a different remainder each epoch
    return order[: nb * batch].reshape(nb, batch)


def job_devices(devices, ndevices: int, batch_size: int) -> list:
    """``devices`` (default: the first ``ndevices`` JAX devices) as a list. Raises ValueError when JAX
    has fewer devices or the global ``batch_size`` does not split over them."""
    devices = list(devices or jax.devices()[:ndevices])
    n = len(devices)
    if n < ndevices:
        raise ValueError(f"{ndevices} devices requested but JAX has {len(jax.devices())}; on CPU "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax")
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} does not split over {n} devices: use a multiple of {n}")
    return devices


def train(config: Config, coll: Collectives, data=None, devices=None,
          shadow: Collectives | None = None) -> Result:
    """Train the CNN data-parallel with ``coll`` and evaluate on the held-out split.

    ``data``: ``load_data()``'s tuple (loaded when None). ``devices``: jax devices (default the
    first ``config.ndevices``). ``shadow``: other collectives run in lockstep, untimed: before step
    k they take step k-1 from this run's own state, so ``lockstep_losses[k] - step_losses[k]`` is what
    one step with the other collectives changes (no drift accumulated over earlier steps).
    Raises ValueError when the batch does not split over the devices.
    """
    devices = job_devices(devices, config.ndevices, config.batch_size)
    n = len(devices)
    x_tr, y_tr, x_te, y_te = data if data is not None else load_data(config.seed)
    model = CNN()
    tx = optax.adam(config.lr)
    steps = make_steps(config.mode, coll, model, tx, devices, jnp.zeros((1, 8, 8, 1), jnp.float32))
    twin = shadow and make_steps(config.mode, shadow, model, tx, devices,
                                 jnp.zeros((1, 8, 8, 1), jnp.float32))

    root = jax.random.PRNGKey(config.seed)
    keys = jnp.stack([jax.random.fold_in(root, i) for i in range(n)])
    stacked = steps.init(keys)
    # process_allgather: with several processes (examples/multiprocess) the stack spans all of them
    # (shard_map: one global array; pmap: each process holds its own devices' rows)
    leaves = [np.asarray(multihost_utils.process_allgather(v, tiled=True)) if jax.process_count() > 1
              else np.asarray(v) for v in jax.tree.leaves(stacked)]
    expect = jax.tree.leaves(model.init(keys[0], jnp.zeros((1, 8, 8, 1), jnp.float32))["params"])
    broadcast_ok = all(np.array_equal(v[i], v[0]) for v in leaves for i in range(n)) and all(
        np.allclose(v[0], np.asarray(e), rtol=0, atol=1e-6) for v, e in zip(leaves, expect))
    if not broadcast_ok:
        raise RuntimeError(f"{coll.name} broadcast did not give every device device 0's parameters")
    params, opt_state = steps.start(stacked)
    nparams = sum(v[0].size for v in leaves)

    predict = jax.jit(lambda p, x: model.apply({"params": p}, x).argmax(-1))
    step_losses, step_times, epochs, compile_s = [], [], [], float("nan")
    lockstep, pending = ([] if twin else None), None
    bar = None
    if config.progress:
        from tqdm.auto import tqdm
        total = config.epochs * (len(y_tr) // config.batch_size)
        bar = tqdm(total=total, desc=f"{coll.name} {config.mode}", unit="step", leave=False,
                   disable=None)  # None: no bar when stderr is not a terminal (logs, CI)
    for epoch in range(config.epochs):
        batches = [steps.shard(x_tr[b], y_tr[b]) for b in
                   _epoch_batches(len(y_tr), config.batch_size, config.seed, epoch)]
        sums = np.zeros(3)
        for xb, yb in batches:
            state = (params, opt_state)
            t0 = time.perf_counter()
            params, opt_state, metrics = steps.step(params, opt_state, xb, yb)
            metrics = np.asarray(jax.block_until_ready(metrics), dtype=np.float64)
            dt = time.perf_counter() - t0
            if np.isnan(compile_s):
                compile_s = dt
            else:
                step_times.append(dt)
            sums += metrics
            step_losses.append(float(metrics[0] / metrics[2]))
            if twin:  # untimed: the shadow's loss here, then its update from this run's state
                m = np.asarray(twin.step(*(pending or state), xb, yb)[2], dtype=np.float64)
                lockstep.append(float(m[0] / m[2]))
                # finished before the next timed step starts (else its tail is timed as this run's step)
                pending = jax.block_until_ready(twin.step(*state, xb, yb)[:2])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{step_losses[-1]:.4f}")
        test_acc = float((np.asarray(predict(steps.host_params(params), x_te)) == y_te).mean())
        epochs.append({"epoch": epoch + 1, "loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2],
                       "test_accuracy": test_acc})
        if bar is not None:
            bar.write(f"[{coll.name} {config.mode}] epoch {epoch + 1:3d}  loss {sums[0] / sums[2]:.4f}  "
                      f"train acc {sums[1] / sums[2]:.4f}  test acc {test_acc:.4f}")
    if bar is not None:
        bar.close()
    return Result(coll.name, config.mode, step_losses, epochs, epochs[-1]["test_accuracy"] if epochs
                  else float("nan"), step_times, compile_s, broadcast_ok, int(nparams), lockstep)


@dataclasses.dataclass
class Comparison:
    """jax_blink run against lax.psum: same seeds, data order and steps.

    Two measures. Lockstep (the exactness check): at every step the lax step starts from the
    jax_blink run's previous state, so the loss difference is what one all-reduce's rounding changes.
    Independent runs (what a user sees): each run follows its own trajectory; float32 differences in
    the last bit, from a different summation order, grow over many Adam steps (as they would for any
    change of reduction order), so these losses drift apart later in training.
    """

    blink: Result
    lax: Result
    max_abs_diff: float        # lockstep: largest |loss_blink - loss_lax| over the steps
    max_rel_diff: float        # lockstep: largest |loss_blink - loss_lax| / |loss_lax|
    free_max_rel_diff: float   # independent runs: largest relative loss difference
    diverge_step: int | None   # independent runs: first step whose relative difference > 1e-5
    collective_s: dict         # seconds per all-reduce of the gradient bucket: {"jax_blink", "lax"}
    step_s: dict               # seconds per train step, both timed interleaved: {"jax_blink", "lax"}


def time_collective(colls: Sequence[Collectives], nelems: int, devices, reps: int = 20) -> dict:
    """Median seconds of one all-reduce of ``nelems`` float32 per device, ``jit(shard_map)``.

    Both collectives run in the same process, interleaved, so their ratio is fair.
    """
    mesh = Mesh(np.asarray(devices), (AXIS,))
    x = jax.device_put(jnp.repeat(jnp.arange(1.0, len(devices) + 1, dtype=jnp.float32), nelems),
                       NamedSharding(mesh, P(AXIS)))
    fns = {c.name: jax.jit(jax.shard_map(lambda v, c=c: c.psum(v, AXIS), mesh=mesh,
                                         in_specs=P(AXIS), out_specs=P()))
           for c in colls}
    for f in fns.values():
        jax.block_until_ready(f(x))
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def time_steps(colls: Sequence[Collectives], config: Config, data=None, devices=None, reps: int = 40) -> dict:
    """Median seconds of one train step (``config.mode``) with each of ``colls``, from the same state
    and batch, the steps interleaved (A, B, A, B, ...) so that their ratio is fair on a busy machine.

    The training runs' own per-step times come from two runs made one after the other (and the
    jax_blink run also takes untimed lax steps between its timed ones), so their ratio is not.
    """
    x_tr, y_tr, _, _ = data if data is not None else load_data(config.seed)
    devices = list(devices or jax.devices()[: config.ndevices])
    model, tx = CNN(), optax.adam(config.lr)
    sample = jnp.zeros((1, 8, 8, 1), jnp.float32)
    steps = {c.name: make_steps(config.mode, c, model, tx, devices, sample) for c in colls}
    first = steps[colls[0].name]
    keys = jnp.stack([jax.random.fold_in(jax.random.PRNGKey(config.seed), i) for i in range(len(devices))])
    params, opt_state = first.start(first.init(keys))
    xb, yb = first.shard(x_tr[: config.batch_size], y_tr[: config.batch_size])
    for s in steps.values():
        jax.block_until_ready(s.step(params, opt_state, xb, yb))
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, s in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(s.step(params, opt_state, xb, yb))
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def explain_train_step(mode: str = "shard_map", batch_size: int = 64, ndevices: int = 8, topology=None):
    """One train step (``mode``) with jax_blink on the first ``ndevices`` JAX devices, for
    ``jax-blink explain examples/flax_digits/train.py:explain_train_step`` (a function taking no
    arguments: the parameters and a zero batch are built inside, so nothing is a constant).

    ``topology``: what jax_blink plans on (None: its default). Returns ``(params, opt_state, metrics)``
    of the step; under ``jax_blink.explain`` nothing runs."""
    devices = job_devices(None, ndevices, batch_size)
    model, tx = CNN(), optax.adam(Config.lr)
    sample = jnp.zeros((1, 8, 8, 1), jnp.float32)
    steps = make_steps(mode, blink_collectives(topology), model, tx, devices, sample)
    params = model.init(jax.random.PRNGKey(0), sample)["params"]
    if mode == "pmap":
        params = jax.tree.map(lambda v: jnp.broadcast_to(v, (len(devices),) + v.shape), params)
        opt_state = jax.vmap(tx.init)(params)
    else:
        opt_state = tx.init(params)
    x, y = steps.shard(jnp.zeros((batch_size, 8, 8, 1), jnp.float32), jnp.zeros((batch_size,), jnp.int32))
    return steps.step(params, opt_state, x, y)


def compare(config: Config, blink: Collectives, data=None, devices=None) -> Comparison:
    """Train with ``blink`` (lax in lockstep) and, independently, with ``lax_collectives()``."""
    data = data if data is not None else load_data(config.seed)
    devices = list(devices or jax.devices()[: config.ndevices])
    rb = train(config, blink, data, devices, shadow=lax_collectives())
    rl = train(config, lax_collectives(), data, devices)
    a, b = np.asarray(rb.step_losses), np.asarray(rb.lockstep_losses)
    diff = np.abs(a - b)
    free = np.abs(a - np.asarray(rl.step_losses)) / np.abs(np.asarray(rl.step_losses))
    over = np.flatnonzero(free > MAX_REL_DIFF)
    coll_s = time_collective([blink, lax_collectives()], rb.nparams, devices)
    step_s = time_steps([blink, lax_collectives()], config, data, devices)
    return Comparison(rb, rl, float(diff.max()), float((diff / np.abs(b)).max()), float(free.max()),
                      int(over[0]) if over.size else None, coll_s, step_s)


# ----------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Training options shared by this script and ``jax-blink demo``."""
    p.add_argument("--mode", choices=MODES, default="shard_map",
                   help="pmap, or jit(shard_map) on a 1-D mesh (default shard_map)")
    p.add_argument("--epochs", type=int, default=Config.epochs, help="passes over the training split")
    p.add_argument("--batch-size", type=int, default=Config.batch_size,
                   help="global batch, split over the devices (default 64)")
    p.add_argument("--lr", type=float, default=Config.lr, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY,
                   help=f"exit status 1 (with the reason on stderr) when the held-out accuracy ends "
                        f"below this (default {MIN_ACCURACY})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def accuracy_shortfall(res: Result, min_accuracy: float) -> str | None:
    """Why the run fails its accuracy target (a sentence for stderr), or None when it meets it."""
    if res.test_accuracy >= min_accuracy:
        return None
    return (f"held-out accuracy {res.test_accuracy:.4f} is below --min-accuracy {min_accuracy} "
            f"after {len(res.epochs)} epoch(s): train longer (--epochs) or lower --min-accuracy")


def config_from_args(args, ndevices: int = 8) -> Config:
    """A Config from parsed ``add_arguments`` options; ValueError on non-positive counts or a batch
    larger than the training split (an epoch would have no step)."""
    if args.epochs < 1 or args.batch_size < 1 or not 0 < args.lr < float("inf"):  # nan fails too
        raise ValueError(f"--epochs, --batch-size and --lr must be positive (and --lr finite), got "
                         f"{args.epochs}, {args.batch_size}, {args.lr}")
    if not 0 <= args.min_accuracy <= 1:  # nan fails too
        raise ValueError(f"--min-accuracy is a fraction in [0, 1], got {args.min_accuracy}")
    n_train = len(load_data(args.seed)[1])
    if args.batch_size > n_train:
        raise ValueError(f"--batch-size {args.batch_size} is larger than the training split ({n_train} images), "
                         f"so an epoch would have no step: use at most {n_train // ndevices * ndevices}")
    return Config(mode=args.mode, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, ndevices=ndevices, progress=not args.no_progress)


def report(res: Result) -> str:
    """One line: final held-out accuracy, per-step time."""
    return (f"[{res.collectives} {res.mode}] held-out accuracy {res.test_accuracy:.4f} "
            f"({len(res.step_losses)} steps, {res.step_time * 1e3:.2f} ms/step, "
            f"first step incl. compile {res.compile_s:.2f} s)")


def report_comparison(c: Comparison) -> str:
    """Lines: loss difference and per-step / per-collective times of both runs."""
    ratio = c.step_s["jax_blink"] / c.step_s["lax"]
    cratio = c.collective_s["jax_blink"] / c.collective_s["lax"]
    return "\n".join([
        f"largest per-step loss difference vs lax.psum: {c.max_abs_diff:.3e} abs, "
        f"{c.max_rel_diff:.3e} rel over {len(c.blink.step_losses)} steps, each from the same state "
        f"({'within' if c.max_rel_diff <= MAX_REL_DIFF else 'OUTSIDE'} {MAX_REL_DIFF:g} rel)",
        f"independent runs: largest loss difference {c.free_max_rel_diff:.3e} rel, "
        + ("never above 1e-5" if c.diverge_step is None else
           f"first above 1e-5 at step {c.diverge_step} (last-bit differences grow over Adam steps)")
        + f"; held-out accuracy {c.blink.test_accuracy:.4f} vs {c.lax.test_accuracy:.4f}",
        f"train step (same state and batch, interleaved): jax_blink {c.step_s['jax_blink'] * 1e3:.2f} ms, "
        f"lax {c.step_s['lax'] * 1e3:.2f} ms (ratio {ratio:.2f})",
        f"gradient all-reduce alone ({c.blink.nparams} float32): jax_blink "
        f"{c.collective_s['jax_blink'] * 1e3:.3f} ms, lax {c.collective_s['lax'] * 1e3:.3f} ms "
        f"(ratio {cratio:.2f})",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--compare-lax", action="store_true",
                   help="repeat the run with lax.psum; report loss difference and per-step times")
    p.add_argument("--topology", default=None,
                   help="preset name or file for jax_blink (default: jax_blink's own choice)")
    p.add_argument("--impl", choices=("auto", "ppermute", "ffi"), default="auto",
                   help="jax_blink lowering (default auto: ffi where built, else ppermute)")
    args = p.parse_args(argv)
    try:
        config = config_from_args(args, ndevices=min(8, len(jax.devices())))
    except ValueError as err:
        p.error(str(err))
    if config.batch_size % config.ndevices:  # checked here so a bad value never starts training
        n = config.ndevices
        near = sorted({max(n, config.batch_size // n * n), (config.batch_size // n + 1) * n})
        p.error(f"--batch-size {config.batch_size} does not split over {n} devices: use a multiple "
                f"of {n} (e.g. {' or '.join(map(str, near))})")
    topo = None
    if args.topology:
        topo = jax_blink.Topology.load(args.topology)
    blink = blink_collectives(topo, args.impl)
    problems = []
    if args.compare_lax:
        c = compare(config, blink)
        res = c.blink
        print(report(c.blink))
        print(report(c.lax))
        print(report_comparison(c))
        if c.max_rel_diff > MAX_REL_DIFF:
            problems.append(f"jax_blink.psum changed a step's loss by {c.max_rel_diff:.2e} relative to "
                            f"lax.psum (bound {MAX_REL_DIFF:g}): a wrong all-reduce; please report it")
    else:
        res = train(config, blink)
        print(report(res))
    problems.append(accuracy_shortfall(res, args.min_accuracy))
    problems = [x for x in problems if x]
    for x in problems:
        print(f"{p.prog}: {x}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
