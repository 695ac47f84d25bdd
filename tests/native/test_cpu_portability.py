"""The native modules run on every x86-64 CPU that jaxlib runs on, whatever CPU built or tests them.

Two checks. (1) Static: in the built ``_cpu`` and ``_gpusim`` modules (and nowhere in ``_linksim``),
vector instructions wider than the baseline (VEX / EVEX encodings: ymm, zmm and opmask registers,
any ``v``-prefixed mnemonic; BMI, ADX and LZCNT, which a host-tuned ``-march=native`` build would add) occur
only inside the per-instruction-set sum kernels (``jax_blink::sum_avx2::Sum*`` /
``jax_blink::sum_avx512::Sum*`` and their internal helpers), never in code that runs before the CPU
check (tables, dispatch, static initialisers). (2) Dynamic: tests/native/cpu_portability_cases.py (every
collective through the native executor, every dtype, the sum kernels of each instruction set, the
GPU interpreter's host build) under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512), with and without
``JAX_BLINK_CPU_ISA=baseline``, and ``-cpu SandyBridge`` (AVX, no AVX2: the lowest jaxlib 0.10 starts on;
jaxlib >= 0.11 needs AVX2 and refuses it, and there the native module's kernels run alone), where an
instruction the CPU lacks raises SIGILL as on such a machine.

qemu (Debian's ``qemu-user``) and objdump are installed by ``.ci/run``, which sets
``JAX_BLINK_REQUIRE_TOOLS=1`` so that a missing tool fails there instead of skipping.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "native" / "cpu_portability_cases.py"
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86_64, reason="x86-64 instruction sets (this machine is not x86-64)")

# A disassembled function label (objdump -d -C) and an instruction line.
LABEL = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSN = re.compile(r"^\s*[0-9a-f]+:\s+(\S+)\s*(.*)$")
# Kernels of one instruction set: the exported Sum<Kind> entries and the unnamed namespace's helpers.
KERNEL = r"(^|\s)jax_blink::sum_{isa}::(Sum[A-Z0-9]+\(|\(anonymous namespace\)::)"
AVX512_OPERAND = re.compile(r"%zmm\d+|%k[0-7]\b")
# Scalar instructions a host-tuned build (-march=native) adds that run only from Haswell on: BMI1/2
# (VEX-encoded, without a 'v'), ADX, and LZCNT (which older CPUs run as BSR: silently other results).
# (TZCNT is left out: compilers emit it for every x86-64 as 'rep bsf', which older CPUs run as BSF.)
HASWELL_SCALAR = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx", "sarx", "shlx",
                  "shrx", "adcx", "adox", "lzcnt"}
# The three QEMU CPUs: (model, JAX_BLINK_CPU_ISA or None, sets it runs, set the kernels then use)
QEMU_RUNS = [("Haswell", None, ["baseline", "avx2"], "avx2"),
             ("Haswell", "baseline", ["baseline", "avx2"], "baseline"),
             ("SandyBridge", None, ["baseline"], "baseline")]


# Where jaxlib itself refuses the CPU: the sum kernels alone (no jax import), against NumPy.
KERNELS_ONLY = """
import numpy as np
from jax_blink._native import _cpu
assert _cpu.sum_isas() == ["baseline"] and _cpu.sum_isa() == "baseline", _cpu.sum_isas()
rng = np.random.default_rng(1)
for dt in ("float32", "float64", "int8", "uint16", "int32", "uint64"):
    xs = [rng.integers(-50, 50, 1003).astype(dt) for _ in range(4)]
    out = np.zeros_like(xs[0])
    assert _cpu.sum_with("baseline", dt, out, xs[0], xs[1:], 1003) == ""
    assert (out == xs[0] + xs[1] + xs[2] + xs[3]).all(), dt
print("baseline ok")
"""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("JAX_BLINK_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{name} is not installed; .ci/run installs it (Debian: qemu-user, binutils)")
        pytest.skip(f"{name} is not installed (Debian: apt-get install qemu-user binutils); CI runs this test")
    return path


def wide_instructions(so: pathlib.Path) -> dict[str, dict[str, int]]:
    """Per function of the shared object ``so``: counts of instructions with AVX-512 operands
    (``avx512``: zmm / opmask registers) and of other VEX/EVEX-encoded or Haswell-only ones (``vex``: ymm
    registers, a ``v`` mnemonic, :data:`HASWELL_SCALAR`). Functions with neither are left out."""
    text = subprocess.run([_tool("objdump"), "-d", "-C", "--no-show-raw-insn", str(so)], capture_output=True,
                          text=True, check=True).stdout
    out: dict[str, dict[str, int]] = {}
    fn = "?"
    for line in text.splitlines():
        m = LABEL.match(line)
        if m:
            fn = m.group(1)
            continue
        m = INSN.match(line)
        if not m:
            continue
        mnemonic, operands = m.groups()
        kind = "avx512" if AVX512_OPERAND.search(operands) else \
            "vex" if mnemonic.startswith("v") or "%ymm" in operands or mnemonic in HASWELL_SCALAR else None
        if kind:
            counts = out.setdefault(fn, {"avx512": 0, "vex": 0})
            counts[kind] += 1
    return out


@pytest.mark.parametrize("module", ["_cpu", "_gpusim"])
def test_wide_instructions_only_inside_the_kernels(module):
    """The fix of the whole kind behind the SIGILL on AVX2-only CPUs (the AVX-512 build's table fill ran
    before any CPU check): no code compiled for AVX2 / AVX-512 outside the kernels the dispatcher
    reaches only after the CPU check."""
    import importlib
    so = pathlib.Path(importlib.import_module(f"jax_blink._native.{module}").__file__)
    found = wide_instructions(so)
    avx2, avx512 = re.compile(KERNEL.format(isa="avx2")), re.compile(KERNEL.format(isa="avx512"))
    misplaced = [f"{fn}: {c}" for fn, c in found.items()
                 if not avx512.search(fn) and (c["avx512"] or not avx2.search(fn))]
    assert not misplaced, "wide instructions outside the per-ISA kernels:\n" + "\n".join(misplaced[:20])
    # not vacuous: the kernels themselves are found, with their own widths (every x86-64 GCC / Clang
    # build holds both; ffi/CMakeLists.txt)
    assert any(avx512.search(fn) and c["avx512"] for fn, c in found.items()), sorted(found)[:5]
    assert any(avx2.search(fn) and "SumF32" in fn and c["vex"] for fn, c in found.items()), sorted(found)[:5]


def test_simulator_module_holds_no_wide_instructions():
    """The simulator's event model (``_linksim``) has no per-ISA kernels: nothing wider than the baseline."""
    from jax_blink._native import _linksim
    found = wide_instructions(pathlib.Path(_linksim.__file__))
    assert not found, sorted(found)[:20]


@pytest.mark.slow
def test_every_collective_runs_on_cpus_without_avx512_or_avx2():
    """tests/native/cpu_portability_cases.py under qemu: the three runs at once (about 2-4 minutes on 2 cores)."""
    qemu = _tool("qemu-x86_64")
    procs = []
    for model, cap, _, _ in QEMU_RUNS:
        env = {k: v for k, v in os.environ.items() if k != "JAX_BLINK_CPU_ISA"}
        if cap:
            env["JAX_BLINK_CPU_ISA"] = cap
        procs.append(subprocess.Popen([qemu, "-cpu", model, sys.executable, str(CASES)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=1500)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    for (model, cap, isas, active), (rc, out, err) in zip(QEMU_RUNS, results):
        what = f"qemu -cpu {model}" + (f", JAX_BLINK_CPU_ISA={cap}" if cap else "")
        if rc != 0 and "This version of jaxlib was built using" in err:
            # below this jaxlib's lowest CPU (jaxlib >= 0.11 needs AVX2): the native module alone there
            assert "avx2" not in isas, (what, err[-2000:])
            r = subprocess.run([qemu, "-cpu", model, sys.executable, "-c", KERNELS_ONLY], capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0 and r.stdout.strip() == "baseline ok", (what, r.stdout, r.stderr[-3000:])
            continue
        # -4 / 132: SIGILL, an instruction this CPU lacks
        assert rc == 0, f"{what}: exit status {rc}\n{out[-2000:]}\n{err[-4000:]}"
        report = json.loads(out.strip().splitlines()[-1])
        assert report["isas"] == isas and report["active"] == active, (what, report)
        assert len(report["checks"]) == 5, (what, report)
        if "avx2" in isas:  # jaxlib's own float16 arithmetic needs F16C (SandyBridge lacks it)
            assert "pmean without" not in report["checks"][1], (what, report)
