"""Issue 42 item 5: the escalation page's blocks (docs/runbooks/escalation.md), run as the page
shows them against a real hub: the first five minutes of an incident (the hub answers, how many
servers run, the last policy versions, the policy file valid) and the check after a step back
(the audit trail's last policy events say what was done and by whom). The steps back themselves
are other pages' blocks (upgrade-rollback, backup-restore), run by their own tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.hub import Hub
from test_runbooks import POLICY, blocks, env_of, runbook, steps_run_by

pytestmark = [pytest.mark.integration]

PAGES = ("escalation",)


def test_the_first_five_minutes_and_the_check_after_a_step_back(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("runbooks-escalation"), POLICY)
    h.start()
    try:
        admin, alice = h.login("admin"), h.login("alice")
        r = alice.start("cpu")
        assert r.status_code in (201, 202), r.text
        alice.wait_ready()
        env = env_of(h, admin)
        out = runbook("escalation", "triage", env)
        assert "hub: 200" in out and "servers running: 1" in out and "policy file: valid" in out, out
        # A policy change made just before the trouble, then the step back the page names first.
        edited = h.policy.read_text().replace("default: true, memory: 4Gi", "default: true, memory: 2Gi")
        assert edited != h.policy.read_text()
        new = Path(tmp_path_factory.mktemp("edit")) / "profiles.yaml"
        new.write_text(edited)
        gpuhub = str(Path(sys.executable).parent / "gpuhub")
        cli_env = {"GPUHUB_TOKEN": admin.token, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
        applied = subprocess.run(
            [gpuhub, "policy", "apply", str(new), "--hub", h.url, "--summary", "cpu: 2Gi only"],
            capture_output=True,
            text=True,
            env=cli_env,
            timeout=120,
        )
        assert applied.returncode == 0, applied.stdout + applied.stderr
        out = runbook("escalation", "triage", env)
        assert "cpu: 2Gi only" in out, out  # the suspect, first in the history
        out = runbook("upgrade-rollback", "rollback-policy", env | {"VERSION": "1"})
        out = runbook("escalation", "verify", env)
        lines = [line for line in out.splitlines() if " by " in line]
        assert "hub: 200" in out and lines, out
        assert any("policy" in line and "by admin" in line for line in lines), out
    finally:
        h.stop()


def test_every_marked_block_of_this_page_is_run_by_a_test():
    ran = steps_run_by(__file__)
    missing = sorted(f"runbook:{page}/{step}" for page in PAGES for step in blocks(page) if (page, step) not in ran)
    assert not missing, f"marked blocks no test runs: {missing}"
