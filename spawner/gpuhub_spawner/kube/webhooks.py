"""Keep Kueue's admission webhooks away from the hub's own namespace.

Kueue's webhooks (pods, Deployments, StatefulSets, Jobs, JobSets, RayClusters, …) all have
``failurePolicy: Fail``. Kueue's ``manifests.yaml`` gives most of them a
``namespaceSelector`` that leaves out only ``kube-system`` and ``kueue-system``, and some
none at all, so with Kueue down the API server refuses every object of those kinds in the
hub's namespace: ``helm upgrade`` of the hub fails, not only new servers. The hub never
needs Kueue for its own objects, so every webhook of both configurations gets one more
``matchExpressions`` entry: ``kubernetes.io/metadata.name NotIn [<hub namespace>]``.
Expressions are ANDed, so the entry narrows whatever selector the webhook already had,
whatever its shape (an existing ``NotIn`` on that key is extended instead, which reads
the same and keeps the object small). Running it twice changes nothing.
"""

from __future__ import annotations

import copy

NAME_KEY = "kubernetes.io/metadata.name"


def exclude_namespace(config: dict, namespace: str) -> tuple[dict, list[str]]:
    """(the webhook configuration with ``namespace`` excluded from every webhook, the names of
    the webhooks that changed)."""
    kind = config.get("kind", "")
    if kind not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        raise ValueError(f"expected a Mutating/ValidatingWebhookConfiguration, got {kind or 'no kind'!r}")
    out = copy.deepcopy(config)
    for meta_field in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        out.get("metadata", {}).pop(meta_field, None)  # apply, not replace: no stale version to conflict on
    changed = []
    for hook in out.get("webhooks") or []:
        if _excludes(hook, namespace):
            continue
        exprs = hook.setdefault("namespaceSelector", {}).setdefault("matchExpressions", [])
        existing = next((e for e in exprs if e.get("key") == NAME_KEY and e.get("operator") == "NotIn"), None)
        if existing is not None:
            existing.setdefault("values", []).append(namespace)
        else:
            exprs.append({"key": NAME_KEY, "operator": "NotIn", "values": [namespace]})
        changed.append(hook["name"])
    return out, changed


def webhooks_covering(config: dict, namespace: str) -> list[str]:
    """Names of the webhooks whose namespaceSelector still selects ``namespace`` (by its name
    label only: a selector on other labels is reported, since it may match)."""
    return [hook["name"] for hook in config.get("webhooks") or [] if not _excludes(hook, namespace)]


def _excludes(hook: dict, namespace: str) -> bool:
    """The webhook's namespaceSelector has ``kubernetes.io/metadata.name NotIn [.., namespace]``."""
    exprs = (hook.get("namespaceSelector") or {}).get("matchExpressions") or []
    return any(e.get("key") == NAME_KEY and e.get("operator") == "NotIn" and namespace in (e.get("values") or []) for e in exprs)
