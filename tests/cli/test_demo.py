"""`jax-blink demo` as a user runs it: a fresh process, no XLA_FLAGS, short training."""

import os
import re
import subprocess
import sys

import pytest


def _demo(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the demo must set it itself
    return subprocess.run([sys.executable, "-m", "jax_blink", "demo", "--no-progress", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_demo_runs_and_prints_plan_training_and_summary():
    p = _demo("--epochs", "3", "--mode", "pmap", "--min-accuracy", "0.9")
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "devices: no GPU detected: topology 'dgx1v' (8 GPUs) mapped onto 8 host CPU devices" in out
    m = re.search(r"plan: (\d+) trees, rate ([\d.]+) GB/s, bound ([\d.]+) GB/s", out)
    assert m, out
    trees, rate, bound = int(m[1]), float(m[2]), float(m[3])
    assert trees >= 1 and 0 < rate <= bound + 1e-6
    assert "ring rate" in out
    assert re.search(r"\[jax_blink pmap\] held-out accuracy 0\.9\d+", out), out
    assert re.search(r"\[lax pmap\] held-out accuracy", out), out
    m = re.search(r"largest per-step loss difference vs lax.psum: \S+ abs, (\S+) rel", out)
    assert m and float(m[1]) <= 1e-5, out
    assert "lowering: ffi (native XLA FFI custom call) on cpu" in out or "lowering: ppermute" in out
    m = re.search(r"summary: held-out accuracy ([\d.]+) .* train step ([\d.]+) ms with jax_blink vs ([\d.]+) ms "
                  r"with lax \(ratio ([\d.]+)\)", out)
    assert m and float(m[1]) >= 0.9 and float(m[2]) > 0 and float(m[3]) > 0, out
    assert abs(float(m[4]) - float(m[2]) / float(m[3])) < 0.02, out


@pytest.mark.slow
def test_demo_bad_batch_size_is_a_clear_error():
    p = _demo("--epochs", "1", "--batch-size", "60")
    assert p.returncode == 2
    assert "--batch-size 60 does not split over 8 devices: use a multiple of 8" in p.stderr
    assert "Traceback" not in p.stderr
    p = _demo("--epochs", "1", "--batch-size", "1600")
    assert p.returncode == 2
    assert "larger than the training split (1437 images)" in p.stderr and "Traceback" not in p.stderr


def test_demo_plan_lines_list_the_trees_only_when_verbose():
    from jax_blink import Topology
    from jax_blink.cli.demo_cmd import _plan_lines

    topo = Topology.preset("dgx1v")
    short = _plan_lines(topo, 8)
    assert len(short) == 1 and short[0].startswith("plan: 24 trees, rate 85.37 GB/s"), short
    long = _plan_lines(topo, 8, verbose=True)
    assert long[1:] == short
    assert sum(ln.startswith("  tree ") for ln in long[0].splitlines()) == 24
    sharded = _plan_lines(topo, 8, "allgather")
    assert len(sharded) == 1 and sharded[0].startswith("plan (allgather): "), sharded


@pytest.mark.slow
def test_demo_fsdp_in_a_fresh_process():
    """`jax-blink demo --fsdp` as a user runs it: plan of the all-gather, FSDP training, lockstep
    (4 epochs, as tests/examples/test_example_fsdp.py trains in process)."""
    p = _demo("--fsdp", "--epochs", "4", timeout=600)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    m = re.search(r"plan \(allgather\): (\d+) trees, rate ([\d.]+) GB/s, bound ([\d.]+) GB/s", out)
    assert m and int(m[1]) >= 8 and abs(float(m[2]) - float(m[3])) <= 1e-6 * float(m[3]), out
    assert re.search(r"\[jax_blink fsdp\] held-out accuracy 0\.9[5-9]", out), out
    m = re.search(r"largest loss difference (\S+) rel \(within", out)
    assert m and float(m[1]) <= 1e-5, out
