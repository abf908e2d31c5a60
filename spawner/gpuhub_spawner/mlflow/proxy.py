"""The authenticating reverse proxy in front of MLflow.

Every request must carry a hub identity: a browser's hub OAuth cookie (single
sign-on: the hub login is the MLflow login) or a hub API token in the
``Authorization`` header (what notebooks send, see ``gpuhub_notebook``). The proxy
maps that identity to the MLflow account of the same name, replaces whatever
credentials came in with that account's basic auth, and forwards. MLflow's own
permission model then decides; the proxy only adds what MLflow cannot know:

* run ownership: ``runs/create`` gets ``user_id`` and the ``mlflow.user`` tag set
  to the hub user (clients send the Unix user, often ``jovyan``), and later edits
  of ``mlflow.user`` are forced back to the hub user;
* personal experiment names: ``users/<name>`` may only be created or renamed to by
  ``<name>`` (so nobody can squat another user's default experiment);
* team read access: an experiment created through the proxy is readable by the
  creator's teams;
* account administration (creating users, passwords, admin flags, roles) is not
  reachable through the proxy at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthenticated
from tornado import httputil, web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

log = logging.getLogger("JupyterHub.gpuhub.mlflow")

API = r"(?:ajax-)?api/[23]\.0/mlflow/"
BLOCKED = re.compile(
    r"^(?:signup|" + API + r"users/(?:create|create-ui|update-password|update-admin|delete)"
    r"|" + API + r"roles/(?:create|update|delete|assign|unassign|permissions/(?:add|remove|update)))/?$"
)
RUNS_CREATE = re.compile(r"^" + API + r"runs/create/?$")
RUNS_SET_TAG = re.compile(r"^" + API + r"runs/set-tag/?$")
RUNS_LOG_BATCH = re.compile(r"^" + API + r"runs/log-batch/?$")
EXPERIMENTS_CREATE = re.compile(r"^" + API + r"experiments/create/?$")
EXPERIMENTS_UPDATE = re.compile(r"^" + API + r"experiments/update/?$")
STREAMED = re.compile(r"(?:^|/)(?:mlflow-artifacts/|get-artifact|model-versions/get-artifact|get-trace-artifact)")
API_PATH = re.compile(r"^(?:ajax-)?api/|^graphql|^gateway/|^v1/")

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "content-length", "host", "authorization", "cookie",
    "origin", "referer", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
}
RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "www-authenticate", "server", "date"}
USER_TAG = "mlflow.user"
PERSONAL_PREFIX = "users/"


class Refused(Exception):
    def __init__(self, status: int, message: str, error_code: str = "PERMISSION_DENIED"):
        self.status = status
        self.message = message
        self.error_code = error_code


def personal_experiment(username: str) -> str:
    return f"{PERSONAL_PREFIX}{username}"


def check_experiment_name(name: object, username: str) -> None:
    if isinstance(name, str) and name.startswith(PERSONAL_PREFIX):
        owner = name[len(PERSONAL_PREFIX):].split("/", 1)[0]
        if owner != username:
            raise Refused(403, f"Experiment names under '{PERSONAL_PREFIX}{owner}' are reserved for hub user {owner}.")


def _force_user_tags(tags: object, username: str) -> list:
    tags = [t for t in (tags or []) if isinstance(t, dict) and t.get("key") != USER_TAG]
    tags.append({"key": USER_TAG, "value": username})
    return tags


def rewrite_request(rel_path: str, method: str, body: bytes, username: str) -> bytes:
    """Apply the ownership rules to a request body; raise Refused to refuse it."""
    if method not in ("POST", "PATCH", "PUT"):
        return body
    matchers = (RUNS_CREATE, RUNS_SET_TAG, RUNS_LOG_BATCH, EXPERIMENTS_CREATE, EXPERIMENTS_UPDATE)
    if not any(m.match(rel_path) for m in matchers):
        return body
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        raise Refused(400, "Request body is not valid JSON.", "INVALID_PARAMETER_VALUE") from None
    if not isinstance(data, dict):
        raise Refused(400, "Request body must be a JSON object.", "INVALID_PARAMETER_VALUE")
    if RUNS_CREATE.match(rel_path):
        data["user_id"] = username
        data["tags"] = _force_user_tags(data.get("tags"), username)
    elif RUNS_SET_TAG.match(rel_path):
        if data.get("key") == USER_TAG:
            data["value"] = username
    elif RUNS_LOG_BATCH.match(rel_path):
        if any(isinstance(t, dict) and t.get("key") == USER_TAG for t in data.get("tags") or []):
            data["tags"] = _force_user_tags(data.get("tags"), username)
    elif EXPERIMENTS_CREATE.match(rel_path):
        check_experiment_name(data.get("name"), username)
    elif EXPERIMENTS_UPDATE.match(rel_path):
        check_experiment_name(data.get("new_name"), username)
    return json.dumps(data).encode()


class MlflowProxyHandler(HubOAuthenticated, web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

    def initialize(self, state):
        self.state = state

    # Cookie-authenticated writes are checked by origin below instead of tornado's
    # _xsrf token, which the MLflow UI does not know about.
    def check_xsrf_cookie(self):
        return

    def set_default_headers(self):
        self.clear_header("Server")

    @property
    def rel_path(self) -> str:
        return self.request.path[len(self.state.prefix):] if self.request.path.startswith(self.state.prefix) else ""

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "log_message", None) or getattr(exc, "message", None) or self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error_code": getattr(exc, "error_code", "PERMISSION_DENIED" if status_code in (401, 403) else "INTERNAL_ERROR"),
                                "message": message}))

    async def prepare(self):
        model = await self.hub_auth.get_user(self, sync=False)
        user = None
        if model and model.get("kind", "user") == "user" and self.hub_auth.check_scopes(self.hub_auth.access_scopes, model):
            user = model
        elif model:
            log.warning("Refusing %s %s: no access to the MLflow service", model.get("kind"), model.get("name"))
        if user is None:
            token_given = bool(self.request.headers.get("Authorization"))
            if token_given or API_PATH.match(self.rel_path) or self.request.method not in ("GET", "HEAD"):
                raise web.HTTPError(401 if not model else 403,
                                    "Log in to the hub (browser) or send a hub API token (Authorization: Bearer ...).")
            self.redirect(self.get_login_url())
            return
        if not getattr(self, "_token_authenticated", False) and self.request.method not in ("GET", "HEAD", "OPTIONS"):
            self._check_same_origin()
        self.current_user = user

    def _check_same_origin(self):
        site = self.request.headers.get("Sec-Fetch-Site")
        if site and site not in ("same-origin", "none"):
            raise web.HTTPError(403, "Cross-site request refused.")
        origin = self.request.headers.get("Origin")
        if origin and origin != "null":
            host = self.request.headers.get("X-Forwarded-Host") or self.request.host
            if urlparse(origin).netloc != host:
                raise web.HTTPError(403, "Cross-origin request refused.")

    async def get(self):
        await self.forward()

    head = post = put = patch = delete = options = get

    async def forward(self):
        state = self.state
        user = self.current_user
        username = user["name"]
        rel = self.rel_path
        if BLOCKED.match(rel):
            raise web.HTTPError(403, "Account administration is managed by the hub, not through MLflow.")
        try:
            body = rewrite_request(rel, self.request.method, self.request.body, username)
        except Refused as e:
            self.set_status(e.status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error_code": e.error_code, "message": e.message}))
            return
        await state.ready()
        teams = state.teams_for(user)
        await state.ensure_account(username, teams)

        for attempt in (1, 2):
            if STREAMED.search(rel):
                await self._stream(rel, body, username)
                return
            response = await self._fetch(rel, body, username)
            if response.code == 401 and attempt == 1:
                # The account changed behind our back (deleted, password reset): redo it once.
                state.accounts.forget(username)
                await state.ensure_account(username, teams)
                continue
            break
        if response.code == 200 and EXPERIMENTS_CREATE.match(rel) and teams:
            try:
                experiment_id = json.loads(response.body)["experiment_id"]
                await state.accounts.share_experiment_with_teams(experiment_id, teams)
            except Exception:
                log.exception("Could not share new experiment of %s with teams %s", username, teams)
        self._relay_head(response.code, response.reason, response.headers)
        if response.body:
            self.write(response.body)
        self.finish()

    def _upstream_request(self, rel: str, body: bytes, username: str, **kwargs) -> HTTPRequest:
        headers = httputil.HTTPHeaders()
        for name, value in self.request.headers.get_all():
            lname = name.lower()
            if lname in HOP_BY_HOP or lname.startswith("sec-fetch-"):
                continue
            headers.add(name, value)
        headers["Host"] = self.state.upstream_hostport
        headers["Authorization"] = self.state.accounts.user_auth(username)
        headers["X-Forwarded-User"] = username
        url = self.state.upstream_root + rel
        if self.request.query:
            url += "?" + self.request.query
        method = self.request.method
        send_body = body if (body or method in ("POST", "PUT", "PATCH")) else None
        return HTTPRequest(
            url, method=method, headers=headers, body=send_body, allow_nonstandard_methods=True,
            follow_redirects=False, decompress_response=False, request_timeout=self.state.request_timeout,
            connect_timeout=20, **kwargs,
        )

    async def _fetch(self, rel: str, body: bytes, username: str):
        return await self.state.http.fetch(self._upstream_request(rel, body, username), raise_error=False)

    def _relay_head(self, code: int, reason: str | None, headers: httputil.HTTPHeaders):
        if code == 599:
            raise web.HTTPError(502, "The MLflow tracking server did not answer.")
        self.set_status(code, reason or httputil.responses.get(code, "Unknown"))
        for name, value in headers.get_all():
            if name.lower() in RESPONSE_DROP:
                continue
            if name.lower() == "location":
                value = self._rewrite_location(value)
            self.add_header(name, value)

    def _rewrite_location(self, value: str) -> str:
        root = self.state.upstream_root
        return self.state.prefix + value[len(root):] if value.startswith(root) else value

    async def _stream(self, rel: str, body: bytes, username: str):
        """Artifacts can be large: relay the response as it arrives."""
        head = {"done": False, "start": None, "headers": httputil.HTTPHeaders()}

        def on_header(line: str):
            if head["start"] is None:
                head["start"] = httputil.parse_response_start_line(line.strip())
                return
            if line.strip():
                head["headers"].parse_line(line)
            else:
                start = head["start"]
                if start.code == 100:
                    head["start"] = None
                    head["headers"] = httputil.HTTPHeaders()
                    return
                self._relay_head(start.code, start.reason, head["headers"])
                head["done"] = True

        def on_chunk(chunk: bytes):
            self.write(chunk)
            asyncio.ensure_future(self.flush())

        req = self._upstream_request(rel, body, username, header_callback=on_header, streaming_callback=on_chunk)
        response = await self.state.http.fetch(req, raise_error=False)
        if not head["done"]:
            self._relay_head(response.code if response.code != 200 else 502, response.reason, response.headers)
        self.finish()


class RootRedirect(web.RequestHandler):
    def initialize(self, target: str):
        self.target = target

    def get(self):
        self.redirect(self.target)


def make_http_client() -> AsyncHTTPClient:
    return AsyncHTTPClient(force_instance=True, max_clients=64, max_body_size=8 * 2**30, max_buffer_size=512 * 2**20)
