"""Launch one single-user server inside its sandbox: ``python -I -m gpuhub_spawner.local.sandbox SPEC -- CMD...``.

Run by the hub as root; it ends by ``exec``-ing the server's command as the server's
unprivileged account, so the hub's pid *is* the server (signals, pidfd, restart
adoption work unchanged; bubblewrap would leave a monitor process in between).
In order:

1. join the server's cgroups (memory, CPU, devices), so every descendant is counted;
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
6. ``no_new_privs``, drop to the account (no supplementary groups), ``chdir`` home,
   ``exec``.

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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_PRIVATE, MS_SLAVE = 1 << 18, 1 << 19
PR_SET_NO_NEW_PRIVS = 38
MNT_DETACH = 2

# Character devices every process may use (the list container runtimes allow by default).
STANDARD_NODES = {
    "null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0),
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
    for link, target in {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                         "stderr": "/proc/self/fd/2"}.items():
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


def _stage_under(target: str, paths: list[str]) -> list[tuple[str, str]]:
    """Bind exposed software that lives under ``target`` (e.g. a venv in /tmp) aside.

    The private /tmp would hide it; ``_restore_staged`` puts it back, read-only, at the
    same path inside the private one. Both the path and, for a symlink, its target count.
    """
    staged = []
    wanted = dict.fromkeys(q for p in paths for q in (os.path.abspath(p), os.path.realpath(p)))
    for i, path in enumerate(wanted):
        if path.startswith(target + "/") and os.path.isdir(path):
            stage = f"/dev/.gpuhub-keep-{target.strip('/').replace('/', '-')}-{i}"
            os.mkdir(stage, 0o700)
            _mount(path, stage, None, MS_BIND | MS_REC)
            staged.append((path, stage))
    return staged


def _restore_staged(staged: list[tuple[str, str]]) -> None:
    for path, stage in staged:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(stage, path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        _check(_libc.umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)


def enter(spec: dict) -> None:
    """Everything before ``exec``: cgroups, mounts, identity. Raises on any failure."""
    for procs in spec.get("cgroup_procs", []):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    dev_dir = spec.get("dev_dir", "/dev")
    gpu_nodes = host_nodes(dev_dir, spec.get("gpu_nodes", []))
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
            parent = os.path.dirname(visible)
            _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            os.mkdir(visible, 0o700)
            _mount(home, visible, None, MS_BIND)
            _mount(None, visible, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        private_tmp = spec.get("tmp")
        if private_tmp:  # last: a home or stand-in tree under /tmp is bound or covered already
            for target in ("/var/tmp", "/tmp"):  # /tmp last: it hides the source below it
                if os.path.isdir(target):
                    kept = _stage_under(target, spec.get("expose", []))
                    _mount(private_tmp, target, None, MS_BIND)
                    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
                    _restore_staged(kept)
    finally:
        os.umask(old)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    os.chdir(spec["visible_home"])
    os.umask(0o022)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I -m gpuhub_spawner.local.sandbox SPEC_JSON -- COMMAND...", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    cmd = argv[2:]
    try:
        enter(spec)
    except OSError as e:
        print(f"gpuhub sandbox: cannot isolate the server: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"gpuhub sandbox: cannot run {cmd[0]!r} as {spec['uid']}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
