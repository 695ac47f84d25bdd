"""Static checks run with the tests: ``ruff check`` (pyproject's [tool.ruff]) over the package, tests,
benchmarks, examples and scripts, and ``lint-imports`` (pyproject's [tool.importlinter]: the pipeline's
layers, the module order inside topology/ and planner/, no import cycles). Any report fails the test
with the tool's own output."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUFF_PATHS = ("jax_blink", "tests", "benchmarks", "examples", "scripts")
# import-linter's command line as a module call, so the test uses the interpreter running the tests
LINT_IMPORTS = ("-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())")


def _run(args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ruff_reports_nothing():
    p = _run(["-m", "ruff", "check", "--no-cache", *RUFF_PATHS])
    assert p.returncode == 0, p.stdout + p.stderr


def test_import_contracts_are_kept():
    p = _run([*LINT_IMPORTS, "--no-cache"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout, p.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("planner/rings.py", "from ..costmodel import choose_plan", "pipeline layers"),   # right, inside a function
    ("topology/model.py", "from .load import load_topology", "topology modules in order"),
])
def test_a_function_level_import_to_the_right_is_reported(tmp_path, module, line, contract):
    # the contracts' own check: a scratch copy of the package with one rightward import inside a
    # function, linted with the copy first on the path (the editable install's finder left out)
    shutil.copytree(ROOT / "jax_blink", tmp_path / "jax_blink", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "jax_blink" / module, "a") as f:
        f.write(f"\n\ndef _scratch():\n    {line}\n    return None\n")
    site = [p for p in sys.path if p.endswith("site-packages")]
    code = (f"import sys; sys.path[:0] = {[str(tmp_path), *site]!r}; import jax_blink; "
            f"assert jax_blink.__file__.startswith({str(tmp_path)!r}), jax_blink.__file__; "
            "from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())")
    env = dict(os.environ, PYTHONPATH="")
    p = _run(["-S", "-c", code, "--no-cache"], cwd=tmp_path, env=env)
    assert p.returncode != 0, p.stdout + p.stderr
    assert f"{contract}" in p.stdout and "BROKEN" in p.stdout, p.stdout + p.stderr
