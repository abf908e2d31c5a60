"""Issue 26's done-when, against one real hub with real servers: alice holds 2 A100s, dave waits;
an admin previews lowering Vision Lab's A100 quota from 2 to 1 and removing the 2×A100 profile,
applies it and rolls it back (API and ``gpuhub policy``), both audited with their diffs; a lead
previews their own team only, a researcher is refused, a broken edit changes nothing, and an
edit on disk is recorded as such."""

import os
import subprocess
import sys
import time

import pytest

from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
flavors:  # The lab's GPU policy. Ask #gpu-admins before raising a quota.
  - {name: a100, displayName: A100, local: {virtual: 3}}   # virtual: no NVIDIA driver here
priorityClasses:
  - {name: interactive, value: 1000}
roles:
  admins: [platform-admins]
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    leads: [vision-leads]
    defaultPriority: interactive
    quota: {gpus: {a100: {nominal: 2}}}
    perUser: {maxServers: 2, maxGPUs: 2}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    quota: {gpus: {a100: {nominal: 1}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, env: {HF_TOKEN: hf-secret-123}}
  - {slug: a100-1, displayName: 1× A100, gpu: {count: 1, flavor: a100}, teams: [vision, nlp]}
  - {slug: a100-2, displayName: 2× A100, gpu: {count: 2, flavor: a100}, teams: [vision]}
defaults:
  queueTimeout: 10m
"""
EDIT = (
    POLICY.replace("a100: {nominal: 2}", "a100: {nominal: 1}")
    .replace("maxGPUs: 2", "maxGPUs: 1")
    .replace("  - {slug: a100-2, displayName: 2× A100, gpu: {count: 2, flavor: a100}, teams: [vision]}\n", "")
)
assert EDIT.count("nominal: 1") == 2 and "a100-2" not in EDIT
LEAD_EDIT = EDIT.replace("hf-secret-123", "'***'")  # what a lead can send: the environment values masked


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("policy-changes"), POLICY) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("admin", "alice", "dave", "lena", "carol")}


@pytest.fixture(scope="module")
def busy(hub, users):
    """alice on two A100s (Vision Lab's whole quota), dave waiting in Vision Lab's queue."""
    alice, dave = users["alice"], users["dave"]
    assert alice.start("a100-2").status_code in (201, 202)
    alice.wait_ready()
    dave.start_background("a100-1", team="vision")
    wait_for(
        lambda: any(
            w["user"] == "dave" for w in users["admin"].api.get(users["admin"].url("/gpuhub/status")).json().get("waiting", [])
        ),
        30,
        "dave waiting",
    )
    yield
    for name in ("dave", "alice"):
        users[name].stop()
    for name in ("dave", "alice"):
        users[name].wait_gone()


def post(client, action, **body):
    return client.api.post(client.url(f"/gpuhub/policy/{action}"), json=body)


def lines(rep, section):
    return [ln["text"] for s in rep["impact"]["sections"] if s["name"] == section for ln in s["lines"]]


def audit(admin, event):
    r = admin.api.get(admin.url("/gpuhub/audit"), params={"event": event})
    r.raise_for_status()
    return r.json()["entries"]


def test_the_admin_sees_who_the_edit_hits_then_applies_and_rolls_it_back(hub, users, busy):
    admin, alice = users["admin"], users["alice"]
    had = admin.api.get(admin.url("/gpuhub/policy")).json()["versions"]  # other tests' versions (any order)
    r = post(admin, "preview", yaml=EDIT)
    assert r.status_code == 200, r.text
    rep = r.json()
    running = " ".join(lines(rep, "running"))
    assert "Vision Lab holds 2 A100 GPUs and its new quota is 1 (1 over): alice's server (2, profile a100-2" in running
    assert "nothing is stopped: it keeps running until its user stops it or it is culled" in running
    assert "alice's server runs profile 2× A100 (a100-2), which the new policy removes: it keeps running" in running
    (dave,) = [t for t in lines(rep, "waiting") if t.startswith("dave's server")]
    assert (
        "waits longer: Vision Lab may hold 1 A100 GPUs instead of 2; 2 of Vision Lab's GPUs in use (held by alice's server)"
        in dave
    )
    assert "Profile 2× A100 (a100-2) is removed; 3 user(s) lose it: alice, dave, lena" in lines(rep, "profiles")[0]
    assert "admin" not in lines(rep, "profiles")[0] and "carol" not in lines(rep, "profiles")[0]  # not in Vision Lab
    assert lines(rep, "quotas") == ["Vision Lab: A100 GPUs quota 2 → 1 (-1); GPUs per user 2 → 1."]
    before = hub.policy.read_text()
    assert before == POLICY  # a preview writes nothing

    r = post(admin, "apply", yaml=EDIT, base=rep["base"])
    assert r.status_code == 200, r.text
    applied = r.json()["version"]
    assert applied["by"] == "admin" and applied["source"] == "applied"
    assert hub.policy.read_text() == EDIT and (hub.policy.parent / "policy.yaml.previous").read_text() == POLICY
    state = admin.api.get(admin.url("/gpuhub/policy")).json()
    assert state["version"]["n"] == applied["n"] and not state["status"]["stale"]
    # What the preview said: alice keeps running on her removed profile; dave still waits.
    assert alice.server()["ready"]
    assert users["dave"].server() and not users["dave"].server()["ready"]
    r = alice.start("a100-2", server="again")
    assert r.status_code == 400 and "There is no profile 'a100-2'" in r.text  # the new policy is in force
    (entry,) = [e for e in audit(admin, "policy_applied") if e["version"] == applied["n"]]
    assert entry["by"] == "admin" and "-        nominal: 2\n+        nominal: 1" in entry["diff"]
    assert "hf-secret-123" not in entry["diff"]
    assert "-  displayName: 2× A100" in entry["diff"] or "a100-2" in entry["diff"]

    r = post(admin, "rollback", version=1)
    assert r.status_code == 200, r.text
    back = r.json()["version"]
    assert back["source"] == "rollback" and back["rollback_to"] == 1 and hub.policy.read_text() == POLICY
    (entry,) = [e for e in audit(admin, "policy_rolled_back") if e["version"] == back["n"]]
    assert entry["by"] == "admin" and entry["to_version"] == 1 and "-        nominal: 1\n+        nominal: 2" in entry["diff"]
    history = admin.api.get(admin.url("/gpuhub/policy")).json()["versions"]
    assert [v["source"] for v in history[:3]] == ["rollback", "applied", had[0]["source"]]


def test_a_lead_previews_their_team_only_and_a_researcher_is_refused(hub, users, busy):
    lena, carol = users["lena"], users["carol"]
    # the lead reads the policy with environment values masked, and previewing that text back
    # changes nothing (the masks are read as the values in force, not as an edit of every team)
    state = lena.api.get(lena.url("/gpuhub/policy")).json()
    assert "hf-secret-123" not in state["text"] and "HF_TOKEN: '***'" in state["text"] and state["path"] is None
    # ... as the admin wrote it (issue 43 item 4): comments, layout and flow style kept, only the values masked
    assert state["text"] == POLICY.replace("hf-secret-123", "'***'"), state["text"]
    assert "hf-secret-123" in users["admin"].api.get(users["admin"].url("/gpuhub/policy")).json()["text"]
    r = post(lena, "preview", yaml=state["text"])
    assert r.status_code == 200, r.text
    assert all(not s["lines"] for s in r.json()["impact"]["sections"])
    r = post(lena, "preview", yaml=LEAD_EDIT)
    assert r.status_code == 200, r.text
    assert any("alice's server" in t for t in lines(r.json(), "running"))
    # A profile-only edit is named, not "No change for anyone" (issue 43 item 4).
    r = post(lena, "preview", yaml=state["text"].replace("teams: [vision]}", "teams: [vision], memory: 8Gi}"))
    assert r.status_code == 200, r.text
    assert lines(r.json(), "profiles") == [
        "Profile 2× A100 (a100-2) changes: memory (default) -> 8Gi (for Vision Lab: alice, dave, lena)."
    ], r.json()
    other = POLICY.replace("a100: {nominal: 1}}}\nprofiles", "a100: {nominal: 0}}}\nprofiles")
    r = post(lena, "preview", yaml=other)
    assert r.status_code == 403 and "changes team(s) you do not lead: nlp" in r.json()["message"]
    r = post(lena, "apply", yaml=EDIT)
    assert r.status_code == 403 and "Only admins may apply" in r.json()["message"]
    for action in ("preview", "apply", "rollback"):
        r = post(carol, action, yaml=EDIT, version=1)
        assert r.status_code == 403, (action, r.text)
    assert carol.api.get(carol.url("/gpuhub/policy")).status_code == 403
    assert hub.policy.read_text() == POLICY


def test_a_broken_edit_is_refused_at_its_line_and_changes_nothing(hub, users, busy):
    admin = users["admin"]
    state = admin.api.get(admin.url("/gpuhub/policy")).json()
    broken = EDIT.replace("a100: {nominal: 1}}}\n    perUser", "a100: {nominal: 1, lendingLimit: 3}}}\n    perUser")
    r = post(admin, "apply", yaml=broken)
    assert r.status_code == 400
    (err,) = r.json()["errors"]
    assert (err["line"], err["path"], err["message"]) == (
        13,
        "teams[0].quota.gpus.a100.lendingLimit",
        "lendingLimit 3 is above the nominal quota 1",
    )
    r = post(admin, "apply", yaml="a: &a [1]\nb: *a\n")
    assert r.status_code == 400 and "anchors and aliases are not accepted" in r.json()["errors"][0]["message"]
    r = admin.api.post(admin.url("/gpuhub/policy/apply"), data=b"{" * 300_000)
    assert r.status_code == 413
    after = admin.api.get(admin.url("/gpuhub/policy")).json()
    assert hub.policy.read_text() == POLICY and after["hash"] == state["hash"] and after["versions"] == state["versions"]


def _big(teams: int, profiles: int) -> str:
    extra = "".join(
        f"  - {{name: t{i}, groups: [vision-lab, nlp-group], quota: {{gpus: {{a100: {{nominal: 0}}}}}}}}\n" for i in range(teams)
    )
    profs = "".join(f"  - {{slug: p{i}, displayName: P{i}, teams: '*'}}\n" for i in range(profiles))
    return LEAD_EDIT.replace("profiles:\n", extra + "profiles:\n" + profs)


def test_a_leads_preview_of_other_teams_is_refused_before_its_impact_and_one_at_a_time(hub, users, busy):
    """Review finding 1: teams x profiles x users of impact cost minutes of the hub's CPU before the
    lead's refusal; now the touched teams refuse it first, and a second preview of the same lead
    while one is checked gets 429."""
    import concurrent.futures

    lena = users["lena"]
    big = _big(1000, 1500)
    assert len(big) < 200_000
    t0 = time.monotonic()
    r = post(lena, "preview", yaml=big)
    took = time.monotonic() - t0
    assert r.status_code == 403 and "changes team(s) you do not lead: nlp, t0, t1, " in r.json()["message"]
    assert took < 3, f"the refusal took {took:.1f} s"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(lena, "preview", yaml=big), range(4)))
    codes = sorted(a.status_code for a in answers)
    assert 403 in codes and 429 in codes and set(codes) <= {403, 429}, codes
    (busy_answer, *_) = [a for a in answers if a.status_code == 429]
    assert "You already have a policy change being checked" in busy_answer.json()["message"]
    assert post(lena, "preview", yaml=LEAD_EDIT).status_code == 200  # free again once answered
    assert hub.policy.read_text() == POLICY


def test_a_lead_never_reads_secrets_from_a_broken_file_nor_confirms_a_guess(hub, users):
    """Review findings 2 and 3."""
    lena, admin = users["lena"], users["admin"]
    before = admin.api.get(admin.url("/gpuhub/policy")).json()["versions"]
    hub.policy.write_text(POLICY + "teams: [\n")
    try:
        wait_for(
            lambda: admin.api.get(admin.url("/gpuhub/policy")).json()["status"].get("stale"),
            20,
            "the broken file noticed",
            interval=0.5,
        )
        r = lena.api.get(lena.url("/gpuhub/policy"))
        assert r.status_code == 200 and "hf-secret-123" not in r.text
        state = r.json()
        assert state["note"].startswith("The policy file on disk does not parse; shown is version ")
        assert "HF_TOKEN: '***'" in state["text"] and "nominal: 2" in state["text"]
    finally:
        hub.policy.write_text(POLICY)
        wait_for(
            lambda: not admin.api.get(admin.url("/gpuhub/policy")).json()["status"].get("stale"),
            20,
            "the file good again",
            interval=0.5,
        )
    # a guess of another team's secret: refused whether right or wrong, and nothing changes
    for guess in ("hf-secret-123", "hf-wrong-guess"):
        r = post(lena, "preview", yaml=POLICY.replace("hf-secret-123", guess))
        assert r.status_code == 403 and "changes team(s) you do not lead: nlp" in r.json()["message"], (guess, r.text)
    assert post(lena, "preview", yaml=LEAD_EDIT).status_code == 200
    assert admin.api.get(admin.url("/gpuhub/policy")).json()["versions"] == before and hub.policy.read_text() == POLICY


def test_an_admin_applying_masked_text_keeps_the_secrets_and_leads_see_only_their_history(hub, users):
    """Review findings 4, 5 and 7."""
    lena, admin = users["lena"], users["admin"]
    # a change of Vision Lab's own (applied and rolled back), which its lead sees with its summary
    r = post(admin, "apply", yaml=EDIT)
    assert r.status_code == 200, r.text
    assert post(admin, "rollback", version=1).status_code == 200
    masked = lena.api.get(lena.url("/gpuhub/policy")).json()["text"]
    assert "HF_TOKEN: '***'" in masked
    # a lead adding a group: the people it brings in are counted, not named
    r = post(lena, "preview", yaml=masked.replace("groups: [vision-lab]", "groups: [vision-lab, platform-admins]", 1))
    assert r.status_code == 200, r.text
    words = " ".join(lines(r.json(), "profiles"))
    assert "1 person outside your teams would join Vision Lab" in words and "admin" not in words
    r = post(lena, "preview", yaml=masked.replace("groups: [vision-lab]", "groups: [vision-lab, nlp-group]", 1))
    assert r.status_code == 403 and "nlp" in r.json()["message"]
    nlp_down = masked.replace("a100: {nominal: 1}}}\nprofiles", "a100: {nominal: 0}}}\nprofiles")
    assert nlp_down != masked
    r = post(admin, "apply", yaml=nlp_down, summary="NLP Group down to no A100")
    assert r.status_code == 200, r.text
    applied = r.json()["version"]
    assert 'HF_TOKEN: "hf-secret-123"' in hub.policy.read_text() and "***" not in hub.policy.read_text()
    assert "flavors:  # The lab's GPU policy." in hub.policy.read_text()  # the lead's text, applied: comments kept
    history = {v["n"]: v for v in lena.api.get(lena.url("/gpuhub/policy")).json()["versions"]}
    assert set(history[applied["n"]]) == {"n", "hash", "by", "at", "source"}  # NLP's change: no summary
    vision_only = [v for v in history.values() if v.get("summary", "").startswith("Vision Lab: A100 GPUs quota 2 → 1")]
    assert vision_only  # the apply above changed Vision Lab alone
    assert not any("NLP" in (v.get("summary") or "") for v in history.values())
    r = post(admin, "rollback", version=1)
    assert r.status_code == 200, r.text
    assert hub.policy.read_text() == POLICY


def policy_cli(hub, client):
    """``gpuhub policy ARGS --hub URL`` as ``client``, with their token (the CLI's env)."""
    env = dict(os.environ, GPUHUB_TOKEN=client.token)
    env.pop("JUPYTERHUB_API_URL", None)

    def gpuhub(*args):
        return subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "policy", *args, "--hub", hub.url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return gpuhub


def test_the_same_through_the_gpuhub_policy_commands(hub, users, busy, tmp_path):
    admin = users["admin"]
    new = tmp_path / "new.yaml"
    new.write_text(EDIT)
    gpuhub = policy_cli(hub, admin)

    out = gpuhub("diff", str(new))
    assert out.returncode == 0, out.stderr
    assert "alice's server runs profile 2× A100 (a100-2), which the new policy removes" in out.stdout
    assert "dave's server (1 A100 GPU" in out.stdout and "waits longer" in out.stdout
    assert "3 user(s) lose it: alice, dave, lena" in out.stdout
    assert hub.policy.read_text() == POLICY
    out = gpuhub("apply", str(new), "--summary", "Vision Lab down to one A100")
    assert out.returncode == 0, out.stderr
    assert hub.policy.read_text() == EDIT and "is in force" in out.stdout
    out = gpuhub("history")
    assert out.returncode == 0 and "Vision Lab down to one A100 *" in out.stdout, out.stdout
    assert "* the version in force now" in out.stdout.splitlines()  # the mark's legend
    out = gpuhub("rollback", "1")
    assert out.returncode == 0, out.stderr
    assert hub.policy.read_text() == POLICY
    entries = audit(admin, "policy_applied") + audit(admin, "policy_rolled_back")
    assert any(e.get("summary") == "Vision Lab down to one A100" and "+        nominal: 1" in e["diff"] for e in entries)
    bad = tmp_path / "bad.yaml"
    bad.write_text(EDIT.replace("maxGPUs: 1", "maxGPUs: 5"))
    out = gpuhub("apply", str(bad))
    assert out.returncode == 1 and f"{bad}:14:" in out.stderr and "per-user cap of 5 GPUs" in out.stderr
    assert hub.policy.read_text() == POLICY
    offline = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "policy", "diff", str(new), "--against", str(hub.policy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert offline.returncode == 0 and "Vision Lab: A100 GPUs quota 2 → 1 (-1)" in offline.stdout


def test_an_edit_on_disk_keeps_working_and_is_recorded_as_such(hub, users):
    admin = users["admin"]
    start = admin.api.get(admin.url("/gpuhub/policy")).json()
    hub.policy.write_text(POLICY.replace("queueTimeout: 10m", "queueTimeout: 15m"))
    try:

        def recorded():
            vs = admin.api.get(admin.url("/gpuhub/policy")).json()["versions"]
            return vs[0] if vs[0]["source"] == "edited on disk" and vs[0]["n"] > start["versions"][0]["n"] else None

        v = wait_for(recorded, 20, "the edit on disk in the history", interval=0.5)
        (entry,) = [e for e in audit(admin, "policy_edited_on_disk") if e["version"] == v["n"]]
        assert "+  queueTimeout: 15m" in entry["diff"]
        assert v["summary"] == "edited on disk: the defaults change" and v["by"].startswith("file owner ")
    finally:  # the policy the other tests start from, in force again (each test passes in any order)
        hub.policy.write_text(POLICY)
        wait_for(
            lambda: admin.api.get(admin.url("/gpuhub/policy")).json()["hash"] == start["hash"],
            20,
            "the policy back as it was",
            interval=0.5,
        )


# 8 A100s promised on a machine of 3, to a team nobody is in: applying it (forced) admits nobody
# more, so the module's other tests find the queue as they left it.
IMPOSSIBLE = POLICY.replace(
    "profiles:\n",
    "  - name: ghost\n    displayName: Ghost Team\n    groups: [nobody-here]\n    quota: {gpus: {a100: {nominal: 8}}}\nprofiles:\n",
    1,
)


def test_an_impossible_quota_is_warned_in_the_preview_and_applies_only_when_confirmed(hub, users, tmp_path):
    """Issue 43 item 3: what `gpuhub validate` warns (8 A100s promised on a machine of 3: the reclaim
    guarantee cannot hold) is in the preview, refused by a plain apply, applied with force, and
    `gpuhub policy diff|apply` say it too (apply needs --force)."""
    admin = users["admin"]
    assert IMPOSSIBLE != POLICY
    r = post(admin, "preview", yaml=IMPOSSIBLE)
    assert r.status_code == 200, r.text
    warned = lines(r.json(), "warnings")
    assert any("a nominal quota of 8 A100 but this machine has 3" in w for w in warned), r.json()["impact"]
    assert r.json()["confirm"] == warned
    refused = post(admin, "apply", yaml=IMPOSSIBLE, base=r.json()["base"])
    assert refused.status_code == 409 and "cannot keep" in refused.json()["message"], refused.text
    assert hub.policy.read_text() == POLICY
    new = tmp_path / "impossible.yaml"
    new.write_text(IMPOSSIBLE)
    gpuhub = policy_cli(hub, admin)

    out = gpuhub("diff", str(new))
    assert out.returncode == 0 and "Warnings: what the new policy promises that this hub cannot keep" in out.stdout, out
    assert warned[0] in out.stdout
    out = gpuhub("apply", str(new))
    assert out.returncode == 1 and "--force" in out.stderr and hub.policy.read_text() == POLICY, out
    out = gpuhub("apply", str(new), "--force", "--summary", "eight A100s, knowingly")
    assert out.returncode == 0 and hub.policy.read_text() == IMPOSSIBLE, out
    versions = admin.api.get(admin.url("/gpuhub/policy")).json()["versions"]
    before = next(v["n"] for v in versions if v.get("summary") != "eight A100s, knowingly")  # newest other one
    assert gpuhub("rollback", str(before)).returncode == 0 and hub.policy.read_text() == POLICY
