"""jax_blink collectives next to XLA's own, jit-compiled on 8 CPU devices, with a time limit.

The cases (tests/jax/rendezvous_cases.py) run in a subprocess per batch: a deadlock between the
jax_blink rendezvous and an XLA collective aborts the whole process inside XLA (or hangs), so
running them here would take pytest down. Each batch gets BATCH_TIMEOUT_S; the test names the case
that was running when the batch died. Values are compared with the lax-only program inside the
worker (numpy asserts).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import jax_blink.api  # noqa: F401  (registers the lowerings)
from jax_blink import lowering

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "rendezvous_cases.py"
BATCH_TIMEOUT_S = 120  # a healthy batch takes < 15 s on 2 cores; XLA aborts a stuck one after ~40 s

_spec = importlib.util.spec_from_file_location("rendezvous_cases", WORKER)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.skipif(lowering.find_lowering("ffi", "cpu") is None,
                                reason="the native CPU FFI target is not registered (ffi/ not built)")


def run_batch(batch, worker=WORKER):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_BLINK_TEST_ABSENT_DEVICE", "JAX_BLINK_TIMEOUT_S")}
    try:
        r = subprocess.run([sys.executable, str(worker), batch], capture_output=True, text=True,
                           timeout=BATCH_TIMEOUT_S, env=env, cwd=HERE.parents[1])
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = f"killed after {BATCH_TIMEOUT_S} s"
    return out, err, rc


def check_batch(batch, module=cases, worker=WORKER):
    """Runs one batch of ``module`` (a cases file: ``batch_cases``) in a subprocess; asserts every
    case passed, naming the one that hung or died."""
    expected = [name for name, _ in module.batch_cases(batch)]
    out, err, rc = run_batch(batch, worker)
    lines = out.splitlines()
    started = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("START ")]
    ok = [ln.split(" ")[1] for ln in lines if ln.startswith("OK ")]
    failed = [ln for ln in lines if ln.startswith("FAIL ")]
    stuck = [name for name in started if name not in ok and not any(f.startswith(f"FAIL {name}:") for f in failed)]
    assert rc == 0 and not failed and ok == expected, (
        f"batch {batch!r}: exit {rc}; {len(ok)}/{len(expected)} cases passed"
        + (f"; died or hung in case {stuck[0]!r}" if stuck else "")
        + ("\n" + "\n".join(failed) if failed else "")
        + "\nstderr tail:\n" + err[-3000:])


@pytest.mark.parametrize("batch", cases.BATCHES)
@pytest.mark.slow
def test_batch(batch):
    check_batch(batch)
