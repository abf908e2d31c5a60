"""Waiting requests keep their place across a hub restart, planned or ``kill -9``.

The queue journal (``admission.journal``) holds every waiting request. When the hub is
back, this puts them into the queue again with their original arrival time (so the
order is the one from before) and re-spawns each through JupyterHub's own REST API, as
the user had, so JupyterHub's bookkeeping (pending spawn, spawn page, proxy route) is
the ordinary one. The spawner's ``start()`` then adopts its request instead of queueing
a new one.

Ordering against a double hand-out: the requests go back only after the hub has
re-registered the servers still running (``JupyterHub.start`` completes after
``init_spawners``), and the queue admits nothing until they are back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from pathlib import Path
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient

from .broker import LocalBroker

log = logging.getLogger("JupyterHub.gpuhub.requeue")

SERVICE = "gpuhub-requeue"


def _token(data: Path) -> str:
    path = data / "requeue-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


def configure_requeue(c, data: Path) -> str:
    """Keep the queue in ``data/queue.journal``; returns the service's token, for
    ``requeue_after_start`` (``wiring.config`` schedules it once the hub has started)."""
    token = _token(data)
    c.LocalBroker.queue_journal = str(data / "queue.journal")
    services = list(c.JupyterHub.services) if "services" in c.JupyterHub else []
    c.JupyterHub.services = services + [{"name": SERVICE, "api_token": token}]  # token only, no process
    roles = list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else []
    c.JupyterHub.load_roles = roles + [{"name": SERVICE, "scopes": ["servers"], "services": [SERVICE]}]
    return token


async def requeue_after_start(app, token: str) -> None:
    """Run once the hub has started: running servers are re-registered by then."""
    broker = LocalBroker.instance(config=app.config)
    tickets, broker.waiting_before_restart = broker.waiting_before_restart, []
    restored = broker.queue.restore_waiting(tickets)
    if not restored:
        return
    # The hub holds each POST up to slow_spawn_timeout; the spawn itself starts at once.
    client = AsyncHTTPClient(force_instance=True, max_clients=len(restored) + 1)

    async def respawn(ticket) -> None:
        user, _, server = ticket.key.partition("/")
        path = f"users/{quote(user, safe='')}/" + (f"servers/{quote(server, safe='')}" if server else "server")
        try:
            resp = await client.fetch(
                app.hub.url + "api/" + path,
                method="POST",
                body=json.dumps(ticket.user_options),
                headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
                raise_error=False,
                request_timeout=300,
            )
            code, why = resp.code, (resp.body or b"")[:300].decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - any failure: the request cannot come back
            code, why = 0, str(e)
        if code in (201, 202):
            log.info("Re-spawned %s, waiting since before the restart", ticket.key)
        else:
            log.warning("Could not bring back %s's queued request (%s): %s", ticket.key, code, why)

    try:
        await asyncio.gather(*(respawn(t) for t in restored))
    finally:
        client.close()
    # start() adopts its ticket as soon as the spawn begins; what is left never will be.
    for ticket in restored:
        if ticket.restored:
            broker.queue.drop_restored(ticket.key)
