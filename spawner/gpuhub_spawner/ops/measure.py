"""What a load test measures beside its own clients' figures (``gpuhub loadtest``).

The hub's CPU and memory come from its own ``process_*`` series on ``/hub/metrics``
(prometheus_client's process collector: the same on one machine and in a pod); the wait for
admission per team from gpuhub's histogram ``gpuhub_team_admission_wait_seconds``, read before
and after the run; the proxy's CPU and memory from ``/proc`` when it runs on this machine
(found by the port it listens on).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections import defaultdict


def parse_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"cpu": None, "rss": None, "waits": defaultdict(dict)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "process_cpu_seconds_total":
                out["cpu"] = s.value
            elif s.name == "process_resident_memory_bytes":
                out["rss"] = s.value
            elif s.name == "gpuhub_team_admission_wait_seconds_bucket":
                out["waits"][s.labels.get("team", "?")][float(s.labels["le"])] = s.value
            elif s.name in ("gpuhub_team_admission_wait_seconds_sum", "gpuhub_team_admission_wait_seconds_count"):
                out["waits"][s.labels.get("team", "?")][s.name.rsplit("_", 1)[1]] = s.value
    return out


def pid_listening_on(port: int, proc: str = "/proc") -> int | None:
    """The process listening on a local TCP port (the proxy's public port), from /proc."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except (OSError, StopIteration):
            continue
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            for fd in os.listdir(f"{proc}/{pid}/fd"):
                if os.readlink(f"{proc}/{pid}/fd/{fd}") in wanted:
                    return int(pid)
        except OSError:
            continue
    return None


def proc_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of a process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, rss_pages * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Reads the hub's metrics (and the local proxy's /proc) every few seconds during the run."""

    def __init__(self, api, every: float, proxy_pid: int | None):  # api: loadtest.Api
        self.api, self.every, self.proxy_pid = api, every, proxy_pid
        self.first: dict | None = None
        self.last: dict | None = None
        self.hub_rss_max = 0.0
        self.proxy_first: tuple[float, float] | None = None  # (when, CPU seconds)
        self.proxy_last: tuple[float, float] | None = None
        self.proxy_rss_max = 0
        self.t_first = self.t_last = 0.0
        self.unreadable: str | None = None

    async def sample(self) -> None:
        now = time.monotonic()
        try:
            r = await self.api.fetch("GET", f"{self.api.hub_url}/hub/metrics", count=False)
            if r.code == 200:
                m = parse_metrics(r.body.decode())
                if self.first is None:
                    self.first, self.t_first = m, now
                self.last, self.t_last = m, now
                self.hub_rss_max = max(self.hub_rss_max, m["rss"] or 0)
            else:
                self.unreadable = f"/hub/metrics answered {r.code} (the token needs read:metrics)"
        except Exception as e:  # noqa: BLE001 - a missed sample is not a failed run
            self.unreadable = f"/hub/metrics: {type(e).__name__}"
        if self.proxy_pid:
            usage = proc_usage(self.proxy_pid)
            if usage:
                self.proxy_first = self.proxy_first or (now, usage[0])
                self.proxy_last = (now, usage[0])
                self.proxy_rss_max = max(self.proxy_rss_max, usage[1])

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every)

    def hub_figures(self) -> dict | None:
        if not self.first or not self.last or self.first["cpu"] is None:
            return None
        wall = max(1e-6, self.t_last - self.t_first)
        return {
            "cpu_cores_mean": round((self.last["cpu"] - self.first["cpu"]) / wall, 3),
            "rss_max_mib": round(self.hub_rss_max / 2**20, 1),
        }

    def proxy_figures(self) -> dict | None:
        if not self.proxy_first or not self.proxy_last:
            return None
        wall = max(1e-6, self.proxy_last[0] - self.proxy_first[0])
        return {
            "pid": self.proxy_pid,
            "cpu_cores_mean": round((self.proxy_last[1] - self.proxy_first[1]) / wall, 3),
            "rss_max_mib": round(self.proxy_rss_max / 2**20, 1),
        }

    def waits(self) -> dict:
        """Per team: admissions during the run, their mean wait and p95 (from the histogram's buckets)."""
        if not self.first or not self.last:
            return {}
        out = {}
        for team, after in self.last["waits"].items():
            before = self.first["waits"].get(team, {})
            n = after.get("count", 0) - before.get("count", 0)
            if n <= 0:
                continue
            total = after.get("sum", 0) - before.get("sum", 0)
            buckets = sorted((le, after[le] - before.get(le, 0)) for le in after if isinstance(le, float))
            out[team] = {"admitted": int(n), "mean_seconds": round(total / n, 3), "p95_seconds": bucket_quantile(0.95, buckets)}
        return out


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (le, count) buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            width = count - lower_count
            return round(lower_le + (le - lower_le) * ((rank - lower_count) / width if width else 1.0), 3)
        lower_le, lower_count = le, count
    return None


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"n": len(values), "median": round(statistics.median(ordered), 3), "p95": round(p95, 3), "max": round(ordered[-1], 3)}
