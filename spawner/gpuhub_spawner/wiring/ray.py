"""Wire Ray clusters into a hub (docs/ray.md): the API and the dashboard's redirect to the
owner's origin, and this hub's backend, started with the hub. Access rides on the jobs scopes
(``wiring.jobs``): a Ray cluster is a job of the user's."""

from __future__ import annotations

from ..hub.ray_api import handlers
from ..policy.scopes import merged_setting
from .app import app_of, ray_manager
from .startup import when_started


def configure_ray(c) -> None:
    app_of(c)  # the Ray API finds this hub's manager through it
    c.JupyterHub.extra_handlers = merged_setting(c.JupyterHub, "extra_handlers", []) + list(handlers)
    # Every server's kernels speak Ray's token authentication, so a plain `ray.init()` joins the
    # user's cluster (found in their private /tmp, token in their ~/.ray/auth_token). Harmless
    # without one: Ray makes itself a token for a new local cluster.
    c.Spawner.environment = dict(merged_setting(c.Spawner, "environment", {}), RAY_AUTH_MODE="token")
    when_started(lambda app: ray_manager(app.config).recover())
