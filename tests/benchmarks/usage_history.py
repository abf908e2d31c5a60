"""What usage history and the audit trail cost the hub's event loop per queue event.

The same storm of queue events (N requests submitted into a 4-GPU team, then released one
by one, each release admitting the next) runs twice in one process: with a bare
``AdmissionQueue`` (baseline) and with a ``UsageRecorder`` attached (SQLite history on disk
in a temporary directory, JSON-lines audit file). Reported: time on the event loop per
event and the ratio to the baseline; then how long the history thread needs to finish
writing (it runs off the loop), and a read of the whole history (page/CSV cost).

    .venv/bin/python tests/benchmarks/usage_history.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.quota import demand_for
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.store import PolicyStatus
from gpuhub_spawner.usage.history import summarize
from gpuhub_spawner.usage.recorder import UsageRecorder

POLICY = parse_policy("""
flavors: [{name: gpu, local: {virtual: 4}}]
teams: [{name: crowd, groups: [crowd], quota: {gpus: {gpu: 4}}}]
profiles: [{slug: g, displayName: G, gpu: {count: 1, flavor: gpu}, teams: "*"}]
""")


def storm(queue: AdmissionQueue, n: int) -> tuple[float, int]:
    demand = demand_for(POLICY, POLICY.profile("g"))
    events = 0
    t0 = time.perf_counter()
    for i in range(n):
        queue.submit(Ticket(key=f"u{i}/", user=f"u{i}", team="crowd", profile="g", demand=demand))
        events += 1
    for i in range(n):
        queue.release(f"u{i}/")
        events += 1
    return time.perf_counter() - t0, events


async def main(n: int) -> None:
    base_q = AdmissionQueue(lambda: POLICY)
    base, events = storm(base_q, n)

    with tempfile.TemporaryDirectory() as d:
        rec = UsageRecorder(db_url=f"sqlite:///{Path(d) / 'hub.sqlite'}", audit_file=str(Path(d) / "audit.jsonl"))
        q = AdmissionQueue(lambda: POLICY)
        broker = SimpleNamespace(
            queue=q,
            devices=SimpleNamespace(devices=[], free_devices=lambda f: []),
            store=SimpleNamespace(current=POLICY, on_change=lambda cb: None, status=PolicyStatus(path="")),
        )
        rec.attach(broker)
        if rec._checker is not None:
            rec._checker.stop()
        loop_time, _ = storm(q, n)
        t0 = time.perf_counter()
        rec.history.flush()
        drain = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = rec.history.rows(0)
        summary = summarize(rows, 0, time.time())
        read = time.perf_counter() - t0
        lines = sum(1 for _ in open(Path(d) / "audit.jsonl"))
    print(f"{events} queue events ({n} requests, 4 GPUs)")
    print(f"  bare queue:            {base / events * 1e6:8.1f} µs/event on the loop (baseline)")
    print(f"  with history + audit:  {loop_time / events * 1e6:8.1f} µs/event on the loop ({loop_time / base:.2f}× baseline)")
    print(f"  history thread drained {drain * 1000:.0f} ms after the storm; {len(rows)} rows, {lines} audit lines")
    print(
        f"  reading and summarising the whole history: {read * 1000:.0f} ms "
        f"({summary['totals']['crowd']['allocations']} allocations)"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(p.parse_args().requests))
