"""The hub's Kubernetes rights, from its code to the manifests the install guide applies (issue 40).

The calls are read from the source: every Kubernetes client method this package's ``kube/``
modules and KubeSpawner 7.1 name (called, or handed to a watch or a retry), every raw
``call_api`` path and every reflector. Each is turned into (namespace, API group, resource,
verb) from the client method's own REST path (kubernetes_asyncio's generated code) or, for
custom objects, from the group and plural the call passes. That set must equal
``kube/rights.py``'s list (a new call without a right there fails here; so does a right no
call uses), and the shipped manifests must grant every right of it: the users' namespace Role
of ``helm-values/user-namespace.yaml`` (and nothing more), ``gpuhub render policy-rbac`` and
``gpuhub render capacity-rbac``. No cluster; the real API server's answer for the same list is
in ``tests/kube/test_hub_rights_real.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import kubespawner
import pytest
import yaml
from kubernetes_asyncio import client

from gpuhub_spawner.kube import rights
from gpuhub_spawner.kube.render import capacity_rbac, policy_rbac
from gpuhub_spawner.policy.loader import parse_policy

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "spawner" / "gpuhub_spawner" / "kube"
USER_NAMESPACE = ROOT / "helm-values" / "user-namespace.yaml"
APIS = (client.CoreV1Api, client.BatchV1Api, client.CustomObjectsApi, client.NetworkingV1Api)
METHOD = re.compile(r"^(create|read|get|list|patch|replace|delete)_\w+$")
HTTP_VERB = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def _api_method(name: str):
    for api in APIS:
        if hasattr(api, name) and hasattr(api, name + "_with_http_info"):
            return getattr(api, name + "_with_http_info")
    return None


def _parse_path(path: str, http: str) -> tuple[bool, str, str, str]:
    """(namespaced, group, resource, verb) of a REST path and method."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    namespaced = rest[:2] == ["namespaces", "{namespace}"]
    if namespaced:
        rest = rest[2:]
    resource, named, sub = rest[0], len(rest) > 1, rest[2:]
    if http == "GET":
        verb = "get" if named else "list"
    elif http == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = HTTP_VERB[http]
    return namespaced, group, resource + ("/" + sub[0] if sub else ""), verb


def _typed(name: str) -> tuple[bool, str, str, str]:
    src = inspect.getsource(_api_method(name))
    m = re.search(r"'(/apis?/[^']+)', '(GET|POST|PUT|PATCH|DELETE)'", src)
    assert m, f"no REST path in kubernetes_asyncio's {name}"
    return _parse_path(m.group(1), m.group(2))


def _scope(namespaced: bool, group: str, resource: str) -> str:
    if not namespaced:
        return rights.CLUSTER
    # The hub's own namespace holds only the policy's ConfigMap (kube/policy_configmap.py).
    return rights.HUB if (group, resource) == ("", "configmaps") else rights.USERS


def _eval(node: ast.AST, namespace: dict):
    return eval(compile(ast.Expression(node), "<arg>", "eval"), namespace)  # a module constant or a literal


def _calls_of(path: Path, module: dict | None) -> set[tuple[str, str, str, str, str]]:
    """(scope, group, resource, verb, where) of every API use in one source file."""
    tree = ast.parse(path.read_text())
    found: set[tuple[str, str, str, str, str]] = set()

    def add(namespaced, group, resource, verb, line):
        found.add((_scope(namespaced, group, resource), group, resource, verb, f"{path.name}:{line}"))

    watched = set()  # list methods handed to a watch stream
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stream":
            if node.args and isinstance(node.args[0], ast.Attribute):
                watched.add(id(node.args[0]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and METHOD.match(node.attr) and _api_method(node.attr):
            name = node.attr
            if "custom_object" in name:
                call = next((c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func is node), None)
                assert call is not None and module is not None, f"{path.name}:{node.lineno}: {name} not called directly"
                namespaced = "namespaced" in name
                group = _eval(call.args[0], module)
                plural = _eval(call.args[3 if namespaced else 2], module)
                verb = name.split("_", 1)[0]
                verb = {"read": "get", "get": "get"}.get(verb, verb)
                if verb == "list" and any(k.arg == "watch" for k in call.keywords):
                    add(namespaced, group, plural, "watch", node.lineno)
                add(namespaced, group, plural, verb, node.lineno)
            else:
                namespaced, group, resource, verb = _typed(name)
                add(namespaced, group, resource, "watch" if id(node) in watched else verb, node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call_api":
            assert module is not None
            raw, http = node.args[0].value, node.args[1].value
            params = next(k.value for k in node.keywords if k.arg == "path_params")
            group = _eval(params.values[[k.value for k in params.keys].index("group")], module)
            add(*_parse_path(raw.replace("{group}", group).replace("{version}", "v"), http), node.lineno)
        elif isinstance(node, ast.ClassDef) and any("Reflector" in ast.unparse(b) for b in node.bases):
            attrs = {
                t.targets[0].id: t.value.value
                for t in node.body
                if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name) and isinstance(t.value, ast.Constant)
            }
            if "kind" in attrs:
                # KubeSpawner's reflectors list, then watch, their kind in the spawner's namespace;
                # the group of a custom kind is the one its list call names (below).
                found.add(
                    ("reflector", attrs.get("api_group_name", "CoreV1Api"), attrs["kind"], "watch", f"{path.name}:{node.lineno}")
                )
                found.add(
                    ("reflector", attrs.get("api_group_name", "CoreV1Api"), attrs["kind"], "list", f"{path.name}:{node.lineno}")
                )
    return found


def _code_rights() -> dict[tuple[str, str, str, str], set[str]]:
    uses: set[tuple[str, str, str, str, str]] = set()
    for f in sorted(KUBE.glob("*.py")):
        mod = importlib.import_module(f"gpuhub_spawner.kube.{f.stem}") if f.stem != "__init__" else None
        uses |= _calls_of(f, vars(mod) if mod else None)
    ks = Path(kubespawner.__file__).parent
    for f in ("spawner.py",):
        uses |= {
            (s, g, r, v, f"kubespawner/{w}") for s, g, r, v, w in _calls_of(ks / f, None) if (g, r) not in rights.NOT_USED
        }  # settings gpuhub leaves off (checked below)
    out: dict[tuple[str, str, str, str], set[str]] = {}
    custom_groups = {r: g for s, g, r, v, w in uses if s != "reflector" and g}
    for scope, group, resource, verb, where in uses:
        if scope == "reflector":
            scope, group = rights.USERS, (custom_groups[resource] if group == "CustomObjectsApi" else "")
        out.setdefault((scope, group, resource, verb), set()).add(where)
    return out


def test_the_derivation_reads_rest_paths():
    assert _typed("read_namespaced_pod_log") == (True, "", "pods/log", "get")
    assert _typed("list_node") == (False, "", "nodes", "list")
    assert _typed("create_namespaced_job") == (True, "batch", "jobs", "create")
    assert _typed("delete_namespaced_persistent_volume_claim") == (True, "", "persistentvolumeclaims", "delete")


def test_every_api_call_of_the_hub_has_its_right_in_the_list_and_no_right_is_unused():
    code = _code_rights()
    listed = rights.needed()
    missing = {k: sorted(v) for k, v in code.items() if k not in listed}
    unused = sorted(listed - code.keys())
    assert missing == {}, f"calls without a right in kube/rights.py: {missing}"
    assert unused == [], f"rights in kube/rights.py that no call uses: {unused}"
    # The calls issue 40 found without RBAC are among them.
    assert ("users", "kueue.x-k8s.io", "workloads", "patch") in code
    assert ("users", "", "pods/log", "get") in code


def test_kubespawner_calls_gpuhub_grants_nothing_for_stay_off():
    """Secrets, Services, Namespaces: KubeSpawner makes them only with internal_ssl,
    services_enabled or enable_user_namespaces, which gpuhub leaves off."""
    from gpuhub_spawner.kube.spawner import KueueSpawner

    assert KueueSpawner.class_traits()["internal_ssl"].default_value is False
    assert KueueSpawner.class_traits()["services_enabled"].default_value is False
    assert KueueSpawner.class_traits()["enable_user_namespaces"].default_value is False
    values = (ROOT / "helm-values" / "values.yaml").read_text()
    for setting in ("internal_ssl", "services_enabled", "enable_user_namespaces"):
        assert setting not in values
    src = (Path(kubespawner.__file__).parent / "spawner.py").read_text()
    assert set(re.findall(r'_ensure_not_exists,\s*"(\w+)"', src)) == {"secret", "service"}


def _user_role() -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(USER_NAMESPACE.read_text()) if d]
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    return role, binding


CAPACITY_POLICY = """\
flavors:
  - {name: l4, displayName: L4, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}}
teams:
  - {name: shared, groups: [s], quota: {gpus: {l4: 2}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
health:
  kubernetes:
    capacityQueue: {l4: shared}
"""


def test_the_shipped_manifests_grant_every_right_the_hub_uses():
    role, binding = _user_role()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "gpuhub"}]
    hub_role, hub_binding = policy_rbac("gpuhub:hub")
    shipped = parse_policy((ROOT / "jupyterhub_config" / "profiles.yaml").read_text())
    cluster_plain = capacity_rbac(shipped, "gpuhub:hub")[0]
    cluster_capacity = capacity_rbac(parse_policy(CAPACITY_POLICY), "gpuhub:hub")[0]
    refused = []
    for scope, group, resource, verb in sorted(rights.needed()):
        if scope == rights.USERS:
            ok = rights.grants(role["rules"], group, resource, verb)
        elif scope == rights.HUB:
            ok = rights.grants(hub_role["rules"], group, resource, verb, "gpuhub-policy")
        elif resource == "clusterqueues":
            ok = rights.grants(cluster_capacity["rules"], group, resource, verb, "shared")
        else:
            ok = rights.grants(cluster_plain["rules"], group, resource, verb)
        if not ok:
            refused.append((scope, group, resource, verb))
    assert refused == []


def test_the_users_namespace_role_grants_nothing_the_hub_does_not_use():
    role, _ = _user_role()
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    used = {(g, r, v) for s, g, r, v in rights.needed() if s == rights.USERS}
    assert sorted(granted - used) == []
    assert "*" not in {x for t in granted for x in t}


@pytest.mark.parametrize("call", ["patch_namespaced_custom_object", "read_namespaced_pod_log"])
def test_a_right_taken_out_of_the_role_fails_the_check(call):
    """The check can fail: the Role as it was before issue 40 refuses the two calls."""
    role, _ = _user_role()
    old = [
        dict(r, verbs=[v for v in r["verbs"] if v != "patch"]) if "workloads" in r["resources"] else r
        for r in role["rules"]
        if r["resources"] != ["pods/log"]
    ]
    if call == "patch_namespaced_custom_object":
        assert not rights.grants(old, "kueue.x-k8s.io", "workloads", "patch")
    else:
        assert not rights.grants(old, "", "pods/log", "get")


def test_can_i_arguments():
    assert rights.can_i_args("", "pods/log", "get") == ["get", "pods", "--subresource=log"]
    assert rights.can_i_args("kueue.x-k8s.io", "workloads", "patch") == ["patch", "workloads.kueue.x-k8s.io"]
