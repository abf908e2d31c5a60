"""``gpuhub loadtest`` against a real hub (issue 28 item 1), at small scale.

A real JupyterHub started as root with gpuhub's config, real ``jupyterhub-singleuser`` servers
and kernels, the real proxy. Four simulated researchers storm a team with two GPUs: two wait
for the first two to stop, which the report's queue wait (the hub's own histogram) shows; each
runs a cell in a kernel, idles, stops; the run's users, tokens and the group it had to make
are gone afterwards. A second run compares itself with the first's JSON. Without ``--yes``
naming the hub, nothing happens. With ``--jobs``, the users then submit batch jobs through the
hub's jobs API: one ends and is reported from its record, one still running at the deadline is
cancelled by the cleanup (its process gone), and the report says both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from support.hub import Hub, processes_with_env, wait_for

pytestmark = pytest.mark.integration

GPUHUB = str(Path(sys.executable).parent / "gpuhub")

POLICY = """\
flavors:
  - name: gpu
    local: {virtual: 2}
teams:
  - name: load
    displayName: Load team
    groups: [load-team]
    quota: {gpus: {gpu: {nominal: 2}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [load]}
defaults:
  queueTimeout: 10m
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("loadtest"), POLICY).start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def admin_token(hub, tmp_path_factory):
    token = hub.login("admin").token
    f = tmp_path_factory.mktemp("token") / "admin.token"
    f.write_text(token)
    os.chmod(f, 0o600)
    return str(f)


def loadtest(hub, token_file, *extra, timeout=400):
    return subprocess.run(
        [GPUHUB, "loadtest", "--hub-url", hub.url, "--token-file", token_file, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def hub_users(hub, token_file) -> list[str]:
    r = requests.get(hub.url + "/hub/api/users", headers={"Authorization": f"token {Path(token_file).read_text()}"})
    r.raise_for_status()
    return [u["name"] for u in r.json()]


def test_without_yes_naming_the_hub_nothing_happens(hub, admin_token):
    p = loadtest(hub, admin_token, "--users", "3")
    assert p.returncode == 2
    assert f"refusing to load {hub.url}" in p.stderr and f"--yes {hub.url}" in p.stderr
    p = loadtest(hub, admin_token, "--users", "3", "--yes", "http://localhost:1")  # another hub named
    assert p.returncode == 2
    assert not [n for n in hub_users(hub, admin_token) if n.startswith("loadtest-")]


def test_a_storm_over_the_teams_quota_reports_spawns_cells_queue_wait_and_cleans_up(hub, admin_token, tmp_path):
    first = tmp_path / "first.json"
    p = loadtest(
        hub, admin_token, "--yes", hub.url, "--users", "4", "--mix", "load-team:gpu-1", "--idle", "1", "--json", str(first)
    )
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr + hub.tail()
    report = json.loads(first.read_text())
    assert report["completed"] == 4 and report["errors"]["users_failed"] == 0
    assert report["spawn_to_ready_seconds"]["n"] == 4 and report["cell_seconds"]["n"] == 4
    # Two GPUs, four users asking for one each: two waited for the first two to stop (idle 1 s),
    # as the hub's own admission histogram says.
    wait = report["queue_wait_by_team"]["load"]
    assert wait["admitted"] == 4 and wait["mean_seconds"] > 0.5
    assert report["hub_process"]["rss_max_mib"] > 50 and report["hub_process"]["cpu_cores_mean"] > 0
    assert report["proxy_process"] and report["proxy_process"]["rss_max_mib"] > 0  # the proxy, found by its port
    assert "spawn_to_ready_seconds median" in p.stdout and "queue wait load" in p.stdout
    # Clean: no user of the run, and the group it made (nobody of load-team had logged in) is gone.
    assert not [n for n in hub_users(hub, admin_token) if n.startswith("loadtest-")]
    token = Path(admin_token).read_text()
    assert requests.get(hub.url + "/hub/api/groups/load-team", headers={"Authorization": f"token {token}"}).status_code == 404

    # A second run compares itself with the first.
    p = loadtest(
        hub, admin_token, "--yes", hub.url, "--users", "2", "--mix", "load-team:gpu-1", "--idle", "0", "--baseline", str(first)
    )
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line for line in p.stdout.splitlines() if "spawn_to_ready_seconds median" in line)
    assert row.rstrip().endswith("x") and "before" in p.stdout


def test_a_profile_the_team_may_not_use_is_counted_as_failed_and_still_cleaned_up(hub, admin_token):
    p = loadtest(hub, admin_token, "--yes", hub.url, "--users", "1", "--mix", "nobody-group:gpu-1", "--idle", "0", "--code", "")
    assert p.returncode == 1
    assert "1 failed" in p.stdout and "loadtest-" in p.stdout  # the failure is named with its user
    assert not [n for n in hub_users(hub, admin_token) if n.startswith("loadtest-")]


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root")
def test_jobs_are_submitted_followed_reported_and_the_unfinished_one_cancelled(hub, admin_token, tmp_path):
    """Two users, each then submits a job with their own token: the first user's ends in a second,
    the second's would run for ten minutes and is still running at the run's deadline. (180 s: a
    spawn took 53 s here at a load average of 29 on 2 cores; the jobs come after the servers.)"""
    out = tmp_path / "jobs.json"
    command = 'case "$JUPYTERHUB_USER" in *-0000) sleep 1 ;; *) sleep 600 ;; esac'
    p = loadtest(
        hub,
        admin_token,
        "--yes",
        hub.url,
        "--users",
        "2",
        "--mix",
        "load-team:gpu-1",
        "--idle",
        "0",
        "--code",
        "",
        "--jobs",
        "2",
        "--job-command",
        command,
        "--prefix",
        "ltjobs-",
        "--deadline",
        "180",
        "--json",
        str(out),
    )
    print(p.stdout, p.stderr)
    assert p.returncode == 1, p.stdout + p.stderr + hub.tail()  # the cancelled job is a failure of its user
    report = json.loads(out.read_text())
    jobs = report["jobs"]
    assert (jobs["submitted"], jobs["succeeded"], jobs["cancelled"], jobs["cancelled_at_deadline"]) == (2, 1, 1, 1), jobs
    assert jobs["http_errors"] == {} and jobs["transport_errors"] == 0 and jobs["profiles"] == ["gpu-1"]
    # The wait to start and the run to the end come from the hub's record: the run of the one that ended.
    assert report["job_queue_wait_seconds"]["n"] == 2
    assert report["job_run_seconds"]["n"] == 1 and 1.0 <= report["job_run_seconds"]["median"] < 60
    assert report["completed"] == 1 and "still running at the run's deadline" in report["errors"]["first_failures"][0]
    assert report["not_cleaned_up"] == []
    assert "job_run_seconds median" in p.stdout and "jobs: 2 of 2 submitted" in p.stdout
    # On the hub: both records (the hub keeps them), the long one cancelled, its process gone; the users gone.
    token = Path(admin_token).read_text()
    r = requests.get(hub.url + "/hub/api/gpuhub/jobs?all=1", headers={"Authorization": f"token {token}"})
    r.raise_for_status()
    ours = {j["user"].rsplit("-", 1)[1]: j for j in r.json()["jobs"] if j["user"].startswith("ltjobs-")}
    assert ours["0000"]["state"] == "succeeded" and ours["0001"]["state"] == "cancelled", ours
    wait_for(lambda: not processes_with_env(f"GPUHUB_JOB_ID={ours['0001']['id']}"), 30, "the cancelled job's process to go")
    assert not [n for n in hub_users(hub, admin_token) if n.startswith("ltjobs-")]


def test_a_failing_cell_still_stops_the_server_so_the_queue_moves(hub, admin_token, tmp_path):
    """Each user's cell fails: they still leave, so the two waiting behind the team's two GPUs get
    theirs within the run (a server left running would hold its GPU until the run's deadline)."""
    out = tmp_path / "failing.json"
    p = loadtest(
        hub,
        admin_token,
        "--yes",
        hub.url,
        "--users",
        "4",
        "--mix",
        "load-team:gpu-1",
        "--idle",
        "0",
        "--code",
        "1/0",
        "--deadline",
        "300",
        "--json",
        str(out),
    )
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads(out.read_text())
    assert report["errors"]["failed_cells"] == 4, report["errors"]
    assert report["spawn_to_ready_seconds"]["n"] == 4, report  # the last two were admitted
    assert "ZeroDivisionError" in " ".join(report["errors"]["first_failures"])
    assert not report["not_cleaned_up"]
    assert not [n for n in hub_users(hub, admin_token) if n.startswith("loadtest-")]
