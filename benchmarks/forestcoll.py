"""jax_blink's planner against ForestColl's public code, side by side on DGX-1V allocations.

Run: ``python benchmarks/forestcoll.py --forestcoll DIR [--pcie] [--reps N] [--sizes 3-8]`` where DIR
holds ForestColl's ``pipeline_allgather.py`` (a checkout of https://github.com/liangyuRain/ForestColl;
it is not a package and is not shipped or downloaded here). Every number comes from this run.

Cases: every allocation of 3..8 GPUs of a DGX-1V whose GPUs are connected by NVLink (181 of them), on
the NVLink-only topology (``dgx1v(pcie=False)``), or with ``--pcie`` on the topology with its PCIe tree
(switches and CPUs as non-compute nodes for ForestColl, as its ``compute_nodes`` argument allows).

Both planners get the same links: ``Topology.subset(allocation)`` with each link's bandwidth (GB/s per
direction) as its capacity. Timed per allocation, interleaved (ForestColl, then jax_blink, then the next
allocation; ``--reps`` rounds), medians per allocation:
- ForestColl: ``optimal_pipeline_spanning_trees(graph, compute_nodes=GPUs)`` (its binary search on the
  optimal time, switch-node removal by edge splitting, and spanning out-tree construction; Zhao et al.,
  "ForestColl", 2024, sections 4-5). Building its networkx graph is not timed.
- jax_blink: ``plan(topology, "allreduce", devices=allocation)`` after ``clear_caches()`` (uncached:
  the subset, the LP packing, the tree-count minimisation and the certificate).

Rates (algbw, GB/s; the nccl-tests convention, bytes per GPU / time): ForestColl returns (U, k) with
all-gather time = M * U / (k N) for M gathered bytes per GPU, so its all-gather algbw is k N / U and its
all-reduce (reduce-scatter then all-gather on the same forest) algbw is k N / (2 U). Checked against
``plan(topology, "allgather").rate_gbps`` (the exact cut bound) on every allocation: the run stops if the
two all-gather rates differ by more than 1e-6 relative, so both sides read the same graph.
Ratios: time jax_blink / ForestColl (lower is faster), all-reduce algbw jax_blink / ForestColl (higher is
better).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import pathlib
import statistics
import sys
import time

import networkx as nx
from rich.console import Console
from rich.table import Table

import jax_blink
from jax_blink.cli._args import positive_int  # the CLI's own "integer >= 1" argparse type
from jax_blink.topology.presets import dgx1v


def load_forestcoll(directory: str):
    """ForestColl's ``pipeline_allgather`` module from a directory, or exit with what to do."""
    path = pathlib.Path(directory).expanduser() / "pipeline_allgather.py"
    if not path.is_file():
        sys.exit(f"no {path}: pass --forestcoll DIR where DIR is a checkout of "
                 "https://github.com/liangyuRain/ForestColl (it holds pipeline_allgather.py)")
    spec = importlib.util.spec_from_file_location("forestcoll_pipeline_allgather", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "optimal_pipeline_spanning_trees", None)):
        sys.exit(f"{path} has no optimal_pipeline_spanning_trees(): not ForestColl's pipeline_allgather.py "
                 "(this script calls that function of https://github.com/liangyuRain/ForestColl)")
    return mod


def allocations(t, sizes):
    """Every GPU set of the given sizes whose GPUs are connected by NVLink alone."""
    nvlink = nx.Graph([(u, v) for u, v, k in t.graph.edges(data="kind") if k == "nvlink"])
    return [d for n in sizes for d in itertools.combinations(t.gpus, n)
            if all(g in nvlink for g in d) and nx.is_connected(nvlink.subgraph(d))]


def forestcoll_graph(sub):
    """The subset topology as ForestColl's input: a DiGraph with 'capacity' = GB/s per direction; nodes
    named by strings (ForestColl sorts them, and GPU ids are ints while switch names are strings)."""
    g = nx.DiGraph()
    for u, v in sub.graph.edges():
        g.add_edge(str(u), str(v), capacity=sub.bandwidth(u, v))
    return g


def run(fc, t, devs, reps):
    """Per allocation: median times (ms) of both planners and their rates (GB/s)."""
    rows = {d: {"fc_ms": [], "jb_ms": []} for d in devs}
    graphs = {d: forestcoll_graph(t.subset(d)) for d in devs}
    for rep in range(reps + 1):  # round 0 warms up (imports, first HiGHS call) and is not kept
        for d in devs:
            s = time.perf_counter()
            (u_scaled, k), _ = fc.optimal_pipeline_spanning_trees(graphs[d], compute_nodes=[str(x) for x in d])
            fc_ms = (time.perf_counter() - s) * 1e3
            jax_blink.clear_caches()
            s = time.perf_counter()
            p = jax_blink.plan(t, "allreduce", devices=list(d))
            jb_ms = (time.perf_counter() - s) * 1e3
            if rep:
                rows[d]["fc_ms"].append(fc_ms)
                rows[d]["jb_ms"].append(jb_ms)
            rows[d]["fc_ag"] = k * len(d) / u_scaled
            rows[d]["jb_ar"] = p.rate_gbps
    for d in devs:
        ag = jax_blink.plan(t, "allgather", devices=list(d)).rate_gbps
        if abs(ag - rows[d]["fc_ag"]) > 1e-6 * ag:
            sys.exit(f"{d}: ForestColl all-gather algbw {rows[d]['fc_ag']:.6f} != jax_blink's cut bound {ag:.6f}; "
                     "the two planners did not read the same graph")
    return rows


def spread(xs):
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def parse_sizes(text: str) -> list:
    """Allocation sizes from "3-8" or "3,5,8": GPU counts in 2..8, at least one; argparse's type."""
    try:
        if "," in text:
            sizes = sorted({int(x) for x in text.split(",")})
        else:
            lo, _, hi = text.partition("-")
            sizes = list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 3-8 or 3,5,8, got {text!r}") from None
    if not sizes or sizes[0] < 2 or sizes[-1] > 8:
        raise argparse.ArgumentTypeError(f"sizes must be GPU counts in 2..8 (a DGX-1V has 8 GPUs), got {text!r}")
    return sizes


def main(argv=None):
    os.environ.setdefault("JAX_BLINK_PLAN_CACHE", "0")  # time planning, not loads from the disk cache
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forestcoll", required=True, metavar="DIR", help="directory holding ForestColl's "
                    "pipeline_allgather.py (a checkout of https://github.com/liangyuRain/ForestColl)")
    ap.add_argument("--pcie", action="store_true", help="model the DGX-1V's PCIe tree too")
    ap.add_argument("--reps", type=positive_int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--sizes", type=parse_sizes, default="3-8", help="allocation sizes, e.g. 3-8 or 3,8 (default 3-8)")
    a = ap.parse_args(argv)
    sizes = a.sizes
    fc = load_forestcoll(a.forestcoll)
    t = dgx1v(pcie=a.pcie)
    devs = allocations(t, sizes)
    rows = run(fc, t, devs, a.reps)
    console = Console(width=max(Console().width, 150))
    tab = Table(title=f"jax_blink vs ForestColl on {t.name}: {len(devs)} NVLink-connected allocations, "
                      f"uncached, median of {a.reps} interleaved rounds")
    for c in ("GPUs", "allocations", "ForestColl ms (median)", "jax_blink ms (median)",
              "time ratio min / median / max", "all-reduce algbw ratio min / median / max"):
        tab.add_column(c, justify="right")
    groups = [(str(n), [d for d in devs if len(d) == n]) for n in sizes] + [("all", devs)]
    for label, ds in groups:
        if not ds:
            continue
        fc_ms = [statistics.median(rows[d]["fc_ms"]) for d in ds]
        jb_ms = [statistics.median(rows[d]["jb_ms"]) for d in ds]
        tr = [j / f for j, f in zip(jb_ms, fc_ms)]
        rr = [rows[d]["jb_ar"] / (rows[d]["fc_ag"] / 2) for d in ds]
        tab.add_row(label, str(len(ds)), f"{statistics.median(fc_ms):.2f}", f"{statistics.median(jb_ms):.2f}",
                    spread(tr), spread(rr))
    console.print(tab)
    ratio = {d: statistics.median(rows[d]["jb_ms"]) / statistics.median(rows[d]["fc_ms"]) for d in devs}
    worst = max(devs, key=ratio.get)
    med = statistics.median(ratio.values())
    console.print("time ratio = jax_blink / ForestColl planning time; algbw ratio = jax_blink all-reduce plan "
                  "rate / ForestColl's (k N / 2U)")
    if list(sizes) != list(range(3, 9)):
        console.print("(the targets are stated over all 181 allocations of 3..8 GPUs: --sizes 3-8, the default)")
    console.print(f"targets: median time ratio <= 0.8: {med:.2f} {'pass' if med <= 0.8 else 'FAIL'}; worst <= 1.5: "
                  f"{ratio[worst]:.2f} {'pass' if ratio[worst] <= 1.5 else 'FAIL'} (GPUs {list(worst)}: jax_blink "
                  f"{statistics.median(rows[worst]['jb_ms']):.2f} ms, ForestColl "
                  f"{statistics.median(rows[worst]['fc_ms']):.2f} ms); wall-clock: load average (1 min) "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores after the run")


if __name__ == "__main__":
    main()
