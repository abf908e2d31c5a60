"""One unprivileged Unix account per hub user, created on first start.

Hub names are free-form (an IdP decides them); account names are not. The mapping is
``prefix + name`` when the name is already a safe account name, otherwise the
sanitised name plus ``_`` and a hash of the original. ``_`` never survives
sanitising, so a hashed name can never equal an unhashed one: the mapping is
collision-free (up to the 40-bit hash). Accounts carry a marker in their GECOS field;
an existing account without it (``root``, a person's login) is never taken over.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import subprocess
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


def ensure_account(hub_name: str, prefix: str = "gpuhub-", shell: str = "/usr/sbin/nologin") -> Account:
    """The account of ``hub_name``, created (no password, no login shell) if missing."""
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
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", shell, "--comment", gecos(hub_name), name],
            capture_output=True, text=True,
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
    """A private (0700) home owned by the account; an existing one is re-owned (contents too) and tightened."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        raise AccountError(f"home {path} is not a directory")
    if (st.st_uid, st.st_gid) != (account.uid, account.gid):
        # A home from before isolation (the demo ran servers as root): the account takes
        # over everything in it, links themselves not followed.
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chown(os.path.join(root, name), account.uid, account.gid, follow_symlinks=False)
        os.chown(path, account.uid, account.gid)
    os.chmod(path, 0o700)


def remove_accounts(prefix: str) -> list[str]:
    """Delete every gpuhub-made account whose name starts with ``prefix`` (tests, uninstall)."""
    removed = []
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
