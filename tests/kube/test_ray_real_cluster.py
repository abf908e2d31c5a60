"""Ray clusters on the real control plane (``GPUHUB_CLUSTER=1``, issue 24): the RayCluster
gpuhub builds (``kube/ray_manifest.py``, from the user's server pod as KueueSpawner makes it)
handed to the real KubeRay operator v1.5.0 and the real Kueue v0.19.2 (its ``ray.io/raycluster``
integration, in Kueue's default configuration), with the shipped policy's Kueue objects.

* A RayCluster within the team's quota is admitted: Kueue un-suspends it, the operator creates
  the head pod (CPU only, on a CPU node) and the worker pods (one A100 each, on the A100 node:
  kwok binds them and marks them Running; nothing runs in them).
* A second one over the team's quota stays suspended, with no pods, and its Workload carries
  Kueue's message; gpuhub's waiting words are made from it. Deleting the first admits it.
* Kueue's webhook refuses a queued RayCluster that autoscales without the elastic-job
  annotation, and accepts it with the annotation (adding its scheduling gate to the templates).

Needs tests/cluster/build.sh kuberay (the operator; skipped with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402

from gpuhub_spawner.kube import kueue as K  # noqa: E402
from gpuhub_spawner.kube.messages import waiting_message  # noqa: E402
from gpuhub_spawner.kube.ray_manifest import ELASTIC_ANNOTATION, ELASTIC_GATE, WorkerGroup, ray_cluster_manifest  # noqa: E402
from gpuhub_spawner.policy.access import resolve_choice  # noqa: E402
from support.hub import waiter

NS = "gpuhub-users"
POLICY = real.REPO / "jupyterhub_config" / "profiles.yaml"


def _skip() -> str | None:
    reason = real.skip_reason()
    if reason:
        return reason
    v = real.versions()
    op = real.CACHE / f"kuberay-{v['KUBERAY_VERSION']}" / "bin" / "ray-operator"
    if not op.exists():
        return f"the KubeRay operator is not built ({op}): run tests/cluster/build.sh kuberay (Go module proxy; ~10 min)"
    return None


SKIP = _skip()
pytestmark = [pytest.mark.cluster, pytest.mark.asyncio(loop_scope="function")]


until = waiter(60)


def rc_url(cluster, name: str = "") -> str:
    return f"{cluster.url}/apis/ray.io/v1/namespaces/{NS}/rayclusters" + (f"/{name}" if name else "")


def get_rc(cluster, name: str) -> dict | None:
    r = cluster.session.get(rc_url(cluster, name), timeout=15)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def workload_of(cluster, name: str) -> dict | None:
    return next(
        (
            w
            for w in cluster.list("workloads", NS)
            if any(o["kind"] == "RayCluster" and o["name"] == name for o in w["metadata"].get("ownerReferences", []))
        ),
        None,
    )


def cond(obj: dict | None, ctype: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def pods_of(cluster, name: str) -> list[dict]:
    return cluster.list("pods", NS, labelSelector=f"ray.io/cluster={name}")


def running_on_nodes(cluster, name: str, count: int):
    pods = pods_of(cluster, name)
    ok = [p for p in pods if p["spec"].get("nodeName") and (p.get("status") or {}).get("phase") == "Running"]
    return pods if len(ok) == count == len(pods) else None


@pytest.fixture(scope="module")
def ray_cluster_plane(tmp_path_factory, request):
    if SKIP:
        pytest.skip(SKIP)
    t0 = time.time()
    cluster = request.getfixturevalue("real_cluster")
    up_s = time.time() - t0
    running = yaml.safe_load((real.DIR / "kueue-config.yaml").read_text())
    assert "ray.io/raycluster" in running["integrations"]["frameworks"], running["integrations"]
    cluster.ensure_namespace(NS)
    cluster.reset(NS)
    cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=true", check=False)
    cluster.apply_policy(POLICY.read_text(), NS, tmp_path_factory.mktemp("policy"))
    yield cluster, up_s
    cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=false", check=False)
    cluster.reset(NS)


async def _manifest(make_spawner, policy_store, name, workers, autoscaling=False):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    policy = policy_store.policy
    policy = policy.model_copy(update={"ray": policy.ray.model_copy(update={"enabled": True, "autoscaling": autoscaling})})
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    return policy, choice, ray_cluster_manifest(name, "alice", policy, choice, pod, workers, namespace=NS)


async def test_over_quota_waits_suspended_with_kueues_message_and_is_admitted_when_the_holder_goes(
    ray_cluster_plane, make_spawner, policy_store
):
    cluster, up_s = ray_cluster_plane
    timeline: dict[str, float] = {}
    policy, choice, first = await _manifest(make_spawner, policy_store, "ray-first", [WorkerGroup("gpu", 2, 1)])
    _, _, second = await _manifest(make_spawner, policy_store, "ray-second", [WorkerGroup("gpu", 2, 1)])

    t0 = time.time()
    r = cluster.session.post(rc_url(cluster), json=first, timeout=15)
    assert r.status_code == 201, r.text
    until(lambda: (c := cond(workload_of(cluster, "ray-first"), "Admitted")) and c["status"] == "True", 60, "ray-first admitted")
    timeline["first admitted"] = time.time() - t0
    until(lambda: get_rc(cluster, "ray-first")["spec"].get("suspend") is False, 30, "ray-first unsuspended")
    pods = until(lambda: running_on_nodes(cluster, "ray-first", 3), 90, "ray-first's head and 2 workers running on kwok nodes")
    timeline["first's 3 pods running"] = time.time() - t0
    by_type = {}
    for p in pods:
        by_type.setdefault(p["metadata"]["labels"]["ray.io/node-type"], []).append(p)
    (head,) = by_type["head"]
    assert len(by_type["worker"]) == 2
    assert head["spec"]["nodeName"].startswith("kwok-cpu-"), head["spec"]["nodeName"]  # CPU only: not on a GPU node
    assert "nvidia.com/gpu" not in (head["spec"]["containers"][0]["resources"].get("limits") or {})
    for w in by_type["worker"]:
        assert w["spec"]["nodeName"] == "kwok-gpu-a100-1"
        assert w["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        env = {e["name"]: e.get("value") for e in w["spec"]["containers"][0]["env"]}
        assert env["GPUHUB_USER"] == "alice" and env["GPUHUB_TEAM"] == "vision"
    wl = workload_of(cluster, "ray-first")
    assert [p["name"] for p in wl["spec"]["podSets"]] == ["head", "gpu"] and wl["spec"]["queueName"] == "vision"

    # Over the quota (vision: 2 A100 nominal + 1 borrowed at most): suspended, no pods, Kueue's words.
    t1 = time.time()
    r = cluster.session.post(rc_url(cluster), json=second, timeout=15)
    assert r.status_code == 201, r.text
    wl2 = until(
        lambda: (x := workload_of(cluster, "ray-second")) and (cond(x, "QuotaReserved") or {}).get("message") and x,
        60,
        "ray-second's Workload with Kueue's pending message",
    )
    msg = cond(wl2, "QuotaReserved")["message"]
    print("\n[kueue] ray-second:", msg)
    assert "couldn't assign flavors to pod set gpu" in msg and "nvidia.com/gpu" in msg, msg
    time.sleep(3)
    assert get_rc(cluster, "ray-second")["spec"]["suspend"] is True and not pods_of(cluster, "ray-second")
    words = waiting_message(policy, choice, wl2, None, None)
    print("[gpuhub]", words)
    assert "team Vision Lab" in words, words

    # The holder deleted: its quota comes back and the waiting one is admitted and runs.
    t2 = time.time()
    r = cluster.session.delete(rc_url(cluster, "ray-first"), timeout=15)
    assert r.status_code in (200, 202), r.text
    until(
        lambda: (c := cond(workload_of(cluster, "ray-second"), "Admitted")) and c["status"] == "True", 90, "ray-second admitted"
    )
    timeline["second admitted after the delete"] = time.time() - t2
    until(lambda: running_on_nodes(cluster, "ray-second", 3), 90, "ray-second's pods running")
    timeline["second's 3 pods running after the delete"] = time.time() - t2
    until(lambda: not pods_of(cluster, "ray-first") and workload_of(cluster, "ray-first") is None, 60, "ray-first gone")
    timeline["second waited in all"] = time.time() - t1
    print(f"[measure] up.sh {up_s:.1f}s; " + "; ".join(f"{k} {v:.1f}s" for k, v in timeline.items()))


async def test_autoscaling_needs_kueues_elastic_job_annotation(ray_cluster_plane, make_spawner, policy_store):
    cluster, _ = ray_cluster_plane
    cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=true", check=False)  # the quota free for it
    _, _, rc = await _manifest(make_spawner, policy_store, "ray-elastic", [WorkerGroup("gpu", 1, 1)], autoscaling=True)
    assert rc["metadata"]["annotations"][ELASTIC_ANNOTATION] == "true"
    bare = yaml.safe_load(yaml.safe_dump(rc))
    bare["metadata"]["name"] = "ray-autoscale-bare"
    del bare["metadata"]["annotations"][ELASTIC_ANNOTATION]
    r = cluster.session.post(rc_url(cluster), json=bare, timeout=15)
    assert r.status_code in (400, 403, 422), r.text
    assert "can use autoscaling only as an elastic job" in r.text, r.text
    r = cluster.session.post(rc_url(cluster), json=rc, timeout=15)
    assert r.status_code == 201, r.text
    created = r.json()
    gates = [g["name"] for g in created["spec"]["headGroupSpec"]["template"]["spec"].get("schedulingGates") or []]
    assert ELASTIC_GATE in gates, created["spec"]["headGroupSpec"]["template"]["spec"]
    until(lambda: workload_of(cluster, "ray-elastic"), 60, "the elastic RayCluster's Workload")
    # Admitted, KubeRay makes the head pod with its autoscaler sidecar, which Pod Security
    # `restricted` (enforced in gpuhub-users, issue 40) admits only with the securityContext
    # gpuhub gives it (autoscalerOptions.securityContext); without it KubeRay's create is refused.
    labels = next(n for n in cluster.list("namespaces") if n["metadata"]["name"] == NS)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
    head = until(
        lambda: next(
            (p for p in pods_of(cluster, "ray-elastic") if p["metadata"]["labels"].get("ray.io/node-type") == "head"), None
        ),
        90,
        "the elastic RayCluster's head pod, made by KubeRay under Pod Security restricted",
    )
    sidecar = next(c for c in head["spec"]["containers"] if c["name"] == "autoscaler")
    assert sidecar["securityContext"] == rc["spec"]["autoscalerOptions"]["securityContext"], sidecar
    assert sidecar["securityContext"]["runAsNonRoot"] is True and sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    cluster.session.delete(rc_url(cluster, "ray-elastic"), timeout=15)
    assert K.QUEUE_LABEL in created["metadata"]["labels"]


@pytest.fixture
def ray_policy(policy_file):
    """The shipped policy with Ray on and room for 4 workers (its own ``ray:`` section replaced:
    a second one is a duplicate key, and the policy store refuses the file)."""
    data = yaml.safe_load(policy_file.read_text())
    data["ray"] = {"enabled": True, "maxWorkers": 4}
    policy_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return policy_file


async def test_the_kube_ray_manager_against_real_kuberay_and_kueue(ray_cluster_plane, ray_policy, make_spawner):
    """KubeRayManager (kube/ray_manager.py) with a client of the real API server: what the hub
    does for `gpuhub ray up/list/down` and the idle culler, on real Kueue and KubeRay."""
    from kubernetes_asyncio import client, config

    from gpuhub_spawner.kube.ray_manager import WARNING_ANNOTATION, KubeRayManager
    from gpuhub_spawner.rayclusters import IDLE, QUEUED, RUNNING, STOPPED, RayRequest

    cluster, _ = ray_cluster_plane
    cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=true", check=False)
    # The hub's own identity (the install guide's service account and bindings), not admin.
    hub_kubeconfig = real.install_hub_identity(cluster, ray_policy, ray_policy.parent / "hub-identity")
    mark = real.audit_mark()
    api_client = await config.new_client_from_config(config_file=str(hub_kubeconfig))
    api = client.CustomObjectsApi(api_client)

    def spawner_for(user, name):
        return make_spawner(user=user.name, groups=[g.name for g in user.groups], profile=None, server_name=name)

    m = KubeRayManager(namespace=NS, poll_interval=0.5, spawner_for=spawner_for, api=lambda: api, users_with_servers=lambda: None)
    alice = make_spawner(user="alice", groups=("vision-lab",), profile="cpu").user
    bob = make_spawner(user="bob", groups=("vision-lab",), profile="cpu").user

    async def until_async(check, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            await m.refresh()
            value = check()
            if value:
                return value
            await asyncio.sleep(0.3)
        raise TimeoutError(f"{what} not reached in {timeout}s")

    try:
        t0 = time.time()
        a = await m.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=2, workers=2, name="train"))
        await until_async(lambda: m.status("train", "alice").state == RUNNING, 90, "alice's cluster running (KubeRay: ready)")
        running_s = time.time() - t0
        b = await m.start(bob, ["vision-lab"], RayRequest(user="bob", gpus=2, workers=1, name="eval"))
        words = await until_async(
            lambda: (v := m.status("eval", "bob")).state == QUEUED and "A100" in v.status and v.status,
            60,
            "bob's cluster queued with Kueue's reason",
        )
        print("\n[gpuhub ray list, bob]", words)
        t1 = time.time()
        assert (await m.stop("train", user_name="alice")).state == STOPPED
        await until_async(lambda: m.status("eval", "bob").state == RUNNING, 90, "bob's cluster running once alice's is gone")
        handover_s = time.time() - t1
        # idle: the profile's rules decide; warned, then deleted (its quota given back)
        v = m.status("eval", "bob")
        ds = dict(await m.cull_pass(now=v.started + 10 * 24 * 3600))
        assert ds[b.id].action in ("warn", "cull"), ds[b.id]
        if ds[b.id].action == "warn":
            rc = get_rc(cluster, b.id)
            assert "will be deleted at" in rc["metadata"]["annotations"][WARNING_ANNOTATION]
            ds = dict(await m.cull_pass(now=ds[b.id].deadline + 1))
        assert m.status("eval", "bob").reason == IDLE
        until(lambda: get_rc(cluster, b.id) is None and not pods_of(cluster, b.id), 60, "bob's RayCluster and pods deleted")
        print(
            f"[measure] manager: alice's cluster running {running_s:.1f}s after start; bob's running "
            f"{handover_s:.1f}s after alice's stop"
        )
        assert a.id != b.id
        calls = real.hub_requests(mark)
        summary = sorted({(c["verb"], c["resource"], c["code"]) for c in calls})
        print(f"[real] the Ray manager's requests as {real.HUB_USER}: {summary}")
        assert [c for c in calls if c["code"] == 403] == [], calls
        assert {
            ("create", "rayclusters"),
            ("list", "rayclusters"),
            ("patch", "rayclusters"),
            ("delete", "rayclusters"),
            ("list", "workloads"),
        } <= {(v, r) for v, r, _ in summary}, summary
    finally:
        cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=false", check=False)
        await api_client.close()


async def test_a_batch_priority_cluster_is_suspended_by_kueue_for_an_interactive_one(
    ray_cluster_plane, make_spawner, policy_store
):
    """Kueue's preemption of a RayCluster (vision's withinClusterQueue: LowerPriority): the
    batch-priority cluster is suspended, KubeRay deletes its pods, its Workload waits again;
    the interactive one is admitted in its place."""
    cluster, _ = ray_cluster_plane
    cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=true", check=False)
    _, _, low = await _manifest(make_spawner, policy_store, "ray-batch", [WorkerGroup("gpu", 2, 1)])
    low["metadata"]["labels"][K.PRIORITY_LABEL] = "batch"
    _, _, high = await _manifest(make_spawner, policy_store, "ray-interactive", [WorkerGroup("gpu", 2, 1)])
    try:
        r = cluster.session.post(rc_url(cluster), json=low, timeout=15)
        assert r.status_code == 201, r.text
        until(lambda: running_on_nodes(cluster, "ray-batch", 3), 90, "the batch cluster running")
        t0 = time.time()
        r = cluster.session.post(rc_url(cluster), json=high, timeout=15)
        assert r.status_code == 201, r.text
        until(
            lambda: (c := cond(workload_of(cluster, "ray-interactive"), "Admitted")) and c["status"] == "True",
            90,
            "the interactive cluster admitted",
        )
        admitted_s = time.time() - t0
        wl = workload_of(cluster, "ray-batch")
        print(
            "\n[kueue] ray-batch:",
            (cond(wl, "Preempted") or {}).get("message"),
            "|",
            (cond(wl, "QuotaReserved") or {}).get("message"),
        )
        assert (cond(wl, "Preempted") or {}).get("status") == "True" or any(
            e.get("reason") == "Preempted" for e in ((wl.get("status") or {}).get("schedulingStats") or {}).get("evictions") or []
        )
        assert get_rc(cluster, "ray-batch")["spec"]["suspend"] is True
        until(lambda: not pods_of(cluster, "ray-batch"), 60, "the batch cluster's pods deleted by KubeRay")
        until(lambda: running_on_nodes(cluster, "ray-interactive", 3), 90, "the interactive cluster's pods running")
        print(
            f"[measure] preemption: interactive admitted {admitted_s:.1f}s after creation, its pods running "
            f"{time.time() - t0:.1f}s after"
        )
    finally:
        cluster.kubectl("-n", NS, "delete", "rayclusters", "--all", "--wait=false", check=False)
