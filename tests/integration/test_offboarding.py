"""Issue 42 item 4: off-boarding a leaver, on a real hub run as root, through the runbook's blocks.

A leaver with a running server, a batch job, a Ray cluster, a file in their home, an API token and a browser
session is off-boarded with ``gpuhub user offboard`` (docs/runbooks/offboarding.md): afterwards
no process of their Unix account runs, the token gets 403, the browser session is sent to the
login page, a login is refused with a message that says why (also after a hub restart), the home
is archived where only root reads it, and the audit trail says who did each step. Running it
again says so; reinstating lets them log in. A team lead cannot off-board anyone (403), an admin
cannot off-board themselves, an unknown name is refused, and none of these changes anything.
One hub for the module.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import requests

from support.hub import PASSWORD, Hub, wait_for
from support.browser import CHROMIUM, log_in
from test_runbooks import blocks, runbook, steps_run_by

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="servers and jobs run as their user's account: needs a hub run as root"),
]

POLICY = """\
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    leads: [vision-leads]
roles:
  admins: [platform-admins]
profiles:
  # 4Gi: the leaver's Ray cluster (--gpus 0) runs in this profile's cgroup, and a Ray head
  # outgrew 1Gi as its last processes started (run 39: OOM-killed before the off-boarding)
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 4Gi}
offboarding:
  home: archive
ray:
  enabled: true
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("offboarding"), POLICY)
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def admin(hub):
    return hub.login("admin")


def env_of(hub: Hub, admin, who: str) -> dict:
    return {
        "HUB": hub.url,
        "GPUHUB_TOKEN": admin.token,
        "DATA": hub.data,
        "POLICY": hub.policy,
        "WHO": who,
        "ACCOUNT": account(hub, who),
    }


def account(hub: Hub, name: str) -> str:
    return hub.env["GPUHUB_ACCOUNT_PREFIX"] + name


def processes_of(uid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^Uid:\s+(\d+)", status, re.M)
        if m and int(m.group(1)) == uid and not re.search(r"^State:\s+Z", status, re.M):  # a zombie has ended
            out.append(int(entry.name))
    return out


def login_attempt(hub: Hub, name: str) -> requests.Response:
    s = requests.Session()
    s.get(hub.url + "/hub/login")
    return s.post(
        hub.url + "/hub/login",
        data={"username": name, "password": PASSWORD, "_xsrf": s.cookies.get("_xsrf")},
        allow_redirects=False,
    )


def offboard(hub: Hub, who, name: str) -> requests.Response:
    return who.api.post(who.url(f"/gpuhub/users/{name}/offboard"))


def gpuhub_user(hub: Hub, token: str, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    env["GPUHUB_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "user", *args, "--hub", hub.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_leaver_is_offboarded_stays_out_across_a_restart_and_is_reinstated(hub, admin):
    alice = hub.login("alice")
    env = env_of(hub, admin, "alice")
    # What she has: a server with a file in her home, a batch job, a token, a browser session.
    assert alice.start("cpu").status_code in (201, 202)
    server = alice.wait_ready()
    contents = hub.server_url(server["url"]) + "api/contents/notes.txt"
    r = requests.put(
        contents,
        headers={"Authorization": f"token {alice.token}"},
        json={"type": "file", "format": "text", "content": "my results"},
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text
    job = alice.api.post(
        alice.url("/gpuhub/jobs"),
        json={"spec": f"profile: cpu\ncommand: [{sys.executable}, -c, 'import time; time.sleep(600)']\n"},
    )
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    wait_for(lambda: alice.api.get(alice.url(f"/gpuhub/jobs/{job_id}")).json()["state"] == "running", 90, f"{job_id} to run")
    ray = importlib.util.find_spec("ray") is not None  # the ray extra (pip install -e '.[ray]')
    if ray:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
        up = subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "ray", "--hub", hub.url, "up", "--gpus", "0", "--name", "leaver"],
            capture_output=True,
            text=True,
            env=dict(e, GPUHUB_TOKEN=alice.token),
            timeout=600,
        )
        assert "Ray cluster leaver: running" in up.stdout, up.stdout + up.stderr
    uid = pwd.getpwnam(account(hub, "alice")).pw_uid
    assert processes_of(uid), "alice's server, job and Ray cluster run under her account"
    assert alice.session.get(hub.url + "/hub/home", allow_redirects=False).status_code == 200

    out = runbook("offboarding", "check", env)
    assert re.search(r"^alice\s+active\s+servers: \(default\)", out, re.M), out

    out = runbook("offboarding", "offboard", env)
    assert "alice off-boarded by admin:" in out, out
    assert "jobs: cancelled 1 job(s)" in out and "servers: stopped 1 server(s)" in out, out
    assert not ray or "ray: stopped 1 Ray cluster(s): leaver" in out, out
    assert re.search(r"tokens: revoked [1-9]\d* token\(s\)", out) and "roles: left groups ['vision-lab']" in out, out
    assert "home archived to" in out and "FAILED" not in out, out

    # Nothing of hers runs; her token and her browser session are dead; her login is refused.
    assert not processes_of(uid), f"processes of alice's account after off-boarding: {processes_of(uid)}"
    assert admin.api.get(admin.url("/users/alice")).json()["servers"] == {}
    # (gpuhub's jobs API sends an unauthenticated request to the login page, as its pages do)
    r = alice.api.get(alice.url(f"/gpuhub/jobs/{job_id}"), allow_redirects=False)
    assert r.status_code == 403 or (r.status_code == 302 and "/hub/login" in r.headers["Location"]), r.status_code
    assert admin.api.get(admin.url(f"/gpuhub/jobs/{job_id}")).json()["state"] == "cancelled"
    assert alice.api.get(alice.url("/user")).status_code == 403
    home = alice.session.get(hub.url + "/hub/home", allow_redirects=False)
    assert home.status_code == 302 and "/hub/login" in home.headers["Location"], (home.status_code, home.headers)
    refused = login_attempt(hub, "alice")
    assert refused.status_code == 403 and "alice was off-boarded by admin" in refused.text, refused.text[-2000:]
    assert "Ask a gpuhub admin to reinstate" in refused.text

    # Her home: archived where only root reads it, then removed.
    archives = list((hub.data / "offboarded-homes").glob("alice-*.tar.gz"))
    assert len(archives) == 1, archives
    st = archives[0].stat()
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600 and (st.st_mode & 0o077) == 0
    with tarfile.open(archives[0]) as tar:
        names = tar.getnames()
        notes = next(n for n in names if n.endswith("/notes.txt"))
        assert tar.extractfile(notes).read() == b"my results"
    assert not (hub.data / "home" / "alice").exists()

    # The audit trail says who did what.
    entries = admin.api.get(admin.url("/gpuhub/audit"), params={"user": "alice"}).json()["entries"]
    steps = {e["step"]: e for e in entries if e["event"] == "offboard_step"}
    assert set(steps) >= {"ray", "jobs", "servers", "tokens", "roles", "home", "mlflow"}, steps
    assert all(e["by"] == "admin" for e in steps.values())
    assert any(e["event"] == "offboarded" and e["by"] == "admin" and not e.get("failed") for e in entries)
    assert any(e["event"] == "acted_on_server" and e.get("why") == "offboarded" for e in entries)

    out = runbook("offboarding", "verify", env)
    assert "processes of " + account(hub, "alice") + ": 0" in out and "offboarded alice by admin failed: none" in out, out

    # Twice is fine, and says so.
    out = runbook("offboarding", "offboard", env)
    assert "alice was already off-boarded" in out and "stopped 0 server(s)" in out, out

    # The block is in the hub's data directory: a restart keeps it.
    hub.stop(kill_servers=False)
    hub.start()
    refused = login_attempt(hub, "alice")
    assert refused.status_code == 403 and "off-boarded" in refused.text

    out = runbook("offboarding", "reinstate", env)
    assert "alice reinstated by admin" in out, out
    back = hub.login("alice")  # raises unless the login succeeds
    assert {g["name"] if isinstance(g, dict) else g for g in back.model()["groups"]} == {"vision-lab"}
    out = runbook("offboarding", "reinstate", env)
    assert "alice was not off-boarded; nothing to do" in out


def test_a_team_lead_cannot_offboard_anyone_and_bad_requests_change_nothing(hub, admin):
    lena, bob = hub.login("lena"), hub.login("bob")
    r = offboard(hub, lena, "bob")
    assert r.status_code == 403 and "admin:users" in r.json()["message"], r.text
    r = gpuhub_user(hub, lena.token, "offboard", "bob")
    assert r.returncode == 1 and "gpuhub user offboard: Off-boarding and reinstating are for hub admins" in r.stderr, r.stderr
    r = lena.api.post(lena.url("/gpuhub/users/bob/reinstate"))
    assert r.status_code == 403
    # A researcher's token cannot list users either.
    assert bob.api.get(bob.url("/gpuhub/users")).status_code == 403

    r = gpuhub_user(hub, admin.token, "offboard", "nobody-here")
    assert r.returncode == 1 and "No user 'nobody-here' in this hub (nothing was changed)" in r.stderr, r.stderr
    r = gpuhub_user(hub, admin.token, "offboard", "admin")
    assert r.returncode == 1 and "You cannot off-board yourself" in r.stderr, r.stderr

    # Nothing changed: bob's token works, he logs in, admin too; nobody is listed as off-boarded.
    assert bob.api.get(bob.url("/user")).status_code == 200
    hub.login("bob")
    assert admin.api.get(admin.url("/user")).json()["admin"] is True
    listed = {u["name"]: u for u in admin.api.get(admin.url("/gpuhub/users")).json()["users"]}
    assert listed["bob"]["offboarded"] is None and listed["admin"]["offboarded"] is None
    entries = admin.api.get(admin.url("/gpuhub/audit"), params={"user": "bob", "event": "offboard_started"}).json()["entries"]
    assert entries == []


def test_the_users_page_offers_offboarding_to_admins_only(hub, admin):
    hub.login("bob")  # an account of the hub (each test stands alone)
    page = admin.session.get(hub.url + "/hub/gpuhub/users")
    assert page.status_code == 200
    assert 'class="btn btn-sm btn-outline-danger gpuhub-offboard" data-user="bob"' in page.text
    assert 'data-user="admin"><td>admin' in page.text and 'gpuhub-offboard" data-user="admin"' not in page.text
    assert "window.confirm(" in page.text
    lena = hub.login("lena")
    assert lena.session.get(hub.url + "/hub/gpuhub/users").status_code == 403


def test_a_step_that_fails_is_said_the_others_still_run_and_a_rerun_finishes_it(hub, admin):
    dave = hub.login("dave")
    home = hub.data / "home" / "dave"  # where the spawner keeps his home (he never started a server)
    home.mkdir(parents=True, exist_ok=True)
    (home / "data.csv").write_text("1,2,3\n")
    archives = hub.data / "offboarded-homes"
    aside = hub.data / "offboarded-homes.aside"
    if archives.exists():
        archives.rename(aside)
    archives.write_text("not a directory")  # the archive cannot be written
    try:
        r = gpuhub_user(hub, admin.token, "offboard", "dave")
        assert r.returncode == 1, r.stdout + r.stderr
        assert re.search(r"^  home: FAILED: \w+Error", r.stdout, re.M), r.stdout
        assert "tokens: revoked" in r.stdout and "roles: left groups" in r.stdout, r.stdout  # the others ran
        assert "steps that failed: home" in r.stdout
        assert (home / "data.csv").read_text() == "1,2,3\n"  # nothing lost
        assert dave.api.get(dave.url("/user")).status_code == 403
        assert login_attempt(hub, "dave").status_code == 403
        (done,) = admin.api.get(admin.url("/gpuhub/audit"), params={"user": "dave", "event": "offboarded"}).json()["entries"]
        assert done["by"] == "admin" and done["failed"] == ["home"], done
    finally:
        archives.unlink()
        if aside.exists():
            aside.rename(archives)
    try:
        r = gpuhub_user(hub, admin.token, "offboard", "dave")
        assert r.returncode == 0 and "dave was already off-boarded" in r.stdout and "home: home archived to" in r.stdout, r.stdout
        assert not home.exists() and list(archives.glob("dave-*.tar.gz"))
    finally:
        gpuhub_user(hub, admin.token, "reinstate", "dave")


@pytest.mark.browser
def test_in_a_browser_the_offboard_button_asks_first_and_shows_what_it_did(hub, admin, request):
    import shutil

    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    browser = request.getfixturevalue("browser")
    carol, erin = hub.login("carol"), hub.login("erin")
    page = browser.new_context().new_page()
    log_in(page, hub.url, "admin")
    page.wait_for_load_state()
    try:
        assert page.goto(hub.url + "/hub/gpuhub/users").status == 200
        asked: list[str] = []
        # Declined: nothing happens to carol.
        page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        page.click('button.gpuhub-offboard[data-user="carol"]')
        assert asked and asked[0].startswith("Off-board carol?"), asked
        assert carol.api.get(carol.url("/user")).status_code == 200
        # Confirmed: erin is off-boarded and the page says what each step did.
        page.once("dialog", lambda d: (asked.append(d.message), d.accept()))
        page.click('button.gpuhub-offboard[data-user="erin"]')
        result = page.locator("#gpuhub-users-result.alert-success")
        result.wait_for(timeout=30_000)
        shown = result.inner_text()
        assert "login: blocked" in shown and "tokens: revoked" in shown and "roles: left groups ['students']" in shown, shown
        assert erin.api.get(erin.url("/user")).status_code == 403
        assert login_attempt(hub, "erin").status_code == 403
    finally:
        page.context.close()
        admin.api.post(admin.url("/gpuhub/users/erin/reinstate"))


def test_every_marked_block_of_the_page_is_run_by_a_test():
    missing = sorted(
        f"runbook:offboarding/{step}" for step in blocks("offboarding") if ("offboarding", step) not in steps_run_by(__file__)
    )
    assert not missing, f"marked blocks no test runs: {missing}"
