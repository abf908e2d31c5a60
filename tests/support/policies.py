"""Policies that several test modules share, built here once (issue 45: one of each).

The job tests (``test_jobs``, ``test_notebook_jobs``, ``test_job_workers``, ``test_ray_jobs``,
``test_browser_run_as_job``) all need the same frame: one GPU flavor of virtual GPUs, the two
priority classes a job and a server queue at, and Vision Lab, whose servers are interactive and
whose jobs are batch. What each module varies (its second team, its profiles, a ``ray:``
section, the queue timeout) it passes in as YAML, indented as it stands in the policy.
"""

from __future__ import annotations


def jobs_policy(
    *,
    profiles: str,
    vision_gpus: int = 1,
    virtual: int | None = None,
    teams: str = "",
    extra: str = "",
    queue_timeout: str = "5m",
) -> str:
    """The job tests' policy: ``virtual`` GPUs (``vision_gpus`` unless said), Vision Lab with
    ``vision_gpus`` of them and as many per user, then ``teams`` (more team items), ``profiles``
    (the profile items) and ``extra`` (more top-level sections)."""
    return f"""\
flavors:
  - name: gpu
    displayName: Tesla
    local: {{virtual: {vision_gpus if virtual is None else virtual}}}
priorityClasses:
  - {{name: interactive, value: 1000}}
  - {{name: batch, value: 100}}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    jobPriority: batch
    quota: {{gpus: {{gpu: {vision_gpus}}}}}
    perUser: {{maxGPUs: {vision_gpus}}}
{teams}profiles:
{profiles}{extra}defaults:
  queueTimeout: {queue_timeout}
"""
