"""Attacks on the one machine's process limits and on a hub's claim to its cgroups, against
real hubs run as root.

- A fork bomb in a user's own kernel, and one in a batch job, is held at the policy's
  ``maxProcesses`` (the cgroup's ``pids.max``): other users' servers still start, the hub
  logs it and the user's spawn page says it once the server stops.
- A second hub started with the first one's account prefix (the harness gives each hub its
  own; here it is shared on purpose) refuses to start, naming the hub that holds the
  prefix, and the first hub's running server is untouched (same pid, still answering).
- A process in a server's cgroup that is not provably this hub's (not the account's) is not
  killed as a "leftover"; the start is refused instead.
- A wake-up of the exit watcher while the server still runs kills nothing.
- A hub killed hard (SIGKILL) leaves its prefix free: its successor starts and adopts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import requests

from support.hub import Hub, processes_with_env, wait_for
from support.kernel import KernelSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroups, accounts and prefix locks need a hub running as root"),
]

POLICY = """\
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab]}
  - {name: nlp, displayName: NLP, groups: [nlp-group]}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: small-procs, displayName: Few processes, teams: "*", cpu: 500m, memory: 1Gi, maxProcesses: 150}
defaults:
  queueTimeout: 5m
  maxProcesses: 300
  maxProcessesPerUser: 500
"""

# A bounded fork bomb: up to 2000 sleepers, as fast as they start; counts what the kernel refused.
BOMB = textwrap.dedent("""\
    import errno, json, os
    kids, refused, other = [], 0, None
    for i in range(2000):
        try:
            kids.append(os.posix_spawn("/bin/sleep", ["sleep", "300"], {}))
        except OSError as e:
            if e.errno != errno.EAGAIN:
                other = repr(e)
                break
            refused += 1
    print(json.dumps({"spawned": len(kids), "refused": refused, "other": other}), flush=True)
""")
REAP = "import os, signal\nfor k in kids:\n    os.kill(k, signal.SIGKILL)\nfor k in kids:\n    os.waitpid(k, 0)\nprint(len(kids))"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from gpuhub_spawner.local.isolation import remove_isolation

    # Poll servers every 5 s (default 30) so the process-limit log line comes promptly.
    h = Hub(tmp_path_factory.mktemp("limits"), POLICY, extra_config="c.Spawner.poll_interval = 5\n")
    h.prefix = prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]
    try:
        h.start()
        yield h
    finally:
        h.stop()
        remove_isolation(prefix)


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "dave", "lena")}


def session(hub, user, server=""):
    s = user.wait_ready(server)
    return KernelSession("", hub.server_url(s["url"]), user.token, f"attack-{uuid.uuid4().hex[:6]}.ipynb")


def server_pid(hub, name, server=""):
    for pid in processes_with_env(f"GPUHUB_TEST_RUN={hub.run_id}"):
        try:
            env = dict(i.split("=", 1) for i in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in i)
            cmd = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if (
            env.get("JUPYTERHUB_USER") == name
            and env.get("JUPYTERHUB_SERVER_NAME", "") == server
            and "jupyterhub-singleuser" in cmd
        ):
            return pid
    raise LookupError(name)


V2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()


def pids_dir(pid: int) -> Path:
    """The pids cgroup directory of ``pid`` (v2: its one cgroup)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if V2 and ctrls == "":
            return Path("/sys/fs/cgroup") / path.lstrip("/")
        if "pids" in ctrls.split(","):
            return Path("/sys/fs/cgroup/pids") / path.lstrip("/")
    raise LookupError(f"no pids cgroup for {pid}")


def answers(hub, user) -> bool:
    s = user.server()
    if not (s and s.get("ready")):
        return False
    r = requests.get(hub.server_url(s["url"]) + "api/status", headers={"Authorization": f"token {user.token}"}, timeout=10)
    return r.status_code == 200


# -- (a) process limits ------------------------------------------------------------------------


def test_a_fork_bomb_is_held_at_its_limit_others_still_start_and_the_user_is_told(hub, users):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    hub.stop_servers("alice")  # a test before may have left her CPU server (any order: seed 478b614b)
    assert alice.start("small-procs").status_code in (201, 202)
    if bob.server() is None:  # the prefix tests leave bob's server running (any order)
        assert bob.start("cpu").status_code in (201, 202)
    k = session(hub, alice)
    bob.wait_ready()
    a_cg = pids_dir(server_pid(hub, "alice"))
    try:
        before = int((a_cg / "pids.current").read_text())
        result = json.loads(k.execute(BOMB, timeout=300))
        held = int((a_cg / "pids.current").read_text())
        # while the bomb holds everything it got, the machine's other users still start servers
        assert carol.start("cpu").status_code in (201, 202)
        carol.wait_ready(timeout=120)
        assert answers(hub, bob) and answers(hub, carol)
    finally:
        k.execute(REAP, timeout=120)
    assert result["other"] is None, result
    assert result["refused"] > 0 and result["spawned"] < 150, (before, result)  # held at the profile's 150
    assert held <= 150, held
    assert (a_cg / "pids.max").read_text().strip() == "150"
    assert (pids_dir(server_pid(hub, "bob")) / "pids.max").read_text().strip() == "300"  # defaults.maxProcesses
    assert before < 64, f"a server with a kernel ran {before} tasks: the documented minimum (64) is too low"
    # the hub's log says it (at its next poll of alice's server), and alice's server still works
    wait_for(
        lambda: "Server alice reached its limit of 150 processes" in hub.log.read_text(),
        60,
        "the hub to log that alice's server reached its process limit",
    )
    k2 = session(hub, alice)
    try:
        assert k2.execute("print('still here')").strip() == "still here"
    finally:
        k2.close()
        k.close()
    # once the server stops, the spawn page says why it may have misbehaved
    alice.stop()
    alice.wait_gone()
    form = alice.session.get(hub.url + "/hub/spawn/alice").text
    assert "gpuhub-stop-reason" in form and "Your server reached its limit of 150 processes" in form, form[:3000]
    carol.stop()
    carol.wait_gone()


def test_a_fork_bomb_in_a_batch_job_is_held_at_its_profiles_limit(hub, users, tmp_path):
    dave = users["dave"]
    spec = tmp_path / "bomb.yaml"
    code = BOMB + "import signal\nfor k in kids:\n    os.kill(k, signal.SIGKILL)\n"
    spec.write_text(f"profile: small-procs\ncommand: [{sys.executable}, -c, {json.dumps(code)}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    env["GPUHUB_TOKEN"] = dave.token
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, "submit", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]

    def done():
        rec = dave.api.get(dave.url(f"/gpuhub/jobs/{job_id}")).json()
        return rec if rec["state"] in ("succeeded", "failed", "cancelled") else None

    rec = wait_for(done, 240, f"job {job_id} to end")
    text = dave.api.get(dave.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]
    line = next(ln for ln in text.splitlines() if ln.startswith("{"))
    result = json.loads(line)
    assert rec["state"] == "succeeded", (rec, text[-2000:])
    assert result["refused"] > 0 and result["spawned"] < 150, result  # the profile's limit, not the default 300
    wait_for(
        lambda: f"Job {job_id} of dave reached its limit of 150 processes" in hub.log.read_text(),
        30,
        "the hub to log that the job reached its process limit",
    )


def test_one_users_many_jobs_together_are_held_at_the_users_limit(hub, users, tmp_path):
    """carol's four jobs each fork as many sleepers as they can and hold them: each job alone
    could hold 300 (defaults.maxProcesses), together they hold no more than her 500
    (defaults.maxProcessesPerUser), and the hub says it was her limit, not a job's."""
    carol = users["carol"]
    release = f"release-{uuid.uuid4().hex[:6]}"  # in her home, where the jobs run
    code = BOMB + textwrap.dedent(f"""\
        import time
        deadline = time.time() + 240
        while not os.path.exists(os.path.expanduser("~/{release}")) and time.time() < deadline:
            time.sleep(0.2)
        import signal
        for k in kids:
            os.kill(k, signal.SIGKILL)
    """)
    spec = tmp_path / "hold.yaml"
    spec.write_text(f"profile: cpu\ncommand: [{sys.executable}, -c, {json.dumps(code)}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    env["GPUHUB_TOKEN"] = carol.token
    jobs = []
    for _ in range(4):
        r = subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, "submit", str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        jobs.append(r.stdout.strip().splitlines()[-1])

    def result(job_id):
        text = carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]
        line = next((ln for ln in text.splitlines() if ln.startswith("{")), None)
        return json.loads(line) if line else None

    try:
        results = wait_for(
            lambda: all(rs := [result(j) for j in jobs]) and rs,
            240,
            "each of carol's four jobs to print how many processes it got",
        )
        spawned = [r["spawned"] for r in results]
        assert all(r["other"] is None for r in results), results
        assert sum(spawned) < 500, spawned  # her limit holds for all her jobs together
        assert sum(spawned) > 300, spawned  # more than one job's limit: the jobs did run at once
        assert min(spawned) < 250, spawned  # a job refused below its own limit of 300: hers bound it
    finally:
        (hub.data / "home" / "carol" / release).write_text("")  # as root, on the host's side
        for job_id in jobs:
            wait_for(
                lambda: (
                    carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}")).json()["state"] in ("succeeded", "failed", "cancelled")
                ),
                120,
                f"job {job_id} to end",
            )
    # Said when a job ends (as for a job's own limit): hers, not the job's, refused the forks.
    wait_for(
        lambda: (
            "with carol's other servers, jobs and Ray clusters, reached the user's limit of 500 processes" in hub.log.read_text()
        ),
        60,
        "the hub to say carol's servers and jobs together reached her limit",
    )


def test_all_servers_and_jobs_together_stay_below_the_machines_pid_max(hub, users):
    """The servers' group holds a cap below the kernel's pid_max: root keeps a reserve."""
    alice = users["alice"]
    if alice.server() is None:
        assert alice.start("cpu").status_code in (201, 202)
    alice.wait_ready()
    d = pids_dir(server_pid(hub, "alice"))
    top = d.parent.parent  # gpuhub/<account>.user/<leaf>
    assert d.parent.name.endswith(".user") and top.name == "gpuhub", d
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    cap = int((top / "pids.max").read_text())
    assert cap <= pid_max - 1024, (cap, pid_max)
    assert (d.parent / "pids.max").read_text().strip() == "500"


# -- (b) one hub per account prefix ------------------------------------------------------------


class SamePrefixHub(Hub):
    """A hub that uses another hub's account prefix (the harness would give it its own)."""

    def __init__(self, *args, prefix: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared_prefix = prefix

    @property
    def env(self) -> dict:
        env = super().env
        env["GPUHUB_ACCOUNT_PREFIX"] = self.shared_prefix
        return env

    def cleanup(self) -> None:
        """Its own processes only: never ``remove_isolation`` (the prefix is the first hub's)."""
        self.stop(kill_servers=False)
        pidfile = self.data / "proxy.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        for pid in processes_with_env(f"GPUHUB_TEST_RUN={self.run_id}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_second_hub_with_the_same_prefix_refuses_to_start_and_touches_nothing(hub, users, tmp_path):
    bob = users["bob"]
    if bob.server() is None:
        assert bob.start("cpu").status_code in (201, 202)
    bob.wait_ready()
    pid = server_pid(hub, "bob")
    second = SamePrefixHub(tmp_path / "second", POLICY, prefix=hub.prefix)
    refusal = None
    try:
        try:
            second.start(timeout=90)
        except RuntimeError as e:  # it exited
            refusal = str(e)
        if refusal is None:
            # It came up: do what its users would, and start bob's server there.
            b2 = second.login("bob")
            b2.start("cpu")
            try:
                b2.wait_ready(timeout=90)
            except TimeoutError:
                pass
        # the first hub's server is untouched: same process, still answering
        assert server_pid(hub, "bob") == pid
        assert answers(hub, bob)
        assert refusal is not None, "a second hub with the same account prefix started"
        assert second.proc.returncode == 1
        assert (
            f"the account prefix {hub.prefix!r} is held by another hub on this machine (pid {hub.proc.pid}, "
            f"data dir {hub.data}, config {hub.config}" in refusal
        ), refusal
    finally:
        second.cleanup()
    assert server_pid(hub, "bob") == pid and answers(hub, bob)


# -- leftovers are killed only when provably the hub's ---------------------------------------------


def test_a_process_in_a_servers_cgroup_that_is_not_the_accounts_is_not_killed(hub, users):
    lena = users["lena"]
    leaf = f"{hub.prefix}lena"
    user_group = f"{leaf}.user"  # every server and job of lena's is in hers
    if V2:
        dirs = [Path("/sys/fs/cgroup/gpuhub") / user_group / leaf]
    else:
        dirs = [
            Path("/sys/fs/cgroup") / c / "gpuhub" / user_group / leaf
            for c in ("memory", "cpu", "devices", "pids")
            if (Path("/sys/fs/cgroup") / c / "gpuhub").is_dir()
        ]
    stranger = subprocess.Popen(["sleep", "300"])  # root's, not lena's account: not the hub's to kill
    try:
        for d in dirs:
            d.parent.mkdir(exist_ok=True)
            d.mkdir(exist_ok=True)
            (d / "cgroup.procs").write_text(str(stranger.pid))
        r = lena.start("cpu")
        if r.status_code == 202:  # the refusal came after the hub's slow-spawn wait
            lena.wait_gone(timeout=120)
        else:
            assert r.status_code == 500 and "cannot start" in r.json()["message"], (r.status_code, r.text)
        assert stranger.poll() is None  # still running
        assert f"cgroup of lena holds processes that do not run as {leaf}" in hub.log.read_text()
        assert lena.server() is None
    finally:
        stranger.kill()
        stranger.wait()
        for d in dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
    # with the stranger gone, lena starts
    assert lena.start("cpu").status_code in (201, 202)
    lena.wait_ready()
    lena.stop()
    lena.wait_gone()


# -- (c) the exit watcher acts on exits only -------------------------------------------------------


def test_a_wake_up_of_the_exit_watcher_kills_nothing_of_a_live_server(tmp_path):
    """What both exit watchers (a server's pidfd, a job's) call on waking, while the process
    still runs in its real cgroup: nothing is killed; after a real exit, the group is swept."""
    from types import SimpleNamespace

    from gpuhub_spawner.local.isolation import IsolatedProcessSpawner, cgroup_host, process_start_time

    host = cgroup_host("/sys/fs/cgroup", "gpuhub")
    if not host.version:
        pytest.skip(host.describe())
    leaf = f"w{uuid.uuid4().hex[:6]}-watch"
    cg = host.server(leaf)
    cg.create(memory=2**28, cpu_millis=500, device_rules=None)
    procs = " ".join(cg.procs_files())
    # a "server" and a child of it, both in the cgroup (as the sandbox puts them)
    proc = subprocess.Popen(["sh", "-c", f"for f in {procs}; do echo $$ > $f; done; sleep 300 & exec sleep 300"])
    try:
        wait_for(lambda: len(cg.pids()) == 2, 20, "the stand-in server and its child in the cgroup")
        sp = IsolatedProcessSpawner(user=SimpleNamespace(name="watch", url="/user/watch/", escaped_name="watch"))
        sp.proc, sp.pid, sp._cgroup, sp._start_time = proc, proc.pid, cg, process_start_time(proc.pid)
        sp.on_process_exit()  # a spurious wake-up
        assert proc.poll() is None and len(cg.pids()) == 2  # nothing killed
        sp.proc = None  # after a hub restart (adopted: no Popen), judged by pid + start time
        sp.on_process_exit()
        assert proc.poll() is None and len(cg.pids()) == 2
        sp.proc = proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        sp.on_process_exit()  # the real exit: the rest of the group goes with it
        wait_for(lambda: not cg.pids(), 20, "the cgroup swept after the real exit")
    finally:
        proc.kill()
        cg.kill_all()
        cg.remove()


# -- the lock dies with its hub --------------------------------------------------------------------


def _ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2 :].split()[1])


def test_a_hub_killed_hard_leaves_its_prefix_to_its_successor(hub, users):
    bob = users["bob"]
    if bob.server() is None:
        assert bob.start("cpu").status_code in (201, 202)
    bob.wait_ready()
    pid = server_pid(hub, "bob")
    servers = set(processes_with_env(f"GPUHUB_TEST_RUN={hub.run_id}"))
    helpers = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and int(p.name) not in servers and _ppid(int(p.name)) == hub.proc.pid
    ]  # its proxy and services, which a crashed unit loses too
    hub.proc.kill()  # no clean-up at all
    hub.proc.wait()
    for p in helpers:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    hub.start()  # same data dir, same prefix: the kernel dropped the dead hub's lock
    bob.wait_ready()
    assert server_pid(hub, "bob") == pid and answers(hub, bob)  # adopted, not killed as a leftover
