"""Storage for jobs and Ray clusters on a multi-node cluster (issue 40 item 3, kube/storage.py).

* Without a cluster: with ``KueueSpawner.work_volume: home`` (the default) a job's pod and a
  Ray cluster's pods mount the user's home claim exactly as the server does (z2jh's dynamic
  storage, rendered as KubeSpawner's volumes); with ``own`` the home claim is gone from them, a
  job's pod mounts its own claim ``<job>-work`` at the home path (so its checkpoint directory
  is on it), a Ray head its cluster's claim and each worker an ``emptyDir``. The claim is a
  ReadWriteOnce PersistentVolumeClaim owned by the Job; everything passes kubernetes-validate
  (1.30, strict) and the Job's pod template Pod Security ``restricted``'s fields stay.
* On the real control plane (``GPUHUB_CLUSTER=1``): the claim made with the hub's own
  service account (the install guide's Role: create persistentvolumeclaims), bound by the
  real PersistentVolume controller to a volume a stand-in provisioner made
  (``harness.StandInProvisioner``), the Job admitted by real Kueue and its pod placed by the
  real scheduler (its VolumeBinding plugin waits for a bound claim), and the claim deleted by
  the garbage collector with its Job. Not shown here (no kubelet, no CSI driver): attaching and
  mounting the volume, and the Multi-Attach refusal of a ReadWriteOnce volume on a second
  node that makes ``home`` need ReadWriteMany.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

from gpuhub_spawner.jobs.spec import JobSpec  # noqa: E402
from gpuhub_spawner.kube.job_manifest import job_manifest  # noqa: E402
from gpuhub_spawner.kube.ray_manifest import WorkerGroup, ray_cluster_manifest  # noqa: E402
from gpuhub_spawner.kube.storage import WORK_VOLUME, claim_name, work_claim  # noqa: E402
from gpuhub_spawner.policy.access import resolve_choice  # noqa: E402

NS = "gpuhub-users"
# What z2jh renders for singleuser.storage.type: dynamic (its defaults), as KubeSpawner traits.
HOME_STORAGE = {
    "volumes": [
        {"name": "volume-{username}{servername}", "persistentVolumeClaim": {"claimName": "claim-{username}{servername}"}}
    ],
    "volume_mounts": [{"name": "volume-{username}{servername}", "mountPath": "/home/jovyan"}],
}


async def server_pod(make_spawner, policy_store, work_volume: str):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1", work_volume=work_volume, **HOME_STORAGE)
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    policy = policy_store.policy
    policy = policy.model_copy(update={"ray": policy.ray.model_copy(update={"enabled": True})})
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    return spawner, policy, choice, pod


def volumes(spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in spec.get("volumes") or []}


def mounts(spec: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in spec["containers"][0].get("volumeMounts") or []}


def env(spec: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in spec["containers"][0].get("env") or []}


JOB = JobSpec.model_validate({"profile": "a100-1", "command": ["python", "train.py"]})


async def test_home_mode_mounts_the_users_home_in_jobs_and_ray_pods(make_spawner, policy_store):
    spawner, policy, choice, pod = await server_pod(make_spawner, policy_store, "home")
    assert spawner.work_volume == "home"  # the default
    job = job_manifest("job-h", "alice", JOB, policy, choice, pod, namespace=NS)
    spec = job["spec"]["template"]["spec"]
    assert volumes(spec)["volume-alice"]["persistentVolumeClaim"]["claimName"] == "claim-alice"
    assert mounts(spec) == {"volume-alice": "/home/jovyan"}
    rc = ray_cluster_manifest("ray-h", "alice", policy, choice, pod, [WorkerGroup("gpu", 1, 2)], namespace=NS)
    for tmpl in [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in rc["spec"]["workerGroupSpecs"]]:
        assert volumes(tmpl["spec"])["volume-alice"]["persistentVolumeClaim"]["claimName"] == "claim-alice"


async def test_own_mode_gives_a_job_its_own_claim_at_the_home_path(make_spawner, policy_store):
    spawner, policy, choice, pod = await server_pod(make_spawner, policy_store, "own")
    job = job_manifest("job-o", "alice", JOB, policy, choice, pod, namespace=NS, work_volume=spawner.work_volume)
    kubernetes_validate.validate(job, "1.30", strict=True)
    spec = job["spec"]["template"]["spec"]
    assert "volume-alice" not in volumes(spec), "the user's ReadWriteOnce home is not mounted in a job"
    assert volumes(spec)[WORK_VOLUME] == {"name": WORK_VOLUME, "persistentVolumeClaim": {"claimName": "job-o-work"}}
    assert mounts(spec) == {WORK_VOLUME: "/home/jovyan"}
    # its checkpoints are on the claim: every attempt, on any node, finds the last one's
    assert env(spec)["GPUHUB_CHECKPOINT_DIR"].startswith("/home/jovyan/")
    assert spec["containers"][0]["securityContext"]["runAsNonRoot"] is True  # Pod Security restricted kept
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "job-o", "uid": "0b2e5c1e-0000-4000-8000-000000000001"},
    }
    claim = work_claim(owner, NS, spawner.work_volume_size, "fast-rwo", {"gpuhub/job": "job-o"})
    kubernetes_validate.validate(claim, "1.30", strict=True)
    assert claim["metadata"]["name"] == claim_name("job-o") == "job-o-work"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "fast-rwo",
    }
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]  # deleted with the Job


async def test_own_mode_ray_head_has_the_claim_workers_an_empty_dir(make_spawner, policy_store):
    spawner, policy, choice, pod = await server_pod(make_spawner, policy_store, "own")
    rc = ray_cluster_manifest(
        "ray-o", "alice", policy, choice, pod, [WorkerGroup("gpu", 1, 2)], namespace=NS, work_volume=spawner.work_volume
    )
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert volumes(head)[WORK_VOLUME]["persistentVolumeClaim"] == {"claimName": "ray-o-work"} and "volume-alice" not in volumes(
        head
    )
    for g in rc["spec"]["workerGroupSpecs"]:
        assert volumes(g["template"]["spec"])[WORK_VOLUME] == {"name": WORK_VOLUME, "emptyDir": {}}
        assert mounts(g["template"]["spec"]) == {WORK_VOLUME: "/home/jovyan"}


def test_values_name_the_storage_knob():
    values = yaml.safe_load((real.REPO / "helm-values" / "values.yaml").read_text())
    ks = values["hub"]["config"]["KueueSpawner"]
    assert ks["work_volume"] in ("home", "own")


# -- the real control plane -----------------------------------------------------------------------

SKIP = real.skip_reason()


@pytest.mark.cluster
@pytest.mark.skipif(bool(SKIP), reason=SKIP or "")
async def test_a_jobs_own_claim_bound_admitted_scheduled_and_collected_on_the_real_plane(
    real_cluster, make_spawner, policy_store, policy_file, tmp_path
):
    from kubernetes_asyncio import config

    from gpuhub_spawner.kube.storage import create_claim

    cluster = real_cluster
    cluster.reset(NS)
    cluster.apply_policy(policy_file.read_text(), NS, tmp_path / "policy")
    hub_kubeconfig = real.install_hub_identity(cluster, policy_file, tmp_path / "hub-identity")
    mark = real.audit_mark()
    provisioner = real.StandInProvisioner(cluster, "gpuhub-standin-rwo").begin()
    spawner, policy, choice, pod = await server_pod(make_spawner, policy_store, "own")
    job = job_manifest("job-st", "alice", JOB, policy, choice, pod, namespace=NS, work_volume="own")
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["sleep", "600"]
    try:
        created = cluster.create("jobs", NS, job)
        api_client = await config.new_client_from_config(config_file=str(hub_kubeconfig))
        try:  # as the job manager does, with the hub's own identity
            await create_claim(api_client, work_claim(created, NS, "1Gi", "gpuhub-standin-rwo", {"gpuhub/job": "job-st"}))
        finally:
            await api_client.close()

        def claim():
            r = cluster.session.get(f"{cluster.url}/api/v1/namespaces/{NS}/persistentvolumeclaims/job-st-work", timeout=15)
            return r.json() if r.status_code == 200 else None

        bound = real.until(
            lambda: (c := claim()) and (c.get("status") or {}).get("phase") == "Bound" and c, 60, "job-st-work Bound"
        )
        pv = bound["spec"]["volumeName"]
        print(f"\n[real] job-st-work Bound to {pv} (stand-in provisioner, real PV controller)")

        def running_pod():
            pods = cluster.list("pods", NS, labelSelector="job-name=job-st")
            return next(
                (p for p in pods if p["spec"].get("nodeName") and (p.get("status") or {}).get("phase") == "Running"), None
            )

        p = real.until(running_pod, 90, "the Job admitted by Kueue and its pod placed by the scheduler with its claim bound")
        vol = next(v for v in p["spec"]["volumes"] if v["name"] == WORK_VOLUME)
        assert vol["persistentVolumeClaim"]["claimName"] == "job-st-work"
        assert p["spec"]["nodeName"] == "kwok-gpu-a100-1", p["spec"]["nodeName"]
        print(f"[real] job-st's pod {p['metadata']['name']} Running on {p['spec']['nodeName']} with job-st-work")
        requests = [r for r in real.hub_requests(mark) if r["resource"] == "persistentvolumeclaims"]
        assert [(r["verb"], r["code"]) for r in requests] == [("create", 201)], requests

        cluster.session.delete(
            f"{cluster.url}/apis/batch/v1/namespaces/{NS}/jobs/job-st", json={"propagationPolicy": "Background"}, timeout=15
        )
        real.until(
            lambda: claim() is None or claim()["metadata"].get("deletionTimestamp"), 90, "job-st-work collected with its Job"
        )
    finally:
        provisioner.stop()
        cluster.session.delete(
            f"{cluster.url}/apis/batch/v1/namespaces/{NS}/jobs/job-st", json={"propagationPolicy": "Background"}, timeout=15
        )
        cluster.kubectl(
            "-n", NS, "delete", "pvc", "-l", "gpuhub/work-volume-of", "--ignore-not-found", "--wait=false", check=False
        )
        cluster.reset(NS)
