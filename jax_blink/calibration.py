"""This machine's collectives, measured and fitted: per-call latency and bandwidth per lowering.

``jax-blink calibrate`` (:mod:`jax_blink.cli.calibrate_cmd`) times jax_blink's executor and XLA's own
collective (the ``"xla"`` lowering) at a few sizes and fits, per lowering x collective x group size,

    time = latency_s + nbytes * seconds_per_byte

(least squares on relative residuals, ``numpy.linalg.lstsq`` with weights 1 / time)

(``nbytes`` in jax_blink's convention: all-reduce the operand, all-gather the gathered output,
reduce-scatter the input), then writes them to ``<cache dir>/calibration.json`` beside the plan cache
(:func:`jax_blink.topology.probe.cache_dir`: ``$JAX_BLINK_CACHE_DIR``, else
``$XDG_CACHE_HOME/jax_blink``, else ``~/.cache/jax_blink``). ``impl="auto"`` reads it
(:func:`load`) to choose between jax_blink's executor and XLA's collective at each call site
(``jax_blink.dispatch``); without a file the defaults stand (jax_blink's executor on CPU, the NCCL
tuner model against the cost model on GPUs). A file that does not parse or does not have this
layout is ignored with a note (logger ``jax_blink.calibration``, WARNING, and :func:`note`);
``JAX_BLINK_CALIBRATION=0`` ignores any file.

File layout (JSON): ``{"version": 1, "platform": "cpu", "fits": [{"lowering": "ffi", "collective":
"allreduce", "group_size": 8, "latency_s": ..., "seconds_per_byte": ..., "sizes": [...],
"times_s": [...]}, ...]}``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib

import numpy as np

from . import envvars
from .topology.probe import cache_dir

VERSION = 1
FILE_NAME = "calibration.json"
#: ``JAX_BLINK_CALIBRATION=0``: ignore any calibration (the defaults stand); unset, empty or "1": use it.
ENV_CALIBRATION = "JAX_BLINK_CALIBRATION"
_LOG = logging.getLogger(__name__)
_state = {"note": None, "cache": None}


@dataclasses.dataclass(frozen=True)
class Fit:
    """``time = latency_s + nbytes * seconds_per_byte`` for one lowering x collective x group size,
    from ``sizes`` (bytes) and ``times_s`` (median seconds per call)."""

    lowering: str
    collective: str
    group_size: int
    latency_s: float
    seconds_per_byte: float
    sizes: tuple = ()
    times_s: tuple = ()

    def time_s(self, nbytes: float) -> float:
        """Seconds at ``nbytes``: between the smallest and largest measured size, the measured medians
        interpolated linearly in log(size) / log(time) (a CPU's per-call costs bend with the caches, a
        line through 4 KiB .. 16 MiB does not follow them); outside, the fitted line."""
        x = float(nbytes)
        if len(self.sizes) >= 2 and self.sizes[0] <= x <= self.sizes[-1] and x > 0:
            return float(np.exp(np.interp(np.log(x), np.log(self.sizes), np.log(self.times_s))))
        return self.latency_s + x * self.seconds_per_byte

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sizes"], d["times_s"] = list(self.sizes), list(self.times_s)
        return d


def fit(lowering: str, collective: str, group_size: int, sizes, times_s) -> Fit:
    """The least-squares :class:`Fit` of ``times_s`` (seconds) against ``sizes`` (bytes), minimising the
    residuals relative to each time (weights 1 / time), both terms non-negative (a negative intercept
    or slope, from noise, is refitted with that term at 0). Raises
    ValueError for fewer than two sizes, unequal lengths or non-finite / non-positive times."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(times_s, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"calibration.fit: needs two or more (size, time) pairs of equal length, got "
                         f"{len(x)} sizes and {len(y)} times")
    if not (np.all(np.isfinite(y)) and np.all(y > 0) and np.all(x >= 0)):
        raise ValueError("calibration.fit: times must be finite and > 0 s, sizes >= 0 bytes")
    w = 1.0 / y  # relative residuals: a 4 KiB call's microseconds count as much as a 64 MiB call's
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (lat, slope), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    if slope < 0:
        lat, slope = float(len(y) / np.sum(w)), 0.0
    elif lat < 0:
        slope, lat = float(np.dot(x * w, np.ones_like(y)) / np.dot(x * w, x * w)), 0.0
    order = np.argsort(x, kind="stable")
    return Fit(lowering, collective, int(group_size), float(lat), float(slope),
               tuple(int(s) for s in x[order]), tuple(float(t) for t in y[order]))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fits of one machine for one platform ("cpu", "cuda", ...)."""

    platform: str
    fits: tuple

    def time_s(self, lowering: str, collective: str, group_size: int, nbytes: float) -> float | None:
        """Fitted seconds of ``lowering`` for ``collective`` over ``group_size`` devices at ``nbytes``, or
        None when the calibration has no fit for them."""
        for f in self.fits:
            if (f.lowering, f.collective, f.group_size) == (lowering, collective, int(group_size)):
                return f.time_s(nbytes)
        return None

    def to_dict(self) -> dict:
        return {"version": VERSION, "platform": self.platform, "fits": [f.to_dict() for f in self.fits]}


def path() -> pathlib.Path:
    """Where the calibration lives: ``<cache dir>/calibration.json``."""
    return pathlib.Path(cache_dir()) / FILE_NAME


def save(cal: Calibration) -> pathlib.Path:
    """Write ``cal`` to :func:`path` atomically (a temporary file, then a rename); returns the path."""
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=1))
    os.replace(tmp, p)
    _state["cache"] = None
    return p


def _parse(data) -> Calibration:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        got = data.get("version") if isinstance(data, dict) else None
        raise ValueError(f"not a version-{VERSION} calibration (version {got!r})")
    platform = data.get("platform")
    if not isinstance(platform, str) or not isinstance(data.get("fits"), list):
        raise ValueError("needs a 'platform' string and a 'fits' list")
    fits = []
    for i, f in enumerate(data["fits"]):
        try:
            item = Fit(str(f["lowering"]), str(f["collective"]), int(f["group_size"]), float(f["latency_s"]),
                       float(f["seconds_per_byte"]), tuple(int(v) for v in f.get("sizes", ())),
                       tuple(float(v) for v in f.get("times_s", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"fit {i} is malformed ({type(err).__name__}: {err})") from None
        if not (math.isfinite(item.latency_s) and math.isfinite(item.seconds_per_byte)
                and item.latency_s >= 0 and item.seconds_per_byte >= 0 and item.group_size >= 2):
            raise ValueError(f"fit {i} has a negative or non-finite term or a group under 2 devices")
        sizes, times = item.sizes, item.times_s
        if len(sizes) != len(times) or any(b <= a for a, b in zip(sizes, sizes[1:])) or \
                any(v <= 0 for v in sizes) or not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"fit {i}: its measured sizes must increase, be > 0 and pair with finite "
                             f"times > 0 (got {len(sizes)} sizes, {len(times)} times)")
        fits.append(item)
    return Calibration(platform, tuple(fits))


def load(platform: str | None = None) -> Calibration | None:
    """This machine's calibration (for ``platform`` when given: None when the file is for another), or
    None without one. A file that cannot be read or parsed is ignored: None, a WARNING on logger
    ``jax_blink.calibration`` and :func:`note` saying why and what to do. Cached per file state.
    ``$JAX_BLINK_CALIBRATION=0``: None (EnvVarError, a ValueError, for a value that is no flag)."""
    if envvars.flag(ENV_CALIBRATION) is False:
        _state["note"] = None
        return None
    p = path()
    try:
        stat = p.stat()
    except OSError:
        _state["note"] = None
        return None
    key = (str(p), stat.st_mtime_ns, stat.st_size)
    if _state["cache"] is not None and _state["cache"][0] == key:
        cal = _state["cache"][1]
    else:
        try:
            cal = _parse(json.loads(p.read_text()))
            _state["note"] = None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as err:
            cal = None
            _state["note"] = (f"jax_blink: calibration {p} ignored ({type(err).__name__}: {err}); the defaults "
                              f"stand. Run `jax-blink calibrate` to write a new one, or delete the file")
            _LOG.warning("%s", _state["note"])
        _state["cache"] = (key, cal)
    if cal is not None and platform is not None and cal.platform != platform:
        return None
    return cal


def note() -> str | None:
    """Why the last :func:`load` ignored the calibration file (None when it did not)."""
    return _state["note"]
