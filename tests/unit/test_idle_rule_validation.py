"""Idle rules that contradict themselves are refused by `gpuhub validate`, at line:column.

The case behind it: with ``warning >= timeout`` a user who came back could never be in
time, and alice was culled with her JupyterLab tab open.
"""

import subprocess
import sys

import pytest

from gpuhub_spawner.policy import PolicyError, parse_policy

POLICY = """\
flavors:
  - name: a100
    local: {{virtual: 2}}
teams:
  - name: vision
    groups: [vision-lab]
    quota:
      gpus:
        a100: {{nominal: 2}}
profiles:
  - slug: gpu
    displayName: One GPU
    gpu: {{count: 1, flavor: a100}}
    teams: [vision]
    idle: {gpu_idle}
  - slug: cpu
    displayName: CPU
    teams: "*"
    idle: {cpu_idle}
defaults:
  idle: {defaults_idle}
"""


def issues(gpu_idle="{}", cpu_idle="{}", defaults_idle="{timeout: 8h, warning: 15m, snooze: 1h, maxSnoozes: 2}"):
    text = POLICY.format(gpu_idle=gpu_idle, cpu_idle=cpu_idle, defaults_idle=defaults_idle)
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def test_sane_rules_pass():
    text = POLICY.format(
        gpu_idle="{timeout: 1h, gpuIdleTimeout: 30m}",
        cpu_idle="{timeout: 8h}",
        defaults_idle="{timeout: 8h, warning: 15m, snooze: 1h, maxSnoozes: 2}",
    )
    parse_policy(text, "p.yaml")


def test_warning_not_shorter_than_timeout_is_located_at_the_profiles_key():
    (msg,) = issues(cpu_idle="{timeout: 2m, warning: 2m}")
    assert msg.startswith("p.yaml:19:34: profiles[1].idle.warning:"), msg
    assert "warning (2m) must be shorter than timeout (2m)" in msg


def test_a_profile_timeout_below_the_inherited_warning_points_at_the_profile():
    (msg,) = issues(gpu_idle="{timeout: 1h, gpuIdleTimeout: 10m}")
    assert msg.startswith("p.yaml:15:41: profiles[0].idle.gpuIdleTimeout:"), msg
    assert "warning (15m) must be shorter than gpuIdleTimeout (10m)" in msg


def test_defaults_themselves_are_checked():
    (msg,) = issues(defaults_idle="{timeout: 10m, warning: 15m}")
    assert msg.startswith("p.yaml:21:") and "defaults.idle.warning" in msg, msg


def test_snoozes_without_a_length_and_a_zero_busy_threshold_and_gpu_rule_on_cpu():
    found = issues(
        gpu_idle="{gpuIdleTimeout: 30m, gpuBusyThreshold: 0}",
        cpu_idle="{gpuIdleTimeout: 1h}",
        defaults_idle="{timeout: 8h, warning: 15m, maxSnoozes: 2}",
    )
    text = "\n".join(found)
    assert "maxSnoozes is 2 but no snooze length is set" in text
    assert "profiles[0].idle.gpuBusyThreshold: gpuBusyThreshold 0 counts every GPU as busy" in text
    assert "profiles[1].idle.gpuIdleTimeout: gpuIdleTimeout on a profile without GPUs never applies" in text
    assert all(line.startswith("p.yaml:") and line.split(":")[1].isdigit() for line in found)


def test_cli_rejects_it(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(POLICY.format(gpu_idle="{}", cpu_idle="{timeout: 2m, warning: 5m}", defaults_idle="{}"))
    r = subprocess.run([sys.executable, "-m", "gpuhub_spawner.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0
    assert f"{bad}:19:34: profiles[1].idle.warning: warning (5m) must be shorter than timeout (2m)" in r.stdout + r.stderr
