"""What isolation costs a spawn, and how fast a hub stops: run on demand, as root.

    .venv/bin/python tests/benchmarks/isolation_spawn.py [N]

Two real hubs in one run, same policy: ``isolation = off`` (today's spawn before this
work: servers as the hub's own user) and the isolated spawn (own Unix account, cgroup,
private /dev). Spawns alternate between them, N each (default 6); the figure is the
ratio of the medians. The profile's CPU quota is every core of the machine, so what is
measured is the isolation, not a CPU quota slowing the server's start. Also: the sandbox launcher alone (``/bin/true`` through it vs
directly), and the seconds from SIGTERM to exit of each hub with a running server
(the hub, its proxy, culler and services).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import conftest  # noqa: E402,F401  (the test client resolves *.localhost and keeps its cookies like a browser)
from support.hub import Hub  # noqa: E402

POLICY = """\
flavors:
  - {name: gpu, displayName: Tesla, local: {virtual: 2}}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 2}}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 2}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: "%d", memory: 2Gi}
""" % (os.cpu_count() or 1)  # a quota of every core: the figure is isolation's cost, not the quota's


def spawn_once(hub: Hub, name: str) -> float:
    user = hub.login(name)
    t0 = time.perf_counter()
    r = user.start("cpu")
    assert r.status_code in (201, 202), r.text
    user.wait_ready(timeout=120)
    took = time.perf_counter() - t0
    user.stop()
    user.wait_gone()
    return took


def launcher_overhead(n: int = 20) -> tuple[float, float]:
    from gpuhub_spawner.local.unix_users import ensure_account, remove_accounts

    prefix = "bench-"
    acct = ensure_account("launcher", prefix)
    home = tempfile.mkdtemp()
    os.chown(home, acct.uid, acct.gid)
    spec = json.dumps({"uid": acct.uid, "gid": acct.gid, "home": home, "visible_home": home, "dev_dir": "/dev",
                       "gpu_nodes": [], "cgroup_procs": [], "expose": [sys.base_prefix, sys.prefix]})

    def timed(cmd):
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            t.append(time.perf_counter() - t0)
        return statistics.median(t)

    try:
        direct = timed(["/bin/true"])
        sandboxed = timed([sys.executable, "-I", "-m", "gpuhub_spawner.local.sandbox", spec, "--", "/bin/true"])
    finally:
        remove_accounts(prefix)
    return direct, sandboxed


def stop_seconds(hub: Hub) -> float:
    t0 = time.perf_counter()
    hub.proc.send_signal(signal.SIGTERM)
    hub.proc.wait(120)
    return time.perf_counter() - t0


def main() -> int:
    if os.geteuid() != 0:
        print("run as root: isolation needs it", file=sys.stderr)
        return 2
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    work = Path(tempfile.mkdtemp(prefix="gpuhub-bench-"))
    plain = Hub(work / "plain", POLICY, extra_config="c.LocalGpuSpawner.isolation = 'off'\n")
    isolated = Hub(work / "isolated", POLICY)
    hubs = {"today (no isolation)": plain, "isolated": isolated}
    times: dict[str, list[float]] = {k: [] for k in hubs}
    try:
        for h in hubs.values():
            h.start()
        users = ["alice", "bob", "carol"]
        for i in range(n + 1):
            for label, h in hubs.items():
                took = spawn_once(h, users[i % len(users)])
                if i:  # the first spawn of each hub warms caches (and makes the accounts)
                    times[label].append(took)
        # one running server each, then SIGTERM: how long until the hub is gone
        for h in hubs.values():
            u = h.login("bob")
            u.start("cpu")
            u.wait_ready()
        stops = {label: stop_seconds(h) for label, h in hubs.items()}
    finally:
        for h in hubs.values():
            h.stop()
    direct, sandboxed = launcher_overhead()
    base = statistics.median(times["today (no isolation)"])
    iso = statistics.median(times["isolated"])
    print(f"spawn (POST -> ready), median of {n} each, same run:")
    for label, t in times.items():
        print(f"  {label:22s} {statistics.median(t):6.2f} s   (all: {', '.join(f'{x:.2f}' for x in t)})")
    print(f"  isolated / today = {iso / base:.2f}x  (+{iso - base:.2f} s)")
    print(f"sandbox launcher alone: /bin/true {direct * 1000:.1f} ms direct, {sandboxed * 1000:.1f} ms through it "
          f"(+{(sandboxed - direct) * 1000:.0f} ms)")
    print("SIGTERM -> hub exited (one server running, left running):")
    for label, s in stops.items():
        print(f"  {label:22s} {s:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
