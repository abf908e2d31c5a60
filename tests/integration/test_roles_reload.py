"""Roles follow the policy without a restart, and an admin starting someone's server from
the spawn page is audited — against one real hub (real JupyterHub RBAC, real servers).

The policy store re-reads the file every ``PolicyStore.check_interval`` (2 s, the default:
not shortened here). Each edit below waits for the hub to say it applied the change
(``roles_applied`` in the audit trail), then checks the user's *existing* token and login
cookie once: no new login, no new token. erin (group ``students``) is in no team and holds
no gpuhub role until the policy gives ``students`` one.
"""

import html
import re
import time

import pytest

from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {{virtual: 2}}
roles:
  admins: [{admins}]
  viewers: [{viewers}]
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    leads: [{leads}]
    quota: {{gpus: {{gpu: 2}}}}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    quota: {{gpus: {{gpu: 0}}}}
profiles:
  - {{slug: cpu, displayName: CPU only, teams: "*", default: true}}
  - {{slug: gpu-1, displayName: One GPU, gpu: {{count: 1, flavor: gpu}}, teams: [vision]}}
"""


def policy(admins="platform-admins", viewers="department-heads", leads="vision-leads") -> str:
    return POLICY.format(admins=admins, viewers=viewers, leads=leads)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("roles"), policy()) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("admin", "alice", "bob", "carol", "erin")}


def audit(admin, **params):
    r = admin.api.get(admin.url("/gpuhub/audit"), params=params)
    r.raise_for_status()
    return r.json()["entries"]


def edit_policy(hub, admin, text, expect: dict[str, list]):
    """Write the policy; wait until the hub says it applied ``expect`` (granted/revoked pairs)."""
    since = time.time() - 1
    hub.policy.write_text(text)

    def applied():
        for e in audit(admin, event="roles_applied", since=str(since)):
            if all(sorted(map(list, v)) == sorted(e.get(k, [])) for k, v in expect.items()):
                return e
        return None

    return wait_for(applied, 20, f"the hub to apply {expect}", interval=0.3)


@pytest.fixture(scope="module")
def spawned_by_admin(hub, users):
    """The admin starts alice's server from the spawn page's form, as a browser would."""
    admin, alice = users["admin"], users["alice"]
    page = admin.session.get(hub.url + "/hub/spawn/alice")
    assert page.status_code == 200 and 'name="profile"' in page.text, page.text[:500]
    action = html.unescape(re.search(r'<form[^>]*id="spawn_form"[^>]*action="([^"]+)"', page.text, re.S).group(1))
    assert "_xsrf=" in action  # the form carries the page's XSRF token (JupyterHub's spawn.html)
    started = time.time()
    r = admin.session.post(
        hub.url + action if action.startswith("/") else action, data={"profile": "gpu-1"}, allow_redirects=False
    )
    assert r.status_code == 302 and "/hub/spawn-pending/alice" in r.headers["Location"], (r.status_code, r.text[:500])
    alice.wait_ready()
    alice.stop()
    alice.wait_gone()
    return started


# -- 1. roles follow the policy -----------------------------------------------------------------
def _usage(client):
    r = client.api.get(client.url("/gpuhub/usage"), params={"since": "1d"})
    assert r.status_code == 200, r.text
    return r.json()


def _page_view(client):
    r = client.session.get(client.hub.url + "/hub/gpuhub/usage?since=1d")
    assert r.status_code == 200
    return re.search(r'id="gpuhub-usage"[^>]*data-view="([^"]+)"', r.text).group(1), r.text


def test_a_group_added_to_viewers_sees_everyones_usage_at_once_and_loses_it_when_removed(hub, users, spawned_by_admin):
    admin, erin = users["admin"], users["erin"]
    # Not a viewer: her own (empty) slice only, by token and by cookie.
    rep = _usage(erin)
    assert rep["view"] == "user" and rep["rows"] == []
    view, text = _page_view(erin)
    assert view == "user" and "alice" not in text

    edit_policy(
        hub, admin, policy(viewers="department-heads, students"), {"granted": [["gpuhub-viewer", "students"]], "revoked": []}
    )
    rep = _usage(erin)  # the same token, no new login
    everyone = [r["user"] for r in _usage(admin)["rows"]]  # alice's, and any a test before started (any order)
    assert rep["view"] == "viewer" and [r["user"] for r in rep["rows"]] == everyone and "alice" in everyone
    view, text = _page_view(erin)  # the same cookie
    assert view == "viewer" and "alice" in text

    # Revocation: the group leaves roles.viewers, and the same token and cookie see nothing again.
    edit_policy(hub, admin, policy(), {"granted": [], "revoked": [["gpuhub-viewer", "students"]]})
    rep = _usage(erin)
    assert rep["view"] == "user" and rep["rows"] == []
    view, text = _page_view(erin)
    assert view == "user" and "alice" not in text
    # The policy's own viewers kept their role throughout.
    r = admin.api.get(admin.url("/groups/department-heads"))
    assert r.status_code == 200 and r.json()["roles"] == ["gpuhub-viewer"]


def test_a_group_added_to_admins_gets_the_audit_trail_and_loses_it_when_removed(hub, users):
    admin, erin = users["admin"], users["erin"]

    def erin_reads_audit():
        return (erin.api.get(erin.url("/gpuhub/audit")).status_code, erin.session.get(hub.url + "/hub/gpuhub/audit").status_code)

    assert erin_reads_audit() == (403, 403)
    edit_policy(hub, admin, policy(admins="platform-admins, students"), {"granted": [["gpuhub-admin", "students"]]})
    assert erin_reads_audit() == (200, 200)
    edit_policy(hub, admin, policy(), {"revoked": [["gpuhub-admin", "students"]]})
    assert erin_reads_audit() == (403, 403)
    # JupyterHub's own admin role is not gpuhub's to change: the hub admin is still one.
    assert "admin" in admin.api.get(admin.url("/users/admin")).json()["roles"]
    assert admin.api.get(admin.url("/groups/platform-admins")).json()["roles"] == ["gpuhub-admin"]


def test_a_group_made_lead_sees_its_team_and_a_new_group_is_created_with_its_role(hub, users):
    admin, erin = users["admin"], users["erin"]
    assert erin.api.get(erin.url("/gpuhub/status")).json()["view"] == "counts"
    assert admin.api.get(admin.url("/groups/auditors")).status_code == 404  # nobody with it has logged in
    entry = edit_policy(
        hub,
        admin,
        policy(leads="vision-leads, students", viewers="department-heads, auditors"),
        {"granted": [["gpuhub-lead", "students"], ["gpuhub-viewer", "auditors"]]},
    )
    assert entry["created_groups"] == ["auditors"]
    assert erin.api.get(erin.url("/gpuhub/status")).json()["view"] == "team"
    r = admin.api.get(admin.url("/groups/auditors"))
    assert r.status_code == 200 and r.json()["roles"] == ["gpuhub-viewer"]
    edit_policy(hub, admin, policy(), {"revoked": [["gpuhub-lead", "students"], ["gpuhub-viewer", "auditors"]]})
    assert erin.api.get(erin.url("/gpuhub/status")).json()["view"] == "counts"
    assert admin.api.get(admin.url("/groups/auditors")).json()["roles"] == []
    # The role change is in the trail beside the policy's diff.
    changed = audit(admin, event="roles_changed")
    assert any(e["changes"].get("auditors") == {"before": ["viewer"], "after": []} for e in changed)


# -- 2. an admin acting on someone's server through the spawn page --------------------------------
def test_an_admin_starting_someones_server_from_the_spawn_page_is_audited(hub, users, spawned_by_admin):
    admin = users["admin"]
    entries = audit(admin, since=str(spawned_by_admin - 1), user="alice")
    events = [(e["event"], e.get("by")) for e in entries if e.get("key") == "alice/"]
    assert events[:3] == [("start_requested", "admin"), ("acted_on_server", "admin"), ("requested", None)], events
    acted = next(e for e in entries if e["event"] == "acted_on_server")
    assert (acted["by"], acted["target_user"], acted["key"], acted["action"]) == ("admin", "alice", "alice/", "start")
    # The same page also starts a server from its query (JupyterHub's GET /hub/spawn/<user>?<options>).
    bob, since = users["bob"], time.time() - 1
    r = admin.session.get(hub.url + "/hub/spawn/bob?profile=cpu", allow_redirects=False)
    assert r.status_code == 302 and "/hub/spawn-pending/bob" in r.headers["Location"], r.status_code
    try:
        bob.wait_ready()
        acted = [(e["by"], e["target_user"], e["action"]) for e in audit(admin, since=str(since), event="acted_on_server")]
        assert acted == [("admin", "bob", "start")]
    finally:
        bob.stop()
        bob.wait_gone()
    # A page that only shows the form starts nothing and records nothing.
    since = time.time() - 1
    assert admin.session.get(hub.url + "/hub/spawn/carol").status_code == 200
    assert not audit(admin, since=str(since), user="carol") and users["carol"].model()["servers"] == {}


def test_an_ordinary_user_cannot_start_someone_elses_server_from_the_spawn_page(hub, users):
    admin, bob, carol = users["admin"], users["bob"], users["carol"]
    since = time.time() - 1
    # bob's own spawn page gives him a valid XSRF token; he aims the form at carol's server.
    own = bob.session.get(hub.url + "/hub/spawn")
    xsrf = re.search(r"_xsrf=([^\"&]+)", html.unescape(own.text)).group(1)
    assert bob.session.get(hub.url + "/hub/spawn/carol").status_code in (403, 404)
    for path in ("/hub/spawn/carol", "/hub/spawn/carol/side"):
        r = bob.session.post(f"{hub.url}{path}?_xsrf={xsrf}", data={"profile": "cpu"}, allow_redirects=False)
        # JupyterHub's scope check refuses it (an XSRF failure would be a 403 saying so).
        assert r.status_code == 404 and "No access to resources" in r.text, (path, r.status_code)
    assert carol.model()["servers"] == {}
    assert not [e for e in audit(admin, since=str(since)) if e.get("user") == "carol" or e.get("target_user") == "carol"]
