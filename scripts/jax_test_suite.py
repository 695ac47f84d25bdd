"""Run JAX's own collective tests with jax_blink's psum / pmean / all_gather / psum_scatter in place of lax's.

The strongest check of "drop-in for ``jax.lax``" is the test suite the JAX team wrote for lax. This script
takes the test files of the jax release that is installed (a jax source checkout, or its ``tests`` folder;
the user supplies them, nothing is downloaded) and runs them under pytest on 8 CPU devices with
``jax.lax.psum``, ``pmean``, ``all_gather`` and ``psum_scatter`` replaced by jax_blink's (``impl=`` each of
``--impl``) before the test modules import them.

1. Selection (``impl`` "lax", the baseline): every test of the files that mention a substituted name whose
   code (with the helpers it calls, its parameters) refers to one, run with lax's functions wrapped to
   record calls. The tests that really called a substituted function are the suite; the ones of them that
   fail with lax too are listed apart (a test-environment issue, not jax_blink's).
2. Each ``impl``: the suite's tests that passed with lax, run with jax_blink's functions.

Printed per impl: passed / failed / errors / skipped, and each failure with the first line of its error.
Tests known to match lax's exact message text or primitive names (:data:`ARTEFACTS`) are listed apart
when they fail with the expected kind of error; failing any other way they count as failures.

Usage (jax 0.10.2's tests, from the jax-ml/jax repository: ``git archive jax-v0.10.2 tests | tar -x``)::

    python scripts/jax_test_suite.py /tmp/jaxtests-0.10.2            # the tests folder or a checkout
    python scripts/jax_test_suite.py /tmp/jaxtests-0.10.2 --impl ppermute --files shard_map_test.py -k vmap

Needs the test extra ``pip install -e ".[jaxtests]"`` (absl-py, and the jax tests' other imports).
Exit status 0 when every impl has no failure beyond the listed artefacts.

This file is also the pytest plugin the runs load (``-p jax_test_suite``; the ``pytest_*`` hooks below),
configured by the ``JAX_BLINK_SUITE_*`` environment variables the driver sets.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

#: The substituted functions of ``jax.lax``.
NAMES = ("psum", "pmean", "all_gather", "psum_scatter")

#: Tests that match lax's exact wording or primitive names (harness artefacts, not defects):
#: test method name (without absl's parameter suffix) -> (reason, regex the failure's first line matches).
ARTEFACTS = {
    "test_psum_not_under_shmap_error": (
        "expects lax's wording for an unbound axis ('... please call psum under `jax.shard_map`'; jax_blink's "
        "names jax_blink.psum)",
        r"AssertionError|does not match|NameError"),
    "test_rewrite_scan": (
        "compares the jaxpr text with lax's primitive names (psum_invariant / pvary)",
        r"AssertionError|!="),
    # jax 0.12 (config.use_rgv3): after checking the values, these look for lax's own lowering in the
    # StableHLO text (replica groups as mesh axes); jax_blink lowers to collective_permute / a custom call
    **{name: ("looks for lax's lowering in the StableHLO text (replica_group_mesh_axes, use_rgv3)",
              r"replica_group_mesh_axes")
       for name in ("test_all_gather_rgv3", "test_all_reduce_rgv3", "test_reduce_scatter_rgv3")},
}

_ENV_IMPL = "JAX_BLINK_SUITE_IMPL"        # "lax" (baseline, recording) or a jax_blink impl
_ENV_REPORT = "JAX_BLINK_SUITE_REPORT"    # where the plugin writes its JSON report
_ENV_SELECT = "JAX_BLINK_SUITE_SELECT"    # a file of node ids to run (else: the static selection)


# ====================================================================================== pytest plugin
_state = {"current": None, "called": set(), "wrappers": {}, "results": {}}


def _wrap(name, fn, impl):
    """``jax.lax.<name>``'s stand-in: jax_blink's function with ``impl`` (or lax's, for "lax"), recording
    that the running test called it."""
    import jax_blink

    target = fn if impl == "lax" else getattr(jax_blink, name)
    extra = {} if impl == "lax" else {"impl": impl}

    @functools.wraps(fn)
    def stand_in(*args, **kwargs):
        if _state["current"] is not None:
            _state["called"].add(_state["current"])
        return target(*args, **kwargs, **extra)

    stand_in.__jax_blink_suite__ = name
    return stand_in


def pytest_configure(config):
    impl = os.environ.get(_ENV_IMPL)
    if impl is None:
        return
    import jax

    for name in NAMES:
        original = getattr(jax.lax, name)
        w = _wrap(name, original, impl)
        _state["wrappers"][name] = w
        setattr(jax.lax, name, w)


def _code_names(code, seen):
    """Names a code object (and the code nested in it: lambdas, inner functions) refers to."""
    if code in seen:
        return set()
    seen.add(code)
    names = set(code.co_names) | set(code.co_freevars)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c, seen)
    return names


def _holds_wrapper(obj, depth=0) -> bool:
    """True when a closure value (absl's test parameters) is or contains a stand-in."""
    if getattr(obj, "__jax_blink_suite__", None):
        return True
    if depth < 3 and isinstance(obj, (tuple, list)):
        return any(_holds_wrapper(o, depth + 1) for o in obj)
    if depth < 3 and isinstance(obj, dict):
        return any(_holds_wrapper(o, depth + 1) for o in obj.values())
    return False


def _refers(fn, cls, depth=0, seen=None) -> bool:
    """Static selection: ``fn``'s code (or a helper function / method it names, two levels deep)
    names a substituted function, or its closure (absl parameters) holds one."""
    seen = set() if seen is None else seen
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _holds_wrapper(value):
            return True
        # a decorator's closure holds the test it wraps (jtu.with_explicit_mesh, absl parameters)
        if isinstance(value, types.FunctionType) and depth < 4 and value.__code__ not in seen \
                and _refers(value, cls, depth, seen):
            return True
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    names = _code_names(code, seen)
    if names & set(NAMES):
        return True
    if depth >= 2:
        return False
    scope = dict(getattr(fn, "__globals__", {}))
    for klass in (inspect.getmro(cls) if cls is not None else ()):
        scope.update(vars(klass))
    for n in names:
        helper = scope.get(n)
        if isinstance(helper, (staticmethod, classmethod)):
            helper = helper.__func__
        if isinstance(helper, types.FunctionType) and _refers(helper, cls, depth + 1, seen):
            return True
    return False


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get(_ENV_IMPL) is None:
        return
    select = os.environ.get(_ENV_SELECT)
    if select:
        wanted = set(Path(select).read_text().split())
        keep = [it for it in items if it.nodeid in wanted]
    else:
        keep = [it for it in items if _refers(getattr(it, "obj", None), getattr(it, "cls", None))]
    dropped = [it for it in items if it not in set(keep)]
    items[:] = keep
    config.hook.pytest_deselected(items=dropped)


def pytest_collectreport(report):
    if os.environ.get(_ENV_IMPL) is not None and report.failed:
        _state["results"][report.nodeid] = {"outcome": "collection error", "message": _first_line(report)}


def pytest_runtest_setup(item):
    _state["current"] = item.nodeid


def pytest_runtest_teardown(item, nextitem):
    _state["current"] = None


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return lines[0].strip()[:300] if lines else ""


def pytest_runtest_logreport(report):
    if os.environ.get(_ENV_IMPL) is None:
        return
    res = _state["results"].setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.when == "call" and report.outcome == "failed":
        res.update(outcome="failed", message=_first_line(report))
    elif report.outcome == "failed" and res["outcome"] != "failed":
        res.update(outcome="error", message=f"[{report.when}] {_first_line(report)}")
    elif report.outcome == "skipped" and res["outcome"] == "passed":
        res.update(outcome="skipped", message=_first_line(report))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(_ENV_REPORT)
    if not path:
        return
    for nodeid, res in _state["results"].items():
        res["called"] = nodeid in _state["called"] or res["outcome"] == "collection error"
    Path(path).write_text(json.dumps(_state["results"], indent=1))


# ====================================================================================== driver
def _tests_dir(path: Path) -> Path:
    for p in (path / "tests", path):
        if (p / "shard_map_test.py").is_file() or (p / "pmap_test.py").is_file():
            return p
    raise SystemExit(f"error: {path} holds no jax tests (no shard_map_test.py / pmap_test.py in it or in "
                     "its tests/ folder); pass a jax source checkout or the tests folder of the jax tag "
                     "matching the installed jax (git archive jax-v<version> tests | tar -x)")


def _checkout_version(path: Path) -> str | None:
    f = path / "jax" / "version.py"
    if f.is_file():
        m = re.search(r'^_version\s*=\s*"([^"]+)"', f.read_text(), re.M)
        return m.group(1) if m else None
    return None


def _candidate_files(tests: Path, names) -> list[Path]:
    pat = re.compile(r"\b(" + "|".join(NAMES) + r")\b")
    files = sorted(tests.glob(names)) if names else sorted(tests.glob("*_test.py"))
    return [f for f in files if pat.search(f.read_text(errors="replace"))]


def _run(impl: str, files, tests: Path, workdir: Path, select=None, k=None, exitfirst=False,
         timeout=None) -> dict:
    """One pytest run of ``files`` with ``impl``; the plugin's JSON report."""
    report = workdir / f"report-{impl}.json"
    report.unlink(missing_ok=True)
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    env = dict(os.environ)
    env.update({_ENV_IMPL: impl, _ENV_REPORT: str(report),
                "XLA_FLAGS": (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
                "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).resolve().parent), str(tests)] + env.get("PYTHONPATH", "").split(os.pathsep))})
    env.pop(_ENV_SELECT, None)
    if select is not None:
        sel = workdir / f"select-{impl}.txt"
        sel.write_text("\n".join(select))
        env[_ENV_SELECT] = str(sel)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "jax_test_suite", "-p", "no:cacheprovider", "-c", str(ini),
           "--rootdir", str(tests), "-W", "ignore", "--tb=line", "-rN", "--continue-on-collection-errors"]
    if k:
        cmd += ["-k", k]
    if exitfirst:
        cmd += ["-x"]
    cmd += [str(f) for f in files]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout)
    if not report.is_file():
        sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"error: pytest ({impl}) wrote no report (exit status {proc.returncode})")
    out = json.loads(report.read_text())
    print(f"  [{impl}] {len(out)} tests in {time.time() - t0:.0f} s", flush=True)
    return out


def _artefact(nodeid: str, message: str):
    """The reason when a failure is a listed artefact failing the expected way, else None."""
    test = nodeid.rsplit("::", 1)[-1]
    base = re.sub(r"\d+$", "", test)  # absl's numbered parameter suffix
    for name, (reason, pattern) in ARTEFACTS.items():
        if name in (test, base) or test.startswith(name + "_"):
            if re.search(pattern, message):
                return reason
    return None


def _short(nodeid: str) -> str:
    return nodeid.replace(".py::", ":")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jax_tests", type=Path, help="a jax source checkout or its tests folder (of the installed "
                                                  "jax's release)")
    ap.add_argument("--impl", nargs="+", default=["auto", "ppermute"], help="jax_blink impls to run (default: "
                                                                              "auto ppermute)")
    ap.add_argument("--files", default=None, help="glob of test files inside the tests folder (default: every "
                                                  "*_test.py naming a substituted function)")
    ap.add_argument("-k", default=None, help="pytest -k expression (while iterating)")
    ap.add_argument("-x", action="store_true", help="stop each run at its first failure (pytest -x)")
    ap.add_argument("--json", type=Path, default=None, help="write every outcome here as JSON")
    ap.add_argument("--reuse-lax", type=Path, default=None, help="take the lax baseline (selection) from an "
                                                                 "earlier --json file instead of running it")
    args = ap.parse_args(argv)

    import jax

    tests = _tests_dir(args.jax_tests.resolve())
    ver = _checkout_version(tests.parent)
    print(f"jax {jax.__version__} installed; tests from {tests}"
          + (f" (checkout of jax {ver})" if ver else ""))
    if ver and ver.split(".")[:3] != jax.__version__.split(".")[:3]:
        print(f"note: the checkout is jax {ver}, the installed jax is {jax.__version__}; tests of another "
              "release may fail with lax too (listed apart)")
    files = _candidate_files(tests, args.files)
    print(f"{len(files)} test files name {', '.join(NAMES)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.reuse_lax:
            base = json.loads(args.reuse_lax.read_text())["lax"]
            if args.k or args.files:  # narrow the reused baseline like the run would
                keep = {n for n in base if not args.files or Path(n.split("::", 1)[0]).match(args.files)}
                base = {n: r for n, r in base.items() if n in keep and (not args.k or args.k in n)}
        else:
            base = _run("lax", files, tests, work, k=args.k)
        broken = {n: r for n, r in base.items() if r["outcome"] == "collection error"}
        for n, r in broken.items():
            print(f"  not importable with this jax (lax too; not counted): {n}: {r['message']}")
        suite = sorted(n for n, r in base.items() if r["called"] and n not in broken)
        lax_bad = {n: base[n] for n in suite if base[n]["outcome"] in ("failed", "error")}
        lax_skip = [n for n in suite if base[n]["outcome"] == "skipped"]
        runnable = [n for n in suite if base[n]["outcome"] == "passed"]
        print(f"\n{len(suite)} tests call a substituted function (of {len(base)} statically selected); with lax: "
              f"{len(runnable)} passed, {len(lax_bad)} failed, {len(lax_skip)} skipped")
        for n, r in lax_bad.items():
            print(f"  lax fails too (not counted): {_short(n)}: {r['message']}")
        results = {"lax": base}
        failed_any = False
        run_files = sorted({n.split("::", 1)[0] for n in runnable})
        for impl in args.impl:
            out = _run(impl, [tests / f for f in run_files], tests, work, select=runnable, exitfirst=args.x) \
                if runnable else {}
            results[impl] = out
            counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "artefact": 0, "not run": 0}
            real, art = [], []
            for n in runnable:
                r = out.get(n)
                if r is None:
                    counts["not run"] += 1
                    continue
                if r["outcome"] in ("failed", "error") and (why := _artefact(n, r["message"])):
                    counts["artefact"] += 1
                    art.append((n, r, why))
                    continue
                counts[r["outcome"]] += 1
                if r["outcome"] in ("failed", "error"):
                    real.append((n, r))
            print(f"\nimpl={impl}: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
                  f"{counts['skipped']} skipped, {counts['artefact']} text/name artefacts"
                  + (f", {counts['not run']} not run" if counts["not run"] else "") + f" (of {len(runnable)})")
            for n, r in real:
                print(f"  {r['outcome'].upper()} {_short(n)}: {r['message']}")
            for n, r, why in art:
                print(f"  artefact {_short(n)}: {why}\n      ({r['message']})")
            failed_any |= bool(real) or counts["not run"] > 0
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
