"""gpuhub's four roles, from the policy's groups, as JupyterHub RBAC roles.

- admin (``roles.admins``): role ``gpuhub-admin`` — everything gpuhub shows, the audit
  trail, and stopping any server (``admin:servers``, which implies gpuhub's scopes).
- team lead (``teams[].leads``): role ``gpuhub-lead`` (``custom:gpuhub:lead``); *which*
  teams is read from the live policy at each request.
- viewer (``roles.viewers``): role ``gpuhub-viewer`` — every team's usage and counts,
  no servers, files or artifacts (MLflow: read-only, see ``mlflow/accounts.py``).
- researcher: a member of a team's groups; the default ``user`` role with gpuhub's
  per-user scopes (own usage, own teams' counts).

JupyterHub assigns configured roles (``load_roles``) to groups only at start.
``PolicyRoles`` applies the policy's groups to these three roles in the hub's database at
every policy reload, the way JupyterHub's ``init_role_assignment`` does at start (the
role's groups become exactly the policy's, plus any the hub's configuration adds), so
granting and revoking take effect at the next request, not the next restart. JupyterHub
resolves a request's scopes from the database on every request (token or cookie alike).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from traitlets import Dict
from traitlets.config import SingletonConfigurable

from ..policy import PolicyStore
from ..policy.access import teams_for
from ..policy.scopes import AUDIT, LEAD, STATUS, STATUS_ALL, USAGE, USAGE_ALL, allowed
from ..usage import recorder

log = logging.getLogger("JupyterHub.gpuhub.roles")


def _merged_roles(c) -> dict[str, dict]:
    return {r["name"]: dict(r) for r in (list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else [])}


def policy_role_groups(policy) -> dict[str, set[str]]:
    """gpuhub role -> the policy's groups that hold it."""
    return {
        "gpuhub-admin": set(policy.roles.admins),
        "gpuhub-viewer": set(policy.roles.viewers),
        "gpuhub-lead": {g for t in policy.teams for g in t.leads},
    }


class PolicyRoles(SingletonConfigurable):
    """Keeps the groups of gpuhub's roles in the hub's database equal to the live policy's."""

    config_groups = Dict(
        help="""Groups the hub's configuration (not the policy) gives a gpuhub role, by role;
        kept when the policy changes. Set by ``configure_policy_roles``.""",
    ).tag(config=True)

    def wanted(self, policy) -> dict[str, set[str]]:
        return {role: groups | set(self.config_groups.get(role, ())) for role, groups in policy_role_groups(policy).items()}

    def apply(self, db, policy) -> dict[str, list]:
        """Grant and strip gpuhub's roles on groups so they match ``policy``; return what changed.

        Mirrors JupyterHub's start-up assignment (``JupyterHub.init_role_assignment``):
        groups are found or created with ``orm.Group``, roles granted and stripped with
        ``jupyterhub.roles.grant_role``/``strip_role``. Only gpuhub's three roles are
        touched (never JupyterHub's ``admin``, ``user``, ``server`` or ``token``), and only
        their groups (users or services a configuration gives them are left alone).
        """
        from jupyterhub import orm
        from jupyterhub.roles import grant_role, strip_role

        changed: dict[str, list] = {"granted": [], "revoked": [], "created_groups": []}
        try:
            for role_name, wanted in self.wanted(policy).items():
                role = orm.Role.find(db, role_name)
                if role is None:  # not loaded at start (another backend's config): nothing to keep in step
                    log.warning("Role %s is not in the hub's database; its groups follow at the next start", role_name)
                    continue
                have = {g.name: g for g in role.groups}
                for name in sorted(wanted - set(have)):
                    group = orm.Group.find(db, name)
                    if group is None:
                        log.info("Creating group %s found in role %s (policy)", name, role_name)
                        group = orm.Group(name=name)
                        db.add(group)
                        changed["created_groups"].append(name)
                    grant_role(db, group, role, commit=False)
                    changed["granted"].append([role_name, name])
                for name in sorted(set(have) - wanted):
                    strip_role(db, have[name], role, commit=False)
                    changed["revoked"].append([role_name, name])
            db.commit()
        except Exception:
            db.rollback()
            raise
        return changed

    def apply_change(self, db, before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list]:
        """Grant and strip only what differs between two ``wanted`` assignments (the last one
        applied and the policy's now); the same effect as ``apply`` when the database held
        ``before``, at the cost of the change instead of every group of every role."""
        from jupyterhub import orm
        from jupyterhub.roles import grant_role, strip_role

        changed: dict[str, list] = {"granted": [], "revoked": [], "created_groups": []}
        try:
            for role_name in after:
                role = orm.Role.find(db, role_name)
                if role is None:
                    continue
                for name in sorted(after[role_name] - before.get(role_name, set())):
                    group = orm.Group.find(db, name)
                    if group is None:
                        log.info("Creating group %s found in role %s (policy)", name, role_name)
                        group = orm.Group(name=name)
                        db.add(group)
                        changed["created_groups"].append(name)
                    if role not in group.roles:
                        grant_role(db, group, role, commit=False)
                        changed["granted"].append([role_name, name])
                for name in sorted(before.get(role_name, set()) - after[role_name]):
                    group = orm.Group.find(db, name)
                    if group is not None and role in group.roles:
                        strip_role(db, group, role, commit=False)
                        changed["revoked"].append([role_name, name])
            db.commit()
        except Exception:
            db.rollback()
            raise
        return changed

    def follow(self, db, store) -> None:
        """Apply the policy now and after every reload of ``store`` (audited as ``roles_applied``)."""

        applied: list[dict[str, set[str]] | None] = [None]

        def apply(policy) -> None:
            # A reload runs on the hub's loop: after the first full pass only the groups whose
            # roles the edit changed are touched (loading every group of a role from the
            # database cost 0.15-0.3 s per reload of a 500-team policy).
            wanted = self.wanted(policy)
            if wanted == applied[0]:
                return
            try:
                changed = self.apply(db, policy) if applied[0] is None else self.apply_change(db, applied[0], wanted)
            except Exception as e:  # the last assignment stays; say so where admins look
                log.exception("Applying the policy's roles to the hub's database failed")
                recorder.audit("roles_apply_failed", error=f"{type(e).__name__}: {e}")
                applied[0] = None  # the next reload makes a full pass again
                return
            applied[0] = wanted
            if changed["granted"] or changed["revoked"]:
                log.info("Policy roles applied: granted %s, revoked %s", changed["granted"], changed["revoked"])
                recorder.audit("roles_applied", **changed)

        store.on_change(apply)
        apply(store.current)
        # The file is re-read every check_interval whichever backend runs (on one machine the
        # broker also does; a refresh that finds the file unchanged costs one stat).
        from tornado.ioloop import PeriodicCallback

        self._watcher = PeriodicCallback(store.refresh, store.check_interval * 1000)
        self._watcher.start()


def follow_policy_roles(app) -> None:
    """Once the hub has started (init_role_assignment has run: the database has the roles);
    ``wiring.usage.configure_usage`` schedules it."""
    PolicyRoles.instance(config=app.config).follow(app.db, PolicyStore.instance(config=app.config))


def configure_policy_roles(c, policy) -> None:
    """Grant gpuhub's roles to the policy's groups (after ``policy.scopes.configure_scopes``),
    at start through ``load_roles``; once the hub runs, ``follow_policy_roles`` keeps them in
    step at every policy reload (scheduled by ``wiring.usage.configure_usage``)."""
    roles = _merged_roles(c)
    groups = policy_role_groups(policy)
    admins = roles.get("gpuhub-admin", {"name": "gpuhub-admin", "scopes": [], "groups": []})
    c.PolicyRoles.config_groups = {"gpuhub-admin": sorted(admins.get("groups", []))}
    admins["scopes"] = sorted(set(admins.get("scopes", [])) | {"admin:servers", "list:users", "read:users", STATUS_ALL,
                                                               USAGE_ALL, AUDIT})
    admins["groups"] = sorted(set(admins.get("groups", [])) | groups["gpuhub-admin"])
    roles["gpuhub-admin"] = admins
    roles["gpuhub-viewer"] = {
        "name": "gpuhub-viewer",
        "description": "gpuhub viewers: every team's usage and counts; no servers, files or artifacts.",
        "scopes": [USAGE_ALL, STATUS],
        "groups": sorted(groups["gpuhub-viewer"]),
    }
    roles["gpuhub-lead"] = {
        "name": "gpuhub-lead",
        "description": "gpuhub team leads: their teams' holders, queue and history (teams from the policy).",
        "scopes": [LEAD, STATUS],
        "groups": sorted(groups["gpuhub-lead"]),
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
