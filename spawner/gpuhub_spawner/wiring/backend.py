"""Which backend provides the hub's admission view (``admission.view``).

On Kubernetes the hub config creates the ledger at start (``wiring.kube.configure_ledger``);
otherwise the one-machine broker admits. Imported by every hub config (``wiring.config``).
"""

from __future__ import annotations

from ..admission.view import provide
from ..kube.ledger import KueueLedger
from ..local.broker import LocalBroker


def broker(config=None):
    if KueueLedger.initialized():  # wiring.kube.configure_ledger created it at hub start
        return KueueLedger.instance()
    return LocalBroker.instance(config=config)


provide(broker)
