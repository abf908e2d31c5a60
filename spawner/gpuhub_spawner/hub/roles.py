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
        """Apply the policy now and after every reload of ``store`` (audited as ``roles_applied``).

        On the hub's loop a reload only compares the policy's role groups with the last ones
        sent; the database work (look-ups, inserts, the commit's fsync: 0.07-0.35 s for the
        500-team policy on a loaded machine) runs in one thread of its own, in reload order,
        with its own session on the hub's database. Back on the loop, the objects it changed
        are expired in the hub's session (it keeps what it loaded: ``expire_on_commit`` is off)
        so the next request's scopes are read afresh, and the change is logged and audited.
        An in-memory database (one per connection) is changed on the loop, as before."""
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        from jupyterhub import orm
        from sqlalchemy.orm import Session
        from sqlalchemy.orm.util import identity_key

        engine = db.get_bind()
        url = engine.url
        in_memory = url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")
        worker = None if in_memory else ThreadPoolExecutor(1, thread_name_prefix="gpuhub-roles")
        sent: list[dict[str, set[str]] | None] = [None]  # on the loop: the last assignment handed on
        has: list[dict[str, set[str]] | None] = [None]  # in the worker: what the database holds (None: unknown)

        def write(session, policy, wanted) -> tuple[dict[str, list], list]:
            """After the first full pass (or a failure) only the groups whose roles the edit
            changed are touched (loading every group of a role cost 0.15-0.3 s per reload)."""
            try:
                changed = self.apply(session, policy) if has[0] is None else self.apply_change(session, has[0], wanted)
            except Exception:
                has[0] = None  # the next reload makes a full pass again
                raise
            has[0] = wanted
            names = {name for _, name in changed["granted"] + changed["revoked"]}
            keys = [identity_key(orm.Role, r.id) for r in session.query(orm.Role).filter(orm.Role.name.in_(list(wanted)))]
            if names:
                keys += [
                    identity_key(orm.Group, g.id) for g in session.query(orm.Group).filter(orm.Group.name.in_(sorted(names)))
                ]
            return changed, keys

        def in_thread(policy, wanted):
            session = Session(bind=engine, expire_on_commit=False)
            try:
                return write(session, policy, wanted)
            finally:
                session.close()

        def done(changed: dict[str, list] | None, keys: list, error: BaseException | None) -> None:
            if error is not None:  # the last assignment stays; say so where admins look
                log.error("Applying the policy's roles to the hub's database failed", exc_info=error)
                recorder.audit("roles_apply_failed", error=f"{type(error).__name__}: {error}")
                sent[0] = None  # the next reload tries again
                return
            assert changed is not None  # None only with an error
            for key in keys:  # the hub's session reads them again at their next use
                obj = db.identity_map.get(key)
                if obj is not None:
                    db.expire(obj)
            if changed["granted"] or changed["revoked"]:
                log.info("Policy roles applied: granted %s, revoked %s", changed["granted"], changed["revoked"])
                recorder.audit("roles_applied", **changed)

        def apply(policy) -> None:
            wanted = self.wanted(policy)
            if wanted == sent[0]:
                return
            sent[0] = wanted
            loop = None
            if worker is not None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    pass
            if loop is None or worker is None:  # here and now: the hub's own session (no worker: no loop either)
                try:
                    changed, _ = write(db, policy, wanted)
                except Exception as e:
                    done(None, [], e)
                    return
                done(changed, [], None)
                return

            def finished(future) -> None:
                error = future.exception()
                changed, keys = (None, []) if error is not None else future.result()
                loop.call_soon_threadsafe(done, changed, keys, error)

            worker.submit(in_thread, policy, wanted).add_done_callback(finished)

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
    admins["scopes"] = sorted(
        set(admins.get("scopes", [])) | {"admin:servers", "list:users", "read:users", STATUS_ALL, USAGE_ALL, AUDIT}
    )
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
    return View(user=name, all=allowed(handler, USAGE_ALL), lead_teams=leads, member_teams=members, audit=allowed(handler, AUDIT))
