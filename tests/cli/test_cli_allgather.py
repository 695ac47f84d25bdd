"""`jax-blink plan / bench / show --collective allgather|reducescatter`: rate vs cut bound, blink vs
NCCL's ring and the LP ring per size, tree drawings, errors."""

import json

import pytest

from jax_blink.cli import main
from jax_blink.planner import bounds
from jax_blink.planner.model import Plan
from jax_blink.planner.rings import nccl_ring_plan, ring_plan
from jax_blink.simulate import simulate
from jax_blink.topology.presets import preset


def test_plan_shows_rate_against_the_cut_bound(capsys):
    assert main(["plan", "--topology", "dgx1v", "--collective", "allgather"]) == 0
    out = capsys.readouterr().out
    # dgx1v: every GPU takes in 149.4 GB/s (6 NVLinks at 22.9 achieved + PCIe gen3 at 12.0); 7 shards
    # enter it: 8 * 149.4 / 7
    assert "allgather on dgx1v GPUs [0, 1, 2, 3, 4, 5, 6, 7]" in out
    assert "rate 170.743 GB/s, cut bound 170.743 GB/s (1.000 of bound)" in out
    assert "rings at most 170.743 GB/s (the best ring packing, rings of 149.400 GB/s in total" in " ".join(out.split())
    assert main(["plan", "--topology", "dgx1v", "--devices", "0,1,2,5", "--collective", "reducescatter",
                 "--json"]) == 0
    p = Plan.from_json(capsys.readouterr().out)
    assert p.collective == "reducescatter" and p.root is None
    assert p.rate_gbps == pytest.approx(bounds.reducescatter_bound(preset("dgx1v"), [0, 1, 2, 5]), rel=1e-6)
    assert {t.root for t in p.trees} == {0, 1, 2, 5}
    assert main(["plan", "--topology", "dgx1v", "--devices", "0-3", "--collective", "allgather",
                 "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "ring, " in out and "each shard travels n-1 = 3 hops" in out


def test_plan_errors(capsys):
    assert main(["plan", "--topology", "dgx1v", "--collective", "allgather", "--root", "1"]) == 2
    assert "an allgather has no root" in capsys.readouterr().err
    assert main(["plan", "--topology", "dgx1v", "--collective", "reducescatter", "--max-trees", "3"]) == 2
    assert "at least one tree per rank" in capsys.readouterr().err
    assert main(["plan", "--topology", "dgx1v", "--collective", "allgather", "--algorithm", "rsag"]) == 2
    assert "all-reduce algorithm" in capsys.readouterr().err


def test_bench_json_compares_blink_with_nccl_ring_and_lp_ring(capsys):
    devs = [0, 1, 2, 5]  # no NVLink ring through these: NCCL falls back to PCIe
    assert main(["bench", "--topology", "dgx1v", "--devices", "0,1,2,5", "--collective", "allgather",
                 "--sizes", "64K,1G", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    topo = preset("dgx1v")
    assert [r["size"] for r in rows] == [64 << 10, 1 << 30]
    for r in rows:
        for name in ("blink", "ring", "lpring"):
            assert r[f"{name}_algbw_gbps"] == pytest.approx(r["size"] / r[f"{name}_time_s"] / 1e9)
            assert r[f"{name}_busbw_gbps"] == pytest.approx(r[f"{name}_algbw_gbps"] * 3 / 4)
        assert r["tree_time_s"] is None
        assert r["ring_time_s"] == simulate(nccl_ring_plan(topo, "allgather", devices=devs), r["size"],
                                            topology=topo).time_s
        assert r["lpring_time_s"] == simulate(ring_plan(topo, "allgather", devices=devs), r["size"],
                                              topology=topo).time_s
        assert r["blink_time_s"] <= min(r["ring_time_s"], r["lpring_time_s"])
    # 1 GiB: the tree packing (82.7 GB/s) is far ahead of NCCL's PCIe rings
    assert rows[1]["blink_plan"].startswith("trees") and rows[1]["ring_time_s"] > 3 * rows[1]["blink_time_s"]


def test_bench_table_for_reducescatter(capsys):
    assert main(["bench", "--topology", "dgx-a100", "--collective", "reducescatter", "--sizes", "1M,64M"]) == 0
    out = capsys.readouterr().out
    assert "blink busbw" in out and "ring busbw" in out and "lp ring busbw" in out and "tree busbw" not in out
    assert "size = the full buffer" in out and "64M" in out


def test_show_draws_allgather_trees_and_reducescatter_rings(capsys, tmp_path):
    png = str(tmp_path / "ag.png")
    assert main(["show", "--topology", "dgx1v", "--devices", "0,1,2,5", "--collective", "allgather",
                 "--png", png]) == 0
    out = capsys.readouterr().out
    assert "allgather on dgx1v GPUs [0, 1, 2, 5]" in out and "trees" in out
    assert (tmp_path / "ag.png").stat().st_size > 10_000
    png = str(tmp_path / "rs.png")
    assert main(["show", "--topology", "dgx1v", "--devices", "0-3", "--collective", "reducescatter",
                 "--algorithm", "ring", "--png", png]) == 0
    assert "reducescatter on dgx1v GPUs [0, 1, 2, 3]: ring" in capsys.readouterr().out
    assert main(["show", "--topology", "dgx1v", "--collective", "allgather", "--algorithm", "tree",
                 "--png", png]) == 2
    assert "double binary tree" in capsys.readouterr().err
