"""The Flax digits training across N processes on this machine, launched by one command.

    python examples/multiprocess/launch.py --processes 2 --local-devices 4 [--epochs 5] [--compare-lax]

Starts ``worker.py`` once per process with ``jax_blink.launch`` (free coordinator port on 127.0.0.1,
live output prefixed ``[pN]``, a failed process stops the rest, everything is cleaned up); each
process owns ``--local-devices`` host CPU devices, and the processes stand in for nodes joined by
NICs of ``--nic-gbps``. Options other than ``--processes``, ``--local-devices``, ``--timeout`` and
``--verbose`` (also print gloo's per-rank connection lines) go to every worker (see
``worker.py --help`` and ``examples/flax_digits/train.py --help``).
On GPU machines leave out ``--local-devices`` (each process then uses the GPUs it is given).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jax_blink.launch import launch_cli

WORKER = pathlib.Path(__file__).resolve().parent / "worker.py"


def worker_options_help() -> str:
    """The options every worker takes (worker.py's own and flax_digits/train.py's), as --help text.

    Built from the worker's and the training script's own argument definitions, so it cannot drift.
    Imports the training script (jax, flax): called only for ``--help``.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("_digits_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # puts examples/flax_digits on sys.path
    import train  # examples/flax_digits/train.py

    wp = argparse.ArgumentParser(prog="worker.py", add_help=False, usage=argparse.SUPPRESS)
    worker.add_worker_arguments(wp)
    train.add_arguments(wp)
    body = wp.format_help().split("\n", 1)[1]  # drop the "options:" title
    return "options passed through to every worker (worker.py, flax_digits/train.py):\n" + body


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=worker_options_help() if wants_help else None)
    p.add_argument("--processes", type=int, default=2, help="processes (stand-ins for nodes) to start")
    p.add_argument("--local-devices", type=int, default=4, help="host CPU devices per process (0: platform default)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before every process is killed")
    p.add_argument("--verbose", action="store_true",
                   help="also print gloo's per-rank '[Gloo] Rank ... is connected' lines")
    args, rest = p.parse_known_args(argv)
    return launch_cli([str(WORKER), *rest], args.processes, args.local_devices or None,
                      timeout_s=args.timeout, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
