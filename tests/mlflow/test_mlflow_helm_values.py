"""helm-values/mlflow-values.yaml: valid for the chart when layered over values.yaml
(as `helm -f values.yaml -f mlflow-values.yaml` merges them), and its extraConfig is
real Python that configures the hub the way the one-machine tests exercise."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from traitlets.config import Config
from support.helm import merge, require_shared

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "helm-values" / "values.yaml"
MLFLOW_VALUES = REPO / "helm-values" / "mlflow-values.yaml"


def _schemas() -> Path:
    return require_shared("schemas", "z2jh-4.4.0")  # skips with the reason on a plain clone


def _merged():
    d = _schemas()
    defaults = yaml.safe_load((d / "values.yaml").read_text())
    schema = yaml.safe_load((d / "values.schema.yaml").read_text())
    merged = merge(defaults, yaml.safe_load(VALUES.read_text()))
    return merge(merged, yaml.safe_load(MLFLOW_VALUES.read_text())), schema


def test_layered_values_validate_against_the_chart_schema():
    merged, schema = _merged()
    jsonschema.validate(merged, schema)
    bad = copy.deepcopy(merged)
    bad["hub"]["service"]["extraPort"] = []  # a typo must fail: the check can fail
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_no_secret_in_the_values():
    text = MLFLOW_VALUES.read_text()
    values = yaml.safe_load(text)
    for name, spec in values["hub"]["extraEnv"].items():
        if any(w in name for w in ("URI", "KEY", "PASSWORD", "TOKEN")):
            assert "valueFrom" in spec, name
    assert "postgresql://" not in yaml.safe_dump(values["hub"]["extraConfig"])


def test_extra_config_configures_the_service(monkeypatch, tmp_path):
    merged, _ = _merged()
    code = merged["hub"]["extraConfig"]["gpuhub-mlflow"]
    monkeypatch.setenv("GPUHUB_MLFLOW_BACKEND_STORE_URI", "postgresql://mlflow:pw@postgres/mlflow")
    c = Config()
    c.JupyterHub.services = []  # what z2jh's hub.services renders (the culler may add one)
    exec(compile(code, "extraConfig", "exec"), {"c": c})
    svc = next(s for s in c.JupyterHub.services if s["name"] == "mlflow")
    port = next(p for p in merged["hub"]["service"]["extraPorts"] if p["name"] == "mlflow")["port"]
    assert svc["url"] == f"http://hub:{port}"
    assert svc["command"][svc["command"].index("--bind-ip") + 1] == "0.0.0.0"
    assert svc["environment"]["GPUHUB_MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
    assert "pw@" not in " ".join(svc["command"])
    # User pods live in gpuhub-users: the hub Service by its namespaced name.
    assert c.Spawner.environment["MLFLOW_TRACKING_URI"] == f"http://hub.gpuhub.svc.cluster.local:{port}/services/mlflow"
    ingress = merged["hub"]["networkPolicy"]["ingress"]
    assert any(p["port"] == port for rule in ingress for p in rule["ports"]
               if any("gpuhub-users" in str(src.get("namespaceSelector")) for src in rule["from"]))
    user_ns = list(yaml.safe_load_all((REPO / "helm-values" / "user-namespace.yaml").read_text()))
    netpol = next(d for d in user_ns if d and d["kind"] == "NetworkPolicy")
    assert any(p["port"] == port for rule in netpol["spec"]["egress"] for p in rule.get("ports") or [])
