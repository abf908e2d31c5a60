"""``gpuhub env create``: a user's own environment layered on the server's (docs/own-packages.md)."""

from __future__ import annotations

import subprocess

import pytest

from gpuhub_spawner import user_envs


def test_an_environment_sees_the_servers_packages_after_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUHUB_ENVS_DIR", str(tmp_path / "envs"))
    assert user_envs.main(["create", "mine", "--no-kernel"]) == 0
    python = tmp_path / "envs" / "mine" / "bin" / "python"
    out = subprocess.run(
        [str(python), "-c", "import sys, gpuhub_spawner, pip; print(sys.prefix); print(gpuhub_spawner.__name__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [str(tmp_path / "envs" / "mine"), "gpuhub_spawner"]
    assert "install:" in capsys.readouterr().out
    # a second create is refused with the way to use it; --refresh re-links it
    assert user_envs.main(["create", "mine", "--no-kernel"]) == 2
    assert "exists; install into it with" in capsys.readouterr().err
    assert user_envs.main(["create", "mine", "--no-kernel", "--refresh"]) == 0


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 65])
def test_a_bad_name_is_refused(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUHUB_ENVS_DIR", str(tmp_path))
    assert user_envs.main(["create", name, "--no-kernel"]) == 2
    assert "use letters, digits" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
