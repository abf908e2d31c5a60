"""A team environment an admin pins (issue 42, item 6; docs/own-packages.md), on a real hub as root.

The admin builds a Python environment under a root-only directory, as the guide says
(``gpuhub env create`` with ``GPUHUB_ENVS_DIR``, then a pip install of the pinned package: a
wheel built here, so no index is needed), and grants it to Vision Lab in the policy as a
dataset with a ``kernel``:

- alice (Vision Lab) finds the kernel "Vision Lab (2026-12)" in her server and runs the pinned
  package in it; she cannot change the environment (a write, ``pip uninstall``); her job runs
  with its Python;
- carol (NLP) has no such kernel, no such mount, cannot reach the admin's directory, and her
  job naming its Python fails;
- bob (Vision Lab) leaves a kernel of it idle on a profile with a short idle rule: the culler
  stops his server like any other, the kernel's process goes with it, and the environment is
  as the admin left it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import pytest

from support.hub import running_hub, wait_for
from support.kernel import KernelSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="a team-only environment is a team's mount: needs a hub running as root"),
]

ENV = "vision-2026-12"
DISPLAY = "Vision Lab (2026-12)"
PYTHON = f"/run/gpuhub/data/{ENV}/bin/python"  # where the team's servers and jobs see it
VALUE = "pinned " + uuid.uuid4().hex[:8]
PASS = 3  # seconds between culler passes; the short profile's idle rule below keeps its ratio
EXTRA_CONFIG = """
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL="5")
"""


def wheel(folder: Path) -> Path:
    """A one-module package's wheel, as ``pip wheel`` would make it (standard library only)."""
    name, ver = "gpuhub_pinned", "1.0"
    files = {
        f"{name}/__init__.py": f"VALUE = {VALUE!r}\n",
        f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
        f"{name}-{ver}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        record = []
        for member, text in files.items():
            z.writestr(member, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(text.encode())}")
        record.append(f"{name}-{ver}.dist-info/RECORD,,")
        z.writestr(f"{name}-{ver}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> Path:
    """The admin's steps (docs/own-packages.md), as root: the environment under a root-only directory."""
    top = tmp_path_factory.mktemp("team-envs")
    envs = top / "envs"
    envs.mkdir(mode=0o700)
    e = dict(os.environ, GPUHUB_ENVS_DIR=str(envs))
    gpuhub = [sys.executable, "-m", "gpuhub_spawner.cli"]
    r = subprocess.run([*gpuhub, "env", "create", ENV, "--no-kernel"], env=e, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [str(envs / ENV / "bin" / "python"), "-m", "pip", "install", "--no-index", str(wheel(top))],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return envs / ENV


@pytest.fixture(scope="module")
def hub(tmp_path_factory, pinned):
    policy = textwrap.dedent(f"""\
        teams:
          - {{name: vision, displayName: Vision Lab, groups: [vision-lab]}}
          - {{name: nlp, displayName: NLP, groups: [nlp-group]}}
        profiles:
          - {{slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}}
          - slug: short
            displayName: CPU, short idle rule
            teams: [vision]
            cpu: 500m
            memory: 1Gi
            idle: {{timeout: 15s, warning: 5s, maxSnoozes: 0}}
        data:
          - {{name: {ENV}, teams: [vision], kernel: "{DISPLAY}", local: {{path: {pinned}}}}}
    """)
    with running_hub(
        tmp_path_factory.mktemp("team-env-hub"),
        policy,
        extra_config=EXTRA_CONFIG,
        env={"GPUHUB_CULL_EVERY": str(PASS)},
        slow_spawn_timeout=1,
    ) as h:
        yield h


def kernel(hub, user, name: str = "python3") -> KernelSession:
    s = user.wait_ready()
    return KernelSession("", hub.server_url(s["url"]), user.token, f"env-{uuid.uuid4().hex[:6]}.ipynb", kernel=name)


def kernelspecs(hub, user) -> dict:
    s = user.wait_ready()
    return user.api.get(hub.server_url(s["url"]) + "api/kernelspecs").json()["kernelspecs"]


def run_job(user, argv: list[str], timeout: float = 120) -> tuple[dict, str]:
    r = user.api.post(
        user.url("/gpuhub/jobs"), json={"spec": f"profile: cpu\ncommand: {json.dumps(argv)}\n", "filename": "e.yaml"}
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    rec = wait_for(
        lambda: (
            (j := user.api.get(user.url(f"/gpuhub/jobs/{job_id}")).json())["state"] in ("succeeded", "failed", "cancelled") and j
        ),
        timeout,
        f"{job_id} to end",
    )
    return rec, user.api.get(user.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


MEMBER = """\
import errno, os, subprocess, sys, gpuhub_pinned
print("value", gpuhub_pinned.VALUE, sys.prefix, sys.executable)
tried = {}
try:
    open(os.path.join(os.path.dirname(gpuhub_pinned.__file__), "__init__.py"), "a").write("VALUE = 'mine'\\n")
    tried["write"] = "written"
except OSError as e:
    tried["write"] = errno.errorcode[e.errno]
try:
    os.mkdir(sys.prefix + "/mine")
    tried["mkdir"] = "made"
except OSError as e:
    tried["mkdir"] = errno.errorcode[e.errno]
un = subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "gpuhub_pinned"], capture_output=True, text=True)
tried["pip uninstall"] = un.returncode
print("tried", repr(tried))
"""


def test_the_pinned_environment_is_a_kernel_and_a_job_python_of_its_team_only(hub, pinned):
    before = tree(pinned)
    alice, carol = hub.login("alice"), hub.login("carol")
    assert alice.start("cpu").status_code in (201, 202)
    assert carol.start("cpu").status_code in (201, 202)
    specs = kernelspecs(hub, alice)
    assert specs[ENV]["spec"]["display_name"] == DISPLAY, sorted(specs)
    k = kernel(hub, alice, ENV)
    try:
        out = k.execute(MEMBER)
    finally:
        k.close()
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["value"] == f"{VALUE} /run/gpuhub/data/{ENV} {PYTHON}", out  # the pinned package, in its environment
    tried = eval(lines["tried"])  # the kernel printed one literal
    # root's files (EACCES) on a read-only mount (EROFS even where the modes would allow it)
    assert tried["write"] in ("EACCES", "EROFS") and tried["mkdir"] == "EROFS" and tried["pip uninstall"] != 0, tried
    assert tree(pinned) == before  # nothing of it changed

    rec, log = run_job(alice, [PYTHON, "-c", "import gpuhub_pinned, sys; print(gpuhub_pinned.VALUE, sys.prefix)"])
    assert rec["state"] == "succeeded" and f"{VALUE} /run/gpuhub/data/{ENV}" in log, (rec, log)

    # carol (NLP): not offered, not mounted, not reachable on the machine, not for her jobs.
    assert ENV not in kernelspecs(hub, carol)
    k = kernel(hub, carol)
    try:
        out = k.execute(
            "import os\n"
            "for p in ('/run/gpuhub/data', %r, %r):\n"
            "    try:\n        print(p, sorted(os.listdir(p)))\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n" % (str(pinned), str(pinned.parent))
        )
    finally:
        k.close()
    assert out.splitlines()[0] == "/run/gpuhub/data FileNotFoundError", out  # she is granted no data at all
    assert all(line.endswith(("PermissionError", "FileNotFoundError")) for line in out.splitlines()[1:]), out
    rec, log = run_job(carol, [PYTHON, "-c", "import gpuhub_pinned"])
    assert rec["state"] == "failed" and VALUE not in log, (rec, log)
    for user in (alice, carol):
        user.stop()
        user.wait_gone()


def test_an_idle_kernel_of_it_is_culled_with_its_server_and_the_environment_stays(hub, pinned):
    before = tree(pinned)
    bob = hub.login("bob")
    assert bob.start("short").status_code in (201, 202)
    k = kernel(hub, bob, ENV)
    pid = int(k.execute("import os, gpuhub_pinned\nprint(os.getpid())").strip())
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == PYTHON.encode()  # its own Python
    k.ws.close()  # the tab is closed; the kernel stays, idle
    wait_for(lambda: bob.server() is None, 15 + 5 + 4 * PASS + 30, "bob's idle server to be culled")
    audit = bob.api.get(bob.url(f"/gpuhub/culling/{bob.name}")).json()
    assert audit["culled"][""]["rule"] == "idle", audit
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, "the kernel's process to end with the server")
    assert tree(pinned) == before
