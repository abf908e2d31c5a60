"""One way to write state (policy/files.py): a reader sees the old file or the new one, the mode
is what the caller asked from the first byte, and a failed write leaves the old file and no
temporary file behind."""

from __future__ import annotations

import os
import stat

import pytest

from gpuhub_spawner.policy.files import write_atomically


def test_the_new_content_replaces_the_old_with_the_asked_mode_and_nothing_left_beside(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    write_atomically(target, '{"new": 1}', 0o600)
    assert target.read_text() == '{"new": 1}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_atomically(target, b"\x00bytes", 0o640)
    assert target.read_bytes() == b"\x00bytes" and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    target = tmp_path / "record.json"
    target.write_text("kept")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, "lost", 0o600)
    assert target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_planted_link_at_a_predictable_name_is_never_followed(tmp_path):
    """The temporary file's name is random and created exclusively: a link another account
    planted beside the target (the old ``<name>.tmp`` scheme) is left alone."""
    target, elsewhere = tmp_path / "key", tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    (tmp_path / "key.tmp").symlink_to(elsewhere)
    (tmp_path / ".key.tmp").symlink_to(elsewhere)
    write_atomically(target, "secret", 0o600)
    assert target.read_text() == "secret" and not target.is_symlink()
    assert elsewhere.read_text() == "untouched"
