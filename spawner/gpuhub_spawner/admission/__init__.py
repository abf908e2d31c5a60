"""Kueue-style admission for the one-machine backend (and the trace-replay benchmark).

``quota`` decides whether a request fits a team's nominal quota or may borrow from its
cohort; ``queue`` orders waiting requests (priority, then FIFO) and admits them on
events — a server stopping, a request arriving or leaving, a policy change.
"""

from .queue import AdmissionQueue, Ticket, WaitStatus
from .quota import Demand, Fit, check_fit, demand_for

__all__ = ["AdmissionQueue", "Demand", "Fit", "Ticket", "WaitStatus", "check_fit", "demand_for"]
