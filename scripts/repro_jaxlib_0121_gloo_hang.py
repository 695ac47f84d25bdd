"""jaxlib 0.12.1: a cross-process collective hangs when the processes' programs differ (lax alone).

Usage: python scripts/repro_jaxlib_0121_gloo_hang.py [--same] [--devices 2] [--timeout 60]

Launches two processes (``jax_blink.launch``, gloo collectives) of ``--devices`` CPU devices each and
runs ``lax.all_gather(x, "p")`` in a ``shard_map`` over a ("p", "l") mesh, once as one program in every
process and once (``--differ``, the default) with a constant that differs by process (the programs
are then different HLO; each still all-gathers the same values). Prints what each process reached.
At jax/jaxlib 0.10.2 and 0.12.0.1 both forms finish within a second; at 0.12.1 (registry of
2026-12-06) the differing form sits in ``gloo::allgather`` until the launcher kills it, with
jax's mesh-axes replica groups and with dense ones (``jax_use_rgv3=False``) alike. jax_blink's
hierarchical lowering therefore lowers one program in every process (its local phases list every
process's groups: ``dispatch.build_request(by_process=True)``).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

WORKER = textwrap.dedent("""
    import sys, time, numpy as np
    DIFFER = sys.argv[1] == "1"
    from jax_blink import distributed
    distributed.initialize()
    import jax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("p", "l"))
    a = np.arange(jax.device_count() * 8, dtype=np.float32).reshape(jax.device_count(), 8)
    x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(("p", "l"))), lambda i: a[i])
    c = float(jax.process_index()) if DIFFER else 0.0  # a process-dependent constant: different programs
    f = jax.jit(jax.shard_map(lambda v: lax.all_gather(v + c, "p", axis=1, tiled=True) - c, mesh=mesh,
                              in_specs=P(("p", "l")), out_specs=P(("p", "l")), check_vma=False))
    print(f"process {jax.process_index()}: jax {jax.__version__}, all-gather over 'p' "
          f"({'programs differ' if DIFFER else 'one program'}) starts", flush=True)
    t = time.monotonic()
    y = f(x).block_until_ready()
    print(f"process {jax.process_index()}: done in {time.monotonic() - t:.2f} s", flush=True)
""")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before the launcher kills the run")
    ap.add_argument("--same", action="store_true", help="one program in every process (finishes at 0.12.1 too)")
    args = ap.parse_args(argv)
    import tempfile

    from jax_blink import launch
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(WORKER)
    try:
        res = launch.launch([fh.name, "0" if args.same else "1"], 2, args.devices, timeout_s=args.timeout, check=False,
                            env={**os.environ, "JAX_BLINK_TIMEOUT_S": str(int(args.timeout) + 60)})
    finally:
        os.unlink(fh.name)
    for i, p in enumerate(res.processes):
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("process ")]
        print(f"[p{i}] exit {p.returncode}: " + " | ".join(lines))
    hung = any(p.returncode != 0 for p in res.processes)
    print("HANG (killed at the timeout)" if hung else "ok")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
