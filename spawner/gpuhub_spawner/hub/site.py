"""The site configuration of a one-machine hub: login, HTTPS, public URL, accounts.

One small YAML file (``gpuhub run --site FILE`` or ``$GPUHUB_SITE_CONFIG``), separate
from the policy: the policy says who may use what; the site file says how this machine
is reached and who people are. Errors are reported with line:column like the policy's.
Secrets are read from files (``client_secret_file``), never written in this file.

    public_url: https://gpu.example.org
    https: {certfile: /etc/gpuhub/tls/fullchain.pem, keyfile: /etc/gpuhub/tls/privkey.pem}
    auth:
      kind: oidc            # demo | github | oidc | entra | pam
      client_id: gpuhub
      client_secret_file: /etc/gpuhub/oauth-client-secret
      authorize_url: https://idp.example.org/auth
      token_url: https://idp.example.org/token
      userinfo_url: https://idp.example.org/userinfo
      admin_groups: [platform-admins]
    accounts: {prefix: gpuhub-, home: "/home/{account}"}
    cookie_host_prefix: true   # default: on when the hub is HTTPS with per-user origins

``public_url`` is where people open the hub; with per-user origins (the default) users'
servers are on ``<user>.<its host>`` and the hub answers only on its host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..policy.loader import PolicyError, PolicyIssue, _compose_and_construct, _Positions, format_loc, load_policy


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Auth(_Strict):
    kind: Literal["demo", "github", "oidc", "entra", "pam"] = "demo"
    client_id: str | None = None
    client_secret_file: str | None = None
    callback_url: str | None = None  # default: <public_url>/hub/oauth_callback
    # oidc
    authorize_url: str | None = None
    token_url: str | None = None
    userinfo_url: str | None = None
    username_claim: str = "preferred_username"
    groups_claim: str = "groups"
    scope: list[str] = ["openid", "profile", "email", "groups"]
    # github
    organizations: list[str] = []
    # entra
    tenant_id: str | None = None
    # who may log in, who is admin (default allowed: every group the policy names)
    allowed_groups: list[str] | None = None
    admin_groups: list[str] = []
    admin_users: list[str] = []

    @model_validator(mode="after")
    def _complete(self):
        need = {
            "github": ["client_id", "client_secret_file"],
            "oidc": ["client_id", "client_secret_file", "authorize_url", "token_url", "userinfo_url"],
            "entra": ["client_id", "client_secret_file", "tenant_id"],
        }.get(self.kind, [])
        missing = [n for n in need if not getattr(self, n)]
        if missing:
            raise ValueError(f"auth kind {self.kind!r} needs {', '.join(missing)}")
        return self


class Https(_Strict):
    certfile: str
    keyfile: str


class Accounts(_Strict):
    prefix: str = "gpuhub-"
    home: str = "/home/{account}"
    isolation: Literal["auto", "on", "off"] = "auto"


class Site(_Strict):
    public_url: str | None = None
    ip: str | None = None
    port: int | None = None
    https: Https | None = None
    # JupyterHub.cookie_host_prefix_enabled: __Host- login cookies, which a user's subdomain
    # cannot overwrite ("cookie tossing"). Unset: on when the hub is HTTPS with per-user origins.
    cookie_host_prefix: bool | None = None
    auth: Auth = Auth()
    accounts: Accounts | None = None

    @field_validator("public_url")
    @classmethod
    def _origin_only(cls, value):
        if value is None:
            return value
        u = urlsplit(value)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
            raise ValueError(f"public_url must be http(s)://host[:port] with no path, not {value!r}")
        return value.rstrip("/")


def parse_site(text: str, filename: str = "<site>") -> Site:
    root, data, _duplicates = _compose_and_construct(text)
    positions = _Positions(root)
    try:
        return Site.model_validate(data or {})
    except ValidationError as e:
        issues = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            line, col = positions.mark(loc, key=err["type"] == "extra_forbidden") or (None, None)
            msg = f"unknown key {loc[-1]!r}" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            issues.append(PolicyIssue(format_loc(loc), line, col, msg))
        raise PolicyError(filename, issues) from None


def load_site(path: str | Path) -> Site:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PolicyError(str(p), [PolicyIssue("", None, None, f"cannot read the site configuration: {e.strerror}")]) from None
    return parse_site(text, str(p))


def policy_groups(policy_file: str) -> list[str]:
    """Every group the policy maps to a team (who may log in, unless the site says otherwise)."""
    try:
        policy = load_policy(policy_file)
    except Exception:
        return []
    groups = {g for t in policy.teams for g in [*t.groups, *(getattr(t, "leads", None) or [])]}
    roles = getattr(policy, "roles", None)
    for name in ("admins", "viewers"):
        groups |= set(getattr(roles, name, None) or [])
    return sorted(groups)
