"""The house stays layered (docs/architecture.md): no import circle, no import from a lower
layer to a higher one, and the two backends never import each other.

The graph is read from the source (AST), every ``import`` counted wherever it is written,
inside functions too: an import hidden in a function to dodge a circle is still an edge.
The one exception is an optional heavy dependency imported lazily on purpose, marked on
its line with ``# lazy: heavy optional dependency``.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(os.environ.get("GPUHUB_ARCH_ROOT", Path(__file__).resolve().parents[2] / "spawner")) / "gpuhub_spawner"
LAZY_MARK = "lazy: heavy optional dependency"

# Bottom to top, as in docs/architecture.md. A module may import its own layer and below.
LAYERS = {
    "policy": 1,  # the policy core
    "admission": 2,  # Kueue's arithmetic, the queue, the admission view both backends provide
    "usage": 3,  # services on the view and the policy: history, audit, metrics
    "culling": 3,  # culling decisions, the board, the reclaimer both backends run
    "jobs": 3,  # job specs, records, what both job backends share
    "rayclusters": 3,  # Ray cluster requests and the manager interface both backends implement
    "mlflow": 3,  # the hub-managed MLflow service
    "policy_spawner": 3,  # the spawner mixin both backends' spawners are built on
    "user_envs": 3,  # gpuhub env: a user's own packages in their home (stdlib only)
    "local": 4,  # one-machine backend
    "kube": 4,  # Kubernetes backend
    "hub": 5,  # JupyterHub-facing: handlers, pages, roles, login, origins, proxy
    "wiring": 6,  # the composition root: wires a backend into a hub
    "cli": 6,  # the command line
    "ops": 6,  # operators' tools against a live hub's API (gpuhub loadtest)
}
# Within layer 3, services build on each other only upwards in this order (no circle between
# packages): jobs (specs, records, the hub client) < usage (its CLI uses the jobs client) <
# culling, mlflow and the spawner mixin (they record into usage).
SERVICE_ORDER = {"jobs": 0, "usage": 1, "culling": 2, "mlflow": 2, "policy_spawner": 2, "rayclusters": 2, "user_envs": 2}
BACKENDS = ("local", "kube")


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        text = f.read_text()
        lines = text.splitlines()
        is_pkg = f.name == "__init__.py"
        out = set()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if LAZY_MARK in lines[node.lineno - 1]:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.split(".")[0] == "gpuhub_spawner":
                    target = node.module
                else:
                    continue
                for alias in node.names:
                    out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
            else:
                out |= {a.name for a in node.names if a.name.split(".")[0] == "gpuhub_spawner"}
        edges[name] = {t for t in out if t in mods and t != name}
    return edges


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_layer():
    areas = {_area(m) for m in _modules()} - {""}
    assert areas <= set(LAYERS), f"give these a layer here and in docs/architecture.md: {sorted(areas - set(LAYERS))}"


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_no_package_circle():
    packages: dict[str, set[str]] = {}
    for a, targets in _graph().items():
        for b in targets:
            if _area(a) and _area(b) and _area(a) != _area(b):
                packages.setdefault(_area(a), set()).add(_area(b))
    assert _cycles(packages) == []


def test_no_upward_import():
    upward = []
    for a, targets in sorted(_graph().items()):
        for b in sorted(targets):
            la, lb = LAYERS.get(_area(a), 0), LAYERS.get(_area(b), 0)
            if lb > la or (la == lb == 3 and SERVICE_ORDER[_area(b)] > SERVICE_ORDER[_area(a)]):
                upward.append(f"{a} (layer {la}) -> {b} (layer {lb})")
    assert upward == []


def test_backends_import_nothing_of_each_other():
    crossing = [
        f"{a} -> {b}"
        for a, targets in sorted(_graph().items())
        for b in sorted(targets)
        if _area(a) in BACKENDS and _area(b) in BACKENDS and _area(a) != _area(b)
    ]
    assert crossing == []


def test_nothing_imports_the_composition_root():
    into = [
        f"{a} -> {b}"
        for a, targets in sorted(_graph().items())
        for b in sorted(targets)
        if _area(b) in ("wiring", "cli") and _area(a) not in ("wiring", "cli")
    ]
    assert into == []


def test_every_unit_test_file_is_in_a_layer():
    """``./run-tests.sh --layer NAME`` runs tests/support/layers.py's lists: a unit test file
    in none of them would never run in a layer's quick check."""
    from support.layers import LAYER_TESTS

    listed = {f for files in LAYER_TESTS.values() for f in files}
    tests = Path(__file__).resolve().parents[1]
    unit = {f"unit/{p.name}" for p in (tests / "unit").glob("test_*.py")}
    assert sorted(unit - listed) == [], "add these to a layer in tests/support/layers.py"
    assert sorted(f for f in listed if not (tests / f).exists()) == []


def test_no_two_test_files_share_a_name():
    """The test folders are not packages: pytest imports each file by its basename, and a second
    file of the same name anywhere under tests/ fails the whole run's collection ('import file
    mismatch') while each passes alone. It happened twice (test_gpu_health, test_ray_manager)."""
    from collections import Counter

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert sorted(n for n, c in names.items() if c > 1) == []


# Module-level state the package may keep, each with its reason (docs/architecture.md, "The
# application object"). Everything else a hub shares lives on its application object
# (hub/context.py), handed in through tornado_settings, or on a traitlets singleton.
MUTABLE_ALLOWED = {
    "wiring.startup._tasks": "the event loop keeps only weak references to tasks (asyncio docs); "
    "this set keeps the hub's start-up work alive until it finishes",
}
ROUTE_TABLES = {"__all__", "handlers", "extra_handlers"}  # written once at import, read by JupyterHub
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakSet", "WeakValueDictionary"}


def _module_state(name: str, text: str) -> list[str]:
    """``global`` statements anywhere, and module-level names bound to a mutable container."""
    found = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{name}:{node.lineno} global {', '.join(node.names)}")
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        v = node.value
        call = v.func.id if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) else None
        if not (isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or call in _MUTABLE_CALLS):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            var = getattr(t, "id", "?")
            if var.isupper() or var in ROUTE_TABLES or f"{name}.{var}" in MUTABLE_ALLOWED:
                continue  # a constant (ALL_CAPS, never rebound: there is no `global` to rebind it)
            found.append(f"{name}:{node.lineno} {var} = <mutable {type(v).__name__ if call is None else call}>")
    return found


def test_the_checker_sees_a_registry_and_a_module_cache():
    sample = "_seen = {}\n_provider = None\n\ndef provide(p):\n    global _provider\n    _provider = p\n"
    assert _module_state("m", sample) == ["m:5 global _provider", "m:1 _seen = <mutable Dict>"]


def test_no_module_level_mutable_state():
    """A hub's shared objects are handed in (the application object in tornado_settings, spawner
    and service traits), never kept in module globals the import graph cannot see: a second hub
    in one process would share them, and a reach from a lower layer to a higher one hides there."""
    found = []
    for name, f in sorted(_modules().items()):
        found += _module_state(name.removeprefix("gpuhub_spawner."), f.read_text())
    assert found == [], "hand it in through the application object (hub/context.py) or add it to MUTABLE_ALLOWED with the reason"
