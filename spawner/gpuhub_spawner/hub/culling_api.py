"""Hub API for culling: the culler service's decisions, users' warnings and snoozes.

- ``POST /hub/api/gpuhub/cull-decision`` — the culler service only.
- ``GET  /hub/api/gpuhub/culling/{user}`` — the user (any of their tokens, including
  their server's), admins, the culler service: the user's warned servers.
- ``POST /hub/api/gpuhub/culling/{user}/snooze`` ``{"server": name}`` — the user.
"""

from __future__ import annotations

import json

from jupyterhub.apihandlers import APIHandler
from tornado import web

from ..culling.board import CullBoard
from ..policy.access import active_profiles

CULLER_SERVICE = "gpuhub-culler"


def _is_service(who, name: str) -> bool:
    return getattr(who, "kind", None) == "service" and getattr(who, "name", None) == name


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
        if not (_is_service(who, CULLER_SERVICE) or getattr(who, "name", None) == name or getattr(who, "admin", False)):
            raise web.HTTPError(404)  # as the hub does: no hint that another user exists
        user = self.find_user(name)
        if user is None:
            raise web.HTTPError(404)
        return user


class CullDecisionHandler(_Base):
    async def post(self):
        if not _is_service(self.current_user, CULLER_SERVICE):
            raise web.HTTPError(403, "only the culler service asks for cull decisions")
        body = json.loads(self.request.body or b"{}")
        user = self.find_user(body.get("user", ""))
        spawner = user.spawners.get(body.get("server", "")) if user else None
        if spawner is None or not spawner.active:
            raise web.HTTPError(404, "no such running server")
        profile = self.profiles_of(user)[spawner.name]
        started = spawner.orm_spawner.started.isoformat() if spawner.orm_spawner.started else None
        decision = self.board.decide(
            f"{user.name}/{spawner.name}",
            profile,
            started=started,
            inactive=body.get("inactive"),
            kernels_idle=body.get("kernels_idle"),
            age=body.get("age"),
            devices=list(getattr(spawner, "devices", []) or []),
            reported_gpus=body.get("gpus"),
        )
        self.write(
            json.dumps(
                {"action": decision.action, "reason": decision.reason, "deadline": decision.deadline, "remaining": decision.remaining}
            )
        )


class CullWarningsHandler(_Base):
    def get(self, name):
        user = self.target_user(name)
        self.write(json.dumps({"servers": self.board.warnings_for(user.name, self.profiles_of(user))}))


class SnoozeHandler(_Base):
    def post(self, name):
        user = self.target_user(name)
        if _is_service(self.current_user, CULLER_SERVICE):
            raise web.HTTPError(403, "only the user (or an admin) snoozes")
        body = json.loads(self.request.body or b"{}")
        server = body.get("server", "")
        profiles = self.profiles_of(user)
        if server not in profiles:
            raise web.HTTPError(404, f"no running server {server!r}")
        ok, message, deadline = self.board.snooze(f"{user.name}/{server}", profiles[server])
        self.set_status(200 if ok else 409)
        self.write(json.dumps({"message": message, "deadline": deadline}))


def cull_warnings(user) -> list[dict]:
    """Template variable for the home page: this user's warned servers."""
    if user is None or not hasattr(user, "spawners") or not CullBoard.initialized():
        return []  # no decision made yet, so no warning stands
    board = CullBoard.instance()
    profiles = active_profiles(board.policy, user)
    return [dict(server=name, **w) for name, w in board.warnings_for(user.name, profiles).items()]


handlers = [
    (r"/api/gpuhub/cull-decision", CullDecisionHandler),
    (r"/api/gpuhub/culling/([^/]+)", CullWarningsHandler),
    (r"/api/gpuhub/culling/([^/]+)/snooze", SnoozeHandler),
]
