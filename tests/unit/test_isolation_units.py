"""Isolation pieces that need no hub: the start-up warning, and the cgroup v2 files written.

cgroup v2 cannot run on the test machine (its memory and cpu controllers are bound to v1
hierarchies), so the v2 writer is checked against a directory laid out like cgroupfs v2
(the kernel's cgroup-v2.rst names and formats); the v1 writer runs against the real
kernel in tests/integration/test_isolation.py.
"""

import io
import os

from gpuhub_spawner.local.cgroups import CgroupHost
from gpuhub_spawner.local.isolation import announce_isolation
from support.fake_cgroups import fake_v2


def test_not_root_is_single_user_mode_said_loudly(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = io.StringIO()
    assert announce_isolation(None, stream=out) is False
    text = out.getvalue()
    assert "SINGLE-USER MODE" in text and "not enforced" in text and "run the hub\n  as root" in text


def test_v2_limits_are_written_where_the_kernel_reads_them(tmp_path, monkeypatch):
    from gpuhub_spawner.local import cgroups

    monkeypatch.setattr(type(tmp_path), "mkdir", fake_v2(tmp_path))
    writes = []
    real_write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: (writes.append((str(path), value)), real_write(path, value)))
    host = CgroupHost.detect(str(tmp_path), "gpuhub")
    assert host.version == 2, host.describe()
    control = str(tmp_path / "gpuhub" / "cgroup.subtree_control")
    assert {v for p, v in writes if p == control} == {"+memory", "+cpu", "+pids"}  # children get the controllers
    root_control = str(tmp_path / "cgroup.subtree_control")
    assert {v for p, v in writes if p == root_control} == {"+memory", "+cpu", "+pids"}  # (systemd hosts: already on)
    cg = host.server("gpuhub-alice")
    cg.create(memory=4 * 2**30, cpu_millis=1500, device_rules=["c 195:0 rwm"])
    d = tmp_path / "gpuhub" / "gpuhub-alice"
    assert (d / "memory.max").read_text() == str(4 * 2**30)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "memory.oom.group").read_text() == "1"  # the whole server goes, not one kernel
    assert (d / "cpu.max").read_text() == "150000 100000"
    assert cg.cpu_quota() == (150000, 100000) and cg.memory_limit() == 4 * 2**30
    assert cg.procs_files() == [str(d / "cgroup.procs")]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert cg.oom_kills() == 1


def test_users_behind_the_wall_get_the_upstream_resolvers_where_the_machines_is_on_its_loopback(tmp_path):
    from gpuhub_spawner.local.user_network import resolver_for_users

    stub, upstream, plain = tmp_path / "stub", tmp_path / "upstream", tmp_path / "plain"
    stub.write_text("# systemd-resolved\nnameserver 127.0.0.53\noptions edns0\n")
    upstream.write_text("nameserver 192.0.2.53\nnameserver 2001:db8::53\n")
    plain.write_text("nameserver 10.255.255.53\n")
    assert resolver_for_users(str(stub), str(upstream)) == str(upstream)  # users cannot reach the stub
    assert resolver_for_users(str(plain), str(upstream)) is None  # reachable through the wall as it is
    assert resolver_for_users(str(stub), str(tmp_path / "missing")) is None
    (tmp_path / "loop").write_text("nameserver 127.0.0.1\n")
    assert resolver_for_users(str(stub), str(tmp_path / "loop")) is None  # no better file: leave it
