"""GPU health on one machine (issue 23) against a real hub and real servers; the faults come
from the fake ``pynvml`` (tests/support/fake_nvml), the one double: an XID is an event in its
file, a counter a number there, read by the unchanged product code through NVML's API.

One Vision Lab (quota 3) on a machine with three fake GPUs, in order: an application XID 13
leaves alice's GPU in; a double-bit ECC count takes the free GPU-fake-2 out; a pending row
remap makes GPU-fake-1 suspect and bob still gets it; lena waits; an XID 79 on alice's
GPU-fake-0 tells alice within 5 s on her home page (bob's page says nothing of it), the team's
usable capacity drops, alice's stop does not hand the broken GPU to lena, whose wait says
why; ``gpuhub gpu uncordon`` gives it back and lena gets it. A drain lets bob keep his GPU
until he stops, then nobody gets it; only admins may drain or uncordon; all is audited.

Each test starts from a clean machine (``fresh``: nobody holds or waits, counters clean, no
mark or drain) and sets up its own part of that story, so each passes alone and in any order.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.fake_gpus import FakeGpus, fake_nvml_env, health_policy
from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

POLICY = health_policy(3)


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return FakeGpus(tmp_path_factory.mktemp("nvml") / "nvml.json", 3, utilization=50)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus):
    with running_hub(
        tmp_path_factory.mktemp("health"), POLICY, extra_config="c.PolicyStore.check_interval = 1\n", env=fake_nvml_env(gpus.path)
    ) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("admin", "alice", "bob", "lena")}


def gpu_list(admin) -> dict[str, dict]:
    r = admin.api.get(admin.url("/gpuhub/gpus"))
    r.raise_for_status()
    return {g["id"]: g for g in r.json()["gpus"]}


def status(client) -> dict:
    r = client.api.get(client.url("/gpuhub/status"))
    r.raise_for_status()
    return r.json()


def vision_a100(client) -> dict:
    return next(t for t in status(client)["teams"] if t["name"] == "vision")["gpus"]["a100"]


def home(client) -> str:
    r = client.session.get(client.hub.url + "/hub/home")
    r.raise_for_status()
    return r.text


def held_by(admin, user) -> str:
    return next(g["id"] for g in gpu_list(admin).values() if g["user"] == user)


def gpuhub_cli(hub, client, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUHUB_TOKEN=client.token)
    env.pop("JUPYTERHUB_API_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "gpu", "--hub", hub.url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def metric(admin, name, **labels) -> float | None:
    text = admin.api.get(admin.hub.url + "/hub/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return None


def fresh(hub, users, gpus) -> float:
    """The machine as the story starts it, whatever the tests before left: nobody holds or
    waits for a GPU, every counter reads clean, no device is marked or drained. Returns the
    time from which the audit holds this test's entries only."""
    admin = users["admin"]
    gone = [u for u in (users["alice"], users["bob"], users["lena"]) if u.server() is not None]
    for u in gone:
        u.stop()
    for u in gone:
        u.wait_gone()
    for d in gpus.devices:
        if d.get("ecc_uncorrected_volatile") or any(d.get("remapped_rows") or ()):
            gpus.set(d["uuid"], ecc_uncorrected_volatile=0, remapped_rows=[0, 0, 0, 0])
    for device, g in gpu_list(admin).items():
        if g["state"] != "healthy" or g["drained"]:  # (a counter's verdict goes by itself at the next poll)
            gpuhub_cli(hub, admin, "uncordon", device)
    wait_for(
        lambda: all(g["state"] == "healthy" and g["usable"] and g["user"] is None for g in gpu_list(admin).values()),
        15,
        "every GPU healthy and free",
    )
    return time.time()


def out_of_service(admin, gpus, device, **fields) -> None:
    """A counter that takes ``device`` out (a double-bit ECC count), read at the next poll."""
    gpus.set(device, **(fields or {"ecc_uncorrected_volatile": 1}))
    wait_for(lambda: gpu_list(admin)[device]["state"] == "bad", 10, f"{device} out of service")


def started(*clients, profile="gpu-1") -> None:
    for c in clients:
        assert c.start(profile).status_code in (201, 202)
        c.wait_ready()


def test_an_application_xid_leaves_the_gpu_in(hub, users, gpus):
    admin, alice = users["admin"], users["alice"]
    fresh(hub, users, gpus)
    started(alice)
    mine = held_by(admin, "alice")
    counted = metric(admin, "gpuhub_gpu_xid_total", device=mine, xid="13") or 0.0
    gpus.xid(mine, 13)
    wait_for(lambda: metric(admin, "gpuhub_gpu_xid_total", device=mine, xid="13") == counted + 1, 10, "XID 13 counted")
    g = gpu_list(admin)[mine]
    assert (g["state"], g["usable"]) == ("healthy", True)
    assert "gpuhub-gpu-failures" not in home(alice)
    assert vision_a100(admin)["usable"] == 3


def test_a_double_bit_ecc_error_takes_a_free_gpu_out(hub, users, gpus):
    admin = users["admin"]
    fresh(hub, users, gpus)
    gpus.set("GPU-fake-2", ecc_uncorrected_volatile=1)
    wait_for(lambda: gpu_list(admin)["GPU-fake-2"]["state"] == "bad", 10, "the DBE count read at a poll")
    g = gpu_list(admin)["GPU-fake-2"]
    assert "uncorrectable ECC" in g["reason"] and not g["usable"]
    assert vision_a100(admin)["usable"] == 2
    assert metric(admin, "gpuhub_gpu_health", device="GPU-fake-2", flavor="a100", state="bad") == 1.0


def test_a_pending_row_remap_is_suspect_and_still_handed_out(hub, users, gpus):
    admin, alice, bob = users["admin"], users["alice"], users["bob"]
    fresh(hub, users, gpus)
    out_of_service(admin, gpus, "GPU-fake-2")
    started(alice)
    (free,) = {"GPU-fake-0", "GPU-fake-1"} - {held_by(admin, "alice")}
    gpus.set(free, remapped_rows=[0, 1, 1, 0])
    wait_for(lambda: gpu_list(admin)[free]["state"] == "suspect", 10, "the pending remap read at a poll")
    started(bob)
    assert held_by(admin, "bob") == free  # the only usable free one: suspect is still given
    assert "row remapping is pending" in gpu_list(admin)[free]["reason"]


def test_xid_79_on_alices_gpu_tells_her_and_nobody_gets_it(hub, users, gpus):
    admin, alice, bob, lena = users["admin"], users["alice"], users["bob"], users["lena"]
    since = fresh(hub, users, gpus)
    out_of_service(admin, gpus, "GPU-fake-2")
    started(alice, bob)
    lena.start_background("gpu-1")  # waits: 0 and 1 held, 2 out of service
    wait_for(lambda: any(w["user"] == "lena" for w in status(admin)["waiting"]), 20, "lena waiting")
    mine = held_by(admin, "alice")
    counted = metric(admin, "gpuhub_gpu_xid_total", device=mine, xid="79") or 0.0
    t0 = time.time()
    gpus.xid(mine, 79)
    page = wait_for(lambda: (lambda p: p if "gpuhub-gpu-failures" in p else None)(home(alice)), 5, "alice told", 0.2)
    told_in = time.time() - t0
    assert told_in <= 5
    notice = re.sub(r"\s+", " ", re.search(r'id="gpuhub-gpu-failures">(.*?)</div>\s*</div>', page, re.S).group(1))
    assert "XID 79: GPU has fallen off the bus" in notice and mine in notice
    assert "Your files are kept" in notice and "a restart gets a healthy GPU" in notice
    assert "gpuhub-gpu-failures" not in home(bob) and "alice" not in home(bob)  # nothing of alice on bob's page
    assert vision_a100(admin)["usable"] == 1
    assert "out of service" in vision_a100(admin)["out_of_service"]
    assert metric(admin, "gpuhub_gpu_xid_total", device=mine, xid="79") == counted + 1

    alice.stop()
    alice.wait_gone()
    time.sleep(1.5)  # a scheduling pass and a poll: the released broken GPU must stay out
    waiting = next(w for w in status(admin)["waiting"] if w["user"] == "lena")
    assert re.search(
        r"only 0 of the 1 usable on this machine are free \(1 of 3 A100 usable, 2 out of service since "
        r"\d\d:\d\d",
        waiting["reason"],
    ), waiting["reason"]
    assert gpu_list(admin)[mine]["user"] is None
    events = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_health", "since": str(since)}).json()["entries"]
    assert any(e["device"] == mine and e["state"] == "bad" and e.get("user") == "alice" and e.get("xid") == 79 for e in events), (
        events
    )


def test_only_admins_drain_or_uncordon(hub, users, gpus):
    fresh(hub, users, gpus)
    gpus.xid("GPU-fake-0", 79)
    wait_for(lambda: gpu_list(users["admin"])["GPU-fake-0"]["state"] == "bad", 10, "GPU-fake-0 out after its XID 79")
    r = gpuhub_cli(hub, users["bob"], "uncordon", "GPU-fake-0")
    assert r.returncode == 1 and "Only admins may drain or uncordon" in r.stderr and "403" in r.stderr
    assert users["bob"].api.get(users["bob"].url("/gpuhub/gpus")).status_code == 403
    assert gpu_list(users["admin"])["GPU-fake-0"]["state"] == "bad"


def test_uncordon_gives_it_back(hub, users, gpus):
    admin, bob, lena = users["admin"], users["bob"], users["lena"]
    since = fresh(hub, users, gpus)
    out_of_service(admin, gpus, "GPU-fake-2")
    gpus.xid("GPU-fake-0", 79)
    wait_for(lambda: gpu_list(admin)["GPU-fake-0"]["state"] == "bad", 10, "GPU-fake-0 out after its XID 79")
    started(bob)  # on GPU-fake-1, the one usable
    lena.start_background("gpu-1")
    wait_for(lambda: any(w["user"] == "lena" for w in status(admin)["waiting"]), 20, "lena waiting")
    listing = gpuhub_cli(hub, admin, "list")
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"GPU-fake-0\s+a100\s+bad\s.*XID 79: GPU has fallen off the bus", listing.stdout), listing.stdout
    r = gpuhub_cli(hub, admin, "uncordon", "GPU-fake-0")
    assert r.returncode == 0 and "GPU-fake-0 is back in service" in r.stdout, (r.stdout, r.stderr)
    lena.wait_ready(timeout=60)
    assert held_by(admin, "lena") == "GPU-fake-0"
    assert vision_a100(admin)["usable"] == 2  # GPU-fake-2's ECC count still says bad
    r = gpuhub_cli(hub, admin, "uncordon", "GPU-fake-2")
    assert "still out of service" in r.stdout and "uncorrectable ECC" in r.stdout
    entries = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_uncordoned", "since": str(since)}).json()["entries"]
    assert [(e["device"], e["by"]) for e in entries] == [("GPU-fake-0", "admin"), ("GPU-fake-2", "admin")]


def test_a_drained_gpu_stays_with_its_holder_then_is_out(hub, users, gpus):
    admin, alice, bob, lena = users["admin"], users["alice"], users["bob"], users["lena"]
    since = fresh(hub, users, gpus)
    out_of_service(admin, gpus, "GPU-fake-2")
    started(lena, bob)
    target = held_by(admin, "bob")
    r = gpuhub_cli(hub, admin, "drain", target)
    assert r.returncode == 0 and "bob/ keeps it until it stops" in r.stdout, (r.stdout, r.stderr)
    assert bob.server()["ready"] and held_by(admin, "bob") == target  # his work goes on
    bob.stop()
    bob.wait_gone()
    alice.start_background("gpu-1")
    wait_for(lambda: any(w["user"] == "alice" for w in status(admin)["waiting"]), 20, "alice waiting")
    time.sleep(1.0)
    waiting = next(w for w in status(admin)["waiting"] if w["user"] == "alice")
    assert "drained by admin" in waiting["reason"] or "out of service" in waiting["reason"], waiting
    assert gpu_list(admin)[target]["user"] is None
    assert gpuhub_cli(hub, admin, "uncordon", target).returncode == 0
    alice.wait_ready(timeout=60)
    assert held_by(admin, "alice") == target
    drained = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_drained", "since": str(since)}).json()["entries"]
    assert [(e["device"], e["by"], e.get("key")) for e in drained] == [(target, "admin", "bob/")]


# A training loop that checkpoints every step (atomically) and resumes from the last one
# (the shape of tests/integration/test_jobs.py's TRAIN; plain Python, no torch). The first
# attempt waits at step 2 for its GPU to fail: the XID never races that attempt's own end (3 s
# after step 2, which a loaded machine's look at the log, two requests and the event's way
# through NVML's event thread can spend).
TRAIN = """\
import json, os, time
ckpt = os.path.join(os.environ["GPUHUB_CHECKPOINT_DIR"], "state.json")
state = {"step": 0, "total": 0}
if os.path.exists(ckpt):
    state = json.load(open(ckpt))
    print("resumed from step", state["step"], flush=True)
print("attempt", os.environ["GPUHUB_ATTEMPT"], "devices", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
for step in range(state["step"] + 1, 9):
    time.sleep(0.5)
    state = {"step": step, "total": state["total"] + step}
    json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
    print("step", step, flush=True)
    if step == 2 and os.environ["GPUHUB_ATTEMPT"] == "1":
        time.sleep(300)  # stopped long before, for its failed GPU (bounded: nothing outlives the test)
print("total", state["total"], flush=True)
"""


def job(client, job_id) -> dict:
    r = client.api.get(client.url(f"/gpuhub/jobs/{job_id}"))
    r.raise_for_status()
    return r.json()


def job_log(client, job_id) -> str:
    return client.api.get(client.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root")
def test_a_job_whose_gpu_fails_resumes_on_a_healthy_gpu_without_using_a_retry(hub, users, gpus, tmp_path):
    admin, bob = users["admin"], users["bob"]
    fresh(hub, users, gpus)
    assert vision_a100(admin)["usable"] == 3
    # No retry of its own allowed, and 'failed' the only reason: were a GPU failure charged
    # as a failure, this job would end failed ('No retries left (0 allowed)').
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: train\nprofile: gpu-1\ncommand: [{sys.executable}, -c, {json.dumps(TRAIN)}]\n"
        "retries: {limit: 0, reasons: [failed]}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, "submit", str(spec)],
        env=dict(env, GPUHUB_TOKEN=bob.token),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    wait_for(lambda: "step 2" in job_log(bob, job_id), 90, "training to reach step 2")
    broken = job(bob, job_id)["attempts"][0]["devices"]
    assert len(broken) == 1 and gpu_list(admin)[broken[0]]["user"] == "bob"

    gpus.xid(broken[0], 79)
    rec = wait_for(lambda: (j := job(bob, job_id))["state"] in ("succeeded", "failed") and j, 120, "the job to end")
    out = job_log(bob, job_id)
    assert rec["state"] == "succeeded", (rec, out)
    first, second = rec["attempts"]
    assert first["reason"] == "gpu-failed", first
    assert f"{broken[0]} (XID 79: GPU has fallen off the bus)" in first["message"]
    assert "not counted against its retries" in first["message"]
    assert second["reason"] == "succeeded" and second["devices"] and second["devices"] != broken
    assert "resumed from step" in out and int(out.split("resumed from step")[1].split()[0]) >= 2
    assert out.count("step 1\n") == 1  # nothing before the checkpoint ran twice
    assert "total 36" in out  # 1+..+8 across both attempts

    # The GPU stays out after the job let it go, until an admin uncordons it.
    g = gpu_list(admin)[broken[0]]
    assert (g["state"], g["usable"], g["user"]) == ("bad", False, None)
    assert vision_a100(admin)["usable"] == 2
    assert gpuhub_cli(hub, admin, "uncordon", broken[0]).returncode == 0
    wait_for(lambda: vision_a100(admin)["usable"] == 3, 10, "the GPU back after uncordon")
