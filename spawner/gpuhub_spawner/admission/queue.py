"""The admission queue: priority first, FIFO within a priority, admitted on events.

Runs inside the hub's event loop; every mutation ends in ``schedule()``, which admits
whatever now fits and refreshes the plain-words status of the waiting tickets the event
touched. There is no polling: a stop, a cancel, a new request or a policy reload is the
trigger. Ordering follows Kueue's scheduler: requests that fit within their team's
nominal quota go before requests that must borrow, then higher priority, then earlier
arrival. With ``fairShare`` on (admission/fairshare.py, docs/fair-share.md), requests of
equal priority go by fair share instead of arrival: a borrower by the share of idle
capacity its team would hold per unit of weight (Kueue's Fair Sharing), then by its team's
decayed usage per unit of weight; inside a team (``fairShare.users``) the user with less
recent use first. Arrival breaks the remaining ties.

Cost per event (a storm can leave thousands waiting): each team keeps its own sorted
queue, usage is kept incrementally, a pass tries each waiting team once per distinct
request shape, and only the teams whose state the event can change (the cohort of the
teams admitted or released, and teams blocked on the devices that moved) get new
statuses. So an event costs O(waiting in the touched teams), not O(all waiting).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from prometheus_client import Gauge, Histogram

from ..policy.model import Policy, Team
from .fairshare import FairOrder, UsageLedger, gpu_time
from .quota import Demand, add_usage, check_fit
from .reclaim import borrowing

log = logging.getLogger("JupyterHub.gpuhub.admission")

QUEUE_WAITING = Gauge("gpuhub_queue_waiting", "Servers waiting for admission", ["team"])
RESOURCE_IN_USE = Gauge("gpuhub_admitted_resources", "Admitted resources per team", ["team", "resource"])
ADMISSION_WAIT = Histogram(
    "gpuhub_admission_wait_seconds",
    "Time from request to admission",
    buckets=(0.1, 1, 5, 30, 60, 300, 900, 1800, 3600, 7200, float("inf")),
)


class Allocator(Protocol):
    """Hands out concrete devices once quota admits a request (one-machine backend)."""

    def allocate(self, key: str, demand: Demand) -> list[str] | None: ...
    def free(self, key: str) -> None: ...
    def restore(self, key: str, devices: list[str]) -> None: ...
    def shortage(self, demand: Demand) -> str | None: ...
    def never_fits(self, demand: Demand) -> str | None: ...


class Journal(Protocol):
    """Keeps waiting requests across hub restarts (``admission.journal.QueueJournal``)."""

    def waiting(self, ticket: "Ticket") -> None: ...
    def removed(self, key: str) -> None: ...


def may_borrow(policy: Policy, team, ticket: "Ticket") -> bool:
    """Jobs always may; a team's servers unless its ``reclaim.interactiveBorrowing`` is false."""
    return ticket.key.startswith("job:") or bool(policy.reclaim_rules(team).interactive_borrowing)


def _shape(ticket: "Ticket") -> tuple:
    # Kept on the ticket while its demand is the same dict: a pass asks per waiting ticket.
    demand = ticket.demand
    hit = ticket.__dict__.get("_shape")
    if hit is None or hit[0] is not demand:
        hit = ticket.__dict__["_shape"] = (demand, (ticket.key.startswith("job:"), tuple(sorted(demand.items()))))
    return hit[1]


class QueueRefused(Exception):
    """The request can never be admitted (more than the team or machine can ever hold)."""


@dataclass
class WaitStatus:
    position: int  # 1-based, in the team's queue
    waiting_in_team: int
    reason: str
    team: str
    in_use: dict[str, int]  # the team's admitted amount per requested resource
    message: str = ""
    fair: str = ""  # fair share's words for this place ("" when fair share is off or decides nothing)


@dataclass
class Admission:
    key: str
    user: str
    team: str
    profile: str
    demand: Demand
    devices: list[str]
    since: float = field(default_factory=time.time)
    priority: int = 0  # reclaim order (admission/reclaim.py): lowest priority goes first
    # GPUs per ``gpu/<flavor>`` key its team held above its nominal quota once this was
    # admitted: borrowed from the cohort, so it may be reclaimed (said at admission).
    borrowed: dict[str, int] = field(default_factory=dict)


_seq = itertools.count()


@dataclass(eq=False)
class Ticket:
    key: str  # "user/server-name": one request per server
    user: str
    team: str
    profile: str
    demand: Demand
    priority: int = 0
    created: float = field(default_factory=time.time)
    seq: int = field(default_factory=lambda: next(_seq))
    status: WaitStatus | None = None
    admission: Admission | None = None
    version: int = 0
    user_options: dict = field(default_factory=dict)  # to re-spawn it after a restart
    restored: bool = False  # re-queued from the journal, its spawner not yet back

    def __post_init__(self):
        self._future: asyncio.Future | None = None
        self._cancelled = False
        self._changed = asyncio.Event()

    @property
    def future(self) -> asyncio.Future:
        """Resolves to the ``Admission``; cancelled when the request leaves the queue."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self._cancelled:
                self._future.cancel()
            elif self.admission is not None:
                self._future.set_result(self.admission)
        return self._future

    @property
    def done(self) -> bool:
        return self.admission is not None or self._cancelled

    def sort_key(self) -> tuple:
        return (-self.priority, self.created, self.seq)

    def _cancel(self) -> None:
        self._cancelled = True
        if self._future is not None and not self._future.done():
            self._future.cancel()
        self._notify()

    def _admit(self, adm: Admission) -> None:
        self.admission = adm
        if self._future is not None and not self._future.done():
            self._future.set_result(adm)
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, since_version: int, timeout: float | None = None) -> None:
        """Wait until the status moves past ``since_version`` (or ``timeout``).

        Readers capture ``version`` *before* they act on the status (and before any
        ``yield``), so a change that lands meanwhile returns at once instead of being
        missed until the next change.
        """
        if self.version != since_version:
            return
        event = self._changed
        try:
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's loses a cancel that finds it done
                await event.wait()
        except TimeoutError:
            pass


class AdmissionQueue:
    def __init__(
        self,
        policy: Callable[[], Policy],
        allocator: Allocator | None = None,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self._policy = policy
        self.clock = clock
        # Decayed GPU usage per team and user (kept whether fair share is on or not: O(1) per event).
        self.fair = UsageLedger(clock)
        self.allocator = allocator
        self.journal = journal
        self._teams: dict[str, list[Ticket]] = {}  # team -> waiting, in (priority, arrival) order
        self._keys: dict[str, Ticket] = {}  # key -> waiting ticket
        self._restored: dict[str, Ticket] = {}  # key -> journal ticket whose spawner is not back yet
        self.admitted: dict[str, Admission] = {}
        self._usage: dict[str, dict[str, int]] = {}
        # flavor key -> teams with a request that fits its quota, so waits on (or for) free devices
        self._device_blocked: dict[str, set[str]] = {}
        self.on_admit: list[Callable[[Admission], None]] = []
        # Usage history and audit (usage/recorder.py) listen to the other events too.
        self.on_submit: list[Callable[[Ticket], None]] = []
        self.on_queued: list[Callable[[Ticket], None]] = []  # submitted and not admitted at once
        self.on_refuse: list[Callable[[Ticket, str], None]] = []
        self.on_cancel: list[Callable[[Ticket], None]] = []
        self.on_release: list[Callable[[Admission], None]] = []
        self._published: dict[str, set[str]] = {}  # team -> resource keys with a gauge value
        # Waiting key -> what it really waits for, when the reclaimer knows better than the
        # quota arithmetic ("NLP Group's GPU is on loan; it is being reclaimed ...").
        self.notes: dict[str, str] = {}
        # While set, nothing is admitted (statuses still update): after a restart the
        # requests that waited before must be back in the queue before anything jumps it.
        self.held = False
        self._configured: Policy | None = None
        self._kept: tuple[dict, dict] = ({}, {})  # fair share's kept capacity at the last pass (for the words)

    # -- state -----------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Ticket]:
        """Every waiting ticket (for pages; O(n))."""
        return [t for q in self._teams.values() for t in q]

    def waiting_in(self, team: str) -> int:
        return len(self._teams.get(team, ()))

    def usage(self) -> dict[str, dict[str, int]]:
        return {team: dict(keys) for team, keys in self._usage.items()}

    def ticket(self, key: str) -> Ticket | None:
        return self._keys.get(key)

    # -- events ----------------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> Ticket:
        """Queue a request (and admit it at once if it fits); refuse what can never fit."""
        if ticket.key in self.admitted or ticket.key in self._keys:
            raise QueueRefused(f"server {ticket.key} already holds or waits for resources")
        policy = self._policy()
        team = policy.team(ticket.team)
        fit = check_fit(policy, {}, team, ticket.demand, may_borrow(policy, team, ticket))
        never = fit.never or (self.allocator.never_fits(ticket.demand) if self.allocator else None)
        if never:
            self._notify(self.on_refuse, ticket, never)
            raise QueueRefused(never)
        self._insert(ticket)
        if self.journal is not None:
            self.journal.waiting(ticket)
        self._notify(self.on_submit, ticket)
        self.schedule({ticket.team})
        if not ticket.done:
            self._notify(self.on_queued, ticket)
        return ticket

    @staticmethod
    def _notify(hooks, *args) -> None:
        for hook in hooks:
            try:
                hook(*args)
            except Exception:  # a listener (history, audit) must never break admission
                log.exception("queue listener failed")

    def restore_waiting(self, tickets: Iterable[Ticket]) -> list[Ticket]:
        """Re-queue requests that waited before a hub restart, in their original order.

        Their spawners come back through JupyterHub (see ``local.requeue``) and ``adopt``
        them; until then a restored ticket holds its place (and, if admitted, its devices).
        """
        self.held = False
        back = []
        for ticket in tickets:
            if ticket.key in self.admitted or ticket.key in self._keys:
                log.warning("Not restoring %s: it already holds or waits for resources", ticket.key)
                continue
            ticket.restored = True
            self._insert(ticket)
            self._restored[ticket.key] = ticket
            back.append(ticket)
        if back:
            log.info("Restored %d waiting request(s) from before the restart", len(back))
        self.schedule()  # a full pass, once: whatever arrived while the queue was held goes too
        return back

    def adopt(self, key: str) -> Ticket | None:
        """The restored ticket for ``key`` (waiting or already admitted), handed to its spawner once."""
        ticket = self._restored.pop(key, None)
        if ticket is not None:
            ticket.restored = False
        return ticket

    def drop_restored(self, key: str) -> None:
        """A restored request whose spawner will not come back: free its place or its devices."""
        if self._restored.pop(key, None) is None:
            return
        if not self.cancel(key):
            self.release(key)

    def cancel(self, key: str, forget: bool = True) -> bool:
        """Take ``key`` out of the queue; ``forget=False`` keeps its journal entry (hub shutdown)."""
        ticket = self._keys.pop(key, None)
        if ticket is None:
            return False
        queue = self._teams[ticket.team]
        del queue[self._index(queue, ticket)]
        if not queue:
            del self._teams[ticket.team]
        ticket._cancel()
        if forget and self.journal is not None:
            self.journal.removed(key)
        log.info("Request %s left the queue", key)
        self.schedule({ticket.team})
        self._notify(self.on_cancel, ticket)
        return True

    def forget(self, key: str) -> None:
        """Drop ``key``'s journal entry unless it still waits: its request is over for good
        (withdrawn while it waited, after ``cancel(key, forget=False)`` kept it in case the
        cancellation was the hub shutting down), so no restart may bring it back.

        Not while the queue is held after a restart: JupyterHub then stops every server that
        was only pending ("appears to have stopped while the Hub was down"), which is no
        withdrawal: those requests are coming back (``restore_waiting``), and their entries
        must stay for the restart after this one."""
        if self.held or key in self._keys or key in self._restored or self.journal is None:
            return
        self.journal.removed(key)

    def release(self, key: str) -> Admission | None:
        """Free what ``key`` holds and hand it to whoever waits next."""
        adm = self.admitted.pop(key, None)
        if adm is None:
            return None
        self._restored.pop(key, None)
        free_before = self._free(set(self._device_blocked) | set(adm.demand))
        add_usage(self._usage, adm.team, adm.demand, -1)
        self.fair.release(key)
        if self.allocator:
            self.allocator.free(key)
        log.info("Released %s (%s, team %s): %s", key, adm.profile, adm.team, adm.devices or "no devices")
        self._notify(self.on_release, adm)
        self.schedule({adm.team}, freed=adm.demand, free_before=free_before)
        return adm

    def restore(self, adm: Admission) -> None:
        """Re-register a server found running after a hub restart (no queueing)."""
        if adm.key in self.admitted:
            raise ValueError(f"{adm.key} is already registered")
        if self.allocator:
            self.allocator.restore(adm.key, adm.devices)
        self.admitted[adm.key] = adm
        add_usage(self._usage, adm.team, adm.demand)
        self.fair.admit(adm.key, adm.team, adm.user, adm.demand, self._policy())
        self._update_metrics({adm.team})

    # -- the scheduler ---------------------------------------------------------------------
    @staticmethod
    def _index(queue: list[Ticket], ticket: Ticket) -> int:
        i = bisect.bisect_left(queue, ticket.sort_key(), key=Ticket.sort_key)
        while queue[i] is not ticket:
            i += 1
        return i

    def _insert(self, ticket: Ticket) -> None:
        queue = self._teams.setdefault(ticket.team, [])
        bisect.insort_right(queue, ticket, key=Ticket.sort_key)
        self._keys[ticket.key] = ticket

    def _cohort(self, policy: Policy, teams: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for name in teams:
            team = policy.team_or_none(name)
            out.update(m.name for m in policy.cohort_members(team)) if team else out.add(name)
        return out

    def _candidates(self, policy: Policy, names: Iterable[str]) -> list[tuple[bool, Ticket]]:
        """Per waiting team in ``names``, its first ticket of each request shape, in Kueue's order
        (with fair share: fair-share order among equal priorities)."""
        order = FairOrder(policy, self.fair, self._usage) if policy.fair else None
        by_user = order is not None and order.fs.users
        out = []
        keyed = []
        for name in names:
            queue = self._teams.get(name)
            team = policy.team_or_none(name)
            if team is None or not queue:
                continue
            if by_user and order is not None:
                heads = self._fair_heads(order, team, queue)
            elif team.queueing_strategy == "StrictFIFO":
                heads = queue[:1]
            else:
                seen, heads = set(), []
                for t in queue:
                    shape = _shape(t)
                    if shape not in seen:
                        seen.add(shape)
                        heads.append(t)
            for t in heads:
                borrows = check_fit(policy, self._usage, team, t.demand, may_borrow(policy, team, t)).borrows
                out.append((borrows, t))
                if order is not None:
                    share = order.borrowed_share(team, t.demand) if borrows else 0.0
                    keyed.append(((borrows, -t.priority, share, order.team_ratio(team), t.created, t.seq), (borrows, t)))
        if order is not None:
            keyed.sort(key=lambda e: e[0])
            return [e[1] for e in keyed]
        out.sort(key=lambda e: (e[0], -e[1].priority, e[1].created, e[1].seq))
        return out

    @staticmethod
    def _fair_heads(order: FairOrder, team, queue: list[Ticket]) -> list[Ticket]:
        """With fairness between users: per request shape (StrictFIFO: overall), the ticket of the
        highest priority whose user has the least recent use (then arrival)."""
        strict = team.queueing_strategy == "StrictFIFO"
        best: dict[tuple, tuple] = {}
        for t in queue:
            shape = () if strict else _shape(t)
            key = (-t.priority, order.user_usage(t.team, t.user), t.created, t.seq)
            got = best.get(shape)
            if got is None or key < got[0]:
                best[shape] = (key, t)
        return [t for _k, t in best.values()]

    def _kept_words(self, policy: Policy, team, ticket: Ticket, fit) -> str:
        """Why a request that would fit waits: what it needs is kept for the request of another
        team ahead of it in fair-share order (the last pass's ``_kept``)."""
        quota_kept, devices_kept = self._kept
        for key in (k for k in ticket.demand if k.startswith("gpu/")):
            holder = devices_kept.get(key)
            if holder is None and fit.borrows:
                holder = quota_kept.get((team.cohort, key))
            if holder is not None and holder != team.name:
                other = policy.team_or_none(holder)
                from .quota import describe

                return (
                    f"needs {describe(key, ticket.demand[key], policy)}: what frees is kept for a larger request of "
                    f"{other.label if other else holder}, ahead of yours in fair-share order, until it can start"
                )
        return ""

    def _usable_for(self, demand: Demand) -> bool:
        """Could the machine's usable devices (in service) ever hold ``demand``? Devices are
        kept only for a request they can serve: a drained GPU must not block a flavor."""
        devices = getattr(self.allocator, "devices", None)
        out = getattr(self.allocator, "out_of_service", None)
        if devices is None or out is None:
            return True
        for key, amount in demand.items():
            if key.startswith("gpu/") and amount > 0:
                flavor = key[4:]
                if sum(1 for d in devices if d.flavor == flavor) - len(out(flavor)) < amount:
                    return False
        return True

    def _free(self, keys: Iterable[str]) -> dict[str, int]:
        count = getattr(self.allocator, "free_devices", None)
        return {k: len(count(k[4:])) for k in keys if k.startswith("gpu/")} if count else {}

    def schedule(
        self, touched: Iterable[str] | None = None, freed: Demand | None = None, free_before: dict | None = None
    ) -> list[Admission]:
        """Admit what fits; refresh the statuses of what the event can change (all when None).

        ``touched``: the teams whose request arrived, left or released resources. Only they,
        their cohorts (quota) and the teams waiting on devices that ``freed`` returned can
        be admitted now; everybody else's answer is unchanged.
        """
        policy = self._policy()
        if policy is not self._configured:
            self.fair.configure(policy)
            self._configured = policy
        admitted: list[Admission] = []
        if touched is None:
            names = set(self._teams)
        else:
            names = self._cohort(policy, touched)
            for key in freed or ():
                names |= self._device_blocked.get(key, set())
        if free_before is None:
            free_before = self._free(set(self._device_blocked) | set(freed or ()))
        while not self.held:  # each admission changes usage: re-pick the best candidate
            progress = False
            # Fair share keeps capacity for the request ahead in fair-share order, against the
            # requests of other teams after it: otherwise small requests take every GPU as it
            # frees, and the bigger request of the team with the better share never starts.
            # Quota: what a team waits for from its cohort (its own lent quota, or a share of
            # the pool) is not lent to a later borrower. Devices: what a request fits its quota
            # for but cannot have yet (too few free) goes to no later request of another team.
            quota_kept: dict[tuple[str | None, str], str] = {}  # (cohort, gpu key) -> team
            devices_kept: dict[str, str] = {}  # gpu key -> team
            for borrows, ticket in self._candidates(policy, names):
                team = policy.team(ticket.team)
                gpu_keys = [k for k in ticket.demand if k.startswith("gpu/")]
                if devices_kept and any(devices_kept.get(k, team.name) != team.name for k in gpu_keys):
                    continue
                if borrows and quota_kept and any(quota_kept.get((team.cohort, k), team.name) != team.name for k in gpu_keys):
                    continue
                fit = check_fit(policy, self._usage, team, ticket.demand, may_borrow(policy, team, ticket))
                if not fit.fits:
                    if policy.fair and team.cohort and not any(sh.capped for sh in fit.shortages):
                        for k in gpu_keys:  # the cohort has too little free now: what frees is kept for it
                            quota_kept.setdefault((team.cohort, k), team.name)
                    continue
                devices: list[str] | None = []
                if self.allocator:
                    devices = self.allocator.allocate(ticket.key, ticket.demand)
                    if devices is None:
                        if policy.fair and self._usable_for(ticket.demand):
                            for k in gpu_keys:
                                devices_kept.setdefault(k, team.name)
                        continue
                admitted.append(self._admit(ticket, devices or []))
                progress = True
                break
            if not progress:
                self._kept = (quota_kept, devices_kept)
                break
        teams = None
        if touched is not None:
            teams = self._cohort(policy, set(touched) | {a.team for a in admitted})
            moved = set(freed or ()) | {k for a in admitted for k in a.demand}
            free_after = self._free(moved)
            for key in moved:  # "only N of M free" changed for those waiting on these devices
                if free_after.get(key) != free_before.get(key, -1):
                    teams |= self._device_blocked.get(key, set())
        self._refresh_statuses(policy, teams)
        self._update_metrics(teams)
        return admitted

    def _admit(self, ticket: Ticket, devices: list[str]) -> Admission:
        adm = Admission(
            ticket.key,
            ticket.user,
            ticket.team,
            ticket.profile,
            ticket.demand,
            devices,
            since=self.clock(),
            priority=ticket.priority,
        )
        queue = self._teams[ticket.team]
        del queue[self._index(queue, ticket)]
        if not queue:
            del self._teams[ticket.team]
        del self._keys[ticket.key]
        self.admitted[ticket.key] = adm
        add_usage(self._usage, ticket.team, ticket.demand)
        policy = self._policy()
        self.fair.admit(adm.key, adm.team, adm.user, adm.demand, policy)
        for key, amount in ticket.demand.items():
            if key.startswith("gpu/") and amount > 0:
                over = min(amount, borrowing(policy, self._usage, ticket.team, key))
                if over > 0:
                    adm.borrowed[key] = over
        if self.journal is not None:
            # Before the launch: a restart must never re-admit what may already run.
            self.journal.removed(ticket.key)
        ADMISSION_WAIT.observe(max(0.0, self.clock() - ticket.created))
        log.info("Admitted %s (%s, team %s) devices=%s", ticket.key, ticket.profile, ticket.team, adm.devices)
        ticket._admit(adm)
        for hook in self.on_admit:
            hook(adm)
        return adm

    def _refresh_statuses(self, policy: Policy, teams: set[str] | None) -> None:
        names = list(self._teams) if teams is None else [n for n in teams if n in self._teams]
        if teams is None:
            self._device_blocked = {}
        for name in names:
            for blocked in self._device_blocked.values():
                blocked.discard(name)
        order = FairOrder(policy, self.fair, self._usage) if policy.fair else None
        groups: dict = {}
        for name in names:
            self._refresh_team(policy, name, self._teams[name], order, groups)

    def _rivals(self, policy: Policy, order: FairOrder, team, groups: dict) -> list:
        """The waiting teams ``team`` competes with (its cohort; without one, the other teams
        without one: they share the machine's devices), in fair-share order (once per refresh)."""
        group = team.cohort or ""
        ranked = groups.get(group)
        if ranked is None:
            if team.cohort:
                members = [m for m in policy.cohort_members(team) if m.name in self._teams]
            else:
                members = [t for n in self._teams if (t := policy.team_or_none(n)) is not None and not t.cohort]
            ranked = groups[group] = sorted(members, key=lambda m: (order.team_ratio(m), m.name))
        return ranked

    def fair_words(self, policy: Policy, order: FairOrder, team, groups: dict | None = None) -> str:
        """Plain words for where fair share puts ``team`` among the teams waiting beside it
        ("" when none waits beside it: then fair share decides nothing for it)."""
        ranked = self._rivals(policy, order, team, {} if groups is None else groups)
        if len(ranked) < 2 or not any(t is team for t in ranked):  # identity: pydantic's == compares fields
            return ""
        from ..policy.quantities import format_duration

        def used(t) -> str:
            return gpu_time(self.fair.team(t.name, order.now))

        mine = order.team_ratio(team)
        ahead: list[Team] = []  # ranked is in fair-share order: those ahead are its first ones (O(1), not O(teams))
        for t in ranked:
            if len(ahead) == 3 or order.team_ratio(t) >= mine:
                break
            if t is not team:
                ahead.append(t)
        text = (
            f"Fair share: {team.label} used {used(team)} lately (usage halves every "
            f"{format_duration(order.fs.half_life)}) against a share of {policy.share_of(team) * 100:.0f}%"
        )
        if not ahead:
            return text + "; no team waiting beside it used less for its share, so its requests go first among equal priorities"
        others = [f"{t.label} {used(t)} against {policy.share_of(t) * 100:.0f}%" for t in ahead]
        names = " and ".join(t.label for t in ahead)
        verb = "goes" if len(ahead) == 1 else "go"
        return text + ", " + ", ".join(others) + f": {names} {verb} first"

    def _refresh_team(
        self, policy: Policy, team_name: str, queue: list[Ticket], order: FairOrder | None = None, groups: dict | None = None
    ) -> None:
        team = policy.team_or_none(team_name)
        label = team.label if team else team_name
        fits: dict[tuple, object] = {}
        by_user = order is not None and order.fs.users

        def fit_of(ticket):
            shape = _shape(ticket)
            if shape not in fits:
                fits[shape] = check_fit(policy, self._usage, team, ticket.demand, may_borrow(policy, team, ticket))
            return shape, fits[shape]

        # Kueue's order inside the team: within-nominal requests before borrowers (with
        # fairness between users: then the user with less recent use first).
        if team is not None and by_user and order is not None:
            fair_order = order  # (narrowed for the key below)
            queue = sorted(
                queue, key=lambda t: (fit_of(t)[1].borrows, -t.priority, fair_order.user_usage(t.team, t.user), t.created, t.seq)
            )
        elif team is not None:
            queue = sorted(queue, key=lambda t: fit_of(t)[1].borrows)
        fair = self.fair_words(policy, order, team, groups) if order is not None and team is not None else ""
        used = self._usage.get(team_name, {})
        cache: dict[tuple, tuple[str, list[str]]] = {}
        for pos, ticket in enumerate(queue, 1):
            shape = _shape(ticket)
            if shape not in cache:
                watch: list[str] = []  # the answer depends on how many of these devices are free
                if team is None:
                    reason = f"team {team_name!r} is no longer in the policy"
                else:
                    fit = fit_of(ticket)[1]
                    reason = "; ".join(s.reason for s in fit.shortages) if not fit.fits else ""
                    if fit.fits and self.allocator:
                        watch = [k for k in ticket.demand if k.startswith("gpu/")]
                        reason = self.allocator.shortage(ticket.demand) or ""
                    if not reason or (not fit.fits and fit.borrows):
                        reason = self._kept_words(policy, team, ticket, fit) or reason
                cache[shape] = (reason, watch)
            reason, watch = cache[shape]
            reason = self.notes.get(ticket.key) or reason
            for key in watch:
                self._device_blocked.setdefault(key, set()).add(team_name)
            if not reason:
                reason = "requests ahead of yours in your team's queue go first" if pos > 1 else "waiting for the scheduler"
            in_use = {k: used.get(k, 0) for k in ticket.demand}
            message = (
                f"Waiting in the queue: position {pos} of {len(queue)} in {label}'s queue. "
                f"This server {reason[0].lower() + reason[1:] if reason else ''}."
            )
            if fair:
                message += f" {fair}."
            if by_user and order is not None and len(queue) > 1:
                message += (
                    f" Within {label}, you used {gpu_time(order.user_usage(team_name, ticket.user))} lately; "
                    "teammates who used less go first."
                )
            status = WaitStatus(pos, len(queue), reason, team_name, in_use, message, fair)
            if status != ticket.status:
                ticket.status = status
                ticket._notify()

    def _update_metrics(self, teams: set[str] | None = None) -> None:
        names = (set(self._teams) | set(self._usage)) if teams is None else teams
        for team in names:
            QUEUE_WAITING.labels(team=team).set(len(self._teams.get(team, ())))
            used = self._usage.get(team, {})
            # Keys a team no longer uses are dropped from _usage: publish them as 0, not stale.
            for key in self._published.get(team, set()) | set(used):
                RESOURCE_IN_USE.labels(team=team, resource=key).set(used.get(key, 0))
            self._published.setdefault(team, set()).update(used)

    def refresh(self, teams: Iterable[str]) -> None:
        """Recompute the waiting messages of ``teams`` (after ``notes`` changed)."""
        self._refresh_statuses(self._policy(), set(teams))

    # -- read-only view for pages -----------------------------------------------------------
    def holdings(self) -> Iterable[Admission]:
        return list(self.admitted.values())
