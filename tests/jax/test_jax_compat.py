"""One home for JAX internals: only ``jax_blink/_jax_compat.py`` imports ``jax._src``, and it refuses
jax / jaxlib versions outside the range pyproject.toml pins (at import of the JAX-facing modules, not
at ``import jax_blink``)."""

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

import jax
import pytest

from jax_blink import _jax_compat
from jax_blink.errors import BlinkError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jax_blink"


def _jax_src_imports(path: pathlib.Path) -> list[str]:
    """'line: module' for every import of jax._src (any form) in the file at ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [f"{node.lineno}: {m}" for m in mods if m == "jax._src" or m.startswith("jax._src.")]
    return out


def test_only_jax_compat_imports_jax_internals():
    found = {str(p.relative_to(ROOT)): _jax_src_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
    offenders = {p: hits for p, hits in found.items() if hits and p != "jax_blink/_jax_compat.py"}
    assert not offenders, f"import jax._src through jax_blink._jax_compat only: {offenders}"
    assert found["jax_blink/_jax_compat.py"], "the compat module imports the internals the package uses"


def test_supported_range_is_the_one_pyproject_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    want = _jax_compat._range_text()
    assert want == ">=0.10.2,<0.13"
    assert f"jax{want}" in deps and f"jaxlib{want}" in deps, (want, deps)


@pytest.mark.parametrize("version,ok", [("0.10.2", True), ("0.11.0", True), ("0.12.9", True),
                                        ("0.12.0.dev20260101", True), ("0.10.1", False), ("0.9.0", False),
                                        ("0.13.0", False), ("0.13.0.dev20260101", False), ("1.0", False),
                                        ("unknown", False)])
def test_version_check_rejects_out_of_range_jax(monkeypatch, version, ok):
    monkeypatch.setattr(jax, "__version__", version)
    if ok:
        _jax_compat.check_versions()
        return
    with pytest.raises(_jax_compat.UnsupportedJaxError) as err:
        _jax_compat.check_versions()
    msg = str(err.value)
    assert f"jax {version}" in msg and f"jaxlib {_jax_compat.jaxlib.__version__}" in msg and ">=0.10.2,<0.13" in msg
    assert isinstance(err.value, ImportError) and isinstance(err.value, BlinkError)


def test_version_check_covers_jaxlib():
    _jax_compat.check_versions("0.10.2", "0.10.2")
    with pytest.raises(_jax_compat.UnsupportedJaxError, match=r"jaxlib 0\.13\.1 is installed"):
        _jax_compat.check_versions("0.10.2", "0.13.1")


def test_unsupported_jax_fails_the_jax_facing_import_not_import_jax_blink():
    """In a fresh process with jax claiming 0.9.0: ``import jax_blink`` works (it imports no jax),
    ``import jax_blink.api`` raises UnsupportedJaxError naming the versions."""
    code = """
import sys
import jax_blink
assert "jax" not in sys.modules, "import jax_blink imported jax"
import jax
jax.__version__ = "0.9.0"
try:
    import jax_blink.api
except ImportError as e:
    print(type(e).__name__, e)
else:
    print("imported")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("UnsupportedJaxError jax_blink supports jax and jaxlib >=0.10.2,<0.13, but jax 0.9.0"), \
        p.stdout
