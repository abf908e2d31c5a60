"""Batch jobs against a real hub run as root: the CLI, the shared queue, isolation, recovery.

One hub for the module. Jobs run through the same isolated launcher as servers (their
user's Unix account, cgroup, private /dev); virtual GPUs stand in for NVML. The training
script is plain Python that checkpoints like a PyTorch loop would (no torch needed).
Accounts and cgroups get a per-hub prefix and are removed at the end (tests/support/hub.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import requests

from support.hub import Hub, wait_for
from support.jobs import logs, record, wait_state
from support.kernel import KernelSession
from support.policies import jobs_policy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root"),
]

POLICY = jobs_policy(
    virtual=2,
    teams="""\
  - name: nlp
    displayName: NLP
    groups: [nlp-group]
    jobPriority: batch
    quota: {gpus: {gpu: 1}}
""",
    profiles="""\
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision, nlp], cpu: "1", memory: 1Gi}
  - {slug: nlp-special, displayName: NLP only, teams: [nlp]}
  - {slug: small, displayName: Small, teams: "*", cpu: 500m, memory: 300Mi}
""",
)

# A training loop that checkpoints every step (atomically) and resumes from the last one. Its
# first attempt waits at step 2 to be ended (preempted, interrupted by a restart): what the test
# brings then never races the attempt's own end (it used to finish 2.4 s after step 2, a budget
# the test's look at the log, its next request and the hub's reaction can spend under load).
TRAIN = textwrap.dedent("""\
    import json, os, time
    ckpt = os.path.join(os.environ["GPUHUB_CHECKPOINT_DIR"], "state.json")
    state = {"step": 0, "total": 0}
    if os.path.exists(ckpt):
        state = json.load(open(ckpt))
        print("resumed from step", state["step"], flush=True)
    print("attempt", os.environ["GPUHUB_ATTEMPT"], "devices", repr(os.environ["CUDA_VISIBLE_DEVICES"]), flush=True)
    for step in range(state["step"] + 1, 9):
        time.sleep(0.4)
        state = {"step": step, "total": state["total"] + step}
        json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
        print("step", step, flush=True)
        if step == 2 and os.environ["GPUHUB_ATTEMPT"] == "1":
            time.sleep(300)  # ended long before by what the test brings (bounded: no orphan outlives it)
    print("total", state["total"], flush=True)
""")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("jobs"), POLICY, extra_config="c.JobManager.max_jobs_per_user = 3\n")
    h.prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]  # accounts and cgroups are removed by the harness at stop
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def train_script(hub):
    """The job's command: the training script inline, as a researcher could also keep it in
    their home. (Not a file under /tmp: every account has a private /tmp.)"""
    return f"[{sys.executable}, -c, {json.dumps(TRAIN)}]"


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "admin")}


def cli(hub, user, *args, env=None, check=True):
    """``gpuhub job ...`` from outside the hub, with a token from the token page."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    e.update(GPUHUB_TOKEN=user.token, **(env or {}))
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def job_file(tmp_path, text: str) -> str:
    p = tmp_path / f"job-{uuid.uuid4().hex[:6]}.yaml"
    p.write_text(text)
    return str(p)


def submit(hub, user, tmp_path, text: str) -> str:
    r = cli(hub, user, "submit", job_file(tmp_path, text))
    return r.stdout.strip().splitlines()[-1]


def stop_servers(users):
    for u in users.values():
        for name in list(u.model()["servers"]):
            u.stop(name)
            u.wait_gone(name)


def held_devices(users) -> list[str]:
    snap = users["admin"].api.get(users["admin"].url("/gpuhub/status")).json()
    return [d["id"] for d in snap["devices"] if d["held"]]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def job_ids(user) -> set[str]:
    return {j["id"] for j in user.api.get(user.url("/gpuhub/jobs")).json()["jobs"]}


def test_bad_job_file_is_explained_with_line_and_column(hub, users, tmp_path):
    had = job_ids(users["bob"])  # what the tests before left (each test passes alone and in any order)
    bad = "profile: gpu-1\ncomand: python train.py\nretries: {limit: 2, reasons: [preemptd]}\ntimeLimit: soon\n"
    r = cli(hub, users["bob"], "submit", job_file(tmp_path, bad), check=False)
    assert r.returncode == 1
    assert ":2:1: comand: unknown key 'comand' (did you mean 'command'?)" in r.stderr
    assert ":3:31: retries.reasons[0]: must be one of preempted" in r.stderr
    assert ":4:12: timeLimit: 'soon' is not a duration" in r.stderr
    # The hub says the same to a client that skips local validation; nothing is queued.
    resp = users["bob"].api.post(users["bob"].url("/gpuhub/jobs"), json={"spec": bad, "filename": "j.yaml"})
    assert resp.status_code == 400 and "j.yaml:2:1: comand: unknown key" in "\n".join(resp.json()["issues"])
    assert job_ids(users["bob"]) == had


def test_forged_jobs_are_refused_before_anything_queues(hub, users, tmp_path):
    bob = users["bob"]
    had = job_ids(bob)
    # Another team's profile.
    r = cli(hub, bob, "submit", job_file(tmp_path, "profile: nlp-special\ncommand: [true]\n"), check=False)
    assert r.returncode == 1 and "Profile 'nlp-special' is not available to your team(s)" in r.stderr and "403" in r.stderr
    # A team the user is not in.
    r = cli(hub, bob, "submit", job_file(tmp_path, "profile: gpu-1\nteam: nlp\ncommand: [true]\n"), check=False)
    assert "not a member of team 'nlp'" in r.stderr
    assert job_ids(bob) == had
    # More GPUs than the per-user cap (1): a running GPU job counts, a second one is refused.
    first = submit(hub, bob, tmp_path, f"profile: gpu-1\ncommand: [{sys.executable}, -c, 'import time; time.sleep(60)']\n")
    r = cli(hub, bob, "submit", job_file(tmp_path, "profile: gpu-1\ncommand: [true]\n"), check=False)
    assert "allows 1 GPU(s) per user; you hold 1" in r.stderr
    assert job_ids(bob) == had | {first}
    snap = users["admin"].api.get(users["admin"].url("/gpuhub/status")).json()
    assert all(t["waiting"] == 0 for t in snap["teams"])
    cli(hub, bob, "cancel", first)


def test_job_from_outside_runs_as_its_user_with_a_full_record(hub, users, tmp_path):
    from gpuhub_spawner.local.unix_users import ensure_account, ensure_home

    bob = users["bob"]
    account = ensure_account("bob", hub.prefix)
    home = hub.data / "home" / "bob"
    ensure_home(str(home), account)
    proj = home / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "hello.py").write_text(
        "import os, json\nprint('uid', os.getuid(), 'cwd', os.getcwd())\n"
        "print('secret seen', os.environ.get('SECRET_NAME'))\n"
        "print('cuda', repr(os.environ['CUDA_VISIBLE_DEVICES']))\n"
        "print('ctx', os.environ['MLFLOW_RUN_CONTEXT'])\n"
        "print('has server token', 'JPY_API_TOKEN' in os.environ)\n"
    )
    git = ["git", "-C", str(proj), "-c", "user.name=t", "-c", "user.email=t@x"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "first"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["chown", "-R", f"{account.uid}:{account.gid}", str(proj)], check=True)

    job_id = submit(
        hub,
        bob,
        tmp_path,
        f"""\
name: hello
profile: cpu
workingDir: proj
command: [{sys.executable}, hello.py]
env: {{SECRET_NAME: value-never-in-the-record}}
""",
    )
    rec = wait_state(bob, job_id, "succeeded", "failed")
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    assert f"uid {account.uid} cwd /home/{account.name}/proj" in out
    assert "secret seen value-never-in-the-record" in out and "cuda ''" in out
    assert f'"gpuhub.job.id": "{job_id}", "gpuhub.job.attempt": "1"' in out
    assert "has server token False" in out
    # The record: who, what, where, when; env names only.
    assert (rec["user"], rec["team"], rec["profile"]["slug"]) == ("bob", "vision", "cpu")
    assert len(rec["policy_sha256"]) == 64 and rec["priority_class"] == "batch"
    att = rec["attempts"][0]
    assert att["git"]["commit"] == head and att["git"]["dirty"] is False
    assert att["exit_code"] == 0 and att["reason"] == "succeeded" and att["account"] == account.name
    assert att["queued"] <= att["admitted"] <= att["started"] <= att["finished"]
    assert "SECRET_NAME" in rec["env_names"] and "GPUHUB_ATTEMPT" in rec["env_names"]
    raw = json.dumps(rec) + (hub.data / "jobs" / f"{job_id}.json").read_text()
    assert "value-never-in-the-record" not in raw
    assert oct((hub.data / "jobs" / f"{job_id}.json").stat().st_mode & 0o777) == "0o600"
    show = cli(hub, bob, "show", job_id).stdout
    assert show.startswith("succeeded") and head in show and "SECRET_NAME" in show
    assert cli(hub, bob, "status", job_id).stdout.startswith("succeeded")
    assert job_id in cli(hub, bob, "list").stdout
    # The hub page shows the same record.
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}")
    assert page.status_code == 200 and head[:12] in page.text


def test_submit_from_a_notebook_terminal_with_the_servers_own_token(hub, users, tmp_path):
    alice = users["alice"]
    assert alice.start("cpu").status_code in (201, 202)
    s = alice.wait_ready()
    k = KernelSession("", hub.server_url(s["url"]), alice.token, f"jobs-{uuid.uuid4().hex[:6]}.ipynb")
    try:
        out = k.execute(
            textwrap.dedent(f"""\
            import os, subprocess, sys
            open("job.yaml", "w").write("profile: cpu\\ncommand: [{sys.executable}, -c, 'import os; print(os.getuid(), os.environ.get(\\"JUPYTERHUB_API_TOKEN\\", \\"none\\")[:6])']\\n")
            r = subprocess.run(["gpuhub", "job", "submit", "job.yaml"], capture_output=True, text=True)  # as typed in a terminal
            print(r.returncode, r.stderr)
            print(r.stdout.strip().splitlines()[-1])
            print(os.getuid(), os.environ["JUPYTERHUB_API_TOKEN"][:6])
        """)
        )
    finally:
        k.close()
    rc_line, job_id, server_ident = [ln for ln in out.strip().splitlines() if ln.strip()][-3:]
    assert rc_line.strip() == "0", out
    rec = wait_state(alice, job_id, "succeeded", "failed")
    assert rec["state"] == "succeeded" and rec["user"] == "alice"
    job_uid, job_token = logs(alice, job_id).splitlines()[1].split()
    server_uid, server_token = server_ident.split()
    assert job_uid == server_uid  # the same account as alice's server
    assert job_token != server_token  # its own MLflow-only token, not the server's
    stop_servers(users)


def test_job_waits_behind_the_teams_quota_and_cancel_frees_its_gpu_at_once(hub, users, tmp_path):
    alice, bob = users["alice"], users["bob"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    # alice's server holds her one GPU: her GPU job is refused (servers and jobs share the cap).
    r = cli(hub, alice, "submit", job_file(tmp_path, "profile: gpu-1\ncommand: [true]\n"), check=False)
    assert "allows 1 GPU(s) per user; you hold 1" in r.stderr
    job_id = submit(
        hub,
        bob,
        tmp_path,
        f"profile: gpu-1\ncommand: [{sys.executable}, -c, 'import time; print(\"up\", flush=True); time.sleep(300)']\n",
    )
    status = cli(hub, bob, "status", job_id).stdout
    assert status.startswith("queued: position 1 of 1 in Vision Lab's queue"), status
    assert "needs 1 Tesla GPU: your team Vision Lab is using 1 of the 1 it may hold" in status, status
    alice.stop()
    rec = wait_state(bob, job_id, "running")
    assert rec["attempts"][0]["devices"] and held_devices(users) == rec["attempts"][0]["devices"]
    wait_for(lambda: "up" in logs(bob, job_id), 30, "the job's output")
    r = cli(hub, bob, "cancel", job_id)
    assert r.stdout.startswith("cancelled")
    assert held_devices(users) == []  # free when cancel returns
    rec = record(bob, job_id)
    assert rec["state"] == "cancelled" and rec["attempts"][0]["reason"] == "cancelled"
    alice.wait_gone()


def test_preempted_job_resumes_from_its_checkpoint_and_finishes_with_the_right_total(hub, users, tmp_path, train_script):
    alice, bob = users["alice"], users["bob"]
    job_id = submit(
        hub,
        bob,
        tmp_path,
        f"""\
name: train
profile: gpu-1
command: {train_script}
retries: {{limit: 0, reasons: [preempted]}}
""",
    )
    wait_for(lambda: "step 2" in logs(bob, job_id), 60, "training to reach step 2")
    # An interactive server of the same team needs the GPU: it reclaims it from the job.
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    rec = wait_state(bob, job_id, "queued")
    first = rec["attempts"][0]
    assert first["reason"] == "preempted" and "interactive server in Vision Lab" in first["message"]
    assert rec["status"].startswith("queued: position 1 of 1 in Vision Lab's queue")
    alice.stop()
    rec = wait_state(bob, job_id, "succeeded", "failed", timeout=90)
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"]
    assert "attempt 2 devices" in out and "resumed from step" in out
    resumed = int(out.split("resumed from step")[1].split()[0])
    assert resumed >= 2
    assert out.count("step 1\n") == 1  # nothing before the checkpoint ran twice
    assert out.strip().splitlines()[-2] == "total 36"  # 1+..+8, across both attempts
    alice.wait_gone()


def test_non_retryable_exit_is_not_retried_and_time_limit_stops_and_says_so(hub, users, tmp_path):
    carol = users["carol"]
    failing = submit(
        hub,
        carol,
        tmp_path,
        f"""\
profile: cpu
command: "{sys.executable} -c 'import sys; print(\\"boom\\"); sys.exit(3)'"
retries: {{limit: 2, reasons: [preempted, 75]}}
""",
    )
    slow = submit(
        hub,
        carol,
        tmp_path,
        f"profile: cpu\ncommand: [{sys.executable}, -c, 'import time; time.sleep(120)']\ntimeLimit: 3s\nretries: 2\n",
    )
    rec = wait_state(carol, failing, "failed", "succeeded")
    assert len(rec["attempts"]) == 1 and rec["attempts"][0]["exit_code"] == 3
    assert rec["status"] == "failed: exit code 3"
    followed = cli(hub, carol, "logs", "-f", failing)  # returns when the job has ended
    assert "boom" in followed.stdout and followed.stderr.strip() == "failed: exit code 3"
    rec = wait_state(carol, slow, "failed", "succeeded", timeout=60)
    assert len(rec["attempts"]) == 1 and rec["attempts"][0]["reason"] == "time-limit"
    assert "time limit of 3s" in rec["status"]
    assert "time-limit" in logs(carol, slow)


def test_a_job_over_its_memory_is_stopped_says_why_and_is_retried_only_as_asked(hub, users, tmp_path):
    carol = users["carol"]
    hog = submit(
        hub,
        carol,
        tmp_path,
        f"""\
profile: small
command: [{sys.executable}, -c, "b = bytearray(600 * 2**20); print('survived')"]
retries: {{limit: 1, reasons: [oom]}}
""",
    )
    rec = wait_state(carol, hog, "failed", "succeeded", timeout=60)
    assert [a["reason"] for a in rec["attempts"]] == ["oom", "oom"]  # one retry, as asked
    assert rec["attempts"][0]["message"].startswith("stopped: it used more than its memory limit of 300Mi (profile 'small')")
    assert rec["status"].endswith("No retries left (1 allowed).")
    assert "survived" not in logs(carol, hog)


def test_another_user_cannot_read_or_cancel_a_job(hub, users, tmp_path):
    bob, carol, admin = users["bob"], users["carol"], users["admin"]
    job_id = submit(
        hub, bob, tmp_path, f"profile: cpu\ncommand: [{sys.executable}, -c, 'import time; print(\"private\"); time.sleep(120)']\n"
    )
    wait_state(bob, job_id, "running")
    for method, path in (("GET", ""), ("GET", "/logs"), ("POST", "/cancel"), ("DELETE", "")):
        r = carol.api.request(method, carol.url(f"/gpuhub/jobs/{job_id}{path}"))
        assert r.status_code == 404, (method, path, r.status_code)
    assert job_id not in json.dumps(carol.api.get(carol.url("/gpuhub/jobs?all=1")).json())
    assert carol.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").status_code == 404
    r = cli(hub, carol, "logs", job_id, check=False)
    assert r.returncode == 1 and "No such job" in r.stderr
    # Encoded paths do not reach another route (raw client: requests would normalise).
    import http.client

    conn = http.client.HTTPConnection("localhost", hub.port)
    conn.request("GET", f"/hub/api/gpuhub/jobs/{job_id}%2Flogs", headers={"Authorization": f"token {carol.token}"})
    assert conn.getresponse().status == 404
    # A token limited to reading its owner's name gets nothing, not even the owner's jobs.
    tok = bob.api.post(bob.url("/users/bob/tokens"), json={"scopes": ["read:users:name!user"]}).json()["token"]
    assert requests.get(bob.url(f"/gpuhub/jobs/{job_id}"), headers={"Authorization": f"token {tok}"}).status_code == 404
    assert record(bob, job_id)["state"] == "running"
    # Admins may.
    assert admin.api.get(admin.url(f"/gpuhub/jobs/{job_id}")).status_code == 200
    assert job_id in json.dumps(admin.api.get(admin.url("/gpuhub/jobs?all=1")).json())
    assert admin.api.post(admin.url(f"/gpuhub/jobs/{job_id}/cancel")).json()["state"] == "cancelled"


def test_a_flood_of_jobs_is_refused_past_the_per_user_limit(hub, users, tmp_path):
    carol = users["carol"]
    text = f"profile: cpu\ncommand: [{sys.executable}, -c, 'import time; time.sleep(120)']\n"
    ids = [submit(hub, carol, tmp_path, text) for _ in range(3)]
    r = cli(hub, carol, "submit", job_file(tmp_path, text), check=False)
    assert r.returncode == 1 and "You have 3 unfinished jobs, the most this hub allows per user" in r.stderr
    for job_id in ids:
        assert cli(hub, carol, "cancel", job_id).stdout.startswith("cancelled")
    assert submit(hub, carol, tmp_path, "profile: cpu\ncommand: [true]\n").startswith("job-")


def test_records_queue_and_running_jobs_survive_a_hub_restart(hub, users, tmp_path, train_script):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    done = submit(hub, bob, tmp_path, f"profile: cpu\ncommand: [{sys.executable}, -c, 'print(\"before restart\")']\n")
    wait_state(bob, done, "succeeded")
    before = record(bob, done)
    # alice's server holds Vision Lab's GPU; bob's GPU job waits behind it; carol's job trains.
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    waiting = submit(hub, bob, tmp_path, f"profile: gpu-1\ncommand: [{sys.executable}, -c, 'print(\"ran after restart\")']\n")
    assert record(bob, waiting)["state"] == "queued"
    dave = hub.login("dave")  # in two teams: names Vision Lab's queue
    second = submit(hub, dave, tmp_path, f"profile: gpu-1\nteam: vision\ncommand: [{sys.executable}, -c, 'print(2)']\n")
    assert record(dave, second)["status"].startswith("queued: position 2 of 2 in Vision Lab's queue")
    training = submit(hub, carol, tmp_path, f"name: train\nprofile: gpu-1\ncommand: {train_script}\n")
    wait_for(lambda: "step 2" in logs(carol, training), 60, "training to reach step 2")

    hub.stop(kill_servers=False)
    hub.start()
    users.update({n: hub.login(n) for n in ("alice", "bob", "carol", "admin")})
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    after = record(bob, done)
    assert after["attempts"] == before["attempts"] and after["state"] == "succeeded"
    assert "before restart" in logs(bob, done)
    # The interrupted attempt is recorded, and the job resumes from its checkpoint.
    rec = wait_state(carol, training, "succeeded", "failed", timeout=90)
    out = logs(carol, training)
    assert [a["reason"] for a in rec["attempts"]] == ["interrupted", "succeeded"], out
    assert "resumed from step" in out and out.strip().splitlines()[-2] == "total 36"
    # The waiting job kept its place behind alice's server, which survived the restart.
    assert alice.server()["ready"]
    assert record(bob, waiting)["status"].startswith("queued: position 1 of 2 in Vision Lab's queue")
    dave = hub.login("dave")
    assert record(dave, second)["status"].startswith("queued: position 2 of 2 in Vision Lab's queue")
    alice.stop()
    assert wait_state(bob, waiting, "succeeded")["attempts"][0]["number"] == 1
    assert "ran after restart" in logs(bob, waiting)
    assert len(wait_state(dave, second, "succeeded")["attempts"]) == 1
    alice.wait_gone()


@pytest.fixture(scope="module")
def mlflow_hub(tmp_path_factory):
    """A second hub with the real MLflow service (costs ~20 s, so only this test uses it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mlflow"))
    from mlflow_service import MlflowEndpoint, mlflow_extra_config
    from support.ports import free_port

    port = free_port()
    h = Hub(tmp_path_factory.mktemp("jobs-mlflow"), POLICY, extra_config=mlflow_extra_config(port))
    try:
        h.start(timeout=90)
        yield h, MlflowEndpoint(h, port)
    finally:
        h.stop()


def test_mlflow_works_in_a_job_with_no_setup_and_every_run_carries_job_and_attempt(mlflow_hub, tmp_path):
    hub, mlflow = mlflow_hub
    bob = hub.login("bob")
    mlflow.wait_ready(bob.token)
    code = (
        "import mlflow\\n"
        "with mlflow.start_run(run_name='epoch') as run:\\n"
        "    mlflow.log_metric('loss', 0.5)\\n"
        "print('run', run.info.run_id)"
    )
    job_id = submit(hub, bob, tmp_path, f'profile: cpu\ncommand: [{sys.executable}, -c, "{code}"]\n')
    rec = wait_state(bob, job_id, "succeeded", "failed", timeout=120)
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    run_id = out.split("run ")[-1].split()[0]
    assert rec["attempts"][0]["mlflow_run_ids"] == [run_id]
    r = mlflow.api(bob.token).get(mlflow.direct + "/api/2.0/mlflow/runs/get", params={"run_id": run_id})
    tags = {t["key"]: t["value"] for t in r.json()["run"]["data"]["tags"]}
    assert tags["gpuhub.job.id"] == job_id and tags["gpuhub.job.attempt"] == "1"
    assert (tags["gpuhub.user"], tags["gpuhub.team"], tags["gpuhub.profile"]) == ("bob", "vision", "cpu")
    assert tags["mlflow.user"] == "bob"  # the run belongs to the job's user, through its own token
    # The job's page links the run into MLflow's UI where a browser opens it (its own origin).
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").text
    assert f'href="{mlflow.public.rstrip("/")}/#/runs/{run_id}"' in page, page.split('id="gpuhub-job-attempts"')[-1][:1500]
    # That token lived only for the attempt.
    notes = [t["note"] for t in bob.api.get(bob.url("/users/bob/tokens")).json()["api_tokens"]]
    assert not any(job_id in n for n in notes), notes


def test_a_cancelled_jobs_mlflow_run_is_ended_killed_not_left_running(mlflow_hub, tmp_path):
    """A killed process runs no atexit: MLflow would show its run RUNNING forever."""
    hub, mlflow = mlflow_hub
    bob = hub.login("bob")
    mlflow.wait_ready(bob.token)
    code = (
        "import mlflow, time\\n"
        "run = mlflow.start_run(run_name='long')\\n"
        "mlflow.log_metric('loss', 0.9)\\n"
        "print('run', run.info.run_id, flush=True)\\n"
        "time.sleep(600)"
    )
    job_id = submit(hub, bob, tmp_path, f'profile: cpu\ncommand: [{sys.executable}, -c, "{code}"]\n')
    run_id = wait_for(
        lambda: "run " in logs(bob, job_id) and logs(bob, job_id).split("run ")[-1].split()[0],
        120,
        "the job's MLflow run to start",
    )
    api = mlflow.api(bob.token)
    status = lambda: api.get(mlflow.direct + "/api/2.0/mlflow/runs/get", params={"run_id": run_id}).json()["run"]["info"]  # noqa: E731
    assert status()["status"] == "RUNNING"
    cli(hub, bob, "cancel", job_id)
    rec = wait_state(bob, job_id, "cancelled", timeout=60)
    assert rec["attempts"][0]["mlflow_run_ids"] == [run_id]
    info = status()
    assert info["status"] == "KILLED", info
    assert info["end_time"] and int(info["end_time"]) >= int(info["start_time"])


def test_a_notebook_jobs_mlflow_run_carries_the_job_and_opens_from_its_page(mlflow_hub):
    """A notebook as a job (issue 44): the kernel papermill starts inherits the job's MLflow
    identity and tags; the run is in the record and linked from the job's page."""
    from gpuhub_spawner.local.unix_users import ensure_account, ensure_home

    hub, mlflow = mlflow_hub
    bob = hub.login("bob")
    mlflow.wait_ready(bob.token)
    account = ensure_account("bob", hub.env["GPUHUB_ACCOUNT_PREFIX"])
    home = hub.data / "home" / "bob"
    ensure_home(str(home), account)
    cells = [
        {
            "cell_type": "code",
            "metadata": {"tags": ["parameters"]},
            "execution_count": None,
            "outputs": [],
            "source": "loss = 1.0",
        },
        {
            "cell_type": "code",
            "metadata": {},
            "execution_count": None,
            "outputs": [],
            "source": "import mlflow\nwith mlflow.start_run(run_name='nb') as run:\n    mlflow.log_metric('loss', loss)\nprint('run', run.info.run_id)",
        },
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    rel = f"nb-mlflow-{uuid.uuid4().hex[:6]}.ipynb"
    (home / rel).write_text(json.dumps(nb))
    os.chown(home / rel, account.uid, account.gid)
    r = bob.api.post(
        bob.url("/gpuhub/jobs"), json={"spec": json.dumps({"profile": "cpu", "notebook": rel, "parameters": {"loss": 0.25}})}
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    rec = wait_state(bob, job_id, "succeeded", "failed", timeout=180)
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    run_id = out.split("run ")[-1].split()[0]
    assert rec["attempts"][0]["mlflow_run_ids"] == [run_id]
    run = mlflow.api(bob.token).get(mlflow.direct + "/api/2.0/mlflow/runs/get", params={"run_id": run_id}).json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["gpuhub.job.id"] == job_id and tags["gpuhub.job.attempt"] == "1" and tags["mlflow.user"] == "bob"
    assert {m["key"]: m["value"] for m in run["data"]["metrics"]} == {"loss": 0.25}  # the parameter reached the run
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").text
    assert f"#/runs/{run_id}" in page and f"gpuhub/jobs/{job_id}/notebook?attempt=1" in page
