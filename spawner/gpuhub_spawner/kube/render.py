"""``gpuhub render kueue FILE``: the policy as Kueue v1beta2 objects, for GitOps.

One ClusterQueue per team (its quota, cohort, borrowing and lending limits), one
LocalQueue per team in the user namespace, a ResourceFlavor per GPU flavor plus one
plain flavor for CPU and memory, and a WorkloadPriorityClass per priority class.

Choices (also in docs/install-kubernetes.md):

* CPU and memory sit in their own resource group on the plain flavor
  ``gpuhub-default`` (no node labels), GPU flavors in one group per device
  resource name. A team without a cpu or memory quota is not limited by Kueue on
  that resource (the nodes still are): it gets a nominal quota of 100k cores /
  1Pi and, in a cohort, ``lendingLimit: 0`` so the placeholder never lends.
* Preemption protects interactive servers: only strictly lower priority is ever
  preempted (``withinClusterQueue`` and ``reclaimWithinCohort: LowerPriority``) and a
  borrowing workload may preempt only workloads below the highest priority class
  (``borrowWithinCohort.maxPriorityThreshold``). Servers at the top priority are
  never preempted; a team lending GPUs gets them back as borrowers stop or are culled.
* ``queueingStrategy`` is the team's ``queueingStrategy`` (default ``BestEffortFIFO``: a
  2-GPU request does not block a 1-GPU request behind it; ``StrictFIFO``: it does).
* ``ephemeral-storage`` is covered with a placeholder quota like CPU/memory without a quota:
  Kueue counts every resource a pod requests, and a LimitRange that gives pods a default
  ``ephemeral-storage`` request would otherwise make them inadmissible forever ("resource
  ephemeral-storage unavailable in ClusterQueue"). Other extended resources that a webhook or
  LimitRange adds must be listed in the policy as flavors, or excluded in Kueue's config.
* LocalQueues live in the *user* namespace (default ``gpuhub-users``), not the hub's, and a
  LocalQueue's ``clusterQueue`` is immutable: ``localqueue_conflicts`` finds renames that
  ``kubectl apply`` would refuse (``gpuhub render kueue --live``).
* MIG slices a team counts in GPU memory (``quota.gpuMemory``, docs/mig.md): Kueue's resource
  transformation (``gpuhub render kueue-config``, merged into Kueue's configuration) adds
  ``gpuhub.io/mig-memory`` (the memory the shape names) to every workload that asks for such a
  slice, keeping the slice itself (``Retain``). Every ClusterQueue whose team may hold such a
  slice covers both: the memory team its ``gpuMemory`` quota and a placeholder on the slice
  resources; a team counting the same shapes in slices its slice quota and a placeholder on the
  memory (both placeholders with ``lendingLimit: 0``). The memory sits in the CPU group, on
  ``gpuhub-default``.
* Fair share (``fairShare``, docs/fair-share.md), in Kueue v0.19.2's own mechanisms: each
  ClusterQueue's ``fairSharing.weight`` is its team's ``weight`` (Kueue's Fair Sharing shares
  a cohort's unused quota by borrowed share per unit of weight); with ``fairShare.users`` a
  ClusterQueue also gets ``admissionScope.admissionMode: UsageBasedAdmissionFairSharing`` and
  each user their own LocalQueue in it (``user_local_queue``; Kueue orders the ClusterQueue's
  workloads by their LocalQueue's decayed usage). ``gpuhub render kueue-config`` adds
  ``fairSharing`` and ``admissionFairSharing`` (``usageHalfLifeTime`` = ``halfLife``,
  ``resourceWeights`` per device resource from ``flavorWeights``, and 0 for CPU, memory and
  ephemeral storage, which Kueue would otherwise count at weight 1, in bytes). v0.19.2 has no
  preemption protection (KEP-9876 came later): ``minRuntime`` is not rendered; the hub's
  reclaimer keeps it for the servers it reclaims.
* Topology-aware placement (Kueue TAS, beta and on by default in v0.19): a flavor with
  ``topology: {name, level, mode}`` gets ``topologyName`` on its ResourceFlavor, and the
  topology it names a ``Topology`` object (its node-label levels, broadest first). Nothing is
  rendered for topologies no flavor names. A several-worker job on such a flavor carries the
  pod-set annotation ``kueue.x-k8s.io/podset-{preferred,required}-topology: <level>``
  (``kube/job_manifest.py``); servers and one-worker jobs on it
  ``kueue.x-k8s.io/podset-unconstrained-topology`` (``kube/spawner.py``). Kueue v0.19.2 lets a
  topology flavor serve only pod sets that ask for a topology, and gives such a pod set one
  topology flavor for every resource it requests (``tas_flavorassigner.go``; found on the real
  plane: "Flavor "gpuhub-default" does not support TopologyAwareScheduling", then "more than
  one TAS flavor assigned"). So a team with quota on such a flavor gets one resource group for
  CPU, memory and devices: ``gpuhub-default`` first (CPU and memory, no device), then each GPU
  flavor with the team's CPU and memory quota beside its device quota. For that team, CPU and
  memory are counted per flavor (a GPU pod's on its GPU flavor), not once for all its pods.
* Output is sorted (kind in apply order, then name; keys sorted) so it diffs cleanly.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from collections import defaultdict

import yaml

from ..policy.loader import PolicyError, load_policy
from ..policy.mig import MIG_MEMORY_RESOURCE
from ..policy.model import Policy, Team
from ..policy.quantities import format_cpu, format_memory
from .kueue import API_VERSION, MANAGED_BY
from .tenancy import tenancy_objects
from .webhooks import exclude_namespace

DEFAULT_NAMESPACE = "gpuhub-users"
DEFAULT_CPU_FLAVOR = "gpuhub-default"
UNLIMITED_CPU = "100k"
UNLIMITED_MEMORY = "1Pi"
UNLIMITED_EPHEMERAL = "1Pi"
UNLIMITED_SLICES = "10k"  # a team counting slices in memory: Kueue still sees the slice resource
KIND_ORDER = ["Topology", "ResourceFlavor", "WorkloadPriorityClass", "ClusterQueue", "LocalQueue"]


def _meta(name: str, namespace: str | None = None) -> dict:
    meta = {"name": name, "labels": dict(MANAGED_BY)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def resource_flavors(policy: Policy, cpu_flavor: str) -> list[dict]:
    out = [{"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(cpu_flavor), "spec": {}}]
    for flavor in policy.flavors:
        spec: dict = {}
        if flavor.node_labels:
            spec["nodeLabels"] = dict(flavor.node_labels)
        if flavor.tolerations:
            spec["tolerations"] = [t.model_dump(exclude_none=True) for t in flavor.tolerations]
        if flavor.topology is not None:
            # Kueue's topology-aware scheduling for this flavor: it reads the nodes' topology
            # labels and places a job's workers per the pod set's topology annotation.
            spec["topologyName"] = flavor.topology.name
        out.append({"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(flavor.name), "spec": spec})
    return out


def topologies(policy: Policy) -> list[dict]:
    """A Kueue ``Topology`` per topology a flavor names (docs/jobs.md, "Several workers"); none
    when no flavor names one, so a policy without topology labels renders what it always did."""
    named = {f.topology.name for f in policy.flavors if f.topology is not None}
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "Topology",
            "metadata": _meta(t.name),
            "spec": {"levels": [{"nodeLabel": level} for level in t.levels]},
        }
        for t in policy.topologies
        if t.name in named
    ]


def priority_classes(policy: Policy) -> list[dict]:
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "WorkloadPriorityClass",
            "metadata": _meta(pc.name),
            "value": pc.value,
            "description": pc.description,
        }
        for pc in policy.priority_classes
    ]


def _quota(nominal: str | int, borrowing, lending, cohort: bool) -> dict:
    entry: dict = {"nominalQuota": str(nominal)}
    if cohort and borrowing is not None:
        entry["borrowingLimit"] = str(borrowing)
    if cohort and lending is not None:
        entry["lendingLimit"] = str(lending)
    return entry


def preemption(policy: Policy, team: Team | None = None) -> dict:
    """Kueue's share of reclaim (docs/reclaim.md): borrowers of lower priority (jobs) go at once.

    ``reclaimWithinCohort: LowerPriority``, not ``Any``: ``Any`` would also delete borrowing
    notebook servers with no notice; those are the hub's to reclaim, after the lender's
    ``reclaim.notice``. A team whose ``reclaim.enabled`` is false takes nothing back
    (``Never``; Kueue's webhook then requires ``borrowWithinCohort: Never`` too).
    """
    values = sorted({pc.value for pc in policy.priority_classes})
    if team is not None and team.cohort and not policy.reclaim_rules(team).enabled:
        return {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Never", "borrowWithinCohort": {"policy": "Never"}}
    rules: dict = {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "LowerPriority"}
    if len(values) > 1:
        rules["borrowWithinCohort"] = {"policy": "LowerPriority", "maxPriorityThreshold": values[-2]}
    else:
        rules["borrowWithinCohort"] = {"policy": "Never"}
    return rules


def memory_counted(policy: Policy) -> dict[str, int]:
    """``{MIG resource: bytes per slice}`` of every flavor a team counts in GPU memory: the inputs
    of Kueue's resource transformations."""
    names = {n for t in policy.teams if t.quota.gpu_memory for n in t.quota.gpu_memory.flavors}
    return {f.resource: f.mig.memory for f in policy.flavors if f.name in names and f.mig and f.mig.strategy == "mixed"}


def kueue_config(policy: Policy) -> dict:
    """The part of Kueue's Configuration (``controller_manager_config.yaml``) the policy needs: one
    resource transformation per MIG shape some team counts in memory, ``Retain`` so a team counting
    the same shape in slices still sees the slice; and with fair share on, Fair Sharing and
    Admission Fair Sharing (``fair_share_config``). Empty when the policy needs neither."""
    out: dict = {}
    inputs = memory_counted(policy)
    if inputs:
        out["resources"] = {
            "transformations": [
                {"input": res, "strategy": "Retain", "outputs": {MIG_MEMORY_RESOURCE: format_memory(inputs[res])}}
                for res in sorted(inputs)
            ]
        }
    out.update(fair_share_config(policy))
    return out


# Kueue's preemption strategies under Fair Sharing (v0.19.2 accepts exactly these lists): first
# only where the preemptor's share with its workload stays at or below the target's without its
# own, then where it is below the target's share before. Kueue's documented default.
FAIR_PREEMPTION_STRATEGIES = ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]
AFS_SAMPLING = 300.0  # Kueue's default usageSamplingInterval (5m)
AFS_SAMPLES_PER_HALF_LIFE = 12  # a half-life shorter than an hour is sampled more often


def afs_sampling(half_life: float) -> float:
    """Kueue's ``usageSamplingInterval``: its default 5m, or a twelfth of a half-life shorter
    than an hour (at least 1s). Kueue folds the LocalQueues' admitted usage into their decayed
    figure once per interval, so with few samples per half-life the figure moves in coarse
    steps and a workload that ran between two samples is missed; each sample is one status
    write per LocalQueue, which is why the default is not shorter."""
    return max(1.0, min(AFS_SAMPLING, half_life / AFS_SAMPLES_PER_HALF_LIFE))


def _duration(seconds: float) -> str:
    """A Go duration (metav1.Duration) for whole seconds: 86400 -> '24h', 5400 -> '1h30m'."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (sec, "s")) if v) or "0s"


def fair_share_config(policy: Policy) -> dict:
    """Kueue's ``fairSharing`` and ``admissionFairSharing`` for the policy's ``fairShare``.

    ``resourceWeights`` is per device resource, not per flavor: flavors sharing one resource
    name (``nvidia.com/gpu`` on A100 and H100 nodes) must have one weight, or Kueue cannot
    say it (a ValueError explains). CPU, memory and ephemeral storage weigh 0: the hub counts
    GPU time only, and Kueue would count a resource it is not told about at weight 1, in its
    base unit (a 2Gi request as 2147483648)."""
    fs = policy.fair
    if fs is None:
        return {}
    weights: dict[str, float] = {"cpu": 0.0, "memory": 0.0, "ephemeral-storage": 0.0}
    if memory_counted(policy):
        weights[MIG_MEMORY_RESOURCE] = 0.0
    by_resource: dict[str, dict[str, float]] = defaultdict(dict)
    for f in policy.flavors:
        by_resource[f.resource][f.name] = fs.flavor_weight(f.name)
    for resource, flavors in sorted(by_resource.items()):
        if len(set(flavors.values())) > 1:
            listed = ", ".join(f"{n}: {w:g}" for n, w in sorted(flavors.items()))
            raise ValueError(
                f"fairShare.flavorWeights: flavors {listed} share the device resource {resource}; Kueue v0.19.2 weighs "
                "usage per resource (admissionFairSharing.resourceWeights), not per flavor: give them one weight"
            )
        weights[resource] = next(iter(flavors.values()))
    return {
        "fairSharing": {"preemptionStrategies": list(FAIR_PREEMPTION_STRATEGIES)},
        "admissionFairSharing": {
            "usageHalfLifeTime": _duration(fs.half_life),
            "usageSamplingInterval": _duration(afs_sampling(fs.half_life)),
            "resourceWeights": weights,
        },
    }


def _weight(value: float) -> str:
    """A Kubernetes quantity for a weight: 3 -> '3', 0.5 -> '0.5' (Kueue parses it as a Quantity)."""
    return f"{value:g}" if "e" not in f"{value:g}" else f"{value:.9f}".rstrip("0").rstrip(".")


def cluster_queue(policy: Policy, team: Team, namespace: str, cpu_flavor: str) -> dict:
    cohort = bool(team.cohort)
    cpu, mem = team.quota.cpu, team.quota.memory
    cpu_entry = (
        _quota(format_cpu(cpu.nominal), _fmt(format_cpu, cpu.borrowing_limit), _fmt(format_cpu, cpu.lending_limit), cohort)
        if cpu
        else _quota(UNLIMITED_CPU, None, 0, cohort)
    )
    mem_entry = (
        _quota(
            format_memory(mem.nominal), _fmt(format_memory, mem.borrowing_limit), _fmt(format_memory, mem.lending_limit), cohort
        )
        if mem
        else _quota(UNLIMITED_MEMORY, None, 0, cohort)
    )
    eph_entry = _quota(UNLIMITED_EPHEMERAL, None, 0, cohort)
    covered = ["cpu", "memory", "ephemeral-storage"]
    cpu_resources = [{"name": "cpu", **cpu_entry}, {"name": "memory", **mem_entry}, {"name": "ephemeral-storage", **eph_entry}]
    # MIG slices counted in memory (Kueue's transformation adds gpuhub.io/mig-memory to their workloads)
    transformed = memory_counted(policy)
    gm = team.quota.gpu_memory
    in_memory = set(gm.flavors) if gm else set()
    holds = [f for f in policy.flavors if f.resource in transformed and (f.name in team.quota.gpus or f.name in in_memory)]
    if holds:
        covered.append(MIG_MEMORY_RESOURCE)
        cpu_resources.append(
            {
                "name": MIG_MEMORY_RESOURCE,
                **(
                    _quota(
                        format_memory(gm.nominal),
                        _fmt(format_memory, gm.borrowing_limit),
                        _fmt(format_memory, gm.lending_limit),
                        cohort,
                    )
                    if gm
                    else _quota(UNLIMITED_MEMORY, None, 0, cohort)
                ),
            }
        )
    groups = [{"coveredResources": covered, "flavors": [{"name": cpu_flavor, "resources": cpu_resources}]}]
    # One group per device resource name; flavors in policy order (Kueue tries them in order).
    by_resource: dict[str, list[dict]] = defaultdict(list)
    for flavor in policy.flavors:
        q = team.quota.gpus.get(flavor.name)
        if flavor.name in in_memory and flavor.resource in transformed:
            entry = _quota(UNLIMITED_SLICES, None, 0, cohort)  # the memory counts; the slice is only seen
        elif q is None:
            continue
        else:
            entry = _quota(q.nominal, q.borrowing_limit, q.lending_limit, cohort)
        by_resource[flavor.resource].append({"name": flavor.name, "resources": [{"name": flavor.resource, **entry}]})
    if any(f.topology is not None and f.name in team.quota.gpus for f in policy.flavors):
        # Kueue TAS (v0.19.2's tas_flavorassigner.go, found on the real plane): a pod set placed
        # by topology takes one topology flavor for every resource it asks, its CPU and memory
        # too, and a topology flavor serves only such pod sets. So this team's CPU, memory and
        # devices are one resource group: the plain flavor first (CPU and memory, no device:
        # CPU-only servers), then each GPU flavor with the team's CPU and memory quota and its
        # own device quota, so a GPU pod's CPU and memory come from its GPU flavor's nodes.
        resources = sorted(by_resource)

        def zero(r: str) -> dict:
            return {"name": r, **_quota(0, None, None, cohort)}

        flavors = [{"name": cpu_flavor, "resources": cpu_resources + [zero(r) for r in resources]}]
        for r in resources:
            for entry in by_resource[r]:
                own = entry["resources"][0]
                devices = [own if other == r else zero(other) for other in resources]
                flavors.append({"name": entry["name"], "resources": copy.deepcopy(cpu_resources) + devices})
        groups = [{"coveredResources": covered + resources, "flavors": flavors}]
    else:
        for resource in sorted(by_resource):
            groups.append({"coveredResources": [resource], "flavors": by_resource[resource]})
    spec: dict = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "queueingStrategy": team.queueing_strategy,
        "preemption": preemption(policy, team),
        "resourceGroups": groups,
    }
    if team.cohort:
        spec["cohortName"] = team.cohort
    if policy.fair is not None:
        spec["fairSharing"] = {"weight": _weight(team.weight)}
        if policy.fair.users:  # the team's users' LocalQueues are ordered by their decayed usage
            spec["admissionScope"] = {"admissionMode": "UsageBasedAdmissionFairSharing"}
    return {"apiVersion": API_VERSION, "kind": "ClusterQueue", "metadata": _meta(team.name), "spec": spec}


def _fmt(formatter, value):
    return None if value is None else formatter(value)


def local_queue(team: Team, namespace: str) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": _meta(team.local_queue, namespace),
        "spec": {"clusterQueue": team.name},
    }


_NOT_DNS = re.compile(r"[^a-z0-9-]+")


# Hex digits of the user name's SHA-256 in a user's queue name: 64 bits, so nobody finds a name
# of their own that lands in another user's queue (and shares or spoils its usage history) by
# trying names; a long name's cleaned part is cut, so the hash alone must keep them apart.
USER_QUEUE_HASH = 16


def user_queue_name(team: Team, user: str) -> str:
    """The LocalQueue of ``user`` in ``team`` when fairness between users is on: the team's
    name (its ClusterQueue's), the user's name made DNS-safe, and a hash of both exact names
    (two names that clean up alike, 'a.b' and 'a-b', stay apart); at most 63 characters.

    Named after the ClusterQueue, not the team's ``queue``: a LocalQueue's ``clusterQueue``
    cannot change (Kueue: "field is immutable"), and a name that always means the same
    ClusterQueue never needs to. A renamed team's users get new queues at their next start."""
    digest = hashlib.sha256(f"{team.name}\0{user}".encode()).hexdigest()[:USER_QUEUE_HASH]
    clean = _NOT_DNS.sub("-", user.lower()).strip("-") or "user"
    base = f"{team.name[:30].rstrip('-')}-u-"
    clean = clean[: 63 - len(base) - USER_QUEUE_HASH - 1].strip("-") or "user"
    return f"{base}{clean}-{digest}"


def queue_for(policy: Policy, team: Team, user: str) -> str:
    """The LocalQueue a user's server, job or Ray cluster of ``team`` joins: their own
    (``user_queue_name``) with ``fairShare.users``, so Admission Fair Sharing orders the
    team's ClusterQueue by each user's decayed usage; the team's otherwise."""
    if policy.fair is not None and policy.fair.users:
        return user_queue_name(team, user)
    return team.local_queue


def user_local_queue(team: Team, user: str, namespace: str = DEFAULT_NAMESPACE) -> dict:
    """A user's own LocalQueue in the team's ClusterQueue (``fairShare.users``): Admission Fair
    Sharing orders a ClusterQueue's workloads by the decayed usage of their LocalQueue, so one
    LocalQueue per user is what makes it fairness between users. Users come and go with the
    identity provider's groups, so these are made when a user first asks (by the hub), not by
    ``gpuhub render kueue``."""
    obj = local_queue(team, namespace)
    obj["metadata"] = _meta(user_queue_name(team, user), namespace)
    obj["metadata"].setdefault("labels", {})["gpuhub.io/team"] = team.name
    obj["metadata"]["annotations"] = {"gpuhub.io/user": user}  # whose it is, exactly (the name is cut and hashed)
    obj["spec"]["fairSharing"] = {"weight": "1"}
    return obj


def render_objects(policy: Policy, namespace: str = DEFAULT_NAMESPACE, cpu_flavor: str = DEFAULT_CPU_FLAVOR) -> list[dict]:
    """All Kueue objects for ``policy``, in apply order (flavors and classes first)."""
    if any(f.name == cpu_flavor for f in policy.flavors):
        raise ValueError(f"flavor name {cpu_flavor!r} is reserved for CPU and memory; pick another --cpu-flavor")
    objs = topologies(policy) + resource_flavors(policy, cpu_flavor) + priority_classes(policy)
    # tenancy.mode team: each team's LocalQueue in its own namespace, its ClusterQueue admitting
    # only that namespace's pods (kube/tenancy.py renders the namespaces themselves).
    objs += [cluster_queue(policy, t, policy.namespace_of(t, namespace), cpu_flavor) for t in policy.teams]
    objs += [local_queue(t, policy.namespace_of(t, namespace)) for t in policy.teams]
    return sorted(objs, key=lambda o: (KIND_ORDER.index(o["kind"]), o["metadata"]["name"]))


def localqueue_conflicts(rendered: list[dict], live: list[dict]) -> list[str]:
    """LocalQueues whose ``spec.clusterQueue`` would change: Kueue's CRD marks it immutable
    (``self == oldSelf``, "field is immutable"), so ``kubectl apply`` fails on them. Typical
    cause: a team renamed while its ``queue`` name stayed. One explanation per conflict."""
    have = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in live if o.get("kind") == "LocalQueue"}
    out = []
    for obj in rendered:
        if obj["kind"] != "LocalQueue":
            continue
        key = (obj["metadata"].get("namespace"), obj["metadata"]["name"])
        old = have.get(key)
        if old and (old.get("spec") or {}).get("clusterQueue") != obj["spec"]["clusterQueue"]:
            ns, name = key
            out.append(
                f"LocalQueue {ns}/{name} points at ClusterQueue {old['spec'].get('clusterQueue')!r}; the policy now says "
                f"{obj['spec']['clusterQueue']!r}. Kueue does not allow changing it (field is immutable). Either keep the "
                f"team's name, or stop that queue's servers and `kubectl delete localqueue -n {ns} {name}` before applying "
                "(waiting servers of that queue lose their place)."
            )
    return out


CAPACITY_RBAC_NAME = "gpuhub-gpu-capacity"


def capacity_rbac(policy: Policy, service_account: str = "gpuhub:hub") -> list[dict]:
    """The cluster-wide rights of the hub's GPU capacity keeper (``kube/capacity.py``), and
    nothing more: ``list`` nodes (every pass reads them, also for the waiting words when no
    queue is designated), and ``get``/``patch`` of the ClusterQueues that
    ``health.kubernetes.capacityQueue`` designates, by name (``resourceNames``)."""
    namespace, _, name = service_account.partition(":")
    if not namespace or not name:
        raise ValueError(f"--service-account {service_account!r}: expected NAMESPACE:NAME")
    rules = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    queues = sorted(set(policy.health.kubernetes.capacity_queue.values()))  # a ClusterQueue is named after its team
    if queues:
        rules.append(
            {"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"], "resourceNames": queues, "verbs": ["get", "patch"]}
        )
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": _meta(CAPACITY_RBAC_NAME),
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": _meta(CAPACITY_RBAC_NAME),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CAPACITY_RBAC_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    return [role, binding]


POLICY_RBAC_NAME = "gpuhub-policy-writer"


def policy_rbac(service_account: str = "gpuhub:hub", configmap: str = "gpuhub-policy") -> list[dict]:
    """The rights the hub needs to apply and roll back the policy (``kube/policy_configmap.py``):
    ``get``, ``list``, ``watch`` and ``patch`` of the policy's one ConfigMap, by name, in the
    hub's own namespace (a Role, not a ClusterRole). ``list``/``watch`` by name need the
    field selector ``metadata.name``, which the hub's watch sends."""
    namespace, _, name = service_account.partition(":")
    if not namespace or not name:
        raise ValueError(f"--service-account {service_account!r}: expected NAMESPACE:NAME")
    meta = _meta(POLICY_RBAC_NAME, namespace)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta,
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [configmap],
                "verbs": ["get", "list", "watch", "patch"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": dict(meta),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": POLICY_RBAC_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    return [role, binding]


def to_yaml(objs: list[dict]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=True, default_flow_style=False, explicit_start=True)


def main(argv: list[str]) -> int:
    """``gpuhub render kueue FILE [--namespace NS]``; argv is what follows ``render``."""
    parser = argparse.ArgumentParser(prog="gpuhub render", description="Render the policy as Kubernetes objects.")
    sub = parser.add_subparsers(dest="what", required=True)
    kueue = sub.add_parser("kueue", help="Kueue ResourceFlavors, ClusterQueues, LocalQueues, WorkloadPriorityClasses")
    kueue.add_argument("file", help="the policy YAML (e.g. jupyterhub_config/profiles.yaml)")
    kueue.add_argument(
        "-n",
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help=f"namespace of the user pods and LocalQueues (default {DEFAULT_NAMESPACE})",
    )
    kueue.add_argument(
        "--cpu-flavor", default=DEFAULT_CPU_FLAVOR, help=f"ResourceFlavor for CPU and memory (default {DEFAULT_CPU_FLAVOR})"
    )
    kueue.add_argument(
        "--live", metavar="FILE", help="`kubectl get localqueues -n NS -o yaml` output: refuse changes Kueue forbids"
    )
    hooks = sub.add_parser(
        "webhook-exclusion", help="Kueue's webhook configuration with the hub's namespace left out of every webhook"
    )
    hooks.add_argument("file", help="`kubectl get {mutating,validating}webhookconfiguration NAME -o json` output, or - for stdin")
    hooks.add_argument("-n", "--namespace", default="gpuhub", help="the hub's namespace (default gpuhub)")
    rbac = sub.add_parser(
        "capacity-rbac", help="the ClusterRole and binding the hub's GPU capacity keeper needs (docs/gpu-health.md)"
    )
    rbac.add_argument("file", help="the policy YAML (its health.kubernetes.capacityQueue names the ClusterQueues)")
    rbac.add_argument(
        "--service-account", default="gpuhub:hub", help="the hub's service account, NAMESPACE:NAME (default gpuhub:hub)"
    )
    ten = sub.add_parser(
        "tenancy",
        help="every namespace where user pods run (the shared one, or each team's: the policy's tenancy) with "
        "its Pod Security label, the hub's Role and RoleBinding and the NetworkPolicies",
    )
    ten.add_argument("file", help="the policy YAML (its tenancy section)")
    ten.add_argument(
        "-n", "--namespace", default=DEFAULT_NAMESPACE, help=f"the shared users' namespace (default {DEFAULT_NAMESPACE})"
    )
    ten.add_argument(
        "--service-account", default="gpuhub:hub", help="the hub's service account, NAMESPACE:NAME (default gpuhub:hub)"
    )
    kcfg = sub.add_parser(
        "kueue-config",
        help="what to merge into Kueue's configuration: resource transformations "
        "for MIG slices counted in GPU memory (docs/mig.md), Fair Sharing and Admission Fair Sharing (docs/fair-share.md)",
    )
    kcfg.add_argument("file", help="the policy YAML")
    prbac = sub.add_parser(
        "policy-rbac", help="the Role and binding the hub needs to apply the policy to its ConfigMap (docs/policy-changes.md)"
    )
    prbac.add_argument(
        "--service-account", default="gpuhub:hub", help="the hub's service account, NAMESPACE:NAME (default gpuhub:hub)"
    )
    prbac.add_argument(
        "--configmap", default="gpuhub-policy", help="the policy's ConfigMap in the hub's namespace (default gpuhub-policy)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage
        return int(e.code or 0)
    if args.what == "webhook-exclusion":
        return _webhook_exclusion(args.file, args.namespace)
    if args.what == "policy-rbac":
        try:
            sys.stdout.write(to_yaml(policy_rbac(args.service_account, args.configmap)))
        except ValueError as e:
            print(f"gpuhub render policy-rbac: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        policy = load_policy(args.file)
        if args.what == "tenancy":
            sys.stdout.write(to_yaml(tenancy_objects(policy, args.namespace, args.service_account)))
            return 0
        if args.what == "capacity-rbac":
            sys.stdout.write(to_yaml(capacity_rbac(policy, args.service_account)))
            return 0
        if args.what == "kueue-config":
            fragment = kueue_config(policy)
            if not fragment:
                print(
                    f"{args.file}: no team counts MIG slices in GPU memory and fair share is off: "
                    "Kueue's configuration needs nothing",
                    file=sys.stderr,
                )
                return 0
            sys.stdout.write(
                "# merge into controller_manager_config.yaml of kueue-manager-config (docs/mig.md, docs/fair-share.md)\n"
            )
            sys.stdout.write(yaml.safe_dump(fragment, sort_keys=True, default_flow_style=False))
            return 0
        objs = render_objects(policy, args.namespace, args.cpu_flavor)
    except PolicyError as e:
        for issue in e.issues:
            print(issue.format(e.filename), file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    if args.live:
        try:
            docs = [d for d in yaml.safe_load_all(open(args.live)) if d]
        except (OSError, yaml.YAMLError) as e:
            print(f"{args.live}: {e}", file=sys.stderr)
            return 1
        live = [i for d in docs for i in (d.get("items") or [d])]
        conflicts = localqueue_conflicts(objs, live)
        for message in conflicts:
            print(f"{args.file}: {message}", file=sys.stderr)
        if conflicts:
            return 1
    sys.stdout.write(to_yaml(objs))
    return 0


def _webhook_exclusion(path: str, namespace: str) -> int:
    """Reads one webhook configuration (JSON or YAML), writes it back with ``namespace`` left
    out of every webhook (for ``kubectl apply -f -``); says on stderr which webhooks changed."""
    try:
        text = sys.stdin.read() if path == "-" else open(path).read()
        config = yaml.safe_load(text)
        if not isinstance(config, dict):
            raise ValueError("expected one webhook configuration object")
        out, changed = exclude_namespace(config, namespace)
    except (OSError, yaml.YAMLError, ValueError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 1
    name = config.get("metadata", {}).get("name", "?")
    print(
        f"{name}: {namespace} left out of {len(changed)} webhook(s)" + (f": {', '.join(changed)}" if changed else " (already)"),
        file=sys.stderr,
    )
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
