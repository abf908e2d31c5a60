"""Wire policy changes into a hub (issue 26): the page and API that preview, apply and roll back
the policy, and the versions store in the hub's data dir (docs/policy-changes.md)."""

from __future__ import annotations

from pathlib import Path

from .startup import when_started


def configure_policy_changes(c, data_dir) -> None:
    """``/hub/gpuhub/policy`` and ``/hub/api/gpuhub/policy``; versions in ``<data_dir>/policy-versions``
    (after ``configure_scopes``: the handlers check ``custom:gpuhub:policy``)."""
    from ..hub.policy_api import handlers, start_versions

    existing = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    c.JupyterHub.extra_handlers = existing + [h for h in handlers if h not in existing]
    directory = str(Path(data_dir) / "policy-versions")
    when_started(lambda app: start_versions(app, directory))
