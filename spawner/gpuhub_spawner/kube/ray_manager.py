"""Ray clusters on Kubernetes (issue 24): the hub creates a KubeRay ``RayCluster``, Kueue admits it.

The Kubernetes side of ``rayclusters.RayClusterManager``. ``start`` checks the request
exactly as on one machine (``rayclusters.choose``, the user's GPU caps as for a job), builds
the RayCluster with ``kube.ray_manifest`` from the user's server pod for the chosen profile
(``KueueSpawner``'s own code path, as batch jobs do) and creates it, suspended, in the user
namespace with the team's LocalQueue label; from then on Kueue admits it (one Workload: the
head and the worker group), un-suspends it, and may suspend it again to preempt it; KubeRay
makes the pods. A cluster holds the profile's GPUs, split evenly over its worker pods
(``--workers K``, at least one; the head is CPU only), so it counts against the team's quota
exactly like a server of that profile.

What the cluster holds is read back every ``poll_interval`` seconds (the RayClusters carrying
``gpuhub/ray-cluster`` and their Workloads, one list each): ``list``/``status`` answer from
that, with Kueue's words for a waiting cluster (``kube.messages.waiting_message``). Nothing is
kept on the hub's disk: the RayCluster object is the record (user, name, request in its
labels and annotations), so a hub restart loses nothing.

Idle clusters: a RayCluster holds its quota for as long as it exists (a cluster is never
"finished" for Kueue), so the culling rules of its profile (``culling.rules.decide``, the same
decision as for servers) warn and then **delete** it. Its signals: ``started`` when Kueue
admitted it; activity is what ``touch`` records (the hub API calls it when the user works
with the cluster) in the ``gpuhub/last-activity`` annotation; ``gpu_busy`` (an optional
reader, e.g. DCGM) says when its GPUs were last busy — without one, its GPUs count as never
busy (unknown is idle, as for servers).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import secrets
import time
from types import SimpleNamespace
from typing import Any, Callable

from . import messages as M
from .job_manifest import USER_ANNOTATION
from .kueue import (
    ADMITTED,
    GROUP as KUEUE_GROUP,
    JOB_UID_LABEL,
    PRIORITY_LABEL,
    PROFILE_LABEL,
    QUOTA_RESERVED,
    TEAM_LABEL,
    VERSION as KUEUE_VERSION,
    condition,
    is_true,
    timestamp,
)
from .policy_configmap import hub_namespace
from .ray_manifest import GROUP, PLURAL, RAY_LABEL, VERSION, WorkerGroup, ray_cluster_manifest
from .storage import OWN, create_claim, work_claim
from .walls import put_up, wall
from ..culling.rules import CullState, Decision, Signals, decide
from ..policy import PolicyStore
from ..policy.access import Choice, ChoiceError, active_profiles, check_job_caps, resolve_choice
from ..policy.model import Policy
from ..rayclusters import (
    BY_USER,
    FAILED,
    FINAL,
    IDLE,
    QUEUED,
    RUNNING,
    STARTING,
    STOPPED,
    WITH_SERVER,
    RayClusterManager,
    RayClusterView,
    RayRequest,
    choose,
)
from ..usage import recorder as usage

log = logging.getLogger("JupyterHub.gpuhub.ray")

NAME_ANNOTATION = "gpuhub/ray-name"  # the user's name for it (names are per user)
WORKERS_ANNOTATION = "gpuhub/ray-workers"
ACTIVITY_ANNOTATION = "gpuhub/last-activity"  # epoch seconds, what ``touch`` records
WARNING_ANNOTATION = "gpuhub/cull-warning"  # the culler's words while a stop is pending
# The ledger's key of a cluster (kube/ledger.py): a Ray cluster is a job of a kind, as on one
# machine, so its audit events and its usage history share ``job:<cluster id>``.
KEY_PREFIX = "job:"


def worker_groups(gpus: int, workers: int) -> list[WorkerGroup]:
    """The profile's ``gpus`` over ``workers`` pods (at least one): equal shares, or refused."""
    pods = max(1, workers)
    if gpus and gpus % pods:
        raise ChoiceError(
            400,
            f"{gpus} GPU(s) cannot be split evenly over {pods} workers on Kubernetes; "
            f"ask for a number of workers that divides {gpus}.",
        )
    return [WorkerGroup("gpu" if gpus else "cpu", pods, gpus // pods if gpus else 0)]


class KubeRayManager(RayClusterManager):
    """One hub's Ray clusters on Kubernetes. ``spawner_for(user, name)`` makes the KueueSpawner
    whose pod the cluster is built from (default: the hub's own spawner configuration)."""

    _instances: dict[int, "KubeRayManager"] = {}

    def __init__(
        self,
        config=None,
        namespace: str | None = None,
        poll_interval: float = 10.0,
        spawner_for: Callable | None = None,
        gpu_busy: Callable[[dict], float | None] | None = None,
        users_with_servers: Callable[[], set[str] | None] | None = None,
        api: Callable | None = None,
    ):
        self.config = config
        # A CustomObjectsApi factory: the spawners' shared client (tests: a client of another cluster).
        self._api: Callable[[], Any] = api if api is not None else _custom_objects_api
        self.users_with_servers = users_with_servers or _users_with_servers
        self._had_server: set[str] = set()
        self.namespace = namespace
        self.poll_interval = poll_interval
        self.spawner_for = spawner_for or self._hub_spawner
        self.gpu_busy = gpu_busy
        self.clusters: dict[str, dict] = {}  # id (RayCluster name) -> object as last read
        self.workloads: dict[str, dict | None] = {}  # id -> its Workload (None: none found for it yet)
        self.ended: dict[str, RayClusterView] = {}  # stopped or gone, newest kept for list/status
        self.cull: dict[str, CullState] = {}
        self.warnings: dict[str, str] = {}  # id -> the warning in force (also in its annotation, for a restart)
        self._poller: asyncio.Task | None = None

    @classmethod
    def instance(cls, config) -> "KubeRayManager":
        """The hub's one manager (``wiring.ray``), in the spawners' namespace."""
        key = id(config)
        if key not in cls._instances:
            section = config.get("KubeRayManager", {}) if hasattr(config, "get") else {}
            namespace = section.get("namespace")
            for name in ("KueueSpawner", "KubeSpawner"):  # the user namespace the spawners use
                if not namespace and hasattr(config, "get") and name in config and "namespace" in config[name]:
                    namespace = config[name]["namespace"]
            cls._instances[key] = cls(config, namespace=namespace, poll_interval=float(section.get("poll_interval", 10.0)))
        return cls._instances[key]

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return PolicyStore.instance(config=self.config).policy

    def _hub_spawner(self, user, name: str):
        from jupyterhub.app import JupyterHub

        from .spawner import KueueSpawner

        app = JupyterHub.instance()
        return KueueSpawner(
            config=app.config,
            user=user,
            hub=app.hub,
            api_token="",
            oauth_client_id="",
            orm_spawner=SimpleNamespace(name=name, server=None),
        )

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll_loop())

    def recover(self) -> None:
        """Start reading the cluster (at hub start: what exists is found by its labels), where the
        policy has Ray clusters (``ray.enabled``); otherwise the first start begins it. A hub
        without Ray clusters polls nothing for them."""
        try:
            enabled = self.policy.ray.enabled
        except Exception:  # noqa: BLE001 - no policy yet: the first start reads it
            enabled = False
        if enabled:
            self._ensure_poller()

    # -- start -------------------------------------------------------------------------------
    async def start(self, user, groups: list[str], request: RayRequest) -> RayClusterView:
        from kubernetes_asyncio.client import ApiException

        policy = self.policy
        rc_choice = choose(policy, groups, request)
        choice = resolve_choice(policy, groups, {"profile": rc_choice.profile.slug, "team": rc_choice.team.name})
        team = choice.team
        check_job_caps(choice, self.held_profiles(user))
        groups_ = worker_groups(choice.gpu_count, request.workers)
        name = request.name or "ray-" + secrets.token_hex(3)
        if any(v.name == name and v.user == user.name and v.state not in FINAL for v in self.list(user.name)):
            raise ChoiceError(409, f"You already have a Ray cluster named {name!r}.")
        cid = "ray-" + secrets.token_hex(5)
        spawner = self.spawner_for(user, cid)
        spawner.user_options = {"profile": choice.profile.slug, "team": team.name}
        pod = await spawner.pod_for(choice)
        ns = self.namespace or spawner.namespace
        self.namespace = ns
        body = ray_cluster_manifest(cid, user.name, policy, choice, pod, groups_, namespace=ns, work_volume=spawner.work_volume)
        body["metadata"]["annotations"].update({NAME_ANNOTATION: name, WORKERS_ANNOTATION: str(max(1, request.workers))})
        try:
            created = await self._api().create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
        except ApiException as e:
            raise ChoiceError(
                400 if e.status in (400, 403, 422) else 502, f"the cluster refused the RayCluster: {_api_message(e)}"
            ) from None
        # The wall (kube/walls.py): only the owner's pods and the hub reach the cluster's pods.
        # Made before Kueue can admit it (it was created suspended); no wall, no cluster.
        try:
            await put_up(
                self._api().api_client, wall(cid, ns, {RAY_LABEL: cid}, pod["metadata"]["labels"], hub_namespace(), owner=created)
            )
            if spawner.work_volume == OWN:  # kube/storage.py: the cluster's own claim, deleted with it
                claim = work_claim(created, ns, spawner.work_volume_size, spawner.work_volume_storage_class, {RAY_LABEL: cid})
                await create_claim(self._api().api_client, claim)
        except ApiException as e:
            try:
                await self._api().delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, cid)
            except ApiException as gone:
                log.warning(
                    "Ray cluster %s: its NetworkPolicy was refused and it could not be deleted: %s", cid, _api_message(gone)
                )
            raise ChoiceError(
                502, f"the cluster refused the Ray cluster's NetworkPolicy: {_api_message(e)}; nothing was started"
            ) from None
        self.clusters[cid] = created
        usage.audit(
            "ray_cluster_requested",
            user=user.name,
            key=KEY_PREFIX + cid,
            cluster=name,
            team=team.name,
            profile=choice.profile.slug,
            gpus=choice.gpu_count,
            workers=max(1, request.workers),
        )
        log.info(
            "Ray cluster %s (%s) of %s created in %s (%s, queue %s)",
            cid,
            name,
            user.name,
            ns,
            choice.profile.slug,
            team.local_queue,
        )
        self._ensure_poller()
        return self.view(created)

    def held_profiles(self, user) -> list:
        policy = self.policy
        held = list(active_profiles(policy, user).values())
        held += [
            p
            for rc in self.clusters.values()
            if _user(rc) == user.name and (p := policy.profile(rc["metadata"]["labels"].get(PROFILE_LABEL, ""))) is not None
        ]
        return held

    # -- reading back --------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        # kubespawner's shared clients are cached per kind with the client configuration of the
        # moment they are made: load the cluster's configuration first, as every KueueSpawner
        # does (its API host, CA, TLS settings), or this loop's first read at hub start would
        # cache a CustomObjectsApi without a host for the whole hub (the jobs and the ledger too).
        from jupyterhub.app import JupyterHub

        if JupyterHub.initialized():  # outside a running hub (tests) the caller configured the client
            try:
                self._hub_spawner(SimpleNamespace(name="gpuhub-ray", id=0, url="/", groups=[]), "")
            except Exception:  # noqa: BLE001 - the reads below say what is wrong, every pass
                log.warning("Could not load the cluster's client configuration", exc_info=True)
        while True:
            try:
                await self.refresh()
                await self.cull_pass()
            except Exception:  # noqa: BLE001
                log.warning("Cannot read Ray clusters", exc_info=True)
            await asyncio.sleep(self.poll_interval)

    async def refresh(self) -> None:
        if not self.namespace:
            return
        api = self._api()
        known = set(self.clusters)  # created before this read: one missing from it was deleted
        rcs = (await api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, label_selector=RAY_LABEL)).get(
            "items", []
        )
        wls = (await api.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, self.namespace, "workloads")).get("items", [])
        by_uid = {(w["metadata"].get("labels") or {}).get(JOB_UID_LABEL): w for w in wls}
        seen = {}
        for rc in rcs:
            cid = rc["metadata"]["name"]
            if cid in self.ended:  # stopped by the hub while this read was under way
                continue
            seen[cid] = rc
            self.workloads[cid] = by_uid.get(rc["metadata"]["uid"])
        for cid in known - set(seen) - set(self.ended):  # deleted outside the hub (kubectl, an admin)
            view = self.view(self.clusters[cid])
            view.state, view.finished = STOPPED, time.time()
            view.status = "stopped: its RayCluster was deleted from the cluster."
            self.ended[cid] = view
            self.workloads.pop(cid, None)
            self.cull.pop(cid, None)
        # what start() created while the list was under way is kept for the next read
        self.clusters = {**{k: v for k, v in self.clusters.items() if k not in known and k not in self.ended}, **seen}

    def _state(self, rc: dict) -> str:
        wl = self.workloads.get(rc["metadata"]["name"])
        st = (rc.get("status") or {}).get("state", "")
        if st == "failed":
            return FAILED
        if rc["spec"].get("suspend") or not (is_true(wl, QUOTA_RESERVED) or is_true(wl, ADMITTED)):
            return QUEUED
        return RUNNING if st == "ready" else STARTING

    def view(self, rc: dict) -> RayClusterView:
        meta = rc["metadata"]
        cid, ns = meta["name"], meta["namespace"]
        if cid in self.ended:
            return self.ended[cid]
        ann, labels = meta.get("annotations") or {}, meta.get("labels") or {}
        policy = self.policy
        state = self._state(rc)
        profile = policy.profile(labels.get(PROFILE_LABEL, ""))
        gpus = profile.gpu.count if profile is not None and profile.gpu else 0
        wl = self.workloads.get(cid)
        if state == QUEUED:
            team = next((t for t in policy.teams if t.name == labels.get(TEAM_LABEL)), None)
            words = "queued"
            if team is not None and profile is not None:
                choice = Choice(team, profile, labels.get(PRIORITY_LABEL), 0)
                words = "queued: " + M.waiting_message(policy, choice, wl, None, None).replace("server", "Ray cluster")
            status = words
        elif state == STARTING:
            status = "starting: the queue admitted it; KubeRay is starting its head and workers."
        elif state == RUNNING:
            status = f"running: head {cid}-head-svc.{ns}.svc, {ann.get(WORKERS_ANNOTATION, '?')} worker(s)."
        else:
            status = f"failed: {(rc.get('status') or {}).get('reason', '')}".strip()
        admitted = (
            timestamp((condition(wl, ADMITTED) or condition(wl, QUOTA_RESERVED) or {}).get("lastTransitionTime"))
            if state in (STARTING, RUNNING)
            else None
        )
        return RayClusterView(
            id=cid,
            name=ann.get(NAME_ANNOTATION, cid),
            user=_user(rc),
            team=labels.get(TEAM_LABEL, ""),
            profile=labels.get(PROFILE_LABEL, ""),
            gpus=gpus,
            workers=int(ann.get(WORKERS_ANNOTATION, "1")),
            state=state,
            status=status,
            address=f"{cid}-head-svc.{ns}.svc.cluster.local:6379" if state == RUNNING else "",
            created=timestamp(meta.get("creationTimestamp")),
            started=admitted,
            warning=self.warnings.get(cid, ann.get(WARNING_ANNOTATION, "")),
        )

    def list(self, user_name: str | None = None) -> list[RayClusterView]:
        views = [self.view(rc) for rc in self.clusters.values()] + list(self.ended.values())
        views = [v for v in views if user_name is None or v.user == user_name]
        return sorted(views, key=lambda v: -(v.created or 0))

    def status(self, cluster: str, user_name: str | None = None) -> RayClusterView | None:
        mine = self.list(user_name)
        return (
            next((v for v in mine if v.id == cluster), None)
            or next((v for v in mine if v.name == cluster and v.state not in FINAL), None)
            or next((v for v in mine if v.name == cluster), None)
        )

    # -- stop -----------------------------------------------------------------------------------
    async def stop(self, cluster: str, reason: str = BY_USER, user_name: str | None = None) -> RayClusterView | None:
        from kubernetes_asyncio.client import ApiException

        view = self.status(cluster, user_name)
        if view is None or view.state in FINAL:
            return view
        rc = self.clusters.get(view.id)
        assert rc is not None  # a view not final is of a cluster read (ended ones are final)
        try:
            await self._api().delete_namespaced_custom_object(
                GROUP, VERSION, rc["metadata"]["namespace"], PLURAL, view.id, propagation_policy="Background"
            )
        except ApiException as e:
            if e.status != 404:
                raise
        # usage history's words (usage/history.py END_REASONS): why its GPU time ended. Noted in
        # the same loop turn as the delete's answer, before the ledger can read the Workload gone.
        usage.note_end(KEY_PREFIX + view.id, "culled" if reason == IDLE else "stopped", by=user_name)
        view.state, view.finished, view.reason = STOPPED, time.time(), reason
        view.status = {
            BY_USER: "stopped by its owner or an admin.",
            WITH_SERVER: "stopped with its owner's server (the policy's ray.stopWithServer).",
            IDLE: f"stopped: idle ({view.warning or 'the policy idle rules'}); its GPUs went back to the queue.",
        }.get(reason, f"stopped ({reason}).")
        self.ended[view.id] = view
        self.clusters.pop(view.id, None)
        self.workloads.pop(view.id, None)
        self.cull.pop(view.id, None)
        self.warnings.pop(view.id, None)
        usage.audit(
            "ray_cluster_stopped", user=view.user, key=KEY_PREFIX + view.id, cluster=view.name, reason=reason, message=view.status
        )
        log.info("Ray cluster %s of %s deleted (%s)", view.id, view.user, reason)
        return view

    # -- idle culling: warn, then delete ---------------------------------------------------------
    async def touch(self, cluster: str, user_name: str | None = None, when: float | None = None) -> None:
        """Record activity on ``cluster`` (the user works with it): ends an idle period."""
        view = self.status(cluster, user_name)
        if view is None or view.state in FINAL:
            return
        await self._annotate(view.id, {ACTIVITY_ANNOTATION: str(int(when or time.time()))})

    async def _annotate(self, cid: str, annotations: dict[str, str | None]) -> None:
        rc = self.clusters.get(cid)
        if rc is None:
            return
        await self._api().patch_namespaced_custom_object(
            GROUP,
            VERSION,
            rc["metadata"]["namespace"],
            PLURAL,
            cid,
            {"metadata": {"annotations": annotations}},
            _content_type="application/merge-patch+json",
        )
        ann = rc["metadata"].setdefault("annotations", {})
        for k, v in annotations.items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v

    def decide(self, cid: str, now: float) -> Decision:
        rc = self.clusters[cid]
        view = self.view(rc)
        if view.state not in (STARTING, RUNNING) or view.started is None:
            self.cull.pop(cid, None)
            return Decision("keep")
        profile = self.policy.profile(view.profile)
        if profile is None:
            return Decision("keep")
        ann = rc["metadata"].get("annotations") or {}
        activity = float(ann[ACTIVITY_ANNOTATION]) if ann.get(ACTIVITY_ANNOTATION, "").isdigit() else None
        rules = self.policy.idle_rules(profile)
        signals = Signals(
            started=view.started,
            last_activity=activity,
            gpu_last_busy=self.gpu_busy(rc) if self.gpu_busy else None,
            has_gpus=view.gpus > 0,
            gpu_unread=None if self.gpu_busy else rules.gpu_unread,
        )
        return decide(now, rules, signals, self.cull.setdefault(cid, CullState()))

    async def cull_pass(self, now: float | None = None) -> builtins.list[tuple[str, Decision]]:  # (list: the method above)
        now = time.time() if now is None else now
        out = []
        with_servers = self.users_with_servers() if self.policy.ray.stop_with_server else None
        for cid in list(self.clusters):
            user = _user(self.clusters[cid])
            if with_servers is not None and self._state(self.clusters[cid]) != QUEUED:
                if user in with_servers:
                    self._had_server.add(user)
                elif user in self._had_server:  # their server stopped (ray.stopWithServer)
                    out.append((cid, Decision("cull", "its owner's server stopped")))
                    await self.stop(cid, WITH_SERVER)
                    continue
            d = self.decide(cid, now)
            out.append((cid, d))
            ann = self.clusters[cid]["metadata"].get("annotations") or {}
            in_force = self.warnings.get(cid, ann.get(WARNING_ANNOTATION, ""))
            if d.action == "warn":
                at = time.strftime("%H:%M:%S UTC", time.gmtime(d.deadline or now))
                words = (
                    f"This Ray cluster will be deleted at {at}: {d.reason}. It holds its GPUs while it exists; "
                    "use it (or stop it yourself) to keep or free them."
                )
                if in_force != words:
                    self.warnings[cid] = words
                    await self._annotate(cid, {WARNING_ANNOTATION: words})
                    usage.audit(
                        "ray_cluster_warned",
                        user=user,
                        key=KEY_PREFIX + cid,
                        cluster=ann.get(NAME_ANNOTATION, cid),
                        reason=d.reason,
                        deadline=d.deadline,
                    )
            elif d.action == "cull":
                await self.stop(cid, IDLE)
            elif in_force:
                self.warnings.pop(cid, None)
                await self._annotate(cid, {WARNING_ANNOTATION: None})
        return out


def _custom_objects_api() -> Any:
    from kubespawner.clients import shared_client

    return shared_client("CustomObjectsApi")


def _users_with_servers() -> set[str] | None:
    """Users with a server admitted by Kueue, from the hub's admission view (this backend's
    KueueLedger: servers are ``user/server``, jobs ``job:<id>``); None where the hub has none."""
    from .ledger import KueueLedger

    if not KueueLedger.initialized():  # no ledger (a test, a CLI): never stop for this
        return None
    queue = KueueLedger.instance().queue
    return {adm.user for key, adm in list(queue.admitted.items()) if "/" in key and not key.startswith("job:")}


def _user(rc: dict) -> str:
    return (rc["metadata"].get("annotations") or {}).get(USER_ANNOTATION, "")


def _api_message(e) -> str:
    import json

    try:
        return json.loads(e.body).get("message") or e.reason
    except Exception:  # noqa: BLE001
        return str(getattr(e, "reason", e))
