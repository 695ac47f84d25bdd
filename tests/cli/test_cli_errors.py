"""Every `jax-blink` option refuses bad input at once: exit status 2 and one line saying what was wrong."""

import re
import time

import pytest

from jax_blink.cli import main
from jax_blink.cli._args import join_negative_values


def fails(capsys, argv, match):
    """Run the CLI; it must exit 2 (argparse's SystemExit or our return) with ``match`` in stderr and
    no traceback."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(match, err), err
    return err


@pytest.mark.parametrize("argv,match", [
    # demo: training options (checked before JAX starts or data loads)
    (["demo", "--lr", "nan"], r"argument --lr: must be a number in \(0, inf\], got 'nan'"),
    (["demo", "--lr", "-1e-3"], r"argument --lr: must be a number in \(0, inf\]"),
    (["demo", "--lr", "inf"], r"argument --lr: .* got 'inf'"),
    (["demo", "--epochs", "0"], r"argument --epochs: must be an integer in \[1, inf\], got '0'"),
    (["demo", "--epochs", "2.5"], r"argument --epochs: must be an integer"),
    (["demo", "--batch-size", "-8"], r"argument --batch-size: must be an integer in \[1, inf\], got '-8'"),
    (["demo", "--seed", "-3"], r"argument --seed: must be an integer in \[0, inf\]"),
    (["demo", "--min-accuracy", "2"], r"argument --min-accuracy: must be a number in \[0, 1\], got '2'"),
    # plan
    (["plan", "--topology", "dgx1v", "--size", "-1M"], r"bad size '-1M': sizes must be a positive whole number"),
    (["plan", "--topology", "dgx1v", "--size", "12Q"], r"bad size '12Q': expected a number with an optional"),
    (["plan", "--topology", "dgx1v", "--max-trees", "0"], r"argument --max-trees: must be an integer in \[1, inf\]"),
    (["plan", "--topology", "dgx1v", "--rate-tolerance", "nan"], r"--rate-tolerance: must be a fraction in \[0, 1\)"),
    (["plan", "--topology", "dgx1vv"], r"'dgx1vv' is not a preset name.*did you mean 'dgx1v'\?.*known presets: dgx1p"),
    (["plan", "--topology", "dgx1v", "--devices", "0,99"], r"devices \[99\] are not GPUs of topology 'dgx1v'"),
    (["plan", "--topology", "dgx1v", "--devices", "3-1"], r"range '3-1' ends below its start; write 1-3"),
    (["plan", "--topology", "dgx1v", "--devices", "-1"], r"'-1' is negative"),
    (["plan", "--topology", "dgx1v", "--collective", "broadcast", "--root", "42"], r"root 42 is not among devices"),
    # bench / show
    (["bench", "--topology", "dgx1v", "--latency-us", "-1"], r"argument --latency-us: must be a number in \[0, inf\]"),
    (["bench", "--topology", "dgx1v", "--latency-us", "nan"], r"argument --latency-us: must be a number"),
    (["bench", "--topology", "dgx1v", "--repeats", "0"], r"argument --repeats: must be an integer in \[1, inf\]"),
    (["bench", "--topology", "dgx1v", "--sizes", "-4K"], r"bad size '-4K'"),
    (["bench", "--topology", "dgx1v", "--sizes", "1K..1T", "--measure"],
     r"--measure allocates the operand on every device: sizes up to 1G per GPU, got 1T"),
    (["bench", "--topology", "dgx1v", "--plan", "/no/such/plan.json"], r"cannot read --plan '/no/such/plan.json'"),
    (["show", "--topology", "dgx1v", "--png", "x.png", "--size", "-5"], r"bad size '-5'"),
    (["show", "--topology", "dgx1v", "--png", ""], r"--png is empty"),
    # topology
    (["topology", "host0"], r"'host0': host<N> takes N host CPU devices in 1\.\.4096"),
    (["topology", "/no/such/topo.xml"], r"'/no/such/topo.xml' is not a preset name.*NCCL's topology XML"),
    (["topology", "dgx1v", "--probe-sizes", "1M"], r"--probe-sizes applies to `jax-blink topology probe`"),
    (["topology", "dgx1v", "--repeats", "2"], r"--repeats applies to `jax-blink topology probe`, not to 'dgx1v'"),
    (["topology", "dgx1v", "--pcie-gbps", "nan"], r"argument --pcie-gbps: must be a finite number of GB/s > 0"),
    (["topology", "probe", "--repeats", "0"], r"argument --repeats: must be an integer in \[1, inf\]"),
    (["topology", "probe", "--probe-sizes", "4G"], r"--probe-sizes up to 1G per transfer"),
    (["topology", "probe", "--pcie-gbps", "10"], r"`topology probe` measures the links"),
    # selftest
    (["selftest", "--ranks", "0"], r"argument --ranks: must be an integer in \[1, inf\]"),
])
def test_bad_option_exits_2_with_a_message(capsys, argv, match):
    fails(capsys, argv, match)


def test_absurd_host_size_is_refused_fast(capsys):
    t0 = time.perf_counter()
    fails(capsys, ["topology", "host100000"], r"host<N> takes N host CPU devices in 1\.\.4096 .*got N=100000")
    assert time.perf_counter() - t0 < 2.0


def test_negative_values_are_joined_only_for_value_options():
    opts = {"--size", "--lr"}
    assert join_negative_values(["plan", "--size", "-1M", "--json"], opts) == ["plan", "--size=-1M", "--json"]
    assert join_negative_values(["demo", "--lr", "-.5"], opts) == ["demo", "--lr=-.5"]
    assert join_negative_values(["plan", "--size", "--json"], opts) == ["plan", "--size", "--json"]
    assert join_negative_values(["x", "--other", "-1"], opts) == ["x", "--other", "-1"]


@pytest.mark.parametrize("field,value,match", [
    ("lr", float("nan"), r"--lr must be positive \(and --lr finite\), got 10, 64, nan"),
    ("lr", float("inf"), r"got 10, 64, inf"),
    ("min_accuracy", float("nan"), r"--min-accuracy is a fraction in \[0, 1\], got nan"),
])
def test_example_refuses_what_its_own_argparse_lets_through(field, value, match):
    """examples/flax_digits/train.py parses --lr with type=float (nan passes argparse): its
    config_from_args, shared with the demo, refuses it before training."""
    import argparse

    from jax_blink.cli.demo_cmd import load_example
    ex = load_example()
    p = argparse.ArgumentParser()
    ex.add_arguments(p)
    args = p.parse_args(["--epochs", "10"])
    setattr(args, field, value)
    with pytest.raises(ValueError, match=match):
        ex.config_from_args(args)
