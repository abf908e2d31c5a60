"""The one-machine hub end to end: a real JupyterHub, real single-user servers.

One hub for the module (starting hubs is the slow part). Virtual GPUs stand in for
NVML; everything else — login, groups, the spawn API, the queue, the processes and
their environments — is the real thing.
"""

import re
import time

import pytest
import requests

from support.hub import Hub

pytestmark = pytest.mark.integration

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 2}
priorityClasses:
  - {name: interactive, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    quota: {gpus: {gpu: {nominal: 1}}}
    perUser: {maxServers: 2, maxGPUs: 1}
  - name: nlp
    displayName: NLP
    groups: [nlp-group]
    quota: {gpus: {gpu: {nominal: 1}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision, nlp]}
  - {slug: nlp-only, displayName: NLP special, teams: [nlp]}
defaults:
  queueTimeout: 5m
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    # Queued spawns answer 202 after 3 s, not JupyterHub's 10 (nothing here tests that wait).
    h = Hub(tmp_path_factory.mktemp("hub"), POLICY, slow_spawn_timeout=3)
    h.start()
    print(f"\n[measure] hub start: {h.started_in:.2f}s")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("alice", "bob", "carol", "dave", "mallory", "admin")}


def stop_all(users):
    for u in users.values():
        for name in list(u.model()["servers"]):
            u.stop(name)
    for u in users.values():
        for name in list(u.model()["servers"]):
            u.wait_gone(name)


@pytest.fixture
def clean(users):
    stop_all(users)
    yield users
    stop_all(users)


def test_spawn_form_shows_only_team_profiles(hub, users):
    r = users["alice"].session.get(hub.url + "/hub/spawn")
    slugs = set(re.findall(r'name="profile" id="[^"]+" value="([^"]+)"', r.text))
    assert slugs == {"cpu", "gpu-1"}
    r = users["carol"].session.get(hub.url + "/hub/spawn")
    assert set(re.findall(r'name="profile" id="[^"]+" value="([^"]+)"', r.text)) == {"cpu", "gpu-1", "nlp-only"}
    r = users["dave"].session.get(hub.url + "/hub/spawn")  # in both teams: chooses
    assert 'name="team"' in r.text and "Vision Lab" in r.text and "NLP" in r.text
    r = users["mallory"].session.get(hub.url + "/hub/spawn")
    assert "not a member of any team" in r.text and "Traceback" not in r.text


def test_forged_requests_are_refused(clean):
    alice, mallory = clean["alice"], clean["mallory"]
    r = alice.start("nlp-only")
    assert r.status_code == 403 and "not available" in r.json()["message"]
    r = alice.start("gpu-1", gpus=4)
    assert r.status_code == 400 and "Unknown server option" in r.json()["message"]
    r = alice.start("no-such-profile")
    assert r.status_code == 400
    r = alice.start("gpu-1", team="nlp")
    assert r.status_code == 403 and "not a member of team 'nlp'" in r.json()["message"]
    r = mallory.start("cpu")
    assert r.status_code == 403 and "not a member of any team" in r.json()["message"]
    assert alice.server() is None and mallory.server() is None


def test_spawn_within_quota_gets_its_own_devices(clean):
    alice, carol = clean["alice"], clean["carol"]
    t0 = time.perf_counter()
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    print(f"\n[measure] one spawn (request to ready): {time.perf_counter() - t0:.2f}s")
    assert carol.start("gpu-1").status_code in (201, 202)
    carol.wait_ready()
    a, c = alice.server_env(), carol.server_env()
    assert a["CUDA_VISIBLE_DEVICES"] and c["CUDA_VISIBLE_DEVICES"]
    assert a["CUDA_VISIBLE_DEVICES"] != c["CUDA_VISIBLE_DEVICES"]
    assert (a["GPUHUB_TEAM"], a["GPUHUB_PROFILE"], a["GPUHUB_GPU_FLAVOR"]) == ("vision", "gpu-1", "gpu")
    # a CPU server sees no GPU at all
    assert clean["bob"].start("cpu").status_code in (201, 202)
    clean["bob"].wait_ready()
    assert clean["bob"].server_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_queue_past_quota_then_release_admits_next(hub, clean):
    alice, bob, dave = clean["alice"], clean["bob"], clean["dave"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    assert bob.start("gpu-1").status_code == 202  # waits instead of failing
    events = bob.progress(until=lambda e: "position" in e.get("message", ""))
    msg = events[-1]["message"]
    assert "position 1 of 1 in Vision Lab's queue" in msg
    assert "needs 1 Tesla GPU: your team Vision Lab is using 1 of the 1 it may hold" in msg and "alice" not in msg
    assert dave.start("gpu-1", team="vision").status_code == 202
    events = dave.progress(until=lambda e: "position 2" in e.get("message", ""))
    assert "position 2 of 2" in events[-1]["message"]
    # status page: counts for everyone
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {bob.token}"}).json()
    assert next(t for t in snap["teams"] if t["name"] == "vision")["waiting"] == 2
    assert "policy" not in snap  # policy health is for admins
    t0 = time.perf_counter()
    alice.stop()
    bob.wait_ready()
    print(f"\n[measure] stop -> next waiting server ready: {time.perf_counter() - t0:.2f}s")
    assert dave.server()["ready"] is False
    events = dave.progress(until=lambda e: "position 1 of 1" in e.get("message", ""))
    assert "position 1 of 1" in events[-1]["message"]


def test_admission_delay_after_stop(hub, clean):
    """The freed GPU is handed over on the stop event itself, not on a poll."""
    alice, bob = clean["alice"], clean["bob"]
    alice.start("gpu-1")
    alice.wait_ready()
    bob.start("gpu-1")
    bob.progress(until=lambda e: "position" in e.get("message", ""))
    alice.stop()
    alice.wait_gone()
    log = hub.log.read_text()
    released = [l for l in log.splitlines() if "Released alice/" in l][-1]
    admitted = [l for l in log.splitlines() if "Admitted bob/" in l][-1]

    def ts(line):
        return time.mktime(time.strptime(line[3:22], "%Y-%m-%d %H:%M:%S")) + float("0." + line[23:26])

    delay = ts(admitted) - ts(released)
    print(f"\n[measure] release -> admission of next: {delay * 1000:.0f} ms")
    lines = log.splitlines()
    assert lines.index(admitted) > lines.index(released)
    # Same synchronous call: only a descheduled hub process shows any gap; 3 s is far above that
    # on a loaded CI machine and still below what any periodic re-check would add.
    assert delay < 3.0
    bob.wait_ready()


def test_cancel_from_the_queue(hub, clean):
    alice, bob = clean["alice"], clean["bob"]
    alice.start("gpu-1")
    alice.wait_ready()
    bob.start("gpu-1")
    bob.progress(until=lambda e: "position" in e.get("message", ""))
    r = bob.stop()
    assert r.status_code in (202, 204)
    bob.wait_gone()
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {alice.token}"}).json()
    assert next(t for t in snap["teams"] if t["name"] == "vision")["waiting"] == 0
    alice.stop()
    alice.wait_gone()
    # the cancelled request did not take the freed GPU
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {alice.token}"}).json()
    assert all(d["user"] is None for d in snap["devices"])


def test_per_user_caps_refuse_before_queueing(clean):
    alice = clean["alice"]
    alice.start("gpu-1")
    alice.wait_ready()
    r = alice.start("gpu-1", server="second")
    assert r.status_code == 403 and "allows 1 GPU(s) per user" in r.json()["message"]
    assert alice.start("cpu", server="notes").status_code in (201, 202)
    alice.wait_ready("notes")
    r = alice.start("cpu", server="third")
    assert r.status_code == 403 and "allows 2 server(s) per user" in r.json()["message"]


def test_broken_policy_edit_keeps_last_good(hub, clean):
    admin, carol = clean["admin"], clean["carol"]
    good = hub.policy.read_text()
    try:
        hub.policy.write_text(good.replace("count: 1, flavor: gpu", "count: -1, flavor: gpu"))
        deadline = time.time() + 10
        snap = {}
        while time.time() < deadline:
            snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {admin.token}"}).json()
            if snap["policy"]["stale"]:
                break
            time.sleep(0.3)
        assert snap["policy"]["stale"]
        assert any("profiles[1].gpu.count: must be at least 0 (got -1)" in e for e in snap["policy"]["errors"])
        assert "policy.yaml:" in snap["policy"]["errors"][0]
        page = admin.session.get(hub.url + "/hub/home").text
        assert "Policy file has errors" in page
        # the hub keeps serving with the last good policy
        assert carol.start("gpu-1").status_code in (201, 202)
        carol.wait_ready()
        # a valid edit takes effect without a restart
        hub.policy.write_text(good.replace("displayName: NLP special", "displayName: NLP renamed"))
        deadline = time.time() + 10
        while time.time() < deadline and "NLP renamed" not in carol.session.get(hub.url + "/hub/spawn/carol/x").text:
            time.sleep(0.3)
        assert "NLP renamed" in carol.session.get(hub.url + "/hub/spawn/carol/x").text
    finally:
        hub.policy.write_text(good)
