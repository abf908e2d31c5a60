"""What one isolated launch costs, step by step: run as root, on demand.

    .venv/bin/python tests/benchmarks/launch_steps.py [N] [--ballast MiB]

Each of N launches does, timed one by one, what ``IsolatedProcessSpawner`` does to start a
server (``_launch_isolated``/``_prepare_and_launch``, ``local/isolation.py``): the account
check, the home, the GPU nodes' numbers, the cgroup's leftovers check, its creation with
limits, its counters and OOM eventfd, the private /tmp, the exposed software's paths, the
launcher's fork and exec (``start_launcher``), the hand-over of its spec; then the stop's
share (kill, remove the cgroup). Wall time (what the loop was held when the step ran on
it; the kernel's cgroup work sleeps, so wall > CPU) and this thread's CPU time, per step:
median and p95. The server is ``sleep``, the account one made for the run and removed after.

``--ballast`` grows this process first (MiB of live Python objects), so a fork (of a
hub-sized process) costs what it costs in a hub: a hub in a storm holds ~150-300 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


class Steps:
    def __init__(self):
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def __call__(self, name, fn, *args, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kw)
        self.wall.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        self.cpu.setdefault(name, []).append((time.thread_time() - c0) * 1000)
        return out


async def one(sp, steps: Steps):
    from gpuhub_spawner.local import sandbox
    from gpuhub_spawner.local.isolation import process_start_time, server_software_paths
    from gpuhub_spawner.local.unix_users import ensure_account, ensure_home

    sp._account = steps("account check (ensure_account)", ensure_account, sp.user.name, sp.account_prefix)
    steps("home (ensure_home)", ensure_home, sp.home_dir, sp._account)
    env = steps("environment (get_env)", sp.get_env)
    nodes = sp.device_nodes()
    found = steps("GPU nodes (host_nodes)", sandbox.host_nodes, sp.device_dir, nodes)
    cg = sp.cgroup_host.server(sp._cgroup_leaf())
    steps("leftovers check (_clear_leftovers)", sp._clear_leftovers, cg)
    steps(
        "cgroup create + limits (cg.create)",
        cg.create,
        memory=2**28,
        cpu_millis=500,
        device_rules=sp.device_rules(found),
        pids=sp.process_limit(),
    )
    steps("cgroup counters (oom_kills, pids.events)", lambda: (cg.oom_kills(), cg.pids_max_events()))
    oom_fd = steps("OOM eventfd (v1)", cg.oom_eventfd)
    tmp = steps("private /tmp (_private_tmp)", sp._private_tmp)
    expose = steps("software paths (server_software_paths)", server_software_paths)
    spec = {
        "uid": sp._account.uid,
        "gid": sp._account.gid,
        "home": sp.home_dir,
        "visible_home": sp.visible_home,
        "dev_dir": sp.device_dir,
        "gpu_nodes": nodes,
        "cgroup_procs": cg.procs_files(),
        "expose": expose,
        "tmp": tmp,
    }
    proc, wfd, payload = steps(
        "launcher fork+exec (start_launcher)",
        sandbox.start_launcher,
        ["/bin/sleep", "300"],
        spec,
        env,
        dict(start_new_session=True),
    )
    steps("start time (/proc/pid/stat)", process_start_time, proc.pid)
    t0, c0 = time.perf_counter(), time.thread_time()
    await sandbox.hand_over(proc, wfd, payload)
    steps.wall.setdefault("spec hand-over (hand_over)", []).append((time.perf_counter() - t0) * 1000)
    steps.cpu.setdefault("spec hand-over (hand_over)", []).append((time.thread_time() - c0) * 1000)
    for _ in range(500):  # the launcher joins the cgroup and execs sleep
        if cg.contains(proc.pid) and open(f"/proc/{proc.pid}/comm").read().strip() == "sleep":
            break
        await asyncio.sleep(0.01)
    if oom_fd is not None:
        os.close(oom_fd)
    steps("stop: kill the group (kill_all)", cg.kill_all)
    proc.wait()
    steps("stop: remove the cgroup (remove)", cg.remove)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", nargs="?", type=int, default=20)
    ap.add_argument("--ballast", type=int, default=200, help="MiB of live objects in this process first")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: isolated launches need accounts, cgroups and mounts")
    from types import SimpleNamespace

    from gpuhub_spawner.local.isolation import IsolatedProcessSpawner, remove_isolation
    from gpuhub_spawner.local.service import hold_account_prefix

    ballast = [bytes(1024) for _ in range(args.ballast * 1024)]  # noqa: F841  (kept alive: the fork copies its page tables)
    prefix = f"b{uuid.uuid4().hex[:6]}-"
    lock = hold_account_prefix(prefix)
    steps = Steps()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(args.n):
                sp = IsolatedProcessSpawner(
                    user=SimpleNamespace(name=f"u{i % 4}", url="/", escaped_name=f"u{i % 4}"),
                    account_prefix=prefix,
                    home_dir_template=tmp + "/{account}",
                )
                sp.cmd = ["/bin/sleep", "300"]
                sp.get_env = lambda: {"PATH": "/usr/bin:/bin", "HOME": "/"}
                asyncio.run(one(sp, steps))
        finally:
            lock.release()
            remove_isolation(prefix)
            from support.hub import remove_private_tmps

            remove_private_tmps(prefix)
    print(
        f"\none isolated launch, step by step: {args.n} launches (4 accounts, made on the first), this process "
        f"~{args.ballast} MiB bigger; load average {os.getloadavg()[0]:.1f}"
    )
    total = 0.0
    for name, wall in steps.wall.items():
        cpu = steps.cpu[name]
        total += statistics.median(wall) if not name.startswith("stop") else 0.0
        print(
            f"  {name:44} wall median {statistics.median(wall):7.2f} ms  p95 {pct(wall, 95):7.2f} | "
            f"CPU median {statistics.median(cpu):6.2f} ms"
        )
    print(f"  sum of the start's medians: {total:.1f} ms (the stop's two steps apart)")


if __name__ == "__main__":
    main()
