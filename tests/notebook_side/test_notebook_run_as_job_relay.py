"""``GET/POST <base_url>gpuhub/jobs``: JupyterLab's "Run as job" relay, against a stand-in for the
hub (the real hub path, in Chromium: tests/integration/test_browser_run_as_job.py). It must use
the server's own hub token, name only this server to stop, send the notebook as a path in the
home, and refuse a bad request before anything reaches the hub."""

from __future__ import annotations

import json

import requests
from nbside import HUB_TOKEN, SERVER_NAME, USER


def test_profiles_come_from_the_hub_with_this_servers_token(nb_server, stand_in):
    r = nb_server.get("gpuhub/jobs")
    assert r.status_code == 200, r.text
    assert r.json() == {"user": USER, "teams": stand_in.teams, "server": SERVER_NAME}
    (req,) = stand_in.requests
    assert (req["method"], req["path"], req["auth"]) == ("GET", "/hub/api/gpuhub/profiles", f"token {HUB_TOKEN}")


def test_a_notebook_is_submitted_as_a_job_that_stops_only_this_server(nb_server, stand_in):
    (nb_server.workdir / "root" / "proj").mkdir(exist_ok=True)
    (nb_server.workdir / "root" / "proj" / "train.ipynb").write_text("{}")
    body = {"path": "proj/train.ipynb", "profile": "gpu-1", "parameters": "lr=0.01", "stop_server": True, "server": "other"}
    r = nb_server.post("gpuhub/jobs", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "job-0123456789" and r.json()["stopped_server"] == "stopping"
    (post,) = stand_in.posts()
    assert (post["path"], post["auth"]) == ("/hub/api/gpuhub/jobs", f"token {HUB_TOKEN}")
    assert post["body"]["stop_server"] == SERVER_NAME and post["body"]["filename"] == "train.ipynb"
    # The server's root is a folder of the home (HOME is the work dir here): the job gets the home's path.
    assert json.loads(post["body"]["spec"]) == {
        "profile": "gpu-1",
        "notebook": "root/proj/train.ipynb",
        "parameters": {"lr": 0.01},
    }


def test_a_bad_request_is_refused_here_with_the_reason(nb_server, stand_in):
    for body, words in (
        ({"path": "../outside.ipynb", "profile": "gpu-1"}, "not in this server's files"),
        ({"path": "missing.ipynb", "profile": "gpu-1"}, "no such notebook"),
        ({"path": "x.txt", "profile": "gpu-1"}, "only a notebook"),
    ):
        r = nb_server.post("gpuhub/jobs", json=body)
        assert r.status_code == 400 and words in r.json()["message"], r.text
    r = nb_server.post("gpuhub/jobs", data=b"{not json")
    assert r.status_code == 400
    # JSON nested deeper than Python's parser goes (within the size bound): a 400 that says
    # so, not a 500 with a RecursionError in the server's log.
    r = nb_server.post("gpuhub/jobs", data=b"[" * 30000 + b"]" * 30000)
    assert r.status_code == 400 and "JSON" in r.json()["message"], r.text
    assert nb_server.post("gpuhub/jobs", data=b"x" * (64 * 1024 + 1)).status_code == 413
    assert stand_in.requests == []  # nothing reached the hub


def test_the_relay_needs_the_users_authentication(nb_server, stand_in):
    assert requests.get(nb_server.url + "gpuhub/jobs", timeout=10).status_code == 403
    assert requests.post(nb_server.url + "gpuhub/jobs", json={"path": "x.ipynb"}, timeout=10).status_code == 403
    assert stand_in.requests == []
