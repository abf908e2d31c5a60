"""GPU-aware culling against a real hub, the real culler service and a fake NVML.

The fake ``pynvml`` (tests/support/fake_nvml) is first on PYTHONPATH for the hub, so
the product code that discovers devices and reads their utilisation is unchanged;
tests set each device's utilisation by rewriting its JSON file.
"""

import json
import time
from pathlib import Path

import pytest
import requests

from support.hub import Hub, wait_for

pytestmark = pytest.mark.integration

FAKE_NVML_DIR = Path(__file__).resolve().parents[1] / "support" / "fake_nvml"

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {match: Fake}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 1}}}
profiles:
  - slug: cpu
    displayName: CPU only
    teams: "*"
    idle: {timeout: 40s, warning: 3s, maxSnoozes: 0}
  - slug: gpu-1
    displayName: One GPU
    gpu: {count: 1, flavor: gpu}
    teams: [vision, nlp]
    idle: {timeout: 1h, gpuIdleTimeout: 10s, warning: 5s, snooze: 10s, maxSnoozes: 1}
defaults:
  idle: {gpuBusyThreshold: 10, maxAge: 7d}
"""


class FakeGpus:
    def __init__(self, path: Path, n: int):
        self.path = path
        self.devices = [
            {"uuid": f"GPU-fake-{i}", "name": "NVIDIA Fake A100", "memory_total": 80 * 2**30, "memory_used": 0, "utilization": 0}
            for i in range(n)
        ]
        self.write()

    def write(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": self.devices}))
        tmp.replace(self.path)

    def set(self, uuid: str, utilization: int):
        next(d for d in self.devices if d["uuid"] == uuid)["utilization"] = utilization
        self.write()


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return FakeGpus(tmp_path_factory.mktemp("nvml") / "nvml.json", 2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus):
    h = Hub(
        tmp_path_factory.mktemp("cull"),
        POLICY,
        env={"PYTHONPATH": str(FAKE_NVML_DIR), "GPUHUB_FAKE_NVML": str(gpus.path), "GPUHUB_CULL_EVERY": "1"},
    )
    h.start()
    yield h
    h.stop()


def device_of(hub, client, user):
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {client.token}"}).json()
    return next(d["id"] for d in snap["devices"] if d["user"] == user)


def warnings(client):
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()["servers"]


def test_idle_gpu_warned_culled_and_handed_on_busy_gpu_survives(hub, gpus):
    alice, bob, carol, dave = (hub.login(n) for n in ("alice", "bob", "carol", "dave"))
    assert {d["id"] for d in requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {alice.token}"}).json()["devices"]} == {"GPU-fake-0", "GPU-fake-1"}
    carol.start("gpu-1")
    carol.wait_ready()
    gpus.set(device_of(hub, carol, "carol"), 90)  # a training run, browser closed
    alice.start("gpu-1")
    alice.wait_ready()
    alice_gpu = device_of(hub, alice, "alice")
    dave.start_background("cpu")
    home_file = hub.data / "home" / "alice" / "results.txt"
    home_file.write_text("keep me")
    queued = bob.start_background("gpu-1")  # bob waits for vision's GPU

    w = wait_for(lambda: warnings(alice).get(""), 20, "a warning for alice")
    assert "GPUs and kernels were idle for 10s" in w["reason"] and w["deadline"] > time.time() - 1
    page = alice.session.get(hub.url + "/hub/home").text
    assert "will be stopped" in page and "Your files are kept" in page
    # what JupyterLab's notification polls: the server's relay, with the server's own token
    relayed = requests.get(hub.url + "/user/alice/gpuhub/culling", headers={"Authorization": f"token {alice.token}"})
    assert relayed.status_code == 200, relayed.text
    assert "GPUs and kernels were idle" in json.dumps(relayed.json())
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {carol.token}"}).json()
    held = next(d for d in snap["devices"] if d["user"] == "alice")
    assert held["idle_for"] and held["stops_at"]  # everyone sees which GPUs sit idle

    wait_for(lambda: alice.server() is None, 30, "alice's idle GPU server to be culled")
    assert home_file.read_text() == "keep me"  # a cull never touches the home directory
    assert queued.result().status_code == 202
    bob.wait_ready(timeout=60)  # the freed GPU went to the next in line
    assert device_of(hub, bob, "bob") == alice_gpu
    log = hub.log.read_text()
    assert "Culling alice/ (profile gpu-1): its GPUs and kernels were idle for 10s" in log
    # carol's busy GPU kept her server well past its GPU-idle timeout, with no warning
    assert carol.server()["ready"] and warnings(carol) == {}
    # the CPU server follows its own, longer rule: still there, culled later by it
    assert dave.server() is not None
    wait_for(lambda: dave.server() is None, 60, "the CPU server to be culled by its own 40s rule")
    assert "Culling dave/ (profile cpu): no activity for 40s" in hub.log.read_text()


def test_snooze_postpones_and_the_limit_holds(hub, gpus):
    bob = hub.login("bob")
    if not bob.server():
        bob.start("gpu-1")
    bob.wait_ready()
    w = wait_for(lambda: warnings(bob).get(""), 30, "a warning for bob")
    first_deadline = w["deadline"]
    assert w["snoozes_left"] == 1
    r = bob.api.post(bob.url("/gpuhub/culling/bob/snooze"), json={"server": ""})
    assert r.status_code == 200 and "snooze 1 of 1" in r.json()["message"]
    assert r.json()["deadline"] >= first_deadline + 10
    # past the first deadline it is still running
    wait_for(lambda: time.time() > first_deadline + 2, 20, "the first deadline to pass")
    assert bob.server() is not None
    r = bob.api.post(bob.url("/gpuhub/culling/bob/snooze"), json={"server": ""})
    assert r.status_code == 409 and "No snoozes left" in r.json()["message"]
    # another user cannot see or snooze bob's server
    carol = hub.login("carol")
    assert carol.api.post(carol.url("/gpuhub/culling/bob/snooze"), json={"server": ""}).status_code == 404
    wait_for(lambda: bob.server() is None, 40, "bob's server to be culled after the snooze ran out")
