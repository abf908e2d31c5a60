"""The two control planes a Kubernetes end-to-end test runs against, behind one interface, so
the same test code runs on both (issue 22):

* ``DoubleBackend``: the API double (``tests/kube/double``), our model of the API server,
  Kueue, the Job controller and the kubelet;
* ``RealBackend``: ``tests/cluster/up.sh``'s control plane (etcd, kube-apiserver /
  controller-manager / scheduler 1.36, the real Kueue v0.19.2, kwok nodes), with
  ``StandInKubelet`` running each Running pod's command as a local process at the pod's IP.

Imported by name (``from backends import ...``), never through ``conftest``. A test module
makes its ``backend`` fixture with ``backend_fixture(POLICY)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402  (tests/cluster/harness.py)

from double.harness import KUBECONFIG as DOUBLE_KUBECONFIG, NAMESPACE, apply_policy, shipped_container_security_context  # noqa: E402
from support.ports import pod_port_hook  # noqa: E402

# The flavor every end-to-end policy names: the real plane's kwok L4 nodes, with their label and
# taint (tests/cluster/nodes.yaml); ``virtual`` GPUs stand in for them on one machine.
L4_FLAVOR = """\
apiVersion: gpuhub/v1
flavors:
  - name: l4
    displayName: L4 24GB
    resource: nvidia.com/gpu
    nodeLabels: {{nvidia.com/gpu.product: NVIDIA-L4}}
{tolerations}    local: {{virtual: {virtual}}}
"""
L4_TOLERATIONS = """\
    tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
"""


def l4_policy(rest: str, virtual: int = 2, tolerations: bool = True) -> str:
    """A scenario's policy: the L4 flavor, then its own priorities, teams and profiles.
    ``tolerations=False`` leaves out the toleration of the real plane's L4 taint, as the
    scenarios that run on the double alone were written."""
    return L4_FLAVOR.format(virtual=virtual, tolerations=L4_TOLERATIONS if tolerations else "") + rest


# The smallest scenario: one team with four L4s and a one-GPU profile.
VISION_ON_L4 = l4_policy("""\
priorityClasses:
  - {name: interactive, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    quota: {cpu: 8, memory: 16Gi, gpus: {l4: {nominal: 4}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
""")


SERVER_DEFAULTS = """\
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
"""


def vision_servers_on_l4(virtual: int = 2, gpus: int = 2) -> str:
    """The servers scenario: one team (vision) with ``gpus`` L4s of quota, one server and one GPU
    per user, a CPU profile for everyone and a one-L4 profile."""
    return l4_policy(
        "priorityClasses:\n"
        "  - {name: interactive, value: 1000}\n"
        "teams:\n"
        "  - name: vision\n"
        "    displayName: Vision Lab\n"
        "    groups: [vision-lab]\n"
        "    defaultPriority: interactive\n"
        f"    quota: {{cpu: 8, memory: 16Gi, gpus: {{l4: {{nominal: {gpus}}}}}}}\n"
        "    perUser: {maxServers: 1, maxGPUs: 1}\n"
        "profiles:\n"
        '  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}\n'
        "  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}\n"
        + SERVER_DEFAULTS,
        virtual=virtual,
    )


def vision_jobs_on_l4(
    virtual: int = 2, cpu: int = 8, gpus: int = 2, max_gpus: int = 1, rest: str = "", tolerations: bool = True
) -> str:
    """The jobs scenario: one team (vision) whose servers run at interactive priority and whose
    jobs at batch, with ``gpus`` L4s of quota, a CPU profile for everyone and a one-L4 profile;
    ``rest`` adds the scenario's own sections (defaults, health, ray)."""
    return l4_policy(
        "priorityClasses:\n"
        "  - {name: interactive, value: 1000}\n"
        "  - {name: batch, value: 100}\n"
        "teams:\n"
        "  - {name: vision, displayName: Vision Lab, groups: [vision-lab], defaultPriority: interactive, jobPriority: batch,\n"
        f"     quota: {{cpu: {cpu}, memory: {2 * cpu}Gi, gpus: {{l4: {{nominal: {gpus}}}}}}}, perUser: {{maxGPUs: {max_gpus}}}}}\n"
        "profiles:\n"
        '  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}\n'
        "  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}\n" + rest,
        virtual=virtual,
        tolerations=tolerations,
    )


# What every Kubernetes hub of the end-to-end tests runs with (fast timings for tests).
HUB_CONFIG = f"""
c.JupyterHub.spawner_class = "gpuhub-kube"
c.KubeSpawner.namespace = {NAMESPACE!r}
import os; os.environ.setdefault("POD_NAMESPACE", "gpuhub")  # the hub's namespace, as z2jh's Deployment sets it
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]   # as z2jh's singleuser.cmd; the "image's" PATH has it
c.KubeSpawner.args = []                         # allow_root comes from the "image" config, as in a pod
c.KubeSpawner.delete_grace_period = 1
c.KubeSpawner.k8s_api_request_timeout = 10
c.KubeSpawner.poll_interval = 1                 # production: 30 s; the hub notices a vanished pod sooner here
c.KubeSpawner.container_security_context = {shipped_container_security_context()!r}  # values.yaml's: Pod Security restricted
c.KueueSpawner.status_interval = 0.2
c.KueueSpawner.queue_poll_interval = 0.5
c.JupyterHub.init_spawners_timeout = 1          # as helm-values/values.yaml
c.KueueLedger.sync_interval = 0.5               # production: 2 s

from gpuhub_spawner.wiring.kube import configure_ledger   # as hub.extraConfig gpuhub-usage does

configure_ledger(c)
"""

# The double's pods share this machine's network (pod IP 127.0.0.1): one port per pod. On the
# real plane each pod has its own loopback IP from its kwok node's podCIDR, and port 8888.
DOUBLE_ONLY_CONFIG = (
    pod_port_hook()
    + """
c.KubeSpawner.ip = "127.0.0.1"
c.KubeSpawner.pre_spawn_hook = _own_port
"""
)

BACKENDS = ["double", "real"]


def owner_job(pod: dict) -> str | None:
    return next((o["name"] for o in pod["metadata"].get("ownerReferences") or [] if o.get("kind") == "Job"), None)


class DoubleBackend:
    name = "double"

    def __init__(self, double):
        self.double = double
        self.kubeconfig = DOUBLE_KUBECONFIG

    def hub_config(self, extra: str = "") -> str:
        return HUB_CONFIG + DOUBLE_ONLY_CONFIG + extra

    def hub_calls(self) -> None:
        return None  # the double models no RBAC (docs/kubernetes-testing.md)

    def network_policies(self) -> list[dict]:
        return self.double.list("networkpolicies", NAMESPACE)

    def services(self) -> list[dict]:
        return self.double.list("services", NAMESPACE)

    def setup(self, policy: str, workdir: Path) -> None:
        apply_policy(self.double, policy)

    def pods(self, user: str | None = None) -> list[dict]:
        return [
            p
            for p in self.double.list("pods", NAMESPACE)
            if user is None or p["metadata"]["labels"].get("hub.jupyter.org/username") == user
        ]

    def workloads(self) -> list[dict]:
        return self.double.list("workloads", NAMESPACE)

    def jobs(self) -> list[dict]:
        return self.double.list("jobs", NAMESPACE)

    def job(self, name: str) -> dict | None:
        return self.double.get("jobs", NAMESPACE, name)

    def pods_of_job(self, name: str) -> list[dict]:
        return self.double.pods_of_job(NAMESPACE, name)

    def events(self, pod_name: str) -> list[dict]:
        return [e for e in self.double.list("events", NAMESPACE) if e["involvedObject"]["name"] == pod_name]

    def kueue(self, up: bool) -> None:
        self.double.set_kueue(up)  # its controller and its failurePolicy: Fail pod webhook

    def healthy(self) -> None:
        """What the double saw that a real API server would have refused, or failed on."""
        assert self.double.invalid == [] and self.double.errors == [], (self.double.invalid, self.double.errors)

    def teardown(self) -> None:
        self.double.reset()


class RealBackend:
    name = "real"

    def __init__(self, cluster: real.RealCluster):
        self.cluster = cluster
        # The hub's kubeconfig: its own service account's token (set up in ``setup``), never
        # the administrator's. The test itself (and the stand-in kubelet) speaks as admin.
        self.kubeconfig: Path | None = None
        self.kubelet: real.StandInKubelet | None = None
        self.audit_since = 0

    def hub_config(self, extra: str = "") -> str:
        return HUB_CONFIG + extra

    def setup(self, policy: str, workdir: Path) -> None:
        for ns in (NAMESPACE, "gpuhub"):
            self.cluster.ensure_namespace(ns)
        self.cluster.reset(NAMESPACE)
        self.cluster.kubectl("-n", NAMESPACE, "delete", "jobs,events", "--all", "--ignore-not-found", check=False)
        # docs/install-kubernetes.md step 1, run as written: keep Kueue's webhooks away from
        # the hub's namespace (idempotent here: only when "gpuhub" is not excluded yet), with
        # this checkout's `gpuhub` on PATH as the guide's CLI step installs it.
        hooks = self.cluster.kubectl(
            "get", "validatingwebhookconfiguration", "kueue-validating-webhook-configuration", "-o", "json"
        ).stdout
        if '"gpuhub"' not in hooks:
            out = subprocess.run(
                ["bash", "-c", real.guide_block("for kind in mutating validating")],
                capture_output=True,
                text=True,
                timeout=120,
                env=dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig), PATH=f"{real.VENV_BIN}:{os.environ['PATH']}"),
            )
            print(f"\n[real] install guide webhook exclusion:\n{out.stdout}{out.stderr}")
            assert out.returncode == 0, out.stderr
        out = self.cluster.apply_policy(policy, NAMESPACE, workdir / "policy")
        print("\n[real] kubectl apply --server-side of `gpuhub render kueue`:\n" + out)
        # The hub speaks as the install guide's service account, bound only by the shipped
        # manifests (issue 40); every request it makes is in the API server's audit log.
        self.kubeconfig = real.install_hub_identity(self.cluster, workdir / "policy" / "profiles.yaml", workdir)
        self.audit_since = real.audit_mark()
        config_dir = workdir / "image-jupyter-config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"allow_root": True}}))
        node_env = {
            "PATH": f"{real.VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONUNBUFFERED": "1",
            "LANG": "C.UTF-8",
            "JUPYTER_CONFIG_DIR": str(config_dir),
        }
        pods_dir = workdir / "pods"
        pods_dir.mkdir(parents=True, exist_ok=True)
        pods_dir.chmod(0o755)
        self.kubelet = real.StandInKubelet(self.cluster, NAMESPACE, pods_dir, node_env)
        self.kubelet.start()

    def pods(self, user: str | None = None) -> list[dict]:
        return [
            p
            for p in self.cluster.list("pods", NAMESPACE)
            if user is None or p["metadata"]["labels"].get("hub.jupyter.org/username") == user
        ]

    def workloads(self) -> list[dict]:
        return self.cluster.list("workloads", NAMESPACE)

    def jobs(self) -> list[dict]:
        return self.cluster.list("jobs", NAMESPACE)

    def job(self, name: str) -> dict | None:
        r = self.cluster.session.get(self.cluster.url + self.cluster.path("jobs", NAMESPACE, name), timeout=15)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def pods_of_job(self, name: str) -> list[dict]:
        return [p for p in self.cluster.list("pods", NAMESPACE) if owner_job(p) == name]

    def events(self, pod_name: str) -> list[dict]:
        return self.cluster.events_for(NAMESPACE, pod_name)

    def kueue(self, up: bool) -> None:
        real.start_kueue() if up else real.stop_kueue()

    def network_policies(self) -> list[dict]:
        return self.cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies")["items"]

    def services(self) -> list[dict]:
        return self.cluster.get(f"/api/v1/namespaces/{NAMESPACE}/services")["items"]

    def hub_calls(self) -> list[dict]:
        """Every request the hub made since ``setup``, as the API server's audit log has it."""
        return real.hub_requests(self.audit_since)

    def check_hub_rights(self) -> list[dict]:
        """The hub's requests so far: none refused by RBAC, each one a right of kube/rights.py."""
        from gpuhub_spawner.kube import rights

        calls = [c for c in self.hub_calls() if c["resource"]]  # not discovery (non-resource URLs)
        scope = {NAMESPACE: rights.USERS, real.HUB_NAMESPACE: rights.HUB, "": rights.CLUSTER}
        refused = [c for c in calls if c["code"] == 403]
        unlisted = [
            c
            for c in calls
            if (scope.get(c["namespace"], c["namespace"]), c["group"], c["resource"], c["verb"]) not in rights.needed()
        ]
        counts: dict[tuple, int] = {}
        for c in calls:
            key = (c["verb"], c["resource"] + (f".{c['group']}" if c["group"] else ""), c["namespace"] or "-", c["code"])
            counts[key] = counts.get(key, 0) + 1
        print(
            f"\n[real] the hub's requests as {real.HUB_USER} (audit log): "
            + ", ".join(f"{v} {r} in {ns} -> {code} x{n}" for (v, r, ns, code), n in sorted(counts.items(), key=str))
        )
        assert refused == [], f"the API server refused the hub (RBAC): {refused}"
        assert unlisted == [], f"the hub made requests kube/rights.py does not list: {unlisted}"
        return calls

    def healthy(self) -> None:
        assert self.kubelet is None or self.kubelet.errors == [], self.kubelet.errors
        self.check_hub_rights()

    def teardown(self) -> None:
        if not real.kueue_running():  # a failed outage test left it stopped
            real.start_kueue()
        if self.kubelet:
            self.kubelet.stop()
        self.cluster.reset(NAMESPACE)
        self.cluster.kubectl("-n", NAMESPACE, "delete", "jobs", "--all", "--ignore-not-found", check=False)
        if self.kubeconfig is not None:  # the whole module's requests: a refusal fails it here
            self.check_hub_rights()


def make_backend(request, policy: str, workdir: Path):
    """The backend ``request.param`` names, set up with ``policy``'s rendered Kueue objects."""
    if request.param == "double":
        b = DoubleBackend(request.getfixturevalue("double"))
    else:
        b = RealBackend(request.getfixturevalue("real_cluster"))
    b.setup(policy, workdir)
    return b


def backend_fixture(policy: str):
    """A module-scoped ``backend`` fixture over both control planes for ``policy``."""

    @pytest.fixture(scope="module", params=BACKENDS)
    def backend(request, tmp_path_factory):
        work = tmp_path_factory.mktemp(f"backend-{request.param}")
        work.chmod(0o755)  # pod processes reach their HOME under it
        b = make_backend(request, policy, work)
        yield b
        b.teardown()

    return backend


def kube_hub_fixture(policy: str, kube_config: str, name: str):
    """A module-scoped ``kube_hub`` fixture: a real JupyterHub with ``KueueSpawner`` on the
    module's ``backend`` (``backend_fixture``, or a module's own), for ``gpuhub job`` tests."""
    from support.hub import Hub

    @pytest.fixture(scope="module")
    def kube_hub(backend, tmp_path_factory):
        hub = Hub(
            tmp_path_factory.mktemp(f"{name}-{backend.name}"),
            policy,
            extra_config=backend.hub_config(kube_config),
            env={"KUBECONFIG": str(backend.kubeconfig)},
        )
        try:
            hub.start()
            yield hub
        finally:
            hub.stop()

    return kube_hub


def job_cli(hub, user, *args, check=True):
    """``gpuhub job ARGS`` against ``hub`` as ``user`` (their token), as a researcher runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env["GPUHUB_TOKEN"] = user.token
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if check:
        assert r.returncode == 0, r.stderr + hub.tail(40)
    return r


def job_record(user, job_id):
    """The job's record as its owner reads it from the hub's API."""
    r = user.api.get(user.url(f"/gpuhub/jobs/{job_id}"))
    r.raise_for_status()
    return r.json()


def condition(obj, ctype):
    """The condition of type ``ctype`` in a Kubernetes object's status, or None."""
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)
