"""Hub-wide state of the one-machine backend: the device table and the admission queue.

One instance per hub process (spawners are per server). Created on first use; it
re-reads the policy every few seconds so queue decisions and the admin status page
follow edits without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from tornado.ioloop import PeriodicCallback
from traitlets import Integer, Type, Unicode
from traitlets.config import SingletonConfigurable

from ..admission.journal import QueueJournal
from ..admission.queue import AdmissionQueue
from ..policy import PolicyStore
from ..policy.checks import capacity_warnings, warning_interval_warnings
from ..policy.grants import grant_warnings
from ..policy.model import Policy
from ..culling.reclaimer import Reclaimer  # lent GPUs come back to their team (admission/reclaim.py)
from ..usage.recorder import UsageRecorder  # history, audit trail, metrics (usage/)
from .devices import CAPABILITIES, DeviceTable, capacity_by_flavor, discover_nvml
from .gpu_health import GpuHealthMonitor

log = logging.getLogger("JupyterHub.gpuhub.broker")


class LocalBroker(SingletonConfigurable):
    job_manager_class = Type(
        None,
        klass=SingletonConfigurable,
        allow_none=True,
        help="""The job manager this hub runs batch jobs with (``local.job_manager.JobManager``), handed in by the
        composition root (``wiring.jobs``): it builds on this class, so this class never imports
        it. None: no jobs on this hub, so none to preempt or end.""",
    ).tag(config=True)
    launch_concurrency = Integer(
        8,
        help="""Admitted servers that may be launching at once.

        gpuhub sets JupyterHub's concurrent_spawn_limit to 0 because a server waiting in
        the queue is a pending spawn: counting it would lock everyone out behind a full
        queue. This limit applies only to servers that were admitted and are starting.""",
    ).tag(config=True)

    queue_journal = Unicode(
        "",
        help="""File that keeps waiting requests across hub restarts (in the hub's data dir).

        Empty: the queue lives in memory only. See ``local.requeue`` for how the requests
        come back through JupyterHub after a restart.""",
    ).tag(config=True)

    gpu_health_file = Unicode(
        "",
        help="""File that keeps GPU drains and the marks of critical XIDs across hub restarts
        (in the hub's data dir). Empty: in memory only. See docs/gpu-health.md.""",
    ).tag(config=True)

    nvidia_capabilities = Unicode(
        CAPABILITIES,
        help="""The driver's table of MIG capability nodes (which nvidia-caps/nvidia-cap<N> grants a
        slice's GPU and compute instance); a MIG server's private /dev gets its slice's. Tests
        point this at a stand-in tree. See docs/mig.md.""",
    ).tag(config=True)

    def __init__(self, discover=None, **kwargs):
        super().__init__(**kwargs)
        if discover is None:
            discover = partial(discover_nvml, capabilities=self.nvidia_capabilities)
        self.store = PolicyStore.instance(config=self.config)
        self.devices = DeviceTable(lambda: self.store.current, discover=discover)
        self.journal = QueueJournal(self.queue_journal) if self.queue_journal else None
        # What waited before a restart; re-queued by local.requeue once the hub has
        # re-registered the servers still running (so no device is handed out twice).
        self.waiting_before_restart = self.journal.load() if self.journal else []
        self.queue = AdmissionQueue(lambda: self.store.current, self.devices, self.journal)
        UsageRecorder.instance(config=self.config).attach(self)
        self.reclaimer = Reclaimer(self)
        # XID events and error counters take failing GPUs out of admission (local/gpu_health.py).
        self.gpu_health = GpuHealthMonitor(self, self.gpu_health_file)
        self.gpu_health.start()
        if self.waiting_before_restart:
            self.queue.held = True  # until they are back: nobody jumps the queue meanwhile
            try:
                asyncio.get_running_loop().call_later(300, self._end_hold)
            except RuntimeError:
                pass
        self.store.on_change(self._policy_changed)
        self.store.add_check(self._machine_checks)
        self._launch_slots: asyncio.Semaphore | None = None
        self._watcher: PeriodicCallback | None = None
        self._ensure_watcher()

    def policy_warnings(self, policy: Policy) -> list[str]:
        """What this machine cannot give that ``policy`` promises (policy/checks.py): the same
        warnings as ``gpuhub validate``; also shown in a policy edit's preview (hub/policy_api.py)."""
        return self._machine_checks(policy)

    def _machine_checks(self, policy: Policy) -> list[str]:
        """What this machine cannot give that the policy promises (policy/checks.py)."""
        hub = self.config.JupyterHub if "JupyterHub" in self.config else {}
        env = self.config.Spawner.get("environment", {}) if "Spawner" in self.config else {}
        try:
            server_interval = float(env.get("JUPYTERHUB_ACTIVITY_INTERVAL", 300))
        except (TypeError, ValueError, AttributeError):
            server_interval = 300.0
        interval = max(float(hub.get("last_activity_interval", 300)), server_interval)
        grants = grant_warnings(policy)  # secrets' files and datasets (policy/grants.py)
        return (
            capacity_warnings(policy, capacity_by_flavor(policy, self.devices.nvml))
            + grants
            + warning_interval_warnings(policy, interval)
        )

    @property
    def policy(self) -> Policy:
        return self.store.policy

    @property
    def launch_slots(self) -> asyncio.Semaphore:
        if self._launch_slots is None:
            self._launch_slots = asyncio.Semaphore(self.launch_concurrency)
        return self._launch_slots

    def _jobs(self) -> Any:
        """The hub's job manager, once it exists (None: no jobs on this hub, or none yet)."""
        cls = self.job_manager_class
        return cls.instance() if cls is not None and cls.initialized() else None

    def preempt_job(self, key: str, message: str, for_key: str | None = None) -> bool:
        """Stop a borrowing job at once and re-queue it (the reclaimer's); False while it is
        admitted but not yet launched (the reclaimer looks again)."""
        jobs = self._jobs()
        return jobs is not None and jobs.preempt(key.partition(":")[2], message)

    def gpu_failed_job(self, key: str, gpu: str) -> bool:
        """A GPU the job ``key`` holds went bad (gpu_health; ``gpu``: 'id (why)'): end its
        attempt as gpu-failed."""
        jobs = self._jobs()
        return jobs is not None and jobs.gpu_failed(key.partition(":")[2], [gpu])

    def _ensure_watcher(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # constructed outside the hub's loop (tests, CLI); no background checks
        if self._watcher is None:
            self._watcher = PeriodicCallback(self.store.refresh, self.store.check_interval * 1000)
            self._watcher.start()

    def _end_hold(self) -> None:
        """Safety net: never keep the queue held if the requests did not come back."""
        if self.queue.held:
            log.warning("Queued requests from before the restart did not come back; admitting again")
            self.queue.held = False
            self.queue.schedule()

    def _policy_changed(self, policy: Policy) -> None:
        self.devices.reload(policy)
        self.queue.schedule()
