"""Fair share on Kubernetes (issue 41): Kueue v0.19.2 admits in the order the one-machine queue
(``admission/fairshare.py``) predicts for the same policy and the same history.

What each side orders by (docs/fair-share.md, "Where Kueue orders differently"), for requests of
equal priority that all must borrow:

* between teams (ClusterQueues of a cohort): Kueue's Fair Sharing tournament, the lowest
  *dominant resource share* after admission first (borrowed GPUs / the cohort's lendable GPUs /
  ``fairSharing.weight``); the one-machine queue: the lowest borrowed GPUs / ``weight`` after
  admission (step 3). The same order (the lendable total is one constant). Neither looks at
  history here: the one-machine queue's step 4 (a team's decayed use) breaks only exact ties
  of step 3, and Kueue has no history between ClusterQueues at all. The scenario has no such
  tie, and the test checks that the prediction does not change when the teams' history is
  swapped, so nothing here rests on the one thing Kueue cannot do.
* inside a team, between users (``fairShare.users``): Kueue's Admission Fair Sharing orders the
  team's ClusterQueue by the decayed usage of each workload's LocalQueue (one per user, made as
  the hub makes them: ``kube.render.user_local_queue``), before priority; the one-machine
  queue by each user's decayed GPU-seconds (step 5), after priority. Kueue's figure is an
  exponentially weighted average of the GPUs admitted, sampled every ``usageSamplingInterval``
  (``consumedResources`` in the LocalQueue's status), the hub's the decayed integral: for a
  continuous record they differ by the constant factor halfLife / ln 2, so they order alike
  wherever sampling does not blur the difference (here: a user who held GPUs against users who
  held none).

The scenario: one cohort, teams NLP (weight 3), Vision (2), Speech (1), each with 1 L4 of its
own, and Pool (weight 1) with 3. History: each team's "heavy" user holds the team's own GPU
(a second, earlier server of NLP's heavy user ran and ended too); the "light" users held
nothing. Pool's own user fills its 3 GPUs. Then both users of each team ask for one more GPU,
which must be borrowed, in the order FIFO would get wrong (heavy users and Speech first); Pool's
servers stop one at a time. Kueue's admissions are read from a watch on the Workloads, and the
one-machine ``AdmissionQueue`` is fed the same events (the real admission and end times of the
history, the same requests, the same releases).

The real Kueue runs with the configuration the install guide ships: its Kueue overlay
(``helm-values/kueue/``) with ``gpuhub render kueue-config``'s fragment merged into
``kueue-config.yaml``, applied and restarted as docs/install-kubernetes.md says. The policy's
``halfLife`` is the shortest the policy allows (1m), so the renderer samples every 5s.

The double runs the same steps (``GPUHUB_CLUSTER`` unset: the double only, the real side
skipped with the reason).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as real  # noqa: E402

from double.harness import NAMESPACE  # noqa: E402
from gpuhub_spawner.admission import AdmissionQueue, Ticket  # noqa: E402
from gpuhub_spawner.kube import kueue as K  # noqa: E402
from gpuhub_spawner.kube.render import kueue_config, queue_for, user_local_queue  # noqa: E402
from gpuhub_spawner.local.devices import DeviceTable  # noqa: E402
from gpuhub_spawner.policy import parse_policy  # noqa: E402
from backends import l4_policy  # noqa: E402

POLICY = l4_policy(
    """\
priorityClasses:
  - {name: interactive, value: 1000}
fairShare:
  halfLife: 1m
  users: true
teams:
  - {name: nlp, displayName: NLP, groups: [nlp], cohort: lab, weight: 3, defaultPriority: interactive,
     quota: {gpus: {l4: {nominal: 1}}}}
  - {name: vision, displayName: Vision, groups: [vision], cohort: lab, weight: 2, defaultPriority: interactive,
     quota: {gpus: {l4: {nominal: 1}}}}
  - {name: speech, displayName: Speech, groups: [speech], cohort: lab, weight: 1, defaultPriority: interactive,
     quota: {gpus: {l4: {nominal: 1}}}}
  - {name: pool, displayName: Pool, groups: [pool], cohort: lab, weight: 1, defaultPriority: interactive,
     quota: {gpus: {l4: {nominal: 3}}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
defaults:
  queueTimeout: 1h
""",
    virtual=6,
)

TEAMS = ("nlp", "vision", "speech")
HISTORY_S = 20.0  # how long the heavy users hold their team's GPU before the contest
CONTEST = [f"{t}-{u}" for u in ("heavy", "light") for t in ("speech", "vision", "nlp")]  # FIFO's order: the wrong one
FREES = 3  # Pool's servers that stop, one at a time


def quantity(value) -> float:
    """A Kubernetes quantity of Kueue's consumedResources ("201m", "1500u", "2", "0") as a number."""
    text = str(value or 0)
    for suffix, scale in (("n", 1e-9), ("u", 1e-6), ("m", 1e-3), ("k", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def user_of(pod: str) -> str:
    return pod.rsplit("-", 1)[0] if pod.count("-") > 1 else pod  # "nlp-heavy-2" -> "nlp-heavy"


def team_of(pod: str) -> str:
    return pod.split("-", 1)[0]


# -- the two control planes --------------------------------------------------------------------


class Plane:
    """One control plane through its REST API (``RealCluster``'s helpers, or the same pointed at
    the double), with a watch that records every Workload version in order."""

    def __init__(self, name: str, api: real.RealCluster):
        self.name, self.api = name, api
        self.versions: list[dict] = []
        self.error: Exception | None = None
        self._halt = threading.Event()
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"workloads watch {name}")
        self._changed = threading.Condition()

    # The watch: short watches resumed from the last resourceVersion (as test_kueue_real_vs_double).
    def begin(self) -> None:
        self._thread.start()
        if not self._opened.wait(15):
            raise TimeoutError(f"[{self.name}] the Workload watch did not open in 15 s: {self.error}")

    def _watch(self) -> None:
        rv = "0"
        path = self.api.path("workloads", NAMESPACE)
        while not self._halt.is_set():
            params = {"watch": "1", "resourceVersion": rv, "timeoutSeconds": "2", "allowWatchBookmarks": "true"}
            try:
                with self.api.session.get(self.api.url + path, params=params, stream=True, timeout=(15, 30)) as r:
                    r.raise_for_status()
                    self._opened.set()
                    for line in r.iter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        rv = event["object"].get("metadata", {}).get("resourceVersion") or rv
                        if event["type"] in ("ADDED", "MODIFIED"):
                            with self._changed:
                                self.versions.append(event["object"])
                                self._changed.notify_all()
            except Exception as e:  # noqa: BLE001 - said by stop() and by every wait
                self.error = e
                self._opened.set()
                with self._changed:
                    self._changed.notify_all()
                return

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(30)
        assert self.error is None, f"[{self.name}] the Workload watch failed: {self.error!r}"

    def wait(self, predicate, timeout: float, what: str):
        """Until ``predicate()`` holds, re-checked at each Workload change the watch reports."""
        deadline = time.time() + timeout
        with self._changed:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.time()
                if left <= 0 or self.error is not None:
                    raise TimeoutError(
                        f"[{self.name}] {what}: not reached in {timeout:.0f}s (admitted so far, in order: "
                        f"{self.admitted_in_order()}; watch error: {self.error!r})"
                    )
                self._changed.wait(min(left, 5.0))  # 5 s: only so a dead watch is noticed

    # What the watch saw.
    def admitted_in_order(self) -> list[str]:
        """Pods whose Workload got QuotaReserved=True, in the order the watch reported it."""
        out: list[str] = []
        for wl in self.versions:
            pod = K.owner_pod_name(wl)
            if pod and pod not in out and K.is_true(wl, K.QUOTA_RESERVED):
                out.append(pod)
        return out

    def reserved_at(self, pod: str) -> float | None:
        for wl in self.versions:
            if K.owner_pod_name(wl) == pod and K.is_true(wl, K.QUOTA_RESERVED):
                return K.timestamp(K.condition(wl, K.QUOTA_RESERVED)["lastTransitionTime"])
        return None

    def waiting(self, pod: str) -> bool:
        """Kueue made the pod's Workload (it is in the queue) and has not reserved quota for it.
        (Not "has a QuotaReserved=False message": Kueue writes none for the later waiters of a
        shape that failed in the same cycle, issue 22's N3.)"""
        wl = next((w for w in reversed(self.versions) if K.owner_pod_name(w) == pod), None)
        return wl is not None and not K.is_true(wl, K.QUOTA_RESERVED)

    # Objects, as the hub makes them.
    def user_queue(self, policy, team: str, user: str) -> str:
        body = user_local_queue(policy.team(team), user, NAMESPACE)  # what KueueSpawner.ensure_queue creates
        self.api.create("localqueues", NAMESPACE, body)
        return body["metadata"]["name"]

    def pod(self, policy, name: str) -> float:
        team = policy.team(team_of(name))
        self.api.create(
            "pods",
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": {
                        K.QUEUE_LABEL: queue_for(policy, team, user_of(name)),
                        K.PRIORITY_LABEL: "interactive",
                        K.TEAM_LABEL: team.name,
                    },
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
                                    "requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": "1"},
                                    "limits": {"nvidia.com/gpu": "1"},
                                },
                            }
                        ],
                    }
                ),
            },
        )
        return time.time()

    def stop_pod(self, name: str) -> float:
        self.api.delete("pods", NAMESPACE, name, grace=0)
        return time.time()

    def consumed(self, queue: str) -> dict:
        lq = self.api.get(self.api.path("localqueues", NAMESPACE, queue))
        return ((((lq.get("status") or {}).get("fairSharing") or {}).get("admissionFairSharingStatus")) or {}).get(
            "consumedResources"
        ) or {}


# -- Kueue configured as the install guide says -------------------------------------------------


def rendered_kueue_config(workdir: Path) -> dict:
    """``gpuhub render kueue-config`` as an operator runs it (its YAML, comments dropped)."""
    f = workdir / "profiles.yaml"
    f.write_text(POLICY)
    out = subprocess.run(
        [str(real.VENV_BIN / "gpuhub"), "render", "kueue-config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.fixture(params=["real", "double"])
def plane(request, tmp_path):
    fragment = rendered_kueue_config(tmp_path)
    assert fragment == kueue_config(parse_policy(POLICY))
    if request.param == "real":
        from test_kueue_pods_ready import OVERLAY, apply_overlay, kueue_config as live_config, restart_kueue, set_config

        cluster = request.getfixturevalue("real_cluster")
        before = live_config(cluster)
        cfg = yaml.safe_load(before)
        cfg.update(fragment)  # docs/fair-share.md: merged into the guide's kueue-config.yaml
        overlay = tmp_path / "kueue-overlay"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(OVERLAY.read_text())
        (overlay / "manifests.yaml").write_text(real.release_manifests())
        (overlay / "kueue-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        apply_overlay(cluster, overlay)
        restart_kueue()
        running = yaml.safe_load((real.DIR / "kueue-config.yaml").read_text())
        assert running["admissionFairSharing"] == fragment["admissionFairSharing"], running
        assert running["fairSharing"] == fragment["fairSharing"], running
        cluster.ensure_namespace(NAMESPACE)
        cluster.reset(NAMESPACE)
        cluster.apply_policy(POLICY, NAMESPACE, tmp_path / "policy")
        p = Plane("real", cluster)
        yield p
        p.stop()
        cluster.reset(NAMESPACE)
        set_config(cluster, before)
        restart_kueue()
    else:
        from double.harness import apply_policy
        from double.server import TOKEN

        double = request.getfixturevalue("double")
        apply_policy(double, POLICY)  # (a clean double first)
        double.kueue_config = fragment  # the same Configuration fragment the real Kueue runs with
        p = Plane("double", real.RealCluster.for_double(double.url, TOKEN))
        yield p
        p.stop()
        double.reset()


# -- the one-machine queue, fed the same events ---------------------------------------------------


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def one_machine(policy, events: list[tuple[float, str, str]], releases: list[float]) -> list[str]:
    """The order ``AdmissionQueue`` admits the contest's requests in, fed ``events``
    ((time, "submit" | "release", pod), in time order) and then Pool's releases at ``releases``."""
    clock = Clock(events[0][0])
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []), clock=clock)
    q.fair.configure(policy)
    admitted: list[str] = []

    def note() -> None:
        for key in q.admitted:
            pod = key.rstrip("/")
            if pod in CONTEST and pod not in admitted:
                admitted.append(pod)

    for t, what, pod in events:
        clock.t = t
        if what == "submit":
            q.submit(
                Ticket(
                    key=f"{pod}/",
                    user=user_of(pod),
                    team=team_of(pod),
                    profile="l4-1",
                    demand={"gpu/l4": 1},
                    priority=1000,
                    created=t,
                )
            )
        else:
            q.release(f"{pod}/")
        note()
    for i, t in enumerate(releases):
        clock.t = t
        q.release(f"pool-ops-{i}/")
        note()
    return admitted


# -- the test ------------------------------------------------------------------------------------


def test_kueue_admits_in_the_fair_share_order_the_one_machine_queue_predicts(plane):
    policy = parse_policy(POLICY)
    plane.begin()
    queues = {}
    for team in TEAMS:
        for kind in ("heavy", "light"):
            queues[f"{team}-{kind}"] = plane.user_queue(policy, team, f"{team}-{kind}")
    queues["pool-ops"] = plane.user_queue(policy, "pool", "pool-ops")
    events: list[tuple[float, str, str]] = []

    # History: NLP's heavy user ran a server that ended; each heavy user holds the team's own GPU.
    events.append((plane.pod(policy, "nlp-heavy-0"), "submit", "nlp-heavy-0"))
    plane.wait(lambda: plane.reserved_at("nlp-heavy-0"), 60, "nlp-heavy-0 admitted")
    time.sleep(HISTORY_S / 2)  # usage accrues: the history is time held
    events.append((plane.stop_pod("nlp-heavy-0"), "release", "nlp-heavy-0"))
    for team in TEAMS:
        events.append((plane.pod(policy, f"{team}-heavy-1"), "submit", f"{team}-heavy-1"))
    for i in range(FREES):
        events.append((plane.pod(policy, f"pool-ops-{i}"), "submit", f"pool-ops-{i}"))
    held = [f"{t}-heavy-1" for t in TEAMS] + [f"pool-ops-{i}" for i in range(FREES)]
    plane.wait(lambda: all(plane.reserved_at(p) for p in held), 60, f"{held} admitted")
    time.sleep(HISTORY_S)
    usage = {u: plane.consumed(q) for u, q in queues.items()}
    print(f"\n[{plane.name}] Kueue's decayed usage per user's LocalQueue before the contest: {json.dumps(usage)}")
    for team in TEAMS:
        assert quantity(usage[f"{team}-heavy"].get("nvidia.com/gpu")) > 0, usage
        assert quantity(usage[f"{team}-light"].get("nvidia.com/gpu")) == 0, usage

    # The contest: six requests that must borrow Pool's GPUs, in distinct seconds (Kueue breaks
    # a tie of creation times by UID), in the order FIFO would get wrong.
    for pod in CONTEST:
        events.append((plane.pod(policy, pod), "submit", pod))
        time.sleep(1.1)
    plane.wait(lambda: all(plane.waiting(p) for p in CONTEST), 60, "every contest request in Kueue's queue")
    releases = []
    for i in range(FREES):
        releases.append(plane.stop_pod(f"pool-ops-{i}"))
        plane.wait(
            lambda: len([p for p in plane.admitted_in_order() if p in CONTEST]) >= i + 1,
            60,
            f"a contest request admitted after pool-ops-{i} stopped",
        )
    kueue_order = [p for p in plane.admitted_in_order() if p in CONTEST]

    predicted = one_machine(policy, sorted(events), releases)
    # Team history swapped (NLP's ended server made Speech's): the prediction must not move, or
    # it would rest on team history, which Kueue does not have.
    swapped = sorted((t, w, "speech-heavy-0" if p == "nlp-heavy-0" else p) for t, w, p in events)
    print(
        f"\n[{plane.name}] Kueue admitted {kueue_order}; the one-machine queue predicts {predicted}; "
        f"FIFO would admit {CONTEST[:FREES]}"
    )
    assert kueue_order == predicted == ["nlp-light", "vision-light", "nlp-heavy"], (kueue_order, predicted)
    assert one_machine(policy, swapped, releases) == predicted
    assert predicted != CONTEST[:FREES]
    # Nothing more was admitted: one GPU freed, one request admitted, each time.
    assert len(kueue_order) == FREES and all(plane.waiting(p) for p in CONTEST if p not in kueue_order)
