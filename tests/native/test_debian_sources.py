"""scripts/debian_sources.py: the CUDA 11.8 build's apt sources are the machine's own bookworm
entries (mirror, options, keyring kept) with contrib and non-free added, in both apt formats."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "debian_sources.py"


def _run(etc, out):
    return subprocess.run([sys.executable, str(SCRIPT), str(etc), str(out)], capture_output=True, text=True)


def test_one_line_and_deb822_entries_are_copied_with_the_components_added(tmp_path):
    etc = tmp_path / "etc"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(
        "# the site mirror\n"
        "deb [signed-by=/k.gpg arch=amd64] http://mirror.site/debian bookworm main  # comment\n"
        "deb-src http://mirror.site/debian bookworm main\n"
        "deb http://mirror.site/debian bookworm-updates main non-free-firmware\n"
        "deb http://mirror.site/debian trixie main\n")
    (etc / "sources.list.d" / "cloud.list").write_text("deb https://packages.example/apt cloud-sdk-bookworm main\n")
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb deb-src\nURIs: http://proxy.site/debian\nSuites: bookworm trixie\nComponents: main contrib\n"
        "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n -----END PGP PUBLIC KEY BLOCK-----\n"
        "\n"
        "Types: deb\nURIs: http://off.site/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n"
        "\n"
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\nComponents: main\n")
    out = tmp_path / "out"
    p = _run(etc, out)
    assert p.returncode == 0, p.stderr
    assert (out / "sources.list").read_text() == (
        "deb [signed-by=/k.gpg arch=amd64] http://mirror.site/debian bookworm main contrib non-free\n"
        "deb http://mirror.site/debian bookworm-updates main non-free-firmware contrib non-free\n")
    assert (out / "sources.list.d" / "debian.sources").read_text() == (
        "Types: deb\nURIs: http://proxy.site/debian\nSuites: bookworm\nComponents: main contrib non-free\n"
        "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n -----END PGP PUBLIC KEY BLOCK-----\n")
    assert "2 one-line entries and 1 deb822 stanzas for bookworm" in p.stderr


def test_no_bookworm_entry_is_an_error_saying_what_to_do(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "sources.list").write_text("deb http://archive.ubuntu.com/ubuntu jammy main\n")
    p = _run(etc, tmp_path / "out")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "no enabled 'deb' entry for Debian bookworm" in p.stderr and "add your mirror's bookworm entry" in p.stderr
    assert not (tmp_path / "out").exists()
