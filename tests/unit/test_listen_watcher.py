"""The hub learns that a server listens from the kernel's socket table, and only believes
the server's own process tree (local/listening.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from gpuhub_spawner.local.listening import PortTaken, listening_sockets, watcher

# Ports from this worker's block (none twice, each bind-checked), not port-0 binds closed at once:
# the kernel hands a closed draw's port out again (20 such draws held a repeat 40 times in 3,000
# here, so two of the 20 servers below met on one port about one run in 75), and anything on the
# machine may take an ephemeral port in the half second before a server here binds it.
from support.ports import free_port


def server(port: int, delay: float) -> subprocess.Popen:
    """A process that listens on ``port`` after ``delay`` seconds, from a child of its own,
    and prints the moment it listened (the system's monotonic clock, the test's too)."""
    code = (
        f"import socket, time, os\ntime.sleep({delay})\n"
        "if os.fork() == 0:\n"
        f"    s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print(time.monotonic(), flush=True)\n"
        "    time.sleep(30)\n"
        "else:\n    os.wait()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


async def test_the_servers_own_listen_wakes_the_wait_within_ticks():
    port = free_port()
    proc = server(port, 0.5)
    try:
        assert await watcher().wait(port, proc.pid, timeout=20) == "listening"
        ended = time.monotonic()
        listened = float(proc.stdout.readline())
        assert port in listening_sockets()
        # The listen ends the wait, soon after it (the watcher reads every tick, 10 ms), however
        # long the loaded machine took to start the process that listens.
        assert 0 <= ended - listened < 2, f"the wait ended {ended - listened:.2f}s after the listen"
    finally:
        proc.kill()
        proc.wait()


async def test_a_port_taken_by_another_process_is_refused_not_routed_to():
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()  # this test process: not the server's tree
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(PortTaken, match=f"port {port} is held by a process outside the server"):
            await watcher().wait(port, proc.pid, timeout=20)
    finally:
        squatter.close()
        proc.kill()
        proc.wait()


async def test_a_server_that_exits_or_never_listens_falls_back():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert await watcher().wait(port, proc.pid, timeout=20) in ("exited",)
    proc.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert await watcher().wait(port, sleeper.pid, timeout=0.3) == "timeout"
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_many_waiters_share_one_read_per_tick():
    ports = [free_port() for _ in range(20)]
    procs = [server(p, 0.3) for p in ports]
    w = watcher()
    try:
        before = w.reads
        t0 = time.monotonic()
        results = await asyncio.gather(*(w.wait(p, pr.pid, timeout=30) for p, pr in zip(ports, procs)))
        elapsed = time.monotonic() - t0
        assert results == ["listening"] * 20
        assert w.reads - before <= elapsed / w.tick + 5  # one table read per tick, not per waiter
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_kernels_answer_over_netlink_is_the_socket_table():
    """The watcher asks netlink (cheap) and falls back to /proc/net/tcp (a walk of every
    connection): both must name the same listening sockets, IPv4 and IPv6, and nothing
    that only connects."""
    from gpuhub_spawner.local.listening import _netlink_listening, _proc_listening

    v4, v6 = socket.socket(), socket.socket(socket.AF_INET6)
    v4.bind(("127.0.0.1", 0))
    v6.bind(("::1", 0))
    v4.listen()
    v6.listen()
    client = socket.create_connection(v4.getsockname())
    try:
        # other processes on the machine may listen or close between two reads: one of a
        # few paired reads must agree exactly
        assert any(_netlink_listening() == _proc_listening("/proc/net") for _ in range(5))
        over_netlink = _netlink_listening()
        for s in (v4, v6):
            assert over_netlink[s.getsockname()[1]] == {os.fstat(s.fileno()).st_ino: os.getuid()}
        assert client.getsockname()[1] not in over_netlink
    finally:
        client.close()
        v4.close()
        v6.close()


async def test_an_isolated_server_is_known_by_its_accounts_socket():
    """As root every server runs as its own account: the kernel's owner uid of the socket on
    the port decides, without reading anything of the user's processes."""
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()  # this test process, outside the "server" below, as our own uid
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert await watcher().wait(port, proc.pid, timeout=20, uid=os.getuid()) == "listening"
        with pytest.raises(PortTaken):
            await watcher().wait(port, proc.pid, timeout=20, uid=os.getuid() + 1)
    finally:
        squatter.close()
        proc.kill()
        proc.wait()


FD_HOARDER = """
import os, resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 25000), hard))
s = socket.socket()
held = []
try:
    for _ in range(20000):
        held.append(os.dup(s.fileno()))
except OSError:
    pass
for _ in range(4):  # children holding as many again
    if os.fork() == 0:
        break
print(len(held), flush=True)
time.sleep(60)
"""


async def test_a_user_holding_many_descriptors_does_not_stall_the_hub():
    """Without isolation the hub looks for the socket among the server's open files; a user's
    tree of processes with 100,000 descriptors must neither block the hub's event loop nor
    keep the scan going (it is bounded and runs in a thread)."""
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()  # not the server's: every check scans the tree and finds nothing
    proc = subprocess.Popen([sys.executable, "-c", FD_HOARDER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert int(proc.stdout.readline()) > 1000
        gaps = []

        async def probe():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(probe())
        try:
            with pytest.raises(PortTaken):
                await watcher().wait(port, proc.pid, timeout=60)
        finally:
            ticker.cancel()
        assert max(gaps) < 0.3, f"the event loop stalled {max(gaps):.2f}s"
    finally:
        squatter.close()
        os.killpg(proc.pid, 9)  # the hoarder and its children
        proc.wait()


def test_two_servers_starting_at_once_never_get_the_same_port():
    """The kernel may hand the same free port twice while the first server is still starting
    (nothing bound it yet): the hub's book gives the second server another one, and the port
    goes back only when its own server is gone."""
    from gpuhub_spawner.local.listening import PortBook

    kernel = iter([52553, 52553, 52553, 40001, 52553])
    book = PortBook(pick=lambda: next(kernel))
    first = book.take("u01")
    second = book.take("u00")
    assert (first, second) == (52553, 40001)
    book.give_back(52553, "u00")  # not u00's: still u01's
    assert book.held == {52553: "u01", 40001: "u00"}
    stuck = PortBook(pick=lambda: 52553, tries=3)
    stuck.take("u01")
    with pytest.raises(RuntimeError, match="no free port after 3 tries"):
        stuck.take("u00")  # a clear error, not a server that cannot listen
    book.give_back(52553, "u01")  # u01's server stopped
    assert book.take("u02") == 52553


def test_a_booked_port_comes_from_the_kernel_and_is_free():
    from gpuhub_spawner.local.listening import PortBook

    book = PortBook()
    port = book.take("u00")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds it
    assert book.held == {port: "u00"}


def test_servers_can_be_given_ports_of_a_range_that_skips_what_something_else_holds():
    """``server_ports``: on a busy machine a port the kernel picked can be taken by any
    connection's local end before the server listens (a start failed so in a whole test run);
    from a range below the ephemeral one the hub hands out only ports nothing holds, never one
    port twice, and says so when the range is used up."""
    from traitlets import TraitError

    from gpuhub_spawner.local.isolation import IsolatedProcessSpawner, _port_span
    from gpuhub_spawner.local.listening import PortBook, port_is_free

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        span = range(taken, taken + 1)
        book = PortBook()
        with pytest.raises(RuntimeError, match=f"no free port in {taken}-{taken}"):
            book.take("u00", span)  # another process listens there
    free = next(
        (range(low, low + 3) for low in range(21000, 30000, 10) if all(port_is_free(p) for p in range(low, low + 3))), None
    )  # three ports nothing holds now
    assert free is not None
    book = PortBook()
    got = [book.take(f"u{i}", free) for i in range(3)]
    assert sorted(got) == list(free), got  # each port once
    with pytest.raises(RuntimeError, match="3 held by this hub's servers"):
        book.take("u3", free)
    book.give_back(got[0], "u0")
    assert book.take("u4", free) == got[0]

    assert _port_span("20000-20999") == range(20000, 21000)
    sp = IsolatedProcessSpawner()
    sp.server_ports = " 20000-20999 "
    assert sp.server_ports == "20000-20999"
    for bad in ("20000", "30000-20000", "80-90", "2000x-3000"):
        with pytest.raises(TraitError, match="server_ports must be FIRST-LAST"):
            sp.server_ports = bad


def test_the_holder_of_a_port_is_named_by_pid_and_command():
    """The hub's "port taken" error names who holds its port (hub/kept_proxy.py), so the
    operator need not look it up: the process holding the socket, found from its inode."""
    from gpuhub_spawner.local.listening import socket_holders

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # held by this test's process for the whole check
        s.listen()
        inodes = set(listening_sockets()[s.getsockname()[1]])
        holders = socket_holders(inodes)
    assert list(holders) == [os.getpid()], holders
    assert "pytest" in holders[os.getpid()] or sys.executable in holders[os.getpid()], holders
    assert socket_holders({1}) == {}  # an inode nobody holds: nobody named
