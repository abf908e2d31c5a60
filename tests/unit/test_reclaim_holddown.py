"""A lender cannot preempt at will (issue 19, item 8b): the reclaim hold-down.

Starting and cancelling a spawn used to preempt a borrowing job each time (and warn a
borrowing server each time). Now a lender who withdraws a request for which borrowers were
reclaimed gets nothing reclaimed again until one ``reclaim.notice`` after that reclaim.
The rule is the shared planner's (``admission/reclaim.py``: ``HoldDown``, ``plan(held_down=)``);
the reclaimer both backends run (``culling/reclaimer.py``) feeds it. Tested on the planner,
then on the reclaimer with the real queue and culling board (no hub), as tests/unit/test_reclaimer.py.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission import reclaim
from gpuhub_spawner.admission.reclaim import Holder, Request, plan
from gpuhub_spawner.culling.board import CullBoard
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.culling.reclaimer import Reclaimer
from gpuhub_spawner.policy import parse_policy

NOTICE = 600.0
POLICY = parse_policy("""\
flavors: [{name: gpu, displayName: Tesla, local: {virtual: 2}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {gpu: 1}}, reclaim: {notice: 10m}}
profiles: [{slug: g1, displayName: g, gpu: {count: 1, flavor: gpu}, teams: "*"}]
""")
K = "gpu/gpu"


# -- the rule -----------------------------------------------------------------------------------
def test_a_withdrawn_request_holds_its_lender_down_until_one_notice_after_the_reclaim():
    h = reclaim.HoldDown()
    h.reclaimed("carol/", "carol", at=100.0, notice=NOTICE)
    h.reclaimed("carol/", "carol", at=150.0, notice=NOTICE)  # later passes: the first reclaim counts
    assert h.held(120.0) == {}  # nothing withdrawn yet
    assert h.withdrawn("carol/", at=130.0) == 700.0
    assert h.held(699.0) == {"carol": 700.0}
    assert h.held(700.0) == {}  # one notice after the reclaim: free again


def test_keyed_by_the_user_not_the_server():
    h = reclaim.HoldDown()
    h.reclaimed("carol/a", "carol", at=0.0, notice=NOTICE)
    h.withdrawn("carol/a", at=5.0)
    assert "carol" in h.held(10.0)  # carol/b, carol's jobs: held down too


def test_a_request_kept_past_the_notice_or_never_reclaiming_holds_nothing_down():
    h = reclaim.HoldDown()
    h.reclaimed("carol/", "carol", at=0.0, notice=NOTICE)
    assert h.withdrawn("carol/", at=NOTICE + 1) is None  # used it for longer than the notice
    assert h.withdrawn("dave/", at=5.0) is None  # nothing was reclaimed for it
    assert h.held(10.0) == {}


def test_the_planner_reclaims_nothing_for_a_held_down_lender():
    usage = {"vision": {K: 2}}
    holders = [Holder("vision-job", "vision", {K: 1}, 0, 5.0, job=True), Holder("bob/", "vision", {K: 1}, 0, 1.0)]
    carol = Request("carol/", "nlp", {K: 1}, "carol")
    assert plan(POLICY, usage, holders, [carol], {K: 0}).reclaim == {"vision-job": ("nlp", "carol/")}
    out = plan(POLICY, usage, holders, [carol], {K: 0}, held_down={"carol"})
    assert out.reclaim == {} and out.covered == {} and out.held == ["carol/"]
    # Another member of the same team is not held down by carol's withdrawal.
    dave = Request("dave/", "nlp", {K: 1}, "dave")
    assert plan(POLICY, usage, holders, [carol, dave], {K: 0}, held_down={"carol"}).reclaim == {"vision-job": ("nlp", "dave/")}
    # A held-down lender's request that fits without any reclaim is planned as usual.
    out = plan(POLICY, {"vision": {K: 1}}, holders[1:], [carol], {K: 1}, held_down={"carol"})
    assert out.held == [] and out.reclaim == {}


# -- the reclaimer, with the real queue -----------------------------------------------------------
@pytest.fixture
def config(tmp_path):
    CullBoard.clear_instance()
    c = Config()
    c.CullBoard.state_file = str(tmp_path / "culling.json")
    yield c
    CullBoard.clear_instance()


def hub(config, preempt=None):
    q = AdmissionQueue(lambda: POLICY, DeviceTable(lambda: POLICY, discover=lambda: []))
    broker = SimpleNamespace(
        queue=q, store=SimpleNamespace(current=POLICY), devices=q.allocator, config=config, preempt_job=preempt
    )
    return q, Reclaimer(broker)


def T(key, team, user=None):
    return Ticket(key=key, user=user or key.split("/")[0], team=team, profile="g1", demand={K: 1})


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_request_cancel_request_does_not_preempt_a_second_borrowing_job(config):
    """The griefing loop on jobs: each start of carol's preempted vision's job at once."""
    preempted = []
    q = None

    def preempt(key, message, for_key):
        preempted.append((key, for_key))

        def requeue():  # the job manager's part: it stops at once, then queues again
            q.release(key)
            q.submit(T(key, "vision", user="bob"))

        asyncio.get_running_loop().call_soon(requeue)
        return True

    q, r = hub(config, preempt)
    q.submit(T("alice/", "vision"))
    await asyncio.sleep(0.01)
    q.submit(T("job:j1", "vision", user="bob"))  # borrows NLP's GPU
    await settle()
    assert set(q.admitted) == {"alice/", "job:j1"}

    q.submit(T("carol/", "nlp"))  # 1st request: the job goes at once, carol gets the GPU
    await settle()
    assert preempted == [("job:j1", "carol/")] and "carol/" in q.admitted
    q.release("carol/")  # ... and she gives it straight back: the job borrows it again
    await settle()
    assert "job:j1" in q.admitted

    carol = q.submit(T("carol/", "nlp"))  # 2nd request, within the notice
    await settle()
    assert preempted == [("job:j1", "carol/")], "a second preemption for the same lender within the notice"
    assert "job:j1" in q.admitted and "carol/" not in q.admitted
    assert "nothing is taken back for you before" in carol.status.message, carol.status.message

    # Her named server and her job are hers too; a teammate is not held down by her.
    q.cancel("carol/")
    carol_b = q.submit(T("carol/b", "nlp"))
    await settle()
    assert preempted == [("job:j1", "carol/")] and "nothing is taken back" in carol_b.status.message
    q.cancel("carol/b")
    await settle()

    # One notice after the first reclaim she may take it back again.
    q.submit(T("carol/", "nlp"))
    await settle()
    r.evaluate(now=time.time() + NOTICE + 1)
    await settle()
    assert preempted == [("job:j1", "carol/"), ("job:j1", "carol/")]
    assert "carol/" in q.admitted


async def test_request_cancel_request_does_not_warn_the_borrowing_server_again(config):
    q, r = hub(config)
    q.submit(T("alice/", "vision"))
    await asyncio.sleep(0.01)
    q.submit(T("bob/", "vision"))  # borrows NLP's GPU
    await settle()
    q.submit(T("carol/", "nlp"))
    await settle()
    assert list(r.notices) == ["bob/"]
    q.cancel("carol/")
    await settle()
    assert r.notices == {}  # withdrawn, as before

    carol = q.submit(T("carol/", "nlp"))
    await settle()
    assert r.notices == {} and CullBoard.instance(config=config).reclaims == {}
    assert "nothing is taken back for you before" in carol.status.message, carol.status.message
    # dave (NLP too) asks: his request reclaims as usual.
    q.cancel("carol/")
    q.submit(T("dave/", "nlp"))
    await settle()
    assert list(r.notices) == ["bob/"] and r.notices["bob/"].for_team == "nlp"
