"""Wire the Kubernetes backend into a hub: mirror Kueue's Workloads as the hub's admission
view (``hub.extraConfig`` in helm-values/values.yaml calls ``configure_ledger``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from jupyterhub.app import JupyterHub

from ..kube.capacity import CapacityKeeper
from ..kube.ledger import KueueLedger
from ..kube.spawner import KueueSpawner
from .app import app_of  # the ledger provides the admission view once created
from .startup import when_started

log = logging.getLogger("JupyterHub.gpuhub.ledger")


def configure_ledger(c) -> None:
    """Mirror Kueue's Workloads in the hub (Kubernetes hubs: ``hub.extraConfig`` calls this).

    The ledger is created as soon as the hub's loop runs, so pages and usage read the
    Kubernetes view from the first request; it starts reading the reflectors once the
    hub has re-registered its servers.
    """
    app = app_of(c)
    app.delete_user_queues = KueueSpawner.delete_user_queues  # off-boarding's "queues" step
    try:
        asyncio.get_running_loop().call_soon(_create)  # the config file has been read by then
    except RuntimeError:
        return  # config read outside a running hub (tools, chart tests)
    when_started(_watch)


def _create() -> None:
    if JupyterHub.initialized():
        KueueLedger.instance(config=JupyterHub.instance().config)


async def _watch(app) -> None:
    ledger = KueueLedger.instance(config=app.config)
    # A spawner of no user, only to reach the reflectors every spawner shares (as
    # KubeJobManager does for jobs).
    spawner = KueueSpawner(
        config=app.config,
        user=SimpleNamespace(name="gpuhub-ledger", id=0, url="/"),
        hub=app.hub,
        api_token="",
        oauth_client_id="",
        orm_spawner=SimpleNamespace(name="", server=None),
    )
    try:
        await ledger.watch(spawner)
    except Exception:  # noqa: BLE001 - spawners start it on their first start or poll instead
        log.exception("Could not start mirroring Kueue's Workloads")
    # GPUs out of service lower the designated ClusterQueues' quota (docs/gpu-health.md); the
    # spawner above has loaded the cluster's credentials. The same keeper tells the holders of
    # server pods on a node whose health taint says its GPUs failed: the hub's culling API and
    # home page read ``node_health`` of the admission view (hub/gpus_api.py), as they read the
    # one-machine monitor (``gpu_health``), and its long poll waits on it.
    if ledger.node_health is None:
        ledger.node_health = CapacityKeeper(lambda: ledger.store.current, pods=lambda: ledger.pod_view)
        ledger.node_health.start()
