"""Usage history, roles, audit trail and metrics against a real hub, a real culler and real servers.

One scripted "day" runs once per module, at production ratios compressed with the hub's own
settings (culler pass 5 s, GPU idle timeout 20 s, warning 10 s, snooze 10 s; activity sync
5 s): alice and bob (Vision Lab) and carol (NLP) hold GPUs, dave waits in NLP's queue until
carol stops, bob's idle GPU is warned, snoozed and culled, a team lead stops alice's idle
server, an admin stops dave's, and the policy is edited (a new lead group). GPU readings come
from the fake ``pynvml`` (tests/support/fake_nvml); the product code reading NVML is unchanged.

The test keeps its own clock of every step (request sent, server ready, stop sent, server
gone) and checks that the hub's history lies within those bounds — an independent figure,
not the hub's arithmetic read back.
"""

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from support.browser import CHROMIUM, chromium, log_in
from support.fake_gpus import FakeGpus, fake_nvml_env
from support.hub import PASSWORD, Hub, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASS = 5

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla T1
    local: {match: Fake}
roles:
  admins: [platform-admins]
  viewers: [department-heads]
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    leads: [vision-leads]
    quota: {cpu: 16, memory: 64Gi, gpus: {gpu: 2}}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    quota: {gpus: {gpu: 1}}
profiles:
  - slug: cpu
    displayName: CPU only
    teams: "*"
  - slug: gpu-1
    displayName: One GPU
    cpu: 1
    memory: 1Gi
    gpu: {count: 1, flavor: gpu}
    teams: [vision, nlp]
    idle: {timeout: 1h, gpuIdleTimeout: 20s, warning: 10s, snooze: 10s, maxSnoozes: 1}
defaults:
  idle: {gpuBusyThreshold: 10, maxAge: 7d}
"""

EXTRA_CONFIG = """
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL="5")
c.LeadActions.idle_after = 15
c.PolicyStore.check_interval = 1
"""

USERS = ["admin", "alice", "bob", "carol", "dave", "lena", "victor", "mallory"]
SLACK = 1.0  # seconds: rounding of timestamps between the test's clock and the hub's


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return FakeGpus(
        tmp_path_factory.mktemp("nvml") / "nvml.json", 3, utilization=80, name="NVIDIA Fake T1", memory_total=16 * 2**30
    )


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A real Prometheus (Debian's package) scraping the hub every second, started before the day."""
    return PrometheusRun(tmp_path_factory.mktemp("prom"))


class PrometheusRun:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
        self.proc = None
        self.url = None

    def start(self, hub, token: str):
        if not self.binary:
            return
        from support.ports import free_port

        port = free_port()
        (self.workdir / "token").write_text(token)
        (self.workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: gpuhub\n"
            "    metrics_path: /hub/metrics\n"
            f"    authorization: {{type: Bearer, credentials_file: {self.workdir / 'token'}}}\n"
            f"    static_configs: [{{targets: ['localhost:{hub.port}']}}]\n"
        )
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=open(self.workdir / "prom.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self._up(), 30, "Prometheus to scrape the hub")

    def _up(self):
        try:
            r = requests.get(self.url + "/api/v1/query", params={"query": 'up{job="gpuhub"}'}, timeout=2).json()
            return any(s["value"][1] == "1" for s in r["data"]["result"])
        except (requests.RequestException, KeyError, ValueError):
            return False

    def wait_scrapes(self, n: int, since: float, timeout: float = 60) -> None:
        """Until Prometheus has scraped the hub ``n`` times since ``since`` (its own sample times,
        not a sleep: a loaded machine delays scrapes)."""

        def count() -> int:
            window_ms = max(1, int((time.time() - since) * 1000))
            result = self.query(f'count_over_time(up{{job="gpuhub"}}[{window_ms}ms])')
            return int(float(result[0]["value"][1])) if result else 0

        wait_for(lambda: count() >= n, timeout, f"{n} scrapes of the hub by Prometheus since {since:.1f}", interval=0.5)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = at
        r = requests.get(self.url + "/api/v1/query", params=params, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus, prometheus):
    h = Hub(
        tmp_path_factory.mktemp("usage"),
        POLICY,
        extra_config=EXTRA_CONFIG,
        env=fake_nvml_env(gpus.path, GPUHUB_CULL_EVERY=str(PASS)),
    )
    h.start()
    yield h
    prometheus.stop()
    h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in USERS}


def device_of(hub, admin, user):
    snap = admin.api.get(admin.url("/gpuhub/status")).json()
    return next(d["id"] for d in snap["devices"] if d["user"] == user)


def audit(admin, **params):
    r = admin.api.get(admin.url("/gpuhub/audit"), params=params)
    r.raise_for_status()
    return r.json()["entries"]


@pytest.fixture(scope="module")
def day(hub, users, gpus, prometheus):
    """Run the scripted day once; return the test's own clock of every step."""
    u = users
    admin_metrics_token = u["admin"].token
    prometheus.start(hub, admin_metrics_token)
    clock: dict[str, dict[str, float]] = {}

    def start(name, **options):
        clock[name] = {"requested": time.time()}
        r = u[name].start("gpu-1", **options)
        assert r.status_code in (201, 202), r.text

    def ready(name):
        u[name].wait_ready()
        clock[name]["ready"] = time.time()

    def stop_by(actor, name, via="hub"):
        clock[name]["stop_sent"] = time.time()
        if via == "hub":
            r = u[actor].api.delete(u[actor].url(f"/users/{name}/server"))
        else:
            r = u[actor].api.post(u[actor].url(f"/gpuhub/servers/{name}/stop"))
        assert r.status_code in (202, 204), r.text
        u[name].wait_gone()
        clock[name]["gone"] = time.time()

    start("alice")
    ready("alice")
    start("carol")
    ready("carol")
    start("dave", team="nlp")  # NLP's one GPU is carol's: dave waits
    wait_for(lambda: any(e["user"] == "dave" for e in audit(u["admin"], event="queued")), 30, "dave queued")
    start("bob")
    ready("bob")
    gpus.set(device_of(hub, u["admin"], "bob"), 0)  # bob's GPU idles from now on
    snoozed = threading.Event()

    def snooze_once():  # bob, watching his notifications, snoozes the warning once
        def warned():
            return u["bob"].api.get(u["bob"].url("/gpuhub/culling/bob")).json()["servers"]

        wait_for(warned, 90, "bob's warning", interval=0.3)
        r = u["bob"].api.post(u["bob"].url("/gpuhub/culling/bob/snooze"), json={"server": ""})
        assert r.status_code == 200, r.text
        snoozed.set()

    watcher = threading.Thread(target=snooze_once, daemon=True)
    watcher.start()
    clock["_all_held"] = {"at": time.time()}
    if prometheus.url:  # Prometheus has seen the three held GPUs, then a few more scrapes for rate()

        def held():
            return sum(float(s["value"][1]) for s in prometheus.query("gpuhub_gpus_in_use"))

        wait_for(lambda: held() == 3, 30, "Prometheus to see the 3 held GPUs", interval=0.5)
        prometheus.wait_scrapes(2, since=time.time())  # two more samples for rate()
    clock["_all_held"]["scraped"] = time.time()
    stop_by("carol", "carol")
    ready("dave")

    # bob was warned and snoozed once (above); then the culler stops him.
    watcher.join(120)
    assert snoozed.is_set(), "bob could not snooze his warning"
    # The lead cannot stop a busy server of her team (alice's GPU reads 80 %).
    r = u["lena"].api.post(u["lena"].url("/gpuhub/servers/alice/stop"))
    assert r.status_code == 409 and "not idle" in r.json()["message"], r.text
    gpus.set(device_of(hub, u["admin"], "alice"), 0)
    u["bob"].wait_gone(timeout=90)
    clock["bob"]["gone"] = time.time()

    # Once alice's GPU has idled for the lead's limit, the lead may stop it.
    clock["alice"]["stop_sent"] = None

    def lead_stops_alice():
        sent = time.time()
        r = u["lena"].api.post(u["lena"].url("/gpuhub/servers/alice/stop"))
        if r.status_code == 409:
            return False
        assert r.status_code == 202, r.text
        clock["alice"]["stop_sent"] = sent
        return True

    wait_for(lead_stops_alice, 60, "alice's server to count as idle for her lead", interval=2)
    u["alice"].wait_gone()
    clock["alice"]["gone"] = time.time()

    # The policy gains a lead group (audited with its diff and the role change).
    hub.policy.write_text(POLICY.replace("leads: [vision-leads]", "leads: [vision-leads, vision-deputies]"))
    wait_for(lambda: audit(u["admin"], event="roles_changed"), 30, "the policy reload")

    stop_by("admin", "dave")  # an admin acts on someone else's server
    clock["_end"] = {"at": time.time()}
    # The history as the day left it: later tests start and stop servers of their own (each
    # test passes alone and in any order), which a report read then would count too.
    clock["_report"] = _rows(u["admin"])
    if prometheus.url:
        prometheus.wait_scrapes(2, since=time.time())  # Prometheus scrapes the hub after NLP stopped
    # The day is over: every GPU reads busy again, as before it. A later test's GPU server (any
    # order) would otherwise land on a GPU the day left idle, and a loaded machine's spawn and
    # steps outlast the 20 s + 10 s idle rule: the culler stopped it under the test, and its cull
    # was a second one in the history the CLI and usage-page tests read ("1 culled for idleness").
    for device in gpus.devices:
        gpus.set(device["uuid"], 80)
    return clock


# -- history -----------------------------------------------------------------------------------
def _rows(client, **params):
    r = client.api.get(client.url("/gpuhub/usage"), params={"since": "1d", **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_history_matches_the_days_own_clock(day, users):
    rep = day["_report"]  # read from the hub right after the day's last stop
    rows = {r["user"]: r for r in rep["rows"]}
    assert set(rows) == {"alice", "bob", "carol", "dave"}
    assert {u: (r["end_reason"], r["stopped_by"]) for u, r in rows.items()} == {
        "alice": ("stopped", "lena"),
        "bob": ("culled", "gpuhub-culler"),
        "carol": ("stopped", "carol"),
        "dave": ("stopped", "admin"),
    }
    bounds = {}
    for name in ("alice", "carol", "dave", "bob"):
        c = day[name]
        start_lo = c["requested"] if name != "dave" else day["carol"]["stop_sent"]
        end_lo = c.get("stop_sent") or c["ready"]
        lo, hi = end_lo - c["ready"], c["gone"] - start_lo
        bounds[name] = (lo, hi)
        assert lo - SLACK <= rows[name]["gpu_seconds"] <= hi + SLACK, (name, rows[name], lo, hi)
        assert rows[name]["gpus"] == 1 and rows[name]["devices"]
    # The team totals are the sums of what each of its members held.
    totals = rep["summary"]["totals"]
    for team, members in (("vision", ["alice", "bob"]), ("nlp", ["carol", "dave"])):
        lo = sum(bounds[m][0] for m in members) / 3600
        hi = sum(bounds[m][1] for m in members) / 3600
        assert lo - 2 * SLACK / 3600 <= totals[team]["gpu_hours"] <= hi + 2 * SLACK / 3600
        assert totals[team]["gpu_hours"] == pytest.approx(sum(rows[m]["gpu_seconds"] for m in members) / 3600, abs=1e-3)
    # dave waited from his request until carol's GPU came back.
    assert day["carol"]["stop_sent"] - day["dave"]["requested"] - SLACK <= rows["dave"]["wait_seconds"]
    assert rows["dave"]["wait_seconds"] <= day["carol"]["gone"] - day["dave"]["requested"] + SLACK
    waits = rep["summary"]["waits"]
    assert waits["count"] == 4 and waits["p95_seconds"] >= waits["median_seconds"] >= 0
    assert waits["p95_seconds"] > 0.9 * rows["dave"]["wait_seconds"] * 0.75
    # Known utilisation: bob's GPU idled, alice's was busy first.
    assert rows["bob"]["idle_gpu_seconds"] >= PASS and rows["bob"]["measured_gpu_seconds"] >= rows["bob"]["idle_gpu_seconds"]
    assert rows["alice"]["busy_gpu_seconds"] >= PASS  # 80 % until her GPU was set idle
    assert rep["summary"]["ended"] == {"stopped": 3, "culled": 1}
    assert totals["vision"]["culls"] == 1


def test_history_survives_a_hub_restart(day, hub, users):
    before = _rows(users["admin"])["rows"]
    hub.stop(kill_servers=False)
    hub.start()
    admin = hub.login("admin")
    users["admin"] = admin
    after = _rows(admin)["rows"]
    assert [(r["user"], r["start"], r["end"], r["end_reason"]) for r in after] == [
        (r["user"], r["start"], r["end"], r["end_reason"]) for r in before
    ]


def test_the_csv_matches_the_page(day, users):
    admin = users["admin"]
    page = admin.session.get(admin.hub.url + "/hub/gpuhub/usage?since=1d").text
    cells = re.findall(r'<tr class="gpuhub-usage-row"><td>([^<]*)</td>.*?class="gpuhub-gpu-seconds">([\d.]+)</td>', page, re.S)
    r = admin.session.get(admin.hub.url + "/hub/gpuhub/usage.csv?since=1d")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [(c[0], round(float(c[1]), 3)) for c in cells] == [(row["user"], round(float(row["gpu_seconds"]), 3)) for row in rows]
    # The page's team table adds up to the CSV.
    for team in ("vision", "nlp"):
        shown = float(re.search(rf'<tr data-team="{team}">.*?class="gpuhub-gpu-hours">([\d.]+)', page, re.S).group(1))
        assert shown == pytest.approx(sum(float(x["gpu_seconds"]) for x in rows if x["team"] == team) / 3600, abs=1e-3)


def test_the_cli_answers_by_team_and_user(day, hub, users):
    def run(client, *args):
        env = dict(os.environ, JUPYTERHUB_API_URL=hub.url + "/hub/api", JUPYTERHUB_API_TOKEN=client.token)
        env.pop("GPUHUB_TOKEN", None)
        return subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "usage", *args], env=env, capture_output=True, text=True, timeout=60
        )

    out = run(users["victor"], "--since", "7d", "--by", "team")
    assert out.returncode == 0, out.stderr
    assert (
        "view: viewer" in out.stdout
        and re.search(r"^vision\s+\d", out.stdout, re.M)
        and re.search(r"^nlp\s+\d", out.stdout, re.M)
    )
    # How the day's four allocations ended, in words (it once read "ended: ended 1" for a job).
    # (the day's 3 stopped and 1 culled, and whatever the module's other tests stopped before this one)
    assert re.search(r"^how allocations ended: \d+ stopped, 1 culled for idleness$", out.stdout, re.M), out.stdout
    out = run(users["victor"], "--since", "7d", "--by", "user", "--csv")
    assert sorted(row["user"] for row in csv.DictReader(io.StringIO(out.stdout))) == ["alice", "bob", "carol", "dave"]
    out = run(users["carol"], "--since", "7d", "--by", "user", "--csv")  # a researcher: herself only
    assert [row["user"] for row in csv.DictReader(io.StringIO(out.stdout))] == ["carol"]
    out = run(users["carol"], "--since", "forever")
    assert out.returncode == 1 and "not a duration" in out.stderr


# -- roles: each sees what the role may see, forged requests are refused -------------------------
def test_each_role_sees_its_own_slice(day, users):
    victor, lena, carol, mallory = (users[n] for n in ("victor", "lena", "carol", "mallory"))
    assert {r["user"] for r in _rows(victor)["rows"]} == {"alice", "bob", "carol", "dave"}
    assert _rows(victor)["view"] == "viewer"
    lead = _rows(lena)
    assert lead["view"] == "lead" and {r["user"] for r in lead["rows"]} == {"alice", "bob"}
    assert set(_rows(lena)["summary"]["totals"]) == {"vision"}
    mine = _rows(carol, by="team")
    assert {r["user"] for r in mine["rows"]} == {"carol"}
    assert set(mine["summary"]["totals"]) == {"nlp"}  # her team's totals, nobody's details
    assert set(_rows(carol, by="user")["summary"]["totals"]) == {"carol"}
    assert _rows(mallory)["rows"] == [] and _rows(mallory)["summary"]["totals"] == {}


def test_forged_requests_are_refused(day, hub, users):
    victor, lena, carol, admin = (users[n] for n in ("victor", "lena", "carol", "admin"))
    for who in (victor, lena, carol):
        assert who.api.get(who.url("/gpuhub/audit")).status_code == 403
        assert who.session.get(hub.url + "/hub/gpuhub/audit").status_code == 403
    # A viewer sees no servers and cannot act on them.
    assert victor.api.get(victor.url("/users/alice")).status_code in (403, 404)
    assert victor.api.get(victor.url("/users")).status_code == 403
    carol.start("gpu-1")
    carol.wait_ready()
    try:
        assert victor.api.post(victor.url("/gpuhub/servers/carol/stop")).status_code == 403
        assert victor.api.delete(victor.url("/users/carol/server")).status_code in (403, 404)
        # A lead of Vision Lab cannot stop NLP's servers, however idle.
        r = lena.api.post(lena.url("/gpuhub/servers/carol/stop"))
        assert r.status_code == 403, r.text
        # An admin's token narrowed to reading its name gets no usage, audit or actions.
        r = admin.api.post(admin.url("/users/admin/tokens"), json={"note": "narrow", "scopes": ["read:users:name!user=admin"]})
        narrow = {"Authorization": f"token {r.json()['token']}"}
        for path in ("/hub/api/gpuhub/usage", "/hub/api/gpuhub/audit", "/hub/api/gpuhub/usage.csv"):
            assert requests.get(hub.url + path, headers=narrow).status_code == 403, path
        assert (
            requests.get(hub.url + "/hub/api/gpuhub/usage.csv", headers={"Authorization": f"token {admin.token}"}).status_code
            == 200
        )
        assert requests.post(hub.url + "/hub/api/gpuhub/servers/carol/stop", headers=narrow).status_code == 403
        # A cookie-authenticated POST without the XSRF token is refused (cross-site forgery).
        r = lena.session.post(hub.url + "/hub/api/gpuhub/servers/alice/stop")
        assert r.status_code == 403
        assert carol.server() and carol.server()["ready"]
    finally:
        carol.stop()
        carol.wait_gone()
    # Percent-encoded names reach the handler decoded (sent raw: requests would normalise them).
    from urllib.parse import urlsplit
    import http.client

    def raw_post(path, token):
        u = urlsplit(hub.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", path, headers={"Authorization": f"token {token}"})
        status = conn.getresponse().status
        conn.close()
        return status

    assert raw_post("/hub/api/gpuhub/servers/car%6Fl/stop", lena.token) == 403  # carol: not her team
    assert raw_post("/hub/api/gpuhub/servers/..%2Fadmin/stop", lena.token) == 404
    assert raw_post("/hub/api/gpuhub/servers/alice%2F/stop", victor.token) in (403, 404)
    # Bad input is answered, not guessed.
    assert carol.api.get(carol.url("/gpuhub/usage"), params={"since": "-1d"}).status_code == 400
    assert carol.api.get(carol.url("/gpuhub/usage"), params={"by": "everyone"}).status_code == 400


def test_status_page_by_role(day, hub, users, gpus):
    admin, lena, carol, dave = users["admin"], users["lena"], users["carol"], users["dave"]
    users["alice"].start("gpu-1")
    users["alice"].wait_ready()
    # alice works on her GPU throughout (the day left some devices reading 0 %: on a loaded
    # machine this test's steps outlast the 20 s + 10 s idle rule, and the culler was right).
    gpus.set(device_of(hub, admin, "alice"), 80)
    carol.start("gpu-1")
    carol.wait_ready()
    pending = dave.start_background("gpu-1", team="nlp")  # NLP's one GPU is carol's: dave waits
    try:

        def dave_waits():
            return [w for w in admin.api.get(admin.url("/gpuhub/status")).json()["waiting"] if w["user"] == "dave"]

        (waiting,) = wait_for(dave_waits, 30, "dave in the admin's waiting list")
        assert waiting["team"] == "nlp" and waiting["position"] == 1 and waiting["since"] <= time.time()
        # Nobody but the admin sees who waits; the lead of Vision Lab does not see NLP's queue.
        assert lena.api.get(lena.url("/gpuhub/status")).json()["waiting"] == []
        assert carol.api.get(carol.url("/gpuhub/status")).json()["waiting"] == []
        # The admin withdraws dave's request (audited); carol keeps her GPU.
        r = admin.api.post(admin.url("/gpuhub/servers/dave/stop"))
        assert r.status_code == 202, r.text
        dave.wait_gone()
        assert dave_waits() == [] and carol.server()["ready"]
        acted = audit(admin, event="acted_on_server", user="dave")
        assert acted[-1]["by"] == "admin" and acted[-1]["action"] == "withdraw"
        pending.result(timeout=30)
        carol.stop()
        carol.wait_gone()
        snap = admin.api.get(admin.url("/gpuhub/status")).json()
        vision = next(t for t in snap["teams"] if t["name"] == "vision")
        assert vision["cpu"] == {"in_use": 1.0, "nominal": 16.0} and vision["gpus"]["gpu"]["display_name"] == "Tesla T1"
        assert {d["user"] for d in snap["devices"] if d["held"]} == {"alice"}
        lead = lena.api.get(lena.url("/gpuhub/status")).json()
        assert lead["view"] == "team" and {d["user"] for d in lead["devices"] if d["held"]} == {"alice"}
        other = carol.api.get(carol.url("/gpuhub/status")).json()
        assert other["view"] == "counts" and {d["user"] for d in other["devices"] if d["held"]} == {None}
        assert "cpu" not in next(t for t in other["teams"] if t["name"] == "vision")
        page = carol.session.get(hub.url + "/hub/gpuhub").text
        assert "alice" not in page and "gpuhub-stop" not in page.split("<script>")[0]
        # A forged start (a profile NLP may not use) is refused, and the refusal is audited.
        r = carol.start("cpu", team="vision")
        assert 400 <= r.status_code < 500, r.text
        refused = audit(admin, event="refused", user="carol")
        assert refused and refused[-1]["requested"] == {"profile": "cpu", "team": "vision"} and refused[-1]["reason"]
    finally:
        for name in ("alice", "carol", "dave"):
            users[name].stop()
        for name in ("alice", "carol", "dave"):
            users[name].wait_gone()


# -- audit trail --------------------------------------------------------------------------------
def test_the_audit_trail_holds_the_day_in_order(day, hub, users):
    entries = audit(users["admin"], since=str(day["alice"]["requested"] - 1), limit="10000")
    seqs = [e["seq"] for e in entries]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    def events(key):
        return [
            e["event"]
            for e in entries
            if e.get("key") == key
            and e["event"]
            in ("requested", "queued", "admitted", "started", "warned", "snoozed", "culled", "released", "acted_on_server")
        ]

    # (alice's idle GPU may be warned about before her lead stops it: both are in the trail)
    assert [e for e in events("alice/") if e != "warned"][:5] == [
        "requested",
        "admitted",
        "started",
        "acted_on_server",
        "released",
    ]
    assert events("dave/")[:4] == ["requested", "queued", "admitted", "started"]
    assert events("bob/")[:7] == ["requested", "admitted", "started", "warned", "snoozed", "culled", "released"]
    released = {e["key"]: e for e in entries if e["event"] == "released"}
    assert released["bob/"]["reason"] == "culled" and released["carol/"]["reason"] == "stopped"
    dave_admitted = next(e for e in entries if e["event"] == "admitted" and e["key"] == "dave/")
    carol_released = next(e for e in entries if e["event"] == "released" and e["key"] == "carol/")
    assert carol_released["seq"] < dave_admitted["seq"] and dave_admitted["devices"] == carol_released["devices"]
    acted = [(e["by"], e["target_user"], e["role"]) for e in entries if e["event"] == "acted_on_server"]
    assert ("lena", "alice", "lead") in acted and ("admin", "dave", "hub-admin") in acted
    reload = next(e for e in entries if e["event"] == "policy_reloaded")
    assert any(line.startswith("+") and "vision-deputies" in line for line in reload["diff"].splitlines())
    roles = next(e for e in entries if e["event"] == "roles_changed")
    assert roles["changes"] == {"vision-deputies": {"before": [], "after": ["lead:vision"]}}
    # The file: 0600, in the hub's data dir, one JSON object per line, nothing secret.
    path = hub.data / "gpuhub-audit.jsonl"
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = path.read_text()
    assert all(json.loads(line) for line in text.splitlines())
    for name in USERS:
        assert users[name].token not in text
    assert PASSWORD not in text


# -- metrics --------------------------------------------------------------------------------------
def _metrics(admin) -> str:
    r = requests.get(admin.hub.url + "/hub/metrics", headers={"Authorization": f"token {admin.token}"})
    r.raise_for_status()
    return r.text


def test_gauges_return_to_zero_after_a_team_stops(day, users):
    text = _metrics(users["admin"])
    if 'gpuhub_admitted_resources{resource="gpu/gpu",team="nlp"}' not in text:
        # The hub restarted since the day (test_history_survives_a_hub_restart, any order: seed
        # 478b614b): its gauges start empty. NLP holds a GPU and stops again, as in the day.
        carol = users["carol"]
        assert carol.start("gpu-1").status_code in (201, 202)
        carol.wait_ready()
        carol.stop()
        carol.wait_gone()
        zero = 'gpuhub_admitted_resources{resource="gpu/gpu",team="nlp"} 0.0'
        text = wait_for(
            lambda: (lambda t: t if zero in t else None)(_metrics(users["admin"])), 30, "NLP's admitted GPUs back at 0"
        )
    assert 'gpuhub_gpus_in_use{flavor="gpu",team="nlp"} 0.0' in text
    admitted = [line for line in text.splitlines() if line.startswith("gpuhub_admitted_resources{")]
    assert 'gpuhub_admitted_resources{resource="gpu/gpu",team="nlp"} 0.0' in text, admitted
    assert 'gpuhub_team_waiting{team="nlp"} 0.0' in text
    assert 'gpuhub_free_devices{flavor="gpu"} 3.0' in text
    assert "gpuhub_gpu_utilization_percent{" not in text  # no device is held: no series
    assert 'gpuhub_quota_nominal_gpus{flavor="gpu",team="nlp"} 1.0' in text
    assert "gpuhub_policy_ok 1.0" in text


DASHBOARD = REPO / "docs" / "grafana" / "gpuhub-dashboard.json"


def test_every_dashboard_metric_is_on_hub_metrics(day, users, gpus):
    """Every gpuhub_* name a panel queries is served by /hub/metrics (the GPU health panels'
    included: an application XID 13 from the fake NVML counts without taking the GPU out)."""
    admin = users["admin"]

    def xid_13s() -> float:  # the Prometheus test may have counted one already (any order)
        m = re.search(r'^gpuhub_gpu_xid_total\{device="GPU-fake-2",xid="13"\} ([\d.]+)$', _metrics(admin), re.M)
        return float(m.group(1)) if m else 0.0

    before = xid_13s()
    gpus.xid("GPU-fake-2", 13)
    wait_for(lambda: xid_13s() == before + 1, 15, "the XID 13 counted on /hub/metrics")
    dash = json.loads(DASHBOARD.read_text())
    names = {n for p in dash["panels"] for t in p.get("targets", []) for n in re.findall(r"\bgpuhub_\w+", t["expr"])}
    assert {"gpuhub_gpu_health", "gpuhub_gpu_xid_total", "gpuhub_gpus_usable"} <= names
    # A family is served even with no series now (a counter before its first count, utilisation
    # with nothing held): its # TYPE line says so; a histogram's series carry suffixes.
    text = _metrics(admin)
    served = set()
    for name, kind in re.findall(r"^# TYPE (gpuhub_\w+) (\w+)$", text, re.M):
        served |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    assert names <= served, sorted(names - served)
    assert 'gpuhub_gpu_health{device="GPU-fake-2",flavor="gpu",state="healthy"} 1.0' in text  # XID 13: it stays
    assert 'gpuhub_gpus_usable{flavor="gpu"} 3.0' in text


def test_prometheus_scrapes_the_hub_and_every_dashboard_query_returns_series(day, users, gpus, prometheus):
    if prometheus.url is None:
        pytest.skip("Debian's prometheus is not installed (run-tests.sh installs it as root)")
    dash = json.loads(DASHBOARD.read_text())
    # Kueue's own panels have series only on Kubernetes (tests/kube/test_kueue_metrics.py).
    targets = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", []) if "kueue_" not in t["expr"]]
    assert len(targets) >= 10
    if "gpuhub_gpu_xid_total{" not in _metrics(users["admin"]):
        gpus.xid("GPU-fake-2", 13)  # an application XID (the GPU stays): the XID panel has a series
    wait_for(lambda: prometheus.query("increase(gpuhub_gpu_xid_total[1h])"), 30, "Prometheus to scrape an XID count twice")
    at = day["_all_held"]["scraped"]
    for title, expr in targets:
        q = (
            expr.replace("$__rate_interval", "5m")
            .replace("$__range_s", "3600")
            .replace("$__range", "1h")
            .replace("$team", ".*")
            .replace("$flavor", ".*")
        )
        # While four servers held or waited (utilisation, in use, waiting) or at the end (culls).
        series = prometheus.query(q, at) or prometheus.query(q)
        assert series, f"panel {title!r}: {q} returned no series"

    # The NLP picture at the end: nothing in use, nothing waiting; Vision's lead culled once.
    def in_use():  # the latest scrape (1 s apart) after the last servers stopped
        return {s["metric"]["team"]: float(s["value"][1]) for s in prometheus.query('gpuhub_gpus_in_use{flavor="gpu"}')}

    wait_for(lambda: in_use() == {"vision": 0, "nlp": 0}, 10, f"Prometheus to see no GPU in use ({in_use()})")
    assert {s["metric"]["team"]: float(s["value"][1]) for s in prometheus.query("gpuhub_team_waiting")} == {"vision": 0, "nlp": 0}
    assert prometheus.query("gpuhub_gpu_utilization_percent") == []  # nothing held: the series are gone
    held = prometheus.query("gpuhub_gpus_in_use", at)
    assert sum(float(s["value"][1]) for s in held) == 3  # alice, bob, carol (dave waiting)


# -- the page in a real Chromium, per role ----------------------------------------------------------


@pytest.mark.browser
def test_the_usage_page_renders_its_charts_for_each_role(day, hub, tmp_path):
    """Charts and tables in Chromium; each role sees its slice. GPUHUB_SCREENSHOTS=docs keeps the PNGs."""
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    shots = Path(os.environ.get("GPUHUB_SCREENSHOTS") or tmp_path)
    expect = {  # role's login: (view, users whose allocations it sees, teams in its totals)
        "admin": ("admin", {"alice", "bob", "carol", "dave"}, {"vision", "nlp"}),
        "lena": ("lead", {"alice", "bob"}, {"vision"}),
        "victor": ("viewer", {"alice", "bob", "carol", "dave"}, {"vision", "nlp"}),
        "carol": ("researcher", {"carol"}, {"nlp"}),
    }
    with chromium() as browser:
        try:
            for name, (view, who, teams) in expect.items():
                page = browser.new_context(viewport={"width": 1000, "height": 1500}).new_page()
                log_in(page, hub.url, name)
                page.wait_for_load_state()
                since = int(time.time() - day["alice"]["requested"]) + 60  # the whole compressed day, however slow
                page.goto(hub.url + f"/hub/gpuhub/usage?since={since}s")
                assert page.locator("#gpuhub-usage").get_attribute("data-view") == view
                for chart in ("allocation", "queue", "idle"):
                    svg = page.locator(f"svg#gpuhub-chart-{chart}")
                    assert svg.is_visible() and svg.bounding_box()["height"] > 100, (name, chart)
                series = page.locator("svg#gpuhub-chart-allocation path.gpuhub-series").evaluate_all(
                    "els => els.map(e => e.dataset.name)"
                )
                labels = {"vision": "Vision Lab", "nlp": "NLP Group"}
                assert set(series) == {labels[t] for t in teams}, (name, series)
                bars = page.locator("svg#gpuhub-chart-idle rect.gpuhub-bar[data-part=idle_gpu_hours]").evaluate_all(
                    "els => els.map(e => [e.dataset.group, parseFloat(e.dataset.value)])"
                )
                assert {g for g, _ in bars} == {labels[t] for t in teams}
                users_shown = set(page.locator("tr.gpuhub-usage-row td:first-child").all_inner_texts())
                assert users_shown == who, (name, users_shown)
                text = page.locator("#gpuhub-usage").inner_text()
                for hidden in {"alice", "bob", "carol", "dave"} - who:
                    assert hidden not in text, (name, hidden)
                if name == "admin":
                    # What each allocation was, when, and how it ended, as a person reads them:
                    # times to the second (no ISO milliseconds), the end in words.
                    assert set(page.locator("td.gpuhub-usage-what").all_inner_texts()) == {"server"}
                    rows = page.locator("#gpuhub-usage-rows").inner_text()
                    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", rows) and not re.search(r"\.\d{3}Z", rows), rows
                    assert re.search(r"How allocations ended: \d+ stopped, 1 culled for idleness\.", text), text
                if name in ("admin", "lena", "victor"):
                    role = {"admin": "admin", "lena": "lead", "victor": "viewer"}[name]
                    page.screenshot(path=str(shots / f"usage-{role}.png"), full_page=True)
                # The audit page only for admins (a viewer or lead gets JupyterHub's 403 page).
                r = page.goto(hub.url + "/hub/gpuhub/audit")
                assert r.status == (200 if name == "admin" else 403)
                if name == "admin":
                    assert page.locator("tr.gpuhub-audit-entry[data-event=culled]").count() >= 1
                page.context.close()
            # The admin stops a holder from the status page (the button posts with the page's XSRF token).
            alice = hub.login("alice")
            alice.start("gpu-1")
            alice.wait_ready()
            page = browser.new_context(viewport={"width": 1000, "height": 1200}).new_page()
            log_in(page, hub.url, "admin")
            page.wait_for_load_state()
            page.goto(hub.url + "/hub/gpuhub")
            page.click('button.gpuhub-stop[data-key="alice/"]')
            page.wait_for_function("document.getElementById('gpuhub-action-result').dataset.status === '202'")
            result = page.locator("#gpuhub-action-result").inner_text()
            assert not result.startswith("202") and "alice" in result, result  # words, not an HTTP code
            alice.wait_gone()
            page.context.close()
        finally:
            browser.close()
