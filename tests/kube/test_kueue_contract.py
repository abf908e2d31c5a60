"""Kueue v0.19.2's own words and failure modes, through the API double and KueueSpawner.

The literal strings in these tests are typed from Kueue v0.19.2's source (file named
beside each), not imported from ``gpuhub_spawner.kube.kueue``: if the module and the
double drifted together away from Kueue, these would fail.
"""

from __future__ import annotations

import asyncio
import copy
import sys

import pytest
from jupyterhub.spawner import SpawnException

from double.harness import HUB_NAMESPACE, NAMESPACE
from gpuhub_spawner.kube.kueue import pod_is_gated
from gpuhub_spawner.kube.messages import eviction_message

pytestmark = pytest.mark.asyncio(loop_scope="function")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
WAIT = 60


async def until(predicate, timeout: float = WAIT):
    """Wait for ``predicate``; past ``timeout`` fail naming the line that waited (no wait here is unbounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"waited {timeout} s for the condition at line {predicate.__code__.co_firstlineno}")
        await asyncio.sleep(0.05)


async def status_until(spawner, predicate):
    while True:
        message = spawner.queue_status()["message"]
        if predicate(message):
            return message
        await asyncio.sleep(0.05)


def quota_reserved(kube, pod_name) -> dict:
    wl = kube.workload_for(NAMESPACE, pod_name) or {}
    return next((c for c in (wl.get("status") or {}).get("conditions") or [] if c["type"] == "QuotaReserved"), {})


async def test_a_request_beyond_the_team_capacity_says_pick_a_smaller_profile(kube, make_spawner):
    """The validator refuses such a policy; a ClusterQueue edited on the cluster is how it happens."""
    cq = kube.get("clusterqueues", None, "students")
    for rg in cq["spec"]["resourceGroups"]:
        for fl in rg["flavors"]:
            for res in fl["resources"]:
                if res["name"] == "nvidia.com/gpu":
                    res["nominalQuota"] = "0"
    kube.apply([{k: v for k, v in cq.items() if k != "status"}])
    spawner = make_spawner(user="amy", groups=("students",), profile="l4-1", queue_timeout=600.0)
    start = spawner.start()
    try:
        message = await asyncio.wait_for(status_until(spawner, lambda m: "never start" in m), WAIT)
        # pkg/scheduler/flavorassigner/flavorassigner.go (fitsResourceQuota), Assignment.Message()
        cond = quota_reserved(kube, spawner.pod_name)
        assert (cond["status"], cond["reason"], cond["message"]) == (
            "False",
            "Pending",
            "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor l4, "
            "previously considered podsets requests (0) + current podset request (1) > maximum capacity (0)",
        )
        assert (
            "This server can never start in team Students's queue: 1 L4 24GB GPU requested but the team can hold "
            "at most 0 L4 24GB GPUs. Pick a smaller profile."
        ) in message
    finally:
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await spawner.stop(now=True)


async def test_an_inactive_cluster_queue_reads_as_not_accepting(kube, make_spawner):
    kube.call(lambda: kube._write("resourceflavors", None, kube.objects[("resourceflavors", None, "l4")], "DELETED"))
    spawner = make_spawner(user="ben", groups=("students",), profile="l4-1", queue_timeout=600.0)
    start = spawner.start()
    try:
        message = await asyncio.wait_for(status_until(spawner, lambda m: "not accepting" in m), WAIT)
        # pkg/scheduler/scheduler.go: the scheduler writes it with the legacy reason "Pending".
        cond = quota_reserved(kube, spawner.pod_name)
        assert (cond["reason"], cond["message"]) == ("Pending", "ClusterQueue students is inactive")
        assert "team Students's queue is not accepting servers right now" in message
    finally:
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await spawner.stop(now=True)


async def test_kueue_started_event_means_admitted_not_running(kube, make_spawner):
    spawner = make_spawner(user="cal", groups=("students",), profile="cpu", queue_timeout=600.0, launch_timeout=600.0)
    kube.call(lambda: setattr(kube, "_start_container", lambda ns, name: None))  # admitted, never runs
    start = spawner.start()
    try:
        await asyncio.wait_for(until(lambda: any(e.get("reason") == "Started" for e in spawner.events)), WAIT)
        started = next(e for e in spawner.events if e.get("reason") == "Started")
        # pkg/controller/jobframework/reconciler.go startJob, pod_controller.go Run
        assert started["message"] == "Admitted by clusterQueue students"
        # Once the hub has seen the gate lifted too (pods and events arrive on separate watches):
        await asyncio.wait_for(until(lambda: spawner._current_pod() and not pod_is_gated(spawner._current_pod())), WAIT)
        assert spawner.queue_status()["message"] == "Quota granted; your server is being placed on a node."
    finally:
        kube.call(lambda: delattr(kube, "_start_container"))
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await spawner.stop(now=True)


async def test_preempted_pod_carries_kueues_termination_condition(kube, make_spawner):
    spawner = make_spawner(user="deb", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(spawner.start(), WAIT)
    await asyncio.wait_for(until(lambda: kube.watching("workloads")), WAIT)
    kube.preempt(NAMESPACE, spawner.pod_name, "InClusterQueue")
    await asyncio.wait_for(until(lambda: spawner._current_pod() is None), WAIT)
    _, gone = spawner.pod_reflector.gone[f"{NAMESPACE}/{spawner.pod_name}"]
    # pkg/controller/jobs/pod/pod_controller.go Stop; reconciler.go: "WorkloadEvicted" + "DueTo" + reason
    [cond] = [c for c in gone["status"]["conditions"] if c["type"] == "TerminationTarget"]
    assert cond["reason"] == "WorkloadEvictedDueToPreempted"
    # Even with no Workload left to read, the pod's own condition is told in plain words.
    assert "stopped by the queue to make room for a higher-priority server" in eviction_message(None, gone)
    assert await spawner.poll() == 1


async def test_workload_is_the_one_owned_by_this_pods_uid(kube, make_spawner):
    """A leftover Workload of an earlier pod with the same name must not speak for this one."""
    blocker = make_spawner(user="eli", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(blocker.start(), WAIT)
    waiter = make_spawner(user="fox", groups=("students",), profile="l4-1", queue_timeout=600.0)
    start = waiter.start()
    try:
        await asyncio.wait_for(status_until(waiter, lambda m: "more needed" in m), WAIT)
        real = kube.workload_for(NAMESPACE, waiter.pod_name)
        stale = copy.deepcopy(real)
        stale["metadata"] = {
            "name": real["metadata"]["name"] + "-old",
            "namespace": NAMESPACE,
            "creationTimestamp": "2999-01-01T00:00:00Z",  # newest by name order
            "ownerReferences": [{**real["metadata"]["ownerReferences"][0], "uid": "0000-old-pod"}],
        }
        stale["status"] = {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Inadmissible",
                    "message": "LocalQueue students doesn't exist",
                    "lastTransitionTime": "2999-01-01T00:00:00Z",
                },
                {
                    "type": "Finished",
                    "status": "True",
                    "reason": "Failed",
                    "message": "old pod",
                    "lastTransitionTime": "2999-01-01T00:00:00Z",
                },
            ]
        }
        kube.call(lambda: kube._write("workloads", NAMESPACE, stale, "ADDED"))
        await asyncio.wait_for(
            until(lambda: waiter.workload_reflector.resources.get(f"{NAMESPACE}/{stale['metadata']['name']}")), WAIT
        )
        await asyncio.sleep(0.3)
        message = waiter.queue_status()["message"]
        assert "1 L4 24GB GPU more needed" in message and "not accepting" not in message
    finally:
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await waiter.stop(now=True)
        await blocker.stop(now=True)


HUB_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "hub-0", "labels": {"component": "hub"}},
    "spec": {"containers": [{"name": "hub", "image": "quay.io/jupyterhub/k8s-hub:4.4.0", "command": SLEEPER}]},
}


async def test_kueue_down_the_hub_namespace_still_creates_pods_and_users_are_told(kube, make_spawner):
    kube.set_kueue(False)
    try:
        # Kueue's own manifests call its pod webhook (failurePolicy: Fail) in every namespace
        # but kube-system and kueue-system: the hub's pods could not be created anywhere else.
        kube.call(lambda: setattr(kube, "webhook_namespaces", None))
        code, body = kube.create("pods", HUB_NAMESPACE, HUB_POD)
        assert code == 500 and 'failed calling webhook "mpod.kb.io"' in body["message"]
        # The documented layout narrows the webhook to the user namespace: the hub is unaffected.
        kube.call(lambda: setattr(kube, "webhook_namespaces", {NAMESPACE}))
        code, body = kube.create("pods", HUB_NAMESPACE, HUB_POD)
        assert code == 201 and "finalizers" not in body["metadata"] and "schedulingGates" not in body["spec"]

        # A user's spawn meanwhile fails at once, in plain words, without retrying for an hour.
        spawner = make_spawner(user="gus", groups=("students",), profile="cpu")
        with pytest.raises(SpawnException) as err:
            await asyncio.wait_for(spawner.start(), WAIT)
        assert err.value.status_code == 503
        assert "queue service (Kueue) is not answering" in err.value.message
        assert kube.count("POST", "pods") == 1  # the one user pod request: not retried
        assert kube.list("pods", NAMESPACE) == []
    finally:
        kube.set_kueue(True)


async def test_stop_while_kueue_is_down_returns_and_the_finalizer_is_released_later(kube, make_spawner):
    spawner = make_spawner(user="hil", groups=("students",), profile="cpu", cmd=SLEEPER)
    await asyncio.wait_for(spawner.start(), WAIT)
    pod = kube.get("pods", NAMESPACE, spawner.pod_name)
    assert pod["metadata"]["finalizers"] == ["kueue.x-k8s.io/managed"]  # pod_webhook.go Default
    process = kube.call(lambda: kube.processes[f"{NAMESPACE}/{spawner.pod_name}"])
    kube.set_kueue(False)
    try:
        await asyncio.wait_for(spawner.stop(), WAIT)  # does not wait for Kueue
        held = kube.get("pods", NAMESPACE, spawner.pod_name)
        assert held["metadata"]["deletionTimestamp"] and held["metadata"]["finalizers"] == ["kueue.x-k8s.io/managed"]
        assert process.poll() is not None  # the server itself is gone; its resources are free
        assert await spawner.poll() is not None
    finally:
        kube.set_kueue(True)
    await asyncio.wait_for(until(lambda: kube.get("pods", NAMESPACE, spawner.pod_name) is None), WAIT)
    assert kube.invalid == [] and kube.errors == []


async def test_ephemeral_storage_from_a_limitrange_is_admitted(kube, make_spawner):
    """A LimitRange's default request reaches the pod; Kueue counts it, so it must be covered."""
    spawner = make_spawner(
        user="ivy", groups=("students",), profile="cpu", cmd=SLEEPER, extra_resource_guarantees={"ephemeral-storage": "1Gi"}
    )
    await asyncio.wait_for(spawner.start(), WAIT)
    wl = kube.workload_for(NAMESPACE, spawner.pod_name)
    assert wl["status"]["admission"]["podSetAssignments"][0]["flavors"]["ephemeral-storage"] == "gpuhub-default"
    await spawner.stop(now=True)


async def test_a_resource_no_cluster_queue_lists_is_explained(kube, make_spawner):
    spawner = make_spawner(
        user="jay",
        groups=("students",),
        profile="cpu",
        queue_timeout=600.0,
        extra_resource_guarantees={"hugepages-2Mi": "64Mi"},
        extra_resource_limits={"hugepages-2Mi": "64Mi"},
    )
    start = spawner.start()
    try:
        message = await asyncio.wait_for(status_until(spawner, lambda m: "never start" in m), WAIT)
        # flavorassigner.go: "resource %s unavailable in ClusterQueue"
        assert "resource hugepages-2Mi unavailable in ClusterQueue" in quota_reserved(kube, spawner.pod_name)["message"]
        assert "the team's queue has no quota for hugepages-2Mi" in message and "LimitRange" in message
    finally:
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await spawner.stop(now=True)


async def _orphan_a_queued_pod(kube, make_spawner, user):
    """What a hub restart leaves behind: a gated pod whose spawner (hub process) is gone."""
    old = make_spawner(user=user, groups=("students",), profile="l4-1", queue_timeout=600.0)
    start = old.start()
    await asyncio.wait_for(status_until(old, lambda m: "more needed" in m), WAIT)
    start.cancel()  # the hub process dies: nobody deletes the pod
    await asyncio.gather(start, return_exceptions=True)
    pod = kube.get("pods", NAMESPACE, old.pod_name)
    assert pod and pod_is_gated(pod)
    return pod


async def test_after_a_restart_a_queued_pod_is_resumed_and_admitted_in_place(kube, make_spawner):
    blocker = make_spawner(user="kim", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(blocker.start(), WAIT)
    pod = await _orphan_a_queued_pod(kube, make_spawner, "lee")
    new = make_spawner(user="lee", groups=("students",), profile="l4-1", queue_timeout=600.0)
    new._started = None  # as the hub loads it from its database after a restart
    check = asyncio.ensure_future(new.poll())
    await asyncio.wait_for(until(lambda: new._spawn_pending), WAIT)  # a pending spawn again
    await asyncio.sleep(0.5)
    assert not check.done() and kube.get("pods", NAMESPACE, new.pod_name)["metadata"]["uid"] == pod["metadata"]["uid"]
    await blocker.stop(now=True)
    assert await asyncio.wait_for(check, WAIT) is None  # running: the hub keeps it
    assert kube.get("pods", NAMESPACE, new.pod_name)["metadata"]["uid"] == pod["metadata"]["uid"]
    await new.stop(now=True)


async def test_after_a_restart_the_queue_timeout_still_counts_from_the_pods_creation(kube, make_spawner):
    blocker = make_spawner(user="max", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(blocker.start(), WAIT)
    await _orphan_a_queued_pod(kube, make_spawner, "ned")
    new = make_spawner(user="ned", groups=("students",), profile="l4-1", queue_timeout=1.0)
    new._started = None
    assert await asyncio.wait_for(new.poll(), WAIT) == 1  # the hub then stops it (deletes the pod)
    assert "waited 1s in team Students's queue" in new.stop_reason and not new._spawn_pending
    await new.stop(now=True)
    assert kube.get("pods", NAMESPACE, new.pod_name) is None
    await blocker.stop(now=True)
