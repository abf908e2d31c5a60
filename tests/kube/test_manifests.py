"""Pod manifests per profile, built by KubeSpawner's own code path, and refusals before any pod."""

from __future__ import annotations

import pytest
from kubernetes_asyncio.client import ApiClient
from tornado import web

from double.schemas import validate
from gpuhub_spawner.kube.kueue import PRIORITY_LABEL, PROFILE_LABEL, QUEUE_LABEL, TEAM_LABEL
from gpuhub_spawner.policy import load_policy

from double.harness import POLICY

pytestmark = pytest.mark.asyncio(loop_scope="function")

CASES = [  # (group, profile) -> team, queue, priority, gpu resource count, node label
    ("vision-lab", "cpu", "vision", "interactive", None),
    ("vision-lab", "a100-1", "vision", "interactive", ("nvidia.com/gpu", "1", "NVIDIA-A100-SXM4-80GB")),
    ("vision-lab", "a100-2", "vision", "interactive", ("nvidia.com/gpu", "2", "NVIDIA-A100-SXM4-80GB")),
    ("nlp-group", "l4-1", "nlp", "interactive", ("nvidia.com/gpu", "1", "NVIDIA-L4")),
    ("students", "l4-1", "students", "batch", ("nvidia.com/gpu", "1", "NVIDIA-L4")),
    ("students", "cpu", "students", "batch", None),
]


async def manifest(spawner) -> dict:
    await spawner.load_user_options()
    pod = await spawner.get_pod_manifest()
    return ApiClient().sanitize_for_serialization(pod)


@pytest.mark.parametrize("group,profile,team,priority,gpu", CASES)
async def test_pod_manifest_for_each_profile(make_spawner, group, profile, team, priority, gpu):
    policy = load_policy(POLICY)
    prof = policy.profile(profile)
    spawner = make_spawner(user="u1", groups=(group,), profile=profile)
    pod = await manifest(spawner)
    pod.setdefault("apiVersion", "v1")
    pod.setdefault("kind", "Pod")
    validate(pod)  # Kubernetes 1.30's schema, strict
    labels = pod["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == team  # the team's LocalQueue
    assert labels[PRIORITY_LABEL] == priority
    assert labels[TEAM_LABEL] == team and labels[PROFILE_LABEL] == profile
    container = pod["spec"]["containers"][0]
    assert container["image"] == prof.image or policy.defaults.image
    res = container["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"]
    assert float(res["requests"]["cpu"]) == prof.cpu / 1000
    assert int(res["requests"]["memory"]) == prof.memory
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUHUB_TEAM"] == team and env["GPUHUB_PROFILE"] == profile and env["GPUHUB_USER"] == "u1"
    if gpu:
        resource, count, product = gpu
        assert res["limits"][resource] == count and res["requests"][resource] == count
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == product
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
        assert env["GPUHUB_GPU_COUNT"] == count
        assert "NVIDIA_VISIBLE_DEVICES" not in env
    else:
        assert not any("gpu" in k for k in res["limits"])
        assert "nvidia.com/gpu.product" not in (pod["spec"].get("nodeSelector") or {})
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # a CUDA image must not see the node's GPUs


async def test_switching_profiles_does_not_leak_gpu_settings(make_spawner):
    spawner = make_spawner(profile="a100-2")
    gpu_pod = await manifest(spawner)
    assert gpu_pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    spawner.user_options = {"profile": "cpu"}
    cpu_pod = await manifest(spawner)
    assert "nvidia.com/gpu" not in cpu_pod["spec"]["containers"][0]["resources"]["limits"]
    assert not cpu_pod["spec"].get("tolerations")
    assert "nvidia.com/gpu.product" not in (cpu_pod["spec"].get("nodeSelector") or {})


@pytest.mark.parametrize(
    "groups,options,status",
    [
        (("students",), {"profile": "a100-1"}, 403),  # another team's profile
        (("vision-lab",), {"profile": "a100-1", "team": "nlp"}, 403),  # a team the user is not in
        (("vision-lab",), {"profile": "cpu", "cpu_limit": "64"}, 400),  # raw KubeSpawner overrides
        (("vision-lab",), {"profile": "does-not-exist"}, 400),
        (("nobody",), {"profile": "cpu"}, 403),
    ],
)
async def test_forged_choices_are_refused_before_any_pod(kube, make_spawner, groups, options, status):
    spawner = make_spawner(groups=groups, profile=None)
    spawner.user_options = options
    with pytest.raises(web.HTTPError) as err:
        await spawner.start()
    assert err.value.status_code == status
    assert kube.count("POST", "pods") == 0
    assert kube.list("pods") == []


async def test_per_user_caps_are_enforced_before_any_pod(kube, make_spawner):
    first = make_spawner(user="sam", groups=("students",), profile="cpu", server_name="one", allow_named_servers=True)
    first._spawn_pending = True  # what the hub marks while a server starts or waits
    second = make_spawner(user="sam", groups=("students",), profile="cpu", server_name="two")
    with pytest.raises(web.HTTPError) as err:
        await second.start()
    assert err.value.status_code == 403
    assert "1 server(s) per user" in err.value.log_message
    assert kube.count("POST", "pods") == 0
