"""``kind: ray`` jobs against a real hub run as root, with real Ray (docs/jobs.md, "Ray jobs").

alice submits a Ray job: a Ray cluster of its own (gpuhub's Ray launcher, the same as
``gpuhub ray up``'s) admitted in Vision Lab's queue with its GPU, its entrypoint submitted
to it through Ray's job submission API. While it runs, carol (another team) probes every
port alice's account listens on from her own kernel, Ray's dashboard agent included, and
reaches none; bob's server takes the team's only GPU and the job is preempted: nothing of
alice's is left running or listening; it runs again on a new cluster and succeeds, and
again nothing is left; the jobs list, the job's page, usage history and the audit trail
show it as alice's. A driver that exits 3 fails its job with exit code 3; a job cancelled
while its cluster starts leaves nothing. Lean: the smallest cluster (a head holding one
GPU), three cluster starts in all.

One hub for the module; virtual GPUs stand in for NVML (Ray schedules on them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from gpuhub_spawner.local.user_network import Wall
from support.hub import running_hub, wait_for
from support.jobs import logs, record
from support.kernel import KernelSession
from support.policies import jobs_policy
from support.walls import PROBE, account, host_listening_ports, listeners_of, pid_arg

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a Ray job runs as its user's account behind the wall: needs a hub running as root"
    ),
]
ray = pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")

POLICY = jobs_policy(
    virtual=2,
    teams="""\
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 1}}}
""",
    profiles="""\
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision], cpu: "1", memory: 4Gi}
""",
    extra="""\
ray:
  enabled: true
  maxWorkers: 1
""",
    queue_timeout="10m",
)

# The driver: a task on the job's GPU; then it holds in the attempt named by HOLD (the job
# file's env), else exits with EXIT (default 0). GPUHUB_ATTEMPT and the job file's env reach
# it through the cluster's processes; GREETING through Ray's runtime environment.
DRIVER = textwrap.dedent("""\
    import json, os, sys, time, ray
    ray.init()
    @ray.remote(num_gpus=1)
    def where():
        return ray.get_gpu_ids(), os.environ.get("GREETING")
    attempt = os.environ.get("GPUHUB_ATTEMPT")
    print("driver attempt", attempt, json.dumps(ray.get(where.remote())), flush=True)
    if os.environ.get("HOLD") == attempt:
        time.sleep(3600)
    sys.exit(int(os.environ.get("EXIT", "0")))
""")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("rayjobs"), POLICY) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "admin")}


@pytest.fixture(autouse=True)
def servers_stopped_after(hub):
    yield
    hub.stop_servers("alice", "bob", "carol")


def submit(user, text: str, filename: str = "ray.yaml"):
    return user.api.post(user.url("/gpuhub/jobs"), json={"spec": text, "filename": filename})


def ray_job(entrypoint: list[str], extra: str = "") -> str:
    return (
        f"kind: ray\nprofile: gpu-1\nentrypoint: {json.dumps(entrypoint)}\n"
        "runtimeEnv:\n  env_vars: {GREETING: hello-from-runtime-env}\n" + extra
    )


def left_of(hub, name: str) -> tuple[list[str], dict]:
    """Every process and listening TCP port of the user's account (read as root, each port in
    its process's own network view): what a job that ended must not leave behind."""
    uid = account(hub, name).pw_uid
    procs = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                procs.append(open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120])
        except OSError:
            continue
    return procs, listeners_of(uid)


def nothing_left(hub, name: str, what: str) -> None:
    # The hub answers the cancel or the preemption once the cgroup is gone; wait only for the
    # kernel's view of the dying processes to settle.
    wait_for(lambda: left_of(hub, name) == ([], {}), 30, f"nothing of {name}'s to run or listen after {what}")


def kernel(hub, user) -> KernelSession:
    assert user.start("cpu").status_code in (201, 202)
    s = user.wait_ready(timeout=120)
    return KernelSession("", hub.server_url(s["url"]), user.token, f"rayjob-{uuid.uuid4().hex[:6]}.ipynb")


def test_refusals_say_why_before_anything_queues(hub, users):
    alice = users["alice"]
    r = submit(alice, "kind: ray\nprofile: gpu-1\nruntimeEnv: {conda: env}\n")
    assert r.status_code == 400, r.text
    assert r.json()["issues"] == [
        "ray.yaml:1:7: entrypoint: is required for kind: ray (the shell command Ray runs on the job's cluster)",
        "ray.yaml:3:14: runtimeEnv.conda: Ray's 'conda' is not offered here: a Ray job's runtime environment may have "
        "env_vars, working_dir, py_modules, pip, excludes",
    ]
    # Ray runs the entrypoint with /bin/sh -c: a leading '-' is refused at the key, not run.
    r = submit(alice, "kind: ray\nprofile: gpu-1\nentrypoint: -m mymodule\n")
    assert r.status_code == 400 and r.json()["issues"] == [
        "ray.yaml:3:13: entrypoint: starts with '-': Ray runs the entrypoint as a shell command (/bin/sh -c), which "
        "would read it as the shell's own option; begin with the program, e.g. 'python -m mymodule'"
    ], r.text
    # Code from the user's files only: Ray would fetch a URI (here: from anywhere on the web).
    r = submit(alice, ray_job(["python", "x.py"]) + "  working_dir: https://code.example/x.zip\n")
    assert r.status_code == 400 and r.json()["issues"] == [
        "ray.yaml:6:16: runtimeEnv.working_dir: 'https://code.example/x.zip' is a URI (https:), which Ray would "
        "fetch instead of reading your files: give a path inside your home directory (a relative path whose first "
        "part has a ':' reads as a URI: write './' before it)"
    ], r.text
    before = alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"]
    r = submit(alice, ray_job(["true"], "workers: 2\n"))
    assert r.status_code == 403 and "at most 1 workers" in r.json()["message"], r.text
    assert alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"] == before  # nothing queued


def test_a_ray_job_runs_on_a_walled_cluster_of_its_own_preempted_whole_and_run_again(hub, users):
    alice, bob, carol, admin = users["alice"], users["bob"], users["carol"], users["admin"]
    r = submit(
        alice,
        ray_job([sys.executable, "-c", DRIVER], "name: walled-ray\nenv: {HOLD: '1'}\n"),
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert r.json()["kind"] == "ray" and r.json()["ray"]["runtime_env"] == {"env_vars": {"GREETING": "hello-from-runtime-env"}}
    wait_for(lambda: "driver attempt 1" in logs(alice, job_id), 400, "the first attempt's driver to run on its cluster")
    out = logs(alice, job_id)
    assert "[gpuhub-ray] submitted" in out, out
    seen = json.loads(next(ln for ln in out.splitlines() if ln.startswith("driver attempt 1")).split(" ", 3)[3])
    assert len(seen[0]) == 1 and seen[1] == "hello-from-runtime-env", out  # its one GPU; Ray's runtime env
    rec = record(alice, job_id)
    assert rec["state"] == "running" and len(rec["attempts"][0]["devices"]) == 1, rec

    # carol, another team's user, from her own kernel: none of the ports alice's account
    # listens on (the GCS, raylets, object managers, workers, the dashboard and its agent)
    # accepts her, on loopback, on alice's address behind the wall or on the wall's hub side,
    # and her posts to the agent (no token check in Ray 2.52) find nothing.
    me = account(hub, "alice")
    ports = listeners_of(me.pw_uid)
    head, agent = pid_arg(me.pw_uid, b"--dashboard-agent-listen-port", b"--head")
    print(
        f"alice's Ray job listens on {len(ports)} TCP ports: " + ", ".join(f"{p} ({v['comm']})" for p, v in sorted(ports.items()))
    )
    assert agent in ports and len(ports) >= 5, ports  # a real cluster: GCS, dashboard, agent, raylet...
    wall = Wall.of(hub.user_network, hub.env["GPUHUB_ACCOUNT_PREFIX"])
    assert os.readlink(f"/proc/{head}/ns/net") != os.readlink("/proc/self/ns/net"), "the cluster runs in the machine's network"
    shown = subprocess.run(
        ["nsenter", "-t", str(head), "-n", "ip", "-j", "-4", "addr", "show", "dev", "eth0"], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    a_addr = json.loads(shown.stdout)[0]["addr_info"][0]["local"]  # her address behind the wall
    addresses = ["127.0.0.1", a_addr, wall.gateway]
    c_k = kernel(hub, carol)
    c_k.execute(PROBE)
    # On the hub's side of the wall what answers is the machine's (its own namespace): a port
    # some other process of the machine listens on there (another hub's, a server's) is not hers.
    host = host_listening_ports()
    targets = sorted({(addr, p) for addr in addresses for p in ports if not (addr == wall.gateway and p in host)})
    got = json.loads(c_k.execute(f"print(json.dumps(probe({targets!r})))", timeout=120))
    now_host = host_listening_ports()
    got = [[a, p] for a, p in got if a != wall.gateway or p not in now_host]
    assert got == [], f"carol reached alice's Ray job's ports: {got}"
    attack = json.loads(
        c_k.execute(
            textwrap.dedent(f"""\
        import urllib.request
        results = []
        for host in {addresses!r}:
            for port in ({agent}, 52365):
                req = urllib.request.Request(f"http://{{host}}:{{port}}/api/job_agent/jobs/", method="POST",
                    data=json.dumps({{"entrypoint": "id > pwned", "submission_id": "x1"}}).encode(),
                    headers={{"Content-Type": "application/json"}})
                try:
                    results.append([host, port, urllib.request.urlopen(req, timeout=4).status])
                except urllib.error.HTTPError as e:
                    results.append([host, port, e.code])
                except OSError:
                    pass
        print(json.dumps(results))
    """),
            timeout=120,
        )
    )
    assert attack == [], f"carol's submissions to alice's cluster got answers: {attack}"
    carol.stop()

    # bob's server needs the team's only GPU: the job is preempted, its whole cluster goes.
    assert bob.start("gpu-1").status_code in (201, 202)
    bob.wait_ready(timeout=120)
    wait_for(lambda: record(alice, job_id)["state"] == "queued", 60, "the Ray job to be preempted and queued again")
    assert record(alice, job_id)["attempts"][0]["reason"] == "preempted"
    nothing_left(hub, "alice", "the preemption")

    # bob's server gone, the job runs again on a new cluster of its own (not charged to its
    # retries: a preemption is the platform's doing), its driver succeeds, nothing is left.
    bob.stop()
    rec = wait_for(
        lambda: (x := record(alice, job_id))["state"] in ("succeeded", "failed", "cancelled") and x,
        300,
        "the Ray job's second attempt to run to its end",
    )
    out = logs(alice, job_id)
    assert rec["state"] == "succeeded", rec["status"] + "\n" + out[-3000:]
    assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"] and rec["attempts"][1]["exit_code"] == 0
    assert "driver attempt 2" in out and '"status": "SUCCEEDED"' in out
    nothing_left(hub, "alice", "the job succeeded")

    # A job of alice's like any other: `gpuhub job list/logs`, the API, the page, usage
    # history, the audit trail.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))} | {
        "GPUHUB_TOKEN": alice.token
    }
    gpuhub = [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url]
    shown = subprocess.run(gpuhub + ["list"], capture_output=True, text=True, env=env, timeout=60)
    assert any(ln.startswith(job_id) and "succeeded" in ln and "(ray)" in ln for ln in shown.stdout.splitlines()), shown
    shown = subprocess.run(gpuhub + ["logs", job_id], capture_output=True, text=True, env=env, timeout=60)
    assert "driver attempt 2" in shown.stdout, shown
    listed = {j["id"]: j for j in alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"]}
    assert listed[job_id]["kind"] == "ray" and listed[job_id]["user"] == "alice"
    page = alice.session.get(hub.url + f"/hub/gpuhub/jobs/{job_id}").text
    assert "Ray entrypoint" in page and "GREETING" in page
    # Usage history: her own view has the job's two admissions of its GPU, the first reclaimed.
    rows = alice.api.get(alice.url("/gpuhub/usage"), params={"since": "1d", "by": "user"}).json()["rows"]
    mine = [r for r in rows if r["kind"] == "job" and r["requested"] >= rec["submitted"] - 1]  # (not another test's job)
    assert sorted((r["user"], r["profile"], r["gpus"], r["end_reason"]) for r in mine) == [
        ("alice", "gpu-1", 1, "ended"),
        ("alice", "gpu-1", 1, "reclaimed"),
    ], rows
    entries = admin.api.get(admin.url("/gpuhub/audit"), params={"user": "alice", "event": "admitted"}).json()["entries"]
    assert [e["key"] for e in entries if e.get("key") == f"job:{job_id}"] == [f"job:{job_id}"] * 2, entries


def test_a_failed_driver_fails_the_job_with_its_exit_code_and_a_cancel_mid_start_leaves_nothing(hub, users):
    alice = users["alice"]
    r = submit(alice, ray_job([sys.executable, "-c", DRIVER], "env: {EXIT: '3'}\nretries: {limit: 0, reasons: [failed]}\n"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    rec = wait_for(
        lambda: (x := record(alice, job_id))["state"] in ("succeeded", "failed", "cancelled") and x,
        300,
        "the Ray job to run to its end",
    )
    out = logs(alice, job_id)
    # The driver's own exit code, through Ray's job submission (Ray says FAILED).
    assert rec["state"] == "failed" and rec["status"].startswith("failed: exit code 3"), rec["status"] + "\n" + out[-3000:]
    assert "driver attempt 1" in out and '"status": "FAILED"' in out and '"exit_code": 3' in out
    nothing_left(hub, "alice", "the job failed")
    # Cancelled while its cluster is starting: every process of it goes, the GPU is free.
    r = submit(alice, ray_job([sys.executable, "-c", DRIVER], "env: {HOLD: '1'}\n"))
    job_id = r.json()["id"]
    wait_for(lambda: any("ray.scripts.scripts start" in p for p in left_of(hub, "alice")[0]), 120, "the Ray head to start")
    rec = alice.api.post(alice.url(f"/gpuhub/jobs/{job_id}/cancel")).json()
    assert rec["state"] == "cancelled", rec
    nothing_left(hub, "alice", "the cancel")
