"""The hub's admission view, whichever backend admits: one policy core, two sources.

On one machine the hub's own queue decides (``local.broker.LocalBroker``); on
Kubernetes Kueue decides and ``kube.ledger.KueueLedger`` mirrors its Workloads into the
same interface, described here. Pages, usage, metrics and the reclaimer read this interface,
never a backend: the hub's application object (``hub.context.GpuHubApp.admission_view``)
gives the one the composition root (``wiring.app``) chose.
"""

from __future__ import annotations

from typing import Any, Protocol

from .queue import AdmissionQueue


class AdmissionView(Protocol):
    """What both backends provide: the queue (``admitted``, ``waiting``, ``on_admit`` /
    ``on_release`` events), the policy in force and the hub's config."""

    queue: AdmissionQueue
    config: Any

    @property
    def policy(self) -> Any: ...
