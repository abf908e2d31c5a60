"""The authenticating reverse proxy in front of MLflow.

Every request must carry a hub identity: a browser's hub OAuth cookie (single
sign-on: the hub login is the MLflow login) or a hub API token in the
``Authorization`` header (what notebooks send, see ``gpuhub_notebook``). The proxy
maps that identity to the MLflow account of the same name, replaces whatever
credentials came in with that account's basic auth, and forwards. MLflow's own
permission model then decides; the proxy only adds what MLflow cannot know:

* one reading of the path: rules apply to the percent-decoded path, the same one
  MLflow routes on, and ambiguous paths are refused (``paths.py``);
* run ownership: ``runs/create`` gets ``user_id`` and the ``mlflow.user`` tag set
  to the hub user (clients send the Unix user, often ``jovyan``), and later edits
  of ``mlflow.user`` are forced back to the hub user;
* personal experiment names: ``users/<name>`` may only be created or renamed to by
  ``<name>`` (so nobody can squat another user's default experiment);
* team read access: an experiment created through the proxy is readable by the
  creator's teams;
* accounts: administration (creating users, passwords, admin flags, roles) is not
  reachable; ``users/list`` and ``roles/list`` answer with the caller's own entries
  only, so nobody enumerates other accounts or their grants;
* cookie-authenticated writes must prove they come from the service's own origin;
* no body on GET/HEAD/OPTIONS (MLflow reads a GET's JSON body when it has no query
  string, so a "read" could carry anything); viewers are judged on what a request
  does: no artifact route, no write, and GraphQL only for the root fields of the MLflow
  UI's read-only run and experiment queries (never ``mlflowListArtifacts``);
* bodies are streamed both ways (an upload never sits in memory), within
  ``max_upload_size``; only the small JSON bodies the rules rewrite are buffered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from urllib.parse import urlsplit

from jupyterhub.services.auth import HubOAuthenticated
from tornado import httputil, iostream, web
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from .paths import AmbiguousPath, decode_path, encode_path

log = logging.getLogger("JupyterHub.gpuhub.mlflow")

API = r"(?:ajax-)?api/\d+\.\d+/mlflow/"
# Everything about accounts and roles; only ALLOWED_ACCOUNT_ROUTES and the two
# filtered listings below get through, the rest is answered 403.
ACCOUNT_ROUTES = re.compile(r"^(?:signup|" + API + r"(?:users|roles)(?:/.*)?)$")
# Self-service routes: MLflow itself limits each to the caller's own account (or to
# resources the caller MANAGEs, for grant/revoke: sharing one's own experiments).
ALLOWED_ACCOUNT_ROUTES = re.compile(
    r"^" + API + r"users/(?:current|current/permissions|get|roles/list"
    r"|permissions/(?:grant|revoke|get|list))/?$"
)
USERS_LIST = re.compile(r"^" + API + r"users/list/?$")
ROLES_LIST = re.compile(r"^" + API + r"roles/list/?$")
# runs/create-promptlab-run (UI prompt lab) also takes a user_id of its own.
RUNS_CREATE = re.compile(r"^" + API + r"runs/create(?:-promptlab-run)?/?$")
RUNS_SET_TAG = re.compile(r"^" + API + r"runs/set-tag/?$")
RUNS_LOG_BATCH = re.compile(r"^" + API + r"runs/log-batch/?$")
EXPERIMENTS_CREATE = re.compile(r"^" + API + r"experiments/create/?$")
EXPERIMENTS_UPDATE = re.compile(r"^" + API + r"experiments/update/?$")
REWRITTEN = (RUNS_CREATE, RUNS_SET_TAG, RUNS_LOG_BATCH, EXPERIMENTS_CREATE, EXPERIMENTS_UPDATE)
API_PATH = re.compile(r"^(?:ajax-)?api/|^graphql|^gateway/|^v1/")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Viewers (policy roles.viewers, hub/roles.py) read runs and metrics only: no artifact
# route of any kind, and no write; MLflow's read-only searches are POSTs.
VIEWER_ARTIFACTS = re.compile(r"artifact", re.I)
# Also read-only as a POST: traces/metrics, the aggregates (trace counts, latency, tokens)
# the UI's run page and experiment overview ask for; MLflow answers it from the database
# after its own READ check on each experiment, and never with a trace's content.
VIEWER_READ_POSTS = re.compile(r"^" + API + r"(?:(?:[a-z-]+/)*search(?:-[a-z-]+)?|traces/metrics)/?$")
BODY_METHODS = ("POST", "PUT", "PATCH")
# Methods whose requests never carry a body here. MLflow's GET handlers read a JSON body
# when there is no query string (``_get_request_message``), and its /graphql reads the
# body whatever the method, so a GET with a body is not a read we could judge by its
# method. DELETE keeps its body: MLflow's registry deletes (registered-models/delete ...)
# take their arguments there, and a viewer makes no DELETE at all.
NO_BODY_METHODS = ("GET", "HEAD", "OPTIONS")
GRAPHQL = re.compile(r"^graphql(?:/|$)")
# The GraphQL root fields a viewer may ask for: those of the MLflow UI's own read-only
# queries (MLflow 3.17.2's bundle: GetRun, SearchRuns, GetMetricHistoryBulkInterval,
# MlflowGetExperimentQuery), so a viewer can open a run page. Not mlflowListArtifacts
# (artifacts), mlflowSearchModelVersions or mlflowSearchDatasets, no mutation, no
# introspection beyond __typename.
VIEWER_GRAPHQL_FIELDS = frozenset(
    {
        "mlflowGetRun",
        "mlflowSearchRuns",
        "mlflowGetExperiment",
        "mlflowGetMetricHistoryBulkInterval",
        "__typename",
    }
)
GRAPHQL_MAX_BODY = 2**20  # a viewer's GraphQL request (the UI's are about 3 KiB)
GRAPHQL_MAX_TOKENS = 10_000

# The MLflow UI's page (the empty path below the prefix) and the one file the proxy serves
# itself: the UI's defaults. MLflow 3.17's UI keeps its choices in the browser's
# localStorage only (no server setting): the workflow view ("mlflow.workflowType", GenAI
# unless chosen), UI telemetry ("mlflow.settings.telemetry.enabled", on unless turned off),
# the telemetry notice ("mlflow.telemetry.info.alert.dismissed") and the "Detect Issues"
# guidance, a modal pop-over ("mlflow.detectIssues.guidanceShown"). The page loads this
# same-origin script before MLflow's own (no inline script: a CSP of script-src 'self'
# allows it), which opens the UI in the model-training view unless the user chose
# another, and keeps telemetry off (the server drops UI telemetry anyway:
# MLFLOW_DISABLE_TELEMETRY, upstream.py) with nothing to announce.
UI_PAGE = ""
UI_DEFAULTS = "gpuhub/ui-defaults.js"
UI_DEFAULTS_TAG = b'<script src="gpuhub/ui-defaults.js"></script>'
UI_DEFAULTS_JS = b"""// gpuhub: defaults of the MLflow UI on this hub (see gpuhub_spawner/mlflow/proxy.py).
(function () {
  var unlessChosen = {"mlflow.workflowType_v1": "machine_learning"};
  var always = {
    "mlflow.settings.telemetry.enabled_v1": false,
    "mlflow.telemetry.info.alert.dismissed_v1": true,
    "mlflow.detectIssues.guidanceShown_v1": true
  };
  try {
    var s = window.localStorage, k;
    for (k in unlessChosen) { if (s.getItem(k) === null) { s.setItem(k, JSON.stringify(unlessChosen[k])); } }
    for (k in always) { s.setItem(k, JSON.stringify(always[k])); }
  } catch (e) { /* no storage (private mode): MLflow's own defaults apply */ }
  // A viewer's artifacts tab: MLflow titles the hub's refusal "Loading artifact failed", as if
  // something broke, above the explanation. That title (and only beside that explanation) is
  // replaced by what it is.
  var FAILED = "Loading artifact failed", WHY = "not available to viewers";
  function retitle(root) {
    if (!root || !document.createTreeWalker || (root.textContent || "").indexOf(FAILED) < 0) { return; }
    var walk = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, null), n, box, i;
    while ((n = walk.nextNode())) {
      if (n.nodeValue !== FAILED) { continue; }
      for (box = n.parentNode, i = 0; box && i < 6; box = box.parentNode, i++) {
        if ((box.textContent || "").indexOf(WHY) >= 0) { n.nodeValue = "Read-only for viewers"; break; }
      }
    }
  }
  if (window.MutationObserver) {
    new MutationObserver(function (records) {
      for (var r = 0; r < records.length; r++) {
        var t = records[r].target;
        retitle(t.nodeType === 1 ? t : t.parentNode);
      }
    }).observe(document.documentElement, {childList: true, subtree: true, characterData: true});
  }
})();
"""
# Not sent upstream for the UI's page, which the proxy rewrites: it needs the whole,
# uncompressed page, never a 304 or a range of the unrewritten one.
UI_PAGE_DROP = {"accept-encoding", "if-none-match", "if-modified-since", "if-range", "range"}

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
    "authorization",
    "cookie",
    "expect",
    "origin",
    "referer",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
}
RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "www-authenticate", "server", "date"}
USER_TAG = "mlflow.user"
PERSONAL_PREFIX = "users/"
DRAIN_LIMIT = 2**20  # refusals of bodies up to this size are answered after reading them
_END = object()
_ABORT = object()


class Refused(Exception):
    def __init__(self, status: int, message: str, error_code: str = "PERMISSION_DENIED"):
        self.status = status
        self.message = message
        self.error_code = error_code


def personal_experiment(username: str) -> str:
    return f"{PERSONAL_PREFIX}{username}"


def check_experiment_name(name: object, username: str) -> None:
    if isinstance(name, str) and name.startswith(PERSONAL_PREFIX):
        owner = name[len(PERSONAL_PREFIX) :].split("/", 1)[0]
        if owner != username:
            raise Refused(403, f"Experiment names under '{PERSONAL_PREFIX}{owner}' are reserved for hub user {owner}.")


def account_route(rel_path: str) -> str | None:
    """``None`` (not an account route), ``"allow"``, ``"users-list"``, ``"roles-list"`` or ``"block"``."""
    if not ACCOUNT_ROUTES.match(rel_path):
        return None
    if ALLOWED_ACCOUNT_ROUTES.match(rel_path):
        return "allow"
    if USERS_LIST.match(rel_path):
        return "users-list"
    if ROLES_LIST.match(rel_path):
        return "roles-list"
    return "block"


def viewer_refusal(rel_path: str, method: str, query: str = "") -> str | None:
    """Why a viewer may not make this request (``None``: they may), judged on what it does.

    GraphQL requests get ``None`` here when they are POSTs without a query string: what
    they ask for is in their body, judged by ``viewer_graphql_refusal``.
    """
    if VIEWER_ARTIFACTS.search(rel_path):
        return "artifacts are not available to viewers"
    if GRAPHQL.match(rel_path):
        if method != "POST" or query:
            return "viewers may send GraphQL only as a POST with a JSON body"
        return None
    if method in SAFE_METHODS or (method == "POST" and VIEWER_READ_POSTS.match(rel_path)):
        return None
    return "changes are not available to viewers"


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate keys")
    return dict(pairs)


def graphql_root_fields(selection_set, fragments: dict) -> list[str]:
    """The root fields an operation selects, through inline fragments and fragment spreads
    (by field name: an alias changes nothing). An unknown fragment counts as a field named
    ``...<name>`` (refused)."""
    from graphql.language import ast

    names: list[str] = []
    stack, seen = [selection_set], set()
    while stack:
        for sel in stack.pop().selections:
            if isinstance(sel, ast.FieldNode):
                names.append(sel.name.value)
            elif isinstance(sel, ast.InlineFragmentNode):
                stack.append(sel.selection_set)
            elif isinstance(sel, ast.FragmentSpreadNode):
                name = sel.name.value
                if name in seen:
                    continue
                seen.add(name)
                frag = fragments.get(name)
                if frag is None:
                    names.append(f"...{name}")
                else:
                    stack.append(frag.selection_set)
            else:
                names.append(type(sel).__name__)
    return names


def viewer_graphql_refusal(body: bytes) -> str | None:
    """Why a viewer's GraphQL request is refused (``None``: it asks only for allowed root fields).

    Every operation in the document is checked (not just ``operationName``'s); each must be
    a ``query`` whose root fields are all in ``VIEWER_GRAPHQL_FIELDS``. The body is read as
    MLflow reads it (one JSON object; duplicate keys are refused, so no two readers can
    pick different ``query`` values).
    """
    try:
        from graphql import GraphQLError, parse
        from graphql.language import ast
    except ImportError:  # fail closed: the check cannot be made
        return "GraphQL cannot be checked on this service (graphql-core is not installed)"
    try:
        data = json.loads(body or b"null", object_pairs_hook=_unique_keys)
    except ValueError:
        return "the GraphQL request is not one JSON object"
    if not isinstance(data, dict):
        return "the GraphQL request is not one JSON object"
    query = data.get("query")
    if not isinstance(query, str):
        return "the GraphQL request has no query"
    try:
        doc = parse(query, no_location=True, max_tokens=GRAPHQL_MAX_TOKENS)
    except GraphQLError as e:
        return f"the GraphQL query does not parse ({e.message})"
    fragments = {d.name.value: d for d in doc.definitions if isinstance(d, ast.FragmentDefinitionNode)}
    for d in doc.definitions:
        if isinstance(d, ast.FragmentDefinitionNode):
            continue
        if not isinstance(d, ast.OperationDefinitionNode):
            return "only GraphQL queries are available to viewers"
        if d.operation is not ast.OperationType.QUERY:
            return f"GraphQL {d.operation.value} operations are not available to viewers"
        names = graphql_root_fields(d.selection_set, fragments)
        if not names:  # only fragment cycles: invalid, and nothing to judge
            return "the GraphQL operation selects no field"
        for name in names:
            if name not in VIEWER_GRAPHQL_FIELDS:
                return f"the GraphQL field {name!r} is not available to viewers"
    return None


def is_rewritten(rel_path: str, method: str) -> bool:
    return method in BODY_METHODS and any(m.match(rel_path) for m in REWRITTEN)


def _force_user_tags(tags: object, username: str) -> list:
    """The tags, the owner's user tag set; anything not a list of tag objects holds no tag."""
    kept = [t for t in tags if isinstance(t, dict) and t.get("key") != USER_TAG] if isinstance(tags, list) else []
    kept.append({"key": USER_TAG, "value": username})
    return kept


def rewrite_request(rel_path: str, method: str, body: bytes, username: str) -> bytes:
    """Apply the ownership rules to a request body; raise Refused to refuse it.

    ``rel_path`` is the decoded path (``paths.decode_path``) below the service prefix.
    """
    if not is_rewritten(rel_path, method):
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
        tags = data.get("tags")
        if isinstance(tags, list) and any(isinstance(t, dict) and t.get("key") == USER_TAG for t in tags):
            data["tags"] = _force_user_tags(tags, username)
    elif EXPERIMENTS_CREATE.match(rel_path):
        check_experiment_name(data.get("name"), username)
    elif EXPERIMENTS_UPDATE.match(rel_path):
        check_experiment_name(data.get("new_name"), username)
    return json.dumps(data).encode()


def normalize_origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL, lower-cased, default ports dropped."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    if port is None or (scheme, port) in (("http", 80), ("https", 443)):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def same_origin_error(headers: httputil.HTTPHeaders, public_origins: frozenset[str], host: str) -> str | None:
    """Why a cookie-authenticated write is not proven same-origin, or None if it is.

    Browsers send ``Sec-Fetch-Site`` and/or ``Origin`` on every write; a cross-site
    page cannot forge either. So: each header that is present must say "same
    origin" (``Origin`` one of ``public_origins``, or, when none is configured, the
    request's own ``Host``), and at least one must be present. ``Origin: null``
    (sandboxed frames, data: URLs, some redirects) never matches.
    """
    site = headers.get("Sec-Fetch-Site")
    origin = headers.get("Origin")
    if site is None and origin is None:
        return "a cookie-authenticated write must carry Origin or Sec-Fetch-Site"
    if site is not None and site.strip().lower() != "same-origin":
        return f"Sec-Fetch-Site {site!r}"
    if origin is not None:
        if origin.strip().lower() == "null":
            return "Origin null"
        try:
            normalized = normalize_origin(origin)
        except ValueError:
            return f"Origin {origin!r}"
        if public_origins:
            if normalized not in public_origins:
                return f"Origin {origin!r} is not one of the configured public origins"
        elif urlsplit(normalized).netloc != host.lower():
            return f"Origin {origin!r} does not match Host {host!r}"
    return None


@web.stream_request_body
class MlflowProxyHandler(HubOAuthenticated, web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

    def initialize(self, state):
        self.state = state
        self.rel = ""
        self.username = None
        self.teams: tuple[str, ...] = ()
        self.viewer = False
        self._route = None
        self._buffered = False
        self._graphql_viewer = False
        self._local: str | None = None
        self._ui_page = False
        self._has_body = False
        self._limit = 0
        self._received = 0
        self._chunks: list[bytes] = []
        self._queue: asyncio.Queue | None = None
        self._upstream: asyncio.Future | None = None
        self._refusal: web.HTTPError | None = None

    # Cookie-authenticated writes are checked by origin below instead of tornado's
    # _xsrf token, which the MLflow UI does not know about.
    def check_xsrf_cookie(self):
        return

    def set_default_headers(self):
        self.clear_header("Server")

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "log_message", None) or getattr(exc, "message", None) or self._reason
        default_code = {
            400: "INVALID_PARAMETER_VALUE",
            401: "PERMISSION_DENIED",
            403: "PERMISSION_DENIED",
            413: "REQUEST_LIMIT_EXCEEDED",
        }.get(status_code, "INTERNAL_ERROR")
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error_code": getattr(exc, "error_code", default_code), "message": message}))

    # -- before the body -----------------------------------------------------------
    async def prepare(self):
        try:
            await self._admit()
        except web.HTTPError as e:
            headers = self.request.headers
            length = headers.get("Content-Length", "0" if "chunked" not in headers.get("Transfer-Encoding", "").lower() else "")
            if e.status_code != 413 and length.isdigit() and int(length) <= DRAIN_LIMIT:
                # Answer after reading the (small or empty) body. Answered before, tornado
                # closes the connection (it cannot know the body is read) without saying so:
                # a kept-alive client's next request is reset, and with unread bytes the
                # kernel resets this one, which the hub's proxy turns into a 503.
                self._refusal = e
                self._buffered, self._limit = False, DRAIN_LIMIT
                return
            raise

    async def _admit(self):
        state = self.state
        method = self.request.method
        try:
            path = decode_path(self.request.path)
        except AmbiguousPath as e:
            log.warning("Refusing %s %r: %s", method, self.request.path[:200], e)
            raise web.HTTPError(400, f"Ambiguous request path refused: {e}.") from None
        if not path.startswith(state.prefix):
            raise web.HTTPError(404)
        self.rel = path[len(state.prefix) :]

        model = await self.hub_auth.get_user(self, sync=False)
        user = None
        if model and model.get("kind", "user") == "user" and self.hub_auth.check_scopes(self.hub_auth.access_scopes, model):
            user = model
        elif model:
            log.warning("Refusing %s %s: no access to the MLflow service", model.get("kind"), model.get("name"))
        if user is None:
            token_given = bool(self.request.headers.get("Authorization"))
            if token_given or API_PATH.match(self.rel) or method not in ("GET", "HEAD"):
                raise web.HTTPError(
                    401 if not model else 403, "Log in to the hub (browser) or send a hub API token (Authorization: Bearer ...)."
                )
            self.redirect(self.get_login_url())
            return
        if not getattr(self, "_token_authenticated", False) and method not in SAFE_METHODS:
            error = same_origin_error(self.request.headers, state.public_origins, self.request.host)
            if error:
                log.warning("Refusing cookie-authenticated %s %s of %s: %s", method, self.rel, user["name"], error)
                raise web.HTTPError(403, f"Cross-origin request refused ({error}).")
        self.current_user = user
        self.username = user["name"]

        self._route = account_route(self.rel)
        if self._route == "block":
            raise web.HTTPError(403, "Account administration is managed by the hub, not through MLflow.")
        self._ui_page = self.rel == UI_PAGE and method == "GET"
        self._buffered = is_rewritten(self.rel, method) or self._route in ("users-list", "roles-list") or self._ui_page
        self._limit = state.max_json_body_size if self._buffered else state.max_upload_size
        headers = self.request.headers
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        length = headers.get("Content-Length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise web.HTTPError(400, "Invalid Content-Length.") from None
            if declared > self._limit:
                raise web.HTTPError(413, self._too_large())
        self._has_body = chunked or bool(length and int(length) > 0)
        if self._has_body and method in NO_BODY_METHODS:
            log.warning("Refusing %s %s of %s with a body", method, self.rel, self.username)
            raise web.HTTPError(400, f"A {method} request must not carry a body.")
        # Our own limit answers 413 first; tornado's (a bare 400) is only a backstop.
        self.request.connection.set_max_body_size(self._limit + 2**24)
        if self.rel == UI_DEFAULTS and method in ("GET", "HEAD"):
            self._local = UI_DEFAULTS  # answered in _respond; nothing goes upstream
            return

        await state.ready()
        self.teams = state.teams_for(user)
        self.viewer = state.viewer_only(user, self.teams)
        # Before anything is forwarded: MLflow's roles follow the user's standing now (the
        # viewers' read-everything role is taken away as soon as they are not viewer-only).
        await state.ensure_account(self.username, self.teams, self.viewer)
        if self.viewer:
            why = viewer_refusal(self.rel, method, self.request.query)
            if why:
                log.warning("Refusing %s %s of viewer %s: %s", method, self.rel, self.username, why)
                raise web.HTTPError(403, f"Viewers see runs and metrics read-only; {why}.")
            if GRAPHQL.match(self.rel):
                # What a GraphQL request does is in its body: hold it (small) and judge it.
                self._graphql_viewer = self._buffered = True
                self._limit = min(state.max_json_body_size, GRAPHQL_MAX_BODY)
                if length is not None and int(length) > self._limit:
                    raise web.HTTPError(413, self._too_large())
                self.request.connection.set_max_body_size(self._limit + 2**24)
        if not self._buffered:
            self._queue = asyncio.Queue(maxsize=8)  # at most 8 chunks of 64 KiB in flight
            self._upstream = asyncio.ensure_future(self._proxy_streamed())
            # Its outcome is awaited in _respond; when the request ends early (413, client
            # gone) nobody awaits it, and its error is expected: consume it.
            self._upstream.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _too_large(self) -> str:
        what = "JSON request" if self._buffered else "upload"
        return f"Request body too large: this {what} may have at most {self._limit} bytes."

    # -- the body --------------------------------------------------------------------
    async def data_received(self, chunk: bytes):
        if self._finished or self._refusal is not None:
            return
        self._received += len(chunk)
        if self._received > self._limit:  # only a chunked body gets here (Content-Length is checked first)
            if not self._headers_written:
                # Stop relaying, drop the rest, answer 413 once the body ends (tornado cuts
                # the connection at the limit + 16 MiB).
                self._abort_upstream()
                self._refusal = web.HTTPError(413, self._too_large())
            return
        if self._buffered:
            self._chunks.append(chunk)
            return
        assert self._upstream is not None  # not buffered: prepare started the request upstream
        if not self._upstream.done():  # else MLflow answered without the body: drop it
            await self._put(chunk)

    async def _put(self, item) -> None:
        assert self._queue is not None and self._upstream is not None  # streamed: prepare made both
        put = asyncio.ensure_future(self._queue.put(item))
        await asyncio.wait({put, self._upstream}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()

    def _abort_upstream(self) -> None:
        if self._queue is None:
            return
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_ABORT)

    def on_connection_close(self):
        self._abort_upstream()
        super().on_connection_close()

    # -- after the body ----------------------------------------------------------------
    async def _respond(self, *args):
        if self._finished:
            return
        if self._refusal is not None:
            raise self._refusal
        if self._local == UI_DEFAULTS:
            self.set_header("Content-Type", "text/javascript; charset=utf-8")
            self.set_header("X-Content-Type-Options", "nosniff")
            self.set_header("Cache-Control", "no-cache")
            if self.request.method == "GET":
                self.write(UI_DEFAULTS_JS)
            else:
                self.set_header("Content-Length", str(len(UI_DEFAULTS_JS)))
        elif self._buffered:
            await self._respond_buffered()
        else:
            if self._has_body:
                await self._put(_END)
            await self._upstream
        if not self._finished:
            self.finish()

    get = head = post = put = patch = delete = options = _respond

    async def _respond_buffered(self):
        state = self.state
        username = self.username
        try:
            body = b"".join(self._chunks)
            if self._graphql_viewer:
                why = viewer_graphql_refusal(body)
                if why:
                    log.warning("Refusing GraphQL of viewer %s: %s", username, why)
                    raise Refused(403, f"Viewers see runs and metrics read-only; {why}.")
            body = rewrite_request(self.rel, self.request.method, body, username)
        except Refused as e:
            self.set_status(e.status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error_code": e.error_code, "message": e.message}))
            return
        response = await self._fetch(self.rel, body)
        if response.code == 200 and self._route == "users-list":
            data = json.loads(response.body)
            data["users"] = [u for u in data.get("users", []) if u.get("username") == username]
            return self._relay_json(response, data)
        if response.code == 200 and self._route == "roles-list":
            mine = await self._fetch(
                self.rel.replace("roles/list", "users/roles/list"),
                b"",
                query=f"username={url_escape(username, plus=False)}",
                method="GET",
            )
            own = {r.get("id") for r in json.loads(mine.body).get("roles", [])} if mine.code == 200 else set()
            data = json.loads(response.body)
            data["roles"] = [r for r in data.get("roles", []) if r.get("id") in own]
            return self._relay_json(response, data)
        if response.code == 200 and EXPERIMENTS_CREATE.match(self.rel) and self.teams:
            try:
                experiment_id = json.loads(response.body)["experiment_id"]
                await state.accounts.share_experiment_with_teams(experiment_id, self.teams)
            except Exception:
                log.exception("Could not share new experiment of %s with teams %s", username, self.teams)
        if self._ui_page:
            return self._relay_ui_page(response)
        self._relay_head(response.code, response.reason, response.headers)
        if response.body:
            self.write(response.body)

    def _relay_ui_page(self, response) -> None:
        """MLflow's page, with the UI's defaults loaded before MLflow's own script."""
        body = response.body or b""
        self._relay_head(response.code, response.reason, response.headers)
        ctype = response.headers.get("Content-Type", "")
        if response.code == 200 and ctype.startswith("text/html") and b"<script" in body:
            body = body.replace(b"<script", UI_DEFAULTS_TAG + b"<script", 1)
            for name in ("ETag", "Last-Modified"):
                self.clear_header(name)
            self.set_header("Cache-Control", "no-cache")
        if body:
            self.write(body)

    def _relay_json(self, response, data) -> None:
        self._relay_head(response.code, response.reason, response.headers)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(data))

    async def _fetch(self, rel: str, body: bytes, query: str | None = None, method: str | None = None):
        """A buffered upstream call (small JSON), redone once if the account changed."""
        for attempt in (1, 2):
            req = self._upstream_request(rel, query=query, method=method, body=body)
            response = await self.state.http.fetch(req, raise_error=False)
            if response.code == 401 and attempt == 1:
                # The account changed behind our back (deleted, password reset): redo it once.
                self.state.accounts.forget(self.username)
                await self.state.ensure_account(self.username, self.teams, self.viewer)
                continue
            return response

    async def _proxy_streamed(self):
        """Relay request and response bodies chunk by chunk, with back-pressure both ways."""
        for attempt in (1, 2):
            retry = attempt == 1 and not self._has_body  # a consumed body cannot be resent
            head = {"start": None, "headers": httputil.HTTPHeaders(), "done": False, "redo": False}

            def on_header(line: str, head=head, retry=retry):
                if head["start"] is None:
                    head["start"] = httputil.parse_response_start_line(line.strip())
                    return
                if line.strip():
                    head["headers"].parse_line(line)
                    return
                start = head["start"]
                if start.code == 100:
                    head["start"], head["headers"] = None, httputil.HTTPHeaders()
                    return
                if start.code == 401 and retry:
                    head["redo"] = True
                    return
                if not self._finished:
                    self._relay_head(start.code, start.reason, head["headers"])
                head["done"] = True

            def on_chunk(chunk: bytes, head=head):
                if head["redo"] or self._finished:
                    return None
                self.write(chunk)
                return self.flush()  # awaited by tornado: a slow reader slows the download

            kwargs = {}
            if self._has_body:
                queue = self._queue

                async def produce(write, queue=queue):
                    while True:
                        item = await queue.get()
                        if item is _END:
                            return
                        if item is _ABORT:
                            raise iostream.StreamClosedError()
                        await write(item)

                kwargs["body_producer"] = produce
                # MLflow may refuse (403) before reading: then no byte is sent upstream.
                kwargs["expect_100_continue"] = True
            req = self._upstream_request(self.rel, header_callback=on_header, streaming_callback=on_chunk, **kwargs)
            length = self.request.headers.get("Content-Length")
            if self._has_body and length is not None:
                req.headers["Content-Length"] = length
            try:
                response = await self.state.http.fetch(req, raise_error=False)
            except Exception as e:  # connection-level failure, either side
                if not head["done"]:
                    log.warning("MLflow did not answer %s %s: %s", self.request.method, self.rel, e)
                    raise web.HTTPError(502, "The MLflow tracking server did not answer.") from None
                # Part of the body was relayed: close instead of finishing, so that the
                # client sees a cut transfer, never a complete-looking short one.
                log.info("Relay of %s %s cut: %s", self.request.method, self.rel, e)
                self.request.connection.close()
                return
            if head["redo"]:
                self.state.accounts.forget(self.username)
                await self.state.ensure_account(self.username, self.teams, self.viewer)
                continue
            if not head["done"] and not self._finished:
                self._relay_head(response.code if response.code != 200 else 502, response.reason, response.headers)
            return

    def _upstream_request(self, rel: str, query: str | None = None, method: str | None = None, **kwargs) -> HTTPRequest:
        headers = httputil.HTTPHeaders()
        for name, value in self.request.headers.get_all():
            lname = name.lower()
            if lname in HOP_BY_HOP or lname.startswith("sec-fetch-"):
                continue
            if self._ui_page and lname in UI_PAGE_DROP:
                continue
            headers.add(name, value)
        headers["Host"] = self.state.upstream_hostport
        headers["Authorization"] = self.state.accounts.user_auth(self.username)
        headers["X-Forwarded-User"] = self.username
        # The decoded path, canonically re-encoded: MLflow decodes it back to exactly
        # the string the rules above were applied to.
        url = self.state.upstream_base + encode_path(self.state.upstream_path + rel)
        query = self.request.query if query is None else query
        if query:
            url += "?" + query
        method = method or self.request.method
        if "body" in kwargs and not kwargs["body"] and method not in BODY_METHODS:
            kwargs["body"] = None
        return HTTPRequest(
            url,
            method=method,
            headers=headers,
            allow_nonstandard_methods=True,
            follow_redirects=False,
            decompress_response=False,
            request_timeout=self.state.request_timeout,
            connect_timeout=20,
            **kwargs,
        )

    def _relay_head(self, code: int, reason: str | None, headers: httputil.HTTPHeaders):
        if code == 599:
            raise web.HTTPError(502, "The MLflow tracking server did not answer.")
        self.set_status(code, reason or httputil.responses.get(code, "Unknown"))
        seen = set()
        for name, value in headers.get_all():
            lname = name.lower()
            if lname in RESPONSE_DROP or lname.startswith("access-control-"):
                continue
            if lname == "location":
                value = self._rewrite_location(value)
            # Replace tornado's defaults (Content-Type: text/html) instead of adding a
            # second value: proxies and browsers may keep the first one.
            (self.add_header if lname in seen else self.set_header)(name, value)
            seen.add(lname)

    def _rewrite_location(self, value: str) -> str:
        root = self.state.upstream_root
        return self.state.prefix + value[len(root) :] if value.startswith(root) else value


class RootRedirect(web.RequestHandler):
    def initialize(self, target: str):
        self.target = target

    def get(self):
        self.redirect(self.target)


def make_http_client() -> AsyncHTTPClient:
    return AsyncHTTPClient(force_instance=True, max_clients=64, max_body_size=2**40, max_buffer_size=64 * 2**20)
