"""Runs a benchmark script in several fresh processes and prints the median of each of its ratios.

One process's ratio (jax_blink / lax, both timed interleaved in that process) moves by more than the
targets' margins from one process to the next on a shared 2-core machine: where the C allocator puts
the buffers, whether a call's output is fresh pages, and what else runs decide it for the whole process
(the identical call timed twice in one process has read 0.82-1.15). So ``--processes N`` runs the
script N times, one after another, each in a new interpreter with the same arguments, collects every
ratio it measured and judges each target on the median over the processes, showing each process's
value beside it.

Used by ``collectives.py`` and ``train_step.py``: they call :func:`add_arguments`, report each ratio
through :func:`record`, and hand over to :func:`run_processes` when ``--processes`` > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from jax_blink.cli._args import positive_int  # the CLI's own "integer >= 1" argparse type

_RECORDS: list[dict] = []


def add_arguments(ap, default: int) -> None:
    """Adds ``--processes N`` (default ``default``) and the internal ``--records FILE``."""
    ap.add_argument("--processes", type=positive_int, default=default,
                    help=f"fresh processes to run, one after another; targets are judged on the median of "
                         f"their ratios (default {default}; 1: this process only, its own tables)")
    ap.add_argument("--records", default=None, help=argparse.SUPPRESS)


def record(table: str, row: str, ratio: float, target: float | None) -> None:
    """Notes one measured ratio (lower is faster) of ``table``'s ``row`` and its target (``None``:
    shown without a verdict)."""
    _RECORDS.append({"table": table, "row": row, "ratio": float(ratio), "target": target})


def save(args) -> None:
    """Writes the ratios recorded so far to ``--records`` (a child's output), if given."""
    if args.records:
        with open(args.records, "w") as f:
            json.dump(_RECORDS, f)


def run_processes(script: str, argv: list[str], processes: int) -> int:
    """Runs ``python script *argv --processes 1 --records FILE`` ``processes`` times in turn and
    prints, per recorded ratio, every process's value, their median, min and max, and the verdict on
    the median. Returns 1 when a child failed, else 0 (a missed target is reported, not an error)."""
    argv = _without_processes(argv)
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            path = os.path.join(tmp, f"run{i}.json")
            print(f"process {i + 1} of {processes} ...", flush=True)
            done = subprocess.run([sys.executable, script, *argv, "--processes", "1", "--records", path],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
                print(f"process {i + 1} failed (exit status {done.returncode})", file=sys.stderr)
                return 1
            if i == 0:  # one process's own tables: absolute times beside the ratios
                print(done.stdout)
            with open(path) as f:
                runs.append(json.load(f))
    _summary(runs)
    return 0


def _without_processes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            out.append(a)
    return out


def _summary(runs: list[list[dict]]) -> None:
    keys: list[tuple[str, str]] = []
    values: dict[tuple[str, str], list[float]] = {}
    targets: dict[tuple[str, str], float | None] = {}
    for run in runs:
        for r in run:
            k = (r["table"], r["row"])
            if k not in values:
                keys.append(k)
                values[k] = []
                targets[k] = r["target"]
            values[k].append(r["ratio"])
    print(f"\nratios over {len(runs)} processes (each: jax_blink / reference, interleaved in that process); "
          "verdict on the median")
    header = ["table", "row", "median", "min", "max", "per process", "target", ""]
    rows = []
    missed = 0
    for k in keys:
        v = np.asarray(values[k])
        med = float(np.median(v))
        t = targets[k]
        verdict = "" if t is None else ("ok" if med <= t else "MISSED")
        missed += verdict == "MISSED"
        rows.append([k[0], k[1], f"{med:.2f}", f"{v.min():.2f}", f"{v.max():.2f}",
                     " ".join(f"{x:.2f}" for x in v), "-" if t is None else f"<= {t:g}", verdict])
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"targets missed (median): {missed} of {sum(t is not None for t in targets.values())}")
