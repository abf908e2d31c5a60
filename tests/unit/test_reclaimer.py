"""The one-machine reclaimer against the real queue and culling board (no hub).

A notice is given to the most recently admitted borrower, shown on the board, named on the
lender's waiting message, withdrawn when the lender leaves, and keeps its deadline across a
hub restart (the board's state file), so a lender never waits more than one notice.
"""

import asyncio
import json
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.queue import Admission
from gpuhub_spawner.culling.board import CullBoard
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.culling.reclaimer import Reclaimer, reclaim_reason
from gpuhub_spawner.policy import parse_policy

POLICY = parse_policy("""\
flavors: [{name: gpu, displayName: Tesla, local: {virtual: 2}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {gpu: 1}}, reclaim: {notice: 10m}}
profiles: [{slug: g1, displayName: g, gpu: {count: 1, flavor: gpu}, teams: "*"}]
""")


@pytest.fixture
def config(tmp_path):
    CullBoard.clear_instance()
    c = Config()
    c.CullBoard.state_file = str(tmp_path / "culling.json")
    yield c
    CullBoard.clear_instance()


def hub(config):
    q = AdmissionQueue(lambda: POLICY, DeviceTable(lambda: POLICY, discover=lambda: []))
    broker = SimpleNamespace(queue=q, store=SimpleNamespace(current=POLICY), devices=q.allocator, config=config)
    return q, Reclaimer(broker)


def T(key, team):
    return Ticket(key=key, user=key[:-1], team=team, profile="g1", demand={"gpu/gpu": 1})


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


async def test_notice_board_message_withdrawal_and_restart(config, tmp_path):
    q, r = hub(config)
    q.submit(T("alice/", "vision"))
    await asyncio.sleep(0.01)
    q.submit(T("bob/", "vision"))  # borrows NLP's GPU
    await settle()
    assert r.notices == {}  # nobody needs it back: the cohort lends
    carol = q.submit(T("carol/", "nlp"))
    await settle()
    assert list(r.notices) == ["bob/"]  # the most recently admitted borrower
    n = r.notices["bob/"]
    assert 599 < n.deadline - n.warned_at <= 600.5 and n.for_team == "nlp"
    board = CullBoard.instance(config=config)
    w = board.warnings_for("bob", {"": None})[""]
    assert w["rule"] == "reclaim" and w["snoozes_left"] == 0 and w["needed_by"] == "NLP Group"
    assert board.snooze("bob/", None)[0] is False
    assert "it is being reclaimed and will be yours by" in carol.status.message
    saved = json.loads((tmp_path / "culling.json").read_text())
    assert saved["reclaims"]["bob/"]["deadline"] == n.deadline

    # The hub restarts while the notice runs: same servers, carol back in the queue.
    CullBoard.clear_instance()
    bob = q.admitted["bob/"]
    q2, r2 = hub(config)
    for adm in q.holdings():
        q2.restore(Admission(adm.key, adm.user, adm.team, adm.profile, adm.demand, adm.devices, adm.since, adm.priority))
    q2.submit(T("carol/", "nlp"))
    await settle()
    assert r2.notices["bob/"].deadline == n.deadline  # not a fresh notice
    assert bob.since == r2.notices["bob/"].since

    # carol leaves: the warning is withdrawn, on the board too.
    q2.cancel("carol/")
    await settle()
    assert r2.notices == {} and CullBoard.instance(config=config).reclaims == {}
    assert CullBoard.instance(config=config).warnings_for("bob", {"": None}) == {}


async def test_minimum_runtime_protects_a_borrower_and_the_lender_is_told_until_when(config):
    """fairShare.minRuntime (docs/fair-share.md): a borrower that just started is not warned;
    the lender's message says from when it can be; once the runtime is reached, it is."""
    policy = parse_policy(
        POLICY.model_dump_json(by_alias=True, exclude_none=True).replace(
            '"teams":[{', '"fairShare":{"minRuntime":1200},"teams":[{', 1
        )
    )
    assert policy.fair.min_runtime == 1200
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []))
    broker = SimpleNamespace(queue=q, store=SimpleNamespace(current=policy), devices=q.allocator, config=config)
    r = Reclaimer(broker)
    q.submit(T("alice/", "vision"))
    q.submit(T("bob/", "vision"))  # borrows NLP's GPU, admitted now
    carol = q.submit(T("carol/", "nlp"))
    await settle()
    assert r.notices == {}  # bob's server started less than 20 minutes ago
    assert "whose server started less than 20m ago (fair share's minimum runtime); it can be reclaimed from" in (
        carol.status.message
    )
    r.evaluate(now=q.admitted["bob/"].since + 1201)
    assert list(r.notices) == ["bob/"]


def test_the_warning_names_only_what_was_borrowed():
    two = {"gpu/gpu": 2, "cpu": 1000}
    assert reclaim_reason(POLICY, "NLP Group", "Vision Lab", two, ["0", "1"], {"gpu/gpu": 2}) == (
        "NLP Group needs back GPUs 0, 1 that your team Vision Lab borrowed"
    )
    # One of two on loan: the one that took the team above its quota, the last given.
    assert reclaim_reason(POLICY, "NLP Group", "Vision Lab", two, ["0", "1"], {"gpu/gpu": 1}) == (
        "NLP Group needs back GPU 1 that your team Vision Lab borrowed"
    )
    # Kubernetes: no device ids, the count.
    assert reclaim_reason(POLICY, "NLP Group", "Vision Lab", two, [], {"gpu/gpu": 1}) == (
        "NLP Group needs back 1 Tesla GPU that your team Vision Lab borrowed"
    )


async def test_a_two_gpu_server_with_one_borrowed_is_told_one(config):
    policy = parse_policy("""\
flavors: [{name: gpu, displayName: Tesla, local: {virtual: 3}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {gpu: 2}}}
profiles:
  - {slug: g1, displayName: g, gpu: {count: 1, flavor: gpu}, teams: "*"}
  - {slug: g2, displayName: g2, gpu: {count: 2, flavor: gpu}, teams: "*"}
""")
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []))
    broker = SimpleNamespace(queue=q, store=SimpleNamespace(current=policy), devices=q.allocator, config=config)
    r = Reclaimer(broker)
    q.submit(Ticket(key="bob/", user="bob", team="vision", profile="g2", demand={"gpu/gpu": 2}))  # 1 of 2 borrowed
    q.submit(T("carol/", "nlp"))  # the free GPU
    q.submit(T("dave/", "nlp"))  # within NLP's quota of 2: the borrowed one comes back
    await settle()
    assert list(r.notices) == ["bob/"]
    first, second = q.admitted["bob/"].devices
    assert r.notices["bob/"].reason == f"NLP Group needs back GPU {second} that your team Vision Lab borrowed"
