"""The composition root: configure a hub for the one-machine backend (``jupyterhub_config.py``
calls ``configure_local``), and the pieces both backends' configs call (the Kubernetes
chart's ``hub.extraConfig`` calls ``configure_culler`` and ``bound_what_users_send``).

Everything a demo needs is derived from a data directory and a policy file, so tests
and the README's run command share one code path.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import sys
from pathlib import Path

from .startup import when_started

TEMPLATES = str(Path(__file__).resolve().parent.parent / "templates")

DEMO_USERS = {
    "alice": {"groups": ["vision-lab"]},
    "bob": {"groups": ["vision-lab"]},
    "carol": {"groups": ["nlp-group"]},
    "dave": {"groups": ["nlp-group", "vision-lab"]},
    "erin": {"groups": ["students"]},
    "mallory": {"groups": ["visitors"]},
    "lena": {"groups": ["vision-lab", "vision-leads"]},  # leads Vision Lab (policy: teams[].leads)
    "victor": {"groups": ["department-heads"]},  # viewer: usage and metrics only (policy: roles.viewers)
    "admin": {"groups": ["platform-admins"], "admin": True},
}


def _bin(name: str) -> str:
    """An executable from this Python's environment (the venv), else from PATH."""
    candidate = Path(sys.prefix) / "bin" / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def private_dir(path) -> Path:
    """``path`` as a directory only its owner can enter, created so from the first byte.

    Missing parents are made 0700 too (never the default umask), an existing directory
    is tightened to 0700.
    """
    p = Path(path).resolve()
    missing = []
    for parent in [p, *p.parents]:
        if parent.exists():
            break
        missing.append(parent)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)  # umask can only remove bits from 0700
        except FileExistsError:
            pass
    if p.stat().st_mode & 0o077:
        p.chmod(0o700)
    return p


def demo_password(data_dir: Path) -> str:
    """The demo password: from GPUHUB_DEMO_PASSWORD, else generated once and kept (0600).

    The file is created with mode 0600 in the same call that creates it (O_EXCL), so
    it is never readable by anyone else, not even for a moment.
    """
    env = os.environ.get("GPUHUB_DEMO_PASSWORD")
    if env:
        return env
    path = private_dir(data_dir) / "demo-password"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(12))
    return path.read_text().strip()


def _merged_list(section, name: str) -> list:
    return list(getattr(section, name)) if name in section else []


def configure_culler(c, *, public_url: str = "", cull_every: int | None = None, state_dir: str | None = None) -> None:
    """Run the GPU-aware culler (jupyterhub-idle-culler 2.0) as a hub service.

    Also registers the hub API it asks for decisions and the home-page notices, so both
    backends call just this (the Kubernetes values do, from hub.extraConfig). The service
    never contacts users' servers, so its role has no ``access:servers`` and
    ``public_url`` is no longer used (kept for callers). Warnings, snoozes and cull
    history persist in ``state_dir`` (default: beside the hub's sqlite database).
    """
    from ..hub.culling_api import handlers, template_vars as culling_template_vars
    from .app import app_of

    app_of(c)  # the culling API's long polls are counted on the hub's application object
    every = cull_every or int(os.environ.get("GPUHUB_CULL_EVERY", 60))
    c.JupyterHub.services = _merged_list(c.JupyterHub, "services") + [
        {
            "name": "gpuhub-culler",
            "command": [
                sys.executable,
                "-m",
                "gpuhub_spawner.culling.service",
                f"--cull-every={every}",
                "--timeout=1",
                "--remove-named-servers=False",
                "--concurrency=20",  # stops of a big pass in parallel
                "--GpuHubCuller.end_with_hub=True",  # a hub killed outright takes its culler along
            ],
        }
    ]
    c.JupyterHub.load_roles = _merged_list(c.JupyterHub, "load_roles") + [
        {
            "name": "gpuhub-culler",
            # A pass looks up each server the hub names and stops it (culling/service.py):
            # nothing more; deliberately no access:servers and no listing of users.
            "scopes": ["read:servers", "delete:servers"],
            "services": ["gpuhub-culler"],
        }
    ]
    c.CullBoard.pass_interval = every
    if state_dir is None and "db_url" in c.JupyterHub and str(c.JupyterHub.db_url).startswith("sqlite:///"):
        state_dir = str(Path(str(c.JupyterHub.db_url)[len("sqlite:///") :]).parent)
    if state_dir:
        c.CullBoard.state_file = str(Path(state_dir) / "gpuhub-culling.json")
    from ..policy.scopes import configure_scopes

    configure_scopes(c)  # the culling API checks custom:gpuhub:culling (both backends)
    c.JupyterHub.extra_handlers = _merged_list(c.JupyterHub, "extra_handlers") + list(handlers)
    template_vars = dict(c.JupyterHub.template_vars) if "template_vars" in c.JupyterHub else {}
    template_vars.update(culling_template_vars(c))
    # A viewer (policy roles.viewers, in no team) starts nothing: their home has no start
    # controls and they land on the usage page (both backends' home page is templates/home.html).
    from ..hub.pages import viewer_home, viewer_only

    template_vars["gpuhub_viewer_only"] = viewer_only
    c.JupyterHub.template_vars = template_vars
    if "default_url" not in c.JupyterHub:
        c.JupyterHub.default_url = viewer_home
    paths = _merged_list(c.JupyterHub, "template_paths")
    c.JupyterHub.template_paths = paths if TEMPLATES in paths else [TEMPLATES, *paths]


def _options_are_read_by_the_spawner(spawner, user_options):
    return None


def bound_what_users_send() -> None:
    """Every request body bounded before a handler runs (413 over 256 KiB: JupyterHub's own
    handlers decode JSON on the loop with no limit), and the started hub's heap frozen so a
    request's allocations never set off a full garbage collection of it (policy/bounded.py).
    Both backends: the chart's extraConfig calls this too."""
    from ..policy.bounded import freeze_heap, limit_request_bodies

    limit_request_bodies()
    when_started(lambda app: freeze_heap())


def configure_local(c, *, data_dir: str, policy_file: str, port: int = 8000, ip: str = "127.0.0.1") -> None:
    from ..hub.pages import extra_handlers, policy_banner
    from .app import app_of  # the one-machine broker provides the admission view (wiring/app.py)

    data = private_dir(data_dir)  # database, secrets, homes: the hub's user only
    (data / "home").mkdir(mode=0o700, exist_ok=True)
    os.close(os.open(data / "jupyterhub.sqlite", os.O_WRONLY | os.O_CREAT, 0o600))  # sqlite would make it 0644

    c.PolicyStore.policy_file = str(Path(policy_file).resolve())

    c.JupyterHub.bind_url = f"http://{ip}:{port}"
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(os.environ.get("GPUHUB_HUB_PORT", 8081))
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(os.environ.get('GPUHUB_PROXY_API_PORT', 8001))}"
    from ..hub.origins import configure_origins, node_proxy_command

    node_proxy = node_proxy_command()  # routes by host; the Python proxy is the fallback
    c.ConfigurableHTTPProxy.command = node_proxy or [_bin("gpuhub-proxy")]
    configure_origins(c, port=port, host_routing=bool(node_proxy))
    c.ConfigurableHTTPProxy.pid_file = str(data / "proxy.pid")
    # A hub restart keeps the running proxy and its routes (open Labs see no outage).
    c.JupyterHub.proxy_class = "gpuhub_spawner.hub.kept_proxy.KeptProxy"
    from types import SimpleNamespace

    from ..local import listening

    # Who holds the public port: the machine's socket table (configs are deep-copied: no module here).
    c.KeptProxy.listening = SimpleNamespace(
        watcher=listening.watcher,
        listening_sockets=listening.listening_sockets,
        socket_holders=listening.socket_holders,
        PortTaken=listening.PortTaken,
    )
    c.KeptProxy.auth_token_file = str(data / "proxy-auth-token")
    c.JupyterHub.db_url = f"sqlite:///{data / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(data / "jupyterhub_cookie_secret")
    c.JupyterHub.template_paths = [TEMPLATES]
    c.JupyterHub.extra_handlers = list(extra_handlers)
    c.JupyterHub.template_vars = {
        "gpuhub_policy_stale": policy_banner,
        "gpuhub_status_page": True,
        "gpuhub_links": [],
    }
    # GPU health: the admin API (gpuhub gpu ...) and the holder's notice on the home page.
    from ..hub.gpus_api import handlers as gpu_handlers, template_vars as gpu_template_vars

    c.JupyterHub.extra_handlers = list(extra_handlers) + list(gpu_handlers)
    c.JupyterHub.template_vars = dict(c.JupyterHub.template_vars, **gpu_template_vars(app_of(c), c))
    c.LocalBroker.gpu_health_file = str(data / "gpu-health.json")

    # Queued servers are pending spawns; JupyterHub's limit would count them and lock
    # everyone out behind a full queue. LocalBroker.launch_concurrency limits launches.
    c.JupyterHub.concurrent_spawn_limit = 0
    # Waiting requests are journaled in the data dir and come back after a restart.
    from ..kube.ledger import KueueLedger
    from ..local.requeue import configure_requeue, requeue_after_start

    token = configure_requeue(c, data)
    # Kubernetes: Kueue keeps the queue (a queued pod keeps its place by itself).
    when_started(lambda app: None if KueueLedger.initialized() else requeue_after_start(app, token))
    c.JupyterHub.allow_named_servers = True  # per-user caps come from the policy
    # Restarting the hub leaves servers (and their GPUs) running; they are re-adopted.
    c.JupyterHub.cleanup_servers = False
    c.JupyterHub.cleanup_proxy = False

    # Isolated (Unix account, cgroup, private /dev per server) whenever the hub is root.
    c.JupyterHub.spawner_class = "gpuhub-local"
    c.Spawner.cmd = [_bin("jupyterhub-singleuser")]
    c.LocalGpuSpawner.home_dir_template = str(data / "home" / "{username}")
    c.SimpleLocalGpuSpawner.home_dir_template = str(data / "home" / "{username}")
    from ..local.isolation import announce_isolation
    from ..local.user_network import configure_wall

    # Each user's processes in a network namespace of their own (root): the hub's API and
    # services then listen on the wall's bridge, where servers and jobs reach them.
    users_reach_hub_at = configure_wall(c, announce_isolation(c))
    if users_reach_hub_at:
        c.JupyterHub.hub_ip = users_reach_hub_at
    # Whether JupyterLab is installed, without importing it: its import cost the hub ~0.2 s of
    # CPU at every start (its extension handlers, jupyter_server, jupyterlab_server).
    c.Spawner.default_url = "/lab" if importlib.util.find_spec("jupyterlab") is not None else "/tree"
    c.Spawner.http_timeout = 60
    # The choice is read by the spawner from user_options itself (and re-validated there).
    c.Spawner.apply_user_options = _options_are_read_by_the_spawner
    if os.geteuid() == 0:
        # Demo servers run as the hub's user; as root (containers, CI) Jupyter needs this.
        c.Spawner.args = ["--ServerApp.allow_root=True"]

    # Login: the demo users, or what the site file ($GPUHUB_SITE_CONFIG) picks (docs/authentication.md).
    from ..hub.auth import configure_site
    from ..hub.site import Site, load_site

    def demo(c):
        from ..hub.demo_auth import DemoAuthenticator

        c.JupyterHub.authenticator_class = DemoAuthenticator
        c.DemoAuthenticator.demo_users = DEMO_USERS
        c.DemoAuthenticator.demo_password = demo_password(data)
        c.Authenticator.admin_users = {u for u, spec in DEMO_USERS.items() if spec.get("admin")}

    site_file = os.environ.get("GPUHUB_SITE_CONFIG")
    configure_site(
        c, load_site(site_file) if site_file else Site(), policy_file=policy_file, public_url=f"http://{ip}:{port}", demo=demo
    )
    from ..hub.origins import serve_hub_only_on_its_host

    serve_hub_only_on_its_host(c)  # after the site file, which may move the hub to HTTPS or its public_url
    bound_what_users_send()
    from ..policy.scopes import configure_scopes

    configure_scopes(c)
    from ..policy import PolicyError, load_policy
    from .usage import configure_usage  # history, audit trail, metrics, roles from the policy

    try:
        roles_policy = load_policy(policy_file)
    except PolicyError:
        roles_policy = None  # the policy store refuses to start and says why
    configure_usage(c, data, roles_policy)
    from .policy_changes import configure_policy_changes  # preview, apply, history, rollback

    configure_policy_changes(c, data)

    configure_culler(c, public_url=f"http://{ip}:{port}")

    # Central MLflow, managed by the hub (after template_vars: it adds its home-page link).
    if os.environ.get("GPUHUB_MLFLOW", "1") != "0":
        from .mlflow import configure as configure_mlflow

        configure_mlflow(
            c,
            data_dir=str(data / "mlflow"),
            policy_path=str(Path(policy_file).resolve()),
            port=int(os.environ.get("GPUHUB_MLFLOW_PORT", 10101)),
        )

    from .jobs import configure_jobs  # batch jobs (after MLflow: it extends the server token's scopes)

    configure_jobs(c, data)
    from .ray import configure_ray  # Ray clusters are jobs of a kind (docs/ray.md)

    configure_ray(c)
    from .offboarding import configure_offboarding, end_processes_of  # gpuhub user offboard NAME (after the login's choice)

    configure_offboarding(c, data)
    app_of(c).end_processes = end_processes_of  # one machine: the leaver's account's processes end too
