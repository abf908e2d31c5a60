"""The one-machine hub's configuration (wiring/config.py) opens JupyterLab where it is installed,
and finds that out without importing it: JupyterLab's import (jupyter_server, jupyterlab_server,
its handlers) cost every hub start ~0.2 s of CPU for a yes/no answer (tests/benchmarks/hub_start.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.util, sys
from traitlets.config import Config
from gpuhub_spawner.wiring.config import configure_local
c = Config()
configure_local(c, data_dir=sys.argv[1], policy_file=sys.argv[2], port=0)
print(c.Spawner.default_url, "jupyterlab" in sys.modules)
"""


def test_servers_open_jupyterlab_when_it_is_installed_and_the_hub_does_not_import_it(tmp_path):
    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("JupyterLab is not installed here (the lab extra)")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "data"), str(ROOT / "jupyterhub_config" / "profiles.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    default_url, imported = out.stdout.split()[-2:]
    assert default_url == "/lab"
    assert imported == "False", "the hub's configuration imported JupyterLab to learn it is installed"
