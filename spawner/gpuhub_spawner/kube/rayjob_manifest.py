"""A ``kind: ray`` job on Kubernetes: a KubeRay ``RayJob`` (``ray.io/v1``) that Kueue's
``ray.io/rayjob`` integration admits as one Workload (issue 44, item 2).

The job's Ray cluster is ``ray_manifest.ray_cluster_manifest``'s RayCluster spec (the one
builder for both: a CPU-only head, one worker group ``workers`` of ``spec.workers`` pods with
the profile's GPUs each, the user's identity, labels, volumes and security context as in
their server's pod), put in the RayJob as ``rayClusterSpec``:

- ``suspend: true`` at creation and the team's LocalQueue label on the RayJob: Kueue makes one
  Workload (pod sets ``head``, ``workers`` and ``submitter``) and un-suspends the RayJob when
  all of it fits the team's quota; KubeRay then creates the RayCluster and, once it runs, the
  submitter Job whose pod runs ``ray job submit`` with the entrypoint;
- ``shutdownAfterJobFinishes: true`` (Kueue refuses a queued RayJob without it): KubeRay
  deletes the cluster when the entrypoint ends; deleting the RayJob (cancel) deletes the
  cluster and the submitter with it (both are owned by the RayJob);
- the submitter pod is the head's template (CPU only, the user's labels, home volume and
  security context, so Pod Security ``restricted`` admits it and ``runtimeEnv``'s relative
  paths are read from the user's home); KubeRay writes its command (``submissionMode:
  K8sJobMode``);
- ``retries.limit`` with ``failed`` (or exit codes: Ray reports none per attempt here) is the
  RayJob's ``backoffLimit`` (a new cluster per retry); a preemption suspends the RayJob
  (KubeRay deletes its cluster) and it waits in the queue again, not counted;
- ``timeLimit`` is ``activeDeadlineSeconds`` and Kueue's ``max-exec-time-seconds`` label.

No autoscaling for a job's cluster: its size is the job file's.

Tested against the KubeRay v1.5.0 RayJob CRD (strict), kubernetes-validate for its pod
templates, and the real KubeRay operator and Kueue on tests/cluster's control plane
(tests/kube/test_rayjob_real.py).
"""

from __future__ import annotations

import copy

import yaml

from .job_manifest import JOB_LABEL, USER_ANNOTATION, job_kueue_labels
from .ray_manifest import API_VERSION, ROLE_LABEL, WorkerGroup, ray_cluster_manifest
from ..jobs.spec import FAILED, JobSpec
from ..policy.access import Choice
from ..policy.model import Policy

KIND = "RayJob"
GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
WORKER_GROUP = "workers"
SUBMITTER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}


def _with_job(template: dict, job_id: str, env: dict[str, str]) -> None:
    """Mark a pod template as the job's (its wall selects on ``JOB_LABEL``) and give its
    container the job's environment."""
    template["metadata"].setdefault("labels", {})[JOB_LABEL] = job_id
    container = template["spec"]["containers"][0]
    kept = [e for e in container.get("env") or [] if e.get("name") not in env]
    container["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]


def ray_job_manifest(
    job_id: str,
    user: str,
    spec: JobSpec,
    policy: Policy,
    choice: Choice,
    pod: dict,
    job_priority_class: str | None = None,
    namespace: str | None = None,
    work_volume: str = "home",
) -> dict:
    """The suspended RayJob for ``spec`` (``kind: ray``); ``pod`` is the user's server pod
    manifest for ``choice`` (a dict), as for ``job_manifest``."""
    cluster = ray_cluster_manifest(
        job_id,
        user,
        policy,
        choice,
        pod,
        [WorkerGroup(WORKER_GROUP, spec.workers, choice.gpu_count)],
        namespace=namespace,
        autoscaling=False,
        work_volume=work_volume,
    )
    cluster_spec = cluster["spec"]
    cluster_spec.pop("suspend", None)  # the RayJob's own suspend is what Kueue flips
    env = {**dict(sorted(spec.env.items())), "GPUHUB_JOB_ID": job_id}
    if spec.experiment:
        env["MLFLOW_EXPERIMENT_NAME"] = spec.experiment
    head = cluster_spec["headGroupSpec"]["template"]
    templates = [head] + [g["template"] for g in cluster_spec["workerGroupSpecs"]]
    if spec.image:
        for t in templates:
            t["spec"]["containers"][0]["image"] = spec.image
    for t in templates:
        _with_job(t, job_id, env)

    # The submitter: the head's pod (CPU only, the user's identity and home), KubeRay's command.
    submitter = copy.deepcopy(head)
    submitter["metadata"]["labels"][ROLE_LABEL] = "submitter"
    submitter["metadata"]["labels"]["component"] = submitter["metadata"]["labels"]["app.kubernetes.io/component"] = (
        "gpuhub-ray-submitter"
    )
    submitter["spec"]["restartPolicy"] = "Never"
    sc = submitter["spec"]["containers"][0]
    sc["name"] = "ray-job-submitter"
    sc["resources"] = {"requests": dict(SUBMITTER_RESOURCES), "limits": dict(SUBMITTER_RESOURCES)}
    home = next((e.get("value") for e in sc.get("env", []) if e.get("name") == "HOME"), None) or "/home/jovyan"
    if spec.working_dir:
        sc["workingDir"] = spec.working_dir if spec.working_dir.startswith("/") else f"{home}/{spec.working_dir}"
    else:
        sc["workingDir"] = home

    meta = pod.get("metadata") or {}
    labels = job_kueue_labels(policy, choice, user, job_id, spec, job_priority_class)
    rj_spec: dict = {
        "entrypoint": spec.ray_entrypoint,
        "suspend": True,  # Kueue un-suspends it on admission
        "shutdownAfterJobFinishes": True,  # the cluster goes when the entrypoint ends
        "ttlSecondsAfterFinished": 0,
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": submitter,
        "submitterConfig": {"backoffLimit": 0},  # a retry is the RayJob's (a new cluster), not a resubmission
        "backoffLimit": spec.retries.limit if FAILED in spec.retries.reasons else 0,
        "rayClusterSpec": cluster_spec,
    }
    runtime_env = spec.runtime_env.for_ray() if spec.runtime_env else {}
    if runtime_env:
        rj_spec["runtimeEnvYAML"] = yaml.safe_dump(runtime_env, sort_keys=True)
    if spec.time_limit:
        rj_spec["activeDeadlineSeconds"] = int(spec.time_limit)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": job_id,
            "namespace": namespace or meta.get("namespace") or "default",
            "labels": labels,
            "annotations": {USER_ANNOTATION: user, **({"gpuhub/name": spec.name} if spec.name else {})},
        },
        "spec": rj_spec,
    }
