"""The admission queue: priority first, FIFO within a priority, admitted on events.

Runs inside the hub's event loop; every mutation ends in ``schedule()``, which admits
whatever now fits and refreshes the plain-words status of every waiting ticket. There
is no polling: a stop, a cancel, a new request or a policy reload is the trigger.
Ordering follows Kueue's scheduler: requests that fit within their team's nominal quota
go before requests that must borrow, then higher priority, then earlier arrival.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from prometheus_client import Gauge, Histogram

from ..policy.model import Policy
from .quota import Demand, add_usage, check_fit

log = logging.getLogger("JupyterHub.gpuhub.admission")

QUEUE_WAITING = Gauge("gpuhub_queue_waiting", "Servers waiting for admission", ["team"])
RESOURCE_IN_USE = Gauge("gpuhub_admitted_resources", "Admitted resources per team", ["team", "resource"])
ADMISSION_WAIT = Histogram(
    "gpuhub_admission_wait_seconds",
    "Time from request to admission",
    buckets=(0.1, 1, 5, 30, 60, 300, 900, 1800, 3600, 7200, float("inf")),
)


class Allocator(Protocol):
    """Hands out concrete devices once quota admits a request (one-machine backend)."""

    def allocate(self, key: str, demand: Demand) -> list[str] | None: ...
    def free(self, key: str) -> None: ...
    def restore(self, key: str, devices: list[str]) -> None: ...
    def shortage(self, demand: Demand) -> str | None: ...
    def never_fits(self, demand: Demand) -> str | None: ...


class QueueRefused(Exception):
    """The request can never be admitted (more than the team or machine can ever hold)."""


@dataclass
class WaitStatus:
    position: int  # 1-based, in the team's queue
    waiting_in_team: int
    reason: str
    team: str
    in_use: dict[str, int]  # the team's admitted amount per requested resource
    message: str = ""


@dataclass
class Admission:
    key: str
    user: str
    team: str
    profile: str
    demand: Demand
    devices: list[str]
    since: float = field(default_factory=time.time)


_seq = itertools.count()


@dataclass(eq=False)
class Ticket:
    key: str  # "user/server-name": one request per server
    user: str
    team: str
    profile: str
    demand: Demand
    priority: int = 0
    created: float = field(default_factory=time.time)
    seq: int = field(default_factory=lambda: next(_seq))
    status: WaitStatus | None = None
    admission: Admission | None = None
    version: int = 0

    def __post_init__(self):
        self._future: asyncio.Future | None = None
        self._cancelled = False
        self._changed = asyncio.Event()

    @property
    def future(self) -> asyncio.Future:
        """Resolves to the ``Admission``; cancelled when the request leaves the queue."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self._cancelled:
                self._future.cancel()
        return self._future

    def _cancel(self) -> None:
        self._cancelled = True
        if self._future is not None and not self._future.done():
            self._future.cancel()
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, since_version: int, timeout: float | None = None) -> None:
        """Wait until the status moves past ``since_version`` (or ``timeout``)."""
        if self.version != since_version:
            return
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class AdmissionQueue:
    def __init__(self, policy: Callable[[], Policy], allocator: Allocator | None = None):
        self._policy = policy
        self.allocator = allocator
        self.waiting: list[Ticket] = []
        self.admitted: dict[str, Admission] = {}
        self.on_admit: list[Callable[[Admission], None]] = []

    # -- state -----------------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        usage: dict[str, dict[str, int]] = {}
        for adm in self.admitted.values():
            add_usage(usage, adm.team, adm.demand)
        return usage

    def ticket(self, key: str) -> Ticket | None:
        return next((t for t in self.waiting if t.key == key), None)

    # -- events ----------------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> Ticket:
        """Queue a request (and admit it at once if it fits); refuse what can never fit."""
        if ticket.key in self.admitted or self.ticket(ticket.key):
            raise QueueRefused(f"server {ticket.key} already holds or waits for resources")
        policy = self._policy()
        team = policy.team(ticket.team)
        fit = check_fit(policy, {}, team, ticket.demand)
        never = fit.never or (self.allocator.never_fits(ticket.demand) if self.allocator else None)
        if never:
            raise QueueRefused(never)
        self.waiting.append(ticket)
        self.schedule()
        return ticket

    def cancel(self, key: str) -> bool:
        ticket = self.ticket(key)
        if ticket is None:
            return False
        self.waiting.remove(ticket)
        ticket._cancel()
        log.info("Request %s left the queue", key)
        self.schedule()
        return True

    def release(self, key: str) -> Admission | None:
        """Free what ``key`` holds and hand it to whoever waits next."""
        adm = self.admitted.pop(key, None)
        if adm is None:
            return None
        if self.allocator:
            self.allocator.free(key)
        log.info("Released %s (%s, team %s): %s", key, adm.profile, adm.team, adm.devices or "no devices")
        self.schedule()
        return adm

    def restore(self, adm: Admission) -> None:
        """Re-register a server found running after a hub restart (no queueing)."""
        if adm.key in self.admitted:
            raise ValueError(f"{adm.key} is already registered")
        if self.allocator:
            self.allocator.restore(adm.key, adm.devices)
        self.admitted[adm.key] = adm
        self._update_metrics()

    # -- the scheduler ---------------------------------------------------------------------
    def _order(self, policy: Policy, usage) -> list[tuple[bool, Ticket]]:
        entries = []
        for t in self.waiting:
            try:
                team = policy.team(t.team)
            except StopIteration:  # team removed from the policy while waiting
                entries.append((True, t))
                continue
            entries.append((check_fit(policy, usage, team, t.demand).borrows, t))
        entries.sort(key=lambda e: (e[0], -e[1].priority, e[1].created, e[1].seq))
        return entries

    def schedule(self) -> list[Admission]:
        policy = self._policy()
        usage = self.usage()
        admitted: list[Admission] = []
        blocked_teams: set[str] = set()
        for _borrows, ticket in self._order(policy, usage):
            team = next((t for t in policy.teams if t.name == ticket.team), None)
            if team is None or ticket.team in blocked_teams:
                continue
            fit = check_fit(policy, usage, team, ticket.demand)
            devices: list[str] | None = []
            if fit.fits and self.allocator:
                devices = self.allocator.allocate(ticket.key, ticket.demand)
            if not fit.fits or devices is None:
                if team.queueing_strategy == "StrictFIFO":
                    blocked_teams.add(ticket.team)
                continue
            adm = Admission(ticket.key, ticket.user, ticket.team, ticket.profile, ticket.demand, devices or [])
            self.admitted[ticket.key] = adm
            add_usage(usage, ticket.team, ticket.demand)
            self.waiting.remove(ticket)
            ticket.admission = adm
            ADMISSION_WAIT.observe(time.time() - ticket.created)
            log.info("Admitted %s (%s, team %s) devices=%s", ticket.key, ticket.profile, ticket.team, adm.devices)
            if not ticket.future.done():
                ticket.future.set_result(adm)
            ticket._notify()
            admitted.append(adm)
            for hook in self.on_admit:
                hook(adm)
        self._refresh_statuses(policy, usage)
        self._update_metrics()
        return admitted

    def _refresh_statuses(self, policy: Policy, usage) -> None:
        per_team: dict[str, list[Ticket]] = {}
        for _b, t in self._order(policy, usage):
            per_team.setdefault(t.team, []).append(t)
        for team_name, tickets in per_team.items():
            team = next((t for t in policy.teams if t.name == team_name), None)
            for pos, ticket in enumerate(tickets, 1):
                if team is None:
                    reason = f"team {team_name!r} is no longer in the policy"
                else:
                    fit = check_fit(policy, usage, team, ticket.demand)
                    if not fit.fits:
                        reason = "; ".join(s.reason for s in fit.shortages)
                    elif self.allocator and (short := self.allocator.shortage(ticket.demand)):
                        reason = short
                    elif pos > 1:
                        reason = "requests ahead of yours in your team's queue go first"
                    else:
                        reason = "waiting for the scheduler"
                in_use = {k: usage.get(team_name, {}).get(k, 0) for k in ticket.demand}
                label = team.label if team else team_name
                message = (
                    f"Waiting in the queue: position {pos} of {len(tickets)} in {label}'s queue. "
                    f"This server {reason[0].lower() + reason[1:] if reason else ''}."
                )
                status = WaitStatus(pos, len(tickets), reason, team_name, in_use, message)
                if status != ticket.status:
                    ticket.status = status
                    ticket._notify()

    def _update_metrics(self) -> None:
        teams = {t.team for t in self.waiting} | {a.team for a in self.admitted.values()}
        for team in teams:
            QUEUE_WAITING.labels(team=team).set(sum(1 for t in self.waiting if t.team == team))
        for team, keys in self.usage().items():
            for key, amount in keys.items():
                RESOURCE_IN_USE.labels(team=team, resource=key).set(amount)

    # -- read-only view for pages -----------------------------------------------------------
    def holdings(self) -> Iterable[Admission]:
        return list(self.admitted.values())
