"""One process of the launcher and fault tests (tests/multiprocess/test_launchers.py, test_faults.py).

Started by ``python -m jax_blink.launch``, ``srun`` or ``mpirun``; joins the job with
``jax_blink.distributed.initialize()`` without arguments (or, with ``--jax-init``, with
``jax.distributed.initialize()`` itself first), builds ``cluster_topology()`` and prints
``RESULT {json}`` lines.

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
ap.add_argument("--jax-init", action="store_true", help="call jax.distributed.initialize() first")
ap.add_argument("--heartbeat", type=int, default=10)
a = ap.parse_args()
T0 = time.monotonic()

if a.jax_init:
    import jax

    jax.distributed.initialize(heartbeat_timeout_seconds=a.heartbeat)

from jax_blink import distributed  # noqa: E402

joined = distributed.initialize(heartbeat_timeout_s=a.heartbeat)

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
    print("RESULT " + json.dumps(kw), flush=True)


emit(case="joined", source=joined.source, process=me, processes=nproc, topology=cluster.topology.name,
     hosts=list(cluster.hosts), local_devices=len(jax.local_devices()))


def sharded(host):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("i")), lambda idx: host[idx])


def both(fn_blink, fn_lax, host):
    """(jax_blink's, lax's) results gathered to every process as NumPy arrays."""
    from jax.experimental import multihost_utils

    outs = []
    for fn in (fn_blink, fn_lax):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
        outs.append(np.asarray(multihost_utils.process_allgather(f(sharded(host)), tiled=True)))
    return outs


kw = dict(topology=cluster.topology, device_map=cluster.device_map)
if a.mode == "collectives":
    rng = np.random.default_rng(7)  # the same on every process: one consistent global input
    cases = {
        "psum_i32": (lambda x: jax_blink.psum(x, "i", **kw), lambda x: jax.lax.psum(x, "i"),
                     rng.integers(-1000, 1000, (N * 3, 37)).astype(np.int32)),
        "psum_f32_integers": (lambda x: jax_blink.psum(x, "i", **kw), lambda x: jax.lax.psum(x, "i"),
                              rng.integers(-1000, 1000, (N * 2, 29)).astype(np.float32)),
        "all_gather_f32": (lambda x: jax_blink.all_gather(x, "i", tiled=True, **kw),
                           lambda x: jax.lax.all_gather(x, "i", tiled=True),
                           rng.standard_normal((N * 2, 13)).astype(np.float32)),
        "psum_scatter_i32": (lambda x: jax_blink.psum_scatter(x, "i", tiled=True, **kw),
                             lambda x: jax.lax.psum_scatter(x, "i", tiled=True),
                             rng.integers(-1000, 1000, (N * N, 11)).astype(np.int32)),
    }
    for name, (fb, fl, host) in cases.items():
        yb, yl = both(fb, fl, host)
        emit(case=name, shape=list(yb.shape), bitwise_equal=bool(yb.dtype == yl.dtype and yb.shape == yl.shape
                                                                   and yb.tobytes() == yl.tobytes()))
    host = rng.standard_normal((N * 3, 41)).astype(np.float32)
    yb, yl = both(lambda x: jax_blink.psum(x, "i", **kw), lambda x: jax.lax.psum(x, "i"), host)
    emit(case="psum_f32_random", max_abs_vs_lax=float(np.max(np.abs(yb.astype(np.float64) - yl))))
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
