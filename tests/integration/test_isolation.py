"""Isolation on one machine, attacked from a user's own kernel against a real hub run as root.

Every attack runs as code in a real kernel of the attacker's real server (the way a
user would: a notebook cell). Stand-in GPU nodes (character devices with NVIDIA's
major number 195, no driver behind them) in a test-owned tree show the device wall:
opening a present stand-in reaches the kernel's driver lookup (ENXIO), a missing one
does not exist (ENOENT). Accounts and cgroups are made with a per-run prefix and
removed at the end.
"""

import errno
import os
import stat
import uuid
from pathlib import Path

import sys

import pytest

from gpuhub_spawner.local.sandbox import _per_mount_proc_options
from support.hub import Hub, processes_with_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mlflow"))
from mlflow_kernel import KernelSession  # noqa: E402  (a real kernel over the Jupyter protocol)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="isolation needs a hub running as root (CI runs as root)"),
]

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 2}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 1}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision, nlp], cpu: "1", memory: 1Gi}
  - {slug: gpu-small, displayName: One GPU small, gpu: {count: 1, flavor: gpu}, teams: [vision], cpu: "1", memory: 400Mi}
defaults:
  queueTimeout: 5m
"""

NVIDIA = 195
HUB_SECRET = "hub-only-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def dev_tree(tmp_path_factory):
    """A stand-in /dev: nvidia0, nvidia1, nvidiactl (major 195), world-openable like the real ones."""
    d = tmp_path_factory.mktemp("dev")
    for name, minor in {"nvidia0": 0, "nvidia1": 1, "nvidiactl": 255}.items():
        os.mknod(d / name, stat.S_IFCHR | 0o666, os.makedev(NVIDIA, minor))
        os.chmod(d / name, 0o666)
    return d


@pytest.fixture(scope="module")
def hub(tmp_path_factory, dev_tree):
    from gpuhub_spawner.local.isolation import remove_isolation

    h = Hub(
        tmp_path_factory.mktemp("iso"),
        POLICY,
        extra_config=f"c.LocalGpuSpawner.device_dir = {str(dev_tree)!r}\n",
        env={"GPUHUB_TEST_HUB_SECRET": HUB_SECRET},
    )
    h.prefix = prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]  # this hub's own accounts
    try:
        h.start()
        yield h
    finally:
        h.stop()
        remove_isolation(prefix)


def session(hub, user, server=""):
    s = user.wait_ready(server)
    base = hub.server_url(s["url"])
    # KernelSession joins hub_url + server_url; with per-user origins the server URL is absolute.
    return KernelSession("", base, user.token, f"attack-{uuid.uuid4().hex[:6]}.ipynb")


def server_pid(hub, name, server=""):
    for pid in processes_with_env(f"GPUHUB_TEST_RUN={hub.run_id}"):
        env = dict(i.split("=", 1) for i in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in i)
        if (
            env.get("JUPYTERHUB_USER") == name
            and env.get("JUPYTERHUB_SERVER_NAME", "") == server
            and "jupyterhub-singleuser" in Path(f"/proc/{pid}/cmdline").read_text()
        ):
            return pid
    raise LookupError(name)


def running(user, profile: str | None = None) -> dict:
    """``user``'s server, ready, with ``profile`` (None: any): what a test needs, whatever the
    tests before left running or stopped (each test passes alone and in any order)."""
    s = user.server()
    if s is not None and profile is not None and (s.get("user_options") or {}).get("profile") != profile:
        user.stop()
        user.wait_gone()
        s = None
    if s is None:
        assert user.start(profile or "cpu").status_code in (201, 202)
    return user.wait_ready()


def try_open(k, paths) -> dict:
    """Open each path from inside the kernel; the errno name or 'ok'."""
    out = k.execute(
        "import errno, json, os\nres = {}\n"
        f"for p in {list(map(str, paths))!r}:\n"
        "    try:\n"
        "        open(p, 'rb').close(); res[p] = 'ok'\n"
        "    except OSError as e:\n"
        "        res[p] = errno.errorcode[e.errno]\n"
        "print(json.dumps(res))"
    )
    import json

    return json.loads(out)


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol")}


def test_each_user_has_an_account_and_cannot_read_others_or_the_hub(hub, users):
    alice, bob = users["alice"], users["bob"]
    running(alice, "cpu")
    running(bob, "cpu")
    ka, kb = session(hub, alice), session(hub, bob)
    try:
        a_uid = int(ka.execute("import os; print(os.getuid())"))
        b_uid = int(kb.execute("import os; print(os.getuid())"))
        assert 0 not in (a_uid, b_uid) and a_uid != b_uid
        home_a = hub.data / "home" / "alice"
        st = home_a.stat()
        assert st.st_uid == a_uid and stat.S_IMODE(st.st_mode) == 0o700
        ka.execute("open('diary.txt', 'w').write('alice only')")
        assert (home_a / "diary.txt").read_text() == "alice only"

        a_pid = server_pid(hub, "alice")
        data = hub.data
        res = try_open(
            kb,
            [
                home_a / "diary.txt",
                f"/home/{hub.prefix}alice/diary.txt",
                data / "jupyterhub.sqlite",
                data / "jupyterhub_cookie_secret",
                f"/proc/{a_pid}/environ",
            ],
        )
        assert res[str(home_a / "diary.txt")] in ("EACCES", "ENOENT"), res
        assert res[f"/home/{hub.prefix}alice/diary.txt"] in ("EACCES", "ENOENT"), res
        assert res[str(data / "jupyterhub.sqlite")] in ("EACCES", "ENOENT"), res
        assert res[str(data / "jupyterhub_cookie_secret")] in ("EACCES", "ENOENT"), res
        # Linux >= 5.8: bob's own /proc does not even show alice's processes; older: unreadable
        hidden = _per_mount_proc_options()
        assert res[f"/proc/{a_pid}/environ"] == ("ENOENT" if hidden else "EACCES"), res
        visible = kb.execute(f"import os; print(os.path.exists('/proc/{a_pid}'), os.path.exists(f'/proc/{{os.getpid()}}'))")
        assert visible.split() == ["False" if hidden else "True", "True"]
        # a file alice's kernel leaves in /tmp (world-readable mode) is not bob's to read
        ka.execute("open('/tmp/alice-notes.txt', 'w').write('alice only'); import os; os.chmod('/tmp/alice-notes.txt', 0o644)")
        assert try_open(kb, ["/tmp/alice-notes.txt"]) == {"/tmp/alice-notes.txt": "ENOENT"}
        assert try_open(ka, ["/tmp/alice-notes.txt"]) == {"/tmp/alice-notes.txt": "ok"}
        listing = kb.execute(
            f"import os\ntry:\n    print(os.listdir({str(data)!r}))\nexcept OSError as e:\n    print('denied', e.errno)"
        )
        assert listing.startswith("denied"), listing
        # nor can bob signal alice's server
        signalled = kb.execute(
            f"import os, signal\ntry:\n    os.kill({a_pid}, signal.SIGTERM); print('killed')\nexcept OSError as e:\n    print('denied')"
        )
        assert signalled.strip() == "denied"
        assert alice.server()["ready"]
        # the hub's data directory is private from the first start
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
    finally:
        ka.close()
        kb.close()


def test_server_environment_carries_nothing_of_the_hubs(hub, users):
    alice = users["alice"]
    running(alice)
    env = dict(i.split("=", 1) for i in Path(f"/proc/{server_pid(hub, 'alice')}/environ").read_text().split("\0") if "=" in i)
    cookie_secret = (hub.data / "jupyterhub_cookie_secret").read_text().strip()
    assert "GPUHUB_TEST_HUB_SECRET" not in env and HUB_SECRET not in "".join(env.values())
    assert not any(cookie_secret in v for v in env.values())
    assert "GPUHUB_DEMO_PASSWORD" not in env and not any("test-password" in v for v in env.values())
    # nothing but what JupyterHub and gpuhub mean to give the server
    allowed_prefixes = ("JUPYTERHUB_", "JPY_", "GPUHUB_", "MLFLOW_")
    allowed = {
        "CUDA_VISIBLE_DEVICES",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "PATH",
        "LANG",
        "LC_ALL",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
        "CONDA_ROOT",
        "CONDA_DEFAULT_ENV",
        "MEM_LIMIT",
        "CPU_LIMIT",
        "RAY_AUTH_MODE",
    }  # gpuhub's: kernels join the user's Ray cluster with its token (docs/ray.md)
    assert env.get("RAY_AUTH_MODE") in (None, "token")
    extra = sorted(k for k in env if k not in allowed and not k.startswith(allowed_prefixes))
    assert extra == [], extra
    assert env["HOME"] == f"/home/{hub.prefix}alice" and env["USER"] == f"{hub.prefix}alice"


def test_gpu_nodes_are_exactly_the_assigned_ones(hub, users, dev_tree):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    running(bob, "cpu")  # first: a GPU of bob's would be Vision Lab's one
    running(alice, "gpu-1")
    running(carol, "gpu-1")
    ka, kc, kb = session(hub, alice), session(hub, carol), session(hub, bob)
    try:
        scan = (
            "import os, stat, json\n"
            "os.environ.pop('CUDA_VISIBLE_DEVICES', None)\n"  # clearing it gains nothing
            "found = {}\n"
            "for root, dirs, files in os.walk('/dev'):\n"
            "    for f in files:\n"
            "        p = os.path.join(root, f)\n"
            "        st = os.lstat(p)\n"
            f"        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == {NVIDIA}:\n"
            "            found[p] = os.minor(st.st_rdev)\n"
            "print(json.dumps(found))"
        )
        import json

        mine = alice.server_env()["CUDA_VISIBLE_DEVICES"]
        theirs = carol.server_env()["CUDA_VISIBLE_DEVICES"]
        assert {mine, theirs} == {"0", "1"}
        assert json.loads(ka.execute(scan)) == {f"/dev/nvidia{mine}": int(mine), "/dev/nvidiactl": 255}
        assert json.loads(kc.execute(scan)) == {f"/dev/nvidia{theirs}": int(theirs), "/dev/nvidiactl": 255}
        assert json.loads(kb.execute(scan)) == {}  # a CPU profile sees no GPU node at all
        res = try_open(ka, [f"/dev/nvidia{mine}", f"/dev/nvidia{theirs}", dev_tree / f"nvidia{theirs}"])
        assert res[f"/dev/nvidia{mine}"] == "ENXIO"  # present: the open reaches the (absent) driver
        assert res[f"/dev/nvidia{theirs}"] == "ENOENT"
        assert res[str(dev_tree / f"nvidia{theirs}")] in ("ENOENT", "EACCES")
        made = ka.execute(
            "import os, stat\n"
            f"try:\n    os.mknod('n', stat.S_IFCHR | 0o666, os.makedev({NVIDIA}, {theirs})); print('made')\n"
            "except OSError as e:\n    print(e.errno)"
        )
        assert made.strip() == str(errno.EPERM)
    finally:
        for k in (ka, kc, kb):
            k.close()


def _server_cgroup(pid: int, controller: str) -> Path | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(",") or (ctrls == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists()):
            base = Path("/sys/fs/cgroup") / (controller if ctrls else "")
            return base / path.lstrip("/")
    return None


def test_device_cgroup_is_a_second_wall(hub, users, dev_tree):
    """Even a process inside alice's devices cgroup that has the other node cannot open it (v1)."""
    import subprocess
    import sys

    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("cgroup v2: no devices controller (the private /dev is the wall)")
    alice = users["alice"]
    running(users["bob"], "cpu")  # a GPU of bob's would be Vision Lab's one
    running(alice, "gpu-1")
    mine = alice.server_env()["CUDA_VISIBLE_DEVICES"]
    other = "1" if mine == "0" else "0"
    cg = _server_cgroup(server_pid(hub, "alice"), "devices")
    if cg is None or not (cg / "devices.list").exists():
        pytest.skip("no cgroup v1 devices controller here (cgroup v2: the private /dev is the wall)")
    code = (
        "import errno, sys\n"
        f"open({str(cg / 'cgroup.procs')!r}, 'w').write('0')\n"
        "def t(p):\n"
        "    try:\n        open(p, 'rb'); return 'ok'\n"
        "    except OSError as e:\n        return errno.errorcode[e.errno]\n"
        f"print(t({str(dev_tree / ('nvidia' + other))!r}), t({str(dev_tree / ('nvidia' + mine))!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["EPERM", "ENXIO"], out


def test_cpu_and_memory_of_the_profile_are_in_the_cgroup(hub, users):
    bob = users["bob"]
    running(bob, "cpu")
    pid = server_pid(hub, "bob")  # cpu profile: 500m, 1Gi
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if v2:
        cg = _server_cgroup(pid, "")
        assert (cg / "cpu.max").read_text().split() == ["50000", "100000"]
        assert int((cg / "memory.max").read_text()) == 2**30
    else:
        cpu, mem = _server_cgroup(pid, "cpu"), _server_cgroup(pid, "memory")
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50000
        assert int((cpu / "cpu.cfs_period_us").read_text()) == 100000
        assert int((mem / "memory.limit_in_bytes").read_text()) == 2**30
    # and every process of the server is in it, its kernels included
    k = session(hub, bob)
    try:
        kpid = int(k.execute("import os; print(os.getpid())"))
        assert Path(f"/proc/{kpid}/cgroup").read_text() == Path(f"/proc/{pid}/cgroup").read_text()
    finally:
        k.close()


def test_over_memory_stops_the_server_says_why_and_the_gpu_goes_on(hub, users):
    alice, carol, bob = users["alice"], users["carol"], users["bob"]
    for u in (alice, carol, bob):
        u.stop()
        u.wait_gone()
    assert alice.start("gpu-small").status_code in (201, 202)  # 400 MiB
    alice.wait_ready()
    assert bob.start("gpu-1").status_code == 202  # same team: waits for alice's GPU
    k = session(hub, alice)
    assert k.execute("print('ready')").strip() == "ready"
    # a cell that allocates (and touches) 1 GiB; no reply is awaited: the kernel dies
    k.send_execute("x = bytearray(1024 * 2**20); x[::4096] = b'1' * len(x[::4096])")
    alice.wait_gone(timeout=120)  # (reclaim before the OOM kill can take a while on a loaded machine)
    bob.wait_ready()  # the GPU went to the next in line
    form = alice.session.get(hub.url + "/hub/spawn/alice").text
    assert "gpuhub-stop-reason" in form and "memory limit of 400 MiB" in form, form[:3000]
    # the next start clears the message
    assert alice.start("cpu").status_code in (201, 202)
    alice.wait_ready()
    alice.stop()
    alice.wait_gone()
    assert "gpuhub-stop-reason" not in alice.session.get(hub.url + "/hub/spawn/alice").text


def test_a_foreign_account_with_the_users_name_is_never_used(hub):
    """An account gpuhub did not make (a person's login, a service) is refused, not taken over."""
    import subprocess

    name = f"{hub.prefix}dave"
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
    try:
        dave = hub.login("dave")
        r = dave.start("cpu", team="nlp")
        assert r.status_code == 500 and "no usable Unix account" in r.json()["message"]
        assert dave.server() is None
        assert f"Unix account {name!r} exists but was not created by gpuhub" in hub.log.read_text()
    finally:
        subprocess.run(["userdel", name], check=True)
