"""Fair share over time (issue 41) against a real hub: the team that used the GPU less lately
is admitted first, and the spawn page says why.

One virtual GPU, owned by a third team (Students, which lends it) and borrowed by NLP and
Vision Lab alike (no quota of their own, equal weights): only their recent use can decide
between them. The hub's usage history says NLP held GPUs for many hours this week and Vision
Lab for few: rows recorded by the hub's own ``usage.history.History`` in the hub's database
while the hub is down, so the decayed usage the queue orders by is the one it reads back at
start (surviving a restart). Then erin (Students) holds the GPU; carol (NLP) asks first,
alice (Vision Lab) second; when erin stops, alice gets the GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import requests

from support.hub import Hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 1}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    cohort: lab
    weight: 1
  - name: nlp
    displayName: NLP
    groups: [nlp-group]
    cohort: lab
    weight: 1
  - name: students
    displayName: Students
    groups: [students]
    cohort: lab
    weight: 1
    quota: {gpus: {gpu: 1}}
profiles:
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: "*", cpu: 500m, memory: 1Gi}
fairShare:
  halfLife: 2d
defaults:
  queueTimeout: 5m
"""

HOUR = 3600.0


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("fairshare"), POLICY)
    try:
        h.start()  # creates the hub's database (and gpuhub's usage tables in it)
        h.stop()
        # The week so far, as the hub recorded it: NLP 2 GPUs for 10 h (ending 4 h ago) and
        # one for 8 h the day before; Vision Lab one GPU for 2 h yesterday.
        from gpuhub_spawner.usage.history import History

        history = History(f"sqlite:///{h.data / 'jupyterhub.sqlite'}")
        now = time.time()
        rows = [
            ("carol", "nlp", 2, now - 14 * HOUR, now - 4 * HOUR),
            ("carol", "nlp", 1, now - 40 * HOUR, now - 32 * HOUR),
            ("alice", "vision", 1, now - 30 * HOUR, now - 28 * HOUR),
        ]
        for i, (user, team, gpus, start, end) in enumerate(rows):
            key = f"{user}/old{i}"
            history.open(
                key=key,
                user=user,
                team=team,
                profile="gpu-1",
                flavor="gpu",
                gpus=gpus,
                devices=["gpu0"],
                requested=start,
                start=start,
            )
            history.close(key, end, "stopped")
        history.flush()
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "carol", "erin", "admin")}


def waiting_message(user, words: str = "Waiting in the queue") -> str:
    """The spawn page's message (its progress stream) once it says ``words``."""
    events = user.progress(until=lambda e: words in e.get("message", ""), timeout=60)
    return events[-1]["message"]


def test_less_recent_use_goes_first_with_the_reason_on_the_spawn_page(hub, users):
    alice, carol, erin, admin = users["alice"], users["carol"], users["erin"], users["admin"]
    assert erin.start("gpu-1").status_code in (201, 202)
    erin.wait_ready()
    try:
        carol_start = carol.start_background("gpu-1")
        wait_for(lambda: carol.server() is not None, 30, "carol's request to reach the queue")
        alone = waiting_message(carol)
        assert "Fair share" not in alone  # nobody waits beside NLP: fair share decides nothing yet
        alice_start = alice.start_background("gpu-1")
        wait_for(lambda: alice.server() is not None, 30, "alice's request to reach the queue")
        alice_words = waiting_message(alice, "Fair share")
        carol_words = waiting_message(carol, "Fair share")

        # carol asked first, but NLP used more for its share: the page says so, in numbers
        m = re.search(
            r"Fair share: NLP used (\d+) GPU-hours lately \(usage halves every 2d\) against a share of 33%", carol_words
        )
        assert m, carol_words
        v = re.search(r"Vision Lab ([\d.]+) GPU-hours? against 33%: Vision Lab goes first", carol_words)
        assert v, carol_words
        assert float(m.group(1)) > float(v.group(1)) > 0
        assert "Fair share: Vision Lab used" in alice_words and "no team waiting beside it used less" in alice_words

        # the admin's figures: the status page's JSON and Prometheus
        status = requests.get(
            hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {admin.token}"}, timeout=30
        ).json()
        figures = {f["name"]: f for f in status["fair_share"]["teams"]}
        assert figures["nlp"]["recent_gpu_hours"] > figures["vision"]["recent_gpu_hours"] > 0
        assert figures["nlp"]["share_pct"] == 33.3
        page = admin.session.get(hub.url + "/hub/gpuhub", timeout=30).text
        assert 'id="gpuhub-fair-share"' in page and "Vision Lab goes first" in page
        # `gpuhub usage` in a terminal: the same figures, lowest use per share first
        env = dict(os.environ, JUPYTERHUB_API_URL=hub.url + "/hub/api", JUPYTERHUB_API_TOKEN=admin.token)
        env.pop("GPUHUB_TOKEN", None)
        cli = subprocess.run(
            [sys.executable, "-m", "gpuhub_spawner.cli", "usage"], env=env, capture_output=True, text=True, timeout=60
        )
        assert cli.returncode == 0, cli.stderr
        table = cli.stdout.split("fair share now (recent GPU use, halving every 2d;", 1)[1].splitlines()[2:5]
        assert [line.split()[0] for line in table] == ["Students", "Vision", "NLP"], cli.stdout
        # the usage page: each team's recent use against its share over the window
        usage = admin.session.get(hub.url + "/hub/gpuhub/usage?since=7d", timeout=30).text
        assert 'id="gpuhub-chart-fair"' in usage
        now = {n: float(re.search(rf"<title>{n}: now ([\d.]+)</title>", usage).group(1)) for n in ("NLP", "Vision Lab")}
        assert now["NLP"] > 1 > now["Vision Lab"]  # NLP used more than its third lately, Vision Lab less
        metrics = requests.get(hub.url + "/hub/metrics", headers={"Authorization": f"token {admin.token}"}, timeout=30).text
        nlp_hours = float(re.search(r'gpuhub_fair_share_recent_gpu_hours\{team="nlp"\} ([\d.e+-]+)', metrics).group(1))
        assert nlp_hours == pytest.approx(figures["nlp"]["recent_gpu_hours"], abs=0.1)

        # the GPU frees: Vision Lab's request is admitted, NLP's (older) request waits on
        erin.stop()
        alice.wait_ready(timeout=120)
        assert carol.server() is not None and not carol.server().get("ready")
        alice_start.result(timeout=60)
    finally:
        for u in (erin, alice, carol):
            u.stop()
        for u in (erin, alice, carol):
            u.wait_gone(timeout=120)
    carol_start.result(timeout=60)
