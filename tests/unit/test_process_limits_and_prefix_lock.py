"""Process limits (policy -> cgroup ``pids.max`` -> the user's message), the account-prefix
lock, and the exit watcher's proof of an exit: the pieces that need no hub.

The real kernel's side (forks refused at the limit, a second hub refused, a live server
left alone) is attacked in tests/integration/test_attack_limits.py.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from gpuhub_spawner.local.cgroups import CgroupHost
from gpuhub_spawner.local.service import PrefixHeld, hold_account_prefix, hold_prefix_at_hub_start
from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.policy.model import DEFAULT_MAX_PROCESSES
from support.fake_cgroups import fake_v2

POLICY = """\
teams:
  - {name: vision, groups: [vision-lab]}
profiles:
  - {slug: cpu, displayName: CPU, teams: "*"}
  - {slug: loaders, displayName: Many loaders, teams: "*", maxProcesses: 8192}
"""


def errors(text):
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


# -- the policy field ------------------------------------------------------------------------


def test_process_limit_comes_from_the_profile_else_the_defaults():
    p = parse_policy(POLICY)
    assert p.process_limit(p.profile("loaders")) == 8192
    assert p.process_limit(p.profile("cpu")) == DEFAULT_MAX_PROCESSES == 4096
    assert p.process_limit(None) == 4096  # a job whose profile left the policy
    p = parse_policy(POLICY + "defaults: {maxProcesses: 512}\n")
    assert p.process_limit(p.profile("cpu")) == 512 and p.process_limit(p.profile("loaders")) == 8192


def test_process_limit_mistakes_are_located():
    assert errors(POLICY.replace("maxProcesses: 8192", "maxProcesses: 10")) == [
        "p.yaml:5:74: profiles[1].maxProcesses: must be at least 64 (got 10)"
    ]
    assert errors(POLICY.replace("maxProcesses: 8192", "maxProcesses: many")) == [
        "p.yaml:5:74: profiles[1].maxProcesses: must be a whole number (got 'many')"
    ]
    assert errors(POLICY + "defaults: {maxProcesses: 100.5}\n") == [
        "p.yaml:6:26: defaults.maxProcesses: must be a whole number (got 100.5)"
    ]
    assert errors(POLICY.replace("maxProcesses:", "maxProcess:"))[0].endswith(
        "profiles[1].maxProcess: unknown key 'maxProcess' (did you mean 'maxProcesses'?)"
    )


# -- the cgroup files ------------------------------------------------------------------------


def test_v2_pids_max_is_written_and_its_events_read(tmp_path, monkeypatch):
    from gpuhub_spawner.local import cgroups

    monkeypatch.setattr(type(tmp_path), "mkdir", fake_v2(tmp_path))
    writes = []
    real_write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: (writes.append((str(path), value)), real_write(path, value)))
    host = CgroupHost.detect(str(tmp_path), "gpuhub")
    # the pids controller is handed down to the servers' groups, or pids.max would not exist there
    assert (str(tmp_path / "gpuhub" / "cgroup.subtree_control"), "+pids") in writes
    (tmp_path / "gpuhub" / "cgroup.subtree_control").write_text("cpu memory pids\n")  # as the kernel shows it
    assert host.has_pids and "NOT enforced" not in host.describe()
    cg = host.server("gpuhub-alice")
    cg.create(memory=2**30, cpu_millis=1000, device_rules=None, pids=300)
    d = tmp_path / "gpuhub" / "gpuhub-alice"
    assert (d / "pids.max").read_text() == "300" and cg.pids_limit() == 300
    assert cg.pids_max_events() == 0
    (d / "pids.events").write_text("max 17\n")
    assert cg.pids_max_events() == 17
    cg.create(memory=None, cpu_millis=None, device_rules=None, pids=None)  # a reused group: no stale limit
    assert (d / "pids.max").read_text() == "max" and cg.pids_limit() is None


def test_v2_a_users_group_holds_the_users_limit_and_goes_with_the_users_last_server(tmp_path, monkeypatch):
    monkeypatch.setattr(type(tmp_path), "mkdir", fake_v2(tmp_path))
    host = CgroupHost.detect(str(tmp_path), "gpuhub")
    a = host.server("gpuhub-alice", user="gpuhub-alice.user")
    b = host.server("gpuhub-alice.job-1", user="gpuhub-alice.user")
    a.create(memory=None, cpu_millis=None, device_rules=None, pids=300, user_pids=500)
    b.create(memory=None, cpu_millis=None, device_rules=None, pids=300, user_pids=500)
    up = tmp_path / "gpuhub" / "gpuhub-alice.user"
    assert (up / "pids.max").read_text() == "500" and a.user_pids_limit() == 500 and a.pids_limit() == 300
    # the user's group hands its controllers down, or its children would have no limits
    assert (up / "cgroup.subtree_control").read_text().endswith("+pids")
    (up / "pids.events").write_text("max 4\n")
    assert b.user_pids_max_events() == 4
    flat = host.server("gpuhub-bob")
    flat.create(memory=None, cpu_millis=None, device_rules=None, pids=300, user_pids=500)
    assert flat.user_pids_limit() is None and not (tmp_path / "gpuhub" / "pids.max").read_text()


def test_the_servers_group_is_capped_below_pid_max_with_a_reserve(tmp_path, monkeypatch):
    monkeypatch.setattr(type(tmp_path), "mkdir", fake_v2(tmp_path))
    host = CgroupHost.detect(str(tmp_path), "gpuhub")
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    cap = host.cap_processes()
    assert cap == pid_max - max(1024, pid_max // 8)
    assert (tmp_path / "gpuhub" / "pids.max").read_text() == str(cap)


def test_v1_pids_hierarchy_gets_the_limit(tmp_path):
    for c in ("memory", "cpu", "pids"):
        (tmp_path / c / "gpuhub").mkdir(parents=True)
        (tmp_path / c / "cgroup.procs").touch()
    host = CgroupHost(tmp_path, 1, "gpuhub", {c: tmp_path / c for c in ("memory", "cpu", "pids")})
    assert host.has_pids
    cg = host.server("gpuhub-bob")
    (tmp_path / "pids" / "gpuhub" / "gpuhub-bob").mkdir()
    (tmp_path / "pids" / "gpuhub" / "gpuhub-bob" / "pids.max").write_text("max\n")
    cg.create(memory=None, cpu_millis=None, device_rules=None, pids=150)
    assert cg.pids_limit() == 150
    no_pids = CgroupHost(tmp_path, 1, "gpuhub", {c: tmp_path / c for c in ("memory", "cpu")})
    assert not no_pids.has_pids and "process limits are NOT enforced" in no_pids.describe()


# -- the user's message ----------------------------------------------------------------------


class FakeGroup:
    def __init__(self, limit=150, user_limit=None, peak=None):
        self.events, self.limit, self.killed, self.removed = 0, limit, 0, 0
        self.user_limit, self.peak, self.user_events = user_limit, peak, 0

    def pids_max_events(self):
        return self.events

    def user_pids_max_events(self):
        return self.user_events

    def user_pids_limit(self):
        return self.user_limit

    def pids_peak(self):
        return self.peak

    def remove_user_group_if_empty(self):
        pass

    def pids_limit(self):
        return self.limit

    def oom_kills(self):
        return 0

    def kill_all(self):
        self.killed += 1
        return 0

    def remove(self):
        self.removed += 1


def spawner(**kw):
    from gpuhub_spawner.local.isolation import IsolatedProcessSpawner

    sp = IsolatedProcessSpawner(user=SimpleNamespace(name="alice", url="/user/alice/", escaped_name="alice"), **kw)
    sp.isolation = "off"
    return sp


def test_forks_refused_below_the_servers_own_limit_are_told_as_the_users_limit(caplog):
    """cgroup v1 counts a refusal in the forking group even where its user's group refused it:
    a group that never reached its own limit was held by the user's."""
    sp = spawner()
    cg = FakeGroup(limit=300, user_limit=500, peak=120)
    cg.events = 3
    with caplog.at_level("WARNING"):
        assert sp._check_process_limit(cg)
    assert sp.process_limit_note.startswith("Your servers, jobs and Ray clusters together reached your limit of 500 ")
    assert "with alice's other servers, jobs and Ray clusters, reached the user's limit of 500 processes" in caplog.text
    own = spawner()
    full = FakeGroup(limit=300, user_limit=500, peak=300)
    full.events = 1
    own._check_process_limit(full)
    assert own.process_limit_note.startswith("Your server reached its limit of 300 processes")


def test_reaching_the_limit_is_logged_once_and_becomes_the_stop_reason(caplog):
    sp = spawner()
    cg = FakeGroup()
    sp._cgroup, sp._pids_base = cg, 0
    assert not sp._check_process_limit(cg) and sp._pids_note is None
    cg.events = 5
    with caplog.at_level("WARNING"):
        assert sp._check_process_limit(cg)
        cg.events = 900
        assert sp._check_process_limit(cg)
    said = [r.getMessage() for r in caplog.records if "reached its limit" in r.getMessage()]
    assert said == [
        "Server alice reached its limit of 150 processes (pids.max; threads count too): 5 new processes or threads refused so far"
    ]
    assert sp.stop_reason is None  # while it runs nothing is stopped
    proc = subprocess.Popen(["true"])
    proc.wait()
    sp.proc, sp.pid = proc, proc.pid
    assert sp.on_process_exit() is True and cg.killed == 1
    sp._note_stop_reason()
    assert sp.stop_reason.startswith("Your server reached its limit of 150 processes at ")
    # an OOM stop says that, not this
    sp.stop_reason = "Your server was stopped because it used more than its memory limit"
    sp._note_stop_reason()
    assert "memory" in sp.stop_reason


def test_a_reused_groups_old_count_is_not_this_servers():
    sp = spawner()
    cg = FakeGroup()
    cg.events = 40
    sp._pids_base = 40
    assert not sp._check_process_limit(cg)


# -- the exit watcher acts only on a real exit ------------------------------------------------


def test_a_wake_up_while_the_server_runs_kills_nothing():
    sp = spawner()
    cg = FakeGroup()
    proc = subprocess.Popen(["sleep", "30"])
    try:
        sp.proc, sp.pid, sp._cgroup = proc, proc.pid, cg
        assert sp.on_process_exit() is False
        assert cg.killed == 0 and cg.removed == 0 and proc.poll() is None
        proc.kill()
        proc.wait()
        assert sp.on_process_exit() is True and cg.killed == 1 and cg.removed == 1
    finally:
        proc.kill()


def test_an_adopted_server_is_judged_by_pid_start_time_and_state():
    from gpuhub_spawner.local.isolation import process_start_time

    sp = spawner()
    proc = subprocess.Popen(["sleep", "30"])
    try:
        sp.proc, sp.pid, sp._start_time = None, proc.pid, process_start_time(proc.pid)  # after a hub restart
        assert not sp.main_process_ended()
        sp._start_time += 1  # the pid now belongs to another process
        assert sp.main_process_ended()
        sp._start_time -= 1
        proc.kill()
        deadline = time.time() + 10
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert sp.main_process_ended()  # exited, not yet reaped by its parent
    finally:
        proc.kill()
        proc.wait()
    assert sp.main_process_ended()


# -- one hub per account prefix --------------------------------------------------------------

HOLDER = textwrap.dedent("""\
    import subprocess, sys, time
    from gpuhub_spawner.local.service import hold_account_prefix
    hold_account_prefix(sys.argv[1], data_dir="/srv/first-hub", config="/etc/first/jupyterhub_config.py", lock_dir=sys.argv[2])
    child = subprocess.Popen(["sleep", "60"])  # a server: it must not keep the lock after the hub is gone
    print(child.pid, flush=True)
    time.sleep(60)
""")


def holder(prefix, lock_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, prefix, str(lock_dir)], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    return p, child


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_dies_with_it(tmp_path):
    lock_dir = tmp_path / "run"
    p, child = holder("t1-", lock_dir)
    try:
        with pytest.raises(PrefixHeld) as e:
            hold_account_prefix("t1-", data_dir="/srv/second", lock_dir=str(lock_dir))
        msg = str(e.value)
        assert (
            f"the account prefix 't1-' is held by another hub on this machine (pid {p.pid}, "
            "data dir /srv/first-hub, config /etc/first/jupyterhub_config.py, since " in msg
        )
        assert "give this one a prefix of its own" in msg
        # overlapping prefixes name the same accounts (t1- + "x-alice" == t1-x- + "alice")
        with pytest.raises(PrefixHeld, match="overlaps the prefix 't1-'"):
            hold_account_prefix("t1-x-", lock_dir=str(lock_dir))
        with pytest.raises(PrefixHeld, match="overlaps the prefix 't1-'"):
            hold_account_prefix("t", lock_dir=str(lock_dir))
        other = hold_account_prefix("t2-", lock_dir=str(lock_dir))  # a prefix of its own is fine
        other.release()
        p.kill()  # however the hub ends, the kernel drops its lock; its server (child) lives on
        p.wait()
        os.kill(child, 0)
        mine = hold_account_prefix("t1-", data_dir="/srv/second", lock_dir=str(lock_dir))
        assert mine.held and hold_account_prefix("t1-", lock_dir=str(lock_dir)) is mine  # idempotent
        mine.release()
    finally:
        p.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


def test_outside_a_starting_hub_nothing_is_locked():
    assert hold_prefix_at_hub_start(None) is None


def test_a_lock_file_is_forgotten_only_when_nobody_holds_it(tmp_path):
    from gpuhub_spawner.local.service import forget_prefix

    lock_dir = tmp_path / "run"
    p, child = holder("t3-", lock_dir)
    try:
        assert not forget_prefix("t3-", str(lock_dir)) and (lock_dir / "prefix-t3-.lock").exists()
    finally:
        p.kill()
        p.wait()
        os.kill(child, signal.SIGKILL)
    assert forget_prefix("t3-", str(lock_dir)) and not (lock_dir / "prefix-t3-.lock").exists()
    lock = hold_account_prefix("t3-", lock_dir=str(lock_dir))  # made again
    assert lock.held and (lock_dir / "prefix-t3-.lock").exists()
    lock.release()


def test_removing_a_prefix_held_by_a_live_hub_is_refused(tmp_path, monkeypatch):
    from gpuhub_spawner.local import isolation, service

    lock_dir = tmp_path / "run"
    monkeypatch.setattr(service, "LOCK_DIR", str(lock_dir))
    p, child = holder("t4-", lock_dir)
    try:
        with pytest.raises(RuntimeError, match=f"'t4-' is held by a running hub \\(pid {p.pid}, data dir /srv/first-hub"):
            isolation.remove_isolation("t4-", cgroup_root=str(tmp_path / "no-cgroups"))
    finally:
        p.kill()
        p.wait()
        os.kill(child, signal.SIGKILL)
