"""Hostile topology files (issue: bounded inputs): seeded mutants of every file in tests/data/topologies
and of presets as JSON give only TopologyError or a sane topology, fast and in little memory; and the
named cases a hostile trial found each get a TopologyError naming the field and value, or a note."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from jax_blink.errors import TopologyError
from jax_blink.topology import Topology

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "topologies"


def test_seeded_mutants_raise_only_topology_errors():
    """540 mutants (60 per source: 6 `topo -m` / XML files, 3 presets as JSON) in a fresh process:
    0 other exceptions, 0 cases over 5 s, peak RSS under 1 GiB. (On the loaders before their checks,
    the same seed gave 89 other exceptions: RecursionError, TypeError, ...)."""
    p = subprocess.run([sys.executable, str(HERE / "fuzz_cases.py"), "60"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["cases"] == 540 and out["other"] == [], out["other"][:20]
    assert out["topology_error"] > 100 and out["accepted"] > 20  # the mutants reach both outcomes
    assert out["slowest_s"] < 5 and out["peak_rss_mib"] < 1024, out


def _json(tmp_path, edit):
    d = Topology.preset("dgx1v").to_dict()
    edit(d)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize("field, value, pattern", [
    ("links", 0, r"links\[0\]: links must be an integer from 1"),
    ("links", 1e999, r"links\[0\]: links must be an integer"),
    ("links", 2.5, r"a fraction"),
    ("links", True, r"links\[0\]: links must be .*got True \(bool\)"),
    ("bandwidth_gbps", True, r"bandwidth_gbps must be a finite number .*got True \(bool\)"),
    ("bandwidth_gbps", 1e-320, r"bandwidth_gbps must be a finite number > 0 of GB/s, from 0.001"),
])
def test_json_numbers_are_checked(tmp_path, field, value, pattern):
    path = _json(tmp_path, lambda d: d["links"][0].__setitem__(field, value))
    with pytest.raises(TopologyError, match=pattern):
        Topology.load(path)


def test_json_unknown_kind_and_sizes_are_named(tmp_path):
    path = _json(tmp_path, lambda d: d["nodes"][-1].__setitem__("kind", "gpuu"))
    with pytest.raises(TopologyError, match=r"unknown node kind 'gpuu'"):
        Topology.load(path)
    star = {"name": "star", "nodes": [{"id": i, "kind": "gpu"} for i in range(10_000)],
            "links": [{"src": i, "dst": 0, "bandwidth_gbps": 10, "kind": "pcie"} for i in range(1, 10_000)]}
    (tmp_path / "star.json").write_text(json.dumps(star))
    t0 = time.perf_counter()
    with pytest.raises(TopologyError, match=r"10,000 GPUs; at most 4,096"):
        Topology.load(str(tmp_path / "star.json"))
    assert time.perf_counter() - t0 < 5
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TopologyError):
        Topology.load(str(tmp_path / "deep.json"))


def test_topo_m_huge_gpu_id_is_refused_fast(tmp_path):
    text = (DATA / "two_gpus_pix_no_p2p.txt").read_text()
    for big in ("GPU99999999999999999999", "GPU30000000"):
        p = tmp_path / "t.txt"
        p.write_text(text.replace("GPU1", big))
        t0 = time.perf_counter()
        with pytest.raises(TopologyError):
            Topology.load(str(p))
        assert time.perf_counter() - t0 < 2


def test_nccl_xml_misspelt_element_is_named(tmp_path):
    p = tmp_path / "t.xml"
    p.write_text((DATA / "dgx1v_nccl_topo.xml").read_text().replace("<nvlink ", "<nvlnk "))
    t = Topology.load(str(p))
    assert any("nvlnk" in n for n in t.notes), t.notes


@pytest.mark.parametrize("bad", ["NaN-23,36-47", "0x10", "-inf"])
def test_topo_m_garbled_affinity_is_refused_naming_line_and_value(tmp_path, bad):
    """A garbled CPU affinity once added a CPU socket without a word; now the file, line, row, column
    and value are named."""
    text = (DATA / "dgx1v_v100.txt").read_text()
    p = tmp_path / "t.txt"
    p.write_text(text.replace("0-11,24-35", bad, 1))
    with pytest.raises(TopologyError, match=rf"t.txt: line \d+, row GPU0, column 'CPU Affinity': got '{bad}'"):
        Topology.load(str(p))
