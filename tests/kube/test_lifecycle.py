"""The spawn lifecycle through the API double: queue, admission, run, stop, preemption, faults.

Students have one L4 (no cohort), so a second student's L4 server queues behind the
first. Servers that only need to exist run a cheap command; the main lifecycle runs
the pod's real command (jupyterhub-singleuser) and talks to it.
"""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest
from jupyterhub.spawner import SpawnException

from double.harness import NAMESPACE
from gpuhub_spawner.kube.state import PendingPollers

pytestmark = pytest.mark.asyncio(loop_scope="function")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
WAIT = 60  # generous bound on a single step; never asserted as a duration


class Progress:
    """Collects a spawner's progress() messages in the background."""

    def __init__(self, spawner):
        self.messages: list[str] = []
        self.task = asyncio.ensure_future(self._run(spawner))

    async def _run(self, spawner):
        async for event in spawner.progress():
            self.messages.append(event["message"])

    async def until(self, predicate):
        while not any(predicate(m) for m in self.messages):
            if self.task.done():
                self.task.result()
                raise AssertionError(f"progress ended without it: {self.messages}")
            await asyncio.sleep(0.05)
        return next(m for m in self.messages if predicate(m))


async def until(predicate, timeout: float = WAIT):
    """Wait for ``predicate``; past ``timeout`` fail naming the line that waited (no wait here is unbounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"waited {timeout} s for the condition at line {predicate.__code__.co_firstlineno}")
        await asyncio.sleep(0.05)


async def answers(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url.rstrip("/") + "/api") as resp:
                    if resp.status == 200:
                        return await resp.json()
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)


async def test_queued_then_admitted_then_running_then_stopped(kube, make_spawner):
    first = make_spawner(user="ann", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(first.start(), WAIT)

    second = make_spawner(user="bob", groups=("students",), profile="l4-1")
    start = second.start()
    progress = Progress(second)
    waiting = await asyncio.wait_for(progress.until(lambda m: "1st of 1" in m), WAIT)
    assert "Waiting for quota: team Students has no free capacity; 1 L4 24GB GPU more needed." in waiting
    assert "in the Students queue" in waiting
    pod = kube.get("pods", NAMESPACE, second.pod_name)
    assert pod["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]
    assert not start.done()
    # The user never sees Kueue's or the scheduler's raw words.
    assert not any("couldn't assign" in m or "pod set" in m or "nodes are available" in m for m in progress.messages)

    await asyncio.wait_for(first.stop(), WAIT)  # frees the L4
    url = await asyncio.wait_for(start, WAIT)
    returned = time.monotonic()
    # Ready means answering: the kubelet's startup probe on the server's API made the pod
    # ready, so the first request after the spawn ends is answered (JupyterHub's own check
    # then passes at once instead of backing off) ...
    async with aiohttp.ClientSession() as session, session.get(url.rstrip("/") + "/api") as resp:
        assert resp.status == 200
    # ... and the spawn ended on the pod watch's event, not at KubeSpawner's next back-off
    # look at the reflector (up to 5 s apart by then).
    became_ready = kube.ready_at[f"{NAMESPACE}/{second.pod_name}"]
    assert returned - became_ready < 0.5, f"the spawn ended {returned - became_ready:.2f}s after the pod was ready"
    await asyncio.wait_for(progress.task, WAIT)
    assert any(m.startswith("Server started") for m in progress.messages)
    info = await asyncio.wait_for(answers(url), WAIT)  # the pod's own command and env serve Jupyter
    assert "version" in info
    pod = kube.get("pods", NAMESPACE, second.pod_name)
    probe = pod["spec"]["containers"][0]["startupProbe"]
    assert probe["httpGet"] == {"path": "/api", "port": second.port, "scheme": "HTTP"} and probe["periodSeconds"] == 1
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["GPUHUB_TEAM"] == "students" and env["JUPYTERHUB_USER"] == "bob"
    assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert await second.poll() is None

    await asyncio.wait_for(second.stop(), WAIT)
    await asyncio.wait_for(until(lambda: kube.list("pods", NAMESPACE) == []), WAIT)  # Kueue's finalizer may hold it a tick longer
    assert kube.list("workloads", NAMESPACE) == []
    assert await second.poll() == 1
    assert kube.invalid == [] and kube.errors == []


async def test_preempted_server_is_marked_stopped_and_the_user_told_why(kube, make_spawner):
    spawner = make_spawner(user="cat", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(spawner.start(), WAIT)
    assert await spawner.poll() is None
    # As in a hub that has been up a while: the shared Workload watch is established.
    await asyncio.wait_for(until(lambda: kube.watching("workloads")), WAIT)

    kube.preempt(NAMESPACE, spawner.pod_name, "InClusterQueue")
    await asyncio.wait_for(until(lambda: kube.get("pods", NAMESPACE, spawner.pod_name) is None), WAIT)
    await asyncio.wait_for(until(lambda: spawner._current_pod() is None), WAIT)
    assert await spawner.poll() == 1  # the hub now marks the server stopped
    assert "higher-priority server of your team" in spawner.stop_reason
    # The reason survives the hub's state round-trip and is shown on the next spawn form.
    state = spawner.get_state()
    spawner.clear_state()
    restored = make_spawner(user="cat", groups=("students",), profile="l4-1")
    restored.load_state(state)
    form = await restored.get_options_form()
    assert 'id="gpuhub-stop-reason"' in form and "higher-priority" in form
    await until(lambda: kube.list("workloads", NAMESPACE) == [])  # garbage-collected after its pod


async def test_preempted_while_launching_fails_the_spawn_with_the_reason(kube, make_spawner):
    spawner = make_spawner(user="dan", groups=("students",), profile="l4-1", cmd=SLEEPER)
    # Admitted, but the container "never gets ready": the kubelet double is not asked to run it.
    kube.call(lambda: setattr(kube, "_start_container", lambda ns, name: None))
    try:
        start = spawner.start()
        await asyncio.wait_for(until(lambda: spawner._admitted_at is not None and kube.watching("workloads")), WAIT)
        kube.preempt(NAMESPACE, spawner.pod_name, "InCohortReclamation")
        with pytest.raises(SpawnException) as err:
            await asyncio.wait_for(start, WAIT)
    finally:
        kube.call(lambda: delattr(kube, "_start_container"))
    assert "borrowed from another team" in str(err.value.log_message)
    assert kube.list("pods", NAMESPACE) == []


async def test_queue_timeout_withdraws_the_server(kube, make_spawner):
    blocker = make_spawner(user="eve", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(blocker.start(), WAIT)
    waiter = make_spawner(user="fay", groups=("students",), profile="l4-1", queue_timeout=1.0, launch_timeout=30.0)
    start = waiter.start()
    # JupyterHub's own limit covers queue + launch (+ slack), read right after start().
    assert waiter.start_timeout == 1 + 30 + waiter.start_timeout_slack
    with pytest.raises(SpawnException) as err:
        await asyncio.wait_for(start, WAIT)
    assert err.value.status_code == 503
    assert "waited 1s in team Students's queue" in err.value.log_message
    await until(lambda: kube.get("pods", NAMESPACE, waiter.pod_name) is None)  # no pod left behind
    await until(lambda: kube.workload_for(NAMESPACE, waiter.pod_name) is None)  # nor, once collected, its Workload
    assert [p["metadata"]["name"] for p in kube.list("pods", NAMESPACE)] == [blocker.pod_name]


async def test_launch_limit_applies_after_admission_only(kube, make_spawner):
    spawner = make_spawner(user="gil", groups=("students",), profile="cpu", queue_timeout=600.0, launch_timeout=1.0)
    kube.call(lambda: setattr(kube, "_start_container", lambda ns, name: None))  # admitted, never runs
    try:
        with pytest.raises(SpawnException) as err:
            await asyncio.wait_for(spawner.start(), WAIT)
    finally:
        kube.call(lambda: delattr(kube, "_start_container"))
    assert "did not start within 1s" in err.value.log_message
    await until(lambda: kube.list("pods", NAMESPACE) == [])


async def test_api_faults_recover_without_leaking_pods(kube, make_spawner):
    blocker = make_spawner(user="hal", groups=("students",), profile="l4-1", cmd=SLEEPER)
    kube.fail("POST", rf"/namespaces/{NAMESPACE}/pods$", 500, times=2)  # create fails twice, then works
    await asyncio.wait_for(blocker.start(), WAIT)
    assert kube.count("POST", "fault") == 2 and len(kube.list("pods", NAMESPACE)) == 1

    # A pod left over with the same name (a crashed hub): KubeSpawner gets 409, deletes it, retries.
    waiter = make_spawner(user="ida", groups=("students",), profile="l4-1", cmd=SLEEPER)
    stale = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": waiter.pod_name, "labels": {"component": "singleuser-server"}},
        "spec": {"containers": [{"name": "notebook", "image": "stale:1", "command": SLEEPER}]},
    }
    kube.call(kube._create_pod, NAMESPACE, stale)
    kube.fail("GET", r"pendingworkloads", 500, times=3)  # the queue position is briefly unavailable
    start = waiter.start()
    progress = Progress(waiter)
    await asyncio.wait_for(progress.until(lambda m: "1 L4 24GB GPU more needed" in m), WAIT)
    pod = kube.get("pods", NAMESPACE, waiter.pod_name)
    assert pod["spec"]["containers"][0]["image"] != "stale:1"

    await until(lambda: kube.count("GET", "fault") >= 1)  # a visibility poll failed while the server waited
    kube.drop_watches()  # every watch cut mid-stream while the server waits
    await asyncio.wait_for(blocker.stop(), WAIT)
    await asyncio.wait_for(start, WAIT)  # admission still seen through the re-established watches
    await asyncio.wait_for(progress.task, WAIT)
    await asyncio.wait_for(waiter.stop(), WAIT)
    await until(lambda: kube.list("pods", NAMESPACE) == [])
    assert kube.list("workloads", NAMESPACE) == []
    assert kube.invalid == []


async def test_api_calls_stay_bounded_with_100_waiting_spawns(kube, make_spawner):
    blocker = make_spawner(user="zed", groups=("students",), profile="l4-1", cmd=SLEEPER)
    await asyncio.wait_for(blocker.start(), WAIT)
    before = dict(kube.calls)
    # The double validates every pod against Kubernetes' schema on one thread; give 100 creates time.
    spawners = [
        make_spawner(user=f"s{i:03d}", groups=("students",), profile="l4-1", status_interval=0.5, k8s_api_request_timeout=60)
        for i in range(100)
    ]
    starts, progresses = [], []
    for i in range(0, len(spawners), 20):  # users arrive in waves; each new pod must show in the watch
        wave = spawners[i : i + 20]  # within KubeSpawner's 10 s, which 100 at once miss on a loaded machine
        starts += [s.start() for s in wave]
        progresses += [Progress(s) for s in wave]
        await asyncio.wait_for(until(lambda: all(s.pod_reflector.pods.get(f"{NAMESPACE}/{s.pod_name}") for s in wave)), WAIT)
    for p in progresses:
        await asyncio.wait_for(p.until(lambda m: "of 100 in the Students queue" in m), WAIT)
    # Kueue's own words ("... more needed") are on the head of the queue only: v0.19.2 leaves
    # the later waiters of the same shape without a QuotaReserved message (N3).
    first = next(p for p in progresses if "You are 1st of 100" in p.messages[-1])
    assert "1 L4 24GB GPU more needed" in first.messages[-1], first.messages[-1]
    poller = next(p for p in PendingPollers.all() if p.local_queue == "students")
    seen = poller.calls
    await asyncio.wait_for(until(lambda: poller.calls >= seen + 3), WAIT)  # everyone waited 3 more poll rounds
    after = dict(kube.calls)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get(("POST", "pods"), 0) == 100
    reads = sum(n for (method, what), n in delta.items() if (method, what) != ("POST", "pods"))
    # One visibility poller for the queue, shared watches: far fewer reads than waiting users.
    assert len([p for p in PendingPollers.all() if p.subscribers]) == 1
    assert delta.get(("GET", "pendingworkloads"), 0) <= poller.calls
    assert delta.get(("GET", "pods"), 0) == 0  # no per-spawner pod reads
    assert reads < 50, delta
    positions = sorted(int(p.messages[-1].split(" of 100")[0].rsplit(" ", 1)[-1][:-2]) for p in progresses)
    assert positions == list(range(1, 101))

    for start in starts:
        start.cancel()
    await asyncio.gather(*starts, return_exceptions=True)
    await asyncio.gather(*(s.stop(now=True) for s in spawners))
    await asyncio.gather(*(p.task for p in progresses), return_exceptions=True)
    await until(lambda: len(kube.list("pods", NAMESPACE)) == 1)
