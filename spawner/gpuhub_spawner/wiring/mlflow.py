"""Wire the central MLflow into a hub config (docs/mlflow.md): ``configure(c, data_dir=...)``.

It adds a hub-managed service ``mlflow`` that runs an MLflow tracking server
(``--app-name basic-auth``, bound to the hub's address) behind an authenticating proxy
(``mlflow/proxy.py``). Browsers reach it with their hub login (OAuth, no second password);
notebooks reach it with their own server's ``JUPYTERHUB_API_TOKEN``, which the
``gpuhub_notebook`` package sends as a bearer token. No MLflow password is ever handed to a
user environment. The service itself is ``python -m gpuhub_spawner.mlflow`` (layer 3); this
module writes the hub's configuration, so it is the composition root's (it moved here from
``gpuhub_spawner.mlflow``).
"""

from __future__ import annotations

import sys

from ..policy.scopes import grant_server_token

SERVICE_ROLE = "gpuhub-mlflow-service"


def _section_get(section, name: str, default=None):
    """A traitlets Config value if it was set (not a LazyConfigValue), else ``default``."""
    return section[name] if name in section else default


def configure(
    c,
    *,
    data_dir: str,
    service_name: str = "mlflow",
    host: str | None = None,
    port: int = 10101,
    tracking_uri: str | None = None,
    policy_path: str | None = None,
    external_url: str | None = None,
    admin_credentials_file: str | None = None,
    backend_store_uri: str | None = None,
    artifacts_destination: str | None = None,
    auth_db_uri: str | None = None,
    reconcile_interval: float = 60.0,
    token_env: bool = False,
    link_name: str = "MLflow",
    python: str | None = None,
    extra_args: list[str] | None = None,
    service_environment: dict[str, str] | None = None,
    pass_environment: tuple[str, ...] = (
        "GPUHUB_MLFLOW_BACKEND_STORE_URI",
        "GPUHUB_MLFLOW_AUTH_DB_URI",
        "GPUHUB_MLFLOW_ADMIN_USERNAME",
        "GPUHUB_MLFLOW_ADMIN_PASSWORD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_DEFAULT_REGION",
        "MLFLOW_S3_ENDPOINT_URL",
        "MLFLOW_S3_IGNORE_TLS",
    ),
    bind_ip: str | None = None,
    service_options: dict | None = None,
) -> dict:
    """Add the MLflow service, its role, user access and single-user environment to ``c``.

    Merges into (never replaces) ``c.JupyterHub.services``, ``c.JupyterHub.load_roles``,
    ``c.JupyterHub.extra_user_scopes``, ``c.Spawner.server_token_scopes``,
    ``c.Spawner.environment`` (and every ``c.<X>Spawner.environment`` already set, such as
    z2jh's ``c.KubeSpawner.environment``) and ``c.JupyterHub.template_vars["gpuhub_links"]``.

    Args:
        data_dir: where the service keeps its key, state, and (one machine) the SQLite
            stores and artifacts. Must be private to the hub's Unix user.
        host, port: where the service listens (``url`` of the hub service). Default: the
            hub's own address (``JupyterHub.hub_ip``) where it is a specific one, which on
            one machine behind the wall is where users' notebooks reach the hub's side
            (local/user_network.py); else 127.0.0.1.
        tracking_uri: what notebooks use as ``MLFLOW_TRACKING_URI``. Default: the
            service's own address (one machine). On Kubernetes, an address pods can
            reach, e.g. ``http://proxy-public/services/mlflow``.
        policy_path: the policy YAML, to map hub groups to teams (team read access).
        external_url: an existing MLflow server (basic-auth app) to front instead of
            starting one; its admin credentials come from ``admin_credentials_file``
            or the service environment (``GPUHUB_MLFLOW_ADMIN_USERNAME/PASSWORD``).
        backend_store_uri, artifacts_destination, auth_db_uri: override the SQLite /
            local-directory defaults (PostgreSQL, ``s3://...``).
        token_env: also set ``MLFLOW_TRACKING_TOKEN`` (= the server's own hub token) for
            images without ``gpuhub-notebook``. Off by default: the token is then sent
            only to this tracking URI, by ``gpuhub_notebook``'s request-header provider.
        service_environment: extra environment for the service (e.g. S3 settings).
        pass_environment: hub environment variables handed to the service when set
            (database URIs with passwords, S3 credentials: on Kubernetes they come from
            Secrets into the hub pod's env, and reach only the service and MLflow).
        bind_ip: where the service listens if not ``host`` (``0.0.0.0`` in a hub pod,
            where ``host`` is the hub Service's name).
        service_options: traitlets of the service (``MlflowService``, docs/mlflow.md),
            e.g. ``{"max_upload_size": 2**31, "public_origins": ["https://hub.example.org"]}``.

    Returns the service definition that was added.
    """
    hub = c.JupyterHub
    if not external_url:  # off-boarding hands experiments over as MLflow's admin (mlflow/handover.py)
        import os.path

        from .app import app_of

        app_of(c).mlflow_state_dir = os.path.join(str(data_dir), "service")
    if host is None:
        hub_ip = _section_get(hub, "hub_ip", "") or ""
        host = hub_ip if hub_ip not in ("", "0.0.0.0", "::") else "127.0.0.1"
    base_url = _section_get(hub, "base_url", "/") or "/"
    if not base_url.endswith("/"):
        base_url += "/"
    prefix = f"{base_url}services/{service_name}/"
    command = [
        python or sys.executable,
        "-m",
        "gpuhub_spawner.mlflow",
        "--data-dir",
        str(data_dir),
        "--reconcile-interval",
        str(reconcile_interval),
    ]
    if policy_path:
        command += ["--policy", str(policy_path)]
    if external_url:
        command += ["--external-url", external_url]
    if admin_credentials_file:
        command += ["--admin-credentials-file", str(admin_credentials_file)]
    if artifacts_destination:
        command += ["--artifacts-destination", artifacts_destination]
    for arg in extra_args or []:
        command += ["--mlflow-arg", arg]
    if bind_ip:
        command += ["--bind-ip", bind_ip]
    for name, value in (service_options or {}).items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            command.append(f"--MlflowService.{name}={v}")
    import os

    passed = {k: os.environ[k] for k in pass_environment if k in os.environ}
    # Store URIs may hold passwords: environment, never the command (the hub logs commands).
    if backend_store_uri:
        passed["GPUHUB_MLFLOW_BACKEND_STORE_URI"] = backend_store_uri
    if auth_db_uri:
        passed["GPUHUB_MLFLOW_AUTH_DB_URI"] = auth_db_uri

    service = {
        "name": service_name,
        "url": f"http://{host}:{port}",
        "command": command,
        "oauth_no_confirm": True,
        "display": True,
        "info": {"description": "Central MLflow tracking server (hub login)"},
        "environment": {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", **passed, **(service_environment or {})},
    }
    services = [s for s in _section_get(hub, "services", []) if s.get("name") != service_name]
    hub.services = services + [service]

    # The service lists users (to revoke removed ones) and reads their groups (teams).
    roles = [r for r in _section_get(hub, "load_roles", []) if r.get("name") != SERVICE_ROLE]
    roles.append(
        {
            "name": SERVICE_ROLE,
            "description": "gpuhub MLflow service: map hub users and groups to MLflow accounts",
            "scopes": ["list:users", "read:users:name", "read:users:groups"],
            "services": [service_name],
        }
    )
    hub.load_roles = roles

    access = f"access:services!service={service_name}"
    # Every hub user may use MLflow (browser OAuth), and so may their servers' tokens.
    hub.extra_user_scopes = set(_section_get(hub, "extra_user_scopes", set()) or set()) | {access}

    # ... and their servers' own tokens, added to what the server role already grants.
    grant_server_token(c, [access])

    uri = tracking_uri or f"http://{host}:{port}{prefix}".rstrip("/")
    ours = {
        "MLFLOW_TRACKING_URI": uri,
        # gpuhub_notebook sends the server's hub token only to this URI.
        "GPUHUB_MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_NAME": _personal_experiment,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # MLflow logs INFO lines ("Creating a new experiment", system metrics) to stderr,
        # which JupyterLab shows in red in every cell: warnings and errors only.
        "MLFLOW_LOGGING_LEVEL": "WARNING",
        # Where a browser opens the UI: gpuhub_notebook prints run links with it.
        "GPUHUB_MLFLOW_UI_URL": _ui_url_for(service_name),
    }
    if token_env:
        ours["MLFLOW_TRACKING_TOKEN"] = _server_token
    for section in _environment_sections(c):
        section.environment = {**dict(_section_get(section, "environment", {}) or {}), **ours}

    tv = dict(_section_get(hub, "template_vars", {}) or {})
    links = [l for l in tv.get("gpuhub_links", []) if l.get("name") != link_name]
    # "service": the page links to the service's own origin (its host and port) where the hub
    # has per-user origins; "url" is the path where it has not.
    # "fragment": MLflow's UI opens on its experiments list, not on its GenAI welcome page.
    links.append({"name": link_name, "url": prefix, "service": service_name, "fragment": "#/experiments"})
    tv["gpuhub_links"] = links
    hub.template_vars = tv
    return service


def _environment_sections(c) -> list:
    """Every config section whose ``environment`` a spawner could end up with.

    traitlets gives an instance the value of the most derived class section that sets a
    trait, so ``c.Spawner.environment`` loses to ``c.KubeSpawner.environment``, which the
    Zero to JupyterHub chart sets from ``singleuser.extraEnv``. Writing into ``c.Spawner``
    and into each ``*Spawner`` section that already sets ``environment`` reaches the
    effective one whatever the spawner class is, without importing it.
    """
    sections = [c.Spawner]
    for name in list(c.keys()):
        if name.endswith("Spawner") and name != "Spawner" and "environment" in c[name]:
            sections.append(c[name])
    return sections


def _personal_experiment(spawner) -> str:
    """Each user's runs go to ``users/<name>`` unless the notebook picks another experiment."""
    return f"users/{spawner.user.name}"


def _ui_url_for(service_name: str):
    def ui_url(spawner) -> str:
        """The service's public origin and prefix as the hub serves it (per-user origins:
        ``http://mlflow--service.localhost:8000/services/mlflow/``); empty where the hub
        has no subdomain host (the notebook then prints MLflow's own links)."""
        services = (getattr(spawner.user, "settings", None) or {}).get("services") or {}
        svc = services.get(service_name)
        host = getattr(svc, "host", "") or ""
        return f"{host}{svc.prefix}" if host and svc is not None else ""

    return ui_url


def _server_token(spawner) -> str:
    return spawner.api_token
