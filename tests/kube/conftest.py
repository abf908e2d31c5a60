"""Fixtures for the Kubernetes backend: the API double, the policy, spawner stand-ins.

The double runs for the whole session in its own thread (KubeSpawner loads its
kubeconfig once per process, so one server with one address); each test gets it
empty, with the rendered Kueue objects applied, and stops KubeSpawner's shared
reflectors afterwards (they belong to the test's event loop).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
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

# kubernetes_asyncio reads $KUBECONFIG when it is imported, before any fixture runs:
# point it at a file now and write the double's address into it when the double starts.
# KubeSpawner prefers in-cluster config; make sure a CI pod's service account is not picked up.
_WORK = Path(tempfile.mkdtemp(prefix="gpuhub-kube-double-"))
_WORK.chmod(0o755)  # not pytest's 0700 tmp dir: pod processes need to reach their HOME
atexit.register(shutil.rmtree, _WORK, True)
KUBECONFIG = _WORK / "kubeconfig"
if not os.environ.get("GPUHUB_TEST_KUBECONFIG"):
    os.environ["KUBECONFIG"] = str(KUBECONFIG)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    return shared_schemas()


@pytest.fixture(scope="session")
def double():
    if os.environ.get("GPUHUB_TEST_KUBECONFIG"):
        pytest.skip("GPUHUB_TEST_KUBECONFIG is set: this session talks to a real cluster (run -m cluster)")
    work = _WORK
    # The "image": the tests' venv on PATH, and Jupyter config as an image would bake it in
    # (docker-stacks images run as jovyan; here the process may run as root).
    config_dir = work / "image-jupyter-config"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"allow_root": True}}))
    node_env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8",
                "JUPYTER_CONFIG_DIR": str(config_dir)}
    server = KubeDouble(work, node_env=node_env).start()
    KUBECONFIG.write_text(server.kubeconfig())
    yield server
    server.close()
    shutil.rmtree(work, ignore_errors=True)


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
    """The hub as a spawner sees it; its API root is answered by the double (version check)."""

    def __init__(self, base):
        super().__init__(public_host="", url=f"{base}/hub/", base_url="/hub/", api_url=f"{base}/hub/api")


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
        spawner = KueueSpawner(config=cfg, user=owner, hub=MockHub(kube.url), api_token="test-token",
                               oauth_client_id=f"jupyterhub-user-{user}",
                               **({"orm_spawner": SimpleNamespace(name=server_name, server=None)} if server_name else {}))
        spawner.user_options = {"profile": profile} if profile else {}
        owner.spawners[server_name] = spawner
        made.append(spawner)
        return spawner

    return make
