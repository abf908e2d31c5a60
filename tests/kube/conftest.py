"""Fixtures for the Kubernetes backend: the API double, the policy, spawner stand-ins.

The double runs for the whole session in its own thread (KubeSpawner loads its
kubeconfig once per process, so one server with one address); each test gets it
empty, with the rendered Kueue objects applied, and stops KubeSpawner's shared
reflectors afterwards (they belong to the test's event loop).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).parent))

from double.harness import (  # noqa: E402  (sets $KUBECONFIG before kubernetes_asyncio loads)
    KUBECONFIG,
    NAMESPACE,
    POLICY,
    REPO,
    VENV_BIN,
    WORK,
    MockHub,
    MockUser,
    shipped_container_security_context,
)
from double.schemas import shared_schemas  # noqa: E402
from double.server import KubeDouble  # noqa: E402
from support.ports import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402  (tests/cluster/harness.py: never imports the double)


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    try:
        return shared_schemas()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def double(schemas_dir):
    """The API double; it validates every object against the real CRDs, so it needs them."""
    if os.environ.get("GPUHUB_TEST_KUBECONFIG"):
        pytest.skip("GPUHUB_TEST_KUBECONFIG is set: this session talks to a real cluster (run -m cluster)")
    work = WORK
    # The "image": the tests' venv on PATH, and Jupyter config as an image would bake it in
    # (docker-stacks images run as jovyan; here the process may run as root).
    config_dir = work / "image-jupyter-config"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"allow_root": True}}))
    node_env = {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
        "JUPYTER_CONFIG_DIR": str(config_dir),
    }
    # Kueue's pod webhook narrowed to the user namespace, as docs/install-kubernetes.md says.
    server = KubeDouble(work, node_env=node_env, webhook_namespaces={NAMESPACE}).start()
    KUBECONFIG.write_text(server.kubeconfig())
    yield server
    server.close()
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def _real_plane():
    """This pytest process's share of the real control plane of ``tests/cluster/up.sh``:
    started when it is not running (under ``harness.plane_lock``, so parallel workers start
    it once), and stopped when the last process that used it finishes, if a test run started
    it and ``GPUHUB_CLUSTER_KEEP=1`` is unset. Skipped with the reason without
    ``GPUHUB_CLUSTER=1`` or the cached binaries."""
    reason = real.skip_reason()
    if reason:
        pytest.skip(reason)
    with real.plane_user():
        with real.plane_lock():
            cluster = real.ensure_up_for_tests()
        yield cluster
    real.down_if_last_user()


@pytest.fixture(scope="module")
def real_cluster(_real_plane):
    """The real control plane, one test file at a time: every real-plane file resets the
    users' namespace and the Kueue objects, so under ``./run-tests.sh``'s parallel workers a
    file holds ``harness.plane_lock`` from its first real-plane test to its end (the others
    wait for it there). What a test creates there it removes itself."""
    with real.plane_lock():
        if not real.RealCluster().ready():  # a previous file's user stopped it
            real.ensure_up_for_tests()
        cluster = _real_plane
        # The users' namespace as the install guide makes it (helm-values/user-namespace.yaml:
        # Pod Security `restricted` enforced, the hub's Role, the NetworkPolicies), whatever an
        # earlier file left: every pod a test makes there meets it (harness.restricted).
        cluster.kubectl("apply", "-f", str(REPO / "helm-values" / "user-namespace.yaml"))
        yield cluster
        if not real.kueue_running():  # a failed outage test left Kueue stopped
            real.start_kueue()


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
        cfg.KueueSpawner.container_security_context = shipped_container_security_context()  # as values.yaml
        if traits.get("cmd", cfg.KueueSpawner.cmd) != ["jupyterhub-singleuser"]:
            # A stand-in that only has to exist serves no API for the startup probe to find:
            # without a probe its container is ready when started, as the kubelet does it.
            cfg.KueueSpawner.startup_probe_period = 0
        for key, value in traits.items():
            setattr(cfg.KueueSpawner, key, value)
        owner = next((s.user for s in made if s.user.name == user), None) or MockUser(user, groups)
        spawner = KueueSpawner(
            config=cfg,
            user=owner,
            hub=MockHub(kube.url),
            api_token="test-token",
            oauth_client_id=f"jupyterhub-user-{user}",
            **({"orm_spawner": SimpleNamespace(name=server_name, server=None)} if server_name else {}),
        )
        spawner.user_options = {"profile": profile} if profile else {}
        owner.spawners[server_name] = spawner
        made.append(spawner)
        return spawner

    return make
