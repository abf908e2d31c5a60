"""The one-machine spawner: admission in the hub, devices by CUDA_VISIBLE_DEVICES.

``start()`` validates the choice against the live policy, queues the request, waits
(with the policy's queue timeout, separate from the launch timeout) until the
admission queue hands it devices, then launches the local process with exactly those
devices visible. Devices return to the queue the moment the process exits — stop,
cull or crash — watched with a pidfd rather than a poll.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

from jupyterhub.spawner import SimpleLocalProcessSpawner
from tornado import web

from ..admission.queue import Admission, QueueRefused, Ticket
from ..admission.quota import check_fit, demand_for, describe
from ..policy.access import ChoiceError, resolve_choice
from ..policy.quantities import format_duration
from ..policy_spawner import PolicySpawnerMixin
from ..culling.board import tell_open_lab
from ..usage import recorder as usage
from .broker import LocalBroker
from .devices import cuda_refusal
from .isolation import IsolatedProcessSpawner
from .runtime import one_machine_runtime


PROGRESS_REFRESH = 15  # seconds between spawn-page messages while nothing changes (the time waited moves)


class QueuedGpuMixin(PolicySpawnerMixin):
    """Admission and device hand-out; mixed into a local process spawner."""

    _ticket: Ticket | None = None
    _admission: Admission | None = None
    _exit_fd: int | None = None
    _ending: asyncio.Future | None = None  # the exit watcher's ending (sweep, then release) under way

    if TYPE_CHECKING:
        # More of what jupyterhub.spawner.Spawner gives (besides PolicySpawnerMixin's list).
        _spawn_pending: bool
        _stop_pending: bool

        async def poll_and_notify(self) -> int | None: ...

    @property
    def broker(self) -> LocalBroker:
        return LocalBroker.instance(config=self.config)

    @property
    def server_key(self) -> str:
        return f"{self.user.name}/{self.name}"

    @property
    def devices(self) -> list[str]:
        return list(self._admission.devices) if self._admission else []

    # -- timeouts: JupyterHub wraps all of start() in start_timeout ---------------------
    def run_pre_spawn_hook(self):
        defaults = self.broker.policy.defaults
        self.start_timeout = int(defaults.queue_timeout + defaults.launch_timeout)
        return super().run_pre_spawn_hook()

    # -- the form shows what is free ----------------------------------------------------
    def profile_status_hook(self, team, profile) -> str:
        if not profile.gpu_count:
            return ""
        policy = self.broker.policy
        flavor = profile.gpu.flavor
        key = f"gpu/{flavor}"
        table = self.broker.devices
        free = len(table.free_devices(flavor))
        total = len([d for d in table.devices if d.flavor == flavor])
        out = table.out_of_service_words(flavor)
        used = self.broker.queue.usage().get(team.name, {}).get(key, 0)
        quota = team.quota.gpus.get(flavor)
        waiting = sum(1 for t in self.broker.queue.waiting if t.team == team.name)
        nominal = quota.nominal if quota else 0
        text = (
            f"Now: {free} of {total} free on this machine{f' ({out})' if out else ''}; {team.label} uses {used} of "
            f"its quota of {nominal}; {waiting} waiting in {team.label}'s queue."
        )
        # Said before the click: what a start now would do (wait, or borrow and what that means).
        demand = demand_for(policy, profile)
        fit = check_fit(policy, self.broker.queue.usage(), team, demand, bool(policy.reclaim_rules(team).interactive_borrowing))
        short = None if not fit.fits else table.shortage(demand)
        if not fit.fits or short:
            why = fit.shortages[0].reason if fit.shortages else short
            text += f" Starting now waits in {team.label}'s queue: {why}."
        elif fit.borrows and team.cohort:
            text += (
                " Starting now borrows another team's unused GPU: if that team needs it back, your "
                f"server is {reclaim_notice_words(policy, team)} (the newest borrower first)."
            )
        return text

    def profile_unavailable_hook(self, team, profile) -> str:
        """Why this machine (or the team's quota) can never serve ``profile``: more GPUs than the
        machine has or the team may ever hold, or a CUDA the driver lacks. The form greys it out
        with this reason; a start is refused with the same words."""
        policy = self.broker.policy
        demand = demand_for(policy, profile)
        fit = check_fit(policy, {}, team, demand, bool(policy.reclaim_rules(team).interactive_borrowing))
        return fit.never or self.broker.devices.never_fits(demand) or cuda_refusal(profile, self.broker.devices.driver()) or ""

    # -- start ----------------------------------------------------------------------------
    async def start(self):
        self.stop_reason = None  # why the last run stopped (a reclaim) is shown once, until this start
        await self.broker.store.fresh()  # an edit just saved applies to this spawn
        choice = self.resolve_request()
        policy = self.broker.policy
        refused = cuda_refusal(choice.profile, self.broker.devices.driver())
        if refused:  # before the queue: waiting could never end in a server that works
            raise web.HTTPError(409, refused, reason=refused)
        demand = demand_for(policy, choice.profile)
        ticket = Ticket(
            key=self.server_key,
            user=self.user.name,
            team=choice.team.name,
            profile=choice.profile.slug,
            demand=demand,
            priority=choice.priority,
            user_options=dict(self.user_options or {}),
        )
        queue = self.broker.queue
        restored = queue.adopt(ticket.key)  # waited before a hub restart (local.requeue)
        if restored is not None and (restored.team, restored.profile) == (ticket.team, ticket.profile):
            self.log.info("%s takes back its place in the queue from before the restart", ticket.key)
            ticket = restored
        else:
            if restored is not None and not queue.cancel(restored.key):
                queue.release(restored.key)  # a different choice now: its old place goes
            try:
                queue.submit(ticket)
            except QueueRefused as e:
                raise web.HTTPError(409, str(e), reason=str(e)) from None
        self._ticket = ticket
        queue_timeout = policy.defaults.queue_timeout
        try:
            # The wait counts from the request, also for one that waited before a restart.
            left = max(0.0, queue_timeout - (time.time() - ticket.created))
            # asyncio.timeout, not wait_for (as for the launch below): Python 3.11's wait_for
            # returns the result when its future is already done as the cancellation comes,
            # i.e. a user who leaves the queue (JupyterHub cancels the spawn) just as the ticket
            # is admitted got a server launched anyway, and JupyterHub's stop a 500 "pending
            # spawn". The shield keeps a cancel here from cancelling the queue's own future.
            async with asyncio.timeout(left):
                self._admission = await asyncio.shield(ticket.future)
        except asyncio.TimeoutError:
            self.broker.queue.cancel(ticket.key)
            wanted = ", ".join(describe(k, v, policy) for k, v in sorted(demand.items()) if k.startswith("gpu/"))
            msg = (
                f"Your server waited {format_duration(queue_timeout)} in {choice.team.label}'s queue "
                f"without getting {wanted or 'its resources'}, so the request was withdrawn. "
                "Try again later or choose a smaller profile."
            )
            self.log.warning("Queue timeout for %s: %s", ticket.key, msg)
            raise web.HTTPError(503, msg, reason=msg) from None
        except asyncio.CancelledError:
            # The user left the queue (stop() already took it out and off the journal) or
            # the hub is shutting down: then the journal keeps it for after the restart.
            if not self.broker.queue.cancel(ticket.key, forget=False):
                self.broker.queue.release(ticket.key)
            raise
        try:
            async with self.broker.launch_slots:
                # asyncio.timeout, not wait_for: the launch runs in this task, so a cancel (the
                # user leaving as they are admitted) reaches whatever it awaits. 3.11's
                # wait_for runs it as a task of its own and returns its result when the cancel
                # finds it done: the launch went on, and JupyterHub's stop gave a 500.
                async with asyncio.timeout(policy.defaults.launch_timeout):
                    url = await super().start()
        except BaseException:
            self.broker.queue.release(ticket.key)
            self._admission = None
            raise
        self._watch_exit(self.pid)
        usage.note_started(self.server_key, self.user.name)
        return url

    def get_env(self):
        env = super().get_env()
        if self.choice is not None:
            env.update(self.choice_environment(self.choice))
            # On one machine the server runs in the hub's Python, not the profile's image (that
            # is Kubernetes'): MLflow runs are tagged with what really ran.
            env["GPUHUB_IMAGE"] = ""
            env["GPUHUB_RUNTIME"] = one_machine_runtime()
        # Always set, even empty: a CPU profile must not see the machine's GPUs.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        env["GPUHUB_DEVICES"] = ",".join(self.devices)
        return env

    # -- what isolation enforces (local/isolation.py) ----------------------------------------
    def granted_scope(self):
        """The policy's secrets and team data for this server's team and profile."""
        if self.choice is None:
            return None
        return self.broker.policy, self.choice.team.name, self.choice.profile.slug

    def device_nodes(self) -> list[str]:
        """Device nodes of exactly the admitted GPUs (plus control/UVM nodes if any)."""
        return self.broker.devices.nodes_for(self.devices)

    def resource_limits(self) -> tuple[int | None, int | None]:
        """The profile's CPU (millis) and memory (bytes), else the policy's defaults."""
        if self.choice is None:
            return None, None
        defaults = self.broker.policy.defaults
        profile = self.choice.profile
        return profile.cpu or defaults.cpu, profile.memory or defaults.memory

    async def get_options_form(self):
        form = await super().get_options_form()
        reason = getattr(self, "stop_reason", None)
        if reason:
            import html

            form = f'<div class="alert alert-warning" id="gpuhub-stop-reason">{html.escape(reason)}</div>' + form
        return form

    # -- release -----------------------------------------------------------------------------
    def _watch_exit(self, pid: int) -> None:
        """Release devices the moment ``pid`` exits (pidfd: event-driven, no polling)."""
        if not pid or not hasattr(os, "pidfd_open"):
            return
        self._unwatch()
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            self._release("process already gone")
            return
        loop = asyncio.get_running_loop()
        self._exit_fd = fd

        def exited():
            # Act only on a proven exit: a wake-up while the server runs must neither sweep
            # its cgroup nor give its GPUs to the next in line.
            if self.proc is not None and self.proc.poll() is None:  # (reaps our child)
                return
            ended = getattr(self, "main_process_ended", None)
            if ended is not None and not ended():
                self.log.warning("%s: exit watcher woke but pid %s is still running; leaving it alone", self.server_key, pid)
                return
            self._unwatch()
            self._ending = asyncio.ensure_future(self._after_exit(pid))

        loop.add_reader(fd, exited)

    async def _after_exit(self, pid: int) -> None:
        """A server's process exited on its own: say why, sweep what it left (isolation's
        ``end_after_exit``, beside the loop), and only then give its GPUs to the next in line."""
        try:
            end = getattr(self, "end_after_exit", None)
            if end is not None:
                await end()  # why it stopped (memory? processes?); nothing of it left running
        except Exception:  # as a stop does: the GPUs go back even when the sweep failed
            self.log.exception("Sweeping up after %s's exit failed", self.server_key)
        try:
            self.log.info("Server %s (pid %s) exited", self.server_key, pid)
            self._release("process exited")
        finally:
            self._ending = None
        if not (self._stop_pending or self._spawn_pending) and getattr(self, "_poll_callback", None) is not None:
            # Tell the hub now, not at the next poll: the user sees the server stopped.
            # (Not while starting: JupyterHub's own start-up wait notices the death.)
            await self.poll_and_notify()

    async def _exit_handled(self) -> None:
        """Wait for the exit watcher's ending, so a poll or stop never releases the GPUs
        before what the server left is swept (nor releases them twice)."""
        ending = self._ending
        if ending is not None and ending is not asyncio.current_task():
            await asyncio.shield(ending)

    def _unwatch(self) -> None:
        if self._exit_fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._exit_fd)
            except RuntimeError:
                pass
            os.close(self._exit_fd)
            self._exit_fd = None

    def _release(self, why: str) -> None:
        if self._admission is not None:
            self.log.info("Releasing %s for %s: %s", self._admission.devices or "resources", self.server_key, why)
        self.broker.queue.release(self.server_key)
        self._admission = None

    async def poll(self):
        status = await super().poll()
        if status is not None:
            await self._exit_handled()
        if status is not None and self._admission is not None:
            self._unwatch()
            self._release("found stopped")
        return status

    async def stop(self, now=False):
        await tell_open_lab(self)  # its open JupyterLab says why before the server goes
        usage.note_end(self.server_key, "stopped")  # unless the culler said why first
        self.broker.queue.cancel(self.server_key)
        try:
            await super().stop(now=now)
        finally:
            self._unwatch()
            await self._exit_handled()
            self._release("stopped")
            self._ticket = None

    def run_post_stop_hook(self):
        """A request withdrawn while it waits (the spawn page's cancel, an admin's withdraw:
        JupyterHub cancels the spawn, then stops a server that never ran, which calls this
        hook but not ``stop()``) leaves no journal entry behind. ``start()`` kept the entry
        at the cancellation, as a hub shutdown needs; JupyterHub stops nothing at its own
        shutdown (``cleanup_servers = False``), so this hook means the request is over, and a
        restart must not hand the user a GPU they gave up."""
        self.broker.queue.forget(self.server_key)
        return super().run_post_stop_hook()

    # -- restarts -----------------------------------------------------------------------------
    def get_state(self):
        state = super().get_state()
        if self._admission is not None:
            a = self._admission
            state["gpuhub"] = {
                "team": a.team,
                "profile": a.profile,
                "demand": a.demand,
                "devices": a.devices,
                "since": a.since,
                "priority": a.priority,  # reclaim order after a restart
            }
        return state

    def load_state(self, state):
        super().load_state(state)
        saved = state.get("gpuhub")
        if not saved or not self.pid or self._admission is not None:
            return
        try:
            os.kill(self.pid, 0)
        except OSError:
            return  # not running: nothing to restore, poll() will clear it
        # The hub's own record is the truth (never the user's process environment, which
        # its owner can change); super().load_state() already checked pid + start time.
        devices = list(saved["devices"])
        adm = Admission(
            self.server_key,
            self.user.name,
            saved["team"],
            saved["profile"],
            saved["demand"],
            devices,
            saved.get("since", time.time()),
            priority=saved.get("priority", 0),
        )
        try:
            self.broker.queue.restore(adm)
        except ValueError as e:
            self.log.error("Cannot restore %s's allocation: %s", self.server_key, e)
            return
        self._admission = adm
        try:
            self.choice = resolve_choice(
                self.broker.policy, self.user_groups, self.user_options or {"profile": saved["profile"], "team": saved["team"]}
            )
        except ChoiceError:
            self.choice = None
        self.log.info("Restored %s holding %s after restart", self.server_key, devices or "no devices")
        try:
            self._watch_exit(self.pid)
        except RuntimeError:
            pass  # no running loop yet; poll() will notice an exit

    # -- progress on the spawn page -----------------------------------------------------------
    async def progress(self):
        """Every change of the request's state, as it happens (and at least every 15 s).

        The version is read before each message is sent: a change that lands while a
        message is on its way (an admission, a new position) is sent next, not lost.
        """
        ticket = self._ticket
        if ticket is None:
            return
        timeout = self.broker.policy.defaults.queue_timeout
        while True:
            version = ticket.version
            if ticket.done:
                break
            if ticket.status is not None:
                waited = time.time() - ticket.created
                # No claim of a wait the user did not notice (the hub holds the form's POST
                # up to slow_spawn_timeout before this page opens); from a minute on, the
                # time waited, refreshed every PROGRESS_REFRESH seconds while the page is open.
                so_far = f"Waiting for {format_duration(waited)}; the" if waited >= 60 else "The"
                yield {
                    "progress": 10,
                    "message": f"{ticket.status.message} {so_far} request is "
                    f"withdrawn after {format_duration(timeout)}. You will start automatically when it is your turn.",
                    "gpuhub": {
                        "position": ticket.status.position,
                        "waiting": ticket.status.waiting_in_team,
                        "team": ticket.status.team,
                        "in_use": ticket.status.in_use,
                        "reason": ticket.status.reason,
                        "fair": ticket.status.fair,
                        "waited": round(waited, 1),
                    },
                }
            await ticket.changed(version, timeout=PROGRESS_REFRESH)
        adm = ticket.admission
        if adm is not None:
            what = f"GPU(s) {', '.join(adm.devices)}" if adm.devices else "no GPU"
            message = f"Admitted with {what}; starting your server."
            if adm.borrowed:
                message += " " + borrowed_words(self.broker.policy, adm)
            yield {"progress": 50, "message": message, "gpuhub": {"borrowed": dict(adm.borrowed)}}


def borrowed_words(policy, adm) -> str:
    """What a borrowed start means, said when it is admitted (Kueue's order, in words)."""
    team = policy.team_or_none(adm.team)
    label = team.label if team else adm.team
    parts = []
    for key, n in adm.borrowed.items():
        name = key.split("/", 1)[1]
        if any(f.name == name for f in policy.flavors):
            name = policy.flavor(name).display_name or name
        parts.append(f"{n} {name} GPU{'s' if n != 1 else ''}")
    lenders = [t for t in policy.cohort_members(team) if t.name != adm.team] if team else []
    names = f" ({', '.join(sorted(t.label for t in lenders))})" if lenders else ""
    when = reclaim_notice_words(policy, team) if team else "warned and stopped after the lending team's notice"
    return (
        f"Borrowed: {' and '.join(parts)} of this {'is' if len(parts) == 1 else 'are'} other teams' unused "
        f"quota{names}, beyond {label}'s own. If a lending team needs it back, one of your team's borrowing "
        f"servers is {when}, the most recently started first; your files are kept."
    )


def reclaim_notice_words(policy, team) -> str:
    """How long a borrower of ``team``'s cohort has once a lender wants its GPUs back: the
    shortest notice of the cohort's other teams ('warned and stopped after at least 10m')."""
    lenders = [t for t in policy.cohort_members(team) if t.name != team.name]
    notices = [policy.reclaim_rules(t).notice or 0 for t in lenders if policy.reclaim_rules(t).enabled]
    if not notices:
        return "warned and stopped after the lending team's notice"
    return f"warned and stopped after at least {format_duration(min(notices))}"


class LocalGpuSpawner(QueuedGpuMixin, IsolatedProcessSpawner):
    """Production one-machine spawner: each server isolated (its own Unix account, cgroup
    with the profile's CPU and memory, a /dev with only its GPUs) whenever the hub runs
    as root; single-user mode, loudly warned, otherwise. See ``local/isolation.py``."""


class SimpleLocalGpuSpawner(QueuedGpuMixin, SimpleLocalProcessSpawner):
    """Demo/CI spawner: servers run as the hub's user with per-user home directories.

    No isolation between users' files; use ``LocalGpuSpawner`` with system users in production.
    """
