"""An MLflow that already exists (issue 42 item 3): a client's tracking server, full of history
from before gpuhub, fronted by the hub as docs/mlflow.md ("Using an existing MLflow server") says.

A separate, real ``mlflow server`` 3.17.2 with the basic-auth app, its own accounts (alice, who
is also a hub user, and oldtimer, who is not) and experiments, runs, params, metrics, tags and
an artifact logged "before". Then a real hub is pointed at it with ``external_url`` and the
server's admin login, exactly as the guide says, and:

- alice's old run reads back as it was, from her notebook (a real kernel, nothing configured);
- her new notebook run lands beside it, in the same experiment, with her identity;
- permissions are as before: bob (a hub user with no grant there) can neither read alice's
  experiment nor oldtimer's, alice cannot read oldtimer's; oldtimer's account survives the
  service's sweeps of removed hub users (it never provisioned it).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import secrets
import subprocess
import sys
import time

import pytest
import requests

from mlflow_service import POLICY, MlflowEndpoint
from support.hub import Hub
from support.kernel import KernelSession
from support.ports import free_port

pytestmark = pytest.mark.integration

API = "/api/2.0/mlflow"
PREFIX = "/services/mlflow"  # the guide: the existing server runs with --static-prefix /services/mlflow


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        ok, seen = check()
        if ok:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"waited {timeout:g} s for {what}; last seen: {seen}")


class OldServer:
    """The client's MLflow, started as they would run it (not by gpuhub)."""

    def __init__(self, root, port: int):
        self.root, self.port = root, port
        self.url = f"http://127.0.0.1:{port}{PREFIX}"
        self.admin = ("admin", secrets.token_urlsafe(16))
        ini = configparser.ConfigParser()
        ini["mlflow"] = {
            "default_permission": "NO_PERMISSIONS",  # the guide's per-user model
            "database_uri": f"sqlite:///{root / 'auth.db'}",
            "admin_username": self.admin[0],
            "admin_password": self.admin[1],
            "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
            # The guide's credential cache (docs/mlflow.md, "Using an existing MLflow server"):
            # without it each of the ~100 requests the hub's service relays here costs a
            # PBKDF2 hash: this server's app used 31.5 CPU-s of the module's 70, 6.5 with it.
            "auth_cache_ttl_seconds": "30",
        }
        with open(root / "auth.ini", "w") as f:
            ini.write(f)
        env = dict(
            os.environ,
            MLFLOW_AUTH_CONFIG_PATH=str(root / "auth.ini"),
            MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
            MLFLOW_DISABLE_TELEMETRY="true",
        )
        mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
        self.proc = subprocess.Popen(
            [
                mlflow,
                "server",
                "--app-name",
                "basic-auth",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
                "--serve-artifacts",
                "--static-prefix",
                PREFIX,
            ],
            env=env,
            stdout=open(root / "server.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def as_user(self, user: str, password: str) -> requests.Session:
        s = requests.Session()
        s.auth = (user, password)
        return s

    def admin_session(self) -> requests.Session:
        return self.as_user(*self.admin)

    def wait_ready(self) -> None:
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"the old MLflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                r = requests.get(f"http://127.0.0.1:{self.port}{PREFIX}/health", timeout=5)
                return r.status_code == 200, r.status_code
            except requests.ConnectionError as e:
                return False, str(e)

        _wait(up, 120, f"the old MLflow server at {self.url} to answer /health")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def _log_history(old: OldServer, user: str, password: str, experiment: str, tmp) -> dict:
    """As ``user`` on the old server, with MLflow's own client: an experiment and a run with a
    param, a metric history, a tag and an artifact. Returns the ids."""
    script = (
        "import json, mlflow\n"
        f"mlflow.set_experiment({experiment!r})\n"
        "with mlflow.start_run(run_name='before-gpuhub') as run:\n"
        "    mlflow.log_param('lr', '0.1')\n"
        "    for step, acc in enumerate([0.5, 0.7, 0.8]):\n"
        "        mlflow.log_metric('acc', acc, step=step)\n"
        "    mlflow.set_tag('dataset', 'imagenet-subset')\n"
        f"    mlflow.log_text('weights before gpuhub', 'model/notes.txt')\n"
        "print(json.dumps({'run': run.info.run_id, 'experiment': run.info.experiment_id}))\n"
    )
    env = dict(
        os.environ,
        MLFLOW_TRACKING_URI=old.url,
        MLFLOW_TRACKING_USERNAME=user,
        MLFLOW_TRACKING_PASSWORD=password,
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    root = tmp_path_factory.mktemp("old-mlflow")
    server = OldServer(root, free_port())
    try:
        server.wait_ready()
        admin = server.admin_session()
        passwords = {"alice": secrets.token_urlsafe(12), "oldtimer": secrets.token_urlsafe(12)}
        for name, pw in passwords.items():
            r = admin.post(server.url + "/api/2.0/mlflow/users/create", json={"username": name, "password": pw})
            assert r.status_code == 200, r.text
        server.history = {
            "alice": _log_history(server, "alice", passwords["alice"], "vision-baseline", root),
            "oldtimer": _log_history(server, "oldtimer", passwords["oldtimer"], "oldtimer-2023", root),
        }
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fronted(tmp_path_factory, old):
    """A real hub pointed at the old server as the guide says: ``external_url`` (with the
    static prefix) and the server's admin login from a file only the hub's user reads."""
    work = tmp_path_factory.mktemp("existing-mlflow-hub")
    creds = work / "mlflow-admin.json"
    fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"username": old.admin[0], "password": old.admin[1]}, f)
    service_port = free_port()
    extra = (
        "from gpuhub_spawner.wiring.mlflow import configure as _configure_mlflow\n"
        "import os as _os\n"
        f"_configure_mlflow(c, data_dir=_os.path.join(_os.environ['GPUHUB_DATA_DIR'], 'mlflow'), port={service_port},\n"
        f"                  policy_path=_os.environ['GPUHUB_POLICY'], reconcile_interval=2,\n"
        f"                  external_url={old.url!r}, admin_credentials_file={str(creds)!r})\n"
    )
    hub = Hub(work, POLICY, extra_config=extra)
    hub.start(timeout=90)
    try:
        yield hub, MlflowEndpoint(hub, service_port)
    finally:
        hub.stop()


def test_old_runs_read_back_and_new_notebook_runs_land_beside_them(old, fronted):
    hub, mlflow = fronted
    alice = hub.login("alice")
    mlflow.wait_ready(alice.token)
    before = old.history["alice"]
    r = alice.start("cpu")
    assert r.status_code in (201, 202), r.text
    server = alice.wait_ready()
    (hub.data / "home" / "alice" / "t.ipynb").write_text(
        json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    )
    kernel = KernelSession(hub.url, server["url"], alice.token, "t.ipynb")
    try:
        # Nothing in the notebook configures MLflow: the hub's service is the tracking URI.
        out = kernel.execute(
            "import json, mlflow\n"
            f"old = mlflow.get_run({before['run']!r})\n"
            "hist = mlflow.MlflowClient().get_metric_history(old.info.run_id, 'acc')\n"
            "notes = mlflow.artifacts.load_text(old.info.artifact_uri + '/model/notes.txt')\n"
            "mlflow.set_experiment('vision-baseline')\n"
            "with mlflow.start_run(run_name='after-gpuhub') as new:\n"
            "    mlflow.log_param('lr', '0.05')\n"
            "    mlflow.log_metric('acc', 0.85)\n"
            "print(json.dumps({'params': old.data.params, 'tags': old.data.tags, 'acc': [m.value for m in hist],\n"
            "                  'notes': notes, 'new': new.info.run_id, 'experiment': new.info.experiment_id}))\n"
        )
    finally:
        kernel.close()
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["params"] == {"lr": "0.1"} and seen["tags"]["dataset"] == "imagenet-subset", seen
    assert seen["acc"] == [0.5, 0.7, 0.8] and seen["notes"] == "weights before gpuhub", seen
    assert seen["experiment"] == before["experiment"], "the new run went to a new experiment, not beside the old one"
    # On the old server itself (its admin, not through gpuhub): both runs, the new one alice's.
    admin = old.admin_session()
    runs = admin.post(old.url + API + "/runs/search", json={"experiment_ids": [before["experiment"]]}).json()["runs"]
    by_id = {r["info"]["run_id"]: r for r in runs}
    assert set(by_id) == {before["run"], seen["new"]}, sorted(by_id)
    new_tags = {t["key"]: t["value"] for t in by_id[seen["new"]]["data"].get("tags", [])}
    assert new_tags.get("mlflow.user") == "alice" and by_id[seen["new"]]["info"]["user_id"] == "alice", new_tags
    old_params = {p["key"]: p["value"] for p in by_id[before["run"]]["data"].get("params", [])}
    assert old_params == {"lr": "0.1"}, old_params  # the new run's lr=0.05 went to the new run only


def test_permissions_are_as_before(old, fronted):
    hub, mlflow = fronted
    alice, bob = hub.login("alice"), hub.login("bob")
    mlflow.wait_ready(bob.token)

    def get(client, run_id):
        return mlflow.api(client.token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id})

    assert get(alice, old.history["alice"]["run"]).status_code == 200
    # bob is a hub user (the service made or adopted his account) with no grant on that server.
    assert get(bob, old.history["alice"]["run"]).status_code in (403, 404)
    assert get(bob, old.history["oldtimer"]["run"]).status_code in (403, 404)
    assert get(alice, old.history["oldtimer"]["run"]).status_code in (403, 404)
    # oldtimer is not a hub user. The service's sweep of removed hub users deletes only accounts
    # it made: frank, a hub user it provisions and the hub then removes, is swept; oldtimer stays.
    hub_admin = hub.login("admin")
    assert hub_admin.api.post(hub_admin.url("/users/frank")).status_code == 201
    token = hub_admin.api.post(hub_admin.url("/users/frank/tokens"), json={"note": "frank"}).json()["token"]
    r = mlflow.api(token).post(mlflow.direct + API + "/experiments/create", json={"name": "users/frank"})
    assert r.status_code == 200, r.text
    admin = old.admin_session()

    def account(name):
        return admin.get(old.url + API + "/users/get", params={"username": name}).status_code

    assert account("frank") == 200
    assert hub_admin.api.delete(hub_admin.url("/users/frank")).status_code == 204
    _wait(lambda: (account("frank") == 404, account("frank")), 60, "the service's sweep to delete frank's account")
    assert account("oldtimer") == 200, "the sweep deleted an account the service never made"
    r = admin.get(old.url + API + "/runs/get", params={"run_id": old.history["oldtimer"]["run"]})
    assert r.status_code == 200 and r.json()["run"]["data"]["params"] == [{"key": "lr", "value": "0.1"}], r.text[:300]


def _as_hub_user(mlflow, token: str, code: str) -> dict:
    """``code`` run by MLflow's own client against the hub's service with a hub token (as a
    notebook would, without a kernel); its last printed line, as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=mlflow.direct, MLFLOW_TRACKING_TOKEN=token, MLFLOW_DISABLE_TELEMETRY="true")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_history_moves_into_the_hub_managed_mlflow_with_its_owners(old, mlflow_hub, tmp_path):
    """docs/mlflow.md "Moving history into the hub's MLflow": `gpuhub mlflow import-history`
    copies the old server's experiments (MLflow's export/import tool) into the hub-managed
    server and gives each experiment's users the permissions they had; twice is harmless."""
    hub, mlflow = mlflow_hub
    alice, bob = hub.login("alice"), hub.login("bob")
    mlflow.wait_ready(alice.token)
    creds = tmp_path / "old-admin.json"
    fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"username": old.admin[0], "password": old.admin[1]}, f)
    gpuhub = os.path.join(os.path.dirname(sys.executable), "gpuhub")
    command = [gpuhub, "mlflow", "import-history", "--from", old.url, "--from-credentials", str(creds)]
    command += ["--data-dir", str(mlflow.data)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "imported 'vision-baseline'" in first.stdout and "imported 'oldtimer-2023'" in first.stdout, first.stdout
    before = old.history["alice"]
    seen = _as_hub_user(
        mlflow,
        alice.token,
        "import json, mlflow\n"
        "c = mlflow.MlflowClient()\n"
        "e = c.get_experiment_by_name('vision-baseline')\n"
        f"r = [r for r in c.search_runs([e.experiment_id]) if r.data.tags.get('mlflow_exim.run_info.run_id') == {before['run']!r}][0]\n"
        "print(json.dumps({'params': r.data.params, 'tags': r.data.tags, 'run': r.info.run_id,\n"
        "                  'acc': [m.value for m in c.get_metric_history(r.info.run_id, 'acc')],\n"
        "                  'notes': mlflow.artifacts.load_text(r.info.artifact_uri + '/model/notes.txt'),\n"
        "                  'experiment': e.experiment_id}))\n",
    )
    assert seen["params"] == {"lr": "0.1"} and seen["tags"]["dataset"] == "imagenet-subset", seen
    assert seen["acc"] == [0.5, 0.7, 0.8] and seen["notes"] == "weights before gpuhub", seen
    assert seen["tags"].get("mlflow_exim.run_info.user_id") == "alice", "the run's original owner was not kept"
    # Owners kept, nobody else let in: bob reads neither; alice does not read oldtimer's.
    admin = mlflow.admin()
    ids = {
        name: admin.get(admin.base + API + "/experiments/get-by-name", params={"experiment_name": name}).json()["experiment"][
            "experiment_id"
        ]
        for name in ("vision-baseline", "oldtimer-2023")
    }
    assert ids["vision-baseline"] == seen["experiment"]

    def get(token, name):  # (a search answers 200 with what the caller may see; a get says no)
        r = mlflow.api(token).get(mlflow.direct + API + "/experiments/get", params={"experiment_id": ids[name]})
        return r.status_code

    # Only what the old server granted: alice's own; bob had nothing there and gets nothing here
    # (the hub's team sharing applies to experiments made through it, not to imported ones).
    assert get(alice.token, "vision-baseline") == 200
    assert get(bob.token, "vision-baseline") in (403, 404)
    assert get(alice.token, "oldtimer-2023") in (403, 404)
    grant = admin.get(
        admin.base + "/api/3.0/mlflow/users/permissions/get",
        params={"username": "oldtimer", "resource_type": "experiment", "resource_id": ids["oldtimer-2023"]},
    )
    assert grant.status_code == 200 and grant.json().get("permission") == "MANAGE", grant.text[:300]
    # Twice: nothing imported again; everything the first run saw is skipped (in some orders
    # test_permissions_are_as_before has already made frank's experiment on the old server).
    counted = re.search(r"(\d+) imported, (\d+) skipped", first.stdout)
    assert counted, first.stdout
    seen_first = int(counted[1]) + int(counted[2])
    runs = len(admin.post(admin.base + API + "/runs/search", json={"experiment_ids": [ids["vision-baseline"]]}).json()["runs"])
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f"0 imported, {seen_first} skipped" in again.stdout, (again.stdout, again.stderr[-1000:])
    after = admin.post(admin.base + API + "/runs/search", json={"experiment_ids": [ids["vision-baseline"]]}).json()["runs"]
    assert len(after) == runs
