"""Topology-aware placement of a several-worker job on the real control plane (issue 44;
``GPUHUB_CLUSTER=1``): Kueue v0.19.2's TAS, configured from the policy alone.

The operator labelled two kwok H100 nodes (two GPUs each) with a block and a rack
(``tests/cluster/nodes-tas.yaml``); the policy declares that topology and places its ``h100``
flavor by rack, ``required``. ``gpuhub render kueue`` (applied server-side through the real API
server, the Topology CRD of Kueue's module) makes the ``Topology`` and the ResourceFlavor's
``topologyName``; a real JupyterHub, as the install guide's service account, submits the jobs:

* a notebook server on that flavor is admitted ("anywhere in the topology") and takes one GPU of
  one rack;
* a 2-worker job is admitted with a topology assignment and both workers are bound to one
  node of the other rack by kube-scheduler (Kueue's TAS pins each pod);
* a 3-worker job, for which the team's quota has room but no rack does, stays queued, with
  Kueue's words, and nothing of it starts.

kwok runs no containers (``StandInKubelet`` runs each pod's command). Skipped with the reason
without the real plane.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

from backends import RealBackend  # noqa: E402
from support.hub import Hub, wait_for  # noqa: E402
from test_job_workers_hub_e2e import KUBE_CONFIG, cli, condition, record  # noqa: E402

SKIP = real.skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.integration, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

POLICY = """\
apiVersion: gpuhub/v1
topologies:
  - name: dc
    levels: [example.com/topology-block, example.com/topology-rack, kubernetes.io/hostname]
flavors:
  - {name: h100, displayName: H100 80GB, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3},
     tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}], local: {virtual: 4},
     topology: {name: dc, level: example.com/topology-rack, mode: required}}
priorityClasses:
  - {name: interactive, value: 1000}
  - {name: batch, value: 100}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], defaultPriority: interactive, jobPriority: batch,
     quota: {cpu: 16, memory: 32Gi, gpus: {h100: {nominal: 6}}}, perUser: {maxGPUs: 6}}
profiles:
  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}
  - {slug: h100-1, displayName: One H100, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: h100}, teams: [vision]}
"""

WORKER = textwrap.dedent("""\
    import os, sys, time
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
    for _ in range(3000):
        if os.path.exists(sys.argv[1]):
            break
        time.sleep(0.1)
""")


@pytest.fixture(scope="module")
def tas_backend(real_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("backend-tas")
    work.chmod(0o755)
    names = real.add_tas_nodes(real_cluster)
    print(f"\n[real] TAS kwok nodes Ready: {names}")
    b = RealBackend(real_cluster)
    try:
        b.setup(POLICY, work)
        yield b
    finally:
        b.teardown()
        real.remove_tas_nodes(real_cluster)


@pytest.fixture(scope="module")
def tas_hub(tas_backend, tmp_path_factory):
    hub = Hub(
        tmp_path_factory.mktemp("kube-tas"),
        POLICY,
        extra_config=tas_backend.hub_config(KUBE_CONFIG),
        env={"KUBECONFIG": str(tas_backend.kubeconfig)},
    )
    try:
        hub.start()
        yield hub
    finally:
        hub.stop()


def test_workers_land_in_one_rack_and_a_job_no_rack_fits_waits(tas_hub, tas_backend, tmp_path):
    backend, cluster = tas_backend, tas_backend.cluster
    topo = cluster.get("/apis/kueue.x-k8s.io/v1beta2/topologies/dc")
    assert [lv["nodeLabel"] for lv in topo["spec"]["levels"]] == [
        "example.com/topology-block",
        "example.com/topology-rack",
        "kubernetes.io/hostname",
    ]
    assert cluster.get(cluster.path("resourceflavors", None, "h100"))["spec"]["topologyName"] == "dc"

    # A notebook server on the topology flavor still starts (it asks Kueue for "anywhere in the
    # topology"): it takes one GPU of one rack, so the 2-worker job below must use the other.
    alice = tas_hub.login("alice")
    assert alice.start("h100-1").status_code in (201, 202)
    alice.wait_ready(timeout=120)
    [server] = backend.pods("alice")
    assert server["metadata"]["annotations"]["kueue.x-k8s.io/podset-unconstrained-topology"] == "true"
    server_rack = cluster.get(f"/api/v1/nodes/{server['spec']['nodeName']}")["metadata"]["labels"]["example.com/topology-rack"]
    print(f"\n[real] alice's server on {server['spec']['nodeName']} (rack {server_rack})")

    bob = tas_hub.login("bob")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    two = tmp_path / "two.yaml"
    two.write_text(f"profile: h100-1\nworkers: 2\ncommand: [{sys.executable}, {script}, {go}]\n")
    job_a = cli(tas_hub, bob, "submit", str(two)).stdout.strip().splitlines()[-1]
    pods = wait_for(
        lambda: len(p := backend.pods_of_job(job_a)) == 2 and all(x["spec"].get("nodeName") for x in p) and p,
        120,
        "both workers of the 2-worker job bound",
    )
    nodes = {p["spec"]["nodeName"] for p in pods}
    racks = {cluster.get(f"/api/v1/nodes/{n}")["metadata"]["labels"]["example.com/topology-rack"] for n in nodes}
    print(f"\n[real] 2-worker job {job_a}: pods on {sorted(nodes)}, rack(s) {sorted(racks)}")
    assert len(racks) == 1 and nodes <= {"kwok-tas-r1", "kwok-tas-r2"}, nodes
    assert racks != {server_rack}  # the rack with a free pair, not the one alice's server is in
    for p in pods:
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == "example.com/topology-rack"
    [wl] = [w for w in backend.workloads() if job_a in w["metadata"]["name"]]
    [psa] = wl["status"]["admission"]["podSetAssignments"]
    assert psa["count"] == 2 and psa.get("topologyAssignment"), psa
    print(f"[real] Kueue's topology assignment: {psa['topologyAssignment']}")
    wait_for(lambda: record(bob, job_a)["state"] == "running", 60, "the 2-worker job running")

    three = tmp_path / "three.yaml"
    three.write_text(f"profile: h100-1\nworkers: 3\ncommand: [{sys.executable}, {script}, {go}]\n")
    job_b = cli(tas_hub, bob, "submit", str(three)).stdout.strip().splitlines()[-1]
    wl_b = wait_for(
        lambda: next((w for w in backend.workloads() if job_b in w["metadata"]["name"] and condition(w, "QuotaReserved")), None),
        60,
        "Kueue's verdict on the 3-worker job",
    )
    reserved = condition(wl_b, "QuotaReserved")
    print(f"[real] 3-worker job {job_b} waits: {reserved['message']}")
    assert reserved["status"] == "False" and "topology" in reserved["message"].lower(), reserved
    assert backend.pods_of_job(job_b) == [] and record(bob, job_b)["state"] == "queued"  # nothing of it starts

    go.write_text("")
    wait_for(lambda: record(bob, job_a)["state"] == "succeeded", 120, "the 2-worker job to finish")
    assert cli(tas_hub, bob, "cancel", job_b).stdout.startswith("cancelled")
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    wait_for(lambda: backend.job(job_b) is None, 60, "the 3-worker Job gone")
    backend.healthy()
