"""The hub's configuration: the culler service with least scopes, merged with other services;
JupyterLab as the servers' default page."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import yaml
from traitlets.config import Config

from gpuhub_spawner.wiring.config import TEMPLATES, configure_culler

REPO = Path(__file__).resolve().parents[2]


def test_culler_service_least_scopes_and_merging():
    c = Config()
    c.JupyterHub.services = [{"name": "mlflow", "url": "http://127.0.0.1:1"}]
    c.JupyterHub.template_vars = {"gpuhub_links": [{"name": "MLflow", "url": "/services/mlflow/"}]}
    configure_culler(c, public_url="http://proxy-public", cull_every=60)
    names = [s["name"] for s in c.JupyterHub.services]
    assert names == ["mlflow", "gpuhub-culler"]
    (role,) = [r for r in c.JupyterHub.load_roles if r["name"] == "gpuhub-culler"]
    # a look before each stop and the stop: the culler never calls (so never sends its token
    # to) user servers, and no longer lists every user
    assert sorted(role["scopes"]) == ["delete:servers", "read:servers"]
    assert not any(a.startswith("--api-page-size") for a in c.JupyterHub.services[1]["command"])
    culler = c.JupyterHub.services[1]
    assert "--cull-every=60" in culler["command"] and "--remove-named-servers=False" in culler["command"]
    assert c.JupyterHub.template_vars["gpuhub_links"][0]["name"] == "MLflow"  # kept
    assert callable(c.JupyterHub.template_vars["gpuhub_cull_warnings"])
    assert c.JupyterHub.template_paths[0] == TEMPLATES
    assert any("/api/gpuhub/cull-decisions" in h[0] for h in c.JupyterHub.extra_handlers)


def test_helm_values_run_the_same_culler_config():
    values = yaml.safe_load((REPO / "helm-values" / "values.yaml").read_text())
    code = values["hub"]["extraConfig"]["gpuhub-culler"]
    c = Config()
    exec(compile(code, "hub.extraConfig.gpuhub-culler", "exec"), {"c": c})
    assert [s["name"] for s in c.JupyterHub.services] == ["gpuhub-culler"]
    assert values["cull"]["enabled"] is False  # the chart's 1.4 culler would race ours


# The one-machine hub's configuration opens JupyterLab where it is installed, and finds that out
# without importing it: JupyterLab's import (jupyter_server, jupyterlab_server, its handlers) cost
# every hub start ~0.2 s of CPU for a yes/no answer (tests/benchmarks/hub_start.py).
PROBE = """
import importlib.util, sys
from traitlets.config import Config
from gpuhub_spawner.wiring.config import configure_local
c = Config()
c.LocalGpuSpawner.network_wall = "off"  # as root it would build the wall's bridge on this machine
configure_local(c, data_dir=sys.argv[1], policy_file=sys.argv[2], port=0)
print(c.Spawner.default_url, "jupyterlab" in sys.modules)
"""


def test_servers_open_jupyterlab_when_it_is_installed_and_the_hub_does_not_import_it(tmp_path):
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("JupyterLab is not installed here (the lab extra)")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "data"), str(REPO / "jupyterhub_config" / "profiles.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    default_url, imported = out.stdout.split()[-2:]
    assert default_url == "/lab"
    assert imported == "False", "the hub's configuration imported JupyterLab to learn it is installed"


def test_offboarding_wraps_whichever_authenticator_the_site_picks_and_its_block_survives_a_restart(tmp_path):
    """An identity provider's login (GenericOAuthenticator, named by its entry point as the site
    file's ``oidc`` names it) keeps its own settings, and refuses an off-boarded name with the
    reason before JupyterHub's own blocked-users check; the block file's names are
    ``blocked_users`` at every start (a new config reads the file again)."""
    import asyncio

    from tornado import web

    from gpuhub_spawner.hub.offboarding import Blocklist, OffboardedLogin
    from gpuhub_spawner.wiring.offboarding import configure_offboarding

    Blocklist(tmp_path / "offboarded.json").add("alice", "admin", groups=["vision-lab"])
    assert (tmp_path / "offboarded.json").stat().st_mode & 0o777 == 0o600
    c = Config()
    c.JupyterHub.authenticator_class = "generic-oauth"
    c.GenericOAuthenticator.client_id = "gpuhub"
    c.Authenticator.blocked_users = {"mallory"}
    configure_offboarding(c, tmp_path)
    cls = c.JupyterHub.authenticator_class
    assert issubclass(cls, OffboardedLogin) and cls.__name__ == "GenericOAuthenticator"
    assert c.Authenticator.blocked_users == {"mallory", "alice"}
    auth = cls(config=c)
    assert auth.client_id == "gpuhub"  # the identity provider's settings still apply
    with pytest.raises(web.HTTPError) as refused:
        asyncio.run(auth.check_blocked_users("alice", {"name": "alice", "groups": ["vision-lab"]}))
    assert refused.value.status_code == 403 and "alice was off-boarded by admin" in refused.value.log_message
    assert asyncio.run(auth.check_blocked_users("mallory")) is False  # JupyterHub's own list, as before
    assert asyncio.run(auth.check_blocked_users("bob")) is True
    configure_offboarding(c, tmp_path)  # twice (a second wiring call): wrapped once
    assert c.JupyterHub.authenticator_class is cls
    assert [h[0] for h in c.JupyterHub.extra_handlers].count("/api/gpuhub/users/([^/]+)/offboard") == 1
