"""The application object of a hub (``hub.context.GpuHubApp``), made here, once per hub config.

``app_of(c)`` finds it in ``c.JupyterHub.tornado_settings["gpuhub"]`` or puts a new one there;
every ``configure_*`` that registers a handler calls it, so the one-machine config and the
chart's ``hub.extraConfig`` reach the same object whichever runs first. Its backend choice:

- admission view: the Kueue ledger once ``wiring.kube.configure_ledger`` has created it, else
  the one-machine broker;
- jobs and Ray: the Kubernetes managers when the hub spawns with ``KueueSpawner``, else one
  machine's. (Which managers are *enabled* is the handlers' registration: ``wiring.jobs``,
  ``wiring.ray``.)
"""

from __future__ import annotations

from jupyterhub.app import JupyterHub

from ..hub.context import SETTINGS_KEY, GpuHubApp
from ..kube.ledger import KueueLedger
from ..local.broker import LocalBroker

try:
    from ..kube.spawner import KueueSpawner
except ImportError:  # lazy: heavy optional dependency (kubespawner, only on Kubernetes hubs)
    KueueSpawner = None  # type: ignore[assignment,misc]


def admission_view(config=None):
    """The hub's admission view: Kueue's, mirrored, once the ledger exists; else the broker's."""
    if KueueLedger.initialized():  # wiring.kube.configure_ledger created it at hub start
        return KueueLedger.instance()
    return LocalBroker.instance(config=config)


def _on_kubernetes() -> bool:
    return JupyterHub.initialized() and KueueSpawner is not None and issubclass(JupyterHub.instance().spawner_class, KueueSpawner)


def jobs_manager(config=None):
    """The jobs backend: Kueue's when the hub spawns with KueueSpawner, else one machine's."""
    if _on_kubernetes():
        from ..kube.job_manager import KubeJobManager

        return KubeJobManager.instance(config=config)
    from ..local.job_manager import JobManager

    return JobManager.instance(config=config)


def ray_manager(config=None):
    """The Ray backend: KubeRay RayClusters through Kueue when the hub spawns with KueueSpawner
    (kube/ray_manager.py, docs/ray-kubernetes.md), else one machine's clusters."""
    if _on_kubernetes():
        from ..kube.ray_manager import KubeRayManager

        return KubeRayManager.instance(config)
    from ..local.ray_manager import LocalRayManager

    return LocalRayManager.instance(config)


def backend_changes(current, policy) -> list | None:
    """On Kubernetes (the ledger exists), the Kueue objects a policy edit changes; else None."""
    if not KueueLedger.initialized():
        return None
    from ..kube.kueue_diff import kueue_changes

    return list(kueue_changes(current, policy))


def app_of(c) -> GpuHubApp:
    """This hub config's application object (made and put in ``tornado_settings`` at first ask)."""
    settings = dict(c.JupyterHub.tornado_settings) if "tornado_settings" in c.JupyterHub else {}
    app = settings.get(SETTINGS_KEY)
    if app is None:
        app = settings[SETTINGS_KEY] = GpuHubApp(
            admission=admission_view, jobs=jobs_manager, ray=ray_manager, backend_changes=backend_changes
        )
        c.JupyterHub.tornado_settings = settings
    return app
