"""Wire batch jobs into a hub: the jobs API and pages, their scopes, and the manager of
this hub's backend, started with the hub (docs/jobs.md)."""

from __future__ import annotations

from pathlib import Path

from jupyterhub.app import JupyterHub

from ..hub.jobs_api import handlers
from ..jobs import JOBS, JOBS_ALL, provide_manager
from ..local.job_manager import JobManager
from ..policy.scopes import grant_server_token, merged_setting
from .startup import when_started

try:
    from ..kube.job_manager import KubeJobManager
    from ..kube.spawner import KueueSpawner

    _KUBE = True
except ImportError:  # lazy: heavy optional dependency (kubespawner, only on Kubernetes hubs)
    _KUBE = False


def configure_jobs(c, data_dir) -> None:
    """Register the jobs API and pages, their scopes, and start the manager with the hub.

    Every user may submit and read their own jobs (``custom:gpuhub:jobs!user``), with
    any of their tokens and their servers' tokens (so ``gpuhub job`` works in a notebook
    terminal); admins read and cancel everyone's (``custom:gpuhub:jobs:all``, implied by
    ``admin:servers`` like gpuhub's other admin scopes).
    """
    c.JobManager.data_dir = str(Path(data_dir).resolve())
    c.KubeJobManager.data_dir = str(Path(data_dir).resolve())
    c.JupyterHub.extra_handlers = merged_setting(c.JupyterHub, "extra_handlers", []) + list(handlers)
    custom = merged_setting(c.JupyterHub, "custom_scopes", {})
    custom[JOBS] = {"description": "Submit batch jobs and read or cancel your own."}
    custom[JOBS_ALL] = {"description": "Read and cancel everyone's batch jobs.", "subscopes": [JOBS]}
    c.JupyterHub.custom_scopes = custom
    own = f"{JOBS}!user"
    extra = merged_setting(c.JupyterHub, "extra_user_scopes", [])
    if own not in extra:
        extra = list(extra) + [own]
    c.JupyterHub.extra_user_scopes = extra
    # So `gpuhub job` works in a terminal of the server, whatever else its token carries.
    grant_server_token(c, [own])
    # JupyterHub forbids extending its own admin role: hub admins get everyone's jobs by
    # admin:servers (hub/jobs_api.py); gpuhub-admin (admins by group, policy/scopes.py) gets jobs:all.
    roles = {r["name"]: dict(r) for r in merged_setting(c.JupyterHub, "load_roles", [])}
    if "gpuhub-admin" in roles:
        roles["gpuhub-admin"]["scopes"] = sorted(set(roles["gpuhub-admin"].get("scopes", [])) | {JOBS_ALL})
    c.JupyterHub.load_roles = list(roles.values())
    when_started(_start_with_hub)


def _start_with_hub(app) -> None:
    """Bring jobs back once the hub has re-registered running servers (their devices first)."""
    manager = _current_manager(app.config)
    if isinstance(manager, JobManager) and not manager.hub_api_url:
        manager.hub_api_url = app.hub.api_url
    manager.recover()


def _current_manager(config):
    """The jobs backend of this hub: Kueue when it spawns with KueueSpawner, else one machine."""
    if JupyterHub.initialized():
        if _KUBE and issubclass(JupyterHub.instance().spawner_class, KueueSpawner):
            return KubeJobManager.instance(config=config)
    return JobManager.instance(config=config)


provide_manager(_current_manager)
