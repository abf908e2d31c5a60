"""The culler service: jupyterhub-idle-culler 2.0, deciding from one hub answer per pass.

idle-culler does what it is good at — listing ready servers page by page, running a pass
every ``cull_every`` seconds, stopping servers through the hub API (named servers are
stopped, never removed; homes are never touched). Each pass starts with a single
``POST /hub/api/gpuhub/cull-decisions``; the hub decides every server in-process and
``cull_arbiter_hook`` only looks the server up in that answer.

This service never talks to a user's server: it holds a token with ``delete:servers``,
and anything sent to a user's server is that user's to read. Its scopes are the ones
idle-culler needs — list:users, read:users:activity, read:servers, delete:servers — and
no ``access:servers``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from functools import partial

import jupyterhub_idle_culler as engine
from jupyterhub_idle_culler import IdleCuller
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.ioloop import IOLoop, PeriodicCallback


class PassDecisions:
    """The hub's answer for one pass: servers to stop (and, for the log, to warn)."""

    def __init__(self, body: dict):
        self.decisions: dict[str, dict] = body.get("decisions", {})
        self.servers = int(body.get("servers", 0))
        self.now = float(body.get("now") or time.time())

    def should_cull(self, server: dict) -> bool:
        key = server.get("full_name")
        return bool(key) and self.decisions.get(key, {}).get("action") == "cull"

    @property
    def to_cull(self) -> int:
        return sum(1 for d in self.decisions.values() if d.get("action") == "cull")

    def stops_expected(self, within: float) -> bool:
        """Whether the next pass (``within`` seconds) will likely stop something."""
        return any(
            d.get("action") == "warn" and (d.get("deadline") or 0) <= self.now + within for d in self.decisions.values()
        )


class GpuHubCuller(IdleCuller):
    _expect_stops = False  # the last answer announced a stop due before this pass

    def _headers(self) -> dict:
        return {"Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}", "Content-Type": "application/json"}

    async def fetch_decisions(self) -> PassDecisions | None:
        resp = await AsyncHTTPClient().fetch(
            HTTPRequest(
                self.url.rstrip("/") + "/gpuhub/cull-decisions",
                method="POST",
                headers=self._headers(),
                body="{}",
                request_timeout=60,
            ),
            raise_error=False,
        )
        if resp.code != 200:
            self.log.error("cull decisions failed: %s %s", resp.code, (resp.body or b"")[:200])
            return None
        return PassDecisions(json.loads(resp.body))

    async def cull_pass(self, cull) -> None:
        """One pass: the hub's decisions, then idle-culler stops what they name.

        Usually the listing is skipped (nothing to stop: one request per pass). When the
        previous answer announced a stop due by now, idle-culler lists the servers while
        the hub decides, and its arbiter waits for the answer: the pass then takes about
        the longer of the two, not their sum.
        """
        t0 = time.perf_counter()
        pending = asyncio.ensure_future(self.fetch_decisions())
        if self._expect_stops:

            async def arbiter(*, inactive, inactive_limit, server, **kw):
                answer = await pending
                return answer is not None and answer.should_cull(server)

            await cull(cull_arbiter=arbiter)
            decisions = await pending
        else:
            decisions = await pending
            if decisions is not None and decisions.to_cull:
                await cull(cull_arbiter=lambda *, inactive, inactive_limit, server, **kw: decisions.should_cull(server))
        if decisions is None:
            self._expect_stops = False
            return  # nothing is stopped on a failed answer
        self._expect_stops = decisions.stops_expected(self.cull_every)
        log = self.log.info if decisions.to_cull else self.log.debug
        log("Pass: %d servers decided, %d to stop (%.2fs)", decisions.servers, decisions.to_cull, time.perf_counter() - t0)

    def start(self):
        """idle-culler's own start(), with each pass preceded by the hub's decisions."""
        if self.generate_config:
            print(self.generate_config_file())
            raise SystemExit(0)
        if self.config_file:
            self.load_config_file(self.config_file)
        try:
            AsyncHTTPClient.configure("tornado.curl_httpclient.CurlAsyncHTTPClient")
        except ImportError:
            pass
        cull = partial(
            engine.cull_idle,
            url=self.url,
            api_token=os.environ["JUPYTERHUB_API_TOKEN"],
            inactive_limit=self.timeout,
            logger=self.log,
            cull_users=False,
            remove_named_servers=self.remove_named_servers,
            max_age=0,  # the hub's rules hold maxAge, with a warning
            concurrency=self.concurrency,
            ssl_enabled=self.ssl_enabled,
            internal_certs_location=self.internal_certs_location,
            cull_admin_users=self.cull_admin_users,
            api_page_size=self.api_page_size,
            cull_default_servers=self.cull_default_servers,
            cull_named_servers=self.cull_named_servers,
        )

        async def one_pass():
            try:
                await self.cull_pass(cull)
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


def main():
    GpuHubCuller.launch_instance()


if __name__ == "__main__":
    main()
