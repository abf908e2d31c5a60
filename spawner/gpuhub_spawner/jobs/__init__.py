"""Batch jobs in the team's GPU queue: ``gpuhub job submit job.yaml`` (docs/jobs.md).

What both backends share: ``spec`` (the job file, located validation), ``records`` (the
evidence, 0600), ``common`` (time limit, policy hash, priority), ``mlflow_runs`` (an
attempt's own MLflow token, the runs it logged), ``entry`` (first code of an attempt, as
the user), ``notebook`` (a notebook job's runner, as the user, and the hub's bounded reading of
the executed notebook), ``cli`` (the client). The backends run them: ``local.job_manager`` (queue,
attempts, retries, reclaim on one machine, with ``local.job_launcher``) and
``kube.job_manager`` (a suspended ``batch/v1`` Job for Kueue, ``kube.job_manifest``).
The hub API and pages are ``hub.jobs_api``; ``wiring.jobs`` wires them into a hub.
"""

from __future__ import annotations

JOBS_SCOPE = "custom:gpuhub:jobs"
JOBS_ALL_SCOPE = "custom:gpuhub:jobs:all"
JOBS, JOBS_ALL = JOBS_SCOPE, JOBS_ALL_SCOPE
