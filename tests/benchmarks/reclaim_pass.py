"""What a reclaim pass costs the hub's event loop (culling/reclaimer.py), on demand.

A pass runs after each burst of queue events. Baseline in the same run: the pass when
nothing is on loan (its O(teams) early exit); measured: 5,000 waiting requests in 100 teams
of 10 cohorts with a borrowing team in every cohort. Also: 3,000 queue submits with and
without the per-request ``interactiveBorrowing`` check.

    .venv/bin/python tests/benchmarks/reclaim_pass.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission import queue as Q
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.culling.reclaimer import Reclaimer
from gpuhub_spawner.policy import parse_policy

TEAMS = "\n".join(f"  - {{name: t{i}, groups: [g{i}], cohort: c{i % 10}, quota: {{gpus: {{a100: 4}}}}}}" for i in range(100))
POLICY = parse_policy(
    f"flavors: [{{name: a100, local: {{virtual: 400}}}}]\nteams:\n{TEAMS}\n"
    "profiles: [{slug: g1, displayName: g, gpu: {count: 1, flavor: a100}, teams: '*'}]\n"
)


def queue():
    return AdmissionQueue(lambda: POLICY, DeviceTable(lambda: POLICY, discover=lambda: []))


def pass_seconds(loans: bool, waiting: int = 5000, rounds: int = 20) -> float:
    q = queue()
    broker = SimpleNamespace(queue=q, store=SimpleNamespace(current=POLICY), devices=q.allocator, config=None)
    r = Reclaimer(broker)
    r._warn = r._preempt_job = lambda *a: None  # plan only: no hub to stop anything in
    for i in range(100):  # every team at its quota; with loans, team 0 of each cohort borrows team 1's
        extra = (4 if i % 10 == 0 else -4 if i % 10 == 1 else 0) if loans else 0
        for j in range(4 + extra):
            q.submit(Ticket(key=f"u{i}-{j}/", user="u", team=f"t{i}", profile="g1", demand={"gpu/a100": 1}))
    for i in range(waiting):
        q.submit(Ticket(key=f"w{i}/", user="w", team=f"t{(i * 7) % 100}", profile="g1", demand={"gpu/a100": 1}))
    r.evaluate()  # warm: first imports
    t0 = time.perf_counter()
    for _ in range(rounds):
        r.evaluate()
    return (time.perf_counter() - t0) / rounds


def submits_seconds(n: int = 3000) -> float:
    q = queue()
    t0 = time.perf_counter()
    for i in range(n):
        q.submit(Ticket(key=f"w{i}/", user="w", team=f"t{(i * 7) % 100}", profile="g1", demand={"gpu/a100": 1}))
    return time.perf_counter() - t0


def main() -> None:
    base, loaded = pass_seconds(False), pass_seconds(True)
    print(
        f"reclaim pass, 5,000 waiting, 100 teams / 10 cohorts: nothing on loan {base * 1e3:.2f} ms (baseline); "
        f"a loan in every cohort {loaded * 1e3:.1f} ms = {loaded / base:.0f}x baseline"
    )
    with_check = min(submits_seconds() for _ in range(3))
    original = Q.may_borrow
    Q.may_borrow = lambda policy, team, ticket: True
    try:
        without = min(submits_seconds() for _ in range(3))
    finally:
        Q.may_borrow = original
    print(
        f"3,000 submits: with the interactiveBorrowing check {with_check:.2f} s, without {without:.2f} s "
        f"(ratio {with_check / without:.2f})"
    )


if __name__ == "__main__":
    main()
