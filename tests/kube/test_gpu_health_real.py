"""A GPU that fails under running pods, on the real control plane (issue 23; ``GPUHUB_CLUSTER=1``).

The scenarios of ``test_gpu_health_kube_e2e.py`` (which runs them on the API double) against
``tests/cluster/up.sh``'s kube-apiserver, kube-scheduler, the Job controller and the real Kueue
v0.19.2, with kwok's L4 node (``kwok-gpu-l4-1``, 4 GPUs) tainted by ``kubectl taint`` as
NVSentinel or node-problem-detector would taint it (``nvidia.com/gpu-error=XID79:NoSchedule``).
A real hub (``backends.RealBackend``: the stand-in kubelet runs each Running pod's command):

* alice's server, bound by kube-scheduler to the L4 node: her JupyterLab long poll answers with
  her server's entry, her home page has the notice; bob is told nothing; the hub's keeper lowers
  vision's ClusterQueue to 0 and Kueue says so; the taint removed, her entry goes and the quota
  comes back.
* bob's job caught mid-run there: the hub deactivates its Workload, the real Kueue evicts it and
  suspends the Job, the attempt is ``gpu-failed``; the taint removed, Kueue admits it again and
  it resumes from its checkpoint and succeeds, the Job's ``status.failed`` 0 with
  ``backoffLimit: 0``.
"""

from __future__ import annotations

import re
import sys
import threading

import pytest

from backends import RealBackend
from support.hub import Hub, wait_for
from test_gpu_health_kube_e2e import WAIT, cli, culling, health_policy, home, record, submit

pytestmark = pytest.mark.integration

NODE = "kwok-gpu-l4-1"
TAINT = "nvidia.com/gpu-error=XID79:NoSchedule"

POLICY = health_policy(tolerations=True)


def untaint(cluster) -> None:
    cluster.kubectl("taint", "nodes", NODE, "nvidia.com/gpu-error-", check=False)  # absent: kubectl says so, fine


def vision_l4_quota(cluster) -> str:
    cq = cluster.get("/apis/kueue.x-k8s.io/v1beta2/clusterqueues/vision")
    return next(f for g in cq["spec"]["resourceGroups"] for f in g["flavors"] if f["name"] == "l4")["resources"][0][
        "nominalQuota"
    ]


@pytest.fixture(scope="module")
def real(real_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-health-real")
    work.chmod(0o755)
    untaint(real_cluster)
    backend = RealBackend(real_cluster)
    backend.setup(POLICY, work)
    hub = Hub(
        work / "hub",
        POLICY,
        extra_config=backend.hub_config("c.KubeJobManager.poll_interval = 0.3\n"),
        env={"KUBECONFIG": str(backend.kubeconfig)},
    )
    try:
        hub.start()
        yield backend, hub
    finally:
        untaint(real_cluster)
        hub.stop()
        backend.teardown()


def test_the_holder_is_told_on_the_real_control_plane(real):
    backend, hub = real
    cluster = backend.cluster
    alice, bob = hub.login("alice"), hub.login("bob")
    wait_for(lambda: vision_l4_quota(cluster) == "2", WAIT, "vision's quota at the policy's 2")
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready(timeout=120)
    [pod] = backend.pods("alice")
    assert pod["spec"]["nodeName"] == NODE, pod["spec"].get("nodeName")
    assert culling(alice)["gpu_failed"] == {}

    answer: dict = {}
    poll = threading.Thread(target=lambda: answer.update(culling(alice, wait=25)))
    poll.start()
    cluster.kubectl("taint", "nodes", NODE, TAINT)
    poll.join(60)
    entry = answer.get("gpu_failed", {}).get("")
    assert entry is not None and entry["reason"] == f"node {NODE}: nvidia.com/gpu-error=XID79", answer
    page = wait_for(lambda: (lambda p: p if "gpuhub-gpu-failures" in p else None)(home(alice)), WAIT, "alice's home page")
    notice = re.sub(r"\s+", " ", re.search(r'id="gpuhub-gpu-failures">(.*?)</div>\s*</div>', page, re.S).group(1))
    assert "The GPU of server (default) failed" in notice and "a restart gets a healthy GPU" in notice, notice
    assert culling(bob)["gpu_failed"] == {} and "gpuhub-gpu-failures" not in home(bob)
    wait_for(lambda: vision_l4_quota(cluster) == "0", WAIT, "vision's quota lowered by the hub's keeper")

    untaint(cluster)
    wait_for(lambda: culling(alice)["gpu_failed"] == {}, WAIT, "alice's entry cleared")
    wait_for(lambda: vision_l4_quota(cluster) == "2", WAIT, "vision's quota restored")
    alice.stop()
    alice.wait_gone(timeout=120)


def test_a_job_ends_gpu_failed_and_resumes_on_the_real_control_plane(real, tmp_path):
    backend, hub = real
    cluster = backend.cluster
    bob = hub.login("bob")
    wait_for(lambda: vision_l4_quota(cluster) == "2", WAIT, "vision's quota at the policy's 2")
    job_id, ckpt = submit(hub, bob, tmp_path, "{limit: 0, reasons: [failed]}")
    [first_pod] = backend.pods_of_job(job_id)
    assert first_pod["spec"]["nodeName"] == NODE

    cluster.kubectl("taint", "nodes", NODE, TAINT)
    rec = wait_for(
        lambda: (r := record(bob, job_id))["attempts"][0].get("reason") == "gpu-failed" and r, WAIT, "attempt 1 ended gpu-failed"
    )
    assert rec["attempts"][0]["account"] == first_pod["metadata"]["name"], rec["attempts"]
    wait_for(lambda: (backend.job(job_id) or {}).get("spec", {}).get("suspend") is True, WAIT, "the Job suspended by Kueue")
    wait_for(lambda: record(bob, job_id)["state"] == "queued", WAIT, "the job queued again")
    assert '"step": 8' not in (ckpt / "state.json").read_text()
    wl = next(w for w in backend.workloads() if job_id in w["metadata"]["name"])
    print(
        f"\n[real] evictions after the taint: {wl['status'].get('schedulingStats')}; "
        f"conditions: {[(c['type'], c['status'], c['reason']) for c in wl['status'].get('conditions', [])]}"
    )
    assert {e["reason"] for e in wl["status"]["schedulingStats"]["evictions"]} == {"Deactivated"}, wl["status"]

    untaint(cluster)
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] in ("succeeded", "failed") and r, 240, "the job's end")
    assert rec["state"] == "succeeded", rec
    assert [a["reason"] for a in rec["attempts"]] == ["gpu-failed", "succeeded"], rec["attempts"]
    job = backend.job(job_id)
    assert job["spec"]["backoffLimit"] == 0 and not job["status"].get("failed"), job["status"]
    out = cli(hub, bob, "logs", job_id)
    assert "from step 0" in out and "total 36" in out, out
    assert "from step 0" not in [ln for ln in out.splitlines() if ln.startswith("attempt")][-1], out
    t0 = rec["attempts"][0]["queued"]
    print(
        "[real job timeline] "
        + "; ".join(
            f"attempt {a['number']}: admitted {(a.get('admitted') or t0) - t0:.1f}s, ended {(a.get('finished') or t0) - t0:.1f}s "
            f"({a['reason']})"
            for a in rec["attempts"]
        ),
        file=sys.stderr,
    )
    backend.healthy()
