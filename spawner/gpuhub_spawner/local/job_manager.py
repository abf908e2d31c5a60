"""Batch jobs on one machine: the team's queue, the user's identity, retries, evidence.

One ``JobManager`` per hub. A submitted job is checked like a server start (the team may
use the profile: ``policy.access.resolve_choice``; the user's GPU cap counts their servers
and jobs together: ``check_job_caps``), refused with the reason before anything queues,
then driven by one asyncio task through its attempts:

    queued ──admission──► running ──exit 0──► succeeded
       ▲                     │
       └── preempted or interrupted (listed in ``retries.reasons``: by default), gpu-failed
           (always; its GPU went bad), or a listed failure (at most ``retries.limit`` of them)
                             └──► failed (non-retryable, limit reached, time limit) / cancelled

- **Same queue.** Every attempt is a ``Ticket`` in the hub's ``AdmissionQueue`` (key
  ``job:<id>``), at the team's ``jobPriority`` (else the priority its servers get), so
  jobs and servers share one quota and one order.
- **Interactive first.** A job never preempts anything. When an interactive server of the
  job's team waits and the team's running jobs of no higher priority hold what it needs,
  the youngest such jobs are stopped (reason ``preempted``) and re-queued: Kueue's
  within-ClusterQueue preemption, with servers as the protected class.
- **Same launcher.** Each attempt starts through ``jobs.launcher.JobProcess`` — the
  one-machine spawner's isolated launcher — as the user's Unix account with exactly the
  admitted GPUs and the profile's CPU and memory.
- **A GPU that goes bad** (``local.gpu_health``) ends the attempt holding it as
  ``gpu-failed``: stopped like a preemption, re-queued at once and resumed from its
  checkpoint on a healthy GPU (the bad one is out of admission), never charged to
  ``retries.limit``. An attempt that died on its own while its GPU went bad ends the same.
- **Recovery.** Every attempt gets ``GPUHUB_ATTEMPT`` and the same ``GPUHUB_CHECKPOINT_DIR``
  in the user's home. ``timeLimit`` bounds the job's total running time.
- **Evidence.** ``jobs.records``: one record per job, rewritten at every stage change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from traitlets import Float, Integer, Unicode
from traitlets.config import SingletonConfigurable

from ..admission.queue import QueueRefused, Ticket
from ..admission.quota import add_usage, check_fit, demand_for, describe
from .broker import LocalBroker
from .devices import cuda_refusal
from .isolation import process_start_time
from .runtime import one_machine_runtime
from ..policy.bounded import loads_json
from ..policy.access import ChoiceError, active_profiles, check_job_caps, resolve_choice
from ..policy.model import Policy, Profile
from ..policy.quantities import format_duration, format_memory
from ..jobs import mlflow_runs
from ..jobs.notebook import failed_cell as notebook_failed_cell, load_bounded as notebook_load
from ..jobs import records as R
from ..jobs.common import TIME_LIMIT, _ts, check_ray_job, job_priority, policy_hash, ray_evidence
from .job_launcher import JobProcess, launcher_config
from ..admission.health import BAD
from ..jobs.spec import FAILED, GPU_FAILED, INTERRUPTED, OOM, PLATFORM_REASONS, PREEMPTED, JobSpec

from ..usage import recorder as usage

log = logging.getLogger("JupyterHub.gpuhub.jobs")

CANCELLED_REASON = "cancelled"
KEY_PREFIX = "job:"


@dataclass
class _Live:
    """What only the running hub knows about a job (never persisted)."""

    ticket: Ticket | None = None
    launcher: JobProcess | None = None
    task: asyncio.Task | None = None
    stop_reason: str | None = None
    stop_message: str = ""
    exited: asyncio.Future | None = None
    token: str | None = None
    demand: dict = field(default_factory=dict)
    stopping: asyncio.Future | None = None  # the hub's stop of the attempt (its cgroup's removal)
    others: list[JobProcess] = field(default_factory=list)  # workers rank 1... (rank 0 is ``launcher``)
    first_failure: tuple[int, int] | None = None  # (rank, exit code) of the worker that failed first


def ray_token(data_dir: str, user: str) -> str:
    """The user's Ray token (one per user, ``<data>/ray/tokens/<user>``, 0600), made on first
    use: every cluster of theirs, a ``gpuhub ray up`` one or a Ray job's, checks it."""
    root = Path(data_dir) / "ray" / "tokens"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root.parent, 0o700)
    path = root / user
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        tok = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tok)
        return tok


def ray_node_argv(
    gpus: int, workers: int, cpus: int, name: str, virtual: bool, entrypoint: str | None = None, runtime_env: dict | None = None
) -> list[str]:
    """gpuhub's Ray launcher (``rayclusters.node``): the one command every one-machine Ray
    cluster runs as, a ``gpuhub ray up`` cluster's or a Ray job's (with its entrypoint)."""
    argv = [sys.executable, "-I", "-m", "gpuhub_spawner.rayclusters.node"]
    argv += ["--gpus", str(gpus), "--workers", str(workers), "--cpus", str(cpus), "--name", name]
    argv += ["--virtual"] if virtual else []
    if entrypoint is not None:
        # The entrypoint last, after '--': never read as one of the launcher's options.
        argv += ["--runtime-env", json.dumps(runtime_env or {}, sort_keys=True), "--", entrypoint]
    return argv


class JobManager(SingletonConfigurable):
    # What this backend runs (the hub refuses other kinds with 501 before submitting).
    job_kinds = ("command", "notebook", "ray")
    data_dir = Unicode("data", help="The hub's data directory; records live in <data_dir>/jobs (0700).").tag(config=True)
    reclaim_interval = Float(
        1.0, help="Seconds between checks whether a waiting interactive server should reclaim GPUs from its team's jobs."
    ).tag(config=True)
    retention_days = Float(
        0.0, help="Delete finished jobs' records and logs older than this at hub start (0: keep forever)."
    ).tag(config=True)
    hub_api_url = Unicode("", help="The hub API URL given to jobs (JUPYTERHUB_API_URL).").tag(config=True)
    max_jobs_per_user = Integer(
        50, help="Unfinished (queued or running) jobs one user may have; more are refused (0: no limit)."
    ).tag(config=True)
    rendezvous_port = Integer(
        29500,
        help="MASTER_PORT of a multi-worker job (torch's default), on the user's own loopback (each user has a "
        "network of their own); a user's further multi-worker jobs running at once get the next ports. "
        "Below the ephemeral range, so no outgoing connection holds it.",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.store = R.JobStore(Path(self.data_dir) / "jobs")
        self.jobs: dict[str, R.JobRecord] = {}
        self._live: dict[str, _Live] = {}
        self._env_values: dict[str, dict[str, str]] = {}
        self._reclaimer: asyncio.Task | None = None
        self._recovered = False

    @property
    def broker(self) -> LocalBroker:
        return LocalBroker.instance(config=self.config)

    @property
    def policy(self) -> Policy:
        return self.broker.store.current

    # -- hub start -------------------------------------------------------------------------
    def recover(self) -> None:
        """Load every record; re-queue waiting jobs, end (and retry) those a restart interrupted."""
        if self._recovered:
            return
        self._recovered = True
        now = time.time()
        for rec in self.store.load_all():
            if rec.state in R.FINAL and self.retention_days and (rec.finished or now) < now - self.retention_days * 86400:
                self._delete(rec)
                continue
            self.jobs[rec.id] = rec
            if rec.state in R.FINAL:
                continue
            att = rec.current
            if rec.state == R.RUNNING and att is not None and att.finished is None:
                self._kill_leftover(rec, att)
                self._end_attempt(rec, att, INTERRUPTED, None, "the hub restarted while this attempt ran")
                if not self._retryable(rec, INTERRUPTED, None):
                    self._finish(rec, R.FAILED, "interrupted by a hub restart ('interrupted' is not in retries.reasons)")
                    continue
            # A job that only waited takes its attempt back: same number, same arrival time,
            # so it keeps its place in the queue (the ticket is created at att.queued).
            self._start_task(rec)
        self._ensure_reclaimer()

    def _delete(self, rec: R.JobRecord) -> None:
        import shutil

        self.store.path(rec.id).unlink(missing_ok=True)
        shutil.rmtree(self.store.root / rec.id, ignore_errors=True)

    def _kill_leftover(self, rec: R.JobRecord, att: R.Attempt) -> None:
        for worker in range(_processes(rec)):
            launcher = self._launcher(rec, att, {}, (None, None), worker=worker)  # for its cgroups' names only
            try:
                for cg in launcher.server_cgroups():  # where this gpuhub puts it, and where an older one did
                    cg.kill_all()
            except Exception:  # noqa: BLE001 - best effort; the pid check below still runs
                log.exception("Cannot sweep the cgroup of %s (worker %d)", rec.id, worker)
        for pid, start in [(att.pid, att.start_time), *[(p[0], p[1]) for p in att.worker_pids if len(p) == 2]]:
            if pid and start is not None and process_start_time(pid) == start:
                try:
                    os.killpg(pid, 9)
                except OSError:
                    pass

    # -- submission ------------------------------------------------------------------------
    def held_profiles(self, user, releasing: str | None = None) -> list[Profile | None]:
        """The user's running or waiting servers and jobs (GPU caps count both); the server
        ``releasing`` (stopped once the job is queued: ``--stop-server``) not counted."""
        policy = self.policy
        held = [p for name, p in active_profiles(policy, user).items() if name != releasing]
        for rec in self.jobs.values():
            if rec.user == user.name and rec.state not in R.FINAL:
                held.extend([policy.profile(rec.profile["slug"])] * max(1, rec.workers))
        return held

    def submit(self, user, groups: list[str], spec: JobSpec, releasing: str | None = None) -> R.JobRecord:
        """Check, queue and record a job; raise ``ChoiceError`` (4xx) before anything queues.

        ``releasing``: a server of the user the caller stops right after (its GPUs do not
        count against the user's cap; the job queues behind it until it is gone)."""
        self.broker.store.refresh()
        policy = self.policy
        options = {"profile": spec.profile, **({"team": spec.team} if spec.team else {})}
        choice = resolve_choice(policy, groups, options)
        if spec.kind == "ray":
            check_ray_job(policy, spec)
        # The team's per-user GPUs (servers and jobs together), not maxServers (check_job_caps).
        team = choice.team
        # N workers hold N times the profile: the cap sees the N-1 beside this request.
        check_job_caps(choice, self.held_profiles(user, releasing) + [choice.profile] * (spec.workers - 1))
        unfinished = sum(1 for r in self.jobs.values() if r.user == user.name and r.state not in R.FINAL)
        if self.max_jobs_per_user and unfinished >= self.max_jobs_per_user:
            raise ChoiceError(
                429,
                f"You have {unfinished} unfinished jobs, the most this hub allows per user; "
                "wait for some to finish or cancel some.",
            )
        pclass, priority = job_priority(policy, choice)
        profile = choice.profile
        demand = _times(demand_for(policy, profile), spec.workers)  # admitted all or nothing: one ticket
        never = self.broker.devices.never_fits(demand) or cuda_refusal(profile, self.broker.devices.driver())
        if never:
            raise ChoiceError(409, never)
        job_id = "job-" + secrets.token_hex(5)
        image = spec.image or profile.image or policy.defaults.image
        if spec.kind == "ray":
            command = self._ray_command(job_id, spec, profile, choice.flavor, demand)
        else:
            # A notebook runs under the hub environment's Python, which has papermill.
            command = spec.notebook_argv(sys.executable) if spec.notebook else spec.argv
        rec = R.JobRecord(
            id=job_id,
            user=user.name,
            team=team.name,
            profile={
                "slug": profile.slug,
                "displayName": profile.display_name,
                "gpu": {"count": profile.gpu_count, "flavor": choice.flavor},
                "cpu": demand["cpu"],
                "memory": demand["memory"],
            },
            priority_class=pclass,
            priority=priority,
            policy_sha256=policy_hash(policy),
            image=image,
            image_digest=image.rsplit("@", 1)[1] if "@" in image else "",
            command=command,
            working_dir=spec.working_dir or "",
            checkpoint_dir=spec.checkpoint_dir or f".gpuhub/checkpoints/{job_id}",
            env_names=[],
            experiment=spec.experiment,
            time_limit=spec.time_limit,
            retries=spec.retries.model_dump(),
            spec=spec.model_dump(by_alias=True, exclude={"env"}) | {"env": sorted(spec.env)},
            name=spec.name,
            kind=spec.kind,
            workers=spec.workers,
            notebook={"path": spec.notebook, "parameters": dict(spec.parameters)} if spec.notebook else None,
            ray=ray_evidence(spec) if spec.kind == "ray" else None,
        )
        self._env_values[job_id] = dict(spec.env)  # values: hub-private file, never in the record
        live = self._live.setdefault(job_id, _Live())
        live.demand = demand
        att = R.Attempt(number=1, queued=time.time())
        rec.attempts.append(att)
        try:
            self._enqueue(rec, att)  # refused (never fits the team) before any record exists
        except QueueRefused as e:
            self._live.pop(job_id, None)
            raise ChoiceError(409, str(e)) from None
        self.jobs[job_id] = rec
        self.store.save_env(job_id, spec.env)
        self.store.save(rec)
        log.info("Job %s of %s queued (%s, team %s, priority %s)", job_id, user.name, profile.slug, team.name, pclass)
        self._start_task(rec, first_ticket=True)
        self._ensure_reclaimer()
        return rec

    def _ray_command(self, job_id: str, spec: JobSpec, profile: Profile, flavor: str | None, demand: dict) -> list[str]:
        """A Ray job's command: gpuhub's Ray launcher with the entrypoint. All of its GPUs
        (``workers`` times the profile's) go to one process tree in one cgroup: with one
        worker the head holds them; with N, N Ray worker nodes each get the profile's."""
        virtual = bool(flavor) and all(d.virtual for d in self.broker.devices.devices if d.flavor == flavor)
        return ray_node_argv(
            gpus=profile.gpu_count * spec.workers,
            workers=spec.workers if spec.workers > 1 else 0,
            cpus=max(1, int(demand.get("cpu", 1000)) // 1000),
            name=job_id,
            virtual=virtual,
            entrypoint=spec.ray_entrypoint,
            runtime_env=spec.runtime_env.for_ray() if spec.runtime_env else {},
        )

    def _enqueue(self, rec: R.JobRecord, att: R.Attempt) -> Ticket:
        live = self._live.setdefault(rec.id, _Live())
        if not live.demand:
            profile = self.policy.profile(rec.profile["slug"])
            if profile is None:
                raise QueueRefused(f"profile {rec.profile['slug']!r} is no longer in the policy")
            live.demand = _times(demand_for(self.policy, profile), rec.workers)
        ticket = Ticket(
            key=KEY_PREFIX + rec.id,
            user=rec.user,
            team=rec.team,
            profile=rec.profile["slug"],
            demand=dict(live.demand),
            priority=rec.priority,
            created=att.queued,
        )
        queue = self.broker.queue
        # Seam: jobs keep their own records across restarts; the queue journal is for
        # servers (its entries are re-spawned through the REST API), so a job's ticket is
        # submitted with the journal detached for this one synchronous call.
        journal = getattr(queue, "journal", None)
        queue.journal = None
        try:
            queue.submit(ticket)
        finally:
            queue.journal = journal
        live.ticket = ticket
        return ticket

    # -- the attempts ----------------------------------------------------------------------
    def _start_task(self, rec: R.JobRecord, first_ticket: bool = False) -> None:
        live = self._live.setdefault(rec.id, _Live())
        live.task = asyncio.ensure_future(self._drive(rec, first_ticket))

    async def _drive(self, rec: R.JobRecord, first_ticket: bool) -> None:
        live = self._live[rec.id]
        try:
            while True:
                att = rec.current
                if att is None or att.finished is not None:
                    att = R.Attempt(number=len(rec.attempts) + 1, queued=time.time())
                    rec.attempts.append(att)
                if not first_ticket:
                    try:
                        self._enqueue(rec, att)
                    except QueueRefused as e:
                        self._end_attempt(rec, att, FAILED, None, f"cannot queue: {e}")
                        self._finish(rec, R.FAILED, str(e))
                        return
                first_ticket = False
                rec.state, rec.message = R.QUEUED, ""
                self.store.save(rec)
                assert live.ticket is not None  # _enqueue set it: above, or in submit for the first attempt
                try:
                    adm = await live.ticket.future
                except asyncio.CancelledError:
                    if live.stop_reason == CANCELLED_REASON:
                        self._end_attempt(rec, att, CANCELLED_REASON, None, live.stop_message)
                        self._finish(rec, R.CANCELLED, live.stop_message)
                        return
                    raise
                att.admitted = time.time()
                att.devices = list(adm.devices)
                try:
                    reason, code, message = await self._run_attempt(rec, att, live)
                finally:
                    self.broker.queue.release(KEY_PREFIX + rec.id)  # its GPUs go to the next in line
                if live.stopping is not None:
                    # The process is gone, but the hub's stop may still be removing the attempt's
                    # cgroup, whose name the next attempt reuses: admitted at once on a healthy GPU,
                    # that attempt found its cgroup removed under it (exit 126).
                    stopping, live.stopping = live.stopping, None
                    await asyncio.wait([stopping])
                self._end_attempt(rec, att, reason, code, message)
                if reason == "succeeded":
                    self._finish(rec, R.SUCCEEDED, "")
                    return
                if reason == CANCELLED_REASON:
                    self._finish(rec, R.CANCELLED, message)
                    return
                retryable = reason == GPU_FAILED or (reason != TIME_LIMIT and self._retryable(rec, reason, code))
                # The platform's doing (a reclaim, a hub restart, a GPU gone bad) re-queues
                # without using a retry, as Kueue's preemption does not count against a
                # Job's backoffLimit.
                platform = reason in PLATFORM_REASONS
                used = sum(1 for a in rec.attempts if a.reason not in PLATFORM_REASONS)
                if retryable and (platform or used <= rec.retries["limit"]):
                    log.info("Job %s attempt %d ended (%s); queued again", rec.id, att.number, reason)
                    continue
                if retryable:
                    message += f" No retries left ({rec.retries['limit']} allowed)."
                self._finish(rec, R.FAILED, message)
                return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a job must end visibly, never hang
            log.exception("Job %s failed inside the hub", rec.id)
            att = rec.current
            if att is not None and att.finished is None:
                self._end_attempt(rec, att, FAILED, None, f"gpuhub could not run it: {e}")
            self._finish(rec, R.FAILED, f"gpuhub could not run it: {e}")
        finally:
            self.broker.queue.cancel(KEY_PREFIX + rec.id)
            self.broker.queue.release(KEY_PREFIX + rec.id)

    @staticmethod
    def _retryable(rec: R.JobRecord, reason: str, code: int | None) -> bool:
        reasons = rec.retries.get("reasons", [])
        return reason in reasons or (reason == FAILED and code is not None and code in reasons)

    def _launcher(
        self, rec: R.JobRecord, att: R.Attempt, env: dict, limits: tuple[int | None, int | None], worker: int = 0
    ) -> JobProcess:
        devices = _worker_devices(att.devices, _processes(rec), worker)
        nodes = self.broker.devices.nodes_for(devices) if devices else []
        return JobProcess(
            user_name=rec.user,
            job_id=rec.id,
            argv=rec.command,
            env=env,
            devices=devices,
            device_nodes=nodes,
            limits=limits,
            worker=worker,
            scope=(self.policy, rec.team, rec.profile["slug"]),
            config=launcher_config(self.config),
        )

    def _rendezvous(self, rec: R.JobRecord) -> dict:
        """MASTER_ADDR/PORT of a multi-worker attempt: the user's own loopback (all of a user's
        processes share one network namespace, which no other user reaches), a port no other
        running multi-worker job of this user has."""
        taken = {
            r.current.rendezvous["master_port"]
            for r in self.jobs.values()
            if r.id != rec.id and r.user == rec.user and r.state == R.RUNNING and r.current and r.current.rendezvous
        }
        port = next(p for p in range(self.rendezvous_port, self.rendezvous_port + 1000) if p not in taken)
        return {"master_addr": "127.0.0.1", "master_port": port, "world_size": rec.workers}

    def _job_env(self, rec: R.JobRecord, att: R.Attempt, home: str) -> dict[str, str]:
        policy = self.policy
        profile = policy.profile(rec.profile["slug"])
        env = dict(profile.env if profile else {})
        if rec.id not in self._env_values:
            self._env_values[rec.id] = self.store.load_env(rec.id)
        env.update(self._env_values[rec.id])
        workdir = os.path.join(home, rec.working_dir) if rec.working_dir else home
        ckpt = rec.checkpoint_dir if rec.checkpoint_dir.startswith("/") else os.path.join(home, rec.checkpoint_dir)
        tags = {"gpuhub.job.id": rec.id, "gpuhub.job.attempt": str(att.number)}
        if rec.name:
            tags["gpuhub.job.name"] = rec.name
        env.update(
            GPUHUB_USER=rec.user,
            GPUHUB_TEAM=rec.team,
            GPUHUB_PROFILE=rec.profile["slug"],
            GPUHUB_IMAGE="",
            GPUHUB_RUNTIME=one_machine_runtime(),
            GPUHUB_GPU_COUNT=str(rec.profile["gpu"]["count"]),
            GPUHUB_GPU_FLAVOR=rec.profile["gpu"]["flavor"] or "",
            GPUHUB_SERVER_NAME="",
            GPUHUB_JOB_ID=rec.id,
            GPUHUB_ATTEMPT=str(att.number),
            GPUHUB_CHECKPOINT_DIR=ckpt,
            GPUHUB_WORKDIR=workdir,
            JUPYTERHUB_USER=rec.user,
            MLFLOW_RUN_CONTEXT=json.dumps(tags),
        )
        if rec.image_digest:
            env["GPUHUB_IMAGE_DIGEST"] = rec.image_digest
        if rec.experiment:
            env["MLFLOW_EXPERIMENT_NAME"] = rec.experiment
        if self.hub_api_url:
            env["JUPYTERHUB_API_URL"] = self.hub_api_url
        if rec.notebook:
            env["GPUHUB_NOTEBOOK_PARAMETERS"] = json.dumps(rec.notebook.get("parameters") or {})
        if rec.kind == "ray":
            # The cluster's token: its RPC services and dashboard refuse a caller without it
            # (the wall around the user keeps everyone else off every port anyway).
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token(self.data_dir, rec.user))
        return env

    async def _run_attempt(self, rec: R.JobRecord, att: R.Attempt, live: _Live) -> tuple[str, int | None, str]:
        limits = (rec.profile["cpu"], rec.profile["memory"])
        launcher = self._launcher(rec, att, {}, limits)
        env = self._job_env(rec, att, launcher.visible_home)
        logdir = self.store.log_dir(rec.id)
        att.log = str(logdir / f"attempt-{att.number}.log")
        logfd = os.open(att.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        gpus = ", ".join(att.devices) if att.devices else "no GPU"
        os.write(logfd, f"[gpuhub] {rec.id} attempt {att.number} admitted with {gpus} at {_ts(att.admitted)}\n".encode())
        rfd, wfd = os.pipe()
        env["GPUHUB_EVIDENCE_FD"] = str(wfd)
        pass_fds: tuple[int, ...] = (wfd,)
        nbfd = None
        if rec.notebook:
            # The executed notebook comes back through a descriptor of a file the hub made
            # beside the log: the job writes it, the user's account can open it by no path.
            att.notebook = str(logdir / f"attempt-{att.number}.ipynb")
            nbfd = os.open(att.notebook, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            env["GPUHUB_NOTEBOOK_FD"] = str(nbfd)
            pass_fds = (wfd, nbfd)
        configured = {k: (v(launcher) if callable(v) else v) for k, v in launcher.environment.items()}
        token = mlflow_runs.new_token(rec, env, configured)
        others: list[JobProcess] = []
        if _processes(rec) > 1:
            att.rendezvous = self._rendezvous(rec)
            rdv = att.rendezvous
            for rank in range(rec.workers):
                worker = launcher if rank == 0 else self._launcher(rec, att, {}, limits, worker=rank)
                worker_env = dict(env) if rank == 0 else {k: v for k, v in env.items() if k != "GPUHUB_EVIDENCE_FD"}
                worker_env.update(
                    MASTER_ADDR=rdv["master_addr"],
                    MASTER_PORT=str(rdv["master_port"]),
                    WORLD_SIZE=str(rec.workers),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(rec.workers),
                    GPUHUB_WORKER=str(rank),
                )
                worker.job_env = worker_env
                if rank:
                    worker.popen_kwargs = {"stdout": logfd, "stderr": logfd}
                    others.append(worker)
            env = launcher.job_env
            devs = "; ".join(
                f"rank {r}: {', '.join(_worker_devices(att.devices, rec.workers, r)) or 'no GPU'}" for r in range(rec.workers)
            )
            os.write(logfd, f"[gpuhub] {rec.workers} workers, rendezvous 127.0.0.1:{rdv['master_port']} ({devs})\n".encode())
        launcher.job_env = env
        launcher.popen_kwargs = {"stdout": logfd, "stderr": logfd, "pass_fds": pass_fds}
        live.launcher, live.stop_reason, live.stop_message = launcher, None, ""
        live.others = []
        evidence = asyncio.get_running_loop().create_future()
        try:
            await launcher.start()
            # All of them or none: a worker that cannot start ends the ones already started.
            for worker in others:
                live.others.append(worker)
                await worker.start()
        except Exception as e:  # noqa: BLE001
            os.close(rfd)
            os.write(logfd, f"[gpuhub] could not start: {e}\n".encode())
            mlflow_runs.revoke(token)
            for started in [launcher, *live.others]:
                if started.proc is not None:
                    await started.stop(now=True)
            live.launcher, live.others = None, []
            return FAILED, None, f"could not start: {e}"
        finally:
            os.close(wfd)
            os.close(logfd)
            if nbfd is not None:
                os.close(nbfd)
        self._read_evidence(rfd, evidence)
        if live.stop_reason:  # cancelled or preempted while it was starting
            for worker in [launcher, *live.others]:
                await worker.stop(now=True)
        proc = launcher.proc
        att.started, att.pid, att.account = time.time(), proc.pid, launcher.account_name if launcher.isolated else None
        att.start_time = process_start_time(proc.pid)  # identity for the restart sweep
        att.worker_pids = [[w.proc.pid, process_start_time(w.proc.pid)] for w in live.others]
        rec.env_names = sorted(launcher.get_env())
        rec.state, rec.message = R.RUNNING, ""
        self.store.save(rec)
        live.exited = _exit_future(proc.pid) if not live.others else asyncio.ensure_future(self._workers_exited(rec, live))
        remaining = None
        if rec.time_limit:
            used = sum(a.running_seconds() for a in rec.attempts if a is not att)
            remaining = max(0.0, rec.time_limit - used)
        try:
            # asyncio.timeout, not wait_for: in 3.11 wait_for returns a done result to a cancel
            # (the hub shutting down) instead of raising it
            async with asyncio.timeout(remaining):
                await asyncio.shield(live.exited)
        except TimeoutError:
            assert rec.time_limit is not None  # the only deadline (remaining) comes from it
            await self._stop(rec.id, TIME_LIMIT, f"stopped: it reached its time limit of {format_duration(rec.time_limit)}")
            await live.exited
        code = proc.poll()
        while code is None:  # a wake-up is not an exit: wait again, never block the loop in wait()
            await _exit_future(proc.pid)
            code = proc.poll()
        await launcher.end_after_exit()  # records an OOM kill; sweeps its cgroup beside the loop
        worker_note = ""
        for rank, worker in enumerate(live.others, start=1):
            wcode = worker.proc.poll()
            while wcode is None:
                await _exit_future(worker.proc.pid)
                wcode = worker.proc.poll()
            await worker.end_after_exit()
            if worker.stop_reason and not launcher.stop_reason:
                launcher.stop_reason = worker.stop_reason  # one worker's OOM is the attempt's
            if code == 0 and wcode != 0:
                code, worker_note = wcode, f" (worker rank {rank})"
        if live.first_failure is not None:  # the one that failed first; the others were stopped for it
            rank, code = live.first_failure
            worker_note = f" (worker rank {rank}; the other workers were stopped)"
            live.first_failure = None
        try:
            async with asyncio.timeout(2):
                ev = await evidence
            att.git = _git_evidence(ev.get("git") if isinstance(ev, dict) else None)
        except (TimeoutError, ValueError):
            pass
        failed_gpus = self._failed_gpus(att)
        if live.stop_reason:
            reason, message = live.stop_reason, live.stop_message
        elif failed_gpus and code != 0:  # it died before the monitor's stop reached it
            reason, message = GPU_FAILED, self.gpu_failed_message(failed_gpus)
        elif launcher.stop_reason:  # the launcher saw the cgroup's OOM kill
            reason = OOM
            message = (
                f"stopped: it used more than its memory limit of {format_memory(rec.profile['memory'])} "
                f"(profile {rec.profile['slug']!r}); choose a profile with more memory"
            )
        elif code == 0:
            reason, message = "succeeded", "exit code 0"
        elif code < 0:
            reason, message = FAILED, f"killed by signal {-code}{worker_note}"
        else:
            reason, message = FAILED, f"exit code {code}{worker_note}"
        if reason == FAILED and launcher.process_limit_note:
            message += f"; {launcher.process_limit_note}"
        if att.notebook:
            # Read back beside the loop: the user wrote it (bounded: jobs.notebook.load_bounded).
            att.failed_cell = await asyncio.to_thread(lambda: notebook_failed_cell(notebook_load(att.notebook)))
            if reason == FAILED and att.failed_cell:
                fc = att.failed_cell
                message = f"cell {fc['cell']} failed: {fc['ename']}: {fc['evalue']}"[:500] + f" ({message})"
        await mlflow_runs.collect_runs(rec, att, {**configured, **env}, token, outcome=reason)
        mlflow_runs.revoke(token)
        with open(att.log, "a") as f:  # noqa: ASYNC230 (one line appended to a local file)
            f.write(f"[gpuhub] attempt {att.number} ended at {_ts(time.time())}: {reason} ({message})\n")
        live.launcher, live.others = None, []
        return reason, code if code >= 0 else None, message

    async def _workers_exited(self, rec: R.JobRecord, live: _Live) -> None:
        """Every worker has exited. Ended together: when one exits with an error, the others
        are stopped (a distributed step cannot finish without it)."""
        workers = [w for w in [live.launcher, *live.others] if w is not None and w.proc is not None]
        pending = {_exit_future(w.proc.pid): w for w in workers}
        stopped = False
        while pending:
            done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                worker = pending.pop(fut)
                code = worker.proc.poll()
                if code is None:  # a wake-up is not an exit
                    pending[_exit_future(worker.proc.pid)] = worker
                elif code != 0 and not stopped and live.stop_reason is None:
                    stopped = True
                    live.first_failure = (worker.worker, code)
                    log.info("Job %s: worker rank %d exited with %s; stopping the others", rec.id, worker.worker, code)
                    for other in pending.values():
                        asyncio.ensure_future(other.stop(now=True))

    def _read_evidence(self, fd: int, fut: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        buf = bytearray()

        def readable():
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if chunk and len(buf) < 65536:
                buf.extend(chunk)
                return
            loop.remove_reader(fd)
            os.close(fd)
            if not fut.done():
                try:
                    # written by the job's first step, as the user: bounded like any user input
                    fut.set_result(
                        loads_json(bytes(buf).split(b"\n", 1)[0], what="the job's evidence", max_bytes=65536, empty={})
                    )
                except ValueError as e:  # (InputRefused is one)
                    fut.set_exception(e)

        loop.add_reader(fd, readable)

    def _end_attempt(self, rec: R.JobRecord, att: R.Attempt, reason: str, code: int | None, message: str) -> None:
        att.finished = time.time()
        att.reason, att.exit_code, att.message = reason, code, message
        self.store.save(rec)

    def _finish(self, rec: R.JobRecord, state: str, message: str) -> None:
        rec.state, rec.message, rec.finished = state, message.strip(), time.time()
        self.store.save(rec)
        log.info("Job %s %s after %d attempt(s): %s", rec.id, state, len(rec.attempts), message)

    # -- stopping --------------------------------------------------------------------------
    async def _stop(self, job_id: str, reason: str, message: str) -> None:
        live = self._live.get(job_id)
        if live is None:
            return
        live.stop_reason, live.stop_message = reason, message
        launcher = live.launcher
        if launcher is not None and launcher.proc is not None:
            # SIGTERM, then SIGKILL; the whole cgroup goes; every worker at once
            await asyncio.gather(*(w.stop(now=True) for w in [launcher, *live.others] if w.proc is not None))
            if live.exited is not None:
                await live.exited

    async def cancel(self, job_id: str) -> R.JobRecord:
        """Leave the queue or stop the attempt; its GPUs are free when this returns."""
        rec = self.jobs[job_id]
        if rec.state in R.FINAL:
            return rec
        live = self._live.get(job_id)
        message = "cancelled by its owner or an admin"
        if live is not None:
            live.stop_reason, live.stop_message = CANCELLED_REASON, message
            if self.broker.queue.cancel(KEY_PREFIX + job_id):
                pass  # the task sees its ticket cancelled
            else:
                await self._stop(job_id, CANCELLED_REASON, message)
            if live.task is not None:
                await asyncio.wait([live.task], timeout=30)
        return rec

    def preempt(self, job_id: str, message: str) -> bool:
        """Stop a running job now and re-queue it (a cohort reclaim: culling/reclaimer.py)."""
        live = self._live.get(job_id)
        if live is None or live.launcher is None or live.stop_reason is not None:
            return False
        log.info("Preempting job %s: %s", job_id, message)
        usage.note_end(KEY_PREFIX + job_id, "reclaimed")
        live.stopping = asyncio.ensure_future(self._stop(job_id, PREEMPTED, message))
        return True

    def _failed_gpus(self, att: R.Attempt) -> list[str]:
        """The attempt's GPUs that went bad (a bad GPU is never handed out: it went bad while held)."""
        book = self.broker.devices.health
        return [f"{d} ({book.of(d).reason})" for d in att.devices if book.of(d).state == BAD]

    @staticmethod
    def gpu_failed_message(gpus: list[str]) -> str:
        return (
            f"its GPU went out of service: {', '.join(gpus)}; queued again to resume from its checkpoint "
            "on a healthy GPU (not counted against its retries)"
        )

    def gpu_failed(self, job_id: str, gpus: list[str]) -> bool:
        """GPUs this running job holds went bad (local/gpu_health.py; 'id (why)' each): stop
        the attempt as ``gpu-failed``; ``_drive`` re-queues it without charging a retry."""
        live = self._live.get(job_id)
        if live is None or live.launcher is None or live.stop_reason is not None:
            return False
        message = self.gpu_failed_message(gpus)
        log.warning("Job %s: %s", job_id, message)
        usage.note_end(KEY_PREFIX + job_id, "crashed")  # history's word (usage/history.py END_REASONS)
        live.stopping = asyncio.ensure_future(self._stop(job_id, GPU_FAILED, message))
        return True

    # -- interactive servers reclaim their team's GPUs ------------------------------------------
    def _ensure_reclaimer(self) -> None:
        if self._reclaimer is None or self._reclaimer.done():
            self._reclaimer = asyncio.ensure_future(self._reclaim_loop())

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reclaim_interval)
            if not any(l.launcher is not None for l in self._live.values()):
                continue
            try:
                for job_id, message in self.victims():
                    log.info("Preempting job %s: %s", job_id, message)
                    usage.note_end(KEY_PREFIX + job_id, "reclaimed")  # usage history: why it ended
                    stop = asyncio.ensure_future(self._stop(job_id, PREEMPTED, message))
                    if job_id in self._live:
                        self._live[job_id].stopping = stop
            except Exception:  # noqa: BLE001
                log.exception("reclaim check failed")

    def victims(self) -> list[tuple[str, str]]:
        """Jobs to stop so that waiting interactive servers fit (same team, priority ≤ theirs)."""
        policy = self.policy
        queue = self.broker.queue
        running = [
            (jid, self.jobs[jid], live)
            for jid, live in self._live.items()
            if live.launcher is not None and live.stop_reason is None and jid in self.jobs
        ]
        if not running:
            return []
        usage = queue.usage()
        chosen: list[tuple[str, str]] = []
        taken: set[str] = set()
        # Fair share's minimum runtime (Slurm's PreemptExemptTime): a job younger than that stays.
        fs = policy.fair
        min_runtime = fs.min_runtime if fs is not None else 0.0
        young_before = time.time() - min_runtime
        if min_runtime > 0:
            running = [r for r in running if ((r[1].current.started or 0) if r[1].current else 0) <= young_before]
        for ticket in sorted(queue.waiting, key=Ticket.sort_key):
            if ticket.key.startswith(KEY_PREFIX) or ticket.restored:
                continue
            team = _team(policy, ticket.team)
            if team is None:
                continue
            gpu_keys = [k for k in ticket.demand if k.startswith("gpu/")]
            if not gpu_keys:
                continue
            if check_fit(policy, usage, team, ticket.demand).fits and not self.broker.devices.shortage(ticket.demand):
                continue  # it will be admitted anyway
            pool = sorted(
                (
                    r
                    for r in running
                    if r[1].team == team.name
                    and r[1].priority <= ticket.priority
                    and r[0] not in taken
                    and any(k in r[2].demand for k in gpu_keys)
                ),
                key=lambda r: (r[1].priority, -_started(r[1])),
            )
            trial = {t: dict(u) for t, u in usage.items()}
            freed: dict[str, int] = {}
            picks = []
            for jid, rec, live in pool:
                add_usage(trial, rec.team, live.demand, -1)
                for k in gpu_keys:
                    freed[k] = freed.get(k, 0) + live.demand.get(k, 0)
                picks.append(jid)
                devices_ok = all(
                    len(self.broker.devices.free_devices(k[4:])) + freed.get(k, 0) >= ticket.demand[k] for k in gpu_keys
                )
                if check_fit(policy, trial, team, ticket.demand).fits and devices_ok:
                    label = team.label
                    wanted = ", ".join(describe(k, ticket.demand[k], policy) for k in gpu_keys)
                    for p in picks:
                        taken.add(p)
                        chosen.append((p, f"preempted: an interactive server in {label} needed {wanted}"))
                    usage = trial
                    break
        return chosen

    # -- reading -----------------------------------------------------------------------------
    def status_line(self, rec: R.JobRecord) -> str:
        """The state word first, then where it stands, in the spawn page's words."""
        if rec.state == R.QUEUED:
            live = self._live.get(rec.id)
            st = live.ticket.status if live and live.ticket else None
            if st is not None:
                reason = st.reason[0].lower() + st.reason[1:] if st.reason else ""
                team = _team(self.policy, rec.team)
                label = team.label if team is not None else rec.team
                line = f"queued: position {st.position} of {st.waiting_in_team} in {label}'s queue; this job {reason}."
                return f"{line} {st.fair}." if getattr(st, "fair", "") else line
            return "queued: waiting for the scheduler."
        if rec.state == R.RUNNING:
            att = rec.current
            gpus = ", ".join(att.devices) if att and att.devices else "no GPU"
            return f"running: attempt {att.number if att else '?'} since {_ts(att.started if att else None)} with {gpus}."
        att = rec.current
        detail = rec.message or (att.message if att else "")
        return f"{rec.state}: {detail}" if detail else rec.state

    def view(self, rec: R.JobRecord) -> dict:
        data = rec.to_dict()
        data["status"] = self.status_line(rec)
        for a in data["attempts"]:
            a.pop("pid", None)
        return data

    def log_files(self, rec: R.JobRecord) -> list[Path]:
        return [Path(a.log) for a in rec.attempts if a.log]


def _processes(rec: R.JobRecord) -> int:
    """Processes the hub starts per attempt: one per worker; one for a Ray job, whose
    launcher starts the cluster's nodes itself (in one cgroup with all its GPUs)."""
    return 1 if rec.kind == "ray" else max(1, rec.workers)


def _times(demand: dict, n: int) -> dict:
    """The demand of ``n`` workers of one profile: admitted as one request, all or nothing."""
    return {k: v * n for k, v in demand.items()} if n > 1 else dict(demand)


def _worker_devices(devices: list[str], workers: int, rank: int) -> list[str]:
    """Rank ``rank``'s share of an attempt's devices (each worker the profile's count)."""
    if workers <= 1:
        return list(devices)
    per = len(devices) // workers
    return list(devices[rank * per : (rank + 1) * per])


def _exit_future(pid: int) -> asyncio.Future:
    """Resolves when ``pid`` exits (pidfd: no polling)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fut.set_result(None)
        return fut

    def exited():
        loop.remove_reader(fd)
        os.close(fd)
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, exited)
    return fut


def _started(rec: R.JobRecord) -> float:
    """When the job's current attempt started (0: none has)."""
    att = rec.current
    return (att.started if att is not None else None) or 0


def _git_evidence(git) -> dict | None:
    """Only the expected shape of what the job's first step reported (it runs as the user)."""
    import re

    if not isinstance(git, dict) or not isinstance(git.get("commit"), str) or not re.fullmatch(r"[0-9a-f]{40,64}", git["commit"]):
        return None
    branch = git.get("branch")
    if not isinstance(branch, str):
        branch = ""
    return {"commit": git["commit"], "dirty": bool(git.get("dirty")), "branch": branch[:200]}


def _team(policy: Policy, name: str):
    return next((t for t in policy.teams if t.name == name), None)
