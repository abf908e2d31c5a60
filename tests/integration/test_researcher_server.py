"""What a researcher meets in their own server, on a hub in the default configuration (MLflow on).

Issue 20: with MLflow on, the server token lost the scopes JupyterLab's cull warning needs (every
poll of the server's relay answered 404) and ``gpuhub usage`` in a terminal was refused; and the
terminal (a login shell: Debian's ``/etc/profile`` resets ``PATH`` for non-root users) had no
``gpuhub`` or ``python``. Here through a real terminal (terminado over its websocket, as
JupyterLab opens one) and the relay JupyterLab polls, on a real hub with real MLflow, as root
(each server its own Unix account) where the machine allows.

Culling at production ratios, compressed with the hub's own settings: the culler passes every
5 s, the hub and the servers sync activity every 5 s, a server whose (virtual, so idle) GPU was
idle for 20 s is warned 15 s before it is stopped. (A GPU rule, because an open JupyterLab polls
through the proxy, which is activity: ``timeout`` would never fire with the tab open.)
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import requests
import websocket

from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 1}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 1}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - slug: gpu-1
    displayName: One GPU
    gpu: {count: 1, flavor: gpu}
    teams: [vision]
    idle: {timeout: 1h, gpuIdleTimeout: 20s, warning: 15s, snooze: 30s, maxSnoozes: 1}
"""

EXTRA_CONFIG = """
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL="5")
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(
        tmp_path_factory.mktemp("researcher"),
        POLICY,
        extra_config=EXTRA_CONFIG,
        mlflow=True,
        env={"GPUHUB_CULL_EVERY": "5"},
        start_timeout=120,
    ) as h:
        yield h


@pytest.fixture(scope="module")
def alice_login(hub):
    a = hub.login("alice")
    yield a
    a.stop()


@pytest.fixture
def alice(alice_login):
    """alice with a GPU server just started. Its (virtual) GPU reads idle, so the culler warns
    it 20 s on and stops it 15 s later: each test gets a whole lifetime of its own, whatever
    ran before it (a server shared by the module was gone or about to go for a later test)."""
    a = alice_login
    if a.server() is not None:
        a.stop()
        a.wait_gone()
    r = a.start("gpu-1")
    assert r.status_code in (201, 202), r.text
    a.wait_ready()
    return a


class Terminal:
    """A JupyterLab terminal: created through the server's REST API, driven over terminado's
    websocket (``["stdin", text]`` in, ``["stdout", text]`` out)."""

    def __init__(self, base: str, token: str):
        self.base, self.token = base, token
        r = requests.post(base + "api/terminals", headers={"Authorization": f"token {token}"}, json={})
        r.raise_for_status()
        self.name = r.json()["name"]
        ws_url = base.replace("http", "ws", 1) + f"terminals/websocket/{self.name}"
        self.ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"], timeout=60)

    def run(self, line: str, timeout: float = 60) -> str:
        """Type ``line`` and return what the shell printed up to a marker echoed after it."""
        marker = uuid.uuid4().hex[:12]
        self.ws.send(json.dumps(["stdin", f"{line}; echo END-$((0x{marker[:6]}+1))\r"]))
        want = f"END-{int(marker[:6], 16) + 1}"  # only the shell's arithmetic prints this, not the echo of the line
        out, deadline = "", time.time() + timeout
        while want not in out:
            if time.time() > deadline:
                raise AssertionError(f"no {want} from the terminal after {timeout}s:\n{out}")
            msg = json.loads(self.ws.recv())
            if msg[0] == "stdout":
                out += msg[1]
        return out

    def close(self) -> None:
        self.ws.close()
        requests.delete(self.base + f"api/terminals/{self.name}", headers={"Authorization": f"token {self.token}"})


def test_the_terminal_has_the_servers_tools_and_gpuhub_works_there(hub, alice):
    server = alice.server()
    base = hub.server_url(server["url"])
    term = Terminal(base, alice.token)
    try:
        out = term.run("command -v python gpuhub mlflow")
        server_env = alice.server_env()
        bindir = server_env["PATH"].split(":")[0]
        for tool in ("python", "gpuhub", "mlflow"):
            assert f"{bindir}/{tool}" in out, (tool, out)
        assert "command not found" not in out
        # gpuhub's CLI reaches the hub with the server's own token (custom:gpuhub:usage).
        out = term.run("gpuhub usage --since 1d --by team >/dev/null && echo USAGE-OK-$((40+2))")
        assert "USAGE-OK-42" in out, out
        assert "custom:gpuhub:usage" not in out
        # and the job CLI too (custom:gpuhub:jobs!user), in the spelling docs/jobs.md gives
        out = term.run("gpuhub job list >/dev/null && echo JOBS-OK-$((40+2))")
        assert "JOBS-OK-42" in out, out
    finally:
        term.close()


def test_jupyterlab_gets_the_cull_warning_through_its_server_with_mlflow_on(hub, alice):
    """The relay JupyterLab's extension polls answers with the hub's warning, not 404."""
    server = alice.server()
    base = hub.server_url(server["url"])
    s = requests.Session()
    s.headers["Authorization"] = f"token {alice.token}"
    first = s.get(base + "gpuhub/culling")
    assert first.status_code == 200, (first.status_code, first.text[:300])
    # The relay answers 200 either way; a refused server token shows as its "error"
    # ("the hub has no culling endpoint": JupyterHub's 404 for a missing scope).
    assert first.json()["enabled"] and "error" not in first.json(), first.json()

    def warned():
        r = s.get(base + "gpuhub/culling")
        assert r.status_code == 200 and "error" not in r.json(), (r.status_code, r.text[:300])
        return r.json().get("warning")

    warning = wait_for(warned, 90, "the hub's cull warning through alice's server", interval=1)
    assert "idle" in json.dumps(warning).lower(), warning


def test_the_home_page_says_what_the_server_holds_and_when_idleness_stops_it(hub, alice):
    home = alice.session.get(hub.url + "/hub/home").content.decode()  # UTF-8, as the page's <meta> says
    assert 'id="gpuhub-servers"' in home, home[:2000]
    row = home.split('class="gpuhub-server" data-server=""', 1)[1].split("</tr>", 1)[0]
    assert "One GPU" in row and "Vision Lab" in row
    # The GPU it holds, counted and named: "1 × Tesla (device 0)", not a bare device index.
    assert f"1 × Tesla (device {alice.server_env()['CUDA_VISIBLE_DEVICES']})" in row, row
    assert "stopped after its GPUs idle for 20s or no use for 1h, with 15s warning" in row, row
