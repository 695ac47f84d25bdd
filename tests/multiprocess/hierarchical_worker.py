"""One process of the hierarchical-lowering tests (tests/multiprocess/test_hierarchical.py, via jax_blink.launch).

Mode ``check``: every collective of jax_blink with impl="auto" against lax on meshes spanning all
processes, many cases per compiled function (process starts and compiles are the cost on 2 cores).
Prints one ``RESULT {json}`` line per case: max |jax_blink - lax|, exact equality, whether the
devices of each group hold bitwise-identical results, what the compiled HLO holds (native
custom calls, XLA all-reduce / all-gather / reduce-scatter, collective-permutes) and a hash of the
lowered program (the same in every process).
Mode ``absent``: the last process never calls the collective; the others must fail, not hang.
"""

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from jax_blink import distributed

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["check", "absent"])
ap.add_argument("--heartbeat", type=int, default=10)
a = ap.parse_args()
distributed.initialize(heartbeat_timeout_s=a.heartbeat)

import jax  # noqa: E402  (after initialize, which configures gloo)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402

me, nproc = jax.process_index(), jax.process_count()
devs = np.array(jax.devices())  # process-major
N = devs.size
L = N // nproc
K = 37  # per-device elements: not a multiple of the local device count (uneven partitions)


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def hlo_counts(f, *args):
    lowered = f.lower(*args)
    t = lowered.compile().as_text()
    # every process must lower one program (jaxlib 0.12.1 hangs cross-process collectives otherwise)
    sha = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]
    return {"program_sha": sha, "custom_call": t.count("custom-call("), "all_reduce": t.count("all-reduce("),
            "all_gather": t.count("all-gather("), "reduce_scatter": t.count("reduce-scatter("),
            "all_to_all": t.count("all-to-all("),
            "collective_permute": t.count("collective-permute(") + t.count("collective-permute-start("),
            "gather": t.count(" gather(")}


def global_array(mesh, host):
    spec = P(mesh.axis_names)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def run_pair(name, mesh, blink_body, lax_body, hosts, *, check_vma=False, groups_of=None):
    """Compile both bodies over ``mesh`` (every output: one block per device), compare, emit."""
    spec = P(mesh.axis_names)
    xs = [global_array(mesh, h) for h in hosts]
    fb = jax.jit(jax.shard_map(blink_body, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec,
                               check_vma=check_vma))
    fl = jax.jit(jax.shard_map(lax_body, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec,
                               check_vma=check_vma))
    counts = hlo_counts(fb, *xs)
    yb = jax.tree_util.tree_map(lambda y: np.asarray(multihost_utils.process_allgather(y, tiled=True)), fb(*xs))
    yl = jax.tree_util.tree_map(lambda y: np.asarray(multihost_utils.process_allgather(y, tiled=True)), fl(*xs))
    for key in yb:
        b, r = yb[key], yl[key]
        blocks = b.reshape(mesh.devices.size, -1)
        same = True
        if groups_of is not None and key in groups_of:
            for grp in groups_of[key]:
                same &= all(np.array_equal(blocks[grp[0]].view(np.uint8), blocks[p].view(np.uint8)) for p in grp)
        emit(case=f"{name}/{key}", dtype=str(b.dtype), shape=list(b.shape), **counts,
             max_abs_vs_lax=float(np.max(np.abs(b.astype(np.float64) - r.astype(np.float64)))) if b.size else 0.0,
             exact_vs_lax=bool(np.array_equal(b, r)), bitwise_in_group=bool(same),
             magnitude=float(np.max(np.abs(r.astype(np.float64)))) if r.size else 0.0)


rng = np.random.default_rng(1234)  # the same on every process: consistent global inputs
hf = rng.standard_normal((N, K)).astype(np.float32)
hi = rng.integers(-1000, 1000, size=(N, K)).astype(np.int32)
hr = rng.standard_normal((N, 4 * N)).astype(np.float32)  # reduce-scatter operands: N x 4 per device


def flat_body(blink):
    """Every collective over the flat axis "i" (rank = mesh position), one output per case."""
    api = jax_blink if blink else lax
    root_b, root_r = N - 1, 1

    def bcast(v):
        if blink:
            return jax_blink.broadcast(v, "i", root=root_b)
        return lax.psum(jnp.where(lax.axis_index("i") == root_b, v, jnp.zeros_like(v)), "i")

    def reduce(v):
        if blink:
            return jax_blink.reduce(v, "i", root=root_r)
        return jnp.where(lax.axis_index("i") == root_r, lax.psum(v, "i"), jnp.zeros_like(v))

    def body(v, vi, w):
        tree = {"a": v[:, :5], "b": v[:, 5:11].reshape(1, 2, 3), "c": vi[:, :7], "d": v[:, 11:12]}
        t = api.psum(tree, "i")

        def step(c, _):  # replicated from the first step on
            return api.psum(c, "i") * 0.5, None

        scanned, _ = lax.scan(step, v, None, length=3)
        return {
            "psum_f32": api.psum(v, "i"),
            "psum_i32": api.psum(vi, "i"),
            "psum_bf16": api.psum(v.astype(jnp.bfloat16), "i").astype(jnp.float32),
            "psum_f16_one_elem": api.psum(v[:, :1].astype(jnp.float16), "i").astype(jnp.float32),
            "tree_a": t["a"], "tree_b": t["b"].reshape(1, -1), "tree_c": t["c"], "tree_d": t["d"],
            "pmean": api.pmean(v, "i"),
            "ag_tiled": api.all_gather(v[0], "i", tiled=True)[None],
            "ag_untiled_i32": api.all_gather(vi[0, :5], "i")[None],
            "rs_tiled": api.psum_scatter(w, "i", scatter_dimension=1, tiled=True),
            "rs_untiled_i32": api.psum_scatter(vi[0, :N], "i").reshape(1, 1),
            "bcast": bcast(v),
            "bcast_i32": bcast(vi),
            "bcast_c64": bcast(lax.complex(v, -v)).real,
            "bcast_c64_imag": bcast(lax.complex(v, 2 * v)).imag,
            "reduce": reduce(v),
            "scan": scanned,
            "vmap": jax.vmap(lambda u: api.psum(u, "i"))(v.reshape(K, 1)).reshape(1, K),
            "grad": jax.grad(lambda u: jnp.sum(api.psum(u ** 2, "i")))(v),
            "grad_ag": jax.grad(lambda u: jnp.sum(api.all_gather(u, "i", tiled=True) ** 3))(v),
        }
    return body


def main_check():
    t0 = time.time()
    flat = Mesh(devs, ("i",))
    everyone = [list(range(N))]
    replicated = {"psum_f32", "psum_i32", "psum_bf16", "psum_f16_one_elem", "tree_a", "tree_b", "tree_c",
                  "tree_d", "pmean", "ag_tiled", "ag_untiled_i32", "bcast", "bcast_i32", "bcast_c64",
                  "bcast_c64_imag", "scan", "vmap"}
    run_pair("flat", flat, flat_body(True), flat_body(False), [hf, hi, hr],
             groups_of={k: everyone for k in replicated})
    # A permuted mesh: ranks alternate between processes (mesh position != device id).
    perm = devs.reshape(nproc, L).T.reshape(-1)[::-1]
    pm = Mesh(perm, ("i",))
    run_pair("permuted", pm,
             lambda v, w: {"psum": jax_blink.psum(v, "i"),
                           "ag": jax_blink.all_gather(v[0, :3], "i", tiled=True)[None],
                           "rs": jax_blink.psum_scatter(w, "i", scatter_dimension=1, tiled=True)},
             lambda v, w: {"psum": lax.psum(v, "i"), "ag": lax.all_gather(v[0, :3], "i", tiled=True)[None],
                           "rs": lax.psum_scatter(w, "i", scatter_dimension=1, tiled=True)},
             [hf, hr], groups_of={"psum": everyone, "ag": everyone})
    # check_vma=True: psum's transpose is pvary (grad of a replicated parameter's loss).
    run_pair("vma", flat,
             lambda v: {"psum": jax_blink.psum(v, "i"),
                        "grad": jax.grad(lambda u: jnp.sum(jax_blink.psum(u * u, "i")))(v),
                        "ag": jax_blink.all_gather(v, "i", axis=1, tiled=True)},
             lambda v: {"psum": lax.psum(v, "i"),
                        "grad": jax.grad(lambda u: jnp.sum(lax.psum(u * u, "i")))(v),
                        "ag": lax.all_gather(v, "i", axis=1, tiled=True)},
             [hf], check_vma=True, groups_of={"psum": everyone})
    # axis_index_groups (lax allows it with check_vma off): two groups, each over every process.
    # (2 x 4: two of a group's devices per process -> hierarchical; one per process or uneven -> ppermute)
    aig = [list(range(0, N, 2)), list(range(1, N, 2))]
    if N % 2 == 0:
        # the second group lists its ranks backwards: the groups' block orders differ
        rev = [list(range(0, N, 2)), list(range(N - 1, 0, -2))]
        run_pair("groups", flat,
                 lambda v, w: {"psum": jax_blink.psum(v, "i", axis_index_groups=aig),
                               "ag": jax_blink.all_gather(v[0, :3], "i", axis_index_groups=rev, tiled=True)[None],
                               "rs": jax_blink.psum_scatter(w[:, :N * 2], "i", scatter_dimension=1, tiled=True,
                                                            axis_index_groups=rev)},
                 lambda v, w: {"psum": lax.psum(v, "i", axis_index_groups=aig),
                               "ag": lax.all_gather(v[0, :3], "i", axis_index_groups=rev, tiled=True)[None],
                               "rs": lax.psum_scatter(w[:, :N * 2], "i", scatter_dimension=1, tiled=True,
                                                      axis_index_groups=rev)},
                 [hf, hr], groups_of={"psum": aig, "ag": rev})
    # 2-D mesh: the collective axis "a" spans the processes, "b" stays inside each one.
    b = 2 if L % 2 == 0 else L
    grid = Mesh(devs.reshape(N // b, b), ("a", "b"))
    cols = [list(range(j, N, b)) for j in range(b)]
    rows = [list(range(r * b, (r + 1) * b)) for r in range(N // b)]
    hg = rng.standard_normal((N, K)).astype(np.float32)
    run_pair("grid", grid,
             lambda v: {"psum_a": jax_blink.psum(v, "a"), "psum_b": jax_blink.psum(v, "b"),
                        "ag_a": jax_blink.all_gather(v, "a", axis=1, tiled=True)},
             lambda v: {"psum_a": lax.psum(v, "a"), "psum_b": lax.psum(v, "b"),
                        "ag_a": lax.all_gather(v, "a", axis=1, tiled=True)},
             [hg], groups_of={"psum_a": cols, "psum_b": rows, "ag_a": cols})
    cuda_hlo(flat)
    emit(case="done", seconds=time.time() - t0, local_devices=L, processes=nproc)


def cuda_hlo(mesh):
    """The GPU shape (one process per node): psum lowered for CUDA on this CPU job (cross-platform
    lowering, no GPU), with the CUDA records ("ffi", "hierarchical") made usable and the CUDA table
    keyed by device id as tests/native/test_cuda_safety.py does. Reports the native calls and the XLA
    all-reduces with their replica groups."""
    import dataclasses
    import re

    from jax_blink import lowering
    from jax_blink.lowering import ffi as ffi_lowering
    cluster = distributed.cluster_topology(nic_gbps=12.5)
    saved = (lowering.LOWERINGS["ffi"].get("cuda"), ffi_lowering.cuda_device_table,
             lowering.LOWERINGS["hierarchical"].get("cuda"))
    lowering.LOWERINGS["ffi"]["cuda"] = dataclasses.replace(saved[0], unavailable=None)
    lowering.LOWERINGS["hierarchical"]["cuda"] = dataclasses.replace(saved[2], unavailable=None)
    ffi_lowering.cuda_device_table = lambda table, devices, p: np.asarray(table, np.int64).reshape(-1)
    import os
    os.environ[ffi_lowering.ENV_NATIVE] = "1"  # as after `jax-blink selftest` passed: impl="auto" may go native
    try:
        f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "i", topology=cluster.topology,
                                                          device_map=cluster.device_map),
                                  mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
        text = f.trace(global_array(mesh, hf)).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        (lowering.LOWERINGS["ffi"]["cuda"], ffi_lowering.cuda_device_table,
         lowering.LOWERINGS["hierarchical"]["cuda"]) = saved
        del os.environ[ffi_lowering.ENV_NATIVE]
    reduces = [ln for ln in text.splitlines() if "stablehlo.all_reduce" in ln or '"stablehlo.all_reduce"' in ln]
    groups = [json.loads(m.group(1).replace(" ", "")) for ln in reduces
              for m in [re.search(r"replica_groups = dense<(\[\[.*?\]\])>", ln)] if m]
    emit(case="cuda_hlo", native_calls=text.count("custom_call @jax_blink_cuda"),
         cpu_calls=text.count("custom_call @jax_blink_cpu"), all_reduce=len(reduces), replica_groups=groups,
         collective_permute=text.count("collective_permute"))


def main_absent():
    mesh = Mesh(devs, ("i",))
    f = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                              check_vma=False))
    x = global_array(mesh, np.ones((N, 64), np.float32))
    f(x).block_until_ready()
    emit(case="absent_step0")
    if me == nproc - 1:
        print(f"process {me}: not calling the collective again", flush=True)
        time.sleep(600)
        sys.exit(0)
    t0 = time.monotonic()
    try:
        f(x).block_until_ready()
        emit(case="absent_survived")
    except Exception as e:  # noqa: BLE001 - the error the peers see
        emit(case="absent_failed", seconds=time.monotonic() - t0, message=str(e)[:500])
        sys.stdout.flush()
        import os
        os._exit(3)  # skip jax.distributed's shutdown barrier, which waits for the absent process


if a.mode == "check":
    main_check()
else:
    main_absent()
