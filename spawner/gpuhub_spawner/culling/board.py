"""The hub's record of pending stops, snoozes and past culls, and where decisions are made.

Each culler pass asks the hub once for every server's decision
(``POST /hub/api/gpuhub/cull-decisions``); the hub decides in-process from what it
recorded itself — start time, last activity, trusted GPU readings — so deciding 5,000
servers is a loop, not 5,000 round trips, and no user's server is ever contacted.
Deciding in the hub also keeps one copy of the state that users see (home page,
JupyterLab) and change (snooze): no race between a snooze and a pass.

A pass costs what is due, not what exists: when a server is kept with no warning
pending, its record remembers when its earliest rule can fire (``next_due``) and what
that was computed from. Activity and busy-GPU readings only move forward, so until that
moment the server is kept without evaluating its rules again, unless its rules (a policy
change), its GPU reading's kind or its start changed. Servers with a pending warning are
evaluated every pass (activity may withdraw it, a snooze may have moved it).

The state survives a hub restart: ``state_file`` (JSON in the hub's data directory,
mode 0600, replaced atomically) holds pending warnings, snooze counts, the last busy GPU
reading and each user's recent culls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timezone
from functools import cached_property
from pathlib import Path

from traitlets import Integer, Unicode
from traitlets.config import SingletonConfigurable

from ..policy import PolicyStore
from ..policy.model import IdleRules, Policy, Profile
from ..policy.quantities import format_duration
from . import metrics
from ..usage import recorder as usage
from .gpu import DcgmPrometheusReader, read_nvml
from .rules import GPU_IDLE, TIMEOUT, CullState, Decision, Signals, decide, due_rules, snooze
from ..policy.files import write_atomically

log = logging.getLogger("JupyterHub.gpuhub.culler")

DEFAULT_BUSY_THRESHOLD = 5
HISTORY_PER_USER = 10
SOFT_SAVE_EVERY = 60.0  # seconds between saves caused only by fresh GPU readings
# A user whose long poll came this recently has a JupyterLab open and visible (the extension asks
# again at once after each answer, at most every 25 s: culling_api.MAX_GPU_WAIT, plus slack).
POLL_GAP = 30.0
RELAY_GRACE = 0.5  # s the relay in a server gets to pass the hub's stop notice on before the stop


@dataclass
class ServerRecord:
    started: float
    state: CullState = field(default_factory=CullState)
    gpu_last_busy: float | None = None
    # Not persisted: the earliest moment a rule can fire, valid while ``basis`` holds
    # (the rules object, has GPUs, judged by activity only, the activity it was computed from).
    next_due: float | None = field(default=None, compare=False, repr=False)
    basis: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def worth_keeping(self) -> bool:
        """Whether a restart must remember it (a fresh record is the same as none)."""
        return self.state.deadline is not None or self.gpu_last_busy is not None

    def to_json(self) -> dict:
        return {"started": self.started, "state": asdict(self.state), "gpu_last_busy": self.gpu_last_busy}

    def kept_until(self, rules, has_gpus: bool, last_activity: float | None, now: float) -> bool:
        """Whether no rule can fire before ``next_due`` (> now) on what changed since."""
        b = self.basis
        return (
            self.next_due is not None
            and now < self.next_due
            and self.state.deadline is None
            and b is not None
            and b[0] is rules
            and b[1] == has_gpus
            and (last_activity or 0.0) >= b[3]
        )


@dataclass
class ServerView:
    """What the hub knows about one ready server, gathered by the API handler."""

    user: str
    server: str
    profile: Profile | None
    started: float
    last_activity: float | None
    team: str = ""
    devices: list[str] = field(default_factory=list)  # one machine: device ids for NVML
    pod: tuple[str, str] | None = None  # Kubernetes: (namespace, pod) for DCGM

    @cached_property
    def key(self) -> str:
        return f"{self.user}/{self.server}"

    @cached_property
    def has_gpus(self) -> bool:
        return bool(self.profile and self.profile.gpu_count)


class CullBoard(SingletonConfigurable):
    state_file = Unicode("", help="Where warnings, snoozes and cull history persist (JSON, 0600); empty: memory only.").tag(
        config=True
    )
    pass_interval = Integer(60, help="Seconds between culler passes (for idle GPU-seconds and the DCGM window).").tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.records: dict[str, ServerRecord] = {}
        self.history: dict[str, list[dict]] = {}
        # user/server -> a reclaim notice (culling/reclaimer.py): shown like a warning, no snooze
        self.reclaims: dict[str, dict] = {}
        self._dirty = False
        self._saved_at = 0.0
        self._last_pass: float | None = None
        self._rules_policy: Policy | None = None
        self._rules_cache: dict[int, tuple[Profile | None, IdleRules]] = {}
        self.dcgm = DcgmPrometheusReader(parent=self)
        # user/server -> why it is being stopped right now (any stop: the culler's, a reclaim,
        # the user's or an admin's from the hub), for the open JupyterLab; not persisted.
        self.stops: dict[str, dict] = {}
        # Long polls (hub/culling_api.py) waiting for what a user is told to change, and the
        # answers still being written, per user (a stop waits for those before the server goes).
        self._waiters: set[asyncio.Future] = set()
        self._answering: dict[str, set[asyncio.Future]] = {}
        self._polled: dict[str, float] = {}  # user -> when a long poll of theirs last came (monotonic)
        self._next_answer: dict[str, set[asyncio.Future]] = {}  # stops waiting for a poll on its way
        self.load()

    # -- persistence ----------------------------------------------------------------------
    def load(self) -> None:
        if not self.state_file or not os.path.exists(self.state_file):
            return
        try:
            with open(self.state_file) as f:
                data = json.load(f)
            for key, rec in data.get("records", {}).items():
                self.records[key] = ServerRecord(
                    started=rec["started"], state=CullState(**rec.get("state", {})), gpu_last_busy=rec.get("gpu_last_busy")
                )
            self.history = {u: list(h) for u, h in data.get("history", {}).items()}
            self.reclaims = {k: dict(v) for k, v in data.get("reclaims", {}).items()}  # deadlines survive a restart
            log.info(
                "Culling state restored: %d servers tracked, %d pending stops",
                len(self.records),
                sum(1 for r in self.records.values() if r.state.deadline),
            )
        except (OSError, ValueError, TypeError, KeyError) as e:
            # A damaged file must not stop the hub; keep it for inspection.
            log.error("Cannot read culling state %s (%s); starting empty, file kept as .bad", self.state_file, e)
            try:
                os.replace(self.state_file, self.state_file + ".bad")
            except OSError:
                pass

    def save(self, force: bool = False) -> None:
        if not self.state_file or not (self._dirty or force):
            return
        # Only records a restart needs (a pending warning, a busy GPU reading): a server
        # with neither gets the same fresh record again, so 5,000 quiet servers cost nothing.
        data = {
            "records": {k: v.to_json() for k, v in self.records.items() if v.worth_keeping},
            "history": self.history,
            "reclaims": self.reclaims,
        }
        path = Path(self.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(data), 0o600)
        self._dirty = False
        self._saved_at = time.time()

    # -- rules ----------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return PolicyStore.instance(config=self.config).policy

    def rules_for(self, profile: Profile | None, policy: Policy | None = None) -> IdleRules:
        """The profile's rules over the defaults, merged once per policy (the same object
        each pass, so a record's ``basis`` notices a policy change by identity).

        ``policy``: the one in force, when the caller already has it (a pass asks the
        store once, not once per server: each ask looks at the policy file)."""
        policy = self.policy if policy is None else policy
        if policy is not self._rules_policy:
            self._rules_policy, self._rules_cache = policy, {}
        hit = self._rules_cache.get(id(profile))
        if hit is not None and hit[0] is profile:
            return hit[1]
        rules = policy.idle_rules(profile) if profile else policy.defaults.idle
        self._rules_cache[id(profile)] = (profile, rules)  # holds the profile: its id stays its own
        return rules

    def _record(self, key: str, started: float) -> ServerRecord:
        rec = self.records.get(key)
        if rec is None or abs(rec.started - started) > 1:
            if rec is not None and rec.worth_keeping:
                self._dirty = True
            rec = self.records[key] = ServerRecord(started=started)
        return rec

    def wants_fresh_activity(self, view: ServerView, now: float, policy: Policy | None = None) -> bool:
        """Whether the proxy's latest activity could change this server's decision now.

        Yes for a server whose rule is due (about to be warned) and a warning about
        inactivity (activity withdraws it). Not for a GPU-idle or maximum-age warning:
        activity does not end those (``rules._idle_period_ended``), and what snoozes a
        GPU-idle warning at its deadline is a person seen (``person_seen``), not traffic.
        """
        rec = self.records.get(view.key)
        if rec is not None and abs(rec.started - view.started) > 1:
            rec = None  # restarted: its old record is not about this server
        if rec is not None and rec.state.deadline is not None:
            return rec.state.rule == TIMEOUT
        rules = self.rules_for(view.profile, policy)
        if rec is not None and rec.kept_until(rules, view.has_gpus, view.last_activity, now):
            return False
        gpu_busy = rec.gpu_last_busy if rec else None
        signals = Signals(view.started, view.last_activity, gpu_busy, view.has_gpus)
        return any(due <= now for due, *_ in due_rules(rules, signals))

    # -- a pass ---------------------------------------------------------------------------
    async def read_gpus(self, views: list[ServerView]) -> dict[str, float | None]:
        """Max utilisation per server key from trusted sources; absent = no reading."""
        gpu_views = [v for v in views if v.has_gpus]
        devices = [d for v in gpu_views for d in v.devices]
        pods = [v.pod for v in gpu_views if v.pod]
        by_device = await asyncio.get_running_loop().run_in_executor(None, read_nvml, devices) if devices else {}
        by_pod = await self.dcgm.read(pods, self.pass_interval) if pods else {}
        out: dict[str, float | None] = {}
        for v in gpu_views:
            values = [by_device[d] for d in v.devices if d in by_device]
            if v.pod and v.pod in by_pod:
                values.append(by_pod[v.pod])
            if values:
                out[v.key] = max(values)
        return out

    async def decide_all(
        self, views: list[ServerView], now: float | None = None, complete: bool = True, alive: set[str] | None = None
    ) -> dict[str, Decision]:
        """Decide every server of one pass.

        ``complete``: ``views`` are all ready servers, so records of servers that are gone
        are dropped — except those in ``alive`` (running but not ready yet, e.g. still being
        re-adopted after a hub restart: their pending warnings must survive).
        """
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        readings = await self.read_gpus(views)
        policy = self.policy
        decisions: dict[str, Decision] = {}
        idle_gpus: dict[str, float] = {}
        gpu_readings: dict[str, tuple[int, float | None, bool]] = {}  # for usage history
        for v in views:
            rules = self.rules_for(v.profile, policy)
            rec = self._record(v.key, v.started)
            util = readings.get(v.key)
            threshold = rules.gpu_busy_threshold if rules.gpu_busy_threshold is not None else DEFAULT_BUSY_THRESHOLD
            if v.has_gpus and v.profile is not None:  # (has_gpus: a profile with GPUs)
                if util is not None and util >= threshold:
                    rec.gpu_last_busy = now
                else:  # idle, or no trusted reading: unknown is idle
                    idle_gpus[v.team] = idle_gpus.get(v.team, 0) + v.profile.gpu_count
                gpu_readings[v.key] = (v.profile.gpu_count, util, util is None or util < threshold)
            # The warning names the rule only where the policy chose one (gpuUnread): unset, an
            # unread GPU (a virtual one, the demo's) counts as idle and reads as it always has.
            unread = rules.gpu_unread if v.has_gpus and util is None else None
            by_activity = unread == "activity"
            if rec.kept_until(rules, v.has_gpus, v.last_activity, now) and rec.basis is not None and rec.basis[2] == by_activity:
                decisions[v.key] = Decision("keep")  # nothing it depends on moved back: no rule due yet
                continue
            signals = Signals(v.started, v.last_activity, rec.gpu_last_busy, v.has_gpus, unread)
            rec.next_due = rec.basis = None
            if rec.state.deadline is None:
                # what ``decide`` does first for a server without a warning, kept to learn when
                # the earliest rule fires (it changes nothing on the record when none is due)
                dues = due_rules(rules, signals)
                if not dues or dues[0][0] > now:
                    rec.next_due = dues[0][0] if dues else float("inf")
                    rec.basis = (rules, v.has_gpus, by_activity, v.last_activity or 0.0)
                    decisions[v.key] = Decision("keep")
                    continue
            before = (rec.state.deadline, rec.state.snoozes)
            d = decide(now, rules, signals, rec.state)
            decisions[v.key] = d
            self._account(v, rec, d, before, util, now)
        if complete:
            keys = {v.key for v in views} | (alive or set())
            for gone in [k for k in self.records if k not in keys]:
                if self.records.pop(gone).worth_keeping:
                    self._dirty = True
        if self._last_pass is not None:
            elapsed = min(now - self._last_pass, 3 * self.pass_interval)
            for team, n in idle_gpus.items():
                metrics.IDLE_GPU_SECONDS.labels(team=team).inc(n * max(0.0, elapsed))
            usage.gpu_pass(
                gpu_readings,
                max(0.0, elapsed),
                {
                    d: reading[1]
                    for v in views
                    if (reading := gpu_readings.get(v.key)) is not None and reading[1] is not None
                    for d in v.devices
                },
            )
        self._last_pass = now
        metrics.IDLE_GPUS_BY_TEAM.publish(idle_gpus, {t.name for t in policy.teams})
        self.save() if self._dirty else None
        if not self._dirty and now - self._saved_at > SOFT_SAVE_EVERY:
            self.save(force=True)  # the last busy readings, so a restart does not forget them
        metrics.PASS_SECONDS.set(time.perf_counter() - t0)
        return decisions

    def _account(self, v: ServerView, rec: ServerRecord, d: Decision, before, util, now: float) -> None:
        if d.action == "keep" and before[0] is None:
            return  # nothing happened to it: no words to build
        if d.action == "warn" and before[0] is not None and before[0] == rec.state.deadline and before[1] == rec.state.snoozes:
            return  # a warning standing as it was
        fmt = lambda s: "n/a" if s is None else format_duration(max(0.0, s))  # noqa: E731
        slug = v.profile.slug if v.profile else "?"
        gpu_text = (
            ""
            if not v.has_gpus
            else (
                f", GPU {util:.0f}%"
                if util is not None
                else f", GPU unread ({'activity only' if self.rules_for(v.profile).gpu_unread == 'activity' else 'counts as idle'})"
            )
        )
        idle_text = (
            f"inactive {fmt(now - (v.last_activity or v.started))}, "
            f"GPUs idle {fmt(now - (rec.gpu_last_busy or v.started)) if v.has_gpus else 'n/a'}{gpu_text}, "
            f"age {fmt(now - v.started)}"
        )
        if d.action == "keep":
            if before[0] is not None:
                log.info("Warning withdrawn for %s (profile %s): %s", v.key, slug, idle_text)
                self._dirty = True
                self.changed()
            return
        if d.action == "cull":
            log.warning("Culling %s (profile %s): %s; %s", v.key, slug, d.reason, idle_text)
            metrics.CULLS.labels(rule=d.rule or "?").inc()
            usage.note_end(v.key, "culled", by="gpuhub-culler")
            usage.audit("culled", key=v.key, user=v.user, team=v.team, profile=slug, rule=d.rule, reason=d.reason)
            entry = {
                "server": v.server,
                "profile": slug,
                "profile_name": v.profile.display_name if v.profile else None,
                "at": now,
                "reason": d.reason,
                "rule": d.rule,
                "idle_since": d.idle_since,
                "started": v.started,
            }
            self.history.setdefault(v.user, []).append(entry)
            del self.history[v.user][:-HISTORY_PER_USER]
            self.records.pop(v.key, None)
            self._dirty = True
            self.changed()  # the open JupyterLab says why before the culler's stop arrives
            return
        if before[0] is None or before[0] != rec.state.deadline or before[1] != rec.state.snoozes:
            self._dirty = True
            self.changed()
        if before[0] is None:
            metrics.WARNINGS.labels(rule=d.rule or "?").inc()
            usage.audit(
                "warned",
                key=v.key,
                user=v.user,
                team=v.team,
                profile=slug,
                rule=d.rule,
                reason=d.reason,
                stops_at=rec.state.deadline,
            )
            log.info("Warning %s (profile %s): stops in %s: %s; %s", v.key, slug, fmt(d.remaining), d.reason, idle_text)
        elif rec.state.snoozes > before[1] and d.rule == GPU_IDLE:
            metrics.SNOOZES.labels(how="returned").inc()
            usage.audit("snoozed", key=v.key, user=v.user, how="returned", stops_at=rec.state.deadline)
            log.info(
                "Snoozed %s: the user came back (snooze %d); stops in %s unless its GPUs are used",
                v.key,
                rec.state.snoozes,
                fmt(d.remaining),
            )

    # -- users ----------------------------------------------------------------------------
    def snooze(self, key: str, profile: Profile | None, now: float | None = None) -> tuple[bool, str, float | None]:
        now = time.time() if now is None else now
        if key in self.reclaims:
            r = self.reclaims[key]
            return (
                False,
                (f"This server cannot be snoozed: its GPU was borrowed and {r['needed_by']} needs it back."),
                r["deadline"],
            )
        rec = self.records.get(key)
        if rec is None:
            return False, "This server has no pending stop to snooze.", None
        ok, message = snooze(now, self.rules_for(profile), rec.state)
        if ok:
            log.info("Snoozed %s: %s", key, message)
            metrics.SNOOZES.labels(how="user").inc()
            usage.audit("snoozed", key=key, user=key.partition("/")[0], how="user", stops_at=rec.state.deadline)
            self._dirty = True
            self.save()
            self.changed()
        return ok, message, rec.state.deadline

    def person_seen(self, key: str, now: float | None = None) -> bool:
        """The user's open JupyterLab says a person clicked, typed or scrolled on it (the lab
        extension reports the first such input after each warning it shows). Recorded on the
        hub's clock, only while a warning is pending; at a GPU-idle deadline it spends one
        snooze (``rules.decide``), as the user's own Snooze button could. Returns whether it
        was recorded."""
        rec = self.records.get(key)
        if rec is None or rec.state.deadline is None:
            return False
        now = time.time() if now is None else now
        first = (rec.state.person_seen or 0.0) <= (rec.state.warned_at or 0.0)
        rec.state.person_seen = now
        if first:  # once per warning: later reports within it change nothing a user sees
            log.info("Person seen on %s's open JupyterLab after the warning (%s)", key, rec.state.rule)
            self._dirty = True
            self.save()
        return True

    def warnings_for(self, user: str, profiles: dict[str, Profile | None]) -> dict[str, dict]:
        """The user's servers with a pending stop (home page, JupyterLab, API)."""
        out = {}
        for server, profile in profiles.items():
            reclaim = self.reclaims.get(f"{user}/{server}")
            if reclaim is not None:  # a borrowed GPU going back: hard, wins over an idle warning
                out[server] = {
                    "deadline": reclaim["deadline"],
                    "reason": reclaim["reason"],
                    "rule": "reclaim",
                    "warned_at": reclaim["warned_at"],
                    "snoozes_used": 0,
                    "snoozes_left": 0,
                    "snooze_seconds": 0,
                    "devices": reclaim["devices"],
                    "needed_by": reclaim["needed_by"],
                }
                continue
            rec = self.records.get(f"{user}/{server}")
            if rec is None or rec.state.deadline is None:
                continue
            rules = self.rules_for(profile)
            s = rec.state
            out[server] = {
                "deadline": s.deadline,
                "reason": s.reason,
                "rule": s.rule,
                "warned_at": s.warned_at,
                "snoozes_used": s.snoozes,
                "snoozes_left": 0 if s.hard else max(0, (rules.max_snoozes or 0) - s.snoozes),
                "snooze_seconds": rules.snooze or 0,
            }
        return out

    def culled_for(self, user: str, active: set[str]) -> dict[str, dict]:
        """Each server's last cull, unless the server is running (or starting) again."""
        out: dict[str, dict] = {}
        for entry in self.history.get(user, []):
            out[entry["server"]] = entry
        return {name: e for name, e in out.items() if name not in active}

    # -- reclaim (culling/reclaimer.py decides; the board only shows) ------------------------
    def set_reclaim(self, key: str, notice: dict) -> None:
        self.reclaims[key] = notice
        self._dirty = True
        self.save()
        self.changed()

    def clear_reclaim(self, key: str) -> None:
        if self.reclaims.pop(key, None) is not None:
            self._dirty = True
            self.save()
            self.changed()

    def reclaimed(self, key: str, reason: str, warned_at: float) -> None:
        """The server was stopped to give its GPU back: the home page says so, like a cull."""
        self.reclaims.pop(key, None)
        user, _, server = key.partition("/")
        self.history.setdefault(user, []).append(
            {
                "server": server,
                "profile": None,
                "profile_name": None,
                "at": time.time(),
                "reason": reason,
                "rule": "reclaim",
                "idle_since": None,
                "started": None,
                "warned_at": warned_at,
            }
        )
        del self.history[user][:-HISTORY_PER_USER]
        self.records.pop(key, None)
        self._dirty = True
        self.save()
        self.changed()

    # -- what open JupyterLabs wait on (hub/culling_api.py's long poll) ------------------------
    def changed(self) -> None:
        """Wake every long poll: what some user is told may have changed (each compares)."""
        for fut in list(self._waiters):
            if not fut.done():
                fut.get_loop().call_soon_threadsafe(_wake, fut)

    async def wait_change(self, timeout: float) -> bool:
        """True when ``changed()`` was called within ``timeout`` seconds."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._waiters.discard(fut)

    def answering(self, user: str) -> asyncio.Future:
        """A long poll of ``user`` holds this until its answer is written (``answered``)."""
        fut = asyncio.get_running_loop().create_future()
        self._answering.setdefault(user, set()).add(fut)
        self._polled[user] = time.monotonic()
        return fut

    def answered(self, user: str, fut: asyncio.Future) -> None:
        for f in [fut, *self._next_answer.pop(user, ())]:
            if not f.done():
                f.set_result(None)
        held = self._answering.get(user)
        if held is not None:
            held.discard(fut)
            if not held:
                del self._answering[user]

    async def stopping(self, key: str, started: float | None, reason: str, wait: float = 2.0) -> None:
        """A server is about to stop (any stop: the culler's, a reclaim, the user's or an
        admin's from the hub): its open JupyterLab is told why at once (the long poll answers),
        and the stop waits for those answers to be written, at most ``wait`` seconds, so that
        they leave before the server (the relay they pass through) goes away. A stop the
        culler or a reclaim decided for this run keeps their words (``history``)."""
        user, _, server = key.partition("/")
        now = time.time()
        last = next((e for e in reversed(self.history.get(user, [])) if e["server"] == server), None)
        if last is None or started is None or not _of_run(last, started):
            self.stops[key] = {"server": server, "at": now, "reason": reason, "rule": "stop", "started": started}
        for old in [k for k, e in self.stops.items() if e["at"] < now - 86400]:
            del self.stops[old]
        held = list(self._answering.get(user, ()))
        if not held and time.monotonic() - self._polled.get(user, -1e9) < POLL_GAP:
            # A JupyterLab of theirs polls (visible) but its next request is on its way: wait for
            # it to come and be answered (at once: it finds the stop already).
            fut = asyncio.get_running_loop().create_future()
            self._next_answer.setdefault(user, set()).add(fut)
            held = [fut]
        self.changed()
        if held:
            done, _ = await asyncio.wait(held, timeout=wait)
            if done:
                # The relay in the server passes the answer on in its own loop; the server's stop
                # signal, sent the moment we return, would stop that loop first (seen: SIGINT
                # 1 ms after the hub's answer, the browser's request hung up).
                await asyncio.sleep(RELAY_GRACE)

    def stopped_for(self, user: str, started: dict[str, float | None]) -> dict[str, dict]:
        """Why each server of ``user`` stopped or is stopping, for the run that started at
        ``started[server]`` (epoch; None: not running): a stop in progress, else the last
        cull or reclaim of that run (or the last one at all, for a server that is not running)."""
        out: dict[str, dict] = {}
        for entry in self.history.get(user, []):
            out[entry["server"]] = entry
        for key, entry in self.stops.items():
            u, _, server = key.partition("/")
            if u == user and (server not in out or entry["at"] >= out[server]["at"]):
                out[server] = entry
        result = {}
        for server, entry in out.items():
            if server not in started:
                continue
            since = started[server]
            if since is None or _of_run(entry, since):
                result[server] = {k: entry.get(k) for k in ("at", "reason", "rule")}
        return result

    def forget(self, key: str) -> None:
        if self.records.pop(key, None) is not None:
            self._dirty = True


def _of_run(entry: dict, started: float) -> bool:
    """Whether a stop or cull ``entry`` is about the run that started at ``started``: by the
    run it names where it names one (a cull, a stop from the hub), else by its time. By time
    alone, a run started within a second of the previous run's cull would be told it was
    culled (a JupyterLab opened on it showed the old stop instead of its own warning)."""
    run = entry.get("started")
    if run is not None:
        return abs(run - started) <= 1
    return entry["at"] >= started - 1


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def tell_open_lab(spawner, wait: float = 2.0) -> None:
    """Before a running server is stopped (by anyone): its open JupyterLab is told at once why,
    through the long poll it holds on the hub (``CullBoard.stopping``), and the stop waits for
    that answer to leave, at most ``wait`` seconds. Never fails a stop."""
    orm_spawner = getattr(spawner, "orm_spawner", None)
    if orm_spawner is None or orm_spawner.server is None or orm_spawner.started is None:
        return  # waiting in the queue or never started: no JupyterLab is open on it
    started = orm_spawner.started
    if started.tzinfo is None:
        started = started.replace(tzinfo=timezone.utc)  # the hub stores naive UTC
    try:
        board = CullBoard.instance(config=spawner.config)
        await board.stopping(f"{spawner.user.name}/{spawner.name}", started.timestamp(), "from the hub", wait=wait)
    except Exception:  # noqa: BLE001 (a notice; the stop goes on)
        log.exception("Could not tell %s/%s's open JupyterLab that it stops", spawner.user.name, spawner.name)
