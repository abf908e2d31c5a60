"""The evidence record of every job and attempt, kept in the hub's data directory.

One JSON file per job (``<data>/jobs/<id>.json``, 0600 in a 0700 directory), rewritten
atomically (temporary file, fsync, rename) at every stage change, so a hub restart or
``kill -9`` loses at most the change being written, never the record. Logs live beside
it (``<data>/jobs/<id>/attempt-<n>.log``): written by the job, readable only through the
hub's API by the job's owner and admins.

What a record holds is what a reviewer needs to say exactly what ran: who, team, the
resolved profile, the policy's hash, image and digest, the working directory's git
commit, the command, the *names* (never values) of the environment variables, devices,
each stage's timestamp, exit code and reason per attempt, where the logs are, MLflow
run ids.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from ..policy.files import write_atomically

JOB_ID = re.compile(r"^job-[0-9a-f]{10}$")

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINAL = (SUCCEEDED, FAILED, CANCELLED)


@dataclass
class Attempt:
    number: int
    queued: float
    admitted: float | None = None
    started: float | None = None
    finished: float | None = None
    devices: list[str] = field(default_factory=list)
    pid: int | None = None
    start_time: int | None = None  # the kernel's start time of pid: with it, an identity
    account: str | None = None
    exit_code: int | None = None
    reason: str | None = None  # succeeded, failed, preempted, interrupted, gpu-failed, oom, time-limit, cancelled
    message: str = ""
    log: str = ""
    git: dict | None = None  # {"commit", "dirty", "branch"} of workingDir, read as the user
    mlflow_run_ids: list[str] = field(default_factory=list)
    # A notebook job: the executed notebook beside the log (written by the job through a
    # descriptor the hub opened), and the cell that failed, read back from it.
    notebook: str = ""
    failed_cell: dict | None = None
    # Several workers: {"master_addr", "master_port", "world_size"} and each worker's pid
    # (rank 1...; rank 0 is ``pid``) with its start time, for the restart sweep.
    rendezvous: dict | None = None
    worker_pids: list[list[int | None]] = field(default_factory=list)

    def running_seconds(self, now: float | None = None) -> float:
        if self.started is None:
            return 0.0
        return max(0.0, (self.finished or now or time.time()) - self.started)


@dataclass
class JobRecord:
    id: str
    user: str
    team: str
    profile: dict  # slug, gpu count/flavor, cpu, memory as resolved at submission
    priority_class: str | None
    priority: int
    policy_sha256: str
    image: str
    image_digest: str
    command: list[str]
    working_dir: str
    checkpoint_dir: str
    env_names: list[str]
    experiment: str | None
    time_limit: float | None
    retries: dict
    spec: dict  # the validated job file (env values removed)
    name: str | None = None
    state: str = QUEUED
    message: str = ""
    submitted: float = field(default_factory=time.time)
    finished: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    backend: str = "local"
    kind: str = "command"  # or "notebook", "ray"
    workers: int = 1
    notebook: dict | None = None  # {"path": relative to home, "parameters": {...}}
    ray: dict | None = None  # kind ray: {"entrypoint", "runtime_env", "workers"} as submitted

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "JobRecord":
        data = dict(data)
        attempts = [Attempt(**a) for a in data.pop("attempts", [])]
        known = set(cls.__dataclass_fields__)
        rec = cls(**{k: v for k, v in data.items() if k in known})
        rec.attempts = attempts
        return rec


class JobStore:
    """Reads and writes records; the directory is the hub's, nobody else can list it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)

    def path(self, job_id: str) -> Path:
        if not JOB_ID.match(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.root / f"{job_id}.json"

    def log_dir(self, job_id: str) -> Path:
        d = self.root / job_id
        os.makedirs(d, mode=0o700, exist_ok=True)
        return d

    def save(self, rec: JobRecord) -> None:
        write_atomically(self.path(rec.id), json.dumps(rec.to_dict(), indent=1, sort_keys=True), 0o600)

    def save_env(self, job_id: str, env: dict[str, str]) -> None:
        """The job file's env *values*: hub-private, read only to start attempts."""
        path = self.log_dir(job_id) / "env.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)

    def load_env(self, job_id: str) -> dict[str, str]:
        try:
            return json.loads((self.root / job_id / "env.json").read_text())
        except (OSError, ValueError):
            return {}

    def load_all(self) -> list[JobRecord]:
        out = []
        for path in sorted(self.root.glob("job-*.json")):
            try:
                out.append(JobRecord.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, TypeError) as e:
                import logging

                logging.getLogger("JupyterHub.gpuhub.jobs").error("Unreadable job record %s: %s", path, e)
        return sorted(out, key=lambda r: r.submitted)
