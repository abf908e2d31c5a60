"""MIG slices end to end on one machine (issue 25), against a real hub and real servers with the
shipped example policy (only its times compressed). The one double is the fake ``pynvml``
(tests/support/fake_nvml): an A100 in MIG mode split into seven 1g.10gb slices (which, as
real NVML, report no utilisation), three whole A100s and two L4s.

Seven students each get their own slice (CUDA_VISIBLE_DEVICES=MIG-<uuid>); the eighth waits
with a message that names slices. The policy's ``gpuUnread: activity`` judges the slices by
activity only: the six idle servers are warned (the warning says so) and stopped, the one in
use is kept, and the eighth student gets a freed slice.
"""

import json
import re
from pathlib import Path

import pytest

from support.fake_gpus import fake_nvml_env
from support.hub import Hub, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASS = 5
STUDENTS = [f"s{i}" for i in range(1, 9)]

EXTRA_CONFIG = f"""
c.DemoAuthenticator.demo_users = dict(c.DemoAuthenticator.demo_users, **{{name: {{"groups": ["students"]}} for name in {STUDENTS!r}}})
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL="5")
"""

# ~/.jupyter/jupyter_server_config.py of the student who is working (kernel activity all along).
WORKING = """
import datetime
from jupyter_server.serverapp import ServerWebApplication
ServerWebApplication.last_activity = lambda self: datetime.datetime.now(datetime.timezone.utc)
"""


def nvml_devices():
    slices = [
        {
            "uuid": f"MIG-5e1f0c2a-0000-4000-8000-00000000000{i}",
            "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
            "memory_total": 10 * 2**30,
            "gi": 7 + i,
            "ci": 0,
        }
        for i in range(7)
    ]
    out = [
        {
            "uuid": "GPU-a100-mig",
            "name": "NVIDIA A100-SXM4-80GB",
            "memory_total": 80 * 2**30,
            "events": [],
            "mig": {"enabled": True, "devices": slices},
        }
    ]
    out += [{"uuid": f"GPU-a100-{i}", "name": "NVIDIA A100-SXM4-80GB", "utilization": 0, "events": []} for i in range(3)]
    out += [{"uuid": f"GPU-l4-{i}", "name": "NVIDIA L4", "utilization": 0, "events": []} for i in range(2)]
    return out


def example_policy() -> str:
    text = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()
    shipped = "idle: {timeout: 1h, gpuUnread: activity}"
    assert shipped in text
    return text.replace(shipped, "idle: {timeout: 90s, warning: 15s, maxSnoozes: 0, gpuUnread: activity}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    nvml = tmp_path_factory.mktemp("nvml") / "nvml.json"
    nvml.write_text(json.dumps({"devices": nvml_devices()}))
    h = Hub(
        tmp_path_factory.mktemp("mig"),
        example_policy(),
        extra_config=EXTRA_CONFIG,
        env=fake_nvml_env(nvml, GPUHUB_CULL_EVERY=str(PASS)),
    )
    d = h.data / "home" / "s1" / ".jupyter"
    d.mkdir(parents=True)
    (d / "jupyter_server_config.py").write_text(WORKING)
    h.start()
    yield h
    h.stop()


def status(client) -> dict:
    r = client.api.get(client.url("/gpuhub/status"))
    r.raise_for_status()
    return r.json()


def warning(client) -> dict | None:
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()["servers"].get("")


def test_seven_students_on_seven_slices_the_eighth_waits_idle_slices_are_culled(hub):
    admin = hub.login("admin")
    users = {name: hub.login(name) for name in STUDENTS}
    for name in STUDENTS[:7]:
        assert users[name].start("mig-1g").status_code in (201, 202)
    visible = {}
    for name in STUDENTS[:7]:  # read at once: an idle server is culled 105 s after it starts
        users[name].wait_ready(timeout=180)
        visible[name] = users[name].server_env()["CUDA_VISIBLE_DEVICES"]
    assert all(re.fullmatch(r"MIG-5e1f0c2a-[0-9a-f-]+", v) for v in visible.values()), visible
    assert len(set(visible.values())) == 7  # one slice each, none given twice

    s8 = users["s8"]
    s8.start_background("mig-1g")
    waiting = wait_for(lambda: next((w for w in status(admin)["waiting"] if w["user"] == "s8"), None), 30, "s8 waiting")
    assert "1 A100 1g.10gb slice" in waiting["reason"], waiting
    events = s8.progress(until=lambda e: "slice" in e.get("message", ""), timeout=30)
    assert "slice" in events[-1]["message"], events

    # The slices report no utilisation; gpuUnread: activity judges them by activity only.
    w = wait_for(lambda: warning(users["s2"]), 150, "a warning for s2's idle slice")
    assert w["rule"] == "idle" and w["reason"].startswith("no activity for 1m30s"), w
    assert "judges it by activity only (gpuUnread: activity)" in w["reason"], w
    for name in STUDENTS[1:7]:
        users[name].wait_gone(timeout=120)
    assert users["s1"].server()["ready"] and warning(users["s1"]) is None  # in use: kept
    s8.wait_ready(timeout=120)
    assert s8.server_env()["CUDA_VISIBLE_DEVICES"] in set(visible.values()) - {visible["s1"]}
    assert "Culling s2/ (profile mig-1g): no activity for 1m30s" in hub.log.read_text()
