"""Which Kueue objects a policy edit changes, and which of those changes Kueue refuses (issue 26).

Compares the objects ``gpuhub render kueue`` renders from the policy in force with those of the
candidate (the rendered objects stand for what is applied: ``gpuhub render kueue --live`` checks
against the cluster itself). A LocalQueue whose ``clusterQueue`` would change is refused by
Kueue (the field is immutable: ``render.localqueue_conflicts``). Pure: no cluster is asked.
"""

from __future__ import annotations

from ..policy.model import Policy
from .render import DEFAULT_CPU_FLAVOR, DEFAULT_NAMESPACE, localqueue_conflicts, render_objects


def _key(obj: dict) -> tuple:
    return obj["kind"], obj["metadata"].get("namespace") or "", obj["metadata"]["name"]


def _name(key: tuple) -> str:
    kind, ns, name = key
    return f"{kind} {ns + '/' if ns else ''}{name}"


def kueue_changes(
    old: Policy, new: Policy, namespace: str = DEFAULT_NAMESPACE, cpu_flavor: str = DEFAULT_CPU_FLAVOR
) -> list[tuple[str, frozenset[str]]]:
    """``(plain words, teams concerned)`` per Kueue object created, deleted or changed, refusals first.

    Teams: a ClusterQueue's and a LocalQueue's team; ResourceFlavors and WorkloadPriorityClasses
    concern every team of either policy."""
    everyone = frozenset(t.name for t in (*old.teams, *new.teams))
    before = {_key(o): o for o in render_objects(old, namespace, cpu_flavor)}
    after_list = render_objects(new, namespace, cpu_flavor)
    after = {_key(o): o for o in after_list}

    def teams(key: tuple, obj: dict) -> frozenset[str]:
        if key[0] == "ClusterQueue":
            return frozenset({key[2]})
        if key[0] == "LocalQueue":
            return frozenset({obj["spec"]["clusterQueue"]})
        return everyone

    out: list[tuple[str, frozenset[str]]] = []
    for text in localqueue_conflicts(after_list, list(before.values())):
        name = text.split(" ")[1]
        ns, _, lq = name.partition("/")
        key = ("LocalQueue", ns, lq)
        out.append(
            (
                "Kueue refuses this change: " + text,
                teams(key, before[key]) | teams(key, after[key]) if key in before and key in after else everyone,
            )
        )
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if a is None:
            assert b is not None  # a key is in one of them at least
            out.append((f"{_name(key)} is created.", teams(key, b)))
        elif b is None:
            out.append((f"{_name(key)} is deleted.", teams(key, a)))
        else:
            fields = sorted(
                k for k in set(a.get("spec", {})) | set(b.get("spec", {})) if a.get("spec", {}).get(k) != b.get("spec", {}).get(k)
            ) + (["value"] if a.get("value") != b.get("value") else [])
            out.append((f"{_name(key)} changes ({', '.join(fields) or 'metadata'}).", teams(key, a) | teams(key, b)))
    return out
