"""Issue 28 item 2: the runbooks of a full home, backup and restore, and a JupyterHub database
upgrade and rollback, run against real hubs (harness: test_runbooks.py): a real 16 MiB tmpfs
under the homes filled by a checkpoint; a backup of a running hub restored into a fresh hub;
that database taken one revision back, refused at start, upgraded with ``jupyterhub
upgrade-db`` and rolled back to the pre-upgrade copy. Its own file so that the pytest workers
share the runbook tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from support.hub import Hub, running_hub
from test_runbooks import POLICY, blocks, env_of, runbook, steps_run_by

pytestmark = [pytest.mark.integration]

PAGES = ("home-full", "backup-restore")  # upgrade-rollback: its policy blocks run in test_runbooks.py


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("runbooks-restore"), POLICY) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {name: hub.login(name) for name in ("admin", "alice", "bob")}


def test_a_full_home_fails_saves_and_the_runbook_finds_and_moves_the_file(hub, users, tmp_path):
    admin, bob = users["admin"], users["bob"]
    homes = hub.data / "home"
    homes.mkdir(exist_ok=True)
    # The homes' filesystem, 16 MiB: on one machine every home shares one, with no per-user quota.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(homes)], check=True)
    try:
        assert bob.start("cpu").status_code in (201, 202)
        s = bob.wait_ready()
        home = homes / "bob"
        st = home.stat()
        big = home / "checkpoint-0042.pt"  # bob's training run wrote until the disk was full
        with open(big, "wb") as f:  # (the data dir is root's 0700: written here, then given to bob)
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC
        os.chown(big, st.st_uid, st.st_gid)
        save = hub.server_url(s["url"]) + "api/contents/notes.txt"
        auth = {"Authorization": f"token {bob.token}"}
        body = {"type": "file", "format": "text", "content": "results\n" * 20000}
        r = requests.put(save, json=body, headers=auth, timeout=30)
        assert r.status_code == 500 and "Unexpected error while saving file: notes.txt" in r.text, (r.status_code, r.text[:300])

        env = env_of(hub, admin, HOMES=homes, WHO_HOME="bob", ARCHIVE=tmp_path / "archive", BIG=big)
        out = runbook("home-full", "check", env)
        assert out.splitlines()[0].split()[-1] == "100%", out
        assert re.search(rf"^1[56] MiB  {re.escape(str(home))}$", out, re.M), out
        out = runbook("home-full", "largest", env)
        assert re.search(rf"^1[56] MiB  \d{{4}}-\d\d-\d\d  {re.escape(str(big))}$", out, re.M), out
        out = runbook("home-full", "move-aside", env)
        assert f"moved checkpoint-0042.pt to {tmp_path / 'archive'}/bob/" in out and not big.exists()
        out = runbook("home-full", "verify", env)
        assert int(next(w for w in out.split() if w.endswith("%")).rstrip("%")) < 10, out
        r = requests.put(save, json=body, headers=auth, timeout=30)
        assert r.status_code in (200, 201), r.text[:300]
    finally:
        if bob.server() is not None:
            bob.stop()
            bob.wait_gone()
        subprocess.run(["umount", "-l", str(homes)])


def test_moving_a_file_aside_follows_no_link_the_user_swapped_in(tmp_path):
    """Between the admin's ``find`` and the move, bob replaces the folder on the file's path by
    a link to a folder of root's holding a file of the same name: the move refuses and root's
    file stays where it was (a root ``mv`` moved it)."""
    homes, archive, victim = tmp_path / "homes", tmp_path / "archive", tmp_path / "etc"
    (homes / "bob" / "runs").mkdir(parents=True)
    victim.mkdir()
    (victim / "checkpoint.pt").write_text("root's")
    big = homes / "bob" / "runs" / "checkpoint.pt"
    big.write_text("bob's")
    env = {"HOMES": homes, "WHO_HOME": "bob", "BIG": big, "ARCHIVE": archive}
    (homes / "bob" / "runs").rename(homes / "bob" / "runs.old")  # bob's swap, after the admin's find
    (homes / "bob" / "runs").symlink_to(victim)
    out = runbook("home-full", "move-aside", env, ok=False)
    assert "refused:" in out and "moved" not in out and (victim / "checkpoint.pt").read_text() == "root's", out
    assert not (archive / "bob" / "checkpoint.pt").exists()
    (homes / "bob" / "runs").unlink()
    (homes / "bob" / "runs.old").rename(homes / "bob" / "runs")  # the real file moves as before
    out = runbook("home-full", "move-aside", env)
    assert f"moved checkpoint.pt to {archive}/bob/" in out and not big.exists()
    assert (archive / "bob" / "checkpoint.pt").read_text() == "bob's"


def test_a_backup_restored_into_a_fresh_hub_then_its_database_upgraded_and_rolled_back(hub, users, tmp_path_factory):
    admin, alice = users["admin"], users["alice"]
    assert alice.start("gpu-1").status_code in (201, 202)  # a usage row and audit entries to find again
    alice.wait_ready()
    alice.stop()
    alice.wait_gone()
    backup, textfiles = tmp_path_factory.mktemp("backup") / "nightly", tmp_path_factory.mktemp("textfile")
    env = env_of(hub, admin, BACKUP=backup, TEXTFILE_DIR=textfiles)
    out = runbook("backup-restore", "backup", env)
    assert out.strip().splitlines()[-1] == "ok", out
    out = runbook("backup-restore", "check", env)
    assert out.splitlines()[0] == "ok" and re.search(r"^files in data.tar.gz: \d+$", out, re.M), out
    assert re.search(r"^gpuhub_backup_last_success_timestamp_seconds \d{10}$", out, re.M), out
    audit_before = len(admin.api.get(admin.url("/gpuhub/audit?limit=10000")).json()["entries"])

    # The machine is lost: a fresh hub, its data directory restored from the backup.
    fresh = Hub(tmp_path_factory.mktemp("restored"), POLICY)
    out = runbook("backup-restore", "restore", env | {"DATA": fresh.data})
    assert out.strip().splitlines()[-1] == "ok", out
    assert not (fresh.data / "proxy.pid").exists()
    fresh.start(timeout=120)
    try:
        renv = env_of(fresh, admin)  # the admin's token from before the loss works on the restored hub
        out = runbook("backup-restore", "verify", renv)
        assert "users: admin alice bob" in out, out
        audit_after = int(re.search(r"^audit entries: (\d+)$", out, re.M).group(1))
        assert audit_after >= audit_before, (audit_before, out)
        assert re.search(r"^alice\s+\d+\.\d+ ", out, re.M) and re.search(r"^how allocations ended: \d+ stopped", out, re.M), (
            out
        )  # usage history, from the backup
    finally:
        fresh.stop()

    # An upgrade whose JupyterHub needs a newer schema than the database has: made here by
    # taking the restored database one revision back, which is what the older release had.
    down = subprocess.run(
        [sys.executable, "-m", "jupyterhub.dbutil", "alembic", "downgrade", "-1"],
        cwd=fresh.data,
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
        capture_output=True,
        text=True,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    fenv = env_of(fresh, admin)
    old = re.search(r"^database schema: (\w+)$", runbook("upgrade-rollback", "check-db", fenv), re.M).group(1)
    with pytest.raises(RuntimeError):
        fresh.start(timeout=120)
    assert "upgrade-db" in fresh.tail(30), fresh.tail(30)
    out = runbook("upgrade-rollback", "upgrade-db", fenv)
    new = re.search(r"^database schema: (\w+)$", out, re.M).group(1)
    assert new != old and re.search(r"^pre-upgrade copy: .*/jupyterhub\.sqlite\.\S+$", out, re.M), out
    fresh.start(timeout=120)
    try:
        out = runbook("upgrade-rollback", "verify", env_of(fresh, admin))
        assert "hub: 200" in out and "users: 3" in out, out
    finally:
        fresh.stop()
    out = runbook("upgrade-rollback", "rollback-db", fenv)
    assert f"database schema: {old}" in out, out


def test_every_marked_block_of_these_pages_is_run_by_a_test():
    mine = [(page, step) for page in PAGES for step in blocks(page)]
    mine += [("upgrade-rollback", s) for s in ("check-db", "upgrade-db", "rollback-db", "verify")]
    ran = steps_run_by(__file__)
    missing = sorted(f"runbook:{page}/{step}" for page, step in mine if (page, step) not in ran)
    assert not missing, f"marked blocks no test runs: {missing}"
