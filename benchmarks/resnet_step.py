"""A Flax ResNet-with-BatchNorm train step on 8 host CPU devices: lax vs jax_blink, measured in one run.

Usage: python benchmarks/resnet_step.py [--width 16] [--image 32] [--batch 4] [--reps 20]
       [--stages 2,2,2,2] [--threshold BYTES]

The model is a ResNet18 (four stages of two basic blocks, a projection where a stage changes shape)
at ``--width`` filters, every normalisation ``BatchNorm(axis_name="batch")``, so each one averages its
batch statistics across devices with ``lax.pmean`` inside Flax; the train step is the usual
data-parallel one (loss and its gradient, ``lax.pmean`` of the gradient pytree and of the loss,
SGD with momentum), ``jax.pmap``-ed over 8 CPU devices on synthetic data. It runs three ways:

- ``lax``: as written;
- ``transform``: ``jax_blink.transform(step)``: every lax psum / pmean (BatchNorm's forward statistics,
  their transposes in the backward pass, the gradients', the loss's) runs through jax_blink,
  independent ones combined into one call per bucket;
- ``rename``: the step's own two ``lax.pmean`` calls written ``jax_blink.pmean`` (BatchNorm's stay on
  lax inside Flax);
- ``uncombined`` (``--uncombined``): the transform with combining off, one call per lax psum.

Printed: the gradient leaf count; XLA's all-reduces in lax's compiled step (after XLA's combiner)
against the jax_blink custom calls and XLA all-reduces left in each jax_blink step; each step's
median and least wall time and median CPU time (all threads of the process) over ``--reps`` rounds
with the three called in turn (the order reversed every other round), the ratios to lax; the
largest relative difference of the losses over ``--steps`` steps trained from one state.
Targets: no more jax_blink calls than XLA's all-reduces, time ratio <= 0.95, losses within 1e-5
relative.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jax_blink  # noqa: E402

AXIS = "batch"
N = 8
ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")
BLINK_CALL = re.compile(r'custom_call_target="jax_blink_(?:cpu|cuda)"')


def make_model(width: int = 16, stages=(2, 2, 2, 2), classes: int = 10):
    """A ResNet (basic blocks) as a Flax module: ``width`` filters in the first stage, doubling per
    stage, ``BatchNorm(axis_name="batch")`` after every convolution. Input NHWC float32."""
    import flax.linen as nn

    class Block(nn.Module):
        filters: int
        strides: int

        @nn.compact
        def __call__(self, x, train: bool):
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                     axis_name=AXIS)
            y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), use_bias=False)(x)
            y = nn.relu(norm()(y))
            y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
            y = norm(scale_init=nn.initializers.zeros)(y)
            if x.shape != y.shape:  # projection shortcut
                x = nn.Conv(self.filters, (1, 1), (self.strides, self.strides), use_bias=False)(x)
                x = norm()(x)
            return nn.relu(x + y)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=AXIS)(x))
            for i, blocks in enumerate(stages):
                for j in range(blocks):
                    x = Block(width * 2 ** i, 2 if i > 0 and j == 0 else 1)(x, train)
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    return ResNet()


def setup(width=16, image=32, batch=4, stages=(2, 2, 2, 2), steps=1, seed=0):
    """(state, batches, make_step): ``state`` = (params, batch_stats, momentum) replicated over the 8
    devices; ``batches`` a list of ``steps`` (images [8, batch, image, image, 3], labels [8, batch]);
    ``make_step(pmean)`` the per-device train step with the step's own averages done by ``pmean``."""
    import optax

    model = make_model(width, tuple(stages))
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((steps, N, batch, image, image, 3)).astype(np.float32)
    ys = rng.integers(0, 10, size=(steps, N, batch)).astype(np.int32)
    variables = model.init(jax.random.PRNGKey(seed), jnp.asarray(xs[0, 0]), train=False)
    tx = optax.sgd(0.05, momentum=0.9)
    rep = functools.partial(jax.tree.map, lambda v: jnp.broadcast_to(v, (N, *np.shape(v))))
    state = (rep(variables["params"]), rep(variables["batch_stats"]), rep(tx.init(variables["params"])))

    def make_step(pmean):
        def step(params, stats, opt, x, y):
            def loss_fn(p):
                logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                return loss, upd["batch_stats"]

            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            grads = pmean(grads, AXIS)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), new_stats, opt, pmean(loss, AXIS)
        return step

    return state, [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)], make_step


def variants(make_step, threshold=None, uncombined=False) -> dict:
    """The pmapped steps: "lax", "transform" (``jax_blink.transform`` of the lax step), "rename" (the
    step's own pmeans by ``jax_blink.pmean``) and, with ``uncombined``, "uncombined" (the transform
    with combining off: one call per lax psum)."""
    lax_step = make_step(lax.pmean)
    out = {"lax": jax.pmap(lax_step, axis_name=AXIS),
           "transform": jax.pmap(jax_blink.transform(lax_step, combine_threshold_bytes=threshold), axis_name=AXIS),
           "rename": jax.pmap(make_step(jax_blink.pmean), axis_name=AXIS)}
    if uncombined:
        out["uncombined"] = jax.pmap(jax_blink.transform(lax_step, combine_threshold_bytes=0), axis_name=AXIS)
    return out


def counts(fns: dict, state, batch) -> dict:
    """Per variant: (XLA all-reduces, jax_blink custom calls) in its compiled step's HLO text."""
    out = {}
    for name, f in fns.items():
        text = f.lower(*state, *batch).compile().as_text()
        out[name] = (len(ALL_REDUCE.findall(text)), len(BLINK_CALL.findall(text)))
    return out


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--image", type=int, default=32, help="image side (pixels)")
    ap.add_argument("--batch", type=int, default=4, help="images per device")
    ap.add_argument("--stages", default="2,2,2,2", help="basic blocks per stage (ResNet18: 2,2,2,2)")
    ap.add_argument("--reps", type=int, default=20, help="timed rounds (each runs every variant once)")
    ap.add_argument("--steps", type=int, default=4, help="train steps compared for the losses")
    ap.add_argument("--threshold", type=int, default=None, help="combine threshold in bytes (default: jax_blink's)")
    ap.add_argument("--uncombined", action="store_true", help="also time the transform with combining off")
    args = ap.parse_args(argv)
    stages = tuple(int(s) for s in args.stages.split(","))
    state, batches, make_step = setup(args.width, args.image, args.batch, stages, args.steps)
    leaves = len(jax.tree.leaves(state[0]))
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores; "
          f"ResNet stages {stages} width {args.width}, {args.image}x{args.image} images, {args.batch} per device, "
          f"{leaves} gradient leaves, {sum(v[0].size for v in jax.tree.leaves(state[0])):,} parameters")
    fns = variants(make_step, args.threshold, args.uncombined)
    c = counts(fns, state, batches[0])
    xla_ar = c["lax"][0]
    print(f"\ncollective calls per step (compiled HLO): lax {xla_ar} XLA all-reduces (after XLA's combiner)")
    for name in [k for k in fns if k != "lax"]:
        ar, calls = c[name]
        verdict = "ok" if calls <= xla_ar else "MISSED"
        print(f"  {name:9s}: {calls} jax_blink calls + {ar} XLA all-reduces left  "
              f"(target: calls <= {xla_ar}: {verdict})")

    # losses: every variant trained from the same state for --steps steps
    worst = {k: 0.0 for k in fns if k != "lax"}
    st = {k: state for k in fns}
    for x, y in batches:
        res = {k: f(*st[k], x, y) for k, f in fns.items()}
        for k in worst:
            worst[k] = max(worst[k], _max_rel(res[k][3], res["lax"][3]))
        st = {k: tuple(r[:3]) for k, r in res.items()}
    print(f"\nlosses over {len(batches)} steps, max relative difference to lax: "
          + ", ".join(f"{k} {v:.2e} ({'ok' if v <= 1e-5 else 'MISSED'})" for k, v in worst.items()))

    x, y = batches[0]
    for f in fns.values():
        jax.block_until_ready(f(*state, x, y))
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for i in range(args.reps):
        order = list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))
        for k, f in order:
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*state, x, y))
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cmed = {k: float(np.median(v)) for k, v in cpu.items()}
    print(f"\nstep time over {args.reps} alternating rounds (ms; wall: median and least; cpu: the process's CPU "
          "time, all threads, median); target wall ratio <= 0.95")
    print(f"{'variant':10s} {'wall':>9s} {'least':>9s} {'cpu':>9s} {'ratio':>7s} {'least r':>8s} {'cpu r':>7s}")
    for k in fns:
        r = med[k] / med["lax"]
        tag = "" if k == "lax" else ("ok" if r <= 0.95 else "MISSED")
        print(f"{k:10s} {med[k] * 1e3:9.2f} {min(times[k]) * 1e3:9.2f} {cmed[k] * 1e3:9.2f} {r:7.3f} "
              f"{min(times[k]) / min(times['lax']):8.3f} {cmed[k] / cmed['lax']:7.3f} {tag}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
