"""The hub-managed ``mlflow`` service: MLflow tracking server + authenticating proxy.

Started by JupyterHub (``c.JupyterHub.services``) with the service environment
(``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_SERVICE_PREFIX``, ``JUPYTERHUB_API_TOKEN``,
OAuth client settings). Run ``python -m gpuhub_spawner.mlflow --help`` for options.

Lifecycle: the proxy listens at once and holds requests until MLflow is healthy; a
SIGTERM/SIGINT stops MLflow's process group and exits within seconds (the hub waits
for its services on shutdown).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlencode, urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler
from tornado import web
from tornado.httpclient import HTTPRequest
from tornado.httpserver import HTTPServer
from traitlets import Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Application

from .accounts import Accounts
from .proxy import MlflowProxyHandler, RootRedirect, make_http_client, normalize_origin
from .secrets import Passwords, ensure_private_dir, load_or_create_key
from .upstream import ADMIN_USERNAME, MlflowServer, ServerSettings
from ..policy.files import write_atomically

log = logging.getLogger("JupyterHub.gpuhub.mlflow")


class TeamResolver:
    """Hub groups -> team names through the policy file (re-read when it changes)."""

    def __init__(self, policy_path: str | None):
        self.path = Path(policy_path) if policy_path else None
        self._sig = None
        self._policy = None

    def _load(self):
        if self.path is None:
            return None
        try:
            st = self.path.stat()
            sig = (st.st_mtime_ns, st.st_size)
        except OSError:
            return self._policy
        if sig != self._sig:
            from ..policy import load_policy

            try:
                self._policy = load_policy(self.path)
            except Exception as e:  # keep the last good policy
                log.warning("Policy %s not usable for MLflow teams, keeping the last good one: %s", self.path, e)
            self._sig = sig
        return self._policy

    def teams(self, groups: list[str]) -> tuple[str, ...]:
        policy = self._load()
        if policy is None:
            return tuple(sorted(set(groups)))
        from ..policy.access import teams_for

        return tuple(sorted(t.name for t in teams_for(policy, groups)))

    def is_viewer(self, groups: list[str]) -> bool:
        """In the policy's ``roles.viewers`` (hub/roles.py): read-only metrics, no artifacts."""
        policy = self._load()
        return bool(policy is not None and set(groups) & set(policy.roles.viewers))


class ServiceState:
    def __init__(
        self,
        *,
        prefix: str,
        upstream_url: str,
        accounts: Accounts,
        teams: TeamResolver,
        state_dir: Path,
        request_timeout: float = 3600.0,
        max_upload_size: int = 2**30,
        max_json_body_size: int = 16 * 2**20,
        public_origins: list[str] | tuple[str, ...] = (),
    ):
        u = urlparse(upstream_url)
        self.upstream_root = upstream_url.rstrip("/") + "/"  # relative paths are appended to this
        self.upstream_base = f"{u.scheme}://{u.netloc}"
        self.upstream_path = u.path.rstrip("/") + "/"  # MLflow's --static-prefix, decoded
        self.max_upload_size = max_upload_size
        self.max_json_body_size = max_json_body_size
        self.public_origins = frozenset(public_origins)
        self.upstream_hostport = u.netloc
        self.prefix = prefix  # with trailing slash, e.g. /services/mlflow/
        self.accounts = accounts
        self.team_resolver = teams
        self.state_dir = state_dir
        self.request_timeout = request_timeout
        self.http = make_http_client()
        self._ready = asyncio.Event()
        self._failed: str | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._provisioned_file = state_dir / "provisioned-users.json"
        try:
            self.provisioned: set[str] = set(json.loads(self._provisioned_file.read_text()))
        except (OSError, ValueError):
            self.provisioned = set()

    async def ready(self, timeout: float = 180.0):
        if self._failed:
            raise web.HTTPError(503, self._failed)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: a cancel (the client left) is never lost
                await self._ready.wait()
        except TimeoutError:
            raise web.HTTPError(503, "The MLflow tracking server is still starting; try again shortly.") from None
        if self._failed:
            raise web.HTTPError(503, self._failed)

    def set_ready(self):
        self._ready.set()

    def set_failed(self, message: str):
        self._failed = message
        self._ready.set()

    def teams_for(self, user: dict) -> tuple[str, ...]:
        return self.team_resolver.teams(list(user.get("groups") or []))

    def viewer_only(self, user: dict, teams: tuple[str, ...]) -> bool:
        """A viewer in no team: reads every experiment's runs and metrics, nothing else.

        A viewer who is also a team member keeps a researcher's access (own and shared
        experiments), without the viewer's read-everything grant.
        """
        return not teams and self.team_resolver.is_viewer(list(user.get("groups") or []))

    async def ensure_account(self, username: str, teams: tuple[str, ...], viewer: bool):
        """The account, its team roles and the viewers' role as the user stands now
        (``viewer``: ``viewer_only``); called on every request, cheap when unchanged."""
        if username == self.accounts.admin_username or ":" in username:
            raise web.HTTPError(403, f"The hub user name {username!r} cannot be used on MLflow.")
        lock = self._locks.setdefault(username, asyncio.Lock())
        async with lock:
            await self.accounts.ensure_user(username, teams, viewer)
            if username not in self.provisioned:
                self.provisioned.add(username)
                self._save_provisioned()

    def _save_provisioned(self):
        write_atomically(self._provisioned_file, json.dumps(sorted(self.provisioned)), 0o600)

    # -- removing users that left the hub ---------------------------------------------
    async def hub_usernames(self, hub_auth: HubOAuth) -> set[str]:
        names: set[str] = set()
        offset = 0
        while True:
            url = f"{hub_auth.api_url.rstrip('/')}/users?" + urlencode({"offset": offset, "limit": 200})
            req = HTTPRequest(
                url,
                headers={"Authorization": f"token {hub_auth.api_token}", "Accept": "application/jupyterhub-pagination+json"},
                request_timeout=30,
            )
            r = await self.http.fetch(req)
            data = json.loads(r.body)
            items = data["items"] if isinstance(data, dict) else data
            names.update(u["name"] for u in items)
            nxt = data.get("_pagination", {}).get("next") if isinstance(data, dict) else None
            if not nxt:
                return names
            offset = nxt["offset"]

    async def reconcile(self, hub_auth: HubOAuth) -> list[str]:
        """Delete the MLflow accounts of provisioned users the hub no longer has."""
        if not self._ready.is_set() or self._failed:
            return []
        hub = await self.hub_usernames(hub_auth)
        gone = sorted(self.provisioned - hub)
        for name in gone:
            lock = self._locks.setdefault(name, asyncio.Lock())
            async with lock:
                await self.accounts.delete_user(name)
                self.provisioned.discard(name)
        if gone:
            self._save_provisioned()
        return gone


class MlflowService(Application):
    """The ``mlflow`` hub service: settings are traitlets, set on its command line
    (``--MlflowService.max_upload_size=...``; ``configure(service_options=...)``
    writes those) or in a config file (``--config=<file>``)."""

    name = "gpuhub-mlflow"
    description = __doc__

    data_dir = Unicode(help="State, SQLite stores and artifacts (one machine).").tag(config=True)
    policy = Unicode("", help="Policy YAML: hub groups -> teams for team read access.").tag(config=True)
    external_url = Unicode("", help="Use this existing MLflow server (with basic-auth) instead of starting one.").tag(config=True)
    admin_credentials_file = Unicode(
        "",
        help="JSON {username, password} of the existing server's admin (with external_url); "
        "default: $GPUHUB_MLFLOW_ADMIN_USERNAME/$GPUHUB_MLFLOW_ADMIN_PASSWORD",
    ).tag(config=True)
    backend_store_uri = Unicode(
        help="Default $GPUHUB_MLFLOW_BACKEND_STORE_URI, else SQLite under data_dir; pass database "
        "passwords through that variable, not the command line."
    ).tag(config=True)
    artifacts_destination = Unicode("", help="Default <data_dir>/artifacts; e.g. s3://bucket/path.").tag(config=True)
    auth_db_uri = Unicode(help="MLflow auth database; default $GPUHUB_MLFLOW_AUTH_DB_URI, else SQLite under data_dir.").tag(
        config=True
    )
    bind_ip = Unicode("", help="Listen here instead of the host of JUPYTERHUB_SERVICE_URL (0.0.0.0 in a pod).").tag(config=True)
    workers = Integer(1, help="uvicorn workers of the MLflow server.").tag(config=True)
    reconcile_interval = Float(60.0, help="Seconds between removed-user sweeps.").tag(config=True)
    mlflow_args = List(Unicode(), help="Extra arguments for `mlflow server`.").tag(config=True)
    max_upload_size = Integer(
        2**30,
        min=0,
        help="Largest request body (artifact upload) in bytes; larger ones get 413. Bodies are "
        "streamed to MLflow, so this bounds disk use, not the service's memory.",
    ).tag(config=True)
    max_json_body_size = Integer(
        16 * 2**20,
        min=0,
        help="Largest body of the JSON requests the proxy rewrites (runs/create, log-batch, "
        "experiments/create, ...), which it must hold in memory; larger ones get 413.",
    ).tag(config=True)
    public_origins = List(
        Unicode(),
        help="Origins (scheme://host[:port]) the MLflow UI is served from. A cookie-authenticated "
        "write must come from one of them (Origin header) or say Sec-Fetch-Site: same-origin. "
        "Default: the origin of $JUPYTERHUB_PUBLIC_URL (set by the hub when "
        "JupyterHub.public_url or a service domain is configured); if that is unset too, the "
        "request's own Host.",
    ).tag(config=True)
    request_timeout = Float(3600.0, help="Seconds one proxied request (an upload) may take.").tag(config=True)

    aliases = {
        "data-dir": "MlflowService.data_dir",
        "policy": "MlflowService.policy",
        "external-url": "MlflowService.external_url",
        "admin-credentials-file": "MlflowService.admin_credentials_file",
        "backend-store-uri": "MlflowService.backend_store_uri",
        "artifacts-destination": "MlflowService.artifacts_destination",
        "auth-db-uri": "MlflowService.auth_db_uri",
        "bind-ip": "MlflowService.bind_ip",
        "workers": "MlflowService.workers",
        "reconcile-interval": "MlflowService.reconcile_interval",
        "mlflow-arg": "MlflowService.mlflow_args",
        "max-upload-size": "MlflowService.max_upload_size",
        "public-origin": "MlflowService.public_origins",
        "config": "MlflowService.config_file",
    }
    config_file = Unicode("", help="A traitlets config file (c.MlflowService.<name> = ...).").tag(config=True)

    @default("backend_store_uri")
    def _default_backend_store_uri(self):
        return os.environ.get("GPUHUB_MLFLOW_BACKEND_STORE_URI", "")

    @default("auth_db_uri")
    def _default_auth_db_uri(self):
        return os.environ.get("GPUHUB_MLFLOW_AUTH_DB_URI", "")

    @default("public_origins")
    def _default_public_origins(self):
        url = os.environ.get("JUPYTERHUB_PUBLIC_URL")
        return [normalize_origin(url)] if url and "://" in url else []

    @validate("public_origins")
    def _validate_public_origins(self, proposal):
        out = []
        for url in proposal["value"]:
            origin = normalize_origin(url)
            if not urlparse(origin).hostname or urlparse(origin).scheme not in ("http", "https"):
                raise TraitError(f"MlflowService.public_origins: {url!r} is not an http(s) origin")
            out.append(origin)
        return out

    def initialize(self, argv=None):
        argv = _join_mlflow_args(sys.argv[1:] if argv is None else list(argv))
        self.parse_command_line(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
            self.parse_command_line(argv)  # the command line wins over the file
        if not self.data_dir:
            raise SystemExit(f"{self.name}: --data-dir is required")


def _join_mlflow_args(argv: list[str]) -> list[str]:
    """``--mlflow-arg --workers=2`` -> ``--mlflow-arg=--workers=2``: the values are options
    of ``mlflow server``, which a command-line parser would otherwise take for ours."""
    out, it = [], iter(argv)
    for arg in it:
        if arg == "--mlflow-arg":
            out.append(f"--mlflow-arg={next(it, '')}")
        else:
            out.append(arg)
    return out


def _admin_credentials(args: MlflowService, passwords: Passwords) -> tuple[str, str]:
    if not args.external_url:
        return ADMIN_USERNAME, passwords.admin()
    if args.admin_credentials_file:
        data = json.loads(Path(args.admin_credentials_file).read_text())
        return data["username"], data["password"]
    try:
        return os.environ["GPUHUB_MLFLOW_ADMIN_USERNAME"], os.environ["GPUHUB_MLFLOW_ADMIN_PASSWORD"]
    except KeyError:
        sys.exit("--external-url needs --admin-credentials-file or GPUHUB_MLFLOW_ADMIN_USERNAME/PASSWORD")


def main(argv=None):
    args = MlflowService()
    args.initialize(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname).1s %(asctime)s gpuhub-mlflow] %(message)s")
    service_url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/mlflow/")
    if not prefix.endswith("/"):
        prefix += "/"
    data_dir = Path(args.data_dir).resolve()
    state_dir = ensure_private_dir(data_dir / "service")
    passwords = Passwords(load_or_create_key(state_dir))
    admin_user, admin_password = _admin_credentials(args, passwords)
    # Password rules and secrets stay out of the environment of everything but MLflow.
    for k in ("GPUHUB_MLFLOW_ADMIN_PASSWORD",):
        os.environ.pop(k, None)

    server = None
    if args.external_url:
        upstream_url = args.external_url.rstrip("/")
        host_header = None
    else:
        server = MlflowServer(
            ServerSettings(
                data_dir=data_dir,
                prefix=prefix.rstrip("/"),
                backend_store_uri=args.backend_store_uri or None,
                artifacts_destination=args.artifacts_destination or None,
                auth_db_uri=args.auth_db_uri or None,
                workers=args.workers,
                extra_args=args.mlflow_args,
            ),
            admin_password=admin_password,
            flask_secret=passwords.flask_secret(),
        )
        upstream_url = server.url
        host_header = server.hostport
    accounts = Accounts(upstream_url, admin_user, admin_password, passwords, host_header=host_header)
    # The handlers use the HubOAuth singleton: configure it before any handler runs.
    # A short cache: a token the hub revoked stops working here within seconds.
    hub_auth = HubOAuth.instance(cache_max_age=10)
    state = ServiceState(
        prefix=prefix,
        upstream_url=upstream_url,
        accounts=accounts,
        teams=TeamResolver(args.policy or None),
        state_dir=state_dir,
        request_timeout=args.request_timeout,
        max_upload_size=args.max_upload_size,
        max_json_body_size=args.max_json_body_size,
        public_origins=args.public_origins,
    )
    (state_dir / "upstream.json").write_text(json.dumps({"url": upstream_url}))

    app = web.Application(
        [
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
            (prefix.rstrip("/"), RootRedirect, {"target": prefix}),
            (prefix + ".*", MlflowProxyHandler, {"state": state}),
        ],
        hub_auth=hub_auth,
        cookie_secret=passwords._derive("tornado-cookie-secret").encode(),
        xsrf_cookies=False,
    )

    async def run():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Bodies the proxy does not stream (the OAuth callback) stay small; the proxy
        # raises this per request to its own upload limit.
        http_server = HTTPServer(app, xheaders=False, max_body_size=2**20)
        http_server.listen(service_url.port, args.bind_ip or service_url.hostname)
        log.info("MLflow service listening on %s%s", os.environ["JUPYTERHUB_SERVICE_URL"].rstrip("/"), prefix)

        async def bring_up():
            try:
                if server is not None:
                    server.start()
                    await server.wait_ready()
                state.set_ready()
            except Exception as e:
                log.error("MLflow tracking server failed: %s", e)
                state.set_failed(f"The MLflow tracking server failed to start: {e}")

        async def sweep():
            while True:
                await asyncio.sleep(args.reconcile_interval)
                try:
                    gone = await state.reconcile(hub_auth)
                    if gone:
                        log.info("Revoked MLflow access of removed hub users: %s", ", ".join(gone))
                except Exception as e:
                    log.warning("Removed-user sweep failed: %s", e)

        tasks = [asyncio.ensure_future(bring_up()), asyncio.ensure_future(sweep())]

        async def watch_child():
            while server is not None and not stop.is_set():
                await asyncio.sleep(1)
                if server.proc is not None and server.proc.poll() is not None and state._ready.is_set():
                    log.error("mlflow server exited with status %s; stopping the service", server.proc.returncode)
                    stop.set()

        tasks.append(asyncio.ensure_future(watch_child()))
        await stop.wait()
        log.info("Stopping the MLflow service")
        http_server.stop()
        for t in tasks:
            t.cancel()
        if server is not None:
            await loop.run_in_executor(None, server.stop)

    t0 = time.monotonic()
    asyncio.run(run())
    log.info("MLflow service stopped (ran %.0f s)", time.monotonic() - t0)


if __name__ == "__main__":
    main()
