"""What a policy edit would do to people, before it applies (issue 26): pure, no hub, no clock.

Given the policy in force, a candidate, the hub's users with their groups, what is admitted
(servers and jobs: who, team, profile, resources) and what waits, ``impact`` says in plain
words:

- which users gain or lose which profiles (and teams);
- which teams' quotas, borrowing and lending limits, cohorts and per-user caps change, by how much;
- which running servers and jobs would be over their team's new quota, over the new per-user
  caps, on a profile or team the candidate removes, and what gpuhub then does with each;
- which waiting requests would be admitted at once, wait longer or can never be admitted;
- which idle (culling) rules change for running servers.

What gpuhub does is read from the code, not promised: nothing that runs is stopped by a policy
change. ``AdmissionQueue`` keeps every admission (its usage keeps counting) and re-runs
``schedule()`` on the new quotas; per-user caps (``policy.access.check_user_caps``) are checked
only when a server or job starts; a server whose profile is gone keeps running and is culled by
``defaults.idle`` (``culling.board.rules_for(None)``), without the GPU-idle rule
(``ServerView.has_gpus`` needs the profile). The one thing that can stop a holder is the
reclaimer (``admission.reclaim.plan``): what a team holds above its nominal quota in a cohort is
borrowed, and comes back when another team of the cohort, with ``reclaim.enabled``, waits for
its own nominal quota — a server is warned and stopped after that team's ``reclaim.notice``, a
job stopped at once and re-queued. A waiting request keeps the resources it asked for, also
when its profile is removed; one that can never fit any more is not refused but waits until
``defaults.queueTimeout`` withdraws it; one whose team is removed is never admitted.

Layer 2 (admission): it needs the quota arithmetic (``quota.check_fit``, ``limits``) and the
shapes of admissions and tickets, and reads the idle rules from the policy model; it imports
no service or backend, so the hub handler, the CLI and unit tests call it the same way.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..policy.model import IdleRules, Policy, Profile, Team
from ..policy.quantities import format_cpu, format_duration, format_memory
from .quota import GPU_MEMORY, check_fit, describe, limits


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Person:
    name: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Holding:
    """Something admitted: a server (``user/name``) or a job (``job:<id>``)."""

    key: str
    user: str
    team: str
    profile: str
    demand: Mapping[str, int]
    since: float = 0.0
    priority: int = 0
    last_activity: float | None = None

    @property
    def job(self) -> bool:
        return self.key.startswith("job:")


@dataclass(frozen=True)
class Request:
    """A waiting request, as the queue holds it."""

    key: str
    user: str
    team: str
    profile: str
    demand: Mapping[str, int]
    priority: int = 0
    created: float = 0.0

    @property
    def job(self) -> bool:
        return self.key.startswith("job:")


# -- output ----------------------------------------------------------------------------------------
SECTIONS = ("warnings", "profiles", "quotas", "running", "waiting", "culling", "kueue")
TITLES = {
    # What `gpuhub validate` warns about the new policy on this hub (the machine's capacity, the
    # warning interval): filled by the hub from its backend (hub/policy_api.py).
    "warnings": "Warnings: what the new policy promises that this hub cannot keep",
    "profiles": "Who gains or loses profiles",
    "quotas": "Quotas, borrowing and lending",
    "running": "Running servers and jobs",
    "waiting": "Waiting requests",
    "culling": "Idle rules of running servers",
    "kueue": "Kueue objects (Kubernetes)",  # filled by the hub on Kubernetes (kube/kueue_diff.py)
}


@dataclass
class Line:
    section: str
    text: str
    teams: frozenset[str] = frozenset()  # whose impact this is (a lead sees their teams' lines)
    users: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()  # servers / jobs / requests named
    anon: str = ""  # the same without the user's name ("would join Vision Lab"), for a lead who may not see them

    def as_dict(self) -> dict:
        return {
            "section": self.section,
            "text": self.text,
            "teams": sorted(self.teams),
            "users": sorted(self.users),
            "keys": sorted(self.keys),
        }


@dataclass
class Impact:
    lines: list[Line] = field(default_factory=list)
    touched_teams: set[str] = field(default_factory=set)  # teams whose entries the edit changes
    global_changes: list[str] = field(default_factory=list)  # what changes for every team

    def add(self, section: str, text: str, teams=(), users=(), keys=()) -> None:
        self.lines.append(Line(section, text, frozenset(teams), frozenset(users), frozenset(keys)))

    def section(self, name: str) -> list[Line]:
        return [ln for ln in self.lines if ln.section == name]

    def only_teams(self, teams: set[str]) -> "Impact":
        """What a lead of ``teams`` may see: lines about those teams only."""
        return Impact([ln for ln in self.lines if ln.teams & teams], self.touched_teams & teams, [])

    def for_lead(self, teams: set[str], insiders: set[str]) -> "Impact":
        """What a lead of ``teams`` may see: lines about those teams only, naming only ``insiders``
        (the people of those teams under the policy in force); anyone else is counted, not named
        ("3 people outside your teams would join Vision Lab")."""
        kept: list[Line | None] = []
        counted: dict[tuple[str, str], tuple[int, set[str], set[str]]] = {}
        for ln in self.lines:
            if not ln.teams & teams:
                continue
            outside = ln.users - insiders
            if not outside:
                kept.append(ln)
                continue
            if ln.anon and len(ln.users) == 1:
                at, who, whose = counted.setdefault((ln.section, ln.anon), (len(kept), set(), set()))
                who.update(outside)
                whose.update(ln.teams & teams)
                if at == len(kept):
                    kept.append(None)  # its place, filled below
                continue
            text = ln.text
            for name in sorted(outside, key=len, reverse=True):
                text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", "someone outside your teams", text)
            keys = frozenset(k for k in ln.keys if k.startswith("job:") or k.partition("/")[0] not in outside)
            kept.append(Line(ln.section, text, ln.teams, ln.users & frozenset(insiders), keys))
        for (section, anon), (at, who, whose) in counted.items():
            n = len(who)
            kept[at] = Line(section, f"{n} {'person' if n == 1 else 'people'} outside your teams {anon}.", frozenset(whose))
        return Impact([ln for ln in kept if ln is not None], self.touched_teams & teams, [])

    @property
    def empty(self) -> bool:
        return not self.lines

    def summary(self) -> str:
        """One line for the version history."""
        counts = [f"{len(self.section(s))} {s}" for s in SECTIONS if self.section(s)]
        return "; ".join(counts) if counts else "no change for anyone"

    def one_line(self) -> str:
        """What changed in the file, in one line (the versions' history): quotas and removed profiles."""
        parts = [ln.text.rstrip(".") for ln in self.section("quotas")]
        parts += [ln.text.split(";")[0].rstrip(".") for ln in self.section("profiles") if ln.text.startswith("Profile ")]
        parts += [g.split(",")[0] for g in self.global_changes]
        return "; ".join(parts) if parts else self.summary()

    def as_dict(self) -> dict:
        return {
            "sections": [{"name": s, "title": TITLES[s], "lines": [ln.as_dict() for ln in self.section(s)]} for s in SECTIONS],
            "touched_teams": sorted(self.touched_teams),
            "global_changes": list(self.global_changes),
            "summary": self.summary(),
        }

    def text(self) -> str:
        out = []
        for s in SECTIONS:
            lines = self.section(s)
            if lines:
                out.append(f"{TITLES[s]}:")
                out += [f"  - {ln.text}" for ln in lines]
        return (
            "\n".join(out) if out else "No change for anyone: no profile, quota, running server or waiting request is affected."
        )


# -- words -----------------------------------------------------------------------------------------
def what(key: str) -> str:
    """``alice/`` -> "alice's server", ``alice/big`` -> "alice's server big", ``job:7f`` -> "job 7f"."""
    if key.startswith("job:"):
        return f"job {key[4:]}"
    user, _, server = key.partition("/")
    return f"{user}'s server {server}" if server else f"{user}'s server"


def _owner(item) -> str:
    return f"{item.user}'s job {item.key[4:]}" if item.key.startswith("job:") else what(item.key)


def _profile_words(policy: Policy, slug: str) -> str:
    p = policy.profile(slug)
    return f"{p.display_name} ({slug})" if p else slug


def _amount(policy: Policy, key: str, amount: int | None) -> str:
    if amount is None:
        return "none"
    if key == "cpu":
        return format_cpu(amount)
    if key in ("memory", GPU_MEMORY):
        return format_memory(amount)
    return str(amount)


def _resource(policy: Policy, key: str) -> str:
    if key in ("cpu", "memory"):
        return key.upper() if key == "cpu" else key
    if key == GPU_MEMORY:
        return "MIG slice memory"
    f = next((f for f in policy.flavors if f.name == key[4:]), None)
    return f"{(f.display_name or f.name) if f else key[4:]} GPUs"


def _demand_words(policy: Policy, demand: Mapping[str, int]) -> str:
    gpus = [describe(k, v, policy) for k, v in sorted(demand.items()) if k.startswith("gpu/") and v]
    return ", ".join(gpus) if gpus else "no GPU"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M", time.localtime(ts)) if ts else "?"


# -- the arithmetic the queue uses, without "now" ----------------------------------------------------
def ceiling(policy: Policy, team: Team, key: str, may_borrow: bool = True) -> int | None:
    """The most of ``key`` ``team`` may ever hold (nominal plus what it may borrow), as
    ``quota.check_fit`` computes it; None where the team is not limited on ``key``."""
    own = limits(team, key)
    if own is None:
        return None
    if not team.cohort or not may_borrow:
        return own.nominal
    pool_cap = sum(lim.lendable for m in policy.cohort_members(team) if (lim := limits(m, key)) is not None)
    borrow_cap = pool_cap - own.lendable
    if own.borrowing_limit is not None:
        borrow_cap = min(borrow_cap, own.borrowing_limit)
    return own.nominal + max(0, borrow_cap)


def _may_borrow(policy: Policy, team: Team, item) -> bool:
    return item.key.startswith("job:") or bool(policy.reclaim_rules(team).interactive_borrowing)


def _gap(policy: Policy, usage, team: Team, req: Request) -> int:
    """How much of its team's own use must stop before ``req`` can fit its team's ceiling
    (the GPUs, summed over the flavors it asks for)."""
    gap = 0
    may = _may_borrow(policy, team, req)
    for key, amount in req.demand.items():
        if not key.startswith("gpu/") or amount <= 0:
            continue
        top = ceiling(policy, team, key, may)
        if top is None:
            continue
        gap += max(0, usage.get(team.name, {}).get(key, 0) + amount - top)
    return gap


def _usage(holdings: Iterable[Holding]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for h in holdings:
        bucket = out.setdefault(h.team, {})
        for k, v in h.demand.items():
            bucket[k] = bucket.get(k, 0) + v
    return out


# -- what changed in the file ---------------------------------------------------------------------
def touched_teams(old: Policy, new: Policy, literal_env: Iterable[str] = (), cohorts: bool = True) -> tuple[set[str], list[str]]:
    """Teams whose own entries or profiles the edit changes, and changes that concern every team
    (flavors, priority classes, defaults, roles, health): a lead may preview only the first kind,
    for their own teams.

    Also touched: every member of a team's old and new cohort when its cohort or quota (nominal,
    borrowing, lending: what the cohort may borrow) changes; every team that uses a group a team
    adds (its members would join). ``literal_env``: slugs of candidate profiles with an
    environment value other than the mask ``***`` -- a change of that profile whatever the value,
    so that a lead cannot confirm a guess of a secret by whether the preview is refused.
    ``cohorts=False``: only the teams whose own entries change, not their cohort's other members
    (a lead may preview an edit of her own team; its effect on the cohort is shown, read-only).
    Linear in teams + profiles."""
    teams: set[str] = set()
    old_t = {t.name: t for t in old.teams}
    new_t = {t.name: t for t in new.teams}
    by_group: dict[str, set[str]] = {}
    for pol in (old, new):
        for t in pol.teams:
            for g in t.groups:
                by_group.setdefault(g, set()).add(t.name)
    for name in set(old_t) | set(new_t):
        a, b = old_t.get(name), new_t.get(name)
        if a == b:
            continue
        teams.add(name)
        if cohorts and (a is None or b is None or a.cohort != b.cohort or a.quota != b.quota):
            for pol, side in ((old, a), (new, b)):
                if side is not None and side.cohort:
                    teams.update(m.name for m in pol.cohort_members(side))
        for g in set(b.groups if b else ()) - set(a.groups if a else ()):
            teams.update(by_group.get(g, ()))
    old_p = {p.slug: p for p in old.profiles}
    new_p = {p.slug: p for p in new.profiles}
    literal = set(literal_env)
    every = False
    for slug in set(old_p) | set(new_p):
        was, now = old_p.get(slug), new_p.get(slug)
        if was == now and slug not in literal:
            continue
        for prof in (was, now):
            if prof is None:
                continue
            if "*" in prof.teams:
                every = True
            else:
                teams.update(prof.teams)
    if every:
        teams.update(old_t)
        teams.update(new_t)
    everyone = []
    for name, label in (
        ("flavors", "the GPU flavors"),
        ("priority_classes", "the priority classes"),
        ("defaults", "the defaults"),
        ("roles", "the roles (admins, viewers)"),
        ("health", "the GPU health rules"),
    ):
        if getattr(old, name) != getattr(new, name):
            everyone.append(f"{label} change, which apply to every team")
    return teams, everyone


# -- the impact --------------------------------------------------------------------------------------
def impact(
    old: Policy,
    new: Policy,
    people: Iterable[Person] = (),
    holdings: Iterable[Holding] = (),
    waiting: Iterable[Request] = (),
    free_devices: Mapping[str, int] | None = None,
    now: float | None = None,
    literal_env: Iterable[str] = (),
) -> Impact:
    """What replacing ``old`` by ``new`` does to ``people``, ``holdings`` and ``waiting``.

    ``free_devices``: free devices per ``gpu/<flavor>`` on one machine (None where Kueue
    counts nodes); ``now`` for the idle rules that would be due at once.
    """
    now = time.time() if now is None else now
    people, holdings, waiting = list(people), list(holdings), list(waiting)
    out = Impact()
    out.touched_teams, out.global_changes = touched_teams(old, new, literal_env)
    _profiles(out, old, new, people)
    _quotas(out, old, new)
    _running(out, old, new, holdings)
    _waiting(out, old, new, holdings, waiting, free_devices)
    _culling(out, old, new, holdings, now)
    return out


class _Offers:
    """Which profiles a policy offers through which teams, indexed once (linear in teams + profiles):
    a user's offer is then the union over their teams, never teams x profiles per user."""

    def __init__(self, pol: Policy):
        self.pol = pol
        self.star = frozenset(p.slug for p in pol.profiles if "*" in p.teams)
        self.own: dict[str, set[str]] = {}
        for p in pol.profiles:
            if "*" not in p.teams:
                for team_name in p.teams:
                    self.own.setdefault(team_name, set()).add(p.slug)
        self.by_group: dict[str, list[Team]] = {}
        for t in pol.teams:
            for g in t.groups:
                self.by_group.setdefault(g, []).append(t)

    def teams(self, groups) -> dict[str, Team]:
        found = {}
        for g in groups:
            for t in self.by_group.get(g, ()):
                found[t.name] = t
        return found

    def offered(self, names) -> set[str]:
        out = set(self.star) if names else set()
        for n in names:
            out |= self.own.get(n, set())
        return out

    def slugs(self, name: str) -> frozenset[str]:
        if self.pol.team_or_none(name) is None:
            return frozenset()
        return self.star | frozenset(self.own.get(name, ()))


def _profiles(out: Impact, old: Policy, new: Policy, people: list[Person]) -> None:
    a, b = _Offers(old), _Offers(new)
    mine = {}
    for u in people:
        ot, nt = a.teams(u.groups), b.teams(u.groups)
        mine[u.name] = (ot, nt, a.offered(ot), b.offered(nt))
    for slug in [p.slug for p in old.profiles if new.profile(p.slug) is None]:
        users = [u.name for u in people if slug in mine[u.name][2]]
        p = old.profile(slug)
        assert p is not None, slug  # a slug of old's profiles
        out.add(
            "profiles",
            f"Profile {p.display_name} ({slug}) is removed"
            + (f"; {len(users)} user(s) lose it: {', '.join(users)}." if users else "."),
            teams=[t.name for t in old.teams if p.usable_by(t.name)],
            users=users,
        )
    changed: dict[str, bool] = {}

    def slugs_changed(t: str) -> bool:
        if t not in changed:
            changed[t] = a.slugs(t) != b.slugs(t)
        return changed[t]

    for u in people:
        old_teams, new_teams, had, has = mine[u.name]
        lost, gained = had - has, has - had
        left = sorted(set(old_teams) - set(new_teams))
        joined = sorted(set(new_teams) - set(old_teams))
        # the teams through which something changed for this user (a lead of another team of theirs sees nothing)
        teams = {t for t in set(old_teams) | set(new_teams) if (t in old_teams) != (t in new_teams) or slugs_changed(t)}
        parts, anon = [], []
        if joined:
            parts.append("joins " + ", ".join(new.team(t).label for t in joined))
            anon.append("would join " + ", ".join(new.team(t).label for t in joined))
        if left:
            parts.append("leaves " + ", ".join(old.team(t).label for t in left))
            anon.append("would leave " + ", ".join(old.team(t).label for t in left))
        if lost:
            parts.append("loses " + ", ".join(_profile_words(old, s) for s in sorted(lost)))
            anon.append("would lose " + ", ".join(_profile_words(old, s) for s in sorted(lost)))
        if gained:
            parts.append("gains " + ", ".join(_profile_words(new, s) for s in sorted(gained)))
            anon.append("would gain " + ", ".join(_profile_words(new, s) for s in sorted(gained)))
        if not new_teams and old_teams:
            parts.append("and is then in no team: no profile at all")
            anon.append("and then be in no team")
        if parts:
            out.add("profiles", f"{u.name} " + "; ".join(parts) + ".", teams=teams, users=[u.name])
            out.lines[-1].anon = "; ".join(anon)
    _definitions(out, old, new, people, {name: m[3] for name, m in mine.items()})


_PROFILE_FIELDS = {  # what a profile-only edit is named by (teams: the gains and losses above)
    "display_name": "name",
    "description": "description",
    "image": "image",
    "cpu": "CPU",
    "memory": "memory",
    "max_processes": "process limit",
    "gpu": "GPUs",
    "priority": "priority",
    "idle": "idle rules",
    "env": "environment",
    "default": "default choice",
}


def _field_words(policy: Policy, name: str, value) -> str:
    if value is None:
        return "none" if name == "gpu" else "(default)"
    if name == "cpu":
        return format_cpu(value)
    if name == "memory":
        return format_memory(value)
    if name == "gpu":
        return _demand_words(policy, {f"gpu/{value.flavor}": value.count}) + (f", CUDA {value.cuda}" if value.cuda else "")
    if name == "idle":
        return (
            ", ".join(
                f"{k} {format_duration(v) if isinstance(v, (int, float)) and k not in ('gpuBusyThreshold', 'maxSnoozes') else v}"
                for k, v in value.model_dump(by_alias=True, exclude_none=True).items()
            )
            or "(defaults)"
        )
    if name == "default":
        return "yes" if value else "no"
    return f"{value}"


def _definitions(out: Impact, old: Policy, new: Policy, people: list[Person], offered: dict) -> None:
    """A profile kept under its slug whose definition changes (image, resources, GPUs, idle rules,
    environment ...): named, with who has it, so a profile-only edit never reads "No change for
    anyone". Environment values are never shown (they may hold secrets): only that it changes."""
    for p in new.profiles:
        o = old.profile(p.slug)
        if o is None or o == p:
            continue
        words = []
        for name, label in _PROFILE_FIELDS.items():
            before, after = getattr(o, name), getattr(p, name)
            if before == after:
                continue
            if name in ("env", "description"):
                words.append(f"{label} changed")
            else:
                words.append(f"{label} {_field_words(old, name, before)} -> {_field_words(new, name, after)}")
        if not words:
            continue  # only its teams changed: the gains and losses say it
        users = sorted(u.name for u in people if p.slug in offered[u.name])
        teams = [t.name for t in new.teams if p.usable_by(t.name)] or [t.name for t in old.teams if o.usable_by(t.name)]
        labels = ", ".join(new.team(t).label for t in teams if new.team_or_none(t))
        text = f"Profile {p.display_name} ({p.slug}) changes: " + "; ".join(words)
        text += f" (for {labels}" + (f": {', '.join(users)}" if users else "") + ")." if labels else "."
        out.add("profiles", text, teams=teams, users=users)  # (a lead sees outsiders unnamed: for_lead)


def _quotas(out: Impact, old: Policy, new: Policy) -> None:
    old_t = {t.name: t for t in old.teams}
    for team in new.teams:
        before = old_t.get(team.name)
        if before is None:
            out.add("quotas", f"Team {team.label} ({team.name}) is added.", teams=[team.name])
            continue
        changes = []
        keys = sorted({f"gpu/{f}" for f in (*before.quota.gpus, *team.quota.gpus)})
        keys += [k for k in ("cpu", "memory", GPU_MEMORY) if getattr(before.quota, k) or getattr(team.quota, k)]
        for key in keys:
            a, b = limits(before, key), limits(team, key)
            if a == b:
                continue
            res = _resource(new, key)
            for attr, label in (("nominal", "quota"), ("borrowing_limit", "borrowing limit"), ("lending_limit", "lending limit")):
                x, y = getattr(a, attr, None) if a else None, getattr(b, attr, None) if b else None
                if x == y:
                    continue
                delta = f" ({y - x:+d})" if isinstance(x, int) and isinstance(y, int) and key.startswith("gpu/") else ""
                unset = "no limit" if attr != "nominal" else "none"
                xs = _amount(old, key, x) if x is not None else unset
                ys = _amount(new, key, y) if y is not None else unset
                changes.append(f"{res} {label} {xs} → {ys}{delta}")
        if before.cohort != team.cohort:
            changes.append(f"cohort {before.cohort or 'none'} → {team.cohort or 'none'}")
        for attr, label in (("max_servers", "servers per user"), ("max_gpus", "GPUs per user")):
            x, y = getattr(before.per_user, attr), getattr(team.per_user, attr)
            if x != y:
                changes.append(f"{label} {x if x is not None else 'no cap'} → {y if y is not None else 'no cap'}")
        if before.groups != team.groups:
            changes.append(f"groups {', '.join(before.groups)} → {', '.join(team.groups)}")
        if before.leads != team.leads:
            changes.append(f"leads {', '.join(before.leads) or 'none'} → {', '.join(team.leads) or 'none'}")
        if changes:
            out.add("quotas", f"{team.label}: " + "; ".join(changes) + ".", teams=[team.name])
    for name, t in old_t.items():
        if new.team_or_none(name) is None:
            out.add("quotas", f"Team {t.label} ({name}) is removed.", teams=[name])
    _cohort_effects(out, old, new)


def _borrowable(policy: Policy, team: Team, key: str) -> int | None:
    """GPUs of ``key`` ``team`` may borrow from its cohort: what the other members may lend
    (their nominal, or their lending limit), capped by its borrowing limit; None: no cohort."""
    if not team.cohort:
        return None
    lendable = 0
    for m in policy.cohort_members(team):
        if m.name == team.name:
            continue
        lim = limits(m, key)
        if lim is None:
            continue
        lendable += lim.nominal if lim.lending_limit is None else min(lim.lending_limit, lim.nominal)
    own = limits(team, key)
    cap = own.borrowing_limit if own is not None else None
    return lendable if cap is None else min(cap, lendable)


def _cohort_effects(out: Impact, old: Policy, new: Policy) -> None:
    """What an edit of one team's quota does to the other teams of its cohort: how many GPUs each
    may now borrow from it (a lead sees this for her cohort, read-only)."""
    changed = {ln_team for ln in out.section("quotas") for ln_team in ln.teams}
    old_t = {t.name: t for t in old.teams}
    for team in new.teams:
        before = old_t.get(team.name)
        if team.name in changed or before is None or not (team.cohort or before.cohort):
            continue
        for key in sorted({f"gpu/{f}" for f in (*before.quota.gpus, *team.quota.gpus)}):
            x, y = _borrowable(old, before, key), _borrowable(new, team, key)
            if x != y and y is not None:
                res = _resource(new, key)
                was = f"was {x}" if x is not None else "it had no cohort"
                out.add(
                    "quotas",
                    f"{team.label} (cohort {team.cohort}, read-only here): may borrow up to {y} {res} from its cohort ({was}).",
                    teams=[team.name],
                )


def _reclaim_words(new: Policy, team: Team, key: str) -> str:
    lenders = [
        m
        for m in new.cohort_members(team)
        if m.name != team.name and new.reclaim_rules(m).enabled and (lim := limits(m, key)) is not None and lim.lendable > 0
    ]
    if not lenders:
        return (
            f"no other team of the {team.cohort} cohort takes quota back (reclaim disabled or nothing lent): kept until stopped"
        )
    notices = sorted({format_duration(new.reclaim_rules(m).notice or 0) for m in lenders})
    return (
        f"counted as borrowed from the {team.cohort} cohort: kept until {', '.join(m.label for m in lenders)} "
        f"need their own quota back; then a server is warned and stopped after {' or '.join(notices)}, a job "
        "is stopped at once and re-queued (lowest priority, newest first)"
    )


def _running(out: Impact, old: Policy, new: Policy, holdings: list[Holding]) -> None:
    usage = _usage(holdings)
    by_team: dict[str, list[Holding]] = {}
    for h in holdings:
        by_team.setdefault(h.team, []).append(h)
    for team_name, held in sorted(by_team.items()):
        team = new.team_or_none(team_name)
        if team is None:
            for h in held:
                out.add(
                    "running",
                    f"{_owner(h)} ({_demand_words(old, h.demand)}) belongs to team {team_name}, "
                    "which the new policy removes: it keeps running until it is stopped (nothing is reclaimed "
                    "from a team that is not in the policy), and it cannot be started again in that team.",
                    teams=[team_name],
                    users=[h.user],
                    keys=[h.key],
                )
            continue
        used = usage.get(team_name, {})
        for key in sorted(used):
            amount = used[key]
            own = limits(team, key)
            if own is None or amount <= own.nominal:
                continue
            before = old.team_or_none(team_name)
            old_lim = limits(before, key) if before else None
            if old_lim is not None and amount > old_lim.nominal and old_lim.nominal <= own.nominal:
                continue  # already over before the edit, and not more so: nothing new
            holders = [h for h in held if h.demand.get(key)]
            names = ", ".join(
                f"{_owner(h)} ({_amount(new, key, h.demand[key])}, profile {h.profile}, since {_clock(h.since)})"
                for h in sorted(holders, key=lambda h: h.since)
            )
            over = amount - own.nominal
            if key.startswith("gpu/") and team.cohort:
                fate = _reclaim_words(new, team, key)
            elif key.startswith("gpu/"):
                fate = "nothing is stopped: it keeps running until its user stops it or it is culled"
            else:
                fate = "nothing is stopped: kept until its user stops it or it is culled (only GPUs are ever reclaimed)"
            out.add(
                "running",
                f"{team.label} holds {_amount(new, key, amount)} {_resource(new, key)} and its new quota is "
                f"{_amount(new, key, own.nominal)} ({_amount(new, key, over) if key.startswith('gpu/') else 'over'}"
                f"{' over' if key.startswith('gpu/') else ''}): {names}. What gpuhub does: {fate}; "
                f"{team.label}'s requests for {_resource(new, key)} wait until its use leaves room within the quota"
                + (" or the cohort lends" if team.cohort else "")
                + ".",
                teams=[team_name],
                users=[h.user for h in holders],
                keys=[h.key for h in holders],
            )
        # per-user caps: servers and GPUs per user, as check_user_caps counts them at a start
        per_user: dict[str, list[Holding]] = {}
        for h in held:
            per_user.setdefault(h.user, []).append(h)
        caps, old_caps = team.per_user, (old.team_or_none(team_name) or team).per_user
        for user, hs in sorted(per_user.items()):
            servers = sum(1 for h in hs if not h.job)
            gpus = sum(v for h in hs for k, v in h.demand.items() if k.startswith("gpu/"))
            over_caps: list[str] = []
            if (
                caps.max_servers is not None
                and servers > caps.max_servers
                and not (old_caps.max_servers is not None and servers > old_caps.max_servers)
            ):
                over_caps.append(f"{servers} servers, new cap {caps.max_servers}")
            if (
                caps.max_gpus is not None
                and gpus > caps.max_gpus
                and not (old_caps.max_gpus is not None and gpus > old_caps.max_gpus)
            ):
                over_caps.append(f"{gpus} GPUs, new cap {caps.max_gpus}")
            if over_caps:
                out.add(
                    "running",
                    f"{user} is over {team.label}'s new per-user caps ({'; '.join(over_caps)}): what is "
                    "running keeps running (caps are checked when a server or job starts); "
                    f"{user} cannot start another {team.label} server or GPU job until back under the cap.",
                    teams=[team_name],
                    users=[user],
                    keys=[h.key for h in hs],
                )
        for h in held:
            if old.profile(h.profile) is not None and new.profile(h.profile) is None:
                if h.job:
                    fate = "it runs to its end with the GPUs it has; a re-queue after a preemption keeps its resources"
                else:
                    idle = new.defaults.idle
                    fate = (
                        "it keeps running and keeps its GPUs until it is stopped; it cannot be started again with "
                        f"that profile; idle culling then uses the defaults' rules (no activity for "
                        f"{format_duration(idle.timeout or 0)}, at most {format_duration(idle.max_age or 0)} old) and "
                        "no longer the GPU-idle rule (the hub no longer knows the profile's GPUs)"
                    )
                out.add(
                    "running",
                    f"{_owner(h)} runs profile {_profile_words(old, h.profile)}, which the new policy removes: {fate}.",
                    teams=[team_name],
                    users=[h.user],
                    keys=[h.key],
                )


def _order(policy: Policy, usage, reqs: list[Request]) -> list[Request]:
    def key(r: Request):
        team = policy.team_or_none(r.team)
        borrows = check_fit(policy, usage, team, dict(r.demand), _may_borrow(policy, team, r)).borrows if team else True
        return (borrows, -r.priority, r.created)

    return sorted(reqs, key=key)


def _fits_devices(free: dict[str, int] | None, demand: Mapping[str, int]) -> bool:
    return free is None or all(free.get(k, 0) >= v for k, v in demand.items() if k.startswith("gpu/") and v)


def _waiting(
    out: Impact, old: Policy, new: Policy, holdings: list[Holding], waiting: list[Request], free_devices: Mapping[str, int] | None
) -> None:
    base = _usage(holdings)
    trial = {t: dict(u) for t, u in base.items()}
    free = dict(free_devices) if free_devices is not None else None
    timeout = format_duration(new.defaults.queue_timeout)
    for r in _order(new, base, waiting):
        team = new.team_or_none(r.team)
        label = f"{_owner(r)} ({_demand_words(new, r.demand)}, waiting since {_clock(r.created)})"
        if team is None:
            out.add(
                "waiting",
                f"{label} waits in team {r.team}, which the new policy removes: it is never admitted "
                f"and is withdrawn at its queue timeout ({timeout}).",
                teams=[r.team],
                users=[r.user],
                keys=[r.key],
            )
            continue
        may = _may_borrow(new, team, r)
        fit = check_fit(new, trial, team, dict(r.demand), may)
        if fit.fits and _fits_devices(free, r.demand):
            for k, v in r.demand.items():
                trial.setdefault(team.name, {})[k] = trial.get(team.name, {}).get(k, 0) + v
                if free is not None and k.startswith("gpu/"):
                    free[k] = free.get(k, 0) - v
            out.add("waiting", f"{label} would be admitted at once.", teams=[team.name], users=[r.user], keys=[r.key])
            continue
        never = [k for k, v in r.demand.items() if k.startswith("gpu/") and v > (ceiling(new, team, k, may) or v)]
        if never:
            k = never[0]
            out.add(
                "waiting",
                f"{label} can never be admitted under the new policy: {team.label} may hold at most "
                f"{ceiling(new, team, k, may)} {_resource(new, k)}. It is not refused: it waits until its queue "
                f"timeout ({timeout}) withdraws it.",
                teams=[team.name],
                users=[r.user],
                keys=[r.key],
            )
            continue
        old_team = old.team_or_none(r.team)
        gap_old = _gap(old, base, old_team, r) if old_team else None
        gap_new = _gap(new, base, team, r)
        tops = "; ".join(
            f"{team.label} may hold {ceiling(new, team, k, may)} {_resource(new, k)}"
            + (
                f" instead of {ceiling(old, old_team, k, may)}"
                if old_team and ceiling(old, old_team, k, may) != ceiling(new, team, k, may)
                else ""
            )
            for k in sorted(r.demand)
            if k.startswith("gpu/") and r.demand[k]
        )
        held_by = sorted(
            {
                _owner(h)
                for h in holdings
                if h.team == team.name and any(h.demand.get(k) for k in r.demand if k.startswith("gpu/"))
            }
        )
        who = f" (held by {', '.join(held_by)})" if held_by else ""
        if gap_old is not None and gap_new != gap_old:
            out.add(
                "waiting",
                f"{label} {'waits longer' if gap_new > gap_old else 'waits less'}: {tops}; "
                f"{gap_new} of {team.label}'s GPUs in use{who} must be freed before it fits (today {gap_old}).",
                teams=[team.name],
                users=[r.user],
                keys=[r.key],
            )


_RULES = (
    ("timeout", "idle timeout"),
    ("gpu_idle_timeout", "GPU-idle timeout"),
    ("max_age", "maximum age"),
    ("warning", "warning"),
    ("snooze", "snooze"),
    ("max_snoozes", "snoozes"),
    ("gpu_busy_threshold", "GPU busy threshold"),
)


def _rules(policy: Policy, slug: str) -> tuple[IdleRules, bool]:
    p: Profile | None = policy.profile(slug)
    return (policy.idle_rules(p) if p else policy.defaults.idle), bool(p and p.gpu_count)


def _fmt_rule(name: str, value, has_gpus: bool) -> str:
    if name == "gpu_idle_timeout" and not has_gpus:
        return "does not apply"
    if value is None:
        return "off"
    if name in ("max_snoozes",):
        return str(value)
    if name == "gpu_busy_threshold":
        return f"{value} %"
    return format_duration(value)


def _culling(out: Impact, old: Policy, new: Policy, holdings: list[Holding], now: float) -> None:
    for h in holdings:
        if h.job:
            continue
        (a, ga), (b, gb) = _rules(old, h.profile), _rules(new, h.profile)
        changes = []
        for name, label in _RULES:
            x, y = _fmt_rule(name, getattr(a, name), ga), _fmt_rule(name, getattr(b, name), gb)
            if x != y:
                changes.append(f"{label} {x} → {y}")
        if not changes:
            continue
        due = ""
        if b.max_age and h.since and now - h.since >= b.max_age and not (a.max_age and now - h.since >= a.max_age):
            due = (
                f" It is already older than the new maximum age ({format_duration(b.max_age)}): warned at the "
                f"culler's next pass and stopped {format_duration(b.warning or 0)} later, with no snooze."
            )
        elif (
            b.timeout
            and h.last_activity
            and now - h.last_activity >= b.timeout
            and not (a.timeout and now - h.last_activity >= a.timeout)
        ):
            due = (
                f" It has been idle longer than the new idle timeout ({format_duration(b.timeout)}): warned at the "
                f"culler's next pass and stopped {format_duration(b.warning or 0)} later unless used."
            )
        team = h.team
        out.add(
            "culling",
            f"{_owner(h)} (profile {h.profile}): " + "; ".join(changes) + "." + due,
            teams=[team],
            users=[h.user],
            keys=[h.key],
        )


# -- a candidate's text ------------------------------------------------------------------------------
# A policy sent to the hub (preview, apply) is bounded before it is parsed, like every YAML a user
# sends (policy/bounded.py: size first, then libyaml's events counted, anchors and aliases refused):
# 256 KiB is the hub's request body limit; 100,000 values is ~5x the example of 500 teams.
MAX_POLICY_BYTES = 256 * 1024
MAX_POLICY_NODES = 100_000
MAX_POLICY_DEPTH = 16


def read_candidate(text: str, filename: str = "new policy") -> tuple[Policy | None, list[dict]]:
    """The candidate policy, or its located errors (the loader's own messages) as
    ``{"line", "column", "path", "message", "text"}``, never an exception."""
    from ..policy.bounded import InputRefused, scan_yaml
    from ..policy.loader import PolicyError, parse_policy

    import yaml

    if not isinstance(text, str):
        return None, [
            {
                "line": None,
                "column": None,
                "path": "",
                "message": "the policy must be YAML text",
                "text": f"{filename}: the policy must be YAML text",
            }
        ]
    try:
        scan_yaml(
            text,
            what="a policy sent to the hub",
            max_bytes=MAX_POLICY_BYTES,
            max_nodes=MAX_POLICY_NODES,
            max_depth=MAX_POLICY_DEPTH,
        )
        return parse_policy(text, filename), []
    except InputRefused as e:
        where = f"{filename}:{e.line}:{e.column}" if e.line else filename
        return None, [
            {
                "line": e.line,
                "column": e.column,
                "path": e.path,
                "message": e.message,
                "text": f"{where}: {e.path or '(top level)'}: {e.message}",
                "status": e.status,
            }
        ]
    except yaml.YAMLError:
        try:
            parse_policy(text, filename)  # the loader's located syntax error
        except PolicyError as e:
            return None, _issues(e)
        raise
    except PolicyError as e:
        return None, _issues(e)


def _issues(e) -> list[dict]:
    return [
        {"line": i.line, "column": i.column, "path": i.path, "message": i.message, "text": i.format(e.filename)} for i in e.issues
    ]
