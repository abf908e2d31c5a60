"""helm-values/: the chart's schema accepts our values merged over its defaults, as helm does.

(``test_chart_config.py`` runs helm itself; this keeps a check that needs no binary.)"""

from __future__ import annotations

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
