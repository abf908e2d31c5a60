"""Carries out ``admission.reclaim``: lent GPUs come back to their team.

Runs on either backend's admission view (``hub.backend``): the one-machine queue, or on
Kubernetes the mirror of Kueue's Workloads (``kube.ledger``). Re-planned on every queue
event (a request queued, a release, a cancel, an admission), coalesced into one pass per
loop turn, and at each notice's deadline. For every holder the plan names:

- a **job** is preempted at once and re-queues from its checkpoint (one machine: the job
  manager stops it; Kubernetes: Kueue preempts lower-priority borrowers itself);
- a **server** is warned where cull warnings are shown (``CullBoard``: hub home page,
  JupyterLab through the notebook extension's relay, the culling API), with its GPUs,
  that its team borrowed them, the team that needs them back and the time it stops. It
  cannot be snoozed. At the deadline (the *lender's* ``reclaim.notice``) it is stopped
  like a cull (files kept) and the lender is admitted on the freed capacity.

If the need goes away first (the lender stopped waiting, a GPU came free) the warning is
withdrawn. The waiting request's message says what it waits for and until when
(``queue.notes``). Notices are kept in the culling board's state file: after a hub
restart a borrower under notice keeps its deadline.

A lender who withdraws a request that had borrowers reclaimed is held down
(``admission.reclaim.HoldDown``): nothing more is reclaimed for them until one notice
period after that reclaim, so starting and cancelling spawns cannot preempt a borrowing
job each time. The hold-down lives in memory (a hub restart ends it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from ..admission.queue import Ticket
from ..admission.quota import add_usage, describe
from ..admission.reclaim import HoldDown, Holder, Request, borrowing, plan, within_nominal
from ..policy.quantities import format_duration
from ..usage import recorder as usage
from .board import CullBoard

log = logging.getLogger("JupyterHub.gpuhub.reclaim")

JOB_PREFIX = "job:"
SAFETY_PASS = 15.0  # seconds; a pass with nothing on loan is O(teams)
STOP_MARGIN = 15.0  # seconds a stopped server takes to exit and hand its GPU on


@dataclass
class Notice:
    key: str  # user/server
    team: str  # the borrower's
    for_team: str  # the lender that needs it back
    warned_at: float
    deadline: float
    reason: str
    devices: list[str]
    since: float = 0.0  # the holder's admission (a notice belongs to one run of a server)


def _clock(ts: float) -> str:
    return time.strftime("%H:%M", time.localtime(ts))


def _clock_s(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _by(ts: float) -> str:
    """A promise in whole minutes must not be early: round up (and allow the stop itself)."""
    return _clock(math.ceil((ts + STOP_MARGIN) / 60) * 60)


def reclaim_reason(policy, lender: str, team: str, demand: dict[str, int], devices: list[str], borrowed: dict[str, int]) -> str:
    """The borrower's warning: what the lender needs back, and that the borrower's team borrowed it.

    Only what is on loan is named: a server given GPUs 1 and 2 of which its team borrowed one
    reads "NLP Group needs back GPU 2 that your team Vision Lab borrowed" (the JupyterLab
    notice before it says the server stops). Quota is counted, not pinned to a device, so the
    borrowed ones are named as the last the server was given of that flavor (those that took
    its team above its nominal quota). On Kubernetes (no device ids: the node's) the count
    with the flavor: "1 L4 24GB GPU". ``borrowed``: GPUs per ``gpu/<flavor>`` key the team
    holds above its nominal quota, capped at the server's own. ``devices``: the server's, in
    its demand's order (``DeviceTable.allocate``). Short: JupyterLab's notice keeps 140
    characters with the deadline, about 70 for this.
    """
    gpu = {k: v for k, v in demand.items() if k.startswith("gpu/") and v > 0}
    lent = {k: min(borrowed.get(k, 0), v) for k, v in gpu.items() if borrowed.get(k, 0) > 0} or gpu
    if devices and len(devices) == sum(gpu.values()):
        named: list[str] = []
        start = 0
        for key, count in gpu.items():
            mine, start = devices[start : start + count], start + count
            named += mine[count - lent.get(key, 0) :]
        what = ("GPU " if len(named) == 1 else "GPUs ") + ", ".join(named)
    else:
        what = ", ".join(describe(k, n, policy) for k, n in lent.items())
    return f"{lender} needs back {what} that your team {team} borrowed"


class Reclaimer:
    def __init__(self, broker):
        self.broker = broker
        self.notices: dict[str, Notice] = {}
        self._stopping: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._pending = False
        self._wake: tuple[float, asyncio.TimerHandle] | None = None  # the next planning at a runtime's end
        self.hold = HoldDown()
        q = broker.queue
        q.on_queued.append(self._poke)
        q.on_release.append(self._released)
        q.on_cancel.append(self._cancelled)
        q.on_admit.append(self._poke)
        try:  # a safety net for what no queue event announces (requests back after a restart)
            asyncio.get_running_loop().call_later(SAFETY_PASS, self._safety)
        except RuntimeError:
            pass

    def _safety(self) -> None:
        self._poke()
        asyncio.get_running_loop().call_later(SAFETY_PASS, self._safety)

    @property
    def policy(self):
        return self.broker.store.current

    def _released(self, adm) -> None:
        self._stopping.discard(adm.key)
        if adm.key in self.notices:  # stopped by its user before the deadline
            self._withdraw(adm.key)
        self._lender_left(adm.key, adm.user)
        self._poke()

    def _cancelled(self, ticket) -> None:
        self._lender_left(ticket.key, ticket.user)
        self._poke()

    def _lender_left(self, key: str, user: str) -> None:
        """A request left: if borrowers were reclaimed for it within the notice, hold its lender down."""
        until = self.hold.withdrawn(key, time.time())
        if until is None:
            return
        log.warning(
            "Reclaim: %s withdrew %s, for which borrowed GPUs were reclaimed; nothing more is reclaimed for %s before %s",
            user,
            key,
            user,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until)),
        )
        try:  # re-plan when it ends (the safety pass would, up to 15 s later)
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(max(0.0, until - time.time()) + 0.05, self._poke)

    def _poke(self, *_args) -> None:
        if self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no hub loop (unit tests, CLI): nothing to carry out
        self._pending = True
        loop.call_soon(self._run)

    def _run(self) -> None:
        self._pending = False
        try:
            self.evaluate()
        except Exception:  # noqa: BLE001 - reclaim must never break admission
            log.exception("reclaim pass failed")

    # -- one pass ---------------------------------------------------------------------------
    def evaluate(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        policy = self.policy
        queue = self.broker.queue
        usage = queue.usage()
        board = self._board()
        if not self.notices and not queue.notes and not board.reclaims and not self._anyone_borrows(policy, usage):
            return  # nothing is on loan: O(teams), the common case in a storm
        holders, leaving = [], []
        for a in queue.holdings():
            if a.key in self._stopping:
                leaving.append(a)  # already on its way back: plan as if released, pick no one else for it
            else:
                holders.append(Holder(a.key, a.team, a.demand, a.priority, a.since, a.key.startswith(JOB_PREFIX)))
        if leaving:
            usage = {t: dict(u) for t, u in usage.items()}
            for a in leaving:
                add_usage(usage, a.team, dict(a.demand), -1)
        # Only requests that fit their team's nominal quota now can reclaim (memo per team and
        # shape: a storm has thousands of waiting requests of a few shapes).
        memo: dict[tuple, bool] = {}

        def lender(t: Ticket) -> bool:
            shape = (t.team, tuple(sorted(t.demand.items())))
            if shape not in memo:
                team = policy.team_or_none(t.team)
                memo[shape] = team is not None and within_nominal(policy, usage, team, t.demand)
            return memo[shape]

        waiting = sorted((t for t in queue.waiting if not t.restored and lender(t)), key=Ticket.sort_key)
        requests = [Request(t.key, t.team, t.demand, t.user) for t in waiting]
        held = self.hold.held(now)
        keys = {k for t in waiting for k in t.demand if k.startswith("gpu/")}
        table = self.broker.devices  # None on Kubernetes: Kueue counts quota, nodes place pods
        free = {k: len(table.free_devices(k[4:])) for k in keys} if table is not None else None
        if free is not None:
            for a in leaving:
                for k in free:
                    free[k] += a.demand.get(k, 0)
        fs = policy.fair
        min_runtime = fs.min_runtime if fs is not None else 0.0
        p = plan(
            policy,
            usage,
            holders,
            requests,
            free,
            under_notice=set(self.notices),
            held_down=held,
            now=now,
            min_runtime=min_runtime,
        )
        if p.protected:
            self._wake_at(min(p.protected.values()))
        for t in waiting:
            if p.covered.get(t.key):  # borrowers are reclaimed for it: counts for the hold-down
                lender_team = policy.team_or_none(t.team)
                notice = policy.reclaim_rules(lender_team).notice if lender_team else 0.0
                self.hold.reclaimed(t.key, t.user, now, notice or 0.0)
        for key, (team, for_key) in p.reclaim.items():
            if key.startswith(JOB_PREFIX):
                self._preempt_job(key, team, for_key)
            elif key not in self.notices:
                self._warn(key, team, now)
        for key in [k for k in self.notices if k not in p.reclaim]:
            self._withdraw(key)
        for key in [k for k in board.reclaims if k not in p.reclaim and k not in self._stopping]:
            board.clear_reclaim(key)  # a notice from before a restart that is no longer needed
        # What each waiting request of a lender now waits for.
        notes: dict[str, str] = {}
        for t in waiting:
            team = policy.team(t.team)
            mine = [self.notices[k] for k in p.covered.get(t.key, []) if k in self.notices]
            if mine:
                by = max(n.deadline for n in mine)
                what = ", ".join(describe(k, v, policy) for k, v in t.demand.items() if k.startswith("gpu/"))
                notes[t.key] = (
                    f"needs {what}: {team.label}'s GPU is on loan to another team; it is being "
                    f"reclaimed and will be yours by {_by(by)} at the latest"
                )
            elif t.key in p.protected:
                what = ", ".join(describe(k, v, policy) for k, v in t.demand.items() if k.startswith("gpu/"))
                notes[t.key] = (
                    f"needs {what}: {team.label}'s GPU is on loan to another team, whose server started less than "
                    f"{format_duration(min_runtime)} ago (fair share's minimum runtime); it can be reclaimed from "
                    f"{_clock_s(p.protected[t.key])}"
                )
            elif t.key in p.held:
                what = ", ".join(describe(k, v, policy) for k, v in t.demand.items() if k.startswith("gpu/"))
                notes[t.key] = (
                    f"needs {what}: {team.label}'s GPU is on loan to another team, and a request of "
                    f"yours that had it taken back was withdrawn, so nothing is taken back for you "
                    f"before {_clock_s(held[t.user])}; it waits until then or until a GPU is free"
                )
        changed = set()
        for k in set(queue.notes) | set(notes):
            if queue.notes.get(k) != notes.get(k) and queue.ticket(k) is not None:
                changed.add(queue.ticket(k).team)
        queue.notes = notes
        if changed:
            queue.refresh(changed)

    def _wake_at(self, when: float) -> None:
        """Plan again when a borrower's minimum runtime ends (the safety pass would, later)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._wake is not None and self._wake[0] <= when:
            if not self._wake[1].cancelled() and self._wake[0] > time.time():
                return
        handle = loop.call_later(max(0.0, when - time.time()) + 0.05, self._poke)
        self._wake = (when, handle)

    @staticmethod
    def _anyone_borrows(policy, usage) -> bool:
        for team_name, keys in usage.items():
            team = policy.team_or_none(team_name)
            if team is None or not team.cohort:
                continue
            if any(borrowing(policy, usage, team_name, k) > 0 for k in keys if k.startswith("gpu/")):
                return True
        return False

    # -- jobs: at once -----------------------------------------------------------------------
    def _preempt_job(self, key: str, for_team: str, for_key: str) -> None:
        label = self._label(for_team)
        message = f"preempted: its GPUs were borrowed from {label}'s quota, and {label} needs them back"
        if self.broker.preempt_job(key, message, for_key):
            self._stopping.add(key)
            log.warning("Reclaim: preempting job %s at once for %s (it re-queues)", key, for_team)
        else:  # admitted, still launching: look again in a moment
            asyncio.get_running_loop().call_later(1.0, self._poke)

    # -- servers: with notice ------------------------------------------------------------------
    def _label(self, team: str) -> str:
        t = self.policy.team_or_none(team)
        return t.label if t else team

    def _warn(self, key: str, for_team: str, now: float) -> None:
        policy = self.policy
        adm = self.broker.queue.admitted.get(key)
        if adm is None:
            return
        lender = policy.team_or_none(for_team)
        notice = policy.reclaim_rules(lender).notice if lender else 0.0
        used = {t: dict(u) for t, u in self.broker.queue.usage().items()}
        for a in self.broker.queue.holdings():
            if a.key in self._stopping:  # already on its way back: no longer borrowed
                add_usage(used, a.team, dict(a.demand), -1)
        borrowed = {
            k: min(v, borrowing(policy, used, adm.team, k)) for k, v in adm.demand.items() if k.startswith("gpu/") and v > 0
        }
        # (Why this server: the home page says it; JupyterLab's toast has room for this only.)
        reason = reclaim_reason(policy, self._label(for_team), self._label(adm.team), adm.demand, adm.devices, borrowed)
        warned_at, deadline = now, now + (notice or 0.0)
        before = self._board().reclaims.get(key)
        if before and before.get("for_team") == for_team and before.get("since") == adm.since:
            # Given before a hub restart: the same deadline, not a fresh notice.
            warned_at, deadline = before["warned_at"], before["deadline"]
        n = Notice(key, adm.team, for_team, warned_at, deadline, reason, list(adm.devices), adm.since)
        self.notices[key] = n
        self._board_set(n)
        log.warning(
            "Reclaim: warning %s (team %s, devices %s): %s needs it back; stops at %s (notice %s)",
            key,
            adm.team,
            adm.devices,
            for_team,
            time.strftime("%H:%M:%S", time.localtime(n.deadline)),
            format_duration(notice or 0),
        )
        self._arm(n)

    def _arm(self, n: Notice) -> None:
        loop = asyncio.get_running_loop()
        old = self._timers.pop(n.key, None)
        if old is not None:
            old.cancel()
        self._timers[n.key] = loop.call_later(max(0.0, n.deadline - time.time()), self._due, n.key)

    def _withdraw(self, key: str) -> None:
        n = self.notices.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._board_clear(key)
        if n is not None:
            log.info("Reclaim: warning for %s withdrawn (%s no longer needs it)", key, n.for_team)

    def _due(self, key: str) -> None:
        self._timers.pop(key, None)
        self._run()  # the need may have gone meanwhile
        n = self.notices.get(key)
        if n is None or n.deadline > time.time() + 0.5:
            return
        self.notices.pop(key, None)
        self._stopping.add(key)
        asyncio.ensure_future(self._stop_server(n))

    async def _stop_server(self, n: Notice) -> None:
        name, _, server = n.key.partition("/")
        log.warning("Reclaim: stopping %s after its notice: %s", n.key, n.reason)
        stopped = False
        try:
            from jupyterhub.app import JupyterHub

            app = JupyterHub.instance()
            user = app.users[name]
            spawner = user.spawners[server]
            if spawner.pending:  # still starting (or already stopping): look again shortly
                self.notices[n.key] = n
                self._timers[n.key] = asyncio.get_running_loop().call_later(2.0, self._due, n.key)
                return
            usage.note_end(n.key, "reclaimed", by="gpuhub-reclaim")
            usage.audit("reclaimed", key=n.key, user=name, team=n.team, for_team=n.for_team, devices=n.devices)
            spawner.stop_reason = (
                f"Your server was stopped at {_clock(time.time())}: {n.reason}. Your files are kept; "
                "start it again when GPUs are free (within your own team's quota it cannot be taken back)."
            )
            self._board_done(n)
            spawner._stop_pending = True
            try:
                await app.proxy.delete_user(user, server)
                await user.stop(server)
            finally:
                spawner._stop_pending = False
            stopped = True
            log.info("Reclaim: %s stopped; its GPUs %s went back to %s", n.key, n.devices, n.for_team)
        except Exception:  # noqa: BLE001
            log.exception("Reclaim: could not stop %s", n.key)
        finally:
            # Stopped but its release not seen yet (on Kubernetes the ledger reads Kueue's
            # Workload a moment later): it stays on its way back until ``_released``, or
            # the next pass would warn it a second time.
            if not (stopped and n.key in self.broker.queue.admitted):
                self._stopping.discard(n.key)
            self._poke()

    # -- where users see it (the culling board) ---------------------------------------------
    def _board(self):
        return CullBoard.instance(config=self.broker.config)

    def _board_set(self, n: Notice) -> None:
        board = self._board()
        if board is not None:
            board.set_reclaim(
                n.key,
                {
                    "deadline": n.deadline,
                    "reason": n.reason,
                    "warned_at": n.warned_at,
                    "devices": n.devices,
                    "team": n.team,
                    "needed_by": self._label(n.for_team),
                    "for_team": n.for_team,
                    "since": n.since,
                },
            )

    def _board_clear(self, key: str) -> None:
        board = self._board()
        if board is not None:
            board.clear_reclaim(key)

    def _board_done(self, n: Notice) -> None:
        board = self._board()
        if board is not None:
            board.reclaimed(n.key, n.reason, n.warned_at)
