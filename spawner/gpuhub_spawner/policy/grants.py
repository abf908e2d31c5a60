"""What a server or job of a team and profile is granted beyond its profile: secrets and team data.

The policy names secrets only by reference (``secrets:``); on one machine the hub reads the
value from the admin's file at each start (so a rewritten file is a rotated secret, no restart)
and hands it to the sandbox on its pipe (``local.sandbox``), never to a log, the audit trail, a
job record or the policy's history. This module resolves grants and reads those files.

Reading is a privileged step (the hub runs as root): the file is opened without following a
link, must be a regular file owned by root (or the hub's own user), writable by nobody else,
in a directory nobody else may write; so a user who can write somewhere on the path cannot
point the hub at a file of their choosing (``/etc/shadow``) or swap the content. Every refusal
names the policy location and the path, never a byte of the file.

A team dataset's directory (``data:``) is checked the same way before the sandbox binds it:
a directory, not a link, under a directory that other accounts cannot enter (so the bind in
the team's servers is the only way in).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from .model import Policy, SecretGrant

MAX_SECRET_FILE_BYTES = 1 * 2**20  # a file of keys; a real one is a few KiB
MAX_SECRET_BYTES = 64 * 2**10  # one value (a Kubernetes Secret holds at most 1 MiB in all)


class GrantUnavailable(Exception):
    """A granted secret or dataset cannot be delivered; the message is located and holds no value."""


@dataclass
class Delivery:
    """What one server or job receives: secret files, secret environment, dataset binds."""

    files: dict[str, str] = field(default_factory=dict)  # secret name -> value (the file's text)
    env: dict[str, str] = field(default_factory=dict)  # variable -> value
    data: list[dict] = field(default_factory=list)  # {"name", "source", "read_only"[, "kernel"]}
    secret_names: list[str] = field(default_factory=list)
    delivered_as: dict[str, str] = field(default_factory=dict)  # secret name -> "file" | "env NAME"

    def __bool__(self) -> bool:
        return bool(self.files or self.env or self.data)

    @property
    def kernels(self) -> dict[str, str]:
        """Team environments among the datasets: name -> the kernel's display name."""
        return {d["name"]: d["kernel"] for d in self.data if d.get("kernel")}

    def sandbox_spec(self) -> dict | None:
        """The sandbox's ``grants`` (local.sandbox.mount_grants): on its pipe only."""
        if not (self.files or self.data):
            return None
        return {"secrets": dict(self.files), "data": [dict(d) for d in self.data]}


def _where(policy: Policy, grant: SecretGrant) -> str:
    return f"secrets[{policy.secrets.index(grant)}] ({grant.name})"


def _check_owner(st: os.stat_result, what: str) -> None:
    if st.st_uid not in (0, os.geteuid()):
        raise GrantUnavailable(f"{what} is owned by uid {st.st_uid}: only root (or the hub's user) may own it")
    # A sticky directory (/tmp) lets others add entries but not replace root's: the next part is checked.
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise GrantUnavailable(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); make it 0600/0700")


def _check_directories(path: str, where: str) -> None:
    """Every directory above ``path``: a real directory (no link), root's (or the hub's user's),
    writable by nobody else (a sticky one such as /tmp aside): so no user can swap a part of
    the path for a way to a file of their choice."""
    cur = ""
    for part in ["", *path.strip("/").split("/")[:-1]]:
        cur = cur.rstrip("/") + "/" + part if part else "/"
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            raise GrantUnavailable(f"{where}.local.file {path}: {cur} is a symbolic link; give the real path")
        _check_owner(st, f"{where}: its directory {cur}")


def read_secret_file(path: str, key: str, where: str) -> str:
    """The value of ``key`` in the YAML mapping at ``path`` (checked as the module says)."""
    what = f"{where}.local.file {path}"
    try:
        _check_directories(path, where)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise GrantUnavailable(f"{what} does not exist") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP: a symbolic link
            raise GrantUnavailable(f"{what} is a symbolic link; gpuhub does not follow it as root") from None
        raise GrantUnavailable(f"{what} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GrantUnavailable(f"{what} is not a regular file")
        _check_owner(st, what)
        raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise GrantUnavailable(f"{what} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    import yaml

    from .bounded import InputRefused, load_yaml

    try:
        _, data = load_yaml(raw, what="secret files", max_bytes=MAX_SECRET_FILE_BYTES)
    except (InputRefused, yaml.YAMLError, ValueError) as e:  # their words may quote the file: only the place is kept
        line = getattr(e, "line", None) or getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" (line {line})" if line else ""
        raise GrantUnavailable(f"{what} is not a YAML mapping of keys to values{at}") from None
    if not isinstance(data, dict):
        raise GrantUnavailable(f"{what} is not a YAML mapping of keys to values")
    if key not in data:
        from .loader import suggest

        names = [k for k in data if isinstance(k, str)]
        raise GrantUnavailable(f"{where}.local.key: {path} has no key {key!r}" + suggest(key, names))
    value = data[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise GrantUnavailable(f"{where}.local.key: the value of {key!r} in {path} is not a string")
    if "\0" in value or len(value.encode()) > MAX_SECRET_BYTES:
        raise GrantUnavailable(
            f"{where}.local.key: the value of {key!r} in {path} holds a NUL byte or exceeds {MAX_SECRET_BYTES} bytes"
        )
    return value


def check_data_dir(path: str, where: str) -> None:
    """``path`` is a real directory that only the sandbox's bind makes reachable."""
    what = f"{where}.local.path {path}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise GrantUnavailable(f"{what} does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise GrantUnavailable(f"{what} is a symbolic link or not a directory")
    cur = ""
    for part in path.strip("/").split("/")[:-1]:
        cur += "/" + part
        pst = os.lstat(cur)
        if stat.S_ISLNK(pst.st_mode):
            raise GrantUnavailable(f"{what}: {cur} is a symbolic link; give the real path")
        if pst.st_uid in (0, os.geteuid()) and not pst.st_mode & 0o001:
            return  # no other account gets past here
    raise GrantUnavailable(
        f"{what} is reachable by every account on this machine, so another team could read it; "
        "keep team data under a directory only root may enter (e.g. chmod 700 /srv/gpuhub-data)"
    )


def local_delivery(policy: Policy, team: str, profile: str) -> Delivery:
    """Read the secrets and check the datasets granted to ``team`` on ``profile`` (one machine).

    Blocking (files): run it off the event loop. Raises ``GrantUnavailable``."""
    out = Delivery()
    for grant in policy.secrets_for(team, profile):
        where = _where(policy, grant)
        if grant.local is None:
            raise GrantUnavailable(f"{where} has no local source (file + key) for this machine")
        value = read_secret_file(grant.local.file, grant.local.key, where)
        out.secret_names.append(grant.name)
        if grant.env:
            out.env[grant.env] = value
            out.delivered_as[grant.name] = f"env {grant.env}"
        else:
            out.files[grant.name] = value
            out.delivered_as[grant.name] = "file"
    for ds in policy.data_for(team, profile):
        where = f"data[{policy.data.index(ds)}] ({ds.name})"
        if ds.local is None:
            raise GrantUnavailable(f"{where} has no local source (path) for this machine")
        check_data_dir(ds.local.path, where)
        entry = {"name": ds.name, "source": ds.local.path, "read_only": ds.read_only}
        if ds.kernel is not None:
            entry["kernel"] = ds.kernel  # a team environment: the sandbox writes its kernelspec
        out.data.append(entry)
    return out


def grant_warnings(policy: Policy) -> list[str]:
    """Grants this machine could not deliver now (a missing file or key, an unsafe file, a dataset
    any account could reach), located: ``gpuhub validate`` and the hub's policy checks say so
    before a user's start is refused for it. Reads the admin's files; never returns a value."""
    out = []
    for grant in policy.secrets:
        if grant.local is not None:
            try:
                read_secret_file(grant.local.file, grant.local.key, _where(policy, grant))
            except GrantUnavailable as e:
                out.append(str(e))
    for i, ds in enumerate(policy.data):
        if ds.local is not None:
            try:
                check_data_dir(ds.local.path, f"data[{i}] ({ds.name})")
            except GrantUnavailable as e:
                out.append(str(e))
                continue
            python = os.path.join(ds.local.path, "bin", "python")
            if ds.kernel is not None and not os.path.exists(python):
                out.append(
                    f"data[{i}] ({ds.name}).kernel: {python} does not exist, so the kernel "
                    f"{ds.kernel!r} cannot start; build the environment there (docs/own-packages.md)"
                )
    return out
