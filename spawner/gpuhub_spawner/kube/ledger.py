"""Kueue's admissions as the hub's ledger on Kubernetes: who holds what, who waits.

On one machine the hub *decides* admission (``admission.queue.AdmissionQueue``); on a
cluster Kueue does, and the hub only reads it. This module mirrors Kueue's Workloads
into the same read interface (``admitted``, ``waiting``, ``usage()``, ``holdings()`` and
the ``on_submit``/``on_queued``/``on_admit``/``on_release``/``on_cancel`` hooks), so the
one policy core serves both backends unchanged: the usage history, audit trail and
per-team metrics (``usage/``), the status pages (``hub/pages.py``) and the reclaimer
(``culling/reclaimer.py``, which warns a borrowing server and stops it after the lender's
notice — Kueue itself gives no notice).

It reads KubeSpawner's shared pod reflector and gpuhub's Workload reflector (one watch
each per namespace, already open for the spawners) every ``sync_interval`` seconds:
in-memory work, no API calls. A Workload is keyed like the one-machine queue:
``user/server`` for a server's pod (from the pod's ``hub.jupyter.org/*`` annotations),
``job:<id>`` for a batch Job and for a RayCluster (a Ray cluster is a job of a kind, as
on one machine; ``<id>`` is the cluster's ``ray-…`` id). Demand is what Kueue admitted
(flavors and resource usage of the admission), or the profile's demand while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tornado.ioloop import PeriodicCallback
from traitlets import Float, Type
from traitlets.config import SingletonConfigurable

from ..admission.queue import Admission, Ticket
from ..admission.quota import demand_for, gpu_key
from ..policy import PolicyStore
from ..policy.model import Policy
from ..policy.quantities import parse_cpu_millis, parse_memory_bytes
from ..culling.reclaimer import Reclaimer  # borrowed servers given back with notice
from ..usage import recorder as usage
from ..usage.recorder import UsageRecorder  # history, audit trail, metrics (usage/)
from .capacity import CapacityKeeper, NodeFault
from .job_manifest import JOB_LABEL
from .ray_manifest import RAY_LABEL
from .kueue import (
    GROUP,
    VERSION,
    ADMITTED,
    EVICTED,
    FINISHED,
    PREEMPTED,
    PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING,
    PREEMPTED_IN_COHORT_RECLAMATION,
    PROFILE_LABEL,
    QUOTA_RESERVED,
    TEAM_LABEL,
    condition,
    is_true,
    owner_pod_name,
    timestamp,
)

log = logging.getLogger("JupyterHub.gpuhub.ledger")

USER_ANNOTATION = "hub.jupyter.org/username"
SERVER_ANNOTATION = "hub.jupyter.org/servername"
RECLAIM_ANNOTATION = "gpuhub/reclaimed-at"  # on a Job's Workload the hub deactivated for a reclaim
# Kueue took it back for the lending team: the history calls that "reclaimed", as on one machine.
_RECLAIM_REASONS = (PREEMPTED_IN_COHORT_RECLAMATION, PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING)


def _owner(wl: dict) -> tuple[str | None, str | None]:
    ref = next((r for r in wl["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    return (ref.get("kind"), ref.get("name")) if ref else (None, None)


def admitted_demand(wl: dict) -> dict[str, int]:
    """What Kueue admitted: ``gpu/<flavor>`` counts, CPU millis, memory bytes."""
    out: dict[str, int] = {}
    for psa in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        for res, qty in (psa.get("resourceUsage") or {}).items():
            if res == "cpu":
                out["cpu"] = out.get("cpu", 0) + parse_cpu_millis(qty)
            elif res == "memory":
                out["memory"] = out.get("memory", 0) + parse_memory_bytes(qty)
            elif res != "pods":
                flavor = (psa.get("flavors") or {}).get(res)
                if flavor:
                    out[gpu_key(flavor)] = out.get(gpu_key(flavor), 0) + int(float(str(qty)))
    return out


class WorkloadQueue:
    """The read side of ``AdmissionQueue``, mirrored from Kueue's Workloads."""

    held = False

    def __init__(self):
        self.admitted: dict[str, Admission] = {}
        self._waiting: dict[str, Ticket] = {}
        self.notes: dict[str, str] = {}  # key -> what a lender's request waits for (the reclaimer's)
        self.on_submit: list = []
        self.on_queued: list = []
        self.on_refuse: list = []  # refusals happen in the spawner, before any Workload
        self.on_cancel: list = []
        self.on_admit: list = []
        self.on_release: list = []

    @property
    def waiting(self) -> list[Ticket]:
        return list(self._waiting.values())

    def waiting_in(self, team: str) -> int:
        return sum(1 for t in self._waiting.values() if t.team == team)

    def ticket(self, key: str) -> Ticket | None:
        return self._waiting.get(key)

    def usage(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for adm in self.admitted.values():
            team = out.setdefault(adm.team, {})
            for k, v in adm.demand.items():
                team[k] = team.get(k, 0) + v
        return out

    def holdings(self) -> list[Admission]:
        return list(self.admitted.values())

    def refresh(self, teams) -> None:
        """Spawners re-read ``notes`` on every status tick; nothing to push."""

    @staticmethod
    def _fire(hooks, *args) -> None:
        for hook in list(hooks):
            try:
                hook(*args)
            except Exception:  # noqa: BLE001 - a listener must not stop the mirror
                log.exception("ledger hook %r failed", hook)

    def apply(self, admitted: dict[str, Admission], waiting: dict[str, Ticket]) -> None:
        """Replace the mirror with Kueue's current state, announcing what changed."""
        for key, adm in list(self.admitted.items()):
            now = admitted.get(key)
            if now is None or now.since != adm.since:  # gone, or evicted and admitted again
                del self.admitted[key]
                self._fire(self.on_release, adm)
        for key, t in list(self._waiting.items()):
            if key not in waiting and key not in admitted:
                del self._waiting[key]
                self._fire(self.on_cancel, t)
        for key, t in waiting.items():
            if key in self._waiting:
                self._waiting[key].demand = t.demand
            else:
                self._waiting[key] = t
                self._fire(self.on_submit, t)
                self._fire(self.on_queued, t)
        for key, adm in admitted.items():
            if key in self.admitted:
                continue
            if self._waiting.pop(key, None) is None:  # admitted between two reads: it was requested too
                self._fire(
                    self.on_submit, Ticket(key, adm.user, adm.team, adm.profile, adm.demand, adm.priority, created=adm.since)
                )
            self.admitted[key] = adm
            self._fire(self.on_admit, adm)


class _Merged:
    """The reflectors of several namespaces read as one (``tenancy.mode: team``: one pair of
    watches per team namespace): ``resources`` keyed ``namespace/name`` as each reflector keys
    them, and ``gone`` (the last state of deleted objects) oldest first."""

    def __init__(self, reflectors):
        self._reflectors = reflectors  # () -> the current reflectors

    @property
    def resources(self) -> dict:
        out: dict = {}
        for r in self._reflectors():
            out.update(r.resources)
        return out

    @property
    def pods(self) -> dict:
        return self.resources

    @property
    def gone(self) -> dict:
        items = [kv for r in self._reflectors() for kv in getattr(r, "gone", {}).items()]
        return dict(sorted(items, key=lambda kv: kv[1][0]))


class KueueLedger(SingletonConfigurable):
    job_manager_class = Type(
        None,
        klass=SingletonConfigurable,
        allow_none=True,
        help="""The job manager this hub runs batch jobs with (``kube.job_manager.KubeJobManager``), handed in by the
        composition root (``wiring.jobs``): it builds on this class, so this class never imports
        it. None: no jobs on this hub, so none to reclaim or name the owner of.""",
    ).tag(config=True)
    """One per hub process on Kubernetes (what ``LocalBroker`` is on one machine)."""

    sync_interval = Float(
        2.0, help="Seconds between reads of the shared pod and Workload reflectors (memory only, no API calls)."
    ).tag(config=True)

    reactivate_hold = Float(
        60.0,
        help="Seconds a job taken back for a lender stays deactivated at most while the lender's request "
        "still waits; it is reactivated at once when that request is admitted or withdrawn.",
    ).tag(config=True)

    devices = None  # Kubernetes places pods on nodes; no device table in the hub

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.store = PolicyStore.instance(config=self.config)
        self.queue = WorkloadQueue()
        self._pods: Any = None
        self._workloads: Any = None
        # namespace -> (pod reflector, Workload reflector): every namespace where user pods run
        # (the shared one, or each team's: the policy's tenancy), started by watch().
        self._sources: dict[str, tuple[Any, Any]] = {}
        self._adding: set[str] = set()
        self._watcher: Any = None  # the spawner whose reflectors' machinery starts new ones
        self._sync: PeriodicCallback | None = None
        self._workload_of: dict[str, tuple[str, str]] = {}
        self._patching: set[tuple[str, str]] = set()
        # Workloads the hub deactivated for a reclaim: (the lender's request it was for, when).
        self._taken_back: dict[tuple[str, str], tuple[str | None, float]] = {}
        self._evicted: dict[str, str] = {}
        self.synced = asyncio.Event()
        # The GPU capacity keeper (kube/capacity.py), started by the composition root once the
        # cluster's credentials are loaded (wiring.kube): lowered quotas, nodes whose GPUs failed.
        self.node_health: CapacityKeeper | None = None
        UsageRecorder.instance(config=self.config).attach(self)
        self.reclaimer = Reclaimer(self)

    @property
    def policy(self) -> Policy:
        return self.store.policy

    @property
    def pod_view(self) -> Any:
        """Every watched namespace's server pods as one reflector-like view (None before watch())."""
        return self._pods

    @property
    def watching(self) -> bool:
        return self._sync is not None

    # -- wiring ------------------------------------------------------------------------------
    async def watch(self, spawner) -> None:
        """Read the reflectors ``spawner`` shares with every other spawner of its namespace."""
        if self._sync is not None:
            return
        namespaces = self._namespaces(spawner)
        if namespaces == [spawner.namespace]:  # the shared namespace: the spawners' own reflectors
            await spawner._start_watching_pods()
            await spawner._start_watching_workloads()
            self._sources.setdefault(spawner.namespace, (spawner.pod_reflector, spawner.workload_reflector))
        else:
            await self._add(spawner, namespaces)
        if self._sync is not None:
            return
        self._watcher = spawner
        self._pods = _Merged(lambda: [p for p, _ in self._sources.values()])
        self._workloads = _Merged(lambda: [w for _, w in self._sources.values()])
        self.sync()
        self._sync = PeriodicCallback(self.sync, self.sync_interval * 1000)
        self._sync.start()
        log.info("Mirroring Kueue's Workloads in %s every %.1fs", ", ".join(sorted(self._sources)), self.sync_interval)

    def _namespaces(self, spawner) -> list[str]:
        """Where user pods run now: the policy's tenancy (a policy edit may add a team)."""
        return self.policy.user_namespaces(getattr(spawner, "_shared_namespace", spawner.namespace))

    async def _add(self, spawner, namespaces: list[str]) -> None:
        """Start the pod and Workload watches of ``namespaces`` not yet watched. A namespace
        that cannot be watched (not created yet, or the hub has no Role there) is logged and
        tried again at the next sync; the others are mirrored meanwhile."""
        for ns in namespaces:
            if ns in self._sources or ns in self._adding:
                continue
            self._adding.add(ns)
            try:
                self._sources[ns] = await spawner.reflectors_in(ns)
            except Exception as e:  # noqa: BLE001
                log.error("Cannot watch pods and Workloads in namespace %s (created? the hub's Role there?): %s", ns, e)
            finally:
                self._adding.discard(ns)

    # -- one read ------------------------------------------------------------------------------
    def sync(self) -> None:
        if self._watcher is not None and not self._adding:
            missing = [ns for ns in self._namespaces(self._watcher) if ns not in self._sources]
            if missing:
                asyncio.ensure_future(self._add(self._watcher, missing))
        try:
            admitted, waiting = self.read()
        except Exception:  # noqa: BLE001 - keep the last picture, try again next tick
            log.exception("reading Kueue's Workloads failed")
            return
        for key in self.queue.admitted.keys() - admitted.keys():
            why = self._evicted.get(key)
            if why:  # Kueue preempted it (the pod and its Workload are gone): say so in the history
                usage.note_end(key, why, by="kueue")
        self.queue.apply(admitted, waiting)
        self.synced.set()
        self._reactivate()

    def read(self) -> tuple[dict[str, Admission], dict[str, Ticket]]:
        policy = self.store.current
        pods = dict(self._pods.resources) if self._pods is not None else {}
        gone_pods = {k: v for k, (_, v) in self._pods.gone.items()} if hasattr(self._pods, "gone") else {}
        admitted: dict[str, Admission] = {}
        waiting: dict[str, Ticket] = {}
        self._evicted = {}
        self._workload_of = {}
        recent = time.monotonic() - 3 * self.sync_interval - 5
        gone = [wl for when, wl in reversed(self._workloads.gone.values()) if when >= recent] if self._workloads else []
        current = list((self._workloads.resources if self._workloads is not None else {}).values())
        for wl in gone + current:  # Kueue's preemptions: a pod's Workload is deleted, a Job's re-queued
            reason = (condition(wl, PREEMPTED) or {}).get("reason") if is_true(wl, EVICTED) else None
            who = self._identify(wl, pods, gone_pods) if reason else None
            if who:
                self._evicted[who[0]] = "reclaimed" if reason in _RECLAIM_REASONS else "preempted"
        for wl in current:
            if is_true(wl, FINISHED) or wl["metadata"].get("deletionTimestamp"):
                continue
            who = self._identify(wl, pods, gone_pods)
            if who is None:
                continue
            key, user, team, profile = who
            self._workload_of[key] = (wl["metadata"]["namespace"], wl["metadata"]["name"])
            if wl["spec"].get("active") is False:
                continue  # deactivated: out of Kueue's queue (the hub reactivates what it reclaimed)
            priority = int(wl["spec"].get("priority") or 0)
            if is_true(wl, QUOTA_RESERVED):
                reserved = condition(wl, ADMITTED) or condition(wl, QUOTA_RESERVED)  # is_true: there is one
                since = timestamp(reserved.get("lastTransitionTime") if reserved else None) or time.time()
                admitted[key] = Admission(key, user, team, profile, admitted_demand(wl), [], since=since, priority=priority)
            else:
                prof = policy.profile(profile)
                demand = demand_for(policy, prof) if prof is not None else {}
                pod_sets = wl["spec"].get("podSets") or []
                if len(pod_sets) == 1 and int(pod_sets[0].get("count", 1)) > 1:
                    # A several-worker job (an Indexed Job): one request of N times the profile.
                    demand = {k: v * int(pod_sets[0]["count"]) for k, v in demand.items()}
                created = timestamp(wl["metadata"].get("creationTimestamp")) or time.time()
                waiting[key] = Ticket(key, user, team, profile, demand, priority, created=created)
        return admitted, waiting

    def fault_of(self, node: str | None) -> NodeFault | None:
        """The health taint of ``node`` as the keeper last read it (None: none, or no keeper)."""
        return self.node_health.faults.get(node or "") if self.node_health is not None else None

    def _jobs(self) -> Any:
        """The hub's job manager, once it exists (None: no jobs on this hub, or none yet)."""
        cls = self.job_manager_class
        return cls.instance() if cls is not None and cls.initialized() else None

    def _job_owner(self, job_id: str) -> str | None:
        """The user who submitted ``job_id`` (the hub's job records), if this hub knows it."""
        jobs = self._jobs()
        rec = jobs.jobs.get(job_id) if jobs is not None else None
        return rec.user if rec else None

    def _identify(self, wl: dict, pods: dict, gone_pods: dict) -> tuple[str, str, str, str] | None:
        labels = (((wl["spec"].get("podSets") or [{}])[0].get("template") or {}).get("metadata") or {}).get("labels") or {}
        kind, name = _owner(wl)
        ns = wl["metadata"].get("namespace")
        if kind == "Pod":
            pod = pods.get(f"{ns}/{owner_pod_name(wl)}") or gone_pods.get(f"{ns}/{owner_pod_name(wl)}")
            if pod is None:
                return None  # not a pod of this hub's (or not read yet)
            meta = pod["metadata"]
            ann, plabels = meta.get("annotations") or {}, meta.get("labels") or {}
            user = ann.get(USER_ANNOTATION)
            if not user or TEAM_LABEL not in plabels:
                return None
            return f"{user}/{ann.get(SERVER_ANNOTATION, '')}", user, plabels[TEAM_LABEL], plabels.get(PROFILE_LABEL, "")
        if kind == "Job" and name is not None and labels.get(JOB_LABEL) == name:  # (an owner reference has a name)
            user = (
                (wl["spec"]["podSets"][0]["template"]["metadata"].get("annotations") or {}).get(USER_ANNOTATION)
                or labels.get(USER_ANNOTATION)
                or ""
            )
            return f"job:{name}", self._job_owner(name) or user, labels.get(TEAM_LABEL, ""), labels.get(PROFILE_LABEL, "")
        if kind == "RayCluster" and labels.get(RAY_LABEL) == name:
            # A Ray cluster is a job of a kind, as on one machine (where it is one): held under
            # ``job:<cluster id>``, so usage history, the reclaimer and the status pages count
            # its GPUs (every pod set's: Kueue admits the head and each worker group together).
            user = (
                (wl["spec"]["podSets"][0]["template"]["metadata"].get("annotations") or {}).get(USER_ANNOTATION)
                or labels.get(USER_ANNOTATION)
                or ""
            )
            return f"job:{name}", user, labels.get(TEAM_LABEL, ""), labels.get(PROFILE_LABEL, "")
        return None

    # -- the reclaimer's actions ---------------------------------------------------------------
    def preempt_job(self, key: str, message: str, for_key: str | None = None) -> bool:
        """Take a borrowing job's GPUs back at once; it re-queues.

        Below the lender's priority Kueue does it itself (``reclaimWithinCohort:
        LowerPriority`` in the rendered ClusterQueues). Otherwise the hub deactivates the
        Job's Workload (``spec.active: false``: Kueue evicts it, its job integration
        suspends the Job) and reactivates it once evicted, so it queues again; the
        Workload is annotated first, so a hub restart in between still reactivates it.
        """
        adm = self.queue.admitted.get(key)
        if adm is None:
            return False
        req = self.queue.ticket(for_key) if for_key else None
        if req is not None and adm.priority < req.priority:
            return True
        where = self._workload_of.get(key)
        if where is None:
            return False
        # Taken back already: the reclaimer asks every pass until Kueue has evicted the Workload
        # (seen on the real plane: the same deactivation sent every 0.5 s for 2.5 s, with its
        # usage end, message and log each time). Once is enough; a failed patch clears the mark.
        current = (self._workloads.resources.get(f"{where[0]}/{where[1]}") if self._workloads is not None else None) or {}
        if where in self._taken_back or (
            RECLAIM_ANNOTATION in ((current.get("metadata") or {}).get("annotations") or {})
            and (current.get("spec") or {}).get("active") is False
        ):
            return True
        self._taken_back[where] = (for_key, time.monotonic())
        usage.note_end(key, "reclaimed", by="gpuhub-reclaim")
        if (jobs := self._jobs()) is not None:
            jobs.reclaimed[key.partition(":")[2]] = message
        log.warning(
            "Reclaim: deactivating job %s (priority %d, not below the lender's) so that it re-queues: %s",
            key,
            adm.priority,
            message,
        )
        asyncio.ensure_future(
            self._patch(
                where, {"metadata": {"annotations": {RECLAIM_ANNOTATION: str(int(time.time()))}}, "spec": {"active": False}}
            )
        )
        return True

    def _reactivate(self) -> None:
        """Reactivate what the hub deactivated for a reclaim, once Kueue has evicted it."""
        for wl in list((self._workloads.resources if self._workloads is not None else {}).values()):
            meta = wl["metadata"]
            if (
                RECLAIM_ANNOTATION in (meta.get("annotations") or {})
                and wl["spec"].get("active") is False
                and not is_true(wl, QUOTA_RESERVED)
                and (meta["namespace"], meta["name"]) not in self._patching
            ):
                where = (meta["namespace"], meta["name"])
                for_key, since = self._taken_back.get(where, (None, 0.0))
                if for_key and self.queue.ticket(for_key) is not None and time.monotonic() - since < self.reactivate_hold:
                    # Not while the lender's request it gave way to still waits: reactivated at
                    # once, the job re-queued ahead of it (same priority, older) and Kueue
                    # admitted it again into the lent quota; on the real plane the hub then
                    # took it back again, up to three times in a row before the lender got in.
                    continue
                self._taken_back.pop(where, None)
                asyncio.ensure_future(
                    self._patch(
                        (meta["namespace"], meta["name"]),
                        {"metadata": {"annotations": {RECLAIM_ANNOTATION: None}}, "spec": {"active": True}},
                    )
                )

    async def _patch(self, where: tuple[str, str], body: dict) -> None:
        from kubespawner.clients import shared_client  # lazy: heavy optional dependency

        ns, name = where
        self._patching.add(where)
        try:
            await shared_client("CustomObjectsApi").patch_namespaced_custom_object(
                GROUP, VERSION, ns, "workloads", name, body, _content_type="application/merge-patch+json"
            )
        except Exception as e:  # noqa: BLE001 - the next pass tries again
            log.warning("Reclaim: could not patch Workload %s/%s: %s", ns, name, getattr(e, "reason", e))
            self._taken_back.pop(where, None)
        finally:
            self._patching.discard(where)
