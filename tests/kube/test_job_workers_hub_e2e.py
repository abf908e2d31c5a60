"""Several workers on Kubernetes (issue 44, item 3): a real JupyterHub submits a ``workers: 2``
job as an Indexed Job that Kueue admits all or nothing, on the API double and, from the same
code, on the real control plane (``GPUHUB_CLUSTER=1``; ``backends.py``).

What runs for real everywhere: the hub, the CLI, the Job and its headless Service through the
API. On the real plane: kube-apiserver, Kueue v0.19.2 (one Workload, one pod set of count 2),
kube-controller-manager's Job controller (the two indexed pods, their completion indexes, the
garbage collector), kube-scheduler; the hub speaks as the install guide's service account,
and every request it made is read back from the API server's audit log (none refused, none
outside ``kube/rights.py``). kwok runs no containers: the ranks and world size are read from
the pods the Job controller made (the completion index it set, the env's downward-API
reference to it), and ``StandInKubelet`` runs each pod's command with that env resolved as a
kubelet would. No DNS here: rank 0's name is checked as the Service and pod hostnames make it,
not resolved (the rendezvous itself is shown on one machine, tests/integration/test_job_workers.py).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from backends import backend_fixture, kube_hub_fixture, job_cli as cli, job_record as record, condition, vision_jobs_on_l4
from support.hub import wait_for

pytestmark = pytest.mark.integration

POLICY = vision_jobs_on_l4(virtual=2, cpu=8, gpus=2, max_gpus=2)

KUBE_CONFIG = """
c.KubeJobManager.poll_interval = 0.3   # production: 10 s
"""

# Each worker says what it was given, then waits for the test to have read the pods.
WORKER = textwrap.dedent("""\
    import os, sys, time
    e = os.environ
    print("rank", e["RANK"], "of", e["WORLD_SIZE"], "master", e["MASTER_ADDR"] + ":" + e["MASTER_PORT"], flush=True)
    go = sys.argv[1]
    for _ in range(3000):
        if os.path.exists(go):
            break
        time.sleep(0.1)
    sys.exit(int(e.get("FAIL_RANK", "-1") == e["RANK"]) * 3)
""")

backend = backend_fixture(POLICY)


kube_hub = kube_hub_fixture(POLICY, KUBE_CONFIG, "kube-workers")


def test_a_two_worker_job_gets_both_workers_or_none_each_with_its_rank(kube_hub, backend, tmp_path):
    bob, alice = kube_hub.login("bob"), kube_hub.login("alice")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: ddp\nprofile: l4-1\nworkers: 2\ncommand: [{sys.executable}, {script}, {go}]\n")

    # A retry on a failing exit cannot restart one worker alone: refused, with the reason, nothing made.
    bad = tmp_path / "bad.yaml"
    bad.write_text(job_file.read_text() + "retries: {limit: 2, reasons: [failed]}\n")
    jobs = len(backend.jobs())
    r = cli(kube_hub, bob, "submit", str(bad), check=False)
    assert r.returncode != 0 and "a failing worker ends the whole job" in r.stderr, r.stderr
    assert len(backend.jobs()) == jobs

    # A teammate holds one of the team's two L4s: the 2-worker job waits, nothing of it starts.
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready(timeout=120)
    job_id = cli(kube_hub, bob, "submit", str(job_file)).stdout.strip().splitlines()[-1]
    job = backend.job(job_id)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == job["spec"]["completions"] == 2
    wl = wait_for(
        lambda: next((w for w in backend.workloads() if job_id in w["metadata"]["name"] and condition(w, "QuotaReserved")), None),
        60,
        "Kueue's verdict on the job's Workload",
    )
    assert [(ps["name"], ps["count"]) for ps in wl["spec"]["podSets"]] == [("main", 2)]  # one request for both
    assert condition(wl, "QuotaReserved")["status"] == "False", wl["status"]
    print(f"\n[{backend.name}] waiting: {condition(wl, 'QuotaReserved')['message']}")
    assert backend.job(job_id)["spec"]["suspend"] is True and backend.pods_of_job(job_id) == []  # nothing half-started
    rec = record(bob, job_id)
    assert rec["state"] == "queued" and rec["workers"] == 2
    assert cli(kube_hub, bob, "status", job_id).stdout.startswith("queued: ")

    # The L4 comes free: both workers are admitted together.
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    rec = wait_for(
        lambda: (
            (r := record(bob, job_id))["state"] == "running"
            and all((r["attempts"][-1]["rendezvous"] or {}).get("pods") or [None])
            and r
        ),
        120,
        "both workers running",
    )
    pods = wait_for(
        lambda: len(p := backend.pods_of_job(job_id)) == 2 and all(x["spec"].get("nodeName") for x in p) and p,
        60,
        "both pods bound",
    )
    index = "batch.kubernetes.io/job-completion-index"
    by_rank = {int(p["metadata"]["annotations"][index]): p for p in pods}
    assert sorted(by_rank) == [0, 1], [p["metadata"]["annotations"] for p in pods]
    for rank, pod in by_rank.items():
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["WORLD_SIZE"]["value"] == "2" and env["MASTER_PORT"]["value"] == "29500"
        assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{index}']"
        assert env["MASTER_ADDR"]["value"] == f"{job_id}-0.{job_id}"
        assert pod["spec"]["hostname"] == f"{job_id}-{rank}" and pod["spec"]["subdomain"] == job_id  # <job>-<rank>.<job>
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert rec["attempts"][-1]["rendezvous"]["pods"] == [by_rank[0]["metadata"]["name"], by_rank[1]["metadata"]["name"]]
    [svc] = [s for s in backend.services() if s["metadata"]["name"] == job_id]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"gpuhub/job": job_id}
    assert [o["uid"] for o in svc["metadata"]["ownerReferences"]] == [backend.job(job_id)["metadata"]["uid"]]
    [wl] = [w for w in backend.workloads() if job_id in w["metadata"]["name"]]
    assert [a["count"] for a in wl["status"]["admission"]["podSetAssignments"]] == [2]
    status = cli(kube_hub, bob, "status", job_id).stdout
    assert status.startswith("running: attempt 1, 2 workers in pods "), status

    go.write_text("")
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "succeeded" and r, 120, "the job to finish")
    assert [a["reason"] for a in rec["attempts"]] == ["succeeded"], rec["attempts"]
    out = cli(kube_hub, bob, "logs", job_id).stdout
    assert f"rank 0 of 2 master {job_id}-0.{job_id}:29500" in out and f"rank 1 of 2 master {job_id}-0.{job_id}:29500" in out, out
    assert "[gpuhub] worker rank 0" in out and "[gpuhub] worker rank 1" in out
    backend.healthy()  # real plane: the hub's requests (services create among them) all allowed by the shipped Role


def test_a_failing_worker_ends_the_whole_job_with_its_rank(kube_hub, backend, tmp_path):
    bob = kube_hub.login("bob")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    go.write_text("")  # no waiting: rank 1 exits 3 at once, rank 0 at once with 0
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"profile: l4-1\nworkers: 2\nenv: {{FAIL_RANK: '1'}}\ncommand: [{sys.executable}, {script}, {go}]\n")
    job_id = cli(kube_hub, bob, "submit", str(job_file)).stdout.strip().splitlines()[-1]
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "failed" and r, 120, "the job to fail")
    att = rec["attempts"][-1]
    assert len(rec["attempts"]) == 1 and att["exit_code"] == 3, rec["attempts"]
    assert "exit code 3 (worker rank 1; the other workers were stopped)" in rec["message"], rec["message"]
    job = backend.job(job_id)
    assert condition(job, "Failed")["status"] == "True" and not job["status"].get("active")
    backend.healthy()
