"""PolicyRoles.apply on JupyterHub's own ORM (in-memory sqlite): the policy's groups become
exactly the groups of gpuhub's roles, configuration-given groups stay, nothing else moves.
The same code against a running hub: tests/integration/test_roles_reload.py."""

from jupyterhub import orm
from jupyterhub.roles import create_role, get_default_roles, grant_role
from traitlets.config import Config

from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.hub.roles import PolicyRoles, configure_policy_roles

POLICY = """\
roles:
  admins: [{admins}]
  viewers: [{viewers}]
teams:
  - name: vision
    groups: [vision-lab]
    leads: [{leads}]
profiles:
  - {{slug: cpu, displayName: C, teams: "*"}}
"""


def policy(admins="ops", viewers="heads", leads="vision-leads"):
    return parse_policy(POLICY.format(admins=admins, viewers=viewers, leads=leads), "p.yaml")


def hub_db(c):
    """A database as JupyterHub's init_role_creation/init_role_assignment leave it."""
    db = orm.new_session_factory("sqlite://")()
    for spec in get_default_roles():
        create_role(db, spec)
    for spec in c.JupyterHub.load_roles:  # scopes left out: custom scopes need a running hub
        create_role(db, {"name": spec["name"]})
    for spec in c.JupyterHub.load_roles:
        role = orm.Role.find(db, spec["name"])
        for name in spec.get("groups", []):
            group = orm.Group.find(db, name) or orm.Group(name=name)
            db.add(group)
            grant_role(db, group, role)
    return db


def groups_of(db, role):
    return sorted(g.name for g in orm.Role.find(db, role).groups)


def test_apply_grants_creates_and_revokes_only_gpuhubs_role_groups():
    c = Config()
    c.JupyterHub.load_roles = [{"name": "gpuhub-admin", "scopes": [], "groups": ["site-admins"]}]
    configure_policy_roles(c, policy())
    db = hub_db(c)
    # A group some other configuration gave JupyterHub's admin role is not gpuhub's to touch.
    other = orm.Group(name="ops-oncall")
    db.add(other)
    grant_role(db, other, "admin")
    roles = PolicyRoles(config=c)
    assert roles.apply(db, policy()) == {"granted": [], "revoked": [], "created_groups": []}

    changed = roles.apply(db, policy(admins="ops, students", viewers="auditors", leads="vision-leads, deputies"))
    assert sorted(changed["granted"]) == [
        ["gpuhub-admin", "students"],
        ["gpuhub-lead", "deputies"],
        ["gpuhub-viewer", "auditors"],
    ]
    assert changed["revoked"] == [["gpuhub-viewer", "heads"]]
    assert sorted(changed["created_groups"]) == ["auditors", "deputies", "students"]
    assert groups_of(db, "gpuhub-admin") == ["ops", "site-admins", "students"]
    assert groups_of(db, "gpuhub-viewer") == ["auditors"]

    # Back to the first policy: everything it did not name is revoked, except the site's own group.
    changed = roles.apply(db, policy())
    assert sorted(changed["revoked"]) == [
        ["gpuhub-admin", "students"],
        ["gpuhub-lead", "deputies"],
        ["gpuhub-viewer", "auditors"],
    ]
    assert groups_of(db, "gpuhub-admin") == ["ops", "site-admins"]
    assert groups_of(db, "gpuhub-viewer") == ["heads"] and groups_of(db, "gpuhub-lead") == ["vision-leads"]
    assert [r.name for r in other.roles] == ["admin"]
    assert orm.Group.find(db, "auditors") is not None  # groups stay; only their role goes
