"""One process of the launcher and fault tests (tests/multiprocess/test_launchers.py, test_faults.py).

Started by ``python -m jax_blink.launch``, ``srun`` or ``mpirun``; joins the job with
``jax_blink.distributed.initialize()`` without arguments (or, with ``--jax-init``, with
``jax.distributed.initialize()`` alone, as a program that knows nothing of jax_blink's entry point),
builds ``cluster_topology()`` and prints ``RESULT {json}`` lines.

Modes:
  collectives: jax_blink.psum / all_gather / psum_scatter over every device of every process
      against lax's on the same mesh and input (int32 and integer-valued float32: exact, so equal bit
      for bit; random float32 psum: max error), then (``--kill``) the last process SIGKILLs itself
      inside a loop of psums.
  fault: ``--how raise|exit|kill|stall`` ``--when before|during``: the last process fails (raises
      RuntimeError, sys.exit(3), SIGKILLs itself, sleeps STALL_S seconds) before its first psum or at
      step 3 of a loop of psums, while the others run the loop.
"""

import argparse
import json
import os
import signal
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["collectives", "fault"])
ap.add_argument("--how", choices=["raise", "exit", "kill", "stall"], default="raise")
ap.add_argument("--when", choices=["before", "during"], default="before")
ap.add_argument("--kill", action="store_true", help="collectives: then the last process SIGKILLs itself")
ap.add_argument("--jax-init", action="store_true",
                help="join with jax.distributed.initialize() (jax_blink.launch's address), not jax_blink's")
ap.add_argument("--heartbeat", type=int, default=10)
ap.add_argument("--hosts", type=int, default=0,
                help="stand-in hosts: JAX_BLINK_HOST=host<k>, the processes split evenly in process order")
ap.add_argument("--claim-gpus", action="store_true",
                help="CUDA_VISIBLE_DEVICES: each process of a host claims the next local-device-count GPUs, as "
                     "SLURM's --gpus-per-task does")
a = ap.parse_args()
T0 = time.monotonic()
if a.hosts or a.claim_gpus:  # before cluster_topology reads them (jax_blink.launch's variables)
    rank, n = int(os.environ["JAX_BLINK_PROCESS_ID"]), int(os.environ["JAX_BLINK_NUM_PROCESSES"])
    per_host = n // max(1, a.hosts)
    if a.hosts:
        os.environ["JAX_BLINK_HOST"] = f"host{rank // per_host}"
    if a.claim_gpus:
        g = int(os.environ["JAX_BLINK_LOCAL_DEVICES"])
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str((rank % per_host) * g + i) for i in range(g))

from jax_blink import distributed  # noqa: E402

if a.jax_init:  # the program joins the job itself; jax_blink is used only afterwards
    import jax

    env = os.environ
    jax.distributed.initialize(env["JAX_BLINK_COORDINATOR"], int(env["JAX_BLINK_NUM_PROCESSES"]),
                               int(env["JAX_BLINK_PROCESS_ID"]), heartbeat_timeout_seconds=a.heartbeat)
    source = "the program's jax.distributed.initialize()"
else:
    source = distributed.initialize(heartbeat_timeout_s=a.heartbeat).source

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402

me, nproc = jax.process_index(), jax.process_count()
cluster = distributed.cluster_topology()
devs = np.array(jax.devices())
N = devs.size
mesh = Mesh(devs, ("i",))


def emit(**kw):
    # one write per line: print's separate write of "\n" lets the launcher interleave two ranks' lines
    sys.stdout.write("RESULT " + json.dumps(kw) + "\n")
    sys.stdout.flush()


emit(case="joined", source=source, process=me, processes=nproc, topology=cluster.topology.name,
     hosts=list(cluster.hosts), local_devices=len(jax.local_devices()), node=cluster.node.name,
     node_fingerprint=cluster.node.fingerprint(), topology_gpus=list(cluster.topology.gpus),
     node_of_process=list(cluster.node_of_process), device_map=sorted(cluster.device_map.items()),
     gpus_of_process={str(p): sorted(cluster.device_map[d.id] for d in devs if d.process_index == p)
                      for p in range(nproc)})


def sharded(host):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("i")), lambda idx: host[idx])


kw = dict(topology=cluster.topology, device_map=cluster.device_map)
if a.mode == "collectives":
    from jax.experimental import multihost_utils

    rng = np.random.default_rng(7)  # the same on every process: one consistent global input
    inputs = {"psum_i32": rng.integers(-1000, 1000, (N * 3, 37)).astype(np.int32),
              "psum_f32_integers": rng.integers(-1000, 1000, (N * 2, 29)).astype(np.float32),
              "all_gather_f32": rng.standard_normal((N * 2, 13)).astype(np.float32),
              "psum_scatter_i32": rng.integers(-1000, 1000, (N * N, 11)).astype(np.int32),
              "psum_f32_random": rng.standard_normal((N * 3, 41)).astype(np.float32)}

    def program(m):
        extra = kw if m is jax_blink else {}

        def fn(xi, xf, xg, xs, xr):
            return (m.psum(xi, "i", **extra), m.psum(xf, "i", **extra), m.all_gather(xg, "i", tiled=True, **extra),
                    m.psum_scatter(xs, "i", tiled=True, **extra), m.psum(xr, "i", **extra))
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("i"),) * 5, out_specs=(P("i"),) * 5, check_vma=False))
        outs = f(*[sharded(h) for h in inputs.values()])
        return [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in outs]

    yb, yl = program(jax_blink), program(jax.lax)
    for (name, _), b, lx in zip(inputs.items(), yb, yl):
        if name == "psum_f32_random":  # summation orders differ: within rounding
            emit(case=name, max_abs_vs_lax=float(np.max(np.abs(b.astype(np.float64) - lx))))
        else:
            emit(case=name, shape=list(b.shape), bitwise_equal=bool(b.dtype == lx.dtype and b.shape == lx.shape
                                                                    and b.tobytes() == lx.tobytes()))
    emit(case="done", seconds=time.monotonic() - T0)
    if not a.kill:
        sys.exit(0)

f = jax.jit(jax.shard_map(lambda x: jax_blink.psum(x, "i", **kw), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                          check_vma=False))
x = sharded(np.ones((N, 64), np.float32))
faulty = me == nproc - 1
how = "kill" if a.mode == "collectives" else a.how
when = "during" if a.mode == "collectives" else a.when


def fail():
    print(f"process {me}: injecting fault {how!r} {when} the collectives at {time.monotonic() - T0:.1f} s",
          flush=True)
    if how == "raise":
        raise RuntimeError(f"injected fault in process {me}")
    if how == "exit":
        sys.exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("STALL_S", "60")))


if faulty and when == "before":
    fail()
for step in range(200):
    if faulty and when == "during" and step == 3:
        fail()
    y = f(x)
    y.block_until_ready()
    if step == 0:
        emit(case="step0", value=float(np.asarray(y.addressable_shards[0].data)[0, 0]),
             seconds=time.monotonic() - T0)
    time.sleep(0.02)
emit(case="survived", step=step)
