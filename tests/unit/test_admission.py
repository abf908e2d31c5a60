"""Kueue-style admission: nominal quota, cohort borrowing, priorities, FIFO, devices."""

import asyncio

import pytest

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.queue import QueueRefused
from gpuhub_spawner.admission.quota import check_fit
from gpuhub_spawner.local.devices import DeviceTable, NvmlDevice, build_inventory
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors:
  - name: gpu
    local: {virtual: 6}
priorityClasses:
  - {name: high, value: 1000}
  - {name: low, value: 10}
teams:
  - name: red
    groups: [red]
    cohort: lab
    defaultPriority: low
    quota: {gpus: {gpu: {nominal: 2, borrowingLimit: 1, lendingLimit: 1}}}
  - name: blue
    groups: [blue]
    cohort: lab
    defaultPriority: low
    quota: {gpus: {gpu: {nominal: 2, lendingLimit: 2}}}
  - name: solo
    groups: [solo]
    quota: {gpus: {gpu: {nominal: 1}}}
    queueingStrategy: StrictFIFO
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}
  - {slug: g2, displayName: g2, gpu: {count: 2, flavor: gpu}, teams: [red, blue]}
"""


@pytest.fixture
def policy():
    return parse_policy(POLICY)


def queue_for(policy, devices=True):
    table = DeviceTable(lambda: policy, discover=lambda: []) if devices else None
    return AdmissionQueue(lambda: policy, table)


def t(key, team, n, priority=0):
    return Ticket(key=key, user=key.split("/")[0], team=team, profile=f"g{n}", demand={"gpu/gpu": n}, priority=priority)


def test_fit_within_nominal_and_borrowing_limits(policy):
    red = policy.team("red")
    assert check_fit(policy, {}, red, {"gpu/gpu": 2}).fits
    assert not check_fit(policy, {}, red, {"gpu/gpu": 2}).borrows
    # 3 = nominal 2 + borrowingLimit 1: fits by borrowing from blue's lendable quota
    fit = check_fit(policy, {"red": {"gpu/gpu": 2}}, red, {"gpu/gpu": 1})
    assert fit.fits and fit.borrows
    # 4 would exceed the borrowing limit
    fit = check_fit(policy, {"red": {"gpu/gpu": 3}}, red, {"gpu/gpu": 1})
    assert not fit.fits and "may hold" in fit.shortages[0].reason


def test_lending_limit_protects_the_guaranteed_part(policy):
    blue = policy.team("blue")
    red = policy.team("red")
    # red lends at most 1: blue can use 2 (own) + 1 (red's lendable) = 3
    assert check_fit(policy, {"blue": {"gpu/gpu": 2}}, blue, {"gpu/gpu": 1}).fits
    assert not check_fit(policy, {"blue": {"gpu/gpu": 3}}, blue, {"gpu/gpu": 1}).fits
    # once blue borrowed red's lendable GPU, red still has its guaranteed one
    assert check_fit(policy, {"blue": {"gpu/gpu": 3}}, red, {"gpu/gpu": 1}).fits
    assert not check_fit(policy, {"blue": {"gpu/gpu": 3}, "red": {"gpu/gpu": 1}}, red, {"gpu/gpu": 1}).fits


def test_no_cohort_no_borrowing_and_never_fits(policy):
    solo = policy.team("solo")
    assert not check_fit(policy, {"solo": {"gpu/gpu": 1}}, solo, {"gpu/gpu": 1}).fits
    assert check_fit(policy, {}, solo, {"gpu/gpu": 2}).never


async def test_queue_admits_on_release_priority_then_fifo(policy):
    q = queue_for(policy)
    a = q.submit(t("a/", "solo", 1))
    assert a.admission is not None
    low1 = q.submit(t("b/", "solo", 1, priority=10))
    low2 = q.submit(t("c/", "solo", 1, priority=10))
    high = q.submit(t("d/", "solo", 1, priority=1000))
    assert [x.status.position for x in (high, low1, low2)] == [1, 2, 3]
    assert "position 2 of 3" in low1.status.message
    q.release("a/")  # the event that admits the next: no polling
    assert high.admission is not None and low1.admission is None
    q.release("d/")
    assert low1.admission is not None and low2.admission is None
    assert await asyncio.wait_for(low1.future, 1) is low1.admission


async def test_requests_within_nominal_go_before_borrowers(policy):
    q = queue_for(policy)
    q.submit(t("r1/", "red", 2))
    q.submit(t("b1/", "blue", 2))
    q.submit(t("b2/", "blue", 1))  # blue borrows red's lendable GPU: 5 of 6 devices
    borrower = q.submit(t("r2/", "red", 1))  # red over nominal would need to borrow: pool empty
    assert borrower.admission is None
    assert "cohort has 0 free to lend" in borrower.status.reason
    q.release("b2/")  # blue back at its nominal 2, which it may also use from the pool
    assert borrower.admission is None
    q.release("b1/")
    assert borrower.admission is not None


async def test_best_effort_lets_smaller_pass_strict_blocks(policy):
    q = queue_for(policy)
    q.submit(t("r1/", "red", 2))
    q.submit(t("b1/", "blue", 2))
    q.submit(t("x/", "red", 1))  # red borrows: 3 of its ceiling 3
    big = q.submit(t("y/", "red", 2))
    assert big.admission is None
    # solo is StrictFIFO: its head blocks the rest even when the rest is no bigger
    s1 = q.submit(t("s1/", "solo", 1))
    s2 = q.submit(t("s2/", "solo", 1))
    assert s1.admission is not None and s2.admission is None


async def test_cancel_removes_and_refusal(policy):
    q = queue_for(policy)
    q.submit(t("a/", "solo", 1))
    w = q.submit(t("b/", "solo", 1))
    assert q.cancel("b/") and w.future.cancelled()
    assert q.ticket("b/") is None
    with pytest.raises(QueueRefused, match="more than team 'solo' can ever hold"):
        q.submit(t("c/", "solo", 2))
    with pytest.raises(QueueRefused, match="already holds"):
        q.submit(t("a/", "solo", 1))


async def test_devices_are_never_shared_and_restore_detects_clashes(policy):
    q = queue_for(policy)
    got = [q.submit(t(f"u{i}/", "blue", 1)).admission for i in range(3)]
    ids = [d for a in got for d in a.devices]
    assert len(ids) == len(set(ids)) == 3
    table = q.allocator
    with pytest.raises(ValueError, match="already held"):
        table.restore("other/", [ids[0]])


def test_nvml_inventory_matches_flavors_and_mig():
    policy = parse_policy(POLICY.replace("local: {virtual: 6}", "local: {match: 'A100'}"))
    devices = [
        NvmlDevice(0, "GPU-aaa", "NVIDIA A100-SXM4-80GB", 80),
        NvmlDevice(1, "MIG-bbb", "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 5),
        NvmlDevice(2, "GPU-ccc", "NVIDIA L4", 24),
    ]
    inv = build_inventory(policy, devices)
    assert [(d.id, d.flavor, d.virtual) for d in inv] == [("GPU-aaa", "gpu", False), ("MIG-bbb", "gpu", False)]
    virtual = build_inventory(parse_policy(POLICY), [])
    assert len(virtual) == 6 and all(d.virtual for d in virtual)
