"""Applying the policy on Kubernetes goes through its ConfigMap (issue 26, ``kube/policy_configmap.py``),
on the API double (every run) and on the real control plane (``GPUHUB_CLUSTER=1``; skipped with
the reason otherwise), the same scenario on both.

Everything runs as the hub's service account with nothing but the Role ``gpuhub render
policy-rbac`` prints (a token from the TokenRequest API): the mirror's list-and-watch of the one
ConfigMap, an apply's read and patch. What an admin would notice: an apply is in the ConfigMap
and in the hub's copy at once; a ``kubectl edit`` reaches the hub's copy within seconds, not
after the kubelet's sync; an apply against a policy someone else has changed meanwhile writes
nothing and says why; the hub's account can touch no other ConfigMap.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

from gpuhub_spawner.kube.policy_configmap import ConfigMapConflict, ConfigMapPolicy, PolicyMirror  # noqa: E402
from gpuhub_spawner.kube.render import policy_rbac  # noqa: E402
from gpuhub_spawner.usage.policy_versions import text_hash  # noqa: E402

SKIP = real.skip_reason()

NS = "gpuhub-pcm-test"  # this test's own namespace
POLICY_A = "# version A\nteams: []\n"
POLICY_B = "# version B (applied from the page)\nteams: []\n"
POLICY_C = "# version C (kubectl edit)\nteams: []\n"


@pytest.fixture(scope="module")
def cluster(_real_plane):
    cluster = _real_plane  # its own namespace: no need to hold the plane alone
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", check=False)
    cluster.ensure_namespace(NS)
    cluster.kubectl("-n", NS, "create", "serviceaccount", "hub")
    rbac = yaml.safe_dump_all(policy_rbac(f"{NS}:hub"))
    cluster.kubectl("apply", "-f", "-", input=rbac)
    for name, text in (("gpuhub-policy", POLICY_A), ("someone-elses", "secret: 1\n")):
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NS},
            "data": {"profiles.yaml": text},
        }
        cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(cm))
    yield cluster
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)


def hub_account_client(cluster):
    """A CoreV1Api that authenticates as the hub's service account (its token only)."""
    from kubernetes_asyncio import client

    token = cluster.kubectl("-n", NS, "create", "token", "hub").stdout.strip()
    kube = yaml.safe_load(real.KUBECONFIG.read_text())
    server = kube["clusters"][0]["cluster"]
    conf = client.Configuration()
    conf.host = server["server"]
    conf.api_key = {"BearerToken": token, "authorization": token}
    conf.api_key_prefix = {"BearerToken": "Bearer", "authorization": "Bearer"}
    if server.get("certificate-authority"):
        conf.ssl_ca_cert = server["certificate-authority"]
    elif server.get("insecure-skip-tls-verify"):
        conf.verify_ssl = False
    return client.ApiClient(conf), client.CoreV1Api


def kubectl_edit(cluster, text: str) -> None:
    """What ``kubectl edit configmap gpuhub-policy`` does, with the admin's credentials."""
    patch = yaml.safe_dump({"data": {"profiles.yaml": text}})
    cluster.kubectl("-n", NS, "patch", "configmap", "gpuhub-policy", "--type=merge", "-p", patch)


def configmap_text(cluster, name="gpuhub-policy") -> str:
    return cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{name}")["data"]["profiles.yaml"]


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


class DoubleEdits:
    """kubectl's part, against the double (its test controls)."""

    def __init__(self, double):
        self.double = double

    def edit(self, text: str) -> None:
        obj = self.double.get("configmaps", NS, "gpuhub-policy")
        obj["data"]["profiles.yaml"] = text
        self.double.call(self._modified, obj)

    async def _modified(self, obj):
        self.double._write("configmaps", NS, obj, "MODIFIED")

    def text(self, name="gpuhub-policy") -> str:
        return self.double.get("configmaps", NS, name)["data"]["profiles.yaml"]


async def scenario(core, edit, text_of, tmp_path):
    """Seed, apply, a kubectl edit, a stale apply, an edit after the watch ran a while."""
    mounted = tmp_path / "mount" / "profiles.yaml"  # what the kubelet mounted at the pod's start
    mounted.parent.mkdir()
    mounted.write_text(POLICY_A)
    mirror = PolicyMirror(
        ConfigMapPolicy("gpuhub-policy", NS, core_api=core), tmp_path / "live" / "profiles.yaml", retry_seconds=0.2
    )
    mirror.seed(mounted)
    assert mirror.path.read_text() == POLICY_A
    mirror.start()
    try:
        write = mirror.writer(asyncio.get_running_loop())
        # An apply (the page's handler runs the writer in its executor thread).
        t0 = time.monotonic()
        previous = await asyncio.to_thread(write, POLICY_B, text_hash(POLICY_A))
        took = time.monotonic() - t0
        assert previous == POLICY_A  # the audit trail's diff starts from what was there
        assert text_of() == POLICY_B
        assert mirror.path.read_text() == POLICY_B  # in force at once, not after the kubelet's sync
        print(f"\n[measure] apply through the ConfigMap: {took * 1000:.0f} ms")

        # Someone runs `kubectl edit`.
        t0 = time.monotonic()
        edit(POLICY_C)
        assert await wait_for(lambda: mirror.path.read_text() == POLICY_C), mirror.path.read_text()
        print(f"[measure] a kubectl edit reached the hub's copy in {(time.monotonic() - t0) * 1000:.0f} ms")

        # An apply previewed against B, after C came in: refused, nothing written.
        with pytest.raises(ConfigMapConflict, match="nothing was written"):
            await asyncio.to_thread(write, POLICY_A, text_hash(POLICY_B))
        assert text_of() == POLICY_C and mirror.path.read_text() == POLICY_C

        # A later edit still arrives.
        edit(POLICY_A)
        assert await wait_for(lambda: mirror.path.read_text() == POLICY_A)
    finally:
        mirror.stop()


@pytest.mark.asyncio(loop_scope="function")
async def test_apply_edit_and_conflict_through_the_configmap_on_the_double(double, tmp_path):
    from kubernetes_asyncio import client

    from double.server import TOKEN

    double.reset()
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gpuhub-policy", "namespace": NS},
        "data": {"profiles.yaml": POLICY_A},
    }
    status, _ = double.create("configmaps", NS, cm)
    assert status == 201
    conf = client.Configuration()
    conf.host = double.url
    conf.api_key = {"BearerToken": TOKEN, "authorization": TOKEN}
    conf.api_key_prefix = {"BearerToken": "Bearer", "authorization": "Bearer"}
    edits = DoubleEdits(double)
    async with client.ApiClient(conf) as api_client:
        await scenario(client.CoreV1Api(api_client), edits.edit, edits.text, tmp_path)
    double.reset()


@pytest.mark.cluster
@pytest.mark.skipif(bool(SKIP), reason=SKIP or "")
@pytest.mark.asyncio(loop_scope="function")
async def test_apply_edit_and_conflict_through_the_configmap_as_the_hubs_account(cluster, tmp_path):
    api_client, CoreV1Api = hub_account_client(cluster)
    async with api_client:
        core = CoreV1Api(api_client)
        await scenario(core, lambda text: kubectl_edit(cluster, text), lambda: configmap_text(cluster), tmp_path)

        # The hub's account reaches that one ConfigMap only.
        other = ConfigMapPolicy("someone-elses", NS, core_api=core)
        with pytest.raises(Exception) as refused:
            await other.read()
        assert getattr(refused.value, "status", None) == 403
        with pytest.raises(Exception) as refused:
            await core.list_namespaced_config_map(NS)  # every ConfigMap: no
        assert getattr(refused.value, "status", None) == 403
    assert configmap_text(cluster, "someone-elses") == "secret: 1\n"
