"""The MLflow tracking server the service runs as its child (one-machine mode).

``mlflow server --app-name basic-auth`` bound to 127.0.0.1 on a free port, with
its static prefix equal to the service prefix (so UI, REST and artifact routes all
live under ``/services/mlflow/`` and the proxy forwards paths unchanged), job
execution off (no ~1 GiB job runner), the Host-header allow-list set to exactly
the address the proxy uses, and the auth database and admin password supplied by
the service. Only this child sees the admin password (in its environment).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

log = logging.getLogger("JupyterHub.gpuhub.mlflow")

ADMIN_USERNAME = "gpuhub-mlflow-admin"


def free_port(host: str = "127.0.0.1") -> int:
    """A port for the MLflow child that the kernel hands to nobody else before the child binds
    it: MLflow imports for 10-20 s first (longer on a loaded machine).

    A port found by binding port 0 and closing the socket at once is the kernel's to give again
    to the next bind of port 0 or outgoing connection on the machine (a kernel's or a Ray
    node's port draws, anyone's client connection); the child then cannot listen, or this
    service's health check meets another program there. Here the port is left in TIME_WAIT
    instead, by a connection to it closed from its own side (the technique of Yelp's
    ephemeral-port-reserve): for the next 60 s the kernel gives it to no bind of port 0 and no
    outgoing connection and refuses a plain bind of it, while a server that binds with
    SO_REUSEADDR, as uvicorn and gunicorn do, takes it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen(1)
        port = s.getsockname()[1]
        with socket.create_connection((host, port)):
            accepted, _ = s.accept()
            accepted.close()  # this side closes first: the TIME_WAIT is on the port itself
        return port


def auth_ini(auth_db_uri: str, admin_username: str = ADMIN_USERNAME) -> str:
    """MLflow basic-auth config: deny by default, grants come from ownership and teams."""
    return (
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = {auth_db_uri}\n"
        f"admin_username = {admin_username}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "grant_default_workspace_access = false\n"
        # PBKDF2 on every request costs ~0.3 s on a small machine; the proxy is the
        # gate that revokes (hub tokens), so a short credential cache is safe.
        "auth_cache_ttl_seconds = 30\n"
    )


@dataclass
class ServerSettings:
    data_dir: Path
    prefix: str  # e.g. /services/mlflow (no trailing slash)
    backend_store_uri: str | None = None
    artifacts_destination: str | None = None
    auth_db_uri: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    workers: int = 1
    mlflow_executable: list[str] = field(default_factory=lambda: [sys.executable, "-m", "mlflow"])
    extra_args: list[str] = field(default_factory=list)

    def resolved(self) -> "ServerSettings":
        d = self.data_dir
        return ServerSettings(
            data_dir=d,
            prefix=self.prefix.rstrip("/"),
            backend_store_uri=self.backend_store_uri or f"sqlite:///{d / 'mlflow.db'}",
            artifacts_destination=self.artifacts_destination or str(d / "artifacts"),
            auth_db_uri=self.auth_db_uri or f"sqlite:///{d / 'auth.db'}",
            host=self.host,
            port=self.port or free_port(self.host),
            workers=self.workers,
            mlflow_executable=self.mlflow_executable,
            extra_args=self.extra_args,
        )


class MlflowServer:
    """Start, health-check and stop ``mlflow server`` as a child process."""

    def __init__(self, settings: ServerSettings, admin_password: str, flask_secret: str):
        self.settings = settings.resolved()
        self._admin_password = admin_password
        self._flask_secret = flask_secret
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None

    @property
    def url(self) -> str:
        """Base URL including the static prefix, e.g. http://127.0.0.1:4242/services/mlflow"""
        s = self.settings
        return f"http://{s.host}:{s.port}{s.prefix}"

    @property
    def hostport(self) -> str:
        return f"{self.settings.host}:{self.settings.port}"

    def command(self) -> list[str]:
        s = self.settings
        assert s.artifacts_destination is not None  # resolved() filled it in
        cmd = [
            *s.mlflow_executable,
            "server",
            "--host",
            s.host,
            "--port",
            str(s.port),
            "--workers",
            str(s.workers),
            # The backend store URI (it may hold a database password) goes through the
            # environment (MLFLOW_BACKEND_STORE_URI), never onto a command line.
            "--artifacts-destination",
            s.artifacts_destination,
            "--serve-artifacts",
            "--app-name",
            "basic-auth",
            "--allowed-hosts",
            self.hostport,
        ]
        if s.prefix:
            cmd += ["--static-prefix", s.prefix]
        return cmd + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_MLFLOW_"))}
        assert self.settings.auth_db_uri is not None and self.settings.backend_store_uri is not None  # resolved() filled them in
        ini = self.settings.data_dir / "basic_auth.ini"
        fd = os.open(ini, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold a DB password
        with os.fdopen(fd, "w") as f:
            f.write(auth_ini(self.settings.auth_db_uri))
        os.chmod(ini, 0o600)
        env.update(
            MLFLOW_BACKEND_STORE_URI=self.settings.backend_store_uri,
            MLFLOW_AUTH_CONFIG_PATH=str(ini),
            MLFLOW_AUTH_ADMIN_PASSWORD=self._admin_password,
            MLFLOW_FLASK_SERVER_SECRET_KEY=self._flask_secret,
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
            # MLflow's own per-run permission checks on /graphql, whatever the operator's
            # environment says (the proxy's viewer rule is the first wall, not the only one).
            MLFLOW_SERVER_ENABLE_GRAPHQL_AUTH="true",
            # No telemetry (MLflow 3 sends usage events unless told not to).
            MLFLOW_DISABLE_TELEMETRY="true",
            DO_NOT_TRACK="true",
        )
        return env

    def start(self) -> None:
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        if s.artifacts_destination and "://" not in s.artifacts_destination:
            Path(s.artifacts_destination).mkdir(parents=True, exist_ok=True)
        log.info("Starting MLflow tracking server on %s (backend %s)", self.hostport, _redact(s.backend_store_uri))
        self.started_at = time.monotonic()
        # Own process group: a SIGTERM to the service reaches the whole MLflow tree
        # through stop(), and a hub's Ctrl-C does not race it.
        self.proc = subprocess.Popen(self.command(), env=self.environment(), start_new_session=True)

    async def wait_ready(self, timeout: float = 180.0) -> None:
        client = AsyncHTTPClient()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with status {self.proc.returncode} before it was ready")
            try:
                r = await client.fetch(f"{self.url}/health", request_timeout=5, raise_error=False)
                if r.code == 200:
                    self.ready_after = time.monotonic() - (self.started_at or time.monotonic())
                    log.info("MLflow tracking server ready after %.1f s", self.ready_after)
                    return
            except (OSError, HTTPClientError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not ready after {timeout:.0f} s")
            await asyncio.sleep(0.25)

    def stop(self, grace: float = 8.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("mlflow server did not stop in %.0f s; killing it", grace)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _redact(uri: str | None) -> str:
    """A store URI without its password (postgresql://user:pw@host/db)."""
    if not uri or "@" not in uri or "://" not in uri:
        return uri or ""
    scheme, rest = uri.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
