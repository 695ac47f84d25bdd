"""`jax-blink plan` options: relays, rate tolerance, forced algorithms, bad input."""

import json

import pytest

from jax_blink.cli import main
from jax_blink.topology.presets import nvlink_gbps

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

    from jax_blink.planner.facade import clear_caches
    from jax_blink.planning import plan
    from jax_blink.topology.presets import PRESETS

    clear_caches()
    t = PRESETS["dgx1v"]()
    for devs in itertools.combinations(range(8), 6):
        plan(t, "allreduce", devices=list(devs))
    assert capfd.readouterr().out == ""


def test_auto_ring_choice_is_explained_and_bounded_by_the_ring_family(capsys):
    # at 1 MiB on dgx1v auto picks NCCL's NVLink rings by simulated time: the notes say auto chose
    # them (the cost model's time) and nobody forced them; the bound is that of any ring over all
    # links, n B / (2(n-1)) with B the min max-flow between GPUs, not the NVLink rings' own rate
    from jax_blink.planner.bounds import allreduce_bound
    from jax_blink.topology.load import load_topology
    t = load_topology("dgx1v")
    ring_cap = 8 * allreduce_bound(t, t.gpus) / (2 * 7)
    assert main(["plan", "--topology", "dgx1v", "--size", "1M", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["algorithm"] == "ring" and d["notes"][0].startswith("NCCL rings on nvlink links")
    assert d["bound_gbps"] == pytest.approx(ring_cap, rel=1e-9) and d["rate_gbps"] < 0.95 * d["bound_gbps"]
    assert d["notes"][-1].startswith("auto: chosen for 1048576 B per GPU by the cost model")
    assert not any("forced" in n for n in d["notes"])
    assert main(["plan", "--topology", "dgx1v", "--size", "1M"]) == 0
    out = capsys.readouterr().out
    assert f"ring bound {ring_cap:.3f} GB/s ({d['rate_gbps'] / ring_cap:.3f} of bound)" in out
    assert "forced" not in out and "asked for" not in out
    assert main(["plan", "--topology", "dgx1v", "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "--algorithm ring: the family you asked for" in out and "forced" not in out


def test_double_binary_tree_bound_is_the_max_flow_not_its_own_rate(capsys):
    from jax_blink.planner.bounds import allreduce_bound
    from jax_blink.topology.load import load_topology
    t = load_topology("dgx1v")
    assert main(["plan", "--topology", "dgx1v", "--size", "4K", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["algorithm"] == "double-binary-tree"
    assert d["bound_gbps"] == pytest.approx(allreduce_bound(t, t.gpus)) and d["rate_gbps"] < d["bound_gbps"]
