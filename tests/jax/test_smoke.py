from jax_blink import Topology
from jax_blink.topology.presets import dgx1v


def test_dgx1v_has_six_links_per_gpu():
    t = dgx1v()
    for g in t.gpus:
        assert sum(d["links"] for _, _, d in t.graph.out_edges(g, data=True) if d["kind"] == "nvlink") == 6


def test_json_round_trip():
    t = dgx1v()
    assert Topology.from_json(t.to_json()) == t


def test_dir_lists_the_lazy_api_and_version_comes_from_the_install():
    from importlib.metadata import version

    import jax_blink
    names = dir(jax_blink)
    for name in ("psum", "pmean", "broadcast", "reduce", "plan", "Plan", "Tree", "ring_rate", "set_device_map",
                 "Topology", "load_topology"):
        assert name in names
    assert set(jax_blink.__all__) <= set(names)
    assert jax_blink.__version__ == version("jax_blink")


def test_cli_version(capsys):
    import sys
    from importlib.metadata import version

    import pytest

    import jax_blink
    from jax_blink.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == (f"jax-blink {version('jax_blink')} (jax {version('jax')}, jaxlib {version('jaxlib')}, "
                           f"Python {sys.version.split()[0]}, CPU kernels {jax_blink.cpu_isa()})")
