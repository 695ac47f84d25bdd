"""Exception types raised by jax_blink, one per stage of the pipeline."""


class BlinkError(Exception):
    """Base class of every error jax_blink raises on purpose."""


class TopologyError(BlinkError, ValueError):
    """A topology could not be built, parsed or queried (names the line, cell or device)."""


class PlanError(BlinkError, ValueError):
    """No valid tree packing exists for the request (names the devices involved)."""


class ScheduleError(BlinkError, ValueError):
    """A schedule could not be built or decoded."""
