"""Reclaim with notice on Kubernetes (issue 14), and the usage history there (issue 15).

A real JupyterHub with KueueSpawner on the API double and, from the same code, on the real
control plane (``GPUHUB_CLUSTER=1``: real Kueue v0.19.2, kwok nodes; ``backends.py``), its
ClusterQueues rendered from the policy below: two teams in one cohort, one L4 of nominal quota each. Vision's second
server borrows NLP's idle L4. When an NLP researcher asks for her team's own GPU, Kueue
would not preempt a server of equal priority (``reclaimWithinCohort: LowerPriority``),
so the hub does, with notice: the borrower is warned where cull warnings are shown, the
lender's spawn page says when the GPU will be hers, and after NLP's ``reclaim.notice``
the hub deletes the borrower's pod; Kueue (the double's, or the real one) then admits the
lender. The hub learns all of it from Kueue's Workloads (``kube/ledger.py``), as on a cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests

from backends import backend_fixture
from support.hub import Hub
from test_hub_e2e import until

pytestmark = pytest.mark.integration

NOTICE = 20

POLICY = f"""\
apiVersion: gpuhub/v1
flavors:
  - name: l4
    displayName: L4 24GB
    resource: nvidia.com/gpu
    nodeLabels: {{nvidia.com/gpu.product: NVIDIA-L4}}
    tolerations:   # the GPU Operator's taint on the real plane's kwok GPU node
      - {{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}
    local: {{virtual: 1}}
priorityClasses:
  - {{name: interactive, value: 1000}}
  - {{name: batch, value: 100}}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    cohort: research
    defaultPriority: interactive
    jobPriority: batch
    quota: {{cpu: 8, memory: 16Gi, gpus: {{l4: {{nominal: 1}}}}}}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    cohort: research
    defaultPriority: interactive
    jobPriority: batch
    quota: {{cpu: 8, memory: 16Gi, gpus: {{l4: {{nominal: 1}}}}}}
    reclaim: {{notice: {NOTICE}s}}
profiles:
  - {{slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {{count: 1, flavor: l4}}, teams: "*", default: true}}
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
  idle: {{timeout: 1h, gpuIdleTimeout: 1h, warning: 5m}}
"""


backend = backend_fixture(POLICY)


@pytest.fixture(scope="module")
def hub(backend, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"kube-reclaim-{backend.name}")
    h = Hub(
        work,
        POLICY,
        extra_config=backend.hub_config("\nc.KubeJobManager.poll_interval = 0.5   # production: 10 s\n"),
        env={"KUBECONFIG": str(backend.kubeconfig), "GPUHUB_CULL_EVERY": "5"},
    )
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "admin")}


@pytest.fixture(autouse=True)
def servers_stopped_after(users):
    """A test that fails midway leaves its servers running; the next test of the module would
    then meet "already running" (400) instead of what it tests. Stop what is left."""
    yield
    for client in users.values():
        if client.server() is not None:
            client.stop()
            client.wait_gone()


def warnings(client) -> dict:
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()["servers"]


def log_time(line: str) -> float:
    m = re.search(r"\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_a_borrowing_server_is_warned_then_stopped_after_the_notice_and_kueue_admits_the_lender(hub, backend, users):
    alice, bob, carol, admin = users["alice"], users["bob"], users["carol"], users["admin"]
    # An earlier test's servers are gone from the hub before Kueue's view of them ends (the
    # ledger hears of the Workload's deletion a moment later, and then audits the release):
    # wait for it, so that the audit read below is this test's.
    until(
        lambda: admin.api.get(admin.url("/gpuhub/status")).json()["devices"] == [], what="no GPU held in the hub's view", hub=hub
    )
    # The log and the audit of earlier tests (bob's other servers) are not this one's.
    log_start, began = len(hub.log.read_text(errors="replace").splitlines()), time.time()
    for client in (alice, bob):  # alice holds vision's own L4; bob, admitted later, borrows NLP's
        assert client.start("l4-1").status_code in (201, 202)
        client.wait_ready()
    until(
        lambda: (
            next(t for t in admin.api.get(admin.url("/gpuhub/status")).json()["teams"] if t["name"] == "vision")["gpus"]["l4"][
                "borrowed"
            ]
            == 1
        ),
        what="vision borrowing in the status",
        hub=hub,
    )
    status = admin.api.get(admin.url("/gpuhub/status")).json()
    vision = next(t for t in status["teams"] if t["name"] == "vision")
    assert vision["gpus"]["l4"]["nominal"] == 1
    assert sorted(d["user"] for d in status["devices"]) == ["alice", "bob"]  # an admin sees who holds what
    seen = carol.api.get(carol.url("/gpuhub/status")).json()  # a researcher of another team: counts only
    assert len(seen["devices"]) == 2 and {d["user"] for d in seen["devices"]} == {None}, seen["devices"]
    assert warnings(bob) == {}

    carol.start_background("l4-1")
    until(lambda: carol.server() is not None, what="carol's spawn pending", hub=hub)
    # Kueue does not preempt a server of equal priority; the hub warns the newest borrower.
    w = until(lambda: warnings(bob).get(""), what="bob's reclaim warning", hub=hub)
    assert w["rule"] == "reclaim" and w["needed_by"] == "NLP Group" and w["snoozes_left"] == 0
    assert w["reason"] == "NLP Group needs back 1 L4 24GB GPU that your team Vision Lab borrowed", w["reason"]
    assert warnings(alice) == {}  # within her team's own quota: never reclaimed
    r = bob.api.post(bob.url("/gpuhub/culling/bob/snooze"), json={"server": ""})
    assert r.status_code == 409
    events = carol.progress(until=lambda e: "being reclaimed" in e.get("message", ""), timeout=30)
    msg = events[-1]["message"]
    assert "NLP Group's GPU is on loan to another team; it is being reclaimed and will be yours by" in msg, msg
    assert "bob" not in msg
    assert len(backend.pods("bob")) == 1  # nothing happens before the notice ends

    # After the notice the hub deletes bob's pod; Kueue admits carol on the freed quota.
    until(lambda: bob.server() is None, timeout=NOTICE + 30, what="bob's server stopped after the notice", hub=hub)
    assert time.time() >= w["deadline"] - 0.5
    assert backend.pods("bob") == []
    carol.wait_ready(timeout=60)
    form = bob.session.get(hub.url + "/hub/spawn").text
    assert 'id="gpuhub-stop-reason"' in form and "NLP Group needs back" in form and "files are kept" in form

    lines = hub.log.read_text(errors="replace").splitlines()[log_start:]
    warned = [l for l in lines if "Reclaim: warning bob/" in l][-1]
    stopping = next(l for l in lines if "Reclaim: stopping bob/" in l)
    admitted = next(l for l in lines if "Server carol admitted by Kueue" in l)
    assert log_time(warned) <= log_time(stopping) <= log_time(admitted)
    timeline = "\n".join((warned, stopping, admitted))
    (Path(os.environ.get("GPUHUB_EVIDENCE_DIR", hub.workdir)) / "kube-reclaim-timeline.log").write_text(timeline + "\n")
    print("\n" + timeline)

    # The usage history (kube/ledger.py feeding usage/): how each allocation ended.
    def rows():
        r = admin.api.get(admin.url("/gpuhub/usage?since=1h"))
        r.raise_for_status()
        return r.json()

    data = until(
        lambda: (d := rows()) and any(a["user"] == "carol" for a in d["rows"]) and d,
        what="carol's allocation in the usage history",
        hub=hub,
    )
    ended = {a["user"]: a for a in data["rows"]}
    assert ended["bob"]["end_reason"] == "reclaimed", ended["bob"]
    assert ended["alice"]["end"] is None and ended["carol"]["team"] == "nlp"
    audit = admin.api.get(admin.url(f"/gpuhub/audit?since={began}")).json()["entries"]
    assert [e["event"] for e in audit if e.get("key") == "bob/" and e["event"] in ("admitted", "reclaimed", "released")] == [
        "admitted",
        "reclaimed",
        "released",
    ]
    for client in (alice, carol):
        client.stop()
        client.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left")
    backend.healthy()


def test_per_team_gauges_follow_kueue_and_return_to_zero(hub, backend, users):
    carol, admin = users["carol"], users["admin"]

    def metric(name: str, team: str) -> float | None:
        text = requests.get(hub.url + "/hub/metrics", headers={"Authorization": f"token {admin.token}"}, timeout=10).text
        m = re.search(rf'^{name}{{flavor="l4",team="{team}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else None

    assert carol.start("l4-1").status_code in (201, 202)
    carol.wait_ready()
    until(lambda: metric("gpuhub_gpus_in_use", "nlp") == 1.0, what="NLP's L4 in use in /hub/metrics", hub=hub)
    assert metric("gpuhub_quota_nominal_gpus", "nlp") == 1.0
    carol.stop()
    carol.wait_gone()
    until(lambda: metric("gpuhub_gpus_in_use", "nlp") == 0.0, what="the gauge back to 0", hub=hub)


def test_a_team_whose_servers_may_not_borrow_waits_for_its_own_quota(hub, backend, users):
    """``reclaim.interactiveBorrowing: false`` on a cluster: Kueue would let the server borrow
    NLP's idle L4 (servers and jobs share the team's ClusterQueue); the hub holds the pod back."""
    alice, bob = users["alice"], users["bob"]
    original = hub.policy.read_text()
    loads = hub.log.read_text(errors="replace").count("Loaded policy")
    hub.policy.write_text(
        original.replace(
            "    jobPriority: batch\n    quota: {cpu: 8, memory: 16Gi, gpus: {l4: {nominal: 1}}}\n  - name: nlp",
            "    jobPriority: batch\n    quota: {cpu: 8, memory: 16Gi, gpus: {l4: {nominal: 1}}}\n"
            "    reclaim: {interactiveBorrowing: false}\n  - name: nlp",
            1,
        )
    )
    assert hub.policy.read_text() != original
    try:
        until(lambda: hub.log.read_text(errors="replace").count("Loaded policy") > loads, what="the policy reload", hub=hub)
        assert alice.start("l4-1").status_code in (201, 202)
        alice.wait_ready()
        bob.start_background("l4-1")
        until(lambda: bob.server() is not None, what="bob's spawn pending", hub=hub)
        events = bob.progress(until=lambda e: "may not borrow" in e.get("message", ""), timeout=30)
        msg = events[-1]["message"]
        assert "your team Vision Lab is using 1 of the 1 it may hold (its servers may not borrow from the cohort)" in msg, msg
        time.sleep(3)  # several status ticks: NLP's L4 is free, yet no pod is created for bob
        assert backend.pods("bob") == []
        alice.stop()
        alice.wait_gone()
        bob.wait_ready(timeout=60)  # his team's own L4 came free
        assert len(backend.pods("bob")) == 1
    finally:
        hub.policy.write_text(original)
        for client in (alice, bob):
            if client.server() is not None:
                client.stop()
                client.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left")


def test_a_borrowing_job_of_the_servers_priority_is_taken_back_at_once_and_requeues(hub, backend, users, tmp_path):
    """Kueue preempts only lower priorities (``reclaimWithinCohort: LowerPriority``). With no
    ``jobPriority`` a team's jobs queue at its servers' priority, so the hub takes a
    borrowing job back itself: it deactivates the Job's Workload (Kueue evicts it and
    suspends the Job), then reactivates it so it queues again. No notice for a job."""
    alice, bob, carol, admin = users["alice"], users["bob"], users["carol"], users["admin"]
    original = hub.policy.read_text()
    loads = hub.log.read_text(errors="replace").count("Loaded policy")
    hub.policy.write_text(original.replace("    jobPriority: batch\n", "", 1))  # vision's jobs: interactive, as its servers
    until(lambda: hub.log.read_text(errors="replace").count("Loaded policy") > loads, what="the policy reload", hub=hub)
    job_id = None
    try:
        assert alice.start("l4-1").status_code in (201, 202)
        alice.wait_ready()
        spec = tmp_path / "job.yaml"
        spec.write_text(
            "profile: l4-1\ncommand: [python3, -c, 'import time; time.sleep(600)']\nretries: {limit: 0, reasons: [preempted]}\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
        env["GPUHUB_TOKEN"] = bob.token
        out = subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, "submit", str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr + hub.tail(40)
        job_id = out.stdout.strip().splitlines()[-1]

        def record():
            return bob.api.get(bob.url(f"/gpuhub/jobs/{job_id}")).json()

        until(lambda: record()["state"] == "running", what="the job running on NLP's lent L4", hub=hub)
        [wl] = [w for w in backend.workloads() if job_id in w["metadata"]["name"]]
        assert wl["spec"]["priority"] == 1000  # the servers' priority: Kueue will not preempt it for carol

        carol.start_background("l4-1")
        carol.wait_ready(timeout=60)  # at once: a job gets no notice
        rec = until(lambda: (r := record())["state"] == "queued" and r, what="the job back in the queue", hub=hub)
        first = rec["attempts"][0]
        assert first["reason"] == "preempted" and "NLP Group needs them back" in first["message"], first

        def workload():
            [wl] = [w for w in backend.workloads() if job_id in w["metadata"]["name"]]
            return wl

        # reactivated by the hub's next mirror pass: it waits for quota like any other
        wl = until(
            lambda: (
                (w := workload())["spec"].get("active", True) is True
                and "gpuhub/reclaimed-at" not in (w["metadata"].get("annotations") or {})
                and w
            ),
            what="the job's Workload reactivated",
            hub=hub,
        )
        reasons = {e["reason"] for e in wl["status"]["schedulingStats"]["evictions"]}
        assert reasons == {"Deactivated"}, wl["status"]
        # Taken back once: not reactivated while carol still waited (else the older job re-queues
        # ahead of her, Kueue admits it again and the hub takes it back again: seen on the real
        # plane, up to three rounds, before kube/ledger.py held the reactivation).
        assert hub.log.read_text(errors="replace").count(f"Reclaim: deactivating job job:{job_id}") == 1

        def released():
            audit = admin.api.get(admin.url("/gpuhub/audit")).json()["entries"]
            return [e for e in audit if e.get("key") == f"job:{job_id}" and e["event"] == "released"]

        entries = until(released, what="the job's release in the audit", hub=hub)
        assert entries[-1]["reason"] == "reclaimed", entries
        calls = backend.hub_calls()
        if calls is not None:  # real: the API server's audit log says who patched the Workload
            patches = [
                (c["verb"], c["name"], c["code"])
                for c in calls
                if c["resource"] == "workloads" and c["verb"] == "patch" and job_id in c["name"]
            ]
            print(f"\n[real] Workload patches by the hub's service account: {patches}")
            assert len(patches) == 2 and {code for *_, code in patches} == {200}, patches  # deactivate, reactivate
    finally:
        hub.policy.write_text(original)
        if job_id:
            bob.api.delete(bob.url(f"/gpuhub/jobs/{job_id}"))
        for client in (alice, carol):
            if client.server() is not None:
                client.stop()
                client.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left", hub=hub)
    backend.healthy()


def test_roles_follow_a_policy_edit_here_too(hub, users):
    """Roles from the policy (issue 15) on the Kubernetes hub, with the Kueue mirror running:
    a group added to ``roles.viewers`` sees every team's usage with the token it already had,
    and loses it when the edit is undone. The same ``PolicyRoles`` as on one machine
    (tests/integration/test_roles_reload.py); the chart wires it (test_chart_config.py)."""
    admin, carol = users["admin"], users["carol"]
    erin = hub.login("erin")  # group students: in no team, no gpuhub role

    def view() -> str:
        r = erin.api.get(erin.url("/gpuhub/usage"), params={"since": "1d"})
        assert r.status_code == 200, r.text
        return r.json()["view"]

    def applied(kind: str, since: float):
        entries = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "roles_applied", "since": str(since)}).json()[
            "entries"
        ]
        return [e for e in entries if ["gpuhub-viewer", "students"] in e.get(kind, [])]

    assert carol.start("l4-1").status_code in (201, 202)  # one allocation in NLP's history for a viewer to see
    carol.wait_ready()
    carol.stop()
    carol.wait_gone()
    assert view() == "user"
    original = hub.policy.read_text()
    since = time.time() - 1
    hub.policy.write_text(original.replace("teams:\n", "roles:\n  viewers: [students]\nteams:\n", 1))
    try:
        until(lambda: applied("granted", since), what="the viewer role granted to students", hub=hub)
        r = erin.api.get(erin.url("/gpuhub/usage"), params={"since": "1d"}).json()
        assert r["view"] == "viewer" and "carol" in {row["user"] for row in r["rows"]}, r
    finally:
        since = time.time() - 1
        hub.policy.write_text(original)
    until(lambda: applied("revoked", since), what="the viewer role revoked from students", hub=hub)
    assert view() == "user"
