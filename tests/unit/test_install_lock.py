"""requirements.lock (relock.sh) against the project's own requirements.

``ensure_venv`` installs with the lock as constraints: a release upstream cannot change what CI
installs between two runs. A lock that no longer satisfies pyproject.toml would make that
install fail (or, on the fallback, quietly resolve something else): caught here, with the line
to change.
"""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def locked() -> dict[str, str]:
    pins = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock:{n}: not 'name==version': {line!r}"
        assert canonicalize_name(name) not in pins, f"requirements.lock:{n}: {name} pinned twice"
        pins[canonicalize_name(name)] = version
    return pins


def requirements(pyproject: Path) -> list[tuple[str, Requirement]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    out = [("dependencies", Requirement(r)) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out += [(f"optional-dependencies.{extra}", Requirement(r)) for r in reqs]
    return out


def test_every_requirement_of_the_project_is_locked_at_a_version_it_allows():
    pins = locked()
    assert len(pins) > 100, "requirements.lock looks truncated"
    wrong = []
    for where, req in requirements(ROOT / "pyproject.toml"):
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            wrong.append(f"pyproject.toml [{where}] {req}: not in requirements.lock")
        elif not req.specifier.contains(version, prereleases=True):
            wrong.append(f"pyproject.toml [{where}] {req}: requirements.lock has {version}")
    assert not wrong, "run ./relock.sh:\n" + "\n".join(wrong)


def test_the_notebook_packages_requirements_agree_with_the_lock_where_it_has_them():
    """The notebook package's extras are the images' (their own lock, images/relock.sh); where
    the hub's environment has the same package, the versions must agree, or a server in the
    hub's environment would run what the images never do."""
    pins = locked()
    wrong = [
        f"images/gpuhub-notebook/pyproject.toml [{where}] {req}: requirements.lock has {pins[canonicalize_name(req.name)]}"
        for where, req in requirements(ROOT / "images/gpuhub-notebook/pyproject.toml")
        if canonicalize_name(req.name) in pins and not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("own", ["gpuhub-spawner", "gpuhub-notebook"])
def test_the_lock_leaves_gpuhubs_own_packages_to_the_checkout(own):
    assert canonicalize_name(own) not in locked(), f"{own} is installed editable from the checkout, never from an index"
