"""``GET <base_url>gpuhub/activity`` on a real jupyter server: the GPUs this server may use
(read through the fake NVML, same code path as nvidia-ml-py), kernels busy/idle with a real
kernel, terminals; plus the CUDA_VISIBLE_DEVICES rules, each in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest
import requests
from nbside import DEVICES, FAKE_NVML_DIR


def _activity(server) -> dict:
    r = server.get("gpuhub/activity")
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    return r.json()


def _held_cell(release) -> str:
    """A cell that runs until the test creates ``release`` (at most 120 s): busy for as long as
    the test needs to see it busy, however slowly a loaded machine answers the test's looks (a
    fixed ``time.sleep(3)`` cell could end between two of them)."""
    return f"import os, time\nt = time.time() + 120\nwhile not os.path.exists({str(release)!r}) and time.time() < t:\n    time.sleep(0.05)"


def _wait(server, predicate, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        body = _activity(server)
        if predicate(body) or time.time() > deadline:
            return body
        time.sleep(0.2)


def test_extension_is_enabled_by_the_installed_config(nb_server):
    # Nothing on the command line names the extension: the package's jupyter_server_config.d did.
    assert "gpuhub_notebook: serving" in nb_server.tail(200)


def test_needs_authentication(nb_server):
    r = requests.get(nb_server.url + "gpuhub/activity", timeout=10)
    assert r.status_code == 403
    r = requests.get(nb_server.url + "gpuhub/activity", headers={"Authorization": "token wrong"}, timeout=10)
    assert r.status_code == 403


def test_reports_only_the_visible_gpus_with_live_utilisation(nb_server, fake_nvml):
    fake_nvml.set(DEVICES)
    body = _activity(nb_server)
    assert "error" not in body
    assert abs(body["sampled_at"] - time.time()) < 30
    # CUDA_VISIBLE_DEVICES="GPU-fake-2,0": in that order, ids as the hub assigned them.
    assert [g["id"] for g in body["gpus"]] == ["GPU-fake-2", "0"]
    assert [g["uuid"] for g in body["gpus"]] == ["GPU-fake-2", "GPU-fake-0"]
    assert all(g["utilization"] == 0 and g["memory_used"] == 0 for g in body["gpus"])
    # The hidden device (index 1, 99% busy) is someone else's: it must not keep this server alive.
    assert "GPU-fake-1" not in json.dumps(body)

    fake_nvml.update(2, utilization=87, memory_used=40 * 2**30)
    gpu = _activity(nb_server)["gpus"][0]
    assert (gpu["id"], gpu["utilization"], gpu["memory_used"]) == ("GPU-fake-2", 87, 40 * 2**30)
    assert gpu["memory_total"] == 85899345920 and gpu["name"] == "NVIDIA Fake H100"
    fake_nvml.set(DEVICES)


def test_kernel_busy_and_idle_and_terminals(nb_server):
    from jupyter_client import BlockingKernelClient

    before = _activity(nb_server)
    assert before["kernels"]["count"] == 0 and before["kernels"]["busy"] == 0
    assert before["kernels"]["last_activity"] is None
    assert before["terminals"] == {"count": 0, "last_activity": None}

    r = nb_server.post("api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    term = None
    try:
        idle = _wait(
            nb_server, lambda b: b["kernels"]["count"] == 1 and b["kernels"]["busy"] == 0 and b["kernels"]["last_activity"]
        )
        assert idle["kernels"]["count"] == 1 and idle["kernels"]["busy"] == 0, idle
        started = datetime.fromisoformat(idle["kernels"]["last_activity"].replace("Z", "+00:00"))

        # Run a cell as a frontend would (a second client of the same kernel): the server sees busy.
        kc = BlockingKernelClient()
        kc.load_connection_file(str(nb_server.runtime_dir / f"kernel-{kid}.json"))
        # No heartbeat channel: its 1 s time-to-dead calls a kernel that is still importing on a loaded
        # machine "dead" (CI saw it); the shell reply of wait_for_ready is the readiness we need.
        kc.start_channels(hb=False)
        try:
            kc.wait_for_ready(timeout=30)
            release = nb_server.workdir / f"release-{kid}"
            kc.execute(_held_cell(release))
            busy = _wait(nb_server, lambda b: b["kernels"]["busy"] == 1, timeout=15)
            assert busy["kernels"] == {**busy["kernels"], "count": 1, "busy": 1}, busy
            release.touch()
            done = _wait(nb_server, lambda b: b["kernels"]["busy"] == 0, timeout=20)
            assert done["kernels"]["busy"] == 0, done
            later = datetime.fromisoformat(done["kernels"]["last_activity"].replace("Z", "+00:00"))
            assert later > started
        finally:
            kc.stop_channels()

        r = nb_server.post("api/terminals", json={})
        assert r.status_code == 200, r.text
        term = r.json()["name"]
        t = _wait(nb_server, lambda b: b["terminals"]["count"] == 1)["terminals"]
        assert t["count"] == 1 and t["last_activity"].endswith("Z"), t
    finally:
        nb_server.delete(f"api/kernels/{kid}")
        if term:
            nb_server.delete(f"api/terminals/{term}")
    after = _wait(nb_server, lambda b: b["kernels"]["count"] == 0 and b["terminals"]["count"] == 0)
    assert after["kernels"]["count"] == 0 and after["terminals"]["count"] == 0


# The visibility rules, through the same reader the handler calls, in a fresh interpreter with
# the fake NVML first on PYTHONPATH (as in the server above).
_PROBE = "import json, gpuhub_notebook.activity as a; print(json.dumps(a.read_gpus()))"


def _read(tmp_path, visible, devices=DEVICES, nvml=True):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"devices": devices}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "GPUHUB_"))}
    env["PYTHONPATH"] = str(FAKE_NVML_DIR)
    if nvml:
        env["GPUHUB_FAKE_NVML"] = str(path)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "visible, ids",
    [
        (None, ["GPU-fake-0", "GPU-fake-1", "GPU-fake-2"]),  # unset: every NVML device
        ("", []),  # empty: none (a CPU server on a GPU node)
        ("1", ["1"]),
        ("GPU-fake-1,GPU-fake-0", ["GPU-fake-1", "GPU-fake-0"]),
        ("2,NoDevFiles,0", ["2"]),  # CUDA stops at the first entry it cannot parse
    ],
)
def test_visible_devices(tmp_path, visible, ids):
    body = _read(tmp_path, visible)
    assert [g["id"] for g in body["gpus"]] == ids
    assert "error" not in body


def test_unknown_device_and_missing_nvml_are_errors_not_idle(tmp_path):
    body = _read(tmp_path, "GPU-fake-0,GPU-gone")
    assert [g["id"] for g in body["gpus"]] == ["GPU-fake-0"]
    assert "GPU-gone" in body["error"]

    body = _read(tmp_path, None, nvml=False)  # no driver / library
    assert body["gpus"] == [] and "NVML" in body["error"]


def test_a_busy_silent_kernel_keeps_its_server_active(tmp_path, fake_nvml):
    """A long cell that prints nothing is still use: the server's own activity moves on."""
    from jupyter_client import BlockingKernelClient
    from nbside import NotebookServer

    server = NotebookServer(
        tmp_path / "busy", {"GPUHUB_FAKE_NVML": str(fake_nvml.path), "JUPYTERHUB_ACTIVITY_INTERVAL": "2"}, base_url="/"
    ).start()
    try:
        kid = server.post("api/kernels", json={"name": "python3"}).json()["id"]
        kc = BlockingKernelClient()
        kc.load_connection_file(str(server.runtime_dir / f"kernel-{kid}.json"))
        # No heartbeat channel: its 1 s time-to-dead calls a kernel that is still importing on a loaded
        # machine "dead" (CI saw it); the shell reply of wait_for_ready is the readiness we need.
        kc.start_channels(hb=False)
        # Busy until released: the activity must move while the cell still runs (a fixed 8 s
        # cell could end before the look below, and its end moves the activity too).
        release = tmp_path / "release"
        try:
            kc.wait_for_ready(timeout=30)
            kc.execute(_held_cell(release))
            busy = _wait(server, lambda b: b["kernels"]["busy"] == 1, timeout=15)
            assert busy["kernels"]["busy"] == 1, busy

            def last():  # what jupyterhub-singleuser reports to the hub (not itself activity)
                return datetime.fromisoformat(server.get("api/status").json()["last_activity"].replace("Z", "+00:00"))

            first = last()
            deadline = time.time() + 6
            while time.time() < deadline and last() <= first:
                time.sleep(0.5)
            assert last() > first, "a busy kernel did not count as activity"
        finally:
            release.touch()
            kc.stop_channels()
    finally:
        server.stop()
