"""Usage history arithmetic, the audit file, role validation and per-cohort lending — units."""

import json
import os
import stat

import pytest

from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.usage.audit import AuditLog
from gpuhub_spawner.usage.history import History, summarize, to_csv
from gpuhub_spawner.usage.metrics import lent_and_borrowed

POLICY = """\
flavors:
  - name: a100
    local: {virtual: 3}
roles:
  admins: [ops]
  viewers: [heads]
teams:
  - name: vision
    groups: [vision-lab]
    leads: [vision-leads]
    cohort: research
    quota: {gpus: {a100: {nominal: 2, lendingLimit: 1}}}
  - name: nlp
    groups: [nlp-group]
    cohort: research
    quota: {gpus: {a100: {nominal: 1, borrowingLimit: 1}}}
profiles:
  - {slug: gpu, displayName: G, gpu: {count: 1, flavor: a100}, teams: "*"}
"""


def errors(text):
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def test_roles_parse_and_a_group_cannot_be_admin_and_viewer():
    p = parse_policy(POLICY, "p.yaml")
    assert p.roles.admins == ["ops"] and p.roles.viewers == ["heads"] and p.team("vision").leads == ["vision-leads"]
    bad = POLICY.replace("viewers: [heads]", "viewers: [heads, ops]")
    assert errors(bad) == [
        "p.yaml:6:20: roles.viewers[1]: group 'ops' is also in roles.admins: a group is either admin or viewer"
    ]


def test_a_misspelt_role_key_is_located():
    bad = POLICY.replace("  viewers: [heads]", "  viewer: [heads]")
    (err,) = errors(bad)
    assert err.startswith("p.yaml:6:3: roles.viewer: unknown key 'viewer'"), err
    bad = POLICY.replace("    leads: [vision-leads]", "    leads: vision-leads")
    (err,) = errors(bad)
    assert err.startswith("p.yaml:10:12: teams[0].leads:"), err


def test_history_adds_up_and_survives_a_new_engine(tmp_path):
    url = f"sqlite:///{tmp_path / 'hub.sqlite'}"
    h = History(url)
    t0 = 1_700_000_000.0
    h.open(
        key="alice/",
        user="alice",
        team="vision",
        profile="gpu",
        flavor="a100",
        gpus=2,
        devices=["0", "1"],
        requested=t0 - 30,
        start=t0,
    )
    h.add_gpu_time({"alice/": (100.0, 40.0)})
    h.close("alice/", t0 + 3600, "culled", "gpuhub-culler")
    h.open(
        key="carol/x",
        user="carol",
        team="nlp",
        profile="gpu",
        flavor="a100",
        gpus=1,
        devices=["2"],
        requested=t0 + 100,
        start=t0 + 110,
    )
    h.flush()  # writes happen on the history's own thread, in order
    rows = History(url).rows(t0 - 10)  # a new engine: what a restarted hub reads
    assert [(r.user, r.end_reason) for r in rows] == [("alice", "culled"), ("carol", None)]
    s = summarize(rows, t0 - 10, t0 + 1910, by="team")
    assert s["totals"]["vision"]["gpu_hours"] == pytest.approx(2.0)
    assert s["totals"]["nlp"]["gpu_hours"] == pytest.approx(0.5)
    assert s["totals"]["vision"]["idle_gpu_hours"] == pytest.approx(40 / 3600, abs=1e-4)
    assert s["totals"]["vision"]["culls"] == 1 and s["ended"] == {"culled": 1}
    assert s["waits"]["median_seconds"] == pytest.approx(20) and s["waits"]["count"] == 2
    csv_text = to_csv(rows, t0 + 1910)
    assert csv_text.splitlines()[0].startswith("user,server,kind,team,profile")
    assert ",culled,gpuhub-culler," in csv_text and "7200.0" in csv_text


def test_who_stopped_a_server_is_kept_when_the_stop_outlasts_its_request(tmp_path):
    """A slow stop: JupyterHub answers the DELETE with 202 before the server is gone, so the
    request names its actor while the allocation is still open; the later close keeps that name
    (the usage page said nobody stopped it). A quick stop (204) names the closed row, as before."""
    h = History(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    now = __import__("time").time()
    for key, user in (("carol/", "carol"), ("dave/", "dave")):
        h.open(
            key=key,
            user=user,
            team="nlp",
            profile="gpu",
            flavor="a100",
            gpus=1,
            devices=["0"],
            requested=now - 60,
            start=now - 50,
        )
    h.set_stopped_by("carol/", "carol")  # 202: the request ended, the server still stopping
    h.close("carol/", now, "stopped")  # the release, which knows no actor
    h.close("dave/", now, "stopped")  # 204: the server went first,
    h.set_stopped_by("dave/", "admin")  # then the request ended
    h.flush()
    rows = {r.user: r for r in h.rows(now - 100)}
    assert (rows["carol"].end_reason, rows["carol"].stopped_by) == ("stopped", "carol")
    assert (rows["dave"].end_reason, rows["dave"].stopped_by) == ("stopped", "admin")


def test_the_audit_file_is_private_and_append_only(tmp_path):
    path = tmp_path / "audit.jsonl"
    a = AuditLog(path)
    a.record("requested", user="bob", token="s3cret", environment={"X": "y"})
    a.record("admitted", user="bob", devices=["0"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["requested", "admitted"]
    assert "s3cret" not in path.read_text() and "environment" not in lines[0]
    b = AuditLog(path)  # a restarted hub continues the sequence
    b.record("released", user="bob")
    assert [e["seq"] for e in b.entries()] == [1, 2, 3]


def test_lending_follows_cohort_usage():
    p = parse_policy(POLICY, "p.yaml")
    lent, borrowed = lent_and_borrowed(p, {"nlp": {"gpu/a100": 2}}, "a100")
    assert borrowed == {"vision": 0, "nlp": 1} and lent == {"vision": 1, "nlp": 0}
    lent, borrowed = lent_and_borrowed(p, {}, "a100")
    assert borrowed == {"vision": 0, "nlp": 0} and lent == {"vision": 0, "nlp": 0}
