"""``gpuhub render webhook-exclusion``: the hub's namespace leaves every Kueue webhook,
whatever selector shape the webhook had, and a second run changes nothing. The real
control plane run (Kueue stopped, the hub's objects still admitted) is
``test_real_cluster_webhooks.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuhub_spawner.kube.webhooks import exclude_namespace, webhooks_covering

KUEUE_LIKE = {
    "apiVersion": "admissionregistration.k8s.io/v1",
    "kind": "MutatingWebhookConfiguration",
    "metadata": {"name": "kueue-mutating-webhook-configuration", "resourceVersion": "812", "uid": "u-1"},
    "webhooks": [
        {
            "name": "mpod.kb.io",
            "failurePolicy": "Fail",  # manifests.yaml: kube-system and kueue-system left out
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}
                ]
            },
        },
        {"name": "mjob.kb.io", "failurePolicy": "Fail"},  # no selector: every namespace
        {
            "name": "mdeployment.kb.io",
            "failurePolicy": "Fail",  # a Helm-chart-like selector on another label
            "namespaceSelector": {"matchLabels": {"team": "ml"}},
        },
    ],
}


def test_every_webhook_leaves_the_hub_namespace_and_keeps_its_own_selector():
    assert webhooks_covering(KUEUE_LIKE, "gpuhub") == ["mpod.kb.io", "mjob.kb.io", "mdeployment.kb.io"]
    out, changed = exclude_namespace(KUEUE_LIKE, "gpuhub")
    assert changed == ["mpod.kb.io", "mjob.kb.io", "mdeployment.kb.io"]
    assert webhooks_covering(out, "gpuhub") == []
    pod, job, deploy = out["webhooks"]
    assert pod["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system", "gpuhub"]}
    ]
    assert job["namespaceSelector"] == {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["gpuhub"]}]
    }
    assert deploy["namespaceSelector"]["matchLabels"] == {"team": "ml"}  # narrowed, not replaced
    assert webhooks_covering(out, "gpuhub-users") == ["mpod.kb.io", "mjob.kb.io", "mdeployment.kb.io"]
    assert "resourceVersion" not in out["metadata"] and KUEUE_LIKE["metadata"]["resourceVersion"] == "812"
    again, changed_again = exclude_namespace(out, "gpuhub")
    assert again == out and changed_again == []


def test_the_cli_reads_kubectl_json_and_says_what_changed():
    done = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "render", "webhook-exclusion", "-n", "gpuhub", "-"],
        input=json.dumps(KUEUE_LIKE),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "kueue-mutating-webhook-configuration: gpuhub left out of 3 webhook(s): mpod.kb.io, mjob.kb.io" in done.stderr
    assert webhooks_covering(json.loads(done.stdout), "gpuhub") == []


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"kind": "Pod", "metadata": {"name": "x"}}', "expected a Mutating/ValidatingWebhookConfiguration, got 'Pod'"),
        ("[1, 2]", "expected one webhook configuration object"),
        ("{{", "-: while parsing"),
    ],
)
def test_anything_else_is_refused_with_the_reason(text, error):
    done = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "render", "webhook-exclusion", "-"],
        input=text,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and error in done.stderr and done.stdout == ""
