"""What every namespace where user pods run needs: ``gpuhub render tenancy``.

The policy's ``tenancy`` (``policy/model.py``) says where a team's pods live: all teams in the
one users' namespace (``shared``, the default), or each team in a namespace of its own
(``team``). Each such namespace gets the same five objects:

* the Namespace, labelled Pod Security ``restricted`` (enforce, warn, audit);
* the Role ``gpuhub-hub``: exactly the hub's rights there (``kube/rights.py``, scope ``users``,
  which ``tests/unit/test_kube_rbac.py`` derives from the code's API calls), and its
  RoleBinding to the hub's ServiceAccount. Namespaced: the hub has no right on pods in any
  namespace this render does not list;
* the NetworkPolicies ``gpuhub-singleuser`` (a server takes traffic only from the hub and the
  proxy, and reaches the hub, DNS and public addresses) and ``gpuhub-batch`` (a job's or Ray
  pod's way out: the same, plus the pods of its own namespace). With one namespace per team,
  "its own namespace" is its team's: no pod of another team is reached, nor reaches a server.

``shared`` renders exactly ``helm-values/user-namespace.yaml`` (``tests/kube/test_tenancy.py``
compares them), so the shipped file and this render cannot drift apart.
"""

from __future__ import annotations

from ..policy.model import Policy
from . import rights

MANAGED = {"app.kubernetes.io/managed-by": "gpuhub"}
ROLE_NAME = "gpuhub-hub"
POD_SECURITY_LEVEL, POD_SECURITY_VERSION = "restricted", "v1.30"
# Namespaces a team's pods must never share: the control plane's and the cluster's defaults.
RESERVED = ("default", "kube-system", "kube-public", "kube-node-lease", "kueue-system")
PRIVATE_RANGES = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.169.254/32"]
TEAM_LABEL = "gpuhub.io/team"


def _meta(name: str, namespace: str | None = None, **labels: str) -> dict:
    meta: dict = {"name": name, "labels": {**MANAGED, **labels}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _split(service_account: str) -> tuple[str, str]:
    namespace, _, name = service_account.partition(":")
    if not namespace or not name:
        raise ValueError(f"--service-account {service_account!r}: expected NAMESPACE:NAME")
    return namespace, name


def _hub_ports_and_public(hub_namespace: str) -> list[dict]:
    """The egress every user pod gets: the hub (API 8081, MLflow 10101), DNS, public addresses."""
    return [
        {
            "to": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}},
                    "podSelector": {"matchLabels": {"component": "hub"}},
                }
            ],
            "ports": [{"port": 8081, "protocol": "TCP"}, {"port": 10101, "protocol": "TCP"}],
        },
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(PRIVATE_RANGES)}}]},
    ]


def namespace_objects(namespace: str, service_account: str = "gpuhub:hub", team: str | None = None) -> list[dict]:
    """The Namespace, the hub's Role and RoleBinding and the two NetworkPolicies of one users'
    namespace (``team``: the team it belongs to, labelled on the Namespace)."""
    hub_namespace, sa_name = _split(service_account)
    pod_security = {}
    for mode in ("enforce", "warn", "audit"):
        pod_security[f"pod-security.kubernetes.io/{mode}"] = POD_SECURITY_LEVEL
        pod_security[f"pod-security.kubernetes.io/{mode}-version"] = POD_SECURITY_VERSION
    ns_labels = {**pod_security, **({TEAM_LABEL: team} if team else {})}
    rules = [
        {"apiGroups": [r.group], "resources": [r.resource], "verbs": list(r.verbs)}
        for r in rights.RIGHTS
        if r.scope == rights.USERS
    ]
    singleuser = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta("gpuhub-singleuser", namespace),
        "spec": {
            "podSelector": {"matchLabels": {"component": "singleuser-server"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}},
                            "podSelector": {
                                "matchExpressions": [{"key": "component", "operator": "In", "values": ["proxy", "hub"]}]
                            },
                        }
                    ],
                    "ports": [{"port": 8888, "protocol": "TCP"}],
                }
            ],
            "egress": _hub_ports_and_public(hub_namespace),
        },
    }
    batch = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta("gpuhub-batch", namespace),
        "spec": {
            "podSelector": {
                "matchExpressions": [
                    {"key": "component", "operator": "In", "values": ["gpuhub-job", "gpuhub-ray-head", "gpuhub-ray-worker"]}
                ]
            },
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {}}]}, *_hub_ports_and_public(hub_namespace)],
        },
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(namespace, **ns_labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(ROLE_NAME, namespace), "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(ROLE_NAME, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE_NAME},
            "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": hub_namespace}],
        },
        singleuser,
        batch,
    ]


def tenancy_objects(policy: Policy, shared: str, service_account: str = "gpuhub:hub") -> list[dict]:
    """Every users' namespace of ``policy`` with its objects: ``shared`` alone, or each team's.

    Refuses (``ValueError``) a team namespace that is the hub's own or one of ``RESERVED``:
    the hub's Role and ``restricted`` there would grant it pods beside the control plane or
    stop the hub's own pods."""
    hub_namespace, _ = _split(service_account)
    out: list[dict] = []
    namespaces: list[tuple[str, str | None]]
    if policy.tenancy.mode != "team":
        namespaces = [(shared, None)]
    else:
        namespaces = [(policy.namespace_of(t, shared), t.name) for t in policy.teams]
    for ns, team in namespaces:
        if ns == hub_namespace or ns in RESERVED:
            who = f"team {team!r}'s namespace" if team else "the users' namespace"
            raise ValueError(f"{who} {ns!r} is the hub's or the cluster's own (tenancy.namespace, --namespace): pick another")
        out += namespace_objects(ns, service_account, team)
    return out
