"""A job on Kubernetes: a suspended ``batch/v1`` Job that Kueue's job integration admits.

The pod template is the user's *server* pod as ``KueueSpawner`` builds it for the same
profile (same image, resources, GPU request, node placement, volumes, labels and
environment), with the server's command replaced by the job's. The Kueue labels go on
the Job, not on its pods: Kueue manages the Job (it creates the Workload, un-suspends the
Job on admission and suspends it again on preemption), so its pods must not also join
the plain-pod integration.

Recovery maps onto the Job API:

- Kueue preemption *suspends* the Job (its pods are deleted, not failed): the Job waits
  in the queue again and nothing counts against ``backoffLimit``;
- ``podFailurePolicy`` decides per exit: pod disruptions (``DisruptionTarget``: node
  drain, eviction) are ignored when ``preempted``/``interrupted`` are retryable; the
  listed exit codes (or every non-zero one with ``failed``) count against
  ``backoffLimit = retries.limit``; any other non-zero exit fails the Job at once;
- ``timeLimit`` is ``activeDeadlineSeconds`` and Kueue's ``max-exec-time-seconds`` label.

Several workers (``workers: N``) are an *Indexed* Job of N pods (``parallelism`` =
``completions`` = N): Kueue's Workload has one pod set of count N, so its quota is reserved
for all N or none, and the operator's ``waitForPodsReady`` (helm-values/kueue) evicts and
re-queues the whole Job when not all N run in time. Each pod is one worker with the
profile's resources; the rendezvous is rank 0's stable name through a headless Service of
the Job's own (``rendezvous_service``, made by the job manager, owned by the Job):
``MASTER_ADDR=<job>-0.<job>``, ``RANK`` from the pod's completion index. A worker's failing
exit fails the whole Job (``podFailurePolicy`` ``FailJob``: the Job controller stops the
other workers), since a rendezvous of N cannot go on with one worker restarted alone; a
preemption suspends the whole Job and all N pods come back together. Where the profile's
flavor names a topology (Kueue TAS), the pod template carries Kueue's pod-set topology
annotation so the N pods land inside one domain of that level.

Why an Indexed Job and not a JobSet: the Job controller is part of every cluster, Kueue's
``batch/job`` integration (on by default) gives the all-or-nothing Workload, and the stable
names come from a plain headless Service; a JobSet needs its own controller and CRD
installed and Kueue's ``jobset`` integration enabled, for what one group of identical
workers does not use (several replicated jobs, whole-set restarts; here a failing worker
ends the attempt and ``retries`` never restart one worker alone).

Tested against kubernetes-validate (strict), the Kueue v0.19.2 Workload CRD, the API
double's model of the Job controller and Kueue's job integration (admission, suspension
on preemption, podFailurePolicy, Indexed Jobs), and on the real control plane (the Job
controller, kube-scheduler and Kueue v0.19.2, its topology-aware scheduling included:
tests/kube/test_job_hub_e2e.py, test_job_workers_hub_e2e.py, test_job_topology_real.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .kueue import PRIORITY_LABEL, PROFILE_LABEL, QUEUE_LABEL, TEAM_LABEL
from .render import queue_for
from .storage import OWN, claim_name, use_work_volume
from ..policy.access import Choice
from ..policy.model import Policy
from ..jobs.spec import FAILED, INTERRUPTED, PREEMPTED, JobSpec

JOB_LABEL = "gpuhub/job"
TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-{mode}-topology"  # mode: preferred or required (Kueue TAS)
UNCONSTRAINED_TOPOLOGY = "kueue.x-k8s.io/podset-unconstrained-topology"  # kube/spawner.py's, on a server pod
RENDEZVOUS_PORT = 29500
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_COMPONENT = "gpuhub-job"  # the ``component`` label of a job's pods
MAX_EXEC_LABEL = "kueue.x-k8s.io/max-exec-time-seconds"
USER_ANNOTATION = "gpuhub/user"
SERVER_ONLY_ENV = (
    "JUPYTERHUB_API_TOKEN",
    "JPY_API_TOKEN",
    "JUPYTERHUB_CLIENT_ID",
    "JUPYTERHUB_OAUTH_CALLBACK_URL",
    "JUPYTERHUB_OAUTH_SCOPES",
    "JUPYTERHUB_OAUTH_ACCESS_SCOPES",
    "JUPYTERHUB_OAUTH_CLIENT_ALLOWED_SCOPES",
    "JUPYTERHUB_SERVICE_PREFIX",
    "JUPYTERHUB_SERVICE_URL",
    "JUPYTERHUB_ACTIVITY_URL",
    "JUPYTERHUB_COOKIE_HOST_PREFIX_ENABLED",
    "JUPYTERHUB_SERVER_NAME",
    "JUPYTERHUB_DEFAULT_URL",
)


def pod_failure_policy(spec: JobSpec) -> dict:
    reasons = spec.retries.reasons
    rules: list[dict[str, Any]] = []
    disruption = "Ignore" if (PREEMPTED in reasons or INTERRUPTED in reasons) else "FailJob"
    rules.append({"action": disruption, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]})
    if spec.workers > 1:
        # One worker restarted alone cannot rejoin the others' rendezvous: any failing exit
        # ends the Job (the job manager refuses retries on exits for several workers).
        rules.append({"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}})
        return {"rules": rules}
    if FAILED in reasons:
        rules.append({"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0]}})
    else:
        codes = sorted(c for c in reasons if isinstance(c, int))
        if codes:
            rules.append({"action": "Count", "onExitCodes": {"operator": "In", "values": codes}})
        rules.append({"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}})
    return {"rules": rules}


def job_kueue_labels(policy: Policy, choice: Choice, user, job_id: str, spec: JobSpec, job_priority_class: str | None) -> dict:
    """The labels by which Kueue queues a job's object (a Job or a RayJob): the team's (or the
    user's) LocalQueue, the job's priority, and its time limit as Kueue's own."""
    pclass = job_priority_class or choice.team.job_priority or choice.priority_class
    labels = {
        QUEUE_LABEL: queue_for(policy, choice.team, user),
        TEAM_LABEL: choice.team.name,
        PROFILE_LABEL: choice.profile.slug,
        JOB_LABEL: job_id,
    }
    if pclass:
        labels[PRIORITY_LABEL] = pclass
    if spec.time_limit:
        # Kueue's own limit (Workload.spec.maximumExecutionTimeSeconds) besides the Job's deadline.
        labels[MAX_EXEC_LABEL] = str(int(spec.time_limit))
    return labels


def job_manifest(
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
    """The suspended Job for ``spec``; ``pod`` is the user's server pod manifest (a dict).
    ``work_volume`` (kube/storage.py): ``home`` keeps the server's volumes; ``own`` mounts the
    job's own claim ``<job>-work`` at the home path instead (made by the job manager)."""
    pod = copy.deepcopy(pod)
    meta = pod.get("metadata") or {}
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in (QUEUE_LABEL, PRIORITY_LABEL)}
    labels[JOB_LABEL] = job_id
    # Not a notebook server (as a Ray pod is not): KubeSpawner's reflector and the policies for
    # servers (gpuhub-singleuser, the proxy's way in on 8888) select on it; a job's pods are
    # reached only as its wall allows (kube/walls.py) and get out as gpuhub-batch lets them.
    labels["component"] = labels["app.kubernetes.io/component"] = JOB_COMPONENT
    pod_spec = pod["spec"]
    pod_spec["restartPolicy"] = "Never"  # required by podFailurePolicy; retries are new pods
    container = pod_spec["containers"][0]
    home = next((e.get("value") for e in container.get("env", []) if e.get("name") == "HOME"), None) or "/home/jovyan"
    container["name"] = "job"
    container["command"] = spec.argv
    container.pop("args", None)
    for key in ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"):
        container.pop(key, None)
    if spec.working_dir:
        container["workingDir"] = spec.working_dir if spec.working_dir.startswith("/") else f"{home}/{spec.working_dir}"
    if spec.image:
        container["image"] = spec.image
    if work_volume == OWN:
        use_work_volume(pod_spec, claim_name(job_id))
    ckpt = spec.checkpoint_dir or f".gpuhub/checkpoints/{job_id}"
    env = [e for e in container.get("env", []) if e.get("name") not in SERVER_ONLY_ENV and e.get("name") not in spec.env]
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    env += [
        {"name": "GPUHUB_JOB_ID", "value": job_id},
        {"name": "GPUHUB_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # No attempt counter exists in a Job's pods: each retry is a new pod, so the pod's
        # name stands for the attempt (expanded by the kubelet from GPUHUB_POD above).
        {"name": "GPUHUB_ATTEMPT", "value": "$(GPUHUB_POD)"},
        {"name": "GPUHUB_CHECKPOINT_DIR", "value": ckpt if ckpt.startswith("/") else f"{home}/{ckpt}"},
        {"name": "MLFLOW_RUN_CONTEXT", "value": json.dumps({"gpuhub.job.id": job_id, "gpuhub.job.attempt": "$(GPUHUB_POD)"})},
    ]
    if spec.workers > 1:
        # Rank 0's stable DNS name: <pod hostname>.<subdomain> through the Job's headless Service.
        pod_spec["subdomain"] = job_id
        env += [
            {"name": "MASTER_ADDR", "value": f"{job_id}-0.{job_id}"},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
            {"name": "WORLD_SIZE", "value": str(spec.workers)},
            {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": "GPUHUB_WORKER", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": "LOCAL_RANK", "value": "0"},  # one worker per pod
            {"name": "LOCAL_WORLD_SIZE", "value": "1"},
        ]
    if spec.experiment:
        env = [e for e in env if e.get("name") != "MLFLOW_EXPERIMENT_NAME"] + [
            {"name": "MLFLOW_EXPERIMENT_NAME", "value": spec.experiment}
        ]
    container["env"] = env
    job_labels = job_kueue_labels(policy, choice, user, job_id, spec, job_priority_class)
    annotations = dict(meta.get("annotations") or {})
    flavor = next((f for f in policy.flavors if f.name == choice.flavor), None)
    if spec.workers > 1 and flavor is not None and flavor.topology is not None:
        # Kueue TAS: all N workers inside one domain of the level the operator named (in place
        # of the server pod's "anywhere in the topology").
        annotations.pop(UNCONSTRAINED_TOPOLOGY, None)
        annotations[TOPOLOGY_ANNOTATION.format(mode=flavor.topology.mode)] = flavor.topology.level
    job_spec = {
        "suspend": True,  # Kueue un-suspends it on admission
        "parallelism": spec.workers,
        "completions": spec.workers,
        "backoffLimit": spec.retries.limit,
        "podFailurePolicy": pod_failure_policy(spec),
        "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
    }
    if spec.time_limit:
        job_spec["activeDeadlineSeconds"] = int(spec.time_limit)
    if spec.workers > 1:
        job_spec["completionMode"] = "Indexed"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_id,
            "namespace": namespace or meta.get("namespace") or "default",
            "labels": job_labels,
            "annotations": {USER_ANNOTATION: user, **({"gpuhub/name": spec.name} if spec.name else {})},
        },
        "spec": job_spec,
    }


def rendezvous_service(job: dict) -> dict:
    """The headless Service that gives a several-worker Job's pods their names
    (``<job>-<index>.<job>``); owned by the Job, so it goes with it."""
    meta = job["metadata"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]} if meta.get("uid") else None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": {JOB_LABEL: meta["name"]},
            **({"ownerReferences": [owner]} if owner else {}),
        },
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: meta["name"]},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "protocol": "TCP"}],
            "publishNotReadyAddresses": True,  # rank 0 is reachable before any readiness
        },
    }


def workload_for(job: dict, priority_value: int = 0) -> dict:
    """The Workload Kueue's job controller derives from ``job`` (for contract tests)."""
    labels = job["metadata"]["labels"]
    wl: dict[str, Any] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": f"job-{job['metadata']['name']}", "namespace": job["metadata"]["namespace"]},
        "spec": {
            "queueName": labels[QUEUE_LABEL],
            "podSets": [{"name": "main", "count": job["spec"]["parallelism"], "template": job["spec"]["template"]}],
        },
    }
    if PRIORITY_LABEL in labels:
        wl["spec"]["priorityClassRef"] = {
            "group": "kueue.x-k8s.io",
            "kind": "WorkloadPriorityClass",
            "name": labels[PRIORITY_LABEL],
        }
        wl["spec"]["priority"] = priority_value
    if MAX_EXEC_LABEL in labels:
        wl["spec"]["maximumExecutionTimeSeconds"] = int(labels[MAX_EXEC_LABEL])
    return wl
