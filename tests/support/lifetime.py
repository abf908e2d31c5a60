"""Nothing a benchmark starts outlives it.

A benchmark stopped by ``timeout`` (or any SIGTERM) used to die on Python's default action for
the signal, before its ``finally`` blocks ran: a hub started in a session of its own (so that
its proxy and servers can be killed as a group) and that proxy ran on for an hour afterwards.
Turned into ``SystemExit`` instead, the signal unwinds the benchmark through its cleanup.
"""

from __future__ import annotations

import signal
import sys


def _exit(signum, frame):  # noqa: ARG001 - the signal handler's signature
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends it at once
    sys.exit(128 + signum)


def end_on_sigterm() -> None:
    """SIGTERM and SIGHUP end this program through its ``finally`` blocks (call from ``__main__``)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)
