"""Who people are: the authenticator chosen in the site configuration.

Every choice delivers groups the same way (``manage_groups``: replaced at each login),
so ``teams[].groups`` in the policy maps them to teams whichever login is used:

- ``demo``: the demo users and one generated password (``DemoAuthenticator``);
- ``github``: GitHub OAuth, groups are ``org:team-slug``;
- ``oidc``: any OpenID Connect provider with a groups claim (Keycloak, Authentik, Dex, Okta...);
- ``entra``: Microsoft Entra ID, groups are object IDs from the token's ``groups`` claim;
- ``pam``: the machine's own accounts, groups are their Unix groups (an offline lab).
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path
from urllib.parse import urlsplit

from jupyterhub.auth import PAMAuthenticator
from traitlets import default

from ..policy.loader import PolicyError, PolicyIssue
from .site import Auth, Site, policy_groups


def read_secret(path: str) -> str:
    """A secret from a file that must not be readable by others."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & 0o077:
        raise PermissionError(f"{p} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    return p.read_text().strip()


class PamGroupsAuthenticator(PAMAuthenticator):
    """PAM login whose hub groups are the account's Unix groups (so the policy maps them)."""

    @default("manage_groups")
    def _manage_groups(self):
        return True

    async def authenticate(self, handler, data):
        name = await super().authenticate(handler, data)
        if not name:
            return None
        name = name["name"] if isinstance(name, dict) else name
        try:
            gid = pwd.getpwnam(name).pw_gid
            groups = sorted({grp.getgrgid(g).gr_name for g in os.getgrouplist(name, gid)})
        except KeyError:
            groups = []
        return {"name": name, "groups": groups}


def github_team_groups(auth_state: dict) -> list[str]:
    """GitHub teams as ``org:team-slug`` (OAuthenticator stores the raw team objects)."""
    return [f"{t['organization']['login']}:{t['slug']}" for t in (auth_state or {}).get("teams") or []]


def configure_auth(c, auth: Auth, *, public_url: str, policy_groups: list[str], demo=None) -> str:
    """Set ``c.JupyterHub.authenticator_class`` and its settings from the site's ``auth``."""
    allowed = set(auth.allowed_groups if auth.allowed_groups is not None else policy_groups) | set(auth.admin_groups)
    callback = auth.callback_url or f"{public_url.rstrip('/')}/hub/oauth_callback"
    c.Authenticator.admin_users = set(auth.admin_users)
    if auth.kind == "demo":
        if demo is not None:
            demo(c)
        return "demo"
    if auth.kind == "pam":
        c.JupyterHub.authenticator_class = PamGroupsAuthenticator
        c.PamGroupsAuthenticator.allowed_groups = allowed
        c.PamGroupsAuthenticator.admin_groups = set(auth.admin_groups)
        return "pam"
    section = {"github": "GitHubOAuthenticator", "oidc": "GenericOAuthenticator", "entra": "AzureAdOAuthenticator"}[auth.kind]
    c.JupyterHub.authenticator_class = {"github": "github", "oidc": "generic-oauth", "entra": "azuread"}[auth.kind]
    s = getattr(c, section)
    s.client_id = auth.client_id
    assert auth.client_secret_file is not None  # Auth._complete requires it for github, oidc and entra
    s.client_secret = read_secret(auth.client_secret_file)
    s.oauth_callback_url = callback
    s.manage_groups = True
    s.allowed_groups = allowed
    s.admin_groups = set(auth.admin_groups)
    if auth.kind == "github":
        s.scope = ["read:org"]
        s.populate_teams_in_auth_state = True
        s.auth_state_groups_key = github_team_groups
        if auth.organizations:
            s.allowed_organizations = set(auth.organizations)
    elif auth.kind == "oidc":
        s.authorize_url = auth.authorize_url
        s.token_url = auth.token_url
        s.userdata_url = auth.userinfo_url
        s.username_claim = auth.username_claim
        s.scope = list(auth.scope)
        s.auth_state_groups_key = f"oauth_user.{auth.groups_claim}"
    elif auth.kind == "entra":
        s.tenant_id = auth.tenant_id
        s.scope = ["openid", "email", "profile"]
        s.username_claim = auth.username_claim
        s.auth_state_groups_key = f"user.{auth.groups_claim}"
    return auth.kind


def configure_site(c, site: Site, *, policy_file: str, public_url: str, demo) -> str:
    """Apply the site file: authenticator, HTTPS, accounts. Returns the login kind."""
    origin = str(c.JupyterHub.subdomain_host) if "subdomain_host" in c.JupyterHub else ""
    if origin and site.public_url:
        # Per-user origins hang off the hub's public host: <user>.gpu.example.org. The hub
        # answers only on its own host (origins.serve_hub_only_on_its_host), so it must be this one.
        domain = os.environ.get("GPUHUB_DOMAIN")
        if domain and domain.lower() != urlsplit(site.public_url).hostname:
            raise PolicyError(
                "site",
                [
                    PolicyIssue(
                        "public_url", None, None, f"its host is not GPUHUB_DOMAIN={domain}; set one of them, or both the same"
                    )
                ],
            )
        origin = c.JupyterHub.subdomain_host = site.public_url
    if site.https is not None:
        for f in (site.https.certfile, site.https.keyfile):
            if not Path(f).is_file():
                raise PolicyError("site", [PolicyIssue("https", None, None, f"{f} does not exist")])
        c.JupyterHub.ssl_cert = site.https.certfile
        c.JupyterHub.ssl_key = site.https.keyfile
        for name in ("bind_url", "subdomain_host"):
            if name in c.JupyterHub and getattr(c.JupyterHub, name):
                setattr(c.JupyterHub, name, str(getattr(c.JupyterHub, name)).replace("http://", "https://", 1))
        origin = origin and str(c.JupyterHub.subdomain_host)
    public = site.public_url or origin or public_url
    _cookie_host_prefix(c, site)
    if site.accounts is not None:
        c.LocalGpuSpawner.account_prefix = site.accounts.prefix
        c.LocalGpuSpawner.home_dir_template = site.accounts.home
        c.LocalGpuSpawner.isolation = site.accounts.isolation
    return configure_auth(c, site.auth, public_url=public, policy_groups=policy_groups(policy_file), demo=demo)


def _cookie_host_prefix(c, site: Site) -> None:
    """``JupyterHub.cookie_host_prefix_enabled`` from ``cookie_host_prefix`` (default: HTTPS with subdomains).

    ``__Host-`` cookies are refused by browsers over plain HTTP, and they must be set on
    path ``/``, so every component on the hub's host receives the login cookie: safe only
    when users' servers are on their own hosts (JupyterHub's own advice).
    """
    origin = str(c.JupyterHub.subdomain_host) if "subdomain_host" in c.JupyterHub else ""
    https = origin.startswith("https://")
    wanted = site.cookie_host_prefix
    if wanted and not origin:
        raise PolicyError(
            "site",
            [
                PolicyIssue(
                    "cookie_host_prefix",
                    None,
                    None,
                    "needs per-user origins: __Host- cookies are set on path /, so servers on the hub's host would receive the hub's login cookie",
                )
            ],
        )
    if wanted and not https:
        raise PolicyError(
            "site",
            [
                PolicyIssue(
                    "cookie_host_prefix",
                    None,
                    None,
                    "needs HTTPS (https, or an https public_url): browsers refuse __Host- cookies over plain HTTP",
                )
            ],
        )
    c.JupyterHub.cookie_host_prefix_enabled = https if wanted is None else wanted
