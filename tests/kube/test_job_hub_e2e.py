"""Batch jobs on Kubernetes end to end: a real JupyterHub with KueueSpawner on the API double.

``gpuhub job submit`` against the hub creates the suspended Job (built from the user's
server pod by KueueSpawner's own code path); the double's model of Kueue's job
integration admits it and its kubelet runs the job's command; a preemption suspends it,
the record says so, and the next pod resumes from the checkpoint. What runs for real:
the hub, the CLI, the Job manifest through the API; what is the double: the API server,
Kueue, the Job controller and the kubelet (``double/jobs.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from double.harness import KUBECONFIG, NAMESPACE, apply_policy
from support.hub import Hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
apiVersion: gpuhub/v1
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}, local: {virtual: 1}}
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

KUBE_CONFIG = f"""
c.JupyterHub.spawner_class = "gpuhub-kube"
c.KubeSpawner.namespace = {NAMESPACE!r}
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]
c.KubeSpawner.args = []
c.KubeSpawner.ip = "127.0.0.1"
c.KubeJobManager.poll_interval = 0.3   # production: 10 s
"""

TRAIN = textwrap.dedent("""\
    import json, os, time
    d = os.environ["GPUHUB_CHECKPOINT_DIR"]; os.makedirs(d, exist_ok=True)
    ckpt = os.path.join(d, "state.json")
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "total": 0}
    print("attempt", os.environ["GPUHUB_ATTEMPT"], "from step", state["step"], flush=True)
    for step in range(state["step"] + 1, 9):
        time.sleep(0.4)
        state = {"step": step, "total": state["total"] + step}
        json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
        print("step", step, flush=True)
    print("total", state["total"], flush=True)
""")


@pytest.fixture(scope="module")
def kube_hub(double, tmp_path_factory):
    apply_policy(double, POLICY)
    hub = Hub(tmp_path_factory.mktemp("kube-jobs"), POLICY, extra_config=KUBE_CONFIG, env={"KUBECONFIG": str(KUBECONFIG)})
    try:
        hub.start()
        yield hub
    finally:
        hub.stop()
        double.reset()


def cli(hub, user, *args, check=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env["GPUHUB_TOKEN"] = user.token
    r = subprocess.run([sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, *args],
                       capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert r.returncode == 0, r.stderr + hub.tail(40)
    return r


def record(user, job_id):
    r = user.api.get(user.url(f"/gpuhub/jobs/{job_id}"))
    r.raise_for_status()
    return r.json()


def test_a_job_submitted_to_the_kube_hub_is_a_suspended_job_that_kueue_admits_preempts_and_resumes(kube_hub, double, tmp_path):
    bob, carol = kube_hub.login("bob"), kube_hub.login("carol")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpt = tmp_path / "ckpt"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: train\nprofile: l4-1\ncommand: [{sys.executable}, {script}]\ncheckpointDir: {ckpt}\n")
    job_id = cli(kube_hub, bob, "submit", str(job_file)).stdout.strip().splitlines()[-1]
    job = double.get("jobs", NAMESPACE, job_id)
    labels = job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "vision" and labels["kueue.x-k8s.io/priority-class"] == "batch"
    env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "JUPYTERHUB_API_TOKEN" not in env  # no server credential in the Job
    wait_for(lambda: (ckpt / "state.json").exists() and '"step": 2' in (ckpt / "state.json").read_text(), 30, "step 2")
    assert cli(kube_hub, bob, "status", job_id).stdout.startswith("running: attempt 1 in pod")
    double.preempt_job(NAMESPACE, job_id)  # Kueue preempts it for higher-priority work
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "succeeded" and r, 60, "the job to finish")
    assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"], rec["attempts"]
    out = cli(kube_hub, bob, "logs", job_id).stdout
    assert "from step 0" in out and "total 36" in out
    second = [ln for ln in out.splitlines() if ln.startswith("attempt")][-1]
    assert "from step 0" not in second  # attempt 2 resumed from the checkpoint
    assert rec["backend"] == "kubernetes" and rec["priority_class"] == "batch" and len(rec["policy_sha256"]) == 64
    # Another user sees nothing of it.
    assert carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}")).status_code == 404
    assert carol.api.post(carol.url(f"/gpuhub/jobs/{job_id}/cancel")).status_code == 404


def test_refusals_and_cancel_on_the_kube_hub(kube_hub, double, tmp_path):
    bob = kube_hub.login("bob")
    creates = double.count("POST", "jobs")
    bad = tmp_path / "forged.yaml"
    bad.write_text("profile: nlp-only\ncommand: [sleep, '60']\n")
    r = cli(kube_hub, bob, "submit", str(bad), check=False)
    assert "not available to your team(s)" in r.stderr and double.count("POST", "jobs") == creates  # no Job made
    ok = tmp_path / "sleep.yaml"
    ok.write_text(f"profile: l4-1\ncommand: [{sys.executable}, -c, 'import time; time.sleep(120)']\n")
    job_id = cli(kube_hub, bob, "submit", str(ok)).stdout.strip().splitlines()[-1]
    wait_for(lambda: record(bob, job_id)["state"] == "running", 30, "running")
    assert cli(kube_hub, bob, "cancel", job_id).stdout.startswith("cancelled")
    assert double.get("jobs", NAMESPACE, job_id) is None and not double.pods_of_job(NAMESPACE, job_id)
