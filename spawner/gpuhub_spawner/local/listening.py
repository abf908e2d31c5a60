"""Learn that a server listens the moment it does, and that the listener is that server.

JupyterHub finds out that a single-user server is up by polling its URL with a growing,
randomised back-off (0.2 s, 0.4 s, 0.8 s ... up to 5 s between tries), which adds on
average half the current step to every spawn. The kernel already knows: a listening
socket exists the moment the server calls ``listen()``. One watcher per hub asks the
kernel for its listening TCP sockets every ``TICK`` seconds while anyone is waiting (one
question for all waiting servers, however many), and wakes each waiter whose port is
listening.

The question goes over netlink (``sock_diag``, the interface ``ss`` uses) and asks for
listening sockets only, which the kernel answers from its listening hash alone: about
0.1 ms here. ``/proc/net/tcp`` is the fallback where netlink is refused; reading it walks
the kernel's whole established-connection hash every time (10 ms here with ten sockets
open), which at 100 reads a second kept a core busy in the kernel, on the hub's event
loop, while any server started.

It also checks who listens. An isolated server (the hub is root) runs as its own Unix
account, and the kernel says which uid owns each socket: the server listens when a socket
on its port belongs to its account. Without isolation every server runs as the hub's user,
so the socket's inode must be among the open files of the server's own process tree; that
scan runs in a thread and is bounded (``MAX_SCAN``), since a user's process can hold
thousands of descriptors. A socket on the server's port held by anyone else (another
user's process that bound the port first) is reported, so the hub never routes a user to
it — stock JupyterHub's poll would take any answer on that port for the server.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field

TICK = 0.01  # seconds between reads of the socket table while a server is starting
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
MAX_SCAN = 20_000  # processes plus descriptors looked at per check of a server's process tree


# sock_diag over netlink (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCPF_LISTEN = 1 << 10
_NLMSG = struct.Struct("=IHHII")  # length, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid (48 bytes)
_REQUEST = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans; sockid (sport, dport big-endian, src, dst,
# if, cookie); expires, rqueue, wqueue, uid, inode
_SPORT = struct.Struct("!H")
_INODE_OFFSET = 4 + 48 + 4 * 4  # the inode follows expires, rqueue, wqueue and uid


def _netlink_listening(netns: str | None = None) -> dict[int, dict[int, int]]:
    """{port: {inode: owner uid}} of listening TCP sockets, asked of the kernel with sock_diag
    (in the network namespace at ``netns``, a user's behind the wall, else the hub's own)."""
    out: dict[int, dict[int, int]] = {}
    if netns:
        from .user_network import socket_in

        diag = socket_in(netns, socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    else:
        diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    with diag as s:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, _TCPF_LISTEN)
            s.send(_NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0) + body)
            done = False
            while not done:
                data = s.recv(1 << 16)
                off = 0
                while off + _NLMSG.size <= len(data):
                    length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
                    if length < _NLMSG.size:
                        raise OSError("malformed netlink answer")
                    if kind == _NLMSG_DONE:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        (err,) = struct.unpack_from("=i", data, off + _NLMSG.size)
                        raise OSError(-err, "sock_diag refused")
                    msg = off + _NLMSG.size
                    (port,) = _SPORT.unpack_from(data, msg + 4)
                    uid, inode = struct.unpack_from("=II", data, msg + _INODE_OFFSET - 4)
                    out.setdefault(port, {})[inode] = uid
                    off += (length + 3) & ~3
    return out


def listening_sockets(proc_net: str = "/proc/net", netns: str | None = None) -> dict[int, dict[int, int]]:
    """{local port: {socket inode: owner uid}} of every listening TCP socket (IPv4 and IPv6)
    in the hub's network namespace (or the one at ``netns``: a user's, behind the wall): from
    netlink, or ``proc_net``'s tables where netlink is refused (and always when ``proc_net``
    is not the real one, as tests point it)."""
    if netns:
        return _netlink_listening(netns)  # a user's namespace has no /proc/net of the hub's to fall back on
    if proc_net == "/proc/net":
        try:
            return _netlink_listening()
        except OSError:
            pass  # no sock_diag (a restricted kernel or seccomp): read the tables instead
    return _proc_listening(proc_net)


def _proc_listening(proc_net: str) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, name)) as f:
                next(f, None)  # header
                for line in f:
                    parts = line.split()
                    if len(parts) < 10 or parts[3] != LISTEN:
                        continue
                    port = int(parts[1].rsplit(":", 1)[1], 16)
                    out.setdefault(port, {})[int(parts[9])] = int(parts[7])
        except (OSError, ValueError, IndexError):
            continue
    return out


def process_tree(pid: int, proc: str = "/proc", limit: int = MAX_SCAN) -> list[int]:
    """``pid`` and its descendants (through each task's ``children`` list), at most ``limit``."""
    seen: list[int] = []
    todo = [pid]
    while todo and len(seen) < limit:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        try:
            for tid in os.listdir(f"{proc}/{p}/task"):
                with open(f"{proc}/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return seen


def _tree_sockets(pid: int, proc: str, wanted: set[int]) -> set[int] | None:
    """Which of ``wanted`` the process tree of ``pid`` has open (``socket_inodes``; in a thread)."""
    return socket_inodes(process_tree(pid, proc), proc, wanted=wanted)


def socket_inodes(pids: list[int], proc: str = "/proc", wanted: set[int] | None = None, limit: int = MAX_SCAN) -> set[int] | None:
    """Socket inodes among the processes' open files; None if they cannot be read (then
    who listens cannot be checked: a hub that is not root, servers of another user).
    Stops at the first of ``wanted`` found, and after ``limit`` processes and descriptors."""
    out: set[int] = set()
    denied = False
    budget = limit
    for p in pids:
        budget -= 1
        if budget <= 0 or (wanted and out & wanted):
            break
        fd_dir = f"{proc}/{p}/fd"
        try:
            names = os.listdir(fd_dir)
        except FileNotFoundError:  # gone: it holds nothing
            continue
        except PermissionError:
            denied = True
            continue
        for name in names[: max(0, budget)]:
            budget -= 1
            try:
                target = os.readlink(f"{fd_dir}/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return None if denied and not out else out


def socket_holders(inodes: set[int], proc: str = "/proc", limit: int = MAX_SCAN) -> dict[int, str]:
    """{pid: command line} of the processes holding any of the socket ``inodes``, for an error
    that names who holds a port (at most ``limit`` processes and descriptors looked at; a
    process whose descriptors cannot be read is skipped). The command line is cut at 200
    characters: it is shown to an operator, not parsed."""
    out: dict[int, str] = {}
    budget = limit
    try:
        pids = sorted(int(n) for n in os.listdir(proc) if n.isdigit())
    except OSError:
        return out
    for pid in pids:
        if budget <= 0:
            break
        found = socket_inodes([pid], proc, wanted=inodes, limit=budget)
        budget -= 1
        if found and found & inodes:
            try:
                with open(f"{proc}/{pid}/cmdline", "rb") as f:
                    cmd = f.read(400).replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            out[pid] = cmd[:200]
    return out


def _gone(pid: int, proc: str = "/proc") -> bool:
    """The process has exited (absent, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


class PortTaken(Exception):
    """Something other than the server listens on the server's port."""


@dataclass
class _Waiter:
    port: int
    pid: int
    future: asyncio.Future
    uid: int | None = None  # the server's own account (isolated servers)
    foreign_since: float | None = None
    netns: str | None = None  # the user's network namespace (behind the wall), else the hub's


@dataclass
class ListenWatcher:
    """One per event loop: ``await watcher.wait(port, pid, timeout)``."""

    tick: float = TICK
    proc: str = "/proc"
    waiters: list[_Waiter] = field(default_factory=list)
    _task: asyncio.Task | None = None
    reads: int = 0  # reads of the socket table so far (tests check it is one per tick, not per waiter)

    async def wait(self, port: int, pid: int, timeout: float, uid: int | None = None, netns: str | None = None) -> str:
        """ "listening" when the server listens on ``port`` (a socket of account ``uid`` when
        given, else one of the process tree of ``pid``), "exited" when the process is gone
        first, "timeout" after ``timeout`` seconds; raises PortTaken when someone else's
        socket holds the port. ``netns``: the server's network namespace (its user's, behind
        the wall), where its socket is."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(port, pid, loop.create_future(), uid, netns=netns)
        self.waiters.append(waiter)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        try:
            # Not wait_for: in 3.11 it answers "listening" when a cancel (the start abandoned)
            # comes as the server listens, and the abandoned start would be routed to.
            async with asyncio.timeout(timeout):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            return "timeout"
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    async def _run(self) -> None:
        while self.waiters:
            tables: dict[str | None, dict[int, dict[int, int]]] = {}
            for ns in {w.netns for w in self.waiters}:  # one read per namespace a server starts in
                try:
                    tables[ns] = listening_sockets(os.path.join(self.proc, "net"), netns=ns)
                except OSError:
                    tables[ns] = {}  # a namespace removed meanwhile: its waiter ends by exit or timeout
            await self._check(tables)
            self.reads += 1
            await asyncio.sleep(self.tick)

    async def _check(self, tables: "dict[str | None, dict[int, dict[int, int]]]") -> None:
        for w in list(self.waiters):
            listening = tables.get(w.netns, {})
            if w.future.done():
                self.waiters.remove(w)
                continue
            if _gone(w.pid, self.proc):
                w.future.set_result("exited")
                continue
            owners = listening.get(w.port)
            if not owners:
                continue
            if w.uid is not None:  # the kernel says whose socket it is
                mine = w.uid in owners.values()
            else:  # everyone is the hub's user: look for the socket among the tree's files
                found = await asyncio.to_thread(_tree_sockets, w.pid, self.proc, set(owners))
                mine = found is None or bool(set(owners) & found)
            if w.future.done():
                continue
            if mine:
                w.future.set_result("listening")
            elif w.foreign_since is None:  # the server's fds are read a moment after listen():
                w.foreign_since = time.monotonic()  # give a just-made socket one more look
            elif time.monotonic() - w.foreign_since > 0.5:
                w.future.set_exception(PortTaken(f"port {w.port} is held by a process outside the server"))


_WATCHERS: dict[int, ListenWatcher] = {}


def watcher() -> ListenWatcher:
    """The watcher of the running event loop (tests run several loops in one process)."""
    loop = asyncio.get_running_loop()
    key = id(loop)
    w = _WATCHERS.get(key)
    if w is None:
        w = _WATCHERS[key] = ListenWatcher()
    return w


class PortBook:
    """The ports this hub has handed to its servers, until each server has stopped.

    JupyterHub's ``random_port()`` asks the kernel for a free port and closes the socket at
    once: the port is free again until the server binds it, seconds later (its Python starts
    first). Two servers starting at the same time can be handed the same port, and the
    second then cannot listen; its user gets an error instead of a server. Seen in a storm of
    50 users on 4 GPUs (2026-12-02): u01 and u00 both got port 52553 within a few seconds.
    A port in this book is not handed out again while its server starts or runs. A port
    that another process binds (not this hub's server) is still refused when the server
    starts (``PortTaken``): the book cannot know of other programs' ports.

    ``pick`` is JupyterHub's ``random_port`` unless a test gives another."""

    def __init__(self, pick=None, tries: int = 50):
        self._pick = pick
        self.tries = tries
        self.held: dict[int, str] = {}  # port -> the server it was handed to

    def take(self, owner: str, span: range | None = None) -> int:
        """A port no server of this hub holds now, booked for ``owner``: from ``span`` where
        given (from a random place in it, the first one nothing binds now), else the kernel's
        choice."""
        if span:
            start = random.randrange(len(span))
            for i in range(len(span)):
                port = span[(start + i) % len(span)]
                if port not in self.held and port_is_free(port):
                    self.held[port] = owner
                    return port
            raise RuntimeError(f"no free port in {span.start}-{span.stop - 1} ({len(self.held)} held by this hub's servers)")
        pick = self._pick
        if pick is None:
            from jupyterhub.utils import random_port

            pick = random_port
        for _ in range(self.tries):
            port = pick()
            if port not in self.held:
                self.held[port] = owner
                return port
        raise RuntimeError(f"no free port after {self.tries} tries ({len(self.held)} held by this hub's servers)")

    def give_back(self, port: int, owner: str) -> None:
        """``owner``'s server stopped (or never started): its port may be handed out again."""
        if self.held.get(port) == owner:
            del self.held[port]


def port_is_free(port: int) -> bool:
    """Nothing on this machine holds ``port`` now (a listener or a connection's local end): it
    binds on every address. Also the tests' own port blocks use it (tests/support/ports.py)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


PORTS = PortBook()  # one per hub process: its spawners share the machine's ports
