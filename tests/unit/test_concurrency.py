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
