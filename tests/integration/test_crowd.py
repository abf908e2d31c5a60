"""A crowd at one real hub: a storm of spawns, open spawn pages, a kill -9 mid-queue.

One hub for the module (4 virtual GPUs, 50 users of one team). Asserts invariants
only — no over-allocation, nothing lost, order kept, no 503 through the public URL,
every waiter told of its admission; the timed figures (200 users, 500 pages) are in
``tests/benchmarks/crowd.py``.
"""

from __future__ import annotations

import json
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from support.hub import alive, Hub, running_hub, wait_for

pytestmark = pytest.mark.integration

GPUS = 4
USERS = [f"u{i:02d}" for i in range(50)]

POLICY = f"""\
flavors:
  - name: gpu
    local: {{virtual: {GPUS}}}
teams:
  - name: crowd
    displayName: Crowd
    groups: [crowd]
    quota: {{gpus: {{gpu: {{nominal: {GPUS}}}}}}}
profiles:
  - {{slug: cpu, displayName: CPU only, teams: "*", default: true}}
  - {{slug: gpu-1, displayName: One GPU, gpu: {{count: 1, flavor: gpu}}, teams: [crowd]}}
defaults:
  queueTimeout: 1h
"""

EXTRA = (
    "c.DemoAuthenticator.demo_users = dict(c.DemoAuthenticator.demo_users, "
    f"**{{n: {{'groups': ['crowd']}} for n in {USERS!r}}})\n"
)


class Stream:
    """One open spawn page: the progress event stream, read in the background."""

    def __init__(self, user, server: str = ""):
        self.user = user
        path = f"/users/{user.name}/servers/{server}/progress" if server else f"/users/{user.name}/server/progress"
        self.resp = user.api.get(user.url(path), stream=True, timeout=(10, 120))
        self.resp.raise_for_status()
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for line in self.resp.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    self.events.put(json.loads(line[5:]))
        except Exception:  # closed by the test
            pass
        self.events.put(None)

    def next(self, until=lambda e: True, timeout: float = 60) -> dict:
        while True:
            evt = self.events.get(timeout=timeout)
            if evt is None:
                raise EOFError(f"{self.user.name}'s stream ended")
            if until(evt):
                return evt

    def close(self):
        # The reader blocks until the next event or keepalive (8 s); cut the socket instead.
        try:
            self.resp.raw.connection.sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass
        self.resp.close()


def children(ppid: int, marker: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def position(evt) -> int | None:
    return (evt.get("gpuhub") or {}).get("position")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("crowd"), POLICY, extra_config=EXTRA) as h:
        yield h


@pytest.fixture(scope="module")
def crowd(hub):
    with ThreadPoolExecutor(10) as pool:
        return dict(zip(USERS, pool.map(hub.login, USERS)))


def holders(hub, _user=None) -> dict[str, str]:
    """Who holds which device, as an admin sees it (teammates see only that a device is held)."""
    admin = hub.login("admin")
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {admin.token}"}).json()
    return {d["id"]: d["user"] for d in snap["devices"] if d["user"]}


def empty(hub, crowd) -> None:
    """Nobody holds or waits for a server (a storm starts from here, whatever ran before)."""
    asked = [n for n in USERS if crowd[n].server() is not None]
    with ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(lambda n: crowd[n].stop().status_code, asked))
    assert set(codes) <= {202, 204}, codes
    for n in asked:
        crowd[n].wait_gone()
    assert holders(hub) == {}


def full_queue(hub, crowd) -> tuple[dict[str, str], list[str]]:
    """Every GPU held and everyone else waiting, whatever the tests before left (each test
    passes alone and in any order): who has no server asks for one. Returns who holds which
    device and who waits."""
    asking = [n for n in USERS if crowd[n].server() is None]
    with ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(lambda n: crowd[n].start("gpu-1").status_code, asking))
    assert set(codes) <= {201, 202}, codes
    running = wait_for(lambda: (h := holders(hub)) and len(h) == GPUS and h, 60, "the GPUs to fill")
    for n in running.values():
        crowd[n].wait_ready()
    waiting = [n for n in USERS if n not in running.values()]
    assert all(crowd[n].server() is not None for n in waiting)
    return running, waiting


def positions(crowd, names) -> dict[str, int]:
    """Each waiting user's position, as their own spawn page shows it."""
    out = {}
    for n in names:
        s = Stream(crowd[n])
        try:
            out[n] = position(s.next(until=lambda e: position(e) is not None))
        finally:
            s.close()
    return out


def test_storm_admits_exactly_the_capacity_and_queues_the_rest(hub, crowd):
    empty(hub, crowd)
    with ThreadPoolExecutor(len(USERS)) as pool:
        codes = list(pool.map(lambda n: crowd[n].start("gpu-1").status_code, USERS))
    assert set(codes) <= {201, 202}, codes  # nobody refused, nobody 503
    running = wait_for(lambda: (h := holders(hub)) and len(h) == GPUS and h, 60, "the GPUs to fill")
    assert len(set(running.values())) == GPUS  # one device each, none shared
    for n in running.values():
        crowd[n].wait_ready()
    waiting = [n for n in USERS if n not in running.values()]
    pos = positions(crowd, waiting)
    assert sorted(pos.values()) == list(range(1, len(waiting) + 1))  # nothing lost, no ties
    assert holders(hub) == running  # still exactly the capacity


def test_open_spawn_pages_do_not_starve_the_public_url(hub, crowd):
    """With 30 waiting users' pages open, everyone else's requests still go through."""
    running, waiting = full_queue(hub, crowd)
    running = set(running.values())
    pages = [Stream(crowd[n]) for n in waiting[:30]]
    try:
        for p in pages:
            p.next(until=lambda e: position(e) is not None)  # each page really is open
        one = crowd[sorted(running)[0]]
        server = hub.server_url(one.server()["url"])
        for i in range(20):
            u = crowd[waiting[-1 - (i % 10)]]
            assert u.api.get(u.url(f"/users/{u.name}"), timeout=60).status_code == 200
            assert requests.get(hub.url + "/hub/login", timeout=60).status_code == 200
            r = requests.get(server + "api/status", headers={"Authorization": f"token {one.token}"}, timeout=60)
            assert r.status_code == 200  # a running user's server, through the proxy
    finally:
        for p in pages:
            p.close()


def test_release_reaches_every_open_page_fifo(hub, crowd):
    """A stop admits the head of the queue; its page says so, the others move up."""
    running, waiting = full_queue(hub, crowd)
    pos = positions(crowd, waiting)
    order = sorted(waiting, key=pos.get)
    pages = {n: Stream(crowd[n]) for n in order[:8]}
    try:
        for n, p in pages.items():
            assert position(p.next(until=lambda e: position(e) is not None)) == pos[n]
        leaving = sorted(running.values())[0]
        crowd[leaving].stop()
        head = pages[order[0]].next(until=lambda e: "Admitted" in e.get("message", "") or e.get("ready"))
        assert "Admitted" in head["message"]  # seen before the server was ready: not lost
        for i, n in enumerate(order[1:8], 1):
            assert position(pages[n].next(until=lambda e: position(e) != i + 1)) == i
        crowd[order[0]].wait_ready()
        now = holders(hub)
        assert order[0] in now.values() and leaving not in now.values() and len(now) == GPUS
    finally:
        for p in pages.values():
            p.close()


def test_kill_9_mid_queue_keeps_every_place_and_admits_nobody_twice(hub, crowd):
    running, waiting = full_queue(hub, crowd)
    before = positions(crowd, waiting)
    assert sorted(before.values()) == list(range(1, len(USERS) - GPUS + 1))  # everyone else waits, no ties
    seen = len(hub.log.read_text().split("Re-spawned "))  # the log holds earlier restarts too

    services = children(hub.proc.pid, "gpuhub_spawner.culling.service")
    hub.proc.send_signal(signal.SIGKILL)
    hub.proc.wait()
    assert services  # the culler, which ends with the hub that started it (the new hub starts its own)
    wait_for(lambda: not [p for p in services if alive(p)], 30, "the killed hub's culler to end with it")
    hub.start()

    # the servers that ran still run, on the same devices; the queue holds nobody twice
    wait_for(lambda: len(hub.log.read_text().split("Re-spawned ")) >= seen + len(waiting), 120, "the queue to come back")
    assert holders(hub) == running
    after = positions(crowd, waiting)
    assert after == before  # every place kept

    # and the queue still moves in that order
    order = sorted(waiting, key=after.get)
    page = Stream(crowd[order[0]])
    try:
        page.next(until=lambda e: position(e) == 1)
        leaving = sorted(running.values())[0]
        crowd[leaving].stop()
        page.next(until=lambda e: "Admitted" in e.get("message", ""))
    finally:
        page.close()
    crowd[order[0]].wait_ready()
    now = holders(hub)
    assert len(now) == GPUS and len(set(now.values())) == GPUS and order[0] in now.values()
    assert positions(crowd, order[1:3]) == {order[1]: 1, order[2]: 2}


def test_planned_restart_keeps_every_place(hub, crowd):
    """An upgrade: SIGTERM, the hub's own shutdown (pending spawns are cancelled), start again."""
    running, waiting = full_queue(hub, crowd)
    before = positions(crowd, waiting)
    assert sorted(before.values()) == list(range(1, len(USERS) - GPUS + 1))
    seen = len(hub.log.read_text().split("Re-spawned "))
    hub.stop(kill_servers=False)
    hub.start()
    wait_for(lambda: len(hub.log.read_text().split("Re-spawned ")) >= seen + len(waiting), 120, "the queue to come back")
    assert holders(hub) == running
    assert positions(crowd, waiting) == before


def test_python_proxy_fallback_has_no_ten_stream_cap(tmp_path):
    """Where Node.js is missing the hub runs gpuhub-proxy: 12 open pages (> tornado's 10) starve nothing."""
    proxy = str(Path(sys.executable).parent / "gpuhub-proxy")
    h = Hub(
        tmp_path,
        POLICY.replace(f"virtual: {GPUS}", "virtual: 1").replace(f"nominal: {GPUS}", "nominal: 1"),
        extra_config=EXTRA,
        env={"GPUHUB_PROXY_COMMAND": proxy, "GPUHUB_SUBDOMAINS": "0"},
    )
    h.start()
    pages = []
    try:
        names = USERS[:13]
        with ThreadPoolExecutor(13) as pool:
            users = dict(zip(names, pool.map(h.login, names)))
        assert users[names[0]].start("gpu-1").status_code in (201, 202)
        users[names[0]].wait_ready()
        for n in names[1:]:
            asked = time.time()
            users[n].start_background("gpu-1")
            wait_for(lambda: users[n].server(), 30, f"{n}'s request to be pending", interval=0.1)
            pages.append(Stream(users[n]))
            first = pages[-1].next(until=lambda e: position(e) is not None)
            # opened as the request is made: the page must not claim a wait that did not happen
            assert first["gpuhub"]["waited"] <= time.time() - asked + 1, first
        pid = int((h.data / "proxy.pid").read_text())
        assert b"gpuhub-proxy" in Path(f"/proc/{pid}/cmdline").read_bytes()  # really the Python proxy
        one = users[names[0]]
        for _ in range(5):
            assert requests.get(h.url + "/hub/login", timeout=60).status_code == 200
            assert one.api.get(one.url(f"/users/{one.name}"), timeout=60).status_code == 200
            r = requests.get(
                h.server_url(one.server()["url"]) + "api/status", headers={"Authorization": f"token {one.token}"}, timeout=60
            )
            assert r.status_code == 200
    finally:
        for p in pages:
            p.close()
        h.stop()
