"""Seeded mutants of every topology file under tests/data/topologies and of presets as JSON, loaded one
by one in this process: each must raise TopologyError or give a sane Topology, in bounded time; prints
one JSON line with the outcome counts, the slowest case and the peak memory (run by
tests/topology/test_topology_fuzz.py in a fresh process; ``python tests/topology/fuzz_cases.py N``)."""

import json
import math
import pathlib
import random
import re
import resource
import signal
import sys
import tempfile
import time

from jax_blink.errors import TopologyError
from jax_blink.topology import Topology

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "topologies"
HOSTILE_NUMBERS = ["0", "-1", "99999999999999999999", "30000000", "nan", "inf", "-inf", "1e999", "1e-320",
                   "2.5", "0x10", "", "NaN-23", "true"]
HOSTILE_JSON = [0, -1, 10**20, 2.5, 1e-320, float("inf"), True, None, "", "gpuu", [], {}, "x" * 10000]
CASE_SECONDS = 5.0


def text_mutant(text: str, rng: random.Random) -> str:
    """One hostile edit of a `topo -m` or NCCL XML text."""
    lines = text.splitlines()
    how = rng.randrange(7)
    if how == 0 and lines:                               # a number replaced
        nums = list(re.finditer(r"\d+(?:\.\d+)?", text))
        if nums:
            m = rng.choice(nums)
            return text[:m.start()] + rng.choice(HOSTILE_NUMBERS) + text[m.end():]
    if how == 1 and lines:                               # a line deleted or doubled
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i] + ([] if rng.random() < 0.5 else [lines[i]] * 2) + lines[i + 1:])
    if how == 2:                                         # a word renamed (GPU0 -> GPU99999999999999999999)
        words = list(re.finditer(r"[A-Za-z_]+\d*", text))
        if words:
            m = rng.choice(words)
            new = rng.choice(["GPU99999999999999999999", "GPU30000000", "nvlnk", "NV99", "X", m.group(0)[::-1]])
            return text[:m.start()] + new + text[m.end():]
    if how == 3:                                         # an element / tag renamed or cut
        cut = rng.randrange(max(1, len(text)))
        return text[:cut]
    if how == 4:                                         # CPU affinity / attribute garbage
        return re.sub(r"(\d+)-(\d+)", lambda m: rng.choice(["NaN-23", "0x10", "-inf", "5-2", m.group(0)]), text,
                      count=rng.randrange(1, 4))
    if how == 5:                                         # every <nvlink> misspelt
        return text.replace("nvlink", "nvlnk").replace("NV", rng.choice(["NV", "NX", "NV999"]))
    return text + "\n" + rng.choice(["GPU0\tX\tNV1", "<gpu dev='1' sm='-5'/>", "\x00", "<!DOCTYPE x>"])


def json_mutant(data, rng: random.Random):
    """One hostile edit of a topology as a JSON value (or its text)."""
    d = json.loads(json.dumps(data))
    how = rng.randrange(5)
    if how == 0 and d["links"]:
        link = rng.choice(d["links"])
        link[rng.choice(["bandwidth_gbps", "links", "src", "dst", "kind"])] = rng.choice(HOSTILE_JSON)
    elif how == 1 and d["nodes"]:
        node = rng.choice(d["nodes"])
        node[rng.choice(["id", "kind", "no_p2p"])] = rng.choice(HOSTILE_JSON)
    elif how == 2:                                       # a star of many GPUs
        n = rng.choice([5000, 10000])
        d["nodes"] += [{"id": 100 + i, "kind": "gpu"} for i in range(n)]
        d["links"] += [{"src": 100 + i, "dst": 0, "bandwidth_gbps": 10, "kind": "pcie"} for i in range(n)]
    elif how == 3:
        return "[" * 100000 + "]" * 100000
    else:
        d[rng.choice(["nodes", "links", "name", "notes"])] = rng.choice(HOSTILE_JSON)
    return json.dumps(d, allow_nan=True)


def sane(t: Topology) -> None:
    """An accepted topology must be one the planner can take: finite positive rates, bounded size."""
    assert 0 < len(t.gpus) <= 4096, len(t.gpus)
    for u, v, bw, _, c in t.links():
        assert 0 < bw < math.inf and isinstance(c, int) and c >= 1, (u, v, bw, c)


def _alarm(*_):
    raise TimeoutError


def main(per_source: int) -> dict:
    rng = random.Random(20261205)
    sources = [(f.name, f.suffix, f.read_text()) for f in sorted(DATA.iterdir()) if f.suffix in (".txt", ".xml")]
    sources += [(f"preset {n}", ".json", Topology.preset(n).to_dict()) for n in ("dgx1v", "dgx-a100", "dgx2")]
    out = {"topology_error": 0, "accepted": 0, "other": [], "slowest_s": 0.0, "cases": 0}
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory() as tmp:
        for name, suffix, base in sources:
            for k in range(per_source):
                body = json_mutant(base, rng) if suffix == ".json" else text_mutant(base, rng)
                path = pathlib.Path(tmp) / f"case{suffix}"
                path.write_text(body, errors="surrogateescape")
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
                try:
                    sane(Topology.load(str(path)))
                    out["accepted"] += 1
                except TopologyError as err:
                    assert str(err), name
                    out["topology_error"] += 1
                except TimeoutError:
                    out["other"].append(f"{name} #{k}: over {CASE_SECONDS} s")
                except BaseException as err:  # noqa: BLE001 - every other outcome is the defect counted
                    out["other"].append(f"{name} #{k}: {type(err).__name__}: {str(err)[:200]}")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                out["slowest_s"] = max(out["slowest_s"], time.perf_counter() - t0)
                out["cases"] += 1
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def _peak_rss_mib() -> float:
    """This process's peak resident memory in MiB: /proc's VmHWM, which belongs to the address space exec
    made. (getrusage's ru_maxrss carries the high-water mark of the process that forked and exec'd us, so
    under a 2.7 GiB pytest it reads 2.7 GiB.)"""
    try:
        for ln in pathlib.Path("/proc/self/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)))
