"""Exception types raised by jax_blink, one per stage of the pipeline."""


class BlinkError(Exception):
    """Base class of every error jax_blink raises on purpose."""


class TopologyError(BlinkError, ValueError):
    """A topology could not be built, parsed or queried (names the line, cell or device)."""


class PlanError(BlinkError, ValueError):
    """No valid tree packing exists for the request (names the devices involved)."""


class ScheduleError(BlinkError, ValueError):
    """A schedule could not be built or decoded."""


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the innermost frame outside
    jax_blink, jax and jaxlib (a lowering-time warning is raised many frames deep inside jax's tracing,
    where a fixed ``stacklevel`` points at library code)."""
    import os
    import sys
    import warnings
    mods = (sys.modules.get(n) for n in ("jax_blink", "jax", "jaxlib"))
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in mods if m is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
