"""Pieces of the MLflow wiring that need no server: config merging, the proxy's
ownership rules, the notebook-side tags and token scoping (against a real git repo)."""

from __future__ import annotations

import json
import subprocess

import pytest
from traitlets.config import Config

from gpuhub_spawner.wiring.mlflow import configure
from gpuhub_spawner.mlflow.paths import AmbiguousPath, decode_path, encode_path
from gpuhub_spawner.mlflow.proxy import Refused, account_route, rewrite_request, same_origin_error
from gpuhub_spawner.mlflow.secrets import Passwords, load_or_create_key
from gpuhub_spawner.mlflow.upstream import ADMIN_USERNAME, MlflowServer, ServerSettings, _redact


def test_configure_merges_into_existing_config(tmp_path):
    c = Config()
    c.JupyterHub.services = [{"name": "culler", "command": ["x"]}]
    c.JupyterHub.load_roles = [{"name": "culler", "scopes": ["list:users"], "services": ["culler"]}]
    c.JupyterHub.template_vars = {"gpuhub_links": [{"name": "GPUs", "url": "/hub/gpuhub"}], "other": 1}
    c.Spawner.environment = {"GPUHUB_TEST_RUN": "1"}
    c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", "read:users:name!user"]
    c.JupyterHub.extra_user_scopes = {"read:groups"}
    configure(c, data_dir=str(tmp_path), port=12345, policy_path="/p.yaml")
    configure(c, data_dir=str(tmp_path), port=12345, policy_path="/p.yaml")  # idempotent

    names = [s["name"] for s in c.JupyterHub.services]
    assert names == ["culler", "mlflow"]
    svc = c.JupyterHub.services[1]
    assert svc["url"] == "http://127.0.0.1:12345" and svc["oauth_no_confirm"] is True
    assert svc["command"][1:3] == ["-m", "gpuhub_spawner.mlflow"] and "--policy" in svc["command"]
    assert sorted(r["name"] for r in c.JupyterHub.load_roles) == ["culler", "gpuhub-mlflow-service", "server"]
    assert c.JupyterHub.extra_user_scopes == {"read:groups", "access:services!service=mlflow"}
    assert c.Spawner.server_token_scopes == [
        "users:activity!user",
        "access:servers!server",
        "read:users:name!user",
        "access:services!service=mlflow",
    ]
    env = c.Spawner.environment
    assert env["GPUHUB_TEST_RUN"] == "1"
    assert env["MLFLOW_TRACKING_URI"] == env["GPUHUB_MLFLOW_TRACKING_URI"] == "http://127.0.0.1:12345/services/mlflow"
    assert "MLFLOW_TRACKING_TOKEN" not in env
    assert callable(env["MLFLOW_EXPERIMENT_NAME"])
    assert c.JupyterHub.template_vars["other"] == 1
    assert c.JupyterHub.template_vars["gpuhub_links"] == [
        {"name": "GPUs", "url": "/hub/gpuhub"},
        {"name": "MLflow", "url": "/services/mlflow/", "service": "mlflow", "fragment": "#/experiments"},
    ]
    # Nothing secret in the hub config: no password, no key.
    assert "password" not in json.dumps(c.JupyterHub.services).lower()


def test_configure_defaults_keep_the_server_role_scopes(tmp_path):
    c = Config()
    configure(
        c,
        data_dir=str(tmp_path),
        token_env=True,
        tracking_uri="http://proxy-public/services/mlflow",
        backend_store_uri="postgresql://mlflow:pw@db/mlflow",
        bind_ip="0.0.0.0",
    )
    svc = c.JupyterHub.services[0]
    assert "postgresql://mlflow:pw@db/mlflow" not in " ".join(svc["command"])  # the hub logs commands
    assert svc["environment"]["GPUHUB_MLFLOW_BACKEND_STORE_URI"] == "postgresql://mlflow:pw@db/mlflow"
    assert svc["command"][-2:] == ["--bind-ip", "0.0.0.0"]
    assert "server_token_scopes" not in c.Spawner  # the server role carries it: nothing replaced
    server = next(r for r in c.JupyterHub.load_roles if r["name"] == "server")
    assert {"users:activity!user", "access:servers!server", "access:services!service=mlflow"} <= set(server["scopes"])
    assert c.Spawner.environment["MLFLOW_TRACKING_URI"] == "http://proxy-public/services/mlflow"
    assert callable(c.Spawner.environment["MLFLOW_TRACKING_TOKEN"])
    assert c.JupyterHub.template_vars["gpuhub_links"] == [
        {"name": "MLflow", "url": "/services/mlflow/", "service": "mlflow", "fragment": "#/experiments"}
    ]


def test_configure_wraps_callable_token_scopes(tmp_path):
    c = Config()
    c.Spawner.server_token_scopes = lambda spawner: ["users:activity!user"]
    configure(c, data_dir=str(tmp_path))
    assert c.Spawner.server_token_scopes(None) == ["users:activity!user", "access:services!service=mlflow"]


def test_every_feature_adds_to_the_server_token_and_none_replaces(tmp_path):
    """Issue 20: with MLflow on, JupyterLab's cull warnings and `gpuhub usage`/`gpuhub job` in a
    terminal need the server token's culling, usage and jobs scopes; MLflow's setup used to
    replace them. Whatever order the features are configured in, the token has all of them."""
    from jupyterhub.roles import get_default_roles

    from gpuhub_spawner.policy.scopes import CULLING, USAGE, configure_scopes
    from gpuhub_spawner.wiring.jobs import JOBS, configure_jobs

    stock = set(next(r for r in get_default_roles() if r["name"] == "server")["scopes"])
    for order in ("scopes-first", "mlflow-first"):
        c = Config()
        steps = [
            lambda: configure_scopes(c),
            lambda: configure(c, data_dir=str(tmp_path / order)),
            lambda: configure_jobs(c, tmp_path / order),
        ]
        for step in steps if order == "scopes-first" else [steps[1], steps[0], steps[2]]:
            step()
        assert "server_token_scopes" not in c.Spawner
        [server] = [r for r in c.JupyterHub.load_roles if r["name"] == "server"]
        want = stock | {f"{CULLING}!user", USAGE, f"{JOBS}!user", "access:services!service=mlflow"}
        assert set(server["scopes"]) == want, order


def test_printed_run_links_use_the_public_address():
    from gpuhub_notebook.mlflow_context import public_link

    env = {
        "GPUHUB_MLFLOW_TRACKING_URI": "http://127.0.0.1:10101/services/mlflow",
        "GPUHUB_MLFLOW_UI_URL": "http://mlflow--service.localhost:8000/services/mlflow/",
    }
    printed = (
        "🏃 View run calm-owl at: http://127.0.0.1:10101/services/mlflow/#/experiments/1/runs/abc\n"
        "🧪 View experiment at: http://127.0.0.1:10101/services/mlflow/#/experiments/1\n"
    )
    assert public_link(printed, env) == (
        "🏃 View run calm-owl at: http://mlflow--service.localhost:8000/services/mlflow/#/experiments/1/runs/abc\n"
        "🧪 View experiment at: http://mlflow--service.localhost:8000/services/mlflow/#/experiments/1\n"
    )
    # No public address known (no per-user origins): MLflow's own output, unchanged.
    assert public_link(printed, {**env, "GPUHUB_MLFLOW_UI_URL": ""}) == printed
    # A tracking URI the user chose elsewhere is not touched.
    other = "View run x at: http://mlflow.example.org/#/experiments/1/runs/a\n"
    assert public_link(other, env) == other


def test_run_owner_is_forced_to_the_hub_user():
    body = json.dumps(
        {"experiment_id": "1", "user_id": "bob", "tags": [{"key": "mlflow.user", "value": "bob"}, {"key": "k", "value": "v"}]}
    ).encode()
    out = json.loads(rewrite_request("api/2.0/mlflow/runs/create", "POST", body, "alice"))
    assert out["user_id"] == "alice"
    assert {t["key"]: t["value"] for t in out["tags"]} == {"mlflow.user": "alice", "k": "v"}
    out = json.loads(
        rewrite_request(
            "ajax-api/2.0/mlflow/runs/set-tag", "POST", b'{"run_id": "r", "key": "mlflow.user", "value": "bob"}', "alice"
        )
    )
    assert out["value"] == "alice"
    out = json.loads(
        rewrite_request(
            "api/2.0/mlflow/runs/log-batch", "POST", b'{"run_id": "r", "tags": [{"key": "mlflow.user", "value": "bob"}]}', "alice"
        )
    )
    assert out["tags"] == [{"key": "mlflow.user", "value": "alice"}]
    out = json.loads(
        rewrite_request(
            "ajax-api/2.0/mlflow/runs/create-promptlab-run", "POST", b'{"experiment_id": "1", "user_id": "bob"}', "alice"
        )
    )
    assert out["user_id"] == "alice"
    # Unrelated requests pass byte for byte.
    assert rewrite_request("api/2.0/mlflow/runs/log-metric", "POST", b'{"a":1}', "alice") == b'{"a":1}'


@pytest.mark.parametrize(
    "path,field", [("api/2.0/mlflow/experiments/create", "name"), ("ajax-api/2.0/mlflow/experiments/update", "new_name")]
)
def test_personal_experiment_names_are_reserved(path, field):
    with pytest.raises(Refused):
        rewrite_request(path, "POST", json.dumps({field: "users/alice/x", "experiment_id": "1"}).encode(), "bob")
    rewrite_request(path, "POST", json.dumps({field: "users/bob/x", "experiment_id": "1"}).encode(), "bob")
    rewrite_request(path, "POST", json.dumps({field: "team-vision/x", "experiment_id": "1"}).encode(), "bob")


@pytest.mark.parametrize(
    "path",
    [
        "signup",
        "api/2.0/mlflow/users/create",
        "ajax-api/2.0/mlflow/users/update-password",
        "api/2.0/mlflow/users/update-admin",
        "api/2.0/mlflow/users/delete",
        "api/2.0/mlflow/users/create-ui",
        "api/3.0/mlflow/roles/assign",
        "ajax-api/3.0/mlflow/roles/permissions/add",
        "api/3.0/mlflow/roles/get",
        "api/3.0/mlflow/roles/users/list",
        "api/3.0/mlflow/roles/permissions/list",
        "api/9.9/mlflow/users/anything-new",
    ],
)
def test_account_administration_is_blocked(path):
    assert account_route(path) == "block"


@pytest.mark.parametrize(
    "path",
    [
        "api/2.0/mlflow/users/current",
        "ajax-api/3.0/mlflow/users/permissions/grant",
        "ajax-api/3.0/mlflow/users/current/permissions",
        "api/3.0/mlflow/users/roles/list",
    ],
)
def test_self_service_account_routes_pass(path):
    assert account_route(path) == "allow"


def test_listings_are_filtered_and_other_routes_untouched():
    assert account_route("ajax-api/2.0/mlflow/users/list") == "users-list"
    assert account_route("api/3.0/mlflow/roles/list") == "roles-list"
    assert account_route("api/2.0/mlflow/runs/create") is None
    assert account_route("api/2.0/mlflow-artifacts/artifacts/users/list") is None


@pytest.mark.parametrize(
    "raw",
    [
        "/services/mlflow/api/2.0/mlflow/experiments%2Fcreate",
        "/services/mlflow/api/2.0/mlflow/experiments%2fcreate",
        "/services/mlflow/api/2.0/mlflow/x/../experiments/create",
        "/services/mlflow/api/2.0/mlflow/x/%2e%2E/experiments/create",
        "/services/mlflow/api/2.0/mlflow/./runs/create",
        "/services/mlflow/api/2.0/mlflow/%2E/runs/create",
        "/services/mlflow/api/2.0//mlflow/runs/create",
        "/services/mlflow/api/2.0/mlflow/runs\\create",
        "/services/mlflow/api/2.0/mlflow/runs%5Ccreate",
        "/services/mlflow/api/2.0/mlflow/%2565xperiments/create",
        "/services/mlflow/api/2.0/mlflow/runs/create%00",
        "/services/mlflow/api/2.0/mlflow/%ff/create",
    ],
)
def test_ambiguous_paths_are_refused(raw):
    with pytest.raises(AmbiguousPath):
        decode_path(raw)


def test_paths_are_decoded_like_mlflow_and_reencoded_canonically():
    assert (
        decode_path("/services/mlflow/api/2.0/mlflow/%65xperiments/create")
        == "/services/mlflow/api/2.0/mlflow/experiments/create"
    )
    assert decode_path("/services/mlflow/api/2.0/mlflow/runs/%63reate") == "/services/mlflow/api/2.0/mlflow/runs/create"
    assert decode_path("/services/mlflow/") == "/services/mlflow/"
    name = "/services/mlflow/api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a b?#100%.txt"
    from urllib.parse import unquote

    assert decode_path(encode_path(name)) == name == unquote(encode_path(name))


def _headers(**kw):
    from tornado.httputil import HTTPHeaders

    return HTTPHeaders({k.replace("_", "-"): v for k, v in kw.items()})


def test_same_origin_proof_for_cookie_writes():
    origins = frozenset({"https://hub.example.org"})
    ok = same_origin_error
    assert ok(_headers(Origin="https://hub.example.org", Sec_Fetch_Site="same-origin"), origins, "x") is None
    assert ok(_headers(Origin="https://HUB.example.org:443"), origins, "x") is None
    assert ok(_headers(Sec_Fetch_Site="same-origin"), origins, "x") is None
    assert ok(_headers(), origins, "hub.example.org")  # neither header: refused
    assert ok(_headers(Origin="null"), origins, "hub.example.org")
    assert ok(_headers(Origin="null", Sec_Fetch_Site="same-origin"), origins, "x")
    assert ok(_headers(Origin="https://bob.hub.example.org"), origins, "hub.example.org")
    assert ok(_headers(Sec_Fetch_Site="same-site"), origins, "x")
    assert ok(_headers(Sec_Fetch_Site="none"), origins, "x")
    # No configured origin: the request's own Host is the reference.
    assert ok(_headers(Origin="http://localhost:8000"), frozenset(), "localhost:8000") is None
    assert ok(_headers(Origin="http://bob.localhost:8000"), frozenset(), "localhost:8000")


def test_service_key_is_private_and_stable(tmp_path):
    key = load_or_create_key(tmp_path / "state")
    assert (tmp_path / "state" / "service.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert load_or_create_key(tmp_path / "state") == key
    p = Passwords(key)
    assert p.user("alice") == Passwords(key).user("alice") != p.user("bob") != p.admin()
    assert len(p.admin()) >= 12  # MLflow refuses shorter admin passwords
    assert key.decode() not in repr(p)


def test_mlflow_command_and_environment(tmp_path):
    s = MlflowServer(ServerSettings(data_dir=tmp_path, prefix="/services/mlflow/"), "adminpw-0123456789", "flask")
    cmd = s.command()
    assert cmd[cmd.index("--app-name") + 1] == "basic-auth"
    assert cmd[cmd.index("--allowed-hosts") + 1] == s.hostport
    assert cmd[cmd.index("--static-prefix") + 1] == "/services/mlflow"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "adminpw-0123456789" not in " ".join(cmd)  # the password is never on a command line
    assert "--backend-store-uri" not in cmd  # store URIs (DB passwords) go through the environment
    env = s.environment()
    assert env["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (tmp_path / "basic_auth.ini").stat().st_mode & 0o777 == 0o600
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == "adminpw-0123456789"
    ini = (tmp_path / "basic_auth.ini").read_text()
    assert "default_permission = NO_PERMISSIONS" in ini and f"admin_username = {ADMIN_USERNAME}" in ini
    assert "adminpw" not in ini


def test_the_upstream_port_is_kept_from_everyone_but_a_server_that_binds_it():
    """The MLflow child binds its port 10-20 s after the service chose it. Meanwhile no bind of
    port 0 and no outgoing connection on the machine is handed that port, and a plain bind of
    it is refused; a server binding it with SO_REUSEADDR (uvicorn, gunicorn) listens there."""
    import errno
    import socket

    from gpuhub_spawner.mlflow.upstream import free_port

    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    drawn = set()
    for _ in range(2000):  # what any process drawing port 0 would get now
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            drawn.add(s.getsockname()[1])
    assert not drawn & ports, sorted(drawn & ports)
    with socket.socket() as listener:  # what any client connection would take as its local port
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        for _ in range(200):
            with socket.create_connection(listener.getsockname()) as c:
                assert c.getsockname()[1] not in ports
                listener.accept()[0].close()
    port = min(ports)
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port)):
            pass


def test_store_uri_passwords_are_redacted_in_logs():
    assert _redact("postgresql://mlflow:s3cret@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert _redact("sqlite:////data/mlflow.db") == "sqlite:////data/mlflow.db"


# -- notebook side -------------------------------------------------------------------
def test_tags_from_identity_and_a_real_git_repo(tmp_path):
    from gpuhub_notebook import gitinfo, identity
    from gpuhub_notebook.mlflow_context import tags_for

    env = {
        "GPUHUB_USER": "alice",
        "GPUHUB_TEAM": "vision",
        "GPUHUB_PROFILE": "a100-1",
        "GPUHUB_IMAGE": "registry/img@sha256:abc",
        "GPUHUB_GPU_COUNT": "1",
        "GPUHUB_GPU_FLAVOR": "a100",
        "GPUHUB_SERVER_NAME": "exp",
    }
    ident = identity.current(env)
    genv = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
    }

    def run(*a):
        return subprocess.run(["git", *a], cwd=tmp_path, env=genv, check=True, capture_output=True, text=True)

    (tmp_path / "f.py").write_text("1\n")
    run("init", "-q")
    run("add", ".")
    run("commit", "-q", "-m", "x")
    head = run("rev-parse", "HEAD").stdout.strip()
    clean = gitinfo.state(str(tmp_path))
    assert clean.commit == head and not clean.dirty
    (tmp_path / "f.py").write_text("2\n")
    tags = tags_for(ident, gitinfo.state(str(tmp_path)), "/home/alice/nb.ipynb")
    assert tags["mlflow.user"] == tags["gpuhub.user"] == "alice"
    assert tags["gpuhub.image.digest"] == "sha256:abc" and tags["gpuhub.image"] == "registry/img@sha256:abc"
    assert "gpuhub.runtime" not in tags
    assert tags["gpuhub.gpu.count"] == "1" and tags["gpuhub.gpu.flavor"] == "a100"
    assert tags["gpuhub.server"] == "exp"
    assert tags["gpuhub.git.commit"] == head and tags["gpuhub.git.dirty"] == "true"
    assert tags["mlflow.source.name"] == "/home/alice/nb.ipynb"
    assert gitinfo.state(str(tmp_path / "..")) is None or gitinfo.state(str(tmp_path / "..")).root != str(tmp_path)


def test_system_metrics_only_on_gpu_servers():
    from gpuhub_notebook import identity
    from gpuhub_notebook.mlflow_context import enable_gpu_system_metrics

    gpu = identity.current({"GPUHUB_USER": "a", "GPUHUB_GPU_COUNT": "2"})
    cpu = identity.current({"GPUHUB_USER": "a", "GPUHUB_GPU_COUNT": "0"})
    env = {}
    assert enable_gpu_system_metrics(gpu, env) and env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] == "true"
    env = {}
    assert not enable_gpu_system_metrics(cpu, env) and env == {}
    env = {"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}  # the user's choice wins
    assert not enable_gpu_system_metrics(gpu, env)
    assert identity.current({}) is None


def test_hub_token_goes_only_to_the_hubs_mlflow():
    from gpuhub_notebook.mlflow_auth import hub_token_for

    env = {"GPUHUB_MLFLOW_TRACKING_URI": "http://hub:10101/services/mlflow", "JUPYTERHUB_API_TOKEN": "tok"}
    assert hub_token_for("http://hub:10101/services/mlflow/", env) == "tok"
    assert hub_token_for("https://mlflow.elsewhere.example", env) is None
    assert hub_token_for("http://hub:10101/services/mlflow", {**env, "MLFLOW_TRACKING_TOKEN": "own"}) is None
    assert hub_token_for("http://hub:10101/services/mlflow", {"JUPYTERHUB_API_TOKEN": "tok"}) is None


def test_this_test_directory_does_not_shadow_mlflow():
    # tests/ is on sys.path (tests/conftest.py); tests/mlflow must stay a plain
    # directory (no __init__.py) so that `import mlflow` is the real package.
    import mlflow

    assert "site-packages" in mlflow.__file__ and hasattr(mlflow, "log_metric")


def test_service_settings_are_traitlets(monkeypatch, tmp_path):
    from traitlets import TraitError

    from gpuhub_spawner.mlflow.service import MlflowService

    monkeypatch.setenv("JUPYTERHUB_PUBLIC_URL", "http://mlflow--service.localhost:8000/services/mlflow/")
    app = MlflowService()
    app.initialize(["--data-dir", str(tmp_path), "--mlflow-arg", "--a", "--mlflow-arg", "--b"])
    assert app.max_upload_size == 2**30 and app.mlflow_args == ["--a", "--b"]
    assert app.public_origins == ["http://mlflow--service.localhost:8000"]  # from the hub's env
    # What configure(service_options=...) writes:
    c = Config()
    configure(
        c,
        data_dir=str(tmp_path),
        service_options={"max_upload_size": 5 * 2**20, "public_origins": ["https://Hub.example.org:443/x"]},
    )
    command = c.JupyterHub.services[0]["command"]
    app = MlflowService()
    app.initialize(command[command.index("--data-dir") :])
    assert app.max_upload_size == 5 * 2**20
    assert app.public_origins == ["https://hub.example.org"]
    with pytest.raises(TraitError):
        MlflowService(public_origins=["ftp://hub.example.org"])
