"""Ray clusters on one machine: a job with no command of its own (docs/ray.md).

``LocalRayManager`` implements ``rayclusters.RayClusterManager`` on top of the one-machine
``JobManager``: a cluster *is* a job whose command is ``rayclusters.node`` (the head and the
workers, ``ray start --block``), so it gets everything a job gets and nothing is copied:

- **policy and caps**: ``rayclusters.choose`` (the ``ray:`` section, the profile with N GPUs),
  then ``JobManager.submit`` (the team may use the profile; the user's GPU cap counts their
  servers, jobs and clusters together; refused before anything queues);
- **the queue**: its ticket ``job:<id>`` in the hub's ``AdmissionQueue`` (same quota, same
  order, the same plain-language waiting message, "this Ray cluster" for "this job");
- **the user**: ``JobProcess``, the one-machine spawner's isolated launcher: the user's Unix
  account and private home and ``/tmp``, the profile's cgroup, a private ``/dev`` with only
  the granted GPUs, ``CUDA_VISIBLE_DEVICES`` set to them;
- **evidence**: the job record (``jobs.records``), usage history (the queue's admission and
  release of ``job:<id>``), and the audit trail (``ray_cluster_*`` events, here).

What is added here: the user's Ray token (one per user, ``<data>/ray/tokens``, 0600: Ray's
token authentication keeps other accounts off the cluster's ports), the ready line read from
the attempt's log (address, dashboard port; the dashboard itself is served on the owner's
origin by their server: ``gpuhub_notebook.ray_dashboard``), and the idle rules:
a running cluster's GPUs are read like a server's (``culling.gpu.read_nvml``) and judged by
the profile's idle rules (``culling.rules.decide``): warned, then stopped. With
``ray.stopWithServer`` a cluster also stops when its user's last server stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from ..culling.gpu import read_nvml
from ..culling.rules import CullState, Signals, decide
from ..jobs import records as R
from ..jobs.spec import JobSpec, Retries
from ..policy.access import ChoiceError
from ..rayclusters import (
    BY_USER,
    FAILED,
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
from ..rayclusters.node import READY
from ..usage import recorder as usage
from .job_manager import KEY_PREFIX, JobManager, ray_node_argv, ray_token

log = logging.getLogger("JupyterHub.gpuhub.ray")

MARK = "GPUHUB_RAY_CLUSTER"  # an env name of the job: this job is a Ray cluster
_WHY = {
    BY_USER: "stopped by its owner or an admin",
    WITH_SERVER: "stopped because its owner's server stopped (the policy's ray.stopWithServer)",
}


@dataclass
class _Watch:
    """What only the running hub knows about a running cluster."""

    ready: dict | None = None
    ready_at: float | None = None  # when the hub first saw the head ready: the idle clock starts there
    log_offset: int = 0
    attempt: int = 0
    gpu_last_busy: float | None = None
    cull: CullState = field(default_factory=CullState)
    warning: str = ""
    had_server: bool = False


class LocalRayManager(RayClusterManager):
    """One hub's Ray clusters on one machine (see the module docstring)."""

    _instances: dict[int, "LocalRayManager"] = {}
    check_interval = 2.0  # seconds between idle and server checks (hub config: LocalRayManager.check_interval)

    def __init__(self, config):
        self.config = config
        section = config.get("LocalRayManager", {}) if hasattr(config, "get") else {}
        self.check_interval = float(section.get("check_interval", self.check_interval))
        self._watch: dict[str, _Watch] = {}
        self._ending: dict[str, tuple[str, str]] = {}  # job id -> (reason, words) while it stops
        self._loop_task: asyncio.Task | None = None

    @classmethod
    def instance(cls, config) -> "LocalRayManager":
        jobs = JobManager.instance(config=config)
        key = id(jobs)
        if key not in cls._instances:
            cls._instances[key] = cls(config)
        return cls._instances[key]

    @property
    def jobs(self) -> JobManager:
        return JobManager.instance(config=self.config)

    # -- the user's token -----------------------------------------------------------------
    def token(self, user: str) -> str:
        return ray_token(self.jobs.data_dir, user)

    # -- start ------------------------------------------------------------------------------
    async def start(self, user, groups: list[str], request: RayRequest) -> RayClusterView:
        jobs = self.jobs
        jobs.broker.store.refresh()
        policy = jobs.policy
        choice = choose(policy, groups, request)
        name = request.name or "ray-" + secrets.token_hex(3)
        if any(r.user == user.name and r.name == name and r.state not in R.FINAL for r in self._records()):
            raise ChoiceError(409, f"You already have a Ray cluster named {name!r}; stop it first or choose another name.")
        flavor = choice.profile.gpu.flavor if choice.profile.gpu else None
        virtual = bool(flavor) and all(d.virtual for d in jobs.broker.devices.devices if d.flavor == flavor)
        cpus = max(1, (choice.profile.cpu or policy.defaults.cpu) // 1000)
        command = ray_node_argv(gpus=choice.gpus, workers=request.workers, cpus=cpus, name=name, virtual=virtual)
        # Built, not parsed: MARK is in the names a job file may not set (GPUHUB_*), so no job
        # of the user's can pass for a cluster.
        spec = JobSpec.model_construct(
            profile=choice.profile.slug,
            team=choice.team.name,
            name=name,
            command=command,
            image=None,
            working_dir=None,
            env={MARK: name, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token(user.name)},
            retries=Retries(limit=0, reasons=[]),
            checkpoint_dir=None,
            experiment=None,
            time_limit=None,
        )
        rec = jobs.submit(user, groups, spec)
        usage.audit(
            "ray_cluster_requested",
            user=user.name,
            key=KEY_PREFIX + rec.id,
            cluster=name,
            team=rec.team,
            profile=rec.profile["slug"],
            gpus=choice.gpus,
            workers=request.workers,
        )
        view = self.view(rec)
        log.info(
            "Ray cluster %s (%s) of %s requested: %d GPU(s), %d worker(s), profile %s; %s",
            name,
            rec.id,
            user.name,
            choice.gpus,
            request.workers,
            rec.profile["slug"],
            view.status,
        )
        self._ensure_loop()
        return view

    # -- reading ----------------------------------------------------------------------------
    def _records(self) -> list[R.JobRecord]:
        return [r for r in self.jobs.jobs.values() if MARK in (r.spec.get("env") or [])]

    def _find(self, cluster: str, user_name: str | None) -> R.JobRecord | None:
        recs = [r for r in self._records() if (user_name is None or r.user == user_name) and cluster in (r.id, r.name)]
        recs.sort(key=lambda r: (r.state in R.FINAL, -(r.attempts[0].queued if r.attempts else 0)))
        return recs[0] if recs else None

    def list(self, user_name: str | None = None) -> list[RayClusterView]:
        recs = [r for r in self._records() if user_name is None or r.user == user_name]
        recs.sort(key=lambda r: -(r.attempts[0].queued if r.attempts else 0))
        return [self.view(r) for r in recs]

    def status(self, cluster: str, user_name: str | None = None) -> RayClusterView | None:
        rec = self._find(cluster, user_name)
        return self.view(rec) if rec else None

    def _ready(self, rec: R.JobRecord) -> dict | None:
        """The head's ready line from the current attempt's log (read on from where we were)."""
        att = rec.current
        if rec.state != R.RUNNING or att is None or not att.log:
            return None
        w = self._watch.setdefault(rec.id, _Watch())
        if w.attempt != att.number:
            w.ready, w.ready_at, w.log_offset, w.attempt = None, None, 0, att.number
        if w.ready is None:
            try:
                with open(att.log, "rb") as f:
                    f.seek(w.log_offset)
                    chunk = f.read(1 << 20)
            except OSError:
                return None
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].splitlines():
                text = line.decode("utf-8", "replace")
                if text.startswith(READY):
                    try:
                        info = json.loads(text[len(READY) :])
                        port = int(info["dashboard_port"])
                        host, gport = str(info["address"]).rsplit(":", 1)
                        w.ready = {
                            "address": f"127.0.0.1:{int(gport)}",
                            "dashboard_port": port,
                            "virtual": bool(info.get("virtual")),
                        }
                        w.ready_at = time.time()
                        log.info(
                            "Ray cluster %s (%s) of %s running: %s, dashboard port %s, GPUs %s",
                            rec.name,
                            rec.id,
                            rec.user,
                            w.ready["address"],
                            port,
                            ", ".join(att.devices) or "none",
                        )
                    except (ValueError, KeyError, TypeError):
                        pass
            w.log_offset += end
        return w.ready

    def view(self, rec: R.JobRecord) -> RayClusterView:
        att = rec.current
        ready = self._ready(rec)
        w = self._watch.get(rec.id)
        gpus = rec.profile["gpu"]["count"]
        v = RayClusterView(
            id=rec.id,
            name=rec.name or rec.id,
            user=rec.user,
            team=rec.team,
            profile=rec.profile["slug"],
            gpus=gpus,
            workers=_workers(rec),
            state="",
            status="",
            devices=list(att.devices) if att else [],
            created=rec.attempts[0].queued if rec.attempts else None,
            started=att.started if att else None,
            finished=rec.finished,
            warning=(w.warning if w else ""),
        )
        if rec.state == R.QUEUED:
            v.state = QUEUED
            v.status = self.jobs.status_line(rec).replace("this job", "this Ray cluster")
        elif rec.state == R.RUNNING and ready is None:
            v.state, v.status = STARTING, f"starting: admitted with {', '.join(v.devices) or 'no GPU'}; the head is starting."
        elif rec.state == R.RUNNING and ready is not None:  # (not ready: just above)
            v.state = RUNNING
            v.address = ready["address"]
            v.dashboard = f"gpuhub/ray/{v.name}/dashboard/"  # served by the owner's server, on their origin
            v.dashboard_port = ready["dashboard_port"]
            virtual = " (virtual GPUs: Ray schedules on them, CUDA has none)" if ready.get("virtual") and gpus else ""
            held = f" {', '.join(v.devices)}" if v.devices else ""  # (no GPU: no device list, no stray space)
            v.status = f'running: since {_ts(v.started)} with {gpus} GPU(s){held}{virtual}; ray.init("{v.address}")'
            if v.warning:
                v.status += f"; {v.warning}"
        else:
            message = rec.message or (att.message if att else "")
            ending = self._ending.get(rec.id)
            if ending is not None:
                message = ending[1]
            if rec.state == R.CANCELLED or (rec.state == R.SUCCEEDED):
                v.state, v.status = STOPPED, f"stopped: {message or 'the cluster ended'}"
            else:
                v.state, v.status = FAILED, f"failed: {message}"
            v.reason = ending[0] if ending is not None else _reason(rec)
        return v

    # -- stopping ---------------------------------------------------------------------------
    async def stop(
        self, cluster: str, reason: str = BY_USER, user_name: str | None = None, message: str | None = None
    ) -> RayClusterView | None:
        rec = self._find(cluster, user_name)
        if rec is None:
            return None
        if rec.state in R.FINAL:
            return self.view(rec)
        words = message or _WHY.get(reason, reason)
        # usage history's words (usage/history.py END_REASONS): why its GPU time ended
        usage.note_end(KEY_PREFIX + rec.id, "culled" if reason == IDLE else "stopped", by=user_name)
        # Known before the job manager ends the job with its own words ("cancelled by ..."):
        # a reader between its end and ours sees why the cluster stopped.
        self._ending[rec.id] = (reason, words)
        try:
            await self.jobs.cancel(rec.id)
            rec.message = words
            rec.spec = dict(rec.spec, rayEnded=reason)
            self.jobs.store.save(rec)
        finally:
            self._ending.pop(rec.id, None)
        self._watch.pop(rec.id, None)
        usage.audit("ray_cluster_stopped", user=rec.user, key=KEY_PREFIX + rec.id, cluster=rec.name, reason=reason, message=words)
        log.info("Ray cluster %s (%s) of %s stopped: %s", rec.name, rec.id, rec.user, words)
        return self.view(rec)

    # -- idle rules and the owner's server ------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._loop())

    def recover(self) -> None:
        self._ensure_loop()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the next pass tries again
                log.exception("Ray cluster check failed")

    def _users_with_servers(self) -> set[str]:
        queue = self.jobs.broker.queue
        return {adm.user for key, adm in list(queue.admitted.items()) if not key.startswith(KEY_PREFIX)}

    async def check(self, now: float | None = None) -> None:
        policy = self.jobs.policy
        running = [r for r in self._records() if r.state == R.RUNNING and self._ready(r) is not None]
        if not running:
            return
        with_servers = self._users_with_servers()
        devices = [d for r in running for d in (r.current.devices if r.current else [])]
        util = await asyncio.get_running_loop().run_in_executor(None, read_nvml, devices) if devices else {}
        now = now or time.time()
        for rec in running:
            w = self._watch.setdefault(rec.id, _Watch())
            att = rec.current
            if rec.user in with_servers:
                w.had_server = True
            elif w.had_server and policy.ray.stop_with_server:
                await self.stop(rec.id, WITH_SERVER)
                continue
            profile = policy.profile(rec.profile["slug"])
            if profile is None:
                continue
            rules = policy.idle_rules(profile)
            assert att is not None  # a running record is in an attempt
            readings = [util[d] for d in att.devices if d in util]
            threshold = rules.gpu_busy_threshold if rules.gpu_busy_threshold is not None else 5
            if readings and max(readings) > threshold:
                w.gpu_last_busy = now
            has_gpus = bool(att.devices)
            unread = None if (readings or not has_gpus) else (rules.gpu_unread or None)
            # From when the head was ready, not from the process start: Ray's start can take
            # minutes on a loaded machine, and a cluster is not idle before it could be used.
            signals = Signals(
                started=w.ready_at or att.started or now,
                last_activity=None,
                gpu_last_busy=w.gpu_last_busy,
                has_gpus=has_gpus,
                gpu_unread=unread,
            )
            before = w.cull.deadline
            d = decide(now, rules, signals, w.cull)
            if d.action == "warn":
                w.warning = f"idle: {d.reason}; it will be stopped at {_ts(d.deadline)} unless its GPUs are used"
                if before is None:
                    log.info("Ray cluster %s (%s) of %s warned: %s", rec.name, rec.id, rec.user, w.warning)
                    usage.audit(
                        "ray_cluster_warned",
                        user=rec.user,
                        key=KEY_PREFIX + rec.id,
                        cluster=rec.name,
                        reason=d.reason,
                        deadline=d.deadline,
                    )
            elif d.action == "cull":
                await self.stop(rec.id, IDLE, message=f"stopped because it was idle: {d.reason}")
            else:
                w.warning = ""


def _workers(rec: R.JobRecord) -> int:
    cmd = rec.command
    try:
        return int(cmd[cmd.index("--workers") + 1])
    except (ValueError, IndexError):
        return 0


def _reason(rec: R.JobRecord) -> str:
    ended = rec.spec.get("rayEnded") if isinstance(rec.spec, dict) else None
    if ended:
        return ended
    att = rec.current
    return (att.reason if att and att.reason else rec.state) or ""


def _ts(t) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t)) if t else "-"
