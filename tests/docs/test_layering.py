"""What the import contracts rest on but cannot check themselves.

The layering itself (every import, at module level or inside a function, goes to the same layer or
one to its left; the module order inside topology/ and planner/; no cycles) is pyproject.toml's
[tool.importlinter] contracts, run by tests/docs/test_lint.py; they are exhaustive, so every module of a
contract's package has a layer. Left here: that import-linter sees every module file, and that
docs/architecture.md states the order the contracts enforce."""

import pathlib
import re
import tomllib

import grimp

REPO = pathlib.Path(__file__).resolve().parents[2]
CONTRACTS = {c["name"]: c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
             ["contracts"]}
DOC = (REPO / "docs" / "architecture.md").read_text()


def _layers(name: str) -> list[list[str]]:
    """A layers contract's layers, left (imported) to right (importing), each a list of modules."""
    return [[m.strip() for m in re.split(r"[:|]", layer)] for layer in reversed(CONTRACTS[name]["layers"])]


def test_import_linter_sees_every_module_file():
    # a .py file in a folder without __init__.py is no module of the package: no contract would check it
    files = set()
    for path in (REPO / "jax_blink").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        files.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    graph = grimp.build_graph("jax_blink", cache_dir=None)
    assert files == set(graph.modules), sorted(files ^ set(graph.modules))


def test_the_documented_pipeline_is_the_contract():
    line = next(ln for ln in DOC.splitlines() if ln.startswith("`errors"))
    documented = [[m.strip(" `/") for m in layer.split(":")] for layer in line.split("->")]
    assert documented == _layers("pipeline layers (docs/architecture.md)"), line


def test_package_tables_follow_the_contracts_order():
    # the module table of docs/architecture.md lists topology/ and planner/ modules in import order
    for pkg, contract in (("topology", "topology modules in order"), ("planner", "planner modules in order")):
        rows = re.findall(rf"^\| `jax_blink/{pkg}/(\w+)\.py` \|", DOC, flags=re.M)
        assert rows == [m for layer in _layers(contract) for m in layer], (pkg, rows)
