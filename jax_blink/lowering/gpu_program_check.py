"""Checks the CUDA executor's device interpreter on the CPU (no GPU needed): ``python -m
jax_blink.lowering.gpu_program_check`` (what ``scripts/gpu_sim_check.sh`` runs).

The CUDA executor (``ffi/src/cuda_executor.cu``) launches one kernel per rank that interprets the
rank's part of the plan (``ffi/src/device_interp.h`` over the program of ``ffi/src/interp_plan.cc``:
tasks per thread block, flags per task with epochs, bounded waits). The same interpreter, compiled
for the host, runs here with one thread per (rank, block) and acquire/release flags
(``jax_blink._native._gpusim.interp_check``), for the plans of every preset and every topology file in
``tests/data/topologies`` (every collective of ``jax_blink.collectives``; odd sizes; dtypes rotating
over all 14):

- outputs bitwise equal to ``jax_blink.schedule.execute`` under random delays, two calls per run on
  the same flags (epochs, nothing reset), in three peer layouts (all pairs peer; none: every
  cross-rank source staged; peers within halves), and once more as a *bucket* of odd leaves (every
  leaf a separate buffer, every other leaf aliased);
- a rank that never starts: every peer gives up within the bound and names it;
- the critical path in task steps against the pipelining ideal (per tree: chunks + depth - 1), with
  one block per (tree, phase) and with the blocks per rank capped at 8 and 1;
- ThreadSanitizer over ``ffi/tests/interp_stress.cc`` (``tsan_check``): the flag protocol race-free in
  the C++ memory model.

Method: Blink (Wang et al., MLSys 2020, Sec. 4: trees' chunks pipelined); the device-side flag
protocol is the one NCCL-style kernels use (one launch, flags in peer-visible memory).
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


LAYOUTS = ("peer", "no-peer", "mixed")


def peer_table(n: int, layout: str) -> list[int]:
    """``peer_ok`` for ``n`` ranks: "peer" every pair loads the other's buffers (empty table), "no-peer"
    none (every cross-rank source staged), "mixed" peers within each half only (two PCIe sockets)."""
    if layout == "peer":
        return []
    if layout == "no-peer":
        return [0] * (n * n)
    if layout == "mixed":
        h = max(n // 2, 1)
        return [int(i // h == j // h) for i in range(n) for j in range(n)]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_schedule(schedule, dtype: str, *, layout: str = "peer", seeds: int = 4, max_blocks: int = 0,
                   leaves=None, aliased=None, absent_rank: int = -1, late_rank: int = -1, late_ms: int = 0,
                   timeout_ms: int = 2000, calls: int = 1, watch: bool = False) -> dict:
    """Runs the device interpreter's program of ``schedule`` (one group) on the host, a thread per
    (rank, block), and compares every rank's output with ``jax_blink.schedule.execute`` bit for bit.

    ``seeds`` runs with random delays (seed 0: none); ``calls`` successive calls per run on the same
    flags (epochs); ``max_blocks`` blocks per rank (0: one per (tree, phase) queue); ``leaves``:
    elements per leaf (a bucket: every leaf its own buffer per rank), ``aliased``: per leaf, result =
    operand buffer; ``absent_rank``: that rank never starts (every peer must give up within
    ``timeout_ms`` naming it); ``late_rank`` starts ``late_ms`` late; ``watch``: a host thread polls the
    error records while the blocks run (``ErrorWatch``, the CUDA executor's non-blocking error path:
    ``watch_error`` its message, ``watch_early`` whether it found it before every block ended). Returns the native dict
    (``critical_path``, ``pipeline_ideal``, ``tasks``, ``flags``, ``dep_waits``, ``blocks``,
    ``staging_elems``, ``threads``, ``mismatched_seeds``, ``mismatched_ranks``, ``error`` (the host's
    message, "" on success), ``records`` (per rank: epoch, missing rank, waiting rank, task)) plus
    ``ratio`` = critical_path / pipeline_ideal. Raises RuntimeError when the native module is missing,
    ValueError on bad leaves / options.
    """
    from jax_blink.schedule import execute
    gpusim = _gpusim()
    n, ne = schedule.nranks, schedule.nelems
    rng = np.random.default_rng(ne * 31 + n)
    xs = np.stack([random_operand(rng, ne, dtype) for _ in range(n)])
    want = execute(schedule, xs)
    leaves = [] if leaves is None else [int(x) for x in leaves]
    aliased = [] if aliased is None else [int(bool(a)) for a in aliased]
    r = dict(gpusim.interp_check(np.asarray(schedule.to_array(), np.int64), dtype, [raw_bits(x) for x in xs],
                                 [raw_bits(np.ascontiguousarray(w)) for w in want], peer_table(n, layout),
                                 max_blocks, seeds, leaves, aliased, absent_rank, late_rank, late_ms, timeout_ms,
                                 calls, watch))
    r["ratio"] = r["critical_path"] / r["pipeline_ideal"] if r["pipeline_ideal"] > 0 else 1.0
    return r


def pipeline_ratios(schedule, caps=(1, 8, 0)) -> dict:
    """Critical path / pipelining ideal of the interpreter's program per block cap (0: no cap), from
    the plan alone (no data run)."""
    gpusim = _gpusim()
    out = {}
    for cap in caps:
        r = gpusim.interp_figures(np.asarray(schedule.to_array(), np.int64), "float32", [], cap)
        out[cap] = r["critical_path"] / r["pipeline_ideal"] if r["pipeline_ideal"] > 0 else 1.0
    return out


# CUDA calls that reach the driver per call and device in steady state (ffi/src/cuda_executor.cu,
# EnqueueLocked, read from the code, not measured here): the kernel launch and the completion event
# record (the default error mode never waits: the next call reads the pinned error records; 3 with
# the wait of JAX_BLINK_CUDA_SYNC_ERRORS=1); besides them only cudaSetDevice / cudaGetLastError
# bookkeeping, the host rendezvous (pointer exchange), a cudaEventQuery per retired program and the
# reads of the pinned error records. A pointer-table upload is added when the buffers changed.
HOST_CUDA_CALLS_PER_CALL = 2


# ------------------------------------------------------------------ ThreadSanitizer run
ROOT = pathlib.Path(__file__).resolve().parents[2]
TSAN_SOURCES = [ROOT / "ffi" / "tests" / "interp_stress.cc"] + [
    ROOT / "ffi" / "src" / f for f in ("blink_core.cc", "interp_plan.cc", "interp_host.cc")]
TSAN_FLAGS = ["-std=c++17", "-g", "-O1", "-pthread", "-fno-omit-frame-pointer", "-fsanitize=thread"]


def tsan_cases():
    """(name, schedule, dtype, options) of the ThreadSanitizer run: small plans covering a reduce
    tree, a broadcast, staged pairs, a bucket with aliased leaves, block caps, and a never-arriving
    rank."""
    from jax_blink.planning import plan
    from jax_blink.schedule import build_schedule
    from jax_blink.topology.presets import PRESETS

    def sched(preset, coll, root=None, ne=203, subset=None):
        topo = PRESETS[preset]()
        if subset:
            topo = topo.subset(subset)
        p = plan(topo, coll, root=root)
        return build_schedule(p, ne - ne % len(p.devices) if coll in ("allgather", "reducescatter") else ne,
                              chunk_elems=29)
    out = [
        ("dgx1v-allreduce", sched("dgx1v", "allreduce"), "float32", dict(calls=2)),
        ("dgx1v-reduce-cap2", sched("dgx1v", "reduce", root=5), "bfloat16", dict(max_blocks=2)),
        ("dgx-a100-broadcast", sched("dgx-a100", "broadcast", root=3), "int8", {}),
        ("pcie-rs-nopeer", sched("pcie-2socket", "reducescatter"), "float16", dict(layout="no-peer")),
        ("pcie-ag-mixed", sched("pcie-2socket", "allgather"), "complex64", dict(layout="mixed")),
    ]
    s = sched("dgx1v", "allreduce", subset=[0, 1, 2, 3])
    leaves = bucket_leaves(s.nelems, sizes=(7, 30, 1, 58))
    out.append(("dgx1v4-bucket", s, "int64", dict(leaves=leaves, aliased=[i % 2 for i in range(len(leaves))])))
    out.append(("dgx1v-absent", sched("dgx1v", "allreduce"), "float32", dict(absent_rank=6, timeout_ms=2000)))
    return out


def write_tsan_cases(directory, seeds: int = 2) -> list[str]:
    """Writes ``tsan_cases()`` for ffi/tests/interp_stress.cc (one directory each); returns them."""
    from jax_blink.schedule import execute
    dirs = []
    for name, s, dtype, o in tsan_cases():
        d = pathlib.Path(directory) / name
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(7)
        xs = np.stack([random_operand(rng, s.nelems, dtype) for _ in range(s.nranks)])
        want = np.ascontiguousarray(execute(s, xs))
        leaves = o.get("leaves") or [s.nelems]
        aliased = o.get("aliased") or [0] * len(leaves)
        peer = peer_table(s.nranks, o.get("layout", "peer"))
        meta = [dtype, o.get("max_blocks", 0), o.get("absent_rank", -1), o.get("calls", 1), o.get("timeout_ms", 20000),
                seeds, len(leaves), *leaves, *aliased, len(peer), *peer]
        (d / "meta.txt").write_text(" ".join(map(str, meta)) + "\n")
        np.asarray(s.to_array(), np.int64).tofile(d / "sched.bin")
        raw_bits(np.ascontiguousarray(xs)).tofile(d / "in.bin")
        raw_bits(want).tofile(d / "want.bin")
        dirs.append(str(d))
    return dirs


def tsan_check(seeds: int = 2, relaxed: bool = False) -> dict:
    """Builds ffi/tests/interp_stress.cc with -fsanitize=thread (system g++, cached by a hash of the
    sources) and runs it on ``write_tsan_cases``; ``relaxed`` builds the mutation whose flags have no
    acquire/release ordering (JAX_BLINK_INTERP_RELAXED_FLAGS: TSan must report races).
    Returns {cases, reports (ThreadSanitizer warnings),
    failures (check failures), error ("" or why it could not run), tail (output end), note}."""
    import hashlib
    import os
    import platform
    import shutil
    import subprocess
    import tempfile
    gxx = shutil.which("g++")
    res = dict(cases=0, reports=0, failures=0, error="", tail="", note="g++ -fsanitize=thread")
    if gxx is None:
        res["error"] = "g++ not found: the ThreadSanitizer build needs the system g++"
        return res
    h = hashlib.sha256()
    for f in TSAN_SOURCES + sorted((ROOT / "ffi" / "src").glob("*.h")):
        h.update(f.name.encode() + f.read_bytes())
    flags = TSAN_FLAGS + (["-DJAX_BLINK_INTERP_RELAXED_FLAGS"] if relaxed else [])
    h.update(repr(flags).encode())
    base = pathlib.Path(tempfile.gettempdir()) / f"jax_blink_interp_tsan_{os.getuid()}" / h.hexdigest()[:16]
    base.mkdir(parents=True, exist_ok=True)
    exe = base / "interp_stress_tsan"
    if not exe.exists():
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        b = subprocess.run([gxx, *flags, "-I", str(ROOT / "ffi" / "src"), *map(str, TSAN_SOURCES), "-o", str(tmp)],
                           capture_output=True, text=True, timeout=900)
        if b.returncode != 0:
            res["error"] = "building interp_stress with -fsanitize=thread failed: " + b.stderr[-3000:]
            return res
        os.replace(tmp, exe)
    with tempfile.TemporaryDirectory() as d:
        dirs = write_tsan_cases(d, seeds=seeds)
        env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=0 second_deadlock_stack=1"}
        r = subprocess.run([str(exe), *dirs], capture_output=True, text=True, timeout=900, env=env)
        if "unexpected memory mapping" in r.stderr and shutil.which("setarch"):
            # TSan's shadow layout does not fit this kernel's ASLR: run without ASLR
            r = subprocess.run([shutil.which("setarch"), platform.machine(), "-R", str(exe), *dirs],
                               capture_output=True, text=True, timeout=900, env=env)
    res["reports"] = r.stderr.count("WARNING: ThreadSanitizer")
    res["tail"] = (r.stdout[-1500:] + r.stderr[-3000:]).strip()
    last = [line for line in r.stdout.splitlines() if line.startswith("interp_stress:")]
    if last:
        parts = last[-1].split()
        res["cases"], res["failures"] = int(parts[1]), int(parts[3])
    elif not res["error"]:
        res["error"] = f"interp_stress exited {r.returncode} without its summary"
    if r.returncode != 0 and not res["failures"] and not res["reports"] and not res["error"]:
        res["error"] = f"interp_stress exited {r.returncode}"
    return res


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


def run(seeds: int = 4, layouts=LAYOUTS, nelems: int = 1031, chunk_elems: int = 29, verbose: bool = True,
        max_ranks: int | None = None, buckets: bool = True, timeouts_every: int = 1) -> dict:
    """Checks every case in every layout (dtypes rotating), once more as a bucket of leaves
    (``bucket_leaves``, every other leaf aliased), and (every ``timeouts_every``-th case; 0: none)
    once with a rank that never arrives (every peer must fail naming it); the pipeline ratio per block
    cap (1, 8, none). Returns
    {programs, bucketed, mismatches, timeouts_checked, worst_ratio, worst_capped {cap: ratio},
    per_topology {name: {cap: worst ratio over its collectives}}, failures}."""
    total = dict(programs=0, bucketed=0, mismatches=0, timeouts_checked=0, worst_ratio=0.0,
                 worst_capped={1: 0.0, 8: 0.0, 0: 0.0}, per_topology={}, failures=[])
    k = 0
    for ci, case in enumerate(cases(nelems, chunk_elems)):
        n = case.schedule.nranks
        if max_ranks and n > max_ranks:
            continue
        runs = [(layout, None, -1) for layout in layouts]
        if buckets:
            runs.append((layouts[total["bucketed"] % len(layouts)], bucket_leaves(case.schedule.nelems), -1))
        if timeouts_every and ci % timeouts_every == 0:
            runs.append(("peer", None, k % n))
        for layout, leaves, absent in runs:
            dtype = DTYPES[k % len(DTYPES)]
            k += 1
            t0 = time.perf_counter()
            aliased = None if leaves is None else [i % 2 for i in range(len(leaves))]
            r = check_schedule(case.schedule, dtype, layout=layout, seeds=1 if absent >= 0 else seeds,
                               leaves=leaves, aliased=aliased, absent_rank=absent,
                               timeout_ms=1000 if absent >= 0 else 20000, calls=1 if absent >= 0 else 2)
            label = f"{case.name} {case.collective} n={n} {layout} {dtype}"
            total["programs"] += 1
            if absent >= 0:
                label += f" rank {absent} absent"
                total["timeouts_checked"] += 1
                named = [rec[1] for i, rec in enumerate(r["records"]) if i != absent]
                bad = not (f"rank {absent} never arrived" in r["error"] and all(m == absent for m in named))
                if bad:
                    total["failures"].append(f"{label}: expected every peer to name rank {absent}: {r['error']} "
                                             f"records {r['records']}")
            else:
                total["bucketed"] += leaves is not None
                total["mismatches"] += r["mismatched_seeds"] + (1 if r["error"] else 0)
                if layout == "peer" and leaves is None:
                    total["worst_ratio"] = max(total["worst_ratio"], r["ratio"])
                if leaves is not None:
                    label += f" {len(leaves)} leaves"
                bad = r["mismatched_seeds"] > 0 or r["error"]
                if bad:
                    total["failures"].append(f"{label}: {r['mismatched_seeds']} mismatched seeds (ranks "
                                             f"{r['mismatched_ranks']}) {r['error']}")
            if verbose:
                print(f"{label:62s} tasks {r['tasks']:5d} flags {r['flags']:5d} blocks {r['blocks']:3d} "
                      f"path {r['critical_path']:4d} ideal {r['pipeline_ideal']:4d} ratio {r['ratio']:.2f} "
                      f"mismatched {r['mismatched_seeds']}/{seeds} {'ok' if not bad else 'FAIL'} "
                      f"{time.perf_counter() - t0:.2f}s", flush=True)
        row = total["per_topology"].setdefault(case.name, {1: 0.0, 8: 0.0, 0: 0.0})
        for cap, ratio in pipeline_ratios(case.schedule).items():
            total["worst_capped"][cap] = max(total["worst_capped"][cap], ratio)
            row[cap] = max(row[cap], ratio)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="random-delay runs per program (default 8)")
    ap.add_argument("--quiet", action="store_true", help="only the summary lines")
    ap.add_argument("--no-tsan", action="store_true", help="skip the ThreadSanitizer run")
    args = ap.parse_args(argv)
    t = run(seeds=args.seeds, verbose=not args.quiet)
    races = 0
    if not args.no_tsan:
        ts = tsan_check()
        print(f"ThreadSanitizer: {ts['cases']} interpreter runs, {ts['reports']} reports, "
              f"{ts['failures']} check failures ({ts['note']})")
        races = ts["reports"]
        if ts["failures"] or ts["reports"] or ts["error"]:
            t["failures"].append(f"tsan: {ts['error']} {ts['tail']}")
    for f in t["failures"]:
        print("FAIL", f, file=sys.stderr)
    print("pipeline ratio per topology (worst over collectives; blocks per rank 1 / 8 / one per tree and phase):")
    for name, row in t["per_topology"].items():
        print(f"  {name:32s} {row[1]:6.2f} {row[8]:6.2f} {row[0]:6.2f}")
    c = t["worst_capped"]
    print(f"block caps (blocks per rank, the one launch's own choice): worst pipeline ratio {c[1]:.2f} at 1 block, "
          f"{c[8]:.2f} at 8, {c[0]:.2f} uncapped (one block per tree and phase); "
          f"{t['timeouts_checked']} never-arriving-rank runs, every peer named the rank")
    # One launch per device on XLA's stream: CUDA_DEVICE_MAX_CONNECTIONS (the stream cap) no longer
    # changes the program, so the ratio under stream caps 1, 8 and unlimited is the uncapped one.
    print(f"gpu program check: {t['programs']} programs, {races} races, {t['mismatches']} mismatches, worst pipeline "
          f"ratio {t['worst_ratio']:.2f} (caps 1, 8, unlimited), host calls per collective <= "
          f"{HOST_CUDA_CALLS_PER_CALL} per device")
    return 0 if not t["failures"] and t["worst_ratio"] <= 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
