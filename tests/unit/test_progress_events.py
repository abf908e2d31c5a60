"""The spawn page's event stream: every change of a waiting request arrives at once.

``progress()`` used to read the ticket's version after its ``yield`` returned, so a
change that landed while the previous event was being sent (an admission, a new
position) was swallowed until the next change or a 30 s timeout.
"""

import asyncio
import re
from types import SimpleNamespace

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.local.spawner import QueuedGpuMixin
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors: [{name: gpu, local: {virtual: 1}}]
teams: [{name: a, groups: [a], quota: {gpus: {gpu: {nominal: 1}}}}]
profiles: [{slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}]
defaults: {queueTimeout: 1h}
"""


def setup():
    policy = parse_policy(POLICY)
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []))
    broker = SimpleNamespace(policy=policy, queue=q)
    return q, broker


def waiter(q, broker, key):
    ticket = q.submit(Ticket(key=key, user=key[:-1], team="a", profile="g1", demand={"gpu/gpu": 1}))
    spawner = SimpleNamespace(_ticket=ticket, broker=broker)
    return ticket, QueuedGpuMixin.progress(spawner)


async def test_admission_while_an_event_is_being_sent_arrives_at_once():
    q, broker = setup()
    q.submit(Ticket(key="holder/", user="holder", team="a", profile="g1", demand={"gpu/gpu": 1}))
    ticket, events = waiter(q, broker, "w/")
    first = await asyncio.wait_for(events.__anext__(), 1)
    assert "position 1 of 1" in first["message"]
    # the consumer is still sending `first` when the holder stops
    q.release("holder/")
    assert ticket.admission is not None
    nxt = await asyncio.wait_for(events.__anext__(), 1)  # was: 30 s, or never
    assert nxt["message"].startswith("Admitted with GPU(s)")


async def test_position_change_while_sending_arrives_at_once():
    q, broker = setup()
    q.submit(Ticket(key="holder/", user="holder", team="a", profile="g1", demand={"gpu/gpu": 1}))
    q.submit(Ticket(key="first/", user="first", team="a", profile="g1", demand={"gpu/gpu": 1}))
    _, events = waiter(q, broker, "second/")
    e1 = await asyncio.wait_for(events.__anext__(), 1)
    assert e1["gpuhub"]["position"] == 2
    q.cancel("first/")  # lands between two events
    e2 = await asyncio.wait_for(events.__anext__(), 1)
    assert e2["gpuhub"]["position"] == 1 and "position 1 of 1" in e2["message"]


async def test_every_waiter_sees_each_change_in_a_crowd():
    """Many pages open at once; each release must reach every waiter promptly."""
    q, broker = setup()
    q.submit(Ticket(key="holder/", user="holder", team="a", profile="g1", demand={"gpu/gpu": 1}))
    streams = [waiter(q, broker, f"u{i}/") for i in range(30)]
    for i, (_, ev) in enumerate(streams):
        assert (await asyncio.wait_for(ev.__anext__(), 1))["gpuhub"]["position"] == i + 1
    q.release("holder/")  # u0 is admitted, everyone else moves up one
    for i, (_ticket, ev) in enumerate(streams):
        evt = await asyncio.wait_for(ev.__anext__(), 1)
        if i == 0:
            assert evt["message"].startswith("Admitted")
        else:
            assert evt["gpuhub"]["position"] == i


async def test_first_message_of_a_fresh_request_does_not_claim_a_wait():
    q, broker = setup()
    q.submit(Ticket(key="holder/", user="holder", team="a", profile="g1", demand={"gpu/gpu": 1}))
    _, events = waiter(q, broker, "w/")
    first = await asyncio.wait_for(events.__anext__(), 1)
    assert "Waiting for" not in first["message"] and first["gpuhub"]["waited"] < 1
    assert "position 1 of 1" in first["message"]


BORROW_POLICY = """\
flavors: [{name: gpu, displayName: Tesla, local: {virtual: 2}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {gpu: 1}}, reclaim: {notice: 10m}}
profiles: [{slug: g1, displayName: g1, gpu: {count: 1, flavor: gpu}, teams: "*"}]
"""


async def test_a_start_that_borrows_says_so_when_it_is_admitted():
    """Issue 20 item 6: dave was admitted at once on NLP's GPU with no word that it was borrowed."""
    policy = parse_policy(BORROW_POLICY)
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []))
    broker = SimpleNamespace(policy=policy, queue=q)
    own = q.submit(Ticket(key="alice/", user="alice", team="vision", profile="g1", demand={"gpu/gpu": 1}))
    assert own.admission is not None and own.admission.borrowed == {}
    ticket = q.submit(Ticket(key="dave/", user="dave", team="vision", profile="g1", demand={"gpu/gpu": 1}))
    assert ticket.admission is not None and ticket.admission.borrowed == {"gpu/gpu": 1}
    [event] = [e async for e in QueuedGpuMixin.progress(SimpleNamespace(_ticket=ticket, broker=broker))]
    assert event["gpuhub"]["borrowed"] == {"gpu/gpu": 1}
    assert (
        "Borrowed: 1 Tesla GPU of this is other teams' unused quota (NLP Group), beyond Vision Lab's own. "
        "If a lending team needs it back, one of your team's borrowing servers is warned and stopped after "
        "at least 10m, the most recently started first; your files are kept."
    ) in event["message"], event["message"]
    # a start within the team's own quota says nothing of the kind
    [plain] = [e async for e in QueuedGpuMixin.progress(SimpleNamespace(_ticket=own, broker=broker))]
    assert "Borrowed" not in plain["message"]


def test_the_spawn_form_says_before_the_click_that_a_start_would_borrow():
    policy = parse_policy(BORROW_POLICY)
    devices = DeviceTable(lambda: policy, discover=lambda: [])
    q = AdmissionQueue(lambda: policy, devices)
    broker = SimpleNamespace(policy=policy, queue=q, devices=devices)
    form = SimpleNamespace(broker=broker)
    vision, gpu = policy.team("vision"), policy.profiles[0]
    before = QueuedGpuMixin.profile_status_hook(form, vision, gpu)
    assert "uses 0 of its quota of 1" in before and "borrows" not in before
    q.submit(Ticket(key="alice/", user="alice", team="vision", profile="g1", demand={"gpu/gpu": 1}))
    after = QueuedGpuMixin.profile_status_hook(form, vision, gpu)
    assert "uses 1 of its quota of 1" in after
    assert "Starting now borrows another team's unused GPU: if that team needs it back, your server is warned" in after


FORM_POLICY = """\
flavors: [{name: gpu, displayName: Tesla, local: {virtual: 3}}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {gpu: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: lab, quota: {gpus: {gpu: 4}}, reclaim: {notice: 10m}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true}
  - {slug: g1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: "*"}
  - {slug: g4, displayName: Four GPUs, gpu: {count: 4, flavor: gpu}, teams: "*"}
"""


class FormOfBroker(QueuedGpuMixin):
    """The spawn form a user of ``groups`` gets from a local broker, as the hub renders it."""

    def __init__(self, broker, groups):
        self._broker = broker
        self.user = SimpleNamespace(name="u", groups=[SimpleNamespace(name=g) for g in groups])

    @property
    def broker(self):
        return self._broker

    @property
    def policy(self):
        return self._broker.policy


def test_the_spawn_form_says_what_the_machine_cannot_serve_and_what_a_start_would_do():
    """Issue 43's polish: out-of-service GPUs counted, a profile the machine cannot serve greyed out
    with the reason, a start that would queue or borrow said before the click, with the notice."""
    policy = parse_policy(FORM_POLICY)
    devices = DeviceTable(lambda: policy, discover=lambda: [])
    q = AdmissionQueue(lambda: policy, devices)
    broker = SimpleNamespace(policy=policy, queue=q, devices=devices)
    vision = FormOfBroker(broker, ["v"])
    html = vision.render_options_form()
    # Four GPUs on a machine of three: greyed out, with why, never pre-selected.
    four = re.search(r'<div class="form-check mb-2 gpuhub-profile-unavailable[^"]*"><input [^>]*value="g4"[^>]*>', html)
    assert four and " disabled" in four.group(0) and " checked" not in four.group(0), html
    assert "Not offered here: 4 Tesla GPUs" in html and "this machine has only 3 Tesla GPUs" in html, html
    assert re.search(r'value="cpu"[^>]* checked', html)
    # One out of service: counted beside the free ones.
    devices.health.mark(devices.devices[2].id, "bad", "XID 79: GPU has fallen off the bus", 79)
    one = QueuedGpuMixin.profile_status_hook(vision, policy.team("vision"), policy.profile("g1"))
    assert one.startswith("Now: 2 of 3 free on this machine (1 out of service since"), one
    assert "XID 79" in one and "borrows" not in one and "waits" not in one
    # Vision Lab holds its own GPU: a second one borrows NLP's, and the notice is said.
    q.submit(Ticket(key="alice/", user="alice", team="vision", profile="g1", demand={"gpu/gpu": 1}))
    two = QueuedGpuMixin.profile_status_hook(vision, policy.team("vision"), policy.profile("g1"))
    assert (
        "Starting now borrows another team's unused GPU: if that team needs it back, your server is warned and "
        "stopped after at least 10m (the newest borrower first)."
    ) in two, two
    # Two held by Vision Lab (one of them borrowed), the third out of service: an NLP start waits.
    q.submit(Ticket(key="bob/", user="bob", team="vision", profile="g1", demand={"gpu/gpu": 1}))
    nlp = FormOfBroker(broker, ["n"])
    three = QueuedGpuMixin.profile_status_hook(nlp, policy.team("nlp"), policy.profile("g1"))
    assert "Now: 0 of 3 free on this machine (1 out of service" in three, three
    assert "Starting now waits in NLP Group's queue: needs 1 Tesla GPU" in three, three
    assert "borrows" not in three
