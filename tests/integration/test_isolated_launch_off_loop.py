"""An isolated launch and the hub's event loop (issue 29): the launch's kernel work runs beside
the loop, not on it, and the servers' start-ups do not take the loop's CPU.

Real parts, no hub: ``IsolatedProcessSpawner`` (as the job launcher's ``JobProcess`` uses
it, with ``sleep`` as the command) as root, with a real Unix account, cgroup, private /tmp
and sandbox launcher. A step of the launch (the launcher's fork and exec) is made to wait
until the event loop has run something else: with the step on the loop that never happens
(the step gives up after ``GIVE_UP`` seconds and says so); beside it, the loop runs at once.
Also: a start cancelled while that step runs (a user's stop during a start, a launch
timeout) leaves no process behind, and the next start and stop work as before.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from support.hub import remove_private_tmps, user_network, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="isolated launches need root (accounts, cgroups, mounts)"),
]

GIVE_UP = 10.0  # seconds a patched step waits for the loop before it records that the loop never ran


@pytest.fixture
def prefix():
    from gpuhub_spawner.local.isolation import remove_isolation
    from gpuhub_spawner.local.service import held_prefix

    p = f"l{uuid.uuid4().hex[:6]}-"
    yield p
    lock = held_prefix(p)
    if lock is not None:
        lock.release()
    remove_isolation(p)
    remove_private_tmps(p)


async def until(predicate, timeout: float = 30.0) -> None:
    """A job's start returns once its launcher has its spec; it then enters the sandbox and execs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def until_set(event: threading.Event, task: asyncio.Future, what: str, timeout: float = 60.0) -> None:
    """Wait for ``event``, set by a patched step of the start in ``task``: a start that ended
    first (with its own error, which is raised here) or a step never reached fails the test
    saying what it waited for, where an unbounded wait held a CI run to its limit."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not event.is_set():
        if task.done():
            task.result()
            raise AssertionError(f"the start ended without {what}")
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; the start is still under way")
        await asyncio.sleep(0.01)


def job(prefix: str, tmp_path, name: str = "ada"):
    from gpuhub_spawner.local.job_launcher import JobProcess
    from gpuhub_spawner.local.isolation import cgroup_host

    if not cgroup_host("/sys/fs/cgroup", "gpuhub").version:
        pytest.skip("no usable cgroups here")
    sp = JobProcess(
        user_name=name,
        job_id=f"j{uuid.uuid4().hex[:6]}",
        argv=[],
        env={},
        devices=[],
        device_nodes=[],
        limits=(500, 2**28),
        account_prefix=prefix,
        home_dir_template=str(tmp_path / "home" / "{account}"),
        # this worker's own network behind the wall: the product's default (10.213.0.0/16) may be
        # a hub's on this machine (another worker's), and a start that finds it taken is refused
        user_network=user_network(),
    )
    sp.cmd = ["/bin/sleep", "300"]
    return sp


class GatedRemoval:
    """``ServerCgroup.remove`` made to wait until the event loop has run something else (it
    gives up after ``GIVE_UP`` s); ``seen`` says, for each removal, whether the loop ran."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.in_step, self.loop_ran = threading.Event(), threading.Event()
        self.seen: list[bool] = []

    def install(self) -> None:
        from gpuhub_spawner.local.cgroups import ServerCgroup

        real, gate = ServerCgroup.remove, self

        def remove(cg):
            gate.in_step.set()
            gate.seen.append(gate.loop_ran.wait(GIVE_UP))
            return real(cg)

        self.monkeypatch.setattr(ServerCgroup, "remove", remove)

    async def other_work(self) -> None:
        """What the loop does beside the removal: it notes that it ran."""
        while not self.in_step.is_set():
            await asyncio.sleep(0.005)
        self.loop_ran.set()


def test_the_loop_runs_while_a_launcher_is_forked(prefix, tmp_path, monkeypatch):
    from gpuhub_spawner.local import sandbox
    from gpuhub_spawner.local.isolation import process_uid

    real = sandbox.start_launcher
    in_step, loop_ran = threading.Event(), threading.Event()
    seen: list[bool] = []

    def start_launcher(*args, **kw):
        in_step.set()
        seen.append(loop_ran.wait(GIVE_UP))  # the loop sets it, if it runs meanwhile
        return real(*args, **kw)

    monkeypatch.setattr(sandbox, "start_launcher", start_launcher)
    sp = job(prefix, tmp_path)

    async def main():
        async def other_work():  # anything else the hub does: a request, a page's update
            while not in_step.is_set():
                await asyncio.sleep(0.005)
            loop_ran.set()

        beside = asyncio.ensure_future(other_work())
        await sp.start()
        await beside
        try:
            # the server as before: running as its account, in its cgroup, its OOM watch on (v1)
            await until(lambda: sp.proc.poll() is not None or process_uid(sp.pid) == sp._account.uid)
            assert sp.proc.poll() is None
            assert process_uid(sp.pid) == sp._account.uid
            assert sp._cgroup.contains(sp.pid)
            if sp._cgroup.host.version == 1:
                assert sp._oom_fd is not None
            assert sp._cgroup.memory_limit() == 2**28
        finally:
            await sp.stop(now=True)
        assert sp.proc is None or sp.proc.poll() is not None

    asyncio.run(main())
    assert seen == [True], f"the event loop did not run for {GIVE_UP:.0f} s while the launcher was started"


def test_a_start_cancelled_during_the_launch_leaves_nothing_running(prefix, tmp_path, monkeypatch):
    from gpuhub_spawner.local import sandbox
    from gpuhub_spawner.local.isolation import process_uid

    real = sandbox.start_launcher
    launched, go_on = threading.Event(), threading.Event()
    procs = []

    def start_launcher(*args, **kw):
        out = real(*args, **kw)
        procs.append(out[0])
        launched.set()
        go_on.wait(GIVE_UP)  # the start is cancelled meanwhile
        return out

    monkeypatch.setattr(sandbox, "start_launcher", start_launcher)
    sp = job(prefix, tmp_path)

    async def main():
        task = asyncio.ensure_future(sp.start())
        await until_set(launched, task, "the launcher to have been started")
        task.cancel()  # what JupyterHub does to a pending start that a user stops
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()
        await sp.stop()  # and then it stops the spawner, which knows of no process yet
        for _ in range(2000):  # the thread's end, then the launcher's kill and reaping
            if procs and procs[0].returncode is not None:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert procs and procs[0].returncode is not None, "the launcher of a cancelled start is still running"
    assert sp.pid == 0 and sp._cgroup is None

    # the next start is a normal one, and so is its stop
    monkeypatch.setattr(sandbox, "start_launcher", real)

    async def again():
        await sp.start()
        pid, cg = sp.pid, sp._cgroup
        await until(lambda: sp.proc.poll() is not None or process_uid(pid) == sp._account.uid)
        assert sp.proc.poll() is None and cg.contains(pid)
        await sp.stop(now=True)
        return cg

    cg = asyncio.run(again())
    wait_for(lambda: not any(p.exists() for p in cg.paths.values()), 20, "the cgroup removed at stop")


def test_the_loop_runs_while_a_stopped_servers_group_is_swept(prefix, tmp_path, monkeypatch):
    """A stop empties and removes the server's cgroup: kill rounds 20 ms apart, then up to 1 s of
    retries while the last processes exit. A culler pass stopping 50 servers did that on the loop,
    one server after the other; the removal step here waits for the loop to run something else."""
    from gpuhub_spawner.local.isolation import process_uid

    gate = GatedRemoval(monkeypatch)
    sp = job(prefix, tmp_path)

    async def main():
        await sp.start()
        pid, cg = sp.pid, sp._cgroup
        await until(lambda: sp.proc.poll() is not None or process_uid(pid) == sp._account.uid)
        assert sp.proc.poll() is None and cg.contains(pid)
        gate.install()
        beside = asyncio.ensure_future(gate.other_work())
        await sp.stop(now=True)
        await beside
        return pid, cg

    pid, cg = asyncio.run(main())
    # (the stop's polls sweep the group once the process is gone; the stop sweeps again, finding nothing)
    assert gate.seen and all(gate.seen), (
        f"the event loop did not run for {GIVE_UP:.0f} s while the stopped server's cgroup was removed: {gate.seen}"
    )
    assert not any(p.exists() for p in cg.paths.values()), "the cgroup is still there after the stop"
    assert sp.proc is None or sp.proc.poll() is not None, f"pid {pid} still runs after the stop"
    assert sp._cgroup is None


def test_the_loop_runs_while_a_group_is_swept_after_its_process_exited_on_its_own(prefix, tmp_path, monkeypatch):
    """A server or job whose process exits on its own (a crash, an OOM kill, the user's own
    ``kill``) has its cgroup swept before its GPUs go on (``end_after_exit``: the exit watcher of
    a server, the end of a job). That sweep ran on the loop; the removal step here waits for the
    loop to run something else. A process the user left in the group is killed all the same."""
    import subprocess

    from gpuhub_spawner.local.isolation import process_uid

    gate = GatedRemoval(monkeypatch)
    sp = job(prefix, tmp_path)
    # the job's command leaves a process behind in its group, then exits
    sp.cmd = ["/bin/sh", "-c", "sleep 300 & echo $! > leftover; while [ ! -e go ]; do sleep 0.05; done"]

    async def main():
        await sp.start()
        pid, cg = sp.pid, sp._cgroup
        await until(lambda: sp.proc.poll() is not None or process_uid(pid) == sp._account.uid)
        assert sp.proc.poll() is None and cg.contains(pid)
        home = tmp_path / "home" / sp.account_name
        await until(lambda: (home / "leftover").exists(), 30)
        leftover = int((home / "leftover").read_text())
        assert cg.contains(leftover)
        gate.install()
        (home / "go").touch()
        await until(lambda: sp.proc.poll() is not None, 30)
        assert sp.proc.poll() is not None, "the job's command did not exit"
        beside = asyncio.ensure_future(gate.other_work())
        ended = await sp.end_after_exit()
        await beside
        return ended, leftover, cg

    ended, leftover, cg = asyncio.run(main())
    assert ended is True
    assert gate.seen and all(gate.seen), (
        f"the event loop did not run for {GIVE_UP:.0f} s while the exited process's cgroup was removed: {gate.seen}"
    )
    assert not any(p.exists() for p in cg.paths.values()), "the cgroup is still there after the sweep"
    gone = subprocess.run(["ps", "-o", "stat=", "-p", str(leftover)], capture_output=True, text=True).stdout.strip()
    assert gone in ("", "Z"), f"the process left in the group (pid {leftover}) still runs: {gone!r}"
    assert sp._cgroup is None


def test_account_checks_never_fill_the_hubs_thread_pool(prefix, tmp_path, monkeypatch):
    """Account changes are one at a time (unix_users' lock). While a crowd's account checks
    wait for it, the hub still resolves the addresses it connects to (tornado does that in
    the event loop's default thread pool: the proxy's API, each server's URL)."""
    from gpuhub_spawner.local import isolation

    real = isolation.ensure_account
    release = threading.Event()

    def ensure_account(*args, **kw):
        release.wait(GIVE_UP)  # a slow useradd, and everyone else waiting for the lock
        return real(*args, **kw)

    monkeypatch.setattr(isolation, "ensure_account", ensure_account)
    jobs = [job(prefix, tmp_path, name=f"crowd{i}") for i in range(8)]  # the broker's launch concurrency

    async def main():
        loop = asyncio.get_running_loop()
        starts = [asyncio.ensure_future(sp.start()) for sp in jobs]
        await asyncio.sleep(0.2)  # every start is now waiting for its account
        try:
            resolved = await asyncio.wait_for(loop.getaddrinfo("localhost", 80), GIVE_UP / 2)
        except asyncio.TimeoutError:
            resolved = None
        release.set()
        await asyncio.gather(*starts)
        for sp in jobs:
            await sp.stop(now=True)
        return resolved

    assert asyncio.run(main()), "an address could not be resolved while account checks waited"


def test_a_launcher_starts_inside_its_servers_cgroup(prefix, tmp_path, monkeypatch):
    """The launcher's own start-up (a Python interpreter, as root, before it has its spec)
    runs in the server's cgroup under the server's limits, not beside the hub's event loop
    at the hub's weight: in a 200-user storm those start-ups took the CPU from the loop
    (issue 29). It is in the cgroup before the hub hands it its spec, so before it could
    have joined by itself."""
    from gpuhub_spawner.local import sandbox

    real = sandbox.hand_over
    seen: list[bool] = []

    async def hand_over(proc, wfd, payload, *args, **kw):
        seen.append(sp._cgroup.contains(proc.pid))  # the spec is not written yet
        return await real(proc, wfd, payload, *args, **kw)

    monkeypatch.setattr(sandbox, "hand_over", hand_over)
    sp = job(prefix, tmp_path)

    async def main():
        await sp.start()
        await sp.stop(now=True)

    asyncio.run(main())
    assert seen == [True], "the launcher ran outside its server's cgroup until it had its spec"


def test_the_servers_group_weighs_the_kernels_default_unless_configured(prefix, tmp_path):
    """All servers' and jobs' cgroups sit in one group. By default it weighs what one ordinary
    process does: at an eighth (the default until stop 38) eight CPU-bound processes at nice 19
    made a spawn 6.8x slower, and a Go build beside the test suite made servers miss their 60 s
    start-up (tests/benchmarks/spawn_under_background.py). An operator may lower it for a
    machine that runs nothing else (the hub's loop then comes first in a start-up storm); the
    kernel takes the value, and one out of range is refused."""
    # The machine's group is every hub's and every test worker's (each launch writes its weight):
    # this test weighs a group of its own, so another worker's launch cannot change what it reads.
    group = f"{prefix}weighed"
    sp = job(prefix, tmp_path)
    assert sp.servers_cpu_weight == 1.0  # the default: nothing configured
    sp.cgroup_group = group
    host = sp.cgroup_host
    assert host.group == group

    def written() -> str:
        if host.version == 2:
            return (host.root / host.group / "cpu.weight").read_text().strip()
        return (host.v1_mounts["cpu"] / host.group / "cpu.shares").read_text().strip()

    async def main(spawner):
        await spawner.start()
        await spawner.stop(now=True)

    asyncio.run(main(sp))
    assert written() == ("100" if host.version == 2 else "1024")

    lowered = job(prefix, tmp_path, name="grace")
    lowered.cgroup_group = group
    lowered.servers_cpu_weight = 0.125
    try:
        asyncio.run(main(lowered))
        assert written() == ("12" if host.version == 2 else "128")
    finally:  # both servers stopped: their leaves are gone, the test's group goes too
        for base in [host.root] if host.version == 2 else list(host.v1_mounts.values()):
            if (base / group).is_dir():
                (base / group).rmdir()

    from traitlets import TraitError

    with pytest.raises(TraitError, match="between 0.002 and 100"):
        sp.servers_cpu_weight = 0
