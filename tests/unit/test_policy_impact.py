"""The impact of a policy edit, in plain words (admission/impact.py), and the versions store
(usage/policy_versions.py): pure code and files in a temporary directory, no hub."""

import os
import time

import pytest

from gpuhub_spawner.admission.impact import Holding, Person, Request, impact, read_candidate
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.usage.policy_versions import PolicyVersions, VersionNotFound, policy_diff, text_hash, write_atomically

OLD = """\
flavors:
  - {name: a100, displayName: A100, local: {virtual: 3}}
priorityClasses:
  - {name: interactive, value: 1000}
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
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - {slug: a100-1, displayName: 1× A100, gpu: {count: 1, flavor: a100}, teams: [vision, nlp]}
  - {slug: a100-2, displayName: 2× A100, gpu: {count: 2, flavor: a100}, teams: [vision], idle: {timeout: 1h, gpuIdleTimeout: 30m}}
defaults:
  queueTimeout: 5m
"""
NEW = (
    OLD.replace("a100: {nominal: 2}", "a100: {nominal: 1}")
    .replace("maxGPUs: 2", "maxGPUs: 1")
    .replace(
        "  - {slug: a100-2, displayName: 2× A100, gpu: {count: 2, flavor: a100}, teams: [vision], idle: {timeout: 1h, gpuIdleTimeout: 30m}}\n",
        "",
    )
)

PEOPLE = [
    Person("alice", ("vision-lab",)),
    Person("bob", ("vision-lab",)),
    Person("carol", ("nlp-group",)),
    Person("dave", ("nlp-group", "vision-lab")),
    Person("erin", ("students",)),
]
NOW = time.time()
DEMAND2 = {"cpu": 1000, "memory": 2 << 30, "gpu/a100": 2}
DEMAND1 = {"cpu": 1000, "memory": 2 << 30, "gpu/a100": 1}


def scenario():
    held = [Holding("alice/", "alice", "vision", "a100-2", DEMAND2, since=NOW - 600)]
    waiting = [Request("dave/", "dave", "vision", "a100-1", DEMAND1, priority=1000, created=NOW - 60)]
    return impact(parse_policy(OLD), parse_policy(NEW), PEOPLE, held, waiting, {"gpu/a100": 1}, now=NOW)


def texts(imp, section):
    return [ln.text for ln in imp.section(section)]


def test_lowering_a_quota_and_removing_a_profile_names_who_it_hits_and_what_gpuhub_does():
    imp = scenario()
    running = " ".join(texts(imp, "running"))
    assert "Vision Lab holds 2 A100 GPUs and its new quota is 1 (1 over): alice's server" in running
    assert "nothing is stopped: it keeps running until its user stops it or it is culled" in running
    assert "alice's server runs profile 2× A100 (a100-2), which the new policy removes" in running
    assert "alice is over Vision Lab's new per-user caps (2 GPUs, new cap 1)" in running
    (dave,) = texts(imp, "waiting")
    assert dave.startswith("dave's server (1 A100 GPU") and "waits longer" in dave
    assert "Vision Lab may hold 1 A100 GPUs instead of 2" in dave and "held by alice's server" in dave
    profiles = texts(imp, "profiles")
    assert "Profile 2× A100 (a100-2) is removed; 4 user(s) lose it: alice, bob, dave." not in profiles
    assert profiles[0] == "Profile 2× A100 (a100-2) is removed; 3 user(s) lose it: alice, bob, dave."
    assert {"alice loses 2× A100 (a100-2).", "bob loses 2× A100 (a100-2).", "dave loses 2× A100 (a100-2)."} <= set(profiles)
    assert not any(t.startswith(("carol", "erin")) for t in profiles)
    assert texts(imp, "quotas") == ["Vision Lab: A100 GPUs quota 2 → 1 (-1); GPUs per user 2 → 1."]
    assert texts(imp, "culling") == [
        "alice's server (profile a100-2): idle timeout 1h → 8h; GPU-idle timeout 30m → does not apply."
    ]
    assert imp.touched_teams == {"vision"} and imp.global_changes == []


def test_raising_the_quota_admits_the_waiting_request_at_once_and_nothing_else_changes():
    raised = OLD.replace("a100: {nominal: 2}", "a100: {nominal: 3}").replace(
        "a100: {nominal: 1}}}\nprofiles", "a100: {nominal: 0}}}\nprofiles"
    )
    held = [Holding("alice/", "alice", "vision", "a100-2", DEMAND2, since=NOW - 600)]
    waiting = [Request("dave/", "dave", "vision", "a100-1", DEMAND1, created=NOW - 60)]
    imp = impact(parse_policy(OLD), parse_policy(raised), PEOPLE, held, waiting, {"gpu/a100": 1}, now=NOW)
    assert texts(imp, "waiting") == [
        f"dave's server (1 A100 GPU, waiting since {time.strftime('%H:%M', time.localtime(NOW - 60))}) would be admitted at once."
    ]
    assert texts(imp, "running") == [] and texts(imp, "profiles") == []
    # ... unless the machine has no free device: then it does not say "at once"
    imp = impact(parse_policy(OLD), parse_policy(raised), PEOPLE, held, waiting, {"gpu/a100": 0}, now=NOW)
    assert not any("at once" in t for t in texts(imp, "waiting"))


def test_a_request_that_can_never_fit_is_said_to_wait_for_its_queue_timeout_not_refused():
    held = []
    waiting = [Request("bob/", "bob", "vision", "a100-2", DEMAND2, created=NOW)]
    imp = impact(parse_policy(OLD), parse_policy(NEW), PEOPLE, held, waiting, None, now=NOW)
    (line,) = texts(imp, "waiting")
    assert "can never be admitted under the new policy: Vision Lab may hold at most 1 A100 GPUs" in line
    assert "waits until its queue timeout (5m) withdraws it" in line


def test_a_borrowing_holder_in_a_cohort_is_said_to_be_reclaimable_after_the_lenders_notice():
    cohort = OLD.replace("groups: [vision-lab]\n", "groups: [vision-lab]\n    cohort: research\n").replace(
        "groups: [nlp-group]\n", "groups: [nlp-group]\n    cohort: research\n"
    )
    lowered = (
        cohort.replace("a100: {nominal: 2}", "a100: {nominal: 1}")
        .replace("maxGPUs: 2", "maxGPUs: 1")
        .replace("teams: [vision], idle", "teams: [nlp], idle")
        .replace("quota: {gpus: {a100: {nominal: 1}}}\nprofiles", "quota: {gpus: {a100: {nominal: 2}}}\nprofiles")
    )
    held = [
        Holding("alice/", "alice", "vision", "a100-1", DEMAND1, since=NOW),
        Holding("bob/", "bob", "vision", "a100-1", DEMAND1, since=NOW),
    ]
    imp = impact(parse_policy(cohort), parse_policy(lowered), PEOPLE, held, [], None, now=NOW)
    running = " ".join(texts(imp, "running"))
    assert "counted as borrowed from the research cohort: kept until NLP Group need their own quota back" in running
    assert "a server is warned and stopped after 2m30s" in running  # half of queueTimeout 5m, as Policy.reclaim_rules


def test_a_lead_sees_only_their_teams_lines_and_global_changes_are_named():
    imp = scenario()
    assert imp.only_teams({"nlp"}).lines == []
    assert len(imp.only_teams({"vision"}).lines) == len(imp.lines)
    _, everyone = (
        impact(parse_policy(OLD), parse_policy(OLD.replace("queueTimeout: 5m", "queueTimeout: 10m"))).touched_teams,
        impact(parse_policy(OLD), parse_policy(OLD.replace("queueTimeout: 5m", "queueTimeout: 10m"))).global_changes,
    )
    assert everyone == ["the defaults change, which apply to every team"]


def test_an_invalid_candidate_gives_the_loaders_located_errors_and_an_alias_bomb_is_refused_before_parsing():
    policy, errors = read_candidate(
        NEW.replace("a100: {nominal: 1}}}\n    perUser", "a100: {nominal: 1, lendingLimit: 3}}}\n    perUser")
    )
    assert policy is None
    assert errors[0]["line"] == 11 and errors[0]["path"] == "teams[0].quota.gpus.a100.lendingLimit"
    assert errors[0]["message"] == "lendingLimit 3 is above the nominal quota 1"
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    )
    t0 = time.perf_counter()
    policy, errors = read_candidate(bomb)
    assert policy is None and "anchors and aliases are not accepted" in errors[0]["message"] and errors[0]["line"] == 1
    assert time.perf_counter() - t0 < 0.5


def test_versions_record_apply_atomically_and_find_by_number_or_hash(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(OLD)
    os.chmod(path, 0o640)
    vs = PolicyVersions(tmp_path / "versions", str(path))
    first = vs.notice_file()
    assert first["n"] == 1 and first["source"] == "loaded at start"
    assert vs.notice_file() is None  # same text: nothing new
    second = vs.apply(NEW, "admin", "Vision Lab quota 2 → 1")
    assert path.read_text() == NEW and (tmp_path / "policy.yaml.previous").read_text() == OLD
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    assert [v["n"] for v in vs.versions()] == [1, 2] and second["by"] == "admin" and second["source"] == "applied"
    assert vs.find("1")["hash"] == first["hash"] and vs.find(second["hash"][:6])["n"] == 2
    assert vs.text_of(vs.find("v1")) == OLD
    with pytest.raises(VersionNotFound):
        vs.find("../../etc/passwd")
    path.write_text(OLD + "# edited\n")  # an admin edits the file on disk
    third = vs.notice_file()
    assert third["source"] == "edited on disk" and third["n"] == 3
    assert third["summary"].startswith("edited on disk: Vision Lab: A100 GPUs quota 1 → 2 (+1)")
    # a fresh store reads the same history back
    assert [v["source"] for v in PolicyVersions(tmp_path / "versions", str(path)).versions()] == [
        "loaded at start",
        "applied",
        "edited on disk",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_on_kubernetes_an_apply_goes_to_the_writer_and_a_refused_write_records_nothing(tmp_path):
    """The ConfigMap writer (kube/policy_configmap.py; tested on the real API server in
    tests/kube/test_policy_configmap.py) takes the place of the file: the version is recorded
    only when it wrote, the diff starts from what it says was there."""
    path = tmp_path / "live.yaml"  # the hub's copy of the ConfigMap; the writer keeps it current
    path.write_text(OLD)
    calls = []

    def writer(text, expected_hash):
        calls.append(expected_hash)
        if expected_hash != text_hash(OLD):
            raise RuntimeError("ConfigMap gpuhub/gpuhub-policy changed: nothing was written")
        path.write_text(text)
        return OLD

    writer.where = "ConfigMap gpuhub/gpuhub-policy (key profiles.yaml)"
    vs = PolicyVersions(tmp_path / "versions", str(path), writer)
    vs.notice_file()
    with pytest.raises(RuntimeError, match="nothing was written"):
        vs.apply(NEW, "admin", "stale preview", expected_hash="0123456789ab")
    assert [v["n"] for v in vs.versions()] == [1] and path.read_text() == OLD
    version = vs.apply(NEW, "admin", "Vision Lab quota 2 → 1", expected_hash=text_hash(OLD))
    assert version["n"] == 2 and path.read_text() == NEW and vs.where.startswith("ConfigMap")
    assert not (tmp_path / "live.yaml.previous").exists()  # the file is not written by the versions store
    assert vs.notice_file() is None  # the watch's copy of the same text is not "edited on disk"


def test_a_failed_write_leaves_the_policy_file_as_it_was(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    path = d / "policy.yaml"
    path.write_text(OLD)
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    os.chmod(d, 0o500)
    try:
        with pytest.raises(OSError):
            write_atomically(path, NEW)
        assert path.read_text() == OLD
    finally:
        os.chmod(d, 0o700)


def test_the_diff_masks_profile_environment_values():
    before = OLD
    after = OLD.replace("teams: [vision, nlp]}", "teams: [vision, nlp], env: {HF_TOKEN: hf_secret}}")
    diff = policy_diff(before, after)
    assert "HF_TOKEN" in diff and "hf_secret" not in diff and "***" in diff


# -- the security review of issue 26 -------------------------------------------------------------------
def _big(teams: int, profiles: int) -> str:
    """Every team in everyone's groups, every profile for every team: the review's stall."""
    extra = "".join(
        f"  - {{name: t{i}, groups: [vision-lab, nlp-group], quota: {{gpus: {{a100: {{nominal: 0}}}}}}}}\n" for i in range(teams)
    )
    profs = "".join(f"  - {{slug: p{i}, displayName: P{i}, teams: '*'}}\n" for i in range(profiles))
    return OLD.replace("profiles:\n", extra + "profiles:\n" + profs)


def test_the_impact_of_many_teams_times_many_profiles_takes_linear_time():
    old, new = parse_policy(OLD), parse_policy(_big(1000, 1500))
    t0 = time.perf_counter()
    imp = impact(old, new, PEOPLE)
    took = time.perf_counter() - t0
    assert took < 3, f"{took:.1f} s"  # teams x profiles x users before: tens of seconds
    (alice,) = [t for t in texts(imp, "profiles") if t.startswith("alice ")]
    assert alice.startswith("alice joins t0, t1, t10, ") and "gains P0 (p0), P1 (p1), P10 (p10), " in alice
    assert not any(t.startswith("erin") for t in texts(imp, "profiles"))  # in no team's groups


def test_a_guessed_secret_or_a_cohort_or_an_added_group_touches_the_other_teams():
    from gpuhub_spawner.admission.impact import touched_teams

    secret = OLD.replace('teams: "*", default: true}', 'teams: "*", default: true, env: {HF_TOKEN: right}}')
    old = parse_policy(secret)
    # the lead's candidate carries the right value: equal to the policy in force, yet a change of the profile
    assert touched_teams(old, parse_policy(secret), {"cpu"})[0] == {"vision", "nlp"}
    assert touched_teams(old, parse_policy(secret))[0] == set()
    pooled = OLD.replace("groups: [nlp-group]\n", "groups: [nlp-group]\n    cohort: pool\n")
    joins = pooled.replace("groups: [vision-lab]\n", "groups: [vision-lab]\n    cohort: pool\n")
    assert touched_teams(parse_policy(pooled), parse_policy(joins))[0] == {"vision", "nlp"}
    lends = pooled.replace("a100: {nominal: 1}}}\nprofiles", "a100: {nominal: 1, lendingLimit: 0}}}\nprofiles")
    assert touched_teams(parse_policy(pooled), parse_policy(lends))[0] == {"nlp"}  # alone in its cohort
    both = joins.replace("a100: {nominal: 2}", "a100: {nominal: 2, borrowingLimit: 0}")
    assert touched_teams(parse_policy(joins), parse_policy(both))[0] == {"vision", "nlp"}
    grab = OLD.replace("groups: [vision-lab]", "groups: [vision-lab, nlp-group]")
    assert touched_teams(parse_policy(OLD), parse_policy(grab))[0] == {"vision", "nlp"}


def test_a_lead_sees_people_outside_their_teams_counted_not_named():
    grab = OLD.replace("groups: [vision-lab]", "groups: [vision-lab, nlp-group, students]")
    imp = impact(parse_policy(OLD), parse_policy(grab), PEOPLE)
    assert "carol joins Vision Lab; gains 2× A100 (a100-2)." in texts(imp, "profiles")  # an admin sees names
    lead = imp.for_lead({"vision"}, {"alice", "bob", "dave"})
    words = " ".join(ln.text for ln in lead.lines)
    assert "carol" not in words and "erin" not in words
    assert "1 person outside your teams would join Vision Lab; would gain 2× A100 (a100-2)." in words  # carol
    assert (
        "1 person outside your teams would join Vision Lab; would gain 1× A100 (a100-1), 2× A100 (a100-2), CPU only (cpu)."
        in words
    )
    assert not any(ln.users - {"alice", "bob", "dave"} for ln in lead.lines)


def test_masked_text_never_returns_a_text_it_cannot_parse_and_masks_every_env():
    from gpuhub_spawner.usage.policy_versions import masked_text

    broken = "profiles:\n  - {slug: cpu, env: {HF_TOKEN: hf-secret}}\nteams: [\n"
    assert masked_text(broken) is None
    assert "hf-secret" not in policy_diff(OLD, broken)
    odd = "profiles: {cpu: {env: {HF_TOKEN: hf-secret}}}\n"  # not a list: still masked
    assert "hf-secret" not in masked_text(odd) and "HF_TOKEN: '***'" in masked_text(odd)


def test_masked_values_sent_back_keep_the_values_in_force():
    from gpuhub_spawner.hub.policy_api import unmask_text

    secret = OLD.replace('teams: "*", default: true}', 'teams: "*", default: true, env: {HF_TOKEN: "ab\'c\\"d", B: x}}')
    current = parse_policy(secret)
    sent = secret.replace('HF_TOKEN: "ab\'c\\"d"', "HF_TOKEN: '***'").replace("B: x", "B: y") + "# a comment\n"
    written = unmask_text(sent, current)
    assert parse_policy(written).profile("cpu").env == {"HF_TOKEN": "ab'c\"d", "B": "y"}
    assert "'***'" not in written and written.endswith("# a comment\n")


def test_the_masked_text_is_made_once_per_version_off_the_loop(monkeypatch):
    import asyncio
    import threading

    from gpuhub_spawner.hub import policy_api
    from gpuhub_spawner.hub.context import PolicyChanges

    made = []

    def counting(text):
        made.append(threading.current_thread().name)
        return "masked"

    monkeypatch.setattr(policy_api, "masked_text_as_written", counting)
    changes = PolicyChanges()  # what the hub's application object keeps between requests

    async def twice():
        return [
            await policy_api.masked_of(changes, OLD),
            await policy_api.masked_of(changes, OLD),
            await policy_api.masked_of(changes, NEW),
        ]

    assert asyncio.run(twice()) == ["masked"] * 3
    assert len(made) == 2 and all(name.startswith("gpuhub-policy") for name in made)


def test_a_leads_history_from_the_terminal_has_every_version_and_only_the_summaries_they_may_see(monkeypatch, capsys):
    from types import SimpleNamespace

    from gpuhub_spawner.usage import policy_cli

    versions = [
        {"n": 2, "hash": "b" * 12, "by": "admin", "at": NOW, "source": "applied"},
        {"n": 1, "hash": "a" * 12, "by": "admin", "at": NOW, "source": "applied", "summary": "Vision Lab: quota"},
    ]
    monkeypatch.setattr(policy_cli, "call", lambda *a, **k: {"role": "lead", "version": versions[0], "versions": versions})
    assert policy_cli._history(SimpleNamespace(hub="http://hub.example")) == 0
    out = capsys.readouterr().out
    assert "applied          - *" in out and "Vision Lab: quota" in out


def test_the_masked_text_keeps_the_admins_comments_and_layout_but_nothing_inside_env():
    """What a lead's text box shows (issue 43 item 4): the file as the admin wrote it, comments,
    blank lines and flow style included, with every environment value masked and the comments
    inside an env mapping (an old value?) gone; where that cannot be exact, the masked data."""
    from gpuhub_spawner.usage.policy_text import masked_text_as_written as masked_text

    written = "# Who may use what. Ask #gpu-admins before raising a quota.\n" + OLD.replace(
        '  - {slug: cpu, displayName: CPU only, teams: "*", default: true}\n',
        "  - slug: cpu   # everyone's\n"
        "    displayName: CPU only\n"
        '    teams: "*"\n'
        "    default: true\n"
        "    env:\n"
        "      HF_TOKEN: hf-secret   # rotated 2026-11\n"
        "      # OLD_TOKEN: hf-old-secret\n"
        "      NOTE: |\n"
        "        multi-line secret\n"
        "\n"
        "    # the GPU profiles\n",
    ).replace("teams: [vision, nlp]}", "teams: [vision, nlp], env: {K: flow-secret}}  # both teams")
    shown = masked_text(written)
    for secret in ("hf-secret", "hf-old-secret", "multi-line secret", "flow-secret", "rotated"):
        assert secret not in shown, shown
    for kept in ("# Who may use what. Ask #gpu-admins", "- slug: cpu   # everyone's", "    # the GPU profiles", "# both teams"):
        assert kept in shown, shown
    assert "      HF_TOKEN: '***'\n      NOTE: '***'\n\n" in shown and "env: {K: '***'}" in shown
    assert parse_policy(shown).profile("cpu").env == {"HF_TOKEN": "***", "NOTE": "***"}
    # An env mapping shared through an anchor cannot be rewritten in place: the masked data instead.
    anchored = "common: &e {K: kept-secret}\nprofiles:\n  - {slug: cpu, env: *e}\n"
    assert "kept-secret" not in masked_text(anchored).split("profiles")[1]


def test_a_profile_only_edit_names_the_change_and_who_has_the_profile():
    new = OLD.replace(
        "{slug: a100-1, displayName: 1× A100, gpu: {count: 1, flavor: a100}, teams: [vision, nlp]}",
        "{slug: a100-1, displayName: 1× A100, gpu: {count: 1, flavor: a100}, teams: [vision, nlp], "
        "image: 'quay.io/jupyter/pytorch-notebook:cuda12', memory: 8Gi, env: {TOKEN: t0ken}}",
    )
    imp = impact(parse_policy(OLD), parse_policy(new), PEOPLE)
    lines = texts(imp, "profiles")
    assert lines == [
        "Profile 1× A100 (a100-1) changes: image (default) -> quay.io/jupyter/pytorch-notebook:cuda12; "
        "memory (default) -> 8Gi; environment changed (for Vision Lab, NLP Group: alice, bob, carol, dave)."
    ], lines
    assert "t0ken" not in imp.text() and "No change for anyone" not in imp.text()
    # A lead of NLP sees it, with Vision Lab's people unnamed.
    lead = imp.for_lead({"nlp"}, {"carol", "dave"})
    assert [ln.text for ln in lead.section("profiles")] == [
        lines[0].replace("alice, bob", "someone outside your teams, someone outside your teams")
    ]
