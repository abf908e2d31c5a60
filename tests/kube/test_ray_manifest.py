"""Ray clusters on Kubernetes (issue 24): the RayCluster gpuhub hands to KubeRay and Kueue.

Built from the user's server pod exactly as KueueSpawner makes it (the real KubeSpawner
code path), then checked against the real contracts: KubeRay v1.5.0's RayCluster CRD
(``openAPIV3Schema``, unknown fields rejected; read from the operator's Go module, never
copied here: skipped with the reason when absent), kubernetes-validate (strict) for every
pod template, and the Kueue v0.19.2 Workload CRD for the Workload Kueue derives from it.
The real operator and Kueue run in tests/kube/test_ray_real_cluster.py.
"""

from __future__ import annotations

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from double.schemas import InvalidObject, kuberay_crds, validate, validate_core
from gpuhub_spawner.kube.kueue import PRIORITY_LABEL, QUEUE_LABEL
from gpuhub_spawner.kube.ray_manifest import (
    ELASTIC_ANNOTATION,
    MAX_POD_SETS,
    MAX_WORKER_GROUPS,
    WorkerGroup,
    pod_set_counts,
    ray_cluster_manifest,
    workload_for,
)
from gpuhub_spawner.policy.access import resolve_choice

# (no module-wide asyncio mark: asyncio_mode = auto runs the async tests, and one test is not async)


def _crds_or_skip():
    try:
        return kuberay_crds()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _with_ray(policy, **rules):
    ray = policy.ray.model_copy(update={"enabled": True, **rules})
    return policy.model_copy(update={"ray": ray})


async def server_pod(spawner) -> dict:
    await spawner.load_user_options()
    return ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())


ONE_GPU_GROUP = (WorkerGroup("gpu", 2, 1),)


async def _cluster(make_spawner, policy_store, autoscaling=False, workers=ONE_GPU_GROUP, **rules):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = _with_ray(policy_store.policy, autoscaling=autoscaling, **rules)
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    return (
        policy,
        choice,
        pod,
        ray_cluster_manifest("ray-alice-1", "alice", policy, choice, pod, list(workers), namespace=spawner.namespace),
    )


async def test_head_is_cpu_only_and_workers_carry_the_profiles_gpus_in_the_teams_queue(make_spawner, policy_store):
    _crds_or_skip()
    policy, choice, pod, rc = await _cluster(make_spawner, policy_store)
    validate(rc)  # KubeRay v1.5.0's CRD, strict, and each pod template with kubernetes-validate
    meta, spec = rc["metadata"], rc["spec"]
    assert rc["apiVersion"] == "ray.io/v1" and meta["namespace"] == "gpuhub-users"
    assert meta["labels"][QUEUE_LABEL] == choice.team.local_queue and meta["labels"][PRIORITY_LABEL] == choice.priority_class
    assert spec["suspend"] is True and ELASTIC_ANNOTATION not in meta["annotations"] and "enableInTreeAutoscaling" not in spec
    assert meta["annotations"]["gpuhub/user"] == "alice"
    head = spec["headGroupSpec"]["template"]
    hc = head["spec"]["containers"][0]
    sc = pod["spec"]["containers"][0]
    assert hc["resources"] == {
        "requests": {"cpu": "1", "memory": str(2 * 2**30)},
        "limits": {"cpu": "1", "memory": str(2 * 2**30)},
    }
    flavor = policy.flavor(choice.flavor)
    assert not set(flavor.node_labels) & set((head["spec"].get("nodeSelector") or {}))  # not pinned to GPU nodes
    henv = {e["name"]: e.get("value") for e in hc["env"]}
    assert henv["NVIDIA_VISIBLE_DEVICES"] == "void" and henv["GPUHUB_GPU_COUNT"] == "0"
    (wg,) = spec["workerGroupSpecs"]
    wc = wg["template"]["spec"]["containers"][0]
    assert wg["replicas"] == wg["minReplicas"] == wg["maxReplicas"] == 2
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == "1" == wc["resources"]["requests"]["nvidia.com/gpu"]
    assert wc["resources"]["limits"]["cpu"] == sc["resources"]["limits"]["cpu"]
    assert wg["template"]["spec"].get("nodeSelector") == pod["spec"].get("nodeSelector")  # the flavor's placement
    assert wc["image"] == hc["image"] == sc["image"]
    for c in (hc, wc):
        env = {e["name"]: e.get("value") for e in c["env"]}
        # The user's identity and MLflow wiring as in their server's pod; no server credential.
        assert env["GPUHUB_USER"] == "alice" and env["GPUHUB_TEAM"] == "vision" and env["GPUHUB_RAY_CLUSTER"] == "ray-alice-1"
        assert "JUPYTERHUB_API_TOKEN" not in env and "JUPYTERHUB_CLIENT_ID" not in env
        for e in sc["env"]:
            if e["name"].startswith("MLFLOW_"):
                assert env.get(e["name"]) == e.get("value"), e["name"]
        assert "command" not in c and "args" not in c and "ports" not in c and "startupProbe" not in c
    for tmpl in (head, wg["template"]):
        # Kueue manages the RayCluster; its pods must not join the plain-pod integration too.
        assert QUEUE_LABEL not in tmpl["metadata"]["labels"] and PRIORITY_LABEL not in tmpl["metadata"]["labels"]
        assert tmpl["metadata"]["labels"]["component"] != "singleuser-server"
        assert tmpl["metadata"]["labels"].get("app.kubernetes.io/component") != "singleuser-server"
    # The Workload Kueue makes of it (head + one pod set per worker group) is valid for v0.19.2.
    wl = workload_for(rc, policy.priority_value(choice.priority_class))
    validate(wl)
    assert [p["name"] for p in wl["spec"]["podSets"]] == ["head", "gpu"] and pod_set_counts(rc) == {"head": 1, "gpu": 2}


async def test_with_fairness_between_users_a_ray_cluster_queues_in_its_users_own_localqueue(make_spawner, policy_store):
    from gpuhub_spawner.kube.kueue import QUEUE_LABEL
    from gpuhub_spawner.kube.render import user_queue_name
    from gpuhub_spawner.policy.model import FairShare

    policy, choice, pod, _ = await _cluster(make_spawner, policy_store)
    policy = policy.model_copy(update={"fair_share": FairShare(users=True)})
    rc = ray_cluster_manifest("r", "alice", policy, choice, pod, list(ONE_GPU_GROUP))
    assert rc["metadata"]["labels"][QUEUE_LABEL] == user_queue_name(choice.team, "alice") != choice.team.local_queue


async def test_autoscaling_only_where_the_policy_allows_it(make_spawner, policy_store):
    _crds_or_skip()
    _, _, _, rc = await _cluster(make_spawner, policy_store, autoscaling=True)
    validate(rc)
    assert rc["metadata"]["annotations"][ELASTIC_ANNOTATION] == "true" and rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["workerGroupSpecs"][0]["minReplicas"] == 0
    # KubeRay's autoscaler sidecar gets the head container's securityContext (Pod Security
    # `restricted` in the users' namespace would refuse the head pod otherwise)
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert rc["spec"]["autoscalerOptions"] == {"securityContext": head["securityContext"]}
    assert head["securityContext"]["runAsNonRoot"] is True and head["securityContext"]["allowPrivilegeEscalation"] is False
    policy, choice, pod, _ = await _cluster(make_spawner, policy_store, autoscaling=False)
    rc = ray_cluster_manifest("r", "alice", policy, choice, pod, [WorkerGroup("gpu", 1, 1)], autoscaling=True)
    assert ELASTIC_ANNOTATION not in rc["metadata"]["annotations"]  # a request cannot widen the policy


async def test_worker_groups_are_bounded_by_kueues_pod_sets(make_spawner, policy_store, schemas_dir):
    policy, choice, pod, _ = await _cluster(make_spawner, policy_store)
    # The limit is the Workload CRD's own (v0.19.2: 18 pod sets), the head one of them.
    wl_crd = (
        yaml.safe_load((schemas_dir / "kueue-v0.19.2" / "kueue.x-k8s.io_workloads.yaml").read_text())
        if (schemas_dir / "kueue-v0.19.2" / "kueue.x-k8s.io_workloads.yaml").exists()
        else None
    )
    if wl_crd is not None:
        v = next(v for v in wl_crd["spec"]["versions"] if v["name"] == "v1beta2")
        assert v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["podSets"]["maxItems"] == MAX_POD_SETS
    groups = [WorkerGroup(f"g{i}", 1, 1) for i in range(MAX_WORKER_GROUPS)]
    rc = ray_cluster_manifest("r", "alice", policy, choice, pod, groups, namespace="gpuhub-users")
    assert len(workload_for(rc)["spec"]["podSets"]) == MAX_POD_SETS
    with pytest.raises(ValueError, match="at most"):
        ray_cluster_manifest("r", "alice", policy, choice, pod, groups + [WorkerGroup("one-more", 1, 1)])
    with pytest.raises(ValueError, match="head"):
        ray_cluster_manifest("r", "alice", policy, choice, pod, [WorkerGroup("head", 1, 1)])


async def test_policy_image_and_head_resources(make_spawner, policy_store):
    _crds_or_skip()
    from gpuhub_spawner.policy.model import RayHeadResources

    _, _, _, rc = await _cluster(
        make_spawner,
        policy_store,
        image="rayproject/ray:2.49.0-gpu",
        head_resources=RayHeadResources(cpu="500m", memory=3 * 2**30),
    )
    validate(rc)
    hc = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    wc = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert hc["image"] == wc["image"] == "rayproject/ray:2.49.0-gpu"
    assert {e["name"]: e.get("value") for e in wc["env"]}["GPUHUB_IMAGE"] == "rayproject/ray:2.49.0-gpu"
    assert hc["resources"]["limits"] == {"cpu": "500m", "memory": str(3 * 2**30)}


def test_the_crd_check_is_strict():
    _crds_or_skip()
    bad = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "x", "namespace": "n"},
        "spec": {
            "headGroupSpec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}},
            "workerGroupSpecs": [{"groupName": "w", "replicas": 1}],
            "notAField": 1,
        },
    }
    with pytest.raises(InvalidObject) as e:
        validate(bad)
    assert "notAField" in str(e.value) and "minReplicas" in str(e.value)
    with pytest.raises(InvalidObject):
        validate_core(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "imag": "i"}]}}
        )
