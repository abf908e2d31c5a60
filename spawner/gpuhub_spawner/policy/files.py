"""Writing a file so that a reader sees the old content or the new, never half, and a crash
(power, OOM kill) leaves one of the two on disk: the one way every part of gpuhub writes its
state (job records, the queue's journal, the culling board, GPU health, policy versions and the
policy file, MLflow's key and accounts). In the lowest layer so every layer may use it.

A temporary file beside the target (same file system, so the rename is atomic), created with
O_EXCL and a random name (``mkstemp``: nobody can plant it or link it elsewhere), mode set on
the descriptor before any byte is written, flushed and fsynced, renamed over the target, then
the directory fsynced so the rename itself survives a crash. On any failure the temporary file
is removed and the target is as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: bytes | str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically and durably, with ``mode``."""
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # the data is in place; only the rename's durability is left to the file system
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is done all the same
    finally:
        os.close(dfd)
