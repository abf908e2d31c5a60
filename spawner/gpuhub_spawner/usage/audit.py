"""The audit trail: one JSON object per line, appended, never rewritten.

Every decision and action gpuhub takes or sees (requests, queueing, admissions with
devices, refusals and why, starts, stops and by whom, cull warnings, snoozes, culls,
reclaims, policy reloads with who and the diff, role changes, an admin acting on
someone else's server) is written here as it happens. The file lives in the hub's data
directory, is created 0600 and opened ``O_APPEND`` so writers only ever add lines.

Nothing secret goes in: entries carry names, teams, profiles, devices, reasons and
policy diffs — never tokens, passwords, cookies or environment values. ``record()``
drops any field whose name looks like a secret, as a guard against future callers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

log = logging.getLogger("JupyterHub.gpuhub.audit")

_SECRET_FIELD = re.compile(r"token|password|secret|cookie|authorization|env", re.I)


class AuditLog:
    """Append-only JSON-lines file; ``path=None`` keeps entries in memory (tests, CLI)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._seq = 0
        self._memory: list[dict] = []
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Kept open for the hub's lifetime (an open per entry costs more than the write);
            # O_APPEND: every write lands at the end, whatever else has the file open.
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(self._fd, 0o600)
            self._seq = sum(1 for _ in self._lines())

    def record(self, event: str, **fields) -> dict:
        """Append one entry (``at``: wall clock; ``seq``: order within this file)."""
        entry = {"seq": 0, "at": round(time.time(), 3), "event": event}
        for k, v in fields.items():
            if v is None or _SECRET_FIELD.search(k):
                continue
            entry[k] = v
        with self._lock:
            self._seq += 1
            entry["seq"] = self._seq
            line = json.dumps(entry, default=str)
            if self.path is None:
                self._memory.append(entry)
            else:
                assert self._fd is not None  # opened with the path, in __init__
                os.write(self._fd, (line + "\n").encode())
        log.debug("audit %s", line)
        return entry

    def _lines(self):
        if self.path is None or not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    yield line

    def entries(self, since: float = 0.0, event: str | None = None, user: str | None = None, limit: int = 1000) -> list[dict]:
        """The newest ``limit`` entries at or after ``since`` (oldest first), optionally filtered."""
        source = self._memory if self.path is None else (json.loads(line) for line in self._lines())
        out = []
        for e in source:
            if e.get("at", 0) < since or (event and e.get("event") != event):
                continue
            if user and user not in (e.get("user"), e.get("by"), e.get("target_user")):
                continue
            out.append(e)
        return out[-limit:] if limit else out
