"""Hub API for culling: one decision request per culler pass, users' warnings and snoozes.

- ``POST /hub/api/gpuhub/cull-decisions`` — the culler service only. Decides every ready
  server in-process from the hub's own records and answers the ones to warn or stop, each
  with the ``started`` it was decided for (the service stops a server only if it is still
  that one); ``{"servers": ["user/name", ...]}`` restricts it to those servers,
  ``{"actions": ["cull"]}`` leaves the warnings out of the answer (counted in ``warned``). Each
  server's view (profile, rules, devices) is kept between passes and rebuilt only when the
  server was restarted or the policy changed; see ``culling/board.py`` for the decision.
- ``GET  /hub/api/gpuhub/culling/{user}`` — the user (any of their tokens, including their
  server's), admins: pending stops (``servers``), recent culls (``culled``) and the user's
  servers whose GPU went bad (``gpu_failed``); ``?gpu_wait=S`` long-polls for the latter.
- ``POST /hub/api/gpuhub/culling/{user}/snooze`` ``{"server": name}`` — the user or an admin.
- ``POST /hub/api/gpuhub/culling/{user}/seen`` ``{"server": name}`` — the user (their server's
  relay): a person used that server's open JupyterLab. The hub stamps its own time (the body
  carries none); while a GPU-idle warning is pending it spends one snooze at the deadline,
  nothing the user's Snooze button could not do. ``{"recorded": bool}``.

Bodies are read with bounded work (``policy.bounded``): size first (413), then a JSON
decode whose depth and value count are capped (400).

Nothing here contacts a user's server: activity is what the hub recorded (proxy route
timestamps, the server's own activity reports) and GPU utilisation comes from NVML in the
hub or DCGM through Prometheus (``culling.gpu``).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any

from dateutil.parser import parse as parse_date
from jupyterhub import orm
from jupyterhub.apihandlers import APIHandler
from jupyterhub.proxy import ConfigurableHTTPProxy
from tornado import web

from ..culling.board import CullBoard, ServerView
from ..policy.access import active_profiles
from ..policy.bounded import MAX_SMALL_BODY_BYTES, InputRefused, loads_json
from ..policy.quantities import format_duration
from ..policy.scopes import CULLING, allowed
from .context import app_of

CULLER_SERVICE = "gpuhub-culler"
MAX_DECISIONS_BODY_BYTES = 256 * 1024  # {"servers": ["user/name", ...]}: ~10,000 servers


def _json_object(handler, *, max_bytes: int, max_nodes: int) -> dict:
    """The request's JSON object, bounded before and while it is decoded."""
    try:
        body = loads_json(
            handler.request.body, max_bytes=max_bytes, max_depth=3, max_nodes=max_nodes, max_containers=16, empty={}
        )
    except InputRefused as e:
        raise web.HTTPError(e.status, e.message) from None
    if not isinstance(body, dict):
        raise web.HTTPError(400, "body must be a JSON object")
    return body


def _is_service(who, name: str) -> bool:
    return getattr(who, "kind", None) == "service" and getattr(who, "name", None) == name


def _epoch(dt: datetime | None) -> float | None:
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)  # the hub stores naive UTC
    return dt.timestamp()


def _parse_time(text: str) -> float | None:
    """An ISO 8601 time (the proxy's) as epoch seconds; None if unreadable."""
    try:
        return _epoch(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except (TypeError, ValueError, OverflowError):
        try:
            return _epoch(parse_date(text))
        except (TypeError, ValueError, OverflowError):
            return None


def _team_of(spawner) -> str:
    team = getattr(getattr(spawner, "choice", None), "team", None)
    return getattr(team, "name", "") or ""


def view_of(spawner, profile) -> ServerView | None:
    orm_spawner = spawner.orm_spawner
    started = _epoch(orm_spawner.started)
    if not spawner.ready or started is None:
        return None  # waiting in the queue or starting: never culled
    pod = None
    if getattr(spawner, "pod_name", None):
        pod = (getattr(spawner, "namespace", "") or "", spawner.pod_name)
    return ServerView(
        user=spawner.user.name,
        server=spawner.name,
        profile=profile,
        started=started,
        last_activity=_epoch(orm_spawner.last_activity),
        team=_team_of(spawner),
        devices=[str(d) for d in (getattr(spawner, "devices", None) or [])],
        pod=pod,
    )


class _Base(APIHandler):
    @property
    def board(self) -> CullBoard:
        return CullBoard.instance(config=self.config)

    def profiles_of(self, user) -> dict:
        return active_profiles(self.board.policy, user)

    def target_user(self, name: str):
        who = self.current_user
        if who is None:
            raise web.HTTPError(403)
        # The request's scopes decide, not who owns the token: the user's own tokens and
        # their servers' carry custom:gpuhub:culling!user=<them>; admin:servers implies it.
        if not allowed(self, CULLING, user=name):
            raise web.HTTPError(404)  # as the hub does: no hint that another user exists
        user = self.find_user(name)
        if user is None:
            raise web.HTTPError(404)
        return user


class _Cached:
    """One ready server's view, valid while the same spawner runs the same start for the
    same user name under the same policy (all a view holds but its activity is fixed at
    spawn: profile, team, devices, pod)."""

    __slots__ = ("user", "spawner", "started", "policy", "view", "activity", "epoch")

    def __init__(self, user, spawner, started, policy, view):
        self.user, self.spawner, self.started, self.policy, self.view = user, spawner, started, policy, view
        self.activity = self.epoch = None  # the hub's last_activity (a datetime) and it in epoch seconds


class CullDecisionsHandler(_Base):
    _alive: set[str]  # every server the hub runs, ready or not (set by _views)

    def _all_views(self) -> list[ServerView]:
        """Every ready server's view: cached ones refreshed with the hub's latest activity.

        One query of two columns for the running servers (the database says what runs, as
        before), then dictionary look-ups; a view is built only for a server not seen
        ready before (or restarted, or after a policy change).
        """
        policy = self.board.policy
        cache: dict[tuple[int, str], _Cached] = self.settings.setdefault("gpuhub_cull_views", {})
        rows = self.db.query(orm.Spawner.user_id, orm.Spawner.name).filter(orm.Spawner.server_id.isnot(None)).all()
        views, alive, seen = [], set(), set()
        users = self.users
        for uid, name in rows:
            # the wrappers the hub holds (plain dict look-ups: UserDict's own would also
            # accept names and query the database; a user not loaded yet is loaded as before)
            user = dict.get(users, uid)
            if user is None:
                try:
                    user = users[uid]
                except KeyError:
                    continue
            ident = (uid, name)
            seen.add(ident)
            spawner = dict.get(user.spawners, name) or user.spawners[name]
            orm_spawner = spawner.orm_spawner
            c = cache.get(ident)
            if (
                c is None
                or c.spawner is not spawner
                or c.started != orm_spawner.started
                or c.policy is not policy
                or c.user != user.orm_user.name
            ):
                c = None
            alive.add(c.view.key if c is not None else f"{user.name}/{name}")
            if not spawner.ready:  # waiting in the queue, starting or stopping: never culled
                continue
            if c is None:
                view = view_of(spawner, active_profiles(policy, user).get(name))
                if view is None:
                    continue
                c = cache[ident] = _Cached(user.name, spawner, orm_spawner.started, policy, view)
            activity = orm_spawner.last_activity
            if activity is not c.activity:
                c.activity, c.epoch = activity, _epoch(activity)
            c.view.last_activity = c.epoch  # (reset: the last pass may have raised it from the proxy)
            views.append(c.view)
        for gone in [i for i in cache if i not in seen]:
            del cache[gone]
        self._alive = alive
        return views

    def _views(self, keys: list[str] | None) -> list[ServerView]:
        self._alive = set()
        if keys is None:
            return self._all_views()
        policy = self.board.policy
        views = []
        pairs = []
        for key in keys:
            name, _, server = str(key).partition("/")
            user = self.find_user(name)
            if user is not None and server in user.spawners:
                pairs.append((user, server))
        profiles_cache: dict[str, dict] = {}
        for user, server in pairs:
            spawner = user.spawners[server]
            if not spawner.active:
                continue
            profiles = profiles_cache.get(user.name)
            if profiles is None:
                profiles = profiles_cache[user.name] = active_profiles(policy, user)
            view = view_of(spawner, profiles.get(server))
            if view is not None:
                views.append(view)
        return views

    async def _fresh_activity(self, views: list[ServerView], now: float) -> None:
        """The proxy's latest per-route activity for servers about to be warned or stopped.

        The hub copies route timestamps into its database only every
        ``last_activity_interval``; a user who came back moments ago must not be culled
        for that lag. One request to the proxy's API, only when something is due.
        """
        board = self.board
        policy = board.policy
        due = {(v.user, v.server): v for v in views if board.wants_fresh_activity(v, now, policy)}
        if not due:
            return
        try:
            if isinstance(self.proxy, ConfigurableHTTPProxy):
                # CHP's table as it sends it: each route's data (user, server_name,
                # last_activity) without re-quoting 5,000 route specs on the loop
                routes = (await (await self.proxy.api_request("")).json()).values()
            else:
                routes = [r.get("data", {}) for r in (await self.proxy.get_all_routes()).values()]
        except Exception as e:
            self.log.warning("Cannot read the proxy's routes for fresh activity: %s", e)
            return
        for data in routes:
            v = due.get((data.get("user"), data.get("server_name")))
            if v is None or not data.get("last_activity"):
                continue
            seen = _parse_time(data["last_activity"])
            if seen is not None:
                v.last_activity = max(v.last_activity or 0.0, seen)

    async def post(self):
        if not _is_service(self.current_user, CULLER_SERVICE):
            raise web.HTTPError(403, "only the culler service asks for cull decisions")
        body = _json_object(self, max_bytes=MAX_DECISIONS_BODY_BYTES, max_nodes=20_000)
        keys = body.get("servers")
        if keys is not None and not isinstance(keys, list):
            raise web.HTTPError(400, "servers must be a list of 'user/name'")
        actions = body.get("actions", ["warn", "cull"])
        if not isinstance(actions, list) or not set(actions) <= {"warn", "cull"}:
            raise web.HTTPError(400, "actions must be a list of 'warn', 'cull'")
        now = time.time()
        views = self._views(keys)
        await self._fresh_activity(views, now)
        decisions = await self.board.decide_all(views, now=now, complete=keys is None, alive=self._alive)
        out, warned = {}, 0
        for v in views:
            d = decisions.get(v.key)
            if d is None or d.action == "keep":
                continue
            warned += d.action == "warn"
            if d.action in actions:
                out[v.key] = {
                    "action": d.action,
                    "reason": d.reason,
                    "rule": d.rule,
                    "deadline": d.deadline,
                    "started": v.started,
                }
        self.write(json.dumps({"now": now, "servers": len(views), "warned": warned, "decisions": out}))


MAX_GPU_WAIT = 25.0  # s: under the usual 60 s idle timeout of proxies in front of the hub
MAX_GPU_WAITERS = 2000  # long polls held at once, all users; past it, answered at once
MAX_GPU_WAITERS_PER_USER = 8  # a few open JupyterLab tabs; past it, answered at once


class CullWarningsHandler(_Base):
    """``servers`` (pending stops), ``culled`` (recent culls), ``gpu_failed`` (the user's
    servers whose GPU went bad: ``{server: {devices, since, reason, xid}}``) and ``stopped``
    (why each running server is being stopped, or the last run of a stopped one was:
    ``{server: {at, reason, rule}}``, rule ``stop`` for a stop from the hub).

    ``?gpu_wait=S`` (0 < S <= 25): a long poll for JupyterLab. The answer waits until any of
    this user's warnings, failed GPUs or stops differs from what it was when the request came,
    or S seconds; ``gpu_wait`` in the answer says how long it was allowed to wait (0: answered
    at once, too many waiting already: the caller polls at its normal pace). A stop waits for
    these answers to be written before the server goes (``CullBoard.stopping``).
    """

    def _gpu_failed(self, user) -> dict:
        from .gpus_api import gpu_failures_of

        return {f.pop("server"): f for f in gpu_failures_of(app_of(self), self.config, user.name)}

    def _snapshot(self, user) -> dict:
        profiles = self.profiles_of(user)
        started = {
            name: (_epoch(sp.orm_spawner.started) if sp.active else None)
            for name, sp in user.spawners.items()
            if name in profiles or sp.active
        }
        return {
            "servers": self.board.warnings_for(user.name, profiles),
            "culled": self.board.culled_for(user.name, set(profiles)),
            "gpu_failed": self._gpu_failed(user),
            "stopped": self.board.stopped_for(user.name, started),
        }

    async def _wait_change(self, user, wait: float, before: dict) -> dict:
        """What the user is told, once it differs from ``before`` or ``wait`` s have passed."""
        from .gpus_api import health_monitor

        board = self.board
        monitor = health_monitor(app_of(self), self.config)
        deadline = time.monotonic() + wait
        now = before
        while (left := deadline - time.monotonic()) > 0:
            waits = [asyncio.ensure_future(board.wait_change(left))]
            if monitor is not None:
                waits.append(asyncio.ensure_future(monitor.wait_change(left)))
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if not any(w.result() for w in done if not w.cancelled()):
                break  # timed out
            now = self._snapshot(user)
            if now != before:
                break
        return now

    async def get(self, name):
        user = self.target_user(name)
        wait = 0.0
        raw = self.get_query_argument("gpu_wait", "")
        if raw:
            try:
                wait = float(raw[:16])
            except ValueError:
                raise web.HTTPError(400, "gpu_wait must be a number of seconds") from None
            if not 0 <= wait <= MAX_GPU_WAIT:  # nan fails both
                raise web.HTTPError(400, f"gpu_wait must be between 0 and {MAX_GPU_WAIT:g} seconds")
        answer = self._snapshot(user)
        held = None
        if wait and any(answer["stopped"].get(name) for name, sp in user.spawners.items() if sp.active):
            wait = 0.0  # a running server is being stopped: say so at once (a stop may wait for it)
        if wait:
            waiters = app_of(self).gpu_waiters  # the hub's, not this module's: one per hub
            mine = waiters.get(user.name, 0)
            if mine >= MAX_GPU_WAITERS_PER_USER or sum(waiters.values()) >= MAX_GPU_WAITERS:
                wait = 0.0
            else:
                waiters[user.name] = mine + 1
                held = self.board.answering(user.name)
                self.log.debug("GPU-failure long poll of %s: held up to %gs", user.name, wait)
                try:
                    answer = await self._wait_change(user, wait, answer)
                finally:
                    self.log.debug("GPU-failure long poll of %s: let go", user.name)
                    n = waiters.get(user.name, 1) - 1
                    if n > 0:
                        waiters[user.name] = n
                    else:
                        waiters.pop(user.name, None)
        self.set_header("Cache-Control", "no-store")
        try:
            self.finish(json.dumps(dict(answer, gpu_wait=wait)))  # written to the socket now
        finally:
            if held is not None:
                self.board.answered(user.name, held)
            elif answer["stopped"]:
                self.board.answered(user.name, asyncio.get_running_loop().create_future())


class SnoozeHandler(_Base):
    def post(self, name):
        user = self.target_user(name)
        body = _json_object(self, max_bytes=MAX_SMALL_BODY_BYTES, max_nodes=16)
        server = body.get("server", "")
        if not isinstance(server, str):
            raise web.HTTPError(400, "server must be a server's name")
        profiles = self.profiles_of(user)
        if server not in profiles:
            raise web.HTTPError(404, f"no running server {server!r}")
        ok, message, deadline = self.board.snooze(f"{user.name}/{server}", profiles[server])
        self.set_status(200 if ok else 409)
        self.write(json.dumps({"message": message, "deadline": deadline}))


class SeenHandler(_Base):
    """A person on the open JupyterLab of one of the user's own servers (see the module)."""

    def post(self, name):
        user = self.target_user(name)  # 404 for anyone else's
        body = _json_object(self, max_bytes=MAX_SMALL_BODY_BYTES, max_nodes=16)
        server = body.get("server", "")
        if not isinstance(server, str) or set(body) - {"server"}:
            raise web.HTTPError(400, 'send {"server": "<a server\'s name>"} and nothing else (the hub records its own time)')
        if server not in self.profiles_of(user):  # the user's running servers
            raise web.HTTPError(404, f"no running server {server[:64]!r}")
        recorded = self.board.person_seen(f"{user.name}/{server}")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps({"recorded": recorded}))


def template_vars(config) -> dict:
    """Home-page variables: pending stops and recent culls of the logged-in user.

    Bound to the hub's config so that the state restored from ``CullBoard.state_file``
    shows right after a restart, before the culler's first pass.
    """

    def board_for(user):
        if user is None or not hasattr(user, "spawners"):
            return None
        return CullBoard.instance(config=config)

    def cull_warnings(user) -> list[dict]:
        board = board_for(user)
        if board is None:
            return []
        profiles = active_profiles(board.policy, user)
        return [dict(server=name, **w) for name, w in board.warnings_for(user.name, profiles).items()]

    def culled_notices(user) -> list[dict]:
        board = board_for(user)
        if board is None:
            return []
        active = {name for name, s in user.spawners.items() if s.active}
        return sorted(board.culled_for(user.name, active).values(), key=lambda e: -e["at"])

    def servers(user) -> list[dict]:
        """What each running server holds and when idleness stops it (the home page's table)."""
        board = board_for(user)
        if board is None:
            return []
        policy = board.policy
        out = []
        for name, profile in active_profiles(policy, user).items():
            spawner = user.spawners[name]
            entry: dict[str, Any] = {
                "server": name,
                "profile": profile.display_name if profile else "(no profile)",
                "team": (spawner.user_options or {}).get("team") or "",
                "gpus": [],
                "borrowed": False,
                "idle": "",
                "ready": bool(spawner.ready),
            }
            team = policy.team_or_none(entry["team"]) if entry["team"] else None
            entry["team"] = team.label if team else entry["team"]
            adm = getattr(spawner, "_admission", None)
            devices = list(getattr(adm, "devices", []) or [])
            if devices and profile is not None and profile.gpu is not None:
                # "1 × A100 (device 2)", not the bare device index ("GPUs 5" read as five GPUs).
                flavor = policy.flavor(profile.gpu.flavor)
                what = flavor.display_name or flavor.name
                unit = f" {flavor.mig.profile} slice" if flavor.mig else ""
                word = "device" if len(devices) == 1 else "devices"
                entry["gpus"] = [f"{len(devices)} × {what}{unit} ({word} {', '.join(map(str, devices))})"]
            else:
                entry["gpus"] = devices
            entry["borrowed"] = bool(getattr(adm, "borrowed", None))
            if profile is not None:
                rules = policy.idle_rules(profile)
                words = []
                if profile.gpu_count and rules.gpu_idle_timeout:
                    words.append(f"its GPUs idle for {format_duration(rules.gpu_idle_timeout)}")
                if rules.timeout:
                    words.append(f"no use for {format_duration(rules.timeout)}")
                if words:
                    entry["idle"] = (
                        "stopped after "
                        + " or ".join(words)
                        + (f", with {format_duration(rules.warning)} warning" if rules.warning else "")
                    )
                if rules.max_age:
                    entry["idle"] += ("; " if entry["idle"] else "") + f"at most {format_duration(rules.max_age)} old"
            out.append(entry)
        return out

    return {"gpuhub_cull_warnings": cull_warnings, "gpuhub_culled": culled_notices, "gpuhub_servers": servers}


handlers = [
    (r"/api/gpuhub/cull-decisions", CullDecisionsHandler),
    (r"/api/gpuhub/culling/([^/]+)", CullWarningsHandler),
    (r"/api/gpuhub/culling/([^/]+)/snooze", SnoozeHandler),
    (r"/api/gpuhub/culling/([^/]+)/seen", SeenHandler),
]
