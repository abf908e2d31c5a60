"""The culler service stops what the hub named, with its own token, and nothing else.

A real hub with the real culler service (its passes an hour apart, so only this test
stops anything). The test drives ``GpuHubCuller.stop_one`` — the service's stop of one
server the hub's answer names — with the service's own token and role, and checks what a
user and an auditor see: a server started again after the decision keeps running, a named
server is stopped and stays the user's, the hub's audit says the culler asked.
"""

import json
import os
from datetime import datetime
from unittest import mock

import pytest
from traitlets.config import Config

from gpuhub_spawner.culling.service import GONE, RESTARTED, STOPPED, STOPPING, GpuHubCuller, PassDecisions
from gpuhub_spawner.wiring.config import configure_culler
from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab]}
  - {name: students, displayName: Students, groups: [students, visitors]}
profiles:
  - slug: cpu
    displayName: CPU only
    teams: "*"
    idle: {timeout: 8h, warning: 15m}
"""

TOKEN = "culler-stops-test-" + "7" * 24

EXTRA_CONFIG = f"""
for _s in c.JupyterHub.services:
    if _s["name"] == "gpuhub-culler":
        _s["api_token"] = {TOKEN!r}  # the service's own token, known to the test
"""


def culler_scopes() -> list[str]:
    c = Config()
    configure_culler(c, cull_every=60)
    (role,) = [r for r in c.JupyterHub.load_roles if r["name"] == "gpuhub-culler"]
    return role["scopes"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(
        tmp_path_factory.mktemp("culler-stops"), POLICY, extra_config=EXTRA_CONFIG, env={"GPUHUB_CULL_EVERY": "3600"}
    ) as h:
        yield h


def started_of(server: dict) -> float:
    return datetime.fromisoformat(server["started"].replace("Z", "+00:00")).timestamp()


def stop(hub, key, decision):
    """One stop exactly as the service makes it, with the service's token (in this process's
    environment only while it runs: the pytest worker goes on to other files)."""
    import asyncio

    with mock.patch.dict(os.environ, {"JUPYTERHUB_API_TOKEN": TOKEN}):
        culler = GpuHubCuller(url=hub.url + "/hub/api", concurrency=5)
        culler.configure_client()
        return asyncio.run(culler.stop_one(key, {"action": "cull", "reason": "test", **decision}))


def audit(hub) -> list[dict]:
    path = hub.data / "gpuhub-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_service_role_can_look_and_stop_but_never_reach_a_server():
    scopes = culler_scopes()
    assert "read:servers" in scopes and "delete:servers" in scopes
    assert not any(s.startswith(("access:servers", "admin", "servers")) for s in scopes)


def test_a_server_started_again_after_the_decision_keeps_running(hub):
    alice = hub.login("alice")
    alice.start("cpu")
    first = alice.wait_ready()
    # the hub decided about a start an hour earlier (the server was stopped and started since)
    assert stop(hub, "alice/", {"started": started_of(first) - 3600}) == RESTARTED
    assert alice.server()["ready"], "a server the hub did not decide about was stopped"
    assert not any(e.get("event") == "stop_requested" and e.get("key") == "alice/" for e in audit(hub))
    # the decision about this very start stops it, audited as asked by the culler service
    # (202 where the hub's stop outlasts its slow_stop_timeout on a loaded machine: it finishes it)
    assert stop(hub, "alice/", {"started": started_of(first)}) in (STOPPED, STOPPING)
    wait_for(lambda: alice.server() is None, 60, "alice's server to stop")
    asked = [e for e in audit(hub) if e.get("event") == "stop_requested" and e.get("key") == "alice/"]
    assert asked and asked[-1]["by"] == "gpuhub-culler" and asked[-1]["by_kind"] == "service"
    # and a second answer naming it finds nothing left to stop
    assert stop(hub, "alice/", {"started": started_of(first)}) == GONE


def test_a_named_server_is_stopped_never_removed(hub):
    bob = hub.login("bob")
    r = bob.start("cpu", server="notes")
    assert r.status_code in (201, 202), r.text
    server = bob.wait_ready("notes")
    assert stop(hub, "bob/notes", {"started": started_of(server)}) in (STOPPED, STOPPING)
    wait_for(lambda: bob.server("notes") is None, 60, "bob's named server to stop")
    kept = bob.api.get(bob.url("/users/bob?include_stopped_servers=1")).json()["servers"]
    assert "notes" in kept and kept["notes"]["stopped"], kept  # his to start again


def test_a_server_that_does_not_exist_is_nothing_to_stop(hub):
    assert stop(hub, "nobody-here/", {"started": 0.0}) == GONE
    assert stop(hub, "bob/never-started", {"started": 0.0}) == GONE


def test_only_what_the_answer_names_as_due_is_stopped(hub):
    erin = hub.login("erin")
    erin.start("cpu")
    server = erin.wait_ready()
    answer = PassDecisions(
        {"now": 0, "servers": 1, "decisions": {"erin/": {"action": "warn", "deadline": 1e12, "started": started_of(server)}}}
    )
    assert answer.due == []
    import asyncio

    with mock.patch.dict(os.environ, {"JUPYTERHUB_API_TOKEN": TOKEN}):
        assert asyncio.run(GpuHubCuller(url=hub.url + "/hub/api").stop_due(answer)) == {}
    assert erin.server()["ready"]
