"""A user's Ray dashboard on the user's own origin, served by their server (docs/ray.md).

``{base_url}gpuhub/ray/<name>/dashboard/<path>`` (for the default server
``http://alice.<domain>/user/alice/gpuhub/ray/<name>/dashboard/``) forwards to the dashboard
of the user's running cluster ``<name>`` on one machine. Why here and not in the hub:

- **the origin.** What the dashboard serves comes from processes running as the user (the
  user could replace it with any page), so it belongs on the user's origin
  (``JupyterHub.subdomain_host``), where a page can act only as its owner's server can, never
  with the hub's cookie. The hub answers only on its own host (docs/security.md), so it
  cannot serve it there itself; the user's server can, and is already reached there.
- **who may open it** is decided exactly as for the server: jupyterhub-singleuser's OAuth
  with the hub (scope ``access:servers!server=<user>/<server>``), before this handler runs.
  Another user's token or login is refused (403), as for the server's own pages.
- **what is forwarded where.** The port comes from the hub (``GET
  {JUPYTERHUB_API_URL}/gpuhub/ray/<name>`` with this server's own token: the caller's own
  clusters only), and the request goes there only while the port's listening socket belongs
  to this server's own account (``/proc/net/tcp``: the kernel's record, not what a process
  says), never to another account's process that took the port. The dashboard needs the
  user's Ray token (``RAY_AUTH_MODE=token``); it is read from ``~/.ray/auth_token`` (written
  there by the cluster, in the private home) and added here, so it never reaches the browser.
  Cookies of the user's origin are not forwarded; the dashboard's own ``Set-Cookie`` is dropped.
- **writes** (the dashboard's POSTs: stopping a job, profiling) need Jupyter's XSRF token
  like every cookie-authenticated write to the server, so another site cannot make the
  owner's browser submit Ray jobs (code as the owner) through it.
- **reads by the dashboard's own page.** JupyterHub accepts a login cookie on a script's GET
  (``Sec-Fetch-Mode: cors``) only with its XSRF token, which Ray's dashboard app does not send:
  every API call and font of the page it opened was sent to the hub's login instead ("No
  cluster status." on an otherwise empty page; found by tests/integration/test_browser_walk.py).
  A GET or HEAD whose browser says ``Sec-Fetch-Site: same-origin`` (the user's own origin,
  a header no page can set) is taken without it: reads only, from the owner's own pages.

- **GETs that act** (Ray's dashboard kills an actor with ``GET /api/actors/kill`` and starts
  profilers with ``GET /worker/...`` and ``/task/...``) are forwarded only when the request
  proves it comes from the owner's own pages: a browser's ``Sec-Fetch-Site`` of
  ``same-origin`` (or ``none``: typed or bookmarked), or a token in ``Authorization``
  (which another site cannot make a browser send). A link on another site gets 403.

GET and POST only (the dashboard's pages and API); no websockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import quote

from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

CLUSTER = r"([a-z0-9][-a-z0-9]{0,40})"
PATH_OK = re.compile(r"[A-Za-z0-9._~/%+-]*")
FORWARDED = ("accept", "content-type", "accept-language")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "set-cookie", "server"}
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
# Ray 2.52 dashboard GETs that change something or run something (not just read).
ACTING_GETS = re.compile(r"(api/actors/kill|worker/|task/|memory_profile)")


def listening_uids(port: int, proc_net: str = "/proc/net") -> set[int]:
    """The uids of the sockets listening on TCP ``port`` (any address, IPv4 and IPv6), from the
    kernel's tables. Empty when nothing listens there. (The hub reads the same tables in
    ``gpuhub_spawner.local.listening``; this package runs in users' images without it.)"""
    uids: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(proc_net, name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
            if len(f) < 8 or f[3] != _LISTEN:
                continue
            try:
                if int(f[1].rsplit(":", 1)[1], 16) == port:
                    uids.add(int(f[7]))
            except (IndexError, ValueError):
                continue
    return uids


def ray_token(home: str | None = None) -> str | None:
    """The user's Ray token: ``RAY_AUTH_TOKEN`` if the server has one, else ``~/.ray/auth_token``."""
    tok = os.environ.get("RAY_AUTH_TOKEN")
    if tok:
        return tok.strip()
    try:
        return Path(home or os.path.expanduser("~"), ".ray", "auth_token").read_text().strip() or None
    except OSError:
        return None


PORT_TTL = 10.0  # seconds a port the hub named is reused (a dashboard polls several times a second)
_ports: dict[str, tuple[int, float]] = {}


async def dashboard_port(cluster: str, environ=None) -> tuple[int | None, str]:
    """(port, "") of the caller's running cluster ``cluster`` from the hub, or (None, why).
    A port is asked for again after ``PORT_TTL``; whoever listens on it is checked at every
    request (``listening_uids``), so a port reused meanwhile by another account gets nothing."""
    known = _ports.get(cluster)
    if known and time.monotonic() - known[1] < PORT_TTL:
        return known[0], ""
    env = os.environ if environ is None else environ
    url, token = env.get("JUPYTERHUB_API_URL", "").rstrip("/"), env.get("JUPYTERHUB_API_TOKEN", "")
    if not (url and token):
        return None, "not running under a gpuhub hub"
    ssl = {
        k: env[v]
        for k, v in (
            ("client_cert", "JUPYTERHUB_SSL_CERTFILE"),
            ("client_key", "JUPYTERHUB_SSL_KEYFILE"),
            ("ca_certs", "JUPYTERHUB_SSL_CLIENT_CA"),
        )
        if env.get(v)
    }
    req = HTTPRequest(
        f"{url}/gpuhub/ray/{quote(cluster, safe='')}",
        headers={"Authorization": f"token {token}", "Accept": "application/json"},
        request_timeout=10,
        connect_timeout=10,
        **ssl,
    )
    try:
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
        return None, f"the hub did not answer: {e}"
    if resp.code == 404:
        _ports.pop(cluster, None)
        return None, f"You have no Ray cluster named {cluster}."
    if resp.code != 200:
        return None, f"the hub answered {resp.code}"
    try:
        view = json.loads(resp.body or b"{}")
    except ValueError:
        return None, "the hub's answer was not JSON"
    port = view.get("dashboard_port")
    if view.get("state") != "running" or not isinstance(port, int):
        _ports.pop(cluster, None)
        return None, f"Ray cluster {cluster} has no dashboard now ({view.get('status') or view.get('state')})."
    _ports[cluster] = (port, time.monotonic())
    return port, ""


def _decoded(path: str) -> str:
    """``path`` as the dashboard's server will route it: percent-decoded until it stops changing
    (``%2561pi`` is ``api`` there after tornado's one decoding here), dot segments resolved."""
    from posixpath import normpath
    from urllib.parse import unquote

    for _ in range(5):
        plain = unquote(path)
        if plain == path:
            break
        path = plain
    return normpath("/" + path).lstrip("/")


class RayDashboardHandler(JupyterHandler):
    """The owner's dashboard, forwarded with the owner's Ray token (see the module docstring)."""

    def write_error(self, status_code: int, **kwargs) -> None:
        # Our own words, as JSON (what the dashboard's pages expect from its API), not Jupyter's
        # HTML error page, which leaves them out.
        exc = (kwargs.get("exc_info") or (None, None))[1]
        message = getattr(exc, "log_message", None) or self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status_code, "message": message}))

    def check_xsrf_cookie(self):
        """Reads from the user's own origin need no XSRF token (see the module docstring); the
        rest as Jupyter and JupyterHub check them. JupyterHub's login-cookie check calls this
        handler's method, so this decides for this handler's requests only."""
        if self.request.method in ("GET", "HEAD") and self.request.headers.get("Sec-Fetch-Site") == "same-origin":
            return None
        return super().check_xsrf_cookie()

    @web.authenticated
    async def get(self, cluster, path):
        await self._forward(cluster, path)

    @web.authenticated
    async def post(self, cluster, path):
        await self._forward(cluster, path)

    async def _forward(self, cluster, path):
        if not PATH_OK.fullmatch(path or "") or ".." in path:
            raise web.HTTPError(400, "Bad path.")
        if self.request.method == "GET" and ACTING_GETS.search(_decoded(path or "")):
            site = self.request.headers.get("Sec-Fetch-Site")
            by_token = "Authorization" in self.request.headers
            if (site is not None and site not in ("same-origin", "none")) or (site is None and not by_token):
                raise web.HTTPError(403, "This dashboard action must come from the dashboard's own page.")
        port, why = await dashboard_port(cluster)
        if port is None:
            raise web.HTTPError(404, why)
        owners = listening_uids(port)
        if owners != {os.getuid()}:
            # Nothing listens yet, or another account's process holds the port: the user's
            # token and requests go only to the user's own dashboard.
            self.log.warning(
                "Ray dashboard port %s of %s is held by uid(s) %s, not %s: not forwarded",
                port,
                cluster,
                sorted(owners),
                os.getuid(),
            )
            raise web.HTTPError(502, f"The dashboard of Ray cluster {cluster} is not listening on its port.")
        headers = {k: v for k, v in self.request.headers.items() if k.lower() in FORWARDED}
        token = ray_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        query = ("?" + self.request.query) if self.request.query else ""
        req = HTTPRequest(
            f"http://127.0.0.1:{port}/{path}{query}",
            method=self.request.method,
            headers=headers,
            body=self.request.body if self.request.method == "POST" else None,
            follow_redirects=False,
            request_timeout=60,
        )
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code == 599:
            raise web.HTTPError(502, "The Ray dashboard did not answer.")
        self.set_status(resp.code)
        for k, v in resp.headers.get_all():
            if k.lower() not in _HOP:
                self.set_header(k, v)
        self.finish(resp.body or b"")


def load(serverapp) -> None:
    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base, "gpuhub", "ray", CLUSTER, "dashboard", "(.*)"), RayDashboardHandler)])
    serverapp.log.info("gpuhub_notebook: serving Ray dashboards at %sgpuhub/ray/<name>/dashboard/", base)
