"""Culling MIG slices that NVML can measure (issue 25): a real hub, real servers, the fake NVML's
H100 in MIG mode with GPM (as Hopper GPUs have it; an A100 has none, tests/integration/test_mig_hub.py).

The hub reads each slice through GPM (culling/gpu.py), so a slice is judged like a whole GPU:
the idle slice is warned by ``gpuIdleTimeout`` and stopped, the busy one is kept although
nobody touches its notebook, and no warning speaks of an unread GPU.
"""

import json
from pathlib import Path

import pytest

from support.fake_gpus import fake_nvml_env
from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASS = 5
STUDENTS = ("s1", "s2")
SLICES = [f"MIG-9b0c1d2e-0000-4000-8000-00000000000{i}" for i in range(3)]

POLICY = """\
flavors:
  - name: h100-1g
    displayName: H100 1g.10gb
    mig: {profile: 1g.10gb}
    local: {match: H100}
teams:
  - {name: students, displayName: Students, groups: [students], quota: {gpus: {h100-1g: 3}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - slug: mig-1g
    displayName: One slice
    gpu: {count: 1, flavor: h100-1g}
    teams: [students]
    idle: {timeout: 1h, gpuIdleTimeout: 90s, warning: 15s, maxSnoozes: 0}
"""

EXTRA_CONFIG = f"""
c.DemoAuthenticator.demo_users = dict(c.DemoAuthenticator.demo_users, **{{name: {{"groups": ["students"]}} for name in {STUDENTS!r}}})
"""


class Nvml:
    def __init__(self, path: Path):
        self.path = path
        self.slices = [
            {
                "uuid": u,
                "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                "memory_total": 10 * 2**30,
                "gi": 9 + i,
                "ci": 0,
                "utilization": 0,
            }
            for i, u in enumerate(SLICES)
        ]
        self.write()

    def write(self):
        gpu = {
            "uuid": "GPU-h100-mig",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total": 80 * 2**30,
            "events": [],
            "gpm": True,
            "mig": {"enabled": True, "devices": self.slices},
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": [gpu]}))
        tmp.replace(self.path)

    def set(self, uuid, utilization):
        next(s for s in self.slices if s["uuid"] == uuid)["utilization"] = utilization
        self.write()


@pytest.fixture(scope="module")
def nvml(tmp_path_factory):
    return Nvml(tmp_path_factory.mktemp("nvml") / "nvml.json")


@pytest.fixture(scope="module")
def hub(tmp_path_factory, nvml):
    with running_hub(
        tmp_path_factory.mktemp("mig-gpm"),
        POLICY,
        extra_config=EXTRA_CONFIG,
        env=fake_nvml_env(nvml.path, GPUHUB_CULL_EVERY=str(PASS)),
    ) as h:
        yield h


def warning(client) -> dict | None:
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()["servers"].get("")


def test_a_busy_gpm_slice_is_kept_and_an_idle_one_is_culled_by_the_gpu_rule(hub, nvml):
    users = {n: hub.login(n) for n in STUDENTS}
    # s1's training runs on its slice from the start (the first slice: s1 asks first, slices go
    # in inventory order); s2's stays idle; nobody opens either notebook.
    nvml.set(SLICES[0], 85)
    assert users["s1"].start("mig-1g").status_code in (201, 202)
    assert users["s2"].start("mig-1g").status_code in (201, 202)
    visible = {n: (u.wait_ready(timeout=180), u.server_env()["CUDA_VISIBLE_DEVICES"])[1] for n, u in users.items()}
    assert visible == {"s1": SLICES[0], "s2": SLICES[1]}, visible

    w = wait_for(lambda: warning(users["s2"]), 200, "a warning for s2's idle slice")
    assert w["rule"] == "gpu-idle" and w["reason"] == "its GPUs were idle for 1m30s", w  # a reading: no unread words
    users["s2"].wait_gone(timeout=90)
    assert users["s1"].server()["ready"] and warning(users["s1"]) is None  # busy: kept, never warned
    log = hub.log.read_text()
    assert "Culling s2/ (profile mig-1g): its GPUs were idle for 1m30s" in log
    assert ", GPU 0%, age" in log and "GPU unread" not in log  # the culler read the slice (GPM)
    assert "Warning s1/" not in log
