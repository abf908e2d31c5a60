"""The install guide's ``waitForPodsReady`` on the real control plane (``GPUHUB_CLUSTER=1``):
real Kueue v0.19.2 started with the guide's block (merged into its ConfigMap as the guide
says), a workload admitted whose pod can never become Ready gives its quota back.

One change to the guide's block, and only for time: ``timeout`` 10m -> 10s and
``backoffBaseSeconds`` 60 -> 2 (``timestamp: Eviction``, ``blockAdmission: false`` and
``backoffLimitCount: 3`` as written). The pods ask for a node label no kwok node has, so the
real scheduler never places them: what a pod on a node that failed after admission, or one
that fits no node, looks like to Kueue.

* A batch Job (Kueue's ``batch/job`` integration, in gpuhub-users): admitted, evicted with
  reason ``PodsReadyTimeout``, suspended (its pods deleted), requeued, admitted again; after
  3 requeues deactivated (``spec.active: false``), so it stops holding and retrying.
* A server pod (plain pod, as the hub creates it): evicted with ``PodsReadyTimeout`` and
  deleted; the hub's ``eviction_message`` on what Kueue left says why in plain words.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as real  # noqa: E402

from gpuhub_spawner.kube import kueue as K  # noqa: E402
from gpuhub_spawner.kube.messages import eviction_message  # noqa: E402
from backends import VISION_ON_L4  # noqa: E402
from support.hub import waiter

NS = "gpuhub-users"
TIMEOUT_S = 10

POLICY = VISION_ON_L4

NEVER = {"gpuhub.test/no-node-has-this": "true"}  # the real scheduler finds no node for it


until = waiter(60)


def restart_kueue() -> None:
    real.stop_kueue()
    real.start_kueue()
    assert real.kueue_running(), "Kueue did not start with the configuration (it validates it at start)"


def set_config(cluster: real.RealCluster, text: str) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=cluster.kubectl(
            "-n",
            "kueue-system",
            "create",
            "configmap",
            "kueue-manager-config",
            "--dry-run=client",
            "-o",
            "yaml",
            f"--from-literal=controller_manager_config.yaml={text}",
        ).stdout,
    )


OVERLAY = Path(__file__).resolve().parents[2] / "helm-values" / "kueue" / "kustomization.yaml"


def kueue_config(cluster) -> str:
    return cluster.get("/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config")["data"][
        "controller_manager_config.yaml"
    ]


def apply_overlay(cluster, overlay: Path) -> None:
    """install-kubernetes.md's put-back and upgrade step, as written there."""
    cluster.kubectl("apply", "--server-side", "--field-manager=gpuhub-kueue", "--force-conflicts", "-k", str(overlay))


@pytest.fixture(scope="module")
def kueue_with_the_guides_config(real_cluster, tmp_path_factory):
    """Kueue configured as install-kubernetes.md says (its ``helm-values/kueue/`` overlay of the
    release manifests, with the guide's edits in ``kueue-config.yaml``), then upgraded as its
    section 6 says: the overlay applied a second time. A bare ``kubectl apply --server-side -f
    manifests.yaml`` is tried in between. What each step left is recorded for
    ``test_the_guides_kueue_config_survives_re_applying_kueues_manifests``; Kueue is restarted
    (what the upgrade's new Deployment does) and runs with the configuration the ConfigMap
    then holds, which the other tests see it enforce."""
    from test_install_guide import guide_wait_for_pods_ready

    cluster = real_cluster
    before = kueue_config(cluster)
    cfg = yaml.safe_load(before)
    if "pod" not in cfg["integrations"]["frameworks"]:
        cfg["integrations"]["frameworks"].append("pod")
    cfg.pop("waitForPodsReady", None)
    w = guide_wait_for_pods_ready()
    w["timeout"] = f"{TIMEOUT_S}s"
    w["requeuingStrategy"]["backoffBaseSeconds"] = 2
    cfg["waitForPodsReady"] = w
    overlay = tmp_path_factory.mktemp("kueue-overlay")
    (overlay / "kustomization.yaml").write_text(OVERLAY.read_text())
    (overlay / "manifests.yaml").write_text(real.release_manifests())
    (overlay / "kueue-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    record = {}
    # The install: Kueue's default configuration in place (another session's edit undone), then
    # the guide's put-back through the overlay, and the restart.
    set_config(cluster, yaml.safe_load(real.release_manifests().split("\n---\n")[-1])["data"]["controller_manager_config.yaml"])
    apply_overlay(cluster, overlay)
    record["installed"] = yaml.safe_load(kueue_config(cluster))
    restart_kueue()
    # Someone follows Kueue's own install page for an upgrade: refused for the ConfigMap alone.
    bare = cluster.kubectl("apply", "--server-side", "-f", str(overlay / "manifests.yaml"), check=False)
    record["bare"] = (bare.returncode, bare.stderr)
    record["after_bare"] = yaml.safe_load(kueue_config(cluster))
    # The upgrade as the guide's section 6 says: the overlay applied again.
    apply_overlay(cluster, overlay)
    record["upgraded"] = yaml.safe_load(kueue_config(cluster))
    restart_kueue()
    record["running"] = yaml.safe_load((real.DIR / "kueue-config.yaml").read_text())
    assert record["running"]["waitForPodsReady"] == w
    cluster.ensure_namespace(NS)
    cluster.reset(NS)
    cluster.apply_policy(POLICY, NS, tmp_path_factory.mktemp("policy"))
    yield cluster, w, record
    cluster.kubectl("-n", NS, "delete", "jobs", "--all", "--wait=false")
    cluster.reset(NS)
    set_config(cluster, before)
    restart_kueue()


@pytest.mark.cluster
def test_the_guides_kueue_config_survives_re_applying_kueues_manifests(kueue_with_the_guides_config):
    """Issue 40 item 4: an upgrade (the overlay applied again) keeps waitForPodsReady and the pod
    integration; Kueue's documented bare apply is refused for the ConfigMap, not a silent
    revert; the restarted Kueue runs with the guide's block (its enforcement: the tests below)."""
    _, w, record = kueue_with_the_guides_config
    for step in ("installed", "after_bare", "upgraded", "running"):
        assert record[step]["waitForPodsReady"] == w, (step, record[step])
        assert "pod" in record[step]["integrations"]["frameworks"], (step, record[step])
    code, err = record["bare"]
    assert code != 0 and 'conflict with "gpuhub-kueue"' in err and ".data.controller_manager_config.yaml" in err, err


def workload_of(cluster, kind: str, name: str) -> dict | None:
    return next(
        (
            w
            for w in cluster.list("workloads", NS)
            if any(o["kind"] == kind and o["name"] == name for o in w["metadata"].get("ownerReferences", []))
        ),
        None,
    )


def cond(obj: dict | None, ctype: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def job_url(cluster, name: str = "") -> str:
    return f"{cluster.url}/apis/batch/v1/namespaces/{NS}/jobs" + (f"/{name}" if name else "")


def get_job(cluster, name: str) -> dict:
    r = cluster.session.get(job_url(cluster, name), timeout=15)
    r.raise_for_status()
    return r.json()


def gpus_used(cluster) -> int:
    cq = cluster.get(cluster.path("clusterqueues", None, "vision"))
    return sum(
        int(r.get("total", 0))
        for f in (cq.get("status") or {}).get("flavorsUsage") or []
        for r in f["resources"]
        if r["name"] == "nvidia.com/gpu"
    )


def pod_spec() -> dict:
    return real.restricted(
        {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": dict(NEVER),
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example.com/gpuhub/notebook:cuda-0.1.0",
                    "command": ["sleep", "600"],
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": "1"},
                        "limits": {"nvidia.com/gpu": "1"},
                    },
                }
            ],
        }
    )


@pytest.mark.cluster
def test_a_job_that_can_never_start_is_evicted_requeued_then_deactivated(kueue_with_the_guides_config):
    cluster, w, _ = kueue_with_the_guides_config
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train-never", "namespace": NS, "labels": {"kueue.x-k8s.io/queue-name": "vision"}},
        "spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod_spec()}},
    }
    r = cluster.session.post(job_url(cluster), json=job, timeout=15)
    assert r.status_code == 201, r.text
    t0 = time.time()

    # Admitted on vision's L4 quota, the Job unsuspended, its pod created and never scheduled
    until(
        lambda: (c := cond(workload_of(cluster, "Job", "train-never"), "Admitted")) and c["status"] == "True",
        60,
        "the Job admitted",
    )
    until(lambda: get_job(cluster, "train-never")["spec"].get("suspend") is False, 30, "the Job unsuspended")
    until(
        lambda: [
            p
            for p in cluster.list("pods", NS, labelSelector="job-name=train-never")
            if (cond(p, "PodScheduled") or {}).get("reason") == "Unschedulable"
        ],
        30,
        "its pod unschedulable",
    )
    until(lambda: gpus_used(cluster) == 1, 30, "one L4 of vision's quota held by the unstartable pod")

    # timeout: evicted with PodsReadyTimeout, the Job suspended, the quota given back
    wl = until(
        lambda: (
            (x := workload_of(cluster, "Job", "train-never"))
            and (cond(x, "Evicted") or {}).get("reason") == K.EVICTED_BY_PODS_READY_TIMEOUT
            and x
        ),
        TIMEOUT_S + 30,
        "eviction by PodsReadyTimeout",
    )
    evicted_after = time.time() - t0
    # counted from admission (Kueue's condition times are whole seconds): not before the timeout
    assert evicted_after >= TIMEOUT_S - 1, evicted_after
    assert wl["status"]["requeueState"]["count"] == 1
    until(lambda: get_job(cluster, "train-never")["spec"].get("suspend") is True, 30, "the Job suspended")

    # requeued after the backoff, admitted again; after backoffLimitCount requeues, deactivated
    limit = w["requeuingStrategy"]["backoffLimitCount"]
    seen_requeued = until(
        lambda: (c := cond(workload_of(cluster, "Job", "train-never"), "Requeued")) and c["status"] == "True" and c,
        60,
        "requeued",
    )
    assert seen_requeued
    counts = set()

    def deactivated():
        x = workload_of(cluster, "Job", "train-never")
        counts.add(((x or {}).get("status", {}).get("requeueState") or {}).get("count"))
        return x and x["spec"].get("active") is False and (cond(x, "Evicted") or {}).get("status") == "True" and x

    final = until(deactivated, limit * (TIMEOUT_S + 20) + 60, "deactivated after the requeuing limit")
    print("\n[final workload conditions]", yaml.safe_dump(final["status"].get("conditions")), "requeue counts seen", counts)
    assert max(c for c in counts if c) == limit, counts  # each timeout counted, up to the limit
    evicted = cond(final, "Evicted")
    assert evicted["status"] == "True" and evicted["reason"] == "DeactivatedDueToRequeuingLimitExceeded", evicted
    assert get_job(cluster, "train-never")["spec"].get("suspend") is True
    # nothing held any more: vision's L4 usage is back to 0
    until(lambda: gpus_used(cluster) == 0, 30, "vision's L4 quota released")
    print(
        f"\n[measure] evicted {evicted_after:.1f}s after creation; deactivated after {limit} requeues ({time.time() - t0:.1f}s)"
    )
    cluster.session.delete(job_url(cluster, "train-never"), json={"propagationPolicy": "Background"}, timeout=15)


@pytest.mark.cluster
def test_a_server_pod_that_can_never_start_is_deleted_and_the_user_told_why(kueue_with_the_guides_config):
    cluster, _, _ = kueue_with_the_guides_config
    cluster.create(
        "pods",
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "jupyter-carol",
                "namespace": NS,
                "labels": {"kueue.x-k8s.io/queue-name": "vision", "component": "singleuser-server"},
            },
            "spec": pod_spec(),
        },
    )
    until(
        lambda: (c := cond(workload_of(cluster, "Pod", "jupyter-carol"), "Admitted")) and c["status"] == "True",
        60,
        "the server admitted",
    )
    # What the hub's pod reflector and Workload mirror last see. The pod as KubeSpawner's reflector
    # sees it: a watch, every change up to its deletion (a poll every 0.2 s missed the moment
    # between Kueue marking the pod and deleting it, stop 38); the Workload read at each change.
    last_pod, last_wl, deleted = None, None, False
    with cluster.session.get(
        f"{cluster.url}{cluster.path('pods', NS)}",
        stream=True,
        timeout=TIMEOUT_S + 60,
        params={"watch": "1", "fieldSelector": "metadata.name=jupyter-carol", "timeoutSeconds": str(TIMEOUT_S + 40)},
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            if event["type"] not in ("ADDED", "MODIFIED", "DELETED"):
                continue
            last_pod = event["object"]  # a DELETED event carries the pod's last state
            last_wl = workload_of(cluster, "Pod", "jupyter-carol") or last_wl
            if event["type"] == "DELETED":
                deleted = True
                break
    if not deleted:
        pytest.fail(f"the server pod was not deleted: {last_pod and last_pod.get('status')}")
    target = cond(last_pod, K.POD_TERMINATION_TARGET)
    assert target and target["reason"] == "WorkloadEvictedDueToPodsReadyTimeout", last_pod.get("status")
    assert (cond(last_wl, "Evicted") or {}).get("reason") == K.EVICTED_BY_PODS_READY_TIMEOUT, last_wl.get("status")
    for words in (eviction_message(last_wl, last_pod), eviction_message(None, last_pod)):
        assert words and "did not start in time after the queue gave it its GPUs" in words, words
        assert "Start it again" in words
