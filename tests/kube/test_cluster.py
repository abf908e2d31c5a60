"""The same lifecycle against a real cluster with Kueue v0.19 (opt-in).

    GPUHUB_TEST_KUBECONFIG=~/.kube/config pytest -m cluster tests/kube/test_cluster.py

Needs: Kueue v0.19 installed (visibility API on), a namespace (GPUHUB_TEST_NAMESPACE,
default gpuhub-test) labelled kubernetes.io/metadata.name (automatic), rights to
create Kueue objects and pods there, and an image that runs jupyterhub-singleuser
(GPUHUB_TEST_IMAGE, default quay.io/jupyter/base-notebook:2025-10-20; it runs `sleep`). Uses CPU-only
profiles so no GPU node is required. Run it in its own pytest session: the kubeconfig
is loaded once per process.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.asyncio(loop_scope="function"),
    pytest.mark.skipif(
        not os.environ.get("GPUHUB_TEST_KUBECONFIG"), reason="set GPUHUB_TEST_KUBECONFIG to run against a real cluster"
    ),
]

NAMESPACE = os.environ.get("GPUHUB_TEST_NAMESPACE", "gpuhub-test")
IMAGE = os.environ.get("GPUHUB_TEST_IMAGE", "quay.io/jupyter/base-notebook:2025-10-20")

POLICY = f"""
apiVersion: gpuhub/v1
priorityClasses:
  - {{name: gpuhub-test-interactive, value: 1000}}
teams:
  - name: gpuhub-test
    groups: [testers]
    defaultPriority: gpuhub-test-interactive
    quota: {{cpu: 500m, memory: 1Gi}}
profiles:
  - slug: small
    displayName: Small
    cpu: 500m
    memory: 1Gi
    teams: "*"
    image: {IMAGE}
defaults:
  queueTimeout: 10m
  launchTimeout: 10m
"""


@pytest.fixture
async def cluster(tmp_path):
    os.environ["KUBECONFIG"] = os.environ["GPUHUB_TEST_KUBECONFIG"]
    from kubernetes_asyncio import client, config

    from gpuhub_spawner.kube.render import render_objects
    from gpuhub_spawner.policy import PolicyStore, parse_policy

    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    PolicyStore.clear_instance()
    store = PolicyStore.instance(policy_file=str(path))
    await config.load_kube_config(config_file=os.environ["GPUHUB_TEST_KUBECONFIG"])
    async with client.ApiClient() as api:
        custom = client.CustomObjectsApi(api)
        for obj in render_objects(parse_policy(POLICY), NAMESPACE):
            group, version = obj["apiVersion"].split("/")
            kind = obj["kind"].lower()  # Kueue's plurals: ...classes, ...flavors, ...queues (issue 40 item 6)
            plural = kind + ("es" if kind.endswith("s") else "s")
            ns = obj["metadata"].get("namespace")
            try:
                if ns:
                    await custom.create_namespaced_custom_object(group, version, ns, plural, obj)
                else:
                    await custom.create_cluster_custom_object(group, version, plural, obj)
            except client.ApiException as e:
                if e.status != 409:
                    raise
    yield store
    from kubespawner import KubeSpawner

    await KubeSpawner._stop_all_reflectors()
    PolicyStore.clear_instance()


async def test_queue_then_run_then_stop_on_a_real_cluster(cluster):
    from traitlets.config import Config

    from gpuhub_spawner.kube.spawner import KueueSpawner

    from double.harness import MockHub, MockUser

    cfg = Config()
    cfg.KueueSpawner.namespace = NAMESPACE
    # No hub runs here for jupyterhub-singleuser to check in with: run a plain command.
    # What this checks on the real thing is the Kueue path (gate, Workload, visibility, admission).
    cfg.KueueSpawner.cmd = ["sleep", "3600"]
    made = []

    def spawner(name):
        s = KueueSpawner(config=cfg, user=MockUser(name, ("testers",)), hub=MockHub("http://127.0.0.1:1"), api_token="x")
        s.user_options = {"profile": "small"}
        made.append(s)
        return s

    first, second = spawner("first"), spawner("second")
    try:
        await asyncio.wait_for(first.start(), 600)
        start = second.start()
        messages = []

        async def watch():
            async for event in second.progress():
                messages.append(event["message"])

        task = asyncio.ensure_future(watch())
        while not any("more needed" in m for m in messages):
            await asyncio.sleep(1)
        assert not start.done()
        await first.stop(now=True)
        await asyncio.wait_for(start, 600)
        await task
        assert await second.poll() is None
    finally:
        for s in made:
            await s.stop(now=True)
