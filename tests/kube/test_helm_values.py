"""helm-values/: the chart's schema accepts our values merged over its defaults, as helm does.

(``test_chart_config.py`` runs helm itself; this keeps a check that needs no binary.)"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from support.helm import merge

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "helm-values" / "values.yaml"


@pytest.fixture(scope="module")
def chart(schemas_dir):
    d = schemas_dir / "z2jh-4.4.0"
    return yaml.safe_load((d / "values.yaml").read_text()), yaml.safe_load((d / "values.schema.yaml").read_text())


def test_values_validate_against_the_chart_schema(chart):
    defaults, schema = chart
    ours = yaml.safe_load(VALUES.read_text())
    jsonschema.validate(merge(defaults, ours), schema)


def test_schema_check_can_fail(chart):
    defaults, schema = chart
    ours = yaml.safe_load(VALUES.read_text())
    ours["hub"]["extraVolumeMount"] = []  # a typo: the chart's schema forbids unknown keys
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merge(defaults, ours), schema)


def test_values_select_the_spawner_and_mount_the_policy_live():
    ours = yaml.safe_load(VALUES.read_text())
    hub = ours["hub"]
    assert hub["config"]["JupyterHub"]["spawner_class"] == "gpuhub-kube"
    mount = next(m for m in hub["extraVolumeMounts"] if m["name"] == "gpuhub-policy")
    assert "subPath" not in mount  # a subPath mount never sees ConfigMap updates
    assert hub["config"]["PolicyStore"]["policy_file"].startswith(mount["mountPath"] + "/")
    volume = next(v for v in hub["extraVolumes"] if v["name"] == "gpuhub-policy")
    assert volume["configMap"]["name"] == "gpuhub-policy"
    assert ours["singleuser"]["profileList"] == []
    assert ours["cull"]["enabled"] is False  # the gpuhub culler's slot
    assert ours["scheduling"]["userPlaceholder"]["enabled"] is False


# -- the install guide's rename checklist -------------------------------------------------------
GUIDE = REPO / "docs" / "install-kubernetes.md"
NAMES = ("gpuhub", "gpuhub-users")  # the hub's namespace (and the Helm release), the users' namespace
IN_DNS = re.compile(r"\.(gpuhub|gpuhub-users)\.svc\b")


def naming_places(node, path=()) -> set[str]:
    """Dotted paths (down to the first list) of the values that name a default namespace or
    release: the whole value (a namespace, a label, a selector value) or a Service DNS name."""
    if isinstance(node, dict):
        return {p for k, v in node.items() if k != "app.kubernetes.io/managed-by" for p in naming_places(v, path + (k,))}
    if isinstance(node, list):
        return {".".join(path)} if any(naming_places(v, path) for v in node) else set()
    if isinstance(node, str) and (node in NAMES or IN_DNS.search(node)):
        return {".".join(path)}
    return set()


def rename_checklist() -> dict[str, set[str]]:
    section = GUIDE.read_text().split("If you change the names", 1)[1].split("\n\n", 2)[1]
    items = re.split(r"\n(?=\* )", section.strip())
    out = {}
    for item in items:
        m = re.match(r"\* `(helm-values/[^`]+)`:(.*)", item, re.S)
        if m:
            out[m.group(1)] = set(re.findall(r"`([\w.-]+)`", m.group(2)))
    return out


def test_the_rename_checklist_names_every_value_that_names_a_namespace():
    checklist = rename_checklist()
    assert "helm-values/user-namespace.yaml" in checklist  # its header's count is checked in test_chart_config.py
    found = {}
    for path in sorted((REPO / "helm-values").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        places = set().union(*(naming_places(d) for d in docs))
        if places:
            found[f"helm-values/{path.name}"] = places
    assert set(found) == set(checklist), f"files naming {NAMES}: {sorted(found)}; the guide's checklist: {sorted(checklist)}"
    for name, places in found.items():
        if name != "helm-values/user-namespace.yaml":
            assert places == checklist[name], (
                f"{name}: values naming {NAMES}: {sorted(places)}; the checklist says {sorted(checklist[name])}"
            )
    assert found["helm-values/mlflow-values.yaml"]  # the file the checklist once missed
