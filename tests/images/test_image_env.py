"""The notebook images' Python environment, built from their lock in a venv and smoke-tested
(issue 28 item 3). No Docker here: the venv stands in for the image's ``pip install`` layer.

What is the same as the image: ``pip install -r notebook-requirements.lock <gpuhub-notebook>``
exactly as both Dockerfiles run it, then ``pip check``. What stands in for the docker-stacks
base (which ships JupyterLab, the Jupyter server and ipykernel): JupyterLab at the hub's pin and
ipykernel, installed first. The Python is this machine's (3.11), the images' is 3.12: the lock
is resolved for 3.12 wheels (images/relock.sh), so a pin that had no 3.11 wheel would show here.

A researcher would notice each check: the server extension that reports GPU activity and shows
cull warnings loads; JupyterLab has gpuhub's extension; ``jupyterhub-singleuser`` is the hub's
version (a mismatch breaks the OAuth handshake); an MLflow run started with the server's
identity carries it (user, team, profile) without a line of code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"

# The module's venv is two pip installs from PyPI (each bounded at 900 s) before its first test.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2000)]


def _pin(name: str) -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for r in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
        m = re.match(rf"^{re.escape(name)}(?:\[[^\]]*\])?==([^;\s]+)", r)
        if m:
            return m.group(1)
    raise KeyError(name)


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-env") / "venv"
    venv.create(root, with_pip=True)
    py = root / "bin" / "python"

    def pip(*args):
        p = subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", *args],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert p.returncode == 0, p.stdout + p.stderr

    pip(f"jupyterlab=={_pin('jupyterlab')}", "ipykernel")  # the base image's part
    pip("-r", str(IMAGES / "notebook-requirements.lock"), str(IMAGES / "gpuhub-notebook"))  # as the Dockerfiles
    return root


def run(env_root: Path, *cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(env_root / "bin" / cmd[0]), *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {}), PATH=f"{env_root / 'bin'}:{os.environ['PATH']}"),
    )


def test_the_lock_installs_consistently(image_env):
    p = run(image_env, "python", "-m", "pip", "check")
    assert p.returncode == 0, p.stdout + p.stderr


def test_jupyterhub_singleuser_is_the_hubs_version(image_env):
    import jupyterhub

    p = run(image_env, "jupyterhub-singleuser", "--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == jupyterhub.__version__ == _pin("jupyterhub")


def _plain(p: subprocess.CompletedProcess) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr)  # without the terminal colours


def test_the_server_extension_and_the_lab_extension_are_enabled(image_env):
    text = _plain(run(image_env, "jupyter", "server", "extension", "list"))
    assert re.search(r"gpuhub_notebook\s+enabled", text), text
    assert re.search(r"gpuhub_notebook \S+ OK", text), text  # it imports and validates
    text = _plain(run(image_env, "jupyter", "labextension", "list"))
    assert re.search(r"gpuhub-notebook v\S+ enabled\s+OK", text), text


def test_an_mlflow_run_carries_the_servers_identity(image_env, tmp_path):
    code = (
        "import json, mlflow\n"
        "with mlflow.start_run() as run:\n"
        "    mlflow.log_metric('loss', 0.5)\n"
        "print(json.dumps(mlflow.get_run(run.info.run_id).data.tags))\n"
    )
    env = {
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "JUPYTERHUB_USER": "alice",
        "GPUHUB_USER": "alice",
        "GPUHUB_TEAM": "vision",
        "GPUHUB_PROFILE": "a100-1",
        "GPUHUB_GPU_FLAVOR": "a100",
        "GPUHUB_GPU_COUNT": "1",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }  # a local store here; in a server it is the hub's MLflow
    p = run(image_env, "python", "-c", code, env=env)
    assert p.returncode == 0, p.stderr
    tags = json.loads(p.stdout.strip().splitlines()[-1])
    assert tags["gpuhub.user"] == "alice" and tags["mlflow.user"] == "alice"
    assert tags["gpuhub.team"] == "vision" and tags["gpuhub.profile"] == "a100-1"
    assert tags["gpuhub.gpu.flavor"] == "a100" and tags["gpuhub.gpu.count"] == "1"
