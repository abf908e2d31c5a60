"""Fixtures for the Kubernetes backend: the API double, the policy, spawner stand-ins.

The double runs for the whole session in its own thread (KubeSpawner loads its
kubeconfig once per process, so one server with one address); each test gets it
empty, with the rendered Kueue objects applied, and stops KubeSpawner's shared
reflectors afterwards (they belong to the test's event loop).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).parent))

from double.schemas import shared_schemas  # noqa: E402
from double.server import KubeDouble  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "jupyterhub_config" / "profiles.yaml"
NAMESPACE = "gpuhub"
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    return shared_schemas()


@pytest.fixture(scope="session")
def double(tmp_path_factory):
    work = tmp_path_factory.mktemp("kube-double")
    node_env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
    server = KubeDouble(work, node_env=node_env).start()
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig())
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    # KubeSpawner prefers in-cluster config; make sure a CI pod's service account is not picked up.
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    yield server
    server.close()
    if old is None:
        os.environ.pop("KUBECONFIG", None)
    else:
        os.environ["KUBECONFIG"] = old


@pytest.fixture
def policy_file(tmp_path):
    """A copy of the shipped policy that a test may edit."""
    path = tmp_path / "profiles.yaml"
    path.write_text(POLICY.read_text())
    return path


@pytest.fixture
def policy_store(policy_file):
    from gpuhub_spawner.policy import PolicyStore

    PolicyStore.clear_instance()
    store = PolicyStore.instance(policy_file=str(policy_file))
    yield store
    PolicyStore.clear_instance()


@pytest_asyncio.fixture(loop_scope="function")
async def kube(double, policy_store):
    """The double, empty, with the policy's Kueue objects applied in NAMESPACE."""
    from gpuhub_spawner.kube.render import render_objects
    from gpuhub_spawner.kube.state import PendingPollers
    from kubespawner import KubeSpawner

    double.reset()
    double.apply(render_objects(policy_store.policy, NAMESPACE))
    PendingPollers.reset()
    yield double
    await KubeSpawner._stop_all_reflectors()
    PendingPollers.reset()
    double.reset()


class MockUser(SimpleNamespace):
    """The parts of ``jupyterhub.user.User`` a spawner touches."""

    def __init__(self, name, groups, **kw):
        super().__init__(name=name, escaped_name=name, id=abs(hash(name)) % 10000, url=f"/user/{name}/",
                         groups=[SimpleNamespace(name=g) for g in groups], spawners={}, **kw)


class MockHub(SimpleNamespace):
    def __init__(self):
        super().__init__(public_host="", url="http://127.0.0.1:1/hub/", base_url="/hub/", api_url="http://127.0.0.1:1/hub/api")


@pytest.fixture
def make_spawner(kube):
    """Build a KueueSpawner for a user in ``groups`` choosing ``profile``; fast timings for tests."""
    from traitlets.config import Config

    from gpuhub_spawner.kube.spawner import KueueSpawner

    made = []

    def make(user="alice", groups=("vision-lab",), profile="cpu", server_name="", **traits):
        cfg = Config()
        cfg.KueueSpawner.namespace = NAMESPACE
        cfg.KueueSpawner.cmd = ["jupyterhub-singleuser"]
        cfg.KueueSpawner.port = free_port()
        cfg.KueueSpawner.status_interval = 0.1
        cfg.KueueSpawner.queue_poll_interval = 0.2
        cfg.KueueSpawner.k8s_api_request_timeout = 5
        cfg.KueueSpawner.k8s_api_request_retry_timeout = 20
        cfg.KueueSpawner.delete_grace_period = 1
        for key, value in traits.items():
            setattr(cfg.KueueSpawner, key, value)
        owner = next((s.user for s in made if s.user.name == user), None) or MockUser(user, groups)
        spawner = KueueSpawner(config=cfg, user=owner, hub=MockHub(), name=server_name, api_token="test-token",
                               oauth_client_id=f"jupyterhub-user-{user}")
        spawner.user_options = {"profile": profile} if profile else {}
        owner.spawners[server_name] = spawner
        made.append(spawner)
        return spawner

    return make
