"""Fair share over time: decayed GPU usage per team and per user (docs/fair-share.md).

What counts is GPU-seconds *held* (from admission to release), per flavor times the
policy's ``fairShare.flavorWeights``, decayed exponentially with ``fairShare.halfLife``:
an hour held a half-life ago counts half an hour. Kueue's Admission Fair Sharing keeps
the same quantity (an exponentially weighted average of admitted requests, sampled), so
the two modes order alike; here it is exact and continuous.

Cost: each team and user keeps ``(value, rate, at)`` (usage decayed to ``at``; weighted
GPUs held since) and is brought forward on demand, so an admission or release is O(1)
and reading a team's usage is one ``exp``: nothing is swept per event, whatever the
number of teams. The ledger runs whether fair share is on or not (it costs nothing), so
turning it on finds the recent past already counted; after a hub restart it is seeded from
the usage history (``usage.history``, the hub's database), which is where it survives.

Pure apart from the clock passed in: the admission queue owns one (``AdmissionQueue.fair``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..policy.model import DEFAULT_HALF_LIFE, FairShare, Policy, Team
from .quota import limits

LN2 = math.log(2.0)
SEED_HALF_LIVES = 10  # history older than this counts under 1/1000: not read at a seed


@dataclass(frozen=True)
class Interval:
    """GPUs of one flavor held by one user of a team from ``start`` to ``end`` (None: still held)."""

    team: str
    user: str
    flavor: str
    gpus: int
    start: float
    end: float | None


class _Acc:
    __slots__ = ("value", "rate", "at")

    def __init__(self, at: float):
        self.value = 0.0  # weighted GPU-seconds, decayed to ``at``
        self.rate = 0.0  # weighted GPUs held since ``at``
        self.at = at

    def read(self, now: float, lam: float) -> float:
        dt = now - self.at
        if dt <= 0:
            return self.value
        d = math.exp(-lam * dt)
        return self.value * d + self.rate * (1.0 - d) / lam

    def advance(self, now: float, lam: float) -> None:
        if now > self.at:
            self.value = self.read(now, lam)
            self.at = now


def gpu_rate(policy: Policy | None, demand: Mapping[str, int]) -> float:
    """Weighted GPUs of ``demand`` (``gpu/<flavor>`` keys times the flavor's weight)."""
    fs = policy.fair_share if policy is not None else None
    out = 0.0
    for key, amount in demand.items():
        if key.startswith("gpu/") and amount > 0:
            out += amount * (fs.flavor_weight(key[4:]) if fs is not None else 1.0)
    return out


class UsageLedger:
    def __init__(self, clock: Callable[[], float] = time.time, half_life: float = DEFAULT_HALF_LIFE):
        self.clock = clock
        self.half_life = half_life
        self._lam = LN2 / half_life
        self._teams: dict[str, _Acc] = {}
        self._users: dict[tuple[str, str], _Acc] = {}
        self._held: dict[str, tuple[str, str, float]] = {}  # admission key -> (team, user, rate)
        # Where a seed reads from: ``since -> intervals`` (the usage history); set by the recorder.
        self.source: Callable[[float], Iterable[Interval]] | None = None
        self._weights: tuple = ()

    # -- events ------------------------------------------------------------------------------
    def admit(self, key: str, team: str, user: str, demand: Mapping[str, int], policy: Policy | None = None) -> None:
        if key in self._held:
            return
        rate = gpu_rate(policy, demand)
        self._held[key] = (team, user, rate)
        if rate:
            now = self.clock()
            for acc in (self._acc(self._teams, team, now), self._acc(self._users, (team, user), now)):
                acc.advance(now, self._lam)
                acc.rate += rate

    def release(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None or not held[2]:
            return
        team, user, rate = held
        now = self.clock()
        for acc in (self._teams.get(team), self._users.get((team, user))):
            if acc is not None:
                acc.advance(now, self._lam)
                acc.rate = max(0.0, acc.rate - rate)

    def _acc(self, table: dict, key, now: float) -> _Acc:
        acc = table.get(key)
        if acc is None:
            acc = table[key] = _Acc(now)
        return acc

    # -- reads -------------------------------------------------------------------------------
    def team(self, name: str, now: float | None = None) -> float:
        """``name``'s decayed weighted GPU-seconds."""
        acc = self._teams.get(name)
        return 0.0 if acc is None else acc.read(self.clock() if now is None else now, self._lam)

    def user(self, team: str, user: str, now: float | None = None) -> float:
        acc = self._users.get((team, user))
        return 0.0 if acc is None else acc.read(self.clock() if now is None else now, self._lam)

    def teams(self, now: float | None = None) -> dict[str, float]:
        now = self.clock() if now is None else now
        return {name: acc.read(now, self._lam) for name, acc in self._teams.items()}

    def users(self, now: float | None = None) -> dict[tuple[str, str], float]:
        now = self.clock() if now is None else now
        return {k: acc.read(now, self._lam) for k, acc in self._users.items()}

    @staticmethod
    def ratio(usage: float, weight: float) -> float:
        """Usage per unit of weight: who has had less than its share goes first (weight 0: last)."""
        if weight <= 0:
            return math.inf
        return usage / weight

    # -- policy and history ------------------------------------------------------------------
    def configure(self, policy: Policy) -> None:
        """Follow the policy's half-life and flavor weights; a change re-reads the history
        (where one is attached): values decayed with one half-life cannot be converted."""
        fs = policy.fair_share
        half_life = fs.half_life if fs is not None else DEFAULT_HALF_LIFE
        weights = tuple(sorted(fs.flavor_weights.items())) if fs is not None else ()
        if half_life == self.half_life and weights == self._weights:
            return
        self.half_life, self._lam, self._weights = half_life, LN2 / half_life, weights
        if self.source is not None:
            self.seed(self.source(self.clock() - SEED_HALF_LIVES * half_life), policy)

    def seed(self, intervals: Iterable[Interval], policy: Policy | None = None) -> None:
        """Start from recorded history: decayed usage of every interval up to now, plus the
        rate of what is still held (by ``admit``; its past is counted here)."""
        now = self.clock()
        lam = self._lam
        fs = policy.fair_share if policy is not None else None
        teams: dict[str, _Acc] = {}
        users: dict[tuple[str, str], _Acc] = {}
        for iv in intervals:
            if iv.gpus <= 0 or not iv.flavor:
                continue
            end = now if iv.end is None else min(iv.end, now)
            start = min(iv.start, end)
            w = iv.gpus * (fs.flavor_weight(iv.flavor) if fs is not None else 1.0)
            value = w * (math.exp(-lam * (now - end)) - math.exp(-lam * (now - start))) / lam
            for table, key in ((teams, iv.team), (users, (iv.team, iv.user))):
                self._acc(table, key, now).value += value
        # What is held now keeps its rate (its past is in the seed from the history).
        for team, user, rate in self._held.values():
            for table, key in ((teams, team), (users, (team, user))):
                self._acc(table, key, now).rate += rate
        self._teams, self._users = teams, users


def use_per_share(
    policy: Policy, intervals: Iterable[Interval], times: list[float], teams: set[str] | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Each team's recent use as a part of its cohort's, divided by its share, at ``times``: 1
    means it used exactly its share lately, 2 twice, 0.5 half (the usage page's chart). Only
    with fair share on (empty otherwise); ``teams``: whose series to return."""
    fs = policy.fair
    if fs is None or not times:
        return {}
    lam = LN2 / fs.half_life
    used: dict[str, list[float]] = {}
    for iv in intervals:
        if iv.gpus <= 0 or not iv.flavor or policy.team_or_none(iv.team) is None:
            continue
        w = iv.gpus * fs.flavor_weight(iv.flavor)
        row = used.setdefault(iv.team, [0.0] * len(times))
        for i, t in enumerate(times):
            if iv.start >= t:
                continue
            end = t if iv.end is None else min(iv.end, t)
            row[i] += w * (math.exp(-lam * (t - end)) - math.exp(-lam * (t - iv.start))) / lam
    totals: dict[str, list[float]] = {}
    for name, row in used.items():
        group = policy.team(name).cohort or ""
        acc = totals.setdefault(group, [0.0] * len(times))
        for i, v in enumerate(row):
            acc[i] += v
    out: dict[str, list[tuple[float, float]]] = {}
    for team in policy.teams:
        if teams is not None and team.name not in teams:
            continue
        share = policy.share_of(team)
        row = used.get(team.name, [0.0] * len(times))
        total = totals.get(team.cohort or "", [0.0] * len(times))
        out[team.name] = [(ts, round(row[i] / total[i] / share, 3) if total[i] and share else 0.0) for i, ts in enumerate(times)]
    return out


class FairOrder:
    """The fair-share part of one scheduling pass's sort keys (cached per pass: O(1) reads)."""

    def __init__(self, policy: Policy, ledger: UsageLedger, usage: Mapping[str, Mapping[str, int]]):
        fs = policy.fair
        if fs is None:
            raise ValueError("a fair-share order needs a policy with fairShare enabled")
        self.policy = policy
        self.fs: FairShare = fs
        self.ledger = ledger
        self.usage = usage
        self.now = ledger.clock()
        self._team: dict[str, float] = {}
        self._user: dict[tuple[str, str], float] = {}

    def team_ratio(self, team: Team) -> float:
        r = self._team.get(team.name)
        if r is None:
            r = self._team[team.name] = UsageLedger.ratio(self.ledger.team(team.name, self.now), team.weight)
        return r

    def user_usage(self, team: str, user: str) -> float:
        r = self._user.get((team, user))
        if r is None:
            r = self._user[team, user] = self.ledger.user(team, user, self.now)
        return r

    def borrowed_share(self, team: Team, demand: Mapping[str, int]) -> float:
        """Kueue's fair-sharing share, with the request admitted: weighted GPUs above the
        team's nominal quota per unit of weight (borrowing of idle capacity shared by weight)."""
        used = self.usage.get(team.name, {})
        over = 0.0
        for key, amount in demand.items():
            if not key.startswith("gpu/") or amount <= 0:
                continue
            lim = limits(team, key)
            if lim is None:
                continue
            over += max(0, used.get(key, 0) + amount - lim.nominal) * self.fs.flavor_weight(key[4:])
        return UsageLedger.ratio(over, team.weight) if over else 0.0


def gpu_time(gpu_seconds: float) -> str:
    """'41 GPU-hours', '0.4 GPU-hours', '12 GPU-minutes', 'no GPU time': as a person reads it."""
    h = gpu_seconds / 3600.0
    if h >= 9.95:
        return f"{h:.0f} GPU-hours"
    if h >= 0.095:
        n = f"{h:.1f}".rstrip("0").rstrip(".")
        return f"{n} GPU-hour{'' if n == '1' else 's'}"
    m = round(gpu_seconds / 60.0)
    if m >= 1:
        return f"{m} GPU-minute{'' if m == 1 else 's'}"
    return "no GPU time"
