"""Central MLflow end to end: a real hub (our config and local spawner), the real
MLflow service (tracking server + authenticating proxy), real single-user servers
and real kernels. Nothing in the notebook configures MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import requests

from mlflow_kernel import KernelSession

pytestmark = pytest.mark.integration

API = "/api/2.0/mlflow"


def _git(cwd, *args):
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.org",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.org",
            "PATH": "/usr/bin:/bin",
            "HOME": str(cwd),
        },
    ).stdout.strip()


def _until(check, timeout: float, what: str):
    """Wait for a condition the system reaches asynchronously; fail with what was seen."""
    deadline = time.time() + timeout
    seen = None
    while time.time() < deadline:
        ok, seen = check()
        if ok:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"{what}: last seen {seen}")


@pytest.fixture(scope="module")
def users(hub, mlflow):
    clients = {name: hub.login(name) for name in ("alice", "bob", "carol", "admin")}
    mlflow.wait_ready(clients["alice"].token)
    return clients


@pytest.fixture(scope="module")
def alice_notebook(hub, users):
    """alice's GPU server, with a notebook in a git repository that has local changes."""
    alice = users["alice"]
    r = alice.start("a100-1")
    assert r.status_code in (201, 202), r.text
    server = alice.wait_ready()
    repo = hub.data / "home" / "alice" / "project"
    repo.mkdir(parents=True)
    (repo / "train.ipynb").write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (repo / "model.py").write_text("LR = 0.1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "model.py").write_text("LR = 0.2\n")  # uncommitted change: dirty tree
    home = repo.parent.stat()
    if os.geteuid() == 0 and home.st_uid != 0:
        # Servers run as the user's own Unix account: the repository is theirs (git
        # refuses to read a repository owned by someone else).
        for path in [repo, *repo.rglob("*")]:
            os.chown(path, home.st_uid, home.st_gid, follow_symlinks=False)
    kernel = KernelSession(hub.url, server["url"], alice.token, "project/train.ipynb")
    yield kernel, commit
    kernel.close()


@pytest.fixture(scope="module")
def alice_run(alice_notebook):
    kernel, commit = alice_notebook
    out = kernel.execute("import mlflow\nmlflow.log_metric('loss', 0.1)\nprint(mlflow.last_active_run().info.run_id)\n")
    return out.strip().splitlines()[-1], commit


def get_run(mlflow, token, run_id):
    return mlflow.api(token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id})


def test_notebook_run_is_owned_by_the_user_and_tagged(mlflow, users, alice_run):
    run_id, commit = alice_run
    r = get_run(mlflow, users["alice"].token, run_id)
    assert r.status_code == 200, r.text
    run = r.json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["user_id"] == "alice"
    assert tags["mlflow.user"] == "alice"
    assert tags["gpuhub.user"] == "alice"
    assert tags["gpuhub.team"] == "vision"
    assert tags["gpuhub.profile"] == "a100-1"
    assert tags["gpuhub.gpu.flavor"] == "a100"
    assert tags["gpuhub.gpu.count"] == "1"
    assert tags["gpuhub.server"] == "default"
    # One machine: the server runs in the hub's Python, not in the profile's image.
    assert "gpuhub.image" not in tags and "gpuhub.image.digest" not in tags, tags
    # What the results depend on (versions), not where the hub's environment lies on its disk.
    runtime = tags["gpuhub.runtime"]
    assert runtime.startswith("one machine (the hub's Python environment): Python ") and ", gpuhub " in runtime, tags
    assert "/" not in runtime, runtime
    assert tags["gpuhub.git.commit"] == commit == tags["mlflow.source.git.commit"]
    assert tags["gpuhub.git.dirty"] == "true"
    assert tags["gpuhub.notebook"].endswith("train.ipynb")
    assert [m for m in run["data"]["metrics"] if m["key"] == "loss"][0]["value"] == 0.1
    exp = (
        mlflow.api(users["alice"].token)
        .get(mlflow.direct + API + "/experiments/get", params={"experiment_id": run["info"]["experiment_id"]})
        .json()["experiment"]
    )
    assert exp["name"] == "users/alice"


def test_gpu_server_logs_system_metrics(alice_notebook):
    kernel, _ = alice_notebook
    out = kernel.execute(
        "import os, time, mlflow\n"
        "print(os.environ.get('MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING'))\n"
        "os.environ['MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL'] = '0.5'\n"
        "mlflow.end_run()\n"
        "with mlflow.start_run(run_name='sysmetrics') as run:\n"
        "    for _ in range(120):  # until the monitor has published a sample (at least one full cycle)\n"
        "        time.sleep(0.5)\n"
        "        if any(k.startswith('system/') for k in mlflow.get_run(run.info.run_id).data.metrics):\n"
        "            break\n"
        "keys = sorted(mlflow.get_run(run.info.run_id).data.metrics)\n"
        "print([k for k in keys if k.startswith('system/')])\n"
    )
    lines = out.strip().splitlines()
    assert "true" in lines
    system_metrics = eval(lines[-1])  # noqa: S307 - our own kernel's repr of a list of str
    assert "system/cpu_utilization_percentage" in system_metrics, out


def test_artifacts_go_through_the_service_with_the_same_permissions(mlflow, users, alice_notebook):
    kernel, _ = alice_notebook
    out = kernel.execute(
        "import os\n"
        "os.environ['MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR'] = 'false'  # tqdm's bar, on stderr, joins the output\n"
        "import mlflow\n"
        "mlflow.end_run()\n"
        "with mlflow.start_run(run_name='artifacts') as run:\n"
        "    mlflow.log_text('hello from alice', 'notes/hello.txt')\n"
        "print(run.info.run_id)\n"
        "print(mlflow.artifacts.load_text(f'runs:/{run.info.run_id}/notes/hello.txt'))\n"
    )
    run_id, text = out.strip().splitlines()[-2:]
    assert text == "hello from alice"
    run = get_run(mlflow, users["alice"].token, run_id).json()["run"]
    path = run["info"]["artifact_uri"].split("mlflow-artifacts:/", 1)[1] + "/notes/hello.txt"
    r = mlflow.api(users["alice"].token).get(f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{path}")
    assert r.status_code == 200 and r.text == "hello from alice"
    r = mlflow.api(users["carol"].token).get(f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{path}")
    assert r.status_code == 403
    r = requests.get(f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{path}")
    assert r.status_code == 401


def test_notebook_environment_holds_no_mlflow_credential(mlflow, users, alice_run):
    from gpuhub_spawner.mlflow.secrets import Passwords, load_or_create_key

    env = users["alice"].server_env()
    secrets = Passwords(load_or_create_key(mlflow.data / "service"))
    forbidden = {
        secrets.user("alice"),
        secrets.admin(),
        secrets.user("bob"),
        (mlflow.data / "service" / "service.key").read_text().strip(),
    }
    assert not forbidden & set(env.values())
    assert not any(f in v for f in forbidden for v in env.values())
    for key in (
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
    ):
        assert key not in env
    assert env["MLFLOW_TRACKING_URI"] == mlflow.direct


def test_teammate_can_read_but_not_write(mlflow, users, alice_run):
    run_id, _ = alice_run
    bob = mlflow.api(users["bob"].token)
    assert get_run(mlflow, users["bob"].token, run_id).status_code == 200
    r = bob.post(
        mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 9.9, "timestamp": 0, "step": 1}
    )
    assert r.status_code == 403, r.text
    r = bob.post(mlflow.direct + API + "/runs/delete", json={"run_id": run_id})
    assert r.status_code == 403, r.text


def test_other_team_can_neither_read_nor_write(mlflow, users, alice_run):
    run_id, _ = alice_run
    carol = mlflow.api(users["carol"].token)
    assert get_run(mlflow, users["carol"].token, run_id).status_code == 403
    exp_id = get_run(mlflow, users["alice"].token, run_id).json()["run"]["info"]["experiment_id"]
    r = carol.post(mlflow.direct + API + "/runs/create", json={"experiment_id": exp_id, "start_time": 0})
    assert r.status_code == 403, r.text
    r = carol.post(
        mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 9.9, "timestamp": 0, "step": 1}
    )
    assert r.status_code == 403, r.text
    r = carol.post(mlflow.direct + API + "/experiments/delete", json={"experiment_id": exp_id})
    assert r.status_code == 403, r.text


@pytest.mark.parametrize("where", ["direct", "public"])
def test_anonymous_and_bad_tokens_are_refused(mlflow, where, alice_run):
    base = getattr(mlflow, where)
    run_id, _ = alice_run
    r = requests.get(base + API + "/runs/get", params={"run_id": run_id})
    assert r.status_code == 401, r.text
    r = requests.get(base + API + "/runs/get", params={"run_id": run_id}, headers={"Authorization": "Bearer not-a-hub-token"})
    assert r.status_code in (401, 403), r.text
    # MLflow basic auth is not accepted from outside: only the service holds passwords.
    r = requests.get(base + API + "/experiments/search", params={"max_results": 1}, auth=("alice", "guess"))
    assert r.status_code in (401, 403), r.text
    # The UI sends anonymous browsers to the hub login, never to a basic-auth prompt.
    r = requests.get(base + "/", allow_redirects=False)
    assert r.status_code == 302
    assert "/hub/api/oauth2/authorize" in r.headers["Location"]
    assert "WWW-Authenticate" not in r.headers


def test_ui_single_sign_on_with_the_hub_login(hub, mlflow, users, alice_run):
    run_id, _ = alice_run
    browser = users["alice"].session  # cookies of a form login to the hub, nothing else
    home = browser.get(hub.url + "/hub/home")
    links = home.text.split('id="gpuhub-links"', 1)[1]  # the home page links the UI
    # ... at the service's own origin, with the hub's port (the public address the UI answers on)
    # (on its experiments list, not MLflow 3's GenAI welcome page)
    assert f'href="{mlflow.public.rstrip("/")}/#/experiments">MLflow</a>' in links, links[:500]
    r = browser.get(mlflow.public + "/")
    assert r.status_code == 200, r.text[:300]
    assert r.url.rstrip("/") == mlflow.public
    assert "<title>MLflow" in r.text or "mlflow" in r.text.lower()
    r = browser.get(mlflow.public + "/ajax-api/2.0/mlflow/runs/get", params={"run_id": run_id})
    assert r.status_code == 200 and r.json()["run"]["info"]["user_id"] == "alice"
    # A cookie-authenticated write from another site is refused.
    r = browser.post(
        mlflow.public + "/ajax-api/2.0/mlflow/runs/set-tag",
        json={"run_id": run_id, "key": "x", "value": "y"},
        headers={"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
    )
    assert r.status_code == 403


def test_personal_experiment_names_cannot_be_squatted(mlflow, users):
    bob = mlflow.api(users["bob"].token)
    r = bob.post(mlflow.direct + API + "/experiments/create", json={"name": "users/alice/notes"})
    assert r.status_code == 403, r.text
    r = bob.post(mlflow.direct + API + "/experiments/create", json={"name": "users/bob/notes"})
    assert r.status_code == 200, r.text


def test_run_owner_cannot_be_spoofed(mlflow, users):
    alice = mlflow.api(users["alice"].token)
    # An experiment of her own (users/alice itself exists only once a notebook of hers logged a run).
    exp = alice.get(mlflow.direct + API + "/experiments/get-by-name", params={"experiment_name": "users/alice/spoof"})
    if exp.status_code == 200:
        exp_id = exp.json()["experiment"]["experiment_id"]
    else:
        r = alice.post(mlflow.direct + API + "/experiments/create", json={"name": "users/alice/spoof"})
        assert r.status_code == 200, r.text
        exp_id = r.json()["experiment_id"]
    r = alice.post(
        mlflow.direct + API + "/runs/create",
        json={
            "experiment_id": exp_id,
            "user_id": "bob",
            "start_time": 0,
            "tags": [{"key": "mlflow.user", "value": "bob"}],
        },
    )
    assert r.status_code == 200, r.text
    run = r.json()["run"]
    run_id = run["info"]["run_id"]
    r = alice.post(mlflow.direct + API + "/runs/set-tag", json={"run_id": run_id, "key": "mlflow.user", "value": "bob"})
    assert r.status_code == 200
    run = get_run(mlflow, users["alice"].token, run_id).json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["user_id"] == "alice"
    assert tags["mlflow.user"] == "alice"


def test_account_administration_is_not_reachable(mlflow, users):
    alice = mlflow.api(users["alice"].token)
    r = alice.post(mlflow.direct + API + "/users/create", json={"username": "eve", "password": "x" * 20})
    assert r.status_code == 403
    r = alice.patch(mlflow.direct + API + "/users/update-admin", json={"username": "alice", "is_admin": True})
    assert r.status_code == 403


def test_removing_a_user_from_the_hub_revokes_mlflow_access(hub, mlflow, users):
    admin = users["admin"].api
    assert admin.post(users["admin"].url("/users/frank")).status_code == 201
    token = admin.post(users["admin"].url("/users/frank/tokens"), json={"note": "frank"}).json()["token"]
    frank = mlflow.api(token)
    r = frank.post(mlflow.direct + API + "/experiments/create", json={"name": "users/frank"})
    assert r.status_code == 200, r.text
    mlf_admin = mlflow.admin()
    assert mlf_admin.get(mlf_admin.base + API + "/users/get", params={"username": "frank"}).status_code == 200

    assert admin.delete(users["admin"].url("/users/frank")).status_code == 204

    def token_refused():
        code = frank.get(mlflow.direct + API + "/experiments/search", params={"max_results": 1}).status_code
        return code in (401, 403), code

    def account_gone():
        code = mlf_admin.get(mlf_admin.base + API + "/users/get", params={"username": "frank"}).status_code
        return code == 404, code

    _until(token_refused, 60, "removed user's token still accepted")
    _until(account_gone, 60, "removed user's MLflow account still exists")
