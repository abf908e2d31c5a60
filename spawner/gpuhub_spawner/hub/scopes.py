"""gpuhub's JupyterHub custom scopes, and the roles that grant them.

Every gpuhub endpoint checks the *request's* scopes (a token limited to reading its own
name gets nothing here, even when an admin owns it), never just who owns the token.

- ``custom:gpuhub:status``: device and queue counts; holders' names only inside the
  reader's own teams. Every user has it (``extra_user_scopes``).
- ``custom:gpuhub:status:all``: every holder, every waiting request, the policy's health.
  The ``gpuhub-admin`` role: admin users and the admin groups.
- ``custom:gpuhub:culling``: read cull warnings and snooze servers; filtered by ``!user``.
  Every user has it for themselves, their servers' own tokens too (for JupyterLab's
  notification), admins for everyone.
"""

from __future__ import annotations

from typing import Iterable

STATUS = "custom:gpuhub:status"
STATUS_ALL = "custom:gpuhub:status:all"
CULLING = "custom:gpuhub:culling"

CUSTOM_SCOPES = {
    STATUS: {
        "description": "See gpuhub's GPU and queue counts, and who holds GPUs in your own teams.",
    },
    STATUS_ALL: {
        "description": "See every GPU holder, every waiting request and the policy's health.",
        "subscopes": [STATUS],
    },
    CULLING: {
        "description": "Read cull warnings and notices, and snooze pending stops.",
    },
}

# JupyterHub's default "server" role (a server's own token), plus reading its owner's warnings.
SERVER_ROLE_SCOPES = ["users:activity!user", "access:servers!server", f"{CULLING}!user"]


def _merged(section, name: str, default):
    return type(default)(getattr(section, name)) if name in section else default


def configure_scopes(c, *, admin_users: Iterable[str] = (), admin_groups: Iterable[str] = ()) -> None:
    """Define the custom scopes and grant them (idempotent across repeated calls)."""
    custom = _merged(c.JupyterHub, "custom_scopes", {})
    custom.update(CUSTOM_SCOPES)
    c.JupyterHub.custom_scopes = custom
    extra = _merged(c.JupyterHub, "extra_user_scopes", [])
    for scope in (STATUS, f"{CULLING}!user"):
        if scope not in extra:
            extra.append(scope)
    c.JupyterHub.extra_user_scopes = extra
    roles = [r for r in _merged(c.JupyterHub, "load_roles", []) if r.get("name") not in ("gpuhub-admin", "server")]
    roles.append(
        {
            "name": "gpuhub-admin",
            "description": "gpuhub administrators: every holder and request, anyone's cull warnings.",
            "scopes": [STATUS_ALL, CULLING],
            "users": sorted(set(admin_users)),
            "groups": sorted(set(admin_groups)),
        }
    )
    roles.append({"name": "server", "scopes": list(SERVER_ROLE_SCOPES)})
    c.JupyterHub.load_roles = roles
