"""What both job backends share: the time-limit reason, the policy's hash kept with each
job, and the priority a job runs at (one machine: ``local.job_manager``; Kubernetes:
``kube.job_manager``)."""

from __future__ import annotations

import hashlib
import time

from ..policy.access import Choice, ChoiceError
from ..policy.model import Policy
from .spec import JobSpec

TIME_LIMIT = "time-limit"


def policy_hash(policy: Policy) -> str:
    """A stable hash of the policy in force (its validated content, not the file's bytes)."""
    return hashlib.sha256(policy.model_dump_json(by_alias=True).encode()).hexdigest()


def job_priority(policy: Policy, choice: Choice) -> tuple[str | None, int]:
    name = choice.team.job_priority or choice.priority_class
    return name, policy.priority_value(name)


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"


def check_ray_job(policy: Policy, spec: JobSpec) -> None:
    """The policy's ``ray:`` section applies to a Ray job's cluster as to ``gpuhub ray up``'s."""
    if not policy.ray.enabled:
        raise ChoiceError(403, "Ray jobs are not enabled on this hub (the policy's ray.enabled is false).")
    if spec.workers > 1 and spec.workers > policy.ray.max_workers:
        raise ChoiceError(
            403,
            f"A Ray job's cluster may have at most {policy.ray.max_workers} workers on this hub "
            f"(the policy's ray.maxWorkers); the job file asks for {spec.workers}.",
        )


def ray_evidence(spec: JobSpec) -> dict:
    """What a Ray job ran, for its record: the entrypoint and runtime environment as given."""
    return {
        "entrypoint": spec.ray_entrypoint,
        "runtime_env": spec.runtime_env.for_ray() if spec.runtime_env else {},
        "workers": spec.workers if spec.workers > 1 else 0,
    }
