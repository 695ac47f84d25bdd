from jax_blink import Topology
from jax_blink.presets import dgx1v


def test_dgx1v_has_six_links_per_gpu():
    t = dgx1v()
    for g in t.gpus:
        assert sum(d["links"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == "nvlink") == 6


def test_json_round_trip():
    t = dgx1v()
    assert Topology.from_json(t.to_json()) == t
