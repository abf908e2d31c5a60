"""Wire policy changes into a hub (issue 26): the page and API that preview, apply and roll back
the policy, and the versions store in the hub's data dir (docs/policy-changes.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from .startup import when_started


def configure_policy_changes(c, data_dir, configmap: str | None = None, key: str = "profiles.yaml") -> None:
    """``/hub/gpuhub/policy`` and ``/hub/api/gpuhub/policy``; versions in ``<data_dir>/policy-versions``
    (after ``configure_scopes``: the handlers check ``custom:gpuhub:policy``).

    ``configmap``: on Kubernetes, the name of the policy's ConfigMap in the hub's namespace.
    Applies then write the ConfigMap, and the store reads the hub's copy of it
    (``<data_dir>/policy-live/<key>``, seeded from the mounted ``c.PolicyStore.policy_file``,
    kept current by a watch): call this before anything creates the ``PolicyStore``."""
    from ..hub.policy_api import handlers, start_versions
    from .app import app_of

    app_of(c)  # the versions store and the apply lock are kept on it

    existing = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    c.JupyterHub.extra_handlers = existing + [h for h in handlers if h not in existing]
    directory = str(Path(data_dir) / "policy-versions")
    if not configmap:
        when_started(lambda app: start_versions(app, directory))
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # config read outside a running hub (tools, the chart's config tests): no mount, no volume
    from ..kube.policy_configmap import ConfigMapPolicy, PolicyMirror

    mirror = PolicyMirror(ConfigMapPolicy(configmap, key=key), Path(data_dir) / "policy-live" / key)
    mirror.seed(c.PolicyStore.policy_file)
    c.PolicyStore.policy_file = str(mirror.path)

    def started(app) -> None:
        from kubespawner.clients import load_config

        ks = app.config.KubeSpawner  # the same API server and credentials as the spawner's
        load_config(
            host=ks.get("k8s_api_host") or None,
            ssl_ca_cert=ks.get("k8s_api_ssl_ca_cert") or None,
            verify_ssl=ks.get("k8s_api_verify_ssl", None),
        )
        mirror.start()
        start_versions(app, directory, mirror.writer(asyncio.get_running_loop()))

    when_started(started)
