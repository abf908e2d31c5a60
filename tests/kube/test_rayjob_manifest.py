"""``kind: ray`` jobs on Kubernetes (issue 44, item 2): the RayJob gpuhub hands to KubeRay and Kueue.

Built from the user's server pod exactly as KueueSpawner makes it (the real KubeSpawner code
path) and checked against the real contracts: KubeRay v1.5.0's RayJob CRD (``openAPIV3Schema``,
unknown fields rejected; read from the operator's Go module, never copied here: skipped with
the reason when absent) and kubernetes-validate (strict) for the submitter, head and worker pod
templates. The real operator and Kueue run it in tests/kube/test_rayjob_real.py.
"""

from __future__ import annotations

import pytest
import yaml

from double.schemas import InvalidObject, kuberay_crds, validate
from gpuhub_spawner.jobs.spec import JobSpec
from gpuhub_spawner.kube.job_manifest import JOB_LABEL, MAX_EXEC_LABEL
from gpuhub_spawner.kube.kueue import PRIORITY_LABEL, QUEUE_LABEL
from gpuhub_spawner.kube.ray_manifest import ray_cluster_manifest, WorkerGroup
from gpuhub_spawner.kube.rayjob_manifest import ray_job_manifest
from gpuhub_spawner.policy.access import resolve_choice
from test_ray_manifest import _with_ray, server_pod


def _crds_or_skip():
    try:
        return kuberay_crds()
    except FileNotFoundError as e:
        pytest.skip(str(e))


async def _ray_job(make_spawner, policy_store, **spec):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = _with_ray(policy_store.policy)
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    job_spec = JobSpec.model_validate({"kind": "ray", "profile": "a100-1", **spec})
    rj = ray_job_manifest("job-0123456789", "alice", job_spec, policy, choice, pod, "batch", namespace=spawner.namespace)
    return policy, choice, pod, rj


async def test_a_ray_job_is_a_suspended_rayjob_with_the_profiles_cluster_in_the_teams_queue(make_spawner, policy_store):
    _crds_or_skip()
    policy, choice, pod, rj = await _ray_job(
        make_spawner,
        policy_store,
        entrypoint="python train.py --epochs 3",
        runtimeEnv={"env_vars": {"LR": "0.1"}, "working_dir": "src"},
        workingDir="proj",
        workers=2,
        timeLimit="2h",
        retries={"limit": 2, "reasons": ["failed", "preempted"]},
    )
    validate(rj)  # KubeRay v1.5.0's RayJob CRD, strict, and each pod template with kubernetes-validate
    meta, spec = rj["metadata"], rj["spec"]
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob" and meta["namespace"] == "gpuhub-users"
    # Kueue's rayjob integration: the team's queue on the RayJob, suspended until admitted whole.
    assert meta["labels"][QUEUE_LABEL] == choice.team.local_queue and meta["labels"][PRIORITY_LABEL] == "batch"
    assert meta["labels"][JOB_LABEL] == "job-0123456789" and meta["labels"][MAX_EXEC_LABEL] == "7200"
    assert spec["suspend"] is True and spec["shutdownAfterJobFinishes"] is True and "clusterSelector" not in spec
    assert spec["entrypoint"] == "python train.py --epochs 3" and spec["activeDeadlineSeconds"] == 7200
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"env_vars": {"LR": "0.1"}, "working_dir": "src"}
    assert spec["backoffLimit"] == 2 and spec["submitterConfig"] == {"backoffLimit": 0}
    # The cluster is the RayCluster builder's: the same spec as a notebook's Ray cluster of that size.
    same = ray_cluster_manifest(
        "job-0123456789",
        "alice",
        policy,
        choice,
        pod,
        [WorkerGroup("workers", 2, 1)],
        namespace="gpuhub-users",
        autoscaling=False,
    )["spec"]
    cs = spec["rayClusterSpec"]
    assert "suspend" not in cs and cs["headGroupSpec"]["rayStartParams"] == same["headGroupSpec"]["rayStartParams"]
    (wg,) = cs["workerGroupSpecs"]
    assert wg["replicas"] == 2 and wg["groupName"] == "workers"
    wc = wg["template"]["spec"]["containers"][0]
    assert wc["resources"] == same["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == "1"
    hc = cs["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in hc["resources"]["limits"]
    sub = spec["submitterPodTemplate"]
    subc = sub["spec"]["containers"][0]
    assert sub["spec"]["restartPolicy"] == "Never" and "command" not in subc  # KubeRay writes `ray job submit`
    assert "nvidia.com/gpu" not in subc["resources"]["limits"] and subc["workingDir"].endswith("/proj")
    server = pod["spec"]["containers"][0]
    for tmpl in (sub, cs["headGroupSpec"]["template"], wg["template"]):
        labels = tmpl["metadata"]["labels"]
        # The job's wall selects on it; the user's identity labels as on their server's pod; not the plain-pod integration.
        assert labels[JOB_LABEL] == "job-0123456789" and QUEUE_LABEL not in labels
        assert labels["hub.jupyter.org/username"] == pod["metadata"]["labels"]["hub.jupyter.org/username"]
        c = tmpl["spec"]["containers"][0]
        assert c["securityContext"] == server["securityContext"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GPUHUB_USER"] == "alice" and env["GPUHUB_JOB_ID"] == "job-0123456789"
        assert "JUPYTERHUB_API_TOKEN" not in env


async def test_retries_only_on_preemption_are_not_a_kuberay_retry_and_a_bad_rayjob_is_refused(make_spawner, policy_store):
    _crds_or_skip()
    _, _, _, rj = await _ray_job(make_spawner, policy_store, entrypoint=["python", "a b.py"])
    assert rj["spec"]["entrypoint"] == "python 'a b.py'" and rj["spec"]["backoffLimit"] == 0
    assert "runtimeEnvYAML" not in rj["spec"] and "activeDeadlineSeconds" not in rj["spec"]
    validate(rj)
    rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"  # the schema can fail
    with pytest.raises(InvalidObject, match="replicas"):
        validate(rj)


# -- the job record from the RayJob's status ---------------------------------------------------
# KubeRay's status, as the operator writes it, validated against the v1.5.0 CRD (strict: a
# field or value KubeRay does not have fails here), then read by the job manager.


class _Api:
    """The few calls ``KubeJobManager._refresh_ray`` makes, answering from ``self.rayjob``."""

    def __init__(self):
        self.rayjob: dict | None = None
        self.pods: list[dict] = []
        self.api_client = self

    def sanitize_for_serialization(self, obj):
        return obj

    async def get_namespaced_custom_object(self, group, version, ns, plural, name):
        from kubernetes_asyncio.client import ApiException

        assert (group, version, plural) == ("ray.io", "v1", "rayjobs")
        if self.rayjob is None:
            raise ApiException(status=404, reason="Not Found")
        return self.rayjob

    async def list_namespaced_custom_object(self, *args, **kwargs):
        return {"items": []}

    async def list_namespaced_pod(self, ns, label_selector):
        return {"items": self.pods}

    async def read_namespaced_pod_log(self, name, ns, limit_bytes=None, tail_lines=None):  # the hub reads a bounded tail
        return f"log of {name}\n"

    async def list_node(self, **kwargs):
        return {"items": []}


def _status(rj: dict, **status) -> dict:
    out = {**rj, "metadata": {**rj["metadata"], "uid": "u-1"}, "status": status}
    validate(out)
    return out


async def test_the_job_record_follows_the_rayjobs_status(make_spawner, policy_store, tmp_path, monkeypatch):
    _crds_or_skip()
    from gpuhub_spawner.jobs import records as R
    from gpuhub_spawner.kube.job_manager import KubeJobManager

    _, _, _, rj = await _ray_job(make_spawner, policy_store, entrypoint="python train.py")
    api = _Api()
    monkeypatch.setattr(KubeJobManager, "_client", staticmethod(lambda kind: api))
    mgr = KubeJobManager(data_dir=str(tmp_path))

    def record():
        rec = R.JobRecord(
            id="job-0123456789",
            user="alice",
            team="vision",
            profile={"slug": "a100-1"},
            priority_class="batch",
            priority=100,
            policy_sha256="",
            image="",
            image_digest="",
            command=[],
            working_dir="",
            checkpoint_dir="",
            env_names=[],
            experiment=None,
            time_limit=None,
            retries={"limit": 0, "reasons": []},
            spec={"namespace": "gpuhub-users"},
            backend="kubernetes",
            kind="ray",
            ray={"entrypoint": "python train.py"},
        )
        rec.attempts.append(R.Attempt(number=1, queued=0.0))
        return rec

    rec = record()
    api.rayjob = _status(rj)  # just created: no status yet, suspended
    await mgr.refresh(rec)
    assert rec.state == R.QUEUED and len(rec.attempts) == 1

    admitted = {**rj, "spec": {k: v for k, v in rj["spec"].items() if k != "suspend"}}  # Kueue un-suspended it (omitempty)
    api.rayjob = _status(admitted, jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName="job-0123456789-abcde")
    submitter = {"metadata": {"name": "job-0123456789-sub", "labels": {"gpuhub/ray-role": "submitter"}}, "spec": {}, "status": {}}
    worker = {"metadata": {"name": "w", "labels": {"gpuhub/ray-role": "worker"}}, "spec": {"nodeName": "gpu-1"}, "status": {}}
    api.pods = [submitter, worker]
    await mgr.refresh(rec)
    assert rec.state == R.RUNNING and rec.current.account == "job-0123456789-sub" and rec.current.devices == ["gpu-1"]
    assert "Ray job RUNNING (KubeRay: Running) on cluster job-0123456789-abcde" in mgr.status_line(rec)
    assert open(rec.current.log).read() == "log of job-0123456789-sub\n"  # the submitter's: `ray job submit`'s output

    api.rayjob = _status(admitted, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED", endTime="2026-12-05T12:00:00Z")
    await mgr.refresh(rec)
    assert rec.state == R.SUCCEEDED and rec.current.reason == "succeeded" and len(rec.attempts) == 1

    rec = record()
    api.rayjob = _status(
        admitted, jobDeploymentStatus="Complete", jobStatus="FAILED", reason="AppFailed", message="Job entrypoint command failed"
    )
    await mgr.refresh(rec)
    assert rec.state == R.FAILED and rec.message == "Job entrypoint command failed" and rec.current.reason == "failed"

    rec = record()
    api.rayjob = _status(admitted, jobDeploymentStatus="Failed", reason="DeadlineExceeded", message="past its deadline")
    rec.time_limit = 60
    await mgr.refresh(rec)
    assert rec.state == R.FAILED and rec.message == "stopped: it reached its time limit of 60s"

    rec = record()
    api.rayjob = None  # deleted behind the hub's back
    await mgr.refresh(rec)
    assert rec.state == R.CANCELLED and "RayJob was deleted" in rec.message
