"""Kueue's vocabulary in one place: API groups, labels, conditions, reasons and messages.

Every string below is copied from Kueue v0.19.2's source (API ``kueue.x-k8s.io/v1beta2``);
the comment beside each names the file it comes from. The renderer, the state reader,
the plain-words layer (``messages.py``) and the test double (``tests/kube/double``) all
import them from here, so the double speaks exactly the words the spawner parses.
Upgrading Kueue means re-checking this file against the new tag, nothing else.
"""

from __future__ import annotations

from datetime import datetime

KUEUE_VERSION = "v0.19.2"

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
VISIBILITY_VERSION = "v1beta2"

# pkg/controller/constants, pkg/constants/constants.go, pkg/controller/jobs/pod/constants/constants.go
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
MANAGED_LABEL = "kueue.x-k8s.io/managed"  # ManagedByKueueLabelKey, value "true"
MANAGED_VALUE = "true"
POD_FINALIZER = MANAGED_LABEL  # PodFinalizer = constants.ManagedByKueueLabelKey
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # SchedulingGateName
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"

# gpuhub's own labels on pods and rendered objects (who/what, for dashboards and the culler).
TEAM_LABEL = "gpuhub/team"
PROFILE_LABEL = "gpuhub/profile"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuhub"}

# Workload condition types (apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"

# QuotaReserved=False reasons. With the UnadmittedWorkloadsObservability gate off (the
# v0.19 default) the scheduler writes "Pending" (pkg/scheduler/scheduler.go
# requeueAndUpdate: UnadmittedWorkloadReasonWithFallback(..., "Pending")) and the workload
# controller "Inadmissible" for a missing/inactive queue; with the gate on, the granular ones.
REASON_PENDING = "Pending"  # WorkloadPending (deprecated, still the default)
REASON_INADMISSIBLE = "Inadmissible"  # WorkloadInadmissible
REASON_WAITING_FOR_QUOTA = "WaitingForQuota"
REASON_EXCEEDS_MAX_QUOTA = "ExceedsMaxQuota"
REASON_MISCONFIGURED = "Misconfigured"
REASON_SUSPENDED = "Suspended"
REASON_NO_MATCHING_FLAVOR = "NoMatchingFlavor"

# Evicted reasons (workload_types.go) and the Preempted condition's reasons (preemption).
EVICTED_BY_PREEMPTION = "Preempted"  # WorkloadEvictedByPreemption
EVICTED_BY_CLUSTER_QUEUE_STOPPED = "ClusterQueueStopped"
EVICTED_BY_LOCAL_QUEUE_STOPPED = "LocalQueueStopped"
EVICTED_DEACTIVATED = "Deactivated"  # WorkloadDeactivated (v1beta1's InactiveWorkload is gone)
# spec.active: false / true (pkg/controller/core/workload_controller.go): the Evicted and
# Requeued conditions a deactivation and a reactivation write.
MSG_DEACTIVATED = "The workload is deactivated"
REASON_REACTIVATED = "Reactivated"  # WorkloadReactivated
MSG_REACTIVATED = "The workload was reactivated"
EVICTED_BY_PODS_READY_TIMEOUT = "PodsReadyTimeout"
EVICTED_DUE_TO_NODE_FAILURES = "NodeFailures"
PREEMPTED_IN_CLUSTER_QUEUE = "InClusterQueue"
PREEMPTED_IN_COHORT_RECLAMATION = "InCohortReclamation"
PREEMPTED_IN_COHORT_FAIR_SHARING = "InCohortFairSharing"
PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING = "InCohortReclaimWhileBorrowing"

# The stopped pod's condition (pkg/controller/jobs/pod/pod_controller.go Stop): type
# ConditionTypeTerminationTarget, reason = the stop reason, which for an eviction is
# "WorkloadEvicted" + "DueTo" + the Evicted reason (jobframework/reconciler.go).
POD_TERMINATION_TARGET = "TerminationTarget"
STOP_REASON_WORKLOAD_EVICTED = "WorkloadEvicted"
STOP_REASON_WORKLOAD_DELETED = "WorkloadDeleted"


def stop_reason_for_eviction(evicted_reason: str) -> str:
    """``WorkloadEvictedDueToPreempted`` and friends, as Kueue writes them on the pod."""
    return f"{STOP_REASON_WORKLOAD_EVICTED}DueTo{evicted_reason}"


# Pod events Kueue records (pkg/controller/jobframework/events.go, reconciler.go).
EVENT_STARTED = "Started"  # "Admitted by clusterQueue X": admitted, NOT running
EVENT_STOPPED = "Stopped"
EVENT_CREATED_WORKLOAD = "CreatedWorkload"
EVENT_REPORTING_CONTROLLER = "pod-kueue-controller"  # the pod integration's recorder, seen on Kueue v0.19.2


def msg_started(cluster_queue: str) -> str:
    return f"Admitted by clusterQueue {cluster_queue}"


def msg_created_workload(namespace: str, name: str) -> str:
    return f"Created Workload: {namespace}/{name}"


# Scheduler messages (pkg/scheduler/flavorassigner/flavorassigner.go). Reasons of one pod
# set are sorted and joined with ", " after "couldn't assign flavors to pod set <name>: ".
MSG_ASSIGN_PREFIX = "couldn't assign flavors to pod set {podset}: "
MSG_UNUSED_QUOTA = "insufficient unused quota for {resource} in flavor {flavor}, {more} more needed"
MSG_MAX_CAPACITY = (
    "insufficient quota for {resource} in flavor {flavor}, previously considered podsets requests "
    "({previous}) + current podset request ({request}) > maximum capacity ({capacity})"
)
MSG_RESOURCE_UNAVAILABLE = "resource {resource} unavailable in ClusterQueue"
MSG_NODE_AFFINITY = "flavor {flavor} doesn't match node affinity"
MSG_UNTOLERATED_TAINT = "untolerated taint {taint} in flavor {flavor}"
# Queue blockers (pkg/controller/core/workload_controller.go getQueueBlocker; the scheduler
# writes the inactive-ClusterQueue one itself with reason "Pending", scheduler.go).
MSG_LQ_MISSING = "LocalQueue {name} doesn't exist"
MSG_LQ_INACTIVE = "LocalQueue {name} is inactive"
MSG_CQ_MISSING = "ClusterQueue {name} doesn't exist"
MSG_CQ_INACTIVE = "ClusterQueue {name} is inactive"
MSG_QUOTA_RESERVED = "Quota reserved in ClusterQueue {name}"
MSG_ADMITTED = "The workload is admitted"

# Kueue's pod webhooks (config/components/webhook/manifests.yaml): both failurePolicy
# Fail, on every pod CREATE outside kube-system and kueue-system unless narrowed.
POD_MUTATING_WEBHOOK = "mpod.kb.io"
POD_VALIDATING_WEBHOOK = "vpod.kb.io"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_NAMESPACE = "kueue-system"
# How the API server reports a failed call (an InternalError, HTTP 500).
WEBHOOK_FAILED_MARKER = "failed calling webhook"


def timestamp(value: str | None) -> float | None:
    """A Kubernetes RFC 3339 time (``creationTimestamp``, ``lastTransitionTime``) as epoch seconds."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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


def owner_pod(workload: dict) -> tuple[str | None, str | None]:
    """(name, uid) of the plain pod a Workload was created for (Kueue sets the owner reference)."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1":
            return ref.get("name"), ref.get("uid")
    return None, None


def owner_pod_name(workload: dict) -> str | None:
    return owner_pod(workload)[0]


def owner_pod_uid(workload: dict) -> str | None:
    return owner_pod(workload)[1]


# Preemption (appended for the test double's Kueue scheduler; copied from v0.19.2 like the rest).
# Policy values of a ClusterQueue's spec.preemption (apis/kueue/v1beta2/clusterqueue_types.go).
PREEMPTION_NEVER = "Never"  # PreemptionPolicyNever, the CRD default of both fields
PREEMPTION_LOWER_PRIORITY = "LowerPriority"
PREEMPTION_LOWER_OR_NEWER_EQUAL_PRIORITY = "LowerOrNewerEqualPriority"
PREEMPTION_ANY = "Any"
BORROW_WITHIN_COHORT_NEVER = "Never"  # BorrowWithinCohortPolicyNever
BORROW_WITHIN_COHORT_LOWER_PRIORITY = "LowerPriority"

# The Evicted/Preempted message (pkg/scheduler/preemption/preemption.go preemptionMessage and
# HumanReadablePreemptionReasons); a path is "/" + cohort + "/" + ClusterQueue (buildCQPath),
# "/" + ClusterQueue without a cohort; an unknown UID or path reads "UNKNOWN".
MSG_PREEMPTED = (
    "Preempted to accommodate a workload (UID: {uid}, JobUID: {job_uid}) due to {why}; "
    "preemptor path: {preemptor_path}; preemptee path: {preemptee_path}"
)
PREEMPTION_WHY = {
    PREEMPTED_IN_CLUSTER_QUEUE: "prioritization in the ClusterQueue",
    PREEMPTED_IN_COHORT_RECLAMATION: "reclamation within the cohort",
    PREEMPTED_IN_COHORT_FAIR_SHARING: "Fair Sharing within the cohort",
    PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING: "reclamation within the cohort while borrowing",
}
UNKNOWN = "UNKNOWN"
# Appended to the preemptor's QuotaReserved=False message (pkg/scheduler/scheduler.go
# markPreemptionOutcome, markSkipped).
MSG_PENDING_PREEMPTION = ". Pending the preemption of {count} workload(s)"
MSG_OVERLAPPING_TARGETS = "Workload has overlapping preemption targets with another workload"
MSG_NO_LONGER_FITS = (
    "Workload no longer fits after processing another workload"  # scheduler.go: another took the quota in the same cycle
)
# What the job reconciler writes once the evicted workload's job stopped
# (pkg/controller/jobframework/reconciler.go: Requeued, QuotaReserved=False "Pending" with the
# eviction message; pkg/workload/admissionchecks.go SyncAdmittedCondition), and what a new
# quota reservation does to an active Evicted/Preempted condition (pkg/workload/workload.go
# SetQuotaReservation, resetActiveCondition).
ADMITTED_REASON_NO_RESERVATION = "NoReservation"  # WorkloadAdmittedReasonNoReservation
MSG_NO_RESERVATION = "The workload has no reservation"
REASON_QUOTA_RESERVED = "QuotaReserved"
MSG_PREVIOUSLY = "Previously: {message}"
