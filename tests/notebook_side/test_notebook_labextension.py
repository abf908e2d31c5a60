"""The prebuilt JupyterLab extension: committed build output, installed by the package's data
files (no npm in CI), discovered and enabled by JupyterLab, and offered to the browser."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
import sys
from pathlib import Path

from nbside import REPO

PKG = REPO / "images" / "gpuhub-notebook"
BUILT = PKG / "src" / "gpuhub_notebook" / "labextension"
INSTALLED = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "gpuhub-notebook"


def test_committed_build_output_is_complete():
    meta = json.loads((BUILT / "package.json").read_text())
    source = json.loads((PKG / "labextension" / "package.json").read_text())
    assert (meta["name"], meta["version"]) == (source["name"], source["version"]) == ("gpuhub-notebook", "0.1.0")
    assert (BUILT / meta["jupyterlab"]["_build"]["load"]).is_file()
    bundle = "".join(p.read_text() for p in (BUILT / "static").glob("*.js"))
    # The bundle is the current source, not an empty or older build.
    for text in (
        "This server will be stopped ",
        "This server was stopped",
        "Hub home",
        "Your files are kept.",
        "Snooze",
        "gpuhub",
        "culling",
        "gpuhub-notebook:cull-warning",
        "gpuhub-notebook:run-as-job",
        "Run as Job",
        "and stop my server",
    ):
        assert text in bundle, text
    # "Run as job" is in the Run menu (the plugin's schema, shipped with the build).
    schema = json.loads((BUILT / "schemas" / "gpuhub-notebook" / "run-as-job.json").read_text())
    run_menu = next(m for m in schema["jupyter.lab.menus"]["main"] if m["id"] == "jp-mainmenu-run")
    assert {"command": "gpuhub-notebook:run-as-job", "rank": 1000} in run_menu["items"]
    assert not (BUILT / "static" / "node_modules").exists()
    total = sum(p.stat().st_size for p in BUILT.rglob("*") if p.is_file())
    assert total < 200_000, total


def test_installed_copy_matches_the_committed_build():
    # Editable installs copy data files: after a rebuild, `pip install -e images/gpuhub-notebook` again.
    assert (INSTALLED / "install.json").is_file()
    built = sorted(p.relative_to(BUILT) for p in BUILT.rglob("*") if p.is_file())
    installed = sorted(p.relative_to(INSTALLED) for p in INSTALLED.rglob("*") if p.is_file() and p.name != "install.json")
    assert built == installed, "reinstall: pip install -e images/gpuhub-notebook"
    _, mismatch, errors = filecmp.cmpfiles(BUILT, INSTALLED, [str(p) for p in built], shallow=False)
    assert mismatch == [] and errors == []


def test_jupyter_labextension_list_shows_it_enabled():
    r = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter"), "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    assert r.returncode == 0, out
    assert re.search(r"gpuhub-notebook v0\.1\.0 enabled\s+OK \(python, gpuhub-notebook\)", out), out


def test_lab_page_loads_the_extension(nb_server):
    r = nb_server.get("lab")
    assert r.status_code == 200, r.text[:500]
    m = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', r.text, re.S)
    config = json.loads(m.group(1))
    (ext,) = [e for e in config["federated_extensions"] if e["name"] == "gpuhub-notebook"]
    assert ext["load"].startswith("static/remoteEntry.") and ext["extension"] == "./extension"
    assert "gpuhub-notebook" not in json.dumps(config.get("disabledExtensions", []))
    js = nb_server.get(f"lab/extensions/gpuhub-notebook/{ext['load']}")
    assert js.status_code == 200 and "gpuhub" in js.text


def test_wheel_carries_lab_extension_and_server_config(tmp_path):
    """What the images install (a plain, non-editable install): no npm, files land in the prefix."""
    import zipfile

    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(PKG)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("gpuhub_notebook-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        data = "gpuhub_notebook-0.1.0.data/data/"
        config = json.loads(z.read(data + "etc/jupyter/jupyter_server_config.d/gpuhub_notebook.json"))
    assert config == {"ServerApp": {"jpserver_extensions": {"gpuhub_notebook": True}}}
    ext = data + "share/jupyter/labextensions/gpuhub-notebook/"
    assert {ext + "package.json", ext + "install.json"} <= names
    assert {ext + "static/" + p.name for p in (BUILT / "static").iterdir()} <= names
    assert not [n for n in names if "node_modules" in n or "/lib/" in n or n.endswith(".ts")]
