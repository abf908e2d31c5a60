"""Granted secrets and data when the hub is not root (single-user mode, no sandbox).

Every server runs as the hub's user then, so nothing is private between users (the hub warns
at start); the layout is the same as isolated: ``$GPUHUB_SECRETS_DIR/<name>`` (0400) and
``$GPUHUB_DATA_DIR/<name>``, in a 0700 directory removed when the server stops. A grant
that cannot be read refuses the start with words that name neither file nor value.
"""

from __future__ import annotations

import asyncio
import os
import stat
from types import SimpleNamespace

import pytest
from tornado import web

from gpuhub_spawner.policy import parse_policy

VALUE = "value-of-the-secret"


def spawner_with(policy, team="vision", profile="cpu"):
    from gpuhub_spawner.local.isolation import IsolatedProcessSpawner

    sp = IsolatedProcessSpawner(user=SimpleNamespace(name="alice", url="/user/alice/", escaped_name="alice"))
    sp.isolation = "off"
    sp.granted_scope = lambda: (policy, team, profile)
    return sp


def policy_for(tmp_path, key="wandb", kernel=""):
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    (etc / "s.yaml").write_text(f"wandb: {VALUE}\n")
    (etc / "s.yaml").chmod(0o600)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "imagenet").mkdir()
    return parse_policy(
        f"""\
teams:
  - {{name: vision, groups: [vision-lab]}}
profiles:
  - {{slug: cpu, displayName: CPU, teams: "*", default: true}}
secrets:
  - {{name: wandb, local: {{file: {etc / "s.yaml"}, key: {key}}}, teams: [vision]}}
data:
  - {{name: imagenet, teams: [vision], {kernel}local: {{path: {data / "imagenet"}}}}}
""",
        "p.yaml",
    )


def test_files_and_data_in_a_private_directory_removed_at_stop(tmp_path):
    sp = spawner_with(policy_for(tmp_path))
    env: dict[str, str] = {}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(sp._resolve_grants(loop, env))
    finally:
        loop.close()
    sp._grants_single_user(env)
    secret = os.path.join(env["GPUHUB_SECRETS_DIR"], "wandb")
    assert open(secret).read() == VALUE and stat.S_IMODE(os.stat(secret).st_mode) == 0o400
    top = os.path.dirname(env["GPUHUB_SECRETS_DIR"])
    assert stat.S_IMODE(os.stat(top).st_mode) == 0o700
    assert os.path.realpath(os.path.join(env["GPUHUB_DATA_DIR"], "imagenet")) == str(tmp_path / "data" / "imagenet")
    sp._remove_grants_tmp()
    assert not os.path.exists(top)


def test_an_unreadable_grant_refuses_the_start_without_naming_it_to_the_user(tmp_path, caplog):
    sp = spawner_with(policy_for(tmp_path, key="wandbb"))
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(web.HTTPError) as e:
            loop.run_until_complete(sp._resolve_grants(loop, {}))
    finally:
        loop.close()
    assert e.value.status_code == 500 and "not available on this machine" in e.value.log_message
    assert "s.yaml" not in e.value.log_message and VALUE not in caplog.text
    assert "secrets[0] (wandb).local.key" in caplog.text


def test_a_team_environment_is_listed_by_jupyter_as_a_kernel_of_its_python(tmp_path, monkeypatch):
    """``data[].kernel``: the server's Jupyter (the real jupyter_client) lists a kernel that runs
    the environment's own Python, where the server sees it (here: the private directory)."""
    from jupyter_client.kernelspec import KernelSpecManager

    sp = spawner_with(policy_for(tmp_path, kernel='kernel: "Vision Lab (2026-12)", '))
    env: dict[str, str] = {"JUPYTER_PATH": "/elsewhere"}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(sp._resolve_grants(loop, env))
    finally:
        loop.close()
    sp._grants_single_user(env)
    try:
        top = os.path.dirname(env["GPUHUB_DATA_DIR"])
        assert env["JUPYTER_PATH"] == os.pathsep.join([os.path.join(top, "jupyter"), "/elsewhere"])
        monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])
        spec = KernelSpecManager().get_kernel_spec("imagenet")
        assert spec.display_name == "Vision Lab (2026-12)" and spec.language == "python"
        assert spec.argv[:3] == [os.path.join(env["GPUHUB_DATA_DIR"], "imagenet", "bin", "python"), "-m", "ipykernel_launcher"]
    finally:
        sp._remove_grants_tmp()
