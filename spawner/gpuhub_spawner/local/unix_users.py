"""One unprivileged Unix account per hub user, created on first start.

Hub names are free-form (an IdP decides them); account names are not. The mapping is
``prefix + name`` when the name is already a safe account name, otherwise the
sanitised name plus ``_`` and a hash of the original. ``_`` never survives
sanitising, so a hashed name can never equal an unhashed one: the mapping is
collision-free (up to the 40-bit hash). Accounts carry a marker in their GECOS field;
an existing account without it (``root``, a person's login) is never taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hashlib
import os
import pwd
import re
import stat
import subprocess
import threading
import time
from dataclasses import dataclass

MARKER = "gpuhub user "
MAX_NAME = 32  # useradd's limit
_SAFE = re.compile(r"[a-z0-9-]+")


class AccountError(RuntimeError):
    """An account cannot be created or used; the message says why, for the admin."""


def system_username(hub_name: str, prefix: str = "gpuhub-") -> str:
    """The account name for ``hub_name``: readable, safe, and distinct for distinct names."""
    if prefix and not re.fullmatch(r"[a-z][a-z0-9-]*", prefix):
        raise AccountError(f"account prefix {prefix!r} must start with a-z and contain only a-z, 0-9 and '-'")
    name = hub_name
    clean = re.sub(r"[^a-z0-9-]+", "-", hub_name.lower()).strip("-")
    exact = bool(_SAFE.fullmatch(hub_name)) and len(prefix + hub_name) <= MAX_NAME
    if not prefix and not re.match(r"[a-z]", hub_name):
        exact = False
    if exact:
        return prefix + name
    digest = hashlib.sha256(hub_name.encode()).hexdigest()[:10]
    room = MAX_NAME - len(prefix) - 1 - len(digest)
    base = clean[:room] or "u"
    if not prefix and not re.match(r"[a-z]", base):
        base = "u" + base[: room - 1]
    return f"{prefix}{base}_{digest}"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    hub_name: str


def lookup(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def gecos(hub_name: str) -> str:
    """The marker comment of an account made for ``hub_name`` (passwd forbids ':' and newlines)."""
    return MARKER + re.sub(r"[^A-Za-z0-9 ._@+-]", "_", hub_name)[:200]


def _ours(entry: pwd.struct_passwd, hub_name: str) -> bool:
    return entry.pw_gecos == gecos(hub_name)


# One account change at a time on this machine. A user's first two servers start together
# (the spawner calls this from executor threads), and concurrent `useradd`s here lose
# updates despite shadow-utils' own locks: two threads creating one name got uids 995 and
# 999 (14 of 15 tries), one server's home went to the first and its launcher ran as the
# second, whose chdir into the home failed. The lookup and the useradd are one step, under
# a lock of this process (threads) and a lock file (other processes: a second hub, tests).
_ACCOUNTS = threading.Lock()
LOCK_FILE = "/run/gpuhub/accounts.lock"


@contextlib.contextmanager
def _accounts_locked():
    with _ACCOUNTS:
        os.makedirs(os.path.dirname(LOCK_FILE), mode=0o755, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def ensure_account(hub_name: str, prefix: str = "gpuhub-", shell: str = "/usr/sbin/nologin") -> Account:
    """The account of ``hub_name``, created (no password, no login shell) if missing."""
    with _accounts_locked():
        return _ensure_account(hub_name, prefix, shell)


def _ensure_account(hub_name: str, prefix: str, shell: str) -> Account:
    name = system_username(hub_name, prefix)
    for attempt in range(20):
        entry = lookup(name)
        if entry is not None:
            if not _ours(entry, hub_name):
                raise AccountError(
                    f"Unix account {name!r} exists but was not created by gpuhub for hub user {hub_name!r}; "
                    "refusing to run a server as it (choose another account prefix)"
                )
            if entry.pw_uid == 0 or entry.pw_gid == 0:
                raise AccountError(f"Unix account {name!r} is privileged (uid/gid 0)")
            return Account(name, entry.pw_uid, entry.pw_gid, hub_name)
        r = subprocess.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                shell,
                "--comment",
                gecos(hub_name),
                name,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            continue
        if r.returncode == 9:  # created meanwhile by another hub process: check it above
            continue
        if "lock" in r.stderr.lower():  # /etc/passwd busy (another useradd): retry
            time.sleep(0.05 * (attempt + 1))
            continue
        raise AccountError(f"useradd {name} failed ({r.returncode}): {r.stderr.strip()}")
    raise AccountError(f"could not create Unix account {name!r}: /etc/passwd stayed locked")


def ensure_home(path: str, account: Account) -> None:
    """A private (0700) home owned by the account; an existing one is re-owned (contents too) and tightened.

    Root works here in a directory a user may control, so everything goes by file
    descriptor: the home is opened without following a link, the walk (``os.fwalk``)
    never enters a link or a directory swapped for one, and each entry is re-owned with
    ``fchownat(AT_SYMLINK_NOFOLLOW)`` relative to its opened directory. Only what the
    home's previous owner owned is taken over, and never a file with other hard links
    (it may be another path's file, e.g. ``/etc/shadow`` linked in by a recycled uid).
    """
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (NotADirectoryError, FileNotFoundError):  # a link (O_NOFOLLOW|O_DIRECTORY) or a file
        raise AccountError(f"home {path} is not a directory") from None
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (account.uid, account.gid):
            # A home from before isolation (the demo ran servers as root), or an account
            # made again with another uid: the account takes over what the old owner had.
            _take_over(fd, st.st_uid, account, path)
            os.fchown(fd, account.uid, account.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _take_over(home_fd: int, old_uid: int, account: Account, path: str) -> None:
    import logging

    skipped = 0
    for _dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=home_fd, follow_symlinks=False):
        for name in dirnames + filenames:  # links to directories are listed in dirnames, never entered
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if st.st_uid != old_uid or (st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode)):
                    skipped += 1
                    continue
                os.chown(name, account.uid, account.gid, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
    if skipped:
        logging.getLogger("JupyterHub.gpuhub.accounts").warning(
            "home %s: %d entries not taken over for %s (another owner's, or hard-linked files)", path, skipped, account.name
        )


def remove_accounts(prefix: str) -> list[str]:
    """Delete every gpuhub-made account whose name starts with ``prefix`` (tests, uninstall)."""
    removed = []
    with _accounts_locked():
        for entry in pwd.getpwall():
            if entry.pw_name.startswith(prefix) and entry.pw_gecos.startswith(MARKER):
                subprocess.run(["userdel", entry.pw_name], capture_output=True)
                try:
                    grp.getgrnam(entry.pw_name)
                    subprocess.run(["groupdel", entry.pw_name], capture_output=True)
                except KeyError:
                    pass
                removed.append(entry.pw_name)
    return removed
