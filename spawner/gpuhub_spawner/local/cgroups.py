"""One cgroup per single-user server: the profile's memory and CPU, enforced by the kernel.

Written straight to cgroupfs, v2 (unified) or v1 (one hierarchy per controller), under
a ``gpuhub`` group at the top of each hierarchy — outside the hub's own (systemd)
unit, so servers outlive a hub restart or upgrade with their limits intact. The same
code runs with or without systemd as PID 1.

- memory: ``memory.max`` (v2) / ``memory.limit_in_bytes`` (v1), swap off for the group.
  A server that goes over is killed as a whole: ``memory.oom.group`` on v2; on v1 the
  hub gets the kernel's OOM eventfd notification and kills the group itself. The OOM
  counter tells the spawner why the server stopped.
- CPU: ``cpu.max`` (v2) / CFS quota (v1), ``cpu_millis`` per 100 ms period.
- processes: ``pids.max`` (v2 and v1), the policy's ``maxProcesses``: the kernel refuses a
  fork or a new thread beyond it, so a fork bomb stops there instead of filling the
  machine's pid space. Its ``max`` counter in ``pids.events`` tells the hub it happened.
  Three levels: each server or job (``maxProcesses``), each user's group holding all of the
  user's servers, jobs and Ray clusters (``defaults.maxProcessesPerUser``; ``gpuhub/<account>.user/``),
  and all of them together (the machine's ``pid_max`` less a reserve for root: ``cap_processes``).
- devices (v1 only): an allow-list of the standard nodes plus the server's GPUs, a
  second wall behind the sandbox's private ``/dev``. cgroup v2 has no device files
  (it needs an eBPF program), so there the private ``/dev`` is the wall.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("JupyterHub.gpuhub.cgroups")

PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "cpu", "devices", "pids")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _mkdir_under(d: Path, prepare_parent=None) -> None:
    """``d`` and its parent (a user's group; ``prepare_parent`` sets it up), made again if the
    user's last server removed the parent meanwhile (``remove_user_group_if_empty`` on another
    thread)."""
    for _ in range(5):
        try:
            d.parent.mkdir(exist_ok=True)
            if prepare_parent is not None:
                prepare_parent(d.parent)
            d.mkdir(exist_ok=True)
            return
        except FileNotFoundError:
            continue
    d.mkdir(exist_ok=True)  # raises, saying where


def _hand_down_controllers(up: Path) -> None:
    """v2: a user's group hands memory, cpu and pids down, or its servers' groups have no limits."""
    want = {"memory", "cpu", "pids"} & set(_read(up / "cgroup.controllers").split())
    for c in sorted(want - set(_read(up / "cgroup.subtree_control").split())):
        _write(up / "cgroup.subtree_control", f"+{c}")


@dataclass
class CgroupHost:
    """What this machine offers: ``version`` 2, 1 or 0 (no usable cgroups)."""

    root: Path = Path("/sys/fs/cgroup")
    version: int = 0
    group: str = "gpuhub"
    v1_mounts: dict[str, Path] = field(default_factory=dict)

    problem: str = ""

    @classmethod
    def detect(cls, root: str = "/sys/fs/cgroup", group: str = "gpuhub") -> "CgroupHost":
        """What this machine offers, after trying to make the ``group`` (so problems show at start)."""
        r = Path(root)
        controllers = _read(r / "cgroup.controllers").split()
        mounts = {c: r / c for c in V1_CONTROLLERS if (r / c / "cgroup.procs").exists()}
        if "memory" in controllers and "cpu" in controllers:
            host = cls(r, 2, group)
        elif "memory" in mounts and "cpu" in mounts:
            host = cls(r, 1, group, mounts)
        else:
            return cls(r, 0, group, problem="no cgroup v2 with memory+cpu, nor v1 memory and cpu hierarchies")
        try:
            if host.version == 2:
                host._v2_parent()
            else:
                for m in mounts.values():
                    (m / group).mkdir(exist_ok=True)
        except OSError as e:
            return cls(r, 0, group, problem=f"cannot make {group} cgroups: {e}")
        return host

    @property
    def has_pids(self) -> bool:
        """Can process limits be enforced (a pids controller for the servers' groups)?"""
        if self.version == 2:
            return "pids" in _read(self.root / self.group / "cgroup.subtree_control").split()
        return self.version == 1 and "pids" in self.v1_mounts

    def describe(self) -> str:
        nopids = "" if self.has_pids else "; no pids controller: process limits are NOT enforced"
        if self.version == 2:
            return f"cgroup v2 at {self.root}/{self.group}{nopids}"
        if self.version == 1:
            return f"cgroup v1 ({', '.join(sorted(self.v1_mounts))}) under {self.group}/{nopids}"
        return f"no usable cgroups ({self.problem}): memory, CPU and process limits are NOT enforced"

    def _v2_parent(self) -> Path:
        root_has = set(_read(self.root / "cgroup.subtree_control").split())
        for c in ("memory", "cpu", "pids"):
            if c not in root_has and c in _read(self.root / "cgroup.controllers").split():
                _write(self.root / "cgroup.subtree_control", f"+{c}")  # systemd hosts have them on already
        parent = self.root / self.group
        if not parent.is_dir():
            parent.mkdir(exist_ok=True)
        want = {"memory", "cpu", "pids"} & set(_read(parent / "cgroup.controllers").split())
        have = set(_read(parent / "cgroup.subtree_control").split())
        for c in sorted(want - have):
            _write(parent / "cgroup.subtree_control", f"+{c}")
        return parent

    def weigh_servers(self, weight: float) -> None:
        """Set the CPU weight of the ``group`` (every server together) against its siblings.

        ``weight`` is relative to the kernel's default (1.0: like one ordinary process beside
        the group on v1, like a default sibling group on v2): v1 ``cpu.shares`` of 1024 x
        weight, v2 ``cpu.weight`` of 100 x weight. It only matters while the CPUs are
        contended, and then decides who runs first: at 1024 the hub's event loop waited 9.4 s
        of a 40 s, 200-user storm for a CPU behind the servers' start-ups, at 128 5.4 s; but at
        128 eight processes at nice 19 made a spawn 6.8x slower (docs/benchmarks.md). Raises
        OSError.
        """
        if self.version == 2:
            _write(self.root / self.group / "cpu.weight", str(min(10000, max(1, round(100 * weight)))))
        elif self.version == 1 and "cpu" in self.v1_mounts:
            _write(self.v1_mounts["cpu"] / self.group / "cpu.shares", str(min(262144, max(2, round(1024 * weight)))))

    def server(self, name: str, user: str | None = None) -> "ServerCgroup":
        """The cgroup of one server (``name``: a safe, unique leaf name), under its user's
        group ``user`` (every server, job and Ray cluster of one user together) where given."""
        rel = f"{user}/{name}" if user else name
        if self.version == 2:
            return ServerCgroup(self, {"unified": self.root / self.group / rel})
        if self.version == 1:
            return ServerCgroup(self, {c: m / self.group / rel for c, m in self.v1_mounts.items()})
        return ServerCgroup(self, {})

    def cap_processes(self, reserve_fraction: float = 0.125, reserve_min: int = 1024) -> int | None:
        """The most tasks all servers and jobs together may hold (the ``group``'s ``pids.max``):
        the kernel's ``pid_max`` less a reserve for everything else, root's repairs included
        (an eighth, at least 1,024). Returns the cap; None where no pids controller is there.
        Raises OSError."""
        d = (self.root / self.group) if self.version == 2 else self.v1_mounts.get("pids", Path("/nonexistent")) / self.group
        if not (d / "pids.max").exists():
            return None
        try:
            pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            return None
        cap = max(64, pid_max - max(reserve_min, int(pid_max * reserve_fraction)))
        if _read(d / "pids.max").strip() != str(cap):
            _write(d / "pids.max", str(cap))
        return cap


@dataclass
class ServerCgroup:
    host: CgroupHost
    paths: dict[str, Path]  # controller ("unified" on v2) -> directory

    @property
    def enforced(self) -> bool:
        return bool(self.paths)

    def to_state(self) -> dict:
        return {k: str(v) for k, v in self.paths.items()}

    @classmethod
    def from_state(cls, host: CgroupHost, state: dict) -> "ServerCgroup":
        return cls(host, {k: Path(v) for k, v in (state or {}).items()})

    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths.values()]

    def create(
        self,
        *,
        memory: int | None,
        cpu_millis: int | None,
        device_rules: list[str] | None,
        pids: int | None = None,
        user_pids: int | None = None,
    ) -> None:
        """Make the group(s) and set the limits; an existing group (stale) is reused empty.

        ``pids``: most tasks (processes and threads) the group may hold; None leaves it unlimited.
        ``user_pids``: the same for its user's group (the parent, where the group has one:
        ``CgroupHost.server(name, user)``), which every server and job of the user shares.
        """
        nested = self._nested()
        if self.host.version == 2:
            self.host._v2_parent()
            d = self.paths["unified"]
            _mkdir_under(d, _hand_down_controllers if nested else None)
            if nested:
                self._set_pids(d.parent, user_pids)
            if memory:
                _write(d / "memory.max", str(memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "memory.oom.group", "1")
            if cpu_millis:
                _write(d / "cpu.max", f"{cpu_millis * PERIOD_US // 1000} {PERIOD_US}")
            self._set_pids(d, pids)
        elif self.host.version == 1:
            for d in self.paths.values():
                _mkdir_under(d)
            if nested and "pids" in self.paths:
                self._set_pids(self.paths["pids"].parent, user_pids)
            if memory:
                m = self.paths["memory"]
                _write(m / "memory.limit_in_bytes", str(memory))
                if (m / "memory.memsw.limit_in_bytes").exists():
                    _write(m / "memory.memsw.limit_in_bytes", str(memory))
                if (m / "memory.swappiness").exists():
                    try:
                        _write(m / "memory.swappiness", "0")
                    except OSError:
                        pass
            if cpu_millis:
                c = self.paths["cpu"]
                _write(c / "cpu.cfs_period_us", str(PERIOD_US))
                _write(c / "cpu.cfs_quota_us", str(cpu_millis * PERIOD_US // 1000))
            if device_rules is not None and "devices" in self.paths:
                d = self.paths["devices"]
                _write(d / "devices.deny", "a")
                for rule in device_rules:
                    _write(d / "devices.allow", rule)
            if "pids" in self.paths:
                self._set_pids(self.paths["pids"], pids)

    def _nested(self) -> bool:
        """Is this a server's group under its user's group (not directly under the ``group``)?"""
        return any(p.parent.name != self.host.group for p in self.paths.values())

    def user_pids_limit(self) -> int | None:
        """The ``pids.max`` of this group's user group; None when unlimited, absent or not nested."""
        d = self._pids_dir()
        if d is None or not self._nested():
            return None
        v = _read(d.parent / "pids.max").strip()
        return int(v) if v.isdigit() else None

    def pids_peak(self) -> int | None:
        """The most tasks the group has held at once (``pids.peak``, Linux 6.1+); None where unknown."""
        d = self._pids_dir()
        v = _read(d / "pids.peak").strip() if d else ""
        return int(v) if v.isdigit() else None

    def user_pids_max_events(self) -> int:
        """Forks refused at the user group's limit as its own ``pids.events`` counts them (where
        the kernel counts there: cgroup v1 counts a refusal in the forking task's group only)."""
        d = self._pids_dir()
        if d is None or not self._nested():
            return 0
        # Linux >= 6.13 (v2): pids.events counts the hits of every limit below too; .local, this group's own
        local = d.parent / "pids.events.local"
        return _keyed(_read(local if local.exists() else d.parent / "pids.events")).get("max", 0)

    def remove_user_group_if_empty(self) -> None:
        """Remove the user's group once its last server or job group is gone (a busy one stays)."""
        if not self._nested():
            return
        for p in self.paths.values():
            try:
                p.parent.rmdir()
            except OSError:
                pass  # another server or job of the user still has its group there

    def _set_pids(self, d: Path, pids: int | None) -> None:
        if not (d / "pids.max").exists():
            if pids:
                log.warning("no pids controller for %s: its limit of %s processes is NOT enforced", d, pids)
            return
        _write(d / "pids.max", str(int(pids)) if pids else "max")  # a reused group gets this one's

    # -- reading back -----------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Every process in the group (v1: in any of its hierarchies)."""
        found: set[int] = set()
        for p in self.paths.values():
            found.update(int(x) for x in _read(p / "cgroup.procs").split())
        return sorted(found)

    def _pids_dir(self) -> Path | None:
        d = self.paths.get("unified") or self.paths.get("pids")
        return d if d is not None and (d / "pids.max").exists() else None

    def pids_limit(self) -> int | None:
        """The group's ``pids.max``; None when unlimited or not enforced."""
        d = self._pids_dir()
        v = _read(d / "pids.max").strip() if d else ""
        return int(v) if v.isdigit() else None

    def pids_current(self) -> int | None:
        d = self._pids_dir()
        v = _read(d / "pids.current").strip() if d else ""
        return int(v) if v.isdigit() else None

    def pids_max_events(self) -> int:
        """How often a fork or new thread was refused for the group's ``pids.max`` (``pids.events``)."""
        d = self._pids_dir()
        return _keyed(_read(d / "pids.events")).get("max", 0) if d else 0

    def contains(self, pid: int) -> bool:
        return pid in self.pids()

    def oom_kills(self) -> int:
        if self.host.version == 2:
            ev = _keyed(_read(self.paths["unified"] / "memory.events"))
            return max(ev.get("oom_kill", 0), ev.get("oom_group_kill", 0))
        if self.host.version == 1:
            return _keyed(_read(self.paths["memory"] / "memory.oom_control")).get("oom_kill", 0)
        return 0

    def memory_limit(self) -> int | None:
        if self.host.version == 2:
            v = _read(self.paths["unified"] / "memory.max").strip()
        elif self.host.version == 1:
            v = _read(self.paths["memory"] / "memory.limit_in_bytes").strip()
        else:
            return None
        return int(v) if v.isdigit() else None

    def cpu_quota(self) -> tuple[int, int] | None:
        """(quota_us, period_us), or None when unlimited or not enforced."""
        if self.host.version == 2:
            q, _, p = _read(self.paths["unified"] / "cpu.max").strip().partition(" ")
        elif self.host.version == 1:
            q = _read(self.paths["cpu"] / "cpu.cfs_quota_us").strip()
            p = _read(self.paths["cpu"] / "cpu.cfs_period_us").strip()
        else:
            return None
        return (int(q), int(p)) if q.lstrip("-").isdigit() and int(q) > 0 and p.isdigit() else None

    # -- OOM notification (v1) ---------------------------------------------------------------
    def oom_eventfd(self) -> int | None:
        """An eventfd that becomes readable when the kernel hits this group's memory limit (v1)."""
        if self.host.version != 1 or not hasattr(os, "eventfd"):
            return None
        m = self.paths["memory"]
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        ofd = os.open(m / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(m / "cgroup.event_control", f"{efd} {ofd}")
        except OSError:
            os.close(efd)
            return None
        finally:
            os.close(ofd)
        return efd

    # -- the end ------------------------------------------------------------------------------
    def kill_all(self) -> int:
        """SIGKILL every process in the group (v2: ``cgroup.kill``); how many were signalled."""
        if self.host.version == 2 and (self.paths["unified"] / "cgroup.kill").exists():
            n = len(self.pids())
            try:
                _write(self.paths["unified"] / "cgroup.kill", "1")
            except OSError:
                pass
            return n
        n = 0
        for _ in range(5):  # processes may fork while being killed
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return n

    def remove(self) -> None:
        """Remove the (empty) group; a group with processes left is kept and logged."""
        for d in self.paths.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: the last processes are still exiting
                    time.sleep(0.02)
            else:
                log.warning("cgroup %s still busy; left in place", d)
