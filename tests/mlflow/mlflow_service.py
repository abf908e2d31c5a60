"""The hub's MLflow service as tests reach it (shared by conftest and test modules).

The service is wired with ``gpuhub_spawner.mlflow.configure`` exactly as the hub
config does; its removed-user sweep runs every 2 s here so revocation is observable.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import requests

from support.hub import REPO, Hub

POLICY = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()


def mlflow_extra_config(service_port: int, service_options: dict | None = None) -> str:
    # Called after the harness sets c.Spawner.environment, so the merge is exercised.
    return (
        "from gpuhub_spawner.wiring.mlflow import configure as _configure_mlflow\n"
        "import os as _os\n"
        f"_configure_mlflow(c, data_dir=_os.path.join(_os.environ['GPUHUB_DATA_DIR'], 'mlflow'), port={service_port},\n"
        f"                  policy_path=_os.environ['GPUHUB_POLICY'], reconcile_interval=2,\n"
        f"                  service_options={service_options!r})\n"
    )


def service_origin(hub: Hub, name: str = "mlflow") -> str:
    """Where the hub serves a service: its own origin under ``subdomain_host``, else the hub's.

    Mirrors ``gpuhub_spawner.hub.origins.configure_origins`` (subdomains unless turned
    off or the host-routing proxy is missing) and JupyterHub's default subdomain hook.
    """
    from jupyterhub.utils import subdomain_hook_idna

    from gpuhub_spawner.hub.origins import node_proxy_command

    if hub.env.get("GPUHUB_SUBDOMAINS", "1") == "0" or node_proxy_command() is None:
        return hub.url
    u = urlsplit(hub.url)
    return f"{u.scheme}://{subdomain_hook_idna(name, u.hostname, 'service')}:{u.port}"


class MlflowEndpoint:
    """The hub's MLflow service as clients see it."""

    def __init__(self, hub: Hub, port: int):
        self.hub = hub
        self.direct = f"http://{hub.users_reach_hub_at()}:{port}/services/mlflow"  # what notebooks use
        self.origin = service_origin(hub)  # the service's public origin (its own under subdomains)
        self.public = f"{self.origin}/services/mlflow"  # through the hub's proxy (browsers)
        self.data = hub.data / "mlflow"

    def api(self, token: str | None) -> requests.Session:
        s = requests.Session()
        if token:
            s.headers["Authorization"] = f"Bearer {token}"
        return s

    def admin(self) -> requests.Session:
        """MLflow's own admin, straight to the upstream server (only tests do this)."""
        from gpuhub_spawner.mlflow.secrets import Passwords, load_or_create_key
        from gpuhub_spawner.mlflow.upstream import ADMIN_USERNAME

        state = self.data / "service"
        pw = Passwords(load_or_create_key(state)).admin()
        s = requests.Session()
        s.auth = (ADMIN_USERNAME, pw)
        s.base = json.loads((state / "upstream.json").read_text())["url"]
        return s

    def service_pid(self) -> int:
        """The service process (the proxy; MLflow is its child), found under the hub."""
        import psutil

        for p in psutil.Process(self.hub.proc.pid).children(recursive=True):
            if "gpuhub_spawner.mlflow" in " ".join(p.cmdline()):
                return p.pid
        raise LookupError("no MLflow service process under the hub")

    def wait_ready(self, token: str, timeout: float = 240) -> float:
        t0 = time.perf_counter()
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                r = self.api(token).get(
                    self.direct + "/api/2.0/mlflow/experiments/search", params={"max_results": 1}, timeout=200
                )
                if r.status_code == 200:
                    return time.perf_counter() - t0
                last = f"{r.status_code} {r.text[:200]}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(0.5)
        raise TimeoutError(f"MLflow service not ready: {last}\n{self.hub.tail(80)}")
