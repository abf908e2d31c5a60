"""Wire off-boarding into a hub (hub/offboarding.py, docs/runbooks/offboarding.md): the block
file in the hub's data directory, its names in ``Authenticator.blocked_users`` at every start,
the authenticator subclassed so a refused login says why, and the API and users page.

Call after the authenticator is chosen (``hub.auth.configure_site``); the one-machine config
does (``wiring.config.configure_local``), and a chart's ``hub.extraConfig`` may
(``configure_offboarding(c, "/srv/jupyterhub")``).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from traitlets.utils.importstring import import_item

from ..hub.offboarding import BLOCK_FILE, Blocklist, handlers, with_offboarding
from .app import app_of


def _authenticator_class(value) -> type:
    """The class ``c.JupyterHub.authenticator_class`` names (a class, an entry point name of
    ``jupyterhub.authenticators`` such as ``github``, or a dotted import path)."""
    if isinstance(value, type):
        return value
    name = str(value or "pam")
    for ep in metadata.entry_points(group="jupyterhub.authenticators"):
        if ep.name.lower() == name.lower():
            return ep.load()
    return import_item(name)


def end_processes_of(spawner) -> str:
    """One machine (``GpuHubApp.end_processes``): every process of the user's own account ended
    (local/leaver.py), where their servers run isolated as that account; else nothing to end."""
    if not getattr(spawner, "isolated", False):
        return "no account of their own (servers run as the hub's user): nothing to end"
    from ..local.leaver import end_account_processes

    return end_account_processes(spawner.account_name)


def configure_offboarding(c, data_dir) -> None:
    data = Path(data_dir)
    app = app_of(c)
    app.offboarding_file = str(data / BLOCK_FILE)
    app.offboarding_archive_dir = str(data / "offboarded-homes")
    names = set(Blocklist(app.offboarding_file).read())
    blocked = set(c.Authenticator.blocked_users) if "blocked_users" in c.Authenticator else set()
    c.Authenticator.blocked_users = blocked | names
    current = c.JupyterHub.authenticator_class if "authenticator_class" in c.JupyterHub else "pam"
    c.JupyterHub.authenticator_class = with_offboarding(_authenticator_class(current), app.offboarding_file)
    have = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    c.JupyterHub.extra_handlers = have + [h for h in handlers if h not in have]
