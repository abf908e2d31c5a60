"""A researcher's own packages (issue 42, item 6), on a real hub run as root when it can.

The server runs the hub's environment, which alice cannot write, and ``pip install --user`` is
refused in a venv. The supported way, ``gpuhub env create NAME`` (docs/own-packages.md): from
her kernel she makes ``~/.venvs/mine`` and installs a package into it (a wheel built in the
test, so no index is needed); after her server's restart the kernel "Python (mine)" is listed
and imports it beside what the server's environment has; her job runs with it; bob's job cannot
use her environment (her home is hers).
"""

from __future__ import annotations

import json
import os
import textwrap
import uuid

import pytest

from support.hub import running_hub, wait_for
from support.kernel import KernelSession

pytestmark = [pytest.mark.integration]

POLICY = """\
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab]}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
"""
VALUE = "from my own package " + uuid.uuid4().hex[:8]

# Run in alice's kernel: a wheel of a one-module package, built in her home with the standard
# library (what `pip wheel` would make), then `gpuhub env create` and a pip install into it.
SETUP = textwrap.dedent(f"""\
    import base64, hashlib, os, subprocess, sys, zipfile
    name, ver = "gpuhub_demo_pkg", "1.0"
    files = {{f"{{name}}/__init__.py": "VALUE = {VALUE!r}\\n",
             f"{{name}}-{{ver}}.dist-info/METADATA": f"Metadata-Version: 2.1\\nName: {{name}}\\nVersion: {{ver}}\\n",
             f"{{name}}-{{ver}}.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
    wheel = os.path.expanduser(f"~/{{name}}-{{ver}}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        record = []
        for path, text in files.items():
            z.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{{path}},sha256={{digest}},{{len(text.encode())}}")
        record.append(f"{{name}}-{{ver}}.dist-info/RECORD,,")
        z.writestr(f"{{name}}-{{ver}}.dist-info/RECORD", "\\n".join(record) + "\\n")
    user = subprocess.run([sys.executable, "-m", "pip", "install", "--user", "--no-index", wheel], capture_output=True, text=True)
    made = subprocess.run(["gpuhub", "env", "create", "mine"], capture_output=True, text=True)
    py = os.path.expanduser("~/.venvs/mine/bin/python")
    pip = subprocess.run([py, "-m", "pip", "install", "--no-index", wheel], capture_output=True, text=True)
    print(repr({{"user": (user.returncode, user.stderr[-300:]), "made": (made.returncode, made.stdout + made.stderr),
                 "pip": (pip.returncode, pip.stdout[-300:] + pip.stderr[-300:]), "python": py}}))
""")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("own-packages"), POLICY, slow_spawn_timeout=1) as h:
        yield h


def kernel(hub, user, name="python3") -> KernelSession:
    s = user.wait_ready()
    return KernelSession("", hub.server_url(s["url"]), user.token, f"pkg-{uuid.uuid4().hex[:6]}.ipynb", kernel=name)


def run_job(user, argv: list[str], timeout: float = 120) -> tuple[dict, str]:
    spec = f"profile: cpu\ncommand: {json.dumps(argv)}\n"
    r = user.api.post(user.url("/gpuhub/jobs"), json={"spec": spec, "filename": "pkg.yaml"})
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


def test_own_environment_survives_a_restart_and_reaches_kernels_and_jobs_of_its_owner_only(hub):
    alice, bob = hub.login("alice"), hub.login("bob")
    assert alice.start("cpu").status_code in (201, 202)
    k = kernel(hub, alice)
    try:
        out = eval(k.execute(SETUP).strip())  # the kernel printed one literal
    finally:
        k.close()
    assert out["user"][0] != 0 and "User site-packages are not visible in this virtualenv" in out["user"][1], out
    assert out["made"][0] == 0 and "Created" in out["made"][1], out
    assert out["pip"][0] == 0, out
    python = out["python"]

    alice.stop()
    alice.wait_gone()
    assert alice.start("cpu").status_code in (201, 202)
    s = alice.wait_ready()
    specs = alice.api.get(hub.server_url(s["url"]) + "api/kernelspecs").json()["kernelspecs"]
    assert specs["mine"]["spec"]["display_name"] == "Python (mine)", sorted(specs)
    k = kernel(hub, alice, "mine")
    try:
        got = k.execute(
            "import sys, gpuhub_demo_pkg, gpuhub_notebook, ipykernel\nprint(gpuhub_demo_pkg.VALUE, sys.prefix.endswith('/.venvs/mine'))"
        )
    finally:
        k.close()
    assert got.strip() == f"{VALUE} True", got  # hers, beside the server environment's packages

    rec, log = run_job(alice, [python, "-c", "import gpuhub_demo_pkg as m; print(m.VALUE)"])
    assert rec["state"] == "succeeded" and VALUE in log, (rec, log)
    if os.geteuid() == 0:  # isolated: bob's account cannot enter alice's home
        rec, log = run_job(bob, [python, "-c", "import gpuhub_demo_pkg"])
        assert rec["state"] == "failed" and VALUE not in log, (rec, log)
