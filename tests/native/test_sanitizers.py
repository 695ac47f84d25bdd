"""The native rendezvous and CPU executor under ThreadSanitizer and Address+UndefinedBehaviorSanitizer.

ffi/tests/core_stress.cc drives blink_core.cc + cpu_executor.cc from many threads (concurrent
meetings, several call sites, repeated run ids, late/absent participants, mismatches, duplicate
ranks, timeouts, FailCall) and checks the results against a plain sum. It is built with the system
g++ twice (-fsanitize=thread; -fsanitize=address,undefined), cached in the temp dir by a hash of the
sources and flags, and run. Any sanitizer report fails the test, also when the exit status is 0.
Without sanitizers: g++ -std=c++17 -O2 -pthread -Iffi/src ffi/tests/core_stress.cc
ffi/src/blink_core.cc ffi/src/cpu_executor.cc ffi/src/cpu_sum.cc ffi/src/cpu_sum_dispatch.cc -o core_stress
&& ./core_stress (the sum kernels in their baseline build only).
"""

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "ffi" / "tests" / "core_stress.cc"] + [
    ROOT / "ffi" / "src" / f for f in ("blink_core.cc", "cpu_executor.cc", "cpu_sum.cc", "cpu_sum_dispatch.cc")]
LINKSIM = [ROOT / "ffi" / "tests" / "linksim_stress.cc", ROOT / "ffi" / "src" / "linksim.cc"]
HEADERS = sorted((ROOT / "ffi" / "src").glob("*.h"))
COMMON = ["-std=c++17", "-g", "-pthread", "-fno-omit-frame-pointer", "-I", str(ROOT / "ffi" / "src")]
VARIANTS = {
    "tsan": ["-O1", "-fsanitize=thread"],
    "asan_ubsan": ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}
REPORTS = ("WARNING: ThreadSanitizer", "ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
           "ERROR: UndefinedBehaviorSanitizer")
RUN_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1 second_deadlock_stack=1",
    "ASAN_OPTIONS": "halt_on_error=1 detect_leaks=1 detect_stack_use_after_return=1 strict_string_checks=1",
    "UBSAN_OPTIONS": "halt_on_error=1 print_stacktrace=1",
}
ROUNDS = "5"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found: the sanitizer builds need the system g++")


def _cache_dir() -> pathlib.Path:
    h = hashlib.sha256()
    for p in SOURCES + LINKSIM + HEADERS:
        h.update(p.name.encode() + p.read_bytes())
    h.update(subprocess.run([GXX, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(repr((COMMON[:-2], VARIANTS)).encode())
    base = pathlib.Path(tempfile.gettempdir()) / f"jax_blink_core_stress_{os.getuid()}"
    d = base / h.hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    os.utime(d)
    for old in sorted(base.iterdir(), key=lambda p: p.stat().st_mtime)[:-4]:  # keep the 4 latest builds
        shutil.rmtree(old, ignore_errors=True)
    return d


@pytest.fixture(scope="module")
def binaries():
    """Builds the variants that are not cached yet, all at once (each g++ is one process)."""
    d = _cache_dir()
    procs = {}
    for name, flags in VARIANTS.items():
        exe = d / f"core_stress_{name}"
        if not exe.exists():
            tmp = exe.with_suffix(f".tmp{os.getpid()}")
            procs[name] = (subprocess.Popen([GXX, *COMMON, *flags, *map(str, SOURCES), "-o", str(tmp)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), tmp, exe)
    exe = d / "linksim_stress_asan_ubsan"
    if not exe.exists():  # the simulator's event model: one thread, so address and UB checks only
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        cmd = [GXX, *COMMON, *VARIANTS["asan_ubsan"], *map(str, LINKSIM), "-o", str(tmp)]
        procs["linksim"] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), tmp, exe)
    errors = {}
    for name, (p, tmp, exe) in procs.items():
        _, err = p.communicate(timeout=600)
        if p.returncode == 0:
            os.replace(tmp, exe)  # atomic: a concurrent session never runs a half-written binary
        else:
            errors[name] = err
    return d, errors


def _missing_runtime(err: str) -> bool:
    return any(s in err for s in ("cannot find -ltsan", "cannot find -lasan", "cannot find -lubsan",
                                  "libtsan_preinit.o", "libasan_preinit.o", "unrecognized argument to -fsanitize"))


def _run(exe: pathlib.Path, extra_env=None, prefix=()):
    env = {**os.environ, **RUN_ENV, **(extra_env or {})}
    env.pop("JAX_BLINK_TIMEOUT_S", None)
    env.pop("JAX_BLINK_TEST_ABSENT_DEVICE", None)
    return subprocess.run([*prefix, str(exe), ROUNDS], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow
def test_core_stress(binaries, variant):
    d, errors = binaries
    if variant in errors:
        if _missing_runtime(errors[variant]):
            pytest.skip(f"g++ has no {variant} runtime (install libtsan/libasan/libubsan for gcc): "
                        f"{errors[variant].strip()[-300:]}")
        pytest.fail(f"building core_stress ({variant}) failed:\n{errors[variant][-4000:]}")
    exe = d / f"core_stress_{variant}"
    r = _run(exe)
    if variant == "tsan" and "unexpected memory mapping" in r.stderr:
        # TSan's shadow layout does not fit this kernel's ASLR (mmap_rnd_bits): run without ASLR.
        setarch = shutil.which("setarch")
        assert setarch, "TSan needs ASLR off here (setarch -R) but setarch is missing:\n" + r.stderr[-2000:]
        r = _run(exe, prefix=(setarch, platform.machine(), "-R"))
    if variant == "asan_ubsan" and "LeakSanitizer has encountered a fatal error" in r.stderr:
        # LSan cannot run under ptrace (some containers); the address and UB checks still can.
        r = _run(exe, {"ASAN_OPTIONS": RUN_ENV["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")})
    reports = [s for s in REPORTS if s in r.stderr]
    assert r.returncode == 0 and not reports, (
        f"core_stress ({variant}) exit {r.returncode}, reports {reports}\nstdout:\n{r.stdout[-2000:]}\n"
        f"stderr:\n{r.stderr[-8000:]}")
    assert " 0 check failures" in r.stdout and "trials" in r.stdout, r.stdout


@pytest.mark.slow
def test_link_level_event_model_under_asan_ubsan(binaries):
    """ffi/tests/linksim_stress.cc: the simulator's native event model on random message graphs
    (zero-byte sends, cycles, refused input) under Address+UndefinedBehaviorSanitizer."""
    d, errors = binaries
    if "linksim" in errors:
        if _missing_runtime(errors["linksim"]):
            pytest.skip(f"g++ has no asan/ubsan runtime: {errors['linksim'].strip()[-300:]}")
        pytest.fail(f"building linksim_stress failed:\n{errors['linksim'][-4000:]}")
    exe = d / "linksim_stress_asan_ubsan"
    r = _run(exe)
    if "LeakSanitizer has encountered a fatal error" in r.stderr:
        r = _run(exe, {"ASAN_OPTIONS": RUN_ENV["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")})
    reports = [s for s in REPORTS if s in r.stderr]
    assert r.returncode == 0 and not reports, (
        f"exit {r.returncode}, reports {reports}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}")
    assert "100 trials, 0 check failures" in r.stdout, r.stdout


# ------------------------------------------------------------------ the device interpreter under TSan
@pytest.mark.slow
def test_device_interpreter_flags_race_free_under_tsan():
    """The interpreter's host build (a thread per rank block) over small plans (reduce trees,
    broadcast, staged pairs, bucket with aliased leaves, block cap, two calls on the same flags, a
    never-arriving rank): 0 ThreadSanitizer reports, every check passes."""
    from jax_blink.lowering.gpu_program_check import tsan_check
    r = tsan_check()
    if r["error"] and _missing_runtime(r["error"]):
        pytest.skip(f"g++ has no TSan runtime: {r['error'][-300:]}")
    assert r["error"] == "" and r["reports"] == 0 and r["failures"] == 0 and r["cases"] >= 10, r["tail"]


@pytest.mark.slow
def test_tsan_sees_the_race_when_flags_lose_acquire_release():
    """The same run built with relaxed flags (no ordering): TSan must report the data races, so the
    check above can fail."""
    from jax_blink.lowering.gpu_program_check import tsan_check
    r = tsan_check(seeds=1, relaxed=True)
    if r["error"] and _missing_runtime(r["error"]):
        pytest.skip(f"g++ has no TSan runtime: {r['error'][-300:]}")
    assert r["reports"] > 0, r["tail"]
