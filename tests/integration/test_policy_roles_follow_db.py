"""PolicyRoles.follow on a hub's database file: the database work of a reload runs beside the
hub's loop, with its own session, and the hub's own session (which keeps what it loaded) sees the
change at its next look, as a request resolving scopes would (issue 29)."""

import asyncio
import threading

import pytest
from jupyterhub import orm
from jupyterhub.roles import create_role, get_default_roles, grant_role
from traitlets.config import Config

from gpuhub_spawner.hub.roles import PolicyRoles, configure_policy_roles
from gpuhub_spawner.policy import PolicyStore, parse_policy

pytestmark = pytest.mark.integration

POLICY = """\
roles:
  admins: [ops]
teams:
  - name: vision
    groups: [vision-lab]
    leads: [{leads}]
    quota: {{gpus: {{gpu: 1}}}}
flavors:
  - {{name: gpu, local: {{virtual: 1}}}}
profiles:
  - {{slug: cpu, displayName: C, teams: "*"}}
"""


def lead_groups_of(group) -> list[str]:
    return sorted(r.name for r in group.roles)


async def test_a_reload_changes_roles_beside_the_loop_and_the_hubs_session_sees_it(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(leads="vision-leads"))
    c = Config()
    configure_policy_roles(c, parse_policy(path.read_text()))
    db = orm.new_session_factory(f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}")()  # the hub's session
    for spec in get_default_roles():
        create_role(db, spec)
    for spec in c.JupyterHub.load_roles:
        create_role(db, {"name": spec["name"]})
        for name in spec.get("groups", []):
            group = orm.Group.find(db, name) or orm.Group(name=name)
            db.add(group)
            grant_role(db, group, orm.Role.find(db, spec["name"]))
    deputies = orm.Group(name="deputies")
    db.add(deputies)
    db.commit()
    leads = orm.Group.find(db, "vision-leads")
    assert lead_groups_of(leads) == ["gpuhub-lead"] and lead_groups_of(deputies) == []  # loaded, kept

    store = PolicyStore(policy_file=str(path))
    roles = PolicyRoles(config=c)
    threads = set()
    real_apply_change = roles.apply_change

    def apply_change(session, before, after):
        threads.add(threading.current_thread().name)
        assert session is not db
        return real_apply_change(session, before, after)

    roles.apply_change = apply_change
    roles.follow(db, store)
    try:
        path.write_text(POLICY.format(leads="deputies"))
        store.refresh()
        for _ in range(500):  # the worker's pass, then its hand-back to the loop
            await asyncio.sleep(0.02)
            if lead_groups_of(deputies) == ["gpuhub-lead"]:
                break
        assert lead_groups_of(deputies) == ["gpuhub-lead"]  # the same objects, read afresh
        assert lead_groups_of(leads) == []
        assert threads and threading.current_thread().name not in threads
    finally:
        roles._watcher.stop()
