"""Validation against the real contracts: Kueue v0.19.2 CRDs and Kubernetes' own schemas.

The CRD files live in ``shared/schemas`` (``$GPUHUB_SHARED_DIR``, or ``../shared`` beside the
repository; never copied into it).
Strictness: unknown fields are rejected (the API server would silently prune them,
which hides bugs), and the few CEL rules that matter for our objects are checked
by hand (jsonschema cannot run CEL).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.30"  # the oldest Kubernetes gpuhub supports


class InvalidObject(Exception):
    pass


def shared_schemas() -> Path:
    """``shared/schemas`` (``$GPUHUB_SHARED_DIR`` or beside the repository); see support/helm.py."""
    from support.helm import MISSING_SHARED, shared_dir

    base = shared_dir()
    if base is None or not (base / "schemas" / "kueue-v0.19.2").is_dir():
        raise FileNotFoundError(MISSING_SHARED)
    return base / "schemas"


def _strict(schema):
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str = "v1beta2"):
    base = shared_schemas() / "kueue-v0.19.2"
    for path in sorted(base.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] != kind:
            continue
        for v in crd["spec"]["versions"]:
            if v["name"] == version:
                schema = _strict(v["schema"]["openAPIV3Schema"])
                return jsonschema.Draft7Validator(schema), crd["spec"]["scope"]
    raise KeyError(f"no CRD for {kind} {version}")


def _cel_checks(obj: dict) -> list[str]:
    """Hand-translated x-kubernetes-validations of the v0.19.2 CRDs that our objects touch."""
    errors = []
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "ClusterQueue":
        for rg in spec.get("resourceGroups") or []:
            for fl in rg.get("flavors") or []:
                if len(fl.get("resources") or []) != len(rg.get("coveredResources") or []):
                    errors.append("flavors must have the same number of resources as the coveredResources")
                for i, res in enumerate(fl.get("resources") or []):
                    if i < len(rg.get("coveredResources") or []) and res.get("name") != rg["coveredResources"][i]:
                        errors.append("flavor resources must be in the order of coveredResources")
                    if "borrowingLimit" in res and not spec.get("cohortName"):
                        errors.append("borrowingLimit must be nil when cohort is empty")
        pre = spec.get("preemption") or {}
        if pre.get("reclaimWithinCohort", "Never") == "Never" and (pre.get("borrowWithinCohort") or {}).get("policy", "Never") != "Never":
            errors.append("reclaimWithinCohort=Never and borrowWithinCohort.Policy!=Never")
    if kind == "ResourceFlavor":
        for t in spec.get("tolerations") or []:
            if not t.get("key") and t.get("operator") != "Exists":
                errors.append("operator must be Exists when 'key' is empty")
            if t.get("operator") == "Exists" and t.get("value"):
                errors.append("a value must be empty when 'operator' is 'Exists'")
    return errors


def validate_kueue(obj: dict) -> None:
    kind = obj.get("kind")
    api = obj.get("apiVersion", "")
    if not api.startswith("kueue.x-k8s.io/"):
        raise InvalidObject(f"{kind}: apiVersion {api!r} is not kueue.x-k8s.io")
    validator, scope = crd_validator(kind, api.split("/", 1)[1])
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    messages = [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors]
    messages += _cel_checks(obj)
    name = (obj.get("metadata") or {}).get("name")
    if not name:
        messages.append("metadata.name is required")
    if scope == "Namespaced" and not obj["metadata"].get("namespace"):
        messages.append("metadata.namespace is required for a namespaced kind")
    if scope == "Cluster" and obj["metadata"].get("namespace"):
        messages.append("metadata.namespace must be empty for a cluster-scoped kind")
    if messages:
        raise InvalidObject(f"{kind} {name}: " + "; ".join(messages))


def validate_core(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise InvalidObject(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {e.message} at {'.'.join(map(str, e.path))}") from None


def validate(obj: dict) -> None:
    if obj.get("apiVersion", "").startswith("kueue.x-k8s.io/"):
        validate_kueue(obj)
    else:
        validate_core(obj)
