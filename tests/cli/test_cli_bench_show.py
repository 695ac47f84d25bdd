"""`jax-blink bench` / `jax-blink show`: sizes syntax, tables, PNG, clear errors."""

import json
import re

import pytest

from jax_blink.cli import main
from jax_blink.cli.bench_cmd import human_time, parse_devices, parse_sizes
from jax_blink.errors import BlinkError
from jax_blink.planning import plan
from jax_blink.topology.presets import preset


def test_parse_sizes():
    assert parse_sizes("1K..8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("4K,1M,64M") == [4096, 1 << 20, 64 << 20]
    assert parse_sizes("1G") == [1 << 30]
    assert parse_sizes("1.5K,100") == [100, 1536]
    assert parse_devices("0-2,5") == [0, 1, 2, 5]
    for bad, msg in [("1X", "bad size"), ("0", "positive"), ("-4K", "positive"), ("8K..1K", "larger"),
                     ("", "empty"), (",".join(str(i) for i in range(1, 71)), "more than")]:
        with pytest.raises(BlinkError, match=msg):
            parse_sizes(bad)


def test_human_time_keeps_small_bounds_readable():
    """A 4-byte bound on a 100 GB/s link is 40 ns: it must not print as "0.0 us"."""
    assert [human_time(t) for t in (4e-8, 2.5e-6, 3.25e-3, 2.0)] == ["40.0 ns", "2.5 us", "3.25 ms", "2.000 s"]


def test_bench_table(capsys):
    assert main(["bench", "--topology", "dgx1v", "--devices", "0,1,4", "--sizes", "1M,64M"]) == 0
    out = capsys.readouterr().out
    assert "blink busbw" in out and "ring busbw" in out and "tree busbw" in out
    assert out.count("\n") > 6 and "64M" in out and "1M" in out


def test_bench_errors(capsys, tmp_path):
    assert main(["bench", "--topology", "dgx1v", "--sizes", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    f = tmp_path / "p.json"
    f.write_text(plan(preset("dgx1v"), "allreduce", devices=[0, 1, 2]).to_json())
    assert main(["bench", "--topology", "dgx1v", "--devices", "0,1,4", "--plan", str(f), "--sizes", "1M"]) == 2
    err = capsys.readouterr().err
    assert "devices [0, 1, 2], not the --devices [0, 1, 4]" in err
    assert main(["bench", "--topology", "dgx1v", "--devices", "0,9", "--sizes", "1M"]) == 2
    assert "9" in capsys.readouterr().err


def test_bench_measure_runs_real_collective(capsys):
    assert main(["bench", "--topology", "dgx1v", "--sizes", "4K", "--measure", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "blink time" in out and "lax time" in out and "busbw" in out and "yes" in out
    # --devices and --topology apply to the measured run too (found by a user test)
    assert main(["bench", "--topology", "dgx1v", "--devices", "0,2,5", "--sizes", "4K", "--measure",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured on local JAX devices [0, 2, 5] planned on dgx1v" in out and "yes" in out


@pytest.mark.parametrize("collective,size", [("allreduce", 4096), ("allgather", 8192), ("broadcast", 2048)])
@pytest.mark.slow
def test_bench_measure_json_has_nccl_tests_columns_and_the_plans_bound(capsys, collective, size):
    import json

    import jax_blink
    from jax_blink import Topology, collectives

    assert main(["bench", "--topology", "dgx1v", "--collective", collective, "--sizes", str(size), "--measure",
                 "--repeats", "2", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert (r["size"], r["count"], r["dtype"], r["n"], r["lowering"], r["equal"]) == \
           (size, size // 4, "float32", 8, "ffi", True)
    factor = collectives.get(collective).busbw_factor(8)
    for name in ("blink", "lax"):
        assert r[f"{name}_time_s"] > 0
        assert r[f"{name}_algbw_gbps"] == pytest.approx(size / r[f"{name}_time_s"] / 1e9)
        assert r[f"{name}_busbw_gbps"] == pytest.approx(r[f"{name}_algbw_gbps"] * factor)
    assert r["blink_over_lax"] == pytest.approx(r["blink_time_s"] / r["lax_time_s"])
    # the bound of the plan jax_blink lowered: size / the certificate `jax-blink plan` prints
    cert = jax_blink.plan(Topology.preset("dgx1v"), collective, devices=list(range(8))).bound_gbps
    assert r["bound_s"] == pytest.approx(size / (cert * 1e9), rel=1e-12) and 0 < r["bound_s"] <= r["sim_s"]


@pytest.mark.slow
def test_bench_measure_sets_up_host_devices_itself():
    """Found by a user: without XLA_FLAGS it printed the simulated table, then failed (1 CPU device)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "jax_blink", "bench", "--topology", "dgx1v", "--devices", "0,5",
                        "--sizes", "4K", "--measure", "--repeats", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "measured on local JAX devices [0, 5] planned on dgx1v" in p.stdout and "yes" in p.stdout


def test_bench_measure_checks_devices_before_the_simulated_table(capsys):
    # this process started JAX with 8 host devices: id 9 cannot be measured, and nothing is printed first
    assert main(["bench", "--topology", "dgx2", "--devices", "0,9", "--sizes", "4K", "--measure"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "ids [9] are not among [0, 1, 2, 3, 4, 5, 6, 7]" in err and "fresh process" in err


def test_show_png(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["show", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "broadcast",
                 "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 panels (2 trees)" in capsys.readouterr().out
    assert main(["show", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "broadcast",
                 "--algorithm", "tree", "--png", str(out)]) == 2


def test_sizes_take_tebibytes_as_the_help_says(capsys):
    from jax_blink.cli import build_parser
    from jax_blink.cli.bench_cmd import human_bytes
    assert parse_sizes("1T") == [1 << 40] and parse_sizes("512G..1T") == [512 << 30, 1 << 40]
    assert human_bytes(1 << 40) == "1T" and human_bytes(3 << 39) == "1.5T"
    help_text = build_parser("bench")._subparsers._group_actions[0].choices["bench"].format_help()
    assert "K/M/G/T = KiB/MiB/GiB/TiB" in " ".join(help_text.split())
    with pytest.raises(BlinkError, match="K/M/G/T suffix"):
        parse_sizes("1P")


def test_devices_syntax_is_shared_and_strict():
    from jax_blink.cli._args import parse_devices as shared
    assert parse_devices is shared
    assert parse_devices("0,1,4") == [0, 1, 4] and parse_devices("0-3") == [0, 1, 2, 3]
    assert parse_devices(" 0-2, 5 ") == [0, 1, 2, 5] and parse_devices(None) is None
    for bad, msg in [("0,,1", "empty item"), ("0,1,", "empty item"), ("", "is empty"),
                     ("0,1,1", "GPU 1 more than once"), ("0-2,2", "GPU 2 more than once"),
                     ("0,-1", "'-1' is negative"), ("a", "'a' is not a GPU id"), ("1.5", "not a GPU id"),
                     ("3-1", "ends below its start")]:
        with pytest.raises(BlinkError, match=msg):
            parse_devices(bad)


@pytest.mark.parametrize("cmd", ["plan", "bench", "show"])
def test_devices_option_is_the_same_in_every_command(cmd, capsys, tmp_path):
    extra = {"plan": ["--json"], "bench": ["--sizes", "1M"], "show": ["--png", str(tmp_path / "t.png")]}[cmd]
    assert main([cmd, "--topology", "dgx1v", "--devices", "0-2,5", *extra]) == 0
    out = capsys.readouterr().out
    want = {"plan": '"devices": [\n    0,\n    1,\n    2,\n    5\n  ]', "bench": "GPUs [0, 1, 2, 5]",
            "show": "GPUs [0, 1, 2, 5]"}[cmd]
    assert want in out
    for bad, msg in [("0,,1", "empty item"), ("0,1,1", "more than once"), ("0,-1", "negative"),
                     ("x", "not a GPU id")]:
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--topology", "dgx1v", "--devices", bad, *extra])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --devices" in err and msg in err, err


@pytest.mark.parametrize("cmd", ["plan", "bench", "show"])
def test_root_with_allreduce_is_an_error(cmd, capsys, tmp_path):
    extra = {"plan": [], "bench": ["--sizes", "1M"], "show": ["--png", str(tmp_path / "t.png")]}[cmd]
    assert main([cmd, "--topology", "dgx1v", "--root", "4", *extra]) == 2
    assert "--root 4 is for --collective broadcast or reduce" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("cmd", ["bench", "show"])
def test_plan_file_that_is_not_utf8_or_json_is_a_clean_error(cmd, capsys, tmp_path):
    extra = ["--sizes", "1M"] if cmd == "bench" else ["--png", str(tmp_path / "t.png")]
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(b"\x89\xfb\x00\xff binary")
    assert main([cmd, "--topology", "dgx1v", "--plan", str(bad), *extra]) == 2
    assert "is not a plan JSON file (not UTF-8 text)" in capsys.readouterr().err
    assert main([cmd, "--topology", "dgx1v", "--plan", str(tmp_path), *extra]) == 2
    assert "is a directory, not a plan JSON file" in capsys.readouterr().err
    assert main([cmd, "--topology", "dgx1v", "--plan", str(tmp_path / "none.json"), *extra]) == 2
    assert "cannot read --plan" in capsys.readouterr().err
    txt = tmp_path / "notes.txt"
    txt.write_text("hello")
    assert main([cmd, "--topology", "dgx1v", "--plan", str(txt), *extra]) == 2
    assert "notes.txt': plan JSON is not valid JSON" in capsys.readouterr().err


def test_plan_made_for_another_topology_names_the_missing_nodes(capsys, tmp_path):
    f = tmp_path / "p.json"
    assert main(["plan", "--topology", "dgx1v", "--json"]) == 0
    f.write_text(capsys.readouterr().out)
    assert main(["bench", "--topology", "dgx1v", "--plan", str(f), "--sizes", "1M"]) == 0
    capsys.readouterr()
    # dgx2 has all 8 GPU ids but one NVSwitch: dgx1v's PCIe switches and direct NVLinks are absent
    assert main(["bench", "--topology", "dgx2", "--plan", str(f), "--sizes", "1M"]) == 2
    err = capsys.readouterr().err
    assert "was made for another topology" in err and "not in topology 'dgx2'" in err
    assert "nodes cpu0, cpu1, pcie-switch-0, pcie-switch-1, pcie-switch-2, pcie-switch-3" in err
    assert "links 0->1, 0->2" in err and "no route" not in err
    # same nodes minus the PCIe tree: only the switch nodes are missing
    assert main(["show", "--topology", "dgx1v-nvlink", "--plan", str(f), "--png",
                 str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "nodes cpu0, cpu1, pcie-switch-0" in err and "links" not in err.split("not in topology")[0]
    # a plan using a link the topology lacks, between nodes it has
    d = json.loads(f.read_text())
    t0 = d["trees"][0]
    d["trees"] = [t0 | {"edges": [[0, 6]] + [e for e in t0["edges"] if e[1] != 6]}]
    assert preset("dgx1v").bandwidth(0, 6) == 0.0
    f.write_text(json.dumps(d))
    assert main(["bench", "--topology", "dgx1v", "--plan", str(f), "--sizes", "1M"]) == 2
    err = capsys.readouterr().err
    assert "links 0->6" in err and "nodes" not in err


def test_show_png_path_written_is_the_path_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["show", "--topology", "dgx1v", "--devices", "0,1", "--collective", "broadcast"]
    assert main([*base, "--png", "trees"]) == 0
    assert "wrote trees.png:" in capsys.readouterr().out
    assert (tmp_path / "trees.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "trees").exists()
    assert main([*base, "--png", "trees.v2"]) == 0  # a suffix that is no image format: .png appended
    assert "wrote trees.v2.png:" in capsys.readouterr().out
    assert (tmp_path / "trees.v2.png").read_bytes()[:4] == b"\x89PNG"
    for other in ("trees.jpg", "trees.JPEG", "plan.svg", "plan.pdf"):
        assert main([*base, "--png", other]) == 2
        assert "written as PNG only" in capsys.readouterr().err
        assert not list(tmp_path.glob(other + "*"))
    assert main([*base, "--png", "T.PNG"]) == 0
    assert "wrote T.PNG:" in capsys.readouterr().out and (tmp_path / "T.PNG").exists()
    (tmp_path / "somedir").mkdir()
    for bad, msg in [("", "--png is empty"), ("  ", "--png is empty"), ("somedir", "is a directory"),
                     ("somedir/", "is a directory"), (str(tmp_path / "somedir"), "is a directory")]:
        assert main([*base, "--png", bad]) == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / ".png").exists() and not (tmp_path / "somedir.png").exists()
    assert main([*base, "--png", "nodir/t.png"]) == 2
    assert "cannot write --png 'nodir/t.png'" in capsys.readouterr().err


def test_show_ring_is_for_allreduce_like_plan(capsys, tmp_path):
    png = str(tmp_path / "t.png")
    assert main(["show", "--topology", "dgx1v", "--algorithm", "ring", "--collective", "broadcast",
                 "--png", png]) == 2
    assert "ring is an all-reduce algorithm" in capsys.readouterr().err
    assert main(["plan", "--topology", "dgx1v", "--algorithm", "ring", "--collective", "broadcast"]) == 2
    assert "ring' is an all-reduce algorithm" in capsys.readouterr().err
    assert main(["show", "--topology", "dgx1v", "--devices", "0-3", "--algorithm", "ring", "--png", png]) == 0
    assert "ring" in capsys.readouterr().out


def test_bench_json_one_object_per_size(capsys):
    from jax_blink.planner.dbtree import nccl_tree_plan
    from jax_blink.planner.rings import nccl_ring_plan
    from jax_blink.simulate import simulate

    assert main(["bench", "--topology", "dgx1v", "--sizes", "1M,1G", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["size"] for r in rows] == [1 << 20, 1 << 30]
    topo = preset("dgx1v")
    for r in rows:
        for name in ("blink", "ring", "tree"):
            assert r[f"{name}_algbw_gbps"] == pytest.approx(r["size"] / r[f"{name}_time_s"] / 1e9)
            assert r[f"{name}_busbw_gbps"] == pytest.approx(r[f"{name}_algbw_gbps"] * 2 * 7 / 8)
        assert r["ring_time_s"] == simulate(nccl_ring_plan(topo), r["size"], topology=topo).time_s
        assert r["tree_time_s"] == simulate(nccl_tree_plan(topo), r["size"], topology=topo).time_s
        assert r["blink_time_s"] <= min(r["ring_time_s"], r["tree_time_s"])
    assert rows[0]["blink_plan"].startswith("ring, ")  # 1 MiB on dgx1v: rings (the trees alone were 0.46x their time)


def test_plan_ring_reports_the_collective_bound_and_rings(capsys):
    assert main(["plan", "--topology", "dgx1v", "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "ring, 36 rings" in out and "rate 85.371 GB/s, ring bound 85.371 GB/s (1.000 of bound)" in out
    # the table lists the 36 rings (each a GPU cycle), not their 288 rotations as trees
    p = plan(preset("dgx1v"), algorithm="ring")
    rows = [ln for ln in out.splitlines() if re.match(r"^│\s*\d+ │", ln)]
    assert "rings" in out and "\ntrees" not in out and len(rows) == len(p.rings()) == 36
    heaviest = max(p.rings(), key=lambda r: r[1])
    assert f"{heaviest[1]:.3f}" in rows[0]
    cycle = [int(x) for x in rows[0].split("│")[4].split("->")]
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == list(range(8))
    assert main(["plan", "--topology", "dgx1v", "--size", "1M"]) == 0
    out = capsys.readouterr().out
    assert "chosen for 1048576 B per GPU" in out and "ring, " in out.splitlines()[0]


def _texts_outside(fig):
    """Texts (titles, suptitle, node labels, colour bar labels) whose drawn box leaves the figure."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    out = []
    for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent")):
        if not t.get_visible() or not t.get_text().strip():
            continue
        b = t.get_window_extent(r)
        if b.x0 < -0.5 or b.y0 < -0.5 or b.x1 > W + 0.5 or b.y1 > H + 0.5:
            out.append((t.get_text(), tuple(round(v) for v in (b.x0, b.y0, b.x1, b.y1)), (W, H)))
    return out


@pytest.mark.parametrize("source, devices, collective, algorithm", [
    ("tests/data/topologies/a100_pcie_nvlink_pairs.txt", [0, 1, 2], "allreduce", "blink"),  # the user's case
    ("dgx1v", None, "broadcast", "blink"),
    ("dgx1v-4node", None, "allreduce", "blink"),
    ("tests/data/topologies/h100_sxm_nvswitch.txt", None, "allreduce", "tree"),
    ("tests/data/topologies/dgx1v_nccl_topo.xml", [0, 1, 4], "allreduce", "ring"),
])
@pytest.mark.slow
def test_show_titles_and_labels_fit_in_the_figure(source, devices, collective, algorithm):
    """Found by a user: `show ... --devices 0,1,2` clipped its title on both sides."""
    import pathlib

    import matplotlib.pyplot as plt

    from jax_blink import load_topology
    from jax_blink.cli.bench_cmd import human_bytes
    from jax_blink.planner.dbtree import nccl_tree_plan
    from jax_blink.planner.rings import nccl_ring_plan
    from jax_blink.plot import plan_figure
    from jax_blink.simulate import simulate

    root = pathlib.Path(__file__).resolve().parents[2]
    topo = load_topology(str(root / source) if "/" in source else source)
    size = 256 << 20
    # the plans and the title `jax-blink show` draws (show_cmd.run)
    p = {"blink": lambda: plan(topo, collective, devices=devices, root=0 if collective != "allreduce" else None,
                               nbytes=size),
         "ring": lambda: nccl_ring_plan(topo, collective, devices=devices),
         "tree": lambda: nccl_tree_plan(topo, devices=devices)}[algorithm]()
    res = simulate(p, size, topology=topo)
    title = (f"{p.collective} on {topo.name} GPUs {list(p.devices)}: {p.shape()}, planned {p.rate_gbps:.2f} GB/s, "
             f"simulated algbw {res.algbw_gbps:.2f} GB/s at {human_bytes(size)}")
    fig, _ = plan_figure(topo, p, link_util=res.link_util, title=title)
    try:
        assert _texts_outside(fig) == []
        assert fig.texts and "simulated algbw" in fig.texts[0].get_text().replace("\n", " ")
    finally:
        plt.close(fig)
