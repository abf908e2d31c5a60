"""Kueue's own metrics on the Grafana dashboard, beside the hub's (issue 40 item 6).

* Without a cluster: every ``kueue_*`` name that a panel or variable of
  ``docs/grafana/gpuhub-dashboard.json`` queries is a metric family that Kueue v0.19.2 registers
  (read from its source, ``pkg/metrics/metrics.go`` of the Kueue module that
  ``tests/cluster/build.sh`` fetched from the Go module proxy; skipped where it is not cached),
  and the panels cover what an operator asks of Kueue: pending workloads, admission wait, quota use.
* On the real control plane (``GPUHUB_CLUSTER=1``): the real Kueue v0.19.2, started from the
  ConfigMap with the guide's ``metrics.enableClusterQueueResources: true``, serves every one of
  those families on its metrics endpoint (HTTPS, a bearer token checked by TokenReview and
  SubjectAccessReview, as Prometheus scrapes it in a cluster), with series for the test's
  ClusterQueue after four pods were admitted and a fifth waits.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402
from backends import VISION_ON_L4  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docs" / "grafana" / "gpuhub-dashboard.json"
NS = "gpuhub-users"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_kueue_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v.get("definition", "") for v in dash["templating"]["list"]]
    return {n for e in exprs for n in re.findall(r"\bkueue_\w+", e)}


def family(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def kueue_source_families() -> dict[str, str]:
    """Metric families Kueue v0.19.2 registers under its subsystem, with their kind
    (``prometheus.New<Kind>Vec`` / ``New<Kind>`` blocks of pkg/metrics/metrics.go)."""
    v = real.versions()["KUEUE_VERSION"]
    src = real.CACHE / "gopath" / "pkg" / "mod" / f"sigs.k8s.io/kueue@{v}" / "pkg" / "metrics" / "metrics.go"
    if not src.exists():
        pytest.skip(f"Kueue {v}'s source is not cached at {src} (tests/cluster/build.sh kueue fetches it)")
    out = {}
    for kind, body in re.findall(
        r"prometheus\.New(Gauge|Counter|Histogram)(?:Vec)?\(\s*prometheus\.\w+Opts\{(.*?)\n\t\t\}", src.read_text(), re.S
    ):
        if "Subsystem: constants.KueueName" in body:
            out["kueue_" + re.search(r'Name:\s*"(\w+)"', body).group(1)] = kind.lower()
    assert len(out) > 30, f"read only {len(out)} Kueue metrics from {src}: the parser no longer fits the source"
    return out


def test_the_dashboards_kueue_queries_name_metrics_kueue_registers():
    names = dashboard_kueue_names()
    # what an operator asks of Kueue: how many wait, how long, how much quota is used
    assert {
        "kueue_pending_workloads",
        "kueue_admission_wait_time_seconds_bucket",
        "kueue_cluster_queue_resource_usage",
        "kueue_cluster_queue_nominal_quota",
    } <= names, names
    source = kueue_source_families()
    missing = sorted(n for n in names if family(n) not in source)
    assert missing == [], f"the dashboard queries metrics Kueue v0.19.2 does not register: {missing}"
    for n in names:  # a _bucket only of a histogram
        if n != family(n):
            assert source[family(n)] == "histogram", n


def test_the_guide_turns_on_the_quota_metrics_the_dashboard_reads():
    """kueue_cluster_queue_resource_usage and _nominal_quota exist only with
    metrics.enableClusterQueueResources (off in Kueue's default file)."""
    from test_install_guide import follow_the_kueue_config_instructions

    default = real.release_manifests_default_config() if real.release_manifests_available() else None
    if default is None:
        pytest.skip("Kueue's module is not cached (tests/cluster/build.sh kueue): its default configuration is read from it")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "kueue-config.yaml"
        f.write_text(default)
        follow_the_kueue_config_instructions(f)
        cfg = yaml.safe_load(f.read_text())
    assert cfg["metrics"]["enableClusterQueueResources"] is True
    assert cfg["metrics"]["bindAddress"] == ":8443"  # the release's own, kept


# -- the real control plane -----------------------------------------------------------------------

POLICY = VISION_ON_L4


def scraper_token(cluster: real.RealCluster) -> str:
    """A ServiceAccount allowed GET /metrics (what Kueue's kueue-metrics-reader ClusterRole grants
    Prometheus), and a token for it."""
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": "kueue-system"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "gpuhub-test-kueue-metrics-reader"},
            "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "gpuhub-test-kueue-metrics-reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "gpuhub-test-kueue-metrics-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": "kueue-system"}],
        },
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return cluster.kubectl("-n", "kueue-system", "create", "token", "prometheus").stdout.strip()


def gpu_pod(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"kueue.x-k8s.io/queue-name": "vision"}},
        "spec": real.restricted(
            {
                "terminationGracePeriodSeconds": 0,
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.example.com/gpuhub/notebook:cuda-0.1.0",
                        "resources": {
                            "requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": "1"},
                            "limits": {"nvidia.com/gpu": "1"},
                        },
                    }
                ],
            }
        ),
    }


@pytest.fixture(scope="module")
def kueue_with_quota_metrics(real_cluster, tmp_path_factory):
    from test_kueue_pods_ready import restart_kueue, set_config

    cluster = real_cluster
    before = cluster.get("/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config")["data"][
        "controller_manager_config.yaml"
    ]
    cfg = yaml.safe_load(before)
    cfg.setdefault("metrics", {})["enableClusterQueueResources"] = True
    set_config(cluster, yaml.safe_dump(cfg, sort_keys=False))
    restart_kueue()
    cluster.reset(NS)
    cluster.apply_policy(POLICY, NS, tmp_path_factory.mktemp("policy"))
    yield cluster
    cluster.reset(NS)
    set_config(cluster, before)
    restart_kueue()


@pytest.mark.cluster
def test_real_kueue_exports_every_metric_the_dashboard_queries(kueue_with_quota_metrics):
    cluster = kueue_with_quota_metrics
    for i in range(5):  # vision's nominal quota is 4 L4: four admitted, the fifth waits
        cluster.create("pods", NS, gpu_pod(f"metrics-{i}"))
    url, ca = real.kueue_metrics_url(), str(real.DIR / "pki" / "ca.crt")
    token = scraper_token(cluster)
    import requests

    def scrape() -> str:
        r = requests.get(url, headers={"Authorization": f"Bearer {token}"}, verify=ca, timeout=15)
        r.raise_for_status()
        return r.text

    # Anonymous scrapes are refused: the endpoint is Kueue's secure one, as in a cluster.
    assert requests.get(url, verify=ca, timeout=15).status_code in (401, 403)
    names = dashboard_kueue_names()
    want = {family(n) for n in names}

    def gpu_gauge(metric: str, text: str) -> float | None:
        m = re.search(
            rf'^{metric}\{{[^}}]*cluster_queue="vision"[^}}]*flavor="l4"[^}}]*resource="nvidia.com/gpu"[^}}]*\}} (\S+)$',
            text,
            re.M,
        )
        return float(m.group(1)) if m else None

    def seen(text: str) -> dict:
        samples = {
            m.group(1) for m in re.finditer(r'^(kueue_\w+?)(?:_bucket|_sum|_count)?\{[^}]*cluster_queue="vision"', text, re.M)
        }
        pending = re.search(
            r'^kueue_pending_workloads\{[^}]*cluster_queue="vision"[^}]*status="inadmissible"[^}]*\} (\S+)$', text, re.M
        )
        return {
            "lacking": sorted(f for f in want if f not in samples),
            "inadmissible": float(pending.group(1)) if pending else None,
            "usage": gpu_gauge("kueue_cluster_queue_resource_usage", text),
            "nominal": gpu_gauge("kueue_cluster_queue_nominal_quota", text),
        }

    expected = {"lacking": [], "inadmissible": 1.0, "usage": 4.0, "nominal": 4.0}
    deadline, text, now = time.time() + 60, "", {}
    while time.time() < deadline:
        text = scrape()
        now = seen(text)
        if now == expected:
            break
        time.sleep(1)
    # series for vision of every family the dashboard reads; 4 L4 in use of 4 nominal; 1 waiting
    assert now == expected, f"Kueue's /metrics after 60 s: {now}, expected {expected}"
    typed = dict(re.findall(r"^# TYPE (kueue_\w+) (\w+)$", text, re.M))
    assert all(family(n) in typed for n in names), sorted(n for n in names if family(n) not in typed)
