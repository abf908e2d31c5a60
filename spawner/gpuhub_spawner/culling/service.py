"""The culler service: one hub answer per pass, then only the servers it names are stopped.

Each pass is a single ``POST /hub/api/gpuhub/cull-decisions``; the hub decides every
server in-process (``culling/board.py``) and answers the ones to warn or stop, each with
the ``started`` it was decided for. The service then stops exactly those, a few at a time
(``concurrency``), each one after a fresh look:

- ``GET /hub/api/users/{user}/server`` (``.../servers/{name}`` for a named server): still
  ready, not pending, and still the start the hub decided about — a server stopped and
  started again between the answer and the stop is left alone (stopped or 404: gone);
- ``DELETE`` on the same URL, without a body: a named server is stopped, never removed,
  and no home is touched. 204: stopped; 202: the hub is still stopping it (its own
  ``slow_stop_timeout`` passed) and finishes on its own; 404: already gone; 400 (e.g. being
  renamed): left for the hub's next decision.

So a pass costs what is due, not what exists: nothing lists the hub's users. Before,
idle-culler listed all of them (5,000 user models, several seconds of the hub's time)
whenever something was to be stopped. What is kept of jupyterhub-idle-culler is its
application: configuration (``--cull-every``, ``--concurrency``, ``--url``, internal SSL,
``--cull-default-servers`` / ``--cull-named-servers``) and the pass every ``cull_every``
seconds. The hub's audit of a cull is written when it decides (``board.py``: "culled" with
the rule and reason, the usage record's end "culled by gpuhub-culler"); the stop itself is
the hub's ordinary stop by this service's token.

This service never talks to a user's server: it holds a token with ``delete:servers``,
and anything sent to a user's server is that user's to read. Its scopes are
read:servers (the look before a stop) and delete:servers: no ``access:servers``, and no
listing of users.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import time
from datetime import datetime, timezone
from urllib.parse import quote

from jupyterhub_idle_culler import IdleCuller, make_ssl_context
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import Bool

#: outcomes of one stop, as counted in the pass's log line
STOPPED, STOPPING, GONE, RESTARTED, NOT_READY, SKIPPED, FAILED = (
    "stopped",
    "stopping",
    "gone",
    "restarted",
    "not ready",
    "skipped",
    "failed",
)


class PassDecisions:
    """The hub's answer for one pass: servers to stop (and, for the log, to warn)."""

    def __init__(self, body: dict):
        self.decisions: dict[str, dict] = body.get("decisions", {})
        self.servers = int(body.get("servers", 0))
        self.warned = int(body.get("warned", 0))
        self.now = float(body.get("now") or time.time())

    @property
    def due(self) -> list[tuple[str, dict]]:
        """``(user/name, decision)`` of every server the hub says to stop now."""
        return [(key, d) for key, d in self.decisions.items() if d.get("action") == "cull"]

    @property
    def to_cull(self) -> int:
        return len(self.due)


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        dt = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


class GpuHubCuller(IdleCuller):
    end_with_hub = Bool(
        False,
        help="""End when the process that started this one (the hub, for a managed service) ends.
        A hub killed outright (kill -9, the kernel's OOM killer) cannot stop its services: this
        culler went on with a failed pass against the dead hub's URL every ``cull_every``
        seconds, beside the restarted hub's own culler. Linux (``PR_SET_PDEATHSIG``); the hub's
        service command sets it.""",
    ).tag(config=True)

    def _headers(self) -> dict:
        return {"Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}", "Content-Type": "application/json"}

    def _api(self, path: str) -> str:
        return self.url.rstrip("/") + path

    async def _request(self, path: str, method: str = "GET", body: str | None = None, timeout: float = 60):
        return await AsyncHTTPClient().fetch(
            HTTPRequest(self._api(path), method=method, headers=self._headers(), body=body, request_timeout=timeout),
            raise_error=False,
        )

    async def fetch_decisions(self) -> PassDecisions | None:
        resp = await self._request("/gpuhub/cull-decisions", "POST", '{"actions": ["cull"]}')  # no warnings
        if resp.code != 200:
            self.log.error("cull decisions failed: %s %s", resp.code, (resp.body or b"")[:200])
            return None
        return PassDecisions(json.loads(resp.body))

    async def stop_one(self, key: str, decision: dict) -> str:
        """Stop one server the hub named, if it is still the one it decided about."""
        user, _, name = key.partition("/")
        if (name == "" and not self.cull_default_servers) or (name != "" and not self.cull_named_servers):
            return SKIPPED
        path = f"/users/{quote(user, safe='')}/" + (f"servers/{quote(name, safe='')}" if name else "server")
        resp = await self._request(path)
        if resp.code == 405:  # a hub before JupyterHub 6 has no GET for one server: its user's model
            resp = await self._request(f"/users/{quote(user, safe='')}")
            model = json.loads(resp.body).get("servers", {}).get(name) if resp.code == 200 else None
            if resp.code == 200 and model is None:
                return GONE
        else:
            model = json.loads(resp.body) if resp.code == 200 else None
        if resp.code == 404:
            return GONE
        if model is None:
            self.log.error("Not stopping %s: looking it up failed: %s %s", key, resp.code, (resp.body or b"")[:200])
            return FAILED
        if model.get("stopped"):
            return GONE
        if model.get("pending") or not model.get("ready"):
            self.log.info("Not stopping %s: it is %s", key, model.get("pending") or "not ready")
            return NOT_READY
        decided, started = decision.get("started"), _epoch(model.get("started"))
        if decided is not None and (started is None or abs(started - float(decided)) > 1):
            self.log.info("Not stopping %s: it was started again after the hub's decision", key)
            return RESTARTED
        resp = await self._request(path, "DELETE")  # no body: a named server is stopped, never removed
        if resp.code == 204:
            self.log.info("Culled %s: %s", key, decision.get("reason") or decision.get("rule") or "")
            return STOPPED
        if resp.code == 202:
            self.log.warning("Culled %s: slow to stop; the hub finishes stopping it", key)
            return STOPPING
        if resp.code == 404:
            return GONE
        self.log.error("Stopping %s failed: %s %s", key, resp.code, (resp.body or b"")[:200])
        return FAILED

    async def stop_due(self, decisions: PassDecisions) -> dict[str, int]:
        """Stop what the answer names, ``concurrency`` at a time; outcomes counted."""
        limit = asyncio.Semaphore(max(1, self.concurrency or 1))

        async def one(key, decision):
            async with limit:
                try:
                    return await self.stop_one(key, decision)
                except Exception as e:  # a timeout, a refused connection: the next pass decides again
                    self.log.error("Stopping %s failed: %s", key, e)
                    return FAILED

        counts: dict[str, int] = {}
        for outcome in await asyncio.gather(*(one(k, d) for k, d in decisions.due)):
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    async def cull_pass(self) -> dict[str, int] | None:
        """One pass: the hub's decisions, then the stops they name (if any); the outcomes."""
        t0 = time.perf_counter()
        decisions = await self.fetch_decisions()
        if decisions is None:
            return None  # nothing is stopped on a failed answer
        counts = await self.stop_due(decisions) if decisions.to_cull else {}
        log = self.log.info if decisions.to_cull else self.log.debug
        log(
            "Pass: %d servers decided, %d warned, %d to stop%s (%.2fs)",
            decisions.servers,
            decisions.warned,
            decisions.to_cull,
            "".join(f", {n} {what}" for what, n in sorted(counts.items())),
            time.perf_counter() - t0,
        )
        return counts

    def configure_client(self) -> None:
        """The HTTP client every request of this service uses (as idle-culler sets it up)."""
        defaults: dict = {"request_timeout": int(os.environ.get("JUPYTERHUB_REQUEST_TIMEOUT") or 60)}
        if self.ssl_enabled:
            loc = self.internal_certs_location
            defaults["ssl_options"] = make_ssl_context(
                f"{loc}/hub-internal/hub-internal.key", f"{loc}/hub-internal/hub-internal.crt", f"{loc}/hub-ca/hub-ca.crt"
            )
        # room for every concurrent stop plus the next pass's decision request
        max_clients = max(10, (self.concurrency or 1) + 2)
        try:
            AsyncHTTPClient.configure("tornado.curl_httpclient.CurlAsyncHTTPClient", max_clients=max_clients, defaults=defaults)
        except ImportError:
            AsyncHTTPClient.configure(None, max_clients=max_clients, defaults=defaults)

    def start(self):
        """idle-culler's application: its configuration and a pass every ``cull_every`` s."""
        if self.generate_config:
            print(self.generate_config_file())
            raise SystemExit(0)
        if self.config_file:
            self.load_config_file(self.config_file)
        if self.end_with_hub:
            _end_with_parent()
        self.configure_client()

        async def one_pass():
            try:
                await self.cull_pass()
            except Exception:
                self.log.exception("culler pass failed")

        loop = IOLoop.current()
        loop.add_callback(one_pass)
        PeriodicCallback(one_pass, 1e3 * self.cull_every).start()
        # The hub stops a managed service with SIGINT, then SIGTERM after 10 s. Left to
        # the defaults this process sat out both (hub shutdown took ~30 s): stop at once.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.asyncio_loop.add_signal_handler(sig, loop.stop)
        try:
            loop.start()
        except KeyboardInterrupt:
            pass


def _end_with_parent() -> None:
    """SIGTERM to this process when its parent ends (the handler set in ``start`` stops it),
    and an exit at once if the parent has ended already (we are then init's or a subreaper's)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        raise SystemExit(0)


def main():
    GpuHubCuller.launch_instance()


if __name__ == "__main__":
    main()
