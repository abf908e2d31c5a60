"""A valid policy that cannot keep its promises on this machine is said so (issue 20 item 7):
``gpuhub validate`` and the live reload warn, and the policy still serves."""

from __future__ import annotations

import logging
import time

from gpuhub_spawner.cli import main
from gpuhub_spawner.policy import PolicyStore, parse_policy
from gpuhub_spawner.policy.checks import capacity_warnings, warning_interval_warnings

IMPOSSIBLE = """\
flavors:
  - {name: a100, displayName: A100, local: {virtual: 3}}
  - {name: cloud, displayName: Cloud GPU}
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], quota: {gpus: {a100: 8, cloud: 50}}}
  - {name: nlp, displayName: NLP, groups: [n], quota: {gpus: {a100: 1}}}
profiles:
  - {slug: g, displayName: G, teams: "*", gpu: {count: 1, flavor: a100}, idle: {timeout: 1h, warning: 2m}}
  - {slug: c, displayName: C, teams: "*", idle: {timeout: 8h, warning: 15m}}
"""


def test_quota_beyond_the_machine_and_short_warnings_are_named():
    policy = parse_policy(IMPOSSIBLE)
    found = capacity_warnings(policy, {"a100": 3})  # "cloud" has no devices here: not checked
    assert found == [
        "teams[vision].quota.gpus.a100: a nominal quota of 8 A100 but this machine has 3: "
        "Vision Lab is promised GPUs that do not exist",
        "flavor a100: the teams' nominal quotas add up to 9 A100 but this machine has 3: "
        "guaranteed GPUs lent to other teams cannot all be reclaimed",
    ]
    assert capacity_warnings(policy, {"a100": 9}) == []
    [short] = warning_interval_warnings(policy, 300)
    assert short.startswith("profiles[g].idle.warning: 2m is shorter than JupyterHub's activity report interval (5m)")
    assert warning_interval_warnings(policy, 60) == []


def test_gpuhub_validate_warns_and_still_says_ok(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text(IMPOSSIBLE)
    assert main(["validate", str(f)]) == 0  # valid: it would serve
    out, err = capsys.readouterr()
    assert "OK (2 teams, 2 profiles, 2 flavors)" in out
    assert "warning: teams[vision].quota.gpus.a100: a nominal quota of 8 A100 but this machine has 3" in err
    assert "warning: profiles[g].idle.warning" in err
    assert main(["validate", "--no-machine", str(f)]) == 0  # a cluster's policy: no machine check
    assert "this machine has" not in capsys.readouterr().err


def test_live_reload_keeps_serving_and_updates_the_warnings(tmp_path, caplog):
    f = tmp_path / "p.yaml"
    f.write_text(IMPOSSIBLE.replace("a100: 8, ", "a100: 2, "))
    PolicyStore.clear_instance()
    store = PolicyStore.instance(policy_file=str(f))
    try:
        store.add_check(lambda p: capacity_warnings(p, {"a100": 3}))
        assert store.status.warnings == []
        with caplog.at_level(logging.WARNING, logger="JupyterHub.gpuhub.policy"):
            time.sleep(0.01)
            f.write_text(IMPOSSIBLE)
            assert store.refresh()
        assert store.policy.team("vision").quota.gpus["a100"].nominal == 8  # live
        assert [w.split(":")[0] for w in store.status.warnings] == ["teams[vision].quota.gpus.a100", "flavor a100"]
        assert store.status.as_dict()["warnings"] == store.status.warnings
        assert "is live, but" in caplog.text and "promised GPUs that do not exist" in caplog.text
    finally:
        PolicyStore.clear_instance()
