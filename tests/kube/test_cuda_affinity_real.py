"""A profile's ``gpu.cuda`` on Kubernetes, on the real scheduler (``GPUHUB_CLUSTER=1``): the
required node affinity KueueSpawner gives the pod (``kube.spawner.cuda_node_terms``) sends it to
a node whose driver supports the CUDA (GPU feature discovery's labels), never to an older one;
a CUDA no node supports leaves it Pending with the scheduler's reason. Two kwok nodes made for
this test, tainted so nothing else lands on them. Skipped with the reason otherwise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

from gpuhub_spawner.kube.spawner import cuda_node_terms  # noqa: E402

SKIP = real.skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

NS = "gpuhub-cuda-test"
TAINT = {"key": "gpuhub-test/cuda", "value": "only", "effect": "NoSchedule"}


def node(name: str, cuda: str, cidr: str) -> dict:
    major, minor = cuda.split(".")
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "type": "kwok",
                "nvidia.com/cuda.runtime-version.major": major,
                "nvidia.com/cuda.runtime-version.minor": minor,
                "nvidia.com/cuda.runtime-version.full": cuda,
            },
        },
        "spec": {"taints": [TAINT], "podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "10"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "10"},
        },
    }


def pod(name: str, major: int, minor: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [{"name": "notebook", "image": "registry.example.com/torch:cu128"}],
            "tolerations": [{"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": cuda_node_terms(major, minor)}
                }
            },
        },
    }


@pytest.fixture(scope="module")
def cluster(real_cluster):
    cluster = real_cluster
    nodes = [node("kwok-cuda-12-2", "12.2", "127.3.1.0/24"), node("kwok-cuda-12-8", "12.8", "127.3.2.0/24")]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(nodes))
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", check=False)
    cluster.ensure_namespace(NS)
    yield cluster
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)
    cluster.kubectl("delete", "node", "kwok-cuda-12-2", "kwok-cuda-12-8", "--ignore-not-found", check=False)


def placed(cluster, name: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = json.loads(cluster.kubectl("-n", NS, "get", "pod", name, "-o", "json").stdout)
        if p["spec"].get("nodeName"):
            return p["spec"]["nodeName"]
        time.sleep(0.2)
    return ""


def test_the_pod_goes_only_to_a_node_whose_driver_runs_its_cuda(cluster):
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([pod("needs-12-8", 12, 8), pod("needs-12-0", 12, 0)]))
    assert placed(cluster, "needs-12-8") == "kwok-cuda-12-8"
    assert placed(cluster, "needs-12-0") in ("kwok-cuda-12-2", "kwok-cuda-12-8")


def test_a_cuda_no_node_runs_stays_pending_with_the_schedulers_reason(cluster):
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod("needs-13-0", 13, 0)))
    deadline = time.monotonic() + 60
    reason = ""
    while time.monotonic() < deadline and "affinity" not in reason:
        events = json.loads(
            cluster.kubectl("-n", NS, "get", "events", "--field-selector", "involvedObject.name=needs-13-0", "-o", "json").stdout
        )["items"]
        reason = " ".join(e.get("message", "") for e in events if e.get("reason") == "FailedScheduling")
        time.sleep(0.3)
    assert "didn't match Pod's node affinity/selector" in reason, reason
    assert placed(cluster, "needs-13-0", timeout=1) == ""
