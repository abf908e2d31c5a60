"""A hub restart loses nothing; a queued server gives up after the queue timeout."""

import requests
import pytest

from support.hub import running_hub
from test_local_hub import POLICY

pytestmark = pytest.mark.integration


def status(hub, user):
    return requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {user.token}"}).json()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("restart"), POLICY) as h:
        yield h


def test_restart_keeps_allocations_and_queue_semantics(hub):
    _stop_all(hub)  # whatever the tests before left (any order)
    alice, carol = hub.login("alice"), hub.login("carol")
    alice.start("gpu-1")
    carol.start("gpu-1")
    alice.wait_ready()
    carol.wait_ready()
    admin = hub.login("admin")  # who holds what is shown in full to admins only
    before = {d["id"]: d["user"] for d in status(hub, admin)["devices"]}
    env_before = alice.server_env()["CUDA_VISIBLE_DEVICES"]
    assert sorted(before.values()) == ["alice", "carol"]

    hub.stop(kill_servers=False)
    hub.start()

    alice, bob = hub.login("alice"), hub.login("bob")
    assert alice.server()["ready"]  # still running, not restarted
    assert alice.server_env()["CUDA_VISIBLE_DEVICES"] == env_before
    after = {d["id"]: d["user"] for d in status(hub, hub.login("admin"))["devices"]}
    assert after == before  # the table was rebuilt from what really runs
    # nothing is assigned twice: vision's quota is still full, so bob waits
    assert bob.start("gpu-1").status_code == 202
    bob.progress(until=lambda e: "position 1 of 1" in e.get("message", ""))
    alice.stop()
    bob.wait_ready()
    assert bob.server_env()["CUDA_VISIBLE_DEVICES"] == env_before


def test_queue_timeout_withdraws_the_request(hub):
    good = hub.policy.read_text()
    hub.policy.write_text(good.replace("queueTimeout: 5m", "queueTimeout: 3s"))
    try:
        carol, dave = hub.login("carol"), hub.login("dave")
        if not carol.server():
            carol.start("gpu-1")
        carol.wait_ready()
        r = dave.start("gpu-1", team="nlp")
        assert r.status_code == 503
        assert "waited 3s in NLP's queue" in r.json()["message"] and "withdrawn" in r.json()["message"]
        assert dave.server() is None
        assert next(t for t in status(hub, carol)["teams"] if t["name"] == "nlp")["waiting"] == 0
    finally:
        hub.policy.write_text(good)


def _journal_waiting(hub) -> set[str]:
    """The requests the queue journal holds as waiting, the ones a restart brings back (read
    line by line, never loaded: loading compacts the file, which is the hub's)."""
    import json

    path, live = hub.data / "queue.journal", set()
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("op") == "wait":
            live.add(entry["key"])
        elif entry.get("op") == "done":
            live.discard(entry["key"])
    return live


def test_a_request_cancelled_while_it_waits_is_not_kept_for_the_next_restart(hub):
    """bob leaves Vision Lab's queue (JupyterHub's DELETE of his pending server, as the spawn
    page's cancel and an admin's withdraw do): the journal must not hold his request any more,
    or the next restart re-spawns it and hands him the GPU he gave up."""
    _stop_all(hub)
    alice, bob = hub.login("alice"), hub.login("bob")
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    assert bob.start("gpu-1").status_code == 202  # Vision Lab's one GPU is alice's: he waits
    bob.progress(until=lambda e: "position 1 of 1" in e.get("message", ""))
    assert "bob/" in _journal_waiting(hub)  # kept for a restart while he waits
    assert bob.stop().status_code in (202, 204)
    bob.wait_gone()
    try:
        assert "bob/" not in _journal_waiting(hub)
    finally:
        _stop_all(hub)


# -- finding 10 of issue 8: restart trusts the hub's own record, and the process's identity --


def _stop_all(hub, names=("alice", "bob", "carol", "dave")):
    hub.stop_servers(*names)


def _holders(hub, user=None):
    return {d["id"]: d.get("user") for d in status(hub, hub.login("admin"))["devices"]}


def test_restart_ignores_what_a_user_writes_into_their_server_environment(hub):
    """The old restart read GPUHUB_DEVICES from /proc/<pid>/environ: a user can rewrite that."""
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parents[1] / "mlflow"))
    from mlflow_kernel import KernelSession

    _stop_all(hub)
    alice, carol = hub.login("alice"), hub.login("carol")
    alice.start("gpu-1")
    carol.start("gpu-1")
    s = alice.wait_ready()
    carol.wait_ready()
    mine, theirs = alice.server_env()["CUDA_VISIBLE_DEVICES"], carol.server_env()["CUDA_VISIBLE_DEVICES"]
    before = _holders(hub, alice)
    assert before[mine] == "alice" and before[theirs] == "carol"
    # the attack, from alice's own kernel: rewrite her server's GPUHUB_DEVICES to carol's GPU
    k = KernelSession("", hub.server_url(s["url"]), alice.token, "attack.ipynb")
    try:
        out = k.execute(
            "import os\n"
            "ppid = os.getppid()\n"
            "st = open(f'/proc/{ppid}/stat').read()\n"
            "fields = st[st.rindex(')') + 2:].split()\n"
            "start, end = int(fields[47]), int(fields[48])\n"
            "with open(f'/proc/{ppid}/mem', 'r+b', buffering=0) as m:\n"
            "    m.seek(start); env = m.read(end - start)\n"
            "    at = env.index(b'GPUHUB_DEVICES=') + len(b'GPUHUB_DEVICES=')\n"
            f"    m.seek(start + at); m.write({theirs!r}.encode())\n"
            "print('rewritten')"
        )
    finally:
        k.close()
    assert out.strip() == "rewritten"
    assert alice.server_env()["GPUHUB_DEVICES"] == theirs  # the process now claims carol's GPU

    hub.stop(kill_servers=False)
    hub.start()
    alice, carol = hub.login("alice"), hub.login("carol")
    assert alice.server()["ready"] and carol.server()["ready"]
    assert _holders(hub, alice) == before  # the hub's record, not the process's claim
    assert alice.server_env()["CUDA_VISIBLE_DEVICES"] == mine
    _stop_all(hub)


def _spawn_with_pid(pid: int, attempts: int = 200):
    """A process with exactly ``pid`` (root: /proc/sys/kernel/ns_last_pid), as a reused pid would be."""
    import subprocess

    for _ in range(attempts):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "300"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not get pid {pid} back (busy machine)")


def test_a_reused_pid_is_not_taken_for_the_server(hub):
    import os
    import signal
    import time

    from support.hub import processes_with_env

    _stop_all(hub)
    alice, bob = hub.login("alice"), hub.login("bob")
    alice.start("gpu-1")
    alice.wait_ready()
    gpu = alice.server_env()["CUDA_VISIBLE_DEVICES"]
    pid = next(
        p
        for p in processes_with_env(f"GPUHUB_TEST_RUN={hub.run_id}")
        if "jupyterhub-singleuser" in open(f"/proc/{p}/cmdline").read()
        and "JUPYTERHUB_USER=alice\0" in open(f"/proc/{p}/environ").read()
    )
    hub.stop(kill_servers=False)
    os.kill(pid, signal.SIGKILL)  # the server dies while the hub is down...
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.05)
    impostor = _spawn_with_pid(pid)  # ...and its pid is handed to an unrelated process
    try:
        hub.start()
        alice, bob = hub.login("alice"), hub.login("bob")
        assert alice.server() is None  # treated as gone, not adopted
        assert "is not the server the hub started" in hub.log.read_text()
        assert impostor.poll() is None  # the unrelated process is left alone
        assert bob.start("gpu-1").status_code in (201, 202)  # and alice's GPU is free again
        bob.wait_ready()
        assert bob.server_env()["CUDA_VISIBLE_DEVICES"] == gpu
    finally:
        impostor.kill()
        impostor.wait()
    _stop_all(hub)
