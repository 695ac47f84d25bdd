"""The package's import layering (docs/architecture.md): every import, at module level or inside a
function, goes to a module of the same layer or one to its left, and modules import no cycle."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jax_blink"
# left to right; a module may import its own layer (without cycles) and the layers to its left
LAYERS = [("errors", "collectives", "_native", "_jax_compat"), ("topology",), ("planner",), ("schedule",), ("simulate",),
          ("costmodel",), ("planning",), ("plot",), ("mapping",), ("lowering",), ("primitives",), ("api",),
          ("cli", "gpu_selftest", "distributed", "launch", "__main__")]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# inside a package: each module imports only those before it
ORDER = {"topology": ("model", "presets", "nvsmi", "ncclxml", "nvml", "probe", "load"),
         "planner": ("model", "routes", "colgen", "bounds", "minimize", "rings", "dbtree", "trees", "sharded",
                     "threephase", "facade")}
# lowering/ffi.py asks gpu_selftest.has_passed() (imported in the function) before using the CUDA executor
KNOWN = {("jax_blink.lowering.ffi", "jax_blink.gpu_selftest")}


def _modules() -> dict:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods: dict):
    """(importer, imported module, line) for every import of a jax_blink module by another."""
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base] + subs
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]  # a name imported from a module
                if t in mods and t not in (mod, "jax_blink"):
                    yield mod, t, node.lineno


def _layer(mod: str) -> int:
    return RANK[mod.split(".")[1]]


def test_no_import_goes_right():
    mods = _modules()
    assert {m.split(".")[1] for m in mods if m != "jax_blink"} <= set(RANK), "a module outside LAYERS"
    bad = [f"{a}:{line} imports {b}" for a, b, line in _imports(mods)
           if a != "jax_blink" and _layer(b) > _layer(a) and (a, b) not in KNOWN]
    assert not bad, bad


def test_package_modules_import_only_earlier_ones():
    mods = _modules()
    for pkg, order in ORDER.items():
        inside = {m.split(".")[2] for m in mods if m.startswith(f"jax_blink.{pkg}.")}
        assert inside == set(order), (pkg, sorted(inside))
    bad = []
    for a, b, line in _imports(mods):
        pa, pb = a.split("."), b.split(".")
        if len(pa) == 3 and len(pb) == 3 and pa[1] == pb[1] and pa[1] in ORDER:
            order = ORDER[pa[1]]
            if order.index(pb[2]) > order.index(pa[2]):
                bad.append(f"{a}:{line} imports {b}")
    assert not bad, bad


def test_no_import_cycles():
    mods = _modules()
    g = nx.DiGraph((a, b) for a, b, _ in _imports(mods) if a != "jax_blink" and (a, b) not in KNOWN)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles


def test_a_rightward_import_is_caught(tmp_path):
    # the check itself: the old planner's lazy import of the cost model is reported
    mods = _modules()
    mods["jax_blink.planner.extra"] = tmp_path / "extra.py"
    (tmp_path / "extra.py").write_text("def f():\n    from ..costmodel import choose_plan\n")
    found = [(a, b) for a, b, _ in _imports(mods) if a == "jax_blink.planner.extra"]
    assert found == [("jax_blink.planner.extra", "jax_blink.costmodel")]
    assert _layer("jax_blink.costmodel") > _layer("jax_blink.planner.extra")
