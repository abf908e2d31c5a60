"""Kueue-style admission for the one-machine backend (and the trace-replay benchmark).

``quota`` decides whether a request fits a team's nominal quota or may borrow from its
cohort; ``queue`` orders waiting requests (priority, then FIFO) and admits them on
events — a server stopping, a request arriving or leaving, a policy change.
"""

from .quota import Demand, Fit, check_fit, demand_for

__all__ = ["AdmissionQueue", "Demand", "Fit", "Ticket", "WaitStatus", "check_fit", "demand_for"]


def __getattr__(name: str):
    # The queue (asyncio, prometheus_client) is imported on first use: what only needs the
    # quota arithmetic (`gpuhub validate`'s machine check through local.devices) skips it.
    if name in ("AdmissionQueue", "Ticket", "WaitStatus"):
        from . import queue

        return getattr(queue, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
