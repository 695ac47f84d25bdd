"""`jax-blink bench` / `jax-blink show`: sizes syntax, tables, PNG, clear errors."""

import json

import pytest

from jax_blink.cli import main
from jax_blink.cli.bench_cmd import parse_devices, parse_sizes
from jax_blink.errors import BlinkError
from jax_blink.packing import plan
from jax_blink.presets import preset


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
    assert "jax_blink.psum" in out and "lax.psum" in out and "yes" in out


def test_show_png(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["show", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "broadcast",
                 "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 panels (2 trees)" in capsys.readouterr().out
    assert main(["show", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "broadcast",
                 "--algorithm", "tree", "--png", str(out)]) == 2
