"""``jax-blink explain path/to/script.py:function``: what every jax_blink call site of a program runs.

``function`` is a module-level function of the script that takes no arguments; it is traced, lowered
and compiled (nothing runs) by :func:`jax_blink.explain`, which prints one row per jax_blink call
site and the XLA collectives left over. The script is imported as a module (its ``if __name__ ==
"__main__":`` block does not run), with its directory first on ``sys.path``. On a machine without
GPUs the command first asks XLA for ``--host-devices`` host CPU devices (default 8), unless
``XLA_FLAGS`` sets a count. To explain a function with arguments, write a zero-argument function
that builds them inside (``examples/flax_digits/train.py:explain_train_step`` builds the model's
parameters and a batch of zeros and calls the train step), or call ``jax_blink.explain(f, *args)``
from Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys

from ..errors import BlinkError
from ._args import force_host_devices, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the explain options."""
    p.add_argument("target", metavar="SCRIPT:FUNCTION",
                   help="a Python file and a function in it taking no arguments, e.g. "
                        "examples/flax_digits/train.py:explain_train_step")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--no-compile", action="store_true",
                   help="lower only (no XLA compile): faster, but XLA's own collectives are not listed")
    p.add_argument("--host-devices", type=positive_int, default=8,
                   help="host CPU devices XLA provides when XLA_FLAGS sets no count (default 8)")


def load_function(target: str):
    """The function named by ``SCRIPT:FUNCTION``. Raises BlinkError for a missing ':', file or
    function, or a function that needs arguments."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise BlinkError(f"explain takes SCRIPT:FUNCTION (e.g. examples/flax_digits/train.py:explain_train_step), "
                         f"got {target!r}")
    if not os.path.isfile(path):
        raise BlinkError(f"explain: no such file {path!r}")
    mod_name = "jax_blink_explained_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise BlinkError(f"explain: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        have = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise BlinkError(f"explain: {path!r} has no function {name!r} (its functions: {', '.join(have) or 'none'})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    needed = [p.name for p in sig.parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise BlinkError(f"explain: {name}() needs arguments {needed}; give a function taking none (build the "
                         "arguments inside it), or call jax_blink.explain(fn, *args) from Python")
    return fn


def run(args: argparse.Namespace) -> int:
    """Import the script, explain the function, print the tables (or --json)."""
    force_host_devices(args.host_devices)  # before jax starts its backends
    fn = load_function(args.target)
    from ..explaining import explain
    report = explain(fn, compile=not args.no_compile)
    if args.json:
        print(report.to_json())
    else:
        from rich.console import Console
        report.print(Console(file=sys.stdout, width=200))
    return 0
