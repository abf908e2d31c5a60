"""A hub restart loses nothing; a queued server gives up after the queue timeout."""

import requests
import pytest

from support.hub import Hub
from test_local_hub import POLICY

pytestmark = pytest.mark.integration


def status(hub, user):
    return requests.get(hub.url + "/hub/api/gpuhub/status", headers={"Authorization": f"token {user.token}"}).json()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("restart"), POLICY)
    h.start()
    yield h
    h.stop()


def test_restart_keeps_allocations_and_queue_semantics(hub):
    alice, carol = hub.login("alice"), hub.login("carol")
    alice.start("gpu-1")
    carol.start("gpu-1")
    alice.wait_ready()
    carol.wait_ready()
    before = {d["id"]: d["user"] for d in status(hub, alice)["devices"]}
    env_before = alice.server_env()["CUDA_VISIBLE_DEVICES"]
    assert sorted(before.values()) == ["alice", "carol"]

    hub.stop(kill_servers=False)
    hub.start()

    alice, bob = hub.login("alice"), hub.login("bob")
    assert alice.server()["ready"]  # still running, not restarted
    assert alice.server_env()["CUDA_VISIBLE_DEVICES"] == env_before
    after = {d["id"]: d["user"] for d in status(hub, alice)["devices"]}
    assert after == before  # the table was rebuilt from what really runs
    # nothing is assigned twice: vision's quota is still full, so bob waits
    assert bob.start("gpu-1").status_code == 202
    bob.progress(until=lambda e: "position 1 of 1" in e.get("message", ""))
    alice.stop()
    bob.wait_ready()
    assert bob.server_env()["CUDA_VISIBLE_DEVICES"] == env_before


def test_queue_timeout_withdraws_the_request(hub):
    good = hub.policy.read_text()
    hub.policy.write_text(good.replace("queueTimeout: 5m", "queueTimeout: 3s"))
    try:
        carol, dave = hub.login("carol"), hub.login("dave")
        if not carol.server():
            carol.start("gpu-1")
        carol.wait_ready()
        r = dave.start("gpu-1", team="nlp")
        assert r.status_code == 503
        assert "waited 3s in NLP's queue" in r.json()["message"] and "withdrawn" in r.json()["message"]
        assert dave.server() is None
        assert next(t for t in status(hub, carol)["teams"] if t["name"] == "nlp")["waiting"] == 0
    finally:
        hub.policy.write_text(good)
