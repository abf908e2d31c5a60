"""Where a machine's CPU goes while a hub works: the hub's loop, its threads, its children.

``crowd.py storm --cpu`` runs one beside every hub. A thread reads ``/proc`` every
``interval`` seconds: the CPU time (user + system) of each thread of the hub process, of
every process below the hub (the proxy, launchers, servers), of the machine as a whole
(``/proc/stat``) and of the benchmark process itself (the crowd's clients and the probes).
Between the window's first and last reading it adds up, per kind of process, what each one
used; a process that ended in the window is counted through the hub's ``cutime`` (its
reaped children) as ``reaped``, since its own entry is gone.

A launcher that ``exec``\\s its server keeps its pid: an isolated server's CPU includes its
launcher's (``python -I -m gpuhub_spawner.local.sandbox``), which is what it costs in the
place of the stock hub's fork. Nothing here is attributed by guess: a process is put in a
kind by its command line as read at the last sample.

Two figures say whether the hub had to wait for the machine: how long its main thread (the
event loop) waited in the kernel's run queue while runnable (``/proc/PID/task/PID/schedstat``)
and the mean number of runnable threads on the machine (``procs_running``).

Why: the 200-user equal-work storm answered the hub API 5x slower than the stock hub's
with the loop holding only a tenth of the window; whether the rest of the machine was
saturated, and by what, decides where to look next.
"""

from __future__ import annotations

import os
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")
# report() keys that are not CPU seconds used by a kind of process
NOT_CPU = ("window_s", "machine busy", "machine capacity", "loop waited for a CPU", "runnable threads (mean)")


def _stat(path: str) -> tuple[str, int, int, int, int, int] | None:
    """(comm, ppid, utime, stime, cutime+cstime, starttime) in clock ticks, or None if gone."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    # fields after comm: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14) ... starttime(19)
    return comm, int(rest[1]), int(rest[11]), int(rest[12]), int(rest[13]) + int(rest[14]), int(rest[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _run_delay(pid: int) -> float:
    """Seconds the process's main thread (the hub's event loop) has waited for a CPU while runnable."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _procs_running() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running "):
                return int(line.split()[1])
    return 0


def kind(cmdline: str, comm: str) -> str:
    if "configurable-http-proxy" in cmdline or "gpuhub-proxy" in cmdline:
        return "proxy"
    if "gpuhub_spawner.local.sandbox" in cmdline:
        return "launchers (before exec)"
    if "tiny_server" in cmdline or "jupyterhub-singleuser" in cmdline:
        return "servers (incl. their launcher)"
    return f"other: {comm}"


class CpuShare:
    """Samples the hub's process tree; ``report()`` gives CPU seconds per kind in the window."""

    def __init__(self, hub_pid: int, window: float, interval: float = 0.25):
        self.hub_pid, self.window, self.interval = hub_pid, window, interval
        self.running: list[int] = []  # runnable threads on the machine, per sample (procs_running)
        self.first: dict = {}
        self.last: dict = {}
        self.kinds: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict:
        procs = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(f"/proc/{name}/stat")
                if st is not None:
                    procs[int(name)] = st
        below = {self.hub_pid}
        grew = True
        while grew:  # every process whose parent chain reaches the hub
            grew = False
            for pid, st in procs.items():
                if pid not in below and st[1] in below:
                    below.add(pid)
                    grew = True
        out = {
            "t": time.monotonic(),
            "machine": _machine_busy(),
            "self": sum(os.times()[:2]),
            "loop wait": _run_delay(self.hub_pid),
        }
        self.running.append(_procs_running())
        hub = procs.get(self.hub_pid)
        if hub is not None:
            out["reaped"] = hub[4]
        threads = {}
        try:
            for tid in os.listdir(f"/proc/{self.hub_pid}/task"):
                st = _stat(f"/proc/{self.hub_pid}/task/{tid}/stat")
                if st is not None:
                    threads[int(tid), st[5]] = st[2] + st[3]
        except OSError:
            pass
        out["threads"] = threads
        children = {}
        for pid in below - {self.hub_pid}:
            st = procs[pid]
            key = (pid, st[5])
            children[key] = st[2] + st[3]
            self.kinds[key] = kind(_cmdline(pid), st[0])
        out["children"] = children
        return out

    def _run(self):
        end = self.first["t"] + self.window
        while not self._stop.wait(min(self.interval, max(0.0, end - time.monotonic()))):
            self.last = self._sample()
            if self.last["t"] >= end:
                return

    def start(self) -> "CpuShare":
        """Samples from now for ``window`` seconds (or until ``stop``)."""
        self.first = self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """The report of the window (waits for its end if it has not come)."""
        self._thread.join()
        return self.report()

    def report(self) -> dict:
        """CPU seconds in the window per kind, plus the window and the machine's capacity."""
        a, b = self.first, self.last
        seconds = b["t"] - a["t"]
        busy = (b["machine"][0] - a["machine"][0]) / TICK
        total = (b["machine"][1] - a["machine"][1]) / TICK
        out = {
            "window_s": seconds,
            "machine busy": busy,
            "machine capacity": total,
            "loop waited for a CPU": b["loop wait"] - a["loop wait"],
            "runnable threads (mean)": sum(self.running) / max(1, len(self.running)),
            "benchmark (clients, probes)": b["self"] - a["self"],
        }
        loop = other = 0
        for key, ticks in b["threads"].items():
            used = (ticks - a["threads"].get(key, 0)) / TICK
            if key[0] == self.hub_pid:
                loop += used
            else:
                other += used
        out["hub: loop thread"] = loop
        out["hub: other threads"] = other
        out["reaped (ended children)"] = (b.get("reaped", 0) - a.get("reaped", 0)) / TICK
        for key, ticks in b["children"].items():
            k = self.kinds.get(key, "other")
            if k.startswith("other: "):
                k = "other children"
            out[k] = out.get(k, 0) + (ticks - a["children"].get(key, 0)) / TICK
        counted = sum(v for k, v in out.items() if k not in NOT_CPU)
        out["rest of the machine"] = busy - counted
        return out
