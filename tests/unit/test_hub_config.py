"""The culler service is configured with least scopes and merges with other services."""

from pathlib import Path

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
