"""Our Helm values through the real Zero to JupyterHub 4.4.0 chart, the way a cluster sees them.

``helm template`` renders the chart (``shared/charts/jupyterhub-4.4.0``) with
``helm-values/values.yaml`` and ``mlflow-values.yaml`` (Helm validates the merged values
against the chart's JSON schema). Then the chart's own hub configuration — the
``jupyterhub_config.py`` and ``z2jh.py`` from the rendered ConfigMap, reading the rendered
Secret's ``values.yaml`` — is executed to get the *effective* config, and a KueueSpawner
built from it makes the pod a user would get. Only the mount root
``/usr/local/etc/jupyterhub/`` is redirected to a temporary folder, and tornado's curl
HTTP client (pycurl is in the hub image, not in this venv) is not switched on.

The shared chart lacks its hub code (``files/hub/*.py``); ``$GPUHUB_Z2JH_HUB_FILES`` supplies it
from a z2jh 4.4.0 checkout, and the tests that execute it skip with the reason otherwise (the
rendering tests run either way).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml
from kubernetes_asyncio.client import ApiClient
from traitlets.config import Config

from double.harness import HUB_NAMESPACE, NAMESPACE, POLICY, MockHub, MockUser
from support.helm import MISSING_HUB_FILES, helm_template, require_shared

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as _real  # noqa: E402  (tests/cluster/harness.py)

REPO = Path(__file__).resolve().parents[2]
VALUES = [REPO / "helm-values" / "values.yaml", REPO / "helm-values" / "mlflow-values.yaml"]
MOUNT = "/usr/local/etc/jupyterhub/"


@pytest.fixture(scope="module")
def rendered():
    chart = require_shared("charts", "jupyterhub-4.4.0")
    return helm_template(chart, VALUES, release="gpuhub", namespace=HUB_NAMESPACE)


def obj(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_the_ingress_names_its_class(rendered):
    """N9: the rendered Ingress carries values.yaml's ingressClassName (without one it is
    served only where a default IngressClass exists)."""
    values = yaml.safe_load((REPO / "helm-values" / "values.yaml").read_text())
    ing = obj(rendered, "Ingress", "jupyterhub")
    assert ing["spec"]["ingressClassName"] == values["ingress"]["ingressClassName"] == "nginx"
    assert {r["host"] for r in ing["spec"]["rules"]} == {"hub.example.org", "*.hub.example.org"}


def run_chart_config(docs, root: Path) -> Config:
    """Execute the rendered chart's jupyterhub_config.py as the hub container would."""
    cm, secret = obj(docs, "ConfigMap", "hub"), obj(docs, "Secret", "hub")
    if not all(name in cm["data"] for name in ("jupyterhub_config.py", "z2jh.py")):
        pytest.skip(MISSING_HUB_FILES)
    (root / "config").mkdir(parents=True)
    (root / "secret").mkdir()
    (root / "code").mkdir()
    for key, value in cm["data"].items():
        (root / "config" / key).write_text(value)
    for key, value in secret["data"].items():
        (root / "secret" / key).write_bytes(base64.b64decode(value))
    mount = str(root) + "/"
    (root / "code" / "z2jh.py").write_text(cm["data"]["z2jh.py"].replace(MOUNT, mount))
    config_py = root / "code" / "jupyterhub_config.py"
    config_py.write_text(cm["data"]["jupyterhub_config.py"].replace(MOUNT, mount))
    c = Config()
    env = {
        "HUB_SERVICE_PORT": "8081",
        "PROXY_API_SERVICE_PORT": "8001",
        "POD_NAMESPACE": HUB_NAMESPACE,
        # what the Secrets named in mlflow-values.yaml put into the hub container
        "GPUHUB_MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow:pw@postgres/mlflow",
    }
    from tornado.httpclient import AsyncHTTPClient

    from tornado.httpserver import HTTPServer

    saved_path = list(sys.path)
    saved_server = HTTPServer._save_configuration()  # the config bounds request bodies process-wide
    sys.modules.pop("z2jh", None)
    try:
        with mock.patch.dict(os.environ, env), mock.patch.object(AsyncHTTPClient, "configure") as curl:
            exec(compile(config_py.read_text(), str(config_py), "exec"), {"get_config": lambda: c, "__file__": str(config_py)})
        curl.assert_called_once_with("tornado.curl_httpclient.CurlAsyncHTTPClient")
    finally:
        sys.path[:] = saved_path
        sys.modules.pop("z2jh", None)
        bounded = HTTPServer.configured_class().__name__
        HTTPServer._restore_configuration(saved_server)
    c._gpuhub_http_server = bounded
    return c


@pytest.fixture(scope="module")
def chart_config(rendered, tmp_path_factory):
    return run_chart_config(rendered, tmp_path_factory.mktemp("chart-hub"))


def test_helm_renders_the_real_chart_with_valid_objects(rendered):
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "Ingress", "ServiceAccount"} <= kinds
    # The chart's RBAC is off (rbac.create: false): no Role grants the hub pods, secrets, PVCs or
    # services in its own namespace; it keeps its ServiceAccount (issue 40 item 2).
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}, kinds
    assert obj(rendered, "ServiceAccount", "hub")
    assert obj(rendered, "Deployment", "hub")["spec"]["template"]["spec"]["serviceAccountName"] == "hub"
    for doc in rendered:
        if doc["kind"] in (
            "Deployment",
            "Service",
            "ConfigMap",
            "Secret",
            "NetworkPolicy",
            "Ingress",
            "Role",
            "RoleBinding",
            "DaemonSet",
            "Job",
            "ServiceAccount",
            "PersistentVolumeClaim",
        ):
            kubernetes_validate.validate(doc, "1.30", strict=True)
    hub = obj(rendered, "Deployment", "hub")["spec"]["template"]["spec"]["containers"][0]
    assert hub["image"] == "registry.example.com/gpuhub/hub:4.4.0-gpuhub-0.1.0"


def test_helm_refuses_values_the_chart_schema_forbids(rendered, tmp_path):
    from support.helm import HelmError

    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"hub": {"extraVolumeMount": []}}))
    with pytest.raises(HelmError, match="extraVolumeMount"):
        helm_template(require_shared("charts", "jupyterhub-4.4.0"), VALUES + [typo], namespace=HUB_NAMESPACE)


def test_user_servers_get_their_own_origin(rendered, chart_config):
    assert chart_config.JupyterHub.subdomain_host == "https://hub.example.org"
    assert chart_config.JupyterHub.cookie_host_prefix_enabled is True
    # The chart's proxy sends unknown hosts to the hub: the hub's own host rule holds there
    # (issue 19 item 3), its static files included.
    from gpuhub_spawner.hub.origins import OTHER_HOST_PATH

    assert any(h[0].startswith(f"/{OTHER_HOST_PATH}") for h in chart_config.JupyterHub.extra_handlers)
    assert "static_handler_class" in chart_config.JupyterHub.tornado_settings
    # ... and what users send is bounded before a handler runs (issue 19 item 2)
    assert chart_config._gpuhub_http_server == "LimitedHTTPServer"
    ingress = obj(rendered, "Ingress", "jupyterhub")
    hosts = [r["host"] for r in ingress["spec"]["rules"]]
    assert hosts == ["hub.example.org", "*.hub.example.org"]
    for rule in ingress["spec"]["rules"]:  # both reach the proxy, which routes by host
        [path] = rule["http"]["paths"]
        assert path["backend"]["service"]["name"] == "proxy-public"
    [tls] = ingress["spec"]["tls"]
    assert set(tls["hosts"]) == {"hub.example.org", "*.hub.example.org"} and tls["secretName"]


def test_effective_config_selects_kueue_spawner_in_the_user_namespace(chart_config):
    c = chart_config
    assert c.JupyterHub.spawner_class == "gpuhub-kube"
    assert c.KubeSpawner.namespace == NAMESPACE  # hub.config overrides the chart's POD_NAMESPACE
    assert c.JupyterHub.hub_connect_url == f"http://hub.{HUB_NAMESPACE}.svc.cluster.local:8081"
    assert c.JupyterHub.allow_named_servers is True  # the policy's perUser.maxServers > 1 needs them
    assert c.JupyterHub.concurrent_spawn_limit == 500
    assert c.JupyterHub.init_spawners_timeout == 1  # queued servers' checks must not hold the hub
    assert c.PolicyStore.policy_file == "/etc/gpuhub/policy/profiles.yaml"
    assert c.DcgmPrometheusReader.prometheus_url  # GPU utilisation from DCGM, never from the pod
    names = [s["name"] for s in c.JupyterHub.services]
    assert "gpuhub-culler" in names and "mlflow" in names and "jupyterhub-idle-culler" not in names
    # Usage history and the audit trail live on the hub's volume; the usage pages are served.
    assert c.UsageRecorder.audit_file == "/srv/jupyterhub/gpuhub-audit.jsonl"
    assert any(h[0] == "/api/gpuhub/usage" for h in c.JupyterHub.extra_handlers)
    # The policy page and API (preview, apply, history, rollback; issue 26) are served, and only
    # gpuhub admins hold the scope that applies (the custom scopes are defined on Kubernetes too).
    assert any(h[0] == r"/gpuhub/policy/?" for h in c.JupyterHub.extra_handlers)
    assert "custom:gpuhub:policy" in c.JupyterHub.custom_scopes
    admin_role = next(r for r in c.JupyterHub.load_roles if r["name"] == "gpuhub-admin")
    assert "custom:gpuhub:policy" in admin_role["scopes"]
    assert "custom:gpuhub:policy" not in c.JupyterHub.extra_user_scopes
    # Batch jobs and Ray clusters are served on Kubernetes too (their managers: Kueue's Jobs, KubeRay).
    assert any(h[0].startswith("/api/gpuhub/jobs") for h in c.JupyterHub.extra_handlers)
    assert any(h[0].startswith("/api/gpuhub/ray") for h in c.JupyterHub.extra_handlers)
    assert "custom:gpuhub:jobs!user" in c.JupyterHub.extra_user_scopes
    assert c.KubeJobManager.data_dir == "/srv/jupyterhub"
    culler_role = next(r for r in c.JupyterHub.load_roles if r["name"] == "gpuhub-culler")
    assert not any(s.startswith("access:servers") for s in culler_role["scopes"])  # never calls user pods
    # z2jh sets c.KubeSpawner.environment from singleuser.extraEnv; that section is the one
    # a KubeSpawner subclass reads, so MLflow's settings must be there (issue 12 item 2).
    assert c.KubeSpawner.environment["MLFLOW_TRACKING_URI"] == (
        f"http://hub.{HUB_NAMESPACE}.svc.cluster.local:10101/services/mlflow"
    )


@pytest.fixture
def spawner_for(double, chart_config):
    from gpuhub_spawner.kube.spawner import KueueSpawner
    from gpuhub_spawner.policy import PolicyStore

    # A deep copy: Config(chart_config) shares its sections, so the policy file set below leaked
    # into the module's chart_config and failed test_effective_config_... when it ran later
    # (issue 40 item 6). The ConfigMap's mount point does not exist here: its content does.
    c = copy.deepcopy(chart_config)
    c.PolicyStore.policy_file = str(POLICY)
    PolicyStore.clear_instance()

    def make(user, groups, profile):
        spawner = KueueSpawner(
            config=c,
            user=MockUser(user, groups),
            hub=MockHub(double.url),
            api_token="t",
            oauth_client_id=f"jupyterhub-user-{user}",
        )
        spawner.user_options = {"profile": profile}
        return spawner

    yield make
    PolicyStore.clear_instance()


async def pod_of(spawner) -> dict:
    await spawner.load_user_options()
    return ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())


@pytest.mark.asyncio(loop_scope="function")
async def test_the_pod_a_user_gets_from_the_charts_own_config(spawner_for, rendered):
    values = yaml.safe_load(VALUES[0].read_text())
    images = values["hub"]["config"]["KueueSpawner"]["default_images"]
    spawner = spawner_for("alice", ["vision-lab"], "a100-1")
    pod = await pod_of(spawner)
    assert spawner.namespace == NAMESPACE
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    uri = f"http://hub.{HUB_NAMESPACE}.svc.cluster.local:10101/services/mlflow"
    assert env["MLFLOW_TRACKING_URI"] == uri and env["GPUHUB_MLFLOW_TRACKING_URI"] == uri
    assert env["MLFLOW_EXPERIMENT_NAME"] == "users/alice"
    assert env["GPUHUB_IMAGE"] == container["image"] == images["gpu"]  # gpuhub's own CUDA image
    labels = pod["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "vision"
    assert labels["kueue.x-k8s.io/priority-class"] == "interactive"
    assert labels["hub.jupyter.org/network-access-hub"] == "true"  # reaches the hub across namespaces
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", **pod}, "1.30", strict=True)

    cpu = await pod_of(spawner_for("bob", ["vision-lab"], "cpu"))
    assert cpu["spec"]["containers"][0]["image"] == images["cpu"] == "{name}:{tag}".format(**values["singleuser"]["image"])
    # The image pullers tolerate the GPU taint; CPU-only user pods must not.
    assert not any(t.get("key") == "nvidia.com/gpu" for t in cpu["spec"].get("tolerations") or [])


def test_image_pullers_prepull_gpuhubs_images_on_gpu_nodes(rendered):
    values = yaml.safe_load(VALUES[0].read_text())
    wanted = set(values["hub"]["config"]["KueueSpawner"]["default_images"].values())
    assert not [d for d in rendered if "hook-image" in d["metadata"]["name"]]  # the hook needs the chart's RBAC
    for name in ("continuous-image-puller",):
        ds = obj(rendered, "DaemonSet", name)["spec"]["template"]["spec"]
        pulled = {c["image"] for c in ds["initContainers"]}
        assert wanted <= pulled, (name, pulled)
        assert not any("minimal-notebook" in i or "k8s-singleuser-sample" in i for i in pulled)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ds["tolerations"]


def test_hub_and_proxy_reach_user_pods_in_their_namespace(rendered):
    def allows_users(rule):
        return any(
            ((t.get("namespaceSelector") or {}).get("matchLabels") or {}).get("kubernetes.io/metadata.name") == NAMESPACE
            and any(p["port"] == 8888 for p in rule.get("ports") or [])
            for t in rule.get("to") or []
        )

    for name in ("hub", "proxy"):
        egress = obj(rendered, "NetworkPolicy", name)["spec"]["egress"]
        assert any(allows_users(r) for r in egress), name
    hub_ingress = obj(rendered, "NetworkPolicy", "hub")["spec"]["ingress"]
    # interNamespaceAccessLabels: accept -> labelled pods of any namespace may reach the hub
    assert any(
        src.get("namespaceSelector") == {"matchLabels": {}}
        and src.get("podSelector") == {"matchLabels": {"hub.jupyter.org/network-access-hub": "true"}}
        for rule in hub_ingress
        for src in rule.get("from") or []
    )


def test_user_namespace_file_is_valid_and_names_its_namespaces_as_its_comment_says():
    path = REPO / "helm-values" / "user-namespace.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    assert {d["kind"] for d in docs} == {"Namespace", "Role", "RoleBinding", "NetworkPolicy"}  # nothing cluster-wide
    # The Role's rules: exactly the hub's rights in the users' namespace (kube/rights.py, derived
    # from the code's calls and checked rule by rule in tests/unit/test_kube_rbac.py).
    from gpuhub_spawner.kube import rights

    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(g, r, v) for s, g, r, v in rights.needed() if s == rights.USERS}
    assert ("kueue.x-k8s.io", "workloads", "patch") in granted and ("", "pods/log", "get") in granted  # issue 40

    def count(node, value, skip=("app.kubernetes.io/managed-by",)):
        if isinstance(node, dict):
            return sum(count(v, value) for k, v in node.items() if k not in skip)
        if isinstance(node, list):
            return sum(count(v, value) for v in node)
        return int(node == value)

    text = path.read_text()
    users, hub = sum(count(d, NAMESPACE) for d in docs), sum(count(d, HUB_NAMESPACE) for d in docs)
    assert f"({NAMESPACE}) in {users} places" in text and f"({HUB_NAMESPACE}) in {hub} places" in text
    assert f"change all {users + hub}" in text


def test_without_subdomains_the_hub_warns_loudly_at_start(tmp_path, capsys):
    """An operator who drops the wildcard host is told what is at risk, at every start."""
    off = tmp_path / "no-subdomains.yaml"
    off.write_text(yaml.safe_dump({"hub": {"config": {"JupyterHub": {"subdomain_host": ""}}}}))
    docs = helm_template(require_shared("charts", "jupyterhub-4.4.0"), VALUES + [off], namespace=HUB_NAMESPACE)
    c = run_chart_config(docs, tmp_path / "root")
    assert not c.JupyterHub.get("subdomain_host")
    err = capsys.readouterr().err
    assert "user servers share the hub's origin" in err and "subdomain_host is not set" in err


def test_with_subdomains_there_is_no_warning(rendered, tmp_path, capsys):
    run_chart_config(rendered, tmp_path / "root")
    assert "share the hub's origin" not in capsys.readouterr().err


# -- Pod Security on the users' namespace (issue 40 item 2) -----------------------------------------
def test_no_privileged_init_container_in_user_pods(chart_config):
    """The chart's cloud-metadata block (a privileged NET_ADMIN init container in every user pod)
    is off: gpuhub-singleuser's egress rule keeps user pods from 169.254.169.254 instead."""
    assert not chart_config.KubeSpawner.get("init_containers")
    docs = [d for d in yaml.safe_load_all((REPO / "helm-values" / "user-namespace.yaml").read_text()) if d]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "gpuhub-singleuser")
    blocks = [b["ipBlock"] for rule in policy["spec"]["egress"] for b in rule.get("to") or [] if "ipBlock" in b]
    assert blocks and all("169.254.169.254/32" in b.get("except", []) for b in blocks)


def _as_pod(name: str, template: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": dict(template["metadata"].get("labels") or {})},
        "spec": template["spec"],
    }


async def _gpuhub_pods(spawner_for) -> dict[str, dict]:
    """Every kind of pod gpuhub puts in the users' namespace, from the chart's effective config:
    a GPU and a CPU server pod, a job's pod and a Ray cluster's head and worker pods."""
    from gpuhub_spawner.jobs.spec import JobSpec
    from gpuhub_spawner.kube.job_manifest import job_manifest
    from gpuhub_spawner.kube.ray_manifest import WorkerGroup, ray_cluster_manifest
    from gpuhub_spawner.policy import PolicyStore
    from gpuhub_spawner.policy.access import resolve_choice

    spawner = spawner_for("alice", ["vision-lab"], "a100-1")
    gpu = await pod_of(spawner)
    cpu = await pod_of(spawner_for("bob", ["vision-lab"], "cpu"))
    policy = PolicyStore.instance().policy
    policy = policy.model_copy(update={"ray": policy.ray.model_copy(update={"enabled": True})})
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    job = job_manifest(
        "job-psa",
        "alice",
        JobSpec.model_validate({"profile": "a100-1", "command": ["sleep", "1"]}),
        policy,
        choice,
        gpu,
        namespace=NAMESPACE,
    )
    rc = ray_cluster_manifest("ray-psa", "alice", policy, choice, gpu, [WorkerGroup("gpu", 1, 1)], namespace=NAMESPACE)
    return {
        "server-gpu": _as_pod("psa-server-gpu", gpu),
        "server-cpu": _as_pod("psa-server-cpu", cpu),
        "job": _as_pod("psa-job", job["spec"]["template"]),
        "ray-head": _as_pod("psa-ray-head", rc["spec"]["headGroupSpec"]["template"]),
        "ray-worker": _as_pod("psa-ray-worker", rc["spec"]["workerGroupSpecs"][0]["template"]),
    }


SKIP_REAL = _real.skip_reason()


@pytest.mark.cluster
@pytest.mark.skipif(bool(SKIP_REAL), reason=SKIP_REAL or "")
@pytest.mark.asyncio(loop_scope="function")
async def test_the_real_api_server_admits_gpuhubs_pods_under_pod_security_and_refuses_z2jhs_init_container(
    spawner_for, real_cluster, tmp_path
):
    """On the real kube-apiserver 1.36 (its PodSecurity admission plugin), in gpuhub-users as
    user-namespace.yaml labels it (`restricted` enforced): every pod gpuhub makes is admitted
    (server-side dry run: the whole admission chain, Kueue's webhooks included) with no
    warning; the same server pod without gpuhub's securityContext is refused, and so is the
    one with the chart's default init container (singleuser.cloudMetadata.blockWithIptables:
    true, the chart's own config executed)."""
    cluster = real_cluster
    cluster.kubectl("apply", "-f", str(REPO / "helm-values" / "user-namespace.yaml"))
    labels = next(n for n in cluster.list("namespaces") if n["metadata"]["name"] == NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"

    def dry_run(pod: dict) -> subprocess.CompletedProcess:
        return cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", input=json.dumps(pod), check=False)

    report = []
    for what, pod in (await _gpuhub_pods(spawner_for)).items():
        out = dry_run(pod)
        report.append(f"  {what}: rc {out.returncode} {out.stdout.strip()} {out.stderr.strip()}")
        assert out.returncode == 0, (what, out.stderr)
        assert "PodSecurity" not in out.stderr, (what, out.stderr)  # no `restricted` warning either

    # The label bites: the same GPU server pod without gpuhub's container securityContext is
    # refused, with the API server's reasons.
    bare = copy.deepcopy((await _gpuhub_pods(spawner_for))["server-gpu"])
    bare["spec"]["containers"][0].pop("securityContext", None)
    out = dry_run(bare)
    report.append(f"  server-gpu without gpuhub's securityContext: rc {out.returncode} {out.stderr.strip()}")
    assert out.returncode != 0 and 'violates PodSecurity "restricted:v1.30"' in out.stderr, out.stderr
    assert "runAsNonRoot" in out.stderr and "seccompProfile" in out.stderr, out.stderr

    on = tmp_path / "block-with-iptables.yaml"
    on.write_text(yaml.safe_dump({"singleuser": {"cloudMetadata": {"blockWithIptables": True}}}))
    docs = helm_template(require_shared("charts", "jupyterhub-4.4.0"), VALUES + [on], namespace=HUB_NAMESPACE)
    c = await asyncio.to_thread(run_chart_config, docs, tmp_path / "root")  # as config is read: no running loop
    [init] = c.KubeSpawner.init_containers
    from gpuhub_spawner.kube.spawner import KueueSpawner
    from gpuhub_spawner.policy import PolicyStore

    c.PolicyStore.policy_file = str(POLICY)
    PolicyStore.clear_instance()
    try:
        spawner = KueueSpawner(
            config=c,
            user=MockUser("carol", ["vision-lab"]),
            hub=MockHub("http://127.0.0.1:1"),
            api_token="t",
            oauth_client_id="jupyterhub-user-carol",
        )
        spawner.user_options = {"profile": "cpu"}
        pod = _as_pod("psa-z2jh-default", await pod_of(spawner))
    finally:
        PolicyStore.clear_instance()
    assert [i["name"] for i in pod["spec"]["initContainers"]] == ["block-cloud-metadata"]
    out = dry_run(pod)
    report.append(f"  z2jh's default (block-cloud-metadata): rc {out.returncode} {out.stderr.strip()}")
    print("\n[real] server-side dry runs in gpuhub-users (enforce restricted):\n" + "\n".join(report))
    assert out.returncode != 0 and 'violates PodSecurity "restricted:v1.30"' in out.stderr, out.stderr
    assert "privileged" in out.stderr and "NET_ADMIN" in out.stderr, out.stderr
