"""Kueue's Workloads mirrored as the hub's ledger (kube/ledger.py), without a hub.

Workloads shaped as Kueue v0.19 writes them (the double's, validated against the CRD in
tests/kube) go in through stand-ins for the two reflectors; out come the same events and
reads the one-machine queue gives: requested, admitted, released (with why), the
per-team usage, and the reclaimer's plan with Kubernetes' rule (no device table).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpuhub_spawner.culling.board import CullBoard
from gpuhub_spawner.kube.ledger import KueueLedger, admitted_demand
from gpuhub_spawner.policy import PolicyStore
from gpuhub_spawner.usage.recorder import UsageRecorder

POLICY = """\
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, local: {virtual: 1}}
priorityClasses: [{name: interactive, value: 1000}, {name: batch, value: 100}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], cohort: research, defaultPriority: interactive,
     quota: {cpu: 8, memory: 16Gi, gpus: {l4: 1}}}
  - {name: nlp, displayName: NLP Group, groups: [n], cohort: research, defaultPriority: interactive,
     quota: {cpu: 8, memory: 16Gi, gpus: {l4: 1}}, reclaim: {notice: 10m}}
profiles: [{slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: "*"}]
"""

NS = "gpuhub-users"


def pod(user: str, team: str, uid: str) -> dict:
    return {
        "metadata": {
            "name": f"jupyter-{user}",
            "namespace": NS,
            "uid": uid,
            "labels": {"gpuhub/team": team, "gpuhub/profile": "l4-1", "hub.jupyter.org/username": user},
            "annotations": {"hub.jupyter.org/username": user},
        }
    }


def workload(user: str, team: str, uid: str, admitted_at: str | None, priority: int = 1000, created="2026-11-30T10:00:00Z"):
    wl = {
        "metadata": {
            "name": f"pod-jupyter-{user}-{uid[:5]}",
            "namespace": NS,
            "creationTimestamp": created,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": f"jupyter-{user}", "uid": uid, "controller": True}],
        },
        "spec": {
            "queueName": team,
            "priority": priority,
            "podSets": [{"name": "main", "count": 1, "template": {"metadata": {"labels": {"gpuhub/team": team}}}}],
        },
        "status": {"conditions": []},
    }
    if admitted_at:
        wl["status"]["admission"] = {
            "clusterQueue": team,
            "podSetAssignments": [
                {
                    "name": "main",
                    "count": 1,
                    "flavors": {"cpu": "default", "memory": "default", "nvidia.com/gpu": "l4"},
                    "resourceUsage": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"},
                }
            ],
        }
        wl["status"]["conditions"] = [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "lastTransitionTime": admitted_at},
            {"type": "Admitted", "status": "True", "reason": "Admitted", "lastTransitionTime": admitted_at},
        ]
    else:
        wl["status"]["conditions"] = [
            {
                "type": "QuotaReserved",
                "status": "False",
                "reason": "Pending",
                "message": "couldn't assign flavors",
                "lastTransitionTime": created,
            }
        ]
    return wl


class Reflector(SimpleNamespace):
    def __init__(self):
        super().__init__(resources={}, gone=OrderedDict())

    def delete(self, key):
        self.gone[key] = (time.monotonic(), self.resources.pop(key))


@pytest.fixture
def ledger(tmp_path):
    for cls in (KueueLedger, PolicyStore, UsageRecorder, CullBoard):
        cls.clear_instance()
    (tmp_path / "policy.yaml").write_text(POLICY)
    c = Config()
    c.PolicyStore.policy_file = str(tmp_path / "policy.yaml")
    c.CullBoard.state_file = str(tmp_path / "culling.json")
    led = KueueLedger.instance(config=c)
    led._pods, led._workloads = Reflector(), Reflector()
    yield led
    for cls in (KueueLedger, PolicyStore, UsageRecorder, CullBoard):
        cls.clear_instance()


def add(led, user, team, uid, admitted_at=None, **kw):
    p = pod(user, team, uid)
    led._pods.resources[f"{NS}/{p['metadata']['name']}"] = p
    wl = workload(user, team, uid, admitted_at, **kw)
    led._workloads.resources[f"{NS}/{wl['metadata']['name']}"] = wl
    return wl


def test_admitted_demand_reads_kueues_flavors_and_usage():
    wl = workload("alice", "vision", "u1", "2026-11-30T10:00:01Z")
    assert admitted_demand(wl) == {"cpu": 1000, "memory": 2 * 1024**3, "gpu/l4": 1}


def test_events_follow_the_workloads_and_usage_is_per_team(ledger):
    seen = []
    q = ledger.queue
    q.on_submit.append(lambda t: seen.append(("requested", t.key)))
    q.on_admit.append(lambda a: seen.append(("admitted", a.key)))
    q.on_release.append(lambda a: seen.append(("released", a.key)))
    q.on_cancel.append(lambda t: seen.append(("left", t.key)))
    wl = add(ledger, "alice", "vision", "u1")
    ledger.sync()
    assert [t.key for t in q.waiting] == ["alice/"] and q.waiting[0].demand["gpu/l4"] == 1
    ledger._workloads.resources[f"{NS}/{wl['metadata']['name']}"] = workload("alice", "vision", "u1", "2026-11-30T10:00:05Z")
    add(ledger, "bob", "vision", "u2", "2026-11-30T10:00:06Z")  # admitted between two reads
    ledger.sync()
    assert q.usage() == {"vision": {"cpu": 2000, "memory": 4 * 1024**3, "gpu/l4": 2}}
    add(ledger, "carol", "nlp", "u3")
    ledger.sync()
    assert q.waiting_in("nlp") == 1
    ledger._workloads.delete(f"{NS}/pod-jupyter-carol-u3")  # she gave up waiting
    ledger._workloads.delete(f"{NS}/pod-jupyter-bob-u2")  # bob stopped
    ledger.sync()
    assert seen == [
        ("requested", "alice/"),
        ("admitted", "alice/"),
        ("requested", "bob/"),
        ("admitted", "bob/"),
        ("requested", "carol/"),
        ("released", "bob/"),
        ("left", "carol/"),
    ]
    assert q.usage() == {"vision": {"cpu": 1000, "memory": 2 * 1024**3, "gpu/l4": 1}}


def test_a_workload_kueue_preempted_is_recorded_as_reclaimed(ledger):
    rec = UsageRecorder.instance()
    wl = add(ledger, "bob", "vision", "u2", "2026-11-30T10:00:06Z")
    ledger.sync()
    wl["status"]["conditions"] += [
        {"type": "Evicted", "status": "True", "reason": "Preempted", "lastTransitionTime": "2026-11-30T10:01:00Z"},
        {"type": "Preempted", "status": "True", "reason": "InCohortReclamation", "lastTransitionTime": "2026-11-30T10:01:00Z"},
    ]
    ledger._workloads.delete(f"{NS}/{wl['metadata']['name']}")
    ledger.sync()
    [row] = rec.history.rows(0)
    assert row.end is not None and row.end_reason == "reclaimed" and row.stopped_by == "kueue"


async def test_the_reclaimer_warns_the_newest_borrower_when_the_lender_waits(ledger):
    add(ledger, "alice", "vision", "u1", "2026-11-30T10:00:01Z")
    add(ledger, "bob", "vision", "u2", "2026-11-30T10:00:09Z")  # borrows NLP's L4
    ledger.sync()
    ledger.reclaimer.evaluate()
    assert ledger.reclaimer.notices == {}  # nobody waits: an idle cohort keeps lending
    add(ledger, "carol", "nlp", "u3")
    ledger.sync()
    ledger.reclaimer.evaluate()
    assert set(ledger.reclaimer.notices) == {"bob/"}
    n = ledger.reclaimer.notices["bob/"]
    assert n.for_team == "nlp" and n.reason == "NLP Group needs back 1 L4 24GB GPU that your team Vision Lab borrowed"
    assert "NLP Group's GPU is on loan to another team; it is being reclaimed" in ledger.queue.notes["carol/"]
    assert CullBoard.instance().reclaims["bob/"]["needed_by"] == "NLP Group"
    ledger._workloads.delete(f"{NS}/pod-jupyter-carol-u3")  # the lender stops waiting
    ledger.sync()
    ledger.reclaimer.evaluate()
    assert ledger.reclaimer.notices == {} and "bob/" not in CullBoard.instance().reclaims


def test_a_batch_jobs_workload_is_keyed_by_its_job(ledger):
    wl = workload("bob", "vision", "u9", "2026-11-30T10:00:06Z", priority=100)
    wl["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "job-0a1b2c3d4e", "uid": "u9", "controller": True}
    ]
    wl["spec"]["podSets"][0]["template"]["metadata"] = {
        "labels": {"gpuhub/team": "vision", "gpuhub/profile": "l4-1", "gpuhub/job": "job-0a1b2c3d4e"},
        "annotations": {"hub.jupyter.org/username": "bob"},
    }
    ledger._workloads.resources[f"{NS}/job-job-0a1b2c3d4e"] = wl
    stray = workload("eve", "vision", "u8", "2026-11-30T10:00:06Z")  # a pod this hub did not make
    ledger._workloads.resources[f"{NS}/{stray['metadata']['name']}"] = stray
    ledger.sync()
    [adm] = ledger.queue.holdings()
    assert (adm.key, adm.user, adm.team, adm.priority) == ("job:job-0a1b2c3d4e", "bob", "vision", 100)


async def test_a_job_taken_back_is_deactivated_once_while_kueue_evicts_it(ledger, monkeypatch):
    """The reclaimer asks every pass until Kueue has evicted the Workload; the hub sends one
    deactivation (issue 40: on the real plane the audit log showed the same patch every 0.5 s
    for 2.5 s). A refused patch clears the mark, so the next pass tries again."""
    import asyncio

    from gpuhub_spawner.kube.ledger import RECLAIM_ANNOTATION

    wl = workload("bob", "vision", "u9", "2026-11-30T10:00:06Z")
    wl["metadata"]["name"] = "job-job-0a1b2c3d4e"
    wl["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "job-0a1b2c3d4e", "uid": "u9", "controller": True}
    ]
    wl["spec"]["podSets"][0]["template"]["metadata"] = {
        "labels": {"gpuhub/team": "vision", "gpuhub/profile": "l4-1", "gpuhub/job": "job-0a1b2c3d4e"},
        "annotations": {"hub.jupyter.org/username": "bob"},
    }
    ledger._workloads.resources[f"{NS}/job-job-0a1b2c3d4e"] = wl
    ledger.sync()
    sent, fail = [], [False]

    async def patch(where, body):
        sent.append((where, body["spec"]["active"]))
        if fail[0]:
            ledger._taken_back.pop(where, None)  # what _patch does when the API server refuses it

    monkeypatch.setattr(ledger, "_patch", patch)
    for _ in range(5):  # five reclaimer passes before Kueue evicts it
        assert ledger.preempt_job("job:job-0a1b2c3d4e", "NLP needs it back") is True
        await asyncio.sleep(0)
    assert sent == [((NS, "job-job-0a1b2c3d4e"), False)]
    # Kueue evicted it: the hub reactivates it once, and a later reclaim may take it back again.
    wl["spec"]["active"] = False
    wl["metadata"]["annotations"] = {RECLAIM_ANNOTATION: "1"}
    wl["status"]["conditions"] = [
        {
            "type": "QuotaReserved",
            "status": "False",
            "reason": "Pending",
            "message": "",
            "lastTransitionTime": "2026-11-30T10:00:09Z",
        }
    ]
    ledger._reactivate()
    await asyncio.sleep(0)
    assert sent[-1] == ((NS, "job-job-0a1b2c3d4e"), True) and not ledger._taken_back
    # Taken back for a lender's waiting request: not reactivated while that request waits (else
    # Kueue re-admits the older job first and the hub takes it back again), then at once.
    add(ledger, "carol", "nlp", "u7")  # carol's server, pending
    ledger.sync()
    [lender] = [t.key for t in ledger.queue.waiting if t.user == "carol"]
    wl["spec"]["active"], wl["metadata"]["annotations"] = True, {}
    wl["status"]["conditions"] = workload("bob", "vision", "u9", "2026-11-30T10:00:06Z")["status"]["conditions"]
    ledger.sync()
    assert ledger.preempt_job("job:job-0a1b2c3d4e", "NLP needs it back", lender) is True
    await asyncio.sleep(0)
    wl["spec"]["active"] = False
    wl["metadata"]["annotations"] = {RECLAIM_ANNOTATION: "2"}
    wl["status"]["conditions"] = [
        {
            "type": "QuotaReserved",
            "status": "False",
            "reason": "Pending",
            "message": "",
            "lastTransitionTime": "2026-11-30T10:00:12Z",
        }
    ]
    before = len(sent)
    ledger._reactivate()
    await asyncio.sleep(0)
    assert len(sent) == before  # carol still waits
    del ledger._workloads.resources[f"{NS}/pod-jupyter-carol-u7"]  # carol admitted elsewhere / withdrew
    ledger._pods.resources.pop(f"{NS}/jupyter-carol")
    ledger.sync()
    ledger._reactivate()
    await asyncio.sleep(0)
    assert sent[-1] == ((NS, "job-job-0a1b2c3d4e"), True) and not ledger._taken_back
    # A refused deactivation: the next pass sends it again.
    wl["spec"]["active"], wl["metadata"]["annotations"] = True, {}
    wl["status"]["conditions"] = workload("bob", "vision", "u9", "2026-11-30T10:00:06Z")["status"]["conditions"]
    ledger.sync()
    fail[0] = True
    ledger.preempt_job("job:job-0a1b2c3d4e", "again")
    await asyncio.sleep(0)
    ledger.preempt_job("job:job-0a1b2c3d4e", "again")
    await asyncio.sleep(0)
    assert [a for _, a in sent[-2:]] == [False, False]
