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
from jax_blink.dispatch import choose_lowering
from jax_blink.errors import BlinkError
from jax_blink.lowering import ffi as ffi_lowering
from jax_blink.lowering import selftest_record

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
    # an R535-R570 fleet (CUDA 12.2-12.8) under a CUDA 13 build: told about the 11.8 build
    why = cpu.driver_support_reason(12080, 13000)
    assert "CUDA 13.0 or later" in why and "scripts/build_cuda118.sh" in why
    # the CUDA 11.8 build (the DGX-1 / V100 fleets' drivers: R450 reports 11.0, R470 11.4, R535 12.2)
    for driver in (11000, 11040, 12020):
        assert cpu.driver_support_reason(driver, 11080) == ""
    assert "CUDA 10.2" in cpu.driver_support_reason(10020, 11080)
    assert "build_cuda118" not in cpu.driver_support_reason(10020, 11080)  # 11.8 would not run there either


def test_arch_support_names_the_11_8_build_for_v100():
    """A V100 under nvcc 13's fat binary: the reason names the toolkit that targets sm_70; the 11.8 build's
    architectures (CMake's default list for nvcc 11.8) run on V100, A100 and H100/H200."""
    why = cpu.arch_support_reason(FAT, 7, 0)
    assert "nvcc 13 cannot target sm_70" in why and "build_cuda118.sh" in why
    assert "build_cuda118" not in cpu.arch_support_reason("90-real", 8, 0)
    for cc in ((7, 0), (8, 0), (9, 0)):
        assert cpu.arch_support_reason("70-real;75-real;80-real;86-real;89-real;90", *cc) == ""


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


def test_cuda_device_table_drops_groups_of_other_processes():
    # A hierarchical local phase lists every process's groups (one program in every process): process
    # 1 keeps its own group's rows (hardware ids), process 0's group is dropped; and the other way round.
    devices = [_dev(0, 0), _dev(1, 1), _dev(2048, 0, proc=1), _dev(2049, 1, proc=1)]
    table = np.array([(0, 0, 0), (1, 0, 1), (2048, 1, 0), (2049, 1, 1)], np.int64).reshape(-1)
    assert ffi_lowering.cuda_device_table(table, devices, 1).reshape(-1, 3).tolist() == [[0, 1, 0], [1, 1, 1]]
    assert ffi_lowering.cuda_device_table(table, devices, 0).reshape(-1, 3).tolist() == [[0, 0, 0], [1, 0, 1]]


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
    monkeypatch.setenv("JAX_BLINK_CUDA_NATIVE", "true")  # a flag's words are read as 0 / 1
    assert choose_lowering("auto", ["cuda"]).name == "ffi"
    for junk in ("yes", "2", "nan"):  # refused, not taken as unset
        monkeypatch.setenv("JAX_BLINK_CUDA_NATIVE", junk)
        with pytest.raises(BlinkError, match=f"JAX_BLINK_CUDA_NATIVE='{junk}': JAX_BLINK_CUDA_NATIVE takes 0 or 1"):
            choose_lowering("auto", ["cuda"])


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


@pytest.mark.slow
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


def _lowered_cuda(computed, *, dialect="hlo", impl="ffi", scale=1, **kw):
    """The CUDA lowering of a pytree psum over 4 host CPU devices standing in for 4 V100s (leaves of
    148 and 60 float32 per device times ``scale``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_blink
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    topo = jax_blink.PRESETS["dgx1v"]().subset([0, 1, 2, 3])

    def step(t):
        if computed:
            t = jax.tree.map(lambda v: v * 2, t)
        return jax_blink.psum(t, "d", topology=topo, impl=impl)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = {"a": jnp.ones((4 * 37 * scale,), jnp.float32), "b": jnp.ones((4 * 5 * scale, 3), jnp.float32)}
    return jax_blink.lowered_text(f, x, platform="cuda", dialect=dialect, **kw)


def test_cuda_lowering_is_one_aliased_custom_call_per_bucket_on_its_own_stream():
    """A pytree psum lowered for CUDA on this CPU-only machine (``jax_blink.lowered_text``: no driver,
    no CUDA module, no patching) is one jax_blink_cuda custom call over every leaf, each result aliased
    to its operand when the operand is computed in the function (not when it is the function's
    argument), inside a call that carries the stream annotation XLA:GPU makes async (call-start /
    call-done on stream 1), in HLO and StableHLO alike."""
    import re
    assert "cuda" not in ffi_lowering.REGISTERED          # the CUDA target cannot run here
    for computed in (False, True):
        hlo = _lowered_cuda(computed)
        calls = [ln for ln in hlo.splitlines() if 'custom_call_target="jax_blink_cuda"' in ln]
        assert len(calls) == 1, calls
        assert re.search(r"custom-call\(\S+, \S+\)", calls[0]), calls[0]       # both leaves, one call
        aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}, api_version", calls[0])
        assert (aliasing.group(1) if aliasing else "") == ("{0}: (0, {}), {1}: (1, {})" if computed else ""), calls[0]
        wrapper = re.findall(r"= \(f32\[37\]\{0\}, f32\[5,3\]\{1,0\}\) call\(.*to_apply=(jax_blink_cuda_call\S*), "
                             r"frontend_attributes=\{(.*?)\}", hlo)
        assert wrapper == [(wrapper[0][0], '_xla_stream_annotation="1",inlineable="false"')], hlo
        # the one annotated call (HLO's converter copies the attributes onto its get-tuple-elements)
        assert [ln for ln in hlo.splitlines() if "_xla_stream_annotation" in ln and "get-tuple-element(" not in ln] \
            == [ln for ln in hlo.splitlines() if "to_apply=jax_blink_cuda_call" in ln]
        body = hlo[hlo.index(wrapper[0][0].rstrip(",") + " {"):]
        assert 'custom_call_target="jax_blink_cuda"' in body.split("\n}")[0]   # the call wraps the custom call
    text = _lowered_cuda(True, dialect="stablehlo")
    assert re.search(r'func\.call @jax_blink_cuda_call\w*\(%\S+, %\S+\) \{mhlo\.frontend_attributes = '
                     r'\{_xla_stream_annotation = "1", inlineable = "false"\}\}', text), text
    assert text.count("stablehlo.custom_call @jax_blink_cuda(") == 1
    assert text.count("#stablehlo.output_operand_alias<") == 2


def test_cuda_stream_setting(monkeypatch):
    """JAX_BLINK_CUDA_STREAM picks the annotated stream, 0 keeps the plain custom call (compute
    stream), anything else fails at lowering naming the variable."""
    monkeypatch.setenv(ffi_lowering.ENV_STREAM, "3")
    assert '_xla_stream_annotation="3"' in _lowered_cuda(True)
    monkeypatch.setenv(ffi_lowering.ENV_STREAM, "0")
    hlo = _lowered_cuda(True)
    assert "_xla_stream_annotation" not in hlo and hlo.count('custom_call_target="jax_blink_cuda"') == 1
    for bad in ("-1", "x", "64", "1.5"):
        monkeypatch.setenv(ffi_lowering.ENV_STREAM, bad)
        with pytest.raises(BlinkError, match="JAX_BLINK_CUDA_STREAM=.*takes an integer in 0..63"):
            _lowered_cuda(True)


def test_lowered_text_auto_follows_the_selftest_gate_and_leaves_nothing_behind(monkeypatch):
    """impl='auto' in a CUDA lowering takes the native call only where the self-test would allow it
    (native_auto=True), else the fastest of the rest by the cost model (here XLA's all-reduce);
    afterwards the CUDA records are unusable here again (no lowering_only left active) and bad
    arguments fail up front."""
    import jax

    import jax_blink
    monkeypatch.delenv(ffi_lowering.ENV_NATIVE, raising=False)
    # 13.6 MB per GPU: a size where the cost model keeps jax_blink's schedule over NCCL's choice on these
    # NVLinks (at 832 B it hands the site to XLA's all-reduce, checked last)
    native = _lowered_cuda(True, impl="auto", native_auto=True, scale=65536)
    portable = _lowered_cuda(True, impl="auto", native_auto=False, scale=65536)
    assert native.count('custom_call_target="jax_blink_cuda"') == 1 and "collective-permute(" not in native
    # without the native executor, the portable rounds are slower than NCCL's modelled ring here: XLA's
    assert 'custom_call_target="jax_blink_cuda"' not in portable and "all-reduce(" in portable
    small = _lowered_cuda(True, impl="auto", native_auto=True)
    assert "jax_blink_cuda" not in small and "all-reduce(" in small
    assert _lowering.find_lowering("ffi", "cuda") is None and not _lowering._LOWERING_ONLY
    assert ffi_lowering._ASSUMED == {}
    with pytest.raises(BlinkError, match="platform must be one of"):
        jax_blink.lowered_text(lambda v: v, np.ones(4), platform="gpu")
    with pytest.raises(BlinkError, match="dialect must be 'hlo' or 'stablehlo'"):
        jax_blink.lowered_text(lambda v: v, np.ones(4), dialect="mlir")
    with pytest.raises(BlinkError, match="fn must be a function"):
        jax_blink.lowered_text(3, np.ones(4))
    assert "custom_call" not in jax_blink.lowered_text(jax.jit(lambda v: v + 1), np.ones(4), platform="cpu")
