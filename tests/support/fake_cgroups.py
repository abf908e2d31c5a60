"""A directory laid out like cgroupfs v2, for the unit tests of the v2 writer.

cgroup v2 cannot run on the test machine (its memory and cpu controllers are bound to v1
hierarchies), so the writer is checked against the kernel's cgroup-v2.rst names and formats:
a root with its controllers, and every new group populated with the interface files the
kernel would create (the v1 writer runs against the real kernel in the integration tests).
"""

from __future__ import annotations

GROUP_FILES = (
    "cgroup.procs",
    "cgroup.controllers",
    "cgroup.subtree_control",
    "cgroup.kill",
    "memory.max",
    "memory.swap.max",
    "memory.oom.group",
    "memory.events",
    "cpu.max",
    "pids.max",
    "pids.current",
    "pids.events",
)


def fake_v2(root):
    """A ``mkdir`` to patch onto ``type(root)`` (``monkeypatch.setattr(type(tmp_path), "mkdir", fake_v2(tmp_path))``)."""
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("")
    real_mkdir = type(root).mkdir

    def mkdir(self, *a, **k):  # the kernel populates a new group's interface files
        real_mkdir(self, *a, **k)
        for f in GROUP_FILES:
            (self / f).touch()
        (self / "cgroup.controllers").write_text("cpu memory pids\n")

    return mkdir
