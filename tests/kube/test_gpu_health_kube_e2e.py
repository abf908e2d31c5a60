"""A GPU that fails under a running pod on Kubernetes, in a real hub on the API double (issue 23).

A real JupyterHub with the Kubernetes spawner, the ledger and the capacity keeper as
``hub.extraConfig`` starts them (``wiring/kube.configure_ledger``). The L4 node every pod of the
double is bound to (``double-node-1``, the L4 node of ``tests/cluster/nodes.yaml`` under that
name) gets the taint NVSentinel or node-problem-detector put on a node whose GPU failed,
``nvidia.com/gpu-error=XID79``:

* alice, whose server holds one of its L4s, is told as on one machine: her JupyterLab's long
  poll (``/hub/api/gpuhub/culling/alice?gpu_wait=25``, what the lab extension asks through its
  server) answers with her server's entry, and her home page has the notice (files kept, a
  restart gets a healthy GPU); bob's CPU-only server on the same node and bob's answers say
  nothing; the taint gone, her entry goes.
* bob's batch job (``retries: {limit: 0, reasons: [failed]}``) running there ends its attempt
  ``gpu-failed``: the hub deactivates its Workload, Kueue suspends the Job (its pod deleted,
  not a failure), the job waits while the node is out (the keeper lowered vision's quota to 0),
  and once the node is back it resumes from its checkpoint and succeeds, the GPU failure not
  counted against its retries (the Job's ``status.failed`` stays 0).
* the same job evicted by a NoExecute taint (Kubernetes' taint manager: ``DisruptionTarget``,
  reason ``DeletionByTaintManager``) ends that attempt ``gpu-failed`` too; the Job controller
  starts the next pod (``podFailurePolicy`` ignores disruptions with the default reasons).

What a holder is told comes only from a taint: a shrunk allocatable lowers the quota
(``test_capacity_hub_e2e.py``) but the hub cannot know which pod's device failed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml

from backends import SERVER_DEFAULTS, vision_jobs_on_l4
from double.harness import KUBECONFIG, NAMESPACE, apply_policy
from support.hub import Hub, wait_for
from support.jobs import record
from test_capacity_hub_e2e import vision_l4_quota
from test_hub_e2e import KUBE_CONFIG, WAIT

pytestmark = pytest.mark.integration

NODE = "double-node-1"  # the double's kubelet binds every pod to this node
L4_NODE = next(
    n
    for n in yaml.safe_load_all((Path(__file__).resolve().parents[1] / "cluster" / "nodes.yaml").read_text())
    if n["metadata"]["name"] == "kwok-gpu-l4-1"
)
TAINT = {"key": "nvidia.com/gpu-error", "value": "XID79", "effect": "NoSchedule"}


def health_policy(tolerations: bool) -> str:
    """The GPU health scenario (two L4s, one per user, the capacity queue synced every second);
    the real plane's file adds the toleration of its L4 nodes' taint."""
    health = "health:\n  kubernetes:\n    capacityQueue: {l4: vision}\n    syncInterval: 1s\n"
    return vision_jobs_on_l4(virtual=1, cpu=6, gpus=2, max_gpus=1, tolerations=tolerations, rest=SERVER_DEFAULTS + health)


POLICY = health_policy(tolerations=False)

HUB_EXTRA = (
    KUBE_CONFIG
    + """
c.KubeJobManager.poll_interval = 0.3   # production: 10 s
"""
)

TRAIN = textwrap.dedent("""\
    import json, os, time
    d = os.environ["GPUHUB_CHECKPOINT_DIR"]; os.makedirs(d, exist_ok=True)
    ckpt = os.path.join(d, "state.json")
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "total": 0}
    print("attempt", os.environ["GPUHUB_ATTEMPT"], "from step", state["step"], flush=True)
    for step in range(state["step"] + 1, 9):
        time.sleep(2.5)  # long enough for the node's failure to catch it mid-run on a loaded machine
        state = {"step": step, "total": state["total"] + step}
        json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
        print("step", step, flush=True)
    print("total", state["total"], flush=True)
""")


def l4_node(*taints: dict) -> dict:
    node = copy.deepcopy(L4_NODE)
    node["metadata"]["name"] = NODE
    node["metadata"]["labels"]["kubernetes.io/hostname"] = NODE
    node["spec"] = {k: v for k, v in (node.get("spec") or {}).items() if k != "taints"}
    if taints:
        node["spec"]["taints"] = [dict(t) for t in taints]
    return node


@pytest.fixture(scope="module")
def health_hub(double, tmp_path_factory):
    double.reset()
    apply_policy(double, POLICY)
    double.put_node(l4_node())
    hub = Hub(tmp_path_factory.mktemp("gpu-health-kube-hub"), POLICY, extra_config=HUB_EXTRA, env={"KUBECONFIG": str(KUBECONFIG)})
    try:
        hub.start()
        yield hub
    finally:
        hub.stop()
        double.reset()


@pytest.fixture
def healthy_node(double, health_hub):
    """Every test starts and ends with the node healthy and vision's quota the policy's."""
    double.put_node(l4_node())
    wait_for(lambda: vision_l4_quota(double) == "2", WAIT, "vision's L4 quota at the policy's 2")
    yield
    double.put_node(l4_node())
    assert double.invalid == [] and double.errors == [], (double.invalid, double.errors)


def culling(user, wait: float | None = None) -> dict:
    query = f"?gpu_wait={wait:g}" if wait else ""
    r = user.api.get(user.url(f"/gpuhub/culling/{user.name}{query}"), timeout=60)
    r.raise_for_status()
    return r.json()


def home(user) -> str:
    r = user.session.get(user.hub.url + "/hub/home")
    r.raise_for_status()
    return r.text


def cli(hub, user, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env["GPUHUB_TOKEN"] = user.token
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr + hub.tail(40)
    return r.stdout


def submit(hub, user, tmp_path, retries: str) -> tuple[str, Path]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpt = tmp_path / "ckpt"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"name: train\nprofile: l4-1\ncommand: [{sys.executable}, {script}]\ncheckpointDir: {ckpt}\nretries: {retries}\n"
    )
    job_id = cli(hub, user, "submit", str(job_file)).strip().splitlines()[-1]
    wait_for(
        lambda: (ckpt / "state.json").exists() and '"step": 1' in (ckpt / "state.json").read_text(), WAIT, "the job's step 1"
    )
    return job_id, ckpt


def one_attempt_per_pod(rec: dict) -> str:
    """Each attempt ran in a pod of its own, numbered in order: the hub's poller and its API
    answers (this file's wait_for) read the job at once, and never take one pod for two
    attempts (tests/kube/test_job_refresh.py). Returns the attempts, for messages."""
    attempts = json.dumps(rec["attempts"], indent=1)
    pods = [a["account"] for a in rec["attempts"]]
    assert all(pods) and len(set(pods)) == len(pods), attempts
    assert [a["number"] for a in rec["attempts"]] == list(range(1, len(pods) + 1)), attempts
    return attempts


def test_the_holder_of_a_server_on_a_node_whose_gpu_failed_is_told_in_jupyterlab_and_on_the_home_page(
    health_hub, double, healthy_node
):
    alice, bob = health_hub.login("alice"), health_hub.login("bob")
    assert alice.start("l4-1").status_code in (201, 202)
    assert bob.start("cpu").status_code in (201, 202)
    alice.wait_ready()
    bob.wait_ready()
    assert culling(alice)["gpu_failed"] == {} and "gpuhub-gpu-failures" not in home(alice)

    # JupyterLab's long poll is waiting when the node's GPU fails (NVSentinel's taint).
    answer: dict = {}
    poll = threading.Thread(target=lambda: answer.update(culling(alice, wait=25)))
    poll.start()
    double.put_node(l4_node(TAINT))
    poll.join(60)
    assert not poll.is_alive()
    # Woken by the change, as a rule; a poll that ran out first (the keeper's pass came after
    # its 25 s on a loaded machine) answers what it started with, and JupyterLab polls again.
    entry = answer["gpu_failed"].get("") or wait_for(
        lambda: answer.update(culling(alice, wait=25)) or answer["gpu_failed"].get(""), WAIT, "alice told"
    )
    assert entry["devices"] == [f"node {NODE}"] and entry["xid"] is None, entry
    assert entry["reason"] == f"node {NODE}: nvidia.com/gpu-error=XID79", entry
    assert isinstance(entry["since"], (int, float)) and answer["gpu_wait"] == 25, answer

    page = wait_for(lambda: (lambda p: p if "gpuhub-gpu-failures" in p else None)(home(alice)), WAIT, "alice's home page")
    notice = re.sub(r"\s+", " ", re.search(r'id="gpuhub-gpu-failures">(.*?)</div>\s*</div>', page, re.S).group(1))
    assert "The GPU of server (default) failed" in notice and f"node {NODE}: nvidia.com/gpu-error=XID79" in notice, notice
    assert "Your files are kept" in notice and "a restart gets a healthy GPU" in notice, notice

    # bob's CPU-only server on the same node holds no GPU: nothing for him, nothing of alice.
    assert culling(bob)["gpu_failed"] == {}
    assert "gpuhub-gpu-failures" not in home(bob)
    assert alice.api.get(alice.url("/gpuhub/culling/bob")).status_code == 404
    # The keeper took the node's 4 GPUs out of vision's quota (2 -> 0).
    wait_for(lambda: vision_l4_quota(double) == "0", WAIT, "vision's quota lowered")

    # The node repaired (taint removed): the notice goes away, the quota comes back.
    double.put_node(l4_node())
    wait_for(lambda: culling(alice)["gpu_failed"] == {}, WAIT, "alice's entry cleared")
    assert "gpuhub-gpu-failures" not in home(alice)
    wait_for(lambda: vision_l4_quota(double) == "2", WAIT, "vision's quota restored")
    alice.stop()
    bob.stop()
    alice.wait_gone()
    bob.wait_gone()


def test_a_job_on_a_node_whose_gpu_failed_ends_gpu_failed_and_resumes_from_its_checkpoint_without_a_retry(
    health_hub, double, healthy_node, tmp_path
):
    bob = health_hub.login("bob")
    job_id, ckpt = submit(health_hub, bob, tmp_path, "{limit: 0, reasons: [failed]}")
    [first_pod] = [p["metadata"]["name"] for p in double.pods_of_job(NAMESPACE, job_id)]

    double.put_node(l4_node(TAINT))
    rec = wait_for(
        lambda: (r := record(bob, job_id))["attempts"][0].get("reason") == "gpu-failed" and r, WAIT, "attempt 1 ended gpu-failed"
    )
    first = rec["attempts"][0]
    assert first["account"] == first_pod and first["devices"] == [NODE], first
    assert first["message"].startswith(f"its node's GPUs went out of service (node {NODE}: nvidia.com/gpu-error=XID79)"), first
    assert "not counted against its retries" in first["message"], first
    # Kueue suspended the Job (its pod deleted, not a failure) and the job waits while the node is out.
    wait_for(
        lambda: (double.get("jobs", NAMESPACE, job_id) or {}).get("spec", {}).get("suspend") is True, WAIT, "the Job suspended"
    )
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "queued" and r, WAIT, "the job queued again")
    assert '"step": 8' not in (ckpt / "state.json").read_text()  # caught mid-run
    wl = next(w for w in double.list("workloads", NAMESPACE) if job_id in w["metadata"]["name"])
    assert {e["reason"] for e in wl["status"]["schedulingStats"]["evictions"]} == {"Deactivated"}, wl["status"]
    assert cli(health_hub, bob, "status", job_id).startswith("queued: ")

    # The node repaired: vision's quota comes back, Kueue admits the job, it resumes and succeeds.
    double.put_node(l4_node())
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] in ("succeeded", "failed") and r, 3 * WAIT, "the job's end")
    assert rec["state"] == "succeeded", rec
    attempts = one_attempt_per_pod(rec)
    reasons = [a["reason"] for a in rec["attempts"]]
    # ["gpu-failed", "succeeded"]; a further gpu-failed attempt only if Kueue re-admitted the job
    # before the keeper's lowered quota landed, as the double binds every pod to this node.
    assert reasons[0] == "gpu-failed" and reasons[-1] == "succeeded" and set(reasons[1:-1]) <= {"gpu-failed"}, attempts
    job = double.get("jobs", NAMESPACE, job_id)
    assert job["spec"]["backoffLimit"] == 0 and not job["status"].get("failed"), job["status"]  # no retry used
    out = cli(health_hub, bob, "logs", job_id)
    assert "from step 0" in out and "total 36" in out, out
    second = [ln for ln in out.splitlines() if ln.startswith("attempt")][-1]
    assert "from step 0" not in second, out  # attempt 2 resumed from the checkpoint


def test_a_job_evicted_by_a_noexecute_taint_ends_that_attempt_gpu_failed(health_hub, double, healthy_node, tmp_path):
    bob = health_hub.login("bob")
    job_id, ckpt = submit(health_hub, bob, tmp_path, "{limit: 0}")
    [first_pod] = [p["metadata"]["name"] for p in double.pods_of_job(NAMESPACE, job_id)]

    # The taint and Kubernetes' taint manager in one step: the pod is evicted before the hub
    # can act on the taint itself.
    evicted = double.taint_node(l4_node({**TAINT, "effect": "NoExecute"}))
    assert evicted == [f"{NAMESPACE}/{first_pod}"], evicted
    rec = wait_for(lambda: (r := record(bob, job_id))["attempts"][0].get("reason") and r, WAIT, "attempt 1 ended")
    first = rec["attempts"][0]
    assert first["account"] == first_pod and first["reason"] == "gpu-failed", rec["attempts"]
    assert first["message"].startswith(f"its node's GPUs went out of service (node {NODE}: nvidia.com/gpu-error=XID79)")

    double.put_node(l4_node())
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] in ("succeeded", "failed") and r, 3 * WAIT, "the job's end")
    assert rec["state"] == "succeeded", rec
    attempts = one_attempt_per_pod(rec)
    reasons = [a["reason"] for a in rec["attempts"]]
    # The double binds the Job controller's next pod to the same node (it has no taint-aware
    # scheduler), where the hub ends it gpu-failed as well; a real scheduler keeps it off.
    # Every attempt has an end, and none of them counts as the job's own failure.
    assert reasons[0] == "gpu-failed" and reasons[-1] == "succeeded", attempts
    assert set(reasons[1:-1]) <= {"gpu-failed"}, attempts
    assert json.loads((ckpt / "state.json").read_text())["step"] == 8
    out = cli(health_hub, bob, "logs", job_id)
    assert "from step 0" not in [ln for ln in out.splitlines() if ln.startswith("attempt")][-1], out
