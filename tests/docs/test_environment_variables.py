"""Every JAX_BLINK_* variable is registered in jax_blink/envvars.py, read only through it, documented
by its generated table, and refuses hostile values with an error naming the variable and the value."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_blink import envvars

REPO = pathlib.Path(__file__).resolve().parents[2]
HOSTILE = ("garbage", "", "-1", "100000000000000000000", "nan")
# variables of the tooling (CI scripts, test switches), not of the package: docs/environment.md lists them
TOOLING = {"JAX_BLINK_CI_ENDS", "JAX_BLINK_CI_PYTHON_", "JAX_BLINK_REQUIRE_TOOLS", "JAX_BLINK_INTERP_RELAXED_FLAGS",
           "JAX_BLINK_SUITE_IMPL", "JAX_BLINK_SUITE_REPORT", "JAX_BLINK_SUITE_SELECT", "JAX_BLINK_GPU_CHECK"}


def test_doc_table_is_the_registry():
    doc = (REPO / "docs" / "environment.md").read_text()
    assert envvars.rewrite_doc(doc) == doc, "run `python -m jax_blink.envvars docs/environment.md`"
    tooling = doc.partition(envvars.END_MARK)[2]
    assert all(f"`{name}" in tooling for name in TOOLING)


def test_every_variable_the_code_reads_is_registered():
    """Python string literals, C/C++ getenv calls, CMake's $ENV{} and shell ${} (macros named
    JAX_BLINK_* are not variables)."""
    pattern = {".py": r"[\"']([A-Z_]*JAX_BLINK_[A-Z0-9_]*[A-Z0-9])[\"']", ".c": r"getenv\(\"(JAX_BLINK_\w+)\"",
               ".sh": r"\$\{?(JAX_BLINK_[A-Z0-9_]*[A-Z0-9])", ".cmake": r"(?:ENV\{|option\()(JAX_BLINK_\w+)"}
    kinds = {".py": ".py", ".cc": ".c", ".cu": ".c", ".h": ".c", ".sh": ".sh", ".txt": ".cmake", ".cmake": ".cmake"}
    names = set()
    files = [*(REPO / "jax_blink").rglob("*.py"), *(REPO / "ffi").rglob("*"), REPO / "CMakeLists.txt",
             *(REPO / "scripts").glob("*")]
    for path in files:
        kind = kinds.get(path.suffix)
        if path.is_file() and kind:
            names |= set(re.findall(pattern[kind], path.read_text(errors="replace")))
    names = {n for n in names if n.startswith("JAX_BLINK_")}
    assert len(names) > 20 and names - set(envvars.REGISTRY) - TOOLING == set()


def test_only_envvars_reads_jax_blink_variables():
    """No module parses a JAX_BLINK_* variable itself (gpu_selftest saves and restores one it sets)."""
    read = re.compile(r"(os\.environ\.get\(|os\.environ\[|os\.getenv\()\s*(\"JAX_BLINK_|ENV_)")
    offenders = []
    for path in (REPO / "jax_blink").rglob("*.py"):
        if path.name == "envvars.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if read.search(line) and not re.search(r"^\s*(saved = |os\.environ\[.*\] = )", line):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("name", [v.name for v in envvars.REGISTRY.values() if v.section != "Build time"])
def test_hostile_values_are_refused_naming_the_variable(monkeypatch, name):
    """garbage, empty, -1, 10^20, nan: accepted (empty means unset) or an EnvVarError whose message
    holds the variable, the value and what it takes; never another exception."""
    var = envvars.var(name)
    for value in HOSTILE:
        monkeypatch.setenv(name, value)
        try:
            envvars.check([name])
        except envvars.EnvVarError as err:
            assert f"{name}={value!r}" in str(err) and "takes" in str(err), str(err)
            continue
        assert value == "" or var.kind in ("text", "path") or (var.kind == "int" and value == "-1" and var.lo < 0), \
            (name, value)
    if var.kind in ("int", "float", "flag", "choice", "address"):  # each of these refuses 10^20 and nan
        for value in ("100000000000000000000", "nan"):
            monkeypatch.setenv(name, value)
            with pytest.raises(envvars.EnvVarError):
                envvars.check([name])


def test_getters_parse_what_they_document(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_NICS_PER_NODE", " 8 ")
    assert envvars.integer("JAX_BLINK_NICS_PER_NODE") == 8
    monkeypatch.setenv("JAX_BLINK_NIC_GBPS", "25")
    assert envvars.number("JAX_BLINK_NIC_GBPS") == 25.0
    for v, want in (("On", True), ("0", False), ("", None)):
        monkeypatch.setenv("JAX_BLINK_WATCH", v)
        assert envvars.flag("JAX_BLINK_WATCH") is want
    monkeypatch.setenv("JAX_BLINK_COORDINATOR", "[::1]:1234")
    assert envvars.address("JAX_BLINK_COORDINATOR") == "[::1]:1234"
    for bad in ("host", "host:0", "host:70000", ":80"):
        monkeypatch.setenv("JAX_BLINK_COORDINATOR", bad)
        with pytest.raises(envvars.EnvVarError, match="JAX_BLINK_COORDINATOR="):
            envvars.address("JAX_BLINK_COORDINATOR")


@pytest.mark.parametrize("env, expect", [
    ({"JAX_BLINK_COORDINATOR": "localhost", "JAX_BLINK_NUM_PROCESSES": "2", "JAX_BLINK_PROCESS_ID": "0"},
     "JAX_BLINK_COORDINATOR='localhost'"),
    ({"JAX_BLINK_COORDINATOR": "localhost:1234", "JAX_BLINK_NUM_PROCESSES": "100000000000000000000",
      "JAX_BLINK_PROCESS_ID": "0"}, "JAX_BLINK_NUM_PROCESSES='100000000000000000000'"),
    ({"JAX_BLINK_COLLECTIVE_TIMEOUT_S": "2147483648", "JAX_BLINK_COORDINATOR": "localhost:1234",
      "JAX_BLINK_NUM_PROCESSES": "1", "JAX_BLINK_PROCESS_ID": "0"}, "JAX_BLINK_COLLECTIVE_TIMEOUT_S='2147483648'"),
])
def test_distributed_initialize_names_the_variable(env, expect):
    """Through the real entry point, in a fresh process: a clean error naming the variable, before jax
    parses the value (jax once raised an IndexError, jaxlib a TypeError, XLA's flag parser aborted)."""
    code = "import jax_blink.distributed as d; d.initialize()"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and expect in p.stderr and "EnvVarError" in p.stderr, p.stderr[-2000:]
