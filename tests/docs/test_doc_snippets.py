"""Every code block of README.md and docs/*.md runs as written, and the output it shows is checked.

Conventions (docs/architecture.md, "Documentation"):

- ```python blocks of one file run in order in one fresh process (8 host CPU devices, repository root
  as the working directory), so a later block uses the names of an earlier one. A statement followed
  by ``# -> text`` (at the end of its last line, or on comment lines right after it) must print
  ``text`` (doctest's rules: ``...`` matches anything, runs of whitespace are equal). A block of
  ``>>>`` lines runs as a doctest in the same namespace.
- ```bash blocks run line by line (``\\`` continues a line; each line in its own ``bash -o pipefail``
  in the repository root, so lines must not depend on each other; a few at a time); ``# -> text``
  checks a line's standard output the same way.
- A block right after ``<!-- no-run: reason -->`` is not run (installs, GPU-only and cluster commands,
  runs of minutes); the reason is required. Other fence languages (text, json, ...) are shown, not
  run; a fence without a language is refused, so nothing runnable slips through unmarked.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python": "python", "bash": "bash", "sh": "bash"}
SHOWN = {"text", "json", "toml", "cpp", "cmake", "diff", "yaml", "ini"}
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(.*?)\s*-->\s*$")  # the whole line
FENCE = re.compile(r"^(\s*)```(.*)$")
LINE_TIMEOUT_S = 240


@dataclass
class Block:
    path: pathlib.Path
    line: int          # 1-based line of the block's first code line
    lang: str
    code: str
    no_run: str | None  # the reason, or None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a markdown file; raises ValueError for an unclosed or unlabelled fence,
    and for a no-run marker without a reason or not right before a fence."""
    lines = path.read_text().splitlines()
    out, i, pending = [], 0, None
    while i < len(lines):
        m = FENCE.match(lines[i])
        marker = NO_RUN.match(lines[i])
        if marker:
            if not marker[1]:
                raise ValueError(f"{path.name}:{i + 1}: <!-- no-run: --> needs a reason")
            pending = (i, marker[1])
        elif m:
            lang = m[2].strip().split()[0] if m[2].strip() else ""
            if not lang:
                raise ValueError(f"{path.name}:{i + 1}: a fence needs a language (python, bash, text, ...)")
            if lang not in RUN and lang not in SHOWN:
                raise ValueError(f"{path.name}:{i + 1}: fence language {lang!r} is neither run {sorted(RUN)} "
                                 f"nor shown {sorted(SHOWN)}")
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"{path.name}:{i + 1}: the fence is never closed")
            indent = len(m[1])
            code = "\n".join(ln[indent:] for ln in lines[i + 1:j]) + "\n"
            reason = pending[1] if pending and pending[0] == i - 1 else None
            if pending and reason is None:
                raise ValueError(f"{path.name}:{pending[0] + 1}: a no-run marker must be the line right before "
                                 "its fence")
            out.append(Block(path, i + 2, RUN.get(lang, lang), code, reason))
            pending, i = None, j
        elif pending and lines[i].strip():
            raise ValueError(f"{path.name}:{pending[0] + 1}: a no-run marker must be the line right before its fence")
        i += 1
    return out


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               JAX_BLINK_CACHE_DIR=str(tmp_path / "cache"), JAX_BLINK_PLAN_CACHE="0", COLUMNS="200")
    return env


# Runs in the fresh process: blocks from stdin (JSON), one namespace, statement by statement.
RUNNER = r'''
import ast, contextlib, doctest, io, json, sys, tokenize, traceback

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
checker = doctest.OutputChecker()
ns = {"__name__": "__main__"}
failed = []

def expected_outputs(code):
    """line number -> the text of its '# -> ' comment."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("# ->"):
            out[tok.start[0]] = tok.string[4:].strip()
    return out

def run_block(b):
    where = lambda n: f"{b['file']}:{b['line'] + n - 1}"
    if ">>>" in b["code"]:
        test = doctest.DocTestParser().get_doctest(b["code"], ns, where(1), b["file"], b["line"] - 1)
        report = []
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        runner.run(test, out=report.append, clear_globs=False)
        ns.update(test.globs)
        if runner.failures:
            failed.append("".join(report))
        return
    tree = ast.parse(b["code"])
    wanted = expected_outputs(b["code"])
    ends = [s.lineno for s in tree.body[1:]] + [len(b["code"].splitlines()) + 1]
    for stmt, nxt in zip(tree.body, ends):
        exp = [wanted[n] for n in range(stmt.end_lineno, nxt) if n in wanted]
        at = where(stmt.lineno)  # before increment_lineno moves the node to the file's numbering
        mod = ast.Module([stmt], [])
        ast.increment_lineno(mod, b["line"] - 1)
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(mod, b["file"], "exec"), ns)
        except BaseException:
            sys.stdout.write(buf.getvalue())
            failed.append(f"{at}: raised\n{traceback.format_exc()}")
            return False
        got = buf.getvalue()
        sys.stdout.write(got)
        if exp and not checker.check_output("\n".join(exp) + "\n", got, FLAGS):
            failed.append(f"{at}: printed\n{got}which is not what the block shows:\n"
                          + "\n".join(exp) + "\n")
    return True

for b in json.load(sys.stdin):
    if run_block(b) is False:
        break  # later blocks use this one's names
if failed:
    print("\n".join(failed), file=sys.stderr)
    sys.exit(1)
'''


def _runnable(path, lang):
    return [b for b in blocks(path) if b.lang == lang and b.no_run is None]


def _files_with(lang):
    """Files with runnable blocks of ``lang``; a file whose fences do not parse is left to
    test_every_block_is_run_or_marked_with_a_reason, which names the problem (no collection error)."""
    out = []
    for p in FILES:
        try:
            if _runnable(p, lang):
                out.append(p)
        except ValueError:
            pass
    return out


def _run_python(blocks_, tmp_path):
    payload = json.dumps([{"file": str(b.path.relative_to(REPO)), "line": b.line, "code": b.code} for b in blocks_])
    return subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True, text=True,
                          cwd=REPO, env=_env(tmp_path), timeout=LINE_TIMEOUT_S * 2)


@pytest.mark.parametrize("path", _files_with("python"), ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run_and_print_what_they_show(path, tmp_path):
    p = _run_python(_runnable(path, "python"), tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}"


def test_the_runner_fails_a_block_that_prints_otherwise_or_raises(tmp_path):
    doc = REPO / "README.md"
    good = Block(doc, 1, "python", "x = 3\nprint(x)  # -> 3\nprint([x] * 2)\n# -> [3, ...]\n", None)
    later = Block(doc, 10, "python", ">>> x + 1\n4\n", None)
    assert _run_python([good, later], tmp_path).returncode == 0
    for code, what in (("print(2)  # -> 3\n", "README.md:20: printed\n2\n"),
                       ("print(1)\n# -> 1\n# -> 2\n", "README.md:20: printed"),
                       (">>> 1 + 1\n3\n", "Failed example"),
                       ("x = 1\n\nraise ValueError('boom')\n", "README.md:22: raised")):
        p = _run_python([good, Block(doc, 20, "python", code, None)], tmp_path)
        assert p.returncode == 1 and what in p.stderr, (code, p.stderr)


def _bash_lines(code: str, first_line: int):
    """(line number, command, expected output lines) per logical line of a bash block."""
    out, cmd, start = [], "", None
    raw = code.splitlines()
    for n, ln in enumerate(raw, first_line):
        if start is None:
            if not ln.strip() or ln.lstrip().startswith("#"):
                if ln.lstrip().startswith("# ->") and out:
                    out[-1][2].append(ln.lstrip()[4:].strip())
                continue
            start = n
        if ln.endswith("\\"):
            cmd += ln[:-1] + "\n"
            continue
        cmd += ln
        m = re.search(r"\s# -> (.*)$", cmd)
        out.append((start, (cmd[:m.start()] if m else cmd).rstrip(), [m[1].strip()] if m else []))
        cmd, start = "", None
    return out


@pytest.mark.parametrize("path", _files_with("bash"), ids=lambda p: str(p.relative_to(REPO)))
def test_bash_blocks_run_and_print_what_they_show(path, tmp_path):
    import doctest
    from concurrent.futures import ThreadPoolExecutor

    env = _env(tmp_path)
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's tools
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

    def check(item) -> str | None:
        line, cmd, exp = item
        where = f"{path.relative_to(REPO)}:{line}"
        p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=LINE_TIMEOUT_S)
        if p.returncode != 0:
            return f"{where}: `{cmd}` exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if exp and not checker.check_output("\n".join(exp) + "\n", p.stdout, flags):
            return f"{where}: `{cmd}` printed\n{p.stdout}which is not what the block shows:\n" + "\n".join(exp)
        return None

    lines = [item for b in _runnable(path, "bash") for item in _bash_lines(b.code, b.line)]
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:  # independent processes
        failures = [f for f in pool.map(check, lines) if f]
    assert not failures, "\n\n".join(failures)


def test_every_block_is_run_or_marked_with_a_reason():
    found, problems = {"run": 0, "no-run": 0}, []
    for path in FILES:
        try:
            bs = blocks(path)
        except ValueError as err:  # an unlabelled or unclosed fence, a stray marker
            problems.append(str(err))
            continue
        for b in bs:
            if b.lang in ("python", "bash"):
                found["no-run" if b.no_run else "run"] += 1
    assert not problems, problems
    assert found["run"] >= 10, found


def test_relative_links_point_at_files_that_exist():
    missing = []
    for path in FILES:
        prose, fenced = [], False
        for ln in path.read_text().splitlines():
            fenced ^= ln.lstrip().startswith("```")
            prose.append("" if fenced or ln.lstrip().startswith("```") else ln)
        for target in re.findall(r"\]\(([^)\s]+)\)", "\n".join(prose)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#", 1)[0]).exists():
                missing.append(f"{path.relative_to(REPO)}: {target}")
    assert not missing, missing


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (REPO / ".ci" / "run").read_text()
    command = 'pip install -e ".[test,examples]" && python -m pytest -q'
    assert command in readme and command in ci


def test_bash_lines_join_continuations_and_take_expected_output():
    code = "# a comment\njax-blink a \\\n  --b  # -> out\n# -> more\n\necho x\n"
    assert _bash_lines(code, 5) == [(6, "jax-blink a \n  --b", ["out", "more"]), (10, "echo x", [])]


def test_the_files_the_docs_name_exist():
    # `tests/...`, `jax_blink/...`, `ffi/...`, ... in backticks: a moved or deleted file must take its docs along
    roots = ("tests/", "jax_blink/", "ffi/", "scripts/", "benchmarks/", "examples/", "docs/", ".ci/")
    missing = []
    for path in FILES:
        for ref in re.findall(r"`([^`\s]+)`", path.read_text()):
            ref = ref.split("::", 1)[0].rstrip(".,:;)")
            if ref.startswith(roots) and not re.search(r"[{}*<>$]", ref) and not (REPO / ref).exists():
                missing.append(f"{path.relative_to(REPO)}: {ref}")
    assert not missing, missing
