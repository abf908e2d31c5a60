"""JupyterLab's "Run as job" (issue 44): what the server's relay sends to the hub, and the
profile list it offers.

The relay (``gpuhub_notebook.server_extension``) turns the browser's request into the hub's job
submission, with this server's own token (the real hub path: tests/integration/
test_browser_run_as_job.py). Here: only the notebook, the profile, the parameters and "stop my
server" come from the browser; the server stopped is always this one; a path out of the home or
the server's files is refused before anything is sent; parameters are typed exactly as
``gpuhub job submit -p`` types them. And the hub's profile list is the spawn page's, in its words.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuhub_notebook.server_extension import (
    RunAsJobError,
    notebook_in_home,
    parameter_value,
    parse_parameters,
    run_as_job_request,
)
from gpuhub_spawner.jobs.cli import parameter_value as cli_parameter_value
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.access import profile_choices

POLICY = """\
flavors:
  - {name: a100, displayName: A100 80GB, local: {virtual: 2}}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {a100: 2}}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {a100: 0}}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", cpu: "1", memory: 1Gi}
  - {slug: a100-1, displayName: One A100, description: For training, gpu: {count: 1, flavor: a100}, teams: [vision], cpu: "2", memory: 8Gi, default: true}
  - {slug: nlp-secret, displayName: NLP only, teams: [nlp]}
"""


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    (h / "proj").mkdir(parents=True)
    (h / "proj" / "train.ipynb").write_text("{}")
    (h / "notes.txt").write_text("x")
    return h


@pytest.mark.parametrize(
    "text", ["3", "-2", "0.5", "1e-3", "True", "true", "False", "false", "None", "null", "abc", "", "0x10", "3.0.1", " 7"]
)
def test_parameters_are_typed_as_the_cli_types_them(text):
    assert parameter_value(text) == cli_parameter_value(text)
    assert type(parameter_value(text)) is type(cli_parameter_value(text))


def test_parameter_lines_with_their_mistakes_located():
    assert parse_parameters("lr=0.01\n\n# a comment\n epochs = 20 \nname=run a\n") == {
        "lr": 0.01,
        "epochs": 20,
        "name": "run a",
    }
    with pytest.raises(RunAsJobError, match="line 2: give a parameter as name=value"):
        parse_parameters("lr=1\nepochs 20")
    with pytest.raises(RunAsJobError, match=r"line 1: '1x' is not a Python name"):
        parse_parameters("1x=3")
    with pytest.raises(RunAsJobError, match="at most 100 parameters"):
        parse_parameters("\n".join(f"p{i}=1" for i in range(101)))


def test_the_notebook_is_named_relative_to_the_home_and_must_be_a_notebook_in_it(home, tmp_path):
    assert notebook_in_home(str(home), "proj/train.ipynb", str(home)) == "proj/train.ipynb"
    # A server whose root is a folder of the home: the path the job gets is still from the home.
    assert notebook_in_home(str(home / "proj"), "/train.ipynb", str(home)) == "proj/train.ipynb"
    for path, words in (
        ("notes.txt", "only a notebook"),
        ("proj/missing.ipynb", "no such notebook"),
        ("../other/x.ipynb", "not in this server's files"),
        ("", "name the notebook"),
        (None, "name the notebook"),
    ):
        with pytest.raises(RunAsJobError, match=words):
            notebook_in_home(str(home), path, str(home))
    # A link from the home to a notebook elsewhere (another user's, a shared folder): its real place counts.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs.ipynb").write_text("{}")
    os.symlink(elsewhere / "theirs.ipynb", home / "link.ipynb")
    with pytest.raises(RunAsJobError, match="not in this server's files"):
        notebook_in_home(str(home), "link.ipynb", str(home))
    # A server rooted above the home reaches files outside it: not run from the home, so refused.
    with pytest.raises(RunAsJobError, match="not in your home directory"):
        notebook_in_home(str(tmp_path), "elsewhere/theirs.ipynb", str(home))


def test_the_submission_stops_only_this_server_and_carries_nothing_else_of_the_browser(home):
    body = {
        "path": "proj/train.ipynb",
        "profile": "a100-1",
        "team": "vision",
        "parameters": "lr=0.5",
        "stop_server": True,
        # What a forged request might add: none of it reaches the hub.
        "server": "someone-else",
        "user": "alice",
        "command": ["sh", "-c", "id"],
        "spec": "profile: cpu\ncommand: id\n",
    }
    sub = run_as_job_request(body, str(home), "gpu", str(home))
    assert set(sub) == {"spec", "filename", "stop_server"} and sub["stop_server"] == "gpu"
    assert sub["filename"] == "train.ipynb"
    spec = json.loads(sub["spec"])
    assert spec == {"profile": "a100-1", "notebook": "proj/train.ipynb", "team": "vision", "parameters": {"lr": 0.5}}
    job = parse_job(sub["spec"], sub["filename"])  # a job file the hub accepts
    assert job.kind == "notebook" and job.notebook == "proj/train.ipynb"
    # Without "stop my server" (or with anything but true) no server is named.
    for stop in (False, "true", 1, None):
        assert "stop_server" not in run_as_job_request({**body, "stop_server": stop}, str(home), "gpu", str(home))
    for bad, words in (
        ({**body, "profile": ""}, "choose a profile"),
        ({**body, "parameters": ["lr=1"]}, "one name=value"),
        ([], "JSON object"),
    ):
        with pytest.raises(RunAsJobError, match=words):
            run_as_job_request(bad, str(home), "gpu", str(home))


def test_the_profile_list_is_the_spawn_pages_for_the_users_own_teams():
    policy = parse_policy(POLICY)
    teams = profile_choices(policy, ["vision-lab"])
    assert [t["name"] for t in teams] == ["vision"] and teams[0]["displayName"] == "Vision Lab"
    assert teams[0]["profiles"] == [
        {
            "slug": "cpu",
            "displayName": "CPU only",
            "description": "",
            "resources": "1 CPU, 1Gi memory, no GPU",
            "gpus": 0,
            "default": False,
        },
        {
            "slug": "a100-1",
            "displayName": "One A100",
            "description": "For training",
            "resources": "2 CPU, 8Gi memory, 1\u00d7 A100 80GB GPU",
            "gpus": 1,
            "default": True,
        },
    ]
    # Another team's profile is not in the list; no team, no list.
    assert "nlp-secret" not in json.dumps(teams)
    assert profile_choices(policy, ["nobody"]) == []
    both = profile_choices(policy, ["nlp-group", "vision-lab"])
    assert [t["name"] for t in both] == ["vision", "nlp"]
    assert [p["slug"] for p in both[1]["profiles"]] == ["cpu", "nlp-secret"] and both[1]["profiles"][0]["default"]
