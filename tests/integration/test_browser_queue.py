"""In a real Chromium: a user sees only their team's profiles and the queue in plain words."""

import json
import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from support.browser import CHROMIUM, log_in, wait_lab_whole
from support.hub import processes_with_env, running_hub
from test_local_hub import POLICY

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    # The product's default URL (JupyterLab), not the test hubs' lighter /tree.
    with running_hub(tmp_path_factory.mktemp("browser"), POLICY, extra_config="c.Spawner.default_url = '/lab'\n", lab=True) as h:
        yield h


def login(browser, hub, name):
    page = browser.new_context().new_page()
    log_in(page, hub.url, name)
    page.wait_for_url("**/hub/spawn**")
    return page


def test_queue_message_on_the_spawn_page(hub, browser, tmp_path):
    alice = login(browser, hub, "alice")
    labels = alice.locator("#gpuhub-profiles input[name=profile]")
    assert sorted(labels.evaluate_all("els => els.map(e => e.value)")) == ["cpu", "gpu-1"]
    alice.check("input[value=gpu-1]")
    alice.click("form button[type=submit], form input[type=submit]")
    alice.wait_for_url("**/user/alice/**", timeout=90_000)

    bob = login(browser, hub, "bob")
    bob.check("input[value=gpu-1]")
    bob.click("form button[type=submit], form input[type=submit]")
    message = bob.locator("#progress-message")
    message.filter(has_text="position 1 of 1").wait_for(timeout=30_000)
    text = message.inner_text()
    assert "Vision Lab's queue" in text and "needs 1 Tesla GPU: your team Vision Lab is using 1 of the 1 it may hold" in text
    bob.screenshot(path=str(tmp_path / "queued.png"))

    # alice stops: bob's page moves on by itself to the running server
    hub.login("alice").stop()
    bob.wait_for_url("**/user/bob/**", timeout=90_000)
    hub.login("bob").stop()


@pytest.mark.parametrize(
    "last_word",
    [
        {"progress": 100, "ready": True, "message": "Server ready at /user/bob/", "url": "/user/bob/"},
        {"progress": 100, "failed": True, "message": "Spawn cancelled"},
    ],
    ids=["ready", "cancelled"],
)
def test_a_hub_going_down_does_not_end_the_waiting_page(hub, browser, last_word):
    """A hub shutting down (a restart) cancels the spawns in its queue, and JupyterHub's
    progress stream then says "ready" (the server's record outlives a cancelled spawn) or
    "Spawn cancelled", as its last word before it stops answering. Seen in a whole run: bob's
    waiting page believed "ready", reloaded while the hub was down and showed the proxy's 503
    page instead of his place in the queue. A last word from a hub that no longer answers is a
    lost stream: the page says so, keeps its place and follows the restarted hub."""
    hub.stop_servers("alice", "bob")  # whatever ran before (any order)
    alice = hub.login("alice")
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    assert hub.login("bob").start("gpu-1").status_code == 202  # bob waits behind alice

    # The hub going down, as the page meets it: the stream's last word, then no answer.
    def hub_root(url: str) -> bool:  # what the page asks to learn whether the hub answers
        return urlparse(url).path.endswith("/hub/api/")

    def stream(url: str) -> bool:
        return urlparse(url).path.endswith("/users/bob/server/progress")

    def down(route):
        route.fulfill(status=503, body="the hub is restarting")

    def last(route):
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            body=f"data: {json.dumps(last_word)}\n\n",
        )

    ctx = browser.new_context()
    try:
        ctx.route(hub_root, down)
        ctx.route(stream, last)
        page = ctx.new_page()
        log_in(page, hub.url, "bob")
        page.wait_for_url("**/hub/spawn-pending/bob**")
        note = page.locator("#gpuhub-reconnect", has_text="Lost contact with the hub")
        note.wait_for(timeout=30_000)  # the last word was taken for a lost stream
        assert "/hub/spawn-pending/bob" in page.url
        page.evaluate("window.__same_page = true")  # gone if the page reloads
        navigations = []
        page.on("framenavigated", lambda f: f == page.main_frame and navigations.append(f.url))
        ctx.unroute(hub_root, down)  # the hub is back
        ctx.unroute(stream, last)
        page.locator("#progress-message").filter(has_text="position 1 of 1").wait_for(timeout=60_000)
        assert not navigations and page.evaluate("window.__same_page === true"), navigations
        assert note.count() == 0 or not note.is_visible()
    finally:
        ctx.close()
        hub.stop_servers("bob", "alice")


def _listening_since(run_id: str, user: str, stop: threading.Event, seen: dict) -> None:
    """Watch, from outside the hub, for the moment carol's server process first listens:
    its processes (found by this hub's run marker and the user in their environment) and
    the kernel's listening sockets, every 20 ms."""
    marker = f"GPUHUB_TEST_RUN={run_id}"
    while not stop.is_set() and "listen" not in seen:
        for pid in processes_with_env(marker):
            inodes = set()
            try:
                if f"JUPYTERHUB_USER={user}\0".encode() not in Path(f"/proc/{pid}/environ").read_bytes():
                    continue
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
                # the process's own view of the network: as root its user's, behind the wall
                for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
                    with open(table) as f:
                        next(f)
                        if any(p[3] == "0A" and int(p[9]) in inodes for p in (line.split() for line in f)):
                            seen["listen"] = time.monotonic()
            except OSError:
                continue
        time.sleep(0.02)


def test_the_spawn_page_moves_to_jupyterlab_when_the_server_listens(hub, browser):
    """No polling delay between a server being able to answer and the user's page going
    there: the hub learns it from the kernel (local/listening.py), the spawn page's event
    stream says ready, the browser follows. Stock JupyterHub polls the server with a
    growing back-off (steps of 1.6-5 s by the time a server has started)."""
    carol = login(browser, hub, "carol")
    navigated: dict[str, float] = {}
    carol.on(
        "request",
        lambda r: (
            navigated.setdefault("lab", time.monotonic()) if r.is_navigation_request() and "/user/carol/" in r.url else None
        ),
    )
    seen: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_listening_since, args=(hub.run_id, "carol", stop, seen), daemon=True)
    watcher.start()
    try:
        carol.check("input[value=cpu]")
        carol.click("form button[type=submit], form input[type=submit]")
        carol.locator("#jp-main-dock-panel").wait_for(timeout=90_000)
        wait_lab_whole(carol)
        carol.locator(".jp-Launcher").wait_for()  # JupyterLab's launcher, on screen
    finally:
        stop.set()
        watcher.join(5)
    try:
        assert "listen" in seen, "carol's server was never seen listening"
        gap = navigated["lab"] - seen["listen"]
        print(f"server listening -> the browser asks for it: {gap * 1000:.0f} ms")
        assert gap < 1.5, f"the page moved to the server {gap:.2f}s after it listened"  # 0.5 s measured here
    finally:
        hub.login("carol").stop()
