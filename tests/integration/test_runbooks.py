"""Issue 28 item 2: the runbooks in docs/runbooks/ are run, and the alert rules pass promtool.

Every block a page marks ```` ```sh runbook:<page>/<step> ```` is extracted from the page and
run with bash against a real hub put into the situation the page describes; the test
substitutes only the page's variables (``HUB``, ``GPUHUB_TOKEN``, ``DATA``, ``POLICY``,
``WHO``, ``BACKUP``, ...), given as environment variables, and asserts what the page says
the block shows. The README's ``runbook:common`` block (the ``api`` helper) runs before each.

This module: the alert rules (promtool), the hub killed and restarted (with a real Prometheus
evaluating the rules), a spawn stuck behind a full quota, a policy edit refused, the cookie
secret rotated and a token revoked; one hub. ``test_runbooks_restore.py``: a full home, a
backup restored into a fresh hub whose database is then upgraded and rolled back;
``test_runbooks_gpu.py``: a bad GPU, a cull dispute; ``test_runbooks_mlflow.py``: MLflow hung.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests
import yaml

from support.hub import Hub, processes_with_env, running_hub, wait_for
from support.ports import free_port

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
ALERTS = REPO / "docs" / "prometheus" / "gpuhub-alerts.yaml"
ALERT_TESTS = REPO / "docs" / "prometheus" / "gpuhub-alerts.test.yaml"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
BLOCK = re.compile(r"^([ \t]*)```sh runbook:([\w-]+)/([\w-]+)\n(.*?)^\1```", re.S | re.M)
COMMON = re.compile(r"^```sh runbook:common\n(.*?)^```", re.S | re.M)

# Pages whose every marked block this module runs (test_runbooks_gpu.py covers the others).
PAGES = ("hub-down", "spawns-stuck", "secrets-rotation")
POLICY_STEPS = {"check-policy", "rollback-policy", "verify"}  # of upgrade-rollback.md

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 1}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    quota: {gpus: {gpu: 1}}
roles:
  admins: [platform-admins]
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, memory: 4Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision]}
defaults:
  queueTimeout: 10m
ray:
  enabled: true
"""


# -- the runbooks, as text ---------------------------------------------------------------------


def blocks(page: str) -> dict[str, str]:
    text = (RUNBOOKS / f"{page}.md").read_text()
    found = {}
    for _indent, name, step, body in BLOCK.findall(text):  # (a block in a list item is indented)
        assert name == page, f"{page}.md has a block of another page: runbook:{name}/{step}"
        assert step not in found, f"{page}.md: runbook:{page}/{step} twice"
        found[step] = textwrap.dedent(body)
    return found


def common() -> str:
    return COMMON.search((RUNBOOKS / "README.md").read_text()).group(1)


def steps_run_by(module_file) -> set[tuple[str, str]]:
    """Every (page, step) a test of ``module_file`` runs: its test functions' calls
    ``runbook("page", "step", ...)``, read from the source. What the check below needs holds
    whichever tests ran before it, or whether they ran at all (each test passes alone and in any
    order); a test that runs a block and fails, fails itself."""
    import ast

    out = set()
    for fn in ast.walk(ast.parse(Path(module_file).read_text())):
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "runbook"
                    and len(node.args) >= 2
                    and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:2])
                ):
                    out.add((node.args[0].value, node.args[1].value))
    return out


def runbook(page: str, step: str, env: dict, ok: bool = True, timeout: float = 120) -> str:
    """Run one marked block of a page, as the page shows it; return what it printed."""
    body = blocks(page)[step]
    script = "set -euo pipefail\n" + common() + body
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in env.items()})
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env.get('PATH', '')}"
    full_env.pop("JUPYTERHUB_API_TOKEN", None)
    full_env.pop("JUPYTERHUB_API_URL", None)
    r = subprocess.run(["bash", "-c", script], env=full_env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    print(f"--- runbook:{page}/{step} (rc {r.returncode})\n{out}")
    if ok:
        assert r.returncode == 0, f"runbook:{page}/{step} failed ({r.returncode}):\n{body}\n---\n{out}"
    return out


def env_of(hub: Hub, admin, **more) -> dict:
    return {"HUB": hub.url, "GPUHUB_TOKEN": admin.token, "DATA": hub.data, "POLICY": hub.policy, **more}


# -- the alert rules ---------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    if not PROMTOOL:
        pytest.skip("promtool is not installed (Debian's prometheus package; run-tests.sh installs it as root)")
    r = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len([rule for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"]])
    assert f"SUCCESS: {n} rules found" in r.stdout
    r = subprocess.run([PROMTOOL, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, cwd=ALERT_TESTS.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # every alert is unit-tested firing, and quiet at another time
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case["alert_rule_test"] if not t["exp_alerts"]}
    names = {rule["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"]}
    assert names == fired == quiet


def test_every_alert_links_a_runbook_that_names_it_and_every_page_has_its_sections():
    rules = [rule for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"]]
    pages = sorted(p.stem for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
    index = (RUNBOOKS / "README.md").read_text()
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("docs/runbooks/") and (REPO / url).is_file(), (rule["alert"], url)
        assert f"`{rule['alert']}`" in (REPO / url).read_text(), f"{url} does not name {rule['alert']}"
    for page in pages:
        text = (RUNBOOKS / f"{page}.md").read_text()
        for section in ("## Symptoms", "## Check", "## Fix", "## Verify", "## On Kubernetes (not run here)"):
            assert section in text, f"{page}.md has no '{section}'"
        assert "**Alert" in text.split("##")[0], f"{page}.md does not name its alert at the top"
        assert f"({page}.md)" in index, f"README.md does not index {page}.md"
        assert blocks(page), f"{page}.md has no runnable block"
    assert "docs/runbooks/README.md" in (REPO / "README.md").read_text()


# -- a real hub, and a real Prometheus evaluating the rules ------------------------------------


class Prometheus:
    def __init__(self, workdir: Path, hub: Hub, token: str):
        self.workdir, self.proc, self.url = workdir, None, None
        if not PROMETHEUS:
            return
        port = free_port()
        (workdir / "token").write_text(token)
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{ALERTS}]\n"
            "scrape_configs:\n"
            "  - job_name: gpuhub\n"
            "    metrics_path: /hub/metrics\n"
            "    scrape_timeout: 900ms\n"
            f"    authorization: {{type: Bearer, credentials_file: {workdir / 'token'}}}\n"
            f"    static_configs: [{{targets: ['localhost:{hub.port}']}}]\n"
        )
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=open(workdir / "prom.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self.value('up{job="gpuhub"}') == 1.0, 30, "Prometheus to scrape the hub")

    def query(self, expr: str) -> list[dict]:
        try:
            r = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5).json()
        except (requests.RequestException, ValueError):
            return []
        return r.get("data", {}).get("result", [])

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def alert(self, name: str) -> str | None:
        """The alert's state in Prometheus (pending or firing), None when inactive."""
        res = self.query(f'ALERTS{{alertname="{name}"}}')
        return res[0]["metric"]["alertstate"] if res else None

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("runbooks"), POLICY, extra_config="c.PolicyStore.check_interval = 1\n") as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("admin", "alice", "bob")}


@pytest.fixture(scope="module")
def prometheus(hub, users, tmp_path_factory):
    p = Prometheus(tmp_path_factory.mktemp("prom"), hub, users["admin"].token)
    yield p
    p.stop()


def stop_all(users):
    for u in users.values():
        if u.server() is not None:
            u.stop()
    for u in users.values():
        u.wait_gone()


def test_hub_down_the_proxy_keeps_servers_and_the_runbook_brings_it_back(hub, users, prometheus):
    admin, alice = users["admin"], users["alice"]
    env = env_of(hub, admin)
    assert alice.start("cpu").status_code in (201, 202)
    started = alice.wait_ready()["started"]
    lab = hub.server_url(alice.server()["url"]) + "api/status"
    auth = {"Authorization": f"token {alice.token}"}
    assert requests.get(lab, headers=auth, timeout=10).status_code == 200
    if prometheus.url:  # the series GpuhubSpawnsFailing reads exists on a real hub (here: a success)
        wait_for(
            lambda: prometheus.query('jupyterhub_server_spawn_duration_seconds_count{job="gpuhub",status="success"}'),
            15,
            "the spawn counted",
        )

    hub.proc.send_signal(signal.SIGKILL)  # the hub dies; its proxy and alice's server do not
    hub.proc.wait()
    out = runbook("hub-down", "check", env)
    assert "hub: 503" in out, out
    assert re.search(r"^proxy: running \(\d+\)$", out, re.M), out
    account = hub.env["GPUHUB_ACCOUNT_PREFIX"] + "alice"
    assert f"server cgroup: {account}" in out, out
    assert requests.get(lab, headers=auth, timeout=10).status_code == 200  # alice works on
    if prometheus.url:
        wait_for(lambda: prometheus.value('up{job="gpuhub"}') == 0.0, 15, "Prometheus to see the hub down")
        wait_for(lambda: prometheus.alert("GpuhubHubDown") == "pending", 15, "GpuhubHubDown pending (for: 2m)")
    out = runbook("hub-down", "validate", env)
    assert "OK" in out or "valid" in out.lower(), out

    hub.start(timeout=120)  # what `systemctl restart gpuhub` does: the same program, same data dir
    out = runbook("hub-down", "verify", env)
    assert "hub: 200" in out
    assert f"alice/ ready=true since {started}" in out, out
    if prometheus.url:
        wait_for(lambda: prometheus.alert("GpuhubHubDown") is None, 15, "GpuhubHubDown to resolve")
        # the series GpuhubHubRestarting reads exists on a real hub, and counts the restart
        wait_for(
            lambda: len(prometheus.query('changes(process_start_time_seconds{job="gpuhub"}[10m]) >= 1')) == 1,
            15,
            "the restart seen in process_start_time_seconds",
        )
    stop_all(users)


def test_spawn_stuck_behind_a_full_quota(hub, users):
    admin, alice, bob = users["admin"], users["alice"], users["bob"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    bob.start_background("gpu-1")
    wait_for(lambda: bob.server() is not None and bob.server().get("pending") == "spawn", 30, "bob waiting")
    env = env_of(hub, admin, WHO="bob", HOLDER="alice")
    out = wait_for(
        lambda: (lambda o: o if "bob (vision, gpu-1) waiting" in o else None)(runbook("spawns-stuck", "check", env)),
        20,
        "the check to show bob waiting",
    )
    assert re.search(
        r"^bob \(vision, gpu-1\) waiting .*, position 1: needs 1 Tesla GPU: your team Vision Lab is using 1 of the 1 it may hold",
        out,
        re.M | re.I,
    ), out
    assert "vision gpu: 1 of 1 in use, 1 usable" in out, out
    assert re.search(r"^\S+\s+gpu\s+\S+.*alice", out, re.M), out  # gpuhub gpu list: alice holds the GPU
    out = runbook("spawns-stuck", "fix", env)
    assert "stop: 200" in out or "stop: 204" in out or "stop: 202" in out, out
    bob.wait_ready()
    out = runbook("spawns-stuck", "verify", env)
    assert "waiting: 0" in out and "bob: ready=true" in out, out
    assert "admin stop alice/" in out, out
    stop_all(users)


def metric_value(hub, token, name) -> float | None:
    text = requests.get(hub.url + "/hub/metrics", headers={"Authorization": f"token {token}"}, timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_a_refused_policy_edit_fires_its_alert_and_a_rollback_restores_it(hub, users, prometheus):
    admin = users["admin"]
    env = env_of(hub, admin)
    good = hub.policy.read_text()
    hub.policy.write_text(good.replace("quota: {gpus: {gpu: 1}}", "quota: {gpus: {tpu: 1}}"))  # no flavor tpu
    wait_for(lambda: metric_value(hub, admin.token, "gpuhub_policy_ok") == 0.0, 20, "the edit refused")
    out = runbook("upgrade-rollback", "check-policy", env)
    assert "gpuhub_policy_ok 0.0" in out and "tpu" in out, out
    version = re.search(r"^\s*(\d+)\s", out.split("gpuhub_policy_ok")[1].split("\n", 2)[2], re.M)
    if prometheus.url:
        wait_for(lambda: prometheus.alert("GpuhubPolicyNotOk") == "pending", 15, "GpuhubPolicyNotOk pending (for: 5m)")
    out = runbook("upgrade-rollback", "rollback-policy", env | {"VERSION": version.group(1) if version else "1"})
    wait_for(lambda: metric_value(hub, admin.token, "gpuhub_policy_ok") == 1.0, 20, "the rollback in force")
    assert "tpu" not in hub.policy.read_text()
    out = runbook("upgrade-rollback", "verify", env)
    assert "hub: 200" in out and "gpuhub_policy_ok 1.0" in out and "users: " in out, out
    if prometheus.url:
        wait_for(lambda: prometheus.alert("GpuhubPolicyNotOk") is None, 15, "GpuhubPolicyNotOk to resolve")


def test_rotating_the_cookie_secret_logs_everyone_out_and_a_revoked_token_is_refused(hub, users):
    admin, alice = users["admin"], users["alice"]
    r = alice.api.post(alice.url("/users/alice/tokens"), json={"note": "leaked"})
    r.raise_for_status()
    leaked, leaked_id = r.json()["token"], r.json()["id"]
    env = env_of(hub, admin, WHO="alice", TOKEN_ID=leaked_id, OLD_TOKEN=leaked)
    out = runbook("secrets-rotation", "check", env)
    assert "cookie secret: mode 600" in out and re.search(rf"^{leaked_id}  note=leaked  created ", out, re.M), out
    assert alice.session.get(hub.url + "/hub/home", allow_redirects=False).status_code == 200
    before = (hub.data / "jupyterhub_cookie_secret").read_text()
    out = runbook("secrets-rotation", "rotate-cookie-secret", env)
    assert "cookie secret: mode 600" in out and (hub.data / "jupyterhub_cookie_secret").read_text() != before
    hub.stop(kill_servers=False)  # `systemctl restart gpuhub`
    hub.start(timeout=120)
    r = alice.session.get(hub.url + "/hub/home", allow_redirects=False)
    assert r.status_code == 302 and "/hub/login" in r.headers["Location"], (r.status_code, r.headers)
    assert requests.get(hub.url + "/hub/api/user", headers={"Authorization": f"token {leaked}"}).status_code == 200
    out = runbook("secrets-rotation", "revoke-token", env)
    assert "revoke: 204" in out, out
    out = runbook("secrets-rotation", "verify", env)
    assert "revoked token: 403" in out and "admin token: 200" in out, out
    users["alice"] = hub.login("alice")
    users["bob"] = hub.login("bob")


def test_rotating_a_users_ray_token_stops_her_clusters_and_her_next_one_runs_with_a_new_token(hub, users):
    pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")
    admin, alice = users["admin"], users["alice"]

    def ray_cli(*args):
        e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
        e.update(GPUHUB_TOKEN=alice.token)
        r = subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "ray", "--hub", hub.url, *args],
            capture_output=True,
            text=True,
            env=e,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout + r.stderr + hub.tail(30)
        return r.stdout

    def cluster_token(name):
        """The token the cluster's processes run with (their environment, read as root)."""
        for pid in processes_with_env(f"GPUHUB_RAY_CLUSTER={name}"):
            env = dict(i.split("=", 1) for i in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in i)
            if env.get("RAY_AUTH_TOKEN"):
                return env["RAY_AUTH_TOKEN"]
        return None

    assert "Ray cluster leaked: running" in ray_cli("up", "--gpus", "0", "--name", "leaked")
    stored = hub.data / "ray" / "tokens" / "alice"
    old = stored.read_text().strip()
    assert cluster_token("leaked") == old
    out = runbook("secrets-rotation", "rotate-ray-token", env_of(hub, admin, WHO="alice"))
    assert re.search(r"^stopped Ray cluster \S+: 200$", out, re.M) and not stored.exists(), out
    states = {c["name"]: c["state"] for c in alice.api.get(alice.url("/gpuhub/ray")).json()["clusters"]}
    assert states["leaked"] == "stopped", states
    assert "Ray cluster fresh: running" in ray_cli("up", "--gpus", "0", "--name", "fresh")
    new = stored.read_text().strip()
    assert new != old and cluster_token("fresh") == new
    ray_cli("down", "fresh")


def test_every_marked_block_of_these_pages_is_run_by_a_test():
    """A block added to a page without a test fails here."""
    mine = [(page, step) for page in PAGES for step in blocks(page)] + [("upgrade-rollback", s) for s in POLICY_STEPS]
    ran = steps_run_by(__file__)
    missing = sorted(f"runbook:{page}/{step}" for page, step in mine if (page, step) not in ran)
    assert not missing, f"marked blocks no test runs: {missing}"
    # the page's other blocks (the database) are test_runbooks_restore.py's
    assert set(blocks("upgrade-rollback")) == POLICY_STEPS | {"check-db", "upgrade-db", "rollback-db"}
