"""The queue journal: waiting requests survive a hub restart, planned or ``kill -9``.

Admission state of *running* servers lives in JupyterHub's database (spawner state);
waiting requests live only in the hub's memory. The journal keeps them in the hub's
data directory as an append-only file of JSON lines (``wait`` when a request joins the
queue, ``done`` when it is admitted or leaves), so an event costs one small append, not
a rewrite of the whole queue. A request's ``done`` is written *before* its server is
launched: after a crash nothing that may already run is admitted again.

The file is 0600 in the hub's 0700 data directory. It is compacted (rewritten to a
temporary file, then atomically renamed) on load and whenever dead lines outnumber live
ones. A torn last line (a kill mid-write) is skipped with a warning; nothing else is lost.
A process kill loses nothing (the kernel holds written data); a power loss may lose the
last few seconds, like the hub's own SQLite database in its default mode.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .queue import Ticket
from ..policy.files import write_atomically

log = logging.getLogger("JupyterHub.gpuhub.journal")


class QueueJournal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._live: dict[str, dict] = {}
        self._lines = 0
        self._fd: int | None = None

    # -- reading -----------------------------------------------------------------------
    def load(self) -> list[Ticket]:
        """The waiting requests the file records, oldest first; compacts the file."""
        self._live = {}
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                op, key = entry["op"], entry["key"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s:%d: skipping an unreadable line (torn write?)", self.path, n)
                continue
            if op == "wait":
                self._live[key] = entry
            elif op == "done":
                self._live.pop(key, None)
        self._compact()
        tickets = []
        for e in sorted(self._live.values(), key=lambda e: (e["created"], e.get("seq", 0))):
            try:
                tickets.append(
                    Ticket(
                        key=e["key"],
                        user=e["user"],
                        team=e["team"],
                        profile=e["profile"],
                        demand={str(k): int(v) for k, v in e["demand"].items()},
                        priority=int(e.get("priority", 0)),
                        created=float(e["created"]),
                        user_options=dict(e.get("options") or {}),
                    )
                )
            except (KeyError, TypeError, ValueError, AttributeError):
                log.warning("%s: skipping a malformed entry for %r", self.path, e.get("key"))
        return tickets

    # -- the Journal protocol of the admission queue ---------------------------------------
    def waiting(self, ticket: Ticket) -> None:
        entry = {
            "op": "wait",
            "key": ticket.key,
            "user": ticket.user,
            "team": ticket.team,
            "profile": ticket.profile,
            "demand": ticket.demand,
            "priority": ticket.priority,
            "created": ticket.created,
            "seq": ticket.seq,
            "options": ticket.user_options,
        }
        self._live[ticket.key] = entry
        self._append(entry)

    def removed(self, key: str) -> None:
        if self._live.pop(key, None) is None:
            return
        self._append({"op": "done", "key": key})
        if self._lines > 64 and self._lines > 2 * len(self._live):
            self._compact()

    # -- the file ----------------------------------------------------------------------------
    def _append(self, entry: dict) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(self._fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        self._lines += 1

    def _compact(self) -> None:
        self.close()
        live = sorted(self._live.values(), key=lambda e: (e["created"], e.get("seq", 0)))
        write_atomically(self.path, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in live), 0o600)
        self._lines = len(self._live)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
