"""impl="xla" (jax_blink.lowering.xla): lax's own collective op, bit for bit lax's results, under pmap,
shard_map (whole and partial axes, axis_index_groups), grad; and impl="auto" handing a call site to it
where this machine's calibration says XLA is faster (jax_blink.calibration), with the reason."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import calibration
from jax_blink.lowering import xla as xla_lowering

N = 8


def _x(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _smap(f, mesh, spec=None):
    spec = P("d") if spec is None else spec
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def test_pmap_psum_bitwise():
    x = _x((N, 1000))
    a = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="xla"), axis_name="i")(x)
    b = jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")(x)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("case", ["psum", "all_gather", "all_gather_untiled", "psum_scatter", "broadcast", "reduce"])
def test_shard_map_bitwise(mesh, case):
    x = _x((N * 96,), 1)
    jb, lx = {
        "psum": (lambda v: jax_blink.psum(v, "d", impl="xla"), lambda v: lax.psum(v, "d")),
        "all_gather": (lambda v: jax_blink.all_gather(v, "d", impl="xla", tiled=True),
                       lambda v: lax.all_gather(v, "d", tiled=True)),
        "all_gather_untiled": (lambda v: jax_blink.all_gather(v.reshape(4, 24), "d", impl="xla", axis=1).reshape(-1),
                               lambda v: lax.all_gather(v.reshape(4, 24), "d", axis=1).reshape(-1)),
        "psum_scatter": (lambda v: jax_blink.psum_scatter(v, "d", impl="xla", tiled=True),
                         lambda v: lax.psum_scatter(v, "d", tiled=True)),
        "broadcast": (lambda v: jax_blink.broadcast(v, "d", root=3, impl="xla"), lambda v: lax.all_gather(v, "d")[3]),
        "reduce": (lambda v: jax_blink.reduce(v, "d", root=2, impl="xla"),
                   lambda v: jnp.where(lax.axis_index("d") == 2, lax.psum(v, "d"), 0)),
    }[case]
    a, b = _smap(jb, mesh)(x), _smap(lx, mesh)(x)
    assert a.shape == b.shape and np.array_equal(a, b)


def test_two_axes_and_groups_bitwise():
    mesh2 = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("a", "b"))
    x = _x((N * 16,), 2)
    spec = P(("a", "b"))
    for jb, lx in ((lambda v: jax_blink.psum(v, "b", impl="xla"), lambda v: lax.psum(v, "b")),
                   (lambda v: jax_blink.psum(v, ("a", "b"), impl="xla"), lambda v: lax.psum(v, ("a", "b"))),
                   (lambda v: jax_blink.all_gather(v, "a", impl="xla", tiled=True),
                    lambda v: lax.all_gather(v, "a", tiled=True))):
        assert np.array_equal(_smap(jb, mesh2, spec)(x), _smap(lx, mesh2, spec)(x))
    groups = [[0, 2], [1, 3]]
    a = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="xla", axis_index_groups=groups), axis_name="i",
                 devices=jax.devices()[:4])(_x((4, 10), 3))
    b = jax.pmap(lambda v: lax.psum(v, "i", axis_index_groups=groups), axis_name="i",
                 devices=jax.devices()[:4])(_x((4, 10), 3))
    assert np.array_equal(a, b)


def test_axis_index_groups_from_groups(mesh):
    assert xla_lowering.axis_index_groups(mesh, ("d",), [tuple(range(N))]) is None
    assert xla_lowering.axis_index_groups(mesh, ("d",), [(0, 2, 4, 6), (1, 3, 5, 7)]) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_grad_matches_lax(mesh):
    x = _x((N * 32,), 4)

    def loss(f):
        return lambda v: jnp.sum(jnp.sin(f(v)) ** 2)
    for jb, lx in ((lambda v: jax_blink.psum(v, "d", impl="xla"), lambda v: lax.psum(v, "d")),
                   (lambda v: jax_blink.all_gather(v, "d", impl="xla", tiled=True),
                    lambda v: lax.all_gather(v, "d", tiled=True)),
                   (lambda v: jax_blink.psum_scatter(v, "d", impl="xla", tiled=True),
                    lambda v: lax.psum_scatter(v, "d", tiled=True))):
        ga = _smap(jax.grad(loss(jb)), mesh)(x)
        gb = _smap(jax.grad(loss(lx)), mesh)(x)
        assert np.array_equal(ga, gb)
    gp = jax.pmap(jax.grad(lambda v: jnp.sum(jax_blink.psum(v, "i", impl="xla") ** 2)), axis_name="i")(_x((N, 8)))
    gl = jax.pmap(jax.grad(lambda v: jnp.sum(lax.psum(v, "i") ** 2)), axis_name="i")(_x((N, 8)))
    assert np.array_equal(gp, gl)


# ------------------------------------------------------------------------------ auto and calibration
@pytest.fixture
def cal_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_BLINK_CALIBRATION", "1")
    return tmp_path


def _write(xla_s, ffi_s):
    fits = tuple(calibration.Fit(low, c, N, lat, 1e-12) for low, lat in (("xla", xla_s), ("ffi", ffi_s))
                 for c in ("allreduce", "allgather", "reducescatter"))
    calibration.save(calibration.Calibration("cpu", fits))


def _site(fn, *args):
    return jax_blink.explain(fn, *args, compile=False).sites[0]


def test_calibration_changes_auto_choice(cal_dir, mesh):
    f = jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")
    x = jnp.ones((N, 256))
    assert _site(f, x).lowering == "ffi"  # no calibration: the defaults stand
    _write(xla_s=1e-6, ffi_s=1e-3)
    s = _site(f, x)
    assert s.lowering == "xla" and "XLA's collective predicted faster" in s.why and "calibration" in s.why
    assert np.array_equal(f(x), jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")(x))
    g = _smap(lambda v: jax_blink.psum_scatter(v, "d", tiled=True), mesh)
    assert _site(g, jnp.ones(N * 64)).lowering == "xla"
    _write(xla_s=1e-3, ffi_s=1e-6)
    s = _site(f, x)
    assert s.lowering == "ffi" and "no slower than XLA" in s.why
    assert _site(jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i"), x).lowering == "ffi"


def test_corrupt_calibration_ignored_with_a_note(cal_dir, caplog):
    calibration.path().write_text("{not json")
    f = jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i")
    with caplog.at_level("WARNING", logger="jax_blink.calibration"):
        s = _site(f, jnp.ones((N, 64)))
    assert s.lowering == "ffi" and "ignored" in s.why
    assert "ignored" in (calibration.note() or "") and "jax-blink calibrate" in calibration.note()
    calibration.path().write_text(json.dumps({"version": 1, "platform": "cpu", "fits": [{"lowering": "xla"}]}))
    assert calibration.load("cpu") is None and "malformed" in calibration.note()


def test_calibration_off_by_env(cal_dir, monkeypatch):
    _write(xla_s=1e-6, ffi_s=1e-3)
    assert calibration.load("cpu") is not None and calibration.load("cuda") is None
    monkeypatch.setenv("JAX_BLINK_CALIBRATION", "0")
    assert calibration.load("cpu") is None
    monkeypatch.setenv("JAX_BLINK_CALIBRATION", "yes")
    with pytest.raises(ValueError, match="JAX_BLINK_CALIBRATION='yes': .*takes 0 or 1"):
        calibration.load("cpu")


def test_fit_recovers_a_line():
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    f = calibration.fit("ffi", "allreduce", 8, sizes, [20e-6 + s * 2e-10 for s in sizes])
    assert f.latency_s == pytest.approx(20e-6) and f.seconds_per_byte == pytest.approx(2e-10)
    flat = calibration.fit("xla", "allreduce", 8, [4096, 65536], [2e-3, 1e-3])  # noise: no negative slope
    assert flat.seconds_per_byte == 0 and flat.latency_s > 0
    with pytest.raises(ValueError, match="two or more"):
        calibration.fit("xla", "allreduce", 8, [4096], [1e-3])


def test_fit_interpolates_its_measurements_and_extends_the_line():
    """Between measured sizes the medians (log-log interpolated), outside them the fitted line; a
    measured tie within MEASURED_TIE_MARGIN goes to XLA, a clear win stays with jax_blink."""
    sizes, times = [4096, 1 << 20, 16 << 20], [100e-6, 1e-3, 20e-3]  # bent: no line passes through all
    f = calibration.fit("ffi", "allreduce", N, sizes, times)
    assert [f.time_s(s) for s in sizes] == pytest.approx(times, rel=1e-12)
    assert f.time_s(4 << 20) == pytest.approx(np.exp(np.interp(np.log(4 << 20), np.log(sizes), np.log(times))))
    assert f.time_s(64 << 20) == pytest.approx(f.latency_s + (64 << 20) * f.seconds_per_byte)
    assert calibration.fit("ffi", "allreduce", N, sizes[::-1], times[::-1]).sizes == tuple(sizes)


@pytest.mark.parametrize("ffi_over_xla, xla", [(0.99, True), (0.96, True), (0.90, False), (1.01, True)])
def test_measured_tie_goes_to_xla(cal_dir, ffi_over_xla, xla):
    fits = [calibration.fit(low, "allreduce", N, [4096, 1 << 20], [t, t]) for low, t in
            (("xla", 1e-3), ("ffi", 1e-3 * ffi_over_xla))]
    calibration.save(calibration.Calibration("cpu", tuple(fits)))
    use, why = xla_lowering.decide("cpu", "allreduce", 65536, N, "ffi", 1.0)
    assert use is xla, why
    if ffi_over_xla > 0.95 and ffi_over_xla < 1:
        assert "less than 5% faster" in why


def test_calibration_with_unordered_measurements_is_ignored(cal_dir):
    f = calibration.fit("xla", "allreduce", N, [4096, 65536], [1e-3, 2e-3]).to_dict()
    f["sizes"] = [65536, 4096]
    calibration.path().write_text(json.dumps({"version": 1, "platform": "cpu", "fits": [f]}))
    assert calibration.load("cpu") is None and "sizes must increase" in calibration.note()


def test_gpu_decision_uses_the_nccl_model():
    """On CUDA without a calibration: XLA's time is NCCL's tuner model (1 GiB on DGX H100: NVLS, faster
    than any tree schedule at its cost-model time of the ring rate); a tiny cost-model time keeps jax_blink."""
    topo = jax_blink.Topology.preset("dgx-h100")
    use, why = xla_lowering.decide("cuda", "allreduce", 1 << 30, 8, "ffi", (1 << 30) / 370e9 * 14 / 8, topo,
                                   list(range(8)))
    assert use and "nvls/Simple" in why
    use, why = xla_lowering.decide("cuda", "allreduce", 4096, 8, "ffi", 1e-6, topo, list(range(8)))
    assert not use and "ring/LL" in why
    use, why = xla_lowering.decide("cpu", "allreduce", 4096, 8, "ffi", 1.0, None, None)
    assert not use and "jax-blink calibrate" in why


def test_cuda_lowering_hands_large_allreduce_to_nccl(mesh):
    """Lowered for CUDA on a DGX H100 topology (no GPU needed): 4 KiB per GPU stays a jax_blink custom
    call, 256 MiB becomes XLA's all-reduce (NCCL's NVLS by the tuner model beats every tree schedule)."""
    f = jax.shard_map(lambda v: jax_blink.psum(v, "d", topology="dgx-h100"), mesh=mesh, in_specs=P("d"),
                      out_specs=P("d"))
    small = jax_blink.lowered_text(f, jax.ShapeDtypeStruct((N * 1024,), jnp.float32), native_auto=True)
    big = jax_blink.lowered_text(f, jax.ShapeDtypeStruct((N * (64 << 20),), jnp.float32), native_auto=True)
    assert "jax_blink_cuda" in small and "all-reduce" not in small
    assert "all-reduce" in big and "jax_blink_cuda" not in big


def test_reason_in_jax_blink_log(cal_dir, monkeypatch, caplog):
    _write(xla_s=1e-6, ffi_s=1e-3)
    monkeypatch.setenv("JAX_BLINK_LOG", "info")
    jax.clear_caches()
    with caplog.at_level("INFO", logger="jax_blink"):
        jax.pmap(lambda v: jax_blink.psum(v, "i"), axis_name="i").lower(jnp.ones((N, 32)))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "lowering xla (auto: xla, XLA's collective predicted faster" in text
