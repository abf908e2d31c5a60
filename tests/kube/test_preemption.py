"""Kueue's preemption as the rendered ClusterQueues configure it, through the API double (issue 14).

The ClusterQueues come from ``render_objects`` (the shipped policy where it can show the
case); the pods are KueueSpawner's own server pods and the Jobs ``job_manifest``'s, created
through the double as a client would. What is asserted is what a cluster would show: which
Workloads hold quota, which were evicted and why (Kueue v0.19.2's condition reasons and
message, typed here from pkg/scheduler/preemption/preemption.go, not imported), the
preempted pod gone, the preempted Job suspended and re-queued. Every object the double
writes is validated against the real CRDs and kubernetes-validate (``kube.invalid``).
No hub runs here.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import requests
from kubernetes_asyncio.client import ApiClient

from double.harness import NAMESPACE, POLICY
from double.server import TOKEN
from gpuhub_spawner.kube.job_manifest import job_manifest
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.kube.kueue import PRIORITY_LABEL, pod_is_gated
from gpuhub_spawner.kube.render import render_objects
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.access import resolve_choice

pytestmark = pytest.mark.asyncio(loop_scope="function")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
WAIT = 30  # a guard against a hang, not a measurement: every step below is event-driven
GROUPS = {"vision": ("vision-lab",), "nlp": ("nlp-group",), "students": ("students",)}
AN_HOUR_AGO = "2000-01-01T00:00:00Z"


async def until(check, what):
    for _ in range(int(WAIT / 0.05)):
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def cond(obj, ctype) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def holds_quota(wl) -> bool:
    return cond(wl, "QuotaReserved").get("status") == "True"


async def server(kube, make_spawner, user, team, profile, priority=None) -> dict:
    """A user's server pod as KueueSpawner makes it (sleeping instead of Jupyter), created."""
    spawner = make_spawner(user=user, groups=GROUPS[team], profile=profile)
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    pod["spec"]["containers"][0].update(command=SLEEPER, args=[])
    if priority:
        pod["metadata"]["labels"][PRIORITY_LABEL] = priority
    status, body = kube.create("pods", NAMESPACE, pod)
    assert status == 201, body
    return body


async def job(kube, make_spawner, policy, user, team, profile, job_id) -> dict:
    """A gpuhub batch job as the Kubernetes backend submits it (the team's jobPriority)."""
    spawner = make_spawner(user=user, groups=GROUPS[team], profile=profile)
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    spec = parse_job(f"profile: {profile}\ncommand: [{sys.executable}, -c, 'import time; time.sleep(600)']\n")
    manifest = job_manifest(
        job_id, user, spec, policy, resolve_choice(policy, list(GROUPS[team]), {"profile": profile}), pod, namespace=NAMESPACE
    )
    r = requests.post(
        f"{kube.url}/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
        json=manifest,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 201, r.text
    return r.json()


def pod_workload(kube, pod) -> dict | None:
    return kube.workload_for(NAMESPACE, pod["metadata"]["name"])


def job_workload(kube, name) -> dict | None:
    return next(
        (
            w
            for w in kube.list("workloads", NAMESPACE)
            if any(ref["kind"] == "Job" and ref["name"] == name for ref in w["metadata"]["ownerReferences"])
        ),
        None,
    )


def running_job_pod(kube, name):
    return next((p for p in kube.pods_of_job(NAMESPACE, name) if (p.get("status") or {}).get("phase") == "Running"), None)


async def admitted(kube, pod=None, job_name=None) -> dict:
    if pod is not None:
        wl = await until(lambda: (w := pod_workload(kube, pod)) and holds_quota(w) and w, f"{pod['metadata']['name']} admitted")
        await until(lambda: not pod_is_gated(kube.get("pods", NAMESPACE, pod["metadata"]["name"])), "the gate lifted")
        return wl
    wl = await until(lambda: (w := job_workload(kube, job_name)) and holds_quota(w) and w, f"job {job_name} admitted")
    await until(lambda: running_job_pod(kube, job_name), f"job {job_name} running")
    return wl


async def waiting(kube, pod) -> dict:
    """The Workload once the scheduler has looked at it and left it pending (its decision made)."""
    return await until(
        lambda: (w := pod_workload(kube, pod)) and cond(w, "QuotaReserved").get("status") == "False" and w,
        f"{pod['metadata']['name']} to be considered",
    )


def admitted_long_ago(kube, wl):
    """As if this Workload got its quota an hour ago (two admissions in one test share a second)."""

    def do():
        obj = kube.objects[("workloads", NAMESPACE, wl["metadata"]["name"])]
        cond(obj, "QuotaReserved")["lastTransitionTime"] = AN_HOUR_AGO

    kube.call(do)


def ever_said(kube, wl, text) -> bool:
    """True if any version of this Workload's QuotaReserved message contained ``text``."""
    name = wl["metadata"]["name"]
    return kube.call(
        lambda: any(
            p == "workloads" and o["metadata"]["name"] == name and text in cond(o, "QuotaReserved").get("message", "")
            for _, _, p, o in kube.history
        )
    )


def shipped_with(replace: tuple[str, str] | None = None):
    text = POLICY.read_text()
    if replace:
        assert replace[0] in text
        text = text.replace(*replace, 1)
    return parse_policy(text)


def cluster_queue(policy, name) -> dict:
    return next(o for o in render_objects(policy, NAMESPACE) if o["kind"] == "ClusterQueue" and o["metadata"]["name"] == name)


async def vision_borrows_with_jobs(kube, make_spawner, policy):
    """Vision (2 A100 nominal) runs a server and two batch jobs: the third A100 is NLP's, lent."""
    alice = await server(kube, make_spawner, "alice", "vision", "a100-1")
    await admitted(kube, alice)
    await job(kube, make_spawner, policy, "ann", "vision", "a100-1", "job-0000000old")
    old = await admitted(kube, job_name="job-0000000old")
    admitted_long_ago(kube, old)
    await job(kube, make_spawner, policy, "ann", "vision", "a100-1", "job-0000000new")
    await admitted(kube, job_name="job-0000000new")
    assert (
        sum(
            1
            for w in kube.list("workloads", NAMESPACE)
            if holds_quota(w) and w["status"]["admission"]["podSetAssignments"][0]["flavors"].get("nvidia.com/gpu") == "a100"
        )
        == 3
    )
    return alice


async def test_a_borrowing_job_is_preempted_at_once_when_the_lender_asks_within_its_quota(kube, make_spawner, policy_store):
    policy = policy_store.policy
    assert cluster_queue(policy, "nlp")["spec"]["preemption"]["reclaimWithinCohort"] == "LowerPriority"
    alice = await vision_borrows_with_jobs(kube, make_spawner, policy)
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    bob_wl = await admitted(kube, bob)  # NLP's own A100, at once
    assert bob_wl["status"]["admission"]["podSetAssignments"][0]["flavors"]["nvidia.com/gpu"] == "a100"
    # Preemption first (the pass that found it could not fit), admission in a later pass.
    assert ever_said(
        kube,
        bob_wl,
        "insufficient unused quota for nvidia.com/gpu in flavor a100, 1 more needed. Pending the preemption of 1 workload(s)",
    )

    # Just enough, in Kueue's order: the lowest priority, then the most recently admitted.
    new = kube.get("jobs", NAMESPACE, "job-0000000new")
    assert new["spec"]["suspend"] is True and not new["status"].get("failed")  # suspended, nothing counted
    assert cond(new, "Suspended")["status"] == "True"
    assert kube.pods_of_job(NAMESPACE, "job-0000000new") == []
    wl = job_workload(kube, "job-0000000new")
    message = (
        f"Preempted to accommodate a workload (UID: {bob_wl['metadata']['uid']}, JobUID: {bob['metadata']['uid']}) "
        "due to reclamation within the cohort; preemptor path: /research/nlp; preemptee path: /research/vision"
    )
    assert (cond(wl, "Evicted")["status"], cond(wl, "Evicted")["reason"], cond(wl, "Evicted")["message"]) == (
        "True",
        "Preempted",
        message,
    )
    assert (cond(wl, "Preempted")["status"], cond(wl, "Preempted")["reason"]) == ("True", "InCohortReclamation")
    assert (cond(wl, "Requeued")["status"], cond(wl, "Requeued")["reason"]) == ("True", "Preempted")
    assert cond(wl, "Admitted")["status"] == "False" and "admission" not in wl["status"]
    # Re-queued: it waits for quota again (vision is at its nominal quota, NLP uses its own).
    wl = await until(
        lambda: (w := job_workload(kube, "job-0000000new")) and "more needed" in cond(w, "QuotaReserved")["message"] and w,
        "the preempted job to wait again",
    )
    assert cond(wl, "QuotaReserved")["message"] == (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor a100, 1 more needed"
    )

    assert holds_quota(job_workload(kube, "job-0000000old")) and running_job_pod(kube, "job-0000000old")
    assert kube.get("jobs", NAMESPACE, "job-0000000old")["spec"]["suspend"] is False
    assert holds_quota(pod_workload(kube, alice)) and kube.get("pods", NAMESPACE, alice["metadata"]["name"])
    assert kube.invalid == [] and kube.errors == []

    # When NLP's server stops, the job gets the loan back.
    kube.delete("pods", NAMESPACE, bob["metadata"]["name"])
    await admitted(kube, job_name="job-0000000new")
    wl = job_workload(kube, "job-0000000new")
    assert (cond(wl, "Evicted")["status"], cond(wl, "Evicted")["reason"]) == ("False", "QuotaReserved")
    assert cond(wl, "Evicted")["message"] == f"Previously: {message}"
    # The count survives the reset: how the hub knows an attempt was preempted (kube/job_manager.py).
    # Kueue v0.19.2 leaves the cause of a preemption empty (preemption.go: Evict(..., "", ...)).
    assert wl["status"]["schedulingStats"]["evictions"] == [{"reason": "Preempted", "underlyingCause": "", "count": 1}]


async def test_a_borrowing_server_of_equal_priority_is_not_preempted_and_the_lender_waits(kube, make_spawner):
    alice = await server(kube, make_spawner, "alice", "vision", "a100-1")
    await admitted(kube, alice)
    amy = await server(kube, make_spawner, "amy", "vision", "a100-1")
    await admitted(kube, amy)
    ada = await server(kube, make_spawner, "ada", "vision", "a100-1")  # borrows NLP's A100
    await admitted(kube, ada)
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    wl = await waiting(kube, bob)
    # Kueue leaves it to the hub (which reclaims with notice): LowerPriority spares an equal.
    # (NLP's GPU group lists its L4 flavor too, which the A100 pod's node selector rules out.)
    assert cond(wl, "QuotaReserved")["message"] == (
        "couldn't assign flavors to pod set main: flavor l4 doesn't match node affinity, "
        "insufficient unused quota for nvidia.com/gpu in flavor a100, 1 more needed"
    )
    for pod in (alice, amy, ada):
        assert holds_quota(pod_workload(kube, pod)) and not cond(pod_workload(kube, pod), "Evicted")
        assert kube.get("pods", NAMESPACE, pod["metadata"]["name"])
    assert pod_is_gated(kube.get("pods", NAMESPACE, bob["metadata"]["name"]))
    # The borrower stops (the hub's reclaim, or its user): the lender is admitted.
    kube.delete("pods", NAMESPACE, ada["metadata"]["name"])
    await admitted(kube, bob)
    assert kube.invalid == [] and kube.errors == []


async def test_a_team_that_does_not_reclaim_never_preempts(kube, make_spawner, policy_store):
    policy = shipped_with(
        (
            "    groups: [nlp-group]\n    cohort: research\n",
            "    groups: [nlp-group]\n    cohort: research\n    reclaim: {enabled: false}\n",
        )
    )
    nlp = cluster_queue(policy, "nlp")
    assert nlp["spec"]["preemption"]["reclaimWithinCohort"] == "Never"
    kube.apply([nlp])
    await vision_borrows_with_jobs(kube, make_spawner, policy_store.policy)
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    wl = await waiting(kube, bob)
    assert cond(wl, "QuotaReserved")["message"].endswith("1 more needed")  # no "Pending the preemption"
    for name in ("job-0000000old", "job-0000000new"):
        assert holds_quota(job_workload(kube, name)) and not cond(job_workload(kube, name), "Evicted")
        assert kube.get("jobs", NAMESPACE, name)["spec"]["suspend"] is False and running_job_pod(kube, name)
    assert pod_is_gated(kube.get("pods", NAMESPACE, bob["metadata"]["name"]))
    assert kube.invalid == [] and kube.errors == []


async def test_an_idle_cohort_keeps_lending(kube, make_spawner, policy_store):
    await vision_borrows_with_jobs(kube, make_spawner, policy_store.policy)
    # NLP works, but on what it did not lend: nothing is taken back.
    bob = await server(kube, make_spawner, "bob", "nlp", "cpu")
    carl = await server(kube, make_spawner, "carl", "nlp", "l4-1")
    await admitted(kube, bob)
    await admitted(kube, carl)
    for name in ("job-0000000old", "job-0000000new"):
        wl = job_workload(kube, name)
        assert holds_quota(wl) and not cond(wl, "Evicted") and running_job_pod(kube, name)
    assert kube.invalid == [] and kube.errors == []


async def test_within_the_team_a_higher_priority_server_preempts_a_lower_one(kube, make_spawner):
    """Students (no cohort, one L4; servers at "batch"): an "interactive" pod takes the L4."""
    erin = await server(kube, make_spawner, "erin", "students", "l4-1")
    erin_wl = await admitted(kube, erin)
    assert erin_wl["spec"]["priority"] == 100
    key = f"{NAMESPACE}/{erin['metadata']['name']}"
    process = kube.call(lambda: kube.processes[key])
    fay = await server(kube, make_spawner, "fay", "students", "l4-1", priority="interactive")
    fay_wl = await admitted(kube, fay)
    assert kube.get("pods", NAMESPACE, erin["metadata"]["name"]) is None and process.poll() is not None
    # The pod's last state: Kueue's stop condition; its Workload went with it (last write).
    gone = kube.last_written("pods", NAMESPACE, erin["metadata"]["name"])
    [stop] = [c for c in gone["status"]["conditions"] if c["type"] == "TerminationTarget"]
    assert stop["reason"] == "WorkloadEvictedDueToPreempted"
    last = kube.last_written("workloads", NAMESPACE, erin_wl["metadata"]["name"])
    message = (
        f"Preempted to accommodate a workload (UID: {fay_wl['metadata']['uid']}, JobUID: {fay['metadata']['uid']}) "
        "due to prioritization in the ClusterQueue; preemptor path: /students; preemptee path: /students"
    )
    assert (cond(last, "Preempted")["reason"], cond(last, "Preempted")["message"]) == ("InClusterQueue", message)
    assert stop["message"] == message
    assert cond(last, "Requeued")["status"] == "False"  # a pod's Workload is not re-queued (SkipReassignmentForPodOwnedWorkloads)
    assert kube.invalid == [] and kube.errors == []


THREE_TEAMS = """\
apiVersion: gpuhub/v1
flavors:
  - name: a100
    resource: nvidia.com/gpu
    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}
priorityClasses:
  - {name: interactive, value: 1000}
  - {name: mid, value: 500}
  - {name: batch, value: 100}
teams:
  - {name: vision, groups: [vision-lab], cohort: pool, defaultPriority: interactive, jobPriority: mid,
     quota: {cpu: 16, memory: 64Gi, gpus: {a100: {nominal: 1}}}}
  - {name: nlp, groups: [nlp-group], cohort: pool, defaultPriority: interactive,
     quota: {cpu: 16, memory: 64Gi, gpus: {a100: {nominal: 1}}}}
  - {name: students, groups: [students], cohort: pool, defaultPriority: interactive,
     quota: {cpu: 16, memory: 64Gi, gpus: {a100: {nominal: 1}}}}
profiles:
  - {slug: a100-1, displayName: 1x A100, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: a100}, teams: "*", default: true}
"""


@pytest.mark.parametrize("threshold", [None, 100])
async def test_a_borrowing_request_preempts_lower_borrowers_up_to_the_threshold(kube, make_spawner, threshold):
    """borrowWithinCohort: NLP, at its quota, wants a second A100 (it would borrow students'
    idle one, which vision's "mid" job borrows): rendered threshold 500 lets it preempt the
    job; with maxPriorityThreshold 100 the job is above it and stays."""
    policy = parse_policy(THREE_TEAMS)
    objs = render_objects(policy, NAMESPACE)
    nlp = next(o for o in objs if o["kind"] == "ClusterQueue" and o["metadata"]["name"] == "nlp")
    assert nlp["spec"]["preemption"]["borrowWithinCohort"] == {"policy": "LowerPriority", "maxPriorityThreshold": 500}
    if threshold is not None:
        nlp["spec"]["preemption"]["borrowWithinCohort"]["maxPriorityThreshold"] = threshold
    kube.reset()
    kube.apply(objs)
    # The pods are the shipped policy's (same team and queue names, A100 profile).
    alice = await server(kube, make_spawner, "alice", "vision", "a100-1")
    await admitted(kube, alice)
    await job(kube, make_spawner, policy, "ann", "vision", "a100-1", "job-00000000mid")
    await admitted(kube, job_name="job-00000000mid")
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    await admitted(kube, bob)
    ben = await server(kube, make_spawner, "ben", "nlp", "a100-1")
    if threshold is None:
        await admitted(kube, ben)
        wl = job_workload(kube, "job-00000000mid")
        assert (cond(wl, "Preempted")["reason"], kube.get("jobs", NAMESPACE, "job-00000000mid")["spec"]["suspend"]) == (
            "InCohortReclaimWhileBorrowing",
            True,
        )
        assert (
            "due to reclamation within the cohort while borrowing; preemptor path: /pool/nlp; preemptee path: /pool/vision"
            in (cond(wl, "Evicted")["message"])
        )
    else:
        await waiting(kube, ben)
        wl = job_workload(kube, "job-00000000mid")
        assert holds_quota(wl) and not cond(wl, "Evicted") and running_job_pod(kube, "job-00000000mid")
    assert kube.invalid == [] and kube.errors == []


async def test_only_the_preemptions_needed_are_made(kube, make_spawner, policy_store):
    """Vision runs a 2-A100 job (admitted long ago) and a newer 1-A100 job, borrowing one.
    A vision server wanting 2 A100s goes through the candidates newest first: the small job
    alone is not enough, the big one is; then the small one turns out not to be needed and
    is put back (Kueue's fillBackWorkloads)."""
    policy = policy_store.policy
    await job(kube, make_spawner, policy, "ann", "vision", "a100-2", "job-00000000big")
    big = await admitted(kube, job_name="job-00000000big")
    admitted_long_ago(kube, big)
    await job(kube, make_spawner, policy, "ann", "vision", "a100-1", "job-0000000small")
    await admitted(kube, job_name="job-0000000small")
    alice = await server(kube, make_spawner, "alice", "vision", "a100-2")
    alice_wl = await admitted(kube, alice)
    wl = job_workload(kube, "job-00000000big")
    assert kube.get("jobs", NAMESPACE, "job-00000000big")["spec"]["suspend"] is True
    assert cond(wl, "Preempted")["message"] == (
        f"Preempted to accommodate a workload (UID: {alice_wl['metadata']['uid']}, JobUID: {alice['metadata']['uid']}) "
        "due to prioritization in the ClusterQueue; preemptor path: /research/vision; preemptee path: /research/vision"
    )
    small = job_workload(kube, "job-0000000small")
    assert holds_quota(small) and not cond(small, "Evicted") and running_job_pod(kube, "job-0000000small")
    assert ever_said(kube, alice_wl, "Pending the preemption of 1 workload(s)")
    assert kube.invalid == [] and kube.errors == []


async def test_a_team_within_its_quota_keeps_it_even_from_a_higher_priority_borrower(kube, make_spawner, policy_store):
    """NLP's batch job runs on NLP's own A100; vision, at its quota, wants a third A100 for a
    server. borrowWithinCohort would allow preempting a lower priority, but only borrowers are
    candidates: the server waits."""
    await job(kube, make_spawner, policy_store.policy, "bob", "nlp", "a100-1", "job-0000000nlp")
    await admitted(kube, job_name="job-0000000nlp")
    for user in ("alice", "amy"):
        await admitted(kube, await server(kube, make_spawner, user, "vision", "a100-1"))
    ada = await server(kube, make_spawner, "ada", "vision", "a100-1")
    wl = await waiting(kube, ada)
    assert cond(wl, "QuotaReserved")["message"] == (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor a100, 1 more needed"
    )
    nlp = job_workload(kube, "job-0000000nlp")
    assert holds_quota(nlp) and not cond(nlp, "Evicted") and running_job_pod(kube, "job-0000000nlp")
    assert kube.invalid == [] and kube.errors == []


async def test_reclaim_any_would_delete_a_borrowing_server_without_notice(kube, make_spawner, policy_store):
    """Why the render says LowerPriority (docs/reclaim.md): with ``reclaimWithinCohort: Any``
    the lender's request deletes vision's borrowing server, the newest, at once."""
    nlp = cluster_queue(policy_store.policy, "nlp")
    nlp["spec"]["preemption"]["reclaimWithinCohort"] = "Any"
    kube.apply([nlp])
    alice = await server(kube, make_spawner, "alice", "vision", "a100-1")
    alice_wl = await admitted(kube, alice)
    admitted_long_ago(kube, alice_wl)
    amy = await server(kube, make_spawner, "amy", "vision", "a100-1")
    amy_wl = await admitted(kube, amy)
    ada = await server(kube, make_spawner, "ada", "vision", "a100-1")
    ada_wl = await admitted(kube, ada)
    admitted_long_ago(kube, ada_wl)  # so amy is the most recently admitted
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    await admitted(kube, bob)
    assert kube.get("pods", NAMESPACE, amy["metadata"]["name"]) is None
    last = kube.last_written("workloads", NAMESPACE, amy_wl["metadata"]["name"])
    assert cond(last, "Preempted")["reason"] == "InCohortReclamation"
    assert cond(last, "Preempted")["message"].endswith(
        "due to reclamation within the cohort; preemptor path: /research/nlp; preemptee path: /research/vision"
    )
    for pod in (alice, ada):
        assert holds_quota(pod_workload(kube, pod))
    assert kube.invalid == [] and kube.errors == []


async def test_a_request_that_needs_preemption_but_finds_none_keeps_its_quota_from_lower_ones(kube, make_spawner, policy_store):
    """Kueue's reserveCapacityForUnreclaimablePreempt: vision's 2-A100 server cannot fit (NLP
    uses its own A100, alice a vision one) and may preempt nobody; the batch job queued after
    it does not take the A100 it waits for, and the server gets both when NLP's stops."""
    alice = await server(kube, make_spawner, "alice", "vision", "a100-1")
    await admitted(kube, alice)
    bob = await server(kube, make_spawner, "bob", "nlp", "a100-1")
    await admitted(kube, bob)
    amy = await server(kube, make_spawner, "amy", "vision", "a100-2")
    await waiting(kube, amy)
    await job(kube, make_spawner, policy_store.policy, "ann", "vision", "a100-1", "job-000000small")
    wl = await until(
        lambda: (w := job_workload(kube, "job-000000small")) and cond(w, "QuotaReserved").get("status") == "False" and w,
        "the job to be considered",
    )
    assert cond(wl, "QuotaReserved")["message"].endswith(
        "insufficient unused quota for nvidia.com/gpu in flavor a100, 1 more needed"
    )
    kube.delete("pods", NAMESPACE, bob["metadata"]["name"])
    amy_wl = await admitted(kube, amy)
    assert amy_wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]["nvidia.com/gpu"] == "2"
    assert not holds_quota(job_workload(kube, "job-000000small"))  # vision holds 3: its quota and the loan
    assert kube.invalid == [] and kube.errors == []


async def test_lower_or_newer_equal_priority_takes_an_equal_only_if_it_was_created_later():
    """withinClusterQueue: LowerOrNewerEqualPriority (not rendered by gpuhub, modelled for
    completeness): the queue-order timestamp is the creation time, in whole seconds."""
    from collections import defaultdict

    from double.server import _Holder, _preemption_targets, _Quotas

    gpu = ("l4", "nvidia.com/gpu")
    cq = {
        "metadata": {"name": "t"},
        "spec": {
            "preemption": {"withinClusterQueue": "LowerOrNewerEqualPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [{"name": "l4", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "1"}]}],
                }
            ],
        },
    }
    quotas = _Quotas({("clusterqueues", None, "t"): cq})

    def workload(name, created, priority=100):
        return {
            "metadata": {"uid": name, "namespace": NAMESPACE, "name": name, "creationTimestamp": created},
            "spec": {"priority": priority},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "True", "lastTransitionTime": created}]},
        }

    preemptor = workload("p", "2026-11-30T10:00:10Z")
    for created, priority, taken in (
        ("2026-11-30T10:00:11Z", 100, True),
        ("2026-11-30T10:00:10Z", 100, False),
        ("2026-11-30T10:00:09Z", 100, False),
        ("2026-11-30T10:00:09Z", 99, True),
    ):
        holder = _Holder(workload("h", created, priority), "t", {gpu: 1})
        used = defaultdict(int, {("t", *gpu): 1})
        targets = _preemption_targets(preemptor, "t", {gpu: 1}, {gpu}, used, {"t": [holder]}, quotas)
        assert [(t.key[1], reason) for t, reason in targets] == ([("h", "InClusterQueue")] if taken else []), (created, priority)
