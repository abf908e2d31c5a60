"""gpuhub's JupyterHub custom scopes, and the roles that grant them.

Every gpuhub endpoint checks the *request's* scopes (a token limited to reading its own
name gets nothing here, even when an admin owns it), never just who owns the token.

- ``custom:gpuhub:status``: device and queue counts, and the reader's own devices.
  Every user has it (``extra_user_scopes``); team leads also see their team (``lead``).
- ``custom:gpuhub:status:all``: every holder, every waiting request, the policy's health.
  Implied by ``admin:servers`` (hub admins); ``gpuhub-admin`` grants it to groups.
- ``custom:gpuhub:culling``: read cull warnings and snooze servers; filtered by ``!user``.
  Every user has it for themselves, their servers' own tokens too (for JupyterLab's
  notification), admins for everyone.
- ``custom:gpuhub:usage``: one's own usage history and one's teams' totals (every user).
- ``custom:gpuhub:usage:all``: everyone's usage history (viewers, admins).
- ``custom:gpuhub:lead``: for the teams the live policy says the reader leads, their
  holders, queue and history, and stopping a member's idle server (``gpuhub-lead``).
- ``custom:gpuhub:audit``: the audit trail (admins).
- ``custom:gpuhub:policy``: apply and roll back the policy, preview any edit (admins; leads
  preview edits of their own teams with ``custom:gpuhub:lead``).

Roles from the policy's groups (``roles.admins``, ``roles.viewers``, ``teams[].leads``)
are granted by ``hub.roles.configure_policy_roles``.
"""

from __future__ import annotations

STATUS = "custom:gpuhub:status"
STATUS_ALL = "custom:gpuhub:status:all"
CULLING = "custom:gpuhub:culling"
USAGE = "custom:gpuhub:usage"
USAGE_ALL = "custom:gpuhub:usage:all"
LEAD = "custom:gpuhub:lead"
AUDIT = "custom:gpuhub:audit"
POLICY = "custom:gpuhub:policy"

CUSTOM_SCOPES = {
    STATUS: {
        "description": "See gpuhub's GPU and queue counts, and your own GPUs.",
    },
    STATUS_ALL: {
        "description": "See every GPU holder, every waiting request and the policy's health.",
        "subscopes": [STATUS],
    },
    CULLING: {
        "description": "Read cull warnings and notices, and snooze pending stops.",
    },
    USAGE: {
        "description": "See your own GPU usage history and your teams' totals.",
    },
    USAGE_ALL: {
        "description": "See every team's and user's GPU usage history.",
        "subscopes": [USAGE],
    },
    LEAD: {
        "description": "Lead your teams: see their holders, queue and history; stop a member's idle server.",
        "subscopes": [USAGE],
    },
    AUDIT: {
        "description": "Read gpuhub's audit trail of decisions and actions.",
    },
    POLICY: {
        "description": "Apply and roll back gpuhub's policy; preview the impact of any edit.",
    },
}

# A request that may administer servers may see and act on everything gpuhub shows about
# them: ``admin:servers`` implies gpuhub's scopes (JupyterHub forbids adding scopes to its
# own ``admin`` role, and this also covers admins made by an authenticator's admin_groups).
IMPLIED_BY = {
    STATUS_ALL: "admin:servers",
    CULLING: "admin:servers",
    USAGE_ALL: "admin:servers",
    AUDIT: "admin:servers",
    POLICY: "admin:servers",
}
# Added to JupyterHub's "server" role (a server's own token): its owner's cull warnings,
# for JupyterLab's notification, and its owner's usage (``gpuhub usage`` in a terminal).
SERVER_SCOPES = [f"{CULLING}!user", USAGE]


def allowed(handler, scope: str, user: str | None = None) -> bool:
    """Whether the request carries ``scope`` (for ``user``, if given) or a scope implying it."""
    suffix = f"!user={user}" if user else ""
    if handler.has_scope(scope + suffix):
        return True
    implied = IMPLIED_BY.get(scope)
    return bool(implied and handler.has_scope(implied + suffix))


def merged_setting(section, name: str, default):
    """A copy of a config setting already given (merged into by several features), else ``default``."""
    return type(default)(getattr(section, name)) if name in section else default


def grant_server_token(c, scopes) -> None:
    """Add ``scopes`` to every single-user server's own token, never replacing what other
    features added: JupyterHub gives a server's token the ``server`` role unless
    ``Spawner.server_token_scopes`` is set, so the scopes go into that role, and also into
    ``server_token_scopes`` where an operator set it (a list or a callable). Every gpuhub
    feature that needs a server-token scope (culling, usage, jobs, MLflow) comes through here.
    """
    import inspect

    from jupyterhub.roles import get_default_roles

    scopes = list(scopes)
    defaults = {r["name"]: r for r in get_default_roles()}
    roles = {r["name"]: dict(r) for r in merged_setting(c.JupyterHub, "load_roles", [])}
    server = roles.get("server", {"name": "server"})
    server["scopes"] = sorted(set(server.get("scopes", defaults["server"]["scopes"])) | set(scopes))
    roles["server"] = server
    c.JupyterHub.load_roles = list(roles.values())
    if "server_token_scopes" not in c.Spawner:
        return
    existing = c.Spawner.server_token_scopes
    if callable(existing):

        def server_token_scopes(spawner, _inner=existing, _add=tuple(scopes)):
            result = _inner(spawner)
            if inspect.isawaitable(result):

                async def merged():
                    return _with(await result, _add)

                return merged()
            return _with(result, _add)

        c.Spawner.server_token_scopes = server_token_scopes
    elif existing:  # empty means "the server role", which has them now
        c.Spawner.server_token_scopes = _with(existing, scopes)


def _with(existing, additions) -> list:
    out = list(existing or [])
    out += [s for s in additions if s not in out]
    return out


def configure_scopes(c, *, admin_groups=()) -> None:
    """Define the custom scopes and grant them (idempotent across repeated calls).

    Users get ``status`` and their own ``culling``; their servers' tokens their owner's
    ``culling``. ``admin_groups`` (identity-provider groups of gpuhub admins who are not
    hub admins) get ``status:all`` and everyone's ``culling`` through the role
    ``gpuhub-admin``.
    """

    custom = merged_setting(c.JupyterHub, "custom_scopes", {})
    custom.update(CUSTOM_SCOPES)
    c.JupyterHub.custom_scopes = custom
    extra = merged_setting(c.JupyterHub, "extra_user_scopes", [])
    for scope in (STATUS, f"{CULLING}!user", USAGE):
        if scope not in extra:
            extra.append(scope)
    c.JupyterHub.extra_user_scopes = extra
    grant_server_token(c, SERVER_SCOPES)
    roles = {r["name"]: dict(r) for r in merged_setting(c.JupyterHub, "load_roles", [])}
    admins = roles.get("gpuhub-admin", {"name": "gpuhub-admin", "scopes": [STATUS_ALL, CULLING, POLICY], "groups": []})
    admins["scopes"] = sorted(set(admins.get("scopes", [])) | {POLICY})
    admins["groups"] = sorted(set(admins.get("groups", [])) | set(admin_groups))
    admins["description"] = "gpuhub administrators: every GPU holder and request, anyone's cull warnings."
    roles["gpuhub-admin"] = admins
    c.JupyterHub.load_roles = list(roles.values())
