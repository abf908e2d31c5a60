"""Which borrowed resources come back, and for whom: Kueue's ``reclaimWithinCohort``.

A team's nominal quota is a promise. Others may borrow what it does not use; when one of
its requests would fit inside its own nominal quota but not in what is free, the
capacity is on loan and comes back from the borrowers. This module only *plans* (pure,
no clock, no I/O); ``local.reclaimer`` carries the plan out: a borrowing job stops at
once and re-queues, a borrowing server gets a warning and stops after the lender's
``reclaim.notice``.

The order is Kueue's for preemption candidates: among the holders of teams that are
borrowing the needed resource, **lowest priority first, then the most recently
admitted** — except that a holder already under notice goes first, so a warning once
given is never moved to someone else (and never given twice). Like Kueue, a team stops
being a candidate as soon as it is no longer above its nominal quota, and holders the
request turns out not to need after all are put back (newest pick first).

A minimum runtime (``fairShare.minRuntime``, Slurm's ``PreemptExemptTime``) protects a
borrower admitted less than that long ago: it is no candidate until then, and the request
it would have served notes when it can be (``Plan.protected``).

A hold-down keeps a lender from preempting at will (``HoldDown``): a lender who withdraws
a request for which borrowers were reclaimed (cancelled while waiting, or stopped soon
after admission) has nothing reclaimed for any request of theirs until one notice period
after that reclaim. Otherwise starting and cancelling a spawn would preempt a borrowing
job each time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping

from ..policy.model import Policy, Team
from .quota import add_usage, check_fit, limits


@dataclass(frozen=True)
class Holder:
    """Something admitted that may be reclaimed (a server or a job)."""

    key: str
    team: str
    demand: Mapping[str, int]
    priority: int = 0
    admitted: float = 0.0
    job: bool = False


@dataclass(frozen=True)
class Request:
    """A waiting request, in queue order. ``lender``: who asks (the hub user), for the hold-down."""

    key: str
    team: str
    demand: Mapping[str, int]
    lender: str = ""


@dataclass
class Plan:
    """Holder key -> (the team that needs it back, the waiting request it is for)."""

    reclaim: dict[str, tuple[str, str]] = field(default_factory=dict)
    covered: dict[str, list[str]] = field(default_factory=dict)  # request key -> holders it waits for
    held: list[str] = field(default_factory=list)  # requests that needed a reclaim but are held down
    # request key -> when the earliest borrower protected by the minimum runtime may be reclaimed
    protected: dict[str, float] = field(default_factory=dict)


@dataclass
class HoldDown:
    """One reclaim per lender per notice period, however often the lender asks and withdraws.

    When borrowers are reclaimed for a request (a job preempted, a server warned), the
    request's lender is noted with the end of the lender team's ``reclaim.notice`` from
    then. If that request is withdrawn before then (cancelled while waiting, or released
    after its admission), the lender is *held down* until that time: ``plan`` reclaims
    nothing for their requests (they wait like any request that does not fit; requests
    that fit are admitted as usual). A request kept past the notice period, or never
    withdrawn, holds nothing down. Keyed by the hub user, not the request: server names
    and job ids are the user's to choose. Pure: every time is passed in.
    """

    reclaims: dict[str, tuple[str, float]] = field(default_factory=dict)  # request key -> (lender, period end)
    until: dict[str, float] = field(default_factory=dict)  # lender -> end of their hold-down

    def reclaimed(self, key: str, lender: str, at: float, notice: float) -> None:
        """Borrowers were reclaimed for request ``key`` of ``lender`` (the first time counts)."""
        if key not in self.reclaims:
            self.reclaims[key] = (lender, at + max(0.0, notice))

    def withdrawn(self, key: str, at: float) -> float | None:
        """Request ``key`` left (cancelled or released): the end of its lender's hold-down, if any."""
        lender, end = self.reclaims.pop(key, ("", 0.0))
        if not lender or at >= end:
            return None
        self.until[lender] = max(self.until.get(lender, 0.0), end)
        return self.until[lender]

    def held(self, now: float) -> dict[str, float]:
        """Lender -> end of their hold-down, for those held down at ``now``."""
        for lender in [u for u, end in self.until.items() if end <= now]:
            del self.until[lender]
        for key in [k for k, (_, end) in self.reclaims.items() if end <= now]:
            del self.reclaims[key]
        return dict(self.until)


def within_nominal(policy: Policy, usage: Mapping[str, Mapping[str, int]], team: Team, demand: Mapping[str, int]) -> bool:
    """Would ``demand`` keep ``team`` at or below its nominal quota on every GPU it asks for?"""
    gpu = {k: v for k, v in demand.items() if k.startswith("gpu/") and v > 0}
    if not gpu or not team.cohort:
        return False
    for key, amount in gpu.items():
        lim = limits(team, key)
        if lim is None or usage.get(team.name, {}).get(key, 0) + amount > lim.nominal:
            return False
    return True


def borrowing(policy: Policy, usage: Mapping[str, Mapping[str, int]], team_name: str, key: str) -> int:
    """How much of ``key`` team ``team_name`` holds above its nominal quota."""
    team = policy.team_or_none(team_name)
    if team is None:
        return 0
    lim = limits(team, key)
    if lim is None:
        return 0
    return max(0, usage.get(team_name, {}).get(key, 0) - lim.nominal)


def plan(
    policy: Policy,
    usage: Mapping[str, Mapping[str, int]],
    holders: Iterable[Holder],
    waiting: Iterable[Request],
    free_devices: Mapping[str, int] | None = None,
    under_notice: Collection[str] = frozenset(),
    held_down: Collection[str] = frozenset(),
    now: float = 0.0,
    min_runtime: float = 0.0,
) -> Plan:
    """What to take back so that every waiting within-nominal request fits.

    ``usage``: admitted amounts per team and key (the queue's). ``free_devices``: free
    devices per ``gpu/<flavor>`` key on one machine (``None`` where devices are not
    counted, as on Kubernetes). ``waiting`` in queue order; each request is planned on
    top of the earlier ones (what they take, what they get back). Teams whose
    ``reclaim.enabled`` is false never take anything back, nor do requests whose
    ``lender`` is in ``held_down`` (``HoldDown.held``): those are listed in ``Plan.held``.
    A holder admitted less than ``min_runtime`` before ``now`` is never picked (already under
    notice excepted: a warning once given stands); ``Plan.protected`` says until when.
    """
    trial: dict[str, dict[str, int]] = {t: dict(u) for t, u in usage.items()}
    free = dict(free_devices) if free_devices is not None else None
    pool = list(holders)
    taken: set[str] = set()
    out = Plan()
    for req in waiting:
        team = policy.team_or_none(req.team)
        if team is None or not policy.reclaim_rules(team).enabled:
            continue
        if not within_nominal(policy, trial, team, req.demand):
            continue
        gpu_keys = [k for k in req.demand if k.startswith("gpu/") and req.demand[k] > 0]

        def fits(t, f, team=team, req=req, gpu_keys=gpu_keys) -> bool:
            if not check_fit(policy, t, team, dict(req.demand)).fits:
                return False
            return f is None or all(f.get(k, 0) >= req.demand[k] for k in gpu_keys)

        if fits(trial, free):
            _take(trial, free, req.team, req.demand)  # fits already (or once earlier reclaims land)
            continue
        if req.lender and req.lender in held_down:
            out.held.append(req.key)  # withdrew a request that reclaimed: not again within the notice
            continue
        members = {m.name for m in policy.cohort_members(team)} - {team.name}
        eligible = [h for h in pool if h.key not in taken and h.team in members and any(h.demand.get(k) for k in gpu_keys)]
        young = [h for h in eligible if min_runtime > 0 and h.key not in under_notice and now - h.admitted < min_runtime]
        if young:
            eligible = [h for h in eligible if h not in young]
        candidates = sorted(eligible, key=lambda h: (h.key not in under_notice, h.priority, -h.admitted, h.key))
        t2 = {t: dict(u) for t, u in trial.items()}
        f2 = dict(free) if free is not None else None
        picks: list[Holder] = []
        for h in candidates:
            if not any(borrowing(policy, t2, h.team, k) > 0 for k in gpu_keys if h.demand.get(k)):
                continue  # that team is back within its quota: nothing of it is on loan
            _give_back(t2, f2, h)
            picks.append(h)
            if fits(t2, f2):
                break
        else:
            if young and any(borrowing(policy, t2, h.team, k) > 0 for h in young for k in gpu_keys if h.demand.get(k)):
                out.protected[req.key] = min(h.admitted for h in young) + min_runtime
            continue  # cannot be made to fit by reclaiming (teammates, other teams' own quota)
        # Put back what turned out not to be needed (Kueue: newest pick first, except the last).
        for h in reversed(picks[:-1]):
            t3 = {t: dict(u) for t, u in t2.items()}
            f3 = dict(f2) if f2 is not None else None
            _take(t3, f3, h.team, h.demand)
            if fits(t3, f3):
                t2, f2 = t3, f3
                picks.remove(h)
        for h in picks:
            taken.add(h.key)
            out.reclaim[h.key] = (req.team, req.key)
        out.covered[req.key] = [h.key for h in picks]
        trial, free = t2, f2
        _take(trial, free, req.team, req.demand)
    return out


def _give_back(usage: dict, free: dict | None, h: Holder) -> None:
    add_usage(usage, h.team, dict(h.demand), -1)
    if free is not None:
        for k, v in h.demand.items():
            if k.startswith("gpu/"):
                free[k] = free.get(k, 0) + v


def _take(usage: dict, free: dict | None, team: str, demand: Mapping[str, int]) -> None:
    add_usage(usage, team, dict(demand))
    if free is not None:
        for k, v in demand.items():
            if k.startswith("gpu/"):
                free[k] = free.get(k, 0) - v
