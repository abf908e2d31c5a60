"""The network wall around a user's Ray cluster and batch job on Kubernetes (issue 39).

Ray's dashboard agent takes work with no token (Ray 2.52.0), and any port a job opens is the
user's: on a cluster, as on one machine, only the owner's own pods and the hub may reach them.
Two NetworkPolicies per RayCluster or Job, made by the hub right after the object, each owned
by it (``ownerReferences``: the garbage collector deletes them with it):

* ``<name>-in`` selects the object's pods (``gpuhub/ray-cluster: <id>`` or ``gpuhub/job:
  <id>``) and lets in only: the same object's pods (a Ray head and its workers), the owner's
  server and job pods (``hub.jupyter.org/username: <owner>`` + ``component`` ``singleuser-server``,
  which KubeSpawner puts on every server pod, or ``gpuhub-job``, a job's pods), and the hub
  (``component: hub`` in the hub's namespace). Every other pod, of any user or namespace, the
  proxy included, is refused: a pod a NetworkPolicy selects for Ingress takes only what some
  policy selecting it allows, and no other policy selects Ray or job pods for Ingress
  (``gpuhub-singleuser`` selects servers only; ``gpuhub-batch`` is about their way out).
* ``<name>-out`` selects the owner's server and job pods and lets them reach the object's pods
  (``gpuhub-singleuser`` limits a server's egress to the hub, DNS and public addresses, so
  without it the owner could not reach their own Ray head on a pod address).

The owner's label value is the one KubeSpawner wrote on the server pod the object was made
from (the escaped user name), so the selectors match what is on the pods. Nothing here is
enforced by the API server: a CNI with NetworkPolicy support does (Calico, Cilium, ...).
"""

from __future__ import annotations

from typing import Any

USERNAME_LABEL = "hub.jupyter.org/username"
COMPONENT_LABEL = "component"
SERVER_COMPONENT = "singleuser-server"
JOB_COMPONENT = "gpuhub-job"  # kube/job_manifest.py
WALL_LABEL = "gpuhub/wall-of"  # the owner's user name label value, on the policies themselves


def owner_selector(pod_labels: dict[str, str]) -> dict:
    """The owner's server and job pods, from the labels of the server pod manifest."""
    return {
        "matchLabels": {USERNAME_LABEL: pod_labels[USERNAME_LABEL]},
        "matchExpressions": [{"key": COMPONENT_LABEL, "operator": "In", "values": [SERVER_COMPONENT, JOB_COMPONENT]}],
    }


def wall(
    name: str, namespace: str, target: dict[str, str], pod_labels: dict[str, str], hub_namespace: str, owner: dict | None = None
) -> list[dict]:
    """The two NetworkPolicies of one RayCluster or Job.

    ``target``: the labels that select exactly the object's pods; ``pod_labels``: the labels of
    the owner's server pod manifest; ``owner``: the created object (``apiVersion``, ``kind``,
    ``metadata.name``/``uid``) the policies belong to."""
    own = {"matchLabels": dict(target)}
    hub = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}},
        "podSelector": {"matchLabels": {COMPONENT_LABEL: "hub"}},
    }
    meta_labels = {"app.kubernetes.io/managed-by": "gpuhub", WALL_LABEL: pod_labels[USERNAME_LABEL]}

    def meta(suffix: str) -> dict:
        m: dict[str, Any] = {"name": f"{name}-{suffix}", "namespace": namespace, "labels": dict(meta_labels)}
        if owner is not None:
            m["ownerReferences"] = [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "blockOwnerDeletion": False,
                }
            ]
        return m

    inbound = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta("in"),
        "spec": {
            "podSelector": own,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": own}, {"podSelector": owner_selector(pod_labels)}, hub]}],
        },
    }
    outbound = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta("out"),
        "spec": {
            "podSelector": owner_selector(pod_labels),
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": own}]}],
        },
    }
    return [inbound, outbound]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels``, ``matchExpressions``) selects ``labels``."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def label_selector(selector: dict) -> str:
    """``selector`` as the API's ``labelSelector`` query string (what ``kubectl -l`` sends)."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], ",".join(e.get("values") or [])
        parts.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key, "DoesNotExist": f"!{key}"}[op]
        )
    return ",".join(parts)


async def put_up(api_client, policies: list[dict]) -> None:
    """Create ``policies`` with ``api_client`` (the client that made their owner)."""
    from kubernetes_asyncio.client import NetworkingV1Api  # lazy: heavy optional dependency

    api = NetworkingV1Api(api_client)
    for p in policies:
        # The client serializes a plain manifest dict as it does a V1NetworkPolicy (its
        # sanitize_for_serialization); its annotations name only the model class.
        await api.create_namespaced_network_policy(p["metadata"]["namespace"], p)  # type: ignore[arg-type]
