"""What both job backends share: the time-limit reason, the policy's hash kept with each
job, and the priority a job runs at (one machine: ``local.job_manager``; Kubernetes:
``kube.job_manager``)."""

from __future__ import annotations

import hashlib
import time

from ..policy.access import Choice
from ..policy.model import Policy

TIME_LIMIT = "time-limit"


def policy_hash(policy: Policy) -> str:
    """A stable hash of the policy in force (its validated content, not the file's bytes)."""
    return hashlib.sha256(policy.model_dump_json(by_alias=True).encode()).hexdigest()


def job_priority(policy: Policy, choice: Choice) -> tuple[str | None, int]:
    name = choice.team.job_priority or choice.priority_class
    return name, policy.priority_value(name)


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"
