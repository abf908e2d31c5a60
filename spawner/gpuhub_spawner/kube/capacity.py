"""Keep Kueue's quota honest when GPUs fail (issue 23, docs/gpu-health.md).

Kueue v0.19.2 never looks at nodes: a ClusterQueue's quota stays the same when a GPU dies,
so Kueue admits pods that can never start. Its maintainers point to an external controller
that lowers a designated ClusterQueue's quota by what is out of service and restores it
(kubernetes-sigs/kueue#3183, #10270; the AppWrapper controller's "slack queue" does this with
``lendingLimit``). This is that controller, run by the hub:

* **What is out of service**, read from what the cluster already says, per GPU flavor (the
  nodes matching the flavor's ``nodeLabels`` that advertise its ``resource``):
  - a cordoned node (``spec.unschedulable``): all its GPUs;
  - a node with a health taint (``health.kubernetes.taints``, default
    ``nvidia.com/gpu-error``: NVSentinel, node-problem-detector) with effect NoSchedule or
    NoExecute: all its GPUs;
  - otherwise ``capacity - allocatable`` of the resource: the devices the device plugin
    reported unhealthy (the kubelet leaves them out of allocatable).
* **Who gives up quota**: the ClusterQueue of the team the policy names for the flavor
  (``health.kubernetes.capacityQueue: {l4: shared}``). One designated queue, not a share of
  every team's: whole GPUs, one write per change, and the team that absorbs failures is
  chosen and known in advance (typically a shared or scavenger team, or a team that exists
  only to hold spare capacity and lend it). Its ``nominalQuota`` for the flavor becomes the
  policy's nominal minus the GPUs out (never below 0; ``lendingLimit`` is lowered with it
  where it would exceed the new nominal), and goes back to the policy's value once they are
  back. What the designated queue cannot absorb (more out than its nominal) is said in the
  log and in waiting messages.
* **How**: a JSON merge patch of ``spec.resourceGroups`` carrying the ClusterQueue's
  ``resourceVersion`` (a concurrent writer makes it fail with 409 and the next pass re-reads),
  plus the annotation ``gpuhub.io/gpus-out-of-service`` saying why. RBAC: ``list``/``watch``
  nodes, ``get``/``patch`` of the designated ClusterQueues only (``resourceNames``).
  Re-applying ``gpuhub render kueue`` puts the full quota back; the next pass lowers it again.

**Who is told** (the rest of issue 23 on Kubernetes): the same pass keeps the nodes whose
health taint says their GPUs failed (``node_faults``). A server pod of the hub's on such a
node is a server whose GPU failed: its holder gets the one-machine notice in JupyterLab and
on the home page (``failures_of``, read by the hub's culling API and home page; the long poll
waits on ``wait_change``), and a batch job's attempt on it ends ``gpu-failed``
(``kube/job_manager.py``). Only a taint tells a holder: it is the node saying its GPUs are
out. A shrunk allocatable is counted out of the quota but tells nobody, because the hub cannot
know which pod got the device the device plugin marked unhealthy (the kubelet's pod-resources
API is node-local); a cordon alone is maintenance, not a failure.

The pure part (``out_of_service``, ``lowered_groups``, ``node_faults``, ``pod_failures``) is
tested without a cluster; the keeper runs it every ``health.kubernetes.syncInterval``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from ..policy.model import Flavor, Policy
from .job_manifest import JOB_LABEL
from .kueue import GROUP, VERSION
from .ray_manifest import RAY_LABEL

USER_ANNOTATION = "hub.jupyter.org/username"  # KubeSpawner's, on every server pod
SERVER_ANNOTATION = "hub.jupyter.org/servername"
MAX_REASON = 200

log = logging.getLogger("JupyterHub.gpuhub.capacity")

ANNOTATION = "gpuhub.io/gpus-out-of-service"
OUT_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass
class OutOfService:
    """One flavor's GPUs on the cluster: how many there are, how many are out and why."""

    total: int = 0
    out: int = 0
    why: list[str] = field(default_factory=list)  # "kwok-gpu-l4-1: tainted nvidia.com/gpu-error (2 GPUs)"

    def words(self, label: str) -> str:
        """'1 of 4 L4 GPUs out of service (kwok-gpu-l4-1: cordoned)'."""
        return f"{self.out} of {self.total} {label} GPUs out of service ({'; '.join(self.why)})"


def _count(value) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def _matches(node: dict, flavor: Flavor) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in (flavor.node_labels or {}).items())


def node_out(node: dict, resource: str, taint_keys: list[str]) -> tuple[int, int, str]:
    """(GPUs the node has, GPUs out of service, why) for one node."""
    status = node.get("status") or {}
    capacity = _count((status.get("capacity") or {}).get(resource))
    if not capacity:
        return 0, 0, ""
    name = node["metadata"]["name"]
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return capacity, capacity, f"{name}: cordoned"
    for t in spec.get("taints") or []:
        if t.get("key") in taint_keys and t.get("effect") in OUT_EFFECTS:
            value = f"={t['value']}" if t.get("value") else ""
            return capacity, capacity, f"{name}: tainted {t['key']}{value}"
    allocatable = (status.get("allocatable") or {}).get(resource)
    unhealthy = max(0, capacity - _count(allocatable)) if allocatable is not None else 0
    if unhealthy:
        return capacity, unhealthy, f"{name}: {unhealthy} unhealthy (allocatable {capacity - unhealthy} of {capacity})"
    return capacity, 0, ""


def out_of_service(policy: Policy, nodes: list[dict]) -> dict[str, OutOfService]:
    """Every GPU flavor's count on ``nodes`` and what is out of service."""
    taints = policy.health.kubernetes.taints
    out: dict[str, OutOfService] = {}
    for flavor in policy.flavors:
        o = out[flavor.name] = OutOfService()
        for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
            if not _matches(node, flavor):
                continue
            total, gone, why = node_out(node, flavor.resource, taints)
            o.total += total
            o.out += gone
            if gone:
                o.why.append(why + (f" ({gone} GPU{'s' if gone != 1 else ''})" if "cordoned" in why or "tainted" in why else ""))
    return out


@dataclass(frozen=True)
class NodeFault:
    """A node whose health taint says its GPUs failed: since when, and the words for it."""

    node: str
    taint: str  # "nvidia.com/gpu-error=XID79"
    effect: str
    since: float

    @property
    def reason(self) -> str:
        """What a holder is told in parentheses ('node kwok-gpu-l4-1: nvidia.com/gpu-error=XID79')."""
        return f"node {self.node}: {self.taint}"[:MAX_REASON]


def _epoch(value) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() if value else None
    except ValueError:
        return None


def node_faults(
    policy: Policy, nodes: list[dict], before: dict[str, NodeFault] | None = None, now: float | None = None
) -> dict[str, NodeFault]:
    """The nodes with a health taint (``health.kubernetes.taints``, NoSchedule or NoExecute).

    ``since`` is the taint's ``timeAdded`` (the API server writes it for NoExecute taints),
    else when a pass first saw it (kept from ``before``).
    """
    before, now = before or {}, time.time() if now is None else now
    keys = policy.health.kubernetes.taints
    out: dict[str, NodeFault] = {}
    for node in nodes:
        name = node["metadata"]["name"]
        for t in (node.get("spec") or {}).get("taints") or []:
            if t.get("key") in keys and t.get("effect") in OUT_EFFECTS:
                taint = t["key"] + (f"={t['value']}" if t.get("value") else "")
                old = before.get(name)
                since = _epoch(t.get("timeAdded")) or (old.since if old and old.taint == taint else now)
                out[name] = NodeFault(name, taint, t["effect"], since)
                break
    return out


def _requests_gpu(pod: dict, resources: set[str]) -> bool:
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        for amounts in (res.get("limits") or {}, res.get("requests") or {}):
            if any(_count(amounts.get(r)) > 0 for r in resources):
                return True
    return False


def pod_failures(policy: Policy, pods: list[dict], faults: dict[str, NodeFault], user: str) -> list[dict]:
    """``user``'s server pods holding a GPU on a node in ``faults``, in the one-machine shape
    (``{"server", "devices", "since", "reason", "xid"}``, earliest first). Never another user's,
    never a batch job's or a Ray cluster's (a job's attempt ends ``gpu-failed`` instead)."""
    resources = {f.resource for f in policy.flavors}
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann, labels = meta.get("annotations") or {}, meta.get("labels") or {}
        fault = faults.get((pod.get("spec") or {}).get("nodeName") or "")
        if (
            fault is None
            or ann.get(USER_ANNOTATION) != user
            or JOB_LABEL in labels
            or RAY_LABEL in labels
            or meta.get("deletionTimestamp")
            or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            or not _requests_gpu(pod, resources)
        ):
            continue
        out.append(
            {
                "server": ann.get(SERVER_ANNOTATION, ""),
                "devices": [f"node {fault.node}"],
                "since": fault.since,
                "reason": fault.reason,
                "xid": None,
            }
        )
    return sorted(out, key=lambda f: (f["since"], f["server"]))


def target_quota(policy: Policy, flavor: str, out: int) -> tuple[str, int, int | None, int]:
    """(team, nominal, lendingLimit, GPUs not absorbed) the designated queue should have."""
    team_name = policy.health.kubernetes.capacity_queue[flavor]
    team = next(t for t in policy.teams if t.name == team_name)
    q = team.quota.gpus[flavor]
    nominal = max(0, q.nominal - out)
    lending = None if q.lending_limit is None else min(q.lending_limit, nominal)
    return team_name, nominal, lending, max(0, out - q.nominal)


def lowered_groups(
    groups: list[dict], flavor: str, resource: str, nominal: int, lending: int | None, cohort: bool
) -> list[dict] | None:
    """``spec.resourceGroups`` with the flavor's quota set; None when nothing changes."""
    new = copy.deepcopy(groups)
    changed = False
    for group in new:
        for fl in group.get("flavors") or []:
            if fl.get("name") != flavor:
                continue
            for r in fl.get("resources") or []:
                if r.get("name") != resource:
                    continue
                if str(r.get("nominalQuota")) != str(nominal):
                    r["nominalQuota"], changed = str(nominal), True
                if cohort and lending is not None and str(r.get("lendingLimit")) != str(lending):
                    r["lendingLimit"], changed = str(lending), True
    return new if changed else None


class CapacityKeeper:
    """The hub's controller: reads nodes, patches the designated ClusterQueues."""

    def __init__(self, policy_of, core_api=None, custom_api=None, pods=None):
        self.policy_of = policy_of  # () -> Policy (the live one)
        self.core_api = core_api
        self.custom_api = custom_api
        self.pods = pods  # () -> KubeSpawner's shared pod reflector (the hub's pods): who holds a failed node
        self.out: dict[str, OutOfService] = {}  # the last pass: what waiting messages say
        self.unabsorbed: dict[str, int] = {}
        self.faults: dict[str, NodeFault] = {}  # node -> its health taint (the last pass)
        self._changed = asyncio.Event()  # set and replaced on every change of ``faults``
        self._task: asyncio.Task | None = None

    def _clients(self):
        if self.core_api is None or self.custom_api is None:
            from kubespawner.clients import shared_client  # lazy: heavy optional dependency

            self.core_api = self.core_api or shared_client("CoreV1Api")
            self.custom_api = self.custom_api or shared_client("CustomObjectsApi")
        return self.core_api, self.custom_api

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next pass tries again
                log.warning("GPU capacity: pass failed: %s", getattr(e, "reason", None) or e)
            await asyncio.sleep(self.policy_of().health.kubernetes.sync_interval)

    async def read_nodes(self) -> list[dict]:
        core, _ = self._clients()
        nodes = await core.list_node()
        return [core.api_client.sanitize_for_serialization(n) for n in nodes.items]

    # -- the holders of a failed node's GPUs (the hub's culling API and home page) -------------
    def failures_of(self, user: str) -> list[dict]:
        """``user``'s servers on a node whose health taint says its GPUs failed."""
        reflector = self.pods() if self.faults and self.pods is not None else None
        if reflector is None:
            return []
        return pod_failures(self.policy_of(), list(reflector.resources.values()), self.faults, user)

    async def wait_change(self, timeout: float) -> bool:
        """Until the failed nodes change (True) or ``timeout`` seconds pass (False)."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's loses a cancel that finds it done
                await self._changed.wait()
            return True
        except TimeoutError:
            return False

    def _set_faults(self, faults: dict[str, NodeFault]) -> None:
        if faults == self.faults:
            return
        for name in faults.keys() - self.faults.keys():
            log.warning(
                "GPU health: node %s is out of service (%s, %s); its server pods' holders are told, its "
                "jobs' attempts end gpu-failed",
                name,
                faults[name].taint,
                faults[name].effect,
            )
        for name in self.faults.keys() - faults.keys():
            log.info("GPU health: node %s is back (%s removed)", name, self.faults[name].taint)
        self.faults = faults
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def sync_once(self) -> dict[str, OutOfService]:
        """One pass: what is out of service, and each designated ClusterQueue set to match."""
        policy = self.policy_of()
        nodes = await self.read_nodes()
        self._set_faults(node_faults(policy, nodes, self.faults))
        out = out_of_service(policy, nodes)
        before = {f: (o.out, tuple(o.why)) for f, o in self.out.items()}
        self.out = out
        for flavor, o in out.items():
            if (o.out, tuple(o.why)) != before.get(flavor, (0, ())):
                level = logging.WARNING if o.out else logging.INFO
                log.log(
                    level, "GPU capacity: flavor %s: %s", flavor, o.words(flavor) if o.out else f"all {o.total} GPUs in service"
                )
        for flavor in policy.health.kubernetes.capacity_queue:
            await self._set_quota(policy, flavor, out.get(flavor, OutOfService()))
        return out

    async def _set_quota(self, policy: Policy, flavor: str, o: OutOfService) -> None:
        _, custom = self._clients()
        team, nominal, lending, unabsorbed = target_quota(policy, flavor, o.out)
        self.unabsorbed[flavor] = unabsorbed
        cq = await custom.get_cluster_custom_object(GROUP, VERSION, "clusterqueues", team)
        fl = policy.flavor(flavor)
        cohort = bool((cq.get("spec") or {}).get("cohortName"))
        groups = lowered_groups((cq.get("spec") or {}).get("resourceGroups") or [], flavor, fl.resource, nominal, lending, cohort)
        annotations = (cq.get("metadata") or {}).get("annotations") or {}
        note = f"{flavor}={o.out}: {'; '.join(o.why)}" if o.out else None
        if groups is None and annotations.get(ANNOTATION) == note:
            return
        body: dict = {"metadata": {"resourceVersion": cq["metadata"]["resourceVersion"], "annotations": {ANNOTATION: note}}}
        if groups is not None:
            body["spec"] = {"resourceGroups": groups}
        await custom.patch_cluster_custom_object(
            GROUP, VERSION, "clusterqueues", team, body, _content_type="application/merge-patch+json"
        )
        if groups is not None:
            log.warning(
                "GPU capacity: ClusterQueue %s nominalQuota for %s set to %d (%s)",
                team,
                flavor,
                nominal,
                o.words(flavor) if o.out else "all GPUs back in service",
            )
        if unabsorbed:
            log.warning(
                "GPU capacity: %d %s GPU(s) out of service are more than ClusterQueue %s can give up; "
                "other teams' quotas still count them",
                unabsorbed,
                flavor,
                team,
            )
