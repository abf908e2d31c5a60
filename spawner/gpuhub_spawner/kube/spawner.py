"""KueueSpawner: KubeSpawner whose pods queue in their team's Kueue LocalQueue.

The policy (``PolicySpawnerMixin``) decides profile, team and priority, and refuses
forged choices and per-user cap violations before any pod exists. KubeSpawner builds
and creates the pod; Kueue's webhook gates it; this class waits for the gate to
lift (queue timeout), then lets KubeSpawner wait for the pod (launch timeout), and
tells the user in plain words what is happening from shared, bounded reads of
Kueue's state (``state.py``).

Hub restarts: JupyterHub polls every server record on start and stops those that do not
answer HTTP. A server still waiting in Kueue's queue (its pod gated) or admitted but not
yet running would be deleted, losing its place. ``poll()`` recognises such a pod in a
hub that did not start it and waits for it (queue timeout, then launch timeout, from the
pod's creation) before answering, so the pod keeps its place and starts when admitted;
meanwhile the server is a pending spawn again, so its spawn page streams ``progress()``.

Kueue outages: its pod webhook has ``failurePolicy: Fail``, so pod creation fails while
it is down (told to the user in plain words, not retried until the start timeout), and
its ``kueue.x-k8s.io/managed`` finalizer keeps a deleted pod's object until Kueue is back,
so ``stop()`` treats "containers gone, only Kueue's finalizer left" as stopped.

Readiness: the pod carries a startup probe on the server's API, so the kubelet marks
the container ready exactly when the server answers, and the spawn ends on the pod
watch's event saying so, not on KubeSpawner's back-off poll of the reflector (0.2 s
growing to 5 s between looks). JupyterHub's own HTTP check then answers at once.

Timeouts: JupyterHub wraps ``start()`` in ``wait_for(start_timeout)``, read right after
``start()`` is called, so ``start()`` sets ``start_timeout`` to queue + launch + slack;
after admission ``start_timeout`` becomes the launch timeout, which KubeSpawner's own
wait for a running pod reads.
"""

from __future__ import annotations

import asyncio
import html
import time

from jupyterhub.spawner import SpawnException
from kubernetes_asyncio.client import ApiException
from jupyterhub.utils import exponential_backoff, maybe_future, url_path_join
from kubernetes_asyncio.client import V1DeleteOptions, V1HTTPGetAction, V1Probe
from kubespawner import KubeSpawner
from tornado import web
from traitlets import Dict, Float, Integer, Unicode, default

from ..policy.access import Choice
from ..policy.quantities import format_duration
from ..policy_spawner import PolicySpawnerMixin
from ..culling.board import tell_open_lab
from ..usage import recorder as usage
from ..policy.access import ChoiceError, resolve_choice
from . import own_quota
from .grants import add_grants, missing_sources
from .ledger import KueueLedger
from .kueue import (
    timestamp,
    POD_FINALIZER,
    PRIORITY_LABEL,
    PROFILE_LABEL,
    QUEUE_LABEL,
    TEAM_LABEL,
    WEBHOOK_FAILED_MARKER,
    pod_is_gated,
)
from .kueue import GROUP, VERSION
from .messages import event_message, eviction_message, waiting_message
from .render import queue_for, user_local_queue
from .state import GoneAwarePodReflector, PendingPollers, WorkloadReflector

# Traits the policy sets per start; their configured values are the base each start builds on.
_POLICY_TRAITS = (
    "image",
    "cpu_limit",
    "cpu_guarantee",
    "mem_limit",
    "mem_guarantee",
    "extra_resource_limits",
    "extra_resource_guarantees",
    "node_selector",
    "tolerations",
    "extra_labels",
    "extra_annotations",
    "environment",
    "node_affinity_required",
)

UNCONSTRAINED_TOPOLOGY = "kueue.x-k8s.io/podset-unconstrained-topology"  # Kueue TAS: anywhere in the topology

# NVIDIA GPU feature discovery labels every GPU node with the newest CUDA its driver supports.
CUDA_MAJOR_LABEL, CUDA_MINOR_LABEL = "nvidia.com/cuda.runtime-version.major", "nvidia.com/cuda.runtime-version.minor"


def cuda_node_terms(major: int, minor: int) -> list[dict]:
    """Node selector terms (OR'ed) for "the driver supports CUDA major.minor or newer": a newer
    major, or the same major with at least that minor. ``Gt`` compares the labels as integers."""
    newer_major = {"matchExpressions": [{"key": CUDA_MAJOR_LABEL, "operator": "Gt", "values": [str(major)]}]}
    same_major = {"matchExpressions": [{"key": CUDA_MAJOR_LABEL, "operator": "In", "values": [str(major)]}]}
    if minor > 0:
        same_major["matchExpressions"].append({"key": CUDA_MINOR_LABEL, "operator": "Gt", "values": [str(minor - 1)]})
    return [newer_major, same_major]


def and_terms(configured: list[dict], extra: list[dict]) -> list[dict]:
    """(configured terms, OR'ed) AND (extra terms, OR'ed), as OR'ed terms: every pair merged."""
    if not configured:
        return extra
    out = []
    for term in configured:
        for more in extra:
            merged = dict(term)
            merged["matchExpressions"] = list(term.get("matchExpressions") or []) + more["matchExpressions"]
            out.append(merged)
    return out


class KueueSpawner(PolicySpawnerMixin, KubeSpawner):
    """One user's server as a pod admitted by Kueue against the team's quota."""

    queue_timeout = Float(
        None,
        allow_none=True,
        config=True,
        help="Seconds a server may wait in the queue before it is withdrawn (default: the policy's defaults.queueTimeout).",
    )
    launch_timeout = Float(
        None,
        allow_none=True,
        config=True,
        help="Seconds from admission until the pod runs (default: the policy's defaults.launchTimeout).",
    )
    start_timeout_slack = Integer(60, config=True, help="Seconds added to queue + launch timeout for JupyterHub's start_timeout.")
    work_volume = Unicode(
        "home",
        config=True,
        help="Where jobs and Ray clusters keep their files on a multi-node cluster (kube/storage.py): "
        "'home', the user's home claim (needs ReadWriteMany home claims: singleuser.storage.storageAccessModes), "
        "or 'own', a ReadWriteOnce claim per job and per Ray cluster, deleted with it.",
    )
    work_volume_size = Unicode("20Gi", config=True, help="The size of each job's and Ray cluster's own claim (work_volume: own).")
    work_volume_storage_class = Unicode(
        None, allow_none=True, config=True, help="The StorageClass of those claims (None: the cluster's default)."
    )
    queue_poll_interval = Float(
        5.0,
        config=True,
        help="Seconds between polls of Kueue's visibility API, one poll per LocalQueue however many users wait.",
    )
    status_interval = Float(1.0, config=True, help="Seconds between re-reads of the (in-memory) shared state while waiting.")
    startup_probe_period = Integer(
        1,
        config=True,
        help="Seconds between the kubelet's probes of a starting server's API (its startup probe); the pod "
        "is ready the moment the API answers. 0: no probe (a started container counts as ready, and "
        "JupyterHub finds the server by polling). A probe set in extra_container_config wins.",
    )
    default_images = Dict(
        value_trait=Unicode(),
        per_key_traits={"cpu": Unicode(), "gpu": Unicode()},
        config=True,
        help="Image for profiles that name none, by kind (``cpu``, ``gpu``): gpuhub's own notebook images "
        "(images/cpu, images/cuda), which carry gpuhub-notebook (GPU activity, cull warnings, MLflow auth). "
        "Takes precedence over the policy's defaults.image, which on one machine is only a label.",
    )

    @default("profile_list")
    def _no_kubespawner_profiles(self):
        return []  # the policy is the profile list (PolicySpawnerMixin renders and checks it)

    # -- the policy applied to the pod ------------------------------------------------
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The configured users' namespace (before load_state puts a stopped server's in):
        # every team's with tenancy.mode shared (the policy), none with mode team.
        self._shared_namespace: str = self.namespace

    def _base(self) -> dict:
        if not hasattr(self, "_policy_base"):
            self._policy_base = {name: getattr(self, name) for name in _POLICY_TRAITS}
        return self._policy_base

    @property
    def effective_queue_timeout(self) -> float:
        return self.queue_timeout if self.queue_timeout is not None else self.policy.defaults.queue_timeout

    @property
    def effective_launch_timeout(self) -> float:
        return self.launch_timeout if self.launch_timeout is not None else self.policy.defaults.launch_timeout

    def apply_choice(self, choice: Choice) -> None:
        """Set image, resources, GPU, placement, Kueue labels and env from the policy."""
        base = self._base()
        policy, profile, team = self.policy, choice.profile, choice.team
        self.image = profile.image or self.default_images.get("gpu" if choice.gpu_count else "cpu") or policy.defaults.image
        cpu = (profile.cpu or policy.defaults.cpu) / 1000
        mem = profile.memory or policy.defaults.memory
        self.cpu_guarantee = self.cpu_limit = cpu
        self.mem_guarantee = self.mem_limit = mem
        limits = dict(base["extra_resource_limits"])
        guarantees = dict(base["extra_resource_guarantees"])
        node_selector = dict(base["node_selector"])
        tolerations = list(self._sorted_dict_values(base["tolerations"]))
        env = dict(base["environment"])
        affinity = list(base["node_affinity_required"])
        annotations = dict(base["extra_annotations"])
        if choice.gpu_count and choice.flavor is not None:  # (GPUs always come with their flavor)
            flavor = policy.flavor(choice.flavor)
            limits[flavor.resource] = guarantees[flavor.resource] = str(choice.gpu_count)
            node_selector.update(flavor.node_labels)
            tolerations += [t.model_dump(exclude_none=True) for t in flavor.tolerations]
            if flavor.topology is not None:
                # Kueue v0.19 gives a topology flavor only to pod sets that ask for a topology:
                # a server (or a one-worker job) asks to be placed anywhere in it.
                annotations[UNCONSTRAINED_TOPOLOGY] = "true"
            need = profile.gpu.cuda_needed if profile.gpu else None
            if need:  # only nodes whose driver runs the profile's CUDA
                affinity = and_terms(affinity, cuda_node_terms(*need))
        else:
            # CUDA images set NVIDIA_VISIBLE_DEVICES=all; without a GPU request that must not expose any.
            env["NVIDIA_VISIBLE_DEVICES"] = "void"
        env.update(self.choice_environment(choice))
        env["GPUHUB_IMAGE"] = self.image  # what the pod really runs (MLflow run tag)
        labels = dict(base["extra_labels"])
        labels.update({QUEUE_LABEL: queue_for(policy, team, self.user.name), TEAM_LABEL: team.name, PROFILE_LABEL: profile.slug})
        if choice.priority_class:
            labels[PRIORITY_LABEL] = choice.priority_class
        self.extra_resource_limits = limits
        self.extra_resource_guarantees = guarantees
        self.node_selector = node_selector
        self.tolerations = tolerations
        self.node_affinity_required = affinity
        self.extra_labels = labels
        self.extra_annotations = annotations
        self.environment = env
        # The policy's tenancy: the team's own namespace, or the shared one. Set per start (a
        # user in two teams has a server, and a home claim, in each team's namespace); saved
        # in the server's state, so stop() and a restarted hub find the pod where it is.
        namespace = policy.namespace_of(team, self._shared_namespace)
        self.namespace = namespace
        self.dns_name = self.dns_name_template.format(namespace=namespace, name=self.pod_name)

    async def pod_for(self, choice: Choice) -> dict:
        """The pod this spawner would make for ``choice`` (checked by the caller), as plain data:
        what a batch Job's template and a RayCluster's pods are built from, exactly as for a
        server of that profile. Refusals come as ``ChoiceError`` with the server start's words."""
        try:
            self._base()
            self.choice = choice
            self.apply_choice(choice)
            await self.ensure_queue(choice)
            # the shared client's serializer: a new ApiClient opens a session nothing closes
            return self.api.api_client.sanitize_for_serialization(await self.get_pod_manifest())
        except Exception as e:  # noqa: BLE001 - the same refusals as a server start
            raise ChoiceError(getattr(e, "status_code", 400), getattr(e, "log_message", None) or str(e)) from None

    async def get_pod_manifest(self):
        """KubeSpawner's pod, plus a startup probe on the server's API (see the module's
        "Readiness"). A startup probe, not a readiness probe: it stops once the server has
        answered, so a busy server is never probed, flapped to not-ready or restarted;
        it gives up (and the kubelet restarts the container) only after the launch timeout."""
        pod = await super().get_pod_manifest()
        container = pod.spec.containers[0]
        if self.choice is not None:  # the policy's secrets and team data, by reference (kube/grants.py)
            policy, team, profile = self.policy, self.choice.team.name, self.choice.profile.slug
            missing = missing_sources(policy, team, profile)
            if missing:
                msg = (
                    "Your server cannot start: a secret or dataset its profile is granted has no source on "
                    "this cluster. An administrator can find why in the hub's log."
                )
                self.log.error("Cannot start %s: %s name no kubernetes source", self._server_key, ", ".join(missing))
                raise web.HTTPError(500, msg, reason=msg)
            self.granted = add_grants(pod, policy, team, profile, 0o440 if self.fs_gid is not None else 0o444)
        period = self.startup_probe_period
        if period and container.startup_probe is None and container.readiness_probe is None:
            container.startup_probe = V1Probe(
                http_get=V1HTTPGetAction(
                    path=url_path_join(self._prefix(), "api"), port=self.port, scheme="HTTPS" if self.internal_ssl else "HTTP"
                ),
                period_seconds=period,
                timeout_seconds=max(1, period),
                failure_threshold=max(1, int(self.effective_launch_timeout // period) + 1),
            )
        return pod

    async def ensure_queue(self, choice: Choice) -> None:
        """With ``fairShare.users``, the user's own LocalQueue in the team's ClusterQueue
        (``kube.render.user_local_queue``), made at their first start there: Kueue's Admission
        Fair Sharing orders a ClusterQueue's waiting workloads by their LocalQueue's decayed
        usage, so a queue per user is what makes it fairness between users. One ``create``
        per start, no read (the hub needs no ``get`` on queues); an existing queue answers 409,
        which is the common case. The queue outlives the server (its usage history lives in its
        status) and is deleted when the user is off-boarded (``delete_user_queues``)."""
        fair = self.policy.fair
        if fair is None or not fair.users:
            return
        body = user_local_queue(choice.team, self.user.name, self.namespace)
        name = body["metadata"]["name"]

        async def create() -> bool:  # as KubeSpawner creates a pod: a slow or failing API server is retried
            try:
                await self.api.api_client.call_api(
                    "/apis/{group}/{version}/namespaces/{namespace}/localqueues",
                    "POST",
                    path_params={"group": GROUP, "version": VERSION, "namespace": self.namespace},
                    body=body,
                    header_params={"Content-Type": "application/json", "Accept": "application/json"},
                    response_types_map={201: "object"},
                    auth_settings=["BearerToken"],
                    _return_http_data_only=True,
                    _request_timeout=self.k8s_api_request_timeout,
                )
                self.log.info("Created LocalQueue %s/%s for %s", self.namespace, name, self._log_name)
                return True
            except ApiException as e:
                if e.status == 409:  # there already: the usual case
                    return True
                if e.status and (e.status >= 500 or e.status == 429):
                    self.log.warning("Creating LocalQueue %s got HTTP %s; retrying", name, e.status)
                    return False
                raise
            except asyncio.TimeoutError:
                self.log.warning("Creating LocalQueue %s timed out; retrying", name)
                return False

        try:
            await exponential_backoff(create, f"LocalQueue {name} not created", timeout=self.k8s_api_request_retry_timeout)
        except TimeoutError:
            raise SpawnException(
                "Your queue could not be set up: the cluster's API server did not answer in time. Nothing was "
                "started; try again in a few minutes.",
                reason="queue_unavailable",
                status_code=503,
            ) from None

    async def delete_user_queues(self) -> str:
        """Off-boarding (``gpuhub user offboard``, Kubernetes): the user's own LocalQueues,
        one per team of the policy (a queue of a team they left is found by its name too).
        Their servers, jobs and clusters were stopped before, so nothing waits in them."""
        fair = self.policy.fair
        if fair is None or not fair.users:
            return "no queues of their own (fairShare.users is off)"
        deleted = []
        for team in self.policy.teams:
            name = queue_for(self.policy, team, self.user.name)
            namespace = self.policy.namespace_of(team, self._shared_namespace)  # tenancy: the team's own, or shared
            try:
                await self.api.api_client.call_api(
                    "/apis/{group}/{version}/namespaces/{namespace}/localqueues/{name}",
                    "DELETE",
                    path_params={"group": GROUP, "version": VERSION, "namespace": namespace, "name": name},
                    header_params={"Accept": "application/json"},
                    response_types_map={200: "object"},
                    auth_settings=["BearerToken"],
                    _return_http_data_only=True,
                    _request_timeout=self.k8s_api_request_timeout,
                )
                deleted.append(name)
            except ApiException as e:
                if e.status != 404:
                    raise
        return f"deleted {len(deleted)} LocalQueue(s) of their own" + (f": {', '.join(deleted)}" if deleted else "")

    def _prefix(self) -> str:
        """The server's URL prefix as JupyterHub tells it (``JUPYTERHUB_SERVICE_PREFIX``,
        ``/user/NAME/[SERVER/]``); a spawner without a server record tells none, so ``/``."""
        return self.server.base_url if self.server is not None else "/"

    async def load_user_options(self):
        """Re-validate ``user_options`` against the live policy (4xx on refusal), then apply it."""
        self._base()
        self.apply_choice(self.resolve_request())

    # -- start: queue wait, then launch ----------------------------------------------
    def start(self):
        # JupyterHub calls start() from its spawn task; a stop of a pending spawn cancels that task.
        self._spawn_task = asyncio.current_task()
        self._ledger()
        self._queued_at = time.monotonic()
        self._admitted_at = None
        self._pod_created = False
        self._hooks_done = False
        self._started = False
        self.stop_reason = None
        self.start_timeout = int(self.effective_queue_timeout + self.effective_launch_timeout + self.start_timeout_slack)
        hook = self.after_pod_created_hook
        if not getattr(hook, "_gpuhub_admission", False):
            admin_hook = hook

            async def wait_then_admin_hook(spawner, pod):
                await spawner.wait_for_admission()
                if admin_hook:
                    await maybe_future(admin_hook(spawner, pod))
                spawner._hooks_done = True  # KubeSpawner's _start has only its wait for a running pod left

            wait_then_admin_hook._gpuhub_admission = True
            self.after_pod_created_hook = wait_then_admin_hook
        return super().start()

    async def _start(self):
        """KubeSpawner's start, stopped early (and cleaned up) if Kueue deletes the pod."""
        try:
            await self.load_user_options()  # the choice (KubeSpawner's _start applies it again)
            assert self.choice is not None
            await self.ensure_queue(self.choice)
            await self._hold_within_own_quota()
        except BaseException:
            own_quota.release(self._server_key)
            raise
        task = asyncio.ensure_future(super()._start())
        try:
            while True:
                change = asyncio.ensure_future(self._pod_changed(self.status_interval))
                done, _ = await asyncio.wait({task, change}, return_when=asyncio.FIRST_COMPLETED)
                change.cancel()
                if task in done:
                    result = task.result()
                    break
                if self._pod_created and self._admitted_at and self._current_pod() is None:
                    task.cancel()
                    raise SpawnException(await self._gone_reason(), reason="evicted", status_code=503)
                result = await self._running_now(task)
                if result is not None:
                    break
            if self._stop_asked():  # a cancellation lost on its way here (see stop_asked)
                raise asyncio.CancelledError("the hub was asked to stop this server while it started")
            self._started = True
            ledger = self._ledger()
            if ledger is not None and ledger.watching:
                ledger.sync()  # its admission is recorded before its start (the audit's order)
            usage.note_started(self._server_key, self.user.name)
            self._audit_grants()
            return result
        except TimeoutError:
            if self._admitted_at:
                await self._cleanup()
                raise SpawnException(
                    f"Your server got its quota but did not start within {format_duration(self.effective_launch_timeout)}; "
                    "it was stopped. Try again, or ask an administrator if it keeps happening.",
                    reason="launch_timeout",
                    status_code=503,
                ) from None
            raise
        except BaseException:
            if not task.done():
                task.cancel()
            raise
        finally:
            own_quota.release(self._server_key)

    granted: dict[str, list[str]] = {}

    def _audit_grants(self) -> None:
        """Which granted secrets and datasets the started pod got, by name (never a value)."""
        if self.granted.get("secrets"):
            usage.audit("secrets_delivered", key=self._server_key, user=self.user.name, names=self.granted["secrets"])
        if self.granted.get("data"):
            usage.audit("data_mounted", key=self._server_key, user=self.user.name, datasets=self.granted["data"])

    # -- reclaim.interactiveBorrowing: false (kube/own_quota.py) ---------------------
    async def _pod_changed(self, timeout: float) -> None:
        """The pod watch's next change of this server's pod, or ``timeout`` seconds."""
        reflector = self.pod_reflector
        if hasattr(reflector, "changed"):
            await reflector.changed(self._ref_key, timeout)
        else:
            await asyncio.sleep(timeout)

    async def _running_now(self, task: asyncio.Future) -> str | None:
        """The server's URL if the watch shows its pod running and ready while KubeSpawner's
        start has only its back-off poll for that left; that poll is then cancelled."""
        pod = self._current_pod()
        if pod is None or not (self._hooks_done and self.is_pod_running(pod)):
            return None
        task.cancel()
        # Not ``await task``: a cancellation of this start itself (the hub stopping it) would
        # arrive as that task's CancelledError and be taken for the one asked for just above,
        # and the start would go on to "running" (Python 3.12's wait_for then loses the stop).
        await asyncio.wait({task})
        if not task.cancelled():
            return task.result()  # it finished on its own meanwhile (or failed: raised here)
        self.pod_id = pod["metadata"]["uid"]
        return self._get_pod_url(pod)

    async def _hold_within_own_quota(self) -> None:
        ledger = self._ledger()
        assert self.choice is not None  # _start's load_user_options just made it
        if ledger is None or not self.choice.gpu_count:
            return
        await ledger.synced.wait()
        deadline = self._queued_at + self.effective_queue_timeout
        while True:
            why, never = own_quota.shortage(self.policy, self.choice, self._server_key, ledger)
            if never:
                raise SpawnException(f"This server can never start: {never}", reason="never_fits", status_code=400)
            if why is None:
                own_quota.claim(self.policy, self.choice, self._server_key)
                self._held = None
                return
            self._held = why
            if time.monotonic() >= deadline:
                raise SpawnException(
                    f"Your server waited {format_duration(self.effective_queue_timeout)} for team "
                    f"{self.choice.team.label}'s own quota, so it was withdrawn. Try again later.",
                    reason="queue_timeout",
                    status_code=503,
                )
            await asyncio.sleep(self.status_interval)

    async def _make_create_pod_request(self, pod, request_timeout):
        """KubeSpawner's create, but a 5xx/429 answer is retried instead of failing the spawn.

        If the failed request did create the pod, the retry gets 409 and KubeSpawner
        deletes and recreates it, so no pod is leaked either way.
        """
        try:
            created = await super()._make_create_pod_request(pod, request_timeout)
            if created:  # from now on the pod in the reflector is this one (the spawn page follows it)
                self._pod_created = True
            return created
        except ApiException as e:
            if WEBHOOK_FAILED_MARKER in str(getattr(e, "body", "") or ""):
                # Kueue's pod webhook (failurePolicy: Fail) is down: retrying until the start
                # timeout would leave the user watching "Preparing" for an hour.
                self.log.error("Creating pod %s refused by an admission webhook: %s", pod.metadata.name, e.body)
                raise SpawnException(
                    "The queue service (Kueue) is not answering, so no server can be queued right now. "
                    "Nothing was started; try again in a few minutes. An administrator can see why in the hub log.",
                    reason="kueue_unavailable",
                    status_code=503,
                ) from None
            if e.status and (e.status >= 500 or e.status == 429):
                self.log.warning("Creating pod %s got HTTP %s; retrying", pod.metadata.name, e.status)
                return False
            raise

    async def _cleanup(self):
        try:
            await self.stop(now=True)
        except Exception:
            self.log.exception("Could not delete pod %s after a failed start", self.pod_name)

    @property
    def _server_key(self) -> str:
        """The key the usage history, audit trail and reclaimer know this server by."""
        return f"{self.user.name}/{self.name}"

    def _ledger(self):
        """The hub's mirror of Kueue (``kube.ledger``), once the hub config started it."""
        if not KueueLedger.initialized():
            return None
        ledger = KueueLedger.instance()
        if not ledger.watching:
            asyncio.ensure_future(ledger.watch(self))
        return ledger

    @property
    def _ref_key(self) -> str:
        return f"{self.namespace}/{self.pod_name}"

    def _current_pod(self) -> dict | None:
        reflector = self.pod_reflector
        return reflector.pods.get(self._ref_key) if reflector else None

    @property
    def workload_reflector(self) -> WorkloadReflector | None:
        return self.__class__.reflectors.get(self._get_reflector_key("workloads"))

    async def _start_watching_pods(self, replace=False):
        # Same reflector as KubeSpawner's, but it remembers deleted pods (the eviction reason).
        return await self._start_reflector(
            kind="pods",
            reflector_class=GoneAwarePodReflector,
            labels={"component": self.component_label},
            omit_namespace=self.enable_user_namespaces,
            replace=replace,
        )

    async def reflectors_in(self, namespace: str) -> tuple:
        """The shared pod and Workload reflectors of ``namespace``, started if need be: what the
        ledger mirrors in each namespace where user pods run (``tenancy.mode: team``: each
        team's). The same shared instances KubeSpawner's ``_start_reflector`` keys by
        ``(kind, namespace)``, so a spawner of that namespace finds them running."""
        pods = await self._reflector_in(
            "pods", namespace, GoneAwarePodReflector, labels={"component": self.component_label}, omit_namespace=False
        )
        return pods, await self._reflector_in("workloads", namespace, WorkloadReflector)

    async def _reflector_in(self, kind: str, namespace: str, reflector_class, **kwargs):
        key = (kind, namespace)
        reflector = self.__class__.reflectors.get(key)
        if reflector is None:
            reflector = self.__class__.reflectors[key] = reflector_class(parent=self, namespace=namespace, **kwargs)
            try:
                await reflector.start()
            except BaseException:
                if self.__class__.reflectors.get(key) is reflector:  # not left half-started for the next caller
                    del self.__class__.reflectors[key]
                raise
        await reflector.first_load_future
        return reflector

    async def _start_watching_workloads(self, replace=False):
        return await self._start_reflector(kind="workloads", reflector_class=WorkloadReflector, replace=replace)

    def _poller(self):
        return PendingPollers.get(
            self.namespace,
            queue_for(self.policy, self.choice.team, self.user.name),
            self.queue_poll_interval,
            self.k8s_api_request_timeout,
            self.log,
        )

    async def wait_for_admission(self) -> None:
        """Hold start() while Kueue's gate is on the pod; withdraw after the queue timeout."""
        self._pod_created = True
        await self._start_watching_workloads()
        poller = self._poller()
        poller.subscribe()
        deadline = self._queued_at + self.effective_queue_timeout
        try:
            while True:
                pod = self._current_pod()
                if pod is None:  # KubeSpawner saw it before calling this hook: it was deleted
                    raise SpawnException(await self._gone_reason(), reason="evicted", status_code=503)
                if pod is not None and not pod_is_gated(pod):
                    break
                if time.monotonic() >= deadline:
                    assert self.choice is not None  # the pod was made from it (load_user_options first)
                    team = self.choice.team.label
                    raise SpawnException(
                        f"Your server waited {format_duration(self.effective_queue_timeout)} in team {team}'s queue "
                        "without getting quota, so it was withdrawn. Try again later or pick a smaller profile.",
                        reason="queue_timeout",
                        status_code=503,
                    )
                await asyncio.sleep(min(self.status_interval, max(0.0, deadline - time.monotonic())))
        finally:
            poller.unsubscribe()
        self._admitted_at = time.monotonic()
        self.start_timeout = int(self.effective_launch_timeout)  # read by KubeSpawner's wait for the running pod
        self.log.info("Server %s admitted by Kueue after %.1fs in the queue", self._log_name, self._admitted_at - self._queued_at)

    # -- what the user sees ------------------------------------------------------------
    def queue_status(self) -> dict:
        """The spawn page's current line: ``{"progress": int, "message": str}``."""
        pod = self._current_pod()
        if self._held and not self._pod_created:
            return {"progress": 5, "message": f"Your server {self._held}.{self._waited()}"}
        if not self._pod_created or pod is None:
            what = f" ({self.choice.profile.display_name})" if self.choice else ""
            return {"progress": 5, "message": f"Preparing your server{what}."}
        if pod_is_gated(pod):
            assert self.choice is not None  # its pod was made from it (start, or _resume after resolve_choice)
            wl_reflector = self.workload_reflector
            workload = wl_reflector.for_pod(self.namespace, self.pod_name, pod["metadata"].get("uid")) if wl_reflector else None
            snapshot = self._poller().snapshot
            pending = snapshot.position(workload["metadata"]["name"]) if workload else None
            queue_length = len(snapshot.items) if snapshot.fetched_at else None
            ledger = self._ledger()
            why = own_quota.why_waiting(self.policy, self.choice, self._server_key, ledger)
            kept = ledger.node_health if ledger else None
            gone = kept.out.get(self.choice.flavor) if kept and self.choice.flavor else None
            text = waiting_message(
                self.policy, self.choice, workload, pending, queue_length, why, (gone.out, gone.total) if gone else None
            )
            note = ledger.queue.notes.get(self._server_key) if ledger else None
            if note:  # the reclaimer's: this team's own quota is on loan and coming back
                text = f"Your server {note}."
            if snapshot.error:
                text += " (Queue position temporarily unavailable.)"
            return {"progress": 10, "message": f"{text}{self._waited()}"}
        best = (50, "Quota granted; your server is being placed on a node.")
        for event in self.events:
            words = event_message(event)
            if words:
                best = words
        return {"progress": best[0], "message": best[1]}

    def _waited(self) -> str:
        """No claim of a wait the user did not notice (the hub holds the form's POST up to
        ``slow_spawn_timeout`` before the page opens); from a minute on, the time waited."""
        waited = time.monotonic() - self._queued_at
        return f" Waiting for {format_duration(waited)}." if waited >= 60 else ""

    async def progress(self):
        """Plain-words status while queued and launching; one update per change."""
        last = None
        while True:
            start_future = self._start_future
            finished = start_future is not None and start_future.done()
            try:
                status = self.queue_status()
            except Exception:  # never break the spawn page over a status read
                self.log.exception("queue status for %s", self._log_name)
                status = None
            if status and status != last:
                last = status
                yield status
            if finished:
                break
            await asyncio.sleep(self.status_interval)

    async def _gone_reason(self, settle: float = 3.0) -> str:
        """Why the pod vanished. Pod and Workload arrive on separate watches, so give the
        Workload's eviction a moment to arrive before calling the deletion unexplained."""
        deadline = time.monotonic() + settle
        while True:
            final = time.monotonic() >= deadline
            # The Workload says precisely why (preempted by whom); the pod's condition only that Kueue did.
            reason = self._eviction_reason(workload_only=not final)
            if reason or final:
                break
            await asyncio.sleep(0.1)
        if reason:
            return reason
        return "Your server's pod was deleted outside the hub (by an administrator or the cluster). Start it again when you are ready."

    def _eviction_reason(self, workload_only: bool = False) -> str | None:
        reflector = self.workload_reflector
        pod_reflector = self.pod_reflector
        gone_pod = (
            pod_reflector.gone.get(self._ref_key, (0, None))[1] if isinstance(pod_reflector, GoneAwarePodReflector) else None
        )
        uid = ((self._current_pod() or gone_pod or {}).get("metadata") or {}).get("uid")
        workload = None
        if reflector:
            workload = reflector.for_pod(self.namespace, self.pod_name, uid) or reflector.gone_for_pod(
                self.namespace, self.pod_name, since=getattr(self, "_queued_at", 0.0), uid=uid
            )
        reason = eviction_message(workload, None if workload_only else gone_pod)
        if reason and (workload or {}).get("status", {}).get("conditions"):
            self.log.warning(
                "Server %s stopped by Kueue: %s (workload conditions: %s)",
                self._log_name,
                reason,
                ((workload or {}).get("status") or {}).get("conditions"),
            )
        return reason

    async def poll(self):
        if self._started is None and not self._resumed:
            pod = await self._unfinished_pod()
            if pod is not None:
                return await self._resume(pod)
        status = await super().poll()
        # Only a server that was up can have been stopped by someone else. A refused or
        # failed start (the hub polls it before cleaning up) was already answered with why.
        was_up = self._started if self._started is not None else self.server is not None
        if status is not None and self.stop_reason is None and was_up:
            self.stop_reason = await self._gone_reason()
        return status

    stop_reason: str | None = None
    _held: str | None = None  # why the pod is held back (interactiveBorrowing: false)
    # True once start() returned, False while starting, after a failed start or a stop;
    # None if this process never started it (a server adopted after a hub restart).
    _started: bool | None = None
    _resumed = False
    _hooks_done = False

    # -- hub restart: a queued or launching pod keeps its place -------------------------
    async def _unfinished_pod(self) -> dict | None:
        """This server's pod if it is still queued (gated) or admitted but not running yet."""
        await self._start_watching_pods()
        await self.pod_reflector.first_load_future
        pod = self._current_pod()
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return None
        if pod_is_gated(pod) or (pod.get("status") or {}).get("phase") == "Pending":
            return pod
        return None

    async def _resume(self, pod: dict):
        """Wait, as start() would have, for a pod this hub process did not create.

        Returns what ``poll()`` must: None once it runs (the hub then checks it answers
        and routes it), 1 if it was withdrawn (queue or launch timeout, evicted), which
        makes the hub stop it with the reason kept on the spawn form.
        """
        self._resumed = True
        try:
            self.choice = resolve_choice(self.policy, self.user_groups, self.user_options)
        except ChoiceError as e:
            self.log.warning(
                "Server %s: its profile is no longer allowed (%s); not resuming its queued pod", self._log_name, e.message
            )
            self.stop_reason = f"Your waiting server was withdrawn after a hub restart: {e.message}"
            return 1
        created = timestamp(pod["metadata"].get("creationTimestamp"))
        self._queued_at = time.monotonic() - max(0.0, time.time() - created) if created else time.monotonic()
        self._pod_created = True
        self._admitted_at = None
        self.log.info("Server %s was waiting in Kueue's queue when the hub restarted; keeping its place", self._log_name)
        # Show it as the pending spawn it is: the spawn page streams progress() again (queue
        # position, then launch) and ends in "ready" or in the reason it was withdrawn.
        resumed = asyncio.get_running_loop().create_future()
        resumed.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self._spawn_future = self._start_future = resumed
        self._spawn_pending = True
        try:
            if pod_is_gated(pod):
                await self.wait_for_admission()
            else:
                self._admitted_at = time.monotonic()
            deadline = self._admitted_at + self.effective_launch_timeout
            while True:
                current = self._current_pod()
                if current is None:
                    raise SpawnException(await self._gone_reason(), reason="evicted", status_code=503)
                if self.is_pod_running(current):
                    break
                if resumed.cancelled():  # the user stopped it meanwhile
                    raise SpawnException("Stopped while waiting.", reason="stopped", status_code=400)
                if time.monotonic() >= deadline:
                    raise SpawnException(
                        f"Your server got its quota but did not start within {format_duration(self.effective_launch_timeout)}; "
                        "it was stopped. Try again, or ask an administrator if it keeps happening.",
                        reason="launch_timeout",
                        status_code=503,
                    )
                await self._pod_changed(self.status_interval)
        except SpawnException as e:
            self._spawn_pending = False
            if not resumed.done():
                resumed.set_exception(e)
            self.stop_reason = e.message
            self.log.warning("Server %s withdrawn while the hub was restarting: %s", self._log_name, self.stop_reason)
            return 1
        self._started = True
        status = await super().poll()  # updates the server's URL to the running pod's
        if status is None:  # still "spawn" pending until the hub's own check has passed
            asyncio.ensure_future(self._route_when_checked(resumed))
        else:
            self._spawn_pending = False
            if not resumed.done():
                resumed.set_exception(SpawnException("Your server stopped while starting.", reason="error", status_code=500))
        return status

    async def _route_when_checked(self, resumed):
        """The hub adds routes for servers it starts, and for the others only on its next
        periodic route check (z2jh: 60 s). Add this one as soon as the hub's check passed,
        then let the spawn page say "ready"."""
        proxy = (getattr(self.user, "settings", None) or {}).get("proxy")
        for _ in range(int(self.http_timeout * 10) + 100):
            if not self._check_pending:
                break
            await asyncio.sleep(0.1)
        self._spawn_pending = False
        if self.ready and proxy is not None:
            try:
                await proxy.add_user(self.user, self.name)
            except Exception:
                self.log.exception("Adding the route for %s after the hub restart", self._log_name)
        if not resumed.done():
            if self.ready:
                resumed.set_result(None)
            else:
                resumed.set_exception(
                    SpawnException("Your server did not answer after starting.", reason="error", status_code=500)
                )

    # -- stop wins over a start that Kueue admits in the same instant ---------------------
    _spawn_task: asyncio.Task | None = None

    def _stop_asked(self) -> bool:
        """Whether the hub was asked to stop this server while its start was under way.

        JupyterHub stops a pending spawn by cancelling its spawn task, waiting a second, then
        stopping the server, which it refuses ("pending spawn") while the spawn still runs. A
        cancellation can be lost: Python 3.11's ``asyncio.wait_for`` returns ``start()``'s result
        when the cancellation arrives after ``start()`` finished but before the spawn task resumed
        (Kueue admitted the server in the same instant: seen on a real control plane), and then
        the spawn went on to "ready", the stop was refused, and the server kept its GPU. The
        request itself is never lost: it stays on the task (``Task.cancelling()``) until the task
        ends, so it is the intent this spawner checks where the spawn goes on."""
        task = self._spawn_task
        return task is not None and not task.done() and task.cancelling() > 0

    def start_polling(self):
        """JupyterHub calls this in its spawn task right after ``start()`` returned: the first
        point after asyncio's ``wait_for`` where a lost stop can be honoured. Raising
        CancelledError here ends the spawn as cancelled, as the hub meant; its stop of the
        server then runs (a second later) and deletes the pod, so the GPU goes to the next in
        line."""
        task = self._spawn_task
        if task is not None and task is asyncio.current_task() and self._stop_asked():
            self.log.warning("Server %s was asked to stop while its start finished; stopping it", self._log_name)
            raise asyncio.CancelledError("the hub was asked to stop this server while it started")
        return super().start_polling()

    # -- stop ----------------------------------------------------------------------------
    def _stopped_but_finalized(self, pod: dict | None) -> bool:
        """Deleted, containers stopped, held only by Kueue's finalizer (Kueue is down)."""
        if pod is None:
            return True
        meta = pod.get("metadata") or {}
        if not meta.get("deletionTimestamp") or set(meta.get("finalizers") or []) - {POD_FINALIZER}:
            return False
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        return all("running" not in (c.get("state") or {}) for c in statuses)

    async def stop(self, now=False):
        """KubeSpawner's stop, but a pod kept only by Kueue's finalizer counts as stopped:
        its containers are gone and its resources freed; Kueue removes the object when back."""
        await tell_open_lab(self)  # its open JupyterLab says why before the pod goes
        self._pod_created = False
        self._started = False
        usage.note_end(self._server_key, "stopped")  # unless the culler or the reclaimer said why first
        await self._start_watching_pods()
        grace = 0 if now else self.delete_grace_period
        options = V1DeleteOptions(grace_period_seconds=grace)
        await exponential_backoff(
            lambda: self._make_delete_pod_request(self.pod_name, options, grace, self.k8s_api_request_timeout),
            f"Could not delete pod {self._ref_key}",
            timeout=self.k8s_api_request_retry_timeout,
        )
        try:
            await exponential_backoff(
                lambda: self._stopped_but_finalized(self._current_pod()),
                f"pod {self._ref_key} did not stop in {self.k8s_api_request_retry_timeout + grace} seconds",
                timeout=self.k8s_api_request_retry_timeout + grace,
            )
        except TimeoutError:
            self.log.error("Pod %s did not stop, restarting pod reflector", self._ref_key)
            await self._start_watching_pods(replace=True)
            raise
        pod = self._current_pod()
        if pod is not None:
            self.log.warning("Pod %s stopped but is kept by Kueue's finalizer (is Kueue running?)", self._ref_key)

    # A stopped server's reason survives the hub's clear_state() and restarts, and is shown once on the form.
    def get_state(self):
        state = super().get_state()
        if self.stop_reason:
            state["gpuhub_stop_reason"] = self.stop_reason
        return state

    def load_state(self, state):
        super().load_state(state)
        self.stop_reason = (state or {}).get("gpuhub_stop_reason") or self.stop_reason

    async def get_options_form(self):
        form = await super().get_options_form()
        if self.stop_reason:
            form = f'<div class="alert alert-info" id="gpuhub-stop-reason">{html.escape(self.stop_reason)}</div>' + form
        return form
