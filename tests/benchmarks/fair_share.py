"""Fair-share replay: a week of contended GPU demand through gpuhub's own admission code.

A seeded synthetic week (Monday 00:00 to Sunday 24:00, minute by simulated minute) of three
teams sharing ``--gpus`` GPUs in one cohort is replayed twice through the real admission
queue (``AdmissionQueue`` over a ``DeviceTable`` of virtual GPUs, ``reclaim.plan`` for lent
quota coming back): once with the policy's ``fairShare`` section (docs/fair-share.md) and once
without it (today's order: priority, then arrival; FIFO below). Same trace, same quotas.

The week
--------
- ``nlp`` (weight 3, nominal half the GPUs): training jobs of 2 GPUs on weekdays (4 users,
  1-2 jobs a day each, 3-8 h), and a deadline burst on Wednesday and Thursday (every user
  adds 3 jobs of 6 h).
- ``vision`` (weight 2, nominal a third): interactive 1-GPU servers on weekdays (6 users
  arriving 8:30-11:00, 2-6 h each, some come back after lunch), an afternoon burst on
  Tuesday and Friday (everyone opens a second server).
- ``speech`` (weight 1, nominal a sixth): one greedy user who keeps ``--greedy`` 1-GPU jobs
  of 10 h queued all week, day and night, resubmitting each as it ends; and a colleague
  with one 1-GPU server on weekdays.

Everything is one priority. Reclaim as in the hub: a request that fits its team's nominal
quota takes lent GPUs back (``reclaim.plan``): a borrowing job is preempted at once and
re-queued with the work it has left, a borrowing server stops after the lender's notice
(10 min) and its user asks again for the time left. With fair share, ``minRuntime`` (15 min)
protects a borrower that has just started.

What is measured
----------------
- Contended minutes: the GPUs asked for (held + waiting) exceed the GPUs there are.
- A team's *entitlement* in a contended minute is the weighted max-min (water-filling) share
  of the GPUs by weight over what the teams ask for: a team asking for less than its weight's
  share is entitled to what it asks, the rest is split by weight among the others.
- **fair-share deviation**: over all contended minutes, the largest gap, in percentage points,
  between a team's share of the GPU-minutes held and its share of the entitlement. (When every
  team asks for more than its weight's share, its entitlement is its weight.)
- Longest wait (request to admission) per team, and the longest of a team whose share of the
  contested GPU-minutes stayed under its entitlement.

Run: ``.venv/bin/python tests/benchmarks/fair_share.py`` (about 30 s); ``--help`` for the knobs.
The last line is ``fair-share deviation: X.X points (FIFO: Y.Y points)``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "spawner"))

from gpuhub_spawner.admission import AdmissionQueue, Ticket  # noqa: E402
from gpuhub_spawner.admission.reclaim import Holder, Request, plan, within_nominal  # noqa: E402
from gpuhub_spawner.local.devices import DeviceTable  # noqa: E402
from gpuhub_spawner.policy import parse_policy  # noqa: E402

MIN = 60.0
HOUR = 60 * MIN
DAY = 24 * HOUR
WEEK = 7 * DAY
START = 1_767_571_200.0  # a Monday 00:00 UTC (2026-01-05): the simulated clock starts here
TEAMS = ("nlp", "vision", "speech")


@dataclass
class Params:
    seed: int = 1
    gpus: int = 12
    greedy: int = 10
    half_life: str = "24h"
    min_runtime: str = "15m"
    notice: float = 10 * MIN


def policy_yaml(p: Params, fair: bool) -> str:
    n = p.gpus
    nominal = {"nlp": n // 2, "vision": n // 3, "speech": n - n // 2 - n // 3}
    weight = {"nlp": 3, "vision": 2, "speech": 1}
    teams = ""
    for t in TEAMS:
        teams += (
            f"  - name: {t}\n    groups: [{t}]\n    cohort: lab\n"
            + (f"    weight: {weight[t]}\n" if fair else "")
            + f"    quota: {{gpus: {{a100: {{nominal: {nominal[t]}}}}}}}\n"
        )
    fs = f"fairShare:\n  halfLife: {p.half_life}\n  minRuntime: {p.min_runtime}\n" if fair else ""
    return (
        f"flavors:\n  - name: a100\n    local: {{virtual: {n}}}\n"
        "defaults:\n  queueTimeout: 7d\n  reclaim: {notice: 10m}\n"
        f"teams:\n{teams}"
        "profiles:\n"
        "  - {slug: g1, displayName: one GPU, gpu: {count: 1, flavor: a100}, teams: '*'}\n"
        "  - {slug: g2, displayName: two GPUs, gpu: {count: 2, flavor: a100}, teams: '*'}\n" + fs
    )


@dataclass
class Work:
    """One thing a user wants to run: ``gpus`` for ``left`` seconds, from ``at`` on."""

    wid: int
    team: str
    user: str
    gpus: int
    at: float
    left: float
    job: bool
    greedy: bool = False
    requested: float = 0.0  # when its current request was made (waits are measured from here)


def make_trace(p: Params) -> list[Work]:
    rnd = random.Random(p.seed)
    out: list[Work] = []

    def add(team, user, gpus, at, hours, job, greedy=False):
        out.append(Work(len(out), team, user, gpus, START + at, hours * HOUR, job, greedy))

    for day in range(7):
        d0 = day * DAY
        weekday = day < 5
        # nlp: training jobs on weekdays, a deadline burst on Wednesday and Thursday
        for u in range(4):
            if weekday:
                for _ in range(rnd.choice((1, 2))):
                    add("nlp", f"nlp{u}", 2, d0 + rnd.uniform(8, 16) * HOUR, rnd.uniform(3, 8), True)
            if day in (2, 3):
                for _ in range(3):
                    add("nlp", f"nlp{u}", 2, d0 + rnd.uniform(9, 12) * HOUR, 6, True)
        # vision: interactive servers in the day, an afternoon burst on Tuesday and Friday
        for u in range(6):
            if not weekday or rnd.random() > 0.9:
                continue
            add("vision", f"vis{u}", 1, d0 + rnd.uniform(8.5, 11) * HOUR, rnd.uniform(2, 6), False)
            if rnd.random() < 0.5:
                add("vision", f"vis{u}", 1, d0 + rnd.uniform(13.5, 15) * HOUR, rnd.uniform(1.5, 4), False)
            if day in (1, 4):
                add("vision", f"vis{u}", 1, d0 + rnd.uniform(13, 14.5) * HOUR, rnd.uniform(2, 3.5), False)
        # speech's colleague: one server on weekdays
        if weekday:
            add("speech", "sp1", 1, d0 + rnd.uniform(9, 10) * HOUR, rnd.uniform(4, 7), False)
    # speech's greedy user: --greedy long jobs queued from Monday 00:00, resubmitted as they end
    for _ in range(p.greedy):
        add("speech", "greedy", 1, rnd.uniform(0, 10) * MIN, 10, True, greedy=True)
    return sorted(out, key=lambda w: w.at)


def water_fill(capacity: float, demand: dict[str, float], weight: dict[str, float]) -> dict[str, float]:
    """Weighted max-min shares of ``capacity`` over ``demand``."""
    out = {t: 0.0 for t in demand}
    hungry = {t for t, d in demand.items() if d > 0}
    left = capacity
    while hungry and left > 1e-9:
        total = sum(weight[t] for t in hungry)
        step = {t: left * weight[t] / total for t in hungry}
        done = {t for t in hungry if demand[t] - out[t] <= step[t]}
        if not done:
            for t in hungry:
                out[t] += step[t]
            break
        for t in done:
            left -= demand[t] - out[t]
            out[t] = demand[t]
        hungry -= done
    return out


@dataclass
class Result:
    held: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TEAMS, 0.0))  # contested GPU-minutes
    entitled: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TEAMS, 0.0))
    waits: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TEAMS})
    # per team, the longest a request waited while its team held less than its entitlement by at
    # least that request (fair share's doing, not the team's own backlog), in hours
    under: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TEAMS, 0.0))
    contended_minutes: int = 0
    reclaims: int = 0
    gpu_hours: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TEAMS, 0.0))
    decide_seconds: float = 0.0
    decisions: int = 0

    def shares(self) -> tuple[dict[str, float], dict[str, float]]:
        h, e = sum(self.held.values()) or 1.0, sum(self.entitled.values()) or 1.0
        return {t: 100 * self.held[t] / h for t in TEAMS}, {t: 100 * self.entitled[t] / e for t in TEAMS}

    def deviation(self) -> float:
        got, due = self.shares()
        return max(abs(got[t] - due[t]) for t in TEAMS)

    def longest_under(self) -> tuple[float, str]:
        team = max(TEAMS, key=lambda t: self.under[t])
        return self.under[team], team


def replay(p: Params, trace: list[Work], fair: bool) -> Result:
    policy = parse_policy(policy_yaml(p, fair))
    clock = {"now": START}
    table = DeviceTable(lambda: policy, discover=lambda: [])
    queue = AdmissionQueue(lambda: policy, table, clock=lambda: clock["now"])
    weight = {t.name: (t.weight if fair else {"nlp": 3, "vision": 2, "speech": 1}[t.name]) for t in policy.teams}
    min_runtime = policy.fair.min_runtime if policy.fair else 0.0
    res = Result()
    works = {w.wid: w for w in trace}
    running: dict[str, tuple[Work, float]] = {}  # key -> (work, admitted at)
    stops: dict[str, float] = {}  # reclaimed servers: key -> when they stop
    starved: dict[str, float] = {}  # waiting key -> hours waited while its team was under its entitlement
    seq = {"n": 0}

    def key_of(w: Work) -> str:
        return f"{'job:' if w.job else ''}{w.user}/{w.wid}.{seq['n']}"

    wid_of: dict[str, int] = {}

    def on_admit(adm) -> None:
        w = works[wid_of[adm.key]]
        running[adm.key] = (w, clock["now"])
        res.waits[w.team].append((clock["now"] - w.requested) / HOUR)

    queue.on_admit.append(on_admit)

    def ask(w: Work, created: float | None = None) -> None:
        seq["n"] += 1
        w.requested = clock["now"]
        key = key_of(w)
        wid_of[key] = w.wid
        demand = {"gpu/a100": w.gpus, "cpu": 1000, "memory": 2**31}
        t0 = time.perf_counter()
        queue.submit(Ticket(key, w.user, w.team, "g2" if w.gpus == 2 else "g1", demand, created=created or clock["now"]))
        res.decide_seconds += time.perf_counter() - t0
        res.decisions += 1

    def end(key: str, finished: bool, again: list | None = None) -> None:
        """``key`` stops; what is left of its work is asked for again (now, or once ``again`` is run)."""
        w, since = running.pop(key)
        stops.pop(key, None)
        t0 = time.perf_counter()
        queue.release(key)
        res.decide_seconds += time.perf_counter() - t0
        res.decisions += 1
        if not finished:
            w.left -= clock["now"] - since
            if w.left > MIN:
                # a preempted job re-queues in its old place; a stopped server's user asks anew
                (again.append if again is not None else lambda x: ask(*x))((w, w.requested if w.job else None))
        elif w.greedy:
            w.left = 10 * HOUR
            ask(w)

    arrivals = list(trace)
    i = 0
    step = MIN
    while clock["now"] < START + WEEK:
        now = clock["now"]
        while i < len(arrivals) and arrivals[i].at <= now:
            ask(arrivals[i])
            i += 1
        for key, (w, since) in list(running.items()):
            if now - since >= w.left:
                end(key, True)
        for key, at in list(stops.items()):
            if at <= now and key in running:
                end(key, False)
        # Lent quota comes back (the hub's reclaimer, reclaim.plan): jobs at once, servers after notice.
        usage = queue.usage()
        lenders = [
            t for t in sorted(queue.waiting, key=Ticket.sort_key) if within_nominal(policy, usage, policy.team(t.team), t.demand)
        ]
        if lenders:
            holders = [Holder(a.key, a.team, a.demand, a.priority, a.since, a.key.startswith("job:")) for a in queue.holdings()]
            free = {"gpu/a100": len(table.free_devices("a100"))}
            pl = plan(
                policy,
                usage,
                holders,
                [Request(t.key, t.team, t.demand, t.user) for t in lenders],
                free,
                under_notice=set(stops),
                now=now,
                min_runtime=min_runtime,
            )
            again: list = []
            for key in pl.reclaim:
                if key in stops or key not in running:
                    continue
                res.reclaims += 1
                if key.startswith("job:"):
                    end(key, False, again)  # every pick stops before any re-queues (as the hub's stops land)
                else:
                    stops[key] = now + p.notice
            for w, created in again:
                ask(w, created)
        # the minute's figures
        held = dict.fromkeys(TEAMS, 0.0)
        for w, _since in running.values():
            held[w.team] += w.gpus
        asked = dict(held)
        for t in queue.waiting:
            asked[t.team] += t.demand["gpu/a100"]
        for team in TEAMS:
            res.gpu_hours[team] += held[team] / 60
        if sum(asked.values()) > p.gpus:
            res.contended_minutes += 1
            due = water_fill(p.gpus, asked, weight)
            for team in TEAMS:
                res.held[team] += held[team]
                res.entitled[team] += due[team]
            for t in queue.waiting:
                if held[t.team] + t.demand["gpu/a100"] <= due[t.team] + 1e-9:
                    starved[t.key] = starved.get(t.key, 0.0) + step / HOUR
                    res.under[t.team] = max(res.under[t.team], starved[t.key])
        clock["now"] = now + step
    return res


def parse_args(argv=None) -> Params:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Params()
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--gpus", type=int, default=d.gpus)
    ap.add_argument("--greedy", type=int, default=d.greedy, help="jobs the greedy user keeps queued")
    ap.add_argument("--half-life", default=d.half_life)
    ap.add_argument("--min-runtime", default=d.min_runtime)
    a = ap.parse_args(argv)
    return Params(a.seed, a.gpus, a.greedy, a.half_life, a.min_runtime)


def report(p: Params, results: dict[str, Result]) -> str:
    lines = [
        f"fair-share replay: seed {p.seed}, {p.gpus} GPUs, one week, teams nlp (weight 3), vision (2), speech (1, "
        f"a greedy user keeping {p.greedy} jobs queued); fair share: halfLife {p.half_life}, minRuntime {p.min_runtime}",
        "",
        f"{'':26}" + "".join(f"{name:>22}" for name in results),
    ]

    def row(label, fn):
        lines.append(f"{label:26}" + "".join(f"{fn(r):>22}" for r in results.values()))

    row("contended hours", lambda r: f"{r.contended_minutes / 60:.1f}")
    for team in TEAMS:
        row(f"{team}: share / entitled", lambda r, t=team: f"{r.shares()[0][t]:.1f}% / {r.shares()[1][t]:.1f}%")
    for team in TEAMS:
        row(f"{team}: GPU-hours held", lambda r, t=team: f"{r.gpu_hours[t]:.0f}")
    for team in TEAMS:
        row(f"{team}: longest wait", lambda r, t=team: f"{max(r.waits[t], default=0):.1f} h")
    for team in TEAMS:
        row(f"{team}: median wait", lambda r, t=team: f"{sorted(r.waits[t])[len(r.waits[t]) // 2] if r.waits[t] else 0:.2f} h")
    for team in TEAMS:
        row(f"{team}: wait under weight", lambda r, t=team: f"{r.under[t]:.1f} h")
    row("reclaims", lambda r: str(r.reclaims))
    row("queue time per decision", lambda r: f"{1e6 * r.decide_seconds / max(1, r.decisions):.0f} us")
    row("deviation (points)", lambda r: f"{r.deviation():.1f}")
    fair, fifo = results["fair share"], results["FIFO"]
    lines.append("")
    lines.append(f"longest wait of a team under its weight: {fair.longest_under()[0]:.1f} h ({fair.longest_under()[1]})")
    lines.append(f"fair-share deviation: {fair.deviation():.1f} points (FIFO: {fifo.deviation():.1f} points)")
    return "\n".join(lines)


def run(p: Params) -> dict[str, Result]:
    trace = make_trace(p)
    out = {}
    for name, fair in (("fair share", True), ("FIFO", False)):
        fresh = [Work(w.wid, w.team, w.user, w.gpus, w.at, w.left, w.job, w.greedy) for w in trace]
        out[name] = replay(p, fresh, fair)
    return out


def main(argv=None) -> int:
    p = parse_args(argv)
    print(report(p, run(p)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
