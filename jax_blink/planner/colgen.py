"""Column generation: the one loop behind every packing LP of the planner, and the rate LP.

Every packing the planner solves is the *rate LP* (:func:`rate_lp`): maximise the total weight of
columns (spanning trees, three-phase trees, rings) subject to sum_c usage_c(e) w_c <= cap(e) for
every directed link e, w >= 0 (Blink, MLSys 2020, section 4, solved exactly where Blink used a
(1-eps) multiplicative-weights approximation); the rooted variant (all-gather / reduce-scatter,
ForestColl, Zhao et al. 2024, sections 4-5) maximises x with every root's columns weighing >= x.
:func:`column_generation` solves both by column generation (Dantzig-Wolfe; e.g. Chvatal, "Linear
Programming", ch. 26) with HiGHS (``highspy``, its official Python API; every round solves its LP
from scratch: re-solving one kept model warm from the last basis ends at other optimal bases, whose
tree counts after :mod:`jax_blink.planner.minimize` were larger on 46 of 1328 benchmark cases): a
few multiplicative-weights rounds (Garg-Koenemann, as Blink's TreeGen) give diverse starting
columns without an LP solve each; then the LP and a pricing
callback alternate, the callback returning the cheapest columns under the LP's dual link prices,
until no column prices below its threshold, the rate reaches an independent upper bound (then the
LP is optimal without a last pricing round), or MAX_ITERATIONS. The LP dual also gives an upper
bound at every round (weak duality), returned as ``dual_bound``.

The packings built on it: :func:`solve_packing` (broadcast, reduce, all-reduce trees),
:func:`solve_rooted_packing` (all-gather / reduce-scatter forests), the three-phase packing
(:mod:`jax_blink.planner.threephase`) and the ring packing (:mod:`jax_blink.planner.rings`).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable

import highspy
import numpy as np

from ..errors import PlanError
from .routes import Column, RouteTable, price_tree, pricer, tree_from_costs

PRICE_TOL = 1e-9            # a column enters while its dual price < threshold - PRICE_TOL
MAX_ITERATIONS = 2000
EXTRA_COLUMNS = 4           # further columns per pricing round (solve_packing)
WARM_STEP = 0.5             # multiplicative-weights step of the warm start


@dataclasses.dataclass
class PackingResult:
    """Output of :func:`column_generation`: columns, LP weights (GB/s, float64 [C]), rate (GB/s),
    dual certificate (GB/s), LP rounds, and the label each column was priced under (``labels``;
    e.g. its three-phase partition). ``roots``: the root of each column for a rooted packing
    (:func:`solve_rooted_packing`), None when one root serves all."""

    columns: list
    weights: np.ndarray
    rate: float
    dual_bound: float
    iterations: int
    roots: list | None = None
    labels: list | None = None


_LOCAL = threading.local()  # this thread's HiGHS instances, by options


@dataclasses.dataclass
class LPResult:
    """A HiGHS solve (:func:`solve_lp`): ``status`` 0 when optimal (else ``message`` says why),
    ``x`` the column values (float64 [N]), ``fun`` the objective, ``duals`` the row duals (float64,
    inequality rows first, then equality rows; <= 0 on a binding <= row of a minimisation),
    ``feasible``: ``x`` is a feasible point (also when a MILP stopped at its node limit)."""

    status: int
    x: np.ndarray
    fun: float
    duals: np.ndarray
    message: str
    feasible: bool


_FD1_LOCK = threading.Lock()
# HiGHS 1.12's MIP solver printf()s this debug line to the C stdout whatever ``output_flag`` says
_STRAY = re.compile(rb"HighsMipSolverData::\w+ tmpSolver\.run\(\);\n?")


def _flush_stdout() -> None:
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):  # closed or broken stream: nothing buffered can reach fd 1
            pass
    try:
        _libc().fflush(None)  # the C library's buffers (where HiGHS's printf lands)
    except (OSError, AttributeError):
        pass


@functools.lru_cache(maxsize=1)
def _libc():
    """The process's C library (``ctypes.CDLL(None)``: a dlopen per call cost more than the flush)."""
    return ctypes.CDLL(None)


_CAPTURE: list = []  # [(pid, file)]: the capture file of :func:`_filtered_stdout`, reused under _FD1_LOCK


def _capture_file():
    """An empty temporary file for fd 1 while HiGHS runs (caller holds _FD1_LOCK): one per process,
    truncated for each use (creating one per solve cost about a third of a small ILP); a forked child
    makes its own, as it shares the parent's file offset."""
    if not _CAPTURE or _CAPTURE[0][0] != os.getpid():
        f = tempfile.TemporaryFile()
        atexit.register(f.close)  # closed at exit, not left to the finaliser (a ResourceWarning under -W)
        _CAPTURE[:] = [(os.getpid(), f)]
    f = _CAPTURE[0][1]
    f.seek(0)
    f.truncate()
    return f


def _filtered_stdout(fn):
    """``fn()`` (a HiGHS solve) with HiGHS's stray lines (:data:`_STRAY`) kept out of file descriptor 1,
    where they would corrupt ``jax-blink plan --json`` and users' output. fd 1 is process-wide, so the
    swap holds a lock (concurrent planners take turns) and whatever else reached fd 1 meanwhile
    (another thread's output) is written back afterwards, not dropped. Without an open fd 1 (closed
    stdout, ``sys.stdout is None``) it just runs ``fn``."""
    with _FD1_LOCK:
        try:
            saved = os.dup(1)
        except OSError:
            return fn()
        try:
            _flush_stdout()
            captured = _capture_file()
            os.dup2(captured.fileno(), 1)
            try:
                return fn()
            finally:
                _flush_stdout()
                os.dup2(saved, 1)
                captured.seek(0)
                rest = memoryview(_STRAY.sub(b"", captured.read()))
                while rest:
                    rest = rest[os.write(1, rest):]
        finally:
            os.close(saved)


def new_highs(options=None) -> highspy.Highs:
    """An empty, silent ``highspy.Highs`` model with HiGHS ``options`` (a dict) set: this thread's
    instance for these options, cleared (``clearModel`` keeps only the options). Constructing a
    ``highspy.Highs`` (callback set-up) cost about as much as solving a small LP."""
    key = tuple(sorted((options or {}).items()))
    kept = _LOCAL.__dict__.setdefault("highs", {})
    h = kept.get(key)
    if h is not None:
        h.clearModel()
        return h
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # one thread: the planner's LPs and ILPs are small, and HiGHS's worker threads cost more to
    # wake than they save (the MILP took ~30 ms with 2 threads on a loaded 2-core machine, 1 ms with 1)
    h.setOptionValue("threads", 1)
    for k, v in (options or {}).items():
        h.setOptionValue(k, v)
    kept[key] = h
    return h


def add_rows(h: highspy.Highs, a: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> None:
    """Add the rows ``lower`` <= ``a`` x <= ``upper`` (``a`` float64 [M, N] over the model's columns)."""
    rows, cols = np.nonzero(a)
    starts = np.searchsorted(rows, np.arange(a.shape[0])).astype(np.int32)
    h.addRows(a.shape[0], np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64), len(rows),
              starts, cols.astype(np.int32), a[rows, cols].astype(np.float64))


def add_columns(h: highspy.Highs, a: np.ndarray, cost: np.ndarray, upper: np.ndarray | None = None) -> None:
    """Add columns with rows ``a`` (float64 [M, K] over the model's M rows), costs [K], bounds 0 <= x <= ``upper``."""
    cols, rows = np.nonzero(a.T)
    starts = np.searchsorted(cols, np.arange(a.shape[1])).astype(np.int32)
    k = a.shape[1]
    h.addCols(k, np.asarray(cost, dtype=np.float64), np.zeros(k),
              np.full(k, highspy.kHighsInf) if upper is None else np.asarray(upper, dtype=np.float64),
              len(rows), starts, rows.astype(np.int32), a[rows, cols].astype(np.float64))


def solved(h: highspy.Highs) -> LPResult:
    """Run ``h`` and return its :class:`LPResult` (status 0 only when HiGHS proves optimality)."""
    h.run()
    status = h.getModelStatus()
    sol = h.getSolution()
    info = h.getInfo()
    ok = status == highspy.HighsModelStatus.kOptimal
    feasible = ok or (sol.value_valid and info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible)
    return LPResult(0 if ok else 1, np.asarray(sol.col_value, dtype=np.float64),
                    float(info.objective_function_value), np.asarray(sol.row_dual, dtype=np.float64),
                    h.modelStatusToString(status), bool(feasible))


def solve_lp(c: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray | None = None,
             upper: np.ndarray | None = None, integrality: np.ndarray | None = None, options=None) -> LPResult:
    """Minimise ``c`` . x subject to ``a_ub`` x <= ``b_ub``, ``a_eq`` x = 0, 0 <= x <= ``upper``
    (default unbounded) with HiGHS; ``integrality``: 0/1 [N], 1 marking integer columns (a MILP);
    ``options``: further HiGHS options (e.g. ``{"mip_max_nodes": 200}``). Returns an :class:`LPResult`."""
    h = new_highs(options)
    n = len(c)
    add_columns(h, np.zeros((0, n)), c, upper)
    add_rows(h, np.asarray(a_ub, dtype=np.float64), np.full(len(b_ub), -highspy.kHighsInf), b_ub)
    if a_eq is not None:
        add_rows(h, np.asarray(a_eq, dtype=np.float64), np.zeros(len(a_eq)), np.zeros(len(a_eq)))
    if integrality is not None and np.any(integrality):
        idx = np.flatnonzero(integrality).astype(np.int32)
        h.changeColsIntegrality(len(idx), idx, np.full(len(idx), highspy.HighsVarType.kInteger))
        return _filtered_stdout(lambda: solved(h))
    return solved(h)


def rate_lp(a: np.ndarray, cap: np.ndarray, a_eq: np.ndarray | None = None) -> LPResult:
    """The rate LP (HiGHS): maximise sum_c w_c subject to ``a`` w <= ``cap``, ``a_eq`` w = 0, w >= 0.

    ``a``: float64 [L, C], how many times column c uses link l; ``cap``: float64 [L], GB/s;
    ``a_eq``: optional rows [E, C] (e.g. equal totals per root). Returns an :class:`LPResult`
    (``x`` the weights, ``-fun`` the rate, ``-duals[:L]`` the link prices)."""
    return solve_lp(-np.ones(a.shape[1]), a, cap, a_eq)


def _rooted_lp(a: np.ndarray, cap: np.ndarray, member: np.ndarray) -> LPResult:
    """The rooted rate LP (HiGHS): maximise x subject to ``a`` w <= ``cap`` and, for every root r,
    sum of r's column weights >= x (``member``: 0/1 [R, C], column c is rooted at r); w, x >= 0.
    Variables [w, x]; the duals of the last R rows are the roots' prices."""
    nl, n, t = a.shape[0], member.shape[0], a.shape[1]
    a_ub = np.block([[a, np.zeros((nl, 1))], [-member, np.ones((n, 1))]])
    return solve_lp(np.concatenate([np.zeros(t), [-1.0]]), a_ub, np.concatenate([cap, np.zeros(n)]))


def _warm_step(y: np.ndarray, col: Column, cap: np.ndarray) -> np.ndarray:
    """Raise the prices of the links ``col`` uses, by WARM_STEP x its bottleneck rate (Garg-Koenemann)."""
    used = col.usage > 0
    return y * (1.0 + WARM_STEP * float(np.min(cap[used] / col.usage[used])) * col.usage / cap)


def column_generation(cap: np.ndarray, price: Callable, *, start=(), warm_rounds: int = 0, roots=None,
                      target: float | None = None, extra: Callable | None = None,
                      max_iterations: int = MAX_ITERATIONS, what: str = "packing", devices=()) -> PackingResult:
    """Maximum-rate packing of the columns ``price`` generates, by column generation.

    Args:
      cap: float64 [L], the capacity of every directed link, GB/s.
      price: ``price(y)`` -> list of (label, :class:`Column`) under link prices ``y`` (float64 [L]):
        the cheapest column of each label (a root, a three-phase partition, or one label for all),
        ``usage`` over the L links; [] or None when there is none (the loop stops). A column is
        identified by (label, ``edges``).
      start: (label, Column) pairs in the LP from the start; the warm start raises their prices first.
      warm_rounds: multiplicative-weights rounds before the first LP: ``price`` at prices starting
        at 1 / cap, each returned column added and its links' prices raised (:func:`_warm_step`).
      roots: None: the rate LP (:func:`rate_lp`), a column enters while its price is below 1 -
        PRICE_TOL, dual bound cap . y / min(1, cheapest price) of the last round. A list of labels
        (the roots of a rooted packing, ``price`` returning one column per root): the rooted LP
        (every root's columns weigh >= x; rate n x); a column of root r enters while its price is
        below the dual z_r of r's row minus PRICE_TOL; dual bound n cap . y / sum of the roots'
        cheapest prices, the least over the rounds; the weights are trimmed so every root carries
        exactly x (scaling down keeps every link within capacity).
      target: an independent upper bound on the rate (GB/s, e.g. a max-flow bound): the loop stops
        once the rate reaches it (1 - 1e-9), with dual bound max(target, rate).
      extra: ``extra(y, column)`` -> further (label, Column) pairs added after the cheapest entering
        column, when the loop goes on (several columns per LP solve cut the degenerate tail).
      max_iterations: most LP rounds.
      what, devices: name the packing and the job in the PlanError of a failed LP.

    Returns a PackingResult (``labels`` always set, ``roots`` for a rooted packing). Raises
    PlanError when HiGHS fails.
    """
    cols, labels, seen = [], [], set()

    def add(label, col):
        if (label, col.edges) in seen:
            return False
        seen.add((label, col.edges))
        cols.append(col)
        labels.append(label)
        return True

    y = 1.0 / cap
    for label, col in start:
        add(label, col)
        y = _warm_step(y, col, cap)
    for _ in range(warm_rounds):
        for label, col in price(y) or ():
            add(label, col)
            y = _warm_step(y, col, cap)
    nl = len(cap)
    roots = None if roots is None else list(roots)
    it, dual = 0, math.inf
    while True:
        it += 1
        t = len(cols)
        a = np.stack([c.usage for c in cols], axis=1).astype(np.float64)
        if roots is None:
            res = rate_lp(a, cap)
        else:
            member = np.zeros((len(roots), t))
            member[[roots.index(r) for r in labels], np.arange(t)] = 1.0
            res = _rooted_lp(a, cap, member)
        if res.status != 0:
            raise PlanError(f"{what} LP failed for devices {list(devices)}: {res.message}")
        if roots is None:
            rate, w = float(-res.fun), res.x.copy()
        else:
            share, w = float(res.x[-1]), res.x[:t].copy()
            rate = len(roots) * share
        if target is not None and rate >= target * (1 - 1e-9):
            dual = max(target, rate)
            break
        marg = -res.duals
        y = np.maximum(marg[:nl], 0.0)
        cands = price(y)
        if not cands:
            dual = max(dual, rate)
            break
        prices = np.array([float(c.usage @ y) for _, c in cands])
        if roots is None:
            thresholds = np.ones(len(cands))
            best = float(prices.min())
            dual = float(cap @ y) / min(1.0, best) if best > 0 else math.inf
        else:
            z = np.maximum(marg[nl:], 0.0)
            thresholds = np.array([z[roots.index(label)] for label, _ in cands])
            if prices.sum() > 0:
                dual = min(dual, len(roots) * float(cap @ y) / prices.sum())
        entering = [lc for lc, p, z_ in zip(cands, prices, thresholds) if p < z_ - PRICE_TOL]
        if it >= max_iterations or not any([add(*lc) for lc in entering]):
            dual = max(dual, rate)
            break
        if extra is not None:
            for lc in extra(y, entering[0][1]):
                add(*lc)
    if roots is not None:
        for r in roots:
            mine = np.array([j for j in range(len(w)) if labels[j] == r])
            s = float(w[mine].sum())
            if s > 0:
                w[mine] *= share / s
    return PackingResult(cols, w, rate, dual, it, None if roots is None else labels, labels)


def _more_columns(table: RouteTable, y: np.ndarray, mode: str, root, col: Column, k: int) -> list:
    """Up to ``k`` further trees that still price below 1 under ``y``: re-price after raising the
    prices of the links the previous tree used (a multiplicative-weights step from the LP duals).
    Several columns per LP solve cut the degenerate tail of column generation (the LP is the cost)."""
    out, yk = [], y.copy()
    step = 0.1 * float(y.sum()) / max(1, int(np.count_nonzero(y))) * float(table.cap.min())
    for _ in range(k):
        yk = yk + step * col.usage / table.cap
        col = price_tree(table, yk, mode, root)
        if col is None:
            break
        if float(col.usage @ y) < 1.0 - PRICE_TOL and all(col.edges != c.edges for c in out):
            out.append(col)
    return out


def solve_packing(table: RouteTable, mode: str, root, warm_start: int | None = None,
                  target: float | None = None, extra_columns: int = EXTRA_COLUMNS) -> PackingResult:
    """Maximum-rate fractional packing of spanning trees over ``table.devices``.

    LP: maximise sum_t w_t subject to sum_t usage_t(e) w_t <= cap(e) for every directed link e,
    w >= 0, columns = trees (``mode``: "arborescence" rooted at ``root`` for broadcast,
    "in-arborescence" into ``root`` for reduce, "spanning" for all-reduce, oriented from ``root``),
    each GPU-level edge with a chosen route. :func:`column_generation` starting from the cheapest
    tree at unit prices and ``warm_start`` (default 2n) multiplicative-weights rounds; pricing is one
    minimum arborescence / spanning tree (:func:`jax_blink.planner.routes.price_tree`); stops when no
    tree prices below 1 - PRICE_TOL or the rate reaches ``target`` (an independent upper bound, e.g.
    Edmonds' max-flow bound). Each round adds the cheapest tree plus up to ``extra_columns`` more
    that also price below 1 (see :func:`_more_columns`).

    Raises PlanError when no spanning tree exists (GPUs that cannot reach ``root``).
    """
    first = price_tree(table, np.ones(len(table.links)), mode, root)
    if first is None:
        raise PlanError(f"no spanning tree over devices {list(table.devices)} rooted at {root}: "
                        f"some GPUs cannot reach each other over the job's links")

    def price(y):
        col = price_tree(table, y, mode, root)
        return [] if col is None else [(root, col)]

    def extra(y, col):
        return [(root, c) for c in _more_columns(table, y, mode, root, col, extra_columns)]

    return column_generation(table.cap, price, start=[(root, first)],
                             warm_rounds=warm_start if warm_start is not None else 2 * len(table.devices),
                             target=target, extra=extra, what="tree-packing", devices=table.devices)


def solve_rooted_packing(table: RouteTable, mode: str, target: float | None = None,
                         warm_rounds: int | None = None) -> PackingResult:
    """Maximum equal-per-root packing of arborescences rooted at every GPU (all-gather / reduce-scatter).

    LP (ForestColl, Zhao et al. 2024, sections 4-5, as one LP): maximise x subject to, for every
    root r in ``table.devices``, sum of the weights of r's trees >= x, and for every directed link
    e, sum_t usage_t(e) w_t <= cap(e); w, x >= 0. Columns are spanning arborescences out of their
    root (``mode="arborescence"``, all-gather) or into it (``"in-arborescence"``, reduce-scatter),
    each GPU-level edge with a chosen route. :func:`column_generation` with ``roots``: with link
    duals y and root duals z, a tree rooted at r enters while its price usage . y < z_r - PRICE_TOL;
    pricing is one minimum arborescence per root over one shared table of route costs; warm start
    ``warm_rounds`` rounds over all roots (default min(n, 8): on dgx1v they cut the LP rounds from 16
    to 3). Weak duality gives the certificate n * cap . y / sum_r (cheapest tree price of r) at
    every round. Stops at optimality or once n * x reaches ``target`` (the exact cut bound,
    :func:`jax_blink.planner.bounds.allgather_bound`).

    Returns a PackingResult whose ``rate`` is n * x (the sum of all tree weights), ``weights`` the
    LP weights trimmed so every root carries exactly x, and ``roots`` the root of each column.
    Raises PlanError when some GPU cannot reach (or be reached from) another.
    """
    roots = list(table.devices)
    pr = pricer(table, mode)

    def price(y):
        w, pick = pr.costs(y)
        out = []
        for r in roots:
            col = tree_from_costs(table, pr, w, pick, r)
            if col is None:
                raise PlanError(f"no spanning tree over devices {list(table.devices)} rooted at {r}: "
                                f"some GPUs cannot reach each other over the job's links")
            out.append((r, col))
        return out

    n = len(roots)
    return column_generation(table.cap, price, warm_rounds=max(1, min(n, 8) if warm_rounds is None else warm_rounds),
                             roots=roots, target=target, what="all-gather packing", devices=table.devices)
