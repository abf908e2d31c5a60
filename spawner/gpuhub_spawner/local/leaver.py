"""The last step of off-boarding on one machine: no process of the leaver's account is left.

Stopping their servers, jobs and Ray clusters ends what gpuhub started; anything those left
behind (a daemon a job forked, a Ray worker still exiting) still runs as the account. Each such
process gets SIGTERM, then SIGKILL after ``grace`` seconds, and its end is awaited on a pidfd
(the kernel says when it is gone: no polling); rounds repeat while processes keep appearing
(a parent forking as it dies), at most ``rounds`` times.
"""

from __future__ import annotations

import os
import select
import signal
import time

from .isolation import process_uid
from .unix_users import lookup


def _state(pid: int) -> str:
    try:
        raw = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return "gone"
    return raw[raw.rindex(b")") + 2 :].split()[0].decode()


def _pids_of(uid: int) -> list[int]:
    """The account's processes that still run (a zombie has ended: only its parent's wait is due)."""
    return [
        int(p) for p in os.listdir("/proc") if p.isdigit() and process_uid(int(p)) == uid and _state(int(p)) not in ("Z", "gone")
    ]


def _signal_and_wait(pids: list[int], sig: int, deadline: float) -> list[int]:
    """Send ``sig`` to each of ``pids`` through a pidfd and wait until they end or ``deadline``;
    the pids still alive."""
    fds = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue  # already gone
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            os.close(fd)
            continue
        fds[fd] = pid
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(fds), [], [], left)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def end_account_processes(account: str, grace: float = 5.0, rounds: int = 5) -> str:
    """End every process of Unix account ``account``; what was done, in words."""
    entry = lookup(account)
    if entry is None:
        return f"no account {account} on this machine"
    ended = 0
    for _ in range(rounds):
        pids = _pids_of(entry.pw_uid)
        if not pids:
            return f"no process of {account} left" + (f" ({ended} ended)" if ended else "")
        ended += len(pids)
        left = _signal_and_wait(pids, signal.SIGTERM, time.monotonic() + grace)
        if left:
            _signal_and_wait(left, signal.SIGKILL, time.monotonic() + grace)
    remaining = _pids_of(entry.pw_uid)
    if remaining:
        states = ", ".join(f"{p} ({_state(p)})" for p in remaining[:10])
        raise RuntimeError(f"{len(remaining)} process(es) of {account} still run after {rounds} rounds: {states}")
    return f"no process of {account} left ({ended} ended)"
