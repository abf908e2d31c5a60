"""A MIG server's private /dev holds its slice's nodes and nothing of another slice (issue 25),
attacked from the students' own kernels against a real hub run as root.

A CUDA process reaches a MIG slice through three nodes: the parent GPU's ``nvidia<minor>`` and
the ``nvidia-caps/nvidia-cap<N>`` nodes that grant the slice's GPU instance and compute
instance, whose minors the driver lists in ``/proc/driver/nvidia/capabilities``. The stand-ins
here: the fake NVML (an A100 in MIG mode, three 1g.10gb slices), a test-owned copy of the
driver's capability table (``LocalBroker.nvidia_capabilities``) and a tree of stand-in nodes
(``LocalGpuSpawner.device_dir``: majors with no driver behind them, so opening a present node
reaches the kernel's driver lookup, ENXIO, and a missing one does not exist, ENOENT), as
tests/integration/test_isolation.py does for whole GPUs.
"""

import json
import os
import stat
import sys
import uuid
from pathlib import Path

import pytest

from support.fake_gpus import fake_nvml_env
from support.hub import Hub

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mlflow"))
from mlflow_kernel import KernelSession  # noqa: E402  (a real kernel over the Jupyter protocol)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="isolation needs a hub running as root (CI runs as root)"),
]

REPO = Path(__file__).resolve().parents[2]
NVIDIA = 195  # the GPU nodes' major
CAPS = 237  # nvidia-caps' major is dynamic (/proc/devices); any major without a driver here stands in
STUDENTS = ("s1", "s2")
# Each slice: its UUID, GPU instance and the nvidia-caps minors of its GI and CI (as the driver numbers them).
SLICES = {f"MIG-1501a7e5-0000-4000-8000-00000000000{i}": (7 + i, 100 + 2 * i, 101 + 2 * i) for i in range(3)}

POLICY = """\
flavors:
  - name: a100-1g
    displayName: A100 1g.10gb
    mig: {profile: 1g.10gb}
    local: {match: A100}
teams:
  - {name: students, displayName: Students, groups: [students], quota: {gpus: {a100-1g: 3}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: mig-1g, displayName: One slice, gpu: {count: 1, flavor: a100-1g}, teams: [students], cpu: "1", memory: 1Gi}
"""

EXTRA_CONFIG = f"""
c.DemoAuthenticator.demo_users = dict(c.DemoAuthenticator.demo_users, **{{name: {{"groups": ["students"]}} for name in {STUDENTS!r}}})
"""


def nvml_devices():
    slices = [
        {"uuid": u, "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "memory_total": 10 * 2**30, "gi": gi, "ci": 0}
        for u, (gi, _, _) in SLICES.items()
    ]
    return [
        {
            "uuid": "GPU-a100-mig",
            "name": "NVIDIA A100-SXM4-80GB",
            "memory_total": 80 * 2**30,
            "events": [],
            "mig": {"enabled": True, "devices": slices},
        }
    ]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The driver's capability table and the stand-in /dev, every slice's nodes in it (as on the host)."""
    caps = tmp_path_factory.mktemp("capabilities")
    dev = tmp_path_factory.mktemp("dev")
    (dev / "nvidia-caps").mkdir()
    os.chmod(dev / "nvidia-caps", 0o755)
    nodes = {"nvidia0": (NVIDIA, 0), "nvidiactl": (NVIDIA, 255)}
    for gi, gi_minor, ci_minor in SLICES.values():
        for sub, minor in ((f"gpu0/mig/gi{gi}", gi_minor), (f"gpu0/mig/gi{gi}/ci0", ci_minor)):
            (caps / sub).mkdir(parents=True, exist_ok=True)
            (caps / sub / "access").write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
            nodes[f"nvidia-caps/nvidia-cap{minor}"] = (CAPS, minor)
    for name, (major, minor) in nodes.items():
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(dev / name, 0o666)  # world-openable like the real ones: only the private /dev keeps them out
    return caps, dev


@pytest.fixture(scope="module")
def hub(tmp_path_factory, trees):
    from gpuhub_spawner.local.isolation import remove_isolation

    caps, dev = trees
    nvml = tmp_path_factory.mktemp("nvml") / "nvml.json"
    nvml.write_text(json.dumps({"devices": nvml_devices()}))
    h = Hub(
        tmp_path_factory.mktemp("mig-iso"),
        POLICY,
        extra_config=EXTRA_CONFIG + f"c.LocalGpuSpawner.device_dir = {str(dev)!r}\n"
        f"c.LocalBroker.nvidia_capabilities = {str(caps)!r}\n",
        env=fake_nvml_env(nvml),
    )
    prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]
    try:
        h.start()
        yield h
    finally:
        h.stop()
        remove_isolation(prefix)


def session(hub, user):
    s = user.wait_ready()
    return KernelSession("", hub.server_url(s["url"]), user.token, f"mig-{uuid.uuid4().hex[:6]}.ipynb")


SCAN = (
    "import os, stat, json\n"
    "found = {}\n"
    "for root, dirs, files in os.walk('/dev'):\n"
    "    for f in files:\n"
    "        p = os.path.join(root, f)\n"
    "        st = os.lstat(p)\n"
    f"        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in ({NVIDIA}, {CAPS}):\n"
    "            found[p] = [os.major(st.st_rdev), os.minor(st.st_rdev)]\n"
    "print(json.dumps(found))"
)


def try_open(k, paths) -> dict:
    return json.loads(
        k.execute(
            "import errno, json, os\nres = {}\n"
            f"for p in {list(map(str, paths))!r}:\n"
            "    try:\n"
            "        open(p, 'rb').close(); res[p] = 'ok'\n"
            "    except OSError as e:\n"
            "        res[p] = errno.errorcode[e.errno]\n"
            "print(json.dumps(res))"
        )
    )


def test_each_slice_server_sees_only_its_slices_gpu_and_capability_nodes(hub, trees):
    _caps, dev = trees
    users = {n: hub.login(n) for n in STUDENTS}
    for u in users.values():
        assert u.start("mig-1g").status_code in (201, 202)
    kernels = {n: session(hub, u) for n, u in users.items()}
    try:
        mine = {n: u.server_env()["CUDA_VISIBLE_DEVICES"] for n, u in users.items()}
        assert set(mine.values()) < set(SLICES) and len(set(mine.values())) == 2, mine
        for name, k in kernels.items():
            _gi, gi_minor, ci_minor = SLICES[mine[name]]
            # the parent GPU, its slice's GI and CI capabilities and the control node: nothing else
            assert json.loads(k.execute(SCAN)) == {
                "/dev/nvidia0": [NVIDIA, 0],
                "/dev/nvidiactl": [NVIDIA, 255],
                f"/dev/nvidia-caps/nvidia-cap{gi_minor}": [CAPS, gi_minor],
                f"/dev/nvidia-caps/nvidia-cap{ci_minor}": [CAPS, ci_minor],
            }, name
            others = [m for u, (_, g, c) in SLICES.items() if u != mine[name] for m in (g, c)]
            paths = [f"/dev/nvidia-caps/nvidia-cap{gi_minor}"] + [f"/dev/nvidia-caps/nvidia-cap{m}" for m in others]
            host = [dev / "nvidia-caps" / f"nvidia-cap{m}" for m in others]
            res = try_open(k, paths + host)
            assert res[paths[0]] == "ENXIO"  # present: the open reaches the (absent) driver
            assert all(res[p] == "ENOENT" for p in paths[1:]), res  # another slice's grant is not there
            assert all(res[str(p)] in ("ENOENT", "EACCES") for p in host), res  # the host tree is hidden
        log = hub.log.read_text()
        for name in STUDENTS:
            _gi, g, c = SLICES[mine[name]]
            assert f"GPU nodes: nvidia-caps/nvidia-cap{g}, nvidia-caps/nvidia-cap{c}, nvidia0, nvidiactl" in log
    finally:
        for k in kernels.values():
            k.close()
