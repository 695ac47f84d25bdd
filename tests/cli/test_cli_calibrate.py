"""``jax-blink calibrate``: measures both lowerings on the 8 host CPU devices, fits, writes the file
auto reads (a short run: two sizes, one collective, one repeat)."""

import json

from jax_blink import calibration
from jax_blink.cli import main


def test_calibrate_writes_fits_auto_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_BLINK_CALIBRATION", "1")
    assert main(["calibrate", "--sizes", "4K,256K", "--repeats", "1", "--collectives", "allreduce", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.split("\nwritten to")[0])
    fits = out["calibration"]["fits"]
    assert {(f["lowering"], f["collective"], f["group_size"]) for f in fits} == {("ffi", "allreduce", 8),
                                                                                 ("xla", "allreduce", 8)}
    assert len(out["measured"]) == 4 and all(r["time_s"] > 0 for r in out["measured"])
    cal = calibration.load("cpu")
    assert cal is not None and cal.time_s("xla", "allreduce", 8, 4096) > 0
    assert cal.time_s("xla", "allreduce", 4, 4096) is None  # another group size: not calibrated


def test_calibrate_bad_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--collectives", "alltoall"]) == 2
    assert "not among" in capsys.readouterr().err
    assert main(["calibrate", "--sizes", "4K"]) == 2
    assert "two or more sizes" in capsys.readouterr().err
