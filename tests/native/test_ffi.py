"""The native FFI executor (ffi/, impl="ffi") on 8 host CPU devices.

The psum/broadcast/reduce equality matrix against lax runs with impl="ffi" in tests/jax/test_psum.py
(parametrised over every registered impl). Here: the native executor against the NumPy reference
``jax_blink.schedule.execute`` (bitwise, every dtype), the rendezvous errors (absent participant ->
timeout naming it, mismatched dtype/size, malformed schedules), a call site inside ``lax.scan``, and
that the CUDA module compiles where nvcc exists.
"""

import hashlib
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_blink
import jax_blink.api  # noqa: F401  (registers the lowerings)
from jax_blink import _native
from jax_blink.errors import BlinkError
from jax_blink.lowering import ffi as ffi_lowering
from jax_blink.lowering.gpu_program_check import random_operand
from jax_blink.planning import plan
from jax_blink.schedule import build_schedule, execute
from jax_blink.topology import Topology

ROOT = pathlib.Path(__file__).resolve().parents[2]
cpu = _native.cpu


def test_native_cpu_module_and_registration():
    assert cpu is not None, _native.cpu_error
    assert ffi_lowering.REGISTERED.get("cpu") == "jax_blink_cpu", ffi_lowering.UNAVAILABLE


def table_for(n, ids=None):
    ids = list(range(n)) if ids is None else ids
    return np.asarray([(d, 0, r) for r, d in enumerate(ids)], np.int64).reshape(-1)


def schedule_for(n, collective="allreduce", nelems=1000, root=None, chunk_elems=64, topo=None):
    p = plan(topo or Topology.host(n), collective, root=root)
    return build_schedule(p, nelems, chunk_elems=chunk_elems)


def run_native(sched, xs, *, devices=None, dtypes=None, timeout_ms=5000, call_site=1):
    n = sched.nranks
    devices = list(range(n)) if devices is None else devices
    outs = [np.full_like(x, 7) for x in xs]
    names = dtypes or [np.dtype(x.dtype).name for x in xs]
    # nanobind takes plain numpy dtypes: hand bfloat16 (ml_dtypes) over as its uint16 bits.
    def raw(a):
        return a.view(np.uint16) if a.dtype.name == "bfloat16" else a
    err = cpu.simulate(sched.to_array(), table_for(n), devices, [raw(x) for x in xs], [raw(o) for o in outs],
                       names, timeout_ms, call_site)
    return err, np.stack(outs) if not err else None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32",
                                   "int64", "uint8", "uint16", "uint32", "uint64", "complex64", "complex128"])
def test_executor_bitwise_equals_reference(dtype):
    """Every dtype, the 8-device all-reduce with many chunks, against the row-by-row NumPy spec."""
    dt = jnp.dtype(dtype)
    sched = schedule_for(8, nelems=70_001, chunk_elems=4096)
    xs = [random_operand(np.random.default_rng(r), (70_001,), dt) for r in range(8)]
    err, got = run_native(sched, xs, dtypes=[dt.name] * 8)
    assert err == ""
    want = execute(sched, np.stack(xs))
    assert got.tobytes() == want.tobytes()
    assert all(got[r].tobytes() == got[0].tobytes() for r in range(8))


@pytest.mark.parametrize("collective,root", [("allreduce", None), ("broadcast", 4), ("reduce", 2)])
@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_executor_collectives_odd_sizes(collective, root, n):
    root = None if root is None else root % n
    topo = jax_blink.PRESETS["dgx1v"]().subset(list(range(n)))
    sched = schedule_for(n, collective, nelems=12_345, root=root, chunk_elems=1000, topo=topo)
    xs = [random_operand(np.random.default_rng(r), (12_345,), "float32") for r in range(n)]
    err, got = run_native(sched, xs)
    assert err == ""
    assert got.tobytes() == execute(sched, np.stack(xs)).tobytes()


@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
def test_executor_shard_forms(collective):
    """One-leaf sharded calls as the CPU lowering makes them (one star per owner): all-gather from the
    rank's shard, reduce-scatter into the rank's shard alone, bitwise equal to the reference."""
    from jax_blink.lowering import shared_memory_stars as _shared_memory_stars
    n, m = 8, 12_347  # a shard of odd length: tiles end unaligned
    sched = build_schedule(_shared_memory_stars(plan(Topology.host(n), collective)), n * m, chunk_elems=5000)
    rng = np.random.default_rng(5)
    full = [rng.standard_normal(n * m).astype(np.float32) for _ in range(n)]
    want = execute(sched, np.stack(full))
    if collective == "allgather":
        ins = [full[r][r * m:(r + 1) * m].copy() for r in range(n)]
        outs = [np.full(n * m, 7, np.float32) for _ in range(n)]
        expect = want
    else:
        ins = full
        outs = [np.full(m, 7, np.float32) for _ in range(n)]
        expect = np.stack([want[r, r * m:(r + 1) * m] for r in range(n)])
    err = cpu.simulate(sched.to_array(), table_for(n), list(range(n)), ins, outs, ["float32"] * n, 5000, 31)
    assert err == ""
    assert np.stack(outs).tobytes() == expect.tobytes()


@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
def test_executor_block_order(collective):
    """The hierarchical lowering's block order: rank r's block of the schedule is P sub-blocks that
    sit interleaved in rank order in the full buffer (virtual block k -> buffer block order[k], here
    the (local rank, process) -> (process, local rank) transpose of 4 local ranks x 3 processes). The
    executor places (all-gather) or reads (reduce-scatter) them there itself: equal to the NumPy
    transpose of the plain shard-form result, bitwise; a bad order is refused, naming it."""
    from jax_blink.lowering import shared_memory_stars as _shared_memory_stars
    L, Pn, m = 4, 3, 1_001  # blocks of odd length: tiles end unaligned
    sched = build_schedule(_shared_memory_stars(plan(Topology.host(L), collective)), L * Pn * m, chunk_elems=900)
    order = [qi * L + i for i in range(L) for qi in range(Pn)]  # virtual k = i * P + qi -> buffer block
    rng = np.random.default_rng(6)
    full = [rng.standard_normal(L * Pn * m).astype(np.float32) for _ in range(L)]
    def to_buffer(v):  # virtual (i, qi) blocks -> the buffer's (qi, i) order
        return v.reshape(L, Pn, m).transpose(1, 0, 2).reshape(-1)
    if collective == "allgather":
        ins = [full[r][r * Pn * m:(r + 1) * Pn * m].copy() for r in range(L)]
        outs = [np.full(L * Pn * m, 7, np.float32) for _ in range(L)]
        want = np.stack([to_buffer(np.concatenate(ins)) for _ in range(L)])
    else:
        ins = [to_buffer(v) for v in full]  # the caller's buffer in rank order
        outs = [np.full(Pn * m, 7, np.float32) for _ in range(L)]
        total = np.sum(np.stack(full).astype(np.float64), axis=0)
        want = np.stack([total[r * Pn * m:(r + 1) * Pn * m] for r in range(L)])
    err = cpu.simulate(sched.to_array(), table_for(L), list(range(L)), ins, outs, ["float32"] * L, 5000, 33,
                       block_order=order)
    assert err == ""
    got = np.stack(outs)
    if collective == "allgather":
        assert got.tobytes() == want.tobytes()
    else:  # the star sums in the executor's order: float32 rounding, not bitwise vs float64
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
        plain = [np.full(Pn * m, 7, np.float32) for _ in range(L)]
        assert cpu.simulate(sched.to_array(), table_for(L), list(range(L)), full, plain, ["float32"] * L, 5000,
                            34) == ""
        assert got.tobytes() == np.stack(plain).tobytes()  # the same sums as the plain order: bitwise
    bad = cpu.simulate(sched.to_array(), table_for(L), list(range(L)), ins, [o.copy() for o in outs],
                       ["float32"] * L, 5000, 35, block_order=[0] * len(order))
    assert "the block order is not a permutation of 0..11" in bad, bad


def test_reduce_scatter_shard_output_needs_owner_writes():
    """A reduce-scatter schedule that keeps partial sums at other ranks (a packing with relaying
    ranks) cannot return the shard alone: every device reports why, nothing is written."""
    n, m = 8, 1000
    sched = build_schedule(plan(Topology.preset("dgx1v"), "reducescatter"), n * m, chunk_elems=500)
    assert any(int(sched.reduce_parent[s, r]) not in (-1, int(sched.seg_root[s]))
               for s in range(len(sched.seg_root)) for r in range(n))  # some rank relays
    ins = [np.ones(n * m, np.float32) for _ in range(n)]
    outs = [np.full(m, 7, np.float32) for _ in range(n)]
    err = cpu.simulate(sched.to_array(), table_for(n), list(range(n)), ins, outs, ["float32"] * n, 5000, 32)
    assert "needs a schedule whose transfers all write into their segment's root" in err, err
    assert all((o == 7).all() for o in outs)


def test_absent_participant_times_out_naming_it():
    sched = schedule_for(4, nelems=100)
    xs = [np.ones(100, np.float32)] * 4
    t0 = time.monotonic()
    n = sched.nranks
    outs = [np.zeros(100, np.float32) for _ in range(3)]
    err = cpu.simulate(sched.to_array(), table_for(n, [10, 11, 12, 13]), [10, 11, 13], xs[:3], outs,
                       ["float32"] * 3, 300, 2)
    assert time.monotonic() - t0 < 5
    assert "timed out after 0.3 s" in err and "device(s) 12 (rank 2) never arrived" in err, err


@pytest.mark.parametrize("other", [("float64", 100), ("float32", 99)])
def test_mismatched_dtype_or_size_is_an_error(other):
    sched = schedule_for(2, nelems=100)
    dt, size = other
    xs = [np.ones(100, np.float32), np.ones(size, dt)]
    err, _ = run_native(sched, xs, call_site=3 if size == 100 else 4)
    # Which check reports first depends on arrival order: the meeting's comparison of participants,
    # or (wrong size) the late device's own operand-vs-schedule check. Both name the mismatch.
    disagree = "participants disagree" in err and "every device must call" in err
    wrong_size = size != 100 and f"operand has {size} elements but the schedule was built for 100" in err
    assert disagree or wrong_size, err


def test_malformed_schedules_are_rejected():
    good = schedule_for(4, nelems=500).to_array()
    assert cpu.validate(good) == ""

    def changed(index, value):
        out = good.copy()
        out[index] = value
        return out

    bad_magic = changed(0, 1)
    bad_version = changed(1, 9)
    big_header = changed(7, 10**12)
    bad_rank = changed(-2, 99)  # last transfer's dst
    cases = {"bad magic": bad_magic, "version 9": bad_version, "exceed the array length": big_header,
             "bad src/dst rank": bad_rank, "the header needs 8": good[:5], "announces": good[:-3]}
    for needle, arr in cases.items():
        msg = cpu.validate(np.ascontiguousarray(arr))
        assert needle in msg and "invalid schedule" in msg, (needle, msg)


def test_timeout_inside_jax_names_the_absent_device(monkeypatch):
    """A device made absent (test hook JAX_BLINK_TEST_ABSENT_DEVICE) -> the call fails within the bound,
    naming the device and the call site's source line."""
    monkeypatch.setenv("JAX_BLINK_TIMEOUT_S", "2")
    monkeypatch.setenv("JAX_BLINK_TEST_ABSENT_DEVICE", "5")
    line = inspect.currentframe().f_lineno + 1
    f = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"timed out after 2 s: device\(s\) 5 \(rank 5\) never arrived") as e:
        jax.block_until_ready(f(np.ones((8, 37), np.float32)))
    assert time.monotonic() - t0 < 2 + 15
    assert "call site jax_blink.psum[allreduce float32 148B " in str(e.value), str(e.value)
    assert f" ffi] at {__file__}:{line} (" in str(e.value), str(e.value)


def test_psum_inside_scan_permuted_mesh():
    """One call site executed many times per run: generations keep the meetings apart."""
    mesh = Mesh(np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 4, 6]], ("i",))

    def body(v, impl):
        def step(c, _):
            c = 0.5 * (impl(c, "i") / 8.0 + c)
            return c, c.sum()
        return lax.scan(step, v, None, length=6)

    def run(psum):
        f = jax.shard_map(lambda v: body(v, psum), mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i")))
        return jax.jit(f)(x)

    x = np.random.default_rng(0).standard_normal((8 * 3, 129)).astype(np.float32)
    got = run(lambda v, a: jax_blink.psum(v, a, impl="ffi"))
    want = run(lax.psum)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-3)


def test_call_site_ids_are_deterministic_and_distinct():
    f = jax.jit(jax.shard_map(lambda v: (jax_blink.psum(v, "i", impl="ffi"), jax_blink.psum(v, "i", impl="ffi")),
                              mesh=Mesh(np.array(jax.devices()), ("i",)), in_specs=P("i"), out_specs=P("i")))
    x = np.ones((8, 16), np.float32)
    txt1 = f.lower(x).as_text()
    txt2 = f.lower(x).as_text()
    import re
    ids1 = re.findall(r"call_site = (-?\d+)", txt1)
    assert len(ids1) == 2 and ids1[0] != ids1[1], ids1
    assert ids1 == re.findall(r"call_site = (-?\d+)", txt2)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _tree_digest(h, paths) -> None:
    for f in sorted(paths):
        h.update(str(f).encode() + f.read_bytes())


@pytest.fixture(scope="module")
def nvcc_objects():
    """{name: (object path, nvcc stderr or "")}: the CUDA executor (.cu), its XLA FFI handler (.cc,
    against this jax's FFI headers) and the GPU harness compiled by nvcc for sm_90, all at once (one
    process each), each kept in the temp dir under a hash of its command, nvcc's
    version and every file of ffi/src (and, for the executor and the handler, of jax's FFI include directory), as
    the sanitizer builds are: unchanged inputs are not compiled again, any changed one is."""
    nvcc, src, inc = _nvcc(), ROOT / "ffi" / "src", pathlib.Path(jax.ffi.include_dir())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    base = pathlib.Path(tempfile.gettempdir()) / f"jax_blink_nvcc_{os.getuid()}"
    jobs = {"cuda_executor": (src / "cuda_executor.cu", ["-I", str(src), "-I", str(inc)], [inc]),
            "cuda_handler": (src / "cuda_handler.cc", ["-I", str(src), "-I", str(inc)], [inc]),
            "gpu_check": (ROOT / "ffi" / "tests" / "gpu_check.cu", ["-I", str(src)], [])}
    out, procs = {}, {}
    for name, (cu, flags, extra) in jobs.items():
        h = hashlib.sha256((version + repr(flags)).encode())
        _tree_digest(h, [cu, *(p for d in (src, *extra) for p in d.rglob("*") if p.is_file())])
        obj = base / h.hexdigest()[:16] / f"{name}.o"
        out[name] = (obj, "")
        if not obj.exists():
            obj.parent.mkdir(parents=True, exist_ok=True)
            tmp = obj.with_suffix(f".tmp{os.getpid()}")
            cmd = [nvcc, "-std=c++17", "-O1", "-arch=sm_90", "-c", str(cu), *flags, "-o", str(tmp)]
            procs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), tmp)
    for name, (p, tmp) in procs.items():
        _, err = p.communicate(timeout=900)
        if p.returncode == 0:
            os.replace(tmp, out[name][0])  # atomic: a concurrent session never reads a half-written object
        else:
            out[name] = (out[name][0], err or f"nvcc exit status {p.returncode}")
    return out


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA module cannot be compiled here")
def test_cuda_module_compiles(nvcc_objects):
    """The CUDA executor (.cu) and its XLA FFI handler (host code through nvcc's host compiler, with the
    CUDA runtime's headers) compile with nvcc (no GPU needed)."""
    for name in ("cuda_executor", "cuda_handler"):
        obj, err = nvcc_objects[name]
        assert not err, (name, err[-4000:])
        assert obj.stat().st_size > 10_000, name


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the gpu_check harness cannot be compiled here")
def test_gpu_check_harness_compiles(nvcc_objects):
    """The GPU harness (the interpreter's checks, launch and upload counters, its add kernel on the
    shared arithmetic) compiles against the executor's header."""
    obj, err = nvcc_objects["gpu_check"]
    assert not err, err[-4000:]
    assert obj.stat().st_size > 0


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "abc", "1e300"])
def test_bad_timeout_env_is_a_clear_error(monkeypatch, value):
    """JAX_BLINK_TIMEOUT_S=inf once overflowed into an instant timeout; bad values now fail at lowering."""
    monkeypatch.setenv("JAX_BLINK_TIMEOUT_S", value)
    f = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")
    with pytest.raises(BlinkError, match=rf"JAX_BLINK_TIMEOUT_S={re.escape(repr(value))}: .*a finite number in \(0, "):
        f(np.ones((8, 3 + len(value)), np.float32))


@pytest.mark.parametrize("name,value", [("JAX_BLINK_CPU_THREADS", "abc"), ("JAX_BLINK_CPU_THREADS", "0"),
                                        ("JAX_BLINK_CPU_THREADS", "100000"), ("JAX_BLINK_CPU_STREAM", "2"),
                                        ("JAX_BLINK_CPU_HUGEPAGES", "yes"), ("JAX_BLINK_ALIAS", "-1"),
                                        ("JAX_BLINK_CPU_ISA", "sse9"), ("JAX_BLINK_CPU_ISA", "\xa0avx2"),
                                        ("JAX_BLINK_CPU_THREADS", "1_0"), ("JAX_BLINK_CPU_THREADS", "\u0661")])
def test_bad_cpu_executor_env_is_a_clear_error(monkeypatch, name, value):
    """The executor's C++ side can only ignore a setting it cannot use; the lowering names it instead."""
    monkeypatch.setenv(name, value)
    f = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")
    with pytest.raises(BlinkError, match=rf"{name}={re.escape(repr(value))}: .*{name} takes "):
        f(np.ones((8, 5 + len(name) + len(value)), np.float32))  # a new shape: a new lowering


def test_good_cpu_executor_env_values_pass(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CPU_THREADS", " 2 ")
    monkeypatch.setenv("JAX_BLINK_CPU_STREAM", "0")
    monkeypatch.setenv("JAX_BLINK_CPU_ISA", " avx2")
    x = np.arange(8 * 7, dtype=np.float32).reshape(8, 7)
    out = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")(x)
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(x.sum(0), x.shape))


SUM_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint16", "int32", "uint64", "complex64",
              "complex128"]


@pytest.mark.parametrize("dtype", SUM_DTYPES)
def test_sum_kernels_give_the_same_bits_on_every_instruction_set(dtype):
    """The executor's sums are built per instruction set (baseline, AVX2, AVX-512 where the CPU has them):
    each must equal the baseline bit for bit, for 1..12 sources (past the 8-at-a-time split) and lengths
    with and without a partial cache line, with infinities, NaNs and overflow in the floats, and the
    float32 baseline must equal NumPy's left-to-right sum."""
    isas = cpu.sum_isas()
    assert isas[0] == "baseline" and cpu.sum_isa() in isas
    rng = np.random.default_rng(5)
    for n in (0, 1, 15, 16, 17, 1000, 4099):
        for k in (1, 2, 7, 8, 9, 12):
            xs = []
            for _ in range(k + 1):
                a = random_operand(rng, n, dtype)  # integers over their whole range: they wrap
                if n > 3 and dtype in ("float16", "bfloat16", "float32", "float64"):
                    a[:3] = np.asarray([np.inf, np.nan, 6e4 if dtype == "float16" else 1e30]).astype(a.dtype)
                xs.append(a.view(np.uint16) if dtype == "bfloat16" else a)
            got = {}
            for isa in isas:
                out = np.full_like(xs[0], 7)
                assert cpu.sum_with(isa, dtype, out, xs[0], xs[1:], n) == ""
                got[isa] = out.tobytes()
            for isa in isas[1:]:
                assert got[isa] == got["baseline"], (isa, n, k)
            if dtype == "float32":
                want = xs[0].copy()
                for x in xs[1:]:
                    want = want + x
                assert got["baseline"] == want.tobytes()
    assert cpu.sum_with("sse9", "float32", np.zeros(1, np.float32), np.zeros(1, np.float32), [], 1) \
        == "unknown instruction set sse9"


@pytest.mark.slow
def test_cpu_isa_cap_picks_the_kernels():
    """JAX_BLINK_CPU_ISA caps the kernels' instruction set for the process (read at the first sum); the
    C++ side trims the ASCII blanks the lowering's check trims (a CRLF env file's value works). A cap
    this CPU does not run is refused by the lowering, naming the widest it runs (the C++ side alone
    would quietly take a lower set)."""
    order = ["baseline", "avx2", "avx512"]
    for cap in ("baseline", " avx2\r\n", "avx512", "\tbaseline\n"):
        env = {**os.environ, "JAX_BLINK_CPU_ISA": cap}
        # the child's own view of its CPU (under qemu-user the child runs natively, on the host's CPU)
        out, child_isas = subprocess.run(
            [sys.executable, "-c", "from jax_blink._native import _cpu; print(_cpu.sum_isa(), *_cpu.sum_isas())"],
            env=env, capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
        want = max((i for i in child_isas.split() if order.index(i) <= order.index(cap.strip())), key=order.index)
        assert out == want, (cap, out)
        ffi_lowering_env = dict(os.environ)
        try:
            os.environ["JAX_BLINK_CPU_ISA"] = cap
            if cap.strip() in cpu.sum_isas():
                ffi_lowering.check_cpu_env()  # accepted by the lowering too
            else:
                with pytest.raises(BlinkError, match=rf"JAX_BLINK_CPU_ISA={cap.strip()} names an instruction set "
                                                     rf"this CPU .* the widest '{cpu.sum_isas()[-1]}'"):
                    ffi_lowering.check_cpu_env()
        finally:
            os.environ.clear()
            os.environ.update(ffi_lowering_env)


def test_cpu_isa_this_cpu_lacks_is_refused(monkeypatch):
    """On any CPU: a cap above what it runs is refused at the call (simulated here by hiding the widest
    set this CPU runs), with the widest set it does run in the message."""
    usable = cpu.sum_isas()
    monkeypatch.setattr(jax_blink._native, "cpu_isas", lambda: tuple(usable[:1]))
    monkeypatch.setenv("JAX_BLINK_CPU_ISA", "avx2")
    f = jax.pmap(lambda v: jax_blink.psum(v, "i", impl="ffi"), axis_name="i")
    with pytest.raises(BlinkError, match=r"JAX_BLINK_CPU_ISA=avx2 names an instruction set this CPU \(or this build\) "
                                         r"does not run: it runs baseline, the widest 'baseline'"):
        f(np.ones((8, 13), np.float32))


@pytest.mark.parametrize("value", ["2", " 2 ", "\t2\r\n", "+2", " ", "", "1_0", "\u0661", "2x", "0x2", "-1",
                                   "300", "99999999999999999999"])
def test_cpu_int_settings_parse_alike_in_python_and_cpp(monkeypatch, value):
    """The lowering's check and the executor read an integer setting alike: what the check accepts the
    executor uses, what it treats as unset or rejects the executor replaces by its default (the C++ side
    once read a blank JAX_BLINK_CPU_HUGEPAGES as 0 and "1_0" threads as 1)."""
    monkeypatch.setenv("JAX_BLINK_CPU_THREADS", value)
    try:
        ffi_lowering.check_cpu_env()
        accepted = True
    except BlinkError:
        accepted = False
    native = cpu.env_int("JAX_BLINK_CPU_THREADS", 1, 256, 7)
    if accepted and value.strip(" \t\n\v\f\r"):
        assert native == int(value)
    else:
        assert native == 7, (value, native)
