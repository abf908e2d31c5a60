"""The root sandbox launcher's hand-over and its no-follow walk, without a hub.

The launcher (``local.sandbox``) gets its spec and the server's environment on a pipe,
applies the environment only at its final ``execve``, and walks the user's private /tmp
without following links. The attacks themselves run against a real hub in
``tests/integration/test_attack_launcher.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from gpuhub_spawner.local import sandbox
from gpuhub_spawner.local.sandbox import UnsafePath, hand_over, open_dir_nofollow, read_payload

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def test_the_walk_refuses_a_link_or_a_file_anywhere_and_makes_only_what_is_missing(tmp_path):
    base, outside = tmp_path / "tmp", tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    os.symlink(outside, base / "top")
    (base / "real").mkdir()
    os.symlink(outside, base / "real" / "nested")
    (base / "file").write_text("x")
    for rel in ("top/venv", "real/nested/venv", "file/venv", "top", "real/nested"):
        with pytest.raises(UnsafePath, match="symbolic link or not a directory"):
            os.close(open_dir_nofollow(str(base), rel, create=True))
    with pytest.raises(UnsafePath, match="not a plain path component"):
        open_dir_nofollow(str(base), "real/../top", create=True)
    assert os.listdir(outside) == []  # nothing was made through a link
    fd = open_dir_nofollow(str(base), "/made/here/venv", create=True)
    try:
        assert os.path.samestat(os.stat(f"/proc/self/fd/{fd}"), os.stat(base / "made" / "here" / "venv"))
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_dir_nofollow(str(base), "missing", create=False)


def _pipe_with(data: bytes) -> int:
    r, w = os.pipe()
    threading.Thread(target=lambda: (os.write(w, data), os.close(w)), daemon=True).start()
    return r


def test_the_payload_is_read_to_its_end_checked_and_its_pipe_closed(monkeypatch):
    env = {"A": "1", "TOKEN": "t" * 100_000}
    r = _pipe_with(json.dumps({"spec": {"uid": 5}, "env": env}).encode())
    assert read_payload(r) == ({"uid": 5}, env)
    with pytest.raises(OSError):
        os.fstat(r)  # closed: the user's process never inherits it
    for bad in ({"spec": {}, "env": {"A": 1}}, {"spec": {}, "env": {"A=B": "x"}}, {"spec": [], "env": {}}, [1]):
        with pytest.raises(ValueError):
            read_payload(_pipe_with(json.dumps(bad).encode()))
    monkeypatch.setattr(sandbox, "MAX_PAYLOAD", 1000)
    with pytest.raises(ValueError, match="larger than"):
        read_payload(_pipe_with(b"{" + b" " * 5000))


def test_main_applies_the_environment_only_at_the_final_exec(monkeypatch):
    # main() runs in this test's process, so this process is the launcher here: it gets the
    # launcher's own environment (start_launcher's LAUNCHER_ENV, nothing else), as the hub
    # starts it. Not whatever this pytest worker inherited or an earlier test left in it
    # (tests/integration/test_culler_stops.py sets JUPYTERHUB_API_TOKEN in its worker), which
    # this test once read as a leak.
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in sandbox.LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    seen = {}
    env = {"LD_PRELOAD": "/home/x/p.so", "JUPYTERHUB_API_TOKEN": "secret"}
    monkeypatch.setattr(sandbox, "enter", lambda spec: seen.update(spec=spec, env_at_enter=dict(os.environ)))
    monkeypatch.setattr(os, "execvpe", lambda f, args, e: seen.update(exec=(f, args, e), env_at_exec=dict(os.environ)))
    r = _pipe_with(json.dumps({"spec": {"uid": 7}, "env": env}).encode())
    sandbox.main(["--spec-fd", str(r), "--", "/bin/prog", "arg"])
    assert seen["spec"] == {"uid": 7}
    # Root's environment is the launcher's own up to the exec, not a variable more.
    assert seen["env_at_enter"] == sandbox.LAUNCHER_ENV, seen["env_at_enter"]
    assert seen["env_at_exec"] == sandbox.LAUNCHER_ENV, seen["env_at_exec"]
    assert seen["exec"] == ("/bin/prog", ["/bin/prog", "arg"], env)


def test_unreadable_spec_is_refused_with_a_message(capsys):
    r = _pipe_with(b"not json")
    assert sandbox.main(["--spec-fd", str(r), "--", "/bin/true"]) == 125
    assert "cannot read the server's spec" in capsys.readouterr().err


class _Proc:
    pid = 4242
    killed = False

    def kill(self):
        self.killed = True


def test_hand_over_writes_a_big_payload_without_blocking_the_loop():
    payload = os.urandom(4 * 2**20)  # 64x a pipe's buffer
    r, w = os.pipe()
    got = bytearray()

    def slow_reader():
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)
            time.sleep(0.001)
        os.close(r)

    async def run():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        reader = threading.Thread(target=slow_reader)
        reader.start()
        await hand_over(_Proc(), w, payload)
        done.set()
        await t
        await asyncio.get_running_loop().run_in_executor(None, reader.join)
        return ticks

    ticks = asyncio.run(run())
    assert bytes(got) == payload
    assert ticks > 10  # the loop kept running while the pipe was full


def test_a_launcher_that_never_reads_is_killed_and_the_start_fails():
    r, w = os.pipe()
    proc = _Proc()
    try:
        with pytest.raises(RuntimeError, match="did not read its spec"):
            asyncio.run(hand_over(proc, w, b"x" * 2**20, timeout=0.5))
        assert proc.killed
    finally:
        os.close(r)


def test_a_launcher_gone_before_reading_is_left_to_the_exit_handling():
    r, w = os.pipe()
    os.close(r)
    asyncio.run(hand_over(_Proc(), w, b"x" * 2**20))  # no exception: its exit says why


@root_only
def test_home_take_over_leaves_hard_links_and_other_owners_files_alone(tmp_path):
    import uuid

    from gpuhub_spawner.local.unix_users import AccountError, ensure_account, ensure_home, remove_accounts

    prefix = f"gs{uuid.uuid4().hex[:5]}-"
    try:
        a = ensure_account("alice", prefix)
        home = tmp_path / "home" / "alice"
        (home / "sub").mkdir(parents=True)
        old_uid = 4321  # a recycled uid owned this home before
        victim = tmp_path / "root-file"
        victim.write_text("root's")
        os.link(victim, home / "sub" / "linked")  # a hard link to a file root owns elsewhere
        (home / "sub" / "mine").write_text("theirs")
        for p in (home, home / "sub", home / "sub" / "mine"):
            os.chown(p, old_uid, old_uid)
        os.symlink(tmp_path / "outside", home / "dirlink")
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "f").write_text("x")
        ensure_home(str(home), a)
        assert os.stat(home).st_uid == a.uid and (home / "sub" / "mine").stat().st_uid == a.uid
        assert victim.stat().st_uid == 0  # the linked file was not taken over
        assert (tmp_path / "outside" / "f").stat().st_uid == 0  # a link was never entered
        link_home = tmp_path / "linkhome"
        os.symlink(tmp_path / "outside", link_home)
        with pytest.raises(AccountError, match="not a directory"):
            ensure_home(str(link_home), a)
        assert (tmp_path / "outside").stat().st_uid == 0
    finally:
        remove_accounts(prefix)
