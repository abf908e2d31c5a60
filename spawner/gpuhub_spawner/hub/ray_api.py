"""Hub API for Ray clusters (docs/ray.md); the backend through ``rayclusters.current_manager``.

- ``POST /hub/api/gpuhub/ray`` ``{"gpus": 2, "workers": 0, "profile": null, "team": null, "name": null}``:
  start one. 403/409/400 with the reason when the policy refuses it (nothing queues); 201
  with the cluster (``status`` starts with the state word: ``queued: position 1 of 1 ...``).
- ``GET /hub/api/gpuhub/ray``: the caller's clusters (``?all=1``: everyone's, admins).
- ``GET /hub/api/gpuhub/ray/<name or id>``, ``DELETE`` (or ``POST .../stop``): read, stop.
- ``/hub/gpuhub/ray/<name>/dashboard/...``: the cluster's Ray dashboard, for its owner only,
  with the owner's hub login; the hub adds the owner's Ray token to what it forwards.

Access uses the jobs scopes (a cluster is a job: ``custom:gpuhub:jobs`` for one's own, with
any of one's tokens and one's servers' tokens, so ``gpuhub ray`` works in a notebook
terminal; ``custom:gpuhub:jobs:all`` or ``admin:servers`` to read and stop everyone's).
Someone else's cluster answers 404. The dashboard is the owner's alone (admins too get 404):
what it serves comes from processes running as the user.
"""

from __future__ import annotations

import json
import re

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from ..policy.access import ChoiceError
from ..policy.bounded import InputRefused, loads_json
from ..rayclusters import BY_USER, FINAL, RayRequest, current_manager
from .jobs_api import _JobsMixin

CLUSTER = r"([a-z0-9][-a-z0-9]{0,40})"
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "set-cookie", "server"}


class _RayMixin(_JobsMixin):
    @property
    def ray(self):
        return current_manager(self.config)

    def cluster_for_request(self, cluster: str):
        me = getattr(self.current_user, "name", None)
        view = self.ray.status(cluster, me) if me and self.can_see(me) else None
        if view is None and self.see_all():
            view = self.ray.status(cluster, None)
        if view is None or not self.can_see(view.user):
            raise web.HTTPError(404, "No such Ray cluster.")
        return view


class RayClustersHandler(_RayMixin, APIHandler):
    @web.authenticated
    def get(self):
        if self.get_argument("all", "") in ("1", "true"):
            views = [v.to_dict() for v in self.ray.list(None) if self.can_see(v.user)]
        else:
            me = getattr(self.current_user, "name", None)
            views = [v.to_dict() for v in self.ray.list(me)] if self.can_see(me) else []
        self.write(json.dumps({"clusters": views}))

    @web.authenticated
    async def post(self):
        user = self.requester()
        try:
            body = loads_json(self.request.body, what="A Ray cluster request", max_bytes=4096, max_depth=2,
                              max_nodes=32, empty={})
        except InputRefused as e:
            raise web.HTTPError(e.status, e.message) from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "Send a JSON object: {\"gpus\": N, \"workers\": K}.")
        def opt(key, kind):
            value = body.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise web.HTTPError(400, f"{key!r} must be {'a whole number' if kind is int else 'text'}")
            return value
        request = RayRequest(user=user.name, gpus=opt("gpus", int), workers=opt("workers", int) or 0,
                             profile=opt("profile", str), team=opt("team", str), name=opt("name", str))
        try:
            view = await self.ray.start(user, [g.name for g in user.groups], request)
        except ChoiceError as e:
            self.log.warning("Refusing %s's Ray cluster: %s", user.name, e.message)
            raise web.HTTPError(e.status, e.message) from None
        self.set_status(201)
        self.write(json.dumps(view.to_dict()))


class RayClusterHandler(_RayMixin, APIHandler):
    @web.authenticated
    def get(self, cluster):
        self.write(json.dumps(self.cluster_for_request(cluster).to_dict()))

    @web.authenticated
    async def delete(self, cluster):
        await self._stop(cluster)

    async def _stop(self, cluster):
        view = self.cluster_for_request(cluster)
        if view.state in FINAL:
            self.set_status(409)
            self.write(json.dumps({"status": 409, "message": f"{view.name} already ended ({view.state})", **view.to_dict()}))
            return
        view = await self.ray.stop(view.id, BY_USER, view.user)
        self.write(json.dumps(view.to_dict()))


class RayClusterStopHandler(RayClusterHandler):
    @web.authenticated
    async def post(self, cluster):
        await self._stop(cluster)


class RayDashboardHandler(_RayMixin, BaseHandler):
    """The owner's dashboard, forwarded with the owner's Ray token (GET and POST)."""

    @web.authenticated
    async def get(self, cluster, path):
        await self._forward(cluster, path)

    @web.authenticated
    async def post(self, cluster, path):
        await self._forward(cluster, path)

    async def _forward(self, cluster, path):
        me = getattr(self.current_user, "name", None)
        target = self.ray.dashboard_target(cluster, me) if me else None
        if target is None:
            raise web.HTTPError(404, "No running Ray cluster of yours by that name.")
        host, port, extra = target
        if not re.fullmatch(r"[A-Za-z0-9._~/%+-]*", path or "") or ".." in path:
            raise web.HTTPError(400, "Bad path.")
        query = ("?" + self.request.query) if self.request.query else ""
        headers = {k: v for k, v in self.request.headers.items()
                   if k.lower() in ("accept", "content-type", "accept-language")}
        headers.update(extra)
        req = HTTPRequest(f"http://{host}:{port}/{path}{query}", method=self.request.method, headers=headers,
                          body=self.request.body if self.request.method == "POST" else None,
                          follow_redirects=False, request_timeout=60)
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code == 599:
            raise web.HTTPError(502, "The Ray dashboard did not answer.")
        self.set_status(resp.code)
        for k, v in resp.headers.get_all():
            if k.lower() not in _HOP:
                self.set_header(k, v)
        self.finish(resp.body or b"")


handlers = [
    (r"/api/gpuhub/ray/?", RayClustersHandler),
    (rf"/api/gpuhub/ray/{CLUSTER}", RayClusterHandler),
    (rf"/api/gpuhub/ray/{CLUSTER}/stop", RayClusterStopHandler),
    (rf"/gpuhub/ray/{CLUSTER}/dashboard/(.*)", RayDashboardHandler),
]
