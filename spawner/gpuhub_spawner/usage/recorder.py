"""Where gpuhub's events become history, audit entries and metrics.

The admission queue, the culling board, the spawner and the policy store call the
module-level functions below (no-ops until a hub attaches a recorder, so units and
other backends need nothing). One ``UsageRecorder`` per hub process writes:

- ``History``: an allocation row opened at admission, closed at release with how it
  ended. The end reason is *noted* by whoever causes the end before the release
  happens (the culler's decision: ``culled``; a job preempted for an interactive
  server: ``reclaimed``; ``Spawner.stop``: ``stopped``); a release nobody announced is
  a ``crashed`` server (or an ``ended`` job). First note wins: a culled server is also
  stopped, and stays ``culled``.
- ``AuditLog``: every decision and action, in order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tornado.ioloop import PeriodicCallback
from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from . import policy_text
from .audit import AuditLog
from ..admission.fairshare import SEED_HALF_LIVES
from .history import History

log = logging.getLogger("JupyterHub.gpuhub.usage")


def current() -> "UsageRecorder | None":
    """The hub's recorder once it listens to an admission view (``attach``); None before, and
    in processes that record nothing (the CLI, a test without one)."""
    if not UsageRecorder.initialized():
        return None
    rec = UsageRecorder.instance()
    return rec if rec.broker is not None else None


# -- hooks other modules call (cheap no-ops without a recorder) ---------------------------------
def note_end(key: str, reason: str, by: str | None = None) -> None:
    """``key``'s coming release ends it for ``reason`` (first note wins)."""
    if (rec := current()) is not None:
        rec._ends.setdefault(key, (reason, by, time.time()))


def note_started(key: str, user: str, url: str | None = None) -> None:
    if (rec := current()) is not None:
        adm = rec.broker.queue.admitted.get(key)
        rec.audit.record(
            "started",
            key=key,
            user=user,
            team=getattr(adm, "team", None),
            profile=getattr(adm, "profile", None),
            devices=getattr(adm, "devices", None),
        )


def audit(event: str, **fields) -> None:
    if (rec := current()) is not None:
        rec.audit.record(event, **fields)


def gpu_pass(
    readings: dict[str, tuple[int, float | None, bool]], elapsed: float, devices: dict[str, float] | None = None
) -> None:
    """A culler pass: per server key (GPUs held, utilisation or None, idle?) over ``elapsed`` s."""
    if (rec := current()) is not None:
        rec._gpu_pass(readings, elapsed, devices or {})


# The policy's masked text (``policy_text.data_text``, formerly here): made in a child process
# for a large policy (``_record_policy_diff``).
_policy_text = policy_text.data_text

# Policies with more teams and profiles than this are diffed in a child process.
BESIDE_FROM_ITEMS = 200


def _items(source) -> int:
    return sum(len(v) for v in source.values() if isinstance(v, list)) if isinstance(source, dict) else 0


def role_map(policy) -> dict[str, list[str]]:
    """Group -> gpuhub roles it grants, from the policy (for the audit's role changes)."""
    out: dict[str, set[str]] = {}
    for g in policy.roles.admins:
        out.setdefault(g, set()).add("admin")
    for g in policy.roles.viewers:
        out.setdefault(g, set()).add("viewer")
    for t in policy.teams:
        for g in t.leads:
            out.setdefault(g, set()).add(f"lead:{t.name}")
        for g in t.groups:
            out.setdefault(g, set()).add(f"researcher:{t.name}")
    return {g: sorted(r) for g, r in sorted(out.items())}


class UsageRecorder(SingletonConfigurable):
    db_url = Unicode("", help="Database for usage history (default: the hub's JupyterHub.db_url).").tag(config=True)
    audit_file = Unicode("", help="Append-only JSON-lines audit trail (0600, in the hub's data dir); empty: memory.").tag(
        config=True
    )
    reconcile_after = Float(
        60.0, help="Seconds after the hub starts when history rows no running server claims are closed as crashed."
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history = History(self.db_url or "sqlite://")
        self.audit = AuditLog(self.audit_file or None)
        self.broker = None
        self._ends: dict[str, tuple[str, str | None, float]] = {}
        self._requested: dict[str, float] = {}
        self._policy_source: Any = None  # what the policy in force was read from (data or Policy)
        self._text_of: tuple[Any, str] | None = None  # (source, its masked text): the last one dumped
        self._differ: ThreadPoolExecutor | None = None  # one thread: the reloads' diffs, in order
        self._roles: dict[str, list[str]] | None = None
        self._failed_at: float | None = None
        self._util: dict[str, float] = {}  # device -> utilisation % at the last pass
        self._checker: PeriodicCallback | None = None

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, broker) -> None:
        """Listen to ``broker``'s queue and policy store (once per hub process)."""
        if self.broker is broker:
            return
        self.broker = broker
        q = broker.queue
        q.on_submit.append(self._submitted)
        q.on_queued.append(self._queued)
        q.on_refuse.append(self._refused)
        q.on_cancel.append(self._cancelled)
        q.on_admit.append(self._admitted)
        q.on_release.append(self._released)
        store = broker.store
        # Fair share's memory (admission/fairshare.py) starts from the recorded history, so a
        # restart forgets nothing; a policy with another half-life re-reads it from here.
        fair = getattr(q, "fair", None)
        if fair is not None:
            fair.configure(store.current)  # half-life and weights first: then one read
            fair.source = lambda since: self.history.rows(since)
            fair.seed(fair.source(fair.clock() - SEED_HALF_LIVES * fair.half_life), store.current)
        self._policy_source = _source(store, store.current)  # dumped only when a reload needs the diff
        self._roles = role_map(store.current)
        store.on_change(self._policy_changed)
        from . import metrics

        metrics.register(broker, self)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(self.reconcile_after, self.reconcile)
        self._checker = PeriodicCallback(self._check_policy_failure, 5000)
        self._checker.start()

    def reconcile(self) -> None:
        """Close rows of allocations that ended while the hub was down (nothing holds them now)."""
        if self.broker is None:
            return
        held = set(self.broker.queue.admitted)
        for key in self.history.open_keys():
            if key not in held:
                self.history.close(key, time.time(), "crashed")
                self.audit.record("released", key=key, reason="crashed", detail="found gone after a hub restart")

    # -- queue events -----------------------------------------------------------------------
    def _sample(self, team: str) -> None:
        """The team's queue length for the queue chart (O(1): only the team the event touched)."""
        self.history.sample_queue({team: self.broker.queue.waiting_in(team)})

    def _record_requested(self, ticket) -> None:
        """The audit's "requested" entry: for every request, admitted, queued or refused."""
        self.audit.record(
            "requested",
            key=ticket.key,
            user=ticket.user,
            team=ticket.team,
            profile=ticket.profile,
            demand=ticket.demand,
            priority=ticket.priority,
        )

    def _submitted(self, ticket) -> None:
        self._ends.pop(ticket.key, None)
        self._requested[ticket.key] = ticket.created
        self._record_requested(ticket)

    def _queued(self, ticket) -> None:
        status = ticket.status
        self.audit.record(
            "queued",
            key=ticket.key,
            user=ticket.user,
            team=ticket.team,
            position=getattr(status, "position", None),
            reason=getattr(status, "reason", None),
        )
        self._sample(ticket.team)

    def _refused(self, ticket, reason: str) -> None:
        self._record_requested(ticket)
        self.audit.record("refused", key=ticket.key, user=ticket.user, team=ticket.team, profile=ticket.profile, reason=reason)

    def _cancelled(self, ticket) -> None:
        self._requested.pop(ticket.key, None)
        self.audit.record(
            "left_queue",
            key=ticket.key,
            user=ticket.user,
            team=ticket.team,
            profile=ticket.profile,
            waited=round(time.time() - ticket.created, 3),
        )
        self._sample(ticket.team)

    def _admitted(self, adm) -> None:
        requested = self._requested.pop(adm.key, adm.since)
        flavor, gpus = "", 0
        for k, v in adm.demand.items():
            if k.startswith("gpu/"):
                flavor, gpus = k[4:], gpus + int(v)
        self._ends.pop(adm.key, None)
        self.history.open(
            key=adm.key,
            user=adm.user,
            team=adm.team,
            profile=adm.profile,
            flavor=flavor,
            gpus=gpus,
            devices=list(adm.devices),
            requested=requested,
            start=adm.since,
        )
        from . import metrics

        metrics.TEAM_WAIT.labels(team=adm.team).observe(max(0.0, adm.since - requested))
        self.audit.record(
            "admitted",
            key=adm.key,
            user=adm.user,
            team=adm.team,
            profile=adm.profile,
            devices=list(adm.devices),
            waited=round(max(0.0, adm.since - requested), 3),
        )
        self._sample(adm.team)

    def _released(self, adm) -> None:
        reason, by, _ = self._ends.pop(adm.key, (None, None, 0))
        if reason is None:
            reason = "ended" if adm.key.startswith("job:") else "crashed"
        now = time.time()
        self.history.close(adm.key, now, reason, by)
        for d in adm.devices:
            self._util.pop(d, None)
        self.audit.record(
            "released",
            key=adm.key,
            user=adm.user,
            team=adm.team,
            profile=adm.profile,
            devices=list(adm.devices),
            reason=reason,
            by=by,
            held_seconds=round(now - adm.since, 3),
        )

    # -- GPU readings from the culler's passes ------------------------------------------------
    def _gpu_pass(self, readings, elapsed: float, devices: dict[str, float]) -> None:
        measured = {}
        for key, (gpus, util, idle) in readings.items():
            if util is None or gpus <= 0:
                continue  # utilisation unknown: counted as held, neither busy nor idle
            measured[key] = (gpus * elapsed, gpus * elapsed if idle else 0.0)
        if elapsed > 0:
            self.history.add_gpu_time(measured)
        held = {d for a in self.broker.queue.admitted.values() for d in a.devices} if self.broker else set()
        self._util = {d: v for d, v in devices.items() if d in held}

    # -- policy ------------------------------------------------------------------------------
    def _policy_changed(self, policy) -> None:
        """On the hub's loop: bookkeeping only (swap a reference, compare the groups' roles,
        hand on a job). Who owns the file and the policy's text and diff (~1 s of CPU for 500
        teams, made in a child process) are found in the recorder's own thread, in reload
        order, and recorded (``policy_reloaded``) when ready."""
        store = self.broker.store if self.broker else None
        path = store.status.path if store is not None else ""
        before, after = self._policy_source, _source(store, policy)
        self._policy_source = after
        self._off_loop(self._record_policy_diff, before, after, path, None)
        roles = role_map(policy)
        if roles != self._roles:
            before = self._roles or {}
            changes = {
                g: {"before": before.get(g, []), "after": roles.get(g, [])}
                for g in sorted(set(before) | set(roles))
                if before.get(g) != roles.get(g)
            }
            self.audit.record("roles_changed", path=path, changes=changes)
            self._roles = roles

    def _off_loop(self, fn, *args) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no hub loop (units, tools): now
            fn(*args)
            return
        if self._differ is None:
            self._differ = ThreadPoolExecutor(1, thread_name_prefix="gpuhub-policy-diff")
        self._differ.submit(fn, *args).add_done_callback(_log_failure)

    def _text(self, source) -> str:
        if self._text_of is not None and self._text_of[0] is source:
            return self._text_of[1]
        return _policy_text(source)

    def _record_policy_diff(self, before, after, path: str, by: str | None) -> None:
        """In the recorder's thread: the policy's masked text before and after, their diff.
        For a large policy (plain data) both are made in a child process: 1-2 s of Python in
        a thread would have the hub's loop wait for the interpreter lock at every turn."""
        if _items(after) > BESIDE_FROM_ITEMS and (before is None or isinstance(before, dict)):
            known = self._text_of[1] if self._text_of is not None and self._text_of[0] is before else None
            new, diff = policy_text.text_and_diff_beside(known, before, after)
        else:
            old = self._text(before) if before is not None else ""
            new = self._text(after)
            diff = policy_text.text_diff(old, new) if new != old else None
        self._text_of = (after, new)
        if diff is not None:
            if by is None:
                try:
                    by = f"file owner {pwd.getpwuid(os.stat(path).st_uid).pw_name}"
                except (OSError, KeyError):
                    pass
            self.audit.record("policy_reloaded", path=path, by=by, diff=diff)

    def _check_policy_failure(self) -> None:
        if self.broker is None:
            return
        status = self.broker.store.status
        if status.failed_at and status.failed_at != self._failed_at:
            self._failed_at = status.failed_at
            self.audit.record("policy_reload_failed", path=status.path, errors=list(status.errors))

    def utilisation(self) -> dict[str, float]:
        return dict(self._util)


def _source(store, policy) -> Any:
    """What ``policy`` was read from: the store's plain data when it is that policy's, else the policy."""
    data = getattr(store, "data", None)
    return data if data is not None and getattr(store, "current", None) is policy else policy


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.error("The audit entry of a policy reload failed", exc_info=future.exception())


def entries_json(entries: list[dict]) -> str:
    return json.dumps({"entries": entries})
