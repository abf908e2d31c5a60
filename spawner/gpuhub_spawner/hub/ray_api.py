"""Hub API for Ray clusters (docs/ray.md); the backend through the hub's application object (``app_of(self).ray``).

- ``POST /hub/api/gpuhub/ray`` ``{"gpus": 2, "workers": 0, "profile": null, "team": null, "name": null}``:
  start one. 403/409/400 with the reason when the policy refuses it (nothing queues); 201
  with the cluster (``status`` starts with the state word: ``queued: position 1 of 1 ...``).
- ``GET /hub/api/gpuhub/ray``: the caller's clusters (``?all=1``: everyone's, admins).
- ``GET /hub/api/gpuhub/ray/<name or id>``, ``DELETE`` (or ``POST .../stop``): read, stop.
- ``/hub/gpuhub/ray/<name>/dashboard/...``: a redirect, for the cluster's owner only, to the
  dashboard on the owner's origin: ``<owner's server URL>gpuhub/ray/<name>/dashboard/...``
  (``http://alice.<domain>/user/alice/...``), which the owner's server serves behind its own hub
  login and forwards with the owner's Ray token (``gpuhub_notebook.ray_dashboard``). The view's
  ``dashboard`` is that URL. The hub itself never serves what the dashboard sends: it comes
  from the owner's processes, and on the hub's origin it would run with the hub's cookie.

Access uses the jobs scopes (a cluster is a job: ``custom:gpuhub:jobs`` for one's own, with
any of one's tokens and one's servers' tokens, so ``gpuhub ray`` works in a notebook
terminal; ``custom:gpuhub:jobs:all`` or ``admin:servers`` to read and stop everyone's).
Someone else's cluster answers 404; so does the dashboard's redirect to anyone but the owner
(admins included), and on the owner's origin the server refuses whoever may not use it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING
from urllib.parse import quote

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from tornado import web

from ..policy.access import ChoiceError
from ..policy.bounded import InputRefused, loads_json
from ..rayclusters import BY_USER, FINAL, RayRequest
from .context import app_of
from .jobs_api import _JobsMixin

CLUSTER = r"([a-z0-9][-a-z0-9]{0,40})"


class _RayMixin(_JobsMixin):
    if TYPE_CHECKING:
        # What jupyterhub's BaseHandler (a tornado RequestHandler) gives the handlers this mixin goes before.
        base_url: str

    @property
    def ray(self):
        return app_of(self).ray(self.config)

    def cluster_for_request(self, cluster: str):
        me = getattr(self.current_user, "name", None)
        view = self.ray.status(cluster, me) if me and self.can_see(me) else None
        if view is None and self.see_all():
            view = self.ray.status(cluster, None)
        if view is None or not self.can_see(view.user):
            raise web.HTTPError(404, "No such Ray cluster.")
        return view

    def dashboard_url(self, owner: str, relative: str) -> str:
        """``relative`` (a view's ``dashboard``) under the owner's default server: its full URL,
        on the owner's origin when the hub has per-user origins."""
        user = self.find_user(owner)
        base = user.url if user is not None else f"{self.base_url}user/{quote(owner, safe='')}/"
        return base + relative

    def out(self, view) -> dict:
        d = view.to_dict()
        if d.get("dashboard"):
            d["dashboard"] = self.dashboard_url(view.user, d["dashboard"])
        return d


class RayClustersHandler(_RayMixin, APIHandler):
    @web.authenticated
    def get(self):
        if self.get_argument("all", "") in ("1", "true"):
            views = [self.out(v) for v in self.ray.list(None) if self.can_see(v.user)]
        else:
            me = getattr(self.current_user, "name", None)
            views = [self.out(v) for v in self.ray.list(me)] if self.can_see(me) else []
        self.write(json.dumps({"clusters": views}))

    @web.authenticated
    async def post(self):
        user = self.requester()
        try:
            body = loads_json(
                self.request.body, what="A Ray cluster request", max_bytes=4096, max_depth=2, max_nodes=32, empty={}
            )
        except InputRefused as e:
            raise web.HTTPError(e.status, e.message) from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, 'Send a JSON object: {"gpus": N, "workers": K}.')

        def opt(key, kind):
            value = body.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise web.HTTPError(400, f"{key!r} must be {'a whole number' if kind is int else 'text'}")
            return value

        request = RayRequest(
            user=user.name,
            gpus=opt("gpus", int),
            workers=opt("workers", int) or 0,
            profile=opt("profile", str),
            team=opt("team", str),
            name=opt("name", str),
        )
        try:
            view = await self.ray.start(user, [g.name for g in user.groups], request)
        except ChoiceError as e:
            self.log.warning("Refusing %s's Ray cluster: %s", user.name, e.message)
            raise web.HTTPError(e.status, e.message) from None
        self.set_status(201)
        self.write(json.dumps(self.out(view)))


class RayClusterHandler(_RayMixin, APIHandler):
    @web.authenticated
    def get(self, cluster):
        self.write(json.dumps(self.out(self.cluster_for_request(cluster))))

    @web.authenticated
    async def delete(self, cluster):
        await self._stop(cluster)

    async def _stop(self, cluster):
        view = self.cluster_for_request(cluster)
        if view.state in FINAL:
            self.set_status(409)
            self.write(json.dumps({"status": 409, "message": f"{view.name} already ended ({view.state})", **self.out(view)}))
            return
        view = await self.ray.stop(view.id, BY_USER, view.user)
        self.write(json.dumps(self.out(view)))


class RayClusterStopHandler(RayClusterHandler):
    @web.authenticated
    async def post(self, cluster):
        await self._stop(cluster)


class RayDashboardHandler(_RayMixin, BaseHandler):
    """The owner's old dashboard address on the hub: a redirect to it on the owner's origin."""

    @web.authenticated
    def get(self, cluster, path):
        me = getattr(self.current_user, "name", None)
        view = self.ray.status(cluster, me) if me else None
        if view is None or not view.dashboard:
            raise web.HTTPError(404, "No running Ray cluster of yours by that name.")
        if not re.fullmatch(r"[A-Za-z0-9._~/%+-]*", path or "") or ".." in path:
            raise web.HTTPError(400, "Bad path.")
        query = ("?" + self.request.query) if self.request.query else ""
        self.redirect(self.dashboard_url(view.user, view.dashboard) + path + query)


handlers = [
    (r"/api/gpuhub/ray/?", RayClustersHandler),
    (rf"/api/gpuhub/ray/{CLUSTER}", RayClusterHandler),
    (rf"/api/gpuhub/ray/{CLUSTER}/stop", RayClusterStopHandler),
    (rf"/gpuhub/ray/{CLUSTER}/dashboard/(.*)", RayDashboardHandler),
]
