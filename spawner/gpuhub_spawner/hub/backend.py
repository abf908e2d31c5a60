"""The hub's admission view, whichever backend admits: one policy core, two sources.

On one machine the hub's own queue decides (``local.broker.LocalBroker``); on
Kubernetes Kueue decides and ``kube.ledger.KueueLedger`` mirrors its Workloads into the
same interface. Pages, usage, metrics and the reclaimer ask here, never for a backend.
"""

from __future__ import annotations


def broker(config=None):
    from ..kube.ledger import KueueLedger

    if KueueLedger.initialized():  # kube.ledger.configure_ledger created it at hub start
        return KueueLedger.instance()
    from ..local.broker import LocalBroker

    return LocalBroker.instance(config=config)
