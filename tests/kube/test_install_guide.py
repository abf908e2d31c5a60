"""docs/install-kubernetes.md followed line by line, twice.

* On the API double (every run): each shell command of the guide's ``sh`` blocks is run as
  written (``gpuhub ...``, ``kubectl create ... --dry-run=client``, ``kubectl get --raw``),
  run with the one change that keeps it off a cluster (``helm upgrade --install`` becomes
  ``helm template`` with the same values files; ``kubectl apply`` of a file goes to the
  double, which validates it against the real CRDs, or through Kubernetes' schema), or read.
* On the real control plane of ``tests/cluster/`` (``GPUHUB_CLUSTER=1``): every command but
  those in ``NOT_ON_REAL`` runs as written, in order, by bash, in a copy of the repository,
  as an operator would: the CLI installed with pip into a fresh venv, Kueue's configuration
  edited through its ConfigMap, the webhook step, the namespaces and the RBAC file, the
  policy and the rendered Kueue objects through Kueue's real webhooks, the chart installed
  by ``helm upgrade --install`` against the real API server, and the checks of section 5
  (RBAC answered by the real authorizer for the hub's service account). Two substitutions,
  as an operator fills in a placeholder: ``<gpu-node>`` is a kwok GPU node, and the chart
  repository's URL is a local one serving the shared z2jh 4.4.0 chart (no network here).

``NOT_ON_REAL`` is the list of steps only read; docs/kubernetes-testing.md must list exactly
those commands (checked without a cluster), so the closing note cannot forget one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import requests
import yaml

from double.harness import KUBECONFIG, NAMESPACE
from support.helm import helm_template, kubectl_binary, require_shared

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "install-kubernetes.md"
TESTING = REPO / "docs" / "kubernetes-testing.md"
GPUHUB = [sys.executable, "-m", "gpuhub_spawner.cli"]


def guide_commands() -> list[str]:
    """Logical shell commands of the guide's sh blocks (continuations and for-loops joined)."""
    commands, text = [], GUIDE.read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        current, continued = "", False
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).rstrip()
            if not line.strip():
                continue
            # a new line of a for-loop's body is a new command in it (bash: "; ")
            sep = "; " if current and not continued and not current.endswith(" do") else " "
            current = f"{current}{sep}{line.strip()}" if current else line.strip()
            continued = current.endswith("\\")
            if continued:
                current = current[:-1].rstrip()
                continue
            if current.startswith("for ") and not current.endswith("done"):
                continue
            commands.append(re.sub(r" {2,}", " ", current))
            current = ""
    return commands


def only_read_in_testing_doc() -> list[str]:
    section = TESTING.read_text().split("## Install guide steps only read", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\* `(.+?)`", section, re.M)


def run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=kw.pop("cwd", REPO), **kw)
    assert done.returncode == 0, f"{cmd}: {done.stderr}"
    return done.stdout


def test_follow_the_guide_against_the_double(kube, tmp_path):
    chart = require_shared("charts", "jupyterhub-4.4.0")
    kube.reset()  # an empty cluster: the guide creates everything
    kube.call(lambda: setattr(kube, "webhook_namespaces", {NAMESPACE}))
    done, read_only = [], []
    for cmd in guide_commands():
        words = shlex.split(cmd.split("|")[0].split(">")[0].split("&&")[0])
        if words == ["gpuhub", "--help"]:
            assert "render" in run(GPUHUB + ["--help"])
        elif words[:2] == ["gpuhub", "validate"]:
            run(GPUHUB + words[1:])
        elif words[:3] == ["gpuhub", "render", "kueue"]:
            args = [str(tmp_path / w) if w == "live-localqueues.yaml" else w for w in words[1:]]
            out = run(GPUHUB + args)
            (tmp_path / "kueue.yaml").write_text(out)
            if "kubectl apply -f kueue.yaml" in cmd:
                kube.apply([d for d in yaml.safe_load_all(out) if d])
        elif words[:3] == ["gpuhub", "render", "capacity-rbac"]:
            docs = [d for d in yaml.safe_load_all(run(GPUHUB + words[1:])) if d]
            assert [d["kind"] for d in docs] == ["ClusterRole", "ClusterRoleBinding"]
            for doc in docs:
                kubernetes_validate.validate(doc, "1.30", strict=True)
            # only list nodes and, for a designated queue, get/patch it by name (unit: test_kube_capacity)
            assert all(set(r["verbs"]) <= {"list", "get", "patch"} for r in docs[0]["rules"])
            assert docs[1]["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": HUB_NS}]
        elif words[:3] == ["gpuhub", "render", "policy-rbac"]:
            docs = [d for d in yaml.safe_load_all(run(GPUHUB + words[1:])) if d]
            assert [d["kind"] for d in docs] == ["Role", "RoleBinding"]
            for doc in docs:
                kubernetes_validate.validate(doc, "1.30", strict=True)
            [rule] = docs[0]["rules"]  # that one ConfigMap, in the hub's namespace
            assert rule["resourceNames"] == ["gpuhub-policy"] and docs[0]["metadata"]["namespace"] == HUB_NS
        elif cmd == "kubectl apply -f kueue.yaml":
            kube.apply([d for d in yaml.safe_load_all((tmp_path / "kueue.yaml").read_text()) if d])
        elif words[:3] == ["kubectl", "apply", "-f"] and words[3].startswith("helm-values/"):
            for doc in yaml.safe_load_all((REPO / words[3]).read_text()):
                kubernetes_validate.validate(doc, "1.30", strict=True)
        elif words[:3] == ["kubectl", "create", "configmap"] and "gpuhub-policy" in words:
            args = [w for w in words if w not in ("--dry-run=client", "-o", "yaml")]
            out = run(
                [str(kubectl_binary())] + args[1:] + ["--dry-run=client", "-o", "yaml"], env={"KUBECONFIG": str(KUBECONFIG)}
            )
            kubernetes_validate.validate(yaml.safe_load(out), "1.30", strict=True)
        elif words[:3] == ["kubectl", "get", "localqueues"]:
            live = {"apiVersion": "v1", "kind": "List", "items": kube.list("localqueues", NAMESPACE)}
            (tmp_path / "live-localqueues.yaml").write_text(yaml.safe_dump(live))
        elif words[:3] == ["helm", "upgrade", "--install"]:
            values = [REPO / w for prev, w in zip(words, words[1:]) if prev == "-f" and (REPO / w).exists()]
            assert [v.name for v in values] == ["values.yaml", "mlflow-values.yaml"]
            helm_template(chart, values, release=words[3], namespace=words[words.index("--namespace") + 1])
        elif words[:3] == ["kubectl", "get", "--raw"]:
            _pending_pod(kube)
            # kubectl sends no bearer token over plain HTTP: the double serves this read anonymously.
            kube.call(lambda: setattr(kube, "anonymous_reads", True))
            out = run([str(kubectl_binary()), "get", "--raw", words[3]], env={"KUBECONFIG": str(KUBECONFIG)})
            items = yaml.safe_load(out)["items"]
            assert items and items[0]["localQueueName"] == "vision" and items[0]["positionInLocalQueue"] == 0
        else:
            read_only.append(cmd)
            continue
        done.append(cmd)
    assert len(done) >= 10, done
    # The Kueue objects the guide applied admit a pod the way the hub will create them.
    assert {q["metadata"]["name"] for q in kube.list("localqueues", NAMESPACE)} == {"vision", "nlp", "students"}
    assert kube.invalid == []
    # What is only read everywhere is also only read here (the rest runs on the real control plane).
    assert set(only_read_in_testing_doc()) <= set(read_only)


def _pending_pod(kube):
    """A vision pod that cannot fit (3 A100 > nominal 2 + borrowing 1 in use) so the queue has one entry."""
    for i in range(4):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"jupyter-u{i}",
                "labels": {"kueue.x-k8s.io/queue-name": "vision", "component": "singleuser-server"},
            },
            "spec": real.restricted(
                {
                    "containers": [
                        {
                            "name": "notebook",
                            "image": "x",
                            "command": ["sleep", "600"],
                            "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}},
                        }
                    ],
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
                }
            ),
        }
        code, _ = kube.create("pods", NAMESPACE, pod)
        assert code == 201
    import time

    deadline = time.time() + 20
    while time.time() < deadline:
        gated = [p for p in kube.list("pods", NAMESPACE) if p["spec"].get("schedulingGates")]
        wl = [
            w
            for w in kube.list("workloads", NAMESPACE)
            if any(
                c["type"] == "QuotaReserved" and c["status"] == "False" for c in (w.get("status") or {}).get("conditions") or []
            )
        ]
        if gated and wl:
            return
        time.sleep(0.1)
    pytest.fail("no pod waiting in the vision queue")


# -- the real control plane ------------------------------------------------------------------------
sys.path.insert(0, str(REPO / "tests" / "cluster"))
import harness as real  # noqa: E402

from gpuhub_spawner.kube.webhooks import webhooks_covering  # noqa: E402

# The guide's steps that do not run on the real control plane, and why. Nothing else may be
# only read: the real-cluster test fails on a command it has no way to run.
NOT_ON_REAL = [
    (
        r"kubectl apply --server-side -f https://github\.com/kubernetes-sigs/kueue/releases/",
        "fetches Kueue's release manifests from GitHub (no network here); tests/cluster/up.sh applies the same objects, "
        "made from the Kueue v0.19.2 module, with each webhook's Service swapped for a local URL (Kueue runs as a process)",
    ),
    (
        r"curl -fsSL -o helm-values/kueue/manifests\.yaml https://github\.com/kubernetes-sigs/kueue/releases/",
        "downloads the same release manifests (no network here); the test writes in their place what up.sh installed "
        "(harness.release_manifests: the objects made from the Kueue v0.19.2 module and the release's ConfigMap "
        "kueue-manager-config with the module's default configuration)",
    ),
    (
        r"kubectl -n kueue-system rollout (status|restart) deploy kueue-controller-manager",
        "Kueue runs as a process, not a Deployment; the test restarts that process with the edited ConfigMap instead",
    ),
    (
        r"kubectl -n gpuhub logs deploy/hub",
        "kwok runs no container, so the hub pod has no log; the hub's own start is run for real in test_real_cluster_e2e.py",
    ),
    (r"helm repo add kuberay ", "reaches KubeRay's Helm repository (no network here)"),
    (
        r"helm install kuberay-operator ",
        "installs KubeRay from its chart (no network here); tests/cluster/up.sh applies the CRDs of the KubeRay v1.5.0 "
        "module and runs the operator built from it as a process",
    ),
    (r"HUB_DIGEST=\$\(crane digest ", "reads a registry"),
    (r"docker (build|push) ", "an image build or push (no container runtime or registry here)"),
]


def not_on_real(cmd: str) -> str | None:
    return next((why for pattern, why in NOT_ON_REAL if re.match(pattern, cmd)), None)


def test_the_only_read_list_is_what_the_real_control_plane_cannot_run():
    assert only_read_in_testing_doc() == [c for c in guide_commands() if not_on_real(c)], (
        "docs/kubernetes-testing.md's list of steps only read must be the guide's commands in NOT_ON_REAL"
    )
    assert all(any(re.match(p, c) for c in guide_commands()) for p, _ in NOT_ON_REAL), "a NOT_ON_REAL entry matches no step"


HUB_NS, USERS_NS = "gpuhub", "gpuhub-users"
HUB_SA = "system:serviceaccount:gpuhub:hub"
GPU_NODE = "kwok-gpu-a100-1"


class Operator:
    """A shell at a checkout of the repository, with kubectl, helm and $HOME of its own."""

    def __init__(self, cluster: real.RealCluster, tmp: Path):
        from support.helm import helm_binary

        self.cluster, self.tmp = cluster, tmp
        self.checkout = tmp / "gpuhub"
        files = subprocess.run(
            [
                "git",
                "ls-files",
                "-co",
                "--exclude-standard",
                "pyproject.toml",
                "README.md",
                "spawner",
                "helm-values",
                "jupyterhub_config",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for name in files:
            src, dst = REPO / name, self.checkout / name
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        tools = tmp / "tools"
        tools.mkdir()
        (tools / "kubectl").symlink_to(real.kubectl_path())
        (tools / "helm").symlink_to(helm_binary())
        home = tmp / "home"
        home.mkdir()
        self.env = dict(
            os.environ,
            HOME=str(home),
            KUBECONFIG=str(cluster.kubeconfig),
            PATH=f"{tools}:/usr/local/bin:/usr/bin:/bin",
            PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip")),
            HELM_CONFIG_HOME=str(tmp / "helm-config"),
            HELM_CACHE_HOME=str(tmp / "helm-cache"),
            HELM_DATA_HOME=str(tmp / "helm-data"),
        )
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            self.env.pop(key, None)
        self.log: list[str] = []

    def sh(self, cmd: str, timeout: int = 180) -> str:
        t0 = time.time()
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", cmd],
            cwd=self.checkout,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self.log.append(f"$ {cmd}   [{time.time() - t0:.1f}s, rc={done.returncode}]\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
        assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout


def chart_repository(tmp: Path) -> tuple[str, subprocess.Popen]:
    """A Helm chart repository on 127.0.0.1 serving the shared z2jh 4.4.0 chart (with the hub's
    Python files when $GPUHUB_Z2JH_HUB_FILES has them, else the tests' placeholder)."""
    from support.ports import free_port
    from support.helm import helm_binary, renderable_chart

    chart = renderable_chart(require_shared("charts", "jupyterhub-4.4.0"))
    repo = tmp / "chart-repo"
    repo.mkdir()
    helm = str(helm_binary())
    subprocess.run([helm, "package", str(chart), "-d", str(repo)], check=True, capture_output=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    subprocess.run([helm, "repo", "index", str(repo), "--url", url], check=True, capture_output=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=repo,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(50):
        try:
            if requests.get(url + "index.yaml", timeout=1).ok:
                break
        except requests.RequestException:
            time.sleep(0.1)
    return url, server


def kueue_pid() -> int | None:
    f = real.DIR / "run" / "kueue.pid"
    return int(f.read_text()) if f.exists() and f.read_text().strip() else None


def restart_kueue() -> None:
    """What `kubectl rollout restart deploy kueue-controller-manager` is here: stop the Kueue
    process; up.sh starts it again with the configuration in the ConfigMap kueue-manager-config."""
    pid = kueue_pid()
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(150):
                os.kill(pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            pass
    subprocess.run(["bash", str(real.HERE / "up.sh")], check=True, timeout=600, capture_output=True)


def kueue_frameworks(cluster: real.RealCluster) -> list[str]:
    cm = cluster.get("/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config")
    return yaml.safe_load(cm["data"]["controller_manager_config.yaml"])["integrations"]["frameworks"]


def guide_wait_for_pods_ready() -> dict:
    """The ``waitForPodsReady`` block the guide has operators add to kueue-config.yaml."""
    block = re.search(r"```yaml\n(\s*waitForPodsReady:.*?)```", GUIDE.read_text(), re.S)
    assert block, "install-kubernetes.md has no waitForPodsReady yaml block"
    import textwrap

    return yaml.safe_load(textwrap.dedent(block.group(1)))["waitForPodsReady"]


def follow_the_kueue_config_instructions(path: Path) -> None:
    """The guide's four edits of kueue-config.yaml, as an operator makes them."""
    cfg = yaml.safe_load(path.read_text())
    frameworks = cfg.setdefault("integrations", {}).setdefault("frameworks", [])
    if "pod" not in frameworks:  # 1. add "pod", keep every other entry
        frameworks.append("pod")
    assert "managedJobsNamespaceSelector" not in cfg  # 2. absent: Kueue manages gpuhub-users; leave it
    assert "waitForPodsReady" not in cfg  # 3. absent from Kueue's default file: add the guide's block
    cfg["waitForPodsReady"] = guide_wait_for_pods_ready()
    cfg.setdefault("metrics", {})["enableClusterQueueResources"] = True  # 4. the dashboard's quota panel
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_the_certificate_is_shown_where_its_namespace_exists():
    """N9: the guide's cert-manager Certificate is namespaced (``gpuhub``); it comes after the
    step that creates that namespace, not among the prerequisites, where `kubectl apply` of it
    would fail with ``namespaces "gpuhub" not found``."""
    text = GUIDE.read_text()
    cert = re.search(r"```yaml\n(apiVersion: cert-manager\.io/v1\nkind: Certificate\n.*?)```", text, re.S)
    assert cert, "install-kubernetes.md has no cert-manager Certificate yaml block"
    doc = yaml.safe_load(cert.group(1))
    ns = doc["metadata"]["namespace"]
    created = text.find(f"kubectl create namespace {ns}")
    assert 0 <= created < cert.start(), f"the Certificate in {ns!r} comes before `kubectl create namespace {ns}`"
    assert doc["spec"]["secretName"] == "gpuhub-tls" and "*.hub.example.org" in doc["spec"]["dnsNames"]


def test_the_guides_wait_for_pods_ready_fits_the_policy():
    """The guide's timeout leaves the hub its launch timeout and more (the hub, not Kueue, gives
    up on a slow server first), and a job that can never start stops retrying."""
    from gpuhub_spawner.policy.model import Defaults
    from gpuhub_spawner.policy.quantities import parse_duration

    w = guide_wait_for_pods_ready()
    assert parse_duration(w["timeout"]) >= Defaults().launch_timeout + 120
    assert w["blockAdmission"] is False
    r = w["requeuingStrategy"]
    assert r["timestamp"] == "Eviction" and 0 < r["backoffLimitCount"] <= 5 and r["backoffBaseSeconds"] >= 30


def empty_cluster(cluster: real.RealCluster) -> None:
    """No gpuhub namespaces, release, Kueue queue objects or stand-in volume left from other runs."""
    if any(n["metadata"]["name"] == USERS_NS for n in cluster.list("namespaces")):
        cluster.reset(USERS_NS)
    for kind in ("clusterqueues", "resourceflavors", "workloadpriorityclasses"):
        for obj in cluster.list(kind):
            cluster.delete(kind, None, obj["metadata"]["name"])
    cluster.kubectl("delete", "namespace", HUB_NS, USERS_NS, "--ignore-not-found", "--wait=false")
    cluster.kubectl("delete", "persistentvolume", "gpuhub-guide-hub-db", "--ignore-not-found", "--wait=false")
    deadline = time.time() + 120
    while any(n["metadata"]["name"] in (HUB_NS, USERS_NS) for n in cluster.list("namespaces")):
        assert time.time() < deadline, "namespaces gpuhub/gpuhub-users still terminating after 120 s"
        time.sleep(1)


def stand_in_volume(cluster: real.RealCluster, tmp: Path) -> None:
    """What a cluster's storage provisioner does for the chart's hub-db-dir claim (no
    StorageClass exists here): a volume it can bind to."""
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "gpuhub-guide-hub-db"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Delete",
                    "hostPath": {"path": str(tmp / "hub-db")},
                    "claimRef": {"namespace": HUB_NS, "name": "hub-db-dir"},
                },
            }
        ),
    )


def fill_the_vision_queue(op: Operator) -> list[str]:
    """Pods created as the hub creates them (as its service account: RBAC decides), one A100
    each, until one waits in Kueue (vision may hold 2 + 1 borrowed)."""
    names = []
    for i in range(4):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"jupyter-guide-{i}",
                "namespace": USERS_NS,
                "labels": {"kueue.x-k8s.io/queue-name": "vision", "component": "singleuser-server"},
            },
            "spec": real.restricted(
                {
                    "containers": [
                        {
                            "name": "notebook",
                            "image": "registry.example.com/gpuhub/notebook:cuda-0.1.0",
                            "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}},
                        }
                    ]
                }
            ),
        }
        out = subprocess.run(
            ["kubectl", "create", "-f", "-", f"--as={HUB_SA}"],
            input=json.dumps(pod),
            env=op.env,
            capture_output=True,
            text=True,
            cwd=op.checkout,
        )
        assert out.returncode == 0, out.stderr
        names.append(pod["metadata"]["name"])
    deadline = time.time() + 60
    while time.time() < deadline:
        pods = {p["metadata"]["name"]: p for p in op.cluster.list("pods", USERS_NS)}
        gated = [n for n, p in pods.items() if p["spec"].get("schedulingGates")]
        running = [n for n, p in pods.items() if (p.get("status") or {}).get("phase") == "Running"]
        if (
            len(gated) == 1
            and len(running) == 3
            and op.cluster.get(
                f"/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{USERS_NS}/localqueues/vision/pendingworkloads"
            )["items"]
        ):
            return names
        time.sleep(0.5)
    pytest.fail(f"vision's queue did not fill as expected: gated {gated}, running {running}")


@pytest.fixture
def guide_cluster(real_cluster):
    cluster = real_cluster
    # The guide creates these cluster-wide objects and expects "created": an earlier run's go first.
    cluster.kubectl("delete", "clusterrolebinding,clusterrole", "gpuhub-gpu-capacity", "--ignore-not-found")
    yield cluster
    # The release goes (other tests create their own "hub" Deployment in gpuhub), and with it
    # the stand-in volume.
    from support.helm import helm_binary

    subprocess.run(
        [
            str(helm_binary()),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "uninstall",
            HUB_NS,
            "-n",
            HUB_NS,
            "--ignore-not-found",
            "--wait",
        ],
        capture_output=True,
        timeout=300,
    )
    cluster.kubectl("delete", "persistentvolume", "gpuhub-guide-hub-db", "--ignore-not-found", "--wait=false")
    # Kueue's webhooks as installed again (the guide's step narrowed them; other tests start
    # from Kueue's manifests), as up.sh applies them.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(real.DIR / "kueue-install.yaml"))
    if "pod" not in kueue_frameworks(cluster):  # a failure left Kueue without its pod integration
        cluster.kubectl("-n", "kueue-system", "delete", "configmap", "kueue-manager-config")
        restart_kueue()


@pytest.mark.cluster
def test_follow_the_guide_on_the_real_control_plane(guide_cluster, tmp_path):
    cluster = guide_cluster
    empty_cluster(cluster)
    op = Operator(cluster, tmp_path)
    (op.checkout / "your-auth-values.yaml").write_text(
        "hub:\n  config:\n    JupyterHub:\n      authenticator_class: dummy\n"
    )  # the operator's own file
    url, server = chart_repository(tmp_path)
    # "Another team's" Kueue: the default configuration without the pod integration, so that
    # the guide's edit has something to do (Kueue still runs with the default until restarted).
    default = cluster.get("/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config")["data"][
        "controller_manager_config.yaml"
    ]
    narrowed = yaml.safe_load(default)
    narrowed["integrations"]["frameworks"].remove("pod")
    narrowed.pop("waitForPodsReady", None)  # none in Kueue's default file (an earlier run of this test left the guide's)
    others = list(narrowed["integrations"]["frameworks"])
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
            f"--from-literal=controller_manager_config.yaml={yaml.safe_dump(narrowed, sort_keys=False)}",
        ).stdout,
    )
    assert "pod" not in kueue_frameworks(cluster)

    ran, only_read = [], []
    try:
        for cmd in guide_commands():
            why = not_on_real(cmd)
            if why:
                only_read.append(cmd)
                if cmd.startswith("curl ") and "manifests.yaml" in cmd:
                    (op.checkout / "helm-values" / "kueue" / "manifests.yaml").write_text(real.release_manifests())
                if "rollout restart" in cmd:
                    restart_kueue()
                    running_cfg = yaml.safe_load((real.DIR / "kueue-config.yaml").read_text())
                    running = running_cfg["integrations"]["frameworks"]
                    assert "pod" in running and set(others) <= set(running), running
                    # Kueue validated the whole file at its start (it exits on an invalid one)
                    assert running_cfg["waitForPodsReady"] == guide_wait_for_pods_ready()
                    assert real.kueue_running(), "Kueue did not start with the edited configuration"
                continue
            run_cmd = cmd.replace("<gpu-node>", GPU_NODE).replace("https://hub.jupyter.org/helm-chart/", url)
            if cmd.startswith("export "):
                op.env["PATH"] = op.sh(f'{cmd}; printf %s "$PATH"')
            elif cmd.startswith("helm upgrade --install"):
                stand_in_volume(cluster, tmp_path)
                out = op.sh(run_cmd, timeout=600)
                assert "STATUS: deployed" in out
                # The chart's RBAC is off (values.yaml rbac.create: false, issue 40): in its own
                # namespace the hub may touch its policy ConfigMap and nothing else.
                roles = [
                    r["metadata"]["name"]
                    for r in cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{HUB_NS}/roles")["items"]
                ]
                assert roles == ["gpuhub-policy-writer"], roles
                for question, want in (
                    ("create pods", "no"),
                    ("get secrets", "no"),
                    ("create persistentvolumeclaims", "no"),
                    ("create services", "no"),
                    ("list pods", "no"),
                    ("patch configmaps/gpuhub-policy", "yes"),
                ):
                    got = subprocess.run(
                        ["kubectl", "-n", HUB_NS, "auth", "can-i", *question.split(), f"--as={HUB_SA}"],
                        env=op.env,
                        capture_output=True,
                        text=True,
                        cwd=op.checkout,
                    ).stdout.strip()
                    assert got == want, (question, got)
            elif cmd.startswith("kubectl -n gpuhub get pods -l component=hub"):
                deadline = time.time() + 90
                while "Running" not in (out := op.sh(run_cmd)) and time.time() < deadline:
                    time.sleep(1)
                assert re.search(r"hub-\S+\s+1/1\s+Running", out), out  # kwok's Running: no container runs
            elif cmd.startswith("kubectl -n gpuhub-users get pods -L"):
                fill_the_vision_queue(op)
                out = op.sh(run_cmd)
                assert out.count("SchedulingGated") == 1 and out.count(" vision") == 4, out
            else:
                out = op.sh(run_cmd, timeout=900 if "pip install" in cmd else 180)
                check_step(cmd, out, op, others)
            ran.append(cmd)
    finally:
        server.terminate()
        print("\n".join(op.log))
    assert only_read == only_read_in_testing_doc()
    assert len(ran) == len(guide_commands()) - len(only_read)


def check_step(cmd: str, out: str, op: Operator, others: list[str]) -> None:
    """What the operator looks at after each step, where the guide says what to expect."""
    cluster = op.cluster
    if cmd.startswith("python3 -m venv"):
        assert (Path(op.env["HOME"]) / ".gpuhub-cli" / "bin" / "gpuhub").exists()
    elif cmd == "gpuhub --help":
        assert "render" in out
    elif cmd.startswith("kubectl get nodes -L"):
        assert "NVIDIA-A100-SXM4-80GB" in out and "NVIDIA-L4" in out
    elif cmd.startswith("kubectl describe node"):
        assert re.search(r"nvidia.com/gpu:\s+8", out), out
    elif cmd.startswith("kubectl get apiservice"):
        assert re.search(r"v1beta2.visibility.kueue.x-k8s.io\s+\S+\s+True", out), out
    elif "get configmap kueue-manager-config" in cmd and "| grep" in cmd:  # section 6's check after an upgrade
        assert re.search(r"^waitForPodsReady:\n\s+timeout: 10m", out, re.M), out
    elif "get configmap kueue-manager-config" in cmd:
        follow_the_kueue_config_instructions(op.checkout / "helm-values" / "kueue" / "kueue-config.yaml")
    elif "-k helm-values/kueue/" in cmd:  # the put-back (section 1) and the upgrade (section 6)
        assert set(kueue_frameworks(cluster)) == set(others) | {"pod"}
        cm = cluster.get("/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config")
        assert yaml.safe_load(cm["data"]["controller_manager_config.yaml"])["waitForPodsReady"] == guide_wait_for_pods_ready()
    elif cmd.startswith("for kind in mutating validating"):
        for kind in ("mutating", "validating"):
            cfg = json.loads(
                cluster.kubectl("get", f"{kind}webhookconfiguration", f"kueue-{kind}-webhook-configuration", "-o", "json").stdout
            )
            assert webhooks_covering(cfg, HUB_NS) == [] and webhooks_covering(cfg, USERS_NS)
    elif cmd.startswith("kubectl apply -f helm-values/user-namespace.yaml"):
        assert "networkpolicy.networking.k8s.io/gpuhub-singleuser created" in out
    elif cmd.startswith("gpuhub render kueue") and "&& kubectl apply" in cmd or cmd == "kubectl apply -f kueue.yaml":
        assert {q["metadata"]["name"] for q in cluster.list("localqueues", USERS_NS)} == {"vision", "nlp", "students"}
    elif cmd.startswith("helm repo add"):
        assert '"jupyterhub" has been added' in out
    elif cmd.startswith("kubectl get clusterqueues,localqueues -A"):
        for cq in cluster.list("clusterqueues"):
            conds = {c["type"]: c["status"] for c in (cq.get("status") or {}).get("conditions") or []}
            assert conds.get("Active") == "True", cq["metadata"]["name"]
        assert all(name in out for name in ("vision", "nlp", "students"))
    elif cmd.startswith("gpuhub render policy-rbac"):
        assert "role.rbac.authorization.k8s.io/gpuhub-policy-writer created" in out, out
        assert "rolebinding.rbac.authorization.k8s.io/gpuhub-policy-writer created" in out, out
    elif cmd.startswith("gpuhub render capacity-rbac"):
        assert "clusterrole.rbac.authorization.k8s.io/gpuhub-gpu-capacity created" in out, out
        assert "clusterrolebinding.rbac.authorization.k8s.io/gpuhub-gpu-capacity created" in out, out
    elif "auth can-i" in cmd and "-n gpuhub-users" not in cmd:
        assert out.strip() == "yes", out
        # cluster-wide, only what the GPU capacity keeper uses: reading the node list, not changing nodes
        for other in ("watch nodes", "patch nodes", "delete nodes", "list clusterqueues.kueue.x-k8s.io"):
            done = subprocess.run(
                ["kubectl", "auth", "can-i", *other.split(), f"--as={HUB_SA}"],
                env=op.env,
                capture_output=True,
                text=True,
                cwd=op.checkout,
            )
            assert done.stdout.strip() == "no", (other, done.stdout + done.stderr)
    elif "auth can-i" in cmd:
        assert out.strip() == "yes", out
        # ... and nothing cluster-wide: the same question outside gpuhub-users is refused
        other = subprocess.run(
            ["bash", "-c", cmd.replace("-n gpuhub-users", "-n default")],
            env=op.env,
            capture_output=True,
            text=True,
            cwd=op.checkout,
        )
        assert other.stdout.strip() == "no", other.stdout + other.stderr
    elif cmd.startswith("kubectl get namespace gpuhub-users"):
        labels = json.loads(out.strip())
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels  # the pods above were admitted under it
        assert labels["pod-security.kubernetes.io/warn"] == "restricted", labels
    elif cmd.startswith("kubectl -n gpuhub-users get workloads"):
        assert out.count("vision") >= 4, out
    elif cmd.startswith("kubectl get --raw"):
        items = json.loads(out)["items"]
        assert [i["localQueueName"] for i in items] == ["vision"] and items[0]["positionInLocalQueue"] == 0, items
