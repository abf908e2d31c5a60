"""Jupyter server extension: GPU activity for the hub's culler, cull warnings for JupyterLab.

Handlers, under the server's ``base_url`` and authenticated like every server API:

``GET gpuhub/activity``
    GPUs, kernels and terminals (``activity``), for the user's own information. The hub's
    culler never reads it: what a user's server says about itself can be forged, so culling
    reads GPUs with NVML in the hub or DCGM on Kubernetes (docs/culling.md).

``GET gpuhub/culling``
    This server's entry of the hub's ``GET {JUPYTERHUB_API_URL}/gpuhub/culling/{user}``, fetched
    with the server's own ``JUPYTERHUB_API_TOKEN``::

        {"enabled": true, "server": "<name>", "now": <epoch>, "warning": {...} | null,
         "gpu_failed": {devices, since, reason, xid} | null,
         "stopped": {at, reason, rule} | null, "gpu_wait": <s>}

    ``enabled`` is false outside a hub (no ``JUPYTERHUB_API_URL``); the lab extension stops polling.
    ``?wait=S`` (at most 25) is a long poll: the hub answers when this user's warnings, GPU
    failures or stops change, or after S s; ``gpu_wait`` says how long the hub agreed to wait
    (0: at once). ``stopped``: this server is being stopped, and why (the hub answers before
    the server goes, so the open JupyterLab says why at once).

``POST gpuhub/culling``
    Relays ``POST {JUPYTERHUB_API_URL}/gpuhub/culling/{user}/snooze`` with ``{"server": "<this
    server>"}`` and passes the hub's status (200, 409, ...) and JSON body through.

``POST gpuhub/culling/seen``
    A person clicked, typed or scrolled on this server's open JupyterLab (the lab extension sends
    it once per warning, on the first such input after the warning appeared). Relays ``POST
    {JUPYTERHUB_API_URL}/gpuhub/culling/{user}/seen`` with ``{"server": "<this server>"}``: the
    browser names neither the server nor a time (the hub stamps its own); a body is refused.
    At a GPU-idle deadline the hub spends one snooze for it, where an open tab's own polling
    spends none.

``GET gpuhub/jobs``
    The profiles this user's teams may use, as the spawn page offers them (the hub's
    ``GET {JUPYTERHUB_API_URL}/gpuhub/profiles``, with this server's token), for JupyterLab's
    "Run as job" picker; plus ``server``, this server's name.

``POST gpuhub/jobs``
    "Run as job" on an open notebook: ``{"path": "<the notebook's path in JupyterLab>",
    "profile": "<slug>", "team": "<name>" (optional), "parameters": "lr=0.01\nepochs=3"
    (optional, one ``name=value`` a line, typed as ``gpuhub job submit -p`` types them),
    "stop_server": true|false}`` becomes the hub's ``POST {JUPYTERHUB_API_URL}/gpuhub/jobs``
    with a notebook job file, sent with this server's own token: the job is the user's, never
    anyone else's, whatever the browser sends. ``stop_server`` stops *this* server once the job
    is queued (the hub lets a server's token stop only that server). The hub's status and JSON
    (201 with the job's record; 400 with located issues; 403/409 with the reason) are passed
    through.

Enabled by ``etc/jupyter/jupyter_server_config.d/gpuhub_notebook.json`` (installed with the
package), or explicitly: ``c.ServerApp.jpserver_extensions = {"gpuhub_notebook": True}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from urllib.parse import quote

from jupyter_server._tz import utcnow
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.ioloop import PeriodicCallback

from . import activity

HUB_TIMEOUT = 10.0


class ActivityHandler(APIHandler):
    auth_resource = "api"
    _track_activity = False  # reading it is observation, not use

    @web.authenticated
    @authorized
    async def get(self):
        loop = asyncio.get_running_loop()
        # NVML calls block; keep them off the event loop (a wedged driver must not hang the server).
        body = await loop.run_in_executor(None, activity.read_gpus)
        body["kernels"] = activity.kernel_activity(self.settings.get("kernel_manager"))
        body["terminals"] = activity.terminal_activity(self.settings.get("terminal_manager"))
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))


def hub_environment(environ=None) -> dict | None:
    env = os.environ if environ is None else environ
    url = env.get("JUPYTERHUB_API_URL", "").rstrip("/")
    token = env.get("JUPYTERHUB_API_TOKEN", "")
    user = env.get("JUPYTERHUB_USER", "")
    if not (url and token and user):
        return None
    return {
        "url": url,
        "token": token,
        "user": user,
        "server": env.get("JUPYTERHUB_SERVER_NAME", ""),
        # internal_ssl: the hub wants this server's client certificate.
        "ssl": {
            k: env[v]
            for k, v in (
                ("client_cert", "JUPYTERHUB_SSL_CERTFILE"),
                ("client_key", "JUPYTERHUB_SSL_KEYFILE"),
                ("ca_certs", "JUPYTERHUB_SSL_CLIENT_CA"),
            )
            if env.get(v)
        },
    }


MAX_GPU_WAIT = 25.0  # the hub's own cap on a long poll (culling_api.MAX_GPU_WAIT)


async def _hub_request(hub: dict, path: str, method: str = "GET", body: dict | None = None, wait: float = 0.0):
    """(status, parsed JSON or {}) from the hub; status 0 when it could not be reached.
    ``wait``: a long poll (the hub answers when this user's GPU-failure notices change)."""
    query = f"?gpu_wait={wait:g}" if wait else ""
    req = HTTPRequest(
        f"{hub['url']}/gpuhub/culling/{quote(hub['user'], safe='')}{path}{query}",
        method=method,
        headers={"Authorization": f"token {hub['token']}", "Content-Type": "application/json", "Accept": "application/json"},
        body=json.dumps(body) if body is not None else None,
        request_timeout=HUB_TIMEOUT + wait,
        connect_timeout=HUB_TIMEOUT,
        **hub["ssl"],
    )
    try:
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
        return 0, {"message": f"hub unreachable: {e}"}
    try:
        data = json.loads(resp.body or b"{}")
    except ValueError:
        data = {"message": (resp.body or b"")[:200].decode(errors="replace")}
    if resp.code == 599:  # tornado's code for connection errors and timeouts
        return 0, {"message": f"hub unreachable: {resp.error}"}
    return resp.code, data if isinstance(data, dict) else {"message": str(data)}


class CullingHandler(APIHandler):
    auth_resource = "api"

    @property
    def _track_activity(self) -> bool:
        # JupyterLab's poll is observation (it must not keep the server "active" on its
        # own); a click on Snooze is the user.
        return self.request.method != "GET"

    @web.authenticated
    @authorized
    async def get(self):
        self.set_header("Cache-Control", "no-store")
        try:
            wait = float(self.get_query_argument("wait", "0")[:16] or 0)
        except ValueError:
            raise web.HTTPError(400, "wait must be a number of seconds") from None
        if not 0 <= wait <= MAX_GPU_WAIT:
            raise web.HTTPError(400, f"wait must be between 0 and {MAX_GPU_WAIT:g} seconds")
        hub = hub_environment()
        if hub is None:
            self.finish(
                json.dumps(
                    {
                        "enabled": False,
                        "server": None,
                        "now": time.time(),
                        "warning": None,
                        "gpu_failed": None,
                        "stopped": None,
                        "gpu_wait": 0,
                    }
                )
            )
            return
        status, data = await _hub_request(hub, "", wait=wait)
        reply = {
            "enabled": True,
            "server": hub["server"],
            "now": time.time(),
            "warning": None,
            "gpu_failed": None,
            "stopped": None,
            "gpu_wait": 0,
        }
        if status == 200:
            entry = (data.get("servers") or {}).get(hub["server"])
            reply["warning"] = entry if isinstance(entry, dict) else None
            failed = data.get("gpu_failed")
            failed = failed.get(hub["server"]) if isinstance(failed, dict) else None
            reply["gpu_failed"] = failed if isinstance(failed, dict) else None
            stopped = data.get("stopped")
            stopped = stopped.get(hub["server"]) if isinstance(stopped, dict) else None
            reply["stopped"] = stopped if isinstance(stopped, dict) else None
            gpu_wait = data.get("gpu_wait")
            reply["gpu_wait"] = gpu_wait if isinstance(gpu_wait, (int, float)) else 0
        elif status == 404:
            reply["error"] = data.get("message") or "the hub has no culling endpoint"
        else:
            self.set_status(502)
            reply["error"] = data.get("message") or f"hub answered {status}"
        self.finish(json.dumps(reply))

    @web.authenticated
    @authorized
    async def post(self):
        hub = hub_environment()
        if hub is None:
            self.set_status(404)
            self.finish(json.dumps({"message": "not running under JupyterHub: nothing to snooze"}))
            return
        status, data = await _post_for_this_server(hub, "/snooze")
        self.set_status(status)
        data.setdefault("server", hub["server"])
        self.finish(json.dumps(data))


async def _post_for_this_server(hub: dict, path: str) -> tuple[int, dict]:
    """POST ``path`` of the hub's culling API for this server, always this server only (the relay
    acts with this server's token): (the status to answer, the body). The hub unreachable is a
    502; the hub refusing our token too (not the browser's credentials, so not a 401/403 here)."""
    status, data = await _hub_request(hub, path, method="POST", body={"server": hub["server"]})
    if status == 0:
        return 502, data
    if status in (401, 403):
        return 502, {"message": f"the hub refused this server's token ({status}): {data.get('message', '')}".strip()}
    return status, data


class CullingSeenHandler(APIHandler):
    """A person on this page: relayed to the hub for this server only (see the module)."""

    auth_resource = "api"

    @web.authenticated
    @authorized
    async def post(self):
        if (self.request.body or b"").strip() not in (b"", b"{}"):
            raise web.HTTPError(400, "send no body: the hub records this server and its own time")
        hub = hub_environment()
        if hub is None:
            self.set_status(404)
            self.finish(json.dumps({"message": "not running under JupyterHub: nothing is culled here"}))
            return
        status, data = await _post_for_this_server(hub, "/seen")
        self.set_status(status)
        self.finish(json.dumps(data))


MAX_RUN_AS_JOB_BODY = 64 * 1024  # a path, a slug and a few parameters; the hub bounds the job file too
MAX_PARAMETERS = 100  # the hub's own limit (gpuhub_spawner.jobs.spec.MAX_PARAMETERS)


class RunAsJobError(ValueError):
    """A "Run as job" request that cannot be sent: said to the user, nothing sent to the hub."""


def parameter_value(text: str):
    """A parameter's value as ``gpuhub job submit -p name=value`` (and papermill's own CLI) reads
    it: bool, None, int, float, else text. The same rules as
    ``gpuhub_spawner.jobs.cli.parameter_value`` (a unit test holds the two together); this
    package does not import the hub's."""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text in ("None", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_parameters(text: str) -> dict:
    """``name=value`` lines (blank lines and ``#`` comments skipped) as a job's parameters;
    a bad line is named by its number."""
    params: dict = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.partition("=")
        name = name.strip()
        if not eq or not name:
            raise RunAsJobError(f"parameters, line {number}: give a parameter as name=value ({line[:60]!r})")
        if not name.isidentifier():
            raise RunAsJobError(f"parameters, line {number}: {name[:60]!r} is not a Python name (a variable of the notebook)")
        params[name] = parameter_value(value.strip())
        if len(params) > MAX_PARAMETERS:
            raise RunAsJobError(f"at most {MAX_PARAMETERS} parameters")
    return params


def notebook_in_home(root_dir: str, path: str, home: str | None = None) -> str:
    """The notebook JupyterLab calls ``path`` (relative to the server's root), as a path relative
    to the user's home, where the job runs it from. Refused: not a notebook, not a file, outside
    the server's root or the home (a link out of them included: the real path counts)."""
    if not isinstance(path, str) or not path.strip() or len(path) > 1024 or "\0" in path:
        raise RunAsJobError("name the notebook to run (its path in JupyterLab)")
    if not path.endswith(".ipynb"):
        raise RunAsJobError(f"{path[:200]}: only a notebook (.ipynb) runs as a job")
    root = os.path.realpath(root_dir)
    full = os.path.realpath(os.path.join(root, path.lstrip("/")))
    home = os.path.realpath(home or os.path.expanduser("~"))
    if os.path.commonpath([root, full]) != root:
        raise RunAsJobError(f"{path[:200]}: not in this server's files")
    if not os.path.isfile(full):
        raise RunAsJobError(f"{path[:200]}: no such notebook (save it first)")
    if os.path.commonpath([home, full]) != home:
        raise RunAsJobError(f"{path[:200]} is not in your home directory: jobs run from your home")
    return os.path.relpath(full, home)


def run_as_job_request(body, root_dir: str, server: str, home: str | None = None) -> dict:
    """The hub's job submission for a "Run as job" request from JupyterLab. Only the notebook,
    the profile (and team), the parameters and whether to stop a server come from the browser;
    which server is stopped is this one's name, never the browser's word."""
    if not isinstance(body, dict):
        raise RunAsJobError("send a JSON object")
    rel = notebook_in_home(root_dir, body.get("path"), home)
    profile = body.get("profile")
    if not isinstance(profile, str) or not profile.strip() or len(profile) > 255:
        raise RunAsJobError("choose a profile")
    spec: dict = {"profile": profile.strip(), "notebook": rel}
    team = body.get("team")
    if isinstance(team, str) and team.strip():
        spec["team"] = team.strip()[:255]
    params = body.get("parameters") or ""
    if not isinstance(params, str):
        raise RunAsJobError("parameters: one name=value a line")
    params = parse_parameters(params)
    if params:
        spec["parameters"] = params
    submission: dict = {"spec": json.dumps(spec), "filename": os.path.basename(rel)}
    if body.get("stop_server") is True:
        submission["stop_server"] = server
    return submission


class RunAsJobHandler(APIHandler):
    """JupyterLab's "Run as job": the profiles to choose from, and the submission, relayed to the
    hub with this server's own token (see the module's docstring)."""

    auth_resource = "api"

    @web.authenticated
    @authorized
    async def get(self):
        self.set_header("Cache-Control", "no-store")
        hub = hub_environment()
        if hub is None:
            self.set_status(404)
            self.finish(json.dumps({"message": "not running under JupyterHub: there is no queue to run a job in"}))
            return
        status, data = await _hub_api(hub, "/gpuhub/profiles")
        self._relay(status, data, hub)

    @web.authenticated
    @authorized
    async def post(self):
        hub = hub_environment()
        if hub is None:
            self.set_status(404)
            self.finish(json.dumps({"message": "not running under JupyterHub: there is no queue to run a job in"}))
            return
        if len(self.request.body or b"") > MAX_RUN_AS_JOB_BODY:
            raise web.HTTPError(413, f"a Run as job request may have at most {MAX_RUN_AS_JOB_BODY} bytes")
        try:
            try:
                body = json.loads(self.request.body or b"{}")
            except RecursionError:  # nested deeper than the parser goes (within 64 KiB)
                raise RunAsJobError("send a JSON object (this JSON is nested too deeply)") from None
            submission = run_as_job_request(body, self.contents_manager.root_dir, hub["server"])
        except ValueError as e:  # RunAsJobError, or JSON that does not parse
            self.set_status(400)
            self.finish(json.dumps({"message": str(e)[:500]}))
            return
        status, data = await _hub_api(hub, "/gpuhub/jobs", method="POST", body=submission)
        self._relay(status, data, hub)

    def _relay(self, status: int, data: dict, hub: dict) -> None:
        if status == 0:
            status = 502
        elif status == 401:
            # Our token was refused by the hub: not the browser's credentials, so not a 401 here.
            data = {"message": f"the hub refused this server's token: {data.get('message', '')}".strip()}
            status = 502
        self.set_status(status)
        data.setdefault("server", hub["server"])
        self.finish(json.dumps(data))


async def _hub_api(hub: dict, path: str, method: str = "GET", body: dict | None = None):
    """(status, parsed JSON or {}) of ``{JUPYTERHUB_API_URL}{path}`` with this server's token;
    status 0 when the hub could not be reached."""
    req = HTTPRequest(
        f"{hub['url']}{path}",
        method=method,
        headers={"Authorization": f"token {hub['token']}", "Content-Type": "application/json", "Accept": "application/json"},
        body=json.dumps(body) if body is not None else None,
        request_timeout=HUB_TIMEOUT,
        connect_timeout=HUB_TIMEOUT,
        **hub["ssl"],
    )
    try:
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
        return 0, {"message": f"hub unreachable: {e}"}
    if resp.code == 599:  # tornado's code for connection errors and timeouts
        return 0, {"message": f"hub unreachable: {resp.error}"}
    try:
        data = json.loads(resp.body or b"{}")
    except ValueError:
        data = {"message": (resp.body or b"")[:200].decode(errors="replace")}
    return resp.code, data if isinstance(data, dict) else {"message": str(data)}


def plain_terminal_shell(serverapp, environ=None) -> None:
    """JupyterLab's terminal: an interactive ``$SHELL``, not jupyter-server's login shell.

    Without a configured ``shell_command`` jupyter-server appends ``-l`` when it has no tty
    (always, under a spawner), and Debian's ``/etc/profile`` then resets ``PATH`` for
    non-root users: ``python``, ``gpuhub`` and ``mlflow`` of the server's environment were
    "command not found". A non-login shell inherits the server's environment (and still
    reads ``~/.bashrc``), as Jupyter's Docker stacks configure it. A shell the operator or
    user configured wins.
    """
    environ = os.environ if environ is None else environ
    settings = dict(serverapp.terminado_settings or {})
    if settings.get("shell_command"):
        return
    shell = environ.get("SHELL") or shutil.which("bash") or shutil.which("sh") or "/bin/sh"
    settings["shell_command"] = [shell]
    serverapp.terminado_settings = settings


def busy_kernels_are_activity(serverapp) -> PeriodicCallback:
    """Count a busy kernel as activity while it runs.

    A long cell that prints nothing sends no kernel message, so jupyter-server (and the
    hub, through jupyterhub-singleuser's activity reports) would see an idle server and
    the ``timeout`` rule would stop a running computation. Marking the server active while
    a kernel is busy can only make this server look *busier*, which is all a server may do:
    the hub reads GPUs itself, so this never keeps an idle GPU past ``gpuIdleTimeout``.
    """
    web_app = serverapp.web_app
    interval = int(os.environ.get("JUPYTERHUB_ACTIVITY_INTERVAL") or 300)
    period = max(1.0, min(60.0, interval / 2))

    def tick():
        km = web_app.settings.get("kernel_manager")
        if km is None:
            return
        for kid in list(km.list_kernel_ids()):
            try:
                busy = getattr(km.get_kernel(kid), "execution_state", None) == "busy"
            except KeyError:
                continue
            if busy:
                web_app.settings.setdefault("last_activity_times", {})["gpuhub-busy-kernel"] = utcnow()
                return

    callback = PeriodicCallback(tick, period * 1000)
    callback.start()
    return callback


def load(serverapp) -> None:
    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "gpuhub", "activity"), ActivityHandler),
            (url_path_join(base, "gpuhub", "culling"), CullingHandler),
            (url_path_join(base, "gpuhub", "culling", "seen"), CullingSeenHandler),
            (url_path_join(base, "gpuhub", "jobs"), RunAsJobHandler),
        ],
    )
    serverapp.log.info("gpuhub_notebook: serving %sgpuhub/activity, %sgpuhub/culling and %sgpuhub/jobs", base, base, base)
    busy_kernels_are_activity(serverapp)
