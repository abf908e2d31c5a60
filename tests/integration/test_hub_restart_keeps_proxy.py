"""Issue 20, item 5: a hub restart keeps the proxy, so open Labs and waiting pages see no outage.

Before: the restarted hub killed the proxy its predecessor left (JupyterHub's
``_check_previous_process``) and started one with a new random token; for the seconds until
the routes came back every request to a running server was refused or got a 503, every open
Lab said "Your server ... is not running", and every waiting page's progress stream died.
"""

import http.server
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from support.browser import CHROMIUM, chromium, log_in, wait_lab_whole
from support.hub import alive, running_hub, wait_for
from test_local_hub import POLICY

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("keptproxy"), POLICY, lab=True) as h:  # an open JupyterLab across the restart
        yield h


def proxy_pid(hub) -> int:
    return int((hub.data / "proxy.pid").read_text().strip())


def restart(hub):
    hub.stop(kill_servers=False)
    hub.start(timeout=120)


def log_since(hub, offset: int) -> str:
    return hub.log.read_text(errors="replace")[offset:]


def test_running_server_answers_through_the_proxy_during_a_restart(hub):
    alice = hub.login("alice")
    if alice.server() is not None:  # left by the browser test (any order)
        alice.stop()
        alice.wait_gone()
    assert alice.start("cpu").status_code in (201, 202)
    s = alice.wait_ready()
    url = hub.server_url(s["url"]) + "api/status"
    headers = {"Authorization": f"token {alice.token}"}
    assert requests.get(url, headers=headers, timeout=10).status_code == 200  # warms the server's token cache
    pid = proxy_pid(hub)

    results, stop = [], threading.Event()

    def hammer():  # a new connection each time, no retries: what an open Lab's polls meet
        while not stop.is_set():
            try:
                code = requests.get(url, headers=headers, timeout=10).status_code
            except requests.RequestException as e:
                code = repr(e)[:120]
            results.append((time.time(), code))
            time.sleep(0.1)

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    offset = len(hub.log.read_text(errors="replace"))
    try:
        wait_for(lambda: len(results) >= 5, 30, "the first requests")
        restart(hub)
        after = len(results)
        # and until the restarted hub has re-checked every route (init_spawners, check_routes)
        wait_for(lambda: len(results) >= after + 30, 60, "requests after the restart")
    finally:
        stop.set()
        t.join(15)
    failures = [(when, code) for when, code in results if code != 200]
    assert not failures, f"{len(failures)} of {len(results)} requests failed during the restart: {failures[:5]}"
    assert proxy_pid(hub) == pid and alive(pid), "the proxy was replaced"
    assert "Keeping the running proxy" in log_since(hub, offset)
    assert hub.login("alice").server()["ready"]
    assert requests.get(url, headers=headers, timeout=10).status_code == 200
    assert stat.S_IMODE((hub.data / "proxy-auth-token").stat().st_mode) == 0o600  # kept for the next restart


def test_waiting_page_and_open_lab_survive_a_restart(hub, tmp_path):
    """In Chromium: bob waits behind alice in Vision Lab's queue, alice has JupyterLab open."""
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    hub.stop_servers("alice", "bob")
    alice_api = hub.login("alice")
    assert alice_api.start("gpu-1").status_code in (201, 202)
    alice_api.wait_ready()
    pid = proxy_pid(hub)

    with chromium() as browser:
        try:

            def login(name):
                page = browser.new_context().new_page()
                log_in(page, hub.url, name)
                page.wait_for_url(lambda u: "/hub/login" not in u, timeout=90_000)
                return page

            lab = login("alice")
            lab.goto(hub.server_url(alice_api.server()["url"]) + "lab", timeout=120_000)
            lab.locator("#jp-main-dock-panel").wait_for(timeout=120_000)
            wait_lab_whole(lab)

            bob = login("bob")
            bob.goto(hub.url + "/hub/spawn")
            bob.check("input[value=gpu-1]")
            bob.click("form button[type=submit], form input[type=submit]")
            message = bob.locator("#progress-message")
            message.filter(has_text="position 1 of 1").wait_for(timeout=60_000)
            bob.evaluate("window.__same_page = true")  # gone if the page reloads
            logged_before = bob.locator(".progress-log-event").count()
            assert logged_before >= 1

            navigations = []
            bob.on("framenavigated", lambda f: f == bob.main_frame and navigations.append(f.url))

            restart(hub)

            # the waiting page finds the restarted hub by itself and follows progress again:
            # the message, blanked here, comes back from the new hub's stream, with no reload
            bob.evaluate("document.getElementById('progress-message').textContent = ''")
            message.filter(has_text="position 1 of 1").wait_for(timeout=90_000)
            assert not navigations and bob.evaluate("window.__same_page === true"), navigations
            assert bob.locator(".progress-log-event").count() >= logged_before  # the log is kept
            bob.screenshot(path=str(tmp_path / "waiting-after-restart.png"))

            # the open Lab never thought its server had stopped
            lab.wait_for_timeout(2_000)
            dialogs = lab.locator(".jp-Dialog")
            texts = dialogs.all_inner_texts() if dialogs.count() else []
            assert not any("not running" in t or "Server connection error" in t for t in texts), texts
            lab.screenshot(path=str(tmp_path / "lab-after-restart.png"))
            assert proxy_pid(hub) == pid

            # alice stops: bob's page moves on to his server, as without a restart
            hub.login("alice").stop()
            bob.wait_for_url("**/user/bob/**", timeout=120_000)
        finally:
            browser.close()
    hub.stop_servers("bob", "alice")


def _replace_proxy_with(hub, argv_of, env=None) -> int:
    """Stop the hub, end its (kept) proxy, put the process ``argv_of(old cmdline)`` at the pid file."""
    hub.stop(kill_servers=False)
    pid = proxy_pid(hub)
    old = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not alive(pid), 20, "the kept proxy to end")
    # detached (not this test's child, as a proxy left by an earlier hub is not the new hub's)
    out = subprocess.run(
        ["sh", "-c", '"$@" >/dev/null 2>&1 </dev/null & echo $!', "sh", *[a.decode() for a in argv_of(old)]],
        env=env,
        start_new_session=True,
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())
    (hub.data / "proxy.pid").write_text(str(pid))
    return pid


def _end(pid):
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_proxy_with_another_command_line_is_not_adopted(hub):
    token = (hub.data / "proxy-auth-token").read_text().strip()

    def other_default_target(old):
        return [a for a in old if not a.startswith(b"--default-target")] + [b"--default-target=http://127.0.0.1:9/"]

    foreign = _replace_proxy_with(hub, other_default_target, env=dict(os.environ, CONFIGPROXY_AUTH_TOKEN=token))
    try:
        api = f"http://127.0.0.1:{hub.proxy_port}/api/routes"
        wait_for(lambda: _answers(api, token), 30, "the foreign proxy's API")  # same token: only the command differs
        offset = len(hub.log.read_text(errors="replace"))
        hub.start(timeout=120)
        assert proxy_pid(hub) != foreign
        assert not alive(foreign)  # stopped, as JupyterHub stops a previous proxy
        assert "is not the proxy this hub would run" in log_since(hub, offset)
        assert "Keeping the running proxy" not in log_since(hub, offset)
    finally:
        _end(foreign)


def test_a_reused_pid_is_neither_adopted_nor_killed(hub):
    bystander = _replace_proxy_with(hub, lambda old: [b"sleep", b"600"])
    try:
        offset = len(hub.log.read_text(errors="replace"))
        hub.start(timeout=120)
        assert proxy_pid(hub) != bystander
        assert alive(bystander), "an unrelated process at the stale pid was signalled"
        assert "which is not a proxy" in log_since(hub, offset)
    finally:
        _end(bystander)


def _answers(url, token) -> bool:
    try:
        return requests.get(url, headers={"Authorization": f"token {token}"}, timeout=3).status_code == 200
    except requests.RequestException:
        return False


def test_a_hub_whose_public_port_is_taken_refuses_to_start(hub):
    """Another process already listens on the hub's public port (any local account can bind an
    unprivileged port first). configurable-http-proxy logs EADDRINUSE and runs on with only its
    API, and stock JupyterHub reports "running at" that port: users' logins would go to the
    squatter. The hub must refuse to start, say why, and leave no proxy behind."""
    hub.stop()  # the hub and its kept proxy: the port is free
    wait_for(lambda: not _listening(hub.port), 20, "the hub's public port to be free")
    offset = len(hub.log.read_text(errors="replace"))

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # a look-alike login page: 404 for the hub's API, so start() keeps waiting
            self.send_response(200 if self.path.startswith("/hub/login") else 404)
            self.end_headers()
            self.wfile.write(b"<form>Sign in</form>")

        def log_message(self, *args):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", hub.port), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="hub exited with 1"):
            hub.start(timeout=120)
        log = log_since(hub, offset)
        assert "is not served by its proxy" in log and f"already listens on port {hub.port}" in log, log[-3000:]
        # Who holds it (the squatter is this test's own process) and the way out the README's
        # command takes.
        assert f"pid {os.getpid()}: " in log and "gpuhub run --port N" in log, log[-3000:]
        assert "JupyterHub is now running" not in log
        assert not _listening(hub.proxy_port), "the proxy was left running (its API still listens)"
    finally:
        squatter.shutdown()
        squatter.server_close()
    hub.start(timeout=120)  # the port is free again: the module's hub runs on for the other tests
    assert requests.get(hub.url + "/hub/login", timeout=10).status_code == 200


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
