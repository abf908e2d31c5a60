"""Many simultaneous requests for more GPUs than exist: never over-allocate, never lose one."""

import asyncio
import random

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors: [{name: gpu, local: {virtual: 4}}]
teams:
  - {name: a, groups: [a], cohort: c, quota: {gpus: {gpu: {nominal: 2}}}}
  - {name: b, groups: [b], cohort: c, quota: {gpus: {gpu: {nominal: 2}}}}
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}
  - {slug: g2, displayName: g2, gpu: {count: 2, flavor: gpu}, teams: "*"}
"""


async def test_many_concurrent_requests_never_overallocate():
    policy = parse_policy(POLICY)
    table = DeviceTable(lambda: policy, discover=lambda: [])
    q = AdmissionQueue(lambda: policy, table)
    rng = random.Random(7)
    held_max = 0
    served = []

    def check_invariants():
        nonlocal held_max
        owners = list(table.owner.values())
        held = len(owners)
        held_max = max(held_max, held)
        assert held <= 4
        per_team = q.usage()
        assert sum(v.get("gpu/gpu", 0) for v in per_team.values()) == held
        devices = [d for a in q.admitted.values() for d in a.devices]
        assert len(devices) == len(set(devices))

    async def user(i):
        await asyncio.sleep(rng.random() * 0.05)
        n = rng.choice([1, 1, 2])
        ticket = Ticket(key=f"u{i}/", user=f"u{i}", team=rng.choice("ab"), profile=f"g{n}", demand={"gpu/gpu": n})
        q.submit(ticket)
        check_invariants()
        adm = await asyncio.wait_for(ticket.future, 30)
        check_invariants()
        await asyncio.sleep(rng.random() * 0.02)
        served.append(adm.key)
        q.release(adm.key)
        check_invariants()

    await asyncio.gather(*(user(i) for i in range(200)))
    assert sorted(served) == sorted(f"u{i}/" for i in range(200))  # nobody lost
    assert held_max == 4  # the machine was really used to the full
    assert not q.waiting and not q.admitted and not table.owner


POLICY_COHORTS = """\
flavors:
  - {name: gpu, local: {virtual: 5}}
  - {name: big, local: {virtual: 2}}
teams:
  - {name: a, groups: [a], cohort: c, quota: {gpus: {gpu: {nominal: 2, lendingLimit: 1}}}}
  - {name: b, groups: [b], cohort: c, quota: {gpus: {gpu: {nominal: 2}, big: {nominal: 1}}}}
  - {name: s, groups: [s], queueingStrategy: StrictFIFO, quota: {gpus: {gpu: {nominal: 2}, big: {nominal: 2}}}}
  - {name: d, groups: [d], quota: {gpus: {gpu: {nominal: 3}}}}
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}
"""


async def test_event_driven_updates_match_a_full_recompute():
    """Each event touches only the teams it can change; a full pass finds nothing it missed."""
    policy = parse_policy(POLICY_COHORTS)
    table = DeviceTable(lambda: policy, discover=lambda: [])
    q = AdmissionQueue(lambda: policy, table)
    rng = random.Random(11)
    shapes = [{"gpu/gpu": 1}, {"gpu/gpu": 2}, {"gpu/big": 1}, {"gpu/big": 2}, {"gpu/gpu": 1, "gpu/big": 1}]

    def snapshot():
        return {t.key: (t.status.position, t.status.waiting_in_team, t.status.reason, t.status.in_use) for t in q.waiting}

    for step in range(600):
        op = rng.random()
        if op < 0.5:
            team = rng.choice("absd")
            demand = rng.choice(shapes)
            try:
                q.submit(
                    Ticket(
                        key=f"k{step}/",
                        user=f"u{step}",
                        team=team,
                        profile="g1",
                        demand=dict(demand),
                        priority=rng.choice([0, 0, 5]),
                    )
                )
            except Exception:
                pass  # can never fit: refused, fine
        elif op < 0.75 and q.admitted:
            q.release(rng.choice(sorted(q.admitted)))
        elif q.waiting:
            q.cancel(rng.choice(sorted(t.key for t in q.waiting)))
        before = snapshot()
        assert q.schedule() == [], f"step {step}: a full pass admitted what the event missed"
        assert snapshot() == before, f"step {step}: a waiting user's status was stale"
        held = [d for a in q.admitted.values() for d in a.devices]
        assert len(held) == len(set(held))
