"""CUDA executor safety logic that runs without a GPU: build/driver compatibility rules, the CUDA device
table (keyed by local hardware id), the safe ``impl="auto"`` default, and ``jax-blink selftest``
without GPUs."""

import dataclasses
import subprocess
import sys
import types

import numpy as np
import pytest

import jax_blink.api  # noqa: F401  (registers the lowerings)
from jax_blink import _native, gpu_selftest
from jax_blink import lowering as _lowering
from jax_blink.errors import BlinkError
from jax_blink.lowering import ffi as ffi_lowering
from jax_blink.lowering import selftest_record
from jax_blink.primitives import choose_lowering

cpu = _native.cpu
FAT = "75-real,80-real,86-real,89-real,90"


@pytest.mark.parametrize("cc,ok", [((7, 0), False), ((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 7), True),
                                   ((8, 9), True), ((9, 0), True), ((10, 0), True), ((12, 0), True), ((6, 1), False)])
def test_arch_support_fat_binary(cc, ok):
    why = cpu.arch_support_reason(FAT, *cc)
    assert (why == "") == ok, why
    if not ok:
        assert f"{cc[0]}.{cc[1]}" in why and "JAX_BLINK_CUDA_ARCH" in why


def test_arch_support_cubin_only_and_ptx_only():
    assert cpu.arch_support_reason("90-real", 10, 0) != ""     # sm_90 cubin does not run on sm_100
    assert cpu.arch_support_reason("90-real", 9, 0) == ""
    assert cpu.arch_support_reason("80-virtual", 9, 0) == ""   # PTX JIT-compiles upwards
    assert cpu.arch_support_reason("80-virtual", 7, 5) != ""
    assert cpu.arch_support_reason("86-real", 8, 0) != ""      # a cubin never runs on a lower minor
    assert cpu.arch_support_reason("70-real;75-real", 7, 0) == ""  # ';' separated as CMake writes it


def test_driver_support():
    assert cpu.driver_support_reason(13000, 13000) == ""
    assert cpu.driver_support_reason(13020, 13000) == ""
    assert cpu.driver_support_reason(12080, 12040) == ""
    assert "CUDA 12.4" in cpu.driver_support_reason(12040, 13000)
    assert "no NVIDIA driver" in cpu.driver_support_reason(0, 13000)


def _dev(id, hw, proc=0):
    return types.SimpleNamespace(id=id, local_hardware_id=hw, process_index=proc)


def test_cuda_device_table_keyed_by_local_hardware_id():
    # A permuted mesh of global ids 10..13 on CUDA ordinals 3, 2, 1, 0 (e.g. a visible-device subset)
    devices = [_dev(10, 3), _dev(11, 2), _dev(12, 1), _dev(13, 0)]
    table = np.array([(12, 0, 0), (10, 0, 1), (13, 0, 2), (11, 0, 3)], np.int64).reshape(-1)
    got = ffi_lowering.cuda_device_table(table, devices, 0).reshape(-1, 3)
    assert got.tolist() == [[1, 0, 0], [3, 0, 1], [0, 0, 2], [2, 0, 3]]
    # the native side finds each rank by that key: run a meeting whose participants arrive as CUDA ordinals
    from jax_blink.planning import plan
    from jax_blink.schedule import build_schedule, execute
    from jax_blink.topology import Topology
    s = build_schedule(plan(Topology.host(4), "allreduce"), 100, chunk_elems=10)
    xs = [np.arange(100, dtype=np.float32) * (r + 1) for r in range(4)]
    ordinal_of_rank = [1, 3, 0, 2]
    outs = [np.zeros(100, np.float32) for _ in range(4)]
    err = cpu.simulate(s.to_array(), got.reshape(-1), ordinal_of_rank, xs, outs, ["float32"] * 4, 5000, 77)
    assert err == ""
    assert np.stack(outs).tobytes() == execute(s, np.stack(xs)).tobytes()


@pytest.mark.parametrize("devices,match", [
    ([_dev(10, 0), _dev(11, 1, proc=1)], "belongs to process 1"),
    ([_dev(10, 0), _dev(11, 0)], "share local hardware id 0"),
    ([_dev(10, 0), _dev(11, None)], "no local hardware id"),
    ([_dev(10, 0)], "not in the mesh"),
])
def test_cuda_device_table_refuses_what_the_handler_could_not_resolve(devices, match):
    table = np.array([(10, 0, 0), (11, 0, 1)], np.int64).reshape(-1)
    with pytest.raises(BlinkError, match=match):
        ffi_lowering.cuda_device_table(table, devices, 0)


@pytest.fixture
def fake_cuda_ffi(monkeypatch, tmp_path):
    """An 'ffi' rule registered for platform cuda, a private record file, no env override."""
    rule = lambda *a, **k: None  # noqa: E731
    usable = dataclasses.replace(_lowering.record("ffi", "cuda"), rule=rule, unavailable=None)
    monkeypatch.setitem(_lowering.LOWERINGS["ffi"], "cuda", usable)
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_BLINK_CUDA_NATIVE", raising=False)
    return rule


def test_auto_uses_ppermute_on_gpus_until_the_selftest_passed(fake_cuda_ffi, monkeypatch):
    key = {"gpus": ["NVIDIA H200 (sm_90)"], "driver": 13000, "build": "abc"}
    monkeypatch.setattr(selftest_record, "machine_key", lambda: key)
    with pytest.warns(UserWarning, match="jax-blink selftest"):
        assert choose_lowering("auto", ["cuda"]).name == "ppermute"
    assert choose_lowering("ffi", ["cuda"]).name == "ffi"      # explicit choice is honoured
    assert choose_lowering("auto", ["cpu"]).name == "ffi"      # CPU is not gated
    path = selftest_record.record_pass(key)
    assert path.parent == selftest_record.record_path().parent and path.exists()
    assert choose_lowering("auto", ["cuda"]).name == "ffi"
    # another driver (or GPU, or build) needs its own pass
    monkeypatch.setattr(selftest_record, "machine_key", lambda: dict(key, driver=13010))
    assert choose_lowering("auto", ["cuda"]).name == "ppermute"


def test_env_overrides_the_gate(fake_cuda_ffi, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CUDA_NATIVE", "1")
    assert choose_lowering("auto", ["cuda"]).name == "ffi"
    monkeypatch.setenv("JAX_BLINK_CUDA_NATIVE", "0")
    assert choose_lowering("auto", ["cuda"]).name == "ppermute"


def test_selftest_without_gpus_says_so_in_one_line():
    if selftest_record.machine_key() is not None:
        pytest.skip("a CUDA GPU is visible here")
    p = subprocess.run([sys.executable, "-m", "jax_blink.cli", "selftest"], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 2 or "No module named" in p.stderr:
        code = "import sys; from jax_blink.cli import main; sys.exit(main(['selftest']))"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "nothing to test" in lines[0], p.stdout
    assert "Traceback" not in p.stderr
    res = gpu_selftest.selftest(out=lambda *_: None)
    assert res.status == 2 and not res and not res.passed


@pytest.mark.parametrize("msg,cls", [
    ("jax_blink: collective timed out after 0.3 s: device(s) 12 (rank 2) never arrived", 2),
    ("jax_blink CUDA error at cudaMalloc (staging scratch): cudaErrorMemoryAllocation (out of memory)", 1),
    ("jax_blink: device 3 cannot join the collective: jax_blink CUDA error at reduce: ...", 1),
    ("jax_blink: device 3 cannot join the collective: it is not in the collective's device table", 0),
    ("jax_blink: participants disagree: device 0 brought 8 x f32, device 1 brought 4 x f32", 0),
])
def test_error_classes_give_ffi_error_codes(msg, cls):
    """0 -> kInvalidArgument, 1 -> kInternal, 2 -> kDeadlineExceeded (the CUDA and CPU handlers)."""
    assert cpu.error_class(msg) == cls


def test_selftest_flow_with_a_cpu_backed_fake_gpu(monkeypatch, tmp_path):
    """The self-test's own logic (checks, table, record) end to end, with `_cuda` replaced by a fake
    whose `execute` runs the schedule on the native CPU executor: a pass is recorded and then lets
    impl='auto' choose the native executor."""
    calls = []

    def execute(schedule, dtype, inputs, outputs, iters, cache_key, leaf_sizes=(), in_place=False):
        n = len(inputs)
        table = np.asarray([(d, 0, r) for r, d in enumerate(range(n))], np.int64).reshape(-1)
        if in_place:  # the executor's results are its operands: outputs start as copies of the inputs
            for i, o in zip(inputs, outputs):
                o[...] = i
            inputs = outputs
        err = cpu.simulate(schedule, table, list(range(n)), inputs, outputs, [dtype] * n, 5000, cache_key,
                           leaf_sizes=list(leaf_sizes), in_place=in_place)
        calls.append((dtype, iters, len(leaf_sizes), in_place))
        return 1e-3, err

    so = tmp_path / "_cuda_fake.so"
    so.write_bytes(b"fake module")
    fake = types.SimpleNamespace(
        __file__=str(so), device_names=lambda: ["Fake GPU (sm_90)"], driver_version=lambda: 13000,
        check_compatibility=lambda: "", built_cuda_version=lambda: 13000, built_architectures=lambda: "90",
        execute=execute)
    monkeypatch.setattr(_native, "cuda", fake)
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    lines = []
    res = gpu_selftest.selftest(out=lines.append)
    assert res.status == 0 and res and res.problems == (), "\n".join(lines)
    text = "\n".join(lines)
    assert "PASSED" in text and "recorded in" in text
    assert text.count(": ok") == 8                       # (3 collectives + buckets) x (peer, forced staging)
    assert len([c for c in calls if c[1] == 0 and not c[2]]) == 6 * len(gpu_selftest.DTYPES)
    nb = len(gpu_selftest.BUCKET_LEAVES)                 # buckets: 3 collectives x dtypes x (separate, in place)
    assert [c[2:] for c in calls if c[2]] == [(nb, False), (nb, True)] * (2 * 3 * len(gpu_selftest.BUCKET_DTYPES))
    assert "busbw" in text and "134217728" in text       # the nccl-tests-style table reached 128 MiB
    assert selftest_record.has_passed()
    # a wrong executor fails the self-test and records nothing
    (tmp_path / "selftest.json").unlink()
    fake.execute = lambda s, d, i, o, it, k, **kw: (1e-3, "")  # leaves outputs unwritten
    res = gpu_selftest.selftest(out=lambda *_: None)
    assert res.status == 1 and not res and res.problems and all(isinstance(p, str) for p in res.problems)
    assert not selftest_record.has_passed()


def test_cuda_lowering_is_one_aliased_custom_call_per_bucket(monkeypatch):
    """A pytree psum lowered for CUDA (cross-platform lowering, no GPU needed) is one jax_blink_cuda
    custom call over every leaf, each result aliased to its operand when the operand is computed in
    the function (as on CPU), not aliased when it is the function's argument."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_blink
    usable = dataclasses.replace(_lowering.record("ffi", "cuda"), unavailable=None)
    monkeypatch.setitem(_lowering.LOWERINGS["ffi"], "cuda", usable)
    # CPU devices have no CUDA ordinal: the table stays keyed by device id here
    monkeypatch.setattr(ffi_lowering, "cuda_device_table",
                        lambda table, devices, p: np.asarray(table, np.int64).reshape(-1))
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    topo = jax_blink.PRESETS["dgx1v"]().subset([0, 1, 2, 3])

    def lowered(computed):
        def step(t):
            if computed:
                t = jax.tree.map(lambda v: v * 2, t)
            return jax_blink.psum(t, "d", topology=topo, impl="ffi")
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        x = {"a": jnp.ones((4 * 37,), jnp.float32), "b": jnp.ones((4 * 5, 3), jnp.float32)}
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "custom_call @jax_blink_cuda" in line]

    for computed in (False, True):
        calls = lowered(computed)
        assert len(calls) == 1, calls
        assert re.search(r"@jax_blink_cuda\(%[\w#]+, %[\w#]+\)", calls[0]), calls[0]
        assert calls[0].count("#stablehlo.output_operand_alias<") == (2 if computed else 0), calls[0]
