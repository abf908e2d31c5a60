"""The hub's queue scenario on the API double and on a real control plane, from the same code.

Opt-in (``GPUHUB_CLUSTER=1``; skipped with the reason otherwise, so ``./run-tests.sh`` is
neither failed nor slowed where the binaries are not cached). The real side is
``tests/cluster/up.sh``: etcd, kube-apiserver / controller-manager / scheduler 1.36, kwok
nodes and the real Kueue v0.19.2 controller with its webhooks and visibility API.

Real there: the API server (admission, validation, server-side apply, watches, RBAC is
bypassed by the admin user), Kueue's webhooks, controller, scheduler, conditions, events and
visibility API, kube-scheduler binding to a kwok GPU node through the flavor's node labels
and toleration, a real JupyterHub with KueueSpawner, and a real ``jupyterhub-singleuser``
reached at the pod's IP. Standing in: kwok for the kubelet (it marks pods Running/Ready at
once and assigns pod IPs from a loopback podCIDR) and ``StandInKubelet`` for the container
runtime (the container's command and env run as a local process bound to the pod IP).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402  (tests/cluster/harness.py)

from double.harness import KUBECONFIG as DOUBLE_KUBECONFIG, NAMESPACE, apply_policy  # noqa: E402
from support.hub import Hub  # noqa: E402

SKIP = real.skip_reason()
pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

POLICY = """\
apiVersion: gpuhub/v1
flavors:
  - name: l4
    displayName: L4 24GB
    resource: nvidia.com/gpu
    nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}
    tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
    local: {virtual: 2}
priorityClasses:
  - {name: interactive, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    quota: {cpu: 8, memory: 16Gi, gpus: {l4: {nominal: 2}}}
    perUser: {maxServers: 1, maxGPUs: 1}
profiles:
  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
"""

COMMON_CONFIG = f"""
c.JupyterHub.spawner_class = "gpuhub-kube"
c.KubeSpawner.namespace = {NAMESPACE!r}
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]
c.KubeSpawner.args = []
c.KubeSpawner.delete_grace_period = 1
c.KubeSpawner.k8s_api_request_timeout = 10
c.KubeSpawner.poll_interval = 1
c.KueueSpawner.status_interval = 0.2
c.KueueSpawner.queue_poll_interval = 0.5
c.JupyterHub.init_spawners_timeout = 1
c.KueueLedger.sync_interval = 0.5

from gpuhub_spawner.wiring.kube import configure_ledger

configure_ledger(c)
"""

# The double's pods share this machine's network (pod IP 127.0.0.1): one port per pod.
DOUBLE_CONFIG = """
import socket as _socket

c.KubeSpawner.ip = "127.0.0.1"


def _own_port(spawner):
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spawner.port = s.getsockname()[1]


c.KubeSpawner.pre_spawn_hook = _own_port
"""

RAW = ("couldn't assign", "pod set", "nodes are available", "insufficient unused quota", "flavor l4")
WAIT = 120


def until(predicate, timeout: float = WAIT, what: str = "condition", hub: Hub | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached in {timeout}s" + (f"\n{hub.tail(80)}" if hub else ""))


class DoubleBackend:
    name = "double"

    def __init__(self, double):
        self.double = double
        self.kubeconfig = DOUBLE_KUBECONFIG
        self.hub_config = COMMON_CONFIG + DOUBLE_CONFIG

    def setup(self, workdir: Path) -> None:
        apply_policy(self.double, POLICY)

    def pods(self, user: str | None = None) -> list[dict]:
        return [p for p in self.double.list("pods", NAMESPACE)
                if user is None or p["metadata"]["labels"].get("hub.jupyter.org/username") == user]

    def workloads(self) -> list[dict]:
        return self.double.list("workloads", NAMESPACE)

    def events(self, pod_name: str) -> list[dict]:
        return [e for e in self.double.list("events", NAMESPACE) if e["involvedObject"]["name"] == pod_name]

    def kueue(self, up: bool) -> None:
        self.double.set_kueue(up)  # its controller and its failurePolicy: Fail pod webhook

    def teardown(self) -> None:
        self.double.reset()


class RealBackend:
    name = "real"

    def __init__(self):
        self.cluster, self.started = real.ensure_up()
        self.kubeconfig = self.cluster.kubeconfig
        self.hub_config = COMMON_CONFIG
        self.kubelet = None

    def setup(self, workdir: Path) -> None:
        for ns in (NAMESPACE, "gpuhub"):
            self.cluster.ensure_namespace(ns)
        self.cluster.reset(NAMESPACE)
        # docs/install-kubernetes.md step 1, run as written: keep Kueue's webhooks away from
        # the hub's namespace (idempotent here: only when "gpuhub" is not excluded yet), with
        # this checkout's `gpuhub` on PATH as the guide's CLI step installs it.
        hooks = self.cluster.kubectl("get", "validatingwebhookconfiguration", "kueue-validating-webhook-configuration",
                                     "-o", "json").stdout
        if '"gpuhub"' not in hooks:
            out = subprocess.run(["bash", "-c", real.guide_block("for kind in mutating validating")], capture_output=True,
                                 text=True, timeout=120, env=dict(os.environ, KUBECONFIG=str(self.kubeconfig),
                                                                  PATH=f"{real.VENV_BIN}:{os.environ['PATH']}"))
            print(f"\n[real] install guide webhook exclusion:\n{out.stdout}{out.stderr}")
            assert out.returncode == 0, out.stderr
        out = self.cluster.apply_policy(POLICY, NAMESPACE, workdir / "policy")
        print("\n[real] kubectl apply --server-side of `gpuhub render kueue`:\n" + out)
        config_dir = workdir / "image-jupyter-config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"allow_root": True}}))
        node_env = {"PATH": f"{real.VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
                    "LANG": "C.UTF-8", "JUPYTER_CONFIG_DIR": str(config_dir)}
        self.kubelet = real.StandInKubelet(self.cluster, NAMESPACE, workdir / "pods", node_env)
        self.kubelet.start()

    def pods(self, user: str | None = None) -> list[dict]:
        return [p for p in self.cluster.list("pods", NAMESPACE)
                if user is None or p["metadata"]["labels"].get("hub.jupyter.org/username") == user]

    def workloads(self) -> list[dict]:
        return self.cluster.list("workloads", NAMESPACE)

    def events(self, pod_name: str) -> list[dict]:
        return self.cluster.events_for(NAMESPACE, pod_name)

    def kueue(self, up: bool) -> None:
        real.start_kueue() if up else real.stop_kueue()

    def teardown(self) -> None:
        if not real.kueue_running():  # a failed outage test left it stopped
            real.start_kueue()
        if self.kubelet:
            self.kubelet.stop()
        self.cluster.reset(NAMESPACE)
        if self.started and not real.os.environ.get("GPUHUB_CLUSTER_KEEP"):
            real.down()


@pytest.fixture(scope="module", params=["double", "real"])
def backend(request, tmp_path_factory):
    b = DoubleBackend(request.getfixturevalue("double")) if request.param == "double" else RealBackend()
    b.setup(tmp_path_factory.mktemp(f"backend-{b.name}"))
    yield b
    b.teardown()


@pytest.fixture(scope="module")
def hub(backend, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"hub-{backend.name}")
    h = Hub(work, POLICY, extra_config=backend.hub_config, env={"KUBECONFIG": str(backend.kubeconfig)})
    try:
        h.start()
        yield h
    finally:
        h.stop()


def reach(client) -> requests.Response:
    s = client.server()
    assert s and s.get("ready"), s
    return requests.get(client.hub.server_url(s["url"]) + "api/status",
                        headers={"Authorization": f"token {client.token}"}, timeout=10)


def latest_message(client, needle: str, timeout: float = WAIT) -> str:
    """The newest progress message containing ``needle`` (the stream ends at the first match)."""
    events = client.progress(until=lambda e: needle in e.get("message", ""), timeout=timeout)
    return events[-1]["message"]


def test_two_servers_on_a_gpu_node_a_third_waits_a_stop_admits_it(backend, hub):
    """Done-when of issue 22: two users of a team spawn onto a GPU node, a third (and a
    fourth, for N3) wait with the hub's explanation built from what Kueue left on their
    Workloads, and a stop admits the first waiter."""
    t0 = time.time()
    timeline: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        timeline.append((time.time() - t0, what))

    alice, bob, dave, lena = (hub.login(u) for u in ("alice", "bob", "dave", "lena"))
    for user in (alice, bob):
        r = user.start("l4-1", team="vision") if user is dave else user.start("l4-1")
        assert r.status_code in (201, 202), r.text
        mark(f"{user.name} asked for l4-1")
    for user in (alice, bob):
        user.wait_ready(timeout=WAIT)
        mark(f"{user.name} ready")
        assert reach(user).status_code == 200
    nodes = {u: backend.pods(u)[0]["spec"].get("nodeName") for u in ("alice", "bob")}
    mark(f"nodes: {nodes}")
    if backend.name == "real":
        assert set(nodes.values()) == {"kwok-gpu-l4-1"}, nodes  # kube-scheduler, flavor nodeLabels + toleration
        pod = backend.pods("alice")[0]
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
        assert "kueue.x-k8s.io/managed" in pod["metadata"]["finalizers"]

    dave.start_background("l4-1", team="vision")
    until(lambda: backend.pods("dave"), what="dave's gated pod", hub=hub)
    mark("dave asked for l4-1 (team full)")
    dave_msg = latest_message(dave, "in the Vision Lab queue")
    mark(f"dave's spawn page: {dave_msg!r}")
    lena.start_background("l4-1")
    until(lambda: backend.pods("lena"), what="lena's gated pod", hub=hub)
    mark("lena asked for l4-1 (team full)")
    lena_msg = latest_message(lena, "2nd of 2")
    mark(f"lena's spawn page: {lena_msg!r}")
    time.sleep(3)  # a few Kueue scheduling cycles
    quota_reserved = {}
    for wl in backend.workloads():
        owner = wl["metadata"]["ownerReferences"][0]["name"]
        qr = next((c for c in wl.get("status", {}).get("conditions", []) if c["type"] == "QuotaReserved"), None)
        quota_reserved[owner] = qr
        mark(f"Workload of {owner}: QuotaReserved={qr and qr['status']} reason={qr and qr.get('reason')} "
             f"message={qr and qr.get('message')!r}")
    # What the hub's explanation for dave is built from: Kueue's own condition on his Workload.
    assert "insufficient unused quota for nvidia.com/gpu in flavor l4" in quota_reserved["jupyter-dave"]["message"]

    assert "You are 1st of 2 in the Vision Lab queue." in dave_msg or "You are 1st of 1 in the Vision Lab queue." in dave_msg, dave_msg
    assert ("Your server needs 1 L4 24GB GPU: your team Vision Lab is using 2 of the 2 it may hold; it waits "
            "until one of your team's servers or jobs stops.") in dave_msg, dave_msg
    assert "You are 2nd of 2 in the Vision Lab queue." in lena_msg, lena_msg
    for m in (dave_msg, lena_msg):
        assert not any(raw in m for raw in RAW), m

    assert alice.stop().status_code in (202, 204)
    mark("alice stopped her server")
    alice.wait_gone()
    mark("alice's server gone")
    dave.wait_ready(timeout=WAIT)
    mark("dave ready (admitted by Kueue)")
    assert reach(dave).status_code == 200
    assert backend.pods("lena") and (backend.pods("lena")[0]["spec"].get("schedulingGates") or [])
    events = [(e.get("reportingComponent") or e.get("source", {}).get("component"), e["reason"], e["message"])
              for e in backend.events(backend.pods("dave")[0]["metadata"]["name"])]
    mark(f"dave's pod events: {events}")

    for user in (bob, dave, lena):
        user.stop()
    for user in (bob, dave, lena):
        user.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left", hub=hub)
    mark("all stopped")
    print(f"\n[timeline, {backend.name}]")
    for t, what in timeline:
        print(f"  {t:7.2f}s  {what}")


def gated(pod: dict) -> bool:
    return bool(pod["spec"].get("schedulingGates"))


def test_a_hub_restart_keeps_waiting_servers_in_their_place(backend, hub):
    """Every ``helm upgrade`` that changes the hub's config restarts the hub: the waiting pods
    keep their place in Kueue's queue (the same pods, still gated), the restarted hub shows
    them as the pending spawns they are with their place, and a stop admits the first."""
    alice, bob, dave = (hub.login(u) for u in ("alice", "bob", "dave"))
    for user in (alice, bob):
        assert user.start("l4-1").status_code in (201, 202)
    for user in (alice, bob):
        user.wait_ready(timeout=WAIT)
    dave.start_background("l4-1", team="vision")
    until(lambda: backend.pods("dave"), what="dave's gated pod", hub=hub)
    latest_message(dave, "1st of 1")
    before = backend.pods("dave")[0]["metadata"]["uid"]

    hub.stop(kill_servers=False)
    assert [p["metadata"]["uid"] for p in backend.pods("dave")] == [before]  # the hub is gone, the queue is not
    hub.start()
    alice, bob, dave = (hub.login(u) for u in ("alice", "bob", "dave"))
    until(lambda: (dave.server() or {}).get("pending") == "spawn", what="dave's pending spawn", hub=hub)
    assert "You are 1st of 1 in the Vision Lab queue." in latest_message(dave, "1st of 1")
    assert [p["metadata"]["uid"] for p in backend.pods("dave")] == [before] and gated(backend.pods("dave")[0])
    assert reach(alice).status_code == 200  # running servers were re-adopted

    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    dave.wait_ready(timeout=WAIT)  # admitted by Kueue into alice's place, on the pod kept across the restart
    assert reach(dave).status_code == 200
    assert backend.pods("dave")[0]["metadata"]["uid"] == before
    for user in (bob, dave):
        user.stop()
    for user in (bob, dave):
        user.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left", hub=hub)


def test_a_kueue_outage_is_told_at_once_and_running_servers_are_untouched(backend, hub):
    """Kueue's pod webhook fails closed: while it is down no server can be queued, the user
    is told so at once in plain words, running servers keep working, and when Kueue is back
    a start works again."""
    alice, bob = hub.login("alice"), hub.login("bob")
    assert alice.start("cpu").status_code in (201, 202)
    alice.wait_ready(timeout=WAIT)
    backend.kueue(False)
    try:
        r = bob.start("cpu")
        assert r.status_code == 503, r.text
        assert "The queue service (Kueue) is not answering" in r.json()["message"], r.text
        until(lambda: bob.server() is None, what="bob's refused spawn cleared", hub=hub)
        assert backend.pods("bob") == []
        assert reach(alice).status_code == 200  # a running server does not need Kueue
    finally:
        backend.kueue(True)
    assert until(lambda: bob.start("cpu").status_code in (201, 202), what="a start accepted with Kueue back", hub=hub)
    bob.wait_ready(timeout=WAIT)
    for user in (alice, bob):
        assert user.stop().status_code in (202, 204)
        user.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left", hub=hub)
