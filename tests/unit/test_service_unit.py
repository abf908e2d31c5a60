"""`gpuhub install-service`: a unit systemd accepts, that runs this hub with the operator's files."""

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path


from gpuhub_spawner.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_install_service_writes_a_valid_unit(tmp_path, capsys):
    site = tmp_path / "site.yaml"
    site.write_text("auth: {kind: pam, admin_groups: [wheel]}\n")
    out = tmp_path / "gpuhub.service"
    assert (
        main(
            [
                "install-service",
                "--config",
                str(REPO / "jupyterhub_config" / "jupyterhub_config.py"),
                "--site",
                str(site),
                "--data-dir",
                str(tmp_path / "data"),
                "--port",
                "8443",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "systemctl daemon-reload && systemctl enable --now gpuhub" in capsys.readouterr().out
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(out)
    svc = unit["Service"]
    assert svc["User"] == "root" and svc["StandardOutput"] == "journal" and svc["UMask"] == "0077"
    assert svc["Restart"] == "on-failure" and svc["KillSignal"] == "SIGTERM"
    assert svc["KillMode"] == "mixed"  # SIGTERM to the hub alone: it stops its services itself, promptly
    argv = shlex.split(svc["ExecStart"])
    assert argv[1] == "run" and argv[argv.index("--site") + 1] == str(site)
    assert argv[argv.index("--data-dir") + 1] == str(tmp_path / "data") and argv[argv.index("--port") + 1] == "8443"
    assert Path(argv[0]).is_file()
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_missing_files_are_named_not_written(tmp_path, capsys):
    out = tmp_path / "gpuhub.service"
    assert main(["install-service", "--site", str(tmp_path / "nope.yaml"), "--output", str(out)]) == 2
    assert "site file" in capsys.readouterr().err and not out.exists()


def test_a_bad_site_file_is_refused_with_its_line(tmp_path, capsys):
    site = tmp_path / "site.yaml"
    site.write_text("auth:\n  kind: oidc\n  client_id: x\n  clinet_secret_file: /etc/secret\n")
    rc = main(
        [
            "run",
            "--site",
            str(site),
            "--data-dir",
            str(tmp_path / "d"),
            "--config",
            str(REPO / "jupyterhub_config" / "jupyterhub_config.py"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and f"{site}:4:3: auth.clinet_secret_file: unknown key" in err
    site.write_text("auth:\n  kind: oidc\n  client_id: x\n")
    assert (
        main(
            [
                "run",
                "--site",
                str(site),
                "--data-dir",
                str(tmp_path / "d"),
                "--config",
                str(REPO / "jupyterhub_config" / "jupyterhub_config.py"),
            ]
        )
        == 1
    )
    assert (
        f"{site}:2:3: auth: auth kind 'oidc' needs client_secret_file, authorize_url, token_url, userinfo_url"
        in capsys.readouterr().err
    )
