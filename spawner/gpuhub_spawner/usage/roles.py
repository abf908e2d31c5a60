"""gpuhub's four roles, from the policy's groups, as JupyterHub RBAC roles.

- admin (``roles.admins``): role ``gpuhub-admin`` — everything gpuhub shows, the audit
  trail, and stopping any server (``admin:servers``, which implies gpuhub's scopes).
- team lead (``teams[].leads``): role ``gpuhub-lead`` (``custom:gpuhub:lead``); *which*
  teams is read from the live policy at each request, so removing a lead group takes
  effect at the next reload. Adding a new group to a role needs a hub restart (JupyterHub
  assigns configured roles at start); the audit trail records the change either way.
- viewer (``roles.viewers``): role ``gpuhub-viewer`` — every team's usage and counts,
  no servers, files or artifacts (MLflow: read-only, see ``mlflow/accounts.py``).
- researcher: a member of a team's groups; the default ``user`` role with gpuhub's
  per-user scopes (own usage, own teams' counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hub.scopes import AUDIT, LEAD, STATUS, STATUS_ALL, USAGE, USAGE_ALL, allowed
from ..policy.access import teams_for


def _merged_roles(c) -> dict[str, dict]:
    return {r["name"]: dict(r) for r in (list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else [])}


def configure_policy_roles(c, policy) -> None:
    """Grant gpuhub's roles to the policy's groups (after ``hub.scopes.configure_scopes``)."""
    roles = _merged_roles(c)
    admins = roles.get("gpuhub-admin", {"name": "gpuhub-admin", "scopes": [], "groups": []})
    admins["scopes"] = sorted(set(admins.get("scopes", [])) | {"admin:servers", "list:users", "read:users", STATUS_ALL,
                                                               USAGE_ALL, AUDIT})
    admins["groups"] = sorted(set(admins.get("groups", [])) | set(policy.roles.admins))
    roles["gpuhub-admin"] = admins
    roles["gpuhub-viewer"] = {
        "name": "gpuhub-viewer",
        "description": "gpuhub viewers: every team's usage and counts; no servers, files or artifacts.",
        "scopes": [USAGE_ALL, STATUS],
        "groups": sorted(set(policy.roles.viewers)),
    }
    roles["gpuhub-lead"] = {
        "name": "gpuhub-lead",
        "description": "gpuhub team leads: their teams' holders, queue and history (teams from the policy).",
        "scopes": [LEAD, STATUS],
        "groups": sorted({g for t in policy.teams for g in t.leads}),
    }
    c.JupyterHub.load_roles = list(roles.values())


@dataclass
class View:
    """What one request may see of usage and status."""

    user: str
    all: bool = False  # every team and user
    lead_teams: set[str] = field(default_factory=set)  # whose members' details it sees
    member_teams: set[str] = field(default_factory=set)  # whose totals it sees
    audit: bool = False

    @property
    def role(self) -> str:
        if self.audit:
            return "admin"
        if self.all:
            return "viewer"
        if self.lead_teams:
            return "lead"
        return "researcher" if self.member_teams else "user"

    def sees_rows_of(self, team: str, user: str) -> bool:
        return self.all or team in self.lead_teams or user == self.user

    def sees_totals_of(self, team: str) -> bool:
        return self.all or team in self.lead_teams or team in self.member_teams


def view_for(handler, policy) -> View | None:
    """The request's view, or None without ``custom:gpuhub:usage``."""
    if not allowed(handler, USAGE):
        return None
    user = handler.current_user
    name = getattr(user, "name", "")
    groups = {g.name for g in getattr(user, "groups", [])} if getattr(user, "kind", "user") == "user" else set()
    members = {t.name for t in teams_for(policy, sorted(groups))}
    leads = set()
    if allowed(handler, LEAD):
        leads = {t.name for t in policy.teams if groups & set(t.leads)}
    return View(user=name, all=allowed(handler, USAGE_ALL), lead_teams=leads, member_teams=members,
                audit=allowed(handler, AUDIT))
