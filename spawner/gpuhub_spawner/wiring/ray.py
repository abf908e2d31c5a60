"""Wire Ray clusters into a hub (docs/ray.md): the API and the dashboard's redirect to the
owner's origin, and this hub's backend, started with the hub. Access rides on the jobs scopes
(``wiring.jobs``): a Ray cluster is a job of the user's."""

from __future__ import annotations

from jupyterhub.app import JupyterHub

from ..hub.ray_api import handlers
from ..local.ray_manager import LocalRayManager
from ..policy.scopes import merged_setting
from ..rayclusters import provide_manager
from .startup import when_started

try:
    from ..kube.ray_manager import KubeRayManager
    from ..kube.spawner import KueueSpawner

    _KUBE = True
except ImportError:  # lazy: heavy optional dependency (kubespawner, only on Kubernetes hubs)
    _KUBE = False


def configure_ray(c) -> None:
    c.JupyterHub.extra_handlers = merged_setting(c.JupyterHub, "extra_handlers", []) + list(handlers)
    # Every server's kernels speak Ray's token authentication, so a plain `ray.init()` joins the
    # user's cluster (found in their private /tmp, token in their ~/.ray/auth_token). Harmless
    # without one: Ray makes itself a token for a new local cluster.
    c.Spawner.environment = dict(merged_setting(c.Spawner, "environment", {}), RAY_AUTH_MODE="token")
    when_started(lambda app: _current_manager(app.config).recover())


def _current_manager(config):
    """This hub's Ray backend: KubeRay RayClusters through Kueue when it spawns with
    KueueSpawner (kube/ray_manager.py, docs/ray-kubernetes.md), else one machine's clusters."""
    if JupyterHub.initialized() and _KUBE and issubclass(JupyterHub.instance().spawner_class, KueueSpawner):
        return KubeRayManager.instance(config)
    return LocalRayManager.instance(config)


provide_manager(_current_manager)
