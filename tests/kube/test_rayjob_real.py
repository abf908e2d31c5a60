"""``kind: ray`` jobs on the real control plane (``GPUHUB_CLUSTER=1``, issue 44 item 2): a real
JupyterHub, speaking as the install guide's service account (every request read back from the
API server's audit log: none refused, none outside ``kube/rights.py``), submits a Ray job as a
KubeRay ``RayJob`` that the real Kueue v0.19.2 (its ``ray.io/rayjob`` integration) admits and
the real KubeRay v1.5.0 operator runs.

* The RayJob is created suspended and waits, with no cluster and no pod, while a teammate's
  job holds the team's only GPU; ``gpuhub job status`` says it is queued.
* Once the GPU is free Kueue admits it (un-suspends it) and KubeRay makes its RayCluster: a
  CPU-only head and a worker with the profile's GPU, each pod carrying the user's labels; the
  job shows as running with KubeRay's status.
* Cancel deletes the RayJob, and with it the RayCluster and every pod.

kwok runs no containers and the stand-in kubelet is stopped here: no Ray process runs, so the
entrypoint itself never runs on this plane (it does on one machine: tests/integration/).
Needs tests/cluster/build.sh kuberay (the operator; skipped with the reason otherwise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backends import make_backend, kube_hub_fixture, job_cli as cli, job_record as record, condition, vision_jobs_on_l4
from support.hub import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

POLICY = vision_jobs_on_l4(
    virtual=1,
    cpu=8,
    gpus=1,
    max_gpus=1,
    rest="""\
ray:
  enabled: true
""",
)

KUBE_CONFIG = """
c.KubeJobManager.poll_interval = 0.3   # production: 10 s
"""


def _skip() -> str | None:
    reason = real.skip_reason()
    if reason:
        return reason
    op = real.CACHE / f"kuberay-{real.versions()['KUBERAY_VERSION']}" / "bin" / "ray-operator"
    if not op.exists():
        return f"the KubeRay operator is not built ({op}): run tests/cluster/build.sh kuberay"
    return None


SKIP = _skip()


@pytest.fixture(scope="module", params=["real"])
def backend(request, tmp_path_factory):
    if SKIP:
        pytest.skip(SKIP)
    work = tmp_path_factory.mktemp("backend-rayjob")
    work.chmod(0o755)
    b = make_backend(request, POLICY, work)
    # No Ray in kwok's pods: the stand-in kubelet would start KubeRay's `ray start` commands.
    assert b.kubelet is not None
    b.kubelet.stop()
    b.kubelet = None
    yield b
    b.cluster.kubectl("-n", "gpuhub-users", "delete", "rayjobs,rayclusters", "--all", "--wait=true", check=False)
    b.teardown()


kube_hub = kube_hub_fixture(POLICY, KUBE_CONFIG, "kube-rayjob")


def get(cluster, plural, name):
    r = cluster.session.get(f"{cluster.url}/apis/ray.io/v1/namespaces/gpuhub-users/{plural}/{name}", timeout=15)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def test_a_ray_job_waits_for_the_teams_gpu_runs_on_its_own_rayjob_cluster_and_cancel_leaves_nothing(kube_hub, backend, tmp_path):
    cluster = backend.cluster
    bob, alice = kube_hub.login("bob"), kube_hub.login("alice")
    # A teammate's job holds the team's one L4.
    hold = tmp_path / "hold.yaml"
    hold.write_text("profile: l4-1\ncommand: [sleep, '3600']\n")
    held = cli(kube_hub, alice, "submit", str(hold)).stdout.strip().splitlines()[-1]
    wait_for(lambda: record(alice, held)["state"] == "running", 120, "the teammate's job to hold the L4")

    job_file = tmp_path / "ray.yaml"
    job_file.write_text(
        "kind: ray\nname: sweep\nprofile: l4-1\nentrypoint: python train.py\nruntimeEnv: {env_vars: {LR: '0.1'}}\n"
    )
    job_id = cli(kube_hub, bob, "submit", str(job_file)).stdout.strip().splitlines()[-1]
    rj = get(cluster, "rayjobs", job_id)
    assert rj is not None and rj["spec"]["suspend"] is True and rj["spec"]["shutdownAfterJobFinishes"] is True
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision"
    wl = wait_for(
        lambda: next((w for w in backend.workloads() if job_id in w["metadata"]["name"] and condition(w, "QuotaReserved")), None),
        60,
        "Kueue's verdict on the RayJob's Workload",
    )
    print(f"\n[real] RayJob waiting: {condition(wl, 'QuotaReserved')['message']}")
    print(f"[real] its pod sets: {[(p['name'], p['count']) for p in wl['spec']['podSets']]}")
    assert condition(wl, "QuotaReserved")["status"] == "False"
    assert get(cluster, "rayjobs", job_id)["spec"]["suspend"] is True
    assert not [p for p in backend.pods() if p["metadata"]["labels"].get("gpuhub/job") == job_id]
    status = cli(kube_hub, bob, "status", job_id).stdout
    assert status.startswith("queued: "), status
    print(f"[real] gpuhub job status (queued): {status.strip()}")

    # The L4 comes free: Kueue admits the RayJob whole, KubeRay makes its cluster.
    cli(kube_hub, alice, "cancel", held)
    wait_for(lambda: not get(cluster, "rayjobs", job_id)["spec"].get("suspend"), 120, "Kueue to admit (unsuspend) the RayJob")
    rc_name = wait_for(
        lambda: (get(cluster, "rayjobs", job_id).get("status") or {}).get("rayClusterName"), 120, "KubeRay's RayCluster"
    )
    rc = get(cluster, "rayclusters", rc_name)
    assert rc is not None and [o["name"] for o in rc["metadata"]["ownerReferences"]] == [job_id]
    pods = wait_for(
        lambda: (
            len(
                p := [
                    x for x in backend.pods() if x["metadata"]["labels"].get("gpuhub/job") == job_id and x["spec"].get("nodeName")
                ]
            )
            >= 2
            and p
        ),
        120,
        "the RayJob's head and worker pods, bound",
    )
    roles = {p["metadata"]["labels"].get("ray.io/node-type"): p for p in pods}
    print(f"[real] pods: {[(p['metadata']['name'], p['spec']['nodeName']) for p in pods]}")
    for p in pods:
        assert p["metadata"]["labels"]["hub.jupyter.org/username"] == "bob"  # the user's labels
        assert p["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] is True
    worker = roles["worker"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1" and roles["worker"]["spec"]["nodeName"].startswith(
        "kwok-gpu-l4"
    )
    assert "nvidia.com/gpu" not in (roles["head"]["spec"]["containers"][0]["resources"].get("limits") or {})
    rec = wait_for(lambda: (r := record(bob, job_id))["state"] == "running" and r, 60, "the job record running")
    assert rec["kind"] == "ray" and rec["ray"]["entrypoint"] == "python train.py"
    status = cli(kube_hub, bob, "status", job_id).stdout
    assert status.startswith("running: attempt 1, Ray job") and rc_name in status, status
    print(f"[real] gpuhub job status (admitted): {status.strip()}")

    # Cancel: the RayJob goes, and with it its RayCluster and every pod.
    cli(kube_hub, bob, "cancel", job_id)
    assert record(bob, job_id)["state"] == "cancelled"
    wait_for(
        lambda: (
            get(cluster, "rayjobs", job_id) is None
            and get(cluster, "rayclusters", rc_name) is None
            and not [p for p in backend.pods() if p["metadata"]["labels"].get("gpuhub/job") == job_id]
        ),
        120,
        "no RayJob, RayCluster or pod of the cancelled job",
    )
    backend.healthy()  # the hub's requests (rayjobs create/get/delete among them) all allowed by the shipped Role
