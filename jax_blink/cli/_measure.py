"""``jax-blink bench --measure``: the real collectives on this machine's JAX devices, jax_blink and
``lax`` side by side in one process, with nccl-tests' columns.

Per size (bytes per device; all-gather / reduce-scatter: the full buffer, as ``bench``): both
programs are ``jax.jit(jax.shard_map(...))`` over a 1-D mesh of the devices, compiled first (the
jax_blink one inside :func:`jax_blink.callsites.collect`, so the row also carries the plan that
lowering chose, its simulated time and the bound's time for that plan, exactly what
``jax_blink.explain`` reports), then called alternately (A B, B A, ...: the interleaving of
``benchmarks/collectives.py``) ``repeats`` times each after three warm-up calls; the medians are
reported. Columns follow nccl-tests (doc/PERFORMANCE.md): size, count (elements), type, time,
``algbw = size / time`` and ``busbw = algbw * factor(n)`` (all-reduce 2(n-1)/n, all-gather /
reduce-scatter (n-1)/n, broadcast / reduce 1). ``lax`` counterparts: ``lax.psum``,
``lax.all_gather(tiled=True)``, ``lax.psum_scatter(tiled=True)``, and for broadcast / reduce
``lax.psum`` of the root-masked operand (broadcast) and ``lax.psum`` masked to the root (reduce).
The operand holds small integers, so every sum is exact and the outputs are compared bitwise.
"""

from __future__ import annotations

import time

import numpy as np

DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")


def _functions(collective: str, topology, root: int):
    """(jax_blink per-device function, lax per-device function) of ``collective`` over axis "i"."""
    import jax.numpy as jnp
    from jax import lax

    from .. import api

    def masked(v):
        return jnp.where(lax.axis_index("i") == root, v, jnp.zeros_like(v))

    if collective == "allreduce":
        return lambda v: api.psum(v, "i", topology=topology), lambda v: lax.psum(v, "i")
    if collective == "allgather":
        return (lambda v: api.all_gather(v, "i", tiled=True, topology=topology),
                lambda v: lax.all_gather(v, "i", tiled=True))
    if collective == "reducescatter":
        return (lambda v: api.psum_scatter(v, "i", tiled=True, topology=topology),
                lambda v: lax.psum_scatter(v, "i", tiled=True))
    if collective == "broadcast":
        return lambda v: api.broadcast(v, "i", root, topology=topology), lambda v: lax.psum(masked(v), "i")
    return lambda v: api.reduce(v, "i", root, topology=topology), lambda v: masked(lax.psum(v, "i"))


def measure(collective: str, sizes, devices, *, repeats: int, topology, dtype: str = "float32", root_rank: int = 0,
            progress=None) -> list[dict]:
    """Measured rows, one per size in ``sizes`` (bytes per device; sharded: the full buffer).

    Args: ``devices`` the JAX devices (rank r = devices[r]); ``repeats`` timed calls of each program;
    ``topology`` what jax_blink plans on; ``dtype`` one of :data:`DTYPES`; ``root_rank`` broadcast /
    reduce root; ``progress`` wraps the size iterable (tqdm) or None.
    Returns dicts: size, count, dtype, n, and for "blink" and "lax" ``<name>_time_s`` (median seconds
    per call), ``<name>_algbw_gbps``, ``<name>_busbw_gbps``; ``blink_over_lax`` (time ratio);
    ``plan``, ``lowering``, ``predicted_s``, ``sim_s``, ``bound_s`` of the jax_blink call site; ``equal``
    (outputs bitwise equal).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from .. import callsites, collectives

    row = collectives.get(collective)
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("i",))
    spec = NamedSharding(mesh, P("i"))
    fb, fl = _functions(collective, topology, root_rank)
    jdt = jnp.dtype(dtype)
    out = []
    for size in (progress(sizes) if progress else sizes):
        count = max(n if row.sharded else 1, size // jdt.itemsize)
        if row.sharded:
            count -= count % n  # n equal shards
        per_dev = count // n if row.input == "shard" else count
        x = jax.device_put(jnp.asarray(np.arange(n * per_dev) % 7, jdt), spec)
        progs = {}
        sites = []
        for name, f in (("blink", fb), ("lax", fl)):
            prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
            if name == "blink":
                jax.clear_caches()  # lower again, so the call site reports
                with callsites.collect() as sites:
                    progs[name] = prog.lower(x).compile()
            else:
                progs[name] = prog.lower(x).compile()
        for f in progs.values():
            for _ in range(3):  # warm-up: thread pools, allocator
                jax.block_until_ready(f(x))
        ts = {k: [] for k in progs}
        for i in range(repeats):
            for k, f in (list(progs.items()) if i % 2 == 0 else reversed(list(progs.items()))):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                ts[k].append(time.perf_counter() - t0)
        equal = bool(np.array_equal(np.asarray(progs["blink"](x)), np.asarray(progs["lax"](x))))
        nbytes = count * jdt.itemsize
        r = {"size": nbytes, "count": count, "dtype": dtype, "n": n}
        for k, v in ts.items():
            t = float(np.median(v))
            r[f"{k}_time_s"] = t
            r[f"{k}_algbw_gbps"] = nbytes / t / 1e9
            r[f"{k}_busbw_gbps"] = nbytes / t / 1e9 * row.busbw_factor(n)
        r["blink_over_lax"] = r["blink_time_s"] / r["lax_time_s"]
        site = sites[0] if sites else None
        r.update(plan=None if site is None else site.shape, lowering=None if site is None else site.lowering,
                 predicted_s=None if site is None else site.predicted_s, sim_s=None if site is None else site.sim_s,
                 bound_s=None if site is None else site.bound_s, equal=equal)
        out.append(r)
    return out
