"""Never slower than XLA, by the model: ``impl="auto"``'s predicted time on a GPU machine against
NCCL's modelled choice and every jax_blink candidate plan, for every preset and topology file.

Per topology (every preset of ``jax_blink.topology.presets.PRESETS``, every file of
``tests/data/topologies`` and of ``--dir`` folders; the same graph once), collective (all five) and
size (bytes per GPU in jax_blink's convention, 4 KiB .. 1 GiB):

- ``nccl``: XLA's collective on that machine, NCCL's tuner model (:func:`jax_blink.nccl_model.predict`,
  back-to-back time; broadcast as the all-gather the "xla" lowering emits, reduce as an all-reduce);
- ``plans``: the least time over ``costmodel.candidate_plans`` of each plan's schedule as the CUDA
  executor runs it (whole-element chunks with the counts the link simulator chose, peer-to-peer sends,
  each tree's chunks free-running: ``costmodel.lowering_schedule`` given that one plan);
- ``ideal``: the least simulated time of the candidate plans themselves (exact shares, no chunking
  limits): not a time any executor reaches, printed to show what the chunking costs;
- ``blink``: what jax_blink's CUDA lowering runs (``costmodel.lowering_schedule`` with the CUDA
  record's settings over all candidates: the fastest schedule it searched);
- ``auto``: what ``impl="auto"`` runs: the "xla" lowering where :func:`jax_blink.lowering.xla.decide`
  says so (XLA strictly faster), else ``blink``.

The check: ``auto <= nccl`` and ``auto <= plans x (1 + SEARCH_TOLERANCE)`` (auto never runs a schedule
slower than one of the candidates it could have run; fails where the lowering's search, over the plans
within ``costmodel.SCHEDULE_SEARCH_MARGIN`` of the fastest, misses a faster candidate by more than
whole-element chunks break ties: 0.07% on dgx1v_v100.txt's reduce-scatter at 4 MiB, a 272-ring plan
ranked 37% behind whose schedule ties the 112-ring one's). No
calibration is read (``JAX_BLINK_CALIBRATION=0``): the model alone.

Run: ``python benchmarks/never_slower.py`` (table; ``--json``; ``--sizes 4K..1G``; ``--topology NAME``
to restrict). Several minutes on two cores for everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

os.environ["JAX_BLINK_CALIBRATION"] = "0"

from jax_blink import costmodel, nccl_model  # noqa: E402
from jax_blink.lowering import xla as xla_lowering  # noqa: E402
from jax_blink.lowering.ffi import CUDA_STEP_LATENCY_S  # noqa: E402
from jax_blink.topology import Topology  # noqa: E402
from jax_blink.topology.presets import PRESETS  # noqa: E402

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce")
SEARCH_TOLERANCE = 0.01
SIZES = tuple(4096 << (2 * k) for k in range(10))  # 4 KiB, 16 KiB, ..., 1 GiB
DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "topologies"


def topologies(dirs=()) -> list[tuple[str, Topology]]:
    """(name, Topology) of every preset and topology file (``.txt`` / ``.xml`` / ``.json``) in ``DATA`` and
    ``dirs``, each graph once (by fingerprint), host CPU topologies left out (no NCCL)."""
    out, seen = [], set()
    cands = [(n, lambda n=n: Topology.preset(n)) for n in PRESETS]
    for d in (DATA, *map(pathlib.Path, dirs)):
        if d.is_dir():
            cands += [(f.name, lambda f=f: Topology.load(str(f))) for f in sorted(d.iterdir())
                      if f.suffix in (".txt", ".xml", ".json")]
    for name, make in cands:
        t = make()
        fp = t.fingerprint()
        if fp in seen or nccl_model.system(t) is None:
            continue
        seen.add(fp)
        out.append((name, t))
    return out


def row(topo: Topology, collective: str, nbytes: int) -> dict:
    """The four times (seconds) of one cell and whether auto holds (module docstring)."""
    devices = list(topo.gpus)
    root = devices[0] if collective in ("broadcast", "reduce") else None
    plans = costmodel.candidate_plans(topo, collective, devices=devices, root=root)
    lat_us = CUDA_STEP_LATENCY_S * 1e6
    plan_times = [costmodel.simulated_time(p, nbytes, topo, lat_us, peer_routes=True) for p in plans if not p.relays]
    nelems = max(1, nbytes // 4)

    def as_run(cands):
        return costmodel.lowering_schedule(cands, nelems, itemsize=4, step_latency_s=CUDA_STEP_LATENCY_S,
                                           round_synchronous=False, topology=topo, chunks_as_simulated=True,
                                           peer_routes=True)[2]
    blink = as_run(plans)
    sched_times = [as_run([p]) for p in plans if not p.relays]
    nccl, src = xla_lowering.xla_time_s("cuda", collective, nbytes, len(devices), topo, devices)
    use, why = xla_lowering.decide("cuda", collective, nbytes, len(devices), "ffi", blink, topo, devices)
    auto = nccl if use else blink
    best_sched = min(sched_times)
    ok = auto <= nccl * (1 + 1e-12) and auto <= best_sched * (1 + SEARCH_TOLERANCE)
    return {"collective": collective, "size": nbytes, "nccl_s": nccl, "nccl": src, "plans_s": best_sched,
            "ideal_s": min(plan_times), "blink_s": blink, "auto_s": auto, "auto": "xla" if use else "ffi", "ok": ok}


def main(argv=None) -> int:
    from jax_blink.cli.bench_cmd import parse_sizes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None, help="bytes per GPU, e.g. 4K..1G (default: 4 KiB .. 1 GiB by 4x)")
    ap.add_argument("--topology", action="append", default=None, help="only these topologies (names as printed)")
    ap.add_argument("--dir", action="append", default=[], help="another folder of topology files")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes) if args.sizes else SIZES
    t0 = time.perf_counter()
    rows = []
    for name, topo in topologies(args.dir):
        if args.topology and name not in args.topology:
            continue
        for c in COLLECTIVES:
            for s in sizes:
                r = row(topo, c, s)
                r["topology"] = name
                rows.append(r)
                if not args.json:
                    print(f"{name:28} {c:13} {s:>11} auto {r['auto']:3} {r['auto_s'] * 1e6:10.1f} us  "
                          f"nccl {r['nccl_s'] * 1e6:10.1f} us ({r['nccl'].split(': ')[-1]:12})  "
                          f"plans {r['plans_s'] * 1e6:10.1f} us  ideal {r['ideal_s'] * 1e6:10.1f} us  "
                          f"{'ok' if r['ok'] else 'SLOWER'}", flush=True)
    bad = [r for r in rows if not r["ok"]]
    if args.json:
        def finite(v):
            return None if isinstance(v, float) and not math.isfinite(v) else v
        clean = [{k: finite(v) for k, v in r.items()} for r in rows]
        print(json.dumps(clean, indent=1))
    else:
        xla = sum(r["auto"] == "xla" for r in rows)
        ffi = [r["auto_s"] / r["ideal_s"] for r in rows if r["auto"] == "ffi"]
        over = sum(x > 1.05 for x in ffi)
        print(f"\n{len(rows)} cells, {len({r['topology'] for r in rows})} topologies: auto hands {xla} to XLA; "
              f"{len(bad)} where auto is predicted slower than NCCL or than a candidate plan's schedule "
              f"(x {1 + SEARCH_TOLERANCE:g}); "
              f"jax_blink's cells run at most {max(ffi, default=1):.3f}x the ideal plan time ({over} above 1.05x); "
              f"{time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
