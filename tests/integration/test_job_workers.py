"""Several workers admitted together (issue 44) against a real hub run as root: ``workers: 2``
gets both workers or none, both rendezvous (MASTER_ADDR/PORT, WORLD_SIZE, RANK) inside the
user's own network, and a teammate's server preempts the whole job, not one worker.

One hub for the module (its own account prefix and data directory: tests/support/hub.py);
two virtual GPUs stand in for NVML.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from support.hub import Hub, alive, processes_with_env, wait_for
from support.jobs import logs, record, wait_state
from support.policies import jobs_policy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root"),
]

POLICY = jobs_policy(
    vision_gpus=2,
    profiles="""\
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision], cpu: 500m, memory: 1Gi}
""",
)

# torch.distributed's rendezvous in miniature: rank 0 listens on MASTER_ADDR:MASTER_PORT,
# every other rank connects and says who it is; rank 0 reports whom it heard.
WORKER = textwrap.dedent("""\
    import os, socket, time
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    print("worker", " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if rank == 0:
        s = socket.create_server(addr)
        heard = []
        while len(heard) < world - 1:
            conn, _ = s.accept()
            heard.append(conn.recv(100).decode())
        print("rank 0 heard", sorted(heard), flush=True)
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(addr).sendall(f"rank {rank} on {env['CUDA_VISIBLE_DEVICES']}".encode())
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    if os.environ.get("HOLD"):
        print("rank", rank, "up", flush=True)
        time.sleep(600)
""")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("workers"), POLICY)
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "admin")}


def submit(user, spec: dict) -> str:
    r = user.api.post(user.url("/gpuhub/jobs"), json={"spec": json.dumps(spec), "filename": "workers.yaml"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def held(users) -> dict[str, list[str]]:
    snap = users["admin"].api.get(users["admin"].url("/gpuhub/status")).json()
    return {d["id"]: d for d in snap["devices"] if d["held"]}


def job_processes(job_id: str) -> list[int]:
    return [p for p in processes_with_env(f"GPUHUB_JOB_ID={job_id}") if alive(p)]


def test_two_workers_get_both_gpus_or_none_and_meet_at_their_rendezvous(hub, users):
    alice, bob = users["alice"], users["bob"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    job_id = submit(bob, {"profile": "gpu-1", "workers": 2, "command": [sys.executable, "-c", WORKER]})
    # One GPU is free, the job needs two: nothing of it starts.
    rec = record(bob, job_id)
    assert rec["state"] == "queued" and rec["workers"] == 2, rec
    assert "needs 2 Tesla GPU" in rec["status"], rec["status"]
    assert len(held(users)) == 1 and job_processes(job_id) == [] and logs(bob, job_id) == ""
    alice.stop()
    rec = wait_state(bob, job_id, "succeeded", "failed")
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    att = rec["attempts"][0]
    assert sorted(att["devices"]) == ["0", "1"]
    port = att["rendezvous"]["master_port"]
    assert att["rendezvous"] == {"master_addr": "127.0.0.1", "master_port": port, "world_size": 2}
    assert port < 32768  # not from the ephemeral range
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("worker "))
    assert len(lines) == 2, out
    seen = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in lines]
    assert [(w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"]) for w in seen] == [("0", "0", "2"), ("1", "1", "2")]
    assert {w["MASTER_PORT"] for w in seen} == {str(port)} and {w["MASTER_ADDR"] for w in seen} == {"127.0.0.1"}
    assert sorted(w["CUDA_VISIBLE_DEVICES"] for w in seen) == ["0", "1"]  # one GPU each, not the same
    rank1_gpu = next(w["CUDA_VISIBLE_DEVICES"] for w in seen if w["RANK"] == "1")
    assert f"rank 0 heard ['rank 1 on {rank1_gpu}']" in out
    alice.wait_gone()


def test_a_teammates_server_preempts_the_whole_job_not_one_worker(hub, users):
    alice, bob = users["alice"], users["bob"]
    job_id = submit(
        bob,
        {
            "profile": "gpu-1",
            "workers": 2,
            "command": [sys.executable, "-c", WORKER],
            "env": {"HOLD": "1"},
            "retries": {"limit": 0, "reasons": ["preempted"]},
        },
    )
    wait_for(lambda: "rank 0 up" in (o := logs(bob, job_id)) and "rank 1 up" in o, 90, "both workers to be up")
    assert len(job_processes(job_id)) >= 2 and len(held(users)) == 2
    # alice needs one GPU; the job holds both: the whole job goes, both workers, both GPUs.
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    rec = wait_state(bob, job_id, "queued")
    assert rec["attempts"][0]["reason"] == "preempted"
    assert job_processes(job_id) == []
    assert len(held(users)) == 1  # alice's; the job's other GPU is free too
    # It waits for both GPUs again, not for one.
    assert "needs 2 Tesla GPU" in record(bob, job_id)["status"]
    alice.stop()
    wait_for(lambda: logs(bob, job_id).count("rank 1 up") == 2, 90, "both workers of the second attempt")
    assert record(bob, job_id)["attempts"][1]["devices"] and len(job_processes(job_id)) >= 2
    assert bob.api.post(bob.url(f"/gpuhub/jobs/{job_id}/cancel")).json()["state"] == "cancelled"
    assert job_processes(job_id) == [] and held(users) == {}
    alice.wait_gone()


def test_a_failing_worker_ends_the_others_and_the_job_says_which(hub, users):
    bob = users["bob"]
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(7)\ntime.sleep(600)"
    job_id = submit(bob, {"profile": "gpu-1", "workers": 2, "command": [sys.executable, "-c", code]})
    rec = wait_state(bob, job_id, "failed", "succeeded")
    assert rec["status"].startswith("failed: exit code 7 (worker rank 1; the other workers were stopped)"), rec["status"]
    assert job_processes(job_id) == [] and held(users) == {}


def test_a_hub_restart_ends_every_worker_of_a_running_job_and_runs_it_again_whole(hub, users):
    bob = users["bob"]
    spec = {"profile": "gpu-1", "workers": 2, "command": [sys.executable, "-c", WORKER], "env": {"HOLD": "1"}}
    job_id = submit(bob, spec)
    wait_for(lambda: "rank 0 up" in (o := logs(bob, job_id)) and "rank 1 up" in o, 90, "both workers to be up")
    before = set(job_processes(job_id))
    assert len(before) >= 2
    hub.stop(kill_servers=False)  # the workers outlive the hub's process...
    assert any(alive(p) for p in before)
    hub.start()
    users.update({n: hub.login(n) for n in ("alice", "bob", "admin")})
    bob = users["bob"]
    # ...and the restarted hub ends all of them, then runs the job again with both workers.
    wait_for(lambda: logs(bob, job_id).count("rank 1 up") == 2, 120, "both workers of the attempt after the restart")
    rec = record(bob, job_id)
    assert rec["attempts"][0]["reason"] == "interrupted"
    assert not any(alive(p) for p in before)
    assert bob.api.post(bob.url(f"/gpuhub/jobs/{job_id}/cancel")).json()["state"] == "cancelled"
    assert job_processes(job_id) == [] and held(users) == {}
