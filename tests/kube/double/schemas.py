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


# Kinds gpuhub renders whose CRD is not among shared/schemas' files: read from the Kueue v0.19.2
# Go module that tests/cluster/build.sh fetched (the same CRD files Kueue's release is made of).
MODULE_ONLY_KINDS = {"Topology": "kueue.x-k8s.io_topologies.yaml"}


def kueue_module_crds() -> Path | None:
    """``config/components/crd/bases`` of the Kueue v0.19.2 module in the real plane's cache."""
    import os

    cache = Path(os.environ.get("GPUHUB_CLUSTER_CACHE", Path.home() / ".cache" / "gpuhub-cluster"))
    d = cache / "gopath" / "pkg" / "mod" / "sigs.k8s.io" / "kueue@v0.19.2" / "config" / "components" / "crd" / "bases"
    return d if d.is_dir() else None


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str = "v1beta2"):
    base = shared_schemas() / "kueue-v0.19.2"
    paths = sorted(base.glob("*.yaml"))
    if kind in MODULE_ONLY_KINDS:
        module = kueue_module_crds()
        if module is None:
            raise FileNotFoundError(
                f"the {kind} CRD comes from the Kueue v0.19.2 module (tests/cluster/build.sh): not fetched here"
            )
        paths = [module / MODULE_ONLY_KINDS[kind]]
    for path in paths:
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
        if (
            pre.get("reclaimWithinCohort", "Never") == "Never"
            and (pre.get("borrowWithinCohort") or {}).get("policy", "Never") != "Never"
        ):
            errors.append("reclaimWithinCohort=Never and borrowWithinCohort.Policy!=Never")
    if kind == "Topology":
        levels = [lv.get("nodeLabel") for lv in spec.get("levels") or []]
        if len(set(levels)) != len(levels):
            errors.append("levels: must be unique")
        if "kubernetes.io/hostname" in levels[:-1]:
            errors.append("the kubernetes.io/hostname label can only be used at the lowest level of topology")
    if kind == "ResourceFlavor":
        if spec.get("topologyName") and not spec.get("nodeLabels"):
            errors.append("at least one nodeLabel is required when topology is set")
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
        raise InvalidObject(
            f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {e.message} at {'.'.join(map(str, e.path))}"
        ) from None


# -- KubeRay (issue 24) ----------------------------------------------------------------------
# The RayCluster CRD is third-party and never copied into the repository: it is read from the
# KubeRay operator's Go module (``go mod download github.com/ray-project/kuberay/ray-operator@v1.5.0``,
# which tests/cluster/build.sh does when it builds the operator), or from $GPUHUB_KUBERAY_CRDS.
KUBERAY_VERSION = "v1.5.0"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
MISSING_KUBERAY = (
    f"KubeRay {KUBERAY_VERSION} CRDs not found: set $GPUHUB_KUBERAY_CRDS to the module's config/crd/bases, or fetch "
    f"the module into the cluster cache: GOPATH=~/.cache/gpuhub-cluster/gopath GOFLAGS=-mod=mod "
    f"go mod download {KUBERAY_MODULE}@{KUBERAY_VERSION} (tests/cluster/build.sh kuberay does it)"
)


def kuberay_crds() -> Path:
    """The folder holding ``ray.io_rayclusters.yaml``, or FileNotFoundError(MISSING_KUBERAY)."""
    import os

    env = os.environ.get("GPUHUB_KUBERAY_CRDS")
    if env:
        candidates = [Path(env)]
    else:
        cache = Path(os.environ.get("GPUHUB_CLUSTER_CACHE", Path.home() / ".cache" / "gpuhub-cluster"))
        mod = cache / "gopath" / "pkg" / "mod" / "github.com" / "ray-project" / "kuberay" / f"ray-operator@{KUBERAY_VERSION}"
        gomodcache = os.environ.get("GOMODCACHE")
        candidates = [mod / "config" / "crd" / "bases"]
        if gomodcache:
            candidates.append(
                Path(gomodcache)
                / "github.com"
                / "ray-project"
                / "kuberay"
                / f"ray-operator@{KUBERAY_VERSION}"
                / "config"
                / "crd"
                / "bases"
            )
    for c in candidates:
        if (c / "ray.io_rayclusters.yaml").is_file():
            return c
    raise FileNotFoundError(MISSING_KUBERAY)


@functools.lru_cache(maxsize=None)
def ray_crd_validator(kind: str = "RayCluster", version: str = "v1"):
    plural = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}[kind]
    crd = yaml.safe_load((kuberay_crds() / f"ray.io_{plural}.yaml").read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return jsonschema.Draft7Validator(_strict(v["schema"]["openAPIV3Schema"])), crd["spec"]["scope"]
    raise KeyError(f"no CRD for {kind} {version}")


def validate_ray(obj: dict) -> None:
    """A ray.io object against KubeRay's CRD (strict), and each pod template as a Pod against
    Kubernetes' schema (kubernetes-validate, strict)."""
    kind, api = obj.get("kind"), obj.get("apiVersion", "")
    validator, _ = ray_crd_validator(kind, api.split("/", 1)[1])
    name = (obj.get("metadata") or {}).get("name")
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    messages = [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors]
    if not name:
        messages.append("metadata.name is required")
    if not (obj.get("metadata") or {}).get("namespace"):
        messages.append("metadata.namespace is required for a namespaced kind")
    if messages:
        raise InvalidObject(f"{kind} {name}: " + "; ".join(messages))
    if kind in ("RayCluster", "RayJob"):
        spec = obj["spec"] if kind == "RayCluster" else obj["spec"].get("rayClusterSpec")
        templates = []
        if kind == "RayJob" and obj["spec"].get("submitterPodTemplate"):
            templates.append(("submitter", obj["spec"]["submitterPodTemplate"]))
        if spec:
            templates.append(("head", spec["headGroupSpec"]["template"]))
            templates += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs") or []]
        for group, tmpl in templates:
            validate_core(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {**(tmpl.get("metadata") or {}), "name": f"{name}-{group}"},
                    "spec": tmpl["spec"],
                }
            )


def validate(obj: dict) -> None:
    if obj.get("apiVersion", "").startswith("kueue.x-k8s.io/"):
        validate_kueue(obj)
    elif obj.get("apiVersion", "").startswith("ray.io/"):
        validate_ray(obj)
    else:
        validate_core(obj)
