"""Checks the CUDA executor's GPU programs on the CPU (no GPU needed): ``python -m
jax_blink.lowering.gpu_program_check`` (what ``scripts/gpu_sim_check.sh`` runs).

The CUDA executor (``ffi/src/cuda_executor.cu``) only issues a *GPU program* built by plain C++
(``ffi/src/gpu_program.cc``): streams, copies, fused reduces, zeroing, event records and waits. This
module drives, through ``jax_blink._native._gpusim.gpu_program_check``, for the plans of every preset and
every topology file in ``tests/data/topologies`` (every collective of ``jax_blink.collectives``:
all-reduce, broadcast, reduce, all-gather, reduce-scatter; odd sizes; every dtype across the set):

- the happens-before race checker over byte ranges (XLA's own stream per rank included: inputs are
  written before the call, outputs are read and both buffers reused after it);
- a CPU emulator of CUDA streams and events with random op durations over several seeds, whose
  captured outputs must equal ``jax_blink.schedule.execute`` bit for bit;
- the critical path in chunk steps (unit cost per copy/reduce/zero) against the pipelining ideal
  ``chunks + depth - 1`` (depth: one chunk's longest dependency chain).

Three layouts per plan: one GPU per rank with peer access (the ratio is measured here), every rank
on one GPU with at most 8 streams per device (how ``ffi/tests/gpu_check.cu`` runs on one GPU), and
no peer access at all (reduce sources staged through the copy engine), 8 streams per device. Then
each plan once more as a *bucket* (what one custom call of a pytree gets): the elements cut into
leaves of odd sizes (``bucket_leaves``: chunks span leaves), every leaf a separate buffer, every
other leaf aliased (result = operand), layouts and dtypes rotating.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

from .. import collectives as _collectives

DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8",
          "uint16", "uint32", "uint64", "complex64", "complex128")
COLLECTIVES = tuple(_collectives.COLLECTIVES)
LAYOUTS = ("peer", "one-gpu", "no-peer")
TOPOLOGY_DIR = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "topologies"


def random_operand(rng, n, dtype):
    """``n`` random elements of ``dtype`` (a numpy dtype name, "bfloat16" included): integers over
    their whole range, floats and complex numbers standard normal. Shared with ``jax-blink selftest``."""
    import ml_dtypes  # noqa: F401  (bfloat16 as a numpy dtype)
    dt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(ml_dtypes.bfloat16)
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
    if np.issubdtype(dt, np.complexfloating):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    return rng.standard_normal(n).astype(dt)


def raw_bits(a):
    """``a`` as something the native modules take: bfloat16 viewed as uint16 (same bits)."""
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _gpusim():
    """``jax_blink._native._gpusim`` (built with the CPU module); RuntimeError when missing."""
    try:
        from jax_blink._native import _gpusim
    except ImportError as e:
        raise RuntimeError(f"jax_blink native module '_gpusim' is not available ({e}); reinstall with "
                           "`pip install -e .`") from e
    return _gpusim


def bucket_leaves(nelems: int, sizes=(7, 30, 1, 58, 113, 3)) -> list[int]:
    """Leaf sizes (elements) of a test bucket of ``nelems`` elements: ``sizes`` repeated, the last
    leaf the remainder (every leaf >= 1; with 29-element chunks, chunks span leaves)."""
    out, k = [], 0
    while sum(out) < nelems:
        out.append(min(sizes[k % len(sizes)], nelems - sum(out)))
        k += 1
    return out


def check_schedule(schedule, dtype: str, *, layout: str = "peer", seeds: int = 8, mutate=("", 0),
                   max_streams: int | None = None, leaves=None, aliased=None) -> dict:
    """Builds, race-checks and emulates the GPU program of ``schedule`` (one group).

    ``leaves``: elements per leaf (a bucket: every leaf a separate buffer per rank; default one leaf
    of ``schedule.nelems``); ``aliased``: per leaf, the result is the operand's buffer (default none).
    Returns the native result dict (``races``, ``race_info``, ``critical_path``, ``chunk_depth``,
    ``segment_chunks``, ``memory_ops``, ``continued_pieces``, ``records``, ``waits``, ``streams``,
    ``leaves``, ``mismatched_seeds``, ``emulator_error``) plus ``ratio`` = critical_path /
    (segment_chunks + chunk_depth - 1). Raises RuntimeError when the native module is missing,
    ValueError on bad leaves (sizes not positive or not summing to ``schedule.nelems``).
    """
    from jax_blink.schedule import execute
    gpusim = _gpusim()
    n, ne = schedule.nranks, schedule.nelems
    rng = np.random.default_rng(ne * 31 + n)
    xs = np.stack([random_operand(rng, ne, dtype) for _ in range(n)])
    want = execute(schedule, xs)
    if layout == "peer":
        devices, peer, cap = list(range(n)), [], 0
    elif layout == "one-gpu":
        devices, peer, cap = [0] * n, [], 8
    elif layout == "no-peer":
        devices, peer, cap = list(range(n)), [0] * (n * n), 8
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if max_streams is not None:
        cap = max_streams
    leaves = [] if leaves is None else [int(x) for x in leaves]
    aliased = [] if aliased is None else [int(bool(a)) for a in aliased]
    r = gpusim.gpu_program_check(np.asarray(schedule.to_array(), np.int64), dtype,
                                 [raw_bits(x) for x in xs], [raw_bits(np.ascontiguousarray(w)) for w in want],
                                 devices, peer, cap, seeds, tuple(mutate), leaves, aliased)
    ideal = r["segment_chunks"] + r["chunk_depth"] - 1
    r["ratio"] = r["critical_path"] / ideal if ideal > 0 else 1.0
    return dict(r)


@dataclasses.dataclass
class Case:
    name: str          # topology source
    collective: str
    root: int | None   # topology GPU id
    schedule: object


def topologies():
    """(name, Topology) for every preset and every shared topology file."""
    from jax_blink.topology.load import load_topology
    from jax_blink.topology.presets import PRESETS
    out = [(name, PRESETS[name]()) for name in PRESETS]
    for f in sorted(TOPOLOGY_DIR.glob("*.txt")):
        out.append((f.name, load_topology(str(f))))
    return out


def cases(nelems: int = 1031, chunk_elems: int = 29):
    """Every (topology, collective) schedule; broadcast/reduce rooted at the last GPU; sharded
    collectives (all-gather, reduce-scatter) on ``nelems`` rounded down to a multiple of the GPUs."""
    from jax_blink import collectives
    from jax_blink.planning import plan
    from jax_blink.schedule import build_schedule
    for name, topo in topologies():
        gpus = sorted(topo.gpus)
        for coll in COLLECTIVES:
            row = collectives.get(coll)
            root = gpus[-1] if row.rooted else None
            p = plan(topo, coll, root=root)
            ne = nelems - nelems % len(gpus) if row.sharded else nelems
            yield Case(name, coll, root, build_schedule(p, ne, chunk_elems=chunk_elems))


def run(seeds: int = 8, layouts=LAYOUTS, nelems: int = 1031, chunk_elems: int = 29, verbose: bool = True,
        max_ranks: int | None = None, buckets: bool = True) -> dict:
    """Checks every case in every layout, and (``buckets``) once more as a bucket of leaves
    (``bucket_leaves``, every other leaf aliased; layout and dtype rotating); returns {programs,
    bucketed, races, mismatches, worst_ratio, failures}."""
    total = dict(programs=0, bucketed=0, races=0, mismatches=0, worst_ratio=0.0, failures=[])
    k = 0
    for case in cases(nelems, chunk_elems):
        if max_ranks and case.schedule.nranks > max_ranks:
            continue
        runs = [(layout, None) for layout in layouts]
        if buckets:
            runs.append((layouts[total["bucketed"] % len(layouts)], bucket_leaves(case.schedule.nelems)))
        for layout, leaves in runs:
            dtype = DTYPES[k % len(DTYPES)]
            k += 1
            t0 = time.perf_counter()
            aliased = None if leaves is None else [i % 2 for i in range(len(leaves))]
            r = check_schedule(case.schedule, dtype, layout=layout, seeds=seeds, leaves=leaves, aliased=aliased)
            bad = r["races"] > 0 or r["mismatched_seeds"] > 0 or r["emulator_error"]
            total["programs"] += 1
            total["bucketed"] += leaves is not None
            total["races"] += r["races"]
            total["mismatches"] += r["mismatched_seeds"] + (1 if r["emulator_error"] else 0)
            if layout == "peer":
                total["worst_ratio"] = max(total["worst_ratio"], r["ratio"])
            label = f"{case.name} {case.collective} n={case.schedule.nranks} {layout} {dtype}"
            if leaves is not None:
                label += f" {len(leaves)} leaves"
            if bad:
                total["failures"].append(f"{label}: {r['races']} races {r['race_info']} "
                                         f"{r['mismatched_seeds']} mismatched seeds {r['emulator_error']}")
            if verbose:
                print(f"{label:60s} ops {r['memory_ops']:5d} waits {r['waits']:5d} streams {r['streams']:4d} "
                      f"path {r['critical_path']:4d} ideal {r['segment_chunks'] + r['chunk_depth'] - 1:4d} "
                      f"ratio {r['ratio']:.2f} races {r['races']} mismatched {r['mismatched_seeds']}/{seeds} "
                      f"{time.perf_counter() - t0:.2f}s", flush=True)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=16, help="random timings per program (default 16)")
    ap.add_argument("--quiet", action="store_true", help="only the summary line")
    args = ap.parse_args(argv)
    t = run(seeds=args.seeds, verbose=not args.quiet)
    for f in t["failures"]:
        print("FAIL", f, file=sys.stderr)
    print(f"gpu program check: {t['programs']} programs ({t['bucketed']} bucketed, multi-leaf), {t['races']} races, "
          f"{t['mismatches']} mismatches, worst pipeline ratio {t['worst_ratio']:.2f}")
    return 0 if not t["failures"] and t["worst_ratio"] <= 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
