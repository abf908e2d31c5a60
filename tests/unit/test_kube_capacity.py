"""kube/capacity.py without a cluster: what counts as out of service, the designated queue's
quota, the ClusterQueue patch, the waiting message, the policy's located errors."""

import pytest

from gpuhub_spawner.kube.capacity import lowered_groups, out_of_service, target_quota
from gpuhub_spawner.kube.messages import waiting_message
from gpuhub_spawner.kube.render import render_objects
from gpuhub_spawner.policy.access import resolve_choice
from gpuhub_spawner.policy.loader import PolicyError, parse_policy

POLICY = """\
flavors:
  - {name: l4, displayName: L4, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}}
  - {name: a100, displayName: A100, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: A100}}
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {l4: 2, a100: 8}}}
  - {name: shared, groups: [s], cohort: lab, quota: {gpus: {l4: {nominal: 6, lendingLimit: 6}}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
health:
  kubernetes:
    capacityQueue: {l4: shared}
"""


def node(name, product, gpus, allocatable=None, taints=(), cordoned=False):
    return {
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product}},
        "spec": {"taints": list(taints), **({"unschedulable": True} if cordoned else {})},
        "status": {
            "capacity": {"nvidia.com/gpu": str(gpus), "cpu": "32"},
            "allocatable": {"nvidia.com/gpu": str(gpus if allocatable is None else allocatable), "cpu": "32"},
        },
    }


def test_what_the_cluster_says_is_counted_per_flavor():
    policy = parse_policy(POLICY)
    nodes = [
        node("l4-a", "NVIDIA-L4", 4, allocatable=3),  # the device plugin marked one unhealthy
        node("l4-b", "NVIDIA-L4", 4, taints=[{"key": "nvidia.com/gpu-error", "value": "xid79", "effect": "NoSchedule"}]),
        node("l4-c", "NVIDIA-L4", 4, taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),  # the usual GPU taint
        node("a100-a", "A100", 8, cordoned=True),
        node("cpu", "none", 0),
    ]
    out = out_of_service(policy, nodes)
    assert (out["l4"].total, out["l4"].out) == (12, 5)
    assert out["l4"].why == ["l4-a: 1 unhealthy (allocatable 3 of 4)", "l4-b: tainted nvidia.com/gpu-error=xid79 (4 GPUs)"]
    assert (out["a100"].total, out["a100"].out, out["a100"].why) == (8, 8, ["a100-a: cordoned (8 GPUs)"])
    # a PreferNoSchedule health taint does not keep pods off: not counted
    soft = node("l4-d", "NVIDIA-L4", 4, taints=[{"key": "nvidia.com/gpu-error", "effect": "PreferNoSchedule"}])
    assert out_of_service(policy, [soft])["l4"].out == 0


def test_the_designated_queue_gives_up_what_is_out_and_gets_it_back():
    policy = parse_policy(POLICY)
    cq = next(o for o in render_objects(policy) if o["kind"] == "ClusterQueue" and o["metadata"]["name"] == "shared")
    groups = cq["spec"]["resourceGroups"]
    assert target_quota(policy, "l4", 5) == ("shared", 1, 1, 0)
    lowered = lowered_groups(groups, "l4", "nvidia.com/gpu", 1, 1, True)
    l4 = next(f for g in lowered for f in g["flavors"] if f["name"] == "l4")["resources"][0]
    assert (l4["nominalQuota"], l4["lendingLimit"]) == ("1", "1")  # lendingLimit never above nominal
    assert lowered[0] == groups[0]  # cpu/memory untouched
    assert target_quota(policy, "l4", 9) == ("shared", 0, 0, 3)  # 3 more than it can give up
    back = lowered_groups(lowered, "l4", "nvidia.com/gpu", *target_quota(policy, "l4", 0)[1:3], True)
    assert back == groups
    assert lowered_groups(groups, "l4", "nvidia.com/gpu", 6, 6, True) is None  # nothing to write


def test_the_waiting_message_says_capacity_is_out_of_service():
    policy = parse_policy(POLICY)
    choice = resolve_choice(policy, ["v"], {"profile": "l4-1"})
    wl = {
        "metadata": {"name": "w"},
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Pending",
                    "message": "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor l4, 1 more needed",
                }
            ]
        },
    }
    text = waiting_message(policy, choice, wl, None, None, None, (5, 12))
    assert "5 of 12 L4 GPUs on the cluster are out of service (failed or drained)." in text
    assert "out of service" not in waiting_message(policy, choice, wl, None, None, None, (0, 12))
    # the designated queue lowered to 0: Kueue says it can never fit; the hub says until when
    wl["status"]["conditions"][0]["message"] = (
        "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor l4, previously "
        "considered podsets requests (0) + current podset request (1) > maximum capacity (0)"
    )
    assert "Pick a smaller profile" in waiting_message(policy, choice, wl, None, None, None, None)
    text = waiting_message(policy, choice, wl, None, None, None, (4, 4))
    assert text == (
        "Waiting: 4 of 4 L4 GPUs on the cluster are out of service (failed or drained), so team "
        "Vision Lab's queue cannot fit this server until they are back."
    ), text


@pytest.mark.parametrize(
    "designation, error",
    [
        ("{l4: nlp}", "health.kubernetes.capacityQueue.l4: unknown team 'nlp'"),
        ("{h100: shared}", "health.kubernetes.capacityQueue.h100: unknown flavor 'h100'"),
        ("{a100: shared}", "health.kubernetes.capacityQueue.a100: team 'shared' has no quota for 'a100'"),
    ],
)
def test_a_wrong_designation_is_refused_where_it_is(designation, error):
    text = POLICY.replace("capacityQueue: {l4: shared}", f"capacityQueue: {designation}")
    with pytest.raises(PolicyError) as e:
        parse_policy(text)
    line = text.splitlines().index(f"    capacityQueue: {designation}") + 1
    assert any(error in i.format("p.yaml") and i.format("p.yaml").startswith(f"p.yaml:{line}:") for i in e.value.issues), [
        i.format("p.yaml") for i in e.value.issues
    ]


class _Recorder:
    """The two kubernetes_asyncio clients the keeper uses, recording every call as the API
    request RBAC decides on: (verb, resource, name)."""

    def __init__(self, nodes, cluster_queues):
        self.nodes, self.cqs, self.calls = nodes, cluster_queues, []
        self.api_client = self

    def sanitize_for_serialization(self, obj):
        return obj

    async def list_node(self):
        self.calls.append(("list", "nodes", None))
        return type("NodeList", (), {"items": self.nodes})()

    async def get_cluster_custom_object(self, group, version, plural, name):
        self.calls.append(("get", f"{plural}.{group}", name))
        return self.cqs[name]

    async def patch_cluster_custom_object(self, group, version, plural, name, body, **kw):
        self.calls.append(("patch", f"{plural}.{group}", name))
        return body


def _allowed(rules, verb, resource, name):
    res, _, group = resource.partition(".")
    return any(
        verb in r["verbs"]
        and res in r["resources"]
        and group in r["apiGroups"]
        and (not r.get("resourceNames") or name in r["resourceNames"])
        for r in rules
    )


def test_the_rendered_rbac_is_exactly_what_the_keeper_asks_for():
    """`gpuhub render capacity-rbac`: every request the keeper makes (a pass that lowers the
    designated queue and one that restores it) is allowed, and the ClusterRole grants nothing
    else: list nodes; get/patch of the designated ClusterQueues by name; no other verb,
    resource or queue."""
    import asyncio

    from gpuhub_spawner.kube.capacity import CapacityKeeper
    from gpuhub_spawner.kube.render import capacity_rbac

    policy = parse_policy(POLICY)
    role, binding = capacity_rbac(policy, "gpuhub:hub")
    assert role["kind"] == "ClusterRole" and binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "gpuhub"}]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"], "resourceNames": ["shared"], "verbs": ["get", "patch"]},
    ]
    cqs = {
        o["metadata"]["name"]: dict(o, metadata=dict(o["metadata"], resourceVersion="1"))
        for o in render_objects(policy)
        if o["kind"] == "ClusterQueue"
    }
    api = _Recorder([node("l4-a", "NVIDIA-L4", 4, allocatable=3)], cqs)
    keeper = CapacityKeeper(lambda: policy, core_api=api, custom_api=api)
    asyncio.run(keeper.sync_once())
    api.nodes = [node("l4-a", "NVIDIA-L4", 4)]
    asyncio.run(keeper.sync_once())
    assert ("patch", "clusterqueues.kueue.x-k8s.io", "shared") in api.calls  # it did lower the quota
    assert all(_allowed(role["rules"], *c) for c in api.calls), api.calls
    used = {(v, r.split(".")[0]) for v, r, _ in api.calls}
    granted = {(v, res) for r in role["rules"] for v in r["verbs"] for res in r["resources"]}
    assert granted == used  # nothing granted that the keeper does not use

    two = parse_policy(POLICY.replace("capacityQueue: {l4: shared}", "capacityQueue: {l4: shared, a100: vision}"))
    assert capacity_rbac(two)[0]["rules"][1]["resourceNames"] == ["shared", "vision"]
    none = parse_policy(POLICY.replace("capacityQueue: {l4: shared}", "capacityQueue: {}"))
    assert capacity_rbac(none)[0]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    with pytest.raises(ValueError):
        capacity_rbac(policy, "hub")
