"""Kueue's vocabulary in one place: API groups, label keys, condition types.

Kueue v0.19 (API ``kueue.x-k8s.io/v1beta2``). Kept apart from the spawner so the
renderer, the state reader and the test double agree on every string.
"""

from __future__ import annotations

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
VISIBILITY_VERSION = "v1beta2"

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"

# gpuhub's own labels on pods and rendered objects (who/what, for dashboards and the culler).
TEAM_LABEL = "gpuhub/team"
PROFILE_LABEL = "gpuhub/profile"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuhub"}

# Workload condition types (v1beta2).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"


def condition(obj: dict | None, ctype: str) -> dict | None:
    """The status condition of type ``ctype`` on a Kubernetes object, if any."""
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return None


def is_true(obj: dict | None, ctype: str) -> bool:
    cond = condition(obj, ctype)
    return bool(cond and cond.get("status") == "True")


def pod_is_gated(pod: dict | None) -> bool:
    """True while Kueue's admission gate keeps the pod away from the scheduler."""
    gates = ((pod or {}).get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ADMISSION_GATE for g in gates)


def owner_pod_name(workload: dict) -> str | None:
    """Name of the plain pod a Workload was created for (Kueue sets the owner reference)."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1":
            return ref.get("name")
    return None
