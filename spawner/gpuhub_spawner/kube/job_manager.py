"""Batch jobs on Kubernetes: the hub creates the suspended Job, Kueue admits it.

Same API, CLI and records as one machine (``hub.jobs_api``); what differs is who queues and
runs: ``submit`` checks the choice and caps exactly as on one machine, builds the Job
with ``jobs.kube.job_manifest`` from the user's server pod (``KueueSpawner``'s own code
path), and creates it; from then on Kueue admits, preempts (suspends) and resumes it, and
the Job controller retries per ``podFailurePolicy``. A watcher reads the Job, its pods
and its Workload every ``poll_interval`` seconds into the record: each pod is an attempt (with
several workers, each run of all N pods; ``_read_workers``); its log is copied into the hub's
data directory when it ends (a preempted pod's log is whatever was read before Kueue deleted
it). A several-worker job also gets its headless rendezvous Service, owned by the Job.

A GPU that fails (docs/gpu-health.md): an attempt whose pod runs on a node with a health
taint (``kube/capacity.py``'s keeper reads them) ends ``gpu-failed`` at the next read: the
hub deactivates the Job's Workload as it does for a reclaim (Kueue evicts it and suspends the
Job: its pod is deleted and not counted against ``backoffLimit``; the ledger reactivates it
once evicted), so the job queues again and resumes from its checkpoint on a healthy node,
and the attempt does not count against ``retries.limit``. An attempt whose pod the taint
already evicted (``DisruptionTarget``, or gone) on such a node ends ``gpu-failed`` too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path
from types import SimpleNamespace

from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from . import messages as M
from .capacity import NodeFault, node_faults
from .kueue import GROUP, JOB_UID_LABEL, VERSION, condition, is_true, timestamp
from ..policy import PolicyStore
from ..policy.access import Choice, ChoiceError, active_profiles, check_job_caps, resolve_choice
from ..policy.model import Policy
from ..jobs import records as R
from ..jobs.common import TIME_LIMIT, check_ray_job, job_priority, policy_hash, ray_evidence
from ..jobs.spec import FAILED, GPU_FAILED, JobSpec
from ..usage import recorder as usage
from .job_manifest import JOB_LABEL, RENDEZVOUS_PORT, job_manifest, rendezvous_service
from . import rayjob_manifest as RJ
from .ray_manifest import ROLE_LABEL
from .ledger import RECLAIM_ANNOTATION, KueueLedger
from .policy_configmap import hub_namespace
from .spawner import KueueSpawner
from .walls import put_up, wall
from .storage import OWN, create_claim, work_claim

log = logging.getLogger("JupyterHub.gpuhub.jobs")

COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"  # on an Indexed Job's pods (annotation and label)
# What the hub copies of one attempt's output per read (all its workers together): the
# output is the user's, and every read of a running job holds it in the hub's memory and
# writes it to the hub's disk. The end of it is kept (a traceback is there).
MAX_POD_LOG_BYTES = 4 * 1024 * 1024
MAX_POD_LOG_LINES = 100_000
MIN_WORKER_LOG_BYTES = 16 * 1024  # each worker's share, however many workers


def _preemptions(wl: dict | None) -> int:
    """How often Kueue preempted (or, for a reclaim, the hub deactivated) this Workload
    (``status.schedulingStats.evictions``)."""
    stats = (((wl or {}).get("status") or {}).get("schedulingStats") or {}).get("evictions") or []
    return sum(int(e.get("count", 0)) for e in stats if e.get("reason") in ("Preempted", "Deactivated"))


def gpu_failed_message(fault: NodeFault) -> str:
    return (
        f"its node's GPUs went out of service ({fault.reason}); queued again to resume from its checkpoint "
        "on a healthy GPU (not counted against its retries)"
    )


def _disrupted(pod: dict) -> bool:
    """The pod was evicted (a NoExecute taint, a drain): Kubernetes' ``DisruptionTarget``."""
    return any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


class KubeJobManager(SingletonConfigurable):
    job_kinds = ("command", "notebook", "ray")  # notebook: refused in submit with the reason (501)

    data_dir = Unicode("data", help="Where job records live (<data_dir>/jobs): the hub's persistent volume.").tag(config=True)
    poll_interval = Float(10.0, help="Seconds between reads of unfinished Jobs, their pods and Workloads.").tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.store = R.JobStore(Path(self.data_dir) / "jobs")
        self.jobs: dict[str, R.JobRecord] = {}
        self._poller: asyncio.Task | None = None
        self._workloads: dict[str, dict | None] = {}
        # One read of a job at a time: the poller and every API answer (``hub.jobs_api.fresh``)
        # read it, and two reads interleaved at their awaits each took a new pod for its own
        # (two attempts for one pod, one of them never ended) or applied an older read last.
        self._reading: dict[str, asyncio.Lock] = {}
        self.reclaimed: dict[str, str] = {}  # job id -> why the hub took its GPUs back (kube/ledger.py)
        self._recovered = False

    @property
    def policy(self) -> Policy:
        return PolicyStore.instance(config=self.config).policy

    def recover(self) -> None:
        if self._recovered:
            return
        self._recovered = True
        for rec in self.store.load_all():
            self.jobs[rec.id] = rec
        self._ensure_poller()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll_loop())

    # -- Kubernetes clients, through KubeSpawner's (config already loaded by it) ------------------
    def _spawner(self, user, job_id: str):
        from jupyterhub.app import JupyterHub

        app = JupyterHub.instance()
        return KueueSpawner(
            config=app.config,
            user=user,
            hub=app.hub,
            api_token="",
            oauth_client_id="",
            orm_spawner=SimpleNamespace(name=job_id, server=None),
        )

    @staticmethod
    def _client(kind: str):
        from kubespawner.clients import shared_client

        return shared_client(kind)

    @classmethod
    def _plain(cls, obj) -> dict:
        """An API answer as plain data, by the shared client's serializer: a new ``ApiClient``
        opens an aiohttp session that nothing closes (an "Unclosed client session" error in the
        hub's log for every read of every running job)."""
        return cls._client("CoreV1Api").api_client.sanitize_for_serialization(obj)

    # -- submission --------------------------------------------------------------------------
    def held_profiles(self, user, releasing: str | None = None):
        policy = self.policy
        held = [p for name, p in active_profiles(policy, user).items() if name != releasing]
        for r in self.jobs.values():
            if r.user == user.name and r.state not in R.FINAL:
                held += [policy.profile(r.profile["slug"])] * max(1, r.workers)
        return held

    async def submit(self, user, groups: list[str], spec: JobSpec, releasing: str | None = None) -> R.JobRecord:
        if spec.notebook is not None:
            # Not yet: the pod would need papermill in its image and a way back for the
            # executed notebook (docs/jobs.md, "A notebook as a job").
            raise ChoiceError(501, "Notebook jobs run on one-machine hubs for now; on Kubernetes submit a command.")
        on_exit = FAILED in spec.retries.reasons or any(isinstance(r, int) for r in spec.retries.reasons)
        if spec.workers > 1 and on_exit and spec.retries.limit:
            raise ChoiceError(
                400,
                "retries.reasons: with several workers on Kubernetes a failing worker ends the whole job "
                "(one worker restarted alone cannot rejoin the others); retry on preempted or interrupted only",
            )
        policy = self.policy
        choice = resolve_choice(policy, groups, {"profile": spec.profile, **({"team": spec.team} if spec.team else {})})
        if spec.kind == "ray":
            check_ray_job(policy, spec)
        team = choice.team
        # N workers hold N times the profile: the per-user cap sees the N-1 beside this request.
        check_job_caps(choice, self.held_profiles(user, releasing) + [choice.profile] * (spec.workers - 1))
        pclass, priority = job_priority(policy, choice)
        job_id = "job-" + secrets.token_hex(5)
        spawner = self._spawner(user, job_id)
        if spec.workers > 1 and spawner.work_volume == OWN:
            # One ReadWriteOnce claim cannot be attached on N nodes: the workers on other nodes
            # would wait for it for ever while the Job holds N workers' quota.
            raise ChoiceError(
                501,
                f"A job of {spec.workers} workers cannot run on this hub: each job gets one ReadWriteOnce volume "
                "of its own (KueueSpawner.work_volume: own), which only one node can mount. Run one worker, "
                "or ask the operator for work_volume: home (ReadWriteMany home volumes; docs/jobs.md).",
            )
        spawner.user_options = {"profile": choice.profile.slug, "team": team.name}
        # The choice was checked above with the jobs' caps (GPUs, not maxServers); the spawner
        # applies it to the pod exactly as for a server of this profile.
        pod = await spawner.pod_for(choice)
        build = RJ.ray_job_manifest if spec.kind == "ray" else job_manifest
        job = build(
            job_id,
            user.name,
            spec,
            policy,
            choice,
            pod,
            job_priority_class=pclass,
            namespace=spawner.namespace,
            work_volume=spawner.work_volume,
        )
        if spec.kind == "ray":
            container = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        else:
            container = job["spec"]["template"]["spec"]["containers"][0]
        profile = choice.profile
        rec = R.JobRecord(
            id=job_id,
            user=user.name,
            team=team.name,
            profile={
                "slug": profile.slug,
                "displayName": profile.display_name,
                "gpu": {"count": profile.gpu_count, "flavor": choice.flavor},
                "cpu": profile.cpu or policy.defaults.cpu,
                "memory": profile.memory or policy.defaults.memory,
            },
            priority_class=pclass,
            priority=priority,
            policy_sha256=policy_hash(policy),
            image=container["image"],
            image_digest=container["image"].rsplit("@", 1)[1] if "@" in container["image"] else "",
            command=["/bin/sh", "-c", spec.ray_entrypoint] if spec.kind == "ray" else spec.argv,
            working_dir=spec.working_dir or "",
            checkpoint_dir=spec.checkpoint_dir or f".gpuhub/checkpoints/{job_id}",
            env_names=sorted(e["name"] for e in container.get("env", [])),
            experiment=spec.experiment,
            time_limit=spec.time_limit,
            retries=spec.retries.model_dump(),
            spec=spec.model_dump(by_alias=True, exclude={"env"}) | {"env": sorted(spec.env)},
            name=spec.name,
            backend="kubernetes",
            workers=spec.workers,
            kind=spec.kind,
            ray=ray_evidence(spec) if spec.kind == "ray" else None,
        )
        try:
            if spec.kind == "ray":
                raw = await self._client("CustomObjectsApi").create_namespaced_custom_object(
                    RJ.GROUP, RJ.VERSION, spawner.namespace, RJ.PLURAL, job
                )
                created = SimpleNamespace(metadata=SimpleNamespace(uid=raw["metadata"]["uid"]))
            else:
                created = await self._client("BatchV1Api").create_namespaced_job(spawner.namespace, job)
        except Exception as e:  # noqa: BLE001
            what = "RayJob" if spec.kind == "ray" else "Job"
            raise ChoiceError(502, f"the cluster refused the {what}: {getattr(e, 'reason', e)}") from None
        granted = spawner.granted  # the policy's secrets and data in its pods, by name (kube/grants.py)
        if granted.get("secrets"):
            usage.audit("secrets_delivered", key=f"job:{job_id}", user=user.name, names=granted["secrets"])
        if granted.get("data"):
            usage.audit("data_mounted", key=f"job:{job_id}", user=user.name, datasets=granted["data"])
        # The wall (kube/walls.py): only the owner's pods and the hub reach the job's pods. Made
        # while the Job is still suspended (Kueue has not admitted it); no wall, no job.
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "metadata": {"name": job_id, "uid": created.metadata.uid}}
        try:
            await put_up(
                self._client("BatchV1Api").api_client,
                wall(job_id, spawner.namespace, {JOB_LABEL: job_id}, pod["metadata"]["labels"], hub_namespace(), owner=owner),
            )
            if spawner.work_volume == OWN:  # kube/storage.py: the job's own claim, deleted with the Job
                claim = work_claim(
                    owner, spawner.namespace, spawner.work_volume_size, spawner.work_volume_storage_class, {JOB_LABEL: job_id}
                )
                await create_claim(self._client("BatchV1Api").api_client, claim)
            if spec.workers > 1:
                # The workers' names (<job>-<rank>.<job>): a headless Service owned by the Job.
                svc = rendezvous_service({**job, "metadata": {**job["metadata"], "uid": created.metadata.uid}})
                await self._client("CoreV1Api").create_namespaced_service(spawner.namespace, svc)
        except Exception as e:  # noqa: BLE001
            try:
                await self._delete(job_id, spawner.namespace, spec.kind)
            except Exception as gone:  # noqa: BLE001
                log.warning(
                    "Job %s: its NetworkPolicy was refused and it could not be deleted: %s", job_id, getattr(gone, "reason", gone)
                )
            raise ChoiceError(
                502,
                f"the cluster refused the job's NetworkPolicy, volume claim or rendezvous Service: {getattr(e, 'reason', e)}; "
                "nothing was started",
            ) from None
        rec.spec["uid"], rec.spec["namespace"] = created.metadata.uid, spawner.namespace
        rec.attempts.append(R.Attempt(number=1, queued=time.time()))
        self.jobs[job_id] = rec
        self.store.save(rec)
        log.info(
            "Job %s of %s created in %s (%s, queue %s)", job_id, user.name, spawner.namespace, profile.slug, team.local_queue
        )
        self._ensure_poller()
        return rec

    # -- reading the cluster back ---------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            for rec in [r for r in self.jobs.values() if r.state not in R.FINAL]:
                try:
                    await self.refresh(rec)
                except Exception:  # noqa: BLE001
                    log.warning("Cannot read job %s", rec.id, exc_info=True)
            await asyncio.sleep(self.poll_interval)

    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._reading.setdefault(job_id, asyncio.Lock())

    async def refresh(self, rec: R.JobRecord) -> None:
        """Read the Job, its pods and its Workload into ``rec``, one read at a time per job
        (a caller that waited for another's read reads again, and not a finished job)."""
        async with self._lock(rec.id):
            if rec.state not in R.FINAL:
                await self._refresh(rec)

    async def _refresh(self, rec: R.JobRecord) -> None:
        from kubernetes_asyncio.client import ApiException

        ns = rec.spec.get("namespace")
        if not ns:
            return
        if rec.kind == "ray":
            await self._refresh_ray(rec, ns)
            return
        try:
            job = self._plain(await self._client("BatchV1Api").read_namespaced_job(rec.id, ns))
        except ApiException as e:
            if e.status == 404 and rec.state not in R.FINAL:
                rec.state, rec.message, rec.finished = R.CANCELLED, "its Job was deleted from the cluster", time.time()
                self.store.save(rec)
            return
        pods = self._plain(await self._client("CoreV1Api").list_namespaced_pod(ns, label_selector=f"{JOB_LABEL}={rec.id}")).get(
            "items", []
        )
        wls = (
            await self._client("CustomObjectsApi").list_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", ns, "workloads", label_selector=f"{JOB_UID_LABEL}={job['metadata']['uid']}"
            )
        ).get("items", [])
        wl = wls[0] if wls else None
        self._workloads[rec.id] = wl
        pods.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
        if rec.workers > 1:
            await self._read_workers(rec, job, pods, wl, ns)
        else:
            await self._read_pods(rec, job, pods, wl, ns)
        complete, failed = (condition(job, "Complete") or {}), (condition(job, "Failed") or {})
        if complete.get("status") == "True":
            rec.state, rec.message, rec.finished = R.SUCCEEDED, "", timestamp(job["status"].get("completionTime")) or time.time()
        elif failed.get("status") == "True":
            reason = failed.get("reason", "")
            msg = {
                "DeadlineExceeded": f"stopped: it reached its time limit of {rec.time_limit:g}s"
                if rec.time_limit
                else "deadline exceeded",
                "BackoffLimitExceeded": f"No retries left ({rec.retries['limit']} allowed).",
            }.get(reason, failed.get("message", ""))
            if reason == "DeadlineExceeded" and rec.current is not None:
                rec.current.reason = TIME_LIMIT
            last = rec.current.message if rec.current else ""
            rec.state, rec.message, rec.finished = R.FAILED, f"{last} {msg}".strip(), time.time()
        elif job["spec"].get("suspend"):
            # Waiting for (or back in) Kueue's queue: the next attempt is queued.
            rec.state = R.QUEUED
            if rec.current is None or rec.current.finished is not None:
                rec.attempts.append(R.Attempt(number=len(rec.attempts) + 1, queued=time.time()))
        else:
            # Admitted: a pod runs, or the Job controller is between a pod's end and the
            # Job's verdict (or its next pod): still the Job's running phase.
            rec.state = R.RUNNING
        if rec.state in (R.SUCCEEDED, R.FAILED):
            # The Job's verdict is in and this record is read no more: an attempt still open
            # (its pod outlived the verdict: a time limit's kill) ends here; none is left
            # without an end.
            for att in rec.attempts:
                if att.account and att.finished is None:
                    att.finished = time.time()
                    if att.reason is None:
                        att.reason = "interrupted"
                        att.message = "its pod was still there when the job ended; the job's result is another attempt's"
        self.store.save(rec)

    async def _delete(self, job_id: str, ns: str, kind: str) -> None:
        """Delete the job's Job, or its RayJob (``kind: ray``): the garbage collector takes what
        they own (pods; a RayJob's RayCluster and submitter Job; the wall, the claim)."""
        if kind == "ray":
            await self._client("CustomObjectsApi").delete_namespaced_custom_object(
                RJ.GROUP, RJ.VERSION, ns, RJ.PLURAL, job_id, propagation_policy="Background"
            )
        else:
            await self._client("BatchV1Api").delete_namespaced_job(job_id, ns, propagation_policy="Background")

    async def _refresh_ray(self, rec: R.JobRecord, ns: str) -> None:
        """A ``kind: ray`` job: read its RayJob (KubeRay's ``jobDeploymentStatus`` and Ray's
        ``jobStatus``), its pods and its Workload into ``rec``.

        One attempt per admission: the RayJob un-suspended (Kueue admitted it) starts one,
        a suspension (Kueue preempted it: KubeRay deleted its cluster) ends it ``preempted``
        and the next waits in the queue; a KubeRay retry (``backoffLimit``, ``status.failed``
        grown) ends it ``failed`` and starts the next. The attempt's pod (``account``) is the
        submitter's, whose log is ``ray job submit``'s: the entrypoint's output."""
        from kubernetes_asyncio.client import ApiException

        try:
            rj = await self._client("CustomObjectsApi").get_namespaced_custom_object(RJ.GROUP, RJ.VERSION, ns, RJ.PLURAL, rec.id)
        except ApiException as e:
            if e.status == 404 and rec.state not in R.FINAL:
                rec.state, rec.message, rec.finished = R.CANCELLED, "its RayJob was deleted from the cluster", time.time()
                self.store.save(rec)
            return
        pods = self._plain(await self._client("CoreV1Api").list_namespaced_pod(ns, label_selector=f"{JOB_LABEL}={rec.id}")).get(
            "items", []
        )
        wls = (
            await self._client("CustomObjectsApi").list_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", ns, "workloads", label_selector=f"{JOB_UID_LABEL}={rj['metadata']['uid']}"
            )
        ).get("items", [])
        wl = wls[0] if wls else None
        self._workloads[rec.id] = wl
        status = rj.get("status") or {}
        deploy, ray_status = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
        rec.ray = {
            **(rec.ray or {}),
            "jobDeploymentStatus": deploy,
            "jobStatus": ray_status,
            "rayCluster": status.get("rayClusterName", ""),
        }
        suspended = bool(rj["spec"].get("suspend")) or deploy in ("", "New", "Suspending", "Suspended")
        att = rec.current
        failed_before = int(rec.spec.get("rayFailed", 0))
        if att is not None and att.finished is None and int(status.get("failed") or 0) > failed_before:
            att.finished, att.reason = time.time(), "failed"
            att.message = status.get("message") or "the Ray job failed"
            rec.spec["rayFailed"] = int(status.get("failed") or 0)
            att = None
        if suspended:
            if att is not None and att.finished is None and att.admitted is not None:
                await self._gone(rec, att, {"spec": rj["spec"]}, wl)
            if rec.current is None or rec.current.finished is not None:
                rec.attempts.append(R.Attempt(number=len(rec.attempts) + 1, queued=time.time()))
            rec.state = R.QUEUED
        elif deploy not in ("Complete", "Failed", "ValidationFailed"):
            if rec.current is None or rec.current.finished is not None:
                rec.attempts.append(R.Attempt(number=len(rec.attempts) + 1, queued=time.time()))
            att = rec.current
            assert att is not None
            if att.admitted is None:
                att.admitted = timestamp((condition(wl, "QuotaReserved") or {}).get("lastTransitionTime")) or time.time()
            rec.state = R.RUNNING
        att = rec.current
        if att is not None and att.finished is None and not suspended:
            mine = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            workers = [p for p in mine if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "worker"]
            nodes = sorted({p["spec"].get("nodeName") or "" for p in workers} - {""})
            if nodes:
                att.devices = nodes
            submitter = next((p for p in mine if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "submitter"), None)
            if submitter is not None:
                att.account = submitter["metadata"]["name"]
                att.started = att.started or timestamp((submitter.get("status") or {}).get("startTime"))
                await self._copy_log(rec, att, ns, att.account)
            elif att.started is None:
                att.started = timestamp(status.get("startTime"))
        if deploy == "Complete" or deploy in ("Failed", "ValidationFailed"):
            ok = deploy == "Complete" and ray_status == "SUCCEEDED"
            reason = status.get("reason") or ""
            message = status.get("message") or ""
            if reason == "DeadlineExceeded" and rec.time_limit:
                message = f"stopped: it reached its time limit of {rec.time_limit:g}s"
            elif not ok and not message:
                message = f"the Ray job ended {ray_status or deploy}"
            if att is not None and att.finished is None:
                att.finished = timestamp(status.get("endTime")) or time.time()
                att.reason = "succeeded" if ok else (TIME_LIMIT if reason == "DeadlineExceeded" else "failed")
                att.message = "the Ray job succeeded" if ok else message
            rec.state = R.SUCCEEDED if ok else R.FAILED
            rec.message = "" if ok else message
            rec.finished = timestamp(status.get("endTime")) or time.time()
        self.store.save(rec)

    async def _read_pods(self, rec: R.JobRecord, job: dict, pods: list[dict], wl: dict | None, ns: str) -> None:
        """One worker: each pod is an attempt."""
        known = {a.account: a for a in rec.attempts if a.account}  # attempt per pod name
        for pod in pods:
            name = pod["metadata"]["name"]
            att = known.get(name)
            if att is None:
                att = rec.current if rec.current is not None and rec.current.account is None else None
                if att is None:
                    att = R.Attempt(number=len(rec.attempts) + 1, queued=time.time())
                    rec.attempts.append(att)
                att.account = name  # on Kubernetes: the pod that ran the attempt
                att.admitted = timestamp((condition(wl, "QuotaReserved") or {}).get("lastTransitionTime")) or time.time()
                att.devices = [pod["spec"].get("nodeName") or ""]
            if att.finished is None and pod["spec"].get("nodeName"):
                # First seen before the scheduler bound it: the node is known only now.
                att.devices = [pod["spec"]["nodeName"]]
            status = pod.get("status") or {}
            att.started = att.started or timestamp(status.get("startTime"))
            term = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("terminated")
            fault = _fault_of(pod["spec"].get("nodeName"))
            if att.finished is None and status.get("phase") in ("Succeeded", "Failed") and term:
                att.finished = timestamp(term.get("finishedAt")) or time.time()
                att.exit_code = term.get("exitCode")
                att.reason = "succeeded" if status["phase"] == "Succeeded" else "failed"
                att.message = f"exit code {att.exit_code}"
                if status["phase"] == "Failed" and _disrupted(pod):
                    # Evicted (a NoExecute taint, a drain): by its node's health taint? The taint
                    # manager acts at once, maybe before the keeper's next pass: ask the node.
                    fault = fault or await self._read_fault(pod["spec"].get("nodeName"))
                    if fault is not None:  # podFailurePolicy's DisruptionTarget rule decides the retry
                        att.reason, att.message = GPU_FAILED, gpu_failed_message(fault)
                elif status["phase"] == "Failed" and fault is not None:
                    # CUDA failed under it: the Job controller counted it as any exit
                    att.message += f" (its node's GPUs were out of service: {fault.reason})"
            elif (
                att.finished is None
                and fault is not None
                and status.get("phase") not in ("Succeeded", "Failed")
                and not pod["metadata"].get("deletionTimestamp")
            ):
                await self._gpu_failed(rec, att, wl, fault)
            await self._copy_log(rec, att, ns, name)
        # Attempts whose pod is gone without an end: Kueue preempted (suspended) the Job.
        live = {p["metadata"]["name"] for p in pods}
        for att in rec.attempts:
            if att.account and att.account not in live and att.finished is None:
                await self._gone(rec, att, job, wl)

    async def _gone(self, rec: R.JobRecord, att: R.Attempt, job: dict, wl: dict | None) -> None:
        """``att``'s pod (a worker's, with several) went without an end: Kueue preempted
        (suspended) the Job, the hub took its GPUs back, or its node's GPUs failed."""
        att.finished = time.time()
        evicted = M.eviction_message(wl, None)
        # Kueue turns Evicted back to False when it admits the Job again, which may
        # happen before this poll; its eviction count does not go back.
        counted = _preemptions(wl) > (
            sum(1 for a in rec.attempts if a.reason == "preempted") + int(rec.spec.get("gpuFailedDeactivations", 0))
        )
        preempted = counted or is_true(wl, "Evicted") or job["spec"].get("suspend")
        reclaimed = self.reclaimed.pop(rec.id, None)  # the hub took its GPUs back (kube/ledger.py)
        if reclaimed:
            preempted, evicted = True, reclaimed
        node = att.devices[0] if att.devices else None
        fault = None if counted or reclaimed else (_fault_of(node) or await self._read_fault(node))
        if fault is not None:  # evicted by its node's health taint
            att.reason, att.message = GPU_FAILED, gpu_failed_message(fault)
            return
        att.reason = "preempted" if preempted else "interrupted"
        if preempted and not evicted:  # re-admitted already: Kueue's words for it are gone
            evicted = "Your server was stopped by the queue to make room for other work; it was queued again."
        att.message = (evicted or "").replace("server", "job")

    async def _read_workers(self, rec: R.JobRecord, job: dict, pods: list[dict], wl: dict | None, ns: str) -> None:
        """Several workers: one attempt is one run of all N pods (admitted together by Kueue).

        ``att.rendezvous["pods"]`` names each rank's pod (its completion index), ``devices``
        each rank's node, ``account`` rank 0's pod. The attempt ends when all N succeed, when
        one fails (``podFailurePolicy`` fails the Job at once and the Job controller stops the
        others: that worker's exit code is the attempt's), or when a worker's pod goes without
        an end (Kueue preempted the Job: all N go, and all N come back together)."""
        n = rec.workers
        live = {p["metadata"]["name"] for p in pods}
        ranks: dict[str, tuple[R.Attempt, int]] = {}
        for att in rec.attempts:
            for rank, name in enumerate((att.rendezvous or {}).get("pods") or []):
                if name:
                    ranks[name] = (att, rank)
        for pod in pods:
            name = pod["metadata"]["name"]
            index = ((pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX_KEY)) or (
                (pod["metadata"].get("labels") or {}).get(COMPLETION_INDEX_KEY)
            )
            if index is None or not str(index).isdigit() or int(index) >= n:
                continue  # not a worker of this Job (it has an index 0..N-1 by construction)
            rank = int(index)
            if name not in ranks:
                cur = rec.current
                slots = (cur.rendezvous or {}).get("pods") if cur is not None else None
                whole = cur is not None and cur.finished is None and all(p in live for p in (slots or []) if p)
                if cur is not None and whole and (not slots or not slots[rank]):
                    att = cur
                else:  # the attempt before lost a worker (or ended): this pod starts the next one
                    att = R.Attempt(number=len(rec.attempts) + 1, queued=time.time())
                    rec.attempts.append(att)
                if att.rendezvous is None or not att.rendezvous.get("pods"):
                    att.rendezvous = {
                        "master_addr": f"{rec.id}-0.{rec.id}",
                        "master_port": RENDEZVOUS_PORT,
                        "world_size": n,
                        "pods": [None] * n,
                    }
                    att.devices = [""] * n
                    att.admitted = timestamp((condition(wl, "QuotaReserved") or {}).get("lastTransitionTime")) or time.time()
                att.rendezvous["pods"][rank] = name
                ranks[name] = (att, rank)
            att, rank = ranks[name]
            if att.finished is None:
                att.devices[rank] = pod["spec"].get("nodeName") or att.devices[rank]
                att.account = next((p for p in (att.rendezvous or {}).get("pods") or [] if p), name)  # rank 0's pod, once seen
                started = timestamp((pod.get("status") or {}).get("startTime"))
                if started and (att.started is None or started < att.started):
                    att.started = started
        for att in rec.attempts:
            slots = (att.rendezvous or {}).get("pods") or []
            if att.finished is not None or not any(slots):
                continue
            by_name = {p["metadata"]["name"]: p for p in pods}
            ends = []  # (rank, phase, exit code, end time) of each worker that ended
            for rank, name in enumerate(slots):
                worker = by_name.get(name) if name else None
                status = (worker or {}).get("status") or {}
                term = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("terminated")
                if worker is not None and status.get("phase") in ("Succeeded", "Failed") and term:
                    ends.append((rank, status["phase"], term.get("exitCode"), timestamp(term.get("finishedAt"))))
            failed = [e for e in ends if e[1] == "Failed"]
            if failed:
                rank, _, code, at = failed[0]
                att.finished, att.exit_code, att.reason = at or time.time(), code, "failed"
                att.message = f"exit code {code} (worker rank {rank}; the other workers were stopped)"
            elif len(ends) == n and all(slots):
                att.finished = max((e[3] or 0 for e in ends), default=0) or time.time()
                att.exit_code, att.reason, att.message = 0, "succeeded", "exit code 0 (all workers)"
            elif any(name and name not in live for name in slots):
                await self._gone(rec, att, job, wl)
            await self._copy_worker_logs(rec, att, ns, [p for p in slots if p in live])

    async def _read_fault(self, node: str | None) -> NodeFault | None:
        """``node``'s health taint read now (``list`` nodes by name: the keeper's RBAC)."""
        if not node:
            return None
        try:
            nodes = self._plain(await self._client("CoreV1Api").list_node(field_selector=f"metadata.name={node}")).get(
                "items", []
            )
        except Exception as e:  # noqa: BLE001 - not allowed, or the API is away: the keeper's view only
            log.info("Cannot read node %s: %s", node, getattr(e, "reason", e))
            return None
        return node_faults(self.policy, nodes).get(node)

    async def _gpu_failed(self, rec: R.JobRecord, att: R.Attempt, wl: dict | None, fault: NodeFault) -> None:
        """The running attempt's node lost its GPUs: end it ``gpu-failed`` and queue the job again.

        The Workload is deactivated as for a reclaim (annotated first, so the ledger
        reactivates it once Kueue has evicted it, even across a hub restart): Kueue suspends
        the Job, its pod is deleted without counting against ``backoffLimit``, and the job
        waits for quota again; the taint keeps the scheduler off the failed node.
        """
        if wl is None:
            return
        if wl["spec"].get("active") is False:
            # Deactivated already (this hub's earlier read, whose patch answered late, or a
            # reclaim): Kueue is stopping the pod; the attempt on the failed node is over all
            # the same, and is not left open.
            att.finished, att.reason, att.message = time.time(), GPU_FAILED, gpu_failed_message(fault)
            return
        meta = wl["metadata"]
        try:
            await self._client("CustomObjectsApi").patch_namespaced_custom_object(
                GROUP,
                VERSION,
                meta["namespace"],
                "workloads",
                meta["name"],
                {"metadata": {"annotations": {RECLAIM_ANNOTATION: str(int(time.time()))}}, "spec": {"active": False}},
                _content_type="application/merge-patch+json",
            )
        except Exception as e:  # noqa: BLE001 - the next read tries again
            log.warning(
                "Job %s: could not deactivate Workload %s/%s after its node's GPUs failed: %s",
                rec.id,
                meta["namespace"],
                meta["name"],
                getattr(e, "reason", e),
            )
            return
        rec.spec["gpuFailedDeactivations"] = int(rec.spec.get("gpuFailedDeactivations", 0)) + 1
        att.finished, att.reason, att.message = time.time(), GPU_FAILED, gpu_failed_message(fault)
        usage.note_end(f"job:{rec.id}", "crashed")  # the history's word (usage/history.py END_REASONS)
        log.warning("Job %s attempt %d: %s", rec.id, att.number, att.message)

    async def _read_pod_log(self, pod: str, ns: str, budget: int) -> str:
        """The end of ``pod``'s log, at most ``budget`` bytes (``MAX_POD_LOG_BYTES``).

        The API server cuts a log by ``tailLines`` and then ``limitBytes`` from the start of
        what is left, so a log longer than the budget would keep the beginning of its tail: a
        cut answer is asked for again with fewer lines (as many as fitted, less a quarter),
        at most twice more; whatever comes back is cut to ``budget`` here too."""
        api = self._client("CoreV1Api")
        lines, text = MAX_POD_LOG_LINES, ""
        for _ in range(3):
            answer = await api.read_namespaced_pod_log(pod, ns, limit_bytes=budget, tail_lines=lines)
            text = answer if isinstance(answer, str) else str(answer)
            if len(text) < budget // 4 or len(text.encode("utf-8", "replace")) < budget:
                return text
            got = text.count("\n")
            if got < 2:
                break
            lines = max(1, got * 3 // 4)
        data = text.encode("utf-8", "replace")
        return data[-budget:].decode("utf-8", "ignore") if len(data) > budget else text

    async def _copy_log(self, rec: R.JobRecord, att: R.Attempt, ns: str, pod: str) -> None:
        try:
            text = await self._read_pod_log(pod, ns, MAX_POD_LOG_BYTES)
        except Exception:  # noqa: BLE001 - not started yet, or gone
            return
        path = self.store.log_dir(rec.id) / f"attempt-{att.number}.log"
        import os

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text if isinstance(text, str) else str(text))
        att.log = str(path)

    async def _copy_worker_logs(self, rec: R.JobRecord, att: R.Attempt, ns: str, pods: list[str]) -> None:
        """Every worker's log in the attempt's one log file, rank by rank under a header (as on
        one machine, all workers write to the attempt's log). Each rank's copy is kept beside it
        (``attempt-N.rank-R.log``), so a worker whose pod is already gone keeps what the last
        read copied."""
        import os

        slots = (att.rendezvous or {}).get("pods") or []
        d = self.store.log_dir(rec.id)

        def write(path: Path, text: str) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)

        changed = False
        # All workers together within one attempt's bound: each its share of it.
        budget = max(MIN_WORKER_LOG_BYTES, MAX_POD_LOG_BYTES // max(1, len(slots)))
        for rank, name in enumerate(slots):
            if not name or name not in pods:
                continue
            try:
                text = await self._read_pod_log(name, ns, budget)
            except Exception:  # noqa: BLE001 - not started yet, or gone
                continue
            write(d / f"attempt-{att.number}.rank-{rank}.log", text if isinstance(text, str) else str(text))
            changed = True
        if not changed:
            return
        parts = []
        for rank, name in enumerate(slots):
            try:
                text = (d / f"attempt-{att.number}.rank-{rank}.log").read_text()
            except OSError:
                continue
            parts.append(f"[gpuhub] worker rank {rank} (pod {name}):\n{text}" + ("" if text.endswith("\n") or not text else "\n"))
        write(d / f"attempt-{att.number}.log", "".join(parts))
        att.log = str(d / f"attempt-{att.number}.log")

    # -- the API's view -------------------------------------------------------------------------
    def status_line(self, rec: R.JobRecord) -> str:
        if rec.state == R.QUEUED:
            wl = self._workloads.get(rec.id)
            team = next((t for t in self.policy.teams if t.name == rec.team), None)
            profile = self.policy.profile(rec.profile["slug"])
            if team is not None and profile is not None:
                choice = Choice(team, profile, rec.priority_class, rec.priority)
                return "queued: " + M.waiting_message(self.policy, choice, wl, None, None).replace("server", "job")
            return "queued"
        if rec.state == R.RUNNING:
            att = rec.current
            pods = [p for p in ((att.rendezvous or {}).get("pods") or []) if p] if att else []
            if rec.kind == "ray":
                ray = rec.ray or {}
                return (
                    f"running: attempt {att.number if att else '?'}, Ray job {ray.get('jobStatus') or 'PENDING'} "
                    f"(KubeRay: {ray.get('jobDeploymentStatus') or '?'}) on cluster {ray.get('rayCluster') or '(being made)'}."
                )
            if rec.workers > 1:
                return f"running: attempt {att.number if att else '?'}, {rec.workers} workers in pods {', '.join(pods) or '?'}."
            return f"running: attempt {att.number if att else '?'} in pod {att.account if att else '?'}."
        detail = rec.message or (rec.current.message if rec.current else "")
        return f"{rec.state}: {detail}" if detail else rec.state

    def view(self, rec: R.JobRecord) -> dict:
        data = rec.to_dict()
        data["status"] = self.status_line(rec)
        return data

    def log_files(self, rec: R.JobRecord) -> list[Path]:
        return [Path(a.log) for a in rec.attempts if a.log]

    async def cancel(self, job_id: str) -> R.JobRecord:
        rec = self.jobs[job_id]
        async with self._lock(job_id):  # no read of the job in between
            return await self._cancel(rec)

    async def _cancel(self, rec: R.JobRecord) -> R.JobRecord:
        job_id = rec.id
        if rec.state in R.FINAL:
            return rec
        await self._refresh(rec)
        try:
            await self._delete(job_id, rec.spec["namespace"], rec.kind)
        except Exception:  # noqa: BLE001
            log.warning("Cannot delete %s %s", "RayJob" if rec.kind == "ray" else "Job", job_id, exc_info=True)
        att = rec.current
        if att is not None and att.finished is None:
            att.finished, att.reason, att.message = time.time(), "cancelled", "cancelled by its owner or an admin"
        rec.state, rec.message, rec.finished = R.CANCELLED, "cancelled by its owner or an admin", time.time()
        self.store.save(rec)
        return rec


def _fault_of(node: str | None) -> NodeFault | None:
    """The health taint of ``node`` as the hub's capacity keeper last read it (on the ledger)."""
    return KueueLedger.instance().fault_of(node) if KueueLedger.initialized() else None
