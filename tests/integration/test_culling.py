"""Culling in a real hub, with the real culler service and real servers, at production ratios.

Culler pass 5 s, timeouts 30 s, warnings 10 s; the hub's own activity sync compressed with
its own settings (``JupyterHub.last_activity_interval`` and the single-user servers'
``JUPYTERHUB_ACTIVITY_INTERVAL``, both 5 s instead of 300 s). GPU readings come from a fake
``pynvml`` first on the hub's ``PYTHONPATH`` (tests/support/fake_nvml); the product code
that reads NVML is unchanged.

Users attack through what they control — their own server's process, configured from
``~/.jupyter/jupyter_server_config.py``: one logs every request header it receives, one
claims its GPU is 100 % busy and reports itself active every few seconds.
"""

import json
import threading
import time

import pytest
import requests

from support.fake_gpus import FakeGpus, fake_nvml_env
from support.hub import Hub, processes_with_env, wait_for, _environ

pytestmark = pytest.mark.integration

PASS = 5

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {match: Fake}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 1}}}
  - {name: students, displayName: Students, groups: [students, visitors]}
profiles:
  - slug: cpu
    displayName: CPU only
    teams: "*"
    idle: {timeout: 30s, warning: 10s, maxSnoozes: 0}
  - slug: gpu-1
    displayName: One GPU
    gpu: {count: 1, flavor: gpu}
    teams: [vision, nlp]
    idle: {timeout: 1h, gpuIdleTimeout: 30s, warning: 10s, snooze: 30s, maxSnoozes: 1}
defaults:
  idle: {gpuBusyThreshold: 10, maxAge: 7d}
"""

EXTRA_CONFIG = """
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL="5")
"""

# ~/.jupyter/jupyter_server_config.py of a user who logs every request their server gets.
HEADER_LOGGER = """
import json, os, tornado.web
_orig = tornado.web.Application.log_request
def _capture(self, handler):
    with open(os.path.join(os.environ["HOME"], "captured.jsonl"), "a") as f:
        f.write(json.dumps({"uri": handler.request.uri, "headers": dict(handler.request.headers)}) + "\\n")
    return _orig(self, handler)
tornado.web.Application.log_request = _capture
# (and it says it is always active, so it lives through every pass of the test)
import datetime
from jupyter_server.serverapp import ServerWebApplication
ServerWebApplication.last_activity = lambda self: datetime.datetime.now(datetime.timezone.utc)
"""

# ... and of a user whose server says it is always active and its GPU 100 % busy.
LIAR = """
import datetime, time
from jupyter_server.serverapp import ServerWebApplication
ServerWebApplication.last_activity = lambda self: datetime.datetime.now(datetime.timezone.utc)
import gpuhub_notebook.activity as _a
_a.read_gpus = lambda environ=None: {"gpus": [{"id": "forged", "utilization": 100}], "sampled_at": time.time()}
"""


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return FakeGpus(tmp_path_factory.mktemp("nvml") / "nvml.json", 2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus):
    h = Hub(
        tmp_path_factory.mktemp("cull"),
        POLICY,
        extra_config=EXTRA_CONFIG,
        env=fake_nvml_env(gpus.path, GPUHUB_CULL_EVERY=str(PASS)),
    )
    for user, config in (("mallory", HEADER_LOGGER), ("carol", LIAR)):
        d = h.data / "home" / user / ".jupyter"
        d.mkdir(parents=True)
        (d / "jupyter_server_config.py").write_text(config)
    h.start()
    yield h
    h.stop()


def device_of(hub, client, user):
    snap = requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {client.token}"}).json()
    return next(d["id"] for d in snap["devices"] if d["user"] == user)


def culling(client):
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()


def warnings(client):
    return culling(client)["servers"]


class Visits:
    """A user working in their server: real requests through the public URL, every second."""

    def __init__(self, hub, client):
        self.url = hub.server_url(client.server()["url"]) + "api/contents"  # its own origin
        self.headers = {"Authorization": f"token {client.token}"}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while True:
            try:
                requests.get(self.url, headers=self.headers, timeout=10)
            except requests.RequestException:
                pass  # a slow answer on a loaded machine: she clicks again a second later
            if self.stop.wait(1):
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class ComesBack(threading.Thread):
    """Alice leaves her server alone until it is warned, then works in it again, and goes on
    working until told to leave (her test may run long after the scene: any order)."""

    def __init__(self, hub, client):
        super().__init__(daemon=True)
        self.hub, self.client = hub, client
        self.first_warning = None
        self.withdrawn_while_visiting = False
        self.error = None
        self.seen = threading.Event()  # two passes past the old deadline, or an error
        self.leave = threading.Event()

    def run(self):
        try:
            self.first_warning = wait_for(lambda: warnings(self.client).get(""), 90, "a warning for alice's idle server")
            with Visits(self.hub, self.client):
                self.withdrawn_while_visiting = bool(
                    wait_for(
                        lambda: warnings(self.client) == {} and self.client.server() is not None, 3 * PASS, "the warning to go"
                    )
                )
                wait_for(lambda: time.time() > self.first_warning["deadline"] + 2 * PASS, 60, "two passes past the old deadline")
                self.seen.set()
                self.leave.wait()
        except Exception as e:  # reported by the test
            self.error = e
        finally:
            self.seen.set()


@pytest.fixture(scope="module")
def scene(hub, gpus):
    """Everyone starts at once; the tests below watch what happens next."""
    users = {n: hub.login(n) for n in ("alice", "bob", "carol", "dave", "erin", "mallory")}
    bob, carol = users["bob"], users["carol"]
    bob.start("gpu-1")
    bob.wait_ready()
    gpus.set(device_of(hub, bob, "bob"), 90)  # a training run, browser closed
    carol.start("gpu-1")
    carol.wait_ready()
    carol_gpu = device_of(hub, carol, "carol")
    # her server really claims it: 100 % on its own endpoint (and fresh activity every 5 s)
    claim = requests.get(
        hub.server_url(carol.server()["url"]) + "gpuhub/activity", headers={"Authorization": f"token {carol.token}"}
    )
    for n in ("alice", "erin", "mallory"):
        users[n].start("cpu")
    for n in ("alice", "erin", "mallory"):
        users[n].wait_ready()
    alice = ComesBack(hub, users["alice"])
    alice.start()
    (hub.data / "home" / "carol" / "results.txt").write_text("keep me")
    queued = users["dave"].start_background("gpu-1", team="nlp")  # waits for carol's GPU
    yield dict(users=users, queued=queued, claim=claim, carol_gpu=carol_gpu, alice=alice)
    alice.leave.set()
    alice.join(30)


def audit(hub) -> list[dict]:
    path = hub.data / "gpuhub-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_untouched_server_is_warned_at_its_timeout_and_stopped_after_the_warning(hub, scene):
    erin = scene["users"]["erin"]

    def warned():
        """Her warning; where her server was culled before this test saw one (tests run in any
        order, and the cull can land between two looks), an untouched server again."""
        w = warnings(erin).get("")
        if not w and erin.server() is None:
            assert erin.start("cpu").status_code in (201, 202)
            erin.wait_ready()
        return w

    w = wait_for(warned, 90, "a warning for erin's untouched server (started again where it was culled unseen)")
    started = erin.server()["started"]
    assert w["rule"] == "idle" and "no activity for 30s" in w["reason"]
    assert w["deadline"] - w["warned_at"] == pytest.approx(10, abs=0.01)  # the whole warning, announced
    page = erin.session.get(hub.url + "/hub/home").text
    assert "will be stopped" in page and "Your files are kept" in page
    wait_for(lambda: erin.server() is None, 40, "erin's server to be stopped after the warning")
    log = hub.log.read_text()
    assert "Culling erin/ (profile cpu): no activity for 30s" in log
    notice = culling(erin)["culled"][""]
    assert notice["rule"] == "idle" and notice["at"] >= w["deadline"] and notice["started"] > 0
    assert started  # it really ran before
    page = erin.session.get(hub.url + "/hub/home").text
    assert 'id="gpuhub-culled"' in page and "was stopped" in page and "no activity for 30s" in page
    assert "Your files are kept" in page and "Start it again" in page


def test_a_user_who_comes_back_after_the_warning_is_kept(hub, scene):
    alice = scene["alice"]
    assert alice.seen.wait(120)
    assert alice.error is None, alice.error
    assert alice.first_warning["rule"] == "idle" and alice.withdrawn_while_visiting
    client = scene["users"]["alice"]
    assert client.server() is not None and client.server()["ready"]  # two passes past the old deadline
    log = hub.log.read_text()
    assert "Warning withdrawn for alice/" in log and "Culling alice/" not in log
    alice.leave.set()
    alice.join(30)


def test_a_server_claiming_a_busy_gpu_is_culled_when_nvml_reads_idle_and_the_gpu_goes_on(hub, scene, gpus):
    users, queued = scene["users"], scene["queued"]
    carol, bob = users["carol"], users["bob"]
    assert scene["claim"].status_code == 200 and scene["claim"].json()["gpus"][0]["utilization"] == 100
    carol_gpu = scene["carol_gpu"]
    # her forged activity is traffic, not a person on her JupyterLab: it keeps nothing and spends
    # no snooze (one is left), the GPU goes at the first deadline
    wait_for(lambda: carol.server() is None, 120, "carol's idle GPU server to be culled")
    log = hub.log.read_text()
    assert "Warning carol/ (profile gpu-1): stops in 10s: its GPUs were idle for 30s" in log
    assert "Snoozed carol/" not in log
    assert "Culling carol/ (profile gpu-1): its GPUs were idle for 30s" in log
    assert (hub.data / "home" / "carol" / "results.txt").read_text() == "keep me"
    assert queued.result().status_code in (201, 202)
    # the freed GPU went to the next in line (the hub's audit: dave's GPU idles too, and a
    # test run before this one may have waited long enough for the culler to take it back)
    admitted = wait_for(
        lambda: [e for e in audit(hub) if e.get("event") == "admitted" and e.get("key") == "dave/"], 60, "dave's admission"
    )
    assert admitted[0]["devices"] == [carol_gpu]
    wait_for(
        lambda: any(e.get("event") == "started" and e.get("key") == "dave/" for e in audit(hub)),
        120,
        "dave's server to start on it",
    )
    # bob's busy GPU kept his server well past its GPU-idle timeout, without a warning
    assert bob.server()["ready"] and warnings(bob) == {}
    assert "bob/" not in "".join(line for line in log.splitlines() if "Warning " in line)


def test_no_hub_token_reaches_a_user_server_during_many_passes(hub, scene):
    mallory = scene["users"]["mallory"]
    with Visits(hub, mallory):  # her own requests: they show the capture works
        deadline = time.time() + 4 * PASS
        wait_for(lambda: time.time() > deadline, 6 * PASS, "four culler passes")
    captured = [json.loads(line) for line in (hub.data / "home" / "mallory" / "captured.jsonl").read_text().splitlines()]
    assert any(mallory.token in json.dumps(c) for c in captured), "the header logger captured nothing"
    own = {mallory.token, mallory.server_env()["JUPYTERHUB_API_TOKEN"]}
    culler = next(_environ(pid) for pid in processes_with_env("JUPYTERHUB_SERVICE_NAME=gpuhub-culler"))
    assert culler["JUPYTERHUB_API_TOKEN"] not in json.dumps(captured)
    for c in captured:
        auth = {k.lower(): v for k, v in c["headers"].items()}.get("authorization", "")
        token = auth.split(" ", 1)[-1] if auth else None
        assert token is None or token in own, f"a foreign credential reached mallory's server: {c['uri']}"
        assert "token=" not in c["uri"] or any(t in c["uri"] for t in own)


def test_only_the_culler_asks_for_decisions_and_only_the_owner_snoozes(hub, scene):
    mallory = scene["users"]["mallory"]
    server_token = mallory.server_env()["JUPYTERHUB_API_TOKEN"]  # what her own server holds
    for token in (mallory.token, server_token):
        r = requests.post(hub.url + "/hub/api/gpuhub/cull-decisions", headers={"Authorization": f"token {token}"}, json={})
        assert r.status_code == 403, r.text
    alice = scene["users"]["alice"]
    for token in (mallory.token, server_token):
        h = {"Authorization": f"token {token}"}
        assert requests.get(hub.url + "/hub/api/gpuhub/culling/alice", headers=h).status_code == 404
        r = requests.post(hub.url + "/hub/api/gpuhub/culling/alice/snooze", headers=h, json={"server": ""})
        assert r.status_code == 404
        # nor say that a person is on alice's JupyterLab (it could spend her snoozes)
        r = requests.post(hub.url + "/hub/api/gpuhub/culling/alice/seen", headers=h, json={"server": ""})
        assert r.status_code == 404, r.text
    assert culling(alice)["servers"] is not None  # alice herself may look
    # her own report is bounded: her server's name and nothing else (the hub stamps its own time)
    own = {"Authorization": f"token {server_token}"}
    seen = hub.url + "/hub/api/gpuhub/culling/mallory/seen"
    for body, status in (
        ({"server": "", "at": time.time() + 86400}, 400),
        ({"server": 7}, 400),
        ([""], 400),
        ({"server": "no-such-server"}, 404),
        ({"server": ""}, 200),
    ):
        r = requests.post(seen, headers=own, json=body)
        assert r.status_code == status, (body, r.text)
    assert r.json() == {"recorded": False}  # her server is not warned (it says it is always active)


def test_metrics_count_warnings_culls_and_idle_gpu_time(hub, scene):
    admin = hub.login("admin")  # read:metrics
    wanted = {
        'gpuhub_culls_total{rule="idle"}': 1,
        'gpuhub_culls_total{rule="gpu-idle"}': 1,
        'gpuhub_cull_warnings_total{rule="gpu-idle"}': 1,
        'gpuhub_idle_gpu_seconds_total{team="nlp"}': 30,
    }

    def values():
        out = {}
        for line in admin.api.get(hub.url + "/hub/metrics").text.splitlines():
            if line.startswith("gpuhub_") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def short():  # what is not counted yet: erin's and carol's culls may come after this test starts
        v = values()
        return {k: v.get(k) for k, least in wanted.items() if v.get(k, 0) < least}

    deadline = time.time() + 240
    while short() and time.time() < deadline:
        time.sleep(1)
    assert short() == {}


def test_a_pending_warning_and_its_snoozes_survive_a_hub_restart(tmp_path):
    """On a hub of its own: a restart would reset the counters the metrics test reads and cut
    the scene's users off mid-visit, whatever ran before or after (each test passes in any order)."""
    gpus = FakeGpus(tmp_path / "nvml.json", 1)  # reads 0 %: bob's GPU sits idle from the start
    hub = Hub(
        tmp_path / "hub",
        POLICY,
        extra_config=EXTRA_CONFIG,
        env=fake_nvml_env(gpus.path, GPUHUB_CULL_EVERY=str(PASS)),
    )
    hub.start()
    try:
        erin, bob = hub.login("erin"), hub.login("bob")
        assert erin.start("cpu").status_code in (201, 202)  # untouched: culled before the restart
        erin.wait_ready()
        # bob starts once erin is warned: she is culled (10 s on) well before his warning
        # (30 s on), and his snoozed deadline is as far from the restart as it can be
        wait_for(lambda: warnings(erin).get(""), 60, "a warning for erin's untouched server")
        assert bob.start("gpu-1").status_code in (201, 202)
        bob.wait_ready()
        w = wait_for(lambda: warnings(bob).get(""), 90, "a GPU-idle warning for bob")
        r = bob.api.post(bob.url("/gpuhub/culling/bob/snooze"), json={"server": ""})
        assert r.status_code == 200, r.text
        before = warnings(bob)[""]
        assert before["snoozes_used"] == 1 and before["snoozes_left"] == 0 and before["deadline"] >= w["deadline"] + 30
        wait_for(lambda: culling(erin)["culled"].get(""), 60, "erin's untouched server to be culled")
        hub.stop(kill_servers=False)
        state = hub.data / "gpuhub-culling.json"
        assert state.stat().st_mode & 0o777 == 0o600
        hub.start()
        bob = hub.login("bob")
        after = warnings(bob)[""]
        assert (after["deadline"], after["snoozes_used"], after["warned_at"]) == (
            before["deadline"],
            before["snoozes_used"],
            before["warned_at"],
        )
        # and the history came back too: erin is still told what happened to her server
        erin = hub.login("erin")
        assert culling(erin)["culled"][""]["rule"] == "idle"
        assert "no activity for 30s" in erin.session.get(hub.url + "/hub/home").text
        wait_for(lambda: bob.server() is None, 60, "bob's idle GPU server to be stopped at the restored deadline")
        # the team's gauges return to zero when its last server stops (not its last value)
        admin = hub.login("admin")

        def vision_gauges():
            lines = [ln for ln in admin.api.get(hub.url + "/hub/metrics").text.splitlines() if 'team="vision"' in ln]
            return {
                ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
                for ln in lines
                if ln.startswith(("gpuhub_admitted_resources{", "gpuhub_idle_gpus{"))
            }

        gauges = wait_for(
            lambda: (lambda g: g if g.get('gpuhub_idle_gpus{team="vision"}') == 0 else None)(vision_gauges()),
            3 * PASS,
            "the next pass after bob's stop",
        )
        gpu = [v for k, v in gauges.items() if k.startswith("gpuhub_admitted_resources{") and "gpu/" in k]
        assert gpu and all(v == 0 for v in gpu), gauges
    finally:
        hub.stop()
