"""Every Kubernetes API right the hub uses, and why: the list the shipped RBAC is checked against.

Kept beside the code that makes the calls. ``tests/unit/test_kube_rbac.py`` reads the calls
themselves from the source (this package's modules and KubeSpawner 7.1's own), derives each
call's (namespace, API group, resource, verb) from the client method's REST path, and fails
when a call is missing here or an entry here has no call left; then it checks that the
manifests the install guide applies (``helm-values/user-namespace.yaml``, ``gpuhub render
capacity-rbac``, ``gpuhub render policy-rbac``) grant every right below, and that the users'
namespace Role grants nothing else. On the real control plane the same list is asked of the
API server's RBAC authorizer (``kubectl auth can-i --as=system:serviceaccount:gpuhub:hub``),
and the hub of the real-plane tests runs with that service account's token.

Where the rights live (docs/install-kubernetes.md, section 2):

* ``users``: the Role ``gpuhub-hub`` in the users' namespace (``user-namespace.yaml``), or in each
  team's namespace with the policy's ``tenancy.mode: team`` (``gpuhub render tenancy``, ``kube/tenancy.py``);
* ``hub``: the Role ``gpuhub-policy-writer`` in the hub's namespace (``gpuhub render policy-rbac``),
  on the policy's ConfigMap only, by name;
* ``cluster``: the ClusterRole ``gpuhub-gpu-capacity`` (``gpuhub render capacity-rbac``): nodes,
  and the ClusterQueues ``health.kubernetes.capacityQueue`` designates, by name.
"""

from __future__ import annotations

from dataclasses import dataclass

USERS, HUB, CLUSTER = "users", "hub", "cluster"


@dataclass(frozen=True)
class Right:
    scope: str  # USERS, HUB or CLUSTER
    group: str  # "" is the core group
    resource: str  # plural, "pods/log" for a subresource
    verbs: tuple[str, ...]
    why: str
    by_name: bool = False  # granted only on named objects (resourceNames)
    only_if: str = ""  # a condition of the policy; empty: always


RIGHTS: tuple[Right, ...] = (
    # KubeSpawner 7.1 (its own code): the user's server pod, its home volume, its events.
    Right(
        USERS,
        "",
        "pods",
        ("create", "delete", "list", "watch"),
        "KubeSpawner creates and deletes each server's pod; its pod reflector lists and watches them; "
        "the job manager lists a job's pods by label (kube/job_manager.py)",
    ),
    Right(
        USERS,
        "",
        "persistentvolumeclaims",
        ("create", "get", "delete"),
        "KubeSpawner creates each user's home volume claim (z2jh's singleuser.storage.type dynamic), "
        "reads it when it exists already, deletes it with the user; with work_volume: own the hub creates "
        "each job's and Ray cluster's own claim (kube/storage.py; the garbage collector deletes it with its owner)",
    ),
    Right(
        USERS,
        "",
        "events",
        ("list", "watch"),
        "KubeSpawner's event reflector: the spawn page's progress (scheduling, Kueue's CreatedWorkload)",
    ),
    Right(USERS, "", "pods/log", ("get",), "the job manager copies each job attempt's log before the pod goes (gpuhub job logs)"),
    # Kueue: what the ledger, the waiting words, reclaim and the job manager read and change.
    Right(
        USERS,
        "kueue.x-k8s.io",
        "workloads",
        ("list", "watch", "patch"),
        "the ledger's Workload reflector lists and watches them; the ledger patches spec.active to take "
        "back a borrowing job and to reactivate it (kube/ledger.py); the job manager lists a job's Workload "
        "and deactivates it when its node's GPUs failed (kube/job_manager.py); the Ray manager lists them",
    ),
    Right(
        USERS,
        "kueue.x-k8s.io",
        "localqueues",
        ("create", "delete"),
        "with fairShare.users each user's own LocalQueue in their team's ClusterQueue, created at their first "
        "start there (an existing one answers 409: no get needed) and deleted when they are off-boarded "
        "(kube/spawner.py ensure_queue, delete_user_queues); the policy's team queues are the admin's apply",
    ),
    Right(
        USERS,
        "visibility.kueue.x-k8s.io",
        "localqueues/pendingworkloads",
        ("get",),
        "queue positions on the spawn page (kube/state.py)",
    ),
    # Batch jobs and Ray clusters.
    Right(
        USERS,
        "batch",
        "jobs",
        ("create", "get", "delete"),
        "gpuhub's batch jobs: a suspended Job Kueue admits; read on every refresh; deleted on cancel (kube/job_manager.py)",
    ),
    Right(
        USERS,
        "ray.io",
        "rayclusters",
        ("create", "list", "patch", "delete"),
        "Ray clusters (kube/ray_manager.py): created, listed on every refresh, annotated, deleted",
    ),
    Right(
        USERS,
        "ray.io",
        "rayjobs",
        ("create", "get", "delete"),
        "kind: ray jobs: a suspended RayJob Kueue admits; read on every refresh; deleted on cancel, which takes its "
        "RayCluster and pods with it (kube/job_manager.py, kube/rayjob_manifest.py)",
    ),
    Right(
        USERS,
        "networking.k8s.io",
        "networkpolicies",
        ("create",),
        "the wall around each Ray cluster and batch job (kube/walls.py): two NetworkPolicies made with the "
        "object and owned by it (the garbage collector deletes them with it)",
    ),
    Right(
        USERS,
        "",
        "services",
        ("create",),
        "a several-worker job's headless Service, which gives its workers their names (MASTER_ADDR=<job>-0.<job>; "
        "kube/job_manifest.py rendezvous_service): made with the Job and owned by it (the garbage collector deletes it)",
    ),
    # The hub's own namespace: the policy's ConfigMap only.
    Right(
        HUB,
        "",
        "configmaps",
        ("get", "list", "watch", "patch"),
        "the policy page applies and rolls back the policy; the hub follows its ConfigMap "
        "(kube/policy_configmap.py); list and watch by name with field selector metadata.name",
        by_name=True,
    ),
    # Cluster-wide: the GPU capacity keeper.
    Right(
        CLUSTER,
        "",
        "nodes",
        ("list",),
        "the GPU capacity keeper counts GPUs out of service (kube/capacity.py); the job manager reads a "
        "failed node's taint by name with a field selector (kube/job_manager.py)",
    ),
    Right(
        CLUSTER,
        "kueue.x-k8s.io",
        "clusterqueues",
        ("get", "patch"),
        "the capacity keeper takes failed GPUs out of the designated ClusterQueues' quota (kube/capacity.py)",
        by_name=True,
        only_if="health.kubernetes.capacityQueue",
    ),
)

# KubeSpawner calls made only with settings gpuhub leaves off (its values and KueueSpawner):
# no rights are granted for them (``services``: only ``create``, for gpuhub's own several-worker
# jobs above; KubeSpawner's reads and deletes of a server's Service stay unused).
# tests/unit/test_kube_rbac.py checks the settings.
NOT_USED = {
    ("", "secrets"): "KubeSpawner.internal_ssl (off)",
    ("", "services"): "KubeSpawner.services_enabled / internal_ssl (off)",
    (
        "",
        "namespaces",
    ): "KubeSpawner.enable_user_namespaces (off: the users' namespaces, shared or per team, are made by the install guide)",
}


def needed(capacity_queues: bool = True) -> set[tuple[str, str, str, str]]:
    """Every (scope, group, resource, verb) of ``RIGHTS``."""
    return {(r.scope, r.group, r.resource, v) for r in RIGHTS for v in r.verbs if capacity_queues or not r.only_if}


def grants(rules: list[dict], group: str, resource: str, verb: str, name: str | None = None) -> bool:
    """Whether RBAC ``rules`` allow ``verb`` on ``group``/``resource`` (the object ``name`` when
    the rule names objects), as Kubernetes' RBAC authorizer matches a rule."""
    for rule in rules:
        if not ({group, "*"} & set(rule.get("apiGroups") or [])):
            continue
        if not ({resource, "*"} & set(rule.get("resources") or [])):
            continue
        if not ({verb, "*"} & set(rule.get("verbs") or [])):
            continue
        names = rule.get("resourceNames") or []
        if names and (name is None or name not in names):
            continue
        return True
    return False


def can_i_args(group: str, resource: str, verb: str) -> list[str]:
    """``kubectl auth can-i`` arguments for one right (``pods --subresource=log`` for pods/log)."""
    base, _, sub = resource.partition("/")
    target = f"{base}.{group}" if group else base
    return [verb, target] + ([f"--subresource={sub}"] if sub else [])
