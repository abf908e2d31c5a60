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
from support.helm import merge

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "helm-values" / "values.yaml"
MLFLOW_VALUES = REPO / "helm-values" / "mlflow-values.yaml"


def _schemas() -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "schemas" / "z2jh-4.4.0").is_dir():
            return parent / "shared" / "schemas" / "z2jh-4.4.0"
    pytest.skip("shared/schemas/z2jh-4.4.0 not found")


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
    assert c.Spawner.environment["MLFLOW_TRACKING_URI"] == f"http://hub:{port}/services/mlflow"
    egress = merged["singleuser"]["networkPolicy"]["egress"]
    assert any(p["port"] == port for rule in egress for p in rule["ports"])
    ingress = merged["hub"]["networkPolicy"]["ingress"]
    assert any(p["port"] == port for rule in ingress for p in rule["ports"])
