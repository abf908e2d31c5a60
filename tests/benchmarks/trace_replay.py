"""Trace replay: what GPU-aware culling buys on a shared GPU machine, in GPU-hours and waits.

A seeded synthetic trace of users over a simulated week is replayed, minute by
simulated minute, through gpuhub's own admission code (``AdmissionQueue`` with a
``DeviceTable`` of virtual GPUs) and, for scenario (c), gpuhub's own culling decision
(``culling.rules.decide`` / ``snooze``), under three culling regimes:

(a) no culling;
(b) activity-only culling with one global timeout: the stock jupyterhub-idle-culler
    behaviour (cull as soon as the hub's ``last_activity`` is older than the timeout;
    no GPU awareness, no warning, no snooze, no maximum age);
(c) gpuhub's rules, read from a small benchmark policy (GPU profiles: ``timeout`` 1h,
    ``gpuIdleTimeout`` 30m; CPU profile: ``timeout`` 8h; ``warning`` 15m, ``snooze`` 1h,
    ``maxSnoozes`` 2, ``maxAge`` 7d), exactly as the hub evaluates them.

The same trace (the users' intentions) is replayed in each regime; what differs is the
outcome (who got a GPU when, which servers were stopped, which training runs died).

The trace (all times simulated; the replay starts on a Monday at 00:00)
------------------------------------------------------------------------
- ``--users`` users, alternately in teams ``vision`` and ``nlp`` (one cohort sharing
  ``--gpus`` virtual GPUs, nominal quota split in two, everything lendable).
  ``--gpu-users`` of them use GPU profiles (``--two-gpu`` of those the 2-GPU profile),
  the rest the CPU profile. Each user has one server (JupyterHub's default).
- Work days: on a weekday a user comes in with probability ``--attendance`` (weekend:
  ``--weekend``; a shorter day). Arrival is uniform in ``--arrive`` hours, the day lasts
  ``--day-hours`` (mean, sd 1h).
- During the day, work stretches (exponential, mean ``--work-block`` min) alternate
  with breaks (uniform ``--break-min``). A break leaves the browser tab open with
  probability ``--break-tab`` (an open JupyterLab tab polls the server, so the hub's
  activity stays fresh while kernels and GPUs are idle), otherwise the laptop is closed.
- While working, the user runs a cell on average every ``--cell-gap`` minutes (kernel
  activity); on a GPU server a cell uses the GPU with probability ``--gpu-cell``.
- A user who wants to work and has no server asks for one: the request goes through the
  admission queue (``created`` = simulated time) and waits until admitted. A user still
  waiting at the end of the day gives up (the request is withdrawn and counted).
  The policy's ``queueTimeout`` is not modelled: a waiting user keeps waiting.
- At the end of the day the user stops the server (``--stop``), leaves the tab open
  overnight (``--tab-overnight``) or closes the browser with the server running (the
  rest: the forgotten session). Nobody stops a server whose training run is still going.
  A user who does not come in the next day(s) leaves the server as it was: forgotten
  sessions last over weekends and absences. Users come back: the next time they want
  to work they use the server if it still runs, or queue for a new one.
- Training runs: on a work day a GPU user launches one with probability ``--train``,
  at a uniformly drawn time of the day (deferred until the user is at the desk with a
  running server; dropped if that never happens that day). Length: log-normal, median
  ``--train-hours``, sigma ``--train-sigma``, at most 36h. A fraction ``--background``
  runs detached (``nohup python train.py &`` from a terminal, output to a file): the
  kernels show no activity and, once the browser is closed, neither does the hub; the
  rest run in a notebook kernel whose busy state and output count as activity. GPUs are
  busy for the whole run except short quiet phases (evaluation, checkpointing, data
  loading: one every ``--dip-every`` minutes on average, lasting ``--dip-minutes``)
  where utilisation reads below the busy threshold. A culled or stopped server kills its
  run (no checkpoint resume: the lost GPU-hours are reported, the run is not retried).
- Culler: a pass every ``--culler-every`` simulated minutes. As in the hub, the decision
  reads only what the hub records: the server's start, its last activity (browser, an open
  tab's polling, a notebook kernel's output through the server's own activity reports) and
  the last pass whose trusted GPU reading (NVML/DCGM) was busy; nothing the server says
  about its kernels or GPUs, and the pass itself is not activity. (b) uses ``--b-timeout``.
- Warnings and snoozes (c): a rule that fires warns; the stop comes ``warning`` later.
  Activity withdraws an activity-timeout warning; for a GPU-idle warning, the user at work
  after the warning (a person on the page, which the lab extension reports; not an open
  tab's polling) uses one snooze at the deadline (as in the hub). A fraction ``--snoozers``
  of users click "snooze" when they see a warning, and they see it only while at the desk
  (JupyterLab shows it; nobody reads a notification in a closed laptop or a meeting).

What is measured
----------------
- GPU-hours held: GPU x hours admitted to a server. Held idle: held while no training
  run is going and the user is not at the desk working in that server.
- Queue wait of GPU requests (request to admission), over the served requests; requests
  abandoned at the end of the day are counted separately; user-hours waited include
  them. Every request ends served, abandoned, refused or still waiting.
- Culls; culls of servers whose GPUs were busy (a training run in progress when the
  cull came, whatever the instantaneous reading); training GPU-hours lost; culls while
  the user was at the desk; warnings (and those shown on a busy server), snoozes used,
  restarts after a cull (the user came back and queued again).

Not modelled: GPU memory, multi-server users, priority classes, preemption, spawn
latency, checkpoint/resume of killed runs, users changing habits after being culled,
the hub's activity-reporting lag, Kubernetes (the one-machine backend's admission and
device table are used; Kueue's arithmetic is the same).

Run: ``python tests/benchmarks/trace_replay.py [--seed 1 --users 40 --days 7 --gpus 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass, field, fields

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.queue import QueueRefused
from gpuhub_spawner.admission.quota import demand_for
from gpuhub_spawner.culling.rules import CullState, Signals, decide, snooze
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.model import Policy

DAY = 24 * 60  # minutes

# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------


@dataclass
class Params:
    seed: int = 1
    users: int = 24
    days: int = 7
    gpus: int = 8
    gpu_users: float = 0.75
    two_gpu: float = 0.15
    attendance: float = 0.85
    weekend: float = 0.1
    arrive: tuple[float, float] = (8.0, 11.0)
    day_hours: float = 8.0
    work_block: float = 70.0
    break_min: tuple[float, float] = (10.0, 75.0)
    break_tab: float = 0.75
    cell_gap: float = 5.0
    gpu_cell: float = 0.6
    stop: float = 0.4
    tab_overnight: float = 0.2
    train: float = 0.35
    train_hours: float = 4.0
    train_sigma: float = 0.8
    background: float = 0.6
    dip_every: float = 60.0
    dip_minutes: tuple[float, float] = (1.0, 6.0)
    snoozers: float = 0.5
    culler_every: int = 5
    b_timeout: float = 60.0
    # gpuhub's rules in the benchmark policy (c)
    gpu_timeout: str = "1h"
    gpu_idle_timeout: str = "30m"
    cpu_timeout: str = "8h"
    warning: str = "15m"
    snooze: str = "1h"
    max_snoozes: int = 2
    max_age: str = "7d"


HELP = {
    "seed": "random seed of the trace",
    "users": "number of users",
    "days": "simulated days (day 0 is a Monday)",
    "gpus": "virtual GPUs on the machine (one flavor, shared by two teams in a cohort)",
    "gpu_users": "fraction of users on GPU profiles (the rest use the CPU profile)",
    "two_gpu": "fraction of GPU users on the 2-GPU profile",
    "attendance": "probability a user works on a given weekday",
    "weekend": "probability a user works on a weekend day (a half day)",
    "arrive": "arrival window, hours of the day (uniform): FROM TO",
    "day_hours": "mean length of a work day in hours (sd 1h)",
    "work_block": "mean length of a work stretch at the desk, minutes (exponential)",
    "break_min": "break length window in minutes (uniform): FROM TO",
    "break_tab": "probability a break leaves the browser tab open (hub activity stays fresh)",
    "cell_gap": "mean minutes between cell executions while working",
    "gpu_cell": "probability a cell on a GPU server uses the GPU",
    "stop": "end of day: probability the user stops the server",
    "tab_overnight": "end of day: probability the tab stays open overnight (else: browser closed, server forgotten)",
    "train": "probability a GPU user launches a training run on a work day",
    "train_hours": "median training run length, hours (log-normal, capped at 36h)",
    "train_sigma": "sigma of the log-normal training length",
    "background": "fraction of training runs detached from the notebook (no kernel activity)",
    "dip_every": "mean minutes between GPU-quiet phases of a training run (eval, checkpoint)",
    "dip_minutes": "length window of a quiet phase, minutes (uniform): FROM TO",
    "snoozers": "fraction of users who snooze when they see a warning",
    "culler_every": "minutes between culler passes",
    "b_timeout": "(b): the stock culler's global inactivity timeout, minutes",
    "gpu_timeout": "(c): GPU profiles' idle timeout",
    "gpu_idle_timeout": "(c): GPU profiles' gpuIdleTimeout",
    "cpu_timeout": "(c): CPU profile's idle timeout",
    "warning": "(c): warning before a cull",
    "snooze": "(c): how long one snooze postpones a cull",
    "max_snoozes": "(c): snoozes allowed per server",
    "max_age": "(c): maximum server age",
}


def benchmark_policy_yaml(p: Params) -> str:
    """The policy of the replay: admission for all scenarios, culling rules for (c)."""
    vision = (p.gpus + 1) // 2
    nlp = p.gpus - vision
    two_gpu = (
        f"""\
  - slug: gpu-2
    displayName: 2 GPUs
    gpu: {{count: 2, flavor: gpu}}
    teams: "*"
    idle: {{timeout: {p.gpu_timeout}, gpuIdleTimeout: {p.gpu_idle_timeout}}}
"""
        if p.gpus >= 2
        else ""  # a profile nobody could ever hold is a policy error
    )
    return f"""\
flavors:
  - name: gpu
    displayName: GPU
    local: {{virtual: {p.gpus}}}
teams:
  - name: vision
    groups: [vision]
    cohort: lab
    quota: {{gpus: {{gpu: {{nominal: {vision}}}}}}}
  - name: nlp
    groups: [nlp]
    cohort: lab
    quota: {{gpus: {{gpu: {{nominal: {nlp}}}}}}}
profiles:
  - slug: cpu
    displayName: CPU only
    teams: "*"
    idle: {{timeout: {p.cpu_timeout}}}
  - slug: gpu-1
    displayName: 1 GPU
    gpu: {{count: 1, flavor: gpu}}
    teams: "*"
    idle: {{timeout: {p.gpu_timeout}, gpuIdleTimeout: {p.gpu_idle_timeout}}}
{two_gpu}defaults:
  idle:
    timeout: 8h
    gpuIdleTimeout: 1h
    gpuBusyThreshold: 5
    maxAge: {p.max_age}
    warning: {p.warning}
    snooze: {p.snooze}
    maxSnoozes: {p.max_snoozes}
"""


# --------------------------------------------------------------------------------------
# The trace: users' intentions, independent of the culling regime
# --------------------------------------------------------------------------------------

OUT, WORK, BREAK_TAB, BREAK_AWAY = 0, 1, 2, 3  # state codes (low 2 bits)
CELL, GPU_BIT = 4, 8  # flags: a cell ran this minute; it used the GPU


@dataclass
class TrainPlan:
    earliest: int  # minute it is planned for
    latest: int  # the user's departure that day: not launched by then, never
    minutes: int
    background: bool
    dips: frozenset[int]  # run-minutes where utilisation reads below the threshold


@dataclass
class Day:
    arrive: int
    depart: int
    action: str  # stop | tab | close


@dataclass
class TraceUser:
    name: str
    team: str
    profile: str
    snoozer: bool
    codes: bytearray
    days: list[Day]
    trains: list[TrainPlan]


def make_trace(p: Params) -> list[TraceUser]:
    rng = random.Random(p.seed)
    horizon = p.days * DAY
    users = []
    n_gpu = round(p.users * p.gpu_users)
    for i in range(p.users):
        gpu = i < n_gpu
        profile = ("gpu-2" if rng.random() < p.two_gpu and p.gpus >= 2 else "gpu-1") if gpu else "cpu"
        u = TraceUser(f"user{i:03d}", ("vision", "nlp")[i % 2], profile, rng.random() < p.snoozers, bytearray(horizon), [], [])
        for d in range(p.days):
            weekend = d % 7 >= 5
            if rng.random() >= (p.weekend if weekend else p.attendance):
                continue
            start = d * DAY + int(rng.uniform(*p.arrive) * 60)
            hours = max(2.0, rng.gauss(p.day_hours, 1.0)) * (0.5 if weekend else 1.0)
            end = min(start + int(hours * 60), (d + 1) * DAY - 1, horizon - 1)
            t = start
            while t < end:
                block = max(10, int(rng.expovariate(1 / p.work_block)))
                for m in range(t, min(t + block, end)):
                    code = WORK
                    if rng.random() < 1 / p.cell_gap:
                        code |= CELL
                        if gpu and rng.random() < p.gpu_cell:
                            code |= GPU_BIT
                    u.codes[m] = code
                t += block
                if t >= end:
                    break
                brk = int(rng.uniform(*p.break_min))
                kind = BREAK_TAB if rng.random() < p.break_tab else BREAK_AWAY
                for m in range(t, min(t + brk, end)):
                    u.codes[m] = kind
                t += brk
            r = rng.random()
            action = "stop" if r < p.stop else "tab" if r < p.stop + p.tab_overnight else "close"
            u.days.append(Day(start, end, action))
            if gpu and rng.random() < p.train:
                at = int(rng.uniform(start, end))
                minutes = max(15, min(36 * 60, int(60 * p.train_hours * math.exp(rng.gauss(0, p.train_sigma)))))
                dips: set[int] = set()
                k = int(rng.expovariate(1 / p.dip_every))
                while k < minutes:
                    length = int(round(rng.uniform(*p.dip_minutes)))
                    dips.update(range(k, min(k + length, minutes)))
                    k += length + int(rng.expovariate(1 / p.dip_every))
                u.trains.append(TrainPlan(at, end, minutes, rng.random() < p.background, frozenset(dips)))
        users.append(u)
    return users


# --------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------


@dataclass
class Run:
    plan: TrainPlan
    started: int
    progress: int = 0


@dataclass
class Server:
    key: str
    gpus: int
    start: int  # minute
    last_hub: int  # hub last_activity (browser, kernels)
    last_cell: int  # last kernel activity
    gpu_last_busy: int | None = None  # like CullBoard: None until the first pass
    cull: CullState = field(default_factory=CullState)
    run: Run | None = None


@dataclass
class UserState:
    trace: TraceUser
    gpus: int
    server: Server | None = None
    ticket: Ticket | None = None
    requested: int = 0
    after_departure: int = OUT  # OUT (browser closed) or BREAK_TAB (tab open overnight)
    next_train: int = 0
    culled_since_last_request: bool = False


@dataclass
class Metrics:
    gpu_minutes_held: int = 0
    gpu_minutes_idle: int = 0
    train_gpu_minutes_done: int = 0
    train_gpu_minutes_lost: int = 0
    runs_completed: int = 0
    runs_killed: int = 0
    runs_never_started: int = 0
    runs_running_at_end: int = 0
    runs_planned: int = 0
    gpu_requests: int = 0
    cpu_requests: int = 0
    served: int = 0
    abandoned: int = 0
    refused: int = 0
    waiting_at_end: int = 0
    waits: list[float] = field(default_factory=list)  # minutes, served GPU requests
    abandoned_wait_minutes: float = 0.0
    culled_gpu: int = 0
    culled_cpu: int = 0
    culled_busy: int = 0
    culled_busy_reading: int = 0  # the pass itself read the GPUs as busy
    culled_at_desk: int = 0
    warnings: int = 0
    warnings_busy: int = 0
    snoozes: int = 0
    restarts_after_cull: int = 0

    @property
    def requests(self) -> int:
        return self.gpu_requests + self.cpu_requests


SCENARIOS = ("none", "activity", "gpuhub")


async def replay(p: Params, trace: list[TraceUser], policy: Policy, scenario: str) -> Metrics:
    table = DeviceTable(lambda: policy, discover=lambda: [])
    queue = AdmissionQueue(lambda: policy, table)
    met = Metrics()
    horizon = p.days * DAY
    users = {f"{t.name}/": UserState(t, policy.profile(t.profile).gpu_count) for t in trace}
    order = list(users.values())
    rules = {prof.slug: policy.idle_rules(prof) for prof in policy.profiles}
    departures: dict[int, list[tuple[UserState, Day]]] = {}
    for u in order:
        for d in u.trace.days:
            departures.setdefault(d.depart, []).append((u, d))
    clock = {"now": 0}

    def on_admit(adm) -> None:
        u = users[adm.key]
        now = clock["now"]
        u.server = Server(adm.key, u.gpus, now, now, now)
        if u.gpus:
            met.waits.append(now - u.requested)
        met.served += 1
        u.ticket = None

    queue.on_admit.append(on_admit)

    def end_run(u: UserState, killed: bool) -> None:
        run = u.server.run
        if run is None:
            return
        if killed:
            met.runs_killed += 1
            met.train_gpu_minutes_lost += run.progress * u.gpus
        u.server.run = None

    def stop(u: UserState) -> None:
        end_run(u, killed=True)
        queue.release(u.server.key)
        u.server = None

    for now in range(horizon):
        clock["now"] = now
        for u, day in departures.get(now, ()):
            if u.ticket is not None:  # gave up waiting for today
                queue.cancel(u.ticket.key)
                u.ticket = None
                met.abandoned += 1
                met.abandoned_wait_minutes += now - u.requested
            action = day.action
            if action == "stop" and u.server is not None and u.server.run is not None:
                action = "close"  # nobody stops a server with a run going
            if action == "stop" and u.server is not None:
                stop(u)
            u.after_departure = BREAK_TAB if action == "tab" else OUT
            while u.next_train < len(u.trace.trains) and u.trace.trains[u.next_train].latest <= now:
                met.runs_never_started += 1
                u.next_train += 1

        for u in order:
            code = u.trace.codes[now]
            state = code & 3 if code else u.after_departure
            s = u.server
            if state == WORK:
                if s is None and u.ticket is None:
                    if u.culled_since_last_request:
                        met.restarts_after_cull += 1
                        u.culled_since_last_request = False
                    prof = policy.profile(u.trace.profile)
                    team = policy.team(u.trace.team)
                    ticket = Ticket(
                        key=f"{u.trace.name}/",
                        user=u.trace.name,
                        team=team.name,
                        profile=prof.slug,
                        demand=demand_for(policy, prof),
                        priority=policy.priority_value(policy.priority_for(team, prof)),
                        created=float(now * 60),
                    )
                    u.requested = now
                    if u.gpus:
                        met.gpu_requests += 1
                    else:
                        met.cpu_requests += 1
                    u.ticket = ticket
                    try:
                        queue.submit(ticket)  # admits at once if it fits (on_admit)
                    except QueueRefused:
                        u.ticket = None
                        met.refused += 1
                    s = u.server
                if s is not None:
                    s.last_hub = now
                    if s.cull.deadline is not None:
                        # a person on the page after a warning: the lab extension tells the hub
                        s.cull.person_seen = now * 60.0
                    if code & CELL:
                        s.last_cell = now
                    if s.run is None and u.next_train < len(u.trace.trains):
                        plan = u.trace.trains[u.next_train]
                        if plan.earliest <= now < plan.latest:
                            s.run = Run(plan, now)
                            u.next_train += 1
            elif state == BREAK_TAB and s is not None:
                s.last_hub = now  # an open JupyterLab tab polls the server
            if s is not None:
                run = s.run
                if run is not None:
                    if not run.plan.background:  # a busy kernel printing progress
                        s.last_hub = now
                        s.last_cell = now
                    run.progress += 1
                    met.train_gpu_minutes_done += u.gpus
                if u.gpus:
                    met.gpu_minutes_held += u.gpus
                    if run is None and state != WORK:
                        met.gpu_minutes_idle += u.gpus
                if run is not None and run.progress >= run.plan.minutes:
                    met.runs_completed += 1
                    s.run = None

        if scenario != "none" and now % p.culler_every == 0:
            for u in order:
                s = u.server
                if s is None:
                    continue
                code = u.trace.codes[now]
                state = code & 3 if code else u.after_departure
                inactive = now - s.last_hub
                cull = False
                busy_reading = False
                if scenario == "activity":
                    cull = inactive >= p.b_timeout  # the stock culler: hub activity only
                else:
                    run = s.run
                    busy_reading = bool(code & GPU_BIT) or (run is not None and run.progress not in run.plan.dips)
                    if u.gpus:
                        if s.gpu_last_busy is None:
                            s.gpu_last_busy = s.start  # idle since start until seen busy
                        if busy_reading:
                            s.gpu_last_busy = now
                        (now - s.gpu_last_busy) * 60.0
                    r = rules[u.trace.profile]
                    # What the real hub decides from: its own records only (start, the
                    # proxy's and the server's activity, trusted GPU readings); no probe
                    # of the server, no kernel report from it.
                    sig = Signals(
                        started=s.start * 60.0,
                        last_activity=s.last_hub * 60.0,
                        gpu_last_busy=None if s.gpu_last_busy is None else s.gpu_last_busy * 60.0,
                        has_gpus=bool(u.gpus),
                    )
                    d = decide(now * 60.0, r, sig, s.cull)
                    if d.action == "warn":
                        if s.cull.warned_at == now * 60.0:
                            met.warnings += 1
                            if run is not None:
                                met.warnings_busy += 1
                        if state == WORK and u.trace.snoozer:
                            ok, _msg = snooze(now * 60.0, r, s.cull)
                            if ok:
                                met.snoozes += 1
                    cull = d.action == "cull"
                if cull:
                    if u.gpus:
                        met.culled_gpu += 1
                    else:
                        met.culled_cpu += 1
                    if s.run is not None:
                        met.culled_busy += 1
                    if busy_reading:
                        met.culled_busy_reading += 1
                    if state == WORK:
                        met.culled_at_desk += 1
                    u.culled_since_last_request = True
                    stop(u)

    for u in order:
        if u.ticket is not None:
            met.waiting_at_end += 1
        if u.server is not None and u.server.run is not None:
            met.runs_running_at_end += 1
        met.runs_never_started += len(u.trace.trains) - u.next_train  # none: departures count them
    met.runs_planned = sum(len(u.trace.trains) for u in order)
    return met


def run_benchmark(p: Params) -> dict[str, Metrics]:
    policy = parse_policy(benchmark_policy_yaml(p), "<benchmark policy>")
    trace = make_trace(p)
    return {sc: asyncio.run(replay(p, trace, policy, sc)) for sc in SCENARIOS}


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def rows(results: dict[str, Metrics]) -> list[tuple[str, list[str]]]:
    def each(f):
        return [f(results[sc]) for sc in SCENARIOS]

    h = lambda minutes: f"{minutes / 60:.1f}"  # noqa: E731
    return [
        ("GPU-hours held", each(lambda m: h(m.gpu_minutes_held))),
        ("GPU-hours held idle", each(lambda m: h(m.gpu_minutes_idle))),
        ("  idle share of held", each(lambda m: f"{100 * m.gpu_minutes_idle / max(1, m.gpu_minutes_held):.0f}%")),
        ("GPU-hours of training done", each(lambda m: h(m.train_gpu_minutes_done))),
        ("GPU requests: served / abandoned", each(lambda m: f"{len(m.waits)} / {m.abandoned}")),
        ("queue wait, mean (min)", each(lambda m: f"{sum(m.waits) / max(1, len(m.waits)):.1f}")),
        ("queue wait, p95 (min)", each(lambda m: f"{_pct(m.waits, 0.95):.1f}")),
        ("user-hours waited (incl. abandoned)", each(lambda m: h(sum(m.waits) + m.abandoned_wait_minutes))),
        ("servers culled: GPU / CPU", each(lambda m: f"{m.culled_gpu} / {m.culled_cpu}")),
        ("culled while GPUs busy (run going)", each(lambda m: f"{m.culled_busy}")),
        ("training GPU-hours lost to culls", each(lambda m: h(m.train_gpu_minutes_lost))),
        (
            "training runs: done / killed / never ran",
            each(lambda m: f"{m.runs_completed} / {m.runs_killed} / {m.runs_never_started}"),
        ),
        ("  (still running when the replay ends)", each(lambda m: f"{m.runs_running_at_end}")),
        ("culled while the user was at the desk", each(lambda m: f"{m.culled_at_desk}")),
        ("warnings (on a busy server)", each(lambda m: f"{m.warnings} ({m.warnings_busy})")),
        ("snoozes used", each(lambda m: f"{m.snoozes}")),
        ("restarts after a cull", each(lambda m: f"{m.restarts_after_cull}")),
    ]


def format_table(p: Params, results: dict[str, Metrics]) -> str:
    heads = ["(a) no culling", f"(b) activity {p.b_timeout:g}m", "(c) gpuhub rules"]
    body = rows(results)
    w0 = max(len(r[0]) for r in body)
    ws = [max(len(heads[i]), *(len(r[1][i]) for r in body)) for i in range(3)]
    line = lambda a, cols: "  ".join([a.ljust(w0)] + [c.rjust(w) for c, w in zip(cols, ws)])  # noqa: E731
    out = [line("", heads), line("", ["-" * w for w in ws])]
    out += [line(name, cols) for name, cols in body]
    return "\n".join(out)


def summary(p: Params, results: dict[str, Metrics]) -> str:
    a, c = results["none"], results["gpuhub"]
    ratio = a.gpu_minutes_idle / c.gpu_minutes_idle if c.gpu_minutes_idle else math.inf
    return (
        f"(c) holds {ratio:.1f}x fewer idle GPU-hours than (a); "
        f"(c) culled {c.culled_busy} server(s) with a training run going "
        f"(and {c.culled_busy_reading} whose GPUs read busy at the culling pass)."
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The model's description as written, each option with its default."""


def parse_args(argv: list[str] | None = None) -> Params:
    d = Params()
    ap = argparse.ArgumentParser(prog="trace_replay.py", description=__doc__, formatter_class=_HelpFormatter)
    for f in fields(Params):
        default = getattr(d, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, tuple):
            ap.add_argument(flag, type=float, nargs=2, metavar=("FROM", "TO"), default=default, help=HELP[f.name])
        else:
            ap.add_argument(flag, type=type(default), default=default, help=HELP[f.name])
    ns = ap.parse_args(argv)
    return Params(**{f.name: (tuple(v) if isinstance(v := getattr(ns, f.name), list) else v) for f in fields(Params)})


def main(argv: list[str] | None = None) -> int:
    p = parse_args(argv)
    t0 = time.perf_counter()
    results = run_benchmark(p)
    elapsed = time.perf_counter() - t0
    n_gpu = round(p.users * p.gpu_users)
    print(
        f"gpuhub culling benchmark: seed {p.seed}, {p.users} users ({n_gpu} on GPU profiles, "
        f"{p.users - n_gpu} CPU), {p.gpus} GPUs, {p.days} days, culler every {p.culler_every} min; "
        f"(c) GPU timeout {p.gpu_timeout}, gpuIdleTimeout {p.gpu_idle_timeout}, CPU timeout {p.cpu_timeout}, "
        f"warning {p.warning}, snooze {p.snooze} x{p.max_snoozes}"
    )
    print()
    print(format_table(p, results))
    print()
    print(summary(p, results))
    print(f"replayed in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
