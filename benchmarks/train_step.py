"""jax_blink vs lax inside whole train steps, on 8 host CPU devices: times measured in one run.

Usage: python benchmarks/train_step.py [--reps N] [--max-mib 64] [--only a,b,c,d] [--impl auto]
       [--processes 5]

Four tables, every ratio = median time with jax_blink / median time of its reference, both measured
in this process with the calls interleaved (A, B, then B, A, ...: the second call of a round ran 1-2%
slower), so machine noise hits both alike.
"ratio" is wall time (the target); "cpu ratio" the same for the process's CPU time per call (all
threads), which other jobs on a shared machine disturb far less:

(a) bare all-reduce, one float32 leaf of 64 KiB .. --max-mib per device: ``jax_blink.psum`` vs
    ``lax.psum`` (target: <= 0.9x from 1 MiB, <= 1.0x below); beside them "local", ``v + 1`` on every
    device: the memory traffic of an all-reduce (read the operand, write a result of its size) without
    the communication, what XLA takes to move those bytes here (a yardstick, not a strict bound: an
    executor avoiding XLA's fresh output pages can beat it);
(b) a pytree of k float32 leaves (k = 1, 2, 4, 16), same total bytes: ``jax_blink.psum`` of the
    pytree vs ``jax_blink.psum`` of one array of those bytes (target <= 1.1x); lax's pytree beside it;
(c) an ~8M-parameter MLP train step (``jit(shard_map)``, check_vma on, optax Adam,
    ``pmean`` of the gradient pytree): ``jax_blink.pmean`` vs ``lax.pmean`` (target <= 1.0x);
(d) the digits CNN train step of ``examples/flax_digits/train.py`` (its own step code, loaded from the
    example): jax_blink collectives vs lax ones (target <= 1.0x).

One process's ratios move by more than the targets' margins from one process to the next (in (b), k=1
times the identical call twice: 0.82-1.15 over single processes), so by default the script runs 5 fresh
processes (``--processes``, benchmarks/repeat.py), prints the first one's tables, then every ratio's
median over the processes, which the targets are judged on.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import repeat  # noqa: E402  (benchmarks/repeat.py, beside this script)
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_blink  # noqa: E402

AXIS = "i"


def interleaved(fns: dict, args: tuple, reps: int) -> dict:
    """Median wall seconds per call of each ``fns[name](*args)`` (calls interleaved over ``reps``
    rounds, A B, B A, A B, ...), and under ``name + " cpu"`` the median CPU seconds of this process per call (every
    thread: XLA's and jax_blink's). CPU time hardly moves when other jobs share the machine; wall time
    does, since the process then gets a varying share of the cores."""
    for f in fns.values():
        jax.block_until_ready(f(*args))  # compile + warm-up (fresh output pages, thread pools)
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for i in range(reps):
        # order reversed every other round: the call right after another ran 1-2% slower (MLP step)
        for k, f in (list(fns.items()) if i % 2 == 0 else reversed(fns.items())):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {k: float(np.median(v)) for k, v in times.items()}
    out.update({f"{k} cpu": float(np.median(v)) for k, v in cpu.items()})
    return out


def _reps(nbytes: int, base: int) -> int:
    # small operands are cheap and noisy: more repeats; large ones: at least 5
    return max(5, min(base * 4, base * (16 << 20) // max(nbytes, 1)))


def _mesh():
    return Mesh(np.asarray(jax.devices()[:8]), (AXIS,))


def _smap(f, mesh, check_vma=False):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=check_vma))


def _sizes(max_mib: int):
    b, out = 64 << 10, []
    while b <= max_mib << 20:
        out.append(b)
        b *= 4
    return out


def _fmt_bytes(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _print(title: str, header: list, rows: list) -> None:
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    print(line(header))
    for r in rows:
        print(line(r))
    sys.stdout.flush()


def _check(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(y).max(initial=0))),
                                   err_msg=what)


def bare(args) -> list:
    """(a): one float32 leaf per device, jax_blink.psum vs lax.psum."""
    mesh = _mesh()
    # local: a local op with an all-reduce's memory traffic (reads the operand, writes a result of its
    # size) and no communication: what XLA takes to move those bytes here (a yardstick, not a bound).
    fns = {"lax": _smap(lambda v: lax.psum(v, AXIS), mesh),
           "blink": _smap(lambda v: jax_blink.psum(v, AXIS, impl=args.impl), mesh),
           "local": _smap(lambda v: v + 1, mesh)}
    rows = []
    for nbytes in _sizes(args.max_mib):
        x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(8 * nbytes // 4), jnp.float32),
                           NamedSharding(mesh, P(AXIS)))
        _check(fns["blink"](x), fns["lax"](x), f"bare psum {nbytes}")
        t = interleaved(fns, (x,), _reps(nbytes, args.reps))
        target = 0.9 if nbytes >= 1 << 20 else 1.0
        r = t["blink"] / t["lax"]
        repeat.record("(a) bare psum", _fmt_bytes(nbytes), r, target)
        repeat.record("(a) bare psum", f"{_fmt_bytes(nbytes)} blink/local", t["blink"] / t["local"], None)
        repeat.record("(a) bare psum", f"{_fmt_bytes(nbytes)} lax/local", t["lax"] / t["local"], None)
        rows.append([_fmt_bytes(nbytes), f"{t['lax'] * 1e3:.3f}", f"{t['blink'] * 1e3:.3f}", f"{r:.2f}",
                     f"{t['blink cpu'] / t['lax cpu']:.2f}", f"{t['local'] * 1e3:.3f}",
                     f"{t['lax'] / t['local']:.2f}", f"{t['blink'] / t['local']:.2f}",
                     f"<= {target}", "ok" if r <= target else "MISSED"])
        del x
    _print("(a) bare all-reduce, 1 float32 leaf, per device (ms per call, median)",
           ["bytes/device", "lax.psum", "jax_blink.psum", "ratio", "cpu ratio", "local v+1", "lax/local",
            "blink/local", "target", ""], rows)
    return rows


def pytree(args) -> list:
    """(b): k leaves of the same total bytes vs one array."""
    mesh = _mesh()
    rows = []
    for total in (args.tree_mib << 20,):
        n = total // 4
        for k in (1, 2, 4, 16):
            shapes = [(n // k,)] * k
            xs = [jax.device_put(jnp.full((8 * s[0],), float(j + 1), jnp.float32), NamedSharding(mesh, P(AXIS)))
                  for j, s in enumerate(shapes)]
            one = jax.device_put(jnp.ones((8 * n,), jnp.float32), NamedSharding(mesh, P(AXIS)))
            psum_tree = _smap(lambda *v: jax_blink.psum(list(v), AXIS, impl=args.impl), mesh)
            psum_one = _smap(lambda v: jax_blink.psum(v, AXIS, impl=args.impl), mesh)
            lax_tree = _smap(lambda *v: lax.psum(list(v), AXIS), mesh)
            _check(psum_tree(*xs), lax_tree(*xs), f"pytree psum k={k}")

            def call_one(*_, f=psum_one, x=one):  # this iteration's array, bound now (the loop rebinds both)
                return f(x)

            fns = {"one": call_one, "tree": psum_tree, "lax_tree": lax_tree}
            t = interleaved(fns, tuple(xs), _reps(total, args.reps))
            r = t["tree"] / t["one"]
            goal = None if k == 1 else 1.1  # k = 1 times the identical call twice: the noise, no target
            repeat.record("(b) k leaves / 1 array", f"{_fmt_bytes(total)} k={k}", r, goal)
            rows.append([_fmt_bytes(total), k, f"{t['one'] * 1e3:.3f}", f"{t['tree'] * 1e3:.3f}", f"{r:.2f}",
                         f"{t['tree cpu'] / t['one cpu']:.2f}", f"{t['lax_tree'] * 1e3:.3f}",
                         f"{t['tree'] / t['lax_tree']:.2f}",
                         "-" if goal is None else ("ok" if r <= goal else "MISSED")])
            del xs, one, fns, call_one  # free this size's buffers before the next
    _print("(b) pytree of k float32 leaves vs one array of the same bytes (ms per call, median; target <= 1.1)",
           ["bytes/device", "k", "blink 1 array", "blink k leaves", "ratio", "cpu ratio", "lax k leaves", "blink/lax",
            ""],
           rows)
    return rows


def _mlp_params(key, sizes):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params[f"layer{i}"] = {"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
                               "b": jnp.zeros((b,), jnp.float32)}
    return params


def _mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def mlp(args) -> list:
    """(c): MLP train step, gradient pytree averaged by jax_blink.pmean vs lax.pmean."""
    import optax

    mesh = _mesh()
    sizes = (784, 2048, 2048, 1024, 512, 10)
    params = _mlp_params(jax.random.PRNGKey(0), sizes)
    nparams = sum(v.size for v in jax.tree.leaves(params))
    tx = optax.adam(1e-3)
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    params = jax.device_put(params, rep)
    opt_state = jax.jit(tx.init, out_shardings=rep)(params)
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal((8 * args.mlp_batch, 784)), jnp.float32), dat)
    y = jax.device_put(jnp.asarray(rng.integers(0, 10, 8 * args.mlp_batch), jnp.int32), dat)

    def make(pmean):
        def body(p, o, xb, yb):
            local = lax.pcast(p, AXIS, to="varying")  # per-device gradients until the pmean

            def loss_fn(q):
                return optax.softmax_cross_entropy_with_integer_labels(_mlp_apply(q, xb), yb).mean()

            loss, g = jax.value_and_grad(loss_fn)(local)
            g = pmean(g, AXIS)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, lax.pmean(loss, AXIS)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                     out_specs=(P(), P(), P())))

    fns = {"lax": make(lax.pmean), "blink": make(lambda g, a: jax_blink.pmean(g, a, impl=args.impl))}
    _check(fns["blink"](params, opt_state, x, y), fns["lax"](params, opt_state, x, y), "mlp step")
    t = interleaved(fns, (params, opt_state, x, y), args.reps)
    r = t["blink"] / t["lax"]
    repeat.record("(c) MLP step", f"{nparams:,} params", r, 1.0)
    row = [f"MLP {'-'.join(map(str, sizes))}", f"{nparams:,}", len(jax.tree.leaves(params)),
           f"{t['lax'] * 1e3:.2f}", f"{t['blink'] * 1e3:.2f}", f"{r:.2f}", f"{t['blink cpu'] / t['lax cpu']:.2f}",
           "ok" if r <= 1.0 else "MISSED"]
    return [row]


def _load_digits_example():
    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from jax_blink.cli.demo_cmd import load_example  # the one loader of examples/flax_digits/train.py
    return load_example()


def digits(args) -> list:
    """(d): the digits CNN train step of examples/flax_digits, timed by its own ``time_steps``."""
    ex = _load_digits_example()
    config = ex.Config(mode="shard_map", progress=False)
    colls = [ex.blink_collectives(None, args.impl), ex.lax_collectives()]
    t = ex.time_steps(colls, config, reps=args.reps * 4)
    leaves = jax.tree.leaves(ex.CNN().init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"])
    r = t["jax_blink"] / t["lax"]
    repeat.record("(d) digits step", "CNN", r, 1.0)
    return [["digits CNN (examples/flax_digits)", f"{sum(v.size for v in leaves):,}", len(leaves),
             f"{t['lax'] * 1e3:.2f}",
             f"{t['jax_blink'] * 1e3:.2f}", f"{r:.2f}", "-", "ok" if r <= 1.0 else "MISSED"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds (more for small operands)")
    ap.add_argument("--max-mib", type=int, default=64, help="largest bare psum per device (MiB)")
    ap.add_argument("--tree-mib", type=int, default=16, help="total bytes per device of table (b)")
    ap.add_argument("--mlp-batch", type=int, default=16, help="MLP examples per device")
    ap.add_argument("--only", default="a,b,c,d", help="tables to run, e.g. a,c")
    ap.add_argument("--impl", default="auto", help="jax_blink lowering: auto, ffi or ppermute")
    repeat.add_arguments(ap, default=5)
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set("abcd"):
        ap.error(f"--only takes tables among a,b,c,d, got {args.only!r}")
    if args.processes > 1:
        return repeat.run_processes(__file__, list(sys.argv[1:] if argv is None else argv), args.processes)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} cores, jax_blink impl={args.impl}")
    if "a" in only:
        bare(args)
    if "b" in only:
        pytree(args)
    rows = (mlp(args) if "c" in only else []) + (digits(args) if "d" in only else [])
    if rows:
        _print("(c, d) train step, jit(shard_map), optax Adam, pmean of the gradient pytree (ms per step, "
               "median; target <= 1.0)",
               ["model", "params", "leaves", "lax", "jax_blink", "ratio", "cpu ratio", ""], rows)
    repeat.save(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
