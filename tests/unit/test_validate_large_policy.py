"""``gpuhub validate`` of a large policy (issue 29 item 3), as a user runs it: a fresh
``gpuhub`` process on the 500-team, 2,000-profile policy of the benchmarks. The command was
made cheaper (idle rules merged without re-validation, each distinct quantity parsed once,
the YAML resolver's per-node calls cut, the garbage collector off while it runs); what it
says must not change: the counts, the machine's warnings, and every mistake with its
file:line:column, however deep in the file and however often repeated.

No GPU is needed: the machine check reads the fake NVML (tests/support/fake_nvml) with no
device, so the policy's virtual GPUs count, as on a machine without a driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))
from bigpolicy import big_policy  # noqa: E402

from gpuhub_spawner.policy import parse_policy  # noqa: E402
from gpuhub_spawner.policy.model import IdleRules, ReclaimRules  # noqa: E402

FAKE_NVML_DIR = REPO / "tests" / "support" / "fake_nvml"
FLAVORS = ("a100", "h100", "l4", "t4")


@pytest.fixture(scope="module")
def big() -> str:
    return big_policy()


def gpuhub_validate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``gpuhub validate ARGS`` in its own process, on a machine whose NVML sees no GPU."""
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"devices": []}))
    env = dict(os.environ, GPUHUB_FAKE_NVML=str(state), PYTHONPATH=os.pathsep.join([str(FAKE_NVML_DIR), str(REPO / "spawner")]))
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "validate", *args], capture_output=True, text=True, env=env, timeout=120
    )


def line_of(text: str, needle: str, after: str = "") -> int:
    """1-based line of the first ``needle`` after the first ``after``."""
    start = text.index(after) if after else 0
    return text.count("\n", 0, text.index(needle, start)) + 1


def test_the_500_team_policy_is_ok_with_the_machines_warnings(tmp_path, big):
    f = tmp_path / "big.yaml"
    f.write_text(big)
    out = gpuhub_validate(tmp_path, str(f))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{f}: OK (500 teams, 2000 profiles, 4 flavors)\n"
    # The teams' guarantees against the 64 virtual GPUs per flavor (no driver here).
    totals = {"a100": 250, "h100": 250, "l4": 250, "t4": 500}
    assert out.stderr.splitlines() == [
        f"  warning: flavor {fl}: the teams' nominal quotas add up to {totals[fl]} {fl} but this machine has 64: "
        "guaranteed GPUs lent to other teams cannot all be reclaimed"
        for fl in FLAVORS
    ]
    # A cluster's policy: no machine check, nothing else changes.
    quiet = gpuhub_validate(tmp_path, "--no-machine", str(f))
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, out.stdout, "")


def test_mistakes_deep_in_the_large_policy_are_each_located(tmp_path, big):
    # team-417: a bad memory quantity; the same bad quantity again in profile-1998 (one parse
    # per distinct string must not swallow the second); profile-1999: a key written twice and
    # a misspelt one.
    text = big.replace(
        "- name: team-417\n  displayName: Team 417\n", "- name: team-417\n  displayName: Team 417\n  perUzer: {}\n"
    )
    text = text.replace("    memory: 256Gi\n", "    memory: 256Gx\n", 418)  # the 418th: team-417's
    text = text.replace("    memory: 256Gx\n", "    memory: 256Gi\n", 417)
    at = text.index("- slug: profile-1998\n")
    text = text[:at] + text[at:].replace("  memory: 16Gi\n", "  memory: 256Gx\n", 1)
    text = text.replace(
        "- slug: profile-1999\n  displayName: Profile 1999\n",
        "- slug: profile-1999\n  displayName: Profile 1999\n  displayName: Twice\n",
    )
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    out = gpuhub_validate(tmp_path, str(f))
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    perUzer = line_of(text, "perUzer")
    memory = line_of(text, "256Gx")
    profile_memory = line_of(text, "256Gx", after="profile-1998")
    twice = line_of(text, "displayName: Twice")
    assert lines == [
        f"{f}: 4 error(s)",
        f"  {f}:{perUzer}:3: teams[417].perUzer: unknown key 'perUzer' (did you mean 'perUser'?)",
        f"  {f}:{memory}:13: teams[417].quota.memory.nominal: '256Gx' is not a quantity (examples: 4, 500m, 16Gi)",
        f"  {f}:{profile_memory}:11: profiles[1998].memory: '256Gx' is not a quantity (examples: 4, 500m, 16Gi)",
        f"  {f}:{twice}:3: profiles[1999].displayName: key 'displayName' appears twice; the second would silently win",
    ], out.stderr


LIBRARY_CALL = """
import gc, sys
from gpuhub_spawner.cli import main
frozen = gc.get_freeze_count()
assert gc.isenabled()
assert main(["validate", "--no-machine", sys.argv[1]]) == 0
print("after, collector on:", gc.isenabled(), "frozen added:", gc.get_freeze_count() - frozen)
gc.disable()
assert main(["validate", "--no-machine", sys.argv[1]]) == 0
print("after, collector off:", gc.isenabled())
"""


def test_a_validate_inside_another_program_leaves_its_garbage_collector_as_it_was(tmp_path):
    """A program that calls ``main(["validate", ...])`` keeps its collector on (or off) and
    nothing of its heap frozen: only ``gpuhub validate`` as the program freezes at its end.

    In its own interpreter: in pytest's, objects other tests froze (the policy store freezes
    its heap) can be freed while validate runs, which would move the count without validate.
    """
    f = tmp_path / "big.yaml"
    f.write_text(big_policy(teams=20, profiles=40))
    env = dict(os.environ, PYTHONPATH=str(REPO / "spawner"))
    out = subprocess.run([sys.executable, "-c", LIBRARY_CALL, str(f)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "after, collector on: True frozen added: 0\n" in out.stdout, out.stdout
    assert "after, collector off: False\n" in out.stdout, out.stdout


def test_a_profiles_idle_rules_are_its_own_over_the_policys_defaults(big):
    policy = parse_policy(
        big_policy(teams=4, profiles=4).replace(
            "- slug: profile-0001\n", "- slug: profile-0001\n  idle: {timeout: 2h, maxSnoozes: 0}\n"
        )
    )
    plain, own = policy.profile("profile-0000"), policy.profile("profile-0001")
    defaults = policy.defaults.idle
    assert policy.idle_rules(plain) == defaults
    rules = policy.idle_rules(own)
    assert (rules.timeout, rules.max_snoozes) == (7200.0, 0)  # its own, 0 included
    assert (rules.warning, rules.gpu_idle_timeout, rules.snooze) == (defaults.warning, defaults.gpu_idle_timeout, defaults.snooze)
    # A copy of the policy with other defaults (the hub's policy editor copies policies): its
    # answer follows its own defaults, not what the original answered before.
    other = policy.model_copy(
        update={"defaults": policy.defaults.model_copy(update={"idle": IdleRules(timeout=60.0, warning=30.0)})}
    )
    assert other.idle_rules(plain) == IdleRules(timeout=60.0, warning=30.0)
    assert other.idle_rules(own).timeout == 7200.0 and other.idle_rules(own).warning == 30.0
    assert policy.idle_rules(own) == rules  # the original unchanged


def test_reclaim_rules_merge_key_by_key():
    base = ReclaimRules(enabled=True, notice=600.0, interactive_borrowing=True)
    assert ReclaimRules().over(base) == base
    assert ReclaimRules(enabled=False).over(base) == ReclaimRules(enabled=False, notice=600.0, interactive_borrowing=True)
    assert ReclaimRules(notice=0.0).over(base).notice == 0.0  # a zero is a value, not "unset"
