"""``<base_url>gpuhub/ray/<name>/dashboard/...``: the user's Ray dashboard served by their own
server, on their origin (docs/ray.md), against a stand-in for the hub's Ray API and a stand-in
dashboard (the real Ray dashboard, behind a real hub, is ``tests/integration/test_ray_cluster.py``).

It forwards only with the server's own authentication, only to the port the hub names for one
of the caller's running clusters, only while that port's listening socket is this account's,
with the user's Ray token added and the browser's cookies left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from nbside import NotebookServer

from support.ports import free_port

USER = "alice"
HUB_TOKEN = "server-token-" + uuid.uuid4().hex
RAY_TOKEN = "ray-token-" + uuid.uuid4().hex


class Recorder:
    def __init__(self, handle):
        self.requests: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _do(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                recorder.requests.append({"method": method, "path": self.path, "headers": dict(self.headers), "body": body})
                status, reply, extra = handle(method, self.path, self.headers)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._do("GET")

            def do_POST(self):
                self._do("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def dashboard():
    d = Recorder(lambda method, path, headers: (200, {"ray_version": "stand-in", "path": path}, {"Set-Cookie": "ray=1; Path=/"}))
    yield d
    d.close()


@pytest.fixture(scope="module")
def clusters():
    return {}  # name -> the view the hub answers for it


@pytest.fixture(scope="module")
def hub(clusters):
    def handle(method, path, headers):
        if headers.get("Authorization") != f"token {HUB_TOKEN}":
            return 403, {"message": "bad token"}, {}
        prefix = "/hub/api/gpuhub/ray/"
        name = path.split("?")[0][len(prefix) :] if path.startswith(prefix) else None
        if method != "GET" or name not in clusters:
            return 404, {"message": "No such Ray cluster."}, {}
        return 200, clusters[name], {}

    h = Recorder(handle)
    yield h
    h.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, hub):
    workdir = tmp_path_factory.mktemp("raydash")
    (workdir / ".ray").mkdir()
    (workdir / ".ray" / "auth_token").write_text(RAY_TOKEN + "\n")  # where the cluster writes it
    s = NotebookServer(
        workdir,
        {
            "JUPYTERHUB_API_URL": f"http://127.0.0.1:{hub.port}/hub/api",
            "JUPYTERHUB_API_TOKEN": HUB_TOKEN,
            "JUPYTERHUB_USER": USER,
            "RAY_AUTH_TOKEN": None,
        },
        base_url=f"/user/{USER}/",
    ).start()
    yield s
    s.stop()


def running(port: int) -> dict:
    return {"state": "running", "status": "running: ...", "dashboard_port": port}


def test_the_owner_gets_her_dashboard_with_her_ray_token_and_without_her_cookies(server, dashboard, clusters):
    clusters["mine"] = running(dashboard.port)
    dashboard.requests.clear()
    r = server.get("gpuhub/ray/mine/dashboard/api/version?verbose=1", cookies={"jupyterhub-user-alice": "secret"})
    assert r.status_code == 200, r.text + server.tail()
    assert r.json() == {"ray_version": "stand-in", "path": "/api/version?verbose=1"}
    assert "ray=1" not in r.headers.get("Set-Cookie", "")  # the dashboard's cookie stays out of her origin
    (seen,) = dashboard.requests
    assert seen["headers"]["Authorization"] == f"Bearer {RAY_TOKEN}"
    assert "Cookie" not in seen["headers"] and HUB_TOKEN not in json.dumps(seen["headers"])


def test_nobody_else_reaches_it(server, dashboard, hub, clusters):
    clusters["mine"] = running(dashboard.port)
    dashboard.requests.clear()
    url = server.url + "gpuhub/ray/mine/dashboard/api/version"
    assert requests.get(url, timeout=20, allow_redirects=False).status_code in (302, 403)  # not logged in
    assert requests.get(url, headers={"Authorization": "token someone-elses"}, timeout=20, allow_redirects=False).status_code in (
        302,
        403,
    )
    assert requests.post(url, timeout=20).status_code == 403
    assert dashboard.requests == []


def test_a_dashboard_action_from_another_site_is_refused(server, dashboard, clusters):
    """Ray kills an actor on a GET: a link on another site must not make the owner's browser do it."""
    clusters["mine"] = running(dashboard.port)
    dashboard.requests.clear()
    url = server.url + "gpuhub/ray/mine/dashboard/api/actors/kill?actor_id=abc&force_kill=true"
    for site in ("cross-site", "same-site"):
        r = requests.get(url, headers={**server.headers(), "Sec-Fetch-Site": site}, timeout=20)
        assert r.status_code == 403 and "dashboard's own page" in r.text, (site, r.status_code, r.text)
    for sneaky in ("%2561pi/actors/kill", "api/actors/%256Bill", "x/%252E%252E/api/actors/kill"):  # decoded again upstream
        r = requests.get(
            server.url + f"gpuhub/ray/mine/dashboard/{sneaky}?actor_id=abc",
            headers={**server.headers(), "Sec-Fetch-Site": "cross-site"},
            timeout=20,
        )
        assert r.status_code in (400, 403), (sneaky, r.status_code, r.text)
    assert dashboard.requests == []
    r = requests.get(url, headers={**server.headers(), "Sec-Fetch-Site": "same-origin"}, timeout=20)
    assert r.status_code == 200 and len(dashboard.requests) == 1  # the dashboard's own button
    r = requests.get(
        server.url + "gpuhub/ray/mine/dashboard/api/version",
        headers={**server.headers(), "Sec-Fetch-Site": "cross-site"},
        timeout=20,
    )
    assert r.status_code == 200  # reading is not acting


def test_only_the_callers_running_clusters(server, dashboard, clusters):
    dashboard.requests.clear()
    r = server.get("gpuhub/ray/not-mine/dashboard/")
    assert r.status_code == 404 and "no Ray cluster named not-mine" in r.text
    clusters["queued"] = {"state": "queued", "status": "queued: position 1 of 1", "dashboard_port": None}
    r = server.get("gpuhub/ray/queued/dashboard/")
    assert r.status_code == 404 and "has no dashboard now (queued: position 1 of 1)" in r.text
    assert dashboard.requests == []


@pytest.mark.skipif(os.geteuid() != 0, reason="another account's listener needs root to start")
def test_a_port_another_account_listens_on_gets_nothing(server, clusters):
    """If the dashboard died and another account took its port, the owner's token and requests
    must not go there: the kernel's socket table names the listener's account."""
    probe = (
        "import socket,sys,time\ns=socket.socket()\ns.bind(('127.0.0.1',0))\ns.listen(8)\n"
        "print(s.getsockname()[1],flush=True)\ns.settimeout(30)\n"
        "try:\n  c,_=s.accept();print('CONNECTED',flush=True)\nexcept OSError:\n  pass\n"
    )
    p = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        port = int(p.stdout.readline())
        clusters["stolen"] = running(port)
        r = server.get("gpuhub/ray/stolen/dashboard/api/version")
        assert r.status_code == 502 and "not listening on its port" in r.text, r.text
    finally:
        p.kill()
        out = p.communicate()[0]
    assert "CONNECTED" not in out


def test_nothing_listening_is_a_502_not_a_hang(server, clusters):
    # A port nothing listens on, from this worker's block (support/ports.py): one bound to port 0
    # and closed is the ephemeral range's, which any process on the machine may listen on, or a
    # client connection take, before the server forwards there.
    port = free_port()
    clusters["gone"] = running(port)
    t0 = time.time()
    r = server.get("gpuhub/ray/gone/dashboard/")
    assert r.status_code == 502 and time.time() - t0 < 15


def test_listening_uids_reads_the_kernels_table(tmp_path):
    from gpuhub_notebook.ray_dashboard import listening_uids

    (tmp_path / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:2049 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 1\n"
        "   1: 0100007F:2049 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1002        0 2\n"
        "   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3\n"
    )
    (tmp_path / "tcp6").write_text(
        "  sl  local_address                         remote_address                        st ...\n"
        "   0: 00000000000000000000000000000000:2049 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000  1003        0 4\n"
    )
    assert listening_uids(0x2049, str(tmp_path)) == {1001, 1003}  # the established one (1002) is no listener
    assert listening_uids(8080, str(tmp_path)) == {0}
    assert listening_uids(1, str(tmp_path)) == set()
