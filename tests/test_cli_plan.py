"""`jax-blink plan` options: relays, rate tolerance, forced algorithms, bad input."""

import json

import pytest

from jax_blink.cli import main
from jax_blink.presets import nvlink_gbps

V2 = nvlink_gbps(2)  # achieved GB/s of one V100 NVLink (25 line rate)


def test_relays_reach_the_max_flow_over_relay_gpus(capsys):
    # dgx1v-nvlink 0 -> 1: direct single link V2, via 2 (0-2 single, 2-1 double) V2,
    # via 3 (0-3 double, 3-1 single) V2, and 0 -> 3 -> 2 -> 1 V2 more: 4 V2 GB/s.
    assert main(["plan", "--topology", "dgx1v-nvlink", "--devices", "0,1", "--collective", "broadcast",
                 "--relays", "2,3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["rate_gbps"] == pytest.approx(4 * V2) and d["bound_gbps"] == pytest.approx(4 * V2)
    assert main(["plan", "--topology", "dgx1v-nvlink", "--devices", "0,1", "--collective", "broadcast",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rate_gbps"] == pytest.approx(V2)


def test_rate_tolerance_trades_rate_for_trees(capsys):
    assert main(["plan", "--topology", "dgx1v", "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert main(["plan", "--topology", "dgx1v", "--rate-tolerance", "0.01", "--json"]) == 0
    loose = json.loads(capsys.readouterr().out)
    assert len(loose["trees"]) < len(exact["trees"])
    assert 0.99 * exact["rate_gbps"] <= loose["rate_gbps"] <= exact["rate_gbps"]


def test_bad_options_exit_2_with_a_message(capsys):
    assert main(["plan", "--topology", "dgx1v", "--relays", "x"]) == 2
    assert "--relays takes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # refused by the option's type, as argparse does
        main(["plan", "--topology", "dgx1v", "--rate-tolerance", "1.5"])
    assert exc.value.code == 2 and "--rate-tolerance: must be a fraction in [0, 1)" in capsys.readouterr().err
    assert main(["plan", "--topology", "dgx1v", "--algorithm", "hierarchical"]) == 2
    assert "two or more nodes" in capsys.readouterr().err


def test_devices_ranges_and_relays_share_one_parser(capsys):
    assert main(["plan", "--topology", "dgx1v", "--devices", "0-2,5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == [0, 1, 2, 5]
    assert main(["plan", "--topology", "dgx1v-nvlink", "--devices", "0,1", "--collective", "broadcast",
                 "--relays", "2-3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rate_gbps"] == pytest.approx(4 * V2)
    assert main(["plan", "--topology", "dgx1v", "--relays", "2,,3"]) == 2
    assert "--relays '2,,3' has an empty item" in capsys.readouterr().err


def test_root_is_only_for_broadcast_and_reduce(capsys):
    assert main(["plan", "--topology", "dgx1v", "--collective", "allreduce", "--root", "4"]) == 2
    assert "--root 4 is for --collective broadcast or reduce" in capsys.readouterr().err
    assert main(["plan", "--topology", "dgx1v", "--collective", "reduce", "--root", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["root"] == 4


def test_planning_prints_nothing_to_stdout(capfd):
    """HiGHS's MIP solver printed debug lines to the C stdout (corrupting --json); they are muted."""
    import itertools

    from jax_blink.packing import clear_caches, plan
    from jax_blink.presets import PRESETS

    clear_caches()
    t = PRESETS["dgx1v"]()
    for devs in itertools.combinations(range(8), 6):
        plan(t, "allreduce", devices=list(devs))
    assert capfd.readouterr().out == ""
