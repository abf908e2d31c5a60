"""The top-level ``gpuhub`` command: what a newcomer's ``--help`` and the start banner say."""

import pytest

from gpuhub_spawner.cli import _mlflow_url, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("validate", "run", "install-service", "render", "job", "usage"):
        assert f"    {command} " in out, (command, out)


def test_banner_names_mlflow_where_a_browser_opens_it(monkeypatch):
    monkeypatch.delenv("GPUHUB_SUBDOMAINS", raising=False)
    assert _mlflow_url("http://localhost:8000") == "http://mlflow--service.localhost:8000/services/mlflow/#/experiments"
    assert _mlflow_url("https://hub.example.org") == "https://mlflow--service.hub.example.org/services/mlflow/#/experiments"
    # without per-user origins the service lives under the hub's own origin
    assert _mlflow_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/services/mlflow/#/experiments"
    monkeypatch.setenv("GPUHUB_SUBDOMAINS", "0")
    assert _mlflow_url("http://localhost:8000") == "http://localhost:8000/services/mlflow/#/experiments"


def test_job_hub_option_goes_before_or_after_the_command(monkeypatch, capsys):
    """`gpuhub job submit FILE --hub URL` was refused; only `gpuhub job --hub URL submit` worked."""
    from gpuhub_spawner.jobs import cli as job_cli

    seen = []
    monkeypatch.setattr(job_cli, "api_base", lambda hub: seen.append(hub) or "http://x/hub/api")
    monkeypatch.setattr(job_cli, "_list", lambda args, base: None)
    assert job_cli.main(["list", "--hub", "http://after"]) == 0
    assert job_cli.main(["--hub", "http://before", "list"]) == 0
    assert job_cli.main(["list"]) == 0
    assert seen == ["http://after", "http://before", None]


def test_every_hub_client_command_finds_the_hub_and_reports_refusals_alike(monkeypatch, capsys):
    """`gpuhub ray` and `gpuhub gpu` share `gpuhub job`'s hub client (jobs/client.py): `--hub`
    before or after the command, and the hub's refusal as `gpuhub <command>: <words> (HTTP n)`."""
    from gpuhub_spawner.jobs.client import HubError
    from gpuhub_spawner.local import gpu_cli
    from gpuhub_spawner.rayclusters import cli as ray_cli

    for mod, argv in ((ray_cli, ["list"]), (gpu_cli, ["list"])):
        seen = []
        monkeypatch.setattr(mod, "api_base", lambda hub, seen=seen: seen.append(hub) or "http://x/hub/api")

        def refuse(base, method, path, body=None):
            raise HubError(403, "This needs the scope custom:gpuhub:jobs.")

        monkeypatch.setattr(mod, "call", refuse)
        assert mod.main(argv + ["--hub", "http://after"]) == 1
        assert mod.main(["--hub", "http://before"] + argv) == 1
        assert seen == ["http://after", "http://before"], mod
        name = "ray" if mod is ray_cli else "gpu"
        assert capsys.readouterr().err.splitlines() == [f"gpuhub {name}: This needs the scope custom:gpuhub:jobs. (HTTP 403)"] * 2


def test_a_reader_that_stops_early_gets_no_traceback_and_the_pipeline_holds():
    """`gpuhub policy history | head -n 3` under `set -o pipefail` (the escalation runbook) failed
    with a BrokenPipeError traceback whenever head left before gpuhub's last line. Here the
    reader is gone before the first line: the command ends quietly, with success."""
    import subprocess
    import sys
    from pathlib import Path

    gpuhub = Path(sys.executable).with_name("gpuhub")
    demo = Path(__file__).resolve().parents[2] / "jupyterhub_config" / "profiles.yaml"
    p = subprocess.Popen([str(gpuhub), "validate", str(demo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader leaves before gpuhub writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
