"""Batch jobs on Kubernetes end to end: a real JupyterHub with KueueSpawner on the API double
and, from the same code, on the real control plane (``GPUHUB_CLUSTER=1``; ``backends.py``).

``gpuhub job submit`` against the hub creates the suspended Job (built from the user's
server pod by KueueSpawner's own code path); Kueue's job integration admits it and the
job's command runs; a teammate's notebook server (priority ``interactive``) preempts it
(``withinClusterQueue: LowerPriority``), the record says so, and when the server stops the
next pod resumes from the checkpoint. What runs for real everywhere: the hub, the CLI, the
Job manifest through the API. On the double: the API server, Kueue, the Job controller and
the kubelet (``double/jobs.py``). On the real plane: kube-apiserver, Kueue v0.19.2,
kube-controller-manager's Job controller, kube-scheduler; kwok and ``StandInKubelet`` for the
kubelet (the pod's command runs as a local process; its exit code becomes the pod's phase).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from backends import backend_fixture, kube_hub_fixture, job_cli as cli, job_record as record
from support.hub import wait_for

pytestmark = pytest.mark.integration

POLICY = """\
apiVersion: gpuhub/v1
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}, local: {virtual: 1},
     tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]}
priorityClasses:
  - {name: interactive, value: 1000}
  - {name: batch, value: 100}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], defaultPriority: interactive, jobPriority: batch,
     quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}, perUser: {maxGPUs: 1}}
  - {name: nlp, displayName: NLP Group, groups: [nlp-group], quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}}
profiles:
  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision, nlp]}
  - {slug: nlp-only, displayName: NLP special, teams: [nlp]}
"""

KUBE_CONFIG = """
c.KubeJobManager.poll_interval = 0.3   # production: 10 s
"""

TRAIN = textwrap.dedent("""\
    import json, os, time
    d = os.environ["GPUHUB_CHECKPOINT_DIR"]; os.makedirs(d, exist_ok=True)
    ckpt = os.path.join(d, "state.json")
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "total": 0}
    print("attempt", os.environ["GPUHUB_ATTEMPT"], "from step", state["step"], flush=True)
    for step in range(state["step"] + 1, 9):
        time.sleep(2.5)  # long enough for a preemption to catch it mid-run on a loaded machine
        state = {"step": step, "total": state["total"] + step}
        json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
        print("step", step, flush=True)
    print("total", state["total"], flush=True)
""")


backend = backend_fixture(POLICY)


kube_hub = kube_hub_fixture(POLICY, KUBE_CONFIG, "kube-jobs")


def test_a_job_submitted_to_the_kube_hub_is_a_suspended_job_that_kueue_admits_preempts_and_resumes(kube_hub, backend, tmp_path):
    bob, carol, alice = kube_hub.login("bob"), kube_hub.login("carol"), kube_hub.login("alice")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpt = tmp_path / "ckpt"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: train\nprofile: l4-1\ncommand: [{sys.executable}, {script}]\ncheckpointDir: {ckpt}\n")
    job_id = cli(kube_hub, bob, "submit", str(job_file)).stdout.strip().splitlines()[-1]
    job = backend.job(job_id)
    labels = job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "vision" and labels["kueue.x-k8s.io/priority-class"] == "batch"
    env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "JUPYTERHUB_API_TOKEN" not in env  # no server credential in the Job
    wait_for(lambda: (ckpt / "state.json").exists() and '"step": 1' in (ckpt / "state.json").read_text(), 60, "step 1")
    assert cli(kube_hub, bob, "status", job_id).stdout.startswith("running: attempt 1 in pod")

    # A teammate's server (interactive, 1000) needs vision's only L4: Kueue preempts the batch job.
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready(timeout=120)
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "queued" and r, 60, "the job back in the queue")
    assert rec["attempts"][0]["reason"] == "preempted", rec["attempts"]
    assert not (ckpt / "state.json").read_text().count('"step": 8')  # caught mid-run
    [wl] = [w for w in backend.workloads() if job_id in w["metadata"]["name"]]
    evictions = {(e["reason"], e.get("underlyingCause", "")) for e in wl["status"]["schedulingStats"]["evictions"]}
    assert evictions == {("Preempted", "")}, wl["status"]  # N5: Kueue leaves the cause empty
    assert cli(kube_hub, bob, "status", job_id).stdout.startswith("queued: ")

    assert alice.stop().status_code in (202, 204)  # the L4 comes free: Kueue re-admits the job
    alice.wait_gone()
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "succeeded" and r, 120, "the job to finish")
    assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"], rec["attempts"]
    t0 = rec["attempts"][0]["queued"]
    print(
        f"\n[job timeline, {backend.name}] "
        + "; ".join(
            f"attempt {a['number']}: queued {a['queued'] - t0:.1f}s, admitted {(a.get('admitted') or t0) - t0:.1f}s, "
            f"ended {(a.get('finished') or t0) - t0:.1f}s ({a['reason']}: {a.get('message')!r})"
            for a in rec["attempts"]
        )
    )
    # The hub's copies of each pod's log (pods/log: the double's kubelet, or kwok serving the
    # stand-in process's output through the API server), the preempted attempt's included.
    out = cli(kube_hub, bob, "logs", job_id).stdout
    assert "from step 0" in out and "total 36" in out, out
    second = [ln for ln in out.splitlines() if ln.startswith("attempt")][-1]
    assert "from step 0" not in second  # attempt 2 resumed from the checkpoint
    assert rec["backend"] == "kubernetes" and rec["priority_class"] == "batch" and len(rec["policy_sha256"]) == 64
    # Another user sees nothing of it.
    assert carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}")).status_code == 404
    assert carol.api.post(carol.url(f"/gpuhub/jobs/{job_id}/cancel")).status_code == 404
    backend.healthy()


def test_refusals_and_cancel_on_the_kube_hub(kube_hub, backend, tmp_path):
    bob = kube_hub.login("bob")
    jobs = len(backend.jobs())
    bad = tmp_path / "forged.yaml"
    bad.write_text("profile: nlp-only\ncommand: [sleep, '60']\n")
    r = cli(kube_hub, bob, "submit", str(bad), check=False)
    assert "not available to your team(s)" in r.stderr and len(backend.jobs()) == jobs  # no Job made
    ok = tmp_path / "sleep.yaml"
    ok.write_text(f"profile: l4-1\ncommand: [{sys.executable}, -c, 'import time; time.sleep(120)']\n")
    job_id = cli(kube_hub, bob, "submit", str(ok)).stdout.strip().splitlines()[-1]
    wait_for(lambda: record(bob, job_id)["state"] == "running", 60, "running")
    # The job's wall (kube/walls.py, issue 39): two NetworkPolicies, owned by the Job, whose
    # selectors name the job's pods and bob's own pods (the real plane checks the selectors in
    # test_walls.py); collected with the Job (the real garbage collector on the real plane).
    [job] = [j for j in backend.jobs() if j["metadata"]["name"] == job_id]
    walls = {p["metadata"]["name"]: p for p in backend.network_policies() if p["metadata"]["name"].startswith(job_id)}
    assert sorted(walls) == [f"{job_id}-in", f"{job_id}-out"], sorted(walls)
    assert {r["uid"] for p in walls.values() for r in p["metadata"]["ownerReferences"]} == {job["metadata"]["uid"]}
    assert walls[f"{job_id}-in"]["spec"]["podSelector"] == {"matchLabels": {"gpuhub/job": job_id}}
    assert walls[f"{job_id}-out"]["spec"]["podSelector"]["matchLabels"]["hub.jupyter.org/username"] == "bob"
    assert cli(kube_hub, bob, "cancel", job_id).stdout.startswith("cancelled")
    wait_for(lambda: backend.job(job_id) is None and not backend.pods_of_job(job_id), 60, "the Job and its pods gone")
    wait_for(
        lambda: not [p for p in backend.network_policies() if p["metadata"]["name"].startswith(job_id)],
        60,
        "the job's NetworkPolicies collected with it",
    )
