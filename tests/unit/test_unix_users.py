"""Account names, foreign accounts, and private-from-the-first-byte data files."""

import os
import stat
import subprocess
import uuid

import pytest

from gpuhub_spawner.wiring.config import demo_password, private_dir
from gpuhub_spawner.local.unix_users import AccountError, ensure_account, ensure_home, remove_accounts, system_username

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix accounts (CI runs as root)")


def test_safe_names_are_kept_readable():
    assert system_username("alice") == "gpuhub-alice"
    assert system_username("bob-2", "lab-") == "lab-bob-2"


@pytest.mark.parametrize("name", ["Alice", "a.b", "a_b", "../etc", "al ice", "x" * 40, "root:0", "é"])
def test_unsafe_names_are_sanitised_and_hashed(name):
    acct = system_username(name)
    assert len(acct) <= 32 and acct.startswith("gpuhub-")
    assert all(c.isascii() and (c.isalnum() or c in "-_") for c in acct) and acct == acct.lower()
    assert "_" in acct  # only hashed names carry '_', so they never equal a kept name


def test_distinct_hub_names_never_share_an_account():
    names = ["alice", "Alice", "ALICE", "a.lice", "a-lice", "a_lice", "alice_" + "0" * 10, "x" * 40, "x" * 41]
    accounts = [system_username(n) for n in names]
    assert len(set(accounts)) == len(names)
    # a hub user cannot pick a name that equals another user's hashed account
    hashed = system_username("a.lice")
    assert system_username(hashed[len("gpuhub-") :]) != hashed


def test_bad_prefix_is_refused():
    with pytest.raises(AccountError, match="prefix"):
        system_username("alice", "Bad Prefix")


@root_only
def test_accounts_are_created_once_unprivileged_and_foreign_ones_refused(tmp_path):
    prefix = f"gu{uuid.uuid4().hex[:5]}-"
    try:
        a = ensure_account("alice", prefix)
        assert a.uid != 0 and a.gid != 0 and ensure_account("alice", prefix) == a
        home = tmp_path / "home" / "alice"
        (home / "project").mkdir(parents=True)  # a home from the days servers ran as root
        (home / "project" / "notes.txt").write_text("mine")
        os.symlink("/etc/passwd", home / "link")
        ensure_home(str(home), a)
        st = home.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (a.uid, 0o700)
        assert (home / "project" / "notes.txt").stat().st_uid == a.uid and os.lstat(home / "link").st_uid == a.uid
        assert os.stat("/etc/passwd").st_uid == 0  # links are not followed
        # an account gpuhub did not make (a person's login, a system account) is never used
        subprocess.run(["useradd", "--system", "--no-create-home", f"{prefix}bob"], check=True)
        with pytest.raises(AccountError, match="not created by gpuhub"):
            ensure_account("bob", prefix)
        subprocess.run(["userdel", f"{prefix}bob"], check=True)
    finally:
        remove_accounts(prefix)


@root_only
def test_a_users_first_servers_starting_together_get_one_account():
    """Found in a loaded suite run: bob's two first servers started at once, two `useradd`s
    raced, and one server's home was given to a uid that /etc/passwd no longer had (its
    launcher: "Permission denied: '/home/<account>'"). Threads of one hub and another
    process (a second hub, here a shell loop of useradds) now take turns."""
    from concurrent.futures import ThreadPoolExecutor
    import pwd

    prefix = f"gr{uuid.uuid4().hex[:5]}-"
    other = subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4 5 6; do useradd --system --no-create-home {prefix}x$i; done"])
    try:
        for n in range(4):
            with ThreadPoolExecutor(4) as pool:
                uids = set(pool.map(lambda _: ensure_account(f"bob{n}", prefix).uid, range(4)))
            assert uids == {pwd.getpwnam(system_username(f"bob{n}", prefix)).pw_uid}, uids
    finally:
        other.wait()
        remove_accounts(prefix)
        for i in range(1, 7):
            subprocess.run(["userdel", f"{prefix}x{i}"], capture_output=True)


def test_data_dir_and_demo_password_are_private_from_the_first_byte(tmp_path, monkeypatch):
    """Created with their final modes: with a permissive umask and chmod disabled they are still private."""
    monkeypatch.delenv("GPUHUB_DEMO_PASSWORD", raising=False)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    monkeypatch.setattr("pathlib.Path.chmod", lambda *a, **k: None)
    old = os.umask(0)
    try:
        data = tmp_path / "new" / "data"
        assert private_dir(data) == data
        password = demo_password(data)
    finally:
        os.umask(old)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "demo-password").stat().st_mode) == 0o600
    assert demo_password(data) == password and len(password) >= 12
