"""Login through a real OpenID Connect provider: groups from the IdP become teams.

The provider (tests/support/oidc_idp.py) is a small real server speaking the
authorization-code flow with PKCE, started by the test; the hub runs the stock
OAuthenticator (GenericOAuthenticator) chosen in a site file, exactly as an operator
would configure it for Keycloak or Authentik. Nothing in the authenticator is patched.
"""

import os
import re

import pytest
import requests

from support.hub import Hub
from support.oidc_idp import OidcProvider
from test_local_hub import POLICY

pytestmark = pytest.mark.integration

SECRET = "idp-client-secret-" + os.urandom(6).hex()


@pytest.fixture(scope="module")
def idp_and_hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("oidc")
    h = Hub(work, POLICY)
    idp = OidcProvider("gpuhub", SECRET, f"{h.url}/hub/oauth_callback").start()
    idp.add_user("carol", "carol-pw", ["nlp-group"])
    idp.add_user("dave", "dave-pw", ["nlp-group", "vision-lab"])
    idp.add_user("zed", "zed-pw", ["marketing"])
    idp.add_user("root", "root-pw", ["platform-admins"])
    secret = work / "client-secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, SECRET.encode())
    os.close(fd)
    site = work / "site.yaml"
    site.write_text(
        f"public_url: {h.url}\n"
        "auth:\n"
        "  kind: oidc\n"
        "  client_id: gpuhub\n"
        f"  client_secret_file: {secret}\n"
        f"  authorize_url: {idp.url}/authorize\n"
        f"  token_url: {idp.url}/token\n"
        f"  userinfo_url: {idp.url}/userinfo\n"
        "  admin_groups: [platform-admins]\n"
    )
    h.extra_env["GPUHUB_SITE_CONFIG"] = str(site)
    h.start()
    yield idp, h
    h.stop()
    idp.stop()


def oidc_login(hub, idp, name, password):
    """What a browser does: hub -> IdP login form -> hub callback. Returns (session, final response)."""
    s = requests.Session()
    r = s.get(hub.url + "/hub/oauth_login", allow_redirects=False)
    assert r.status_code == 302 and r.headers["Location"].startswith(idp.url + "/authorize?"), r.headers
    form = s.get(r.headers["Location"])
    assert form.status_code == 200, form.text
    fields = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', form.text))
    fields.update(username=name, password=password)
    r = s.post(idp.url + "/authorize", data=fields, allow_redirects=False)
    if r.status_code != 302:
        return s, r
    return s, s.get(r.headers["Location"])  # the hub's callback, then on to the hub


def api_token(hub, s, name):
    xsrf = s.cookies.get("_xsrf", path="/hub/") or s.cookies.get("_xsrf")
    r = s.post(f"{hub.url}/hub/api/users/{name}/tokens", headers={"X-XSRFToken": xsrf}, json={"note": "t"})
    r.raise_for_status()
    return r.json()["token"]


def test_oidc_login_maps_idp_groups_to_teams(idp_and_hub):
    idp, hub = idp_and_hub
    s, r = oidc_login(hub, idp, "dave", "dave-pw")
    assert r.status_code == 200 and "/hub/" in r.url, (r.status_code, r.url)
    assert ["GET /authorize", "POST /authorize", "POST /token", "GET /userinfo"] == idp.log[-4:]
    token = api_token(hub, s, "dave")
    me = requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}).json()
    assert me["name"] == "dave" and sorted(me["groups"]) == ["nlp-group", "vision-lab"]
    assert not me["admin"]
    form = s.get(hub.url + "/hub/spawn/dave").text
    assert "Vision Lab" in form and "NLP" in form  # both teams' profiles, from the IdP's groups


def test_group_changes_at_the_idp_apply_at_the_next_login(idp_and_hub):
    idp, hub = idp_and_hub
    s, r = oidc_login(hub, idp, "carol", "carol-pw")
    assert r.status_code == 200
    token = api_token(hub, s, "carol")
    assert requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}).json()["groups"] == ["nlp-group"]
    idp.users["carol"]["groups"] = ["vision-lab"]  # moved to another team at the IdP
    try:
        s, r = oidc_login(hub, idp, "carol", "carol-pw")
        token = api_token(hub, s, "carol")
        assert requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}).json()["groups"] == [
            "vision-lab"
        ]
    finally:  # the IdP as the other tests know it (any order)
        idp.users["carol"]["groups"] = ["nlp-group"]


def test_admin_comes_from_the_idp_group(idp_and_hub):
    idp, hub = idp_and_hub
    s, r = oidc_login(hub, idp, "root", "root-pw")
    assert r.status_code == 200
    token = api_token(hub, s, "root")
    assert requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}).json()["admin"] is True


def test_users_in_no_policy_group_and_bad_passwords_do_not_get_in(idp_and_hub):
    idp, hub = idp_and_hub
    s, r = oidc_login(hub, idp, "zed", "zed-pw")  # authenticated by the IdP, but in no team's group
    assert r.status_code == 403
    assert requests.get(f"{hub.url}/hub/api/users/zed", headers={"Authorization": "token none"}).status_code == 403
    s, r = oidc_login(hub, idp, "carol", "wrong")
    assert r.status_code == 401 and "POST /token" not in idp.log[-1:]
    # the demo password is not a way in once the site picks OIDC
    s = requests.Session()
    s.get(hub.url + "/hub/login")
    r = s.post(
        hub.url + "/hub/login",
        data={"username": "alice", "password": "test-password-123", "_xsrf": s.cookies.get("_xsrf")},
        allow_redirects=False,
    )
    assert r.status_code != 302 or "oauth" in r.headers.get("Location", "")


def test_a_forged_callback_is_refused(idp_and_hub):
    idp, hub = idp_and_hub
    s = requests.Session()
    s.get(hub.url + "/hub/oauth_login", allow_redirects=False)  # a state cookie for this browser
    r = s.get(hub.url + "/hub/oauth_callback?code=made-up&state=made-up")
    assert r.status_code in (400, 403)
