"""The queue journal: waiting requests survive a restart in order; nothing is admitted twice."""

import os
import stat

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.journal import QueueJournal
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors: [{name: gpu, local: {virtual: 2}}]
priorityClasses: [{name: high, value: 100}]
teams:
  - {name: a, groups: [a], quota: {gpus: {gpu: {nominal: 1}}}}
  - {name: b, groups: [b], quota: {gpus: {gpu: {nominal: 1}}}}
profiles: [{slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}]
"""


def hub(path, policy):
    """What one hub process holds: a device table, a journal, a queue."""
    journal = QueueJournal(path)
    before = journal.load()
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []), journal)
    return q, before


def t(key, team="a", priority=0, **kw):
    return Ticket(
        key=key,
        user=key.split("/")[0],
        team=team,
        profile="g1",
        demand={"gpu/gpu": 1},
        priority=priority,
        user_options={"profile": "g1", "team": team},
        **kw,
    )


async def test_waiting_requests_come_back_in_order_and_admitted_ones_do_not(tmp_path):
    policy = parse_policy(POLICY)
    path = tmp_path / "queue.journal"
    q, before = hub(path, policy)
    assert before == []
    q.submit(t("run/"))  # admitted: never in the journal's waiting set again
    waiting = [q.submit(t(f"w{i}/")) for i in range(5)]
    q.submit(t("vip/", priority=100))
    q.cancel("w2/")  # left the queue: gone for good
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    order = [x.key for x in sorted(q.waiting, key=lambda x: x.sort_key())]

    # kill -9: no shutdown code runs; a new process reads the file
    q2, back = hub(path, policy)
    assert [x.key for x in back] == [w.key for w in waiting if w.key != "w2/"] + ["vip/"]  # arrival order
    by_key = {x.key: x for x in back}
    assert by_key["w0/"].created == waiting[0].created and by_key["vip/"].priority == 100
    assert by_key["w0/"].user_options == {"profile": "g1", "team": "a"}
    # the running server is re-registered from JupyterHub's state first, then the queue comes back
    from gpuhub_spawner.admission.queue import Admission

    q2.restore(Admission("run/", "run", "a", "g1", {"gpu/gpu": 1}, ["gpu-0"]))
    q2.held = True
    newcomer = q2.submit(t("late/"))  # arrives while the queue is coming back
    q2.restore_waiting(back)
    assert [x.key for x in sorted(q2.waiting, key=lambda x: x.sort_key())] == order + ["late/"]
    assert not q2.admitted.keys() - {"run/"}  # team a is full: nobody admitted twice
    q2.release("run/")
    assert q2.admitted.keys() == {"vip/"} and newcomer.admission is None
    # a restored request is adopted by its spawner once, admitted or waiting
    assert q2.adopt("vip/").admission is not None and q2.adopt("vip/") is None


async def test_torn_last_line_and_compaction(tmp_path):
    policy = parse_policy(POLICY)
    path = tmp_path / "queue.journal"
    q, _ = hub(path, policy)
    q.submit(t("run/"))
    for i in range(200):  # a day of churn
        q.submit(t(f"x{i}/"))
        q.cancel(f"x{i}/")
    q.submit(t("keep/"))
    assert len(path.read_text().splitlines()) < 70  # compacted as it goes, not O(history)
    with open(path, "a") as f:
        f.write('{"op":"wait","key":"torn/","us')  # killed mid-write
    _, back = hub(path, policy)
    assert [x.key for x in back] == ["keep/"]


async def test_dropped_restored_request_frees_its_devices(tmp_path):
    policy = parse_policy(POLICY)
    path = tmp_path / "queue.journal"
    q, _ = hub(path, policy)
    q.submit(t("run/"))
    q.submit(t("gone/"))
    q2, back = hub(path, policy)
    q2.restore_waiting(back)  # "run/" did not survive the restart: "gone/" is admitted at once
    assert "gone/" in q2.admitted
    q2.drop_restored("gone/")  # its user was deleted meanwhile: the re-spawn failed
    assert not q2.admitted and not q2.allocator.owner
    assert hub(path, policy)[1] == []


async def test_a_request_that_arrived_while_the_queue_came_back_is_not_forgotten(tmp_path):
    policy = parse_policy(POLICY)
    path = tmp_path / "queue.journal"
    q, _ = hub(path, policy)
    q.submit(t("run/"))
    q.submit(t("w/"))  # team a waits
    q2, back = hub(path, policy)
    q2.held = True  # restarted: the old queue is not back yet
    other = q2.submit(t("b1/", team="b"))  # another team, free quota and a free device
    assert other.admission is None
    q2.restore_waiting(back)
    assert other.admission is not None  # admitted once the queue is back, not left waiting
