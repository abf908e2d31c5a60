"""Wire Ray clusters into a hub (docs/ray.md): the API and the dashboard proxy, and this
hub's backend, started with the hub. Access rides on the jobs scopes (``wiring.jobs``):
a Ray cluster is a job of the user's."""

from __future__ import annotations

from ..hub.ray_api import handlers
from ..local.ray_manager import LocalRayManager
from ..policy.scopes import merged_setting
from ..rayclusters import provide_manager
from .startup import when_started


def configure_ray(c) -> None:
    c.JupyterHub.extra_handlers = merged_setting(c.JupyterHub, "extra_handlers", []) + list(handlers)
    when_started(lambda app: LocalRayManager.instance(app.config).recover())


def _current_manager(config):
    """One machine's clusters (Kubernetes: kube.ray_manager, wired here when it exists)."""
    return LocalRayManager.instance(config)


provide_manager(_current_manager)
