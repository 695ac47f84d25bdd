"""The ``jax-blink`` command line: one module per subcommand, imported only when used.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import BlinkError

# subcommand -> (module, one-line help)
COMMANDS = {
    "topology": ("jax_blink.cli.topology_cmd",
                 "show a topology (preset, nvidia-smi topo -m file, NCCL XML, JSON, detect)"),
    "plan": ("jax_blink.cli.plan_cmd", "plan a tree packing for a collective"),
    "bench": ("jax_blink.cli.bench_cmd", "simulated (and measured) time, algbw, busbw: blink vs ring vs tree"),
    "show": ("jax_blink.cli.show_cmd", "draw the trees of a plan to a PNG"),
    "demo": ("jax_blink.cli.demo_cmd", "plan + data-parallel Flax training with jax_blink.psum"),
    "selftest": ("jax_blink.cli.selftest_cmd", "check the native CUDA executor on this machine's GPUs"),
    "calibrate": ("jax_blink.cli.calibrate_cmd",
                  "measure this machine's collectives (jax_blink's executor and XLA's) and fit the costs auto uses"),
    "explain": ("jax_blink.cli.explain_cmd", "what every jax_blink call site of SCRIPT:FUNCTION runs (nothing runs)"),
}


class _VersionAction(argparse.Action):
    """--version: :func:`version_text` on one line (argparse's own version action wraps it to the
    terminal width)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``only`` imports just that subcommand's module."""
    p = argparse.ArgumentParser(prog="jax-blink", description="Topology-aware collectives for JAX (Blink).")
    p.add_argument("--version", action=_VersionAction, nargs=0,
                   help="print the versions of jax_blink, jax, jaxlib, Python and the CPU kernels, then exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            try:
                module = importlib.import_module(mod)
            except ModuleNotFoundError as err:
                if err.name != mod:
                    raise
                continue
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return p


def version_text() -> str:
    """'jax-blink 0.1.0 (jax 0.10.2, jaxlib 0.10.2, Python 3.11.7, CPU kernels avx2)', read without
    importing jax (the last part: :func:`jax_blink.cpu_isa`, or why the native module is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__, _native

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    kernels = _native.cpu.sum_isa() if _native.cpu is not None else "not built"
    return (f"jax-blink {__version__} (jax {v('jax')}, jaxlib {v('jaxlib')}, "
            f"Python {sys.version.split()[0]}, CPU kernels {kernels})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jax-blink`` console script. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    only = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only)
    from ._args import join_negative_values, value_options
    args = parser.parse_args(join_negative_values(argv, value_options(parser)))
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except BlinkError as err:
        print(f"jax-blink {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
