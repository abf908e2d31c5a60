"""Attacks on the MLflow identity proxy, replayed against a real hub and a real MLflow.

Each test performs an attack an ordinary hub user could make (issue 8, findings 3, 4,
8 and 9) and passes only because it fails now. Paths are sent with ``http.client`` so
that they reach the service byte for byte (``requests`` would normalise them), both on
the service port notebooks use (``MLFLOW_TRACKING_URI``) and on the public route
through the hub's proxy.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
from urllib.parse import urlsplit

import pytest

from mlflow_service import POLICY, MlflowEndpoint, mlflow_extra_config
from support.hub import Hub
from support.ports import free_port

pytestmark = pytest.mark.integration

API = "/api/2.0/mlflow"
PREFIX = "/services/mlflow"
MAX_UPLOAD = 512 * 2**20  # this hub's MlflowService.max_upload_size
MiB = 2**20


@pytest.fixture(scope="module")
def mlflow_hub(tmp_path_factory):
    port = free_port()
    hub = Hub(
        tmp_path_factory.mktemp("mlflow-attacks"), POLICY, extra_config=mlflow_extra_config(port, {"max_upload_size": MAX_UPLOAD})
    )
    hub.start(timeout=90)
    try:
        yield hub, MlflowEndpoint(hub, port)
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def users(mlflow_hub, mlflow):
    hub = mlflow_hub[0]
    clients = {name: hub.login(name) for name in ("alice", "bob", "carol", "erin")}
    mlflow.wait_ready(clients["alice"].token)
    return clients


def raw(
    base: str,
    method: str,
    path: str,
    token: str | None = None,
    body: bytes | None = None,
    headers: dict | None = None,
    cookies: str | None = None,
) -> tuple[int, bytes]:
    """One request with ``path`` sent exactly as written (no normalisation)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    if cookies:
        h["Cookie"] = cookies
    if body is not None:
        h.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def routes(mlflow: MlflowEndpoint) -> dict[str, str]:
    return {"service-port": mlflow.direct.rsplit(PREFIX, 1)[0], "public": mlflow.origin}


def experiment_by_name(mlflow, name):
    admin = mlflow.admin()
    r = admin.get(admin.base + API + "/experiments/get-by-name", params={"experiment_name": name})
    return r.json()["experiment"] if r.status_code == 200 else None


def own_run(mlflow, user) -> tuple[str, str]:
    s = mlflow.api(user.token)
    name = f"users/{user.name}/attacks"
    exp = s.get(mlflow.direct + API + "/experiments/get-by-name", params={"experiment_name": name})
    if exp.status_code == 200:
        exp_id = exp.json()["experiment"]["experiment_id"]
    else:
        r = s.post(mlflow.direct + API + "/experiments/create", json={"name": name})
        assert r.status_code == 200, r.text
        exp_id = r.json()["experiment_id"]
    r = s.post(mlflow.direct + API + "/runs/create", json={"experiment_id": exp_id, "start_time": 0})
    assert r.status_code == 200, r.text
    return exp_id, r.json()["run"]["info"]["run_id"]


# -- finding 3: one reading of the path ------------------------------------------------
@pytest.mark.parametrize("route", ["service-port", "public"])
def test_encoded_experiments_create_cannot_squat_a_personal_experiment(mlflow, users, route):
    base = routes(mlflow)[route]
    body = json.dumps({"name": "users/erin"}).encode()
    for path in (
        f"{PREFIX}{API}/%65xperiments/create",
        f"{PREFIX}/ajax-api/2.0/mlflow/experiments/%63reate",
        f"{PREFIX}/api/2.0/mlflow/experiments/create",
    ):
        status, data = raw(base, "POST", path, users["bob"].token, body)
        assert status == 403, (path, status, data[:300])
        assert b"reserved for hub user erin" in data
    assert experiment_by_name(mlflow, "users/erin") is None


@pytest.mark.parametrize("route", ["service-port", "public"])
def test_encoded_runs_create_cannot_record_another_user(mlflow, users, route):
    base = routes(mlflow)[route]
    exp_id, _ = own_run(mlflow, users["bob"])
    body = json.dumps(
        {"experiment_id": exp_id, "user_id": "alice", "start_time": 0, "tags": [{"key": "mlflow.user", "value": "alice"}]}
    ).encode()
    status, data = raw(base, "POST", f"{PREFIX}{API}/runs/%63reate", users["bob"].token, body)
    assert status == 200, data[:300]
    run = json.loads(data)["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["user_id"] == "bob" and tags["mlflow.user"] == "bob"


DOT_SEGMENT = re.compile(r"/(?:\.|%2[eE]){1,2}/")
AMBIGUOUS = [
    f"{PREFIX}{API}/experiments%2Fcreate",
    f"{PREFIX}{API}/experiments%2fcreate",
    f"{PREFIX}{API}/runs/../experiments/create",
    f"{PREFIX}{API}/runs/%2e%2e/experiments/create",
    f"{PREFIX}{API}/runs/%2E%2E/experiments/create",
    f"{PREFIX}{API}/./experiments/create",
    f"{PREFIX}{API}/%2e/experiments/create",
    f"{PREFIX}{API}//experiments/create",
    f"{PREFIX}/api/2.0//mlflow/experiments/create",
    f"{PREFIX}{API}/experiments%5Ccreate",
    f"{PREFIX}{API}/%2565xperiments/create",
]


@pytest.mark.parametrize("route", ["service-port", "public"])
def test_ambiguous_paths_are_refused_with_400(mlflow, users, route):
    base = routes(mlflow)[route]
    body = json.dumps({"name": "users/erin"}).encode()
    seen = {path: raw(base, "POST", path, users["bob"].token, body) for path in AMBIGUOUS}
    for path, (status, data) in seen.items():
        if route == "public" and DOT_SEGMENT.search(path):
            # The hub's proxy (Node configurable-http-proxy) resolves dot segments, encoded
            # ones included, before it forwards: the service gets experiments/create,
            # decides on that path, and its rule refuses the squat.
            assert status == 403 and b"reserved for hub user erin" in data, (path, status, data[:300])
        else:
            assert status == 400, (path, status, data[:300])
            assert b"Ambiguous request path" in data
    assert experiment_by_name(mlflow, "users/erin") is None


# -- finding 4: streamed bodies, an upload limit -------------------------------------------
def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(pid)


class RssSampler:
    def __init__(self, pid: int):
        self.pid = pid
        self.before = _rss(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.after = _rss(self.pid)


def _blocks(total: int, seed: bytes = b"gpuhub"):
    """``total`` bytes generated on the fly (never held at once), and their digest."""
    block = hashlib.sha256(seed).digest() * (MiB // 32)
    sent = 0
    while sent < total:
        piece = block[: min(len(block), total - sent)]
        sent += len(piece)
        yield piece


def test_large_upload_and_download_are_streamed_within_bounded_memory(mlflow, users):
    import os

    size = int(os.environ.get("GPUHUB_UPLOAD_MB", "200")) * MiB
    assert size <= MAX_UPLOAD
    alice = users["alice"]
    exp_id, run_id = own_run(mlflow, alice)
    path = f"{PREFIX}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/big.bin"
    u = urlsplit(mlflow.direct)
    pid = mlflow.service_pid()
    digest = hashlib.sha256()
    with RssSampler(pid) as up:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        conn.putrequest("PUT", path)
        conn.putheader("Authorization", f"Bearer {alice.token}")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        for piece in _blocks(size):
            digest.update(piece)
            conn.send(piece)
        r = conn.getresponse()
        body = r.read()
        conn.close()
    assert r.status == 200, body[:300]
    with RssSampler(pid) as down:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        conn.request("GET", path, headers={"Authorization": f"Bearer {alice.token}"})
        r = conn.getresponse()
        got = hashlib.sha256()
        n = 0
        while chunk := r.read(MiB):
            got.update(chunk)
            n += len(chunk)
        conn.close()
    assert r.status == 200 and n == size and got.hexdigest() == digest.hexdigest()
    print(
        f"\nproxy RSS for a {size // MiB} MiB artifact: before {up.before / MiB:.0f} MiB, "
        f"peak during upload {up.peak / MiB:.0f} MiB, after {up.after / MiB:.0f} MiB; "
        f"peak during download {down.peak / MiB:.0f} MiB"
    )
    assert up.peak - up.before < 64 * MiB, (up.before, up.peak)
    assert down.peak - down.before < 64 * MiB, (down.before, down.peak)


@pytest.mark.parametrize("route", ["service-port", "public"])
def test_upload_over_the_limit_gets_413_before_the_body_is_read(mlflow, users, route):
    alice = users["alice"]
    exp_id, run_id = own_run(mlflow, alice)
    u = urlsplit(routes(mlflow)[route])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.putrequest("PUT", f"{PREFIX}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/huge.bin")
    conn.putheader("Authorization", f"Bearer {alice.token}")
    conn.putheader("Content-Length", str(MAX_UPLOAD + 1))
    # What curl and other careful clients do for large bodies: ask before sending.
    conn.putheader("Expect", "100-continue")
    conn.endheaders()  # and no body: the answer must not wait for it
    r = conn.getresponse()
    data = r.read()
    conn.close()
    assert r.status == 413, data[:300]
    assert json.loads(data)["error_code"] == "REQUEST_LIMIT_EXCEEDED"


def test_upload_into_another_users_run_is_refused_by_mlflow(mlflow, users):
    """MLflow decides before reading the body (the proxy asks it with Expect: 100-continue);
    the refusal reaches the client as MLflow's 403, and nothing is written."""
    exp_id, run_id = own_run(mlflow, users["alice"])
    path = f"{PREFIX}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/planted.bin"
    size = 8 * MiB
    status, data = raw(
        mlflow.direct.rsplit(PREFIX, 1)[0],
        "PUT",
        path,
        users["carol"].token,
        body=b"".join(_blocks(size)),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert status == 403, data[:300]
    files = mlflow.api(users["alice"].token).get(mlflow.direct + API + "/artifacts/list", params={"run_id": run_id}).json()
    assert "planted.bin" not in {f["path"] for f in files.get("files", [])}


def test_json_bodies_the_proxy_reads_are_limited_too(mlflow, users):
    """The proxy holds the JSON bodies it rewrites (16 MiB at most, by default): a larger one,
    announced or chunked, gets 413 and never reaches MLflow."""
    _, run_id = own_run(mlflow, users["alice"])
    u = urlsplit(mlflow.direct)
    path = f"{PREFIX}{API}/runs/log-batch"
    limit = 16 * MiB
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.putrequest("POST", path)
    conn.putheader("Authorization", f"Bearer {users['alice'].token}")
    conn.putheader("Content-Length", str(limit + 1))
    conn.endheaders()  # answered from the head alone
    r = conn.getresponse()
    assert r.status == 413, r.read()[:300]
    conn.close()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    filler = b" " * MiB
    chunks = [b'{"run_id": "' + run_id.encode() + b'", "params": [{"key": "big", "value": "1"}]}']
    chunks += [filler] * 17  # JSON allows trailing whitespace: valid, just too large
    conn.request(
        "POST",
        path,
        body=iter(chunks),
        encode_chunked=True,
        headers={"Authorization": f"Bearer {users['alice'].token}", "Content-Type": "application/json"},
    )
    r = conn.getresponse()
    data = r.read()
    conn.close()
    assert r.status == 413, data[:300]
    run = mlflow.api(users["alice"].token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id}).json()["run"]
    assert "big" not in {p["key"] for p in run["data"].get("params", [])}


# -- finding 8: no account enumeration ----------------------------------------------------
def test_users_list_shows_only_the_caller(mlflow, users):
    for name in ("bob", "carol"):  # make sure several accounts exist
        mlflow.api(users[name].token).get(mlflow.direct + API + "/experiments/search", params={"max_results": 1})
    for path in (f"{PREFIX}{API}/users/list", f"{PREFIX}/ajax-api/2.0/mlflow/users/list", f"{PREFIX}{API}/users/%6cist"):
        status, data = raw(mlflow.direct.rsplit(PREFIX, 1)[0], "GET", path, users["bob"].token)
        if status == 200:
            assert [u["username"] for u in json.loads(data)["users"]] == ["bob"], data[:300]
        else:
            assert status == 403, data[:300]
    # ... while MLflow itself (as its admin) knows them all.
    admin = mlflow.admin()
    assert {"alice", "bob", "carol"} <= {u["username"] for u in admin.get(admin.base + API + "/users/list").json()["users"]}


def test_roles_are_not_enumerable(mlflow, users):
    mlflow.wait_ready(users["carol"].token)  # carol's first MLflow request gives her team (nlp) its role
    bob = mlflow.api(users["bob"].token)
    mine = bob.get(mlflow.direct + "/api/3.0/mlflow/users/roles/list", params={"username": "bob"})
    assert mine.status_code == 200, mine.text
    own = {r["id"] for r in mine.json()["roles"]}
    assert own, "bob is in team vision, so he holds its role"
    r = bob.get(mlflow.direct + "/api/3.0/mlflow/roles/list", params={"workspace": "default"})
    if r.status_code == 200:
        assert {role["id"] for role in r.json()["roles"]} <= own, r.text
    else:
        assert r.status_code == 403
    admin = mlflow.admin()
    every = admin.get(admin.base + "/api/3.0/mlflow/roles/list").json()["roles"]
    assert len(every) > len(own)  # other teams' roles exist and stay hidden
    other = next(role for role in every if role["id"] not in own)
    for path, params in (
        ("/api/3.0/mlflow/roles/get", {"role_id": other["id"]}),
        ("/api/3.0/mlflow/roles/users/list", {"role_id": other["id"]}),
        ("/api/3.0/mlflow/roles/permissions/list", {"role_id": other["id"]}),
        ("/api/3.0/mlflow/users/roles/list", {"username": "carol"}),
        ("/api/2.0/mlflow/users/get", {"username": "carol"}),
    ):
        r = bob.get(mlflow.direct + path, params=params)
        assert r.status_code == 403, (path, r.status_code, r.text[:300])


def test_a_refused_request_keeps_the_connection_for_the_next_one(mlflow, users):
    """MLflow's Python client reuses a kept-alive connection. A refusal decided before the
    (empty) body was read used to make tornado close the connection after answering, with
    no ``Connection: close``: the client's next request on it was reset (seen as a flaky
    ``ConnectionResetError`` in test_roles_are_not_enumerable)."""
    u = urlsplit(mlflow.direct)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Authorization": f"Bearer {users['bob'].token}"}
    try:
        for path in ("/api/3.0/mlflow/roles/get?role_id=1", "/api/3.0/mlflow/roles/users/list?role_id=1"):
            conn.request("GET", u.path + path, headers=headers)
            r = conn.getresponse()
            assert r.status == 403 and b"managed by the hub" in r.read()
            assert (r.getheader("Connection") or "").lower() != "close"
            time.sleep(0.3)  # a closing server's FIN has arrived by now
        conn.request("GET", u.path + "/api/2.0/mlflow/experiments/search?max_results=1", headers=headers)
        r = conn.getresponse()
        assert r.status == 200, r.read()[:300]
        r.read()
    finally:
        conn.close()


# -- finding 9: cookie-authenticated writes prove same origin --------------------------------
@pytest.fixture(scope="module")
def alice_browser(mlflow, users):
    """alice's browser cookies for the service (hub login + OAuth), as a Cookie header."""
    session = users["alice"].session
    r = session.get(mlflow.public + "/")
    assert r.status_code == 200 and r.url.startswith(mlflow.public), (r.status_code, r.url)
    host = urlsplit(mlflow.public).hostname
    return "; ".join(
        f"{c.name}={c.value}"
        for c in session.cookies
        if host == c.domain.lstrip(".")
        or host.endswith(c.domain if c.domain.startswith(".") else "." + c.domain)
        or c.domain in ("localhost", ".localhost", host)
    )


def test_cookie_writes_without_same_origin_proof_are_refused(mlflow, users, alice_browser):
    _, run_id = own_run(mlflow, users["alice"])
    base = mlflow.origin
    set_tag = f"{PREFIX}/ajax-api/2.0/mlflow/runs/set-tag"
    body = json.dumps({"run_id": run_id, "key": "csrf", "value": "x"}).encode()
    bob_origin = mlflow.hub.url.replace("://localhost", "://bob.localhost")
    attacks = {
        "Origin null": {"Origin": "null"},
        "Origin null, Sec-Fetch-Site same-origin": {"Origin": "null", "Sec-Fetch-Site": "same-origin"},
        "no Origin, no Sec-Fetch-Site": {},
        "another user's server (same site)": {"Origin": bob_origin, "Sec-Fetch-Site": "same-site"},
        "another user's server, old browser": {"Origin": bob_origin},
        "cross-site": {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
        "Sec-Fetch-Site none": {"Sec-Fetch-Site": "none"},
    }
    for what, headers in attacks.items():
        status, data = raw(base, "POST", set_tag, body=body, headers=headers, cookies=alice_browser)
        assert status == 403, (what, status, data[:300])
    # A form post of text/plain to upload-artifact: what a cross-site <form> can send.
    upload = f"{PREFIX}/ajax-api/2.0/mlflow/upload-artifact?run_uuid={run_id}&path=evil.txt"
    for headers in ({"Origin": "null"}, {}, {"Origin": bob_origin, "Sec-Fetch-Site": "same-site"}):
        status, data = raw(
            base, "POST", upload, body=b"owned=1", headers={"Content-Type": "text/plain", **headers}, cookies=alice_browser
        )
        assert status == 403, (headers, status, data[:300])
    run = mlflow.api(users["alice"].token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id}).json()["run"]
    assert "csrf" not in {t["key"] for t in run["data"].get("tags", [])}
    files = mlflow.api(users["alice"].token).get(mlflow.direct + API + "/artifacts/list", params={"run_id": run_id}).json()
    assert "evil.txt" not in {f["path"] for f in files.get("files", [])}

    # The same write from the service's own origin works, and so does a token without any.
    status, data = raw(
        base,
        "POST",
        set_tag,
        body=body,
        cookies=alice_browser,
        headers={"Origin": mlflow.origin, "Sec-Fetch-Site": "same-origin"},
    )
    assert status == 200, data[:300]
    status, data = raw(base, "POST", set_tag, body=body, cookies=alice_browser, headers={"Sec-Fetch-Site": "same-origin"})
    assert status == 200, data[:300]
    status, data = raw(base, "POST", set_tag, users["alice"].token, body)
    assert status == 200, data[:300]


# -- issue 19, item 6: a viewer is judged on what a request does, not its method -------------
LIST_ARTIFACTS = 'query Files { mlflowListArtifacts(input: {runId: "%s"}) { files { path } } }'
# The MLflow UI's run-page query (MLflow 3.17.2's bundle, trimmed): what a viewer may send.
UI_GET_RUN = (
    'query GetRun($data: MlflowGetRunInput!) @component(name: "MLflow.ExperimentRunTracking") '
    "{ mlflowGetRun(input: $data) { apiError { code message } run { info { runUuid artifactUri } "
    "data { metrics { key value } } } } }"
)


@pytest.fixture(scope="module")
def carols_artifact(mlflow, users):
    """A run of carol's (NLP) with an artifact: what the viewer victor must not list."""
    exp_id, run_id = own_run(mlflow, users["carol"])
    s = mlflow.api(users["carol"].token)
    r = s.put(
        f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/nlp-weights.txt",
        data=b"nlp secret",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    r = s.post(
        mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 0.5, "timestamp": 0, "step": 1}
    )
    assert r.status_code == 200, r.text
    return exp_id, run_id


@pytest.mark.parametrize("route", ["service-port", "public"])
def test_a_viewer_cannot_list_another_teams_artifacts_through_graphql(mlflow_hub, mlflow, users, carols_artifact, route):
    """victor (a viewer: MLflow READ on every experiment, kept off artifacts by the proxy)
    asks MLflow's /graphql for carol's artifact listing. The old rule let every GET through
    as a read, and MLflow reads a GET's JSON body; nor may the listing hide in a POST."""
    from urllib.parse import urlencode

    hub = mlflow_hub[0]
    victor, carol = hub.login("victor"), users["carol"]
    base = routes(mlflow)[route]
    _, run_id = carols_artifact
    graphql = f"{PREFIX}/graphql"
    listing = LIST_ARTIFACTS % run_id
    allowed_run = 'mlflowGetRun(input: {runId: "%s"}) { run { info { runUuid } } }' % run_id
    attacks = {
        "GET with a JSON body": ("GET", graphql, {"query": listing}),
        "GET with the query string": ("GET", graphql + "?" + urlencode({"query": listing}), None),
        "POST": ("POST", graphql, {"query": listing}),
        "POST with a query string": ("POST", graphql + "?" + urlencode({"query": "{ __typename }"}), {"query": listing}),
        "POST, aliased next to an allowed field": (
            "POST",
            graphql,
            {"query": "query { r: %s f: %s }" % (allowed_run, listing.split("{", 1)[1].rsplit("}", 1)[0])},
        ),
        "POST, through a fragment": (
            "POST",
            graphql,
            {"query": "query Q { ...F } fragment F on Query { %s }" % listing.split("{", 1)[1].rsplit("}", 1)[0]},
        ),
        "POST, a second operation beside the named one": (
            "POST",
            graphql,
            {"query": "query Ok { %s } %s" % (allowed_run, listing), "operationName": "Files"},
        ),
    }
    seen = {}
    for what, (method, path, payload) in attacks.items():
        body = None if payload is None else json.dumps(payload).encode()
        status, data = raw(base, method, path, victor.token, body)
        seen[what] = (status, b"nlp-weights" in data, data[:200])
    assert not [what for what, (_, leaked, _) in seen.items() if leaked], seen
    assert all(status in (400, 403) for status, _, _ in seen.values()), seen
    # A body on a GET is refused for everyone, not only viewers (MLflow would read it).
    status, data = raw(base, "GET", f"{PREFIX}{API}/runs/get", carol.token, json.dumps({"run_id": run_id}).encode())
    assert status == 400 and b"must not carry a body" in data, (status, data[:300])

    # What a team member legitimately sends works: carol lists her own run's artifacts.
    status, data = raw(base, "POST", graphql, carol.token, json.dumps({"query": listing}).encode())
    assert status == 200, data[:300]
    assert [f["path"] for f in json.loads(data)["data"]["mlflowListArtifacts"]["files"]] == ["nlp-weights.txt"]
    # And the viewer may open the run the way the MLflow UI does (issue 20): metrics, no files.
    status, data = raw(
        base,
        "POST",
        graphql,
        victor.token,
        json.dumps({"query": UI_GET_RUN, "operationName": "GetRun", "variables": {"data": {"runId": run_id}}}).encode(),
    )
    assert status == 200, data[:300]
    run = json.loads(data)["data"]["mlflowGetRun"]["run"]
    assert run["info"]["runUuid"] == run_id and [m["key"] for m in run["data"]["metrics"]] == ["loss"]
