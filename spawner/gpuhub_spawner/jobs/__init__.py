"""Batch jobs in the team's GPU queue: ``gpuhub job submit job.yaml`` (docs/jobs.md).

``spec`` (the job file, located validation), ``manager`` (queue, attempts, retries,
reclaim), ``mlflow_runs`` (an attempt's own MLflow token, the runs it logged), ``launcher`` (the one-machine server launcher, for a job), ``entry`` (first
code of an attempt, as the user), ``records`` (the evidence, 0600), ``api`` (hub API and
pages), ``cli`` (the client), ``kube`` (a suspended ``batch/v1`` Job for Kueue).
"""

from __future__ import annotations

from pathlib import Path

JOBS_SCOPE = "custom:gpuhub:jobs"
JOBS_ALL_SCOPE = "custom:gpuhub:jobs:all"


def _merged(section, name: str, default):
    return type(default)(getattr(section, name)) if name in section else default


def configure_jobs(c, data_dir) -> None:
    """Register the jobs API and pages, their scopes, and start the manager with the hub.

    Every user may submit and read their own jobs (``custom:gpuhub:jobs!user``), with
    any of their tokens and their servers' tokens (so ``gpuhub job`` works in a notebook
    terminal); admins read and cancel everyone's (``custom:gpuhub:jobs:all``, implied by
    ``admin:servers`` like gpuhub's other admin scopes).
    """
    from .api import handlers

    c.JobManager.data_dir = str(Path(data_dir).resolve())
    c.KubeJobManager.data_dir = str(Path(data_dir).resolve())
    c.JupyterHub.extra_handlers = _merged(c.JupyterHub, "extra_handlers", []) + list(handlers)
    custom = _merged(c.JupyterHub, "custom_scopes", {})
    custom[JOBS] = {"description": "Submit batch jobs and read or cancel your own."}
    custom[JOBS_ALL] = {"description": "Read and cancel everyone's batch jobs.", "subscopes": [JOBS]}
    c.JupyterHub.custom_scopes = custom
    own = f"{JOBS}!user"
    extra = _merged(c.JupyterHub, "extra_user_scopes", [])
    if own not in extra:
        extra = list(extra) + [own]
    c.JupyterHub.extra_user_scopes = extra
    from ..hub.scopes import grant_server_token

    # So `gpuhub job` works in a terminal of the server, whatever else its token carries.
    grant_server_token(c, [own])
    # JupyterHub forbids extending its own admin role: hub admins get everyone's jobs by
    # admin:servers (api.py); gpuhub-admin (admins by group, hub/scopes.py) gets jobs:all.
    roles = {r["name"]: dict(r) for r in _merged(c.JupyterHub, "load_roles", [])}
    if "gpuhub-admin" in roles:
        roles["gpuhub-admin"]["scopes"] = sorted(set(roles["gpuhub-admin"].get("scopes", [])) | {JOBS_ALL})
    c.JupyterHub.load_roles = list(roles.values())
    from ..hub.startup import when_started

    when_started(_start_with_hub)


JOBS, JOBS_ALL = JOBS_SCOPE, JOBS_ALL_SCOPE


def _start_with_hub(app) -> None:
    """Bring jobs back once the hub has re-registered running servers (their devices first)."""
    from .manager import JobManager

    manager = current_manager(app.config)
    if isinstance(manager, JobManager) and not manager.hub_api_url:
        manager.hub_api_url = app.hub.api_url
    manager.recover()


def current_manager(config):
    """The jobs backend of this hub: Kueue when it spawns with KueueSpawner, else one machine."""
    from jupyterhub.app import JupyterHub

    from .manager import JobManager

    if JupyterHub.initialized():
        try:
            from ..kube.spawner import KueueSpawner

            if issubclass(JupyterHub.instance().spawner_class, KueueSpawner):
                from .kube_backend import KubeJobManager

                return KubeJobManager.instance(config=config)
        except ImportError:
            pass
    return JobManager.instance(config=config)
