"""MIG slices on the real control plane (``GPUHUB_CLUSTER=1``, issue 25): for each of the NVIDIA
device plugin's two strategies, the example policy's Kueue objects (``gpuhub render kueue``,
applied server-side through Kueue v0.19.2's webhooks) and students' servers built by
KueueSpawner for the ``mig-1g`` profile, as the hub builds them, created in the user namespace:

* real Kueue admits seven of them against the students' quota of seven 1g.10gb slices, on the
  flavor ``a100-1g`` (mixed: resource ``nvidia.com/mig-1g.10gb``; single: ``nvidia.com/gpu``,
  chosen by the flavor's ``nvidia.com/gpu.product`` label over the team's L4 flavor, which has
  free quota for the same resource), and the real kube-scheduler binds each to the kwok node
  advertising that strategy's slices (``tests/cluster/nodes-mig.yaml``, added by the harness
  for this file only);
* an eighth waits, gated, with Kueue's message naming the resource and the flavor, and the
  hub's words made from it name a slice; when one student stops, the eighth is admitted and
  bound to the MIG node.

No container runs (kwok reports the pods Running). Skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

from double.harness import NAMESPACE, POLICY, MockHub, MockUser, shipped_container_security_context  # noqa: E402
from gpuhub_spawner.kube import kueue as K  # noqa: E402
from gpuhub_spawner.kube.messages import waiting_message  # noqa: E402
from gpuhub_spawner.policy.access import resolve_choice  # noqa: E402
from gpuhub_spawner.policy.loader import parse_policy  # noqa: E402
from support.hub import waiter

SKIP = real.skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

NS = NAMESPACE
EXAMPLE = POLICY.read_text()
MIXED = "mig: {profile: 1g.10gb, strategy: mixed}"
SINGLE_PRODUCT = "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
SINGLE = f"mig: {{profile: 1g.10gb, strategy: single}}\n    nodeLabels: {{nvidia.com/gpu.product: {SINGLE_PRODUCT}}}"
assert MIXED in EXAMPLE, "the example policy's a100-1g flavor changed: update this test"

# strategy -> (policy text, the resource a slice is requested as)
STRATEGIES = {
    "mixed": (EXAMPLE, "nvidia.com/mig-1g.10gb"),
    "single": (EXAMPLE.replace(MIXED, SINGLE), "nvidia.com/gpu"),
}
QUOTA = 7  # the example policy's students: a100-1g: {nominal: 7}
STUDENTS = [f"student{i}" for i in range(1, QUOTA + 2)]


@pytest.fixture(scope="module")
def mig_plane(real_cluster):
    cluster = real_cluster
    cluster.ensure_namespace(NS)
    cluster.reset(NS)
    names = real.add_mig_nodes(cluster)
    print(f"\n[real] MIG kwok nodes Ready: {names}")
    yield cluster
    cluster.reset(NS)
    real.remove_mig_nodes(cluster)


def server_pods(policy_file: Path, users: list[str]) -> list[dict]:
    """Each student's server pod for the ``mig-1g`` profile, as the hub makes it: KueueSpawner
    re-checks the choice against the live policy (``load_user_options``) and builds the pod
    (``get_pod_manifest``), as its ``start`` does before creating it."""
    from kubernetes_asyncio.client import ApiClient
    from traitlets.config import Config

    from gpuhub_spawner.kube.spawner import KueueSpawner
    from gpuhub_spawner.policy import PolicyStore

    async def build() -> list[dict]:
        out = []
        async with ApiClient() as api:
            for user in users:
                cfg = Config()
                cfg.KueueSpawner.namespace = NS
                cfg.KueueSpawner.cmd = ["jupyterhub-singleuser"]
                # values.yaml's: gpuhub-users enforces Pod Security restricted (issue 40)
                cfg.KueueSpawner.container_security_context = shipped_container_security_context()
                spawner = KueueSpawner(
                    config=cfg,
                    user=MockUser(user, ["students"]),
                    hub=MockHub("http://127.0.0.1:8081"),
                    api_token="test-token",
                    oauth_client_id=f"jupyterhub-user-{user}",
                )
                spawner.user_options = {"profile": "mig-1g"}
                await spawner.load_user_options()
                pod = api.sanitize_for_serialization(await spawner.get_pod_manifest())
                pod["metadata"]["namespace"] = NS
                out.append(pod)
        return out

    PolicyStore.clear_instance()
    PolicyStore.instance(policy_file=str(policy_file))
    try:
        return asyncio.run(build())
    finally:
        PolicyStore.clear_instance()


def cond(obj: dict | None, ctype: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def workload_of(cluster, pod_name: str) -> dict | None:
    return next(
        (
            w
            for w in cluster.list("workloads", NS)
            if any(o["kind"] == "Pod" and o["name"] == pod_name for o in w["metadata"].get("ownerReferences") or [])
        ),
        None,
    )


def get_pod(cluster, name: str) -> dict | None:
    r = cluster.session.get(cluster.url + cluster.path("pods", NS, name), timeout=15)
    return None if r.status_code == 404 else r.json()


until = waiter(60, interval=0.1)


def admitted_and_bound(cluster, name: str, t0: float, timeline: dict) -> dict:
    """Wait for the pod's Workload to be Admitted, then for the pod to be bound and Running;
    the seconds since ``t0`` of each go into ``timeline[name]``."""
    until(lambda: (c := cond(workload_of(cluster, name), K.ADMITTED)) and c["status"] == "True", 60, f"{name} admitted")
    admitted = time.monotonic() - t0
    pod = until(
        lambda: (
            (p := get_pod(cluster, name))
            and p["spec"].get("nodeName")
            and (p.get("status") or {}).get("phase") == "Running"
            and p
        ),
        60,
        f"{name} bound and Running",
    )
    timeline[name] = (admitted, time.monotonic() - t0)
    return pod


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_seven_students_get_a_1g_slice_on_the_mig_node_and_the_eighth_waits_for_one(strategy, mig_plane, tmp_path, monkeypatch):
    cluster = mig_plane
    policy_text, resource = STRATEGIES[strategy]
    node = real.mig_nodes()[strategy]
    node_name = node["metadata"]["name"]
    # what the node advertises is what the install guide's "Which MIG strategy" reads
    live = json.loads(cluster.kubectl("get", "node", node_name, "-o", "json").stdout)
    assert live["metadata"]["labels"]["nvidia.com/mig.strategy"] == strategy
    assert int(live["status"]["allocatable"][resource]) > QUOTA, live["status"]["allocatable"]

    cluster.reset(NS)
    print(
        f"\n[real, {strategy}] kubectl apply --server-side of `gpuhub render kueue`:\n"
        + cluster.apply_policy(policy_text, NS, tmp_path / "policy")
    )
    until(
        lambda: (c := cond(cluster.get(cluster.path("clusterqueues", None, "students")), "Active")) and c["status"] == "True",
        60,
        "ClusterQueue students Active",
    )
    flavor = cluster.get(cluster.path("resourceflavors", None, "a100-1g"))
    if strategy == "single":
        assert flavor["spec"]["nodeLabels"] == {"nvidia.com/gpu.product": SINGLE_PRODUCT}
    else:
        assert "nodeLabels" not in flavor["spec"]

    policy_file = tmp_path / "profiles.yaml"
    policy_file.write_text(policy_text)
    # KubeSpawner loads a kubeconfig when built: this session's $KUBECONFIG is the double's (read by
    # kubernetes_asyncio at import), so point its default at the real one for this test only
    monkeypatch.setattr("kubernetes_asyncio.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
    pods = server_pods(policy_file, STUDENTS)
    for pod in pods:
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[resource] == "1", limits
        if strategy == "single":
            assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == SINGLE_PRODUCT
        else:
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu.product" not in (pod["spec"].get("nodeSelector") or {})

    timeline: dict[str, tuple[float, float]] = {}
    t0 = time.monotonic()
    for pod in pods[:QUOTA]:
        cluster.create("pods", NS, pod)
    names = [p["metadata"]["name"] for p in pods]
    for name in names[:QUOTA]:
        bound = admitted_and_bound(cluster, name, t0, timeline)
        assert bound["spec"]["nodeName"] == node_name, (name, bound["spec"]["nodeName"])
        wl = workload_of(cluster, name)
        flavors = wl["status"]["admission"]["podSetAssignments"][0]["flavors"]
        assert flavors[resource] == "a100-1g", flavors  # single: not the team's L4, whose quota is free
        if strategy == "single":
            assert bound["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == SINGLE_PRODUCT
    all_seven = time.monotonic() - t0

    # the eighth: over the students' seven slices, it waits gated with Kueue's words
    eighth = names[QUOTA]
    t8 = time.monotonic()
    cluster.create("pods", NS, pods[QUOTA])
    reserved = until(
        lambda: (c := cond(workload_of(cluster, eighth), K.QUOTA_RESERVED)) and c.get("message") and c,
        60,
        f"{eighth}'s Workload has Kueue's QuotaReserved condition",
    )
    kueue_says = reserved["message"]
    waited = time.monotonic() - t8
    assert reserved["status"] == "False", reserved
    assert f"insufficient unused quota for {resource} in flavor a100-1g, 1 more needed" in kueue_says, kueue_says
    pod8 = get_pod(cluster, eighth)
    assert pod8["spec"].get("schedulingGates") and not pod8["spec"].get("nodeName"), pod8["spec"]
    policy = parse_policy(policy_text, "profiles.yaml")
    choice = resolve_choice(policy, ["students"], {"profile": "mig-1g"})
    words = waiting_message(policy, choice, workload_of(cluster, eighth), None, None)
    assert words == "Waiting for quota: team Students has no free capacity; 1 A100 1g.10gb slice more needed.", words

    # a student stops: the eighth gets the freed slice
    t_stop = time.monotonic()
    cluster.delete("pods", NS, names[0])
    until(lambda: get_pod(cluster, names[0]) is None, 60, f"{names[0]} gone")
    gone = time.monotonic() - t_stop
    bound = admitted_and_bound(cluster, eighth, t_stop, timeline)
    assert bound["spec"]["nodeName"] == node_name

    print(
        f"\n[real, {strategy}] node {node_name}: allocatable {resource}={live['status']['allocatable'][resource]}, "
        f"labels nvidia.com/mig.strategy={strategy} nvidia.com/gpu.product={live['metadata']['labels']['nvidia.com/gpu.product']}"
    )
    for name in names[:QUOTA]:
        a, b = timeline[name]
        print(
            f"  {name}: admitted by Kueue {a:.2f}s after the seven pods were created, bound to {node_name} and Running {b:.2f}s"
        )
    print(f"  all seven bound in {all_seven:.2f}s")
    print(f"  {eighth}: Kueue's QuotaReserved=False after {waited:.2f}s: {kueue_says!r}")
    print(f"  the hub's words: {words!r}")
    a, b = timeline[eighth]
    print(
        f"  {names[0]} deleted, its pod gone in {gone:.2f}s; {eighth} admitted {a:.2f}s and bound to {node_name} "
        f"{b:.2f}s after the delete"
    )
    cluster.reset(NS)
