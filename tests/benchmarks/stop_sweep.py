"""Isolated servers stopped together, and the hub's event loop meanwhile: run as root, on demand.

    .venv/bin/python tests/benchmarks/stop_sweep.py --before REV [--servers 20] [--rounds 3]

A stop ends with a sweep of the server's cgroup: every process the user left (kernels, a
background job) is killed, in rounds 20 ms apart, and the group is removed once the last of
them has exited (retried every 20 ms for up to 1 s). A culler pass stops its due servers
together, as here. Each round starts ``--servers`` isolated servers (``IsolatedProcessSpawner``
as the job launcher's ``JobProcess`` uses it, real accounts, cgroups and sandbox launcher),
each a shell that leaves ``--children`` processes behind its main one, then stops them all at
once while a probe coroutine measures the loop's gaps: the longest is what a user's request
would have waited. This tree and the package at ``--before`` (``git archive``, first on
``PYTHONPATH``) run in interleaved rounds, each in a process of its own; medians are printed
with the ratio now / before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from revisions import extract


def one(servers: int, children: int) -> dict:
    """One round in this process: start, then stop all together, probing the loop."""
    from gpuhub_spawner.local.isolation import process_uid, remove_isolation
    from gpuhub_spawner.local.job_launcher import JobProcess
    from gpuhub_spawner.local.service import held_prefix

    prefix = f"sw{uuid.uuid4().hex[:4]}-"
    home = tempfile.mkdtemp(prefix="stop-sweep-")
    leftovers = "sleep 300 & " * children

    def process(i: int) -> JobProcess:
        sp = JobProcess(
            user_name=f"u{i}",
            job_id=f"j{uuid.uuid4().hex[:6]}",
            argv=[],
            env={},
            devices=[],
            device_nodes=[],
            limits=(500, 2**28),
            account_prefix=prefix,
            home_dir_template=home + "/{account}",
        )
        sp.cmd = ["/bin/sh", "-c", leftovers + "exec sleep 300"]
        return sp

    async def main() -> dict:
        sps = [process(i) for i in range(servers)]
        for sp in sps:
            await sp.start()
        for sp in sps:  # running as its account, with its leftovers started
            while process_uid(sp.pid) != sp._account.uid or len(sp._cgroup.pids()) < children + 1:
                await asyncio.sleep(0.02)
        gaps: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        probing = asyncio.ensure_future(probe())
        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(sp.stop(now=True) for sp in sps))
        wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - c0
        done.set()
        await probing
        return {"wall_ms": wall * 1000, "loop_cpu_ms": loop_cpu * 1000, "longest_gap_ms": max(gaps) * 1000}

    try:
        return asyncio.run(main())
    finally:
        lock = held_prefix(prefix)
        if lock is not None:
            lock.release()
        remove_isolation(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=20)
    ap.add_argument("--children", type=int, default=2, help="processes each server leaves behind its main one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=None, help="also measure the package at this git revision")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a round, in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.servers, args.children)))
        return
    if os.geteuid() != 0:
        sys.exit("stop_sweep.py needs root (accounts, cgroups, the sandbox launcher)")
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subjects = {"now": env}
        if args.before:
            subjects[f"@{args.before}"] = dict(env, PYTHONPATH=str(extract(args.before, Path(tmp) / "before")))
        results: dict[str, list[dict]] = {name: [] for name in subjects}
        cmd = [sys.executable, __file__, "--one", "--servers", str(args.servers), "--children", str(args.children)]
        for _ in range(args.rounds):
            for name in random.sample(list(subjects), len(subjects)):
                out = subprocess.run(cmd, env=subjects[name], capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    sys.exit(f"{name}: round failed\n{out.stderr[-2000:]}")
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"{args.servers} isolated servers (each leaving {args.children} processes) stopped together, "
        f"{args.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f} at the end"
    )
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    for name, rs in results.items():
        each = ", ".join(f"{r['longest_gap_ms']:.0f}" for r in rs)
        print(
            f"  {name:>12}  longest loop gap median {med[name]['longest_gap_ms']:7.1f} ms (each: {each}); "
            f"stop-all wall {med[name]['wall_ms']:6.0f} ms; loop thread CPU {med[name]['loop_cpu_ms']:5.0f} ms"
        )
    if args.before:
        b = med[f"@{args.before}"]
        print(
            "  now / before: "
            + ", ".join(f"{k} {med['now'][k] / b[k]:.2f}x" for k in ("longest_gap_ms", "wall_ms", "loop_cpu_ms"))
        )


if __name__ == "__main__":
    main()
