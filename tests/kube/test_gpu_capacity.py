"""GPUs out of service lower the quota Kueue admits against, and restoring them restores it
(issue 23 item 3; kube/capacity.py), on the API double and on the real control plane.

The same steps on both backends: the hub's ``CapacityKeeper`` (its own code, through
kubernetes_asyncio with the backend's kubeconfig) reads the L4 node, and its ClusterQueue
patch is what Kueue then admits against: on the real side the real Kueue v0.19.2 controller
and a kwok node (its status and taints written as the device plugin, NVSentinel or an operator
would), on the double the double's admission loop and a Node from ``tests/cluster/nodes.yaml``.
The real side is opt-in (``GPUHUB_CLUSTER=1``) and skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402

from double.harness import KUBECONFIG as DOUBLE_KUBECONFIG, NAMESPACE  # noqa: E402
from backends import VISION_ON_L4  # noqa: E402
from support.hub import waiter

NODE = "kwok-gpu-l4-1"
L4_NODE = next(n for n in yaml.safe_load_all((Path(real.HERE) / "nodes.yaml").read_text()) if n["metadata"]["name"] == NODE)

POLICY = (
    VISION_ON_L4
    + """\
health:
  kubernetes:
    capacityQueue: {l4: vision}
"""
)


until = waiter(60)


class Backend:
    def __init__(self, name, api: real.RealCluster, kubeconfig: Path, set_node):
        self.name, self.api, self.kubeconfig, self._set_node = name, api, kubeconfig, set_node

    def node(self, allocatable: int = 4, taint: str | None = None, cordoned: bool = False) -> None:
        """The L4 node as the device plugin (allocatable), NVSentinel (taint) or an admin (cordon) leave it."""
        self._set_node(allocatable, taint, cordoned)

    def l4_quota(self) -> tuple[str, str | None]:
        cq = self.api.get(self.api.path("clusterqueues", None, "vision"))
        l4 = next(f for g in cq["spec"]["resourceGroups"] for f in g["flavors"] if f["name"] == "l4")
        return l4["resources"][0]["nominalQuota"], (cq["metadata"].get("annotations") or {}).get("gpuhub.io/gpus-out-of-service")

    def pod(self, name: str) -> None:
        self.api.create(
            "pods",
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": {"kueue.x-k8s.io/queue-name": "vision", "kueue.x-k8s.io/priority-class": "interactive"},
                },
                "spec": real.restricted(
                    {
                        "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 1,
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [
                            {
                                "name": "notebook",
                                "image": "registry.example.com/gpuhub/notebook:cuda-0.1.0",
                                "command": ["sleep", "600"],
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": "1"},
                                    "limits": {"nvidia.com/gpu": "1"},
                                },
                            }
                        ],
                    }
                ),
            },
        )

    def quota_reserved(self, pod_name: str) -> dict | None:
        wl = next(
            (
                w
                for w in self.api.list("workloads", NAMESPACE)
                if any(o["name"] == pod_name for o in w["metadata"].get("ownerReferences", []))
            ),
            None,
        )
        return next((c for c in (wl or {}).get("status", {}).get("conditions", []) if c["type"] == "QuotaReserved"), None)

    def admitted(self, pod_name: str) -> bool:
        c = self.quota_reserved(pod_name)
        return bool(c and c["status"] == "True")


def node_object(allocatable: int, taint: str | None, cordoned: bool) -> dict:
    node = copy.deepcopy(L4_NODE)
    node["status"]["allocatable"]["nvidia.com/gpu"] = str(allocatable)
    if taint:
        node["spec"]["taints"].append({"key": taint, "value": "xid79", "effect": "NoSchedule"})
    if cordoned:
        node["spec"]["unschedulable"] = True
    return node


# real_cluster: the session's one real control plane (tests/kube/conftest.py)


@pytest.fixture(params=["double", "real"])
def backend(request, tmp_path):
    if request.param == "real":
        cluster = request.getfixturevalue("real_cluster")
        cluster.ensure_namespace(NAMESPACE)  # the install-guide test deletes and recreates it
        cluster.reset(NAMESPACE)
        cluster.apply_policy(POLICY, NAMESPACE, tmp_path)

        def set_node(allocatable, taint, cordoned):
            want = node_object(allocatable, taint, cordoned)
            # What a kubelet reports (status subresource) and what kubectl taint/cordon write.
            r = cluster.session.patch(
                cluster.url + f"/api/v1/nodes/{NODE}/status",
                json={"status": {"allocatable": want["status"]["allocatable"]}},
                headers={"Content-Type": "application/merge-patch+json"},
                timeout=15,
            )
            r.raise_for_status()
            cluster.patch(
                "nodes", None, NODE, {"spec": {"taints": want["spec"]["taints"], "unschedulable": True if cordoned else None}}
            )

        b = Backend("real", cluster, cluster.kubeconfig, set_node)
        yield b
        for name in [p["metadata"]["name"] for p in cluster.list("pods", NAMESPACE)]:
            cluster.delete("pods", NAMESPACE, name, grace=0)
        set_node(4, None, False)
        cluster.reset(NAMESPACE)
    else:
        from double.harness import apply_policy
        from double.server import TOKEN

        double = request.getfixturevalue("double")
        apply_policy(double, POLICY)
        b = Backend(
            "double",
            real.RealCluster.for_double(double.url, TOKEN),
            DOUBLE_KUBECONFIG,
            lambda *a: double.put_node(node_object(*a)),
        )
        b.node()
        yield b
        double.reset()


def keeper_pass(backend):
    """One pass of the hub's keeper with its own clients on the backend's kubeconfig."""
    from kubernetes_asyncio import client, config

    from gpuhub_spawner.kube.capacity import CapacityKeeper
    from gpuhub_spawner.policy.loader import parse_policy

    policy = parse_policy(POLICY)

    async def run():
        api = await config.new_client_from_config(config_file=str(backend.kubeconfig))
        async with api:
            keeper = CapacityKeeper(lambda: policy, client.CoreV1Api(api), client.CustomObjectsApi(api))
            return (await keeper.sync_once())["l4"]

    return asyncio.run(run())


def test_a_gpu_out_of_service_lowers_the_quota_kueue_admits_against_and_comes_back(backend):
    out = keeper_pass(backend)
    assert (out.total, out.out) == (4, 0)
    assert backend.l4_quota() == ("4", None)

    # The device plugin marks one GPU unhealthy: the kubelet reports allocatable 3 of 4.
    backend.node(allocatable=3)
    out = keeper_pass(backend)
    assert (out.total, out.out) == (4, 1)
    assert backend.l4_quota() == ("3", f"l4=1: {NODE}: 1 unhealthy (allocatable 3 of 4)")
    for i in range(4):
        backend.pod(f"p{i}")
    until(lambda: all(backend.admitted(f"p{i}") for i in range(3)), 60, "three admitted")
    c = until(lambda: (c := backend.quota_reserved("p3")) and c["status"] == "False" and c, 60, "the 4th told why")
    assert "insufficient unused quota for nvidia.com/gpu in flavor l4, 1 more needed" in c["message"], c
    time.sleep(2)
    assert not backend.admitted("p3")  # Kueue admits against 3, not the 4 the policy says

    # The GPU is back: the quota is restored and Kueue admits the 4th.
    backend.node(allocatable=4)
    keeper_pass(backend)
    assert backend.l4_quota() == ("4", None)
    until(lambda: backend.admitted("p3"), 60, "the 4th admitted once the GPU is back")

    # NVSentinel taints the node: all four GPUs are out, the quota goes to 0; a new pod waits.
    backend.node(taint="nvidia.com/gpu-error")
    out = keeper_pass(backend)
    assert backend.l4_quota() == ("0", f"l4=4: {NODE}: tainted nvidia.com/gpu-error=xid79 (4 GPUs)")
    backend.pod("p4")
    until(lambda: (c := backend.quota_reserved("p4")) and c["status"] == "False", 60, "p4 waiting")

    # Cordoned instead: still out; uncordoned and untainted: the policy's quota again.
    backend.node(cordoned=True)
    keeper_pass(backend)
    assert backend.l4_quota() == ("0", f"l4=4: {NODE}: cordoned (4 GPUs)")
    backend.node()
    keeper_pass(backend)
    assert backend.l4_quota() == ("4", None)


@pytest.mark.cluster
def test_the_keeper_runs_as_the_hubs_service_account_with_only_the_rendered_rbac(real_cluster, tmp_path):
    """Real control plane only (the double does not authorize): `gpuhub render capacity-rbac`
    applied as the guide says, the real authorizer answers `kubectl auth can-i` for the hub's
    service account (what the keeper uses: yes; anything else: no), and the keeper itself, with
    that account's token, lowers and restores vision's quota."""
    import json
    import subprocess

    cluster = real_cluster
    cluster.ensure_namespace(NAMESPACE)
    cluster.reset(NAMESPACE)
    cluster.apply_policy(POLICY, NAMESPACE, tmp_path)
    (tmp_path / "profiles.yaml").write_text(POLICY)
    cluster.kubectl("create", "namespace", "gpuhub", check=False)
    cluster.kubectl("-n", "gpuhub", "create", "serviceaccount", "hub", check=False)
    rendered = subprocess.run(
        [
            str(real.VENV_BIN / "gpuhub"),
            "render",
            "capacity-rbac",
            str(tmp_path / "profiles.yaml"),
            "--service-account",
            "gpuhub:hub",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sa = "--as=system:serviceaccount:gpuhub:hub"
    try:
        cluster.kubectl("apply", "-f", "-", input=rendered)
        answers = {}
        for question in [
            "list nodes",
            "watch nodes",
            "get nodes/kwok-gpu-l4-1",
            "patch nodes/kwok-gpu-l4-1",
            "delete nodes/kwok-gpu-l4-1",
            "get clusterqueues.kueue.x-k8s.io/vision",
            "patch clusterqueues.kueue.x-k8s.io/vision",
            "update clusterqueues.kueue.x-k8s.io/vision",
            "delete clusterqueues.kueue.x-k8s.io/vision",
            "patch clusterqueues.kueue.x-k8s.io/nlp",
            "list clusterqueues.kueue.x-k8s.io",
            "patch resourceflavors.kueue.x-k8s.io/l4",
        ]:
            out = cluster.kubectl("auth", "can-i", *question.split(), sa, check=False).stdout.strip()
            answers[question] = out
        assert answers == {
            "list nodes": "yes",
            "watch nodes": "no",
            "get nodes/kwok-gpu-l4-1": "no",
            "patch nodes/kwok-gpu-l4-1": "no",
            "delete nodes/kwok-gpu-l4-1": "no",
            "get clusterqueues.kueue.x-k8s.io/vision": "yes",
            "patch clusterqueues.kueue.x-k8s.io/vision": "yes",
            "update clusterqueues.kueue.x-k8s.io/vision": "no",
            "delete clusterqueues.kueue.x-k8s.io/vision": "no",
            "patch clusterqueues.kueue.x-k8s.io/nlp": "no",
            "list clusterqueues.kueue.x-k8s.io": "no",
            "patch resourceflavors.kueue.x-k8s.io/l4": "no",
        }, answers

        # The keeper with the service account's own token (no admin rights behind it).
        token = cluster.kubectl("-n", "gpuhub", "create", "token", "hub", "--duration=10m").stdout.strip()
        kc = yaml.safe_load(cluster.kubeconfig.read_text())
        kc["users"] = [{"name": "hub", "user": {"token": token}}]
        for ctx in kc["contexts"]:
            ctx["context"]["user"] = "hub"
        sa_kubeconfig = tmp_path / "hub-sa.kubeconfig"
        sa_kubeconfig.write_text(json.dumps(kc))
        b = Backend("real-as-hub", cluster, sa_kubeconfig, None)
        r = cluster.session.patch(
            cluster.url + f"/api/v1/nodes/{NODE}/status",
            json={"status": {"allocatable": {"nvidia.com/gpu": "3"}}},
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=15,
        )
        r.raise_for_status()
        out = keeper_pass(b)
        assert (out.total, out.out) == (4, 1)
        assert b.l4_quota() == ("3", f"l4=1: {NODE}: 1 unhealthy (allocatable 3 of 4)")
    finally:
        r = cluster.session.patch(
            cluster.url + f"/api/v1/nodes/{NODE}/status",
            json={"status": {"allocatable": {"nvidia.com/gpu": "4"}}},
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=15,
        )
    out = keeper_pass(b)
    assert out.out == 0 and b.l4_quota() == ("4", None)
    cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered)
    cluster.reset(NAMESPACE)
