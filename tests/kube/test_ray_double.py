"""Ray clusters on the API double (issue 24): the same steps as tests/kube/test_ray_real_cluster.py
(real KubeRay v1.5.0 and Kueue v0.19.2), on the double's model of KubeRay and Kueue's
``ray.io/raycluster`` integration (``double/ray.py``), so they run on every clone."""

from __future__ import annotations


import pytest
import requests
from kubernetes_asyncio.client import ApiClient

from double.harness import NAMESPACE
from double.server import TOKEN
from gpuhub_spawner.kube import kueue as K
from gpuhub_spawner.kube.messages import waiting_message
from gpuhub_spawner.kube.ray_manifest import ELASTIC_GATE, MSG_AUTOSCALING_NOT_ELASTIC, WorkerGroup, ray_cluster_manifest
from gpuhub_spawner.policy.access import resolve_choice
from support.hub import waiter

pytestmark = pytest.mark.asyncio(loop_scope="function")
H = {"Authorization": f"Bearer {TOKEN}"}


def _url(double, name=""):
    return f"{double.url}/apis/ray.io/v1/namespaces/{NAMESPACE}/rayclusters" + (f"/{name}" if name else "")


_until = waiter(60, interval=0.05)


def _wl(double, name):
    return next(
        (
            w
            for w in double.list("workloads", NAMESPACE)
            if any(o["kind"] == "RayCluster" and o["name"] == name for o in w["metadata"].get("ownerReferences", []))
        ),
        None,
    )


def _cond(obj, ctype):
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def _manifest(make_spawner, policy_store, name, workers, autoscaling=False):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    policy = policy_store.policy
    policy = policy.model_copy(update={"ray": policy.ray.model_copy(update={"enabled": True, "autoscaling": autoscaling})})
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    return policy, choice, ray_cluster_manifest(name, "alice", policy, choice, pod, workers, namespace=NAMESPACE)


async def test_over_quota_waits_suspended_and_is_admitted_when_the_holder_goes(kube, make_spawner, policy_store):
    double = kube
    policy, choice, first = await _manifest(make_spawner, policy_store, "ray-first", [WorkerGroup("gpu", 2, 1)])
    _, _, second = await _manifest(make_spawner, policy_store, "ray-second", [WorkerGroup("gpu", 2, 1)])
    r = requests.post(_url(double), json=first, headers=H)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["suspend"] is True
    _until(lambda: _cond(_wl(double, "ray-first"), "Admitted").get("status") == "True", 10, "ray-first admitted")
    wl = _wl(double, "ray-first")
    assert [p["name"] for p in wl["spec"]["podSets"]] == ["head", "gpu"] and wl["spec"]["podSets"][1]["count"] == 2
    assert [a["name"] for a in wl["status"]["admission"]["podSetAssignments"]] == ["head", "gpu"]
    assert wl["status"]["admission"]["podSetAssignments"][1]["resourceUsage"]["nvidia.com/gpu"] == "2"
    pods = _until(
        lambda: len(double.pods_of_ray(NAMESPACE, "ray-first")) == 3 and double.pods_of_ray(NAMESPACE, "ray-first"),
        10,
        "head and 2 workers",
    )
    kinds = sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods)
    assert kinds == ["head", "worker", "worker"]
    rc = requests.get(_url(double, "ray-first"), headers=H).json()
    assert rc["spec"]["suspend"] is False and rc["status"]["state"] == "ready"
    # the flavor's node labels on the GPU group's template only (the head stays off GPU nodes)
    assert (
        rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    )
    assert "nvidia.com/gpu.product" not in (rc["spec"]["headGroupSpec"]["template"]["spec"].get("nodeSelector") or {})

    r = requests.post(_url(double), json=second, headers=H)
    assert r.status_code == 201, r.text
    wl2 = _until(
        lambda: _cond(_wl(double, "ray-second"), "QuotaReserved").get("message") and _wl(double, "ray-second"),
        10,
        "ray-second pending",
    )
    msg = _cond(wl2, "QuotaReserved")["message"]
    assert msg.startswith("couldn't assign flavors to pod set gpu: ") and "nvidia.com/gpu in flavor a100" in msg, msg
    assert not double.pods_of_ray(NAMESPACE, "ray-second")
    words = waiting_message(policy, choice, wl2, None, None)
    assert "team Vision Lab" in words, words

    assert requests.delete(_url(double, "ray-first"), headers=H).status_code == 200
    _until(lambda: _cond(_wl(double, "ray-second"), "Admitted").get("status") == "True", 10, "ray-second admitted")
    _until(lambda: len(double.pods_of_ray(NAMESPACE, "ray-second")) == 3, 10, "ray-second's pods")
    assert not double.pods_of_ray(NAMESPACE, "ray-first") and _wl(double, "ray-first") is None
    requests.delete(_url(double, "ray-second"), headers=H)


async def test_kueues_webhook_on_autoscaling_and_preemption_suspends(kube, make_spawner, policy_store):
    double = kube
    _, _, rc = await _manifest(make_spawner, policy_store, "ray-elastic", [WorkerGroup("gpu", 1, 1)], autoscaling=True)
    bare = {**rc, "metadata": {**rc["metadata"], "name": "ray-bare", "annotations": {}}}
    r = requests.post(_url(double), json=bare, headers=H)
    assert r.status_code == 403 and MSG_AUTOSCALING_NOT_ELASTIC in r.json()["message"], r.text
    r = requests.post(_url(double), json=rc, headers=H)
    assert r.status_code == 201, r.text
    assert {"name": ELASTIC_GATE} in r.json()["spec"]["headGroupSpec"]["template"]["spec"]["schedulingGates"]
    before = {
        p["metadata"]["name"]
        for p in _until(
            lambda: len(double.pods_of_ray(NAMESPACE, "ray-elastic")) == 2 and double.pods_of_ray(NAMESPACE, "ray-elastic"),
            10,
            "its pods",
        )
    }
    # Preempted: suspended, its pods deleted, its Workload requeued; with the quota free it is
    # admitted again at once and gets new pods.
    double.preempt_ray(NAMESPACE, "ray-elastic")
    wl = _wl(double, "ray-elastic")
    assert [e["reason"] for e in wl["status"]["schedulingStats"]["evictions"]] == [K.EVICTED_BY_PREEMPTION]
    after = _until(
        lambda: len(double.pods_of_ray(NAMESPACE, "ray-elastic")) == 2 and double.pods_of_ray(NAMESPACE, "ray-elastic"),
        10,
        "new pods after re-admission",
    )
    assert not before & {p["metadata"]["name"] for p in after}
    double.set_kueue(False)
    try:
        r = requests.post(_url(double), json={**rc, "metadata": {**rc["metadata"], "name": "ray-down"}}, headers=H)
        assert r.status_code == 500 and 'failed calling webhook "mraycluster.kb.io"' in r.json()["message"]
    finally:
        double.set_kueue(True)


async def test_a_batch_priority_cluster_is_suspended_for_an_interactive_one(kube, make_spawner, policy_store):
    """As on the real control plane (test_ray_real_cluster.py): vision's withinClusterQueue:
    LowerPriority suspends the batch cluster, its pods go, the interactive one is admitted."""
    double = kube
    _, _, low = await _manifest(make_spawner, policy_store, "ray-batch", [WorkerGroup("gpu", 2, 1)])
    low["metadata"]["labels"][K.PRIORITY_LABEL] = "batch"
    _, _, high = await _manifest(make_spawner, policy_store, "ray-interactive", [WorkerGroup("gpu", 2, 1)])
    assert requests.post(_url(double), json=low, headers=H).status_code == 201
    _until(lambda: len(double.pods_of_ray(NAMESPACE, "ray-batch")) == 3, 10, "the batch cluster's pods")
    assert requests.post(_url(double), json=high, headers=H).status_code == 201
    _until(lambda: _cond(_wl(double, "ray-interactive"), "Admitted").get("status") == "True", 10, "the interactive one admitted")
    wl = _wl(double, "ray-batch")
    assert _cond(wl, K.PREEMPTED).get("status") == "True", wl["status"]
    assert "due to prioritization in the ClusterQueue; preemptor path: /research/vision" in _cond(wl, K.PREEMPTED)["message"]
    assert requests.get(_url(double, "ray-batch"), headers=H).json()["spec"]["suspend"] is True
    assert not double.pods_of_ray(NAMESPACE, "ray-batch")
    _until(lambda: len(double.pods_of_ray(NAMESPACE, "ray-interactive")) == 3, 10, "the interactive cluster's pods")
