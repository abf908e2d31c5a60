"""Reading, as root, what a user's processes listen on, and probing it from another user's seat.

Shared by the attack tests of the wall around each user (``test_attack_network.py``: a
server, a job and a ``gpuhub ray up`` cluster; ``test_ray_jobs.py``: a Ray job's cluster).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess

PROBE = """\
import json, select, socket, errno
def probe(targets, timeout=6.0):
    '''Connect to every (address, port) at once; return those that accepted.'''
    socks = {}
    for addr, port in targets:
        fam = socket.AF_INET6 if ':' in addr else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex((addr, port))
        if rc in (0, errno.EINPROGRESS):
            socks[s] = (addr, port)
        else:
            s.close()
    accepted = []
    end = __import__('time').monotonic() + timeout
    pending = dict(socks)
    while pending:
        left = end - __import__('time').monotonic()
        if left <= 0:
            break
        _, w, _ = select.select([], list(pending), [], left)
        for s in w:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                accepted.append(pending[s])
            del pending[s]
    for s in socks:
        s.close()
    return sorted(accepted)
"""


def account(hub, name: str) -> pwd.struct_passwd:
    from gpuhub_spawner.local.unix_users import system_username

    return pwd.getpwnam(system_username(name, hub.env["GPUHUB_ACCOUNT_PREFIX"]))


def listeners_of(uid: int) -> dict[int, dict]:
    """As root: {port: {address, pid, comm}} of every listening TCP socket held by a process of
    ``uid``, each read in its own process's network view."""
    found: dict[int, dict] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
            comm = open(f"/proc/{pid}/comm").read().strip()
            for table in ("tcp", "tcp6"):
                for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
                    parts = line.split()
                    if parts[3] != "0A" or int(parts[9]) not in inodes:
                        continue
                    hexaddr, hexport = parts[1].rsplit(":", 1)
                    found[int(hexport, 16)] = {"address": _addr(hexaddr), "pid": pid, "comm": comm}
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
    return found


def _addr(hexaddr: str) -> str:
    import socket
    import struct

    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hexaddr, 16)))
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def machine_addresses() -> list[str]:
    """Every IPv4 address of the machine's own network namespace (the hub's)."""
    shown = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True).stdout)
    return sorted({a["local"] for link in shown for a in link.get("addr_info", [])})


def host_listening_ports() -> set[int]:
    from gpuhub_spawner.local.listening import listening_sockets

    return set(listening_sockets())


def pid_arg(uid: int, *words: bytes) -> tuple[int, int | None]:
    """(pid, the number after ``words[0]``) of a process of ``uid`` whose command line holds ``words``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if all(any(w in a for a in args) for w in words):
            after = next((args[i + 1] for i, a in enumerate(args) if a == words[0] and i + 1 < len(args)), b"")
            return int(entry), int(after) if after.isdigit() else None
    raise AssertionError(f"no process of uid {uid} with {words} on its command line")
