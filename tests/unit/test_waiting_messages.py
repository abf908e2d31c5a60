"""Every waiting message names what the request waits for, in terms a user can act on."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.queue import QueueRefused
from gpuhub_spawner.local import spawner as local_spawner
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors: [{name: a100, displayName: A100, local: {virtual: 4}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {a100: 2}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {a100: 2}}, reclaim: {interactiveBorrowing: false}}
profiles: [{slug: g1, displayName: g1, gpu: {count: 1, flavor: a100}, teams: "*"}]
defaults: {queueTimeout: 1h}
"""
K = "gpu/a100"


def queue():
    policy = parse_policy(POLICY)
    return AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []))


def T(key, team, n=1):
    return Ticket(key=key, user=key.split("/")[0].split(":")[-1], team=team, profile="g1", demand={K: n})


def test_on_loan_teammates_and_cohort_full_are_told_apart():
    q = queue()
    for k in ("v1/", "v2/", "v3/", "v4/"):
        assert q.submit(T(k, "vision")).admission is not None  # vision borrows all of nlp's quota
    lender = q.submit(T("n1/", "nlp"))
    assert "NLP Group's own quota (2) is on loan to other teams of the lab cohort" in lender.status.reason
    borrower = q.submit(T("v5/", "vision"))
    assert "Vision Lab is using 4 of the 4 it may hold" in borrower.status.reason
    assert "waits until one of your team's servers or jobs stops" in borrower.status.reason
    q.release("v4/")
    q.release("v3/")  # nlp's request gets one back; vision now borrows 0
    assert lender.admission is not None
    assert "v1" not in borrower.status.message and "alice" not in borrower.status.message


def test_a_team_whose_servers_may_not_borrow():
    q = queue()
    assert q.submit(T("n1/", "nlp")).admission and q.submit(T("n2/", "nlp")).admission
    third = q.submit(T("n3/", "nlp"))  # 2 GPUs free in the cohort, but nlp's servers may not borrow
    assert third.admission is None and "its servers may not borrow from the cohort" in third.status.reason
    job = q.submit(T("job:n4", "nlp"))  # a job of the same team may
    assert job.admission is not None
    with pytest.raises(QueueRefused) as e:
        q.submit(T("n5/", "nlp", 3))  # more than the team's own quota: can never fit a server
    assert "more than team 'nlp' can ever hold" in str(e.value)


async def test_the_time_waited_is_not_claimed_at_first_and_moves_while_the_page_is_open(monkeypatch):
    q = queue()
    for k in ("v1/", "v2/", "n1/", "n2/"):
        q.submit(T(k, "vision" if k[0] == "v" else "nlp"))
    ticket = q.submit(T("n3/", "nlp"))
    spawner = SimpleNamespace(_ticket=ticket, broker=SimpleNamespace(policy=q._policy(), queue=q))
    events = local_spawner.QueuedGpuMixin.progress(spawner)
    first = await asyncio.wait_for(events.__anext__(), 1)
    assert "Waiting for" not in first["message"]
    ticket.created = time.time() - 125  # it has waited two minutes
    monkeypatch.setattr(local_spawner, "PROGRESS_REFRESH", 0.05)
    later = await asyncio.wait_for(events.__anext__(), 2)  # nothing changed: the page still moves
    assert "Waiting for 2m" in later["message"] and later["gpuhub"]["waited"] > first["gpuhub"]["waited"]
    await events.aclose()
