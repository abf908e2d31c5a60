"""The hub-managed ``mlflow`` service: MLflow tracking server + authenticating proxy.

Started by JupyterHub (``c.JupyterHub.services``) with the service environment
(``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_SERVICE_PREFIX``, ``JUPYTERHUB_API_TOKEN``,
OAuth client settings). Run ``python -m gpuhub_spawner.mlflow --help`` for options.

Lifecycle: the proxy listens at once and holds requests until MLflow is healthy; a
SIGTERM/SIGINT stops MLflow's process group and exits within seconds (the hub waits
for its services on shutdown).
"""

from __future__ import annotations

import argparse
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

from .accounts import Accounts
from .proxy import MlflowProxyHandler, RootRedirect, make_http_client
from .secrets import Passwords, ensure_private_dir, load_or_create_key
from .upstream import ADMIN_USERNAME, MlflowServer, ServerSettings

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


class ServiceState:
    def __init__(self, *, prefix: str, upstream_url: str, accounts: Accounts, teams: TeamResolver,
                 state_dir: Path, request_timeout: float = 3600.0):
        u = urlparse(upstream_url)
        self.upstream_root = upstream_url.rstrip("/") + "/"  # relative paths are appended to this
        self.upstream_base = f"{u.scheme}://{u.netloc}"
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
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
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

    async def ensure_account(self, username: str, teams: tuple[str, ...]):
        if username == self.accounts.admin_username or ":" in username:
            raise web.HTTPError(403, f"The hub user name {username!r} cannot be used on MLflow.")
        lock = self._locks.setdefault(username, asyncio.Lock())
        async with lock:
            await self.accounts.ensure_user(username, teams)
            if username not in self.provisioned:
                self.provisioned.add(username)
                self._save_provisioned()

    def _save_provisioned(self):
        tmp = self._provisioned_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.provisioned)))
        os.replace(tmp, self._provisioned_file)

    # -- removing users that left the hub ---------------------------------------------
    async def hub_usernames(self, hub_auth: HubOAuth) -> set[str]:
        names: set[str] = set()
        offset = 0
        while True:
            url = f"{hub_auth.api_url.rstrip('/')}/users?" + urlencode({"offset": offset, "limit": 200})
            req = HTTPRequest(url, headers={"Authorization": f"token {hub_auth.api_token}",
                                            "Accept": "application/jupyterhub-pagination+json"}, request_timeout=30)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpuhub_spawner.mlflow", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="state, SQLite stores and artifacts (one machine)")
    p.add_argument("--policy", help="policy YAML: hub groups -> teams for team read access")
    p.add_argument("--external-url", help="use this existing MLflow server (with basic-auth) instead of starting one")
    p.add_argument("--admin-credentials-file",
                   help="JSON {username, password} of the existing server's admin (with --external-url); "
                        "default: $GPUHUB_MLFLOW_ADMIN_USERNAME/$GPUHUB_MLFLOW_ADMIN_PASSWORD")
    p.add_argument("--backend-store-uri", default=os.environ.get("GPUHUB_MLFLOW_BACKEND_STORE_URI"),
                   help="default $GPUHUB_MLFLOW_BACKEND_STORE_URI, else sqlite under --data-dir; "
                        "pass database passwords through that variable, not this flag")
    p.add_argument("--artifacts-destination", help="default <data-dir>/artifacts; e.g. s3://bucket/path")
    p.add_argument("--auth-db-uri", default=os.environ.get("GPUHUB_MLFLOW_AUTH_DB_URI"),
                   help="MLflow auth database; default $GPUHUB_MLFLOW_AUTH_DB_URI, else sqlite under --data-dir")
    p.add_argument("--bind-ip", help="listen here instead of the host of JUPYTERHUB_SERVICE_URL (e.g. 0.0.0.0 in a pod)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--reconcile-interval", type=float, default=60.0, help="seconds between removed-user sweeps")
    p.add_argument("--max-body-mb", type=int, default=1024, help="largest request (artifact upload) accepted")
    p.add_argument("--mlflow-arg", action="append", default=[], help="extra argument for `mlflow server`")
    return p.parse_args(argv)


def _admin_credentials(args, passwords: Passwords) -> tuple[str, str]:
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
    args = parse_args(argv)
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
                data_dir=data_dir, prefix=prefix.rstrip("/"),
                backend_store_uri=args.backend_store_uri, artifacts_destination=args.artifacts_destination,
                auth_db_uri=args.auth_db_uri, workers=args.workers, extra_args=args.mlflow_arg,
            ),
            admin_password=admin_password, flask_secret=passwords.flask_secret(),
        )
        upstream_url = server.url
        host_header = server.hostport
    accounts = Accounts(upstream_url, admin_user, admin_password, passwords, host_header=host_header)
    # The handlers use the HubOAuth singleton: configure it before any handler runs.
    # A short cache: a token the hub revoked stops working here within seconds.
    hub_auth = HubOAuth.instance(cache_max_age=10)
    state = ServiceState(prefix=prefix, upstream_url=upstream_url, accounts=accounts,
                         teams=TeamResolver(args.policy), state_dir=state_dir)
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
        http_server = HTTPServer(app, xheaders=False, max_body_size=args.max_body_mb * 2**20)
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
