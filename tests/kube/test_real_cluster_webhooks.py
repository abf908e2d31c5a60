"""The install guide's webhook step on a real control plane: with Kueue stopped, the hub's
namespace still takes a Deployment, a Job and a pod (a ``helm upgrade`` of the hub works
during a Kueue outage) once ``gpuhub render webhook-exclusion`` has run, and refuses them
before; users' pods stay refused (no server is started without Kueue). Restarting Kueue
with its install objects resets the selectors, as the guide warns.

Opt-in (``GPUHUB_CLUSTER=1``, ``tests/cluster/up.sh``); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402

from gpuhub_spawner.kube.webhooks import webhooks_covering  # noqa: E402

SKIP = real.skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

HUB_NS, USERS_NS = "gpuhub", "gpuhub-users"
CONFIGS = {"mutating": "kueue-mutating-webhook-configuration", "validating": "kueue-validating-webhook-configuration"}


def objects(ns: str) -> list[dict]:
    """What the chart creates in its namespace: a Deployment (hub, proxy), a hook Job, a pod."""
    template = {
        "metadata": {"labels": {"app": "probe"}},
        "spec": real.restricted(
            {"restartPolicy": "Never", "containers": [{"name": "c", "image": "registry.example.com/probe:1"}]}
        ),
    }
    always = yaml.safe_load(yaml.safe_dump(template))
    always["spec"]["restartPolicy"] = "Always"
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "hub", "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": "probe"}}, "template": always},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "hook-image-awaiter", "namespace": ns},
            "spec": {"template": template},
        },
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "proxy", "namespace": ns}, "spec": template["spec"]},
    ]


def dry_run_create(cluster: real.RealCluster, obj: dict) -> str:
    """'' when the API server (its admission webhooks included) accepts the object, else its error."""
    p = cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", input=json.dumps(obj), check=False)
    return "" if p.returncode == 0 else p.stderr.strip()


@pytest.fixture(scope="module")
def cluster(real_cluster):
    cluster = real_cluster
    for ns in (HUB_NS, USERS_NS):
        cluster.ensure_namespace(ns)
    yield cluster
    if not cluster.ready() or not real.kueue_running():  # a failed test left Kueue stopped: start it again
        subprocess.run(["bash", str(real.HERE / "up.sh")], check=False, timeout=600)


@pytest.mark.timeout(1500)  # it stops Kueue and brings the plane back up (up.sh: up to 600 s)
def test_a_kueue_outage_leaves_the_hub_namespace_deployable_after_the_guides_step(cluster):
    configs = {
        kind: json.loads(cluster.kubectl("get", f"{kind}webhookconfiguration", name, "-o", "json").stdout)
        for kind, name in CONFIGS.items()
    }
    covering = {kind: webhooks_covering(cfg, HUB_NS) for kind, cfg in configs.items()}
    print(f"\nKueue's webhooks covering {HUB_NS!r} as installed: {json.dumps(covering)}")
    assert covering["mutating"] and covering["validating"]

    real.stop_kueue()
    t0 = time.time()
    before = {o["kind"]: dry_run_create(cluster, o) for o in objects(HUB_NS)}
    print(f"Kueue stopped; the hub's namespace before the step: {json.dumps(before, indent=1)}")
    assert all("failed calling webhook" in err for err in before.values()), before

    env = dict(
        os.environ,
        KUBECONFIG=str(cluster.kubeconfig),
        PATH=f"{Path(real.kubectl_path()).parent}:{real.VENV_BIN}:{os.environ['PATH']}",
    )
    step = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", real.guide_block("for kind in mutating validating")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(f"the guide's step: rc={step.returncode}\n{step.stdout}{step.stderr}")
    assert step.returncode == 0
    after = {o["kind"]: dry_run_create(cluster, o) for o in objects(HUB_NS)}
    users = {o["kind"]: dry_run_create(cluster, o) for o in objects(USERS_NS)}
    print(
        f"after the step ({time.time() - t0:.1f}s with Kueue down): hub namespace {json.dumps(after)}; "
        f"users' namespace: {json.dumps(users, indent=1)}"
    )
    assert after == {"Deployment": "", "Job": "", "Pod": ""}
    assert "failed calling webhook" in users["Pod"]  # no server pod is created behind Kueue's back
    for kind, name in CONFIGS.items():
        cfg = json.loads(cluster.kubectl("get", f"{kind}webhookconfiguration", name, "-o", "json").stdout)
        assert webhooks_covering(cfg, HUB_NS) == []
        assert webhooks_covering(cfg, USERS_NS)  # the users' namespace is still Kueue's

    t1 = time.time()
    subprocess.run(["bash", str(real.HERE / "up.sh")], check=True, timeout=600, capture_output=True)
    reset = {
        kind: webhooks_covering(
            json.loads(cluster.kubectl("get", f"{kind}webhookconfiguration", name, "-o", "json").stdout), HUB_NS
        )
        for kind, name in CONFIGS.items()
    }
    print(f"Kueue restarted with its install objects in {time.time() - t1:.1f}s; covering {HUB_NS!r} again: {json.dumps(reset)}")
    assert reset["mutating"], "re-applying Kueue's manifests resets the selectors (the guide says to re-run the step)"
