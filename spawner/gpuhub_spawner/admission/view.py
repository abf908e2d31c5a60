"""The hub's admission view, whichever backend admits: one policy core, two sources.

On one machine the hub's own queue decides (``local.broker.LocalBroker``); on
Kubernetes Kueue decides and ``kube.ledger.KueueLedger`` mirrors its Workloads into the
same interface (``queue.admitted``, ``queue.waiting``, ``on_admit``/``on_release``
events, ``policy``, ``config``). Pages, usage, metrics and the reclaimer ask here, never
for a backend. The composition root (``wiring.backend``) says which backend provides it.
"""

from __future__ import annotations

from typing import Callable

_provider: Callable | None = None


def provide(provider: Callable) -> None:
    """Set what ``admission_view(config)`` returns (the composition root does, once)."""
    global _provider
    _provider = provider


def admission_view(config=None):
    """The admission view of this hub (the backend that admits)."""
    if _provider is None:
        raise RuntimeError("no backend wired into this hub: import gpuhub_spawner.wiring.backend (hub configs do)")
    return _provider(config)
