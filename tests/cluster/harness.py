"""The real control plane of ``tests/cluster/up.sh`` as the tests see it.

* ``skip_reason()``: why the real-cluster tests cannot run here (``GPUHUB_CLUSTER`` unset,
  binaries not in the cache, no kubectl), or None.
* ``RealCluster``: the API server through its REST API (the admin client certificate that
  ``up.sh`` writes), plus ``kubectl apply --server-side`` for what an operator applies.
* ``StandInKubelet``: what stands in for a kubelet's container runtime. kwok binds pods,
  assigns each a pod IP from its node's ``podCIDR`` (loopback ranges in ``nodes.yaml``)
  and marks it Running/Ready, but runs nothing. This thread runs the container's own
  ``command`` + ``args`` with its ``env`` as a local process bound to that pod IP, so the hub
  reaches a real ``jupyterhub-singleuser`` at ``http://<podIP>:<port>`` as it would in a
  cluster, and stops it when the pod is being deleted.

Nothing here imports the API double: these helpers talk to whatever serves the kubeconfig.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path(os.environ.get("GPUHUB_CLUSTER_CACHE", Path.home() / ".cache" / "gpuhub-cluster"))
DIR = Path(os.environ.get("GPUHUB_CLUSTER_DIR", "/tmp/gpuhub-cluster"))
KUBECONFIG = DIR / "kubeconfig"
VENV_BIN = Path(sys.executable).parent


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        m = re.match(r"^(\w+)=(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def binaries() -> dict[str, Path]:
    v = versions()
    kube = CACHE / f"kube-{v['KUBE_VERSION']}" / "bin"
    return {
        "etcd": CACHE / f"etcd-{v['ETCD_VERSION']}" / "bin" / "etcd",
        "kube-apiserver": kube / "kube-apiserver",
        "kube-controller-manager": kube / "kube-controller-manager",
        "kube-scheduler": kube / "kube-scheduler",
        "kwok": CACHE / f"kwok-{v['KWOK_VERSION']}" / "bin" / "kwok",
        "kueue": CACHE / f"kueue-{v['KUEUE_VERSION']}" / "bin" / "kueue",
    }


def kubectl_path() -> str | None:
    return os.environ.get("GPUHUB_KUBECTL") or shutil.which("kubectl")


def skip_reason() -> str | None:
    if not os.environ.get("GPUHUB_CLUSTER"):
        return (
            "real control plane tests are opt-in: set GPUHUB_CLUSTER=1 (tests/cluster/up.sh starts "
            "etcd, kube-apiserver 1.36, kwok and Kueue v0.19.2 from binaries cached by tests/cluster/build.sh)"
        )
    missing = [name for name, path in binaries().items() if not os.access(path, os.X_OK)]
    if missing:
        return (
            f"real control plane binaries not cached in {CACHE} ({', '.join(missing)}): run "
            "tests/cluster/build.sh once (Go >= 1.26 and the Go module proxy; about 55 min on 2 busy cores)"
        )
    if not kubectl_path():
        return "kubectl not found (set GPUHUB_KUBECTL)"
    return None


class RealCluster:
    """The API server of ``up.sh``, spoken to as the admin user."""

    def __init__(self, kubeconfig: Path = KUBECONFIG):
        self.kubeconfig = Path(kubeconfig)
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        self.url = cfg["clusters"][0]["cluster"]["server"]
        ca = cfg["clusters"][0]["cluster"]["certificate-authority"]
        user = cfg["users"][0]["user"]
        self.session = requests.Session()
        self.session.trust_env = False  # else $REQUESTS_CA_BUNDLE overrides verify= below
        self.session.verify = ca
        self.session.cert = (user["client-certificate"], user["client-key"])

    @classmethod
    def for_double(cls, url: str, token: str) -> "RealCluster":
        """The same REST helpers pointed at the API double (plain HTTP, bearer token)."""
        self = cls.__new__(cls)
        self.kubeconfig, self.url = None, url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        return self

    def create(self, kind: str, ns: str | None, obj: dict) -> dict:
        r = self.session.post(self.url + self.path(kind, ns), json=obj, timeout=15)
        if r.status_code >= 400:
            raise RuntimeError(f"create {kind} {obj['metadata'].get('name')}: {r.status_code} {r.text}")
        return r.json()

    # -- REST ------------------------------------------------------------------------------
    def get(self, path: str, **params) -> dict:
        r = self.session.get(self.url + path, params=params, timeout=15)
        r.raise_for_status()
        return r.json()

    def ready(self) -> bool:
        try:
            return self.session.get(self.url + "/readyz", timeout=3).status_code == 200
        except requests.RequestException:
            return False

    @staticmethod
    def path(kind: str, ns: str | None = None, name: str | None = None) -> str:
        core = {"pods", "events", "secrets", "namespaces", "nodes", "services"}
        base = "/api/v1" if kind in core else "/apis/batch/v1" if kind == "jobs" else "/apis/kueue.x-k8s.io/v1beta2"
        out = base + (f"/namespaces/{ns}" if ns else "") + f"/{kind}"
        return out + (f"/{name}" if name else "")

    def list(self, kind: str, ns: str | None = None, **params) -> list[dict]:
        return self.get(self.path(kind, ns), **params)["items"]

    def delete(self, kind: str, ns: str | None, name: str, grace: int | None = None) -> None:
        body = {"gracePeriodSeconds": grace} if grace is not None else None
        r = self.session.delete(self.url + self.path(kind, ns, name), json=body, timeout=15)
        if r.status_code not in (200, 202, 404):
            r.raise_for_status()

    def patch(self, kind: str, ns: str | None, name: str, body: dict) -> None:
        r = self.session.patch(
            self.url + self.path(kind, ns, name),
            data=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=15,
        )
        if r.status_code != 404:
            r.raise_for_status()

    def pending_workloads(self, cluster_queue: str) -> list[dict]:
        return self.get(f"/apis/visibility.kueue.x-k8s.io/v1beta2/clusterqueues/{cluster_queue}/pendingworkloads")["items"]

    # -- kubectl, as an operator --------------------------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [kubectl_path(), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def apply_policy(self, policy_text: str, namespace: str, workdir: Path) -> str:
        """``gpuhub render kueue`` output, applied server-side (through Kueue's webhooks)."""
        workdir.mkdir(parents=True, exist_ok=True)
        policy = workdir / "profiles.yaml"
        policy.write_text(policy_text)
        rendered = subprocess.run(
            [str(VENV_BIN / "gpuhub"), "render", "kueue", str(policy), "--namespace", namespace],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (workdir / "kueue.yaml").write_text(rendered)
        return self.kubectl("apply", "--server-side", "--field-manager=gpuhub-tests", "-f", str(workdir / "kueue.yaml")).stdout

    def ensure_namespace(self, name: str) -> None:
        """The namespace exists; one that does is left as it is. Not a server-side apply: on a
        namespace that `kubectl apply -f helm-values/user-namespace.yaml` labelled, kubectl
        moves the client-side apply's fields to the server-side applier (whatever its field
        manager) and the apply, which names no labels, then removes the Pod Security labels
        (seen on the real API server: enforce: restricted gone)."""
        r = self.session.get(self.url + self.path("namespaces", None, name), timeout=15)
        if r.status_code == 200:
            return
        r = self.session.post(
            self.url + self.path("namespaces"),
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            timeout=15,
        )
        if r.status_code not in (201, 409):
            raise RuntimeError(f"create namespace {name}: {r.status_code} {r.text}")

    def reset(self, namespace: str) -> None:
        """No pods, Workloads or Kueue queue objects left (finalizers removed as Kueue would)."""
        for pod in self.list("pods", namespace):
            self.delete("pods", namespace, pod["metadata"]["name"], grace=0)
        deadline = time.time() + 60
        while self.list("pods", namespace) and time.time() < deadline:
            for pod in self.list("pods", namespace):  # Kueue removes its finalizer; help if it is slow
                if pod["metadata"].get("deletionTimestamp") and time.time() > deadline - 45:
                    self.patch("pods", namespace, pod["metadata"]["name"], {"metadata": {"finalizers": None}})
            time.sleep(0.5)
        for kind in ("workloads", "localqueues"):
            for obj in self.list(kind, namespace):
                self.delete(kind, namespace, obj["metadata"]["name"])
        for kind in ("clusterqueues", "resourceflavors", "workloadpriorityclasses"):
            for obj in self.list(kind):
                self.delete(kind, None, obj["metadata"]["name"])
        deadline = time.time() + 60
        while time.time() < deadline and any(self.list(k) for k in ("clusterqueues", "resourceflavors")):
            time.sleep(0.5)

    def events_for(self, namespace: str, name: str) -> list[dict]:
        return self.list("events", namespace, fieldSelector=f"involvedObject.name={name}")


def restricted(spec: dict) -> dict:
    """A pod spec a test creates in the users' namespace, made to meet Pod Security
    ``restricted`` as gpuhub's own user pods do (issue 40: helm-values/user-namespace.yaml
    enforces it): every container gets values.yaml's ``KubeSpawner.container_security_context``
    plus what KubeSpawner adds (``allowPrivilegeEscalation: false``, z2jh's ``singleuser.uid``
    1000). Returns ``spec``, changed in place."""
    values = yaml.safe_load((REPO / "helm-values" / "values.yaml").read_text())
    ctx = values["hub"]["config"]["KubeSpawner"]["container_security_context"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        c["securityContext"] = {**json.loads(json.dumps(ctx)), "allowPrivilegeEscalation": False, "runAsUser": 1000}
    return spec


def until(predicate, timeout: float, what: str):
    """``predicate()``'s first truthy value within ``timeout`` seconds, or a TimeoutError naming
    ``what`` was awaited."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not reached in {timeout}s")


class StandInProvisioner(threading.Thread):
    """What a storage provisioner (a CSI driver's external-provisioner) does, for one
    StorageClass it creates (``gpuhub.test/stand-in``, binding Immediate): for each claim of
    that class still Pending, a PersistentVolume of the claim's size and access modes,
    pre-bound to it (``claimRef``); the real PersistentVolume controller then binds the pair.
    The volumes are hostPath stand-ins nothing mounts (kwok runs no kubelet); ``stop()``
    removes them and the StorageClass."""

    PROVISIONER = "gpuhub.test/stand-in"

    def __init__(self, cluster: RealCluster, storage_class: str):
        super().__init__(daemon=True, name=f"stand-in-provisioner {storage_class}")
        self.cluster, self.storage_class = cluster, storage_class
        self.made: list[str] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def begin(self) -> "StandInProvisioner":
        self.cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump(
                {
                    "apiVersion": "storage.k8s.io/v1",
                    "kind": "StorageClass",
                    "metadata": {"name": self.storage_class},
                    "provisioner": self.PROVISIONER,
                    "volumeBindingMode": "Immediate",
                    "reclaimPolicy": "Retain",
                }
            ),
        )
        self.start()
        return self

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                claims = self.cluster.get("/api/v1/persistentvolumeclaims")["items"]
                for c in claims:
                    if (
                        c["spec"].get("storageClassName") == self.storage_class
                        and (c.get("status") or {}).get("phase") == "Pending"
                    ):
                        self._provision(c)
            except Exception as e:  # surfaced by stop()
                self.errors.append(repr(e))
            self._halt.wait(0.3)

    def _provision(self, claim: dict) -> None:
        meta = claim["metadata"]
        name = f"standin-{meta['uid']}"
        if name in self.made:
            return
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {"pv.kubernetes.io/provisioned-by": self.PROVISIONER}},
            "spec": {
                "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
                "accessModes": claim["spec"]["accessModes"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": self.storage_class,
                "claimRef": {
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
                "hostPath": {"path": f"/tmp/gpuhub-standin-volumes/{name}"},
            },
        }
        r = self.cluster.session.post(self.cluster.url + "/api/v1/persistentvolumes", json=pv, timeout=15)
        if r.status_code >= 400:
            self.errors.append(f"PV for {meta['namespace']}/{meta['name']}: {r.status_code} {r.text[:300]}")
            return
        self.made.append(name)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        for name in self.made:
            self.cluster.session.delete(self.cluster.url + f"/api/v1/persistentvolumes/{name}", timeout=15)
        self.cluster.kubectl("delete", "storageclass", self.storage_class, "--ignore-not-found", check=False)
        assert self.errors == [], self.errors


HUB_NAMESPACE, HUB_SERVICE_ACCOUNT = "gpuhub", "hub"
HUB_USER = f"system:serviceaccount:{HUB_NAMESPACE}:{HUB_SERVICE_ACCOUNT}"
AUDIT_LOG = DIR / "logs" / "audit.log"


def install_hub_identity(cluster: RealCluster, policy_file: Path, workdir: Path, hours: int = 3) -> Path:
    """The hub's identity and rights exactly as docs/install-kubernetes.md gives them, and a
    kubeconfig that speaks as it (issue 40: a hub run as administrator hides missing RBAC).

    The chart's ServiceAccount ``hub`` in ``gpuhub`` (z2jh renders a plain ServiceAccount of
    that name; the chart itself is installed only by test_install_guide.py), then section 2's
    rights as written: ``kubectl apply -f helm-values/user-namespace.yaml`` (the Role and
    RoleBinding in the users' namespace), ``gpuhub render capacity-rbac`` for ``policy_file``
    and ``gpuhub render policy-rbac``, applied. The token comes from the TokenRequest API
    (``POST .../serviceaccounts/hub/token``), bound to the ServiceAccount, ``hours`` long.
    Returns the kubeconfig's path: the API server, its CA and that token, nothing else."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster.ensure_namespace(HUB_NAMESPACE)
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": HUB_SERVICE_ACCOUNT, "namespace": HUB_NAMESPACE}}
        ),
    )
    cluster.kubectl("apply", "-f", str(REPO / "helm-values" / "user-namespace.yaml"))
    sa = f"{HUB_NAMESPACE}:{HUB_SERVICE_ACCOUNT}"
    for what in (["capacity-rbac", str(policy_file)], ["policy-rbac"]):
        rendered = subprocess.run(
            [str(VENV_BIN / "gpuhub"), "render", *what, "--service-account", sa], capture_output=True, text=True, check=True
        ).stdout
        cluster.kubectl("apply", "-f", "-", input=rendered)
    r = cluster.session.post(
        cluster.url + f"/api/v1/namespaces/{HUB_NAMESPACE}/serviceaccounts/{HUB_SERVICE_ACCOUNT}/token",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": hours * 3600}},
        timeout=15,
    )
    if r.status_code >= 400:
        raise RuntimeError(f"TokenRequest for {HUB_USER}: {r.status_code} {r.text}")
    token = r.json()["status"]["token"]
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    kc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "hub", "user": {"token": token}}],
        "contexts": [{"name": "hub", "context": {"cluster": admin["clusters"][0]["name"], "user": "hub"}}],
        "current-context": "hub",
    }
    path = workdir / "hub.kubeconfig"
    path.write_text(yaml.safe_dump(kc))
    path.chmod(0o600)
    who = subprocess.run(
        [kubectl_path(), "--kubeconfig", str(path), "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert who.stdout.strip() == HUB_USER, (who.stdout, who.stderr)
    return path


def audit_mark() -> int:
    """Where the API server's audit log ends now (``hub_requests(since=...)``)."""
    return AUDIT_LOG.stat().st_size if AUDIT_LOG.exists() else 0


def hub_requests(since: int = 0) -> list[dict]:
    """Every request the API server saw from the hub's service account after ``since`` (its
    audit log: up.sh's policy records that user's requests at the Metadata level), as
    ``{verb, group, resource, namespace, name, code}``, one per request (its last stage)."""
    if not AUDIT_LOG.exists():
        raise AssertionError(
            f"no audit log at {AUDIT_LOG}: the control plane was started by an up.sh without "
            "the audit policy (tests/cluster/down.sh; up.sh)"
        )
    by_id: dict[str, dict] = {}
    with AUDIT_LOG.open("rb") as f:
        f.seek(since)
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line being written
            if ev.get("user", {}).get("username") != HUB_USER:
                continue
            ref = ev.get("objectRef") or {}
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            by_id[ev["auditID"]] = {
                "verb": ev["verb"],
                "group": ref.get("apiGroup", ""),
                "resource": resource,
                "namespace": ref.get("namespace", ""),
                "name": ref.get("name", ""),
                "code": (ev.get("responseStatus") or {}).get("code"),
                "uri": ev.get("requestURI", ""),
            }
    return list(by_id.values())


def guide_block(starts: str) -> str:
    """The ```sh block of docs/install-kubernetes.md that begins with ``starts`` (run as written)."""
    guide = (REPO / "docs" / "install-kubernetes.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", guide, re.S):
        if block.startswith(starts):
            return block
    raise AssertionError(f"no sh block starting {starts!r} in install-kubernetes.md")


def kueue_module() -> Path:
    return CACHE / "gopath" / "pkg" / "mod" / f"sigs.k8s.io/kueue@{versions()['KUEUE_VERSION']}"


def release_manifests_available() -> bool:
    return (kueue_module() / "config" / "components" / "manager" / "controller_manager_config.yaml").exists()


def release_manifests_default_config() -> str:
    """The ``controller_manager_config.yaml`` of Kueue's release ConfigMap (from its module)."""
    return (kueue_module() / "config" / "components" / "manager" / "controller_manager_config.yaml").read_text()


def kueue_metrics_url() -> str:
    """Kueue's metrics endpoint as up.sh binds it (HTTPS, its metrics certificate)."""
    base = int(os.environ.get("GPUHUB_CLUSTER_PORT_BASE", "32300"))
    return f"https://127.0.0.1:{base + 85}/metrics"


def release_manifests() -> str:
    """What Kueue's release ``manifests.yaml`` holds, as this control plane installs it: the
    objects ``up.sh`` applied (``kueue-install.yaml``: CRDs, namespace, webhooks, visibility
    API, from the Kueue module by ``kueue_manifests.py``) and the release's ConfigMap
    ``kueue-manager-config`` with the module's default ``controller_manager_config.yaml`` and
    the labels of ``config/default`` (no Deployment or RBAC: Kueue runs as a process here)."""
    default = release_manifests_default_config()
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "kueue-manager-config",
            "namespace": "kueue-system",
            "labels": {"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"},
        },
        "data": {"controller_manager_config.yaml": default},
    }
    return (DIR / "kueue-install.yaml").read_text().rstrip("\n") + "\n---\n" + yaml.safe_dump(cm, sort_keys=False)


def ensure_up() -> tuple[RealCluster, bool]:
    """The running control plane, started with up.sh when it is not (returns whether it was)."""
    if KUBECONFIG.exists():
        cluster = RealCluster()
        if cluster.ready():
            return cluster, False
    t0 = time.time()
    subprocess.run(["bash", str(HERE / "up.sh")], check=True, timeout=900)
    print(f"\n[measure] tests/cluster/up.sh: {time.time() - t0:.1f}s")
    return RealCluster(), True


def down() -> None:
    subprocess.run(["bash", str(HERE / "down.sh")], check=False, timeout=120)


# Several pytest processes (./run-tests.sh's xdist workers) may use the one control plane.
# Every real-plane test file resets the users' namespace and the Kueue objects, so a file
# holds PLANE_LOCK (exclusive) while it uses the plane; each process that uses it holds
# USERS_LOCK shared for its whole session, and the last to leave stops a plane a test run
# started (STARTED_BY_TESTS), unless GPUHUB_CLUSTER_KEEP=1.
PLANE_LOCK = Path(f"{DIR}.plane.lock")
USERS_LOCK = Path(f"{DIR}.users.lock")
STARTED_BY_TESTS = Path(f"{DIR}.started-by-tests")


@contextlib.contextmanager
def plane_lock():
    """The control plane for this caller alone (other test processes wait here)."""
    with PLANE_LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_users_file = None


@contextlib.contextmanager
def plane_user():
    """This process uses the control plane (a shared lock, released by ``down_if_last_user``)."""
    global _users_file
    _users_file = USERS_LOCK.open("a")
    fcntl.flock(_users_file, fcntl.LOCK_SH)
    yield


def ensure_up_for_tests() -> RealCluster:
    cluster, started = ensure_up()
    if started:
        STARTED_BY_TESTS.write_text(str(os.getpid()))
    return cluster


def down_if_last_user() -> None:
    """Stop the plane when no other test process uses it, if a test run started it."""
    global _users_file
    f, _users_file = _users_file, None
    if f is None:
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # from shared: only if no one else holds it
    except BlockingIOError:
        f.close()
        return
    try:
        if STARTED_BY_TESTS.exists() and not os.environ.get("GPUHUB_CLUSTER_KEEP"):
            with plane_lock():
                down()
            STARTED_BY_TESTS.unlink(missing_ok=True)
    finally:
        f.close()


MIG_NODES_FILE = HERE / "nodes-mig.yaml"


def mig_nodes() -> dict[str, dict]:
    """The MIG kwok nodes of ``nodes-mig.yaml`` by strategy (``nvidia.com/mig.strategy``)."""
    return {n["metadata"]["labels"]["nvidia.com/mig.strategy"]: n for n in yaml.safe_load_all(MIG_NODES_FILE.read_text())}


def add_mig_nodes(cluster: RealCluster, timeout: int = 90) -> list[str]:
    """Put in the kwok nodes advertising MIG slices (one per device-plugin strategy) and wait
    until kwok reports them Ready. Not part of ``up.sh``'s node set: only the tests that need
    them add them, and take them out again with ``remove_mig_nodes``."""
    names = [n["metadata"]["name"] for n in mig_nodes().values()]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MIG_NODES_FILE))
    cluster.kubectl("wait", "--for=condition=Ready", *(f"node/{n}" for n in names), f"--timeout={timeout}s")
    return names


def remove_mig_nodes(cluster: RealCluster) -> None:
    names = [n["metadata"]["name"] for n in mig_nodes().values()]
    cluster.kubectl("delete", "node", *names, "--ignore-not-found", check=False)


TAS_NODES_FILE = HERE / "nodes-tas.yaml"


def add_tas_nodes(cluster: RealCluster, timeout: int = 90) -> list[str]:
    """Put in the kwok nodes labelled with a rack topology (``nodes-tas.yaml``) and wait until
    kwok reports them Ready; ``remove_tas_nodes`` takes them out again."""
    names = [n["metadata"]["name"] for n in yaml.safe_load_all(TAS_NODES_FILE.read_text())]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(TAS_NODES_FILE))
    cluster.kubectl("wait", "--for=condition=Ready", *(f"node/{n}" for n in names), f"--timeout={timeout}s")
    return names


def remove_tas_nodes(cluster: RealCluster) -> None:
    names = [n["metadata"]["name"] for n in yaml.safe_load_all(TAS_NODES_FILE.read_text())]
    cluster.kubectl("delete", "node", *names, "--ignore-not-found", check=False)


def kueue_pid() -> int | None:
    f = DIR / "run" / "kueue.pid"
    return int(f.read_text()) if f.exists() and f.read_text().strip() else None


def kueue_running() -> bool:
    pid = kueue_pid()
    try:
        return pid is not None and os.kill(pid, 0) is None
    except ProcessLookupError:
        return False


def stop_kueue() -> None:
    """A Kueue outage: its controller, webhooks and visibility API stop answering."""
    pid = kueue_pid()
    assert pid, "up.sh recorded no Kueue pid"
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 30
    while time.time() < deadline and kueue_running():
        time.sleep(0.2)
    if kueue_running():
        os.kill(pid, signal.SIGKILL)


def start_kueue() -> None:
    """Kueue back (up.sh starts what is not running, from the cache)."""
    if not kueue_running():
        subprocess.run(["bash", str(HERE / "up.sh")], check=True, timeout=600)


class StandInKubelet(threading.Thread):
    """Runs what kwok only pretends to: each Running pod's container, as a local process at the
    pod's IP. ``node_env`` is the "image" (PATH, Jupyter config)."""

    def __init__(self, cluster: RealCluster, namespace: str, workdir: Path, node_env: dict[str, str]):
        super().__init__(daemon=True, name="stand-in-kubelet")
        self.cluster, self.namespace, self.workdir, self.node_env = cluster, namespace, Path(workdir), node_env
        self.processes: dict[str, subprocess.Popen] = {}
        self.errors: list[str] = []
        self.started_at: dict[str, float] = {}
        self.exited: dict[str, int] = {}  # pod UID -> exit code, for pods that do not restart
        self.logs_objects: set[tuple[str, str]] = set()  # kwok Logs objects made, removed by stop()
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as e:  # surfaced through .errors
                self.errors.append(repr(e))
            self._stop.wait(0.3)

    def stop(self) -> None:
        self._stop.set()
        for key in list(self.processes):
            self._kill(key)
        for ns, name in self.logs_objects:
            self.cluster.session.delete(f"{self.cluster.url}/apis/kwok.x-k8s.io/v1alpha1/namespaces/{ns}/logs/{name}", timeout=15)

    def _kill(self, key: str) -> None:
        proc = self.processes.pop(key, None)
        if proc and proc.poll() is None:
            try:
                os.killpg(proc.pid, 15)
                proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass

    def _sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.cluster.list("pods", self.namespace)}
        for uid in list(self.processes):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                self._kill(uid)
            elif self.processes[uid].poll() is not None and pod["spec"].get("restartPolicy", "Always") != "Always":
                proc = self.processes.pop(uid)
                proc.copier.join(5)  # its last lines in the log before the pod ends  # type: ignore[attr-defined]
                self._report_exit(pod, proc.returncode)
        for uid, pod in pods.items():
            status = pod.get("status") or {}
            if (
                uid in self.processes
                or uid in self.exited
                or pod["metadata"].get("deletionTimestamp")
                or status.get("phase") != "Running"
                or not status.get("podIP")
            ):
                continue
            self._start(pod)

    def _report_exit(self, pod: dict, code: int) -> None:
        """What a kubelet reports when the container of a pod that does not restart (a Job's)
        exits: the pod Succeeded or Failed with the exit code. kwok's own ``pod-complete``
        stage, which marks every Job pod Succeeded as soon as it runs, is left out by up.sh."""
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        container = pod["spec"]["containers"][0]
        started = datetime.fromtimestamp(self.started_at.get(pod["metadata"]["name"], time.time()), timezone.utc)
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "finishedAt": now,
        }
        body = {
            "status": {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": [
                    {"type": t, "status": "False", "lastTransitionTime": now, "reason": "PodCompleted"}
                    for t in ("Ready", "ContainersReady")
                ],
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "started": False,
                        "state": {"terminated": terminated},
                    }
                ],
            }
        }
        self.exited[pod["metadata"]["uid"]] = code
        r = self.cluster.session.patch(
            self.cluster.url + self.cluster.path("pods", pod["metadata"]["namespace"], pod["metadata"]["name"]) + "/status",
            data=json.dumps(body),
            headers={"Content-Type": "application/strategic-merge-patch+json"},
            timeout=15,
        )
        if r.status_code not in (200, 404):
            self.errors.append(f"status of {pod['metadata']['name']}: {r.status_code} {r.text[:300]}")

    def log_of(self, pod_name: str) -> str:
        """What the pod's container wrote (also served by kwok as its log while the pod exists)."""
        f = self.workdir / pod_name / "container.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def _env(self, pod: dict, container: dict) -> dict[str, str]:
        env = dict(self.node_env)
        for item in container.get("env") or []:
            src = item.get("valueFrom") or {}
            if src.get("fieldRef"):
                path = src["fieldRef"]["fieldPath"]
                m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
                env[item["name"]] = (
                    (pod["metadata"].get(m.group(1)) or {}).get(m.group(2), "")  # an Indexed Job's completion index
                    if m
                    else {
                        "metadata.name": pod["metadata"]["name"],
                        "metadata.namespace": pod["metadata"]["namespace"],
                        "status.podIP": pod["status"]["podIP"],
                    }.get(path, "")
                )
            elif src.get("secretKeyRef"):
                ref = src["secretKeyRef"]
                import base64

                secret = self.cluster.get(self.cluster.path("secrets", pod["metadata"]["namespace"], ref["name"]))
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            else:
                env[item["name"]] = re.sub(
                    r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), item.get("value", "")
                )
        return env

    def _start(self, pod: dict) -> None:
        container = pod["spec"]["containers"][0]
        ip = pod["status"]["podIP"]
        env = self._env(pod, container)
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if "JUPYTERHUB_SERVICE_URL" in env:  # bind where the hub will look: the pod's own IP
            env["JUPYTERHUB_SERVICE_URL"] = re.sub(r"^(https?://)[^:/]+", rf"\g<1>{ip}", env["JUPYTERHUB_SERVICE_URL"])
        home = self.workdir / pod["metadata"]["name"]
        home.mkdir(parents=True, exist_ok=True)
        env.setdefault("HOME", str(home))
        proc = subprocess.Popen(
            argv, env=env, cwd=str(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        proc.copier = threading.Thread(target=self._copy_output, args=(proc, home), daemon=True)  # type: ignore[attr-defined]
        proc.copier.start()  # type: ignore[attr-defined]
        self.processes[pod["metadata"]["uid"]] = proc
        self.started_at[pod["metadata"]["name"]] = time.time()
        self._serve_log(pod, container["name"], home / "container.cri.log")

    @staticmethod
    def _copy_output(proc: subprocess.Popen, home: Path) -> None:
        """The container's output as written (``container.log``) and as a container runtime
        writes it for the kubelet (CRI format, ``container.cri.log``: what kwok serves)."""
        from datetime import datetime, timezone

        with open(home / "container.log", "ab") as plain, open(home / "container.cri.log", "ab") as cri:
            for line in iter(proc.stdout.readline, b""):
                plain.write(line)
                plain.flush()
                stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f") + "000Z"
                cri.write(stamp.encode() + b" stdout F " + line.rstrip(b"\n") + b"\n")
                cri.flush()

    def _serve_log(self, pod: dict, container: str, path: Path) -> None:
        """A kwok ``Logs`` object naming the process's output: kwok's kubelet port then serves it
        as the container's log (``kubectl logs``, the pods/log subresource)."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        url = f"{self.cluster.url}/apis/kwok.x-k8s.io/v1alpha1/namespaces/{ns}/logs"
        self.cluster.session.delete(f"{url}/{name}", timeout=15)  # a pod of the same name before
        r = self.cluster.session.post(
            url,
            json={
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "Logs",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"logs": [{"containers": [container], "logsFile": str(path), "follow": True}]},
            },
            timeout=15,
        )
        if r.status_code >= 400:
            self.errors.append(f"kwok Logs for {name}: {r.status_code} {r.text[:300]}")
        self.logs_objects.add((ns, name))
