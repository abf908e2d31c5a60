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
        # Always this server: the relay acts with this server's token, for this server only.
        status, data = await _hub_request(hub, "/snooze", method="POST", body={"server": hub["server"]})
        if status == 0:
            status = 502
        elif status in (401, 403):
            # Our token was refused by the hub: not the browser's credentials, so not a 403 here.
            data = {"message": f"the hub refused this server's token ({status}): {data.get('message', '')}".strip()}
            status = 502
        self.set_status(status)
        data.setdefault("server", hub["server"])
        self.finish(json.dumps(data))


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
        ],
    )
    serverapp.log.info("gpuhub_notebook: serving %sgpuhub/activity and %sgpuhub/culling", base, base)
    busy_kernels_are_activity(serverapp)
