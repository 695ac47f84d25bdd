"""One process of the multi-process tests (started by tests/test_multiprocess.py via jax_blink.launch).

Modes:
  check: jax_blink.psum on meshes spanning all processes vs lax.psum over the same mesh; prints one
         ``RESULT {json}`` line per case (max error vs lax.psum and vs a float64 NumPy sum, whether
         all devices' results are bitwise equal, how many collective-permutes, all-reduces and
         custom calls the compiled HLO holds); with ``--pmap-digits`` one epoch of examples/flax_digits
         ``--mode pmap`` against lax.pmean in lockstep.
  kill:  runs jax_blink.psum in a loop; the last process SIGKILLs itself after a few steps; the
         others must be aborted by jax.distributed's heartbeat (the test checks how and when).
  stall: with JAX_BLINK_WATCH=1, two steps of two jax_blink.psum call sites (over the process axis
         of a processes x local devices grid, and over both axes); the last process stalls (sleeps
         instead of calling) at step 1; the others print ``RESULT`` with the error each site gives.
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from jax_blink import distributed

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["check", "kill", "stall"])
ap.add_argument("--impl", default="auto")
ap.add_argument("--heartbeat", type=int, default=10)
ap.add_argument("--pmap-digits", action="store_true", help="check: also train examples/flax_digits with --mode pmap")
a = ap.parse_args()

distributed.initialize(heartbeat_timeout_s=a.heartbeat)

import jax  # noqa: E402  (after initialize, which configures gloo)
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink.planner import facade  # noqa: E402

me, nproc = jax.process_index(), jax.process_count()
cluster = distributed.cluster_topology(nic_gbps=12.5)
devs = np.array(jax.devices())  # global, process-major
G = len(jax.local_devices())
N = devs.size


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


plan = jax_blink.plan(cluster.topology, "allreduce", devices=list(range(N)))
emit(case="plan", algorithm=plan.algorithm, rate_gbps=plan.rate_gbps, bound_gbps=plan.bound_gbps,
     ntrees=len(plan.trees), topology=cluster.topology.name, fingerprint=cluster.topology.fingerprint(),
     device_map=sorted(cluster.device_map.items()))


def run(mesh, axes, dtype, shape_per_dev, blink, impl=None, algorithm=None):
    """Per-device results of psum over ``axes`` (each device's copy kept: out sharded over all axes)."""
    names = mesh.axis_names
    spec = P(names)  # leading dim split over every mesh axis: one block per device

    def body(x):
        if blink:
            return jax_blink.psum(x, axes, impl=impl or a.impl, topology=cluster.topology,
                                  device_map=cluster.device_map, algorithm=algorithm)
        return jax.lax.psum(x, axes)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    gshape = (mesh.devices.size * shape_per_dev[0], *shape_per_dev[1:])
    rng = np.random.default_rng(1234)  # same on every process: the global input is consistent
    if np.issubdtype(dtype, np.integer):
        host = rng.integers(-1000, 1000, size=gshape).astype(dtype)
    else:
        host = rng.standard_normal(gshape).astype(dtype)
    x = jax.make_array_from_callback(gshape, NamedSharding(mesh, spec), lambda idx: host[idx])
    hlo = f.lower(x).compile().as_text() if blink else ""
    y = multihost_utils.process_allgather(f(x), tiled=True)
    return host, np.asarray(y), hlo


def check(name, mesh, axes, dtype, shape_per_dev=(3, 37), algorithm=None, impl=None):
    host, yb, hlo = run(mesh, axes, dtype, shape_per_dev, True, impl=impl, algorithm=algorithm)
    _, yl, _ = run(mesh, axes, dtype, shape_per_dev, False)
    # Per-device blocks in mesh order; group members (devices sharing a psum) must be bitwise equal.
    mshape = mesh.devices.shape
    blocks = yb.reshape(*mshape, *shape_per_dev)
    hostb = host.reshape(*mshape, *shape_per_dev).astype(np.float64)
    ax = tuple(mesh.axis_names.index(n) for n in ((axes,) if isinstance(axes, str) else axes))
    ref64 = np.broadcast_to(hostb.sum(axis=ax, keepdims=True), hostb.shape)
    first = np.take(blocks, [0], axis=ax[0]) if len(ax) == 1 else blocks[
        tuple(slice(0, 1) if i in ax else slice(None) for i in range(len(mshape)))]
    bitwise = bool(np.array_equal(np.broadcast_to(first, blocks.shape).view(np.uint8),
                                  np.ascontiguousarray(blocks).view(np.uint8)))
    emit(case=name, dtype=np.dtype(dtype).name, shape=list(blocks.shape),
         bitwise_equal_in_group=bitwise,
         max_abs_vs_lax=float(np.max(np.abs(yb.astype(np.float64) - yl.astype(np.float64)))),
         max_abs_vs_numpy64=float(np.max(np.abs(blocks.astype(np.float64) - ref64))),
         exact_vs_lax=bool(np.array_equal(yb, yl)),
         collective_permute=hlo.count("collective-permute-start") + hlo.count("collective-permute("),
         all_reduce=hlo.count("all-reduce"), custom_call=hlo.count("custom-call("))


if a.mode == "check":
    t0 = time.time()
    flat = Mesh(devs, ("i",))
    check("flat_f32", flat, "i", np.float32)
    check("flat_i32", flat, "i", np.int32)
    # A permuted mesh: mesh position != device id, and process boundaries are interleaved.
    perm = devs.reshape(nproc, G).T.reshape(-1)[::-1]
    check("permuted_f32", Mesh(perm, ("i",)), "i", np.float32)
    grid = Mesh(devs.reshape(nproc, G), ("node", "local"))
    check("grid_both_axes_f32", grid, ("node", "local"), np.float32)
    check("grid_cross_node_axis_f32", grid, "node", np.float32)
    hp = distributed.three_phase_plan(cluster.topology, "allreduce", list(range(N)))
    def leaders_per_node(tree):  # GPUs of each node with a cross-node tree edge (three phases: 1)
        ends = {}
        for c, par in tree.gpu_parents().items():
            if c // G != par // G:
                ends.setdefault(c // G, set()).add(c)
                ends.setdefault(par // G, set()).add(par)
        return max((len(v) for v in ends.values()), default=0)

    emit(case="three_phase_plan", ntrees=len(hp.trees), rate_gbps=hp.rate_gbps,
         crosses_network=all(any("network" in str(e) for e in t.edges) for t in hp.trees),
         max_leaders_per_node=max(leaders_per_node(t) for t in hp.trees))
    # distinct shape: build_request caches per (mesh, shape, ...) and must not reuse flat_f32's plan
    facade._CACHE.clear()  # then the lowering's own plan() call is the only one recorded
    # the planner's three phases as a tree schedule (ppermute; impl="auto" would run the hierarchical
    # lowering, whose intra-process phases plan each node alone)
    check("three_phase_f32", flat, "i", np.float32, shape_per_dev=(2, 41), algorithm="hierarchical",
          impl="ppermute")
    check("three_phase_auto_f32", flat, "i", np.float32, shape_per_dev=(2, 43), algorithm="hierarchical")
    emit(case="three_phase_lowered", algorithms=sorted({k[5] for k in facade._CACHE if len(k[1]) == N}))
    # jax_blink.explain on the job's mesh: the row's numbers against plan() / bench's sweep, here
    from jax_blink.cli.bench_cmd import simulate_sweep
    # impl="ppermute": the tree schedule the row describes (impl="auto" here runs "hierarchical")
    fx = jax.jit(jax.shard_map(lambda v: jax_blink.psum(v, "i", topology=cluster.topology, impl="ppermute",
                                                          device_map=cluster.device_map),
                               mesh=flat, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    xx = jax.make_array_from_callback((N * 64,), NamedSharding(flat, P("i")),
                                      lambda idx: np.ones(N * 64, np.float32)[idx])
    site, = jax_blink.explain(fx, xx, compile=False).sites
    ref = jax_blink.plan(cluster.topology, "allreduce", devices=list(site.plan.devices))
    swept, = simulate_sweep(cluster.topology, ref, [site.nbytes], progress=False)
    fixed, = simulate_sweep(cluster.topology, site.plan, [site.nbytes], progress=False, fixed=True)
    emit(case="explain", lowering=site.lowering, why=site.why, group_size=site.group_size, nbytes=site.nbytes,
         processes=site.processes, bound=[site.bound_gbps, ref.bound_gbps], sim=[site.sim_s, fixed["blink"].time_s],
         ring=[site.ring_s, None if swept["ring"] is None else swept["ring"].time_s],
         auto=[site.auto_s, swept["blink"].time_s])
    # impl="ffi" is an in-process custom call: across processes it must be refused clearly.
    try:
        run(flat, "i", np.float32, (1, 4), True, impl="ffi")
        emit(case="ffi_refused", refused=False, message="")
    except jax_blink.BlinkError as e:
        emit(case="ffi_refused", refused=True, message=str(e))
    if a.pmap_digits:
        # examples/flax_digits --mode pmap over every process (each process feeds pmap the rows of its
        # own devices): one epoch, lax.pmean in lockstep from the same state each step.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                        "flax_digits"))
        import train as digits

        jax_blink.set_device_map(cluster.device_map)
        cfg = digits.Config(mode="pmap", epochs=1, progress=False, ndevices=N)
        r = digits.train(cfg, digits.blink_collectives(cluster.topology), devices=list(devs),
                         shadow=digits.lax_collectives())
        emit(case="pmap_digits", broadcast_ok=r.broadcast_ok, steps=len(r.step_losses),
             max_rel_vs_lax=max(abs(a - b) / abs(b) for a, b in zip(r.step_losses, r.lockstep_losses)),
             first_loss=r.step_losses[0], last_loss=r.step_losses[-1], test_accuracy=r.test_accuracy)
    emit(case="done", seconds=time.time() - t0)
elif a.mode == "stall":
    # impl="auto" on a grid of processes x local devices: over "node" (one device per process) auto
    # takes XLA's all-reduce alone; over both axes, the hierarchical lowering's three phases. The
    # watch must name the stalled process at either (its phase (b), the one that waits on processes).
    grid = Mesh(devs.reshape(nproc, G), ("node", "local"))
    spec = P(("node", "local"))

    def site(axes, shape):
        f = jax.jit(jax.shard_map(lambda x: jax_blink.psum(x, axes, topology=cluster.topology, impl=a.impl,
                                                             device_map=cluster.device_map),
                                  mesh=grid, in_specs=spec, out_specs=spec, check_vma=False))
        x = jax.make_array_from_callback((N * shape[0], *shape[1:]), NamedSharding(grid, spec),
                                         lambda idx: np.ones((N * shape[0], *shape[1:]), np.float32)[idx])
        return f, x
    sites = {"node": site("node", (3, 37)), "both": site(("node", "local"), (3, 37))}
    t0 = time.time()
    for step in range(2):
        if step == 1 and me == nproc - 1:
            time.sleep(float(os.environ["STALL_S"]))  # stalls: never calls step 1
            emit(case="stalled", seconds=time.time() - t0)
            break
        for name, (f, x) in sites.items():
            try:
                if step == 0:
                    emit(case=f"lowered_{name}", hlo_all_reduce=f.lower(x).compile().as_text().count("all-reduce("))
                t1 = time.time()
                y = f(x)
                y.block_until_ready()
                emit(case=f"step{step}_{name}", value=float(np.asarray(y.addressable_shards[0].data)[0, 0]))
            except Exception as e:  # noqa: BLE001 - the watch's error, reported to the test
                emit(case=f"error_{name}", step=step, seconds=time.time() - t1, message=str(e))
else:
    mesh = Mesh(devs, ("i",))
    f = jax.jit(jax.shard_map(lambda x: jax_blink.psum(x, "i", impl=a.impl, topology=cluster.topology,
                                                         device_map=cluster.device_map),
                              mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    x = jax.make_array_from_callback((N, 64), NamedSharding(mesh, P("i")),
                                     lambda idx: np.ones((N, 64), np.float32)[idx])
    for step in range(2000):
        y = f(x)
        y.block_until_ready()
        if step == 0:
            emit(case="kill_step0", value=float(np.asarray(y.addressable_shards[0].data)[0, 0]))
        if step == 3 and me == nproc - 1:
            print(f"process {me}: killing myself with SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)
    emit(case="kill_survived", step=step)
    sys.exit(0)
