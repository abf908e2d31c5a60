"""What isolation costs a spawn, and how fast a hub stops: run on demand, as root.

    .venv/bin/python tests/benchmarks/isolation_spawn.py [N]

Three real hubs in one run, same policy: ``isolation = off`` (servers as the hub's own
user), the isolated spawn without the wall (own Unix account, cgroup, private /dev;
``network_wall = off``) and the isolated spawn behind the wall (each user's own network
namespace, the default as root). Each user's first spawn on each hub (account, home, and
behind the wall the user's namespace and veth pair) is a warm-up, reported apart; then
spawns alternate between the hubs, N each (default 6); the figures are ratios of the medians. The profile's CPU quota is every core of the machine, so what is
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
    spec = json.dumps(
        {
            "uid": acct.uid,
            "gid": acct.gid,
            "home": home,
            "visible_home": home,
            "dev_dir": "/dev",
            "gpu_nodes": [],
            "cgroup_procs": [],
            "expose": [sys.base_prefix, sys.prefix],
        }
    )

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


def wall_setup_ms(n: int = 10) -> float:
    """What the wall adds to a user's first start: their namespace, pair, address, route."""
    from gpuhub_spawner.local.user_network import Wall

    wall = Wall.of("10.218.0.0/24", "bench-wall-")
    took = []
    try:
        wall.ensure_bridge()
        for i in range(n):
            t0 = time.perf_counter()
            wall.ensure_user(f"bench-wall-u{i}")
            took.append(time.perf_counter() - t0)
    finally:
        wall.remove_all()
    return statistics.median(took) * 1000


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
    plain = Hub(work / "plain", POLICY, extra_config="c.LocalGpuSpawner.isolation = 'off'\n", lab=True)
    isolated = Hub(work / "isolated", POLICY, extra_config="c.LocalGpuSpawner.network_wall = 'off'\n", lab=True)
    walled = Hub(work / "walled", POLICY, lab=True)
    hubs = {"no isolation": plain, "isolated, no wall": isolated, "isolated + wall": walled}
    times: dict[str, list[float]] = {k: [] for k in hubs}
    first: dict[str, list[float]] = {k: [] for k in hubs}
    users = ["alice", "bob", "carol"]
    try:
        for h in hubs.values():
            h.start()
        for name in users:  # first spawns: accounts, homes, the users' namespaces
            for label, h in hubs.items():
                first[label].append(spawn_once(h, name))
        for i in range(n):
            for label, h in hubs.items():
                times[label].append(spawn_once(h, users[i % len(users)]))
        # one running server each, then SIGTERM: how long until the hub is gone
        for h in hubs.values():
            u = h.login("bob")
            u.start("cpu")
            u.wait_ready()
        stops = {label: stop_seconds(h) for label, h in hubs.items()}
    finally:
        for h in hubs.values():
            h.stop()
    netns_ms = wall_setup_ms()
    direct, sandboxed = launcher_overhead()
    base = statistics.median(times["no isolation"])
    iso = statistics.median(times["isolated, no wall"])
    wall = statistics.median(times["isolated + wall"])
    print(f"spawn (POST -> ready), median of {n} each, same run:")
    for label, t in times.items():
        print(f"  {label:22s} {statistics.median(t):6.2f} s   (all: {', '.join(f'{x:.2f}' for x in t)})")
    print(f"  isolated / no isolation = {iso / base:.2f}x  (+{iso - base:.2f} s)")
    print(f"  walled / isolated       = {wall / iso:.2f}x  (+{wall - iso:.2f} s)")
    print(f"  walled / no isolation   = {wall / base:.2f}x  (+{wall - base:.2f} s)")
    print("each user's first spawn (account, home; behind the wall also the user's namespace), median of 3:")
    for label, t in first.items():
        print(f"  {label:22s} {statistics.median(t):6.2f} s   (all: {', '.join(f'{x:.2f}' for x in t)})")
    print(f"a user's namespace, veth pair, address and route made (Wall.ensure_user), median of 10: {netns_ms:.1f} ms")
    print(
        f"sandbox launcher alone: /bin/true {direct * 1000:.1f} ms direct, {sandboxed * 1000:.1f} ms through it "
        f"(+{(sandboxed - direct) * 1000:.0f} ms)"
    )
    print("SIGTERM -> hub exited (one server running, left running):")
    for label, s in stops.items():
        print(f"  {label:22s} {s:6.2f} s")
    return 0


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    sys.exit(main())
