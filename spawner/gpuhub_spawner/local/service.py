"""``gpuhub install-service``: the systemd unit that runs the one-machine hub on a GPU server.

What the unit guarantees, and why:

- runs ``gpuhub run`` as root (servers need their own accounts, cgroups and a private
  ``/dev``; the hub drops nothing of its own into them);
- logs to the journal (``journalctl -u gpuhub``), ``UMask=0077`` so everything the hub
  writes is private, data in ``--data-dir`` (default ``/var/lib/gpuhub``);
- ``Restart=on-failure``; a stop is SIGTERM to the hub alone (``KillMode=mixed``),
  then SIGKILL for whatever of the unit is left. Single-user servers live in their own cgroups (``gpuhub/...``),
  outside the unit, so ``systemctl restart gpuhub`` and upgrades keep them running;
  the restarted hub re-adopts them from its database (identity: pid + start time).

One hub per account prefix on a machine (``hold_account_prefix``): the Unix accounts and
cgroups a hub makes are named by its prefix, so a second hub with the same prefix would
find the first one's servers in "its" cgroups. A hub holds its prefix with an ``flock``
on ``/run/gpuhub/prefix-<prefix>.lock`` from the moment its config is read (before any
server is adopted) until its process ends, however it ends; a second hub is refused,
told which hub holds the prefix.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

UNIT = """\
[Unit]
Description=gpuhub: a JupyterHub for teams sharing GPUs
Documentation=file://{docs}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User=root
WorkingDirectory=/
ExecStart={exec_start}
Environment=PYTHONUNBUFFERED=1
UMask=0077
Restart=on-failure
RestartSec=5
# SIGTERM goes to the hub alone, which stops its services itself (measured: ~2.5 s);
# SIGTERM to every process of the unit (control-group) made it wait ~30 s on the culler.
# What is left after the hub exits (the proxy) gets SIGKILL. Users' servers run in their
# own cgroups outside the unit and are re-adopted when the hub comes back.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=30
StandardOutput=journal
StandardError=journal
SyslogIdentifier=gpuhub
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""


def render_unit(*, config: str, policy: str, data_dir: str, port: int, site: str | None) -> str:
    gpuhub = str(Path(sys.prefix) / "bin" / "gpuhub")
    args = [gpuhub, "run", "--config", config, "--policy", policy, "--data-dir", data_dir, "--port", str(port)]
    if site:
        args += ["--site", site]
    docs = Path(config).resolve().parents[1] / "docs" / "install-one-machine.md"
    return UNIT.format(exec_start=" ".join(shlex.quote(a) for a in args), docs=docs)


def install_service(args) -> int:
    """Write the unit (or print it with ``--print``); say what to run next."""
    config = str(Path(args.config).resolve())
    policy = str(Path(args.policy or Path(config).parent / "profiles.yaml").resolve())
    site = str(Path(args.site).resolve()) if args.site else None
    for what, path in (("config", config), ("policy", policy), ("site file", site)):
        if path and not Path(path).is_file():
            print(f"gpuhub install-service: the {what} {path} does not exist", file=sys.stderr)
            return 2
    unit = render_unit(config=config, policy=policy, data_dir=str(Path(args.data_dir).resolve()), port=args.port, site=site)
    if args.print:
        sys.stdout.write(unit)
        return 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(unit)
    tmp.replace(out)
    print(
        f"Wrote {out}. Next:\n"
        f"  systemctl daemon-reload && systemctl enable --now {out.stem}\n"
        f"  journalctl -u {out.stem} -f      # the hub's log\n"
        f"Data (database, secrets, homes): {Path(args.data_dir).resolve()} - back it up (docs/install-one-machine.md)."
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("install-service", help="write a systemd unit that runs this hub (journal logs, restarts)")
    p.add_argument("--config", default="jupyterhub_config/jupyterhub_config.py")
    p.add_argument("--policy", default=None, help="policy file (default: profiles.yaml beside the config)")
    p.add_argument("--site", default=None, help="site file: login, HTTPS, accounts (docs/authentication.md)")
    p.add_argument("--data-dir", default="/var/lib/gpuhub")
    p.add_argument("--port", type=int, default=443)
    p.add_argument("--output", default="/etc/systemd/system/gpuhub.service")
    p.add_argument("--print", action="store_true", help="print the unit instead of writing it")
    p.set_defaults(func=install_service)


# -- one hub per account prefix ----------------------------------------------------------------

LOCK_DIR = "/run/gpuhub"  # the same for every hub on the machine, whatever its data dir


class PrefixHeld(RuntimeError):
    """Another live hub on this machine holds the account prefix (or one overlapping it)."""

    def __init__(self, prefix: str, holder: dict, theirs: str | None = None):
        self.prefix, self.holder = prefix, holder
        what = f"the account prefix {prefix!r}"
        if theirs is not None and theirs != prefix:
            what += f" overlaps the prefix {theirs!r}, which"
        super().__init__(
            f"gpuhub: {what} is held by another hub on this machine ({describe_holder(holder)}). "
            "Two hubs with one prefix share Unix accounts and cgroups, and each would kill the other's "
            "servers as leftovers. Stop that hub, or give this one a prefix of its own "
            "(c.LocalGpuSpawner.account_prefix or $GPUHUB_ACCOUNT_PREFIX)."
        )


def describe_holder(holder: dict) -> str:
    parts = [f"pid {holder.get('pid', '?')}"]
    if holder.get("data_dir"):
        parts.append(f"data dir {holder['data_dir']}")
    if holder.get("config"):
        parts.append(f"config {holder['config']}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts)


class PrefixLock:
    """This process's hold on an account prefix: an flock that the kernel drops when the
    process ends (the descriptor is close-on-exec, so no server or proxy inherits it)."""

    def __init__(self, prefix: str, path: Path, fd: int, info: dict):
        self.prefix, self.path, self.fd, self.info = prefix, path, fd, info

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:  # tests; a hub never lets go before it exits
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _HELD.pop((str(self.path.parent), self.prefix), None)


_HELD: dict[tuple[str, str], PrefixLock] = {}


def _lock_name(prefix: str) -> str:
    import hashlib
    import re

    if re.fullmatch(r"[A-Za-z0-9._-]{0,64}", prefix):
        return f"prefix-{prefix}.lock"
    return f"prefix-{hashlib.sha256(prefix.encode()).hexdigest()[:16]}.lock"


def _read_holder(path: Path) -> dict:
    import json

    for _ in range(20):  # a holder writes its details just after locking
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict):
            return info
        import time

        time.sleep(0.05)
    return {}


def _held_by_other(path: Path) -> bool:
    """Is ``path`` flocked by a live process (never by this one: ours are in ``_HELD``)?"""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def held_prefix(prefix: str, lock_dir: str | None = None) -> PrefixLock | None:
    """This process's lock on ``prefix``, if it holds one."""
    lock = _HELD.get((str(Path(lock_dir or LOCK_DIR)), prefix))
    return lock if lock is not None and lock.held else None


def hold_account_prefix(
    prefix: str, *, data_dir: str | None = None, config: str | None = None, lock_dir: str | None = None
) -> PrefixLock:
    """Hold ``prefix`` for the rest of this process; raise ``PrefixHeld`` naming the hub that has it.

    Also refused: a prefix that is a prefix of a held one, or the other way round
    (``gpuhub-`` and ``gpuhub-t1-`` would both name an account ``gpuhub-t1-alice``).
    Idempotent within one process.
    """
    import fcntl
    import json
    import time

    d = Path(lock_dir or LOCK_DIR)
    mine = held_prefix(prefix, str(d))
    if mine is not None:
        return mine
    d.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = d.lstat()
    if not os.path.isdir(d) or os.path.islink(d) or (os.geteuid() == 0 and st.st_uid != 0) or st.st_mode & 0o022:
        raise RuntimeError(f"{d} must be a directory owned by root and writable by root only (prefix locks live there)")
    path = d / _lock_name(prefix)
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), path.stat()
        except BlockingIOError:
            os.close(fd)
            raise PrefixHeld(prefix, _read_holder(path)) from None
        except FileNotFoundError:  # removed (forget_prefix) between open and lock: again
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)  # locked a file that was replaced meanwhile: lock the one in place
    else:
        raise RuntimeError(f"cannot lock {path}: it keeps being replaced")
    info = {
        "prefix": prefix,
        "pid": os.getpid(),
        "data_dir": data_dir,
        "config": config,
        "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "argv": sys.argv,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    lock = PrefixLock(prefix, path, fd, info)
    # Overlapping prefixes share account names: held ones refuse this prefix too.
    for other in sorted(d.glob("prefix-*.lock")):
        if other == path:
            continue
        theirs = _read_holder(other) if _held_by_other(other) else {}
        p = theirs.get("prefix")
        if isinstance(p, str) and (p.startswith(prefix) or prefix.startswith(p)) and _held_by_other(other):
            os.close(fd)
            raise PrefixHeld(prefix, theirs, p)
    _HELD[(str(d), prefix)] = lock
    return lock


def prefix_holder(prefix: str, lock_dir: str | None = None) -> dict | None:
    """Who holds ``prefix`` if another live process does (its pid, data dir, config), else None."""
    if held_prefix(prefix, lock_dir) is not None:
        return None
    path = Path(lock_dir or LOCK_DIR) / _lock_name(prefix)
    return (_read_holder(path) or {"pid": "?"}) if _held_by_other(path) else None


def forget_prefix(prefix: str, lock_dir: str | None = None) -> bool:
    """Remove ``prefix``'s lock file unless a live hub holds it (tests, uninstall). Removed
    while locked, so a hub that opened it meanwhile notices and locks the new one."""
    import fcntl

    path = Path(lock_dir or LOCK_DIR) / _lock_name(prefix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink()
        return True
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(fd)


def configured_prefix(c=None) -> str:
    """The account prefix the hub's spawners will use (config, else $GPUHUB_ACCOUNT_PREFIX, else gpuhub-)."""
    for section in ("LocalGpuSpawner", "IsolatedProcessSpawner"):
        if c is not None and section in c and "account_prefix" in c[section]:
            return c[section].account_prefix
    return os.environ.get("GPUHUB_ACCOUNT_PREFIX", "gpuhub-")


def hold_prefix_at_hub_start(c=None, stream=None) -> PrefixLock | None:
    """At a hub's start (its config being read, before any server is adopted): hold the
    account prefix, or end this hub with a message naming the one that holds it.

    Nothing outside a starting JupyterHub (tools and tests that read the config)."""
    try:
        from jupyterhub.app import JupyterHub
    except ImportError:  # pragma: no cover
        return None
    if not JupyterHub.initialized():
        return None
    app = JupyterHub.instance()
    starting = getattr(app, "_start_future", None)  # set by initialize() just before the config is read
    if starting is None or starting.done():
        return None
    data_dir = None
    if c is not None and "JupyterHub" in c and "cookie_secret_file" in c.JupyterHub:
        data_dir = str(Path(c.JupyterHub.cookie_secret_file).parent)
    try:
        return hold_account_prefix(
            configured_prefix(c),
            data_dir=data_dir or os.getcwd(),
            config=str(Path(app.config_file).resolve()) if app.config_file else None,
        )
    except PrefixHeld as e:
        import logging

        print(str(e), file=stream or sys.stderr, flush=True)
        logging.getLogger("JupyterHub.gpuhub.isolation").critical("%s", e)
        raise SystemExit(1) from None
