"""Which nodes' GPUs failed and whose servers sit on them (kube/capacity.py, issue 23): the pure
part, without a cluster. The hub end to end: test_gpu_health_kube_e2e.py."""

from __future__ import annotations

import asyncio

from gpuhub_spawner.kube.capacity import CapacityKeeper, NodeFault, node_faults, pod_failures
from gpuhub_spawner.policy.loader import parse_policy

POLICY = parse_policy("""\
apiVersion: gpuhub/v1
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}, local: {virtual: 1}}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 2}}}}
profiles:
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}
health:
  kubernetes:
    taints: [nvidia.com/gpu-error, example.com/gpu-check]
""")


def node(name: str, *taints: dict, unschedulable: bool = False) -> dict:
    spec = {"taints": list(taints)} if taints else {}
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "metadata": {"name": name},
        "spec": spec,
        "status": {"capacity": {"nvidia.com/gpu": "4"}, "allocatable": {"nvidia.com/gpu": "4"}},
    }


def pod(
    name: str, user: str, node_name: str, gpus: int = 1, server: str = "", phase: str = "Running", labels: dict | None = None
) -> dict:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "1"}
    return {
        "metadata": {
            "name": name,
            "labels": labels or {},
            "annotations": {"hub.jupyter.org/username": user, "hub.jupyter.org/servername": server},
        },
        "spec": {"nodeName": node_name, "containers": [{"name": "notebook", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


def test_a_health_taint_that_keeps_pods_off_is_a_failed_node_and_anything_else_is_not():
    nodes = [
        node("a", {"key": "nvidia.com/gpu-error", "value": "XID79", "effect": "NoSchedule"}),
        node("b", {"key": "example.com/gpu-check", "effect": "NoExecute", "timeAdded": "2026-12-02T04:00:00Z"}),
        node("c", {"key": "nvidia.com/gpu-error", "value": "XID79", "effect": "PreferNoSchedule"}),
        node("d", {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}),
        node("e", unschedulable=True),  # a cordon is maintenance, not a failure: counted out of quota, nobody told
        node("f"),
    ]
    faults = node_faults(POLICY, nodes, now=1000.0)
    assert sorted(faults) == ["a", "b"]
    assert faults["a"] == NodeFault("a", "nvidia.com/gpu-error=XID79", "NoSchedule", 1000.0)
    assert faults["a"].reason == "node a: nvidia.com/gpu-error=XID79"
    assert faults["b"].since == 1796184000.0 and faults["b"].reason == "node b: example.com/gpu-check"  # timeAdded
    # A later pass keeps when it was first seen; a different taint value is a new failure.
    assert node_faults(POLICY, nodes, before=faults, now=2000.0)["a"].since == 1000.0
    nodes[0]["spec"]["taints"][0]["value"] = "XID48"
    assert node_faults(POLICY, nodes, before=faults, now=2000.0)["a"].since == 2000.0


def test_only_the_users_own_gpu_servers_on_a_failed_node_are_told():
    faults = {"a": NodeFault("a", "nvidia.com/gpu-error=XID79", "NoSchedule", 1000.0)}
    pods = [
        pod("jupyter-alice", "alice", "a"),
        pod("jupyter-alice-big", "alice", "a", server="big"),
        pod("jupyter-alice-cpu", "alice", "a", gpus=0, server="cpu"),  # holds no GPU
        pod("jupyter-alice-other", "alice", "f", server="other"),  # a healthy node
        pod("jupyter-alice-done", "alice", "a", server="done", phase="Failed"),  # no longer runs
        pod("job-1-abcde", "alice", "a", labels={"gpuhub/job": "job-1"}),  # a job's attempt ends gpu-failed instead
        pod("ray-1-head", "alice", "a", labels={"gpuhub/ray-cluster": "ray-1"}),
        pod("jupyter-bob", "bob", "a"),
    ]
    told = pod_failures(POLICY, pods, faults, "alice")
    assert told == [
        {"server": "", "devices": ["node a"], "since": 1000.0, "reason": "node a: nvidia.com/gpu-error=XID79", "xid": None},
        {"server": "big", "devices": ["node a"], "since": 1000.0, "reason": "node a: nvidia.com/gpu-error=XID79", "xid": None},
    ]
    assert [f["server"] for f in pod_failures(POLICY, pods, faults, "bob")] == [""]
    assert pod_failures(POLICY, pods, {}, "alice") == []


def test_the_keeper_wakes_long_polls_when_the_failed_nodes_change():
    async def run():
        keeper = CapacityKeeper(lambda: POLICY)
        assert await keeper.wait_change(0.05) is False
        waiting = asyncio.ensure_future(keeper.wait_change(30))
        await asyncio.sleep(0)
        keeper._set_faults({"a": NodeFault("a", "nvidia.com/gpu-error", "NoSchedule", 1.0)})
        assert await asyncio.wait_for(waiting, 5) is True
        same = asyncio.ensure_future(keeper.wait_change(0.2))
        keeper._set_faults({"a": NodeFault("a", "nvidia.com/gpu-error", "NoSchedule", 1.0)})  # no change
        assert await same is False

    asyncio.run(run())
