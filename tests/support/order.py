"""The order check every run performs: the tests of each file run in an order shuffled by a seed.

A file's tests share a hub (module-scoped fixtures), so a test can silently depend on what an
earlier test left behind: a running server, a waiting user, a policy edit. The suite is too
long for a second, shuffled pass, so the ordinary run is the check: within each file in scope
the tests run in an order a seed decides; each class's tests stay together (class fixtures are
set up once) and files stay whole (module fixtures once). Files keep the order tests/conftest.py
gives them (slowest first).

The seed is the git tree of tests/ at HEAD (``git rev-parse HEAD:tests``, 8 hex digits): the
same for every run of one version of the tests, a developer's and CI's alike, and unchanged by a
commit that touches no test. ``GPUHUB_TEST_ORDER`` overrides it: any other word is a seed,
``file`` keeps the order of the file, ``reversed`` runs each file (and each class) backwards,
the most adversarial order for tests written one after the other. Under pytest-xdist the
controller's seed goes to every worker, so all collect the same order, as xdist requires.

An item's place comes from a hash of the seed and its node id, not from its index: a file run
alone (``pytest tests/integration/test_x.py``) runs in the same order as in the whole suite,
and so does any subset of it.

Not pytest-randomly: it also reseeds ``random`` before every test (to the same value in every
xdist worker, so tests that draw names or ports at random would draw the same ones in both),
shuffles the files (which fights the slowest-first order), has no reversed order, and draws a
new seed each run unless told one; its option to keep the seed would have to be set from here
anyway. pytest-random-order keeps a module's classes together only in its 'class' bucket,
which then interleaves files (module fixtures set up again), and under xdist each worker
draws its own seed unless one is given.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable, Iterable
from itertools import groupby
from pathlib import Path

import pytest

ENV = "GPUHUB_TEST_ORDER"
_WORKER_KEY = "gpuhub_test_order"


def default_seed(tests_dir: Path) -> tuple[str, str]:
    """The seed a run takes unless told one, and where it came from."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD:./"], cwd=tests_dir, capture_output=True, text=True, timeout=30)
        tree = out.stdout.strip()
        if out.returncode == 0 and tree:
            return tree[:8], f"the git tree of {tests_dir.name}/ at HEAD"
    except (OSError, subprocess.SubprocessError):
        pass
    digest = hashlib.sha1()  # no git (an exported tarball): the test files' contents
    for p in sorted(tests_dir.rglob("*.py")):
        digest.update(p.relative_to(tests_dir).as_posix().encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()[:8], f"a hash of the .py files under {tests_dir.name}/ (no git)"


def parse(value: str | None, tests_dir: Path) -> tuple[str, str, str]:
    """(mode, seed, where the seed came from); mode is 'shuffled', 'file' or 'reversed'."""
    value = (value or "").strip()
    if value in ("file", "reversed"):
        return value, "", ""
    if value:
        return "shuffled", value, f"${ENV}"
    seed, origin = default_seed(tests_dir)
    return "shuffled", seed, origin


def _key(seed: str, nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{nodeid}".encode()).digest()[:8], "big")


def _below_module(item) -> list:
    """The nodes from the item's module (exclusive) down to the item: [Class, ..., Function]."""
    chain = item.listchain()
    for i in range(len(chain) - 1, -1, -1):
        if isinstance(chain[i], pytest.Module):
            return chain[i + 1 :]
    return [item]


def _arrange(entries: list, depth: int, mode: str, seed: str) -> list:
    """entries: (item, nodes below its module); all share the nodes above ``depth``."""
    groups: dict[str, tuple[object, list]] = {}
    for entry in entries:
        node = entry[1][depth]
        groups.setdefault(node.nodeid, (node, []))[1].append(entry)
    ordered = list(groups.values())
    if mode == "reversed":
        ordered.reverse()
    else:
        ordered.sort(key=lambda g: _key(seed, g[0].nodeid))
    out = []
    for _node, members in ordered:
        leaves = [e for e in members if len(e[1]) == depth + 1]  # the item itself
        inner = [e for e in members if len(e[1]) > depth + 1]  # inside a class at this level
        out.extend(leaves)
        if inner:
            out.extend(_arrange(inner, depth + 1, mode, seed))
    return out


def arrange(items: list, mode: str, seed: str, in_scope: Callable[[Path], bool]) -> None:
    """Reorder ``items`` in place: within each file in scope by ``mode``; files stay whole and
    in their order, and so do the files out of scope."""
    if mode == "file":
        return
    out = []
    for path, group in groupby(items, key=lambda it: Path(str(it.path))):
        group = list(group)
        if in_scope(path) and len(group) > 1:
            group = [e[0] for e in _arrange([(it, _below_module(it)) for it in group], 0, mode, seed)]
        out.extend(group)
    items[:] = out


class OrderCheck:
    """The plugin tests/conftest.py registers: ``OrderCheck(tests_dir, ("integration", "unit"))``
    shuffles the files under those folders of tests_dir; ``keep`` names files (relative to
    tests_dir) left in their written order, each with the reason, printed with the seed."""

    def __init__(self, tests_dir: Path, folders: Iterable[str], env: dict | None = None, keep: dict[str, str] | None = None):
        self.tests_dir = tests_dir.resolve()
        self.folders = tuple(folders)
        self.env = env
        self.keep = dict(keep or {})
        self.mode = self.seed = self.origin = ""

    def in_scope(self, path: Path) -> bool:
        try:
            rel = path.resolve().relative_to(self.tests_dir)
        except ValueError:
            return False
        return bool(rel.parts) and rel.parts[0] in self.folders and rel.as_posix() not in self.keep

    def pytest_configure(self, config):
        import os

        env = os.environ if self.env is None else self.env
        given = getattr(config, "workerinput", {}).get(_WORKER_KEY)
        if given:  # an xdist worker: the controller's choice
            self.mode, self.seed, self.origin = given
        else:
            self.mode, self.seed, self.origin = parse(env.get(ENV), self.tests_dir)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):  # xdist controller, for each worker
        node.workerinput[_WORKER_KEY] = (self.mode, self.seed, self.origin)

    def describe(self) -> str:
        where = ", ".join(f"{self.tests_dir.name}/{f}" for f in self.folders)
        if self.mode == "file":
            return f"test order: as written in each file ({ENV}=file)"
        kept = "".join(f"; kept as written: {self.tests_dir.name}/{f} ({why})" for f, why in sorted(self.keep.items()))
        if self.mode == "reversed":
            return f"test order: each file of {where} backwards ({ENV}=reversed){kept}"
        return (
            f"test order: shuffled within each file of {where}, seed {self.seed} ({self.origin}); "
            f"{ENV}={self.seed} repeats it, =file keeps each file's order, =reversed runs each backwards{kept}"
        )

    def pytest_report_header(self, config):
        return self.describe()

    @pytest.hookimpl(tryfirst=True)  # before tests/conftest.py puts the slowest files first
    def pytest_collection_modifyitems(self, session, config, items):
        arrange(items, self.mode, self.seed, self.in_scope)

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if hasattr(config, "workerinput"):
            return
        terminalreporter.write_sep("-", "test order")
        terminalreporter.write_line(self.describe())
        if self.mode != "file":
            value = self.seed if self.mode == "shuffled" else self.mode
            terminalreporter.write_line(
                f"A test that fails in this order but passes alone relies on an earlier test's state. "
                f"{ENV}={value} .venv/bin/python -m pytest -p no:xdist tests/<file> runs that file in the same order "
                f"(a file alone or any part of it keeps its tests' order: it comes from the seed and each test's id)."
            )
