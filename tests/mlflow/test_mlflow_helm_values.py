"""helm-values/mlflow-values.yaml: valid for the chart when layered over values.yaml
(as `helm -f values.yaml -f mlflow-values.yaml` merges them), and its extraConfig is
real Python that configures the hub the way the one-machine tests exercise."""

from __future__ import annotations

import copy
import ipaddress
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from traitlets.config import Config
from support.helm import helm_template, merge, require_shared

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
    assert any(
        p["port"] == port
        for rule in ingress
        for p in rule["ports"]
        if any("gpuhub-users" in str(src.get("namespaceSelector")) for src in rule["from"])
    )
    user_ns = list(yaml.safe_load_all((REPO / "helm-values" / "user-namespace.yaml").read_text()))
    netpol = next(d for d in user_ns if d and d["kind"] == "NetworkPolicy")
    assert any(p["port"] == port for rule in netpol["spec"]["egress"] for p in rule.get("ports") or [])


# -- who reaches the MLflow port, as the chart renders it --------------------------------------
# NetworkPolicies are read here as the API defines them (kubernetes-validate checks the
# objects); they are enforced by a CNI plugin, which neither the API double nor the real
# control plane of tests/cluster has, so what these tests show is the rendered intent.

PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
HUB_NS, USERS_NS = "gpuhub", "gpuhub-users"


def _selects(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _allowing(rules: list[dict], side: str, port: int, policy_ns: str, pod: dict, ns: str) -> list[dict]:
    """The peers (of ``from``/``to``) through which ``rules`` let a pod with labels ``pod`` in
    namespace ``ns`` talk on ``port`` (numbered ports only: 10101 has no name anywhere)."""
    out = []
    for rule in rules:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port or (p.get("endPort") and p["port"] <= port <= p["endPort"]) for p in ports):
            continue
        for peer in rule.get(side) or [{}]:
            if "ipBlock" in peer:
                out.append(peer)
            elif not peer:
                out.append(peer)  # no peers: everyone
            elif "namespaceSelector" in peer:
                if _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns}) and _selects(
                    peer.get("podSelector"), pod
                ):
                    out.append(peer)
            elif ns == policy_ns and _selects(peer.get("podSelector"), pod):
                out.append(peer)
    return out


def _covers_private(peer: dict) -> bool:
    """Whether an ipBlock peer (or an empty peer: every address) reaches a private address."""
    if "ipBlock" not in peer:
        return not peer
    block = ipaddress.ip_network(peer["ipBlock"]["cidr"])
    excepted = [ipaddress.ip_network(e) for e in peer["ipBlock"].get("except") or []]
    for private in PRIVATE:
        if block.version != private.version or not block.overlaps(private):
            continue
        part = private if private.subnet_of(block) else block  # CIDRs nest or are disjoint
        if not any(e.version == part.version and part.subnet_of(e) for e in excepted):
            return True
    return False


@pytest.fixture(scope="module")
def rendered():
    chart = require_shared("charts", "jupyterhub-4.4.0")
    return helm_template(chart, [VALUES, MLFLOW_VALUES], release="gpuhub", namespace=HUB_NS)


def _pod_labels(docs, name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)["spec"]["template"]["metadata"][
        "labels"
    ]


def test_only_the_proxy_and_user_pods_reach_mlflow_on_the_hub_by_selector(rendered):
    netpols = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "NetworkPolicy"}
    for netpol in netpols.values():
        kubernetes_validate.validate(netpol, "1.30", strict=True)
    port = next(p for p in yaml.safe_load(MLFLOW_VALUES.read_text())["hub"]["service"]["extraPorts"] if p["name"] == "mlflow")[
        "port"
    ]
    hub, proxy = _pod_labels(rendered, "hub"), _pod_labels(rendered, "proxy")
    hub_pol, proxy_pol = netpols["hub"], netpols["proxy"]
    assert _selects(hub_pol["spec"]["podSelector"], hub) and _selects(proxy_pol["spec"]["podSelector"], proxy)

    # proxy -> hub:port, both ends by selectors that match the pods the chart renders
    egress = _allowing(proxy_pol["spec"]["egress"], "to", port, HUB_NS, hub, HUB_NS)
    assert any("podSelector" in p for p in egress), "the proxy's egress names the hub pod on the MLflow port"
    assert not [p for p in egress if _covers_private(p)], (
        f"the proxy reaches the hub's MLflow port through private IP ranges: {[p for p in egress if _covers_private(p)]}"
    )
    ingress = _allowing(hub_pol["spec"]["ingress"], "from", port, HUB_NS, proxy, HUB_NS)
    assert ingress and all("podSelector" in p and "ipBlock" not in p for p in ingress), ingress
    # No ipBlock opening a private range to any port is left in the proxy's egress (DNS aside).
    for rule in proxy_pol["spec"]["egress"]:
        if {p.get("port") for p in rule.get("ports") or [{}]} != {53}:
            assert not any(_covers_private(p) for p in rule.get("to") or [{}]), rule

    # notebooks in the user namespace reach it too (the API); nothing else does
    user_pod = {"component": "singleuser-server", "hub.jupyter.org/network-access-hub": "true"}
    assert _allowing(hub_pol["spec"]["ingress"], "from", port, HUB_NS, user_pod, USERS_NS)
    others = [
        ({**proxy, "release": "other"}, HUB_NS),  # another release's proxy in the namespace
        ({"hub.jupyter.org/network-access-hub": "true", "app": "anything"}, HUB_NS),  # any pod the hub's API admits
        (user_pod, "default"),
        (proxy, USERS_NS),
    ]
    for labels, ns in others:
        assert not _allowing(hub_pol["spec"]["ingress"], "from", port, HUB_NS, labels, ns), (labels, ns)
