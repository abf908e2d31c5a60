"""The Kubernetes backend end to end: a real JupyterHub with KueueSpawner, on the API double.

One JupyterHub subprocess for the module (our ``jupyterhub_config.py``, the hub
switched to ``gpuhub-kube``), reaching the Kubernetes API double (``double/``) through
a kubeconfig, as a z2jh hub reaches its cluster. The double's admission loop applies
the Kueue objects rendered from this module's small policy, and its kubelet runs each
admitted pod's own command and env as a local process, which the hub reaches through
its proxy. Everything is asserted the way a user meets it: the REST API, the progress
event stream, the spawn page, and the server behind ``/user/<name>/``.

What differs from a cluster is in the hub config below: pods share the host network
here, so each spawn gets its own port (a pre-spawn hook) and binds 127.0.0.1; poll
and status intervals are short so the test does not wait for production cadences.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from backends import HUB_CONFIG, l4_policy  # what every Kubernetes hub of these tests runs with
from double.harness import KUBECONFIG, NAMESPACE, apply_policy
from support.helm import chart_proxy_command, require_shared
from support.hub import Hub, waiter
from support.ports import pod_port_hook

pytestmark = pytest.mark.integration

POLICY = l4_policy(
    """\
priorityClasses:
  - {name: interactive, value: 1000}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    defaultPriority: interactive
    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}
    perUser: {maxServers: 1, maxGPUs: 1}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    defaultPriority: interactive
    quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 1}}}
profiles:
  - {slug: cpu, displayName: CPU only, cpu: 0.5, memory: 1Gi, teams: "*", default: true}
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision, nlp]}
  - {slug: nlp-only, displayName: NLP special, teams: [nlp]}
defaults:
  queueTimeout: 5m
  launchTimeout: 2m
""",
    virtual=1,
    tolerations=False,
)

# Appended to our hub config (after configure_local): what a z2jh deployment sets instead
# (helm-values/values.yaml). The culler service stays, as it does there; MLflow is off.
KUBE_CONFIG = f"""
{HUB_CONFIG}
# The double's pods share this machine's network: one port per pod, loopback only.
{pod_port_hook()}
c.KubeSpawner.ip = "127.0.0.1"
c.KubeSpawner.pre_spawn_hook = _own_port
"""

RAW = ("couldn't assign", "pod set", "nodes are available", "insufficient unused quota", "flavor l4")
WAIT = 90


until = waiter(WAIT)


@pytest.fixture(scope="module")
def kube_hub(double, tmp_path_factory):
    work = tmp_path_factory.mktemp("kube-hub")
    apply_policy(double, POLICY)
    env = {"KUBECONFIG": str(KUBECONFIG)}
    # The proxy at the version z2jh 4.4.0's proxy image ships (CHP 5.2.0), when npm can fetch it.
    chart_proxy = chart_proxy_command(require_shared("charts", "jupyterhub-4.4.0"))
    if chart_proxy:
        env["GPUHUB_PROXY_COMMAND"] = " ".join(chart_proxy[0])
    hub = Hub(work, POLICY, extra_config=KUBE_CONFIG, env=env)
    hub.chart_proxy_version = chart_proxy[1] if chart_proxy else None
    try:
        hub.start()
        print(f"\n[measure] kube hub start: {hub.started_in:.2f}s")
        yield hub
    finally:
        hub.stop()
        double.reset()


@pytest.fixture(scope="module")
def users(kube_hub):
    return {name: kube_hub.login(name) for name in ("alice", "bob", "carol", "mallory")}


def pods(double, user: str | None = None) -> list[dict]:
    return [
        p
        for p in double.list("pods", NAMESPACE)
        if user is None or p["metadata"]["labels"].get("hub.jupyter.org/username") == user
    ]


def reach(client, server: str = "") -> requests.Response:
    """The user's own server through the hub's proxy, with the user's token."""
    s = client.server(server)
    assert s and s.get("ready"), s
    return requests.get(
        client.hub.server_url(s["url"]) + "api/status", headers={"Authorization": f"token {client.token}"}, timeout=10
    )


def wait_pending(client, server: str = "") -> dict:
    return until(
        lambda: (client.server(server) or {}).get("pending") == "spawn" and client.server(server),
        what=f"{client.name}'s spawn pending",
        hub=client.hub,
    )


def test_the_hub_runs_with_the_charts_proxy_version(kube_hub):
    """JupyterHub 6.1 with the configurable-http-proxy of z2jh 4.4.0's proxy image: every
    test in this module (host routing per user included) goes through it."""
    if kube_hub.chart_proxy_version is None:
        pytest.skip("npm cannot install configurable-http-proxy here; the hub used its default proxy")
    tag = yaml.safe_load((require_shared("charts", "jupyterhub-4.4.0") / "values.yaml").read_text())["proxy"]["chp"]["image"][
        "tag"
    ]
    assert kube_hub.chart_proxy_version == str(tag)
    assert requests.get(kube_hub.url + "/hub/api", timeout=10).status_code == 200  # through that proxy


def test_spawn_page_lists_only_the_team_profiles(kube_hub, users):
    html = users["alice"].session.get(kube_hub.url + "/hub/spawn").text
    assert set(re.findall(r'name="profile" id="[^"]+" value="([^"]+)"', html)) == {"cpu", "l4-1"}
    html = users["carol"].session.get(kube_hub.url + "/hub/spawn").text
    assert set(re.findall(r'name="profile" id="[^"]+" value="([^"]+)"', html)) == {"cpu", "l4-1", "nlp-only"}


def test_refusals_answer_4xx_with_the_reason_and_create_no_pod(double, users):
    alice, mallory = users["alice"], users["mallory"]
    creates = double.count("POST", "pods")
    workloads = sorted(w["metadata"]["name"] for w in double.list("workloads", NAMESPACE))  # others' may run
    r = alice.start("nlp-only")  # another team's profile, forged through the REST API
    assert r.status_code == 403 and "not available" in r.json()["message"], r.text
    r = alice.start("l4-1", gpus=4)
    assert r.status_code == 400 and "Unknown server option" in r.json()["message"], r.text
    r = alice.start("no-such-profile")
    assert r.status_code == 400, r.text
    r = alice.start("l4-1", team="nlp")
    assert r.status_code == 403 and "not a member of team 'nlp'" in r.json()["message"], r.text
    r = mallory.start("cpu")
    assert r.status_code == 403 and "not a member of any team" in r.json()["message"], r.text
    assert alice.server() is None and mallory.server() is None
    assert pods(double, "alice") == [] and pods(double, "mallory") == []
    assert sorted(w["metadata"]["name"] for w in double.list("workloads", NAMESPACE)) == workloads
    assert double.count("POST", "pods") == creates  # not even attempted
    # A refused request is not a server that stopped: the spawn page carries no stop note.
    html = alice.session.get(alice.hub.url + "/hub/spawn").text
    assert 'id="gpuhub-stop-reason"' not in html, re.findall(r'id="gpuhub-stop-reason">([^<]*)<', html)


def test_queue_admission_and_stop_through_the_hub(kube_hub, double, users):
    alice, bob = users["alice"], users["bob"]

    # Within quota: a ready server, reachable through the hub's proxy with the user's token.
    r = alice.start("l4-1")
    assert r.status_code in (201, 202), r.text
    alice.wait_ready()
    assert reach(alice).status_code == 200
    [pod] = pods(double, "alice")
    labels = pod["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "vision" and labels["kueue.x-k8s.io/priority-class"] == "interactive"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "schedulingGates" not in pod["spec"]  # admitted by the double's Kueue

    # Per-user cap (maxServers 1): refused before any pod exists.
    r = alice.start("cpu", server="second")
    assert r.status_code == 403 and "allows 1 server(s) per user" in r.json()["message"], r.text
    assert alice.server("second") is None and len(pods(double, "alice")) == 1

    # Past the team's quota: the spawn waits, and the progress stream says why in plain words.
    pending = bob.start_background("l4-1")
    wait_pending(bob)
    stream = ThreadPoolExecutor(1)
    events: list[dict] = []
    reading = stream.submit(bob.progress, until=lambda e: events.append(e) or False, timeout=WAIT)
    stream.shutdown(wait=False)
    waiting = until(
        lambda: next((e["message"] for e in list(events) if "1st of 1" in e.get("message", "")), None),
        what="the queue position in bob's progress stream",
        hub=kube_hub,
    )
    # In the hub's own words (kube/ledger.py's view of Kueue), as on one machine: who uses the quota.
    assert (
        "Your server needs 1 L4 24GB GPU: your team Vision Lab is using 1 of the 1 it may hold; it waits "
        "until one of your team's servers or jobs stops."
    ) in waiting, events
    assert "You are 1st of 1 in the Vision Lab queue." in waiting, events
    [bob_pod] = pods(double, "bob")
    assert bob_pod["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]
    model = bob.server()
    assert model["pending"] == "spawn" and not model["ready"]

    # Stopping the first server frees the L4: the waiting one is admitted and becomes ready,
    # and the same progress stream follows it from the queue to "ready".
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    bob.wait_ready()
    assert reach(bob).status_code == 200
    assert pending.result(timeout=WAIT).status_code in (201, 202)  # 202: the hub held it as a slow spawn
    reading.result(timeout=WAIT)
    assert events[-1].get("ready") is True, events
    messages = [e["message"] for e in events]
    assert any(m.startswith("Quota granted") or m.startswith("Server started") for m in messages), messages
    for message in messages:
        assert not any(raw in message for raw in RAW), message
    assert pods(double, "alice") == []
    assert "schedulingGates" not in pods(double, "bob")[0]["spec"]
    assert double.invalid == [] and double.errors == []
    assert bob.stop().status_code in (202, 204)  # the module's other tests find the queue empty
    bob.wait_gone()


def test_preemption_marks_the_server_stopped_and_says_why(kube_hub, double, users):
    bob = users["bob"]
    assert bob.start("l4-1").status_code in (201, 202)
    bob.wait_ready()
    [pod] = pods(double, "bob")
    until(lambda: double.watching("workloads"), what="the hub's Workload watch")

    double.preempt(NAMESPACE, pod["metadata"]["name"], "InClusterQueue")
    until(lambda: bob.server() is None, what="the hub marking bob's server stopped", hub=kube_hub)
    assert pods(double, "bob") == []
    until(lambda: double.list("workloads", NAMESPACE) == [], what="the preempted Workload collected after its pod")

    # Where the user meets it: their notebook URL now answers 424 and points at the spawn
    # page, and the spawn page carries the reason (the hub's log has Kueue's own words).
    r = requests.get(kube_hub.url + "/user/bob/api/status", headers={"Authorization": f"token {bob.token}"}, timeout=10)
    assert r.status_code == 424 and "/hub/spawn/bob" in r.json()["message"], r.text
    page = bob.session.get(kube_hub.url + "/user/bob/tree", timeout=10)
    assert page.status_code == 424
    [relaunch] = re.findall(r'href="(/hub/spawn/bob[^"]*)"', page.text)
    html = bob.session.get(kube_hub.url + relaunch.replace("&amp;", "&"), timeout=10).text
    m = re.search(r'<div class="alert alert-info" id="gpuhub-stop-reason">([^<]*)</div>', html)
    assert m, html[:2000]
    assert "stopped by the queue to make room for a higher-priority server of your team" in m.group(1)
    assert "Preempted to accommodate" not in html  # Kueue's raw words stay in the log
    assert "stopped by Kueue" in kube_hub.log.read_text(errors="replace")

    # Starting again rejoins the queue and the server comes back.
    assert bob.start("l4-1").status_code in (201, 202)
    bob.wait_ready()
    assert reach(bob).status_code == 200
    assert bob.stop().status_code in (202, 204)
    bob.wait_gone()
    until(lambda: pods(double) == [], what="no pods left")
    assert double.invalid == [] and double.errors == []


def test_queue_timeout_withdraws_the_server_and_says_so(kube_hub, double, users):
    """The queue's own limit (here cut to 3 s by a live policy edit, no hub restart)."""
    alice, bob = users["alice"], users["bob"]
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready()
    original = kube_hub.policy.read_text()
    kube_hub.policy.write_text(original.replace("queueTimeout: 5m", "queueTimeout: 3s"))
    try:
        pending = bob.start_background("l4-1")
        wait_pending(bob)
        events = bob.progress(until=lambda e: False, timeout=WAIT)  # to the end: ready or failed
        assert events[-1].get("failed") is True, events
        assert "waited 3s in team Vision Lab's queue without getting quota, so it was withdrawn" in events[-1]["message"]
        assert not any(raw in e["message"] for e in events for raw in RAW), events
        r = pending.result(timeout=WAIT)
        assert r.status_code in (202, 503), r.text
        until(lambda: bob.server() is None, what="bob's withdrawn spawn cleared", hub=kube_hub)
        until(lambda: pods(double, "bob") == [], what="bob's pod withdrawn")
        until(
            lambda: (
                [
                    w
                    for w in double.list("workloads", NAMESPACE)  # collected after its pod
                    if w["spec"]["podSets"][0]["template"]["metadata"]["labels"].get("hub.jupyter.org/username") == "bob"
                ]
                == []
            ),
            what="bob's Workload collected",
        )
        # The timeout was told on the spawn page's progress; no stale "stopped" note follows it.
        assert 'id="gpuhub-stop-reason"' not in bob.session.get(kube_hub.url + "/hub/spawn").text
    finally:
        kube_hub.policy.write_text(original)
    assert reach(alice).status_code == 200  # the holder was never disturbed
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    until(lambda: pods(double) == [], what="no pods left")
    assert double.invalid == [] and double.errors == []


def test_a_kueue_outage_is_told_at_once_and_running_servers_are_untouched(kube_hub, double, users):
    alice, carol = users["alice"], users["carol"]
    assert alice.start("cpu").status_code in (201, 202)
    alice.wait_ready()
    double.set_kueue(False)  # Kueue's controller and its failurePolicy: Fail pod webhook are down
    try:
        r = carol.start("cpu")
        assert r.status_code == 503, r.text
        assert "The queue service (Kueue) is not answering" in r.json()["message"], r.text
        until(lambda: carol.server() is None, what="carol's refused spawn cleared", hub=kube_hub)
        assert pods(double, "carol") == []
        assert reach(alice).status_code == 200  # a running server does not need Kueue
    finally:
        double.set_kueue(True)
    assert carol.start("cpu").status_code in (201, 202)  # back to normal
    carol.wait_ready()
    for user in (alice, carol):
        assert user.stop().status_code in (202, 204)
        user.wait_gone()
    until(lambda: pods(double, "alice") == pods(double, "carol") == [], what="alice's and carol's pods gone")


def test_hub_restart_keeps_waiting_servers_in_their_place(kube_hub, double, users):
    """Every `helm upgrade` that changes the hub config restarts the hub: waiting servers
    must survive it, keep their place, and be admitted later in the same order."""
    from gpuhub_spawner.kube.kueue import pod_is_gated

    alice, bob = users["alice"], users["bob"]
    dave = kube_hub.login("dave")  # in both teams; queues in Vision Lab's here
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready()
    bob.start_background("l4-1")
    until(lambda: pods(double, "bob"), what="bob's gated pod", hub=kube_hub)
    dave.start_background("l4-1", team="vision")
    until(lambda: pods(double, "dave"), what="dave's gated pod", hub=kube_hub)
    before = {u: pods(double, u)[0]["metadata"]["uid"] for u in ("bob", "dave")}
    assert all(pod_is_gated(pods(double, u)[0]) for u in before)

    kube_hub.stop(kill_servers=False)
    assert {u: pods(double, u)[0]["metadata"]["uid"] for u in before} == before  # the hub is gone, the queue is not
    kube_hub.start()
    alice, bob, dave = (kube_hub.login(u) for u in ("alice", "bob", "dave"))

    # The restarted hub kept the same pods: same UIDs, so the same place in Kueue's queue,
    # and shows them as the pending spawns they are, with their place on the progress stream.
    for user, place in ((bob, "1st of 2"), (dave, "2nd of 2")):
        until(lambda: (user.server() or {}).get("pending") == "spawn", what=f"{user.name}'s pending spawn", hub=kube_hub)
        events = user.progress(until=lambda e: place in e.get("message", ""), timeout=WAIT)
        assert f"You are {place} in the Vision Lab queue." in events[-1]["message"], events
    assert {u: [p["metadata"]["uid"] for p in pods(double, u)] for u in before} == {u: [uid] for u, uid in before.items()}
    assert all(pod_is_gated(pods(double, u)[0]) for u in before)
    assert reach(alice).status_code == 200  # the running server was re-adopted as before

    # Alice stops: bob (first in line) is admitted and reachable; dave still waits.
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    bob.wait_ready()
    assert reach(bob).status_code == 200
    assert pod_is_gated(pods(double, "dave")[0])
    # dave's spawn page follows him from the queue to "ready", as if the hub had never restarted:
    # the page is open before bob stops, as a user's would be (opened after, it shows only "ready").
    seen = []
    with ThreadPoolExecutor(1) as pool:
        follow = pool.submit(
            dave.progress, until=lambda e: seen.append(e) or bool(e.get("ready") or e.get("failed")), timeout=WAIT
        )
        until(
            lambda: any("in the Vision Lab queue" in e["message"] for e in seen) or follow.done(),
            what="dave's progress stream showing his place",
            hub=kube_hub,
        )
        assert not follow.done(), seen
        assert bob.stop().status_code in (202, 204)
        bob.wait_gone()
        events = follow.result()
    assert events[-1].get("ready") is True, events
    assert any(e["message"].startswith("Quota granted") or e["message"].startswith("Server") for e in events[:-1]), events
    dave.wait_ready()
    assert reach(dave).status_code == 200
    assert dave.stop().status_code in (202, 204)
    dave.wait_gone()
    until(lambda: pods(double) == [], what="no pods left")
    log = kube_hub.log.read_text(errors="replace")
    assert "was waiting in Kueue's queue when the hub restarted; keeping its place" in log
    assert "does not appear to be running" not in log
    assert double.invalid == [] and double.errors == []
