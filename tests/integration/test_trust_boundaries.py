"""Attacks by an ordinary user against a real hub; each test passes because the attack fails.

The attacker has a demo account, their own server and a browser — no root. Covered here:
per-user origins (a page on bob's server opened by carol), caps bypassed by leaving out
``profile``, holders' names leaking through the status page, and gpuhub APIs trusting
who owns a token instead of its scopes.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support.browser import CHROMIUM, chromium, log_in
from support.hub import Hub, running_hub, wait_for
from support.kernel import KernelSession
from test_local_hub import POLICY, clean  # noqa: F401  (clean: every server stopped around a test)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("trust"), POLICY) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("alice", "bob", "carol", "mallory", "admin")}


# -- finding 5: caps cannot be skipped by leaving out the profile ------------------------------
def test_leaving_out_the_profile_does_not_skip_the_per_user_cap(clean):
    """vision allows 2 servers per user: bob asks for 5 at once, none naming a profile."""
    bob = clean["bob"]
    with ThreadPoolExecutor(5) as pool:
        codes = list(pool.map(lambda i: bob.api.post(bob.url(f"/users/bob/servers/s{i}"), json={}).status_code, range(5)))
    assert codes.count(403) >= 3, codes
    assert len(bob.model()["servers"]) <= 2, codes  # never more than the cap, even while settling

    def settled():  # every listed server ready (a refused one may still be on its way out)
        servers = bob.model()["servers"]
        return all(m.get("ready") for m in servers.values()) and servers

    servers = wait_for(settled, 90, f"bob's servers to settle ({codes})", interval=0.2)
    assert 1 <= len(servers) <= 2, (codes, servers)
    # The hub's record holds the resolved choice, not the empty request.
    for _name, model in bob.model()["servers"].items():
        assert model["user_options"] == {"profile": "cpu", "team": "vision"}, model
    r = bob.api.post(bob.url("/users/bob/servers/extra"), json={})
    assert r.status_code == 403 and "allows 2 server(s) per user" in r.json()["message"]


# -- finding 6: who holds which GPU is not shown to everyone -----------------------------------
def _status(hub, user):
    return requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {user.token}"})


def test_holders_are_visible_only_to_their_team_and_admins(hub, clean):
    alice, carol, mallory, admin = clean["alice"], clean["carol"], clean["mallory"], clean["admin"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()

    def holders(user):
        return {d["user"] for d in _status(hub, user).json()["devices"] if d["held"]}

    assert holders(admin) == {"alice"}
    assert holders(alice) == {"alice"}  # her own team
    assert holders(carol) == {None}  # NLP sees that a device is held, not by whom
    assert holders(mallory) == {None}  # in no team: counts only
    snap = _status(hub, mallory).json()
    assert snap["view"] == "counts" and "policy" not in snap
    assert next(t for t in snap["teams"] if t["name"] == "vision")["gpus"]["gpu"]["in_use"] == 1
    page = mallory.session.get(hub.url + "/hub/gpuhub").text
    assert "alice" not in page and "counts only" in page
    assert "alice" in admin.session.get(hub.url + "/hub/gpuhub").text


# -- finding 7: gpuhub APIs check the token's scopes, not its owner ----------------------------
def test_a_restricted_admin_token_cannot_read_the_status(hub, users):
    admin = users["admin"]
    r = admin.api.post(admin.url("/users/admin/tokens"), json={"note": "name only", "scopes": ["read:users:name!user=admin"]})
    assert r.status_code == 201, r.text
    narrow = {"Authorization": f"token {r.json()['token']}"}
    assert requests.get(hub.url + "/hub/api/user", headers=narrow).status_code == 200  # the token works...
    r = requests.get(hub.url + "/hub/api/gpuhub/status", headers=narrow)
    assert r.status_code == 403, r.text  # ...but carries no gpuhub scope
    # A token with only the counts scope sees counts, even though an admin owns it.
    r = admin.api.post(admin.url("/users/admin/tokens"), json={"note": "counts", "scopes": ["custom:gpuhub:status"]})
    assert r.status_code == 201, r.text
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {r.json()['token']}"}).json()
    assert snap["view"] != "all" and "policy" not in snap


def test_cull_warnings_and_snoozes_need_the_culling_scope_for_that_user(hub, users):
    admin, alice, mallory = users["admin"], users["alice"], users["mallory"]
    r = admin.api.post(admin.url("/users/admin/tokens"), json={"note": "narrow", "scopes": ["read:users:name!user=admin"]})
    narrow = {"Authorization": f"token {r.json()['token']}"}
    culling = hub.url + "/hub/api/gpuhub/culling/alice"
    for headers in (narrow, {"Authorization": f"token {mallory.token}"}):
        assert requests.get(culling, headers=headers).status_code == 404
        assert requests.post(culling + "/snooze", headers=headers, json={"server": ""}).status_code == 404
    assert requests.get(culling, headers={"Authorization": f"token {alice.token}"}).status_code == 200
    assert requests.get(culling, headers={"Authorization": f"token {admin.token}"}).status_code == 200


# -- finding 2: a page on bob's server, opened by carol, acts as carol -------------------------
ATTACK_PAGE = """<!doctype html><html><body><script>
async function attack() {
  const hub = %(hub)s;
  const out = {origin: location.origin};
  async function attempt(name, url, init) {
    try {
      const r = await fetch(url, Object.assign({credentials: "include"}, init || {}));
      const text = await r.text();
      out[name] = r.status + " " + (name.startsWith("home") ? text : text.slice(0, 300));
    } catch (e) { out[name] = "blocked: " + e; }
  }
  const mint = {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({note: "stolen-by-bob"})};
  await attempt("whoami", hub + "/hub/api/user");
  await attempt("home", hub + "/hub/home");
  await attempt("mint", hub + "/hub/api/users/carol/tokens", mint);
  await attempt("whoami_same_host", "/hub/api/user");
  await attempt("home_same_host", "/hub/home");
  let xsrf = null;
  const pattern = /xsrf_token: "([^"]+)"/;
  const m = pattern.exec(out.home_same_host || "") || pattern.exec(out.home || "");
  if (m) xsrf = m[1];
  const cookie = /_xsrf=([^;]+)/.exec(document.cookie);
  if (!xsrf && cookie) xsrf = cookie[1];
  out.xsrf = xsrf;
  if (xsrf) {
    const withXsrf = Object.assign({}, mint, {headers: {"Content-Type": "application/json", "X-XSRFToken": xsrf}});
    await attempt("mint_xsrf", hub + "/hub/api/users/carol/tokens", withXsrf);
    await attempt("mint_xsrf_same_host", "/hub/api/users/carol/tokens", withXsrf);
  }
  window.attackResult = out;
}
attack();
</script></body></html>
"""


def _publish_attack_page(hub, bob) -> str:
    """bob makes his own server serve a page to anyone, as any user can: from his kernel."""
    assert bob.start("cpu").status_code in (201, 202)
    server = bob.wait_ready()
    kernel = KernelSession(hub.url, server["url"], bob.token, "setup.ipynb")
    try:
        kernel.execute(
            "import os, pathlib\n"
            "home = pathlib.Path.home()\n"
            "(home / 'public').mkdir(exist_ok=True)\n"
            f"(home / 'public' / 'attack.html').write_text({ATTACK_PAGE % {'hub': json.dumps(hub.url)}!r})\n"
            "(home / '.jupyter').mkdir(exist_ok=True)\n"
            "(home / '.jupyter' / 'jupyter_server_config.py').write_text("
            "f'c.ServerApp.extra_static_paths = [{str(home / \"public\")!r}]\\n')\n"
        )
    finally:
        kernel.close()
    bob.stop()
    bob.wait_gone()
    assert bob.start("cpu").status_code in (201, 202)
    server = bob.wait_ready()
    url = hub.server_url(server["url"]) + "static/attack.html"
    assert requests.get(url).status_code == 200  # served without login: bob's choice
    return url


def _run_attack(hub, url) -> dict:
    with chromium() as browser:
        try:
            page = browser.new_context().new_page()
            log_in(page, hub.url, "carol")
            page.wait_for_url("**/hub/**")
            page.goto(url)
            page.wait_for_function("window.attackResult !== undefined", timeout=30_000)
            return page.evaluate("window.attackResult")
        finally:
            browser.close()


def _stolen_tokens(carol) -> list:
    tokens = carol.api.get(carol.url("/users/carol/tokens")).json()["api_tokens"]
    return [t for t in tokens if t.get("note") == "stolen-by-bob"]


@pytest.mark.browser
def test_a_page_on_bobs_server_cannot_act_as_carol(hub, clean):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    url = _publish_attack_page(hub, clean["bob"])
    assert url.startswith(hub.url.replace("://localhost", "://bob.localhost")), url  # bob's own origin
    result = _run_attack(hub, url)
    print("\n[attack with per-user origins]", json.dumps(result, indent=1)[:1500])
    assert result["origin"] != hub.url
    assert not _stolen_tokens(clean["carol"])
    assert not (result.get("whoami") or "").startswith("200"), result
    assert not (result.get("whoami_same_host") or "").startswith("200"), result
    # Whatever XSRF token the page finds belongs to an anonymous session on bob's origin
    # (the hub's login page), never to carol's: nothing is minted with it.
    for attempt in ("mint", "mint_xsrf", "mint_xsrf_same_host"):
        assert not (result.get(attempt) or "").startswith("201"), result
    for page in ("home", "home_same_host"):
        assert "carol" not in (result.get(page) or ""), result


@pytest.mark.browser
def test_the_same_attack_works_when_subdomains_are_turned_off(tmp_path):
    """Control: the attack is real. With subdomains off the hub warns at start, and it works."""
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    h = Hub(tmp_path, POLICY, env={"GPUHUB_SUBDOMAINS": "0"})
    h.start()
    try:
        assert "user servers share the hub's origin" in h.log.read_text()
        bob, carol = h.login("bob"), h.login("carol")
        url = _publish_attack_page(h, bob)
        result = _run_attack(h, url)
        print("\n[attack without per-user origins]", json.dumps(result, indent=1)[:600])
        assert result["origin"] == h.url
        assert (result.get("mint_xsrf") or "").startswith("201"), result
        assert _stolen_tokens(carol)
    finally:
        h.stop()
