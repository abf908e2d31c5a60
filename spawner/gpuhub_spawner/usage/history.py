"""Usage history in the hub's own database: one row per allocation, queue-length samples.

Tables are gpuhub's own (``gpuhub_allocations``, ``gpuhub_queue_samples``) in the
database JupyterHub already uses (``JupyterHub.db_url``: SQLite on one machine,
PostgreSQL/MySQL behind z2jh), through SQLAlchemy — so history is backed up, migrated
and survives restarts with the rest of the hub's state, and no new service is needed.
The tables are created if missing and never touch JupyterHub's own.

An allocation is what the admission queue admitted for one server or job: who, team,
profile, flavor, GPUs, devices, when requested, admitted and released, how it ended
(``stopped``, ``culled``, ``reclaimed``, ``crashed``, ``ended`` for a finished job), and
GPU-seconds held, measured (a trusted utilisation reading existed) and idle.
"""

from __future__ import annotations

import atexit
import csv
import io
import logging
import queue
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine, event, select, update
from sqlalchemy.pool import StaticPool

log = logging.getLogger("JupyterHub.gpuhub.usage")

metadata = MetaData()

allocations = Table(
    "gpuhub_allocations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False, index=True),
    Column("user", String(255), nullable=False, index=True),
    Column("server", String(255), nullable=False, default=""),
    Column("kind", String(16), nullable=False, default="server"),  # server | job
    Column("team", String(255), nullable=False, index=True),
    Column("profile", String(255), nullable=False),
    Column("flavor", String(255), nullable=False, default=""),
    Column("gpus", Integer, nullable=False, default=0),
    Column("devices", String(1024), nullable=False, default=""),
    Column("requested", Float, nullable=False),
    Column("start", Float, nullable=False, index=True),
    Column("end", Float, nullable=True, index=True),
    Column("end_reason", String(32), nullable=True),
    Column("stopped_by", String(255), nullable=True),
    Column("measured_gpu_seconds", Float, nullable=False, default=0.0),
    Column("idle_gpu_seconds", Float, nullable=False, default=0.0),
)

queue_samples = Table(
    "gpuhub_queue_samples",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False, index=True),
    Column("team", String(255), nullable=False),
    Column("waiting", Integer, nullable=False),
)

END_REASONS = ("stopped", "culled", "reclaimed", "crashed", "ended")
# How each allocation of the history ended (usage/history.py END_REASONS), in a person's words:
# the records say "ended" for a job that finished by itself, which read "ended: ended 1".
END_WORDS = {
    "stopped": "stopped",
    "culled": "culled for idleness",
    "reclaimed": "reclaimed by the lending team",
    "crashed": "crashed",
    "ended": "jobs finished",
}


def describe_ends(ends: dict[str, int]) -> str:
    """``{"stopped": 3, "culled": 1}`` -> ``"3 stopped, 1 culled for idleness"``."""
    return ", ".join(f"{n} {END_WORDS.get(k, k)}" for k, n in sorted(ends.items(), key=lambda kv: (-kv[1], kv[0])))


CSV_FIELDS = [
    "user",
    "server",
    "kind",
    "team",
    "profile",
    "flavor",
    "gpus",
    "devices",
    "requested",
    "start",
    "end",
    "end_reason",
    "stopped_by",
    "wait_seconds",
    "gpu_seconds",
    "measured_gpu_seconds",
    "idle_gpu_seconds",
    "busy_gpu_seconds",
]


def engine_for(db_url: str):
    if db_url.startswith("sqlite"):
        if db_url in ("sqlite://", "sqlite:///:memory:"):
            eng = create_engine(db_url, connect_args={"check_same_thread": False}, poolclass=StaticPool)
        else:
            eng = create_engine(db_url, connect_args={"timeout": 30})

        @event.listens_for(eng, "connect")
        def _wal(conn, _record):  # the hub writes the same file; WAL avoids writer stalls
            conn.execute("PRAGMA busy_timeout=30000")

        return eng
    return create_engine(db_url, pool_pre_ping=True)


@dataclass
class Row:
    """One allocation with its derived figures (``end`` None: still held, counted to ``now``)."""

    user: str
    server: str
    kind: str
    team: str
    profile: str
    flavor: str
    gpus: int
    devices: str
    requested: float
    start: float
    end: float | None
    end_reason: str | None
    stopped_by: str | None
    measured_gpu_seconds: float
    idle_gpu_seconds: float

    def held_until(self, now: float) -> float:
        return self.end if self.end is not None else now

    def gpu_seconds(self, now: float, lo: float = 0.0, hi: float = float("inf")) -> float:
        """GPU-seconds held inside [lo, hi)."""
        a, b = max(self.start, lo), min(self.held_until(now), hi)
        return max(0.0, b - a) * self.gpus

    @property
    def wait_seconds(self) -> float:
        return max(0.0, self.start - self.requested)

    def as_dict(self, now: float) -> dict:
        d = {k: getattr(self, k) for k in CSV_FIELDS if hasattr(self, k) and not callable(getattr(self, k))}
        held = self.gpu_seconds(now)
        d.update(
            wait_seconds=round(self.wait_seconds, 3),
            gpu_seconds=round(held, 3),
            measured_gpu_seconds=round(self.measured_gpu_seconds, 3),
            idle_gpu_seconds=round(self.idle_gpu_seconds, 3),
            busy_gpu_seconds=round(max(0.0, self.measured_gpu_seconds - self.idle_gpu_seconds), 3),
        )
        return d


class History:
    """Writes and reads gpuhub's usage tables.

    Writes go to one background thread, in order, so the hub's event loop never waits on
    the database's disk (a storm of queue events would otherwise queue behind fsyncs);
    reads first wait for the writes queued before them. Pending writes are finished when
    the hub exits (the thread is joined at interpreter exit).
    """

    def __init__(self, db_url: str):
        self.engine = engine_for(db_url)
        metadata.create_all(self.engine)
        self._last_waiting: dict[str, int] = {}
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gpuhub-history", daemon=True)
        self._thread.start()
        atexit.register(self.flush)  # the hub exiting finishes what it queued

    def _write(self, fn, *args) -> None:
        self._ops.put((fn, args))

    def _run(self) -> None:
        """Apply queued writes in order, as many as are waiting in one transaction."""
        while True:
            batch = [self._ops.get()]
            while len(batch) < 500:
                try:
                    batch.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            writes = [op for op in batch if not isinstance(op, threading.Event)]
            try:
                if writes:
                    with self.engine.begin() as conn:
                        for fn, args in writes:
                            fn(conn, *args)
            except Exception:  # one bad write must not lose the others: apply them one by one
                for fn, args in writes:
                    try:
                        with self.engine.begin() as conn:
                            fn(conn, *args)
                    except Exception:  # history must never take the hub down; the audit trail has it
                        log.exception("usage history write failed: %s", fn.__name__)
            for op in batch:
                if isinstance(op, threading.Event):
                    op.set()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every write queued so far is in the database."""
        done = threading.Event()
        self._ops.put(done)
        done.wait(timeout)

    # -- writes --------------------------------------------------------------------------

    def open(
        self,
        *,
        key: str,
        user: str,
        team: str,
        profile: str,
        flavor: str,
        gpus: int,
        devices: list[str],
        requested: float,
        start: float,
    ) -> None:
        kind = "job" if key.startswith("job:") else "server"
        server = "" if kind == "job" else key.partition("/")[2]
        self._write(self._open, key, user, server, kind, team, profile, flavor, gpus, devices, requested, start)

    def _open(self, conn, key, user, server, kind, team, profile, flavor, gpus, devices, requested, start) -> None:
        # A row still open for this key belongs to an allocation whose release was
        # never seen (hub killed): it ended no later than this new start.
        conn.execute(
            update(allocations)
            .where(allocations.c.key == key, allocations.c.end.is_(None))
            .values(end=start, end_reason="crashed")
        )
        conn.execute(
            allocations.insert().values(
                key=key,
                user=user,
                server=server,
                kind=kind,
                team=team,
                profile=profile,
                flavor=flavor,
                gpus=gpus,
                devices=",".join(devices),
                requested=requested,
                start=start,
            )
        )

    def close(self, key: str, end: float, reason: str, stopped_by: str | None = None) -> None:
        self._write(self._close, key, end, reason, stopped_by)

    def _close(self, conn, key, end, reason, stopped_by) -> None:
        values = {"end": end, "end_reason": reason}
        if stopped_by is not None:  # else keep whom a stop request already named (set_stopped_by)
            values["stopped_by"] = stopped_by
        conn.execute(update(allocations).where(allocations.c.key == key, allocations.c.end.is_(None)).values(**values))

    def set_stopped_by(self, key: str, by: str, within: float = 120.0) -> None:
        """Name who stopped ``key`` (known only when the request that stopped it finishes).

        The request may finish before the stop does: JupyterHub answers 202 when a server takes
        longer than its ``slow_stop_timeout`` (10 s) to stop, which a loaded machine gives. Then
        the allocation is still open and is named now; its close keeps the name."""
        self._write(self._set_stopped_by, key, by, within, time.time())

    def _set_stopped_by(self, conn, key, by, within, now) -> None:
        unnamed = (allocations.c.key == key, allocations.c.stopped_by.is_(None))
        row = conn.execute(
            select(allocations.c.id).where(*unnamed, allocations.c.end.is_(None)).order_by(allocations.c.start.desc()).limit(1)
        ).first()
        if row is None:
            row = conn.execute(
                select(allocations.c.id)
                .where(*unnamed, allocations.c.end >= now - within)
                .order_by(allocations.c.end.desc())
                .limit(1)
            ).first()
        if row:
            conn.execute(update(allocations).where(allocations.c.id == row[0]).values(stopped_by=by))

    def add_gpu_time(self, measured: dict[str, tuple[float, float]]) -> None:
        """Per open key: (GPU-seconds with a trusted reading, of which idle)."""
        if measured:
            self._write(self._add_gpu_time, dict(measured))

    def _add_gpu_time(self, conn, measured) -> None:
        for key, (known, idle) in measured.items():
            conn.execute(
                update(allocations)
                .where(allocations.c.key == key, allocations.c.end.is_(None))
                .values(
                    measured_gpu_seconds=allocations.c.measured_gpu_seconds + known,
                    idle_gpu_seconds=allocations.c.idle_gpu_seconds + idle,
                )
            )

    def sample_queue(self, waiting: dict[str, int], at: float | None = None) -> None:
        """Record the queue lengths of ``waiting``'s teams that changed since their last sample."""
        at = time.time() if at is None else at
        changed = {t: n for t, n in waiting.items() if self._last_waiting.get(t, 0) != n}
        if not changed:
            return
        self._last_waiting.update(changed)
        self._write(self._sample, [{"at": at, "team": t, "waiting": n} for t, n in changed.items()])

    def _sample(self, conn, rows) -> None:
        conn.execute(queue_samples.insert(), rows)

    def open_keys(self) -> list[str]:
        self.flush()
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(select(allocations.c.key).where(allocations.c.end.is_(None)))]

    # -- reads ---------------------------------------------------------------------------

    def rows(self, since: float, until: float | None = None, teams: set[str] | None = None, user: str | None = None) -> list[Row]:
        """Allocations overlapping [since, until), oldest first."""
        q = select(allocations).where((allocations.c.end.is_(None)) | (allocations.c.end >= since))
        if until is not None:
            q = q.where(allocations.c.start < until)
        if teams is not None:
            q = q.where(allocations.c.team.in_(sorted(teams)))
        if user is not None:
            q = q.where(allocations.c.user == user)
        self.flush()
        with self.engine.connect() as conn:
            out = []
            for r in conn.execute(q.order_by(allocations.c.start, allocations.c.id)):
                m = r._mapping
                out.append(Row(**{k: m[k] for k in Row.__dataclass_fields__}))
            return out

    def queue_series(self, since: float, teams: set[str] | None = None) -> list[tuple[float, str, int]]:
        q = select(queue_samples.c.at, queue_samples.c.team, queue_samples.c.waiting).where(queue_samples.c.at >= since)
        if teams is not None:
            q = q.where(queue_samples.c.team.in_(sorted(teams)))
        self.flush()
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(q.order_by(queue_samples.c.at, queue_samples.c.id))]


# -- summaries (pure functions of rows: the page, the API, the CSV and the CLI share them) -----
def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bucket_start(t: float, period: str) -> float:
    """Start of the UTC day or ISO week (Monday) containing ``t``."""
    day = t - (t % 86400)
    if period == "week":
        weekday = time.gmtime(day).tm_wday
        return day - weekday * 86400
    return day


def summarize(rows: list[Row], since: float, now: float, by: str = "team", period: str = "day") -> dict:
    """GPU-hours allocated/busy/idle per ``by`` (team|user) per period, waits, end reasons."""
    if by not in ("team", "user"):
        raise ValueError("by must be 'team' or 'user'")
    if period not in ("day", "week"):
        raise ValueError("period must be 'day' or 'week'")
    step = 86400 if period == "day" else 7 * 86400
    totals: dict[str, dict] = {}
    buckets: dict[tuple[str, float], float] = {}
    waits: list[float] = []
    ends: dict[str, int] = {}
    for r in rows:
        name = getattr(r, by)
        held = r.gpu_seconds(now, since)
        t = totals.setdefault(
            name,
            {
                "gpu_hours": 0.0,
                "measured_gpu_hours": 0.0,
                "idle_gpu_hours": 0.0,
                "busy_gpu_hours": 0.0,
                "allocations": 0,
                "culls": 0,
            },
        )
        t["gpu_hours"] += held / 3600
        # Readings accrue over the whole allocation; pro-rate to the window.
        whole = r.gpu_seconds(now)
        share = held / whole if whole else 0.0
        t["measured_gpu_hours"] += r.measured_gpu_seconds * share / 3600
        t["idle_gpu_hours"] += r.idle_gpu_seconds * share / 3600
        t["busy_gpu_hours"] += max(0.0, r.measured_gpu_seconds - r.idle_gpu_seconds) * share / 3600
        if r.start >= since:
            t["allocations"] += 1
            waits.append(r.wait_seconds)
        if r.end_reason and r.end is not None and r.end >= since:
            ends[r.end_reason] = ends.get(r.end_reason, 0) + 1
            if r.end_reason == "culled":
                t["culls"] += 1
        b = bucket_start(max(since, r.start), period)  # only the periods this allocation overlaps
        last = min(now, r.held_until(now))
        while b < last:
            v = r.gpu_seconds(now, max(b, since), b + step)
            if v:
                buckets[(name, b)] = buckets.get((name, b), 0.0) + v / 3600
            b += step
    for t in totals.values():
        for k in ("gpu_hours", "measured_gpu_hours", "idle_gpu_hours", "busy_gpu_hours"):
            t[k] = round(t[k], 4)
    periods = sorted({b for _, b in buckets})
    return {
        "since": since,
        "until": now,
        "by": by,
        "period": period,
        "totals": dict(sorted(totals.items())),
        "periods": [
            {
                "start": b,
                "date": time.strftime("%Y-%m-%d", time.gmtime(b)),
                "gpu_hours": {n: round(v, 4) for (n, bb), v in sorted(buckets.items()) if bb == b},
            }
            for b in periods
        ],
        "waits": {"count": len(waits), "median_seconds": _percentile(waits, 0.5), "p95_seconds": _percentile(waits, 0.95)},
        "ended": ends,
    }


def when(t: float) -> str:
    """A time as a person reads it on a page, to the second (UTC, said in the heading)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(round(t % 1 * 1000)) % 1000:03d}Z"


# A spreadsheet reads a cell that begins with one of these as a formula (or, for tab and
# CR, after stripping them): =HYPERLINK(...), +cmd|..., -2+3, @SUM(...). Full-width forms
# count too (some spreadsheets normalise them). OWASP's advice: prefix such a text cell
# with a single quote, which spreadsheets show as text and do not evaluate.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")
CSV_LINE_END = "\r\n"  # RFC 4180; see to_csv


def csv_cell(value):
    """``value`` safe for a CSV cell opened in a spreadsheet: text that a spreadsheet
    would take for a formula gets a leading ``'``; numbers are left as they are (a
    negative number is a number, not text a user chose)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def to_csv(rows: list[Row], now: float) -> str:
    """One line per allocation. Every text cell (user, server, team, profile, flavor,
    devices, end reason, who stopped it: names from users, admins and the IdP) goes
    through ``csv_cell``. Lines end in CRLF (RFC 4180): the writer then quotes any cell
    holding a CR or LF, which with a bare LF terminator it leaves a CR unquoted, and a
    reader would start a new row there."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator=CSV_LINE_END)
    w.writeheader()
    for r in rows:
        d = r.as_dict(now)
        for k in ("requested", "start", "end"):
            if d.get(k) is not None:
                d[k] = iso(d[k])
        w.writerow({k: ("" if d.get(k) is None else csv_cell(d[k])) for k in CSV_FIELDS})
    return buf.getvalue()
