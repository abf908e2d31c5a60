"""Launch one single-user server (or job) inside its sandbox: ``python -I -m gpuhub_spawner.local.sandbox --spec-fd N -- CMD...``.

Run by the hub as root; it ends by ``exec``-ing the server's command as the server's
unprivileged account, so the hub's pid *is* the server (signals, pidfd, restart
adoption work unchanged; bubblewrap would leave a monitor process in between).

**Nothing of the user's reaches this process while it is root.** The hub starts it with
a fixed environment (``LAUNCHER_ENV``: a system ``PATH`` and ``LANG``, nothing else): the
dynamic loader honours ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT``, ``GCONV_PATH``...
in any non-setuid process, root included, and ``python -I`` ignores only ``PYTHON*``. The
spec and the server's environment (which holds its API token) come on an inherited pipe
(``N``), never on argv (world-readable in ``/proc``) nor in this process's environment;
the environment is applied only by the final ``execve``, after the switch to the user.
Where root has to create or mount something in a directory the user controls (their
private ``/tmp``), it walks it with ``O_NOFOLLOW`` and mounts onto the opened directory
(``/proc/self/fd/N``): a link the user planted is refused, never followed.

In order:

1. join the server's cgroups (memory, CPU, devices), so every descendant is counted, and
   the user's network namespace where the hub gives one (``user_network``: the wall);
2. a private mount namespace (mounts propagate in from the host, never out);
3. a fresh ``/dev``: the usual harmless nodes, a private ``/dev/shm``, a new ``devpts``
   instance, and *only* the GPU nodes this server was given (same major:minor as the
   host's); a stand-in device tree outside ``/dev`` is covered, too;
4. the private home made reachable at ``/home/<account>`` when it lives elsewhere
   (for example under the hub's private data directory), and the server's Python made
   reachable (read-only) where it sits under a private directory such as ``/root``
   (pyenv, conda): that directory is replaced by an empty one holding just it;
5. a private ``/tmp`` (and ``/var/tmp``): a file one user's kernel leaves there is not
   readable by another; its own ``/proc`` where the kernel allows it (Linux >= 5.8): other users' processes
   are invisible, not merely unreadable;
5b. where the policy grants any, a private read-only tmpfs at ``/run/gpuhub`` with the granted
   secrets as the account's own 0400 files and the team's datasets bound in, with a kernelspec
   (``jupyter/kernels/<name>``) for each one the policy makes a team environment (``mount_grants``);
6. ``no_new_privs``, drop to the account (no supplementary groups), ``chdir`` home,
   ``execve`` with the server's environment.

What stays visible: ``/proc/self/mountinfo`` names the host paths the binds come from
(the home's, e.g. ``<data dir>/home/<user>``, the private tmp's ``/tmp/gpuhub/<account>``
and the exposed Python's). A bind mount always shows its source's path within its
filesystem; the paths are names only (their parents are root-only). A home configured
at ``/home/{account}`` needs no bind and shows nothing.

The account has no ``CAP_MKNOD`` and cannot mount, so it cannot create the missing
nodes; clearing ``CUDA_VISIBLE_DEVICES`` therefore gains nothing: the driver cannot
open a GPU whose node does not exist.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_PRIVATE, MS_SLAVE = 1 << 18, 1 << 19
PR_SET_NO_NEW_PRIVS = 38
MNT_DETACH = 2

# The launcher's whole environment while it is root: nothing the hub's or the user's
# environment holds reaches the dynamic loader or Python of a privileged process.
LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
MAX_PAYLOAD = 16 * 2**20  # spec + environment; a real one is a few KiB
HAND_OVER_TIMEOUT = 60.0  # the launcher reads its pipe first thing

# Character devices every process may use (the list container runtimes allow by default).
STANDARD_NODES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _node(path: str, major: int, minor: int, mode: int = 0o666) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))


def host_nodes(dev_dir: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """major:minor of each named character device under ``dev_dir``; missing ones are skipped."""
    found = {}
    for name in names:
        try:
            st = os.stat(os.path.join(dev_dir, name))
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found[name] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return found


def build_dev(gpu_nodes: dict[str, tuple[int, int]]) -> None:
    """Replace ``/dev`` in this mount namespace by a minimal one with only ``gpu_nodes``."""
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m")
    for name, (major, minor) in STANDARD_NODES.items():
        _node(f"/dev/{name}", major, minor)
    os.mkdir("/dev/pts", 0o755)
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.mkdir("/dev/shm", 0o1777)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for link, target in {
        "fd": "/proc/self/fd",
        "stdin": "/proc/self/fd/0",
        "stdout": "/proc/self/fd/1",
        "stderr": "/proc/self/fd/2",
    }.items():
        os.symlink(target, f"/dev/{link}")
    for name, (major, minor) in gpu_nodes.items():
        _node(f"/dev/{name}", major, minor)


def _per_mount_proc_options() -> bool:
    """Since Linux 5.8 each proc mount has its own options; before, hidepid would change the host's."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def _blocked_ancestor(path: str) -> str | None:
    """The topmost directory above ``path`` that other users cannot traverse, if any."""
    cur = ""
    for part in path.strip("/").split("/")[:-1]:
        cur += "/" + part
        if not os.stat(cur).st_mode & 0o001:
            return cur
    return None


def expose(paths: list[str]) -> None:
    """Make ``paths`` reachable read-only although an ancestor is private (e.g. ``/root``).

    The private ancestor is covered by an empty tmpfs (its other contents stay hidden)
    holding only the bound paths. Call after ``build_dev`` (staging lives in /dev).
    """
    staged = []
    for i, path in enumerate(dict.fromkeys(os.path.realpath(p) for p in paths)):
        blocked = _blocked_ancestor(path) if os.path.isdir(path) else None
        if blocked is None:
            continue
        stage = f"/dev/.gpuhub-expose-{i}"
        os.mkdir(stage, 0o700)
        _mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((blocked, path, stage))
    covered: set[str] = set()
    for blocked, path, stage in staged:
        if blocked not in covered:
            _mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            covered.add(blocked)
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(stage, path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        _check(_libc.umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)


class UnsafePath(OSError):
    """A path root was asked to create or mount on holds a link or a non-directory."""


_DIR_NOFOLLOW = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


def open_dir_nofollow(base: str, rel: str, create: bool = False) -> int:
    """An ``O_PATH`` fd of the directory ``base/rel``, reached without following any link.

    ``base`` is a directory root made or trusts (a mount point it just made); below it,
    each component of ``rel`` is opened with ``O_NOFOLLOW`` relative to the one before
    (and, with ``create``, made with ``mkdirat`` where missing), so a link or file the user
    put anywhere on the way (or swaps in meanwhile) is refused instead of followed.
    Mount onto ``/proc/self/fd/<fd>`` to mount on exactly the directory checked.
    """
    fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    done = base.rstrip("/")
    try:
        for part in rel.strip("/").split("/") if rel.strip("/") else []:
            if part in ("", ".", ".."):
                raise UnsafePath(f"{done}/{part}: not a plain path component")
            done += "/" + part
            try:
                nfd = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)  # mkdirat never follows a link
                except FileExistsError:
                    pass  # made meanwhile: checked by the open below like anything else
                try:
                    nfd = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
                except (NotADirectoryError, FileNotFoundError) as e:
                    raise UnsafePath(f"{done} changed while it was being made; refusing to follow it") from e
            except NotADirectoryError:  # O_NOFOLLOW|O_DIRECTORY on a link or a file
                raise UnsafePath(
                    f"{done} is a symbolic link or not a directory; gpuhub does not follow it as root (remove it and start again)"
                ) from None
            os.close(fd)
            fd = nfd
            if not stat.S_ISDIR(os.fstat(fd).st_mode):  # pragma: no cover - O_DIRECTORY ensures it
                raise UnsafePath(f"{done} is not a directory")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _stage_under(target: str, paths: list[str]) -> list[tuple[str, str]]:
    """Bind exposed software that lives under ``target`` (e.g. a venv in /tmp) aside, read-only.

    The private /tmp would hide it; ``_restore_staged`` puts it back at the same path
    inside the private one. Both the path and, for a symlink, its target count. The
    stage is made read-only here: a bind of it keeps that, so the copy put back inside
    the user's directory never has to be found again by a path the user controls.
    """
    staged = []
    wanted = dict.fromkeys(q for p in paths for q in (os.path.abspath(p), os.path.realpath(p)))
    for i, path in enumerate(wanted):
        if path.startswith(target + "/") and os.path.isdir(path):
            stage = f"/dev/.gpuhub-keep-{target.strip('/').replace('/', '-')}-{i}"
            os.mkdir(stage, 0o700)
            _mount(path, stage, None, MS_BIND | MS_REC)
            _mount(None, stage, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            staged.append((path, stage))
    return staged


def _restore_staged(target: str, staged: list[tuple[str, str]]) -> None:
    """Put staged software back at its path inside ``target`` (now the user's private tmp).

    The user owns what is in there: every directory on the way is opened or made without
    following links, and the bind goes onto the opened directory itself.
    """
    for path, stage in staged:
        fd = open_dir_nofollow(target, path[len(target) :], create=True)
        try:
            _mount(stage, f"/proc/self/fd/{fd}", None, MS_BIND | MS_REC)
        finally:
            os.close(fd)
        _check(_libc.umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)


def enter(spec: dict) -> None:
    """Everything before ``exec``: cgroups, network, mounts, identity. Raises on any failure."""
    for procs in spec.get("cgroup_procs", []):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    netns = spec.get("netns")
    if netns:  # the user's network namespace (root's /run/netns/<account>): the wall around the user
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns({netns})")
        finally:
            os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    dev_dir = spec.get("dev_dir", "/dev")
    gpu_nodes = host_nodes(dev_dir, spec.get("gpu_nodes", []))
    grants = spec.get("grants")
    sources = open_grant_sources(grants)
    old = os.umask(0)
    try:
        build_dev(gpu_nodes)
        expose(spec.get("expose", []))
        if _per_mount_proc_options():
            # A /proc of its own: other users' processes are invisible (not just unreadable).
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        if os.path.realpath(dev_dir) != "/dev" and os.path.isdir(dev_dir):
            _mount("tmpfs", dev_dir, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=4k")
        home, visible = spec["home"], spec["visible_home"]
        if os.path.realpath(home) != os.path.realpath(visible):
            # The home itself is the user's: bound as the directory it is (a link is refused),
            # opened before the tmpfs below can cover it.
            home_fd = _open_own_dir(home, "home")
            try:
                parent = os.path.dirname(visible)
                _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
                os.mkdir(visible, 0o700)
                _mount(f"/proc/self/fd/{home_fd}", visible, None, MS_BIND)
            finally:
                os.close(home_fd)
            _mount(None, visible, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        resolv = spec.get("resolv_conf")
        if resolv:  # the machine's resolver is on its loopback, which the user's network has not
            _mount(resolv, "/etc/resolv.conf", None, MS_BIND)
            _mount(None, "/etc/resolv.conf", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        private_tmp = spec.get("tmp")
        if private_tmp:  # last: a home or stand-in tree under /tmp is bound or covered already
            for target in ("/var/tmp", "/tmp"):  # /tmp last: it hides the source below it
                if os.path.isdir(target):
                    kept = _stage_under(target, spec.get("expose", []))
                    tmp_fd = _open_own_dir(private_tmp, "private /tmp")
                    try:
                        _mount(f"/proc/self/fd/{tmp_fd}", target, None, MS_BIND)
                    finally:
                        os.close(tmp_fd)
                    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
                    _restore_staged(target, kept)  # inside the user's tmp: never follows a link
        if grants:
            mount_grants(grants, spec["uid"], spec["gid"], sources)
    finally:
        os.umask(old)
        for fd in sources.values():
            os.close(fd)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    os.chdir(spec["visible_home"])
    os.umask(0o022)


RUN_DIR = "/run/gpuhub"  # policy.model.RUN_DIR (this module imports nothing of gpuhub: it runs as root)
GRANTS_TMPFS_SIZE = "4m"


def open_grant_sources(grants: dict | None) -> dict[str, int]:
    """``O_PATH`` fds of the granted datasets' directories, opened before any mount of the
    sandbox's could hide them (a dataset under /tmp is covered by the private /tmp)."""
    fds: dict[str, int] = {}
    try:
        for entry in (grants or {}).get("data") or []:
            fds[entry["name"]] = _open_own_dir(entry["source"], f"dataset {entry['name']}")
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def mount_grants(grants: dict, uid: int, gid: int, sources: dict[str, int]) -> None:
    """Granted secrets and team data (policy ``secrets:``/``data:``), in this mount namespace only.

    A tmpfs over ``/run/gpuhub`` (the host's, root's, holds nothing of the user's and stays
    hidden) with ``secrets/<name>`` files (0400) in a 0500 directory, both the account's, and
    ``data/<name>`` bind mounts of the team's directories (read-only unless granted
    read-write), ``jupyter/kernels/<name>/kernel.json`` (root's, 0444) for each dataset that is
    a team environment (``kernel``); then the tmpfs is made read-only. Nobody else's mount namespace has them,
    and another account cannot enter this one (``/proc/<pid>/root`` needs ptrace rights).
    The values came on the pipe; nothing is written to a disk."""
    os.makedirs(RUN_DIR, 0o755, exist_ok=True)  # the mount point, on the host: root's, empty
    _mount("tmpfs", RUN_DIR, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode=0755,size={GRANTS_TMPFS_SIZE}")
    secrets = grants.get("secrets") or {}
    if secrets:
        sdir = f"{RUN_DIR}/secrets"
        os.mkdir(sdir, 0o500)
        for name, value in secrets.items():
            if not name or "/" in name or name in (".", ".."):
                raise OSError(f"secret name {name!r} is not a file name")
            fd = os.open(f"{sdir}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
            try:
                os.write(fd, value.encode())
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)
        os.chown(sdir, uid, gid)
    data = grants.get("data") or []
    if data:
        os.mkdir(f"{RUN_DIR}/data", 0o755)
    for entry in data:
        name, source = entry["name"], entry["source"]
        if not name or "/" in name or name in (".", ".."):
            raise OSError(f"dataset name {name!r} is not a file name")
        target = f"{RUN_DIR}/data/{name}"
        os.mkdir(target, 0o755)
        # The admin's directory (the hub checked it is under a root-only one): opened without
        # following a link (open_grant_sources), bound as the directory it is; no submounts.
        src_fd = sources.get(name)
        if src_fd is None:
            raise OSError(f"dataset {name} ({source}) was not opened")
        _mount(f"/proc/self/fd/{src_fd}", target, None, MS_BIND)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
        _mount(None, target, None, flags | (MS_RDONLY if entry.get("read_only", True) else 0))
    kernels = {e["name"]: e["kernel"] for e in data if e.get("kernel")}
    if kernels:  # team environments: a kernelspec each, root's, in the read-only tmpfs
        os.mkdir(f"{RUN_DIR}/jupyter", 0o755)  # (umask 0 here: modes as written)
        os.mkdir(f"{RUN_DIR}/jupyter/kernels", 0o755)
        for name, display in kernels.items():
            os.mkdir(f"{RUN_DIR}/jupyter/kernels/{name}", 0o755)
            path = f"{RUN_DIR}/jupyter/kernels/{name}/kernel.json"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
            try:
                os.write(fd, kernel_spec(f"{RUN_DIR}/data/{name}/bin/python", str(display), name).encode())
            finally:
                os.close(fd)
    _mount(None, RUN_DIR, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode=0755,size={GRANTS_TMPFS_SIZE}")


def kernel_spec(python: str, display: str, name: str) -> str:
    """The ``kernel.json`` of a team environment (policy ``data[].kernel``): its own Python runs
    ipykernel, which the admin installed into it (docs/own-packages.md)."""
    return json.dumps(
        {
            "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": display,
            "language": "python",
            "metadata": {"gpuhub": {"team_environment": name}},
        }
    )


def _open_own_dir(path: str, what: str) -> int:
    """An ``O_PATH`` fd of ``path``, a directory the hub made (its parent is root's), not a link."""
    try:
        return os.open(path, _DIR_NOFOLLOW)
    except NotADirectoryError:
        raise UnsafePath(f"the {what} {path} is a symbolic link or not a directory; refusing to use it") from None


def read_payload(fd: int) -> tuple[dict, dict[str, str]]:
    """The spec and the environment the hub wrote on pipe ``fd`` (read to its end, then closed)."""
    chunks, size = [], 0
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_PAYLOAD:
                raise ValueError(f"spec larger than {MAX_PAYLOAD} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    payload = json.loads(b"".join(chunks))
    if not isinstance(payload, dict):
        raise ValueError("the payload must be an object")
    spec, env = payload.get("spec"), payload.get("env")
    if not isinstance(spec, dict) or not isinstance(env, dict):
        raise ValueError("spec and env must be objects")
    for key, value in env.items():
        if not isinstance(value, str) or not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(f"environment variable {key!r} is not a name=string pair")
    return spec, env


def start_launcher(cmd: list[str], spec: dict, env: dict[str, str], popen: dict):
    """Start ``cmd`` in its sandbox (hub side): ``(Popen, write fd, payload)``.

    The launcher runs as root with ``LAUNCHER_ENV`` only; ``spec`` and ``env`` travel on a
    pipe it inherits (``pass_fds``), written by ``hand_over`` without blocking the loop.
    Other ``popen`` arguments (stdout, stderr, pass_fds of the caller) are kept.
    """
    from subprocess import Popen

    payload = json.dumps({"spec": spec, "env": env}).encode()
    rfd, wfd = os.pipe()  # both close-on-exec; only rfd is passed, to this child alone
    try:
        kwargs = dict(popen, env=dict(LAUNCHER_ENV), pass_fds=(*popen.get("pass_fds", ()), rfd))
        launcher = [sys.executable, "-I", "-m", "gpuhub_spawner.local.sandbox", "--spec-fd", str(rfd), "--"]
        proc = Popen([*launcher, *cmd], **kwargs)
    except BaseException:
        os.close(wfd)
        raise
    finally:
        os.close(rfd)
    return proc, wfd, payload


async def hand_over(proc, wfd: int, payload: bytes, timeout: float = HAND_OVER_TIMEOUT) -> None:
    """Write ``payload`` to the launcher's pipe from the event loop (non-blocking), then close it.

    A launcher that died first is left to the caller's exit handling (its stderr says why);
    one that does not read within ``timeout`` is killed and the start fails.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    view = memoryview(payload)

    async def write_loop():
        nonlocal view
        while view.nbytes:
            try:
                n = os.write(wfd, view)
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(wfd, lambda ready=ready: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    loop.remove_writer(wfd)
                continue
            view = view[n:]

    os.set_blocking(wfd, False)
    try:
        # Not wait_for: in 3.11 it returns when the write is done as a cancel comes (the start
        # cancelled: the user left), and the cancelled start went on to run the server.
        async with asyncio.timeout(timeout):
            await write_loop()
    except BrokenPipeError:
        pass  # the launcher is gone before reading: its exit is seen by the caller
    except TimeoutError:
        proc.kill()
        raise RuntimeError(f"the sandbox launcher (pid {proc.pid}) did not read its spec in {timeout:.0f} s") from None
    finally:
        os.close(wfd)


def main(argv: list[str]) -> int:
    env = None
    if len(argv) >= 4 and argv[0] == "--spec-fd" and argv[2] == "--" and argv[1].isdigit():
        # The hub's way: spec and environment on an inherited pipe.
        cmd = argv[3:]
        try:
            spec, env = read_payload(int(argv[1]))
        except (OSError, ValueError) as e:
            print(f"gpuhub sandbox: cannot read the server's spec: {e}", file=sys.stderr)
            return 125
    elif len(argv) >= 3 and argv[1] == "--":
        # Tools and benchmarks (tests/device, tests/benchmarks): a spec on argv, and the
        # command runs with this process's own environment, as the caller chose it.
        spec, cmd = json.loads(argv[0]), argv[2:]
    else:
        print(
            "usage: python -I -m gpuhub_spawner.local.sandbox --spec-fd FD -- COMMAND...\n"
            "       python -I -m gpuhub_spawner.local.sandbox SPEC_JSON -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    try:
        enter(spec)
    except OSError as e:
        print(f"gpuhub sandbox: cannot isolate the server: {e}", file=sys.stderr)
        return 126
    try:
        if env is None:
            os.execvp(cmd[0], cmd)
        else:
            os.execvpe(cmd[0], cmd, env)  # the user's environment: only now, as the user
    except (OSError, ValueError) as e:
        print(f"gpuhub sandbox: cannot run {cmd[0]!r} as {spec['uid']}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
