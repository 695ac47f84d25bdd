"""The machine's own apt entries for one Debian suite, with the components a build needs added.

``scripts/build_cuda118.sh`` fetches Debian bookworm's non-free CUDA 11.8 toolkit with apt into its own
folder. It must use the mirror, proxy and keyring this machine is configured for (clusters reach Debian
through internal mirrors), so it copies the machine's entries for the suite instead of naming a mirror:

    python scripts/debian_sources.py /etc/apt OUT_DIR [--suite bookworm] [--components main contrib non-free]

reads ``/etc/apt/sources.list``, ``sources.list.d/*.list`` (one-line entries) and
``sources.list.d/*.sources`` (deb822 stanzas), keeps the ``deb`` entries whose suite is ``bookworm`` or
``bookworm-*`` (updates, security), adds the missing components, and writes ``OUT_DIR/sources.list`` and
``OUT_DIR/sources.list.d/debian.sources`` for apt's ``Dir::Etc::SourceList`` / ``SourceParts``. Options
(``[signed-by=...]``) and the other deb822 fields (Signed-By, Architectures, ...) are kept. Exits 1
with a message saying what to do when no entry matches.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ONE_LINE = re.compile(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)")


def _wanted(suite: str, base: str) -> bool:
    return suite == base or suite.startswith(base + "-")


def _add(components: list[str], need: list[str]) -> list[str]:
    return components + [c for c in need if c not in components]


def one_line_entries(text: str, base: str, need: list[str]) -> list[str]:
    """``deb [options] URI suite components`` lines of ``text`` for the suite, components added."""
    out = []
    for line in text.splitlines():
        m = ONE_LINE.match(line.split("#", 1)[0])
        if m and _wanted(m[3], base):
            out.append(f"deb {m[1] or ''}{m[2]} {m[3]} {' '.join(_add(m[4].split(), need))}")
    return out


def deb822_stanzas(text: str, base: str, need: list[str]) -> list[str]:
    """The enabled ``Types: deb`` stanzas of a ``.sources`` file for the suite, other suites and
    ``deb-src`` dropped, components added; continuation lines (an inline Signed-By key) kept."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += "\n" + line
            else:
                key, _, value = line.partition(":")
                key = key.strip()
                fields[key] = value.strip()
        suites = [s for s in fields.get("Suites", "").split() if _wanted(s, base)]
        if "deb" not in fields.get("Types", "").split() or not suites or fields.get("Enabled", "yes") == "no":
            continue
        fields.update(Types="deb", Suites=" ".join(suites),
                      Components=" ".join(_add(fields.get("Components", "").split(), need)))
        out.append("\n".join(f"{k}:{v}" if v.startswith("\n") else f"{k}: {v}" for k, v in fields.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("etc", type=pathlib.Path, help="apt's configuration folder (/etc/apt)")
    ap.add_argument("out", type=pathlib.Path, help="folder for sources.list and sources.list.d/")
    ap.add_argument("--suite", default="bookworm")
    ap.add_argument("--components", nargs="+", default=["main", "contrib", "non-free"])
    a = ap.parse_args(argv)
    parts = a.etc / "sources.list.d"
    lines = []
    for f in [a.etc / "sources.list", *sorted(parts.glob("*.list"))]:
        if f.is_file():
            lines += one_line_entries(f.read_text(), a.suite, a.components)
    stanzas = []
    for f in sorted(parts.glob("*.sources")):
        stanzas += deb822_stanzas(f.read_text(), a.suite, a.components)
    if not lines and not stanzas:
        print(f"debian_sources: {a.etc}/sources.list and {parts}/ hold no enabled 'deb' entry for Debian "
              f"{a.suite} (suite {a.suite} or {a.suite}-*): add your mirror's {a.suite} entry to apt's sources "
              "(or lay out a CUDA 11.8 toolkit yourself and pip install with CUDACXX=/path/to/nvcc "
              "JAX_BLINK_CUDA=ON)", file=sys.stderr)
        return 1
    (a.out / "sources.list.d").mkdir(parents=True, exist_ok=True)
    (a.out / "sources.list").write_text("".join(x + "\n" for x in lines))
    (a.out / "sources.list.d" / "debian.sources").write_text("\n".join(x + "\n" for x in stanzas))
    print(f"debian_sources: {len(lines)} one-line entries and {len(stanzas)} deb822 stanzas for {a.suite} from "
          f"{a.etc}, with {' '.join(a.components)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
