"""Kueue's decisions on the real controller (v0.19.2, tests/cluster/up.sh) and on the API
double, side by side: the review's points N2, N3, N4/N5 (issue 22).

The double's side always runs; the real side is opt-in (``GPUHUB_CLUSTER=1``) and skipped
with the reason otherwise. Each test runs the same
steps on both backends through the Kubernetes REST API (pods created as the hub creates
them: a LocalQueue label and a priority-class label), prints what each backend left, and
asserts what real Kueue does, on both: each difference the real controller showed was fixed
in the double (N2 cycle order, N3 one message per shape, N4 the pod integration's event
component, N5 an empty preemption cause, quotas with decimal suffixes such as ``100k``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402

from double.harness import NAMESPACE  # noqa: E402
from backends import l4_policy  # noqa: E402
from support.hub import waiter


POLICY = l4_policy(
    """\
priorityClasses:
  - {name: low, value: 100}
  - {name: high, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    cohort: research
    defaultPriority: low
    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    cohort: research
    defaultPriority: high
    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
"""
)


class Backend:
    def __init__(self, name: str, api: real.RealCluster, apply, reset):
        self.name, self.api, self._apply, self._reset = name, api, apply, reset

    def pod(self, name: str, queue: str, priority: str, gpus: int = 1) -> dict:
        return self.api.create(
            "pods",
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": {"kueue.x-k8s.io/queue-name": queue, "kueue.x-k8s.io/priority-class": priority},
                },
                "spec": real.restricted(
                    {
                        "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 1,
                        "containers": [
                            {
                                "name": "notebook",
                                "image": "registry.example.com/gpuhub/notebook:cuda-0.1.0",
                                "command": ["sleep", "600"],
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": str(gpus)},
                                    "limits": {"nvidia.com/gpu": str(gpus)},
                                },
                            }
                        ],
                    }
                ),
            },
        )

    def workload_of(self, pod_name: str) -> dict | None:
        return next(
            (
                w
                for w in self.api.list("workloads", NAMESPACE)
                if any(o["name"] == pod_name for o in w["metadata"].get("ownerReferences", []))
            ),
            None,
        )

    def condition(self, pod_name: str, ctype: str) -> dict | None:
        wl = self.workload_of(pod_name) or {}
        return next((c for c in wl.get("status", {}).get("conditions", []) if c["type"] == ctype), None)

    def admitted(self, pod_name: str) -> bool:
        c = self.condition(pod_name, "QuotaReserved")
        return bool(c and c["status"] == "True")

    def waiting_with_message(self, pod_name: str) -> bool:
        c = self.condition(pod_name, "QuotaReserved")
        return bool(c and c["status"] == "False")

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self.api.list("pods", NAMESPACE)}

    def events(self, pod_name: str) -> list[tuple]:
        return [
            (e.get("reportingComponent") or (e.get("source") or {}).get("component"), e["type"], e["reason"], e["message"])
            for e in self.api.list("events", NAMESPACE)
            if e["involvedObject"]["name"] == pod_name
        ]

    def delete_pod(self, name: str) -> None:
        self.api.delete("pods", NAMESPACE, name, grace=1)


until = waiter(60)


class Watch(threading.Thread):
    """A watch on ``path`` (the API server's or the double's), keeping every version of every
    object it reports, the DELETED ones' last state included: what the hub's reflectors see."""

    def __init__(self, api: real.RealCluster, path: str, **params: str):
        super().__init__(daemon=True, name=f"watch {path}")
        self.api, self.path, self.params = api, path, params
        self.versions: list[tuple[str, dict]] = []
        self.error: Exception | None = None
        self._opened = threading.Event()
        self._halt = threading.Event()

    def begin(self) -> "Watch":
        self.start()
        if not self._opened.wait(15):
            raise TimeoutError(f"the watch on {self.path} did not open in 15 s: {self.error}")
        return self

    def run(self) -> None:
        # Short watches (the server ends each after 2 s), each resumed from the last
        # resourceVersion seen, so a stop never has to close a stream under its reader.
        rv = "0"
        while not self._halt.is_set():
            params = {**self.params, "watch": "1", "resourceVersion": rv, "timeoutSeconds": "2", "allowWatchBookmarks": "true"}
            try:
                with self.api.session.get(self.api.url + self.path, params=params, stream=True, timeout=(15, 30)) as r:
                    r.raise_for_status()
                    self._opened.set()
                    for line in r.iter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        rv = event["object"].get("metadata", {}).get("resourceVersion") or rv
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self.versions.append((event["type"], event["object"]))
            except Exception as e:  # noqa: BLE001  (said by stop())
                self.error = e
                self._opened.set()
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert not self.is_alive(), f"the watch on {self.path} did not end"
        assert self.error is None, f"the watch on {self.path} failed: {self.error!r}"

    def last(self, match) -> dict | None:
        return next((obj for _, obj in reversed(self.versions) if match(obj)), None)

    def deleted(self, name: str) -> bool:
        return any(t == "DELETED" and obj["metadata"]["name"] == name for t, obj in self.versions)


# real_cluster: the session's one real control plane (tests/kube/conftest.py)


@pytest.fixture(params=["real", "double"])
def backend(request, tmp_path):
    if request.param == "real":
        cluster = request.getfixturevalue("real_cluster")
        cluster.ensure_namespace(NAMESPACE)  # the install-guide test deletes and recreates it
        cluster.reset(NAMESPACE)
        cluster.apply_policy(POLICY, NAMESPACE, tmp_path)
        b = Backend("real", cluster, None, lambda: cluster.reset(NAMESPACE))
    else:
        from double.harness import apply_policy
        from double.server import TOKEN

        double = request.getfixturevalue("double")
        apply_policy(double, POLICY)
        b = Backend("double", real.RealCluster.for_double(double.url, TOKEN), None, double.reset)
    yield b
    for name in list(b.pods()):
        b.api.delete("pods", NAMESPACE, name, grace=0)
    b._reset()


def test_n2_a_lenders_own_quota_request_goes_before_a_higher_priority_borrower(request, backend):
    """N2: vision (lender) and nlp each hold 1 L4 of the cohort's 2. vision-2 (low priority,
    within vision's nominal quota once vision-1 stops) and nlp-2 (high priority, would borrow
    vision's L4) wait together; vision-1 stops. Real Kueue admits vision-2."""
    backend.pod("vision-1", "vision", "low")
    backend.pod("nlp-1", "nlp", "high")
    until(lambda: backend.admitted("vision-1") and backend.admitted("nlp-1"), what="vision-1 and nlp-1 admitted")
    backend.pod("vision-2", "vision", "low")
    time.sleep(1.1)  # distinct creation seconds: nlp-2 is the newer one, FIFO would not favour it
    backend.pod("nlp-2", "nlp", "high")
    until(lambda: backend.waiting_with_message("vision-2") and backend.waiting_with_message("nlp-2"), what="both waiting")
    backend.delete_pod("vision-1")
    first = until(lambda: next((p for p in ("vision-2", "nlp-2") if backend.admitted(p)), None), what="one admitted")
    time.sleep(2)
    both = {p: backend.admitted(p) for p in ("vision-2", "nlp-2")}
    print(
        f"\n[{backend.name}] N2: admitted first: {first}; after 2 s: {both}; "
        f"nlp-2 QuotaReserved: {json.dumps(backend.condition('nlp-2', 'QuotaReserved'))}"
    )
    assert first == "vision-2", both
    # Either nlp-2 fitted when the cycle began (by borrowing) and lost the L4 to vision-2 within
    # it, or the cycle began after vision-2's admission: both are seen on the real controller.
    assert backend.condition("nlp-2", "QuotaReserved")["message"] in (
        "Workload no longer fits after processing another workload",
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor l4, 1 more needed",
    )


def test_n3_later_waiters_of_the_same_shape_get_no_message_in_a_cycle(request, backend):
    """N3: vision's one L4 is in use; three more 1-L4 requests wait. Real Kueue writes its
    "insufficient unused quota" message on the head only; the others get none (or keep none)."""
    backend.pod("vision-1", "vision", "low")
    until(lambda: backend.admitted("vision-1"), what="vision-1 admitted")
    # nlp's L4 is taken too, so nothing can be borrowed
    backend.pod("nlp-1", "nlp", "high")
    until(lambda: backend.admitted("nlp-1"), what="nlp-1 admitted")
    for i in (2, 3, 4):
        backend.pod(f"vision-{i}", "vision", "low")
        time.sleep(1.1)
    until(lambda: backend.waiting_with_message("vision-2"), what="vision-2 waiting with a message")
    time.sleep(5)  # several scheduling cycles
    seen = {p: backend.condition(p, "QuotaReserved") for p in ("vision-2", "vision-3", "vision-4")}
    print(f"\n[{backend.name}] N3: QuotaReserved per waiter:")
    for p, c in seen.items():
        print(f"  {p}: {json.dumps(c)}")
    assert seen["vision-2"] and "insufficient unused quota" in seen["vision-2"]["message"], seen
    assert not any(c and c.get("message") for c in (seen["vision-3"], seen["vision-4"])), seen


def test_n4_n5_pod_events_and_preemption_cause(request, backend):
    """N4: Kueue's pod events are reported by ``pod-kueue-controller`` (reportingComponent /
    source.component). N5: a preempted Workload's eviction record (schedulingStats) and
    conditions, as real Kueue writes them; printed, with the parts the hub reads asserted."""
    backend.pod("vision-low", "vision", "low")
    until(lambda: backend.admitted("vision-low"), what="vision-low admitted")
    until(lambda: any(e[2] == "Started" for e in backend.events("vision-low")), what="Kueue's Started event")
    events = backend.events("vision-low")
    print(f"\n[{backend.name}] N4: events of an admitted pod: {events}")
    kueue_events = [e for e in events if e[2] == "CreatedWorkload" or (e[2] == "Started" and e[3].startswith("Admitted by"))]
    # nlp's L4 taken, so vision-high cannot borrow: it preempts within vision's own queue
    backend.pod("nlp-1", "nlp", "high")
    until(lambda: backend.admitted("nlp-1"), what="nlp-1 admitted")
    # Kueue preempts vision-low within a second and deletes its pod (and then its Workload):
    # the victim's every version is read from watches, as the hub's reflectors see it (a poll
    # every 0.2 s missed the moment on the real plane).
    pods = Watch(backend.api, backend.api.path("pods", NAMESPACE), fieldSelector="metadata.name=vision-low").begin()
    workloads = Watch(backend.api, backend.api.path("workloads", NAMESPACE)).begin()
    try:
        backend.pod("vision-high", "vision", "high")

        def victim_workload() -> dict | None:
            return workloads.last(lambda w: any(o["name"] == "vision-low" for o in w["metadata"].get("ownerReferences", [])))

        def evicted() -> bool:
            c = next(
                (c for c in ((victim_workload() or {}).get("status") or {}).get("conditions", []) if c["type"] == "Evicted"), None
            )
            return bool(c and c["status"] == "True") or pods.deleted("vision-low")

        until(evicted, what="vision-low's Workload Evicted, or its pod deleted, in the watches")
        until(lambda: backend.admitted("vision-high"), what="vision-high admitted")
        until(
            lambda: pods.deleted("vision-low") and "Preempted" in json.dumps(victim_workload()),
            what="vision-low's pod deleted and its Workload's Preempted condition, in the watches",
        )
    finally:
        pods.stop()
        workloads.stop()
    seen = {"workload": victim_workload(), "pod": pods.last(lambda p: p["metadata"]["name"] == "vision-low")}
    wl_status = (seen.get("workload") or {}).get("status") or {}
    print(
        f"[{backend.name}] N5: preempted Workload conditions: "
        f"{json.dumps([c for c in wl_status.get('conditions', []) if c['type'] in ('Evicted', 'Preempted', 'Requeued')])}"
    )
    print(f"[{backend.name}] N5: preempted Workload schedulingStats: {json.dumps(wl_status.get('schedulingStats'))}")
    print(
        f"[{backend.name}] N5: preempted pod conditions: "
        f"{json.dumps([c for c in ((seen.get('pod') or {}).get('status') or {}).get('conditions', []) if c['type'] == 'TerminationTarget'])}"
    )
    print(f"[{backend.name}] N5: preempted pod events: {backend.events('vision-low')}")
    assert kueue_events and all(e[0] == "pod-kueue-controller" for e in kueue_events), kueue_events
    preempted = next(c for c in wl_status["conditions"] if c["type"] == "Preempted")
    assert preempted["reason"] == "InClusterQueue" and preempted["message"].startswith("Preempted to accommodate a workload")
    assert wl_status["schedulingStats"]["evictions"] == [{"reason": "Preempted", "underlyingCause": "", "count": 1}]


def test_the_renderers_unlimited_cpu_placeholder_admits(request, backend):
    """A team without a cpu/memory quota gets the renderer's placeholder (``100k`` cores,
    ``1Pi``). Real Kueue admits against it; the double's admission loop raised on ``100k``
    (its ``_amount`` parses quotas with the policy's CPU parser, which takes only plain
    and milli cores), so nothing was admitted at all."""
    text = POLICY.replace(
        "    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}\n", "    quota: {gpus: {l4: {nominal: 1}}}\n"
    )
    assert "100k" not in text and text != POLICY
    if backend.name == "real":
        backend.api.reset(NAMESPACE)
        out = backend.api.apply_policy(text, NAMESPACE, Path(request.getfixturevalue("tmp_path")) / "placeholder")
        print(out)
        cq = backend.api.get("/apis/kueue.x-k8s.io/v1beta2/clusterqueues/vision")
        assert any(
            r.get("nominalQuota") == "100k" for g in cq["spec"]["resourceGroups"] for f in g["flavors"] for r in f["resources"]
        ), cq["spec"]
    else:
        from double.harness import apply_policy

        apply_policy(request.getfixturevalue("double"), text)
    backend.pod("vision-1", "vision", "low")
    until(lambda: backend.admitted("vision-1"), timeout=30, what="vision-1 admitted")
