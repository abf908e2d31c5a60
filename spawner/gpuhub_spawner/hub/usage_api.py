"""Usage history, audit trail and server actions: hub API and pages.

- ``/hub/gpuhub/usage`` (page, SVG charts), ``/hub/api/gpuhub/usage`` (JSON),
  ``/hub/gpuhub/usage.csv`` (CSV, cookie or token): what a reader sees follows
  ``hub.roles.View`` — all (viewers, admins), their teams' members (leads), their own
  allocations and their teams' totals (researchers).
- ``/hub/gpuhub/audit`` and ``/hub/api/gpuhub/audit``: the audit trail (``custom:gpuhub:audit``).
- ``POST /hub/api/gpuhub/servers/<user>[/<server>]/stop``: an admin stops any server or
  withdraws a waiting request; a team lead stops a member of their team's *idle*
  server. Both are audited with who acted on whose server.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timezone
from typing import TYPE_CHECKING, Any

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from jupyterhub.utils import url_path_join
from tornado import web
from traitlets import Float
from traitlets.config import SingletonConfigurable

from ..culling.board import CullBoard
from ..policy.quantities import format_duration, parse_duration
from ..policy.scopes import AUDIT, allowed
from ..usage import charts
from ..usage.history import describe_ends, iso, summarize, to_csv, when
from ..usage.recorder import UsageRecorder, note_end
from .context import app_of
from .roles import View, view_for

if TYPE_CHECKING:
    from traitlets.config import Config

MAX_SINCE = 366 * 86400


class LeadActions(SingletonConfigurable):
    idle_after = Float(
        900.0,
        help="""A team lead may stop a member's server once it has had no activity and no busy GPU
        reading for this many seconds (or while a cull warning is pending).""",
    ).tag(config=True)


class _Base:
    if TYPE_CHECKING:
        # What jupyterhub's BaseHandler (a tornado RequestHandler) gives the handlers this mixin goes before.
        config: Config
        current_user: Any  # jupyterhub.user.User, or the service (untyped)

        def get_argument(self, name: str, default: str, strip: bool = True) -> str: ...  # the overload used here

    @property
    def broker(self):
        return app_of(self).admission_view(self.config)

    @property
    def recorder(self) -> UsageRecorder:
        rec = UsageRecorder.instance(config=self.config)
        if rec.broker is None:
            rec.attach(self.broker)
        return rec

    def usage_view(self) -> View:
        view = view_for(self, self.broker.policy)
        if view is None:
            raise web.HTTPError(403, "This needs the scope custom:gpuhub:usage.")
        return view

    def window(self) -> tuple[float, float]:
        raw = self.get_argument("since", "7d")
        try:
            seconds = parse_duration(raw)
        except (ValueError, TypeError):
            raise web.HTTPError(400, f"since={raw!r} is not a duration (e.g. 7d, 24h, 90m)") from None
        if not 0 < seconds <= MAX_SINCE:
            raise web.HTTPError(400, "since must be between 1s and 366d")
        now = time.time()
        return now - seconds, now

    def report(self, view: View) -> dict:
        since, now = self.window()
        by = self.get_argument("by", "team")
        period = self.get_argument("period", "day")
        if by not in ("team", "user") or period not in ("day", "week"):
            raise web.HTTPError(400, "by must be team or user; period day or week")
        history = self.recorder.history
        every = history.rows(since)
        rows = [r for r in every if view.sees_rows_of(r.team, r.user)]
        if by == "team":
            # Team totals: a researcher sees their teams' sums without anyone's details.
            basis = [r for r in every if view.sees_totals_of(r.team) or view.sees_rows_of(r.team, r.user)]
        else:
            basis = rows
        summary = summarize(basis, since, now, by=by, period=period)
        policy = self.broker.policy
        visible_teams = {t.name for t in policy.teams if view.sees_totals_of(t.name)}
        queue = [(at, team, n) for at, team, n in history.queue_series(since) if team in visible_teams]
        from .pages import fair_share_figures  # team figures: what the status page shows everyone

        fair = fair_share_figures(policy, getattr(self.broker, "queue", None))
        if fair is not None:
            fair["teams"] = [f for f in fair["teams"] if f["name"] in visible_teams]
        return {
            "fair_share": fair,
            "view": view.role,
            "user": view.user,
            "since": since,
            "until": now,
            "summary": summary,
            "rows": [r.as_dict(now) for r in rows],
            "queue": [{"at": at, "team": team, "waiting": n} for at, team, n in queue],
            "quota": {t.name: {f: q.nominal for f, q in t.quota.gpus.items()} for t in policy.teams if t.name in visible_teams},
            "labels": {t.name: t.label for t in policy.teams},
        }


class UsageAPIHandler(_Base, APIHandler):
    @web.authenticated
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.report(self.usage_view())))


class UsageCSVHandler(_Base, BaseHandler):
    """The CSV for a browser (cookie); ``UsageCSVAPIHandler`` serves the same to tokens."""

    @web.authenticated
    def get(self):
        view = self.usage_view()
        since, now = self.window()
        rows = [r for r in self.recorder.history.rows(since) if view.sees_rows_of(r.team, r.user)]
        self.set_header("Content-Type", "text/csv; charset=utf-8")
        stamp = time.strftime("%Y%m%d", time.gmtime(now))
        self.set_header("Content-Disposition", f'attachment; filename="gpuhub-usage-{stamp}.csv"')
        self.write(to_csv(rows, now))


class UsageCSVAPIHandler(UsageCSVHandler, APIHandler):
    pass


def _allocation_series(rows: list[dict], since: float, now: float) -> dict[str, list[tuple[float, float]]]:
    """GPUs held per team over time (a step function from allocation starts and ends)."""
    events: dict[str, list[tuple[float, int]]] = {}
    for r in rows:
        if not r["gpus"]:
            continue
        events.setdefault(r["team"], []).append((max(r["start"], since), r["gpus"]))
        if r["end"] is not None:
            events[r["team"]].append((r["end"], -r["gpus"]))
    out = {}
    for team, evs in events.items():
        level = 0
        pts: list[tuple[float, float]] = []  # the chart's (time, GPUs held)
        for t, d in sorted(evs):
            level += d
            pts.append((t, level))
        out[team] = pts
    return out


class UsagePageHandler(_Base, BaseHandler):
    @web.authenticated
    async def get(self):
        view = self.usage_view()
        rep = self.report(view)
        since, now = rep["since"], rep["until"]
        # Allocation per team against quota needs every visible team's allocations.
        team_rows = [
            r.as_dict(now)
            for r in self.recorder.history.rows(since)
            if view.sees_totals_of(r.team) or view.sees_rows_of(r.team, r.user)
        ]
        labels = rep["labels"]
        alloc = {labels.get(t, t): pts for t, pts in _allocation_series(team_rows, since, now).items()}
        quota = {labels.get(t, t): float(sum(q.values())) for t, q in rep["quota"].items()}
        queue: dict[str, list[tuple[float, float]]] = {}
        for e in rep["queue"]:
            queue.setdefault(labels.get(e["team"], e["team"]), []).append((e["at"], e["waiting"]))
        totals = rep["summary"]["totals"]
        bars = {
            labels.get(n, n): {
                "gpu_hours": v["gpu_hours"],
                "busy_gpu_hours": v["busy_gpu_hours"],
                "idle_gpu_hours": v["idle_gpu_hours"],
            }
            for n, v in totals.items()
        }
        svgs = {
            "fair": self._fair_chart(view, since, now, labels),
            "allocation": charts.step_chart(
                "gpuhub-chart-allocation", "GPUs allocated per team (dashed: nominal quota)", alloc, since, now, "GPUs", quota
            ),
            "queue": charts.step_chart("gpuhub-chart-queue", "Requests waiting per team", queue, since, now, "waiting"),
            "idle": charts.bar_chart(
                "gpuhub-chart-idle",
                "GPU-hours: allocated, busy and idle",
                bars,
                [("gpu_hours", "allocated"), ("busy_gpu_hours", "busy"), ("idle_gpu_hours", "idle")],
                "GPU-hours",
            ),
        }
        by_user = (
            summarize([r for r in self.recorder.history.rows(since) if view.sees_rows_of(r.team, r.user)], since, now, by="user")
            if view.role != "user" or rep["rows"]
            else None
        )
        html = await self.render_template(
            "gpuhub_usage.html",
            rep=rep,
            svgs=svgs,
            by_user=by_user,
            view=view,
            when=when,
            describe_ends=describe_ends,
            since_arg=self.get_argument("since", "7d"),
            csv_url=url_path_join(self.hub.base_url, "gpuhub/usage.csv") + f"?since={self.get_argument('since', '7d')}",
        )
        self.finish(html)

    def _fair_chart(self, view, since: float, now: float, labels: dict) -> str:
        """Fair share (docs/fair-share.md): each visible team's recent use against its share over
        the window, 48 points, from the usage history (with the half-lives before the window)."""
        from ..admission.fairshare import SEED_HALF_LIVES, use_per_share

        policy = self.broker.policy
        if policy.fair is None:
            return ""
        rows = self.recorder.history.rows(since - SEED_HALF_LIVES * policy.fair.half_life)
        teams = {t.name for t in policy.teams if view.sees_totals_of(t.name)}
        times = [since + (now - since) * i / 47 for i in range(48)]
        series = {labels.get(n, n): pts for n, pts in use_per_share(policy, rows, times, teams).items()}
        title = (
            f"Fair share: recent GPU use ÷ share (1 = exactly its share; use halves every "
            f"{format_duration(policy.fair.half_life)})"
        )
        return charts.step_chart("gpuhub-chart-fair", title, series, since, now, "use ÷ share")


class AuditAPIHandler(APIHandler):
    @web.authenticated
    def get(self):
        if not allowed(self, AUDIT):
            raise web.HTTPError(403, f"This needs the scope {AUDIT}.")
        rec = UsageRecorder.instance(config=self.config)
        try:
            since = float(self.get_argument("since", "0"))
            limit = min(int(self.get_argument("limit", "1000")), 10000)
        except ValueError:
            raise web.HTTPError(400, "since is a Unix time, limit a number") from None
        entries = rec.audit.entries(
            since=since, event=self.get_argument("event", None) or None, user=self.get_argument("user", None) or None, limit=limit
        )
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"entries": entries}))


class AuditPageHandler(BaseHandler):
    @web.authenticated
    async def get(self):
        if not allowed(self, AUDIT):
            raise web.HTTPError(403, f"This needs the scope {AUDIT}.")
        rec = UsageRecorder.instance(config=self.config)
        entries = rec.audit.entries(
            event=self.get_argument("event", None) or None, user=self.get_argument("user", None) or None, limit=500
        )
        shown = [
            {
                "at": iso(e["at"]),
                "event": e["event"],
                "detail": {k: v for k, v in e.items() if k not in ("seq", "at", "event", "diff")},
                "diff": e.get("diff"),
            }
            for e in reversed(entries)
        ]
        self.finish(await self.render_template("gpuhub_audit.html", entries=shown))


class ServerStopHandler(_Base, APIHandler):
    """An admin stops any server or request; a team lead a team member's idle server."""

    async def post(self, owner: str, server: str = ""):
        actor = self.current_user
        if actor is None:
            raise web.HTTPError(403)
        user = self.find_user(owner)
        if user is None or server not in user.spawners and server not in user.orm_spawners:
            raise web.HTTPError(404, "No such server.")
        key = f"{owner}/{server}"
        spawner = user.spawners[server]
        queue = self.broker.queue
        held = queue.admitted.get(key)
        waiting = queue.ticket(key)
        team = held.team if held else (waiting.team if waiting else None)
        # JupyterHub's own permission to stop this server (admins, gpuhub-admin): any server.
        as_admin = self.has_scope(f"servers!server={owner}/{server}") and owner != getattr(actor, "name", None)
        how = None
        if as_admin:
            how = "admin"
        else:
            view = self.usage_view()
            if team is None or team not in view.lead_teams:
                raise web.HTTPError(403, "You may stop only your own team's servers, as its lead.")
            if held is None:
                raise web.HTTPError(409, "Only the owner or an admin may withdraw a waiting request.")
            idle, why = self._idle(key, spawner)
            if not idle:
                raise web.HTTPError(409, f"{owner}'s server is not idle ({why}); a lead may stop only idle servers.")
            how = "lead"
        if not (spawner.active or waiting or held):
            raise web.HTTPError(409, "That server is not running or waiting.")
        name = getattr(actor, "name", "?")
        self.recorder.audit.record(
            "acted_on_server",
            by=name,
            role=how,
            target_user=owner,
            key=key,
            team=team,
            action="withdraw" if waiting and not held else "stop",
        )
        note_end(key, "stopped", by=name)
        if spawner.pending == "spawn" and spawner._spawn_future:
            # Cancel the spawn and wait for it to have ended (JupyterHub's own API sleeps a
            # second here and hopes); then stop whatever part of it had started.
            future = spawner._spawn_future
            future.cancel()
            await asyncio.wait({future}, timeout=30)
            await self.stop_single_user(user, server)
        elif spawner.pending:
            raise web.HTTPError(409, f"The server is {spawner.pending}; try again in a moment.")
        elif spawner.ready or held:
            await self.stop_single_user(user, server)
        self.set_status(202)
        self.write(json.dumps({"stopping": key, "by": name, "as": how, "message": f"Stopping {key} (as {how})."}))

    def _idle(self, key: str, spawner) -> tuple[bool, str]:
        rec = CullBoard.instance().records.get(key) if CullBoard.initialized() else None
        if rec is not None and rec.state.deadline:
            return True, "a cull warning is pending"
        now = time.time()
        limit = LeadActions.instance(config=self.config).idle_after
        last = spawner.orm_spawner.last_activity if spawner.orm_spawner else None
        last_t = 0.0
        if last is not None:  # JupyterHub stores naive UTC
            last_t = (last if last.tzinfo else last.replace(tzinfo=timezone.utc)).timestamp()
        busy = rec.gpu_last_busy if rec and rec.gpu_last_busy else 0.0
        recent = max(last_t, busy)
        if now - recent >= limit:
            return True, "idle"
        return False, f"active {int(now - recent)}s ago, idle counts from {int(limit)}s"


handlers = [
    (r"/gpuhub/usage/?", UsagePageHandler),
    (r"/gpuhub/usage\.csv", UsageCSVHandler),
    (r"/api/gpuhub/usage", UsageAPIHandler),
    (r"/api/gpuhub/usage\.csv", UsageCSVAPIHandler),
    (r"/gpuhub/audit/?", AuditPageHandler),
    (r"/api/gpuhub/audit", AuditAPIHandler),
    (r"/api/gpuhub/servers/([^/]+)/stop", ServerStopHandler),
    (r"/api/gpuhub/servers/([^/]+)/([^/]+)/stop", ServerStopHandler),
]
