"""The GPU capacity keeper inside a real hub, on the API double (issue 23; kube/capacity.py).

A real JupyterHub with the Kubernetes spawner, the ledger and the keeper as
``hub.extraConfig`` starts them (``wiring/kube.configure_ledger``), against the double: the
L4 node of ``tests/cluster/nodes.yaml`` (4 GPUs) loses one allocatable GPU, as the kubelet
reports a device the NVIDIA device plugin marked unhealthy. Vision's quota (designated:
``capacityQueue: {l4: vision}``) drops from 2 to 1, so bob, who would have fitted next to
alice, waits, and his spawn page says GPUs are out of service. The GPU back: the quota
is restored and bob's server starts.
"""

from __future__ import annotations

import copy
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from backends import l4_policy, l4_policy
from double.harness import KUBECONFIG, apply_policy
from support.hub import Hub
from test_hub_e2e import KUBE_CONFIG, WAIT, pods, until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

pytestmark = pytest.mark.integration

NODE = "kwok-gpu-l4-1"
L4_NODE = next(
    n
    for n in yaml.safe_load_all((Path(__file__).resolve().parents[1] / "cluster" / "nodes.yaml").read_text())
    if n["metadata"]["name"] == NODE
)

POLICY = l4_policy(
    """\
priorityClasses:
  - {name: interactive, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 2}}}
    perUser: {maxServers: 1, maxGPUs: 1}
profiles:
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
health:
  kubernetes:
    capacityQueue: {l4: vision}
    syncInterval: 1s
""",
    virtual=1,
    tolerations=False,
)


def l4_node(allocatable: int) -> dict:
    node = copy.deepcopy(L4_NODE)
    node["status"]["allocatable"]["nvidia.com/gpu"] = str(allocatable)
    return node


def vision_l4_quota(double) -> str:
    cq = next(q for q in double.list("clusterqueues", None) if q["metadata"]["name"] == "vision")
    return next(f for g in cq["spec"]["resourceGroups"] for f in g["flavors"] if f["name"] == "l4")["resources"][0][
        "nominalQuota"
    ]


@pytest.fixture(scope="module")
def capacity_hub(double, tmp_path_factory):
    double.reset()
    apply_policy(double, POLICY)
    double.put_node(l4_node(4))
    hub = Hub(tmp_path_factory.mktemp("capacity-hub"), POLICY, extra_config=KUBE_CONFIG, env={"KUBECONFIG": str(KUBECONFIG)})
    try:
        hub.start()
        yield hub
    finally:
        hub.stop()
        double.reset()


def test_a_gpu_out_of_service_makes_a_waiting_user_told_and_its_return_starts_him(capacity_hub, double):
    alice, bob = capacity_hub.login("alice"), capacity_hub.login("bob")
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready()

    # The device plugin marks one of the node's 4 L4s unhealthy: the keeper inside the hub
    # lowers vision's quota from 2 to 1 within its sync interval.
    double.put_node(l4_node(3))
    until(lambda: vision_l4_quota(double) == "1", 30, "vision's L4 quota lowered by the hub's keeper", hub=capacity_hub)

    pending = bob.start_background("l4-1")
    events: list[dict] = []
    pool = ThreadPoolExecutor(1)
    reading = pool.submit(
        bob.progress, until=lambda e: events.append(e) or bool(e.get("ready") or e.get("failed")), timeout=3 * WAIT
    )
    pool.shutdown(wait=False)
    waiting = until(
        lambda: next((e["message"] for e in list(events) if "out of service" in e.get("message", "")), None),
        WAIT,
        "bob told GPUs are out of service",
        hub=capacity_hub,
    )
    assert "1 of 4 L4 24GB GPUs on the cluster is out of service (failed or drained)." in waiting, events
    [bob_pod] = pods(double, "bob")
    assert bob_pod["spec"].get("schedulingGates"), "bob's pod should wait in Kueue while the quota is lowered"

    # The GPU is back: the quota is the policy's again and bob's server starts.
    double.put_node(l4_node(4))
    until(lambda: vision_l4_quota(double) == "2", 30, "vision's L4 quota restored", hub=capacity_hub)
    bob.wait_ready()
    assert pending.result(timeout=WAIT).status_code in (201, 202)
    reading.result(timeout=WAIT)
    assert events[-1].get("ready") is True, events
    alice.stop()
    bob.stop()
