"""``GET/POST <base_url>gpuhub/culling``: the relay from JupyterLab to the hub's culling API,
against a stand-in for the hub (the real endpoint is covered by the hub's integration tests).
It must use the server's own hub token, answer for this server only, and pass 409 through."""

from __future__ import annotations

import time

import requests
from nbside import HUB_TOKEN, SERVER_NAME, USER


def test_no_warning(nb_server, stand_in):
    r = nb_server.get("gpuhub/culling")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["enabled"] is True and body["server"] == SERVER_NAME and body["warning"] is None
    assert abs(body["now"] - time.time()) < 30
    (req,) = stand_in.requests
    assert (req["method"], req["path"], req["auth"]) == ("GET", f"/hub/api/gpuhub/culling/{USER}", f"token {HUB_TOKEN}")


def test_returns_only_this_servers_warning(nb_server, stand_in):
    stand_in.warn("", minutes=3, reason="default server idle")  # the user's other server
    assert nb_server.get("gpuhub/culling").json()["warning"] is None
    w = stand_in.warn(SERVER_NAME, minutes=10, reason="GPU idle for 30 min")
    assert nb_server.get("gpuhub/culling").json()["warning"] == w


def test_a_failed_gpu_is_relayed_for_this_server_only(nb_server, stand_in):
    failure = {"devices": ["GPU-x"], "since": time.time(), "reason": "XID 79: GPU has fallen off the bus", "xid": 79}
    stand_in.gpu_failed[""] = dict(failure, devices=["GPU-y"])  # the user's other server
    body = nb_server.get("gpuhub/culling").json()
    assert body["gpu_failed"] is None and body["gpu_wait"] == 0
    stand_in.gpu_failed[SERVER_NAME] = failure
    assert nb_server.get("gpuhub/culling").json()["gpu_failed"] == failure
    # The lab extension's long poll: passed to the hub as gpu_wait, bounded here too.
    stand_in.reset()
    r = nb_server.get("gpuhub/culling?wait=25")
    assert r.status_code == 200, r.text
    (req,) = stand_in.requests
    assert req["path"] == f"/hub/api/gpuhub/culling/{USER}?gpu_wait=25"
    for bad in ("26", "-1", "nan", "soon"):
        assert nb_server.get(f"gpuhub/culling?wait={bad}").status_code == 400, bad
    assert len(stand_in.requests) == 1  # refused before reaching the hub


def test_snooze_relays_for_this_server_until_none_are_left(nb_server, stand_in):
    w = stand_in.warn(SERVER_NAME, snoozes_left=1, snooze_seconds=600)
    first = w["deadline"]
    # Whatever the browser names, the relay snoozes the server it runs in.
    r = nb_server.post("gpuhub/culling", json={"server": "someone-else"})
    assert r.status_code == 200, r.text
    assert r.json()["deadline"] == first + 600
    (post,) = stand_in.posts()
    assert post["path"] == f"/hub/api/gpuhub/culling/{USER}/snooze"
    assert post["body"] == {"server": SERVER_NAME} and post["auth"] == f"token {HUB_TOKEN}"
    assert nb_server.get("gpuhub/culling").json()["warning"]["deadline"] == first + 600

    r = nb_server.post("gpuhub/culling")
    assert r.status_code == 409
    assert r.json()["message"].startswith("No snoozes left")


def test_a_person_seen_is_relayed_for_this_server_with_no_word_of_the_browser(nb_server, stand_in):
    stand_in.warn(SERVER_NAME, minutes=10, reason="its GPUs were idle for 30m")
    r = nb_server.post("gpuhub/culling/seen")
    assert r.status_code == 200, r.text
    assert r.json() == {"recorded": True}
    (post,) = stand_in.posts()
    assert post["path"] == f"/hub/api/gpuhub/culling/{USER}/seen"
    # this server, and no time: the hub stamps its own (a browser's clock or claim is not asked)
    assert post["body"] == {"server": SERVER_NAME} and post["auth"] == f"token {HUB_TOKEN}"
    # a browser naming another server, or a time of its choosing, is refused before the hub
    for body in ({"server": "someone-else"}, {"at": time.time() + 86400}):
        r = nb_server.post("gpuhub/culling/seen", json=body)
        assert r.status_code == 400, (body, r.text)
    assert len(stand_in.posts()) == 1
    assert requests.post(nb_server.url + "gpuhub/culling/seen", timeout=10).status_code == 403  # not logged in
    assert len(stand_in.posts()) == 1


def test_relay_needs_the_users_authentication(nb_server, stand_in):
    assert requests.get(nb_server.url + "gpuhub/culling", timeout=10).status_code == 403
    assert requests.post(nb_server.url + "gpuhub/culling", timeout=10).status_code == 403
    assert stand_in.requests == []  # nothing reached the hub


def test_hub_unreachable_is_a_502_not_a_hang(tmp_path, stand_in):
    from nbside import NotebookServer, free_port

    server = NotebookServer(
        tmp_path,
        {
            "JUPYTERHUB_API_URL": f"http://127.0.0.1:{free_port()}/hub/api",
            "JUPYTERHUB_API_TOKEN": HUB_TOKEN,
            "JUPYTERHUB_USER": USER,
        },
        base_url="/",
    ).start()
    try:
        r = server.get("gpuhub/culling")
        assert r.status_code == 502 and "unreachable" in r.json()["error"]
        r = server.post("gpuhub/culling")
        assert r.status_code == 502
    finally:
        server.stop()


def test_outside_a_hub_the_relay_is_disabled():
    from gpuhub_notebook.server_extension import hub_environment

    assert hub_environment({}) is None
    assert hub_environment(
        {"JUPYTERHUB_API_URL": "http://hub/hub/api/", "JUPYTERHUB_API_TOKEN": "t", "JUPYTERHUB_USER": "bob"}
    ) == {"url": "http://hub/hub/api", "token": "t", "user": "bob", "server": "", "ssl": {}}
