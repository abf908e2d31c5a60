"""One real hub (our config, our local spawner) with the real MLflow service, per module.

The service is wired with ``gpuhub_spawner.mlflow.configure`` exactly as the hub
config does; its removed-user sweep runs every 2 s here so revocation is observable.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from support.hub import REPO, Hub, free_port

POLICY = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()


def mlflow_extra_config(service_port: int, data: str = "") -> str:
    # Called after the harness sets c.Spawner.environment, so the merge is exercised.
    return (
        "from gpuhub_spawner.mlflow import configure as _configure_mlflow\n"
        "import os as _os\n"
        f"_configure_mlflow(c, data_dir=_os.path.join(_os.environ['GPUHUB_DATA_DIR'], 'mlflow'), port={service_port},\n"
        "                  policy_path=_os.environ['GPUHUB_POLICY'], reconcile_interval=2)\n"
    )


class MlflowEndpoint:
    """The hub's MLflow service as clients see it."""

    def __init__(self, hub: Hub, port: int):
        self.hub = hub
        self.direct = f"http://127.0.0.1:{port}/services/mlflow"  # what notebooks use
        self.public = f"{hub.url}/services/mlflow"  # through the hub's proxy (browsers)
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

    def wait_ready(self, token: str, timeout: float = 240) -> float:
        t0 = time.perf_counter()
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                r = self.api(token).get(self.direct + "/api/2.0/mlflow/experiments/search",
                                        params={"max_results": 1}, timeout=200)
                if r.status_code == 200:
                    return time.perf_counter() - t0
                last = f"{r.status_code} {r.text[:200]}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(0.5)
        raise TimeoutError(f"MLflow service not ready: {last}\n{self.hub.tail(80)}")


@pytest.fixture(scope="module")
def mlflow_hub(tmp_path_factory):
    service_port = free_port()
    hub = Hub(tmp_path_factory.mktemp("mlflow-hub"), POLICY, extra_config=mlflow_extra_config(service_port))
    hub.start(timeout=90)
    endpoint = MlflowEndpoint(hub, service_port)
    try:
        yield hub, endpoint
    finally:
        hub.stop()
