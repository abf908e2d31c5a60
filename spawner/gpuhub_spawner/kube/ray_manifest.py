"""A Ray cluster on Kubernetes: a KubeRay ``RayCluster`` (``ray.io/v1``) that Kueue's
``ray.io/raycluster`` integration admits as one Workload (issue 24).

Built from the user's *server* pod as ``KueueSpawner`` makes it for the same profile, the
way ``job_manifest`` builds a Job: same image, identity (``GPUHUB_USER``, ``GPUHUB_TEAM``,
...), MLflow environment, volumes and security context; the server's own credentials
(``job_manifest.SERVER_ONLY_ENV``), command, ports and probes are left out: KubeRay
writes the ``ray start`` command and the Ray ports itself.

- The **head** is CPU-only: ``ray.headResources`` of the policy, no GPU request, no GPU
  node placement (the flavor's node labels and tolerations are taken off), and
  ``NVIDIA_VISIBLE_DEVICES=void`` so a CUDA image sees none.
- Each **worker group** asks for ``nvidia.com/gpu`` (the profile flavor's resource) per
  pod, with the profile's CPU and memory and the flavor's placement, like the server pod.
- The Kueue labels go on the RayCluster, not its pods (Kueue manages the RayCluster: it
  creates one Workload with a ``head`` pod set and one per worker group, un-suspends it on
  admission and suspends it on preemption), so the pods must not also join the plain-pod
  integration.
- ``kueue.x-k8s.io/elastic-job: "true"`` and ``enableInTreeAutoscaling`` only where the
  policy allows autoscaling (``ray.autoscaling``): Kueue v0.19 refuses a queued RayCluster
  that autoscales without it ("a kueue-managed RayCluster can use autoscaling only as an
  elastic job"); its webhook then adds the ``kueue.x-k8s.io/elastic-job`` scheduling gate
  to the templates itself.
- At most ``MAX_WORKER_GROUPS`` worker groups: a Workload holds at most 18 pod sets in
  Kueue v0.19.2 (``jobframework.MaxPodSets``, the Workload CRD's ``podSets.maxItems``),
  one of them the head's.

Tested against the KubeRay v1.5.0 RayCluster CRD's openAPIV3Schema (unknown fields
rejected), kubernetes-validate for the pod templates, and the real KubeRay operator and
Kueue on tests/cluster's control plane (tests/kube/test_ray_*.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .job_manifest import SERVER_ONLY_ENV, USER_ANNOTATION
from .kueue import PRIORITY_LABEL, PROFILE_LABEL, QUEUE_LABEL, TEAM_LABEL
from .render import queue_for
from .storage import OWN, claim_name, use_work_volume
from ..policy.access import Choice
from ..policy.model import Policy

API_VERSION = "ray.io/v1"
KIND = "RayCluster"
GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
RAY_LABEL = "gpuhub/ray-cluster"
ROLE_LABEL = "gpuhub/ray-role"  # head | worker, on the pods
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"  # workloadslicing.EnabledAnnotationKey (v0.19.2)
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"  # kueue.ElasticJobSchedulingGate, added by Kueue's webhook
MAX_POD_SETS = 18  # Kueue v0.19.2 jobframework.MaxPodSets
MAX_WORKER_GROUPS = MAX_POD_SETS - 1  # the head is a pod set too
HEAD_POD_SET = "head"  # Kueue's pod set name for the head; no worker group may take it
# Kueue v0.19.2's RayCluster webhook (pkg/controller/jobs/raycluster/raycluster_webhook.go):
# its names and the words of its refusals, as the API server returns them.
MUTATING_WEBHOOK = "mraycluster.kb.io"
VALIDATING_WEBHOOK = "vraycluster.kb.io"
MSG_AUTOSCALING_NOT_ELASTIC = (
    "spec.enableInTreeAutoscaling: Invalid value: true: a kueue-managed RayCluster can use autoscaling only as an "
    f'elastic job: enable the ElasticJobsViaWorkloadSlices feature gate and set the "{ELASTIC_ANNOTATION}": "true" annotation'
)
MSG_TOO_MANY_POD_SETS = "spec.workerGroupSpecs: Too many: {count}: must have at most {limit} items"
MSG_HEAD_RESERVED = 'spec.workerGroupSpecs[{index}].groupName: Forbidden: "head" is reserved for the head group'
SERVER_KEYS = ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle", "command", "args")


@dataclass(frozen=True)
class WorkerGroup:
    name: str
    replicas: int
    gpus: int  # per pod, of the profile's flavor


def _cpu(millis: int) -> str:
    return f"{millis}m" if millis % 1000 else str(millis // 1000)


def _strip_flavor_placement(pod_spec: dict, policy: Policy, choice: Choice) -> None:
    """The head runs on any node: the GPU flavor's node labels and tolerations come off."""
    if not choice.gpu_count or not choice.flavor:
        return
    flavor = policy.flavor(choice.flavor)
    selector = {k: v for k, v in (pod_spec.get("nodeSelector") or {}).items() if flavor.node_labels.get(k) != v}
    if selector:
        pod_spec["nodeSelector"] = selector
    else:
        pod_spec.pop("nodeSelector", None)
    flavor_tols = [t.model_dump(exclude_none=True) for t in flavor.tolerations]
    tols = [t for t in pod_spec.get("tolerations") or [] if {k: v for k, v in t.items() if v is not None} not in flavor_tols]
    if tols:
        pod_spec["tolerations"] = tols
    else:
        pod_spec.pop("tolerations", None)


def _template(pod: dict, container_name: str, role: str, cluster: str, image: str, env_extra: dict[str, str]) -> dict:
    pod = copy.deepcopy(pod)
    meta = pod.get("metadata") or {}
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in (QUEUE_LABEL, PRIORITY_LABEL)}
    # Not a notebook server: KubeSpawner's reflector and z2jh's singleuser policies select on it.
    labels["component"] = labels["app.kubernetes.io/component"] = f"gpuhub-ray-{role}"
    labels[RAY_LABEL] = cluster
    labels[ROLE_LABEL] = role
    spec = pod["spec"]
    spec.pop("restartPolicy", None)  # KubeRay's default (Always) restarts a crashed Ray process
    spec.pop("hostname", None)
    spec.pop("subdomain", None)
    container = spec["containers"][0]
    container["name"] = container_name
    container["image"] = image
    for key in SERVER_KEYS:
        container.pop(key, None)
    env = [e for e in container.get("env", []) if e.get("name") not in SERVER_ONLY_ENV and e.get("name") not in env_extra]
    env += [{"name": k, "value": v} for k, v in env_extra.items()]
    container["env"] = env
    return {"metadata": {"labels": labels, "annotations": dict(meta.get("annotations") or {})}, "spec": spec}


def ray_cluster_manifest(
    name: str,
    user: str,
    policy: Policy,
    choice: Choice,
    pod: dict,
    workers: list[WorkerGroup],
    namespace: str | None = None,
    autoscaling: bool | None = None,
    work_volume: str = "home",
) -> dict:
    """The RayCluster ``name`` of ``user``; ``pod`` is the user's server pod for ``choice``
    (a dict, as ``KueueSpawner.get_pod_manifest`` makes it). ``autoscaling`` defaults to
    the policy's ``ray.autoscaling`` and may only narrow it."""
    rules = policy.ray
    if not workers:
        raise ValueError("a Ray cluster needs at least one worker group")
    if len(workers) > MAX_WORKER_GROUPS:
        raise ValueError(f"{len(workers)} worker groups: Kueue admits at most {MAX_WORKER_GROUPS} besides the head")
    if any(w.name == HEAD_POD_SET for w in workers):
        raise ValueError(f"{HEAD_POD_SET!r} is the head's pod set name in Kueue; a worker group cannot have it")
    if len({w.name for w in workers}) != len(workers):
        raise ValueError("worker group names must differ")
    elastic = rules.autoscaling if autoscaling is None else (rules.autoscaling and autoscaling)
    server = pod["spec"]["containers"][0]
    image = rules.image or server["image"]
    meta = pod.get("metadata") or {}
    namespace = namespace or meta.get("namespace") or "default"
    common = {"GPUHUB_RAY_CLUSTER": name, "GPUHUB_IMAGE": image}

    # -- head: CPU only --------------------------------------------------------------------
    head = _template(
        pod,
        "ray-head",
        "head",
        name,
        image,
        {**common, "GPUHUB_GPU_COUNT": "0", "GPUHUB_GPU_FLAVOR": "", "NVIDIA_VISIBLE_DEVICES": "void"},
    )
    _strip_flavor_placement(head["spec"], policy, choice)
    hc = head["spec"]["containers"][0]
    if work_volume == OWN:  # kube/storage.py: the cluster's own claim on the head only
        use_work_volume(head["spec"], claim_name(name))
    head_res = {"cpu": _cpu(rules.head_resources.cpu), "memory": str(rules.head_resources.memory)}
    hc["resources"] = {"requests": dict(head_res), "limits": dict(head_res)}

    # -- workers: the profile's GPUs per pod -------------------------------------------------
    resource = policy.flavor(choice.flavor).resource if choice.flavor else "nvidia.com/gpu"
    groups = []
    for wg in workers:
        extra = {**common, "GPUHUB_GPU_COUNT": str(wg.gpus), "GPUHUB_RAY_WORKER_GROUP": wg.name}
        if not wg.gpus:
            extra["NVIDIA_VISIBLE_DEVICES"] = "void"
        tmpl = _template(pod, "ray-worker", "worker", name, image, extra)
        c = tmpl["spec"]["containers"][0]
        res = copy.deepcopy(server.get("resources") or {})
        for part in ("requests", "limits"):
            res.setdefault(part, {}).pop(resource, None)
            if wg.gpus:
                res[part][resource] = str(wg.gpus)
            if not res[part]:
                del res[part]
        c["resources"] = res
        if not wg.gpus:
            _strip_flavor_placement(tmpl["spec"], policy, choice)
        if work_volume == OWN:  # a ReadWriteOnce claim cannot follow workers onto other nodes
            use_work_volume(tmpl["spec"], None)
        group = {
            "groupName": wg.name,
            "replicas": wg.replicas,
            "minReplicas": 0 if elastic else wg.replicas,
            "maxReplicas": wg.replicas,
            "rayStartParams": {"num-gpus": str(wg.gpus)},
            "template": tmpl,
        }
        groups.append(group)

    labels = {
        QUEUE_LABEL: queue_for(policy, choice.team, user),
        TEAM_LABEL: choice.team.name,
        PROFILE_LABEL: choice.profile.slug,
        RAY_LABEL: name,
    }
    if choice.priority_class:
        labels[PRIORITY_LABEL] = choice.priority_class
    annotations = {USER_ANNOTATION: user}
    spec = {
        "suspend": True,  # Kueue un-suspends it on admission (its webhook would set it too)
        "headGroupSpec": {"rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"}, "template": head},
        "workerGroupSpecs": groups,
    }
    if elastic:
        annotations[ELASTIC_ANNOTATION] = "true"
        spec["enableInTreeAutoscaling"] = True
        if hc.get("securityContext"):
            # KubeRay adds the autoscaler sidecar to the head pod with no securityContext
            # unless the RayCluster gives it one; the users' namespace enforces Pod Security
            # `restricted` (issue 40), which would refuse the head pod. It gets the head
            # container's (the server's: non-root, no privilege escalation, no capabilities,
            # RuntimeDefault seccomp). KubeRay's own init container already copies the Ray
            # container's.
            spec["autoscalerOptions"] = {"securityContext": copy.deepcopy(hc["securityContext"])}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


def pod_templates(cluster: dict) -> list[tuple[str, dict]]:
    """(pod set name, template) as Kueue's RayCluster integration makes its pod sets: the head,
    then each worker group under its own name."""
    spec = cluster["spec"]
    out = [(HEAD_POD_SET, spec["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs") or []]
    return out


def pod_set_counts(cluster: dict) -> dict[str, int]:
    """Pods per pod set as Kueue counts them (``effectiveWorkerCount``: replicas, default 1,
    times numOfHosts)."""
    spec = cluster["spec"]
    out = {HEAD_POD_SET: 1}
    for g in spec.get("workerGroupSpecs") or []:
        out[g["groupName"]] = int(g.get("replicas", 1)) * max(1, int(g.get("numOfHosts", 1)))
    return out


def workload_for(cluster: dict, priority_value: int = 0) -> dict:
    """The Workload Kueue's RayCluster integration derives from ``cluster`` (for contract
    tests and the double): a ``head`` pod set and one per worker group."""
    meta = cluster["metadata"]
    counts = pod_set_counts(cluster)
    wl: dict[str, Any] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": f"raycluster-{meta['name']}", "namespace": meta["namespace"]},
        "spec": {
            "queueName": meta["labels"][QUEUE_LABEL],
            "podSets": [
                {
                    "name": n,
                    "count": counts[n],
                    "template": {
                        "metadata": {"labels": dict((t.get("metadata") or {}).get("labels") or {})},
                        "spec": copy.deepcopy(t["spec"]),
                    },
                }
                for n, t in pod_templates(cluster)
            ],
        },
    }
    if PRIORITY_LABEL in meta["labels"]:
        wl["spec"]["priorityClassRef"] = {
            "group": "kueue.x-k8s.io",
            "kind": "WorkloadPriorityClass",
            "name": meta["labels"][PRIORITY_LABEL],
        }
        wl["spec"]["priority"] = priority_value
    return wl


def kueue_refusal(cluster: dict) -> str | None:
    """What Kueue v0.19.2's RayCluster webhook says when it refuses ``cluster`` (a queued one),
    or None (``validateCreate``; the feature gate ElasticJobsViaWorkloadSlices is on by default)."""
    spec = cluster.get("spec") or {}
    errors = []
    elastic = ((cluster.get("metadata") or {}).get("annotations") or {}).get(ELASTIC_ANNOTATION) == "true"
    if spec.get("enableInTreeAutoscaling") and not elastic:
        errors.append(MSG_AUTOSCALING_NOT_ELASTIC)
    count = len(spec.get("workerGroupSpecs") or []) + 1
    if count > MAX_POD_SETS:
        errors.append(MSG_TOO_MANY_POD_SETS.format(count=count, limit=MAX_POD_SETS))
    for i, g in enumerate(spec.get("workerGroupSpecs") or []):
        if g.get("groupName") == HEAD_POD_SET:
            errors.append(MSG_HEAD_RESERVED.format(index=i))
    if not errors:
        return None
    return errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
